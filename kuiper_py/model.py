"""The Qwen3 forward, written once against a backend (backend.Backend: NumPy or CuPy).

Prefill and decode are separate entry points over one preallocated KV cache that the
backend owns; `pos` is the number of positions already in the cache. Each forward is one
backend.Step (one sequence here: this class holds one conversation's position).
"""
from __future__ import annotations

import numpy as np

from .backend import Backend, Step
from .errors import KuiperError


class Qwen3:
    def __init__(self, model_file, ops_cls, max_context: int, **ops_kwargs):
        self.args = model_file.args
        self._check_context(max_context)
        self.max_context = max_context
        self.ops: Backend = ops_cls(self.args, model_file.weights, max_context, **ops_kwargs)
        self.pos = 0

    def _check_context(self, n: int) -> None:
        if not 0 < n <= self.args.max_position_embeddings:
            raise KuiperError(f"--max-context {n} must be in 1..{self.args.max_position_embeddings} "
                              f"(the model's max_position_embeddings)")

    def set_context(self, max_context: int) -> None:
        """Reallocate the KV cache for a new context length; the weights stay where they are."""
        if max_context != self.max_context:
            self._check_context(max_context)
            self.ops.alloc_cache(max_context)
            self.max_context = max_context
        self.pos = 0

    def reset(self) -> None:
        self.pos = 0

    def _body(self, step: Step, all_logits: bool = False):
        return self.ops.logits(self._layers(step), all_logits)

    def _layers(self, step: Step):
        """Every layer and the final norm: x [T, D], the lm_head's input."""
        ops, w = self.ops, self.ops.weights
        reduce = ops.all_reduce  # backend.Collectives: a tensor-parallel rank's partial sums added; else x itself
        h = ops.embed(step)  # [T, D]
        r = None
        for i, layer in enumerate(w.layers):
            ops.begin_layer()
            h, x = ops.add_rmsnorm(h, r, layer.attn_norm)
            r = reduce(ops.attention(x, layer, i, step))
            h, x = ops.add_rmsnorm(h, r, layer.ffn_norm)
            r = reduce(ops.moe(x, layer) if layer.router is not None else ops.mlp(x, layer))
        return ops.add_rmsnorm(h, r, w.final_norm)[1]

    def _forward(self, ids: list[int], all_logits: bool = False):
        pos0, T = self.pos, len(ids)
        if pos0 + T > self.max_context:
            raise KuiperError(f"context full: {pos0} + {T} tokens exceed --max-context {self.max_context}")
        step = Step.single(ids, pos0)
        self.ops.begin_step(step)
        try:
            # a backend may replay a short prompt's layers as one captured graph (CUDA: padded to a bucket of
            # lengths; x's first T rows are the prompt's)
            x = None if T == 1 else \
                self.ops.prefill_graph(step, lambda padded: self._layers(Step.single(padded, pos0)))
            out = self._body(step, all_logits) if x is None else self.ops.logits(x[:T], all_logits)
        finally:
            self.ops.end_step()
        self.pos += T
        return out

    def forward_step(self, step: Step, all_logits: bool = False):
        """One Step of B >= 1 sequences over a paged backend's KV blocks (each Seq with its position and block
        table; the batch scheduler holds them, not self.pos): logits [B, V] of each sequence's last token, or
        [T, V] of every token with all_logits. A backend that replays graphs runs a decode step (one new token per
        sequence) as one (CUDA: a graph per batch bucket); its logits are then valid until the next step."""
        if self.ops.graphs and not all_logits and all(len(s.ids) == 1 and s.block_table is not None
                                                      for s in step.seqs):
            return self.ops.decode_step(lambda: self._body(step), step)
        self.ops.begin_step(step)
        try:
            return self._body(step, all_logits)
        finally:
            self.ops.end_step()

    def warm_prefill_graphs(self) -> list[int]:
        """Have a backend that replays short prefills as graphs (CUDA) capture every length bucket's now, for a
        session that will meet many prompt lengths (a chat's turns); the buckets captured, [] where none are."""
        return self.ops.warm_prefill_graphs(lambda padded: self._layers(Step.single(padded, 0)))

    def warm_decode_graphs(self, n_valid: int, keys: tuple[int, int] | None = None) -> list[int]:
        """Have a backend that replays decode steps as graphs (CUDA) capture every flash-decoding regime's now (keys
        (lo, hi): only those of steps with lo..hi keys); n_valid: the ids the session's draws take. The regimes
        captured, [] where none are."""
        return self.ops.warm_decode_graphs(lambda pos0: self._body(Step.single([self.ops.SAMPLED_TOKEN], pos0)),
                                           n_valid, keys)

    def prefill(self, ids: list[int], all_logits: bool = False) -> np.ndarray:
        """Run the prompt (appended at the current position); float32 logits [V] of its last token,
        or [T, V] for every position with all_logits (for tests)."""
        if not ids:
            raise KuiperError("empty prompt")
        return self._forward(list(ids), all_logits)

    def decode(self, token: int):
        """One token at the current position; float32 logits [V]. Backends that can (CUDA) replay
        the whole step as one captured graph."""
        token = int(token)
        if not self.ops.graphs:
            return self._forward([token])
        if self.pos + 1 > self.max_context:
            raise KuiperError(f"context full: {self.pos} + 1 tokens exceed --max-context {self.max_context}")
        step = Step.single([token], self.pos)
        out = self.ops.decode_step(lambda: self._body(step), step)
        self.pos += 1
        return out

    @property
    def can_queue_ahead(self) -> bool:
        """Whether decode_sampled() is served: a backend that draws on the device and replays graphs."""
        return self.ops.graphs and self.ops.queues_draws

    def decode_sampled(self):
        """decode() of the token the backend's last sample_launch drew, queued before the host has read
        it: the GPU runs the step while the host turns the previous token into text, instead of idling
        for the copy back and the next launch. discard() takes the step back if that token ends the
        generation."""
        if self.pos + 1 > self.max_context:
            raise KuiperError(f"context full: {self.pos} + 1 tokens exceed --max-context {self.max_context}")
        step = Step.single([self.ops.SAMPLED_TOKEN], self.pos)
        out = self.ops.decode_step(lambda: self._body(step), step)
        self.pos += 1
        return out

    def discard(self) -> None:
        """Take back the last decode_sampled() step: its cache row is overwritten by the next step."""
        self.rewind(self.pos - 1)

    def rewind(self, pos: int) -> None:
        """Go back to position pos (<= the current one): later steps overwrite the cache rows from there."""
        assert 0 <= pos <= self.pos
        self.pos = pos
        self.ops.forget_position()
