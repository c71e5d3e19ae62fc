"""Prefill's W4A16 GEMMs: dequant + cuBLAS, the mma.sync tile, the warp-specialized and register-operand wgmma
kernels (sm_90a), and the rule that picks one per shape."""
from __future__ import annotations

import math
import sys
import weakref

import numpy as np

from ...loader import AwqLinear
from .. import settings as cfg
from ..memory import _BUF_GEN, _CAPTURING, _NULL, _NotCapturable, _device_zeros, _empty, _i
from .gemv import GEMV_COLS, _mat_slots, device_tuning
from .rows import ROWS_MAX, rows_fit, rows_gemm
from ..runtime.build import kernel
from ..runtime.device import current_device_id, sm_count
from ..runtime.launch import cu_launch_ex, _cu_tmap_encode, _remember, allow_dynamic_smem, launch_ex, tma_map_2d
from ..runtime.registry import RS_STAGES, WGMMA_PRODUCERS, WGMMA_TILES, WGMMA_TILE_EFF

try:
    import cupy as cp
    from cupy_backends.cuda.libs import cublas as _cublas
except ImportError:  # pragma: no cover - CPU-only installs
    cp = _cublas = None

GEMM_BM, GEMM_BN = 64, 128  # the MoE grouped GEMM's tile (moe_maps' tile_m); dense prefill picks 64 or 128 rows


_DEQ: dict[int, object] = {}


def dequant_scratch(n: int):
    """The fp16 matrix the large-M path dequantizes into: one per device, grown to the largest
    projection group met (100 MB at 8B). Every use is ordered on one stream, so reuse is safe."""
    dev = current_device_id()
    if dev not in _DEQ or _DEQ[dev].size < n:
        _BUF_GEN[0] += 1
        _DEQ.pop(dev, None)
        _DEQ[dev] = cp.empty((n,), cp.float16)
    return _DEQ[dev][:n]


