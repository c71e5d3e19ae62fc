"""Qwen3-MoE: routing (prefill and decode), the expert maps, the grouped expert GEMMs and decode's expert GEMVs."""
from __future__ import annotations

import math

import numpy as np

from ...loader import AwqLinear, AwqStack
from .. import settings as cfg
from ..memory import _NULL, _device_zeros, _empty, _f, _i
from .gemm import GEMM_BM, GEMM_BN, _pow2_group, cublas_ready, rs_smem_bytes, silu_mul, wgmma_available
from .gemv import gemv
from ..runtime.build import kernel, raw_kernel
from ..runtime.device import current_device_id, sm_count, smem_optin
from ..runtime.launch import allow_dynamic_smem, launch_ex, tma_map_2d, tma_map_words
from ..runtime.registry import MOE_RS_FORMS, MOE_RS_TILES, MOE_TC_TILES, moe_rs_name

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None




MOE_MAX_EXPERTS, MOE_MAX_TOPK = 256, 32  # moe.cu: 8 experts per lane of a warp; k slots kept by lanes


MOE_LOGIT_TB = 16  # moe.cu MOE_LOGIT_TB: tokens per block of moe_router_logits


def moe_rmma_smem(warps: int) -> int:
    """moe_route_mma's dynamic shared memory: its cp.async stages, [warps][MOE_RMMA_ST 4][6 pieces][32 lanes] x 16 B."""
    return warps * 4 * 6 * 32 * 16


def moe_route_wide_t() -> int:
    """The most prompt tokens moe_route_mma runs its 16-warp form for (moe_route_wide_t)."""
    return cfg.SETTINGS.moe_route_wide_t if cfg.SETTINGS.moe_route_wide_t is not None else 16 * sm_count()


_RMMA_FITS: dict[tuple[int, str], bool] = {}


def moe_rmma_groups(E: int) -> int:
    """moe_route_mma's expert groups of 32 (its NG) for E experts: 4 up to 128, else 8."""
    return 4 if E <= 128 else 8


def moe_rmma_split_name(E: int, warps: int) -> str:
    """moe_route_mma's split instantiation of moe_rmma_form's form for E experts and warps per block."""
    ng = moe_rmma_groups(E)
    return f"moe_route_mma_split<{ng}, {warps // ng}>"


def moe_rmma_form(T: int, E: int) -> tuple[str, int]:
    """(instantiation, warps) of moe_route_mma for T tokens and E experts: 16 warps up to moe_route_wide_t() tokens where
    the block's shared memory (the dynamic stages and the compiled kernel's static partial logits) fits the device.
    The fit is a device constant, asked of the driver once per device and instantiation (every MoE prefill layer
    routes)."""
    ng = moe_rmma_groups(E)
    if T <= moe_route_wide_t():
        wide = f"moe_route_mma<{ng}, {16 // ng}>"
        key = (current_device_id(), wide)
        fits = _RMMA_FITS.get(key)
        if fits is None:
            fits = _RMMA_FITS[key] = moe_rmma_smem(16) + raw_kernel("moe", wide).shared_size_bytes <= smem_optin()
        if fits:
            return wide, 16
    return f"moe_route_mma<{ng}, {8 // ng}>", 8


# ---------------------------------------------------------------------------------------------- MoE stages
_MOE_COUNTER: dict[int, object] = {}


_MOE_TILE_COUNTERS: dict[int, object] = {}


MOE_ROUTE_MAX_TILES = 4096  # the split form's per-tile counters (65536 tokens)


def moe_route_counter():
    """moe_route_mma's arrival counter for the maps (one int32, zero between launches; each launch leaves it zero),
    per device."""
    return _device_zeros(_MOE_COUNTER, 1)


def moe_route_tile_counters():
    """moe_route_mma's split form's arrival counters, one per 16-token tile (int32 [MOE_ROUTE_MAX_TILES], zero between
    launches; each launch leaves them zero), per device."""
    return _device_zeros(_MOE_TILE_COUNTERS, MOE_ROUTE_MAX_TILES)


