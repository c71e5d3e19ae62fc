"""A few token rows at once (gemv_rows.cu): the W4A16 projections and the fp16 lm_head for M = 2..16 rows, each
weight read once for all rows on tensor cores. A speculative verify step (K + 1 tokens) and small batches take
these instead of the prefill GEMMs, whose tiles leave most SMs idle at so few rows."""
from __future__ import annotations

import math

from ..memory import _BUF_GEN, _empty, _i
from ..runtime.build import kernel, raw_kernel
from ..runtime.launch import allow_dynamic_smem
from ..runtime.device import current_device_id, device_attrs, sm_count
from .gemv import _mat_slots

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None

ROWS_MAX = 16  # gemv_rows.cu RW_MAX_M: the MMA's m
ROWS_CHUNK = 128  # gemv_rows.cu RW_CHUNK: rows of K a pipeline stage holds
ROWS_SMEM = 4 * 23552  # gemv_rows.cu RW_STAGES * RW_STAGE_BYTES (a static_assert there holds them equal)
ROWS_BLOCKS_MAX = 2  # gemv_rows.cu __launch_bounds__(256, 2): the blocks an SM's registers hold


def rows_fit(mats) -> bool:
    """gemv_rows.cu's shape table: up to 3 matrices with one K and group size, K % 32, N % 32 (a tile's zero words
    in 16-byte pieces), group 32 or 64 or a multiple of 128 (a stage's chunk holds whole groups), K whole groups."""
    m0 = mats[0]
    return (all(m.K == m0.K and m.group_size == m0.group_size for m in mats)
            and rows_fit_shape(m0.K, tuple(m.N for m in mats), m0.group_size))


def rows_fit_shape(K: int, Ns: tuple[int, ...], g: int) -> bool:
    """rows_fit for matrices K x N (each N of Ns) with one group size g."""
    return (len(Ns) <= 3 and K % 32 == 0 and (g in (32, 64) or g > 0 and g % ROWS_CHUNK == 0) and K % g == 0
            and all(n % 32 == 0 for n in Ns))


def rows_blocks_per_sm() -> int:
    """gemv_rows blocks one SM holds: two where its shared memory takes two stage rings (Hopper), else one."""
    a = device_attrs()
    per_block = ROWS_SMEM + 128 + a.get("ReservedSharedMemoryPerBlock", 1024)  # (+ its static shared memory)
    return max(1, min(ROWS_BLOCKS_MAX, a["MaxSharedMemoryPerMultiprocessor"] // per_block))


_SPLITS: dict[tuple, tuple[int, int]] = {}


def rows_split(K: int, tiles: int) -> tuple[int, int]:
    """(splits, rows per split) of K over a launch of `tiles` column tiles: the split whose busiest SM streams the
    fewest bytes at ROWS_MAX rows, counting the blocks' waves over the GPU's slots (rows_blocks_per_sm() an SM), each
    block's chunks and, with more than one split, the partial sums it writes and the last block reads back. It does
    not depend on the launch's rows, which set the order of a row's sums through the split: a row's sums are the
    same bits whatever rows share its launch (an eager step and its bucket's graph replay, a verify step and
    plain decoding's rows)."""
    key = (K, tiles, sm_count(), rows_blocks_per_sm())
    if key not in _SPLITS:
        chunks = math.ceil(K / ROWS_CHUNK)
        slots = key[3] * key[2]
        chunk_bytes = ROWS_CHUNK * 256 // 2 + ROWS_CHUNK * ROWS_MAX * 2  # a tile's weights and the rows of x
        best = None
        for per in range(chunks, 0, -1):  # chunks per block, most first: fewer splits win ties
            S = math.ceil(chunks / per)
            if math.ceil(chunks / S) != per:
                continue  # (the same split as a larger per)
            cost = math.ceil(tiles * S / slots) * (per * chunk_bytes + (S > 1) * ROWS_MAX * 256 * 4 * 2)
            if best is None or cost < best[0]:
                best = (cost, S, per * ROWS_CHUNK)
        _SPLITS[key] = best[1:]
    return _SPLITS[key]


_SCRATCH: dict[int, list] = {}
ROWS_MAX_TILES = 4096  # column tiles of one launch: the arrival counters' length


def rows_scratch(n_partial: int = 0):
    """(partials, counters) of the split launches, per device. The counters are made once, zeroed, and stay zero
    between launches (the last block of each tile clears its own): made before any graph capture (graphs.py), since
    a captured cp.zeros does not run. The partials grow as needed, which drops the graphs that hold the old ones
    (_BUF_GEN). Every use is ordered on one stream, so reuse is safe."""
    dev = current_device_id()
    rec = _SCRATCH.get(dev)
    if rec is None:
        rec = _SCRATCH[dev] = [cp.empty((4 << 20,), cp.float32), cp.zeros((ROWS_MAX_TILES,), cp.uint32)]
    if rec[0].size < n_partial:
        _BUF_GEN[0] += 1
        rec[0] = None
        rec[0] = cp.empty((n_partial,), cp.float32)
    return rec


def rows_gemm(x, mats, out=None):
    """x [M, K] fp16 (2 <= M <= ROWS_MAX, rows contiguous) times 1-3 device AwqLinears with one K, side by side ->
    out [M, sum of N] fp16."""
    mats = mats if isinstance(mats, tuple) else (mats,)
    M, K = x.shape
    assert 1 <= M <= ROWS_MAX and rows_fit(mats) and K == mats[0].K and x.flags.c_contiguous
    Ntot = sum(m.N for m in mats)
    out = _empty((M, Ntot), cp.float16) if out is None else out
    assert out.shape == (M, Ntot) and out.flags.c_contiguous
    tiles = sum(math.ceil(m.N / 256) for m in mats)
    assert tiles <= ROWS_MAX_TILES
    S, rph = rows_split(K, tiles)
    part, counters = rows_scratch(S * M * Ntot if S > 1 else 0)
    allow_dynamic_smem(raw_kernel("rows", "gemv_rows"), ROWS_SMEM)
    kernel("rows", "gemv_rows")((tiles, S), (256,), (x, _i(M), _i(K), _i(mats[0].group_size), *_mat_slots(mats),
                                                      out, _i(Ntot), part, counters, _i(S), _i(rph)),
                                shared_mem=ROWS_SMEM)
    return out


LM_HEAD_ROWS_MAX = 64  # lm_head_rows<NT>: 8 NT token rows, NT up to 8 (compiled 1, 2, 4, 8)


def rows_lm_head(x, W, out=None):
    """x [M, D] fp16 (M <= LM_HEAD_ROWS_MAX, rows contiguous), W [V, D] fp16 -> out [M, V] fp32: the head read once
    for all M rows (each row's sums in the same order whatever M)."""
    M, D = x.shape
    V = W.shape[0]
    assert 1 <= M <= LM_HEAD_ROWS_MAX and D % 32 == 0 and W.shape[1] == D and x.flags.c_contiguous
    out = cp.empty((M, V), cp.float32) if out is None else out
    nt = next(n for n in (1, 2, 4, 8) if M <= 8 * n)
    kernel("rows", f"lm_head_rows<{nt}>")((math.ceil(V / 128),), (256,), (x, _i(M), W, out, _i(V), _i(D)))
    return out


