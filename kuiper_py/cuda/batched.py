"""CupyOps' steps of several sequences (backend.PagedBackend): a Step whose Seqs carry block tables runs eagerly over
a pool of fp16 KV blocks [layers, n_blocks, block_size, KV, head_dim]. Its 1..16 token rows go through the
projections of gemv_rows.cu (each weight read once for every row); 17..64 rows through the fused wgmma GEMMs where
the prefill path takes them (sm_90: one 64-row tile, each weight read once), else gemv_rows.cu 16 rows a launch;
more through the prefill GEMMs. The lm_head is gemv_rows.cu's, up to 64 rows a launch; q/k norm + RoPE + the block
write and attention through paged.cu, each row at its own sequence's position. A step without block tables takes
CupyOps' single-sequence paths, untouched.

A decode step (every Seq one new token) replays the CUDA graph of its batch bucket (1, 2, ..., 64; captured on the
bucket's first step): the graph reads the token ids, positions and block tables from one device buffer made with
the pool, which the host fills with one copy per step; a bucket's extra rows are padding that writes and reads only
the pool's spare block. Prefill chunks run eagerly."""
from __future__ import annotations

import numpy as np

from ..config import rope_tables
from ..errors import ResourceError
from . import memory as mem
from .memory import _BUF_GEN, _CAPTURING, _NotCapturable, _i
from .ops.gemm import (cublas_ready, gemm, gemm_path, gemm_split_buffers, silu_mul, swiglu_prefill,
                       wgmma_available)
from .ops.gemv import gemv, gemv_counters
from .ops.moe import moe_route_counter, moe_route_tile_counters
from .ops.norm import lm_head
from .ops.paged import (DECODE_BUCKETS, PAGED_MAX_GROUP, PagedRows, decode_bucket, decode_inputs_size,
                        decode_inputs_views, pack_decode_inputs, paged_attention, paged_qk_norm_rope_store, paged_scratch,
                        route_rows, rows_argmax)
from .ops.rows import LM_HEAD_ROWS_MAX, ROWS_MAX, rows_fit, rows_lm_head, rows_scratch
from .runtime.build import kernel

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None

KV_POOL_HEADROOM = 1 << 30  # bytes of free GPU memory kv_pool_blocks leaves out before its share (activations)


def _paged_path(T: int, mats) -> str:
    """gemm()'s path for a paged step's T rows, or "rows16": gemv_rows.cu 16 rows a launch. Up to ROWS_MAX rows
    "rows"; up to max_batch the fused wgmma/rs GEMM where the prefill path takes it (one row tile reads each weight
    once), else "rows16" (a weight read once per 16 rows, where the alternative, cuBLAS, is not capturable in a
    decode graph); more, the prefill path. Up to max_batch rows the path is the one of T's decode bucket, whose
    graph runs the step: an eager step of T rows takes the same kernels as its replay (each row's sums then do
    not depend on the other rows), so its logits are bitwise the graph's."""
    fits = rows_fit(mats)
    R = route_rows(T)
    if R <= ROWS_MAX and fits:
        path = gemm_path(R, mats) if R > 1 else "rows"  # (2-16 rows: gemv_rows or this GPU's faster wgmma)
        return path if path == "wgmma" else "rows"
    path = gemm_path(R, mats)
    if R <= DECODE_BUCKETS[-1] and fits and path not in ("wgmma", "rs"):
        return "rows16"
    return path


class _DecodeRows:
    """PagedRows of a decode graph's bucket: views of the device input buffer that the host fills before each
    replay (ids, positions, tables), and each row its own sequence."""

    def __init__(self, inputs, seq_of_row, width: int, bucket: int, block_size: int):
        self.ids, self.tok_pos, self.tables = decode_inputs_views(inputs, width, bucket)
        self.tok_seq = seq_of_row[:bucket]
        self.block_size, self.n_tokens = block_size, bucket
        self.last = np.arange(bucket)