def _dequant_blocks(N: int, K: int) -> int:
    """256-thread blocks of gemm_w4a16.cu's dequant_quad grid for one [K, N] matrix: a thread per packed word of
    a row quad, 32-word column tiles x K/4 quads."""
    return math.ceil(math.ceil(N / GEMV_COLS) * (K // 4) * 32 / 256)


def awq_dequant(m: AwqLinear, out=None):
    """The fp16 matrix [K, N] of a device AwqLinear (qweight tiled), (q - z) * s per element. out may
    be a column slice [K, N] of a wider row-major matrix (its row stride is passed on)."""
    out = dequant_scratch(m.K * m.N).reshape(m.K, m.N) if out is None else out
    assert out.shape == (m.K, m.N) and out.strides[1] == 2 and out.strides[0] % 16 == 0
    kernel("gemm", "awq_dequant")((_dequant_blocks(m.N, m.K),), (256,), (m.qweight, m.qzeros, m.scales, out,
                                                                         _i(m.N), _i(m.K), _i(m.group_size),
                                                                         _i(out.strides[0] // 2)))
    return out


def awq_dequant3(mats, out):
    """One to three device AwqLinears with one K and group size (q, k and v) dequantized side by side into out
    [K, sum of N] (a row-major matrix or a column slice of a wider one) by one launch of awq_dequant3: what
    awq_dequant writes for each, in one launch instead of one per matrix."""
    K, g = mats[0].K, mats[0].group_size
    assert 1 <= len(mats) <= 3 and all(m.K == K and m.group_size == g for m in mats)
    assert out.shape == (K, sum(m.N for m in mats)) and out.strides[1] == 2 and out.strides[0] % 16 == 0
    args = []
    for j in range(3):
        m = mats[j] if j < len(mats) else None
        args += [m.qweight, m.qzeros, m.scales, _i(m.N)] if m is not None else [_NULL, _NULL, _NULL, _i(0)]
    kernel("gemm", "awq_dequant3")((max(_dequant_blocks(m.N, K) for m in mats), len(mats)), (256,),
                                   (*args, out, _i(K), _i(g), _i(out.strides[0] // 2)))
    return out


_F32_ONE, _F32_ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)  # host alpha and beta of cublas_matmul


def cublas_matmul(x, W, out):
    """out [T, N] = x [T, K] @ W [K, N], fp16 with fp32 accumulation, as cupy.matmul computes it (the same cuBLAS
    call), on the current stream. One cublasGemmEx on CuPy's handle: row-major out is column-major out^T = W^T x^T,
    so W goes first. Rows may be strided (a column slice of a wider matrix); elements must be contiguous."""
    T, K = x.shape
    N = W.shape[1]
    assert W.shape[0] == K and out.shape == (T, N)
    if not (x.strides[1] == W.strides[1] == out.strides[1] == 2
            and x.dtype == W.dtype == out.dtype == cp.float16):
        return cp.matmul(x, W, out=out)
    h = cp.cuda.device.get_cublas_handle()
    _cublas.setStream(h, cp.cuda.get_current_stream().ptr)
    _cublas.setPointerMode(h, _cublas.CUBLAS_POINTER_MODE_HOST)  # alpha and beta are host floats
    f16 = cp.cuda.runtime.CUDA_R_16F
    _cublas.gemmEx(h, _cublas.CUBLAS_OP_N, _cublas.CUBLAS_OP_N, N, T, K, _F32_ONE.ctypes.data,
                   W.data.ptr, f16, W.strides[0] // 2, x.data.ptr, f16, x.strides[0] // 2, _F32_ZERO.ctypes.data,
                   out.data.ptr, f16, out.strides[0] // 2, _cublas.CUBLAS_COMPUTE_32F, _cublas.CUBLAS_GEMM_DEFAULT)
    return out


_CUBLAS: dict[int, bool] = {}


def cublas_ready() -> bool:
    """cuBLAS loaded and its handle made on this device (one tiny fp16 matmul). If the library cannot
    be loaded, one stderr line, and dense prefill stays on the fused MMA GEMM."""
    dev = current_device_id()
    if dev not in _CUBLAS:
        try:
            cp.matmul(cp.zeros((2, 64), cp.float16), cp.zeros((64, 64), cp.float16))
            _CUBLAS[dev] = True
        except Exception as e:  # noqa: BLE001 - a missing or broken libcublas, whatever CuPy raises
            print(f"kuiper: cuBLAS unavailable ({type(e).__name__}: {e}); prefill uses the W4A16 MMA GEMM",
                  file=sys.stderr)
            _CUBLAS[dev] = False
    return _CUBLAS[dev]


_WGMMA_OK: dict[int, bool] = {}


def wgmma_available() -> bool:
    """The fused wgmma GEMM can run here: compute capability exactly 9.0 (sm_90a code runs nowhere
    else) and a driver with TMA descriptors (cuTensorMapEncodeTiled, CUDA 12.0) and cuLaunchKernelEx."""
    dev = current_device_id()
    if dev not in _WGMMA_OK:
        _WGMMA_OK[dev] = (int(cp.cuda.Device().compute_capability) == 90 and _cu_tmap_encode() is not None
                          and cu_launch_ex() is not None)
    return _WGMMA_OK[dev]


def _pow2_group(group: int) -> bool:
    """gemm_wgmma.cu's group sizes: 64 << n (a K tile's group index is a shift)."""
    return group >= 64 and group & (group - 1) == 0


def wgmma_fits(mats) -> bool:
    """gemm_wgmma.cu's shape table: up to 3 matrices with one K, K % 64, N % 256, group a power of two >= 64."""
    return (all(m.K == mats[0].K and m.group_size == mats[0].group_size for m in mats)
            and wgmma_fits_shape(mats[0].K, tuple(m.N for m in mats), mats[0].group_size))


def wgmma_fits_shape(K: int, Ns: tuple[int, ...], group: int) -> bool:
    """wgmma_fits for matrices K x N (each N of Ns) with one group size."""
    return len(Ns) <= 3 and K % 64 == 0 and all(n % 256 == 0 for n in Ns) and _pow2_group(group)


def wgmma_max_m(K: int, N: int) -> int:
    """Most rows for which the default path takes the fused wgmma GEMM (docs/PERFORMANCE.md;
    H100, TFLOP/s at 128 / 256 / 512 rows, fused vs dequant + cuBLAS): 8B q|k|v 206 / 263 / 323 vs
    103 / 191 / 351-413, gate 266 / 319 / 351 vs 141 / 276 / 425, down 290 / 346 / 373-383 vs
    138 / 257 / 428-440; 8B o 188 / 276 / 324-352 vs 65 / 133 / 261-405 (dequant + cuBLAS pays for
    writing back an fp16 matrix that fits in L2), 30B-A3B q|k|v 155 / 161 / 240 vs 42 /
    87 / 166, o 128 / 198 / 280 vs 33 / 68 / 130. So: matrices up to 4096 x 4096 to 512 rows, larger
    ones to 256; at 2048 rows dequant + cuBLAS wins everywhere (580-640 vs 320-370)."""
    return 512 if K * N <= 4096 * 4096 else 256


def rs_range(K: int, N: int) -> tuple[int, int]:
    """The rows (least, most) for which the default path takes gemm_w4a16_rs (docs/PERFORMANCE.md;
    H200 TFLOP/s, rs as rs_choose plans it against the better of the other two paths): 8B q|k|v at 256 /
    384 / 512 rows 328 / 315 / 423 vs 285 / 300 / 370, o 315 / 329 / 437 vs 297 / 315 / 448 (the kernel
    above, which took o to 512 rows, 373), gate|up 440 / 424 / 539 vs 364 / 416 / 479, down 463 / 407 / 506
    vs 375 / 363 / 490; 30B-A3B q|k|v at 256 / 512 / 768 242 / 333 / 494 vs 175 / 268 / 324 (dequant +
    cuBLAS, the path at 768 before, 233), o at 384 / 512 / 768 239 / 317 / 330 vs 226 / 298 / 329. At 768
    rows dequant + cuBLAS wins at 8B o, gate|up and down (503-544 vs 421-480; q|k|v: 338 vs 344 and the
    kernel above's 356), and the kernel above at 128 rows (and for N < 4096, 30B-A3B o, at 256: 211 vs
    177). So: from 256 rows (384 for N < 4096) to 512 for matrices from 4096 x 4096, to 768 for smaller
    ones. The H100 agrees but for 30B-A3B at 384 rows, 3% behind the kernel above.
    On the H200, once rs's dequantization was cheaper: below 256 rows rs is now the faster too, 8B
    q|k|v / gate|up / down at 80 rows 159 / 263 / 209 against 147 / 227 / 200, at 128 rows 243 / 415 / 327 against
    227 / 348 / 319, at 176 rows 237 / 304 / 333 against 176 / 250 / 258; at 64 rows it is behind (128 / 168 against
    141 / 202 for q|k|v / down). 8B o (4096 x 4096) stays on the kernel above up to 128 rows (214 against 177) and
    changes at 144 (181 against 169); 30B-A3B q|k|v (2048 x 5120) at 144 / 176 / 224 rows 143 / 167 / 219 against
    147 / 178 / 157. So: from 80 rows for matrices larger than 4096 x 4096, from 144 for the others of 4096 rows
    and columns or more, from 224 for shorter ones of 4096 columns or more, from 384 below 4096 columns as before
    (30B-A3B o, 4096 x 2048: the kernel above still leads at 256 rows, 211 against 177)."""
    lo = 80 if K * N > 4096 * 4096 else (144 if K >= 4096 else 224) if N >= 4096 else 384
    return lo, (512 if K * N >= 4096 * 4096 else 768)


# gemm()'s "rs" path for 257 to rs_rows_split_max rows of a matrix of at least RS_ROWS_SPLIT_KN weights: the first
# 256 rows by 256-token blocks, the rest by a second launch of 64-token blocks (docs/PERFORMANCE.md; 0: one
# launch whatever the rows)
RS_ROWS_SPLIT_KN = 3 * 4096 * 4096


def rs_rows_split(T: int, K: int, N: int) -> int:
    """The rows of gemm()'s first rs launch where it splits a prompt's rows in two, else 0. Why: gemm_w4a16_rs's
    blocks pass over their weights at the same pace whatever their tokens (a ragged last tile whose wgmmas cover
    only its rows was as slow), so 257-320 rows in 256-token blocks cost the GPU two full passes; one
    pass of 256 tokens, then 64-token blocks of 256 channels (half the blocks per pass) cost less where the
    matrix's passes are long (H200, Qwen3-8B gate|up at 288 rows 161 against 209 µs, down 83 against 91; q|k|v
    and o gain nothing). The whole 8B prefill: -15% at 257 tokens, -10% at 320, +6% at 352 (the bound)."""
    return 256 if 256 < T <= cfg.SETTINGS.rs_rows_split_max and K * N >= RS_ROWS_SPLIT_KN else 0


_MATS: dict[tuple, list] = {}


def mats_record(mats) -> list:
    """[shape signature, kernel arguments or None] of a projection's matrices, kept by their ids until one of them
    is collected (a finalizer drops the entry then, before its id can be reused; a model's weights are not kept
    alive by this cache): the signature ((K, N) of each, group size, whether gemm_wgmma.cu's shape table takes
    them) keys what depends only on shapes, the prompt's path and launch plan, so that a prompt length not seen
    before plans each projection shape once, not once per layer; the arguments
    (_mat_slots') are filled in by the first fused GEMM launch that needs them."""
    key = tuple(map(id, mats))
    rec = _MATS.get(key)
    if rec is None:
        rec = [(tuple((m.K, m.N) for m in mats), mats[0].group_size, wgmma_fits(mats)), None]
        for m in mats:
            weakref.finalize(m, _MATS.pop, key, None).atexit = False
        _remember(_MATS, key, rec)
    return rec


_GEMM_PATHS: dict[tuple, str] = {}


def _kn(sig) -> tuple[int, int]:
    """(K, N) of a projection's shape signature (its matrices side by side)."""
    return sig[0][0][0], sum(n for _, n in sig[0])


def rows_wgmma_min(table: dict, K: int, N: int) -> int | None:
    """A per-GPU table's rows from which 2..rows_max_m rows of a K x N projection take the fused wgmma GEMM (its
    "rows_wgmma_min" entry), or None."""
    return table.get("rows_wgmma_min", {}).get((K, N))


def gemm_path(T: int, mats) -> str:
    """The prefill path gemm() takes for T rows of the matrices mats: "rows" (2 to rows_max_m rows: gemv_rows.cu),
    "rs" or "wgmma" (the two fused Hopper GEMMs), "dequant" (cuBLAS) or "mma". Kept per (rows, the matrices' shape signature, the settings it
    reads): every prefill layer asks again."""
    sig, st = mats_record(mats)[0], cfg.SETTINGS
    few = 1 < T <= min(st.rows_max_m, ROWS_MAX)
    # this GPU's table's entry, part of the key, looked up only where it decides (a prompt's layers ask per call)
    wg_min = rows_wgmma_min(device_tuning(), *_kn(sig)) if few else None
    key = (T, sig, st.gemm_rs, st.gemm_wgmma, st.gemm_wgmma_min_m, st.gemm_dequant_min_m, st.rows_max_m, wg_min,
           cublas_ready(), current_device_id())
    path = _GEMM_PATHS.get(key)
    if path is not None:
        return path
    K, N = _kn(sig)
    # (the two fused kernels share a shape table, sig[2])
    return _remember(_GEMM_PATHS, key, gemm_rule(T, K, N, rows_fit(mats), wgmma_available() and sig[2],
                                                 cublas_ready(), st, wg_min))


def gemm_rule(T: int, K: int, N: int, rows_ok: bool, fused_ok: bool, cublas: bool, st, wg_min: int | None) -> str:
    """gemm_path's rule, of facts only (cuda/plan.py's PrefillPlan states it for a model): T rows of a K x N
    projection (N: its matrices side by side) whose shapes gemv_rows takes (rows_ok) and the fused Hopper GEMMs take
    on this GPU (fused_ok), with cuBLAS loaded or not, under the tuning st, with this GPU's rows_wgmma_min entry."""
    if 1 < T <= min(st.rows_max_m, ROWS_MAX) and rows_ok:
        # gemv_rows, unless this GPU's table has the fused GEMM (one 64-row tile, the same weight bytes) faster
        # for this shape from this many rows
        wg = wg_min is not None and T >= wg_min and fused_ok and st.gemm_wgmma != "0" and T <= wgmma_max_m(K, N)
        return "wgmma" if wg else "rows"
    lo, hi = rs_range(K, N)
    rs = st.gemm_rs != "0" and fused_ok and (st.gemm_rs == "1" or lo <= T <= hi)
    fused = (st.gemm_wgmma != "0" and T >= st.gemm_wgmma_min_m and fused_ok
             and (st.gemm_wgmma == "1" or T <= wgmma_max_m(K, N)))
    return "rs" if rs else "wgmma" if fused else "dequant" if T >= st.gemm_dequant_min_m and cublas else "mma"


def wgmma_plan(T: int, N: int, K: int) -> tuple[int, int, int, int]:
    """(BM, BN, n_full, split) for T rows and N columns: the tile with the least time counted in
    waves of blocks over the SMs, each wave costing its tile's area over its relative throughput
    (64-row tiles win when 128-row ones leave most SMs idle: o and down at 128-256 rows). The tiles
    of a partial last wave split their K tiles split ways (up to wgmma_split_max, at least 8 K tiles
    each), so that wave costs 1/split; n_full tiles run whole."""
    sms, best = sm_count(), None
    tiles_ok = [cfg.SETTINGS.gemm_wgmma_tile] if cfg.SETTINGS.gemm_wgmma_tile else list(WGMMA_TILES)
    for bm, bn in tiles_ok:
        tiles = math.ceil(T / bm) * (N // bn)
        waves, tail = divmod(tiles, sms)
        split = max(1, min(cfg.SETTINGS.wgmma_split_max, sms // tail, K // 64 // 8)) if tail else 1
        cost = (waves + (1 / split if tail else 0)) * bm * bn / WGMMA_TILE_EFF[(bm, bn)]  # in tile units
        if best is None or cost < best[0]:
            best = (cost, (bm, bn, tiles - tail if split > 1 else tiles, split))
    return best[1]


_GEMM_SPLIT: dict[int, object] = {}


_GEMM_TICKETS: dict[int, object] = {}


def gemm_split_buffers(n_part: int):
    """(partial sums, tickets) of gemm_wgmma.cu's split tiles, per device: the fp32 partials grown as needed, the
    tickets zero between launches. Every use is ordered on one stream, so reuse is safe."""
    dev = current_device_id()
    part = _GEMM_SPLIT.get(dev)
    if part is None or part.size < n_part:
        if part is not None:  # (a graph captured before holds the old partials)
            _BUF_GEN[0] += 1
        part = _GEMM_SPLIT[dev] = cp.empty((n_part,), cp.float32)
    return part, _device_zeros(_GEMM_TICKETS, 4096)


def wgmma_smem_bytes(bm: int, bn: int, sx: int, sb: int, ps: int) -> int:
    """WsSmem<bm, bn, sx, sb, ps>::bytes of gemm_wgmma.cu (the kernel traps if it gets less)."""
    return (sx * bm + sb * bn) * 128 + ps * (bn * 32 + bn * 2 + bn // 2) + 16 * (sx + sb) + 16 + 1024


_WGMMA_CALLS: dict[tuple, tuple] = {}


def gemm_wgmma(x, mats, out, tile: tuple[int, int] | None = None, plan: tuple | None = None,
               producers: int | None = None):
    """The fused Hopper GEMM (gemm_wgmma.cu): all matrices (q, k, v) in one launch, side by side in
    out. By default wgmma_plan()'s tile and split-K of the last wave; tile: (BM, BN), one of
    WGMMA_TILES, in whole tiles; plan: (BM, BN, n_full, split) as wgmma_plan gives it (tests).
    producers: the kernel's producer warpgroups (one of WGMMA_PRODUCERS; by default the last). x is
    read through a TMA descriptor (tma_map_2d). Everything but x's descriptor and out is worked out
    once per (the matrices' shapes, x's and out's shapes and strides, tile, plan, producers) and kept: a
    prefill repeats them per layer and per prompt, and the checks and plan had cost more host time than
    the launch."""
    return tma_gemm(_WGMMA_CALLS, x, mats, out, (tile, plan, producers),
                    lambda: wgmma_call(x, mats, out, tile, plan, producers))


def tma_gemm(cache: dict, x, mats, out, settings: tuple, build):
    """Launch one of gemm_wgmma.cu's fused GEMMs from its plan in cache, keyed by (the matrices' shape
    signature, x's and out's shapes and strides, settings, device), so every layer's projection of one shape
    shares it; build() makes the plan on a miss: (kernel, grid, block, shared memory, rows per TMA box of x,
    the arguments after out). The matrices' own arguments come from mats_record; x's descriptor and out are
    per call."""
    mrec = mats_record(mats)
    if mrec[1] is None:
        mrec[1] = tuple(_mat_slots(mats))
    key = (mrec[0], x.shape, x.strides, out.shape, out.strides, settings, current_device_id())
    rec = cache.get(key)
    if rec is None:
        rec = _remember(cache, key, build())
    fn, grid, block, smem, rows, tail = rec
    launch_ex(fn, grid, block, (tma_map_2d(x, rows, 64), *mrec[1], out, *tail), smem)
    return out


RS_PART_COST = 14  # K tiles: what one more K range of a tile costs gemm_w4a16_rs (fit to the measured splits)


# a 128-token block's throughput relative to a 256-token one (the same area: 256 x 128 channels); H200,
# 2048 rows, split 1, measured: 0.77-0.84 over the 8B and 30B-A3B shapes
RS_BT128_EFF = 0.8


def rs_channels(bt: int) -> int:
    """A gemm_w4a16_rs block's channels: 4 consumer warpgroups of 64, or 2 with 256 tokens (RS_WG)."""
    return 128 if bt == 256 else 256


def rs_cost(T: int, N: int, K: int, bt: int, s: int) -> float:
    """rs_plan's model of gemm_w4a16_rs's time for T rows of N columns, bt tokens per block, each tile's K in
    s ranges: waves of parts over the SMs, each wave a part's K tiles plus RS_PART_COST, over the block's
    relative throughput."""
    parts = math.ceil(T / bt) * (N // rs_channels(bt)) * s
    return math.ceil(parts / sm_count()) * (K // 64 / s + RS_PART_COST) / (RS_BT128_EFF if bt == 128 else 1.0)


def rs_plan(T: int, N: int, K: int, bt: int = 128) -> int:
    """gemm_w4a16_rs's split for bt tokens per block: the K ranges per tile (up to 8, each at least 8 K tiles)
    with the least rs_cost (ties to the smaller split). The fit: o and down at 512 rows (64 tiles)
    split 2, at 256 rows split 4; q|k|v at 512 (96 tiles) stays whole. With 256 tokens the
    model's splits are within the probe's spread of the best measured ones."""
    nk = K // 64
    return min(range(1, max(1, min(8, nk // 8)) + 1), key=lambda s: (rs_cost(T, N, K, bt, s), s))


def rs_choose(T: int, N: int, K: int) -> tuple[int, int]:
    """(tokens per block, split) with the least rs_cost: 256 tokens unless a half-empty last token tile
    costs more than the 128-token block's lower throughput (30B-A3B q|k|v at 384 rows: 128 tokens in 2
    ranges, 297 TFLOP/s, against 246)."""
    return min(((bt, rs_plan(T, N, K, bt)) for bt in (256, 128)), key=lambda p: rs_cost(T, N, K, *p))


def rs_smem_bytes(st: int, bt: int) -> int:
    """RsSmem<st, bt>::bytes of gemm_wgmma.cu (gemm_w4a16_rs and gemm_moe_rs trap on less)."""
    return st * (bt * 128 + 8192 + 512 + 128) + 16 * st + 1024


_RS_CALLS: dict[tuple, tuple] = {}


def gemm_rs(x, mats, out, bt: int | None = None, split: int | None = None):
    """The register-A wgmma GEMM (gemm_wgmma.cu gemm_w4a16_rs; gemm()'s "rs"
    path): up to 3 matrices with the same K (each N % 256 == 0), side by side in out; bt tokens per block
    (64, 128, or 256 with blocks of 128 channels); each tile's K cut into split ranges. By default
    rs_choose's bt and split (with bt given, rs_plan's split). As gemm_wgmma, everything but x's descriptor
    is worked out once per (matrices, shapes, strides, bt, split) and kept."""
    return tma_gemm(_RS_CALLS, x, mats, out, (bt, split), lambda: rs_call(x, mats, out, bt, split))


def rs_call(x, mats, out, bt, split) -> tuple:
    """gemm_rs's launch plan for these shapes, laid out as wgmma_call's."""
    T, K = x.shape
    N = sum(m.N for m in mats)
    assert wgmma_fits(mats) and mats[0].K == K and out.shape[0] == T and out.shape[1] >= N
    assert x.strides[1] == 2 and x.strides[0] % 16 == 0 and out.strides[1] == 2
    if bt is None:
        bt, split = rs_choose(T, N, K) if split is None else (256, split)
    assert bt in RS_STAGES
    split = split or rs_plan(T, N, K, bt)
    bc, st = rs_channels(bt), RS_STAGES[bt]
    tiles = math.ceil(T / bt) * (N // bc)
    assert 1 <= split <= K // 64
    part, ticket = gemm_split_buffers(tiles * split * bt // 2 * (2 * bc) if split > 1 else 0)  # bt / 2 per thread
    assert split == 1 or tiles <= ticket.size
    fn = kernel("gemm90rs", f"gemm_w4a16_rs<{st}, {bt}>")
    smem = rs_smem_bytes(st, bt)
    allow_dynamic_smem(fn, smem)
    tail = (_i(T), _i(K), _i(mats[0].group_size), _i(out.strides[0] // 2), _i(split), part, ticket)
    # a warpgroup per 64 channels (the kernel traps on another block size)
    return fn, (math.ceil(T / bt), N // bc, split), (2 * bc,), smem, bt, tail


def wgmma_call(x, mats, out, tile, plan, producers) -> tuple:
    """gemm_wgmma's launch plan for these shapes: (kernel, grid, block, shared memory, BM, the arguments
    after out). The plan holds the split-K buffers it was made with (a later, larger plan allocates new
    ones)."""
    assert x.strides[1] == 2 and out.strides[1] == 2 and x.strides[0] % 16 == 0 and wgmma_fits(mats)
    T, K, N = x.shape[0], mats[0].K, sum(m.N for m in mats)
    assert x.shape[1] == K and out.shape[0] == T and out.shape[1] >= N
    if plan is not None:
        bm, bn, n_full, split = plan
    elif tile is not None:
        (bm, bn), split = tile, 1
        n_full = math.ceil(T / bm) * (N // bn)
    else:
        bm, bn, n_full, split = wgmma_plan(T, N, K)
    assert 1 <= split <= K // 64 and 0 <= n_full <= math.ceil(T / bm) * (N // bn)
    n_split = math.ceil(T / bm) * (N // bn) - n_full
    part, ticket = gemm_split_buffers(n_split * split * bm * bn)
    assert n_split <= ticket.size
    rings = WGMMA_TILES[(bm, bn)]
    fn = kernel("gemm90", f"gemm_w4a16_ws<{bm}, {bn}, {', '.join(map(str, rings))}, {producers or WGMMA_PRODUCERS[-1]}>")
    smem = wgmma_smem_bytes(bm, bn, *rings)
    allow_dynamic_smem(fn, smem)
    tail = (_i(T), _i(K), _i(mats[0].group_size), _i(out.strides[0] // 2), _i(n_full), _i(split), part, ticket)
    # the block is the kernel's launch bound, WG_THREADS: its roles are laid out by thread index
    return fn, (n_full + n_split * split,), (fn.max_threads_per_block,), smem, bm, tail


def gemm(x, m, out=None, path: str | None = None):
    """Prefill projection: x [T, K] fp16 -> [T, N] fp16; m one AwqLinear or a tuple of them with the
    same K (q, k, v), multiplied as one matrix [K, sum of N]. Paths "wgmma" (sm_90, short prompts of
    some shapes, see gemm_path) and "rs" (sm_90, mid-size prompts, rs_range; two launches where rs_rows_split
    says so): the fused wgmma GEMMs of gemm_wgmma.cu, the weights dequantized in shared memory or registers and
    never written out. Otherwise from gemm_dequant_min_m rows the weights are dequantized (LOP3)
    into an fp16 scratch matrix that cuBLAS multiplies (path "dequant", fp32 accumulation); below
    it, or with path="mma", the fused tensor-core W4A16 GEMM of gemm_w4a16.cu."""
    mats = m if isinstance(m, tuple) else (m,)
    K, N = mats[0].K, sum(w.N for w in mats)
    T = x.shape[0]
    out = _empty((T, N), cp.float16) if out is None else out
    path = path or gemm_path(T, mats)
    if path == "rows":
        return rows_gemm(x, mats, out)
    if path == "wgmma":
        return gemm_wgmma(x, mats, out)
    if path == "rs":
        h = rs_rows_split(T, K, N)
        if h:
            gemm_rs(x[:h], mats, out[:h], 256)
            gemm_rs(x[h:], mats, out[h:], 64)
            return out
        return gemm_rs(x, mats, out)
    if path == "dequant":
        if _CAPTURING[0]:  # (CuPy refuses cuBLAS calls while a stream captures)
            raise _NotCapturable("cuBLAS")
        W = dequant_scratch(K * N).reshape(K, N)
        if len(mats) == 1:
            awq_dequant(mats[0], W)
        else:  # side by side in one launch: one cuBLAS call for q, k and v (k and v alone are narrow)
            awq_dequant3(mats, W)
        return cublas_matmul(x, W, out)
    if len(mats) > 1:  # the MMA tile writes whole rows: one matrix at a time, then side by side
        c = 0
        for w in mats:
            out[:, c:c + w.N] = gemm(x, w, path="mma")
            c += w.N
        return out
    m = mats[0]
    # gemm_w4a16.cu's two dense tiles: 128 rows measured 5-8% faster at 2048-8192 tokens on H100 and
    # slower at 128-512 (fewer blocks than SMs x 2)
    bm = 128 if T >= 1024 else 64
    grid = (math.ceil(m.N / GEMM_BN), math.ceil(T / bm))
    kernel("gemm", f"gemm_w4a16<{bm}>")(grid, (2 * bm,), (x, m.qweight, m.qzeros, m.scales, out, _i(T), _i(m.N), _i(m.K),
                                                _i(m.group_size)))
    return out


def swiglu_prefill(x, w1: AwqLinear, w3: AwqLinear, out=None):
    """silu(x W1) * (x W3) for x [T, K] fp16 -> [T, I] fp16. On the fused wgmma, rs and rows paths gate and up are
    one launch ([T, 2I], as q|k|v are); the dequant path multiplies them one at a time (its scratch
    holds one matrix)."""
    T, I = x.shape[0], w1.N
    path = gemm_path(T, (w1, w3))
    if path in ("wgmma", "rs", "rows"):
        y = gemm(x, (w1, w3), path=path)
        g, u, ld = y, y[:, I:], 2 * I
    else:
        g, u, ld = gemm(x, w1), gemm(x, w3), I
    return silu_mul(g, u, I, ld, out)


def silu_mul(g, u, I: int, ld: int, out=None):
    """out [T, I] fp16 = silu(g) * u (gemm_w4a16.cu silu_mul): g and u the first I columns of rows ld elements
    apart (ld = I for separate matrices, 2I for the halves of one [T, 2I] product, u then g[:, I:])."""
    T = g.shape[0]
    out = _empty((T, I), cp.float16) if out is None else out
    kernel("gemm", "silu_mul")((math.ceil(T * I / 2048),), (256,), (g, u, out, _i(T * I), _i(I), _i(ld)))
    return out
