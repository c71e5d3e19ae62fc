"""CupyOps' steps of several sequences (backend.PagedBackend): a Step whose Seqs carry block tables runs eagerly over
a pool of fp16 KV blocks [layers, n_blocks, block_size, KV, head_dim]. Its 1..16 token rows go through the
projections and the lm_head of gemv_rows.cu (each weight read once for every row), more through the prefill GEMMs;
q/k norm + RoPE + the block write and attention through paged.cu, each row at its own sequence's position. A step
without block tables takes CupyOps' single-sequence paths, untouched."""
from __future__ import annotations

import numpy as np

from ..config import rope_tables
from ..errors import ResourceError
from . import memory as mem
from .memory import _i
from .ops.gemm import gemm, silu_mul, swiglu_prefill
from .ops.paged import PAGED_MAX_GROUP, PagedRows, paged_attention, paged_qk_norm_rope_store
from .ops.rows import ROWS_MAX, rows_fit, rows_lm_head
from .runtime.build import kernel

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None

KV_POOL_HEADROOM = 1 << 30  # bytes of free GPU memory kv_pool_blocks leaves out before its share (activations)


class PagedSteps:
    """The PagedBackend half of CupyOps; `_paged` is the running paged step's PagedRows (None: a single-sequence
    step, or none)."""
    max_batch = 16  # a decode step's rows fit one gemv_rows.cu launch (ROWS_MAX)
    _paged = None
    k_blocks = v_blocks = None

    def block_bytes(self, block_size: int) -> int:
        a = self.args
        return 2 * 2 * a.num_hidden_layers * block_size * a.kv_dim

    def kv_pool_blocks(self, block_size: int, utilization: float) -> int:
        """Blocks that `utilization` of the free GPU memory (less KV_POOL_HEADROOM) holds."""
        free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
        return int(max(0, free - KV_POOL_HEADROOM) * utilization) // self.block_bytes(block_size)

    def alloc_blocks(self, n_blocks: int, block_size: int, max_context: int) -> None:
        """The pool: keys and values [layers, n_blocks, block_size, KV, head_dim] fp16, and RoPE tables for
        positions up to max_context."""
        a = self.args
        if a.num_attention_heads // a.num_key_value_heads > PAGED_MAX_GROUP:
            raise ResourceError(f"{a.num_attention_heads} query heads per {a.num_key_value_heads} KV heads: the "
                                f"paged attention kernel takes at most {PAGED_MAX_GROUP} per KV head")
        shape = (a.num_hidden_layers, n_blocks, block_size, a.num_key_value_heads, a.head_dim)
        self.k_blocks = self.v_blocks = None
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

    def _begin_paged(self, step) -> bool:
        """Whether `step` is a paged one (every Seq with a block table): then its lookups go to the device."""
        self._paged = None
        if any(s.block_table is None for s in step.seqs):
            return False
        if self.k_blocks is None or step.batch > self.max_batch:
            raise NotImplementedError(f"a paged step of {step.batch} sequences needs alloc_blocks() and at most "
                                      f"{self.max_batch} sequences")
        mem._ARENA = None  # (fresh arrays: the arena's slots serve single-sequence prefills)
        self._argmax_ready = False
        self._paged = PagedRows(step.seqs, self.block_size)
        return True

    def _paged_embed(self, step):
        ids = np.asarray([t for s in step.seqs for t in s.ids], np.int32)
        if (ids < 0).any():
            raise NotImplementedError("a paged step takes its token ids from the host (no SAMPLED_TOKEN)")
        h = cp.empty((ids.size, self.args.hidden_size), cp.float32)
        table = self.weights.embed
        if isinstance(table, np.ndarray):  # pinned host memory: its address is valid on the device
            table = np.uint64(table.ctypes.data)
        kernel("norm", "embed_gather")((ids.size,), (256,), (cp.asarray(ids), table, h, _i(self.args.hidden_size)))
        return h

    @staticmethod
    def _paged_proj(x, mats):
        """x [T, K] @ the matrices side by side: gemv_rows.cu for up to ROWS_MAX rows, else the prefill GEMMs."""
        mats = mats if isinstance(mats, tuple) else (mats,)
        x = cp.ascontiguousarray(x)
        return gemm(x, mats, path="rows" if x.shape[0] <= ROWS_MAX and rows_fit(mats) else None)

    def _paged_gate_up(self, x, layer):
        if x.shape[0] <= ROWS_MAX and rows_fit((layer.w1, layer.w3)):
            y, I = self._paged_proj(x, (layer.w1, layer.w3)), layer.w1.N
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
        """Each sequence's last row's logits [B, V] (every row's [T, V] with all_positions), ROWS_MAX rows a
        launch."""
        x = x if all_positions else x[cp.asarray(self._paged.last)]
        x = cp.ascontiguousarray(x)
        out = cp.empty((x.shape[0], self.args.vocab_size), cp.float32)
        for r in range(0, x.shape[0], ROWS_MAX):
            rows_lm_head(x[r:r + ROWS_MAX], self.weights.lm_head, out[r:r + ROWS_MAX])
        return out