def moe_route_splits(T: int, D: int, warps: int, ng: int) -> int:
    """moe_route_mma's K splits per 16-token tile (gridDim.y): as many as keep the grid one wave (one 16-warp block or two
    8-warp blocks per SM) up to moe_route_split_max, each split at least one 32-wide chunk of D per warp; or
    moe_route_splits forced (within the chunk bound). One token never splits (a decode step's fallback routing may be
    captured in a graph, where the partial logits' allocation has no place)."""
    if T == 1:
        return 1
    tiles, ks = math.ceil(T / 16), warps // ng
    most = max(1, (D // 32) // ks)
    if cfg.SETTINGS.moe_route_splits != "auto":
        return max(1, min(int(cfg.SETTINGS.moe_route_splits), most))
    per_sm = 1 if warps == 16 else 2
    return max(1, min(cfg.SETTINGS.moe_route_split_max, most, per_sm * sm_count() // tiles))


def moe_route(x, router, k: int, norm_topk: bool, logits=None, ids=None, weights=None, maps=None):
    """Router logits in fp32, softmax, top-k, optional renormalisation (logits [T, E] fp32 kept).
    x [T, D] fp16, router [E, D] fp16 -> ids int32 [T, k], weights fp32 [T, k]. One launch on tensor cores
    (moe_route_mma, 8 or 16 warps per block: moe_rmma_form) where D % 32 == 0 and E <= 256, unless moe_router is
    "cuda". maps (tile_m, counts, offsets, tiles, p2u, u2p): moe_maps' arrays for these picks are written too, by
    the routing launch's last block (moe_route_maps, in the 16-warp form: up to moe_route_wide_t() tokens, where it
    was measured; the 8-warp form's maps over more picks were not) or by moe_maps after it."""
    T, D = x.shape
    E = router.shape[0]
    logits = _empty((T, E), cp.float32) if logits is None else logits
    ids = _empty((T, k), cp.int32) if ids is None else ids
    weights = _empty((T, k), cp.float32) if weights is None else weights
    if (cfg.SETTINGS.moe_router != "cuda" and D % 32 == 0 and E <= MOE_MAX_EXPERTS and x.flags.c_contiguous
            and router.flags.c_contiguous):
        name, warps = moe_rmma_form(T, E)
        smem = moe_rmma_smem(warps)
        tiles = math.ceil(T / 16)
        splits = moe_route_splits(T, D, warps, moe_rmma_groups(E))
        if splits > 1:  # the split instantiation (its own code and registers: the unsplit form keeps its own)
            assert tiles <= MOE_ROUTE_MAX_TILES
            name = moe_rmma_split_name(E, warps)
            split = (_empty((splits, T, E), cp.float32), moe_route_tile_counters())
        else:
            split = ()
        allow_dynamic_smem(raw_kernel("moe", name), smem)
        fuse = maps is not None and cfg.SETTINGS.moe_route_maps and warps == 16
        if fuse:
            assert all(a.dtype == cp.int32 and a.flags.c_contiguous for a in maps[1:])
            assert [a.size for a in maps[1:]] == [E, E + 1, E + 1, T * k, T * k]
            tail = (moe_route_counter(), _i(maps[0]), *maps[1:], *split)
        else:
            tail = (_NULL, _i(0), _NULL, _NULL, _NULL, _NULL, _NULL, *split)
        kernel("moe", name)((tiles, splits), (32 * warps,), (
            x, router, logits, ids, weights, _i(T), _i(D), _i(E), _i(k), _i(int(norm_topk)), *tail), shared_mem=smem)
        if maps is not None and not fuse:
            moe_maps(ids, E, out=maps[1:], tile_m=maps[0])
        return ids, weights
    if T >= cfg.SETTINGS.moe_router_gemm_min_t and cublas_ready():  # fp32 products of fp16 values are exact: fp32 logits
        cp.matmul(x.astype(cp.float32), router.astype(cp.float32).T, out=logits)
    else:
        kernel("moe", "moe_router_logits")((math.ceil(E / 8), math.ceil(T / MOE_LOGIT_TB)), (256,),
                                           (x, router, logits, _i(T), _i(D), _i(E)))
    kernel("moe", "moe_topk")((math.ceil(T / 8),), (256,), (logits, ids, weights, _i(T), _i(E), _i(k),
                                                           _i(int(norm_topk))))
    if maps is not None:
        moe_maps(ids, E, out=maps[1:], tile_m=maps[0])
    return ids, weights


def moe_route_decode(h, norm_w, eps: float, router, k: int, norm_topk: bool, logits, xout, ids, weights, counter,
                     pend=None, hout=None):
    """One decode token's routing in one kernel: xout = rmsnorm(h) * norm_w (fp16 [1, D], h fp32), the
    router logits (fp32 [E]), softmax, top-k -> ids int32 [1, k], weights fp32 [1, k]. counter: one
    int32, zero before (left zero). pend (int64 [D], accumulating mode): the o projection's pending
    sums, so the row is h + fp16(pend), written to hout (fp32 [1, D]; h is not changed)."""
    D, E = h.shape[1], router.shape[0]
    assert D % 8 == 0 and D <= 8192 and xout.size == D and logits.size >= E
    assert (pend is None) == (hout is None) and (pend is None or (pend.dtype == cp.int64 and pend.size == hout.size == D))
    null = np.uint64(0)
    kernel("moe", "moe_route_decode")((math.ceil(E / 8),), (256,), (
        h, norm_w, _f(eps), router, logits, xout, ids, weights, counter, _i(D), _i(E), _i(k), _i(int(norm_topk)),
        pend if pend is not None else null, hout if hout is not None else null))
    return ids, weights


MOE_MAPS_STAGE_MAX = 128 << 10  # moe_expert_maps' staging of p2u (dynamic shared memory): up to 32K picks


_MAPS_ROOM: dict[int, int] = {}


def moe_maps_stage_room() -> int:
    """The bytes of dynamic shared memory moe_expert_maps may stage p2u in on this device (MOE_MAPS_STAGE_MAX, or
    less where the opt-in limit and the kernel's static arrays leave less), allowed once per device."""
    dev = current_device_id()
    if dev not in _MAPS_ROOM:
        fn = raw_kernel("moe", "moe_expert_maps")
        room = _MAPS_ROOM[dev] = max(0, min(MOE_MAPS_STAGE_MAX, smem_optin() - fn.shared_size_bytes))
        allow_dynamic_smem(fn, room)
    return _MAPS_ROOM[dev]


def moe_maps(ids, n_experts: int, out=None, tile_m: int = GEMM_BM):
    """counts [E], expert_first_token_offset [E+1], tile offsets [E+1] (grouped-GEMM row tiles of tile_m
    rows), permuted_row_to_unpermuted_row [T*k] and its inverse, built by one block on the device."""
    n, E = ids.size, n_experts
    if out is None:
        out = moe_maps_arrays(n, E)
    counts, offsets, tiles, p2u, u2p = out
    assert [a.size for a in out] == [E, E + 1, E + 1, n, n]
    smem = 4 * n if 4 * n <= moe_maps_stage_room() else 0  # p2u put together in shared memory (expert_maps_block)
    kernel("moe", "moe_expert_maps")((1,), (1024,), (ids, _i(n), _i(E), _i(tile_m), counts, offsets, tiles, p2u,
                                                     u2p), shared_mem=smem)
    return counts, offsets, tiles, p2u, u2p


def _moe_grid_rows(n: int, E: int, tile_m: int = GEMM_BM) -> int:
    """Row tiles the grouped GEMM launches: sum_e ceil(count_e / tile_m) <= ceil(n / tile_m) + min(E, n)."""
    return math.ceil(n / tile_m) + min(E, n)


def moe_tc_fits(D: int, inter: int, group: int) -> bool:
    """gemm_moe_tc's shape table for both expert GEMMs: each N a multiple of 256 (whole column tiles), each K of
    128 (its x chunks), the group a multiple of 128 (a chunk's scales and zeros are one group's)."""
    return D % 256 == 0 and inter % 256 == 0 and group % 128 == 0


def moe_tc_tile(n: int, E: int, st=None) -> int | None:
    """gemm_moe_tc's rows per tile for n routed rows over E experts, or None where gemm_moe_rs is taken (moe_tc);
    st: the tuning (default the active one)."""
    st = st or cfg.SETTINGS
    if st.moe_tc == "0" or n > st.moe_tc_max_mean * E:
        return None
    return 16 if n <= st.moe_tc_t16_max * E else 32


def moe_rs_fits(D: int, inter: int, group: int) -> bool:
    """gemm_moe_rs's shape table for both expert GEMMs: gate|up [D, 2 inter] and down [inter, D], each N a
    multiple of 256 (whole 32-word column tiles), each K of 64, group 64 << n."""
    return D % 256 == 0 and inter % 256 == 0 and _pow2_group(group)


def moe_rs_tile(n: int, E: int, st=None) -> int:
    """gemm_moe_rs's rows per tile for n routed rows over E experts (moe_rs_bt128_from; st: the tuning, default the
    active one)."""
    return 128 if n >= (st or cfg.SETTINGS).moe_rs_bt128_from * E else 64


def moe_gather(x, p2u, k: int, out=None):
    """xp [T*k, D] = x[p2u // k]: each expert's rows contiguous (moe.cu moe_gather_rows), for gemm_moe_rs."""
    n, D = p2u.size, x.shape[1]
    assert D % 8 == 0 and x.flags.c_contiguous
    out = _empty((n, D), cp.float16) if out is None else out
    kernel("moe", "moe_gather_rows")((n,), (128,), (x, p2u, out, _i(D), _i(k)))
    return out


def gemm_moe_rs(x, stack: AwqStack, offsets, tiles, bt: int, out=None):
    """One grouped GEMM over every expert (gemm_wgmma.cu gemm_moe_rs): x [n, K] in permuted row order (each
    expert's rows contiguous, offsets [E+1]; tiles [E+1] moe_maps' tile offsets for tile_m = bt) times each
    expert's [K, N] matrix -> out [n, N] in the same order."""
    n, K = x.shape
    E, N = stack.E, stack.scales.shape[-1]
    assert bt in MOE_RS_TILES and K % 64 == 0 and N % 256 == 0 and _pow2_group(stack.group_size)
    assert stack.qweight.shape[1] == K and x.strides[1] == 2 and x.strides[0] % 16 == 0
    out = _empty((n, N), cp.float16) if out is None else out
    st, wg = MOE_RS_FORMS[bt]
    fn = kernel("gemm90rs", moe_rs_name(st, bt, wg))
    smem = rs_smem_bytes(st, bt)
    allow_dynamic_smem(fn, smem)
    xmap = tma_map_2d(x, bt, 64)
    launch_ex(fn, (N // (64 * wg), _moe_grid_rows(n, E, bt)), (128 * wg,), (
        xmap, stack.qweight, stack.qzeros, stack.scales, _i(N), out, _i(K), _i(stack.group_size),
        _i(out.strides[0] // 2), offsets, tiles, _i(E), tma_map_words(stack.qweight, wg)), smem)
    return out


def gemm_moe_tc(x, stack: AwqStack, offsets, tiles, tm: int, out=None, p2u=None, k: int = 1):
    """One grouped GEMM over every expert (gemm_moe_tc.cu, few rows per expert): x [n, K] in permuted row order
    (each expert's rows contiguous, offsets [E+1]; tiles [E+1] moe_maps' tile offsets for tile_m = tm), or with
    p2u the [T, K] token rows, permuted row r reading token p2u[r] // k; times each expert's [K, N] matrix -> out
    [n, N] in permuted order."""
    n = x.shape[0] if p2u is None else p2u.size
    K = x.shape[1]
    E, N = stack.E, stack.scales.shape[-1]
    assert tm in MOE_TC_TILES and K % 128 == 0 and N % 256 == 0 and stack.group_size % 128 == 0
    assert stack.qweight.shape[1] == K and x.flags.c_contiguous
    out = _empty((n, N), cp.float16) if out is None else out
    assert out.strides[1] == 2 and out.strides[0] % 4 == 0
    kernel("moetc", f"gemm_moe_tc<{tm}, {int(p2u is not None)}>")((N // 256, _moe_grid_rows(n, E, tm)), (128,), (
        x, _NULL if p2u is None else p2u, _i(k), stack.qweight, stack.qzeros, stack.scales, _i(N), out, _i(K),
        _i(stack.group_size), _i(out.strides[0] // 2), offsets, tiles, _i(E)))
    return out


def moe_gemm_gate_up(x, w13: AwqStack, offsets, tiles, p2u, k: int, out=None):
    """Grouped GEMM1: x [T, D] gathered per expert through p2u, times each expert's [gate | up], SwiGLU
    in the epilogue -> act [T*k, I] in permuted row order."""
    T, K = x.shape
    N = w13.scales.shape[-1]
    n = T * k
    out = _empty((n, N // 2), cp.float16) if out is None else out
    kernel("gemm", "gemm_moe_gate_up")((N // 2 // (GEMM_BN // 2), _moe_grid_rows(n, w13.E)), (128,), (
        x, w13.qweight, w13.qzeros, w13.scales, out, offsets, tiles, p2u, _i(k), _i(w13.E), _i(N), _i(K),
        _i(w13.group_size)))
    return out


def moe_gemm_down(act, w2: AwqStack, offsets, tiles, out=None):
    """Grouped GEMM2: act [T*k, I] (permuted) times each expert's down weights -> y [T*k, D] (permuted)."""
    n, K = act.shape
    N = w2.scales.shape[-1]
    out = _empty((n, N), cp.float16) if out is None else out
    kernel("gemm", "gemm_moe_down")((math.ceil(N / GEMM_BN), _moe_grid_rows(n, w2.E)), (128,), (
        act, w2.qweight, w2.qzeros, w2.scales, out, offsets, tiles, _i(w2.E), _i(N), _i(K), _i(w2.group_size)))
    return out


def moe_finalize(y, u2p, weights, out=None):
    """Un-permute and weight: out [T, D] = sum_j weights[t, j] * y[u2p[t*k + j]]."""
    T, k = weights.shape
    D = y.shape[1]
    assert D % 8 == 0 and k <= 32 and y.flags.c_contiguous and u2p.size == T * k
    out = _empty((T, D), cp.float16) if out is None else out
    assert out.flags.c_contiguous
    kernel("moe", "moe_finalize")((T,), (256,), (y, u2p, weights, out, _i(D), _i(k)))
    return out


def moe_rs_path(w13: AwqStack, w2: AwqStack) -> bool:
    """Whether moe_experts takes gemm_moe_rs for these stacks (moe_rs, compute capability 9.0, moe_rs_fits)."""
    D, inter = w2.scales.shape[-1], w2.qweight.shape[1]
    return (cfg.SETTINGS.moe_rs != "0" and w13.group_size == w2.group_size and w13.scales.shape[-1] == 2 * inter
            and moe_rs_fits(D, inter, w2.group_size) and wgmma_available())


def moe_experts_tile(w13: AwqStack, w2: AwqStack, n: int, rs: bool | None = None) -> tuple[bool, int]:
    """(rs, tile rows) of moe_experts for n routed rows: whether it takes the Hopper path (rs, default moe_rs_path)
    and the rows per tile its expert maps are counted in: on that path gemm_moe_tc's (16 or 32, moe_tc_tile) where
    it serves, else gemm_moe_rs's (moe_rs_tile, 64 or 128); GEMM_BM on the mma.sync path."""
    if rs is None:
        rs = moe_rs_path(w13, w2)
    if not rs:
        return False, GEMM_BM
    tm = moe_tc_tile(n, w13.E) if moe_tc_fits(w2.scales.shape[-1], w2.qweight.shape[1], w2.group_size) else None
    return True, tm or moe_rs_tile(n, w13.E)


def moe_maps_arrays(n: int, E: int) -> tuple:
    """Output arrays for moe_maps of n picks over E experts: counts, offsets, tiles, p2u, u2p (int32)."""
    return tuple(_empty((m,), cp.int32) for m in (E, E + 1, E + 1, n, n))


def moe_experts(x, w13: AwqStack, w2: AwqStack, ids, weights, rs: bool | None = None, finalize: bool = True,
                maps=None):
    """Prefill's expert half: x [T, D] fp16 through each token's k experts (ids int32 [T, k], weights fp32
    [T, k]) and their weighted sum -> [T, D] fp16, every stage on the device. rs (default moe_rs_path):
    the expert maps in tiles of moe_rs_tile rows, the rows gathered per expert, gemm_moe_rs over gate|up,
    SwiGLU, gemm_moe_rs over down; otherwise gemm_w4a16.cu's grouped GEMMs (the gather in gate|up's A
    loads, SwiGLU in its epilogue). Then finalize; without it, (y [T*k, D] permuted, u2p, weights), which
    add_rmsnorm's experts argument sums. maps: moe_maps' arrays for ids, already built in the tiles of
    moe_experts_tile (moe_route's maps); otherwise moe_maps builds them here."""
    k = ids.shape[1]
    n = ids.size
    rs, bt = moe_experts_tile(w13, w2, n, rs)
    if maps is None:
        maps = moe_maps(ids, w13.E, tile_m=bt)
    _, offsets, tiles, p2u, u2p = maps
    if not rs:
        y = moe_gemm_down(moe_gemm_gate_up(x, w13, offsets, tiles, p2u, k), w2, offsets, tiles)
    else:  # [n, 2I] permuted: gate | up; gemm_moe_tc reads the token rows through p2u itself (no gathered copy)
        tc = bt in MOE_TC_TILES
        gu = (gemm_moe_tc(x, w13, offsets, tiles, bt, p2u=p2u, k=k) if tc
              else gemm_moe_rs(moe_gather(x, p2u, k), w13, offsets, tiles, bt))
        inter = gu.shape[1] // 2
        y = (gemm_moe_tc if tc else gemm_moe_rs)(silu_mul(gu, gu[:, inter:], inter, 2 * inter), w2, offsets, tiles, bt)
    return moe_finalize(y, u2p, weights) if finalize else (y, u2p, weights)


def moe_gate_up_views(w13: AwqStack) -> tuple[AwqLinear, AwqLinear]:
    """Expert 0's gate and up halves of a [gate | up] stack (tiled as two matrices) as views: zeros
    and scales are column views (row length 2I), the tiled qweights the two halves of the expert's
    words. The expert GEMV offsets them to the selected experts itself."""
    e0 = w13.expert(0)
    h, K = e0.N // 2, e0.K
    q = e0.qweight.reshape(-1)
    return (AwqLinear(q[:K * h // 8].reshape(K, h // 8), e0.qzeros[:, :h // 8], e0.scales[:, :h], w13.group_size),
            AwqLinear(q[K * h // 8:].reshape(K, h // 8), e0.qzeros[:, h // 8:], e0.scales[:, h:], w13.group_size))


def moe_decode(x, w13: AwqStack, w2: AwqStack, ids, weights, partial, act, out, resid=None, zero=None, acc=None):
    """One token through its k selected experts, ids and weights read on the device: the expert GEMV
    over gate|up with the SwiGLU epilogue, then over down with the weighted sum (finalize). out [1, D];
    with resid (fp32 [1, D]) the sum is added into it instead. zero: accumulators the gate/up GEMV
    clears (gemv's). acc=(gu, y): accumulating mode, no reduction tails: the slots' [gate | up] sums
    to gu (int64 [k, 2 * inter]), SwiGLU in the down GEMV's prologue, the weighted sum to y (int64
    [D]); act, out and resid unused."""
    gate, up = moe_gate_up_views(w13)
    if acc is not None:
        gu, y = acc
        gemv(x, [gate, up], "swiglu", None, partial, ids=ids, ld=2 * gate.N, zero=zero, acc_out=gu)
        gemv(None, [w2.expert(0)], "moe_sum", None, partial, ids=ids, slot_w=weights, pend=gu, acc_out=y,
             ids_early=True)
        return y
    gemv(x, [gate, up], "swiglu", act, partial, ids=ids, ld=2 * gate.N, zero=zero)
    gemv(act, [w2.expert(0)], "moe_sum", out, partial, ids=ids, slot_w=weights, x_slot_stride=gate.N, resid=resid,
         ids_early=True)  # the gate/up GEMV, not the router, is the kernel just before
    return out
