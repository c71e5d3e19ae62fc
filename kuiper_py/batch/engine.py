"""BatchEngine: many requests on one model, stepped together (continuous batching over a paged KV cache).

    be = BatchEngine(engine)
    h = be.submit(prompt_ids, params, max_tokens)
    while be.step(): ...            # or be.run_until_done()
    for record in h.take(): ...     # generate.Record items, as generate() yields them

A request's records are what generate() yields for it alone: the same tokens (its draws use its own seed), the
same text with stop strings held back and cut, the same finish reasons."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..backend import Seq, Step
from ..errors import KuiperError, ResourceError
from ..generate import Engine, Record, _check_request, _covering, held_back
from ..sampling import RowDraw, SamplingParams, device_seed, sample, token_logprobs
from ..speculative import plain_greedy
from ..tokenizer import StreamDecoder
from .blocks import BlockPool, KVCacheManager
from .scheduler import Request, Scheduler


class PoolTooSmall(ResourceError):
    """The KV pool the settings give cannot hold one sequence of the context asked for."""


@dataclass
class BatchConfig:
    """The batching settings (the issue's knobs); None: derived from the model and the backend."""
    max_context: int | None = None  # positions one sequence may hold (default: the model's maximum)
    block_size: int = 16  # positions per KV block
    n_blocks: int | None = None  # the pool's size; default: `utilization` of the backend's memory
    utilization: float = 0.5  # of the memory available (CPU: host; CUDA: free GPU memory) the pool may take
    chunk_size: int = 256  # prompt tokens a sequence prefills per step
    max_seqs: int = 64  # sequences running at once (at most the backend's max_batch)
    step_tokens: int | None = None  # tokens per step (default: max_seqs + chunk_size)
    prefix_caching: bool = True


@dataclass(eq=False)
class Handle:
    """A submitted request: its records as they are drawn (take() them), whether it has finished."""
    request: Request
    stop: list[str]
    eos: set[int]
    logprobs: int | None
    decoder: StreamDecoder | None
    records: list[Record] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "context" or "cancelled" once finished
    cancelled: bool = False
    t_admit: float | None = None
    t_first: float | None = None
    pending: str = ""
    emitted: int = 0
    decoded: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)  # the drawn tokens (the records' `tokens`, as generate()'s share one)
    seed: int = 0  # the device draws' seed (sampling.device_seed)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def take(self) -> list[Record]:
        """The records made since the last take()."""
        out, self.records = self.records, []
        return out

    def cancel(self) -> None:
        """Stop this request at the next step; its blocks go back to the pool then."""
        self.cancelled = True