class PagedSteps:
    """The PagedBackend half of CupyOps; `_paged` is the running paged step's PagedRows (None: a single-sequence
    step, or none). paged_graphs False runs decode steps eagerly too (tests); paged_graph_steps counts the steps
    replayed as graphs."""
    max_batch = DECODE_BUCKETS[-1]  # 64: a decode step's rows fit one wgmma row tile (or 4 gemv_rows.cu launches)
    _paged = None
    k_blocks = v_blocks = None
    paged_graphs = True
    paged_graph_steps = 0
    _dgraphs = _dnever = None  # bucket -> its graph's record; the buckets whose capture was refused (alloc_blocks)

    def block_bytes(self, block_size: int) -> int:
        a = self.args
        return 2 * 2 * a.num_hidden_layers * block_size * a.kv_dim

    def kv_pool_blocks(self, block_size: int, utilization: float) -> int:
        """Blocks that `utilization` of the free GPU memory (less KV_POOL_HEADROOM) holds."""
        free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
        return int(max(0, free - KV_POOL_HEADROOM) * utilization) // self.block_bytes(block_size)

    def alloc_blocks(self, n_blocks: int, block_size: int, max_context: int) -> None:
        """The pool: keys and values [layers, n_blocks + 1, block_size, KV, head_dim] fp16 (block n_blocks: the
        decode graphs' padding rows'), RoPE tables for positions up to max_context, the decode graphs' inputs."""
        a = self.args
        if a.num_attention_heads // a.num_key_value_heads > PAGED_MAX_GROUP:
            raise ResourceError(f"{a.num_attention_heads} query heads per {a.num_key_value_heads} KV heads: the "
                                f"paged attention kernel takes at most {PAGED_MAX_GROUP} per KV head")
        shape = (a.num_hidden_layers, n_blocks + 1, block_size, a.num_key_value_heads, a.head_dim)
        self.k_blocks = self.v_blocks = None
        self._dgraphs, self._dnever = {}, set()  # (they hold the old pool's addresses)
        cp.get_default_memory_pool().free_all_blocks()
        try:
            self.k_blocks = cp.zeros(shape, cp.float16)
            self.v_blocks = cp.zeros(shape, cp.float16)
        except cp.cuda.memory.OutOfMemoryError:
            self.k_blocks = self.v_blocks = None
            raise ResourceError(f"out of GPU memory: {n_blocks} KV blocks need "
                                f"{n_blocks * self.block_bytes(block_size) / 2**20:.0f} MiB") from None
        self.block_size = block_size
        cos, sin = rope_tables(a, max_context)
        self.pool_cos, self.pool_sin = cp.asarray(cos), cp.asarray(sin)
        self._alloc_decode_inputs(n_blocks, -(-max_context // block_size))

    def _alloc_decode_inputs(self, pad_block: int, width: int) -> None:
        """What the decode graphs read and write besides the pool, made before any capture: the input buffer and
        its pinned host twin (one copy a step, ordered by an event), each row's sequence, the greedy ids."""
        import cupyx
        self._pad_block, self._table_width = pad_block, width
        self._in_dev = cp.zeros((decode_inputs_size(width),), cp.int32)
        self._in_host = cupyx.zeros_pinned((decode_inputs_size(width),), np.int32)
        self._in_event = cp.cuda.Event(disable_timing=True)
        self._seq_of_row = cp.arange(DECODE_BUCKETS[-1], dtype=cp.int32)
        self._ids_dev = cp.zeros((DECODE_BUCKETS[-1],), cp.int32)
        self._ids_host = cupyx.zeros_pinned((DECODE_BUCKETS[-1],), np.int32)

    def _begin_paged(self, step) -> bool:
        """Whether `step` is a paged one (every Seq with a block table): then its lookups go to the device."""
        self._paged = None
        if any(s.block_table is None for s in step.seqs):
            return False
        if self.k_blocks is None or step.batch > self.max_batch:
            raise NotImplementedError(f"a paged step of {step.batch} sequences needs alloc_blocks() and at most "
                                      f"{self.max_batch} sequences")
        mem.use_arena(None)  # (fresh arrays: the arena's slots serve single-sequence prefills)
        self._argmax_ready = False
        self._paged = PagedRows(step.seqs, self.block_size)
        return True

    def _paged_embed(self, step):
        ids = self._paged.ids  # (a decode graph's: on the device already)
        if ids is None:
            ids = np.asarray([t for s in step.seqs for t in s.ids], np.int32)
            if (ids < 0).any():
                raise NotImplementedError("a paged step takes its token ids from the host (no SAMPLED_TOKEN)")
            ids = cp.asarray(ids)
        h = cp.empty((ids.size, self.args.hidden_size), cp.float32)
        table = self.weights.embed
        if isinstance(table, np.ndarray):  # pinned host memory: its address is valid on the device
            table = np.uint64(table.ctypes.data)
        kernel("norm", "embed_gather")((ids.size,), (256,), (ids, table, h, _i(self.args.hidden_size)))
        return h

    def _paged_proj(self, x, mats, path=None):
        """x [T, K] @ the matrices side by side: one row through the decode GEMV (weights at ~0.8 of copy bandwidth
        in a decode step, against ~0.2-0.4 for gemv_rows' rows on the H100), more by path (_paged_path's)."""
        mats = mats if isinstance(mats, tuple) else (mats,)
        x = cp.ascontiguousarray(x)
        if x.shape[0] == 1:
            return gemv(x, list(mats), "plain", cp.empty((1, sum(m.N for m in mats)), cp.float16), self.d["partial"])
        path = path or _paged_path(x.shape[0], mats)
        if path != "rows16":
            return gemm(x, mats, path=path)
        out = cp.empty((x.shape[0], sum(m.N for m in mats)), cp.float16)
        for r in range(0, x.shape[0], ROWS_MAX):
            gemm(x[r:r + ROWS_MAX], mats, out[r:r + ROWS_MAX], path="rows")
        return out

    def _paged_attention_block(self, x, layer, i: int):
        """A paged step's attention block (CupyOps.attention): q|k|v, the per-token q/k norm, RoPE and block write,
        paged attention, o."""
        a = self.args
        qd, kvd = a.q_dim, a.kv_dim
        y = self._paged_proj(x, (layer.wq, layer.wk, layer.wv))
        q = self._paged_rope(y[:, :qd], y[:, qd:qd + kvd], y[:, qd + kvd:], layer, i)
        return self._paged_proj(self._paged_attention(q, i), layer.wo)

    def _paged_mlp(self, x, layer):
        """A paged step's SwiGLU MLP block (CupyOps.mlp)."""
        return self._paged_proj(self._paged_gate_up(x, layer), layer.w2)

    def _paged_gate_up(self, x, layer):
        mats = (layer.w1, layer.w3)
        path = _paged_path(x.shape[0], mats)
        if path in ("rows", "rows16", "wgmma", "rs"):
            y, I = self._paged_proj(x, mats, path), layer.w1.N
            return silu_mul(y, y[:, I:], I, 2 * I)
        return swiglu_prefill(cp.ascontiguousarray(x), layer.w1, layer.w3)

    def _paged_rope(self, q, k, v, layer, i: int):
        a = self.args
        return paged_qk_norm_rope_store(q, k, v, layer.q_norm, layer.k_norm, self.pool_cos, self.pool_sin,
                                        self.k_blocks[i], self.v_blocks[i], self._paged, a.num_attention_heads,
                                        a.rms_norm_eps)

    def _paged_attention(self, q, i: int):
        return paged_attention(q, self.k_blocks[i], self.v_blocks[i], self._paged)

    def _paged_logits(self, x, all_positions: bool):
        """Each sequence's last row's logits [B, V] (every row's [T, V] with all_positions), LM_HEAD_ROWS_MAX rows
        a launch (the head read once per launch)."""
        if not all_positions and len(self._paged.last) != x.shape[0]:  # (a decode step's rows are all last rows)
            x = x[cp.asarray(self._paged.last)]
        x = cp.ascontiguousarray(x)
        out = cp.empty((x.shape[0], self.args.vocab_size), cp.float32)
        if x.shape[0] == 1:  # (one row: the decode step's lm_head GEMV, at decode's bandwidth)
            lm_head(x[0], self.weights.lm_head, out[0])
            return out
        for r in range(0, x.shape[0], LM_HEAD_ROWS_MAX):
            rows_lm_head(x[r:r + LM_HEAD_ROWS_MAX], self.weights.lm_head, out[r:r + LM_HEAD_ROWS_MAX])
        return out

    # ------------------------------------------------------------------ decode steps as a graph per batch bucket
    def _paged_decode_step(self, body, step):
        """A paged decode step (each Seq one new token) replayed as its bucket's graph, captured from body() (the
        model's forward of the step) on the bucket's first step; eagerly where graphs are off or the bucket's
        capture was refused. Logits [B, V]: the first B rows of the bucket's buffer, which the next step's replay
        overwrites."""
        B = step.batch
        if self.k_blocks is None or B > self.max_batch:
            raise NotImplementedError(f"a paged step of {B} sequences needs alloc_blocks() and at most "
                                      f"{self.max_batch} sequences")
        bucket = decode_bucket(B)
        rec = self._bucket_graph(bucket, body) if self._paged_graphs_on() else None
        if rec is None:
            self.begin_step(step)
            try:
                return body()
            finally:
                self.end_step()
        self._argmax_ready = False  # (the single-sequence graph's fused draw is not this step's)
        self._in_event.synchronize()  # the last step's copy has read the pinned buffer
        n = pack_decode_inputs(step.seqs, bucket, self.block_size, self._pad_block, self._in_host)
        cp.cuda.runtime.memcpyAsync(self._in_dev.data.ptr, self._in_host.ctypes.data, 4 * n,
                                    cp.cuda.runtime.memcpyHostToDevice, self._stream.ptr)
        self._in_event.record(self._stream)
        rec[0].launch(self._stream)
        self.paged_graph_steps += 1
        return rec[1][:B]

    def _paged_graphs_on(self) -> bool:
        """Whether decode steps replay graphs (a routing log records each step's routing on the host, which a
        replay would skip)."""
        return bool(self.graphs and self.paged_graphs and self.routing_log is None)

    def _bucket_graph(self, bucket: int, body):
        """(graph, logits [bucket, V], its allocations, _BUF_GEN) of a bucket, captured where it has none or holds
        a module buffer replaced since (_BUF_GEN); None where its capture was refused (_NotCapturable)."""
        rec = self._dgraphs.get(bucket)
        if rec is not None and rec[3] == _BUF_GEN[0]:
            return rec
        if bucket in self._dnever:
            return None
        # the kernels' zeroed counters and scratch made now (a captured cp.zeros's memset would not run), gemm_path's
        # device probes run (cuBLAS's is a matmul), and the paged kernels built (the load builds the model's others)
        gemv_counters(), moe_route_counter(), moe_route_tile_counters(), gemm_split_buffers(0), rows_scratch()
        cublas_ready(), wgmma_available()
        for name in ("paged_qk_norm_rope_store", "paged_attention", "paged_attention_merge"):
            kernel("paged", f"{name}<{self.args.head_dim}>")
        paged_scratch(DECODE_BUCKETS[-1] * self.args.num_attention_heads, self.args.head_dim)
        kernel("paged", "rows_argmax")
        for _ in range(8):  # (captured again while a module buffer grew under the capture)
            gen = _BUF_GEN[0]
            rec = self._capture_bucket(bucket, body)
            if rec is None:
                self._dnever.add(bucket)
                return None
            if gen == _BUF_GEN[0]:
                self._dgraphs[bucket] = rec
                return rec
        raise AssertionError("a decode graph's capture did not settle in 8 tries")

    def _capture_bucket(self, bucket: int, body):
        """Capture body() over the bucket's rows, read from the input buffer; every allocation it makes is kept
        with the graph (the replays write them)."""
        pool, stream, keep = cp.get_default_memory_pool(), self._stream, []

        def alloc(n: int):
            m = pool.malloc(n)
            keep.append(m)
            return m
        self._argmax_ready = False
        mem.use_arena(None)  # (activations from the pool, kept with the graph)
        self._paged = _DecodeRows(self._in_dev, self._seq_of_row, self._table_width, bucket, self.block_size)
        _CAPTURING[0], out = True, None
        try:
            with stream, cp.cuda.using_allocator(alloc):
                stream.begin_capture()
                try:
                    out = body()
                except _NotCapturable:
                    out = None
                finally:
                    graph = stream.end_capture()
        finally:
            _CAPTURING[0] = False
            self._paged = None
        if out is None:
            return None
        assert out.shape[0] == bucket and out.flags.c_contiguous
        return graph, out, keep, _BUF_GEN[0]

    def argmax_rows(self, logits, n_valid: int) -> np.ndarray:
        """Each row's argmax over ids < n_valid, as host ints; a decode graph's logits through rows_argmax into
        buffers made with the pool (nothing allocated on the device), others through cp.argmax."""
        rec = next((r for r in self._dgraphs.values() if r[1].data.ptr == logits.data.ptr), None) \
            if self._dgraphs and logits.ndim == 2 else None
        if rec is None or logits.shape[1] != rec[1].shape[1]:
            return cp.argmax(logits[:, :n_valid], axis=1).get()
        B = logits.shape[0]
        with self._stream:
            rows_argmax(logits, n_valid, self._ids_dev)
        cp.cuda.runtime.memcpyAsync(self._ids_host.ctypes.data, self._ids_dev.data.ptr, 4 * B,
                                    cp.cuda.runtime.memcpyDeviceToHost, self._stream.ptr)
        self._stream.synchronize()
        return self._ids_host[:B].copy()
