"""CUDA graphs: a decode step captured once per flash-decoding regime and replayed per token (greedy's draw riding
along), and short prefills captured per length bucket and replayed."""
from __future__ import annotations

import numpy as np

from . import memory as mem
from . import settings as cfg
from ..backend import SAMPLED_TOKEN, Step
from .memory import _ArenaFull, _BUF_GEN, _CAPTURING, _NotCapturable, _PBUF_IDS, _PBUF_POS, prefill_bucket
from .ops.gemm import gemm_split_buffers
from .ops.gemv import decode_regimes, gemv_counters
from .ops.moe import moe_route_counter, moe_route_tile_counters
from .ops.rows import rows_scratch
from .runtime.build import kernel
from .runtime.launch import tma_map_cache

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


class CudaGraphs:
    """CupyOps' graph capture and replay (a mixin: the state it reads is CupyOps')."""

    def decode_step(self, body, step: Step):
        """Run `body` (the model's one-token forward) as a captured CUDA graph; logits [V] fp32. The step's token
        SAMPLED_TOKEN: the id the last sample_launch drew, read by the graph from d["token"] (the host may not know
        it yet). A paged step (block tables) of B sequences: its batch bucket's graph, logits [B, V] (batched.py)."""
        if step.seqs[0].block_table is not None:
            return self._paged_decode_step(body, step)
        s = step.one()
        token, pos0 = (None if s.ids[0] == SAMPLED_TOKEN else s.ids[0]), s.pos0
        if token is None:
            assert self._draw_queued or self._sampled is not None, "no draw to decode"
        elif self._sampled is None or token != self._sampled:
            self.d["token"].fill(token)
            self._sampled = token
        self._begin(pos0, 1)
        self._graph, self._graph_argmax_n = self._decode_graph(self.plan.regime(pos0 + 1), body)
        self._graph.launch(self._stream)
        self._dev_pos = pos0 + 1
        self._argmax_ready = True  # until the next step: d["logits"]'s argmax is in the pinned host int
        self._argmax_slot = 1 + (pos0 + 1) % 2
        if self._graph_argmax_n:  # the graph wrote its argmax to d["token"]: the host learns it in sample_result
            self._sampled = None
        return self.d["logits"]

    def _decode_graph(self, regime: int, body) -> tuple:
        """(graph, the ids its fused argmax covers) of a flash-decoding regime (attn_short: a graph per regime),
        captured from body() where the regime has none."""
        if regime not in self.decode_graph_cache:
            stream = self._stream
            # greedy decode's draw rides in the graph: lm_head max's each block's best (logit, id) of the
            # first n_valid ids (the last draw's, else the vocabulary) into d["argmax"], advance_position
            # turns it into the id (d["token"] and the pinned host int), so sample_launch needs no kernel
            d, n = self.d, self._last_n_valid or self.args.vocab_size
            self._capture_argmax = n
            with stream:
                stream.begin_capture()
                try:
                    out = body()
                    kernel("rope", "advance_position")((1,), (1,), (
                        d["pos"], *((d["argmax"], d["token"], np.uint64(self._tok_host.ctypes.data)) if n
                                    else (np.uint64(0),) * 3)))
                finally:
                    graph = stream.end_capture()
                    self._capture_argmax = 0
            assert out.data.ptr == self.d["logits"].data.ptr
            self.decode_graph_cache[regime] = graph, n
        return self.decode_graph_cache[regime]

    def warm_decode_graphs(self, body_at, n_valid: int, keys: tuple[int, int] | None = None) -> list[int]:
        """Capture now the decode graph of every flash-decoding regime this cache has (attn_short's bounds within it,
        then the capacity's), which the steps would otherwise capture on the first one each meets (a chat's first
        reply, then its keys passing each bound); keys (lo, hi): only the regimes of steps with lo..hi keys (a
        generation of known length). body_at(pos0) is the model's one-token forward at pos0 on the drawn token
        (SAMPLED_TOKEN); n_valid the ids the draws take (the graphs' fused greedy argmax covers them). Returns the
        regimes that have a graph."""
        if not self.graphs:
            return []
        self._last_n_valid = n_valid
        for regime in decode_regimes(self.attn_short, self.max_context, keys):
            pos0 = min(regime, self.max_context) - 1  # (a step whose keys reach the regime's bound)
            self._begin(pos0, 1)
            self._decode_graph(regime, lambda: body_at(pos0))
        self._dev_pos = None  # (d["pos"] was filled for the captures: the next step writes its own)
        return sorted(self.decode_graph_cache)

    # ------------------------------------------------------------------ short prefills as CUDA graphs
    def prefill_graph(self, step: Step, layers):
        """A prompt's layers and final norm as one replayed CUDA graph: x [B, D] fp16, B = prefill_bucket(T), whose
        first T rows are the prompt's (the rest the padding's: ids 0 at positions pos0 + T..pos0 + B - 1, whose
        cache rows later steps overwrite before any step reads them), or None where the prefill runs eagerly: a
        prompt longer than prefill_graph_max_t, whose padded end passes the cache, or whose bucket this process has
        not met (the first prefill of a bucket runs eagerly: a capture costs as much host time as that prefill, so
        a one-off prompt does not pay it). One graph per bucket serves every position: the rotary embedding, the
        cache rows written and attention's keys come from the position the host writes before each replay, with
        the cache maps of the prompt's pos0 + B keys. layers(ids) runs the model's layers and final
        norm on a list of B ids."""
        s = step.one()
        ids, pos0 = s.ids, s.pos0
        T = len(ids)
        if not (self._prefill_graphs_on() and 1 < T <= cfg.SETTINGS.prefill_graph_max_t):
            return None
        B = prefill_bucket(T)
        if pos0 + B > self.max_context or B in self._pnever:
            return None
        rec = self._current_prefill_graph(B)
        if rec is None:
            if B not in self._pseen:
                self._pseen.add(B)
                return None
            rec = self._capture_prefill(B, layers)
            if rec is None:
                return None
        host = np.zeros((_PBUF_IDS + 4 * B,), np.uint8)
        host[:_PBUF_POS] = np.frombuffer(bytes(tma_map_cache(self.k_cache, pos0 + B))
                                         + bytes(tma_map_cache(self.v_cache, pos0 + B)), np.uint8)
        host[_PBUF_POS:].view(np.int32)[0] = pos0
        host[_PBUF_IDS:_PBUF_IDS + 4 * T].view(np.int32)[:] = ids
        self._pbuf[:host.size].set(host)  # on the null stream: after the last replay's reads, before this one's
        rec[0].launch(self._stream)
        return rec[1]

    def warm_prefill_graphs(self, layers) -> list[int]:
        """Capture now the prefill graph of every bucket that fits the cache and has none, so a prompt of up to
        prefill_graph_max_t tokens replays its bucket's graph from its first meeting on (`kuiper chat` at its start:
        its turns meet most buckets, and otherwise each bucket's first meeting runs eagerly and its second pays the
        capture). layers(ids) runs the model's layers on a list of B ids. The largest bucket first, so the shared
        activations grow once; captured again while a module buffer grew under an earlier capture (_BUF_GEN).
        Returns the buckets that have a graph."""
        if not self._prefill_graphs_on():
            return []
        top = min(cfg.SETTINGS.prefill_graph_max_t, self.max_context)
        buckets = sorted({B for B in map(prefill_bucket, range(2, top + 1)) if B <= self.max_context}, reverse=True)
        for _ in range(4):
            todo = [B for B in buckets if B not in self._pnever and self._current_prefill_graph(B) is None]
            if not todo:
                break
            for B in todo:
                self._capture_prefill(B, layers)
        return [B for B in reversed(buckets) if self._current_prefill_graph(B) is not None]

    def _prefill_graphs_on(self) -> bool:
        """Whether prefills may replay graphs at all (a routing log records each prefill's routing on the host,
        which a replay would skip)."""
        return bool(self.prefill_graphs and self.graphs and self.routing_log is None)

    def _current_prefill_graph(self, B: int) -> tuple | None:
        """Bucket B's graph where it holds today's module buffers, else None (a stale one is dropped: a module
        buffer it reads was replaced since its capture, _BUF_GEN)."""
        rec = self.prefill_graph_cache.get(B)
        if rec is not None and rec[3] != _BUF_GEN[0]:
            del self.prefill_graph_cache[B]
            rec = None
        return rec

    def _capture_prefill(self, B: int, layers) -> tuple | None:
        """Capture layers() at B tokens: activations from the shared _BumpArena (grown and the capture retried
        while a region is too small; the graphs captured before then hold the old region and are dropped), every
        other allocation kept with the graph (the residual rows), the position, ids and the attention's cache maps
        read from self._pbuf. None where the prefill calls what a capture cannot hold (_NotCapturable); B is then
        never tried again (_pnever). Either way B counts as met (_pseen)."""
        self._pseen.add(B)
        if self._pbuf is None:
            # (the pool's blocks: 512-aligned)
            self._pbuf = cp.zeros((_PBUF_IDS + 4 * cfg.SETTINGS.prefill_graph_max_t,), cp.uint8)
        # the kernels' counters that are made zeroed on first use, made now: inside a capture cp.zeros's memset is
        # captured, not run, and a capture that is retried or refused would leave them holding garbage
        gemv_counters(), moe_route_counter(), moe_route_tile_counters(), gemm_split_buffers(0), rows_scratch()
        pool, arena, stream = cp.get_default_memory_pool(), self.prefill_arena, self._stream
        for _ in range(64):
            keep, full, gen, refused = [], None, _BUF_GEN[0], False

            def alloc(n: int, keep=keep):
                m = pool.malloc(n)
                keep.append(m)
                return m
            arena.reset()
            prev = mem.use_arena(arena)
            self._graph_ids = self._pbuf[_PBUF_IDS:_PBUF_IDS + 4 * B].view(cp.int32)
            self._graph_pos = self._pbuf[_PBUF_POS:_PBUF_IDS].view(cp.int32)
            _CAPTURING[0] = True
            try:
                with stream, cp.cuda.using_allocator(alloc):
                    stream.begin_capture()
                    try:
                        x = layers([0] * B)
                    except _ArenaFull as e:
                        full = e.args
                    except _NotCapturable:
                        refused = True
                    finally:
                        graph = stream.end_capture()
            finally:
                mem.use_arena(prev)
                self._graph_ids = self._graph_pos = None
                _CAPTURING[0] = False
            if refused:
                self._pnever.add(B)
                return None
            if full is not None:
                self.prefill_graph_cache.clear()
                arena.grow(*full)
            elif gen == _BUF_GEN[0]:  # (else a module buffer grew during the capture: the retry meets the new one)
                assert x.shape[0] == B
                self.prefill_graph_cache[B] = rec = (graph, x, keep, gen)
                return rec
        raise AssertionError("a prefill graph's capture did not settle in 64 tries")