class BatchEngine:
    def __init__(self, engine: Engine, config: BatchConfig | None = None):
        cfg = config or BatchConfig()
        args = engine.file.args
        self.engine, self.cfg = engine, cfg
        if engine.tp > 1:
            raise KuiperError(f"batching several sequences and --tp {engine.tp} cannot be combined yet")
        self.max_context = cfg.max_context or args.max_position_embeddings
        if not 0 < self.max_context <= args.max_position_embeddings:
            raise KuiperError(f"--max-context {self.max_context} must be in 1..{args.max_position_embeddings}")
        self.model = engine.session(1)  # (the single-sequence cache, unused here, kept small)
        ops = self.model.ops
        if ops.max_batch < 2:
            raise KuiperError(f"the {engine.device} backend runs one sequence a step (max_batch {ops.max_batch}): "
                              f"batching needs a backend that runs several")
        bs = cfg.block_size
        per_seq = -(-self.max_context // bs)
        n_blocks = cfg.n_blocks or min(ops.kv_pool_blocks(bs, cfg.utilization), cfg.max_seqs * per_seq)
        if n_blocks < per_seq:
            raise PoolTooSmall(f"a KV pool of {n_blocks} blocks of {bs} positions cannot hold one sequence of "
                              f"{self.max_context} positions (--max-context)")
        ops.alloc_blocks(n_blocks, bs, self.max_context)
        self.pool = BlockPool(n_blocks, bs, cfg.prefix_caching)
        self.sched = Scheduler(KVCacheManager(self.pool), cfg.chunk_size, min(cfg.max_seqs, ops.max_batch),
                               cfg.step_tokens or cfg.max_seqs + cfg.chunk_size)
        self.handles: dict[Request, Handle] = {}
        self.steps = 0

    def submit(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, stop: list[str] | None = None,
               eos_ids: list[int] | None = None, logprobs: int | None = None) -> Handle:
        """Queue a request (its records come as steps run); eos_ids None: the model's, [] never stops on one."""
        _check_request(self.engine, prompt_ids, max_tokens)
        if len(prompt_ids) > self.max_context:
            raise KuiperError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_context}")
        eos = set(self.engine.file.args.eos_token_ids if eos_ids is None else eos_ids)
        tok = self.engine.tokenizer
        h = Handle(Request(list(prompt_ids), max_tokens, params), [s for s in (stop or []) if s], eos, logprobs,
                   StreamDecoder(tok) if tok else None, seed=device_seed(params))
        if max_tokens == 0:
            self._finish(h, Record(None, "", "length", prompt_tokens=len(prompt_ids)))
            return h
        self.handles[h.request] = h
        self.sched.add(h.request)
        return h

    @property
    def active(self) -> int:
        """Requests submitted and not finished."""
        return len(self.handles)

    def step(self) -> bool:
        """One forward over the scheduled sequences, and each finished prompt's or decode's token drawn; False
        when there was nothing to run."""
        for r, h in list(self.handles.items()):
            if h.cancelled:
                self._end(h, "cancelled")
        sched = self.sched.schedule()
        if not sched:
            return False
        now = time.perf_counter()
        step = Step(tuple(Seq(tuple(r.tokens[r.computed:r.computed + n]), r.computed, 0,
                              tuple(self.sched.kv.tables[r])) for r, n in sched))
        for r, _ in sched:
            h = self.handles[r]
            h.t_admit = h.t_admit or now
        draws = self._draws(self.model.forward_step(step), sched)
        self.steps += 1
        for i, (r, n) in enumerate(sched):
            self.sched.advance(r, n)
            if r.computed == len(r.tokens):
                self._draw(self.handles[r], *draws[i])
        return True

    def _draws(self, logits, sched) -> list[tuple[int, np.ndarray | None]]:
        """(token, the row's logits on the host where its logprobs need them) for each sequence that draws this step
        (its prompt done, or a decode step): its draw by the backend from its own settings and seed (sample_rows; a
        plain greedy step through argmax_rows), the [B, V] logits staying where they are, except the rows of
        requests that asked for logprobs, which draw on the host as generate() does for them."""
        drawing = [self.handles[r] if r.computed + n == len(r.tokens) else None for r, n in sched]
        if not any(drawing):
            return [(None, None)] * len(sched)
        ops, n_valid = self.model.ops, self.engine.n_valid_tokens
        if all(h is None or (h.logprobs is None and plain_greedy(h.request.params)) for h in drawing):
            ids = ops.argmax_rows(logits, n_valid)
            return [(int(ids[i]), None) for i in range(len(sched))]
        out: list[tuple[int | None, np.ndarray | None]] = [(None, None)] * len(sched)
        draws: list[RowDraw | None] = [None] * len(sched)
        for i, h in enumerate(drawing):
            if h is None:
                continue
            r = h.request
            if h.logprobs is not None:  # (before sample_rows, which may overwrite the logits it draws from)
                x = np.asarray(ops.to_host(logits[i]))
                out[i] = (sample(x, r.params, r.rng, r.tokens, n_valid, generated=h.out), x)
            else:
                draws[i] = RowDraw(r.params, r.rng, h.seed, len(h.out), r.tokens, h.out)
        for i, tok in enumerate(ops.sample_rows(logits, draws, n_valid)):
            if tok is not None:
                out[i] = (tok, None)
        return out

    def run_until_done(self) -> None:
        while self.step():
            pass

    def _draw(self, h: Handle, tok: int, x: np.ndarray | None) -> None:
        """The request's drawn token (x: its row's logits on the host, where its logprobs are asked for), then its
        record."""
        r = h.request
        lp = None if h.logprobs is None else token_logprobs(x, tok, h.logprobs, self.engine.n_valid_tokens)
        now = time.perf_counter()
        if h.t_first is None:
            h.t_first = now
        dec = h.decoder
        if tok in h.eos:
            return self._finish(h, self._rec(h, None, h.pending + (dec.flush() if dec else ""), "stop", lp=lp))
        r.tokens.append(tok)
        h.out.append(tok)
        h.pending += dec.push(tok) if dec else ""
        text = h.pending
        if h.stop:
            h.decoded.append(h.emitted + len(h.pending))
            hit = min((h.pending.find(s) for s in h.stop if s in h.pending), default=-1)
            if hit >= 0:
                cut = h.out[:_covering(h.decoded, h.emitted + hit)]
                return self._finish(h, self._rec(h, tok, h.pending[:hit], "stop", cut, lp))
            keep = held_back(h.pending, h.stop)
            text = h.pending[:len(h.pending) - keep]
            h.emitted += len(text)
        h.pending = h.pending[len(text):]
        tail = lambda: text + h.pending + (dec.flush() if dec else "")  # noqa: E731 - the text a last record ends with
        if len(h.out) >= r.max_tokens:
            return self._finish(h, self._rec(h, tok, tail(), "length", lp=lp))
        if r.computed >= self.max_context:  # (the drawn token has no position left to take)
            return self._finish(h, self._rec(h, tok, tail(), "context", lp=lp))
        h.records.append(self._rec(h, tok, text, lp=lp))

    def _rec(self, h: Handle, tok, text: str, reason=None, tokens=None, lp=None) -> Record:
        r, now = h.request, time.perf_counter()
        return Record(tok, text, reason, len(r.prompt) - r.cached_tokens, (h.t_first or now) - (h.t_admit or now),
                      len(h.out), now - (h.t_first or now), r.computed - len(r.prompt),
                      h.out if tokens is None else tokens, r.cached_tokens, 0.0, lp)

    def _finish(self, h: Handle, last: Record) -> None:
        h.records.append(last)
        self._end(h, last.finish_reason)

    def _end(self, h: Handle, reason: str) -> None:
        h.finish_reason = reason
        if self.handles.pop(h.request, None) is not None:
            self.sched.remove(h.request)
