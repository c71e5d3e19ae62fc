"""CuPy backend: the same ops as ops_numpy, as cupy.RawModule kernels from kernels_cu/ (device queries, launches,
the kernel registry and its builds in kuiper_py/cuda/runtime; the tuning in kuiper_py/cuda/settings.py).

Activations are fp16 with an fp32 residual stream; weights stay AWQ-packed (4-bit) on the GPU.
Their qweight is rearranged once at load into the tiled layout of common.cuh (tile_qweight): the
same words, ordered so the decode GEMV reads whole contiguous spans. Decode (T = 1) runs on
preallocated buffers and allocates nothing per token.
"""
from __future__ import annotations

import ctypes
import math
import os
import sys
import weakref

import numpy as np

from .config import ModelArgs, rope_tables
from .cuda.settings import Settings
# the runtime layer (kuiper_py/cuda/runtime): what the ops below use, and the names cli.py, bench.py, generate.py, the
# tools and the tests import from this module
from .cuda.runtime.device import (_dev_id, check_device, copy_bandwidth, cuda_available, device_attrs, device_name,
                                  gpu_memory_used_mib, gpu_name, sm_count, smem_optin)
from .cuda.runtime.launch import (_LaunchAttr, _PdlKernel, _cluster_attr, _cluster_policy_attr, _cu_fn,
                                  _cu_launch_ex, _cu_occupancy_clusters, _cu_tmap_encode, _pdl_attr, _remember,
                                  allow_dynamic_smem, blocks_per_sm, launch_ex, pdl_enabled, resident_clusters,
                                  tma_map_2d, tma_map_cache, tma_map_words)
from .cuda.runtime.registry import (ATTN_CM_HB, ATTN_CM_MAX, FFN_GLOBAL_CAPS, FFN_PAIRS, FFN_XCH_GLOBAL,
                                    FFN_XCH_PUSH, FW_CONFIGS, FW_NC3_FROM, GEMV_O_MIN_BLOCKS, GEMV_ROWS,
                                    MOE_RS_FORMS, MOE_RS_FORMS_ALL, MOE_RS_TILES, MOE_TC_TILES, RS_STAGES,
                                    WGMMA_PRODUCERS, WGMMA_TILES, WGMMA_TILE_EFF, _FILES, _FILES_SM90, fw_name,
                                    gemv_name, moe_rs_name)
from .cuda.runtime.build import (MODULE_PARTS, SM90A_FAMILIES, _BUILDING, _compiled, _family_names, _kernel_group,
                                 _module, _module_keys, _usable_cpus, family_modules, headers_tag, kernel,
                                 kernel_build_seconds, kernel_dir, model_families, model_groups, precompile)
from .errors import KuiperError, ResourceError
from .loader import (AwqLinear, AwqStack, Layer, Weights, check_weights_fit, device_bytes, drop_pages,
                     kv_bytes_per_position)
from .sampling import SamplingParams

try:
    import cupy as cp
    from cupy_backends.cuda.libs import cublas as _cublas
except ImportError:  # pragma: no cover - CPU-only installs
    cp = _cublas = None

# The active tuning (cuda/settings.py): the defaults, or what the CupyOps being built was given (one backend per
# process); the functions below read it at each call.
SETTINGS = Settings()


def use_settings(settings: Settings) -> None:
    """Make `settings` the active tuning (CupyOps does at construction)."""
    global SETTINGS
    SETTINGS = settings

# the grid size the split aims at: 4 blocks per SM measured best on H100 with the tiled layout and
# the first loads ahead of pdl_wait (3 and 6 tried; 3 was best before). gemv_blocks_per_sm sets it
# on every GPU and shape; unset, a GEMV takes device_tables's target for its shape on this GPU, else
# GEMV_BASE_BLOCKS_PER_SM (gemv_blocks_per_sm)
GEMV_BASE_BLOCKS_PER_SM = 4.0
# a target below the base never takes a projection under min(gemv_min_splits, its splits at the base):
# 3 per SM would give Qwen3-32B's gate/up two splits of 2560 rows, 6.6% slower per step (change 83; with
# gemv_blocks_per_sm=3 on the H200, the floor's 3 x 1792 measured 2.6% faster, change 84)
# the o GEMV (its prologue merges flash decoding's partials) aims at 3 while flash decoding has at most
# GEMV_O_COARSE_SPLITS splits: since its blocks are spread over the SMs (change 82), a grid that does not
# fill every SM's registers lets the next kernel's blocks sit resident at their PDL wait with their first
# loads out (change 71's residency gap). Qwen3-8B's o then takes 16 splits of 256 rows instead of 32 of
# 128, two heads merged per block: 0.6% shorter steps at 512 and 8k (33 attention splits), 0.7% longer
# at 32k (65) with decode_merge, hence the bound (PERFORMANCE.md change 83); with gemv_merge_span (below)
# 1.3% shorter at 32k on the H100, so there the bound covers the 80 splits of a 40960-position cache
# (GEMV_O_MERGE_COARSE_SPLITS, change 121). The other projections stay at 4: 3 for all of them made
# Qwen3-32B's gate/up two splits of 2560 rows, 6.6% slower per step
GEMV_O_COARSE_SPLITS = 48
GEMV_O_MERGE_COARSE_SPLITS = 80
# split-K on the wave tail (gemm_wgmma.cu): the tiles of a partial last wave each split into up to
# this many K ranges, so that wave takes 1/split of the time (q|k|v at 512 rows: 192 tiles on 132
# SMs, 1.45 waves run as 2); 1 turns it off (A/B)
GEMV_STEP = 8 * GEMV_ROWS  # rows a block's 8 warps take per step: the split granularity
GEMV_COLS = 256
GEMV_EPI = {"plain": 0, "swiglu": 1, "moe_sum": 2, "qkv_rope": 3}
GEMM_BM, GEMM_BN = 64, 128  # the MoE grouped GEMM's tile (moe_maps' tile_m); dense prefill picks 64 or 128 rows
MOE_MAX_EXPERTS, MOE_MAX_TOPK = 256, 32  # moe.cu: 8 experts per lane of a warp; k slots kept by lanes
SUPPORTED_HEAD_DIMS = (64, 128)
# flash decoding's fewest keys per split (common.cuh decode_chunk; the kernels' own default below): device_tables's
# "attn_min_chunk" for the model's shape, else DECODE_MIN_CHUNK; attn_min_chunk sets it (A/B)
DECODE_MIN_CHUNK = 32
# the short-context regimes of flash decoding (attn_short; changes 116, 158): attn_short key counts ("512,1024"),
# "0" none, unset: device_tables's "attn_short" for the model's shape
# flash decoding's splits merged by their own cluster (attention.cu attn_decode_gqa CM) instead of in the o GEMV's
# prologue: "1" / "0" for every shape (A/B), unset: device_tables's "attn_cm"
# flash decoding's splits past ATTN_MMA_KEYS keys on tensor cores (attn_decode.cuh attn_split_mma_long), which
# needs a second 64-key tile buffer of dynamic shared memory; attn_mma_long=0: the scalar loop (A/B)
# flash-decoding split size at capacity, and the most blocks per SM the splits may take: the long path's
# blocks hold ~70 KB of shared memory (3 per SM), and its splits cost little arithmetic per key
ATTN_MMA_KEYS, ATTN_LONG_TILE = 64, 64  # attn_decode.cuh

# the one-token id that means "the id the last sample_launch drew", read by the step from device memory
SAMPLED_TOKEN = -1
# sampling.cu: a block's threads, the candidates its shared memory holds, and the logits each block of
# sample_token_mb scans. sample_mb=0 draws in one block (sample_token) always (A/B)
SMP_THREADS, SMP_CAND, SMP_CHUNK, SMP_MAX_BLOCKS = 1024, 4096, 16384, 256
# greedy decode's argmax rides inside the decode graph (lm_head's blocks, advance_position): no draw kernel per
# greedy step


def draw_plan(n_valid: int, p: SamplingParams) -> tuple[int, int] | None:
    """(blocks, candidates per block) of sample_token_mb for a draw over n_valid logits, or None for the
    one-block sample_token: top-k off or past the union's room (blocks x candidates <= SMP_CAND), or a
    vocabulary one block covers."""
    G = -(-n_valid // SMP_CHUNK)
    if not SETTINGS.sample_mb or G < 2:
        return None
    assert G <= SMP_MAX_BLOCKS, f"{n_valid} logits: more than {SMP_MAX_BLOCKS} sampling blocks"
    cap = min(SMP_CAND // G, SMP_THREADS)
    if p.temperature == 0 or 0 < p.top_k <= cap and p.top_k < n_valid:
        return G, cap
    return None


MOE_LOGIT_TB = 16  # moe.cu MOE_LOGIT_TB: tokens per block of moe_router_logits
# from this many tokens the prefill router's logits are an fp32 cuBLAS GEMM on fp32 copies of x and the router
# instead of moe_router_logits (PERFORMANCE.md change 168, H100 30B-A3B, routing per prefill: 2048 tokens 3.31-3.43
# against 5.13-5.14 ms; 512 tokens 1.71 against 1.70-1.74, and one run of each 512-token measure with the GEMM
# went 1.5x slower, so below 1024 tokens the kernel stays)
# "mma" (default): the logits on tensor cores with the top-k in the same launch (moe.cu moe_route_mma) where
# D % 32 == 0 and E <= 256; "cuda": moe_router_logits (or the fp32 cuBLAS GEMM from moe_router_gemm_min_t tokens)
# and moe_topk, as before PERFORMANCE.md change 181
# up to this many tokens moe_route_mma runs 16 warps per block (each over half of D's chunks), above it 8; 0: always 8.
# Unset: 16 x the SM count, while the 16-warp form's blocks (16 tokens each, one per SM by their shared memory) are
# one wave. H100 30B-A3B, GPU time per prefill, 16 against 8 warps: 512 tokens 18.27 / 18.68 ms, 1024 26.18 / 26.47,
# 2048 42.34 / 42.72 (128 blocks), 2560 52.28 / 52.01 (160 blocks), 4096 80.71 / 80.35 (PERFORMANCE.md changes 188-189)
# "1" (default): a MoE prefill layer's expert maps are built by moe_route_mma's last block (PERFORMANCE.md change
# 197); "0": by moe_expert_maps, a launch of its own after the routing (A/B)
# moe_route_mma's split form (PERFORMANCE.md change 198): "auto" splits D over up to moe_route_split_max blocks per
# 16-token tile while the grid stays one wave; an integer forces that many splits (1: none)


def moe_rmma_smem(warps: int) -> int:
    """moe_route_mma's dynamic shared memory: its cp.async stages, [warps][MOE_RMMA_ST 4][6 pieces][32 lanes] x 16 B."""
    return warps * 4 * 6 * 32 * 16


def moe_route_wide_t() -> int:
    """The most prompt tokens moe_route_mma runs its 16-warp form for (moe_route_wide_t)."""
    return SETTINGS.moe_route_wide_t if SETTINGS.moe_route_wide_t is not None else 16 * sm_count()


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
        key = (_dev_id(), wide)
        fits = _RMMA_FITS.get(key)
        if fits is None:
            fits = _RMMA_FITS[key] = moe_rmma_smem(16) + _compiled("moe", wide).shared_size_bytes <= smem_optin()
        if fits:
            return wide, 16
    return f"moe_route_mma<{ng}, {8 // ng}>", 8


def tile_qweight(q, segments: int = 1):
    """AWQ qweight [..., K, W] (int32, NumPy or CuPy) -> the tiled layout of common.cuh, same shape and
    words: 32-word column tiles one after another, each [K/4][tile width][4]. segments > 1 splits
    the columns into that many matrices first ([gate | up] expert stacks), each tiled on its own."""
    xp = cp.get_array_module(q) if cp is not None else np
    *lead, K, W = q.shape
    if segments > 1:
        q = xp.moveaxis(q.reshape(*lead, K, segments, W // segments), -2, -3)  # [..., seg, K, W/seg]
        return tile_qweight(q).reshape(*lead, K, W)
    assert K % 4 == 0
    Wf = W // 32 * 32
    n = len(lead)
    full = q[..., :Wf].reshape(*lead, K // 4, 4, Wf // 32, 32)
    parts = [xp.ascontiguousarray(full.transpose(*range(n), n + 2, n, n + 3, n + 1)).reshape(*lead, -1)]
    if W > Wf:  # a narrower last tile
        tail = q[..., Wf:].reshape(*lead, K // 4, 4, W - Wf)
        parts.append(xp.ascontiguousarray(tail.transpose(*range(n), n, n + 2, n + 1)).reshape(*lead, -1))
    return xp.concatenate(parts, axis=-1).reshape(*lead, K, W)


def device_linear(lin, segments: int = 1):
    """An AwqLinear or AwqStack copied to the GPU with its qweight tiled (what the kernels read)."""
    return type(lin)(tile_qweight(cp.asarray(lin.qweight), segments), cp.asarray(lin.qzeros),
                     cp.asarray(lin.scales), lin.group_size)


# A multi-token forward of at most this many tokens takes its activations from the CupyOps' _Arena instead of
# cupy.empty (PERFORMANCE.md change 194): short prefills are host-bound, and the ~18 allocations of a MoE layer were
# ~3.5 ms of a 512-token Qwen3-30B-A3B prefill's ~18 ms of enqueue on the H200. 0 turns it off (A/B). Longer
# prompts are GPU-bound, and their activations are large: they keep the pool, which reuses one layer's blocks
_ARENA = None  # the _Arena of the forward being enqueued (CupyOps.begin_step / end_step), or None


class _Arena:
    """Activation arrays of a short multi-token forward, kept from one forward to the next. A layer's n-th
    allocation gets slot (layer parity, n): the same array as two layers before, whose values that layer's
    own kernels and the next layer's first norm (the residual's input) have consumed in stream order
    before anything of this layer is enqueued. So nothing a layer produces is overwritten before it is
    read, provided that no value lives past the next layer, which holds for the model's loop (the
    residual stream h is not taken from here). A request of another shape or dtype replaces its slot."""

    def __init__(self):
        # (shape, dtype, array): the shape and dtype kept beside the array so a hit is a tuple compare and an
        # identity test, not reads of CuPy attributes on every allocation of the prefill path
        self.slots: dict[tuple[int, int], tuple] = {}
        self.half = self.seq = 0

    def begin_layer(self) -> None:
        self.half ^= 1
        self.seq = 0

    def take(self, shape: tuple, dtype):
        key = (self.half, self.seq)
        self.seq += 1
        hit = self.slots.get(key)
        if hit is not None and hit[0] == shape and hit[1] is dtype:
            return hit[2]
        a = cp.empty(shape, dtype)
        self.slots[key] = (shape, dtype, a)
        return a

    def clear(self) -> None:
        self.slots.clear()


# Prefill graphs (CupyOps.prefill_graph): a prompt of 2..prefill_graph_max_t tokens, at the cache's start or after
# earlier turns, runs, from the second time its length bucket is met, as one CUDA graph captured at the bucket's
# length (the prompt padded at its end), so the host enqueues one graph launch instead of ~7 kernel launches per
# layer. 0 turns them off.
# what a replay reads, in one device buffer the host fills before each (one copy): K's and V's cache maps of the
# prompt's keys at bytes 0 and 128 (64-byte aligned, for flash_attn_wgmma), the position at _PBUF_POS, the padded
# ids from _PBUF_IDS (PERFORMANCE.md change 207)
_PBUF_POS, _PBUF_IDS = 256, 260
# bumped whenever a module-level device buffer is replaced by a larger one (_dequant_scratch, _gemm_split_buffers):
# a graph captured before holds the old address, so it is dropped
_BUF_GEN = [0]


def prefill_bucket(T: int) -> int:
    """The length a T-token prefill graph runs at: T rounded up to a multiple of 16 up to 128 tokens, of 32 up to 256,
    of 64 beyond (16 graphs up to 512 tokens; at most 16, 32 or 64 rows of padding, 12% at most past 128 tokens)."""
    step = 16 if T <= 128 else 32 if T <= 256 else 64
    return -(-T // step) * step


class _NotCapturable(Exception):
    """A prefill met a call that a graph capture cannot hold (cuBLAS through CuPy): its bucket runs eagerly."""


_CAPTURING = [False]  # a prefill graph is being captured


class _ArenaFull(Exception):
    """A _BumpArena region is too small for this capture: grow it and capture again."""


class _BumpArena:
    """The activations of every prefill graph: two regions (layer parity, as _Arena's slots alternate), each
    handed out from its start again at each layer of its parity. Graphs replay one at a time on one stream and
    no value lives past the next layer (_Arena's rule), so all buckets share the same bytes. A request past a
    region's end raises _ArenaFull with the bytes that layer needs, so that the capture is retried after grow."""
    ALIGN = 512  # as CuPy's pool: every TMA and 16-byte access stays aligned

    def __init__(self):
        self.regions = [None, None]
        self.off = [0, 0]
        self.half = 0

    def size(self, h: int) -> int:
        return 0 if self.regions[h] is None else self.regions[h].nbytes

    def reset(self) -> None:
        self.off = [0, 0]
        self.half = 0

    def begin_layer(self) -> None:
        self.half ^= 1
        self.off[self.half] = 0

    def take(self, shape: tuple, dtype):
        h, o = self.half, self.off[self.half]
        n = -(-math.prod(shape) * np.dtype(dtype).itemsize // self.ALIGN) * self.ALIGN
        if o + n > self.size(h):
            raise _ArenaFull(h, o + n)
        self.off[h] = o + n
        return cp.ndarray(shape, dtype, memptr=self.regions[h].data + o)

    def grow(self, h: int, nbytes: int) -> None:
        """Region h a quarter above nbytes (the layer's later requests fit in most cases, so a capture meets few
        retries), rounded up to 2 MiB; the old region's bytes go back to the pool."""
        nbytes = -(-nbytes * 5 // 4 // (2 << 20)) * (2 << 20)
        self.regions[h] = None
        self.regions[h] = cp.empty((nbytes,), cp.uint8)


def _empty(shape: tuple, dtype):
    """cp.empty, or the active forward's arena slot (_ARENA): the prefill path's output arrays."""
    return cp.empty(shape, dtype) if _ARENA is None else _ARENA.take(shape, dtype)


_I32: dict[int, np.int32] = {}


def _i(v):
    """A kernel's int32 argument, refused (not wrapped) when it does not fit. The same sizes recur on every
    layer of every prefill: each value's np.int32 is made once (a dict hit costs a tenth of the check and the
    conversion, ~1800 times per 48-layer prefill)."""
    r = _I32.get(v)
    if r is None:
        if not -2**31 <= int(v) < 2**31:
            raise KuiperError(f"a kernel size argument ({v}) exceeds the int32 range; use a smaller --max-context")
        r = np.int32(v)
        if len(_I32) < 65536:
            _I32[v] = r
    return r


def _f(v):
    return np.float32(v)


_NULL = np.uint64(0)  # a null pointer argument


_COUNTERS: dict[int, object] = {}


# Launches whose blocks are spread evenly over the SMs (spread_smem): "attn" (flash decoding), "gemv"
# (the decode GEMVs). Not the one-launch FFN: its clusters need
# a free slot on 8 SMs of a GPC, and capping the slots left 8B's 48 clusters no room (+15% per step); its
# form without clusters caps itself by registers (ffn_global_plan)
_SPREAD: dict[tuple, int] = {}


def spread_smem(family: str, name: str, blocks: int, threads: int) -> int:
    """Dynamic shared memory (bytes, unused by the kernel) that lets at most ceil(blocks / SMs) blocks
    of kernel `name` of `family` sit on one SM, or 0 where its registers already do (or no size does). A
    grid of fewer blocks than the SMs could hold is otherwise placed where space frees first: flash
    decoding's 264 blocks landed on ~93 SMs, up to 4 per SM, beside idle ones (PERFORMANCE.md change
    82). Worked out once per (device, kernel, grid, block); a launch then costs one dict lookup."""
    key = (_dev_id(), family, name, blocks, threads)
    pad = _SPREAD.get(key)
    if pad is None:
        pad = _SPREAD[key] = _spread_smem(_compiled(family, name), blocks, threads)
    return pad


def _spread_smem(fn, blocks: int, threads: int) -> int:
    def fit(smem: int) -> int:
        return blocks_per_sm(fn, threads, smem)

    want = -(-blocks // sm_count())
    if fit(0) <= want:
        return 0
    a = device_attrs()
    per_sm, reserved = a["MaxSharedMemoryPerMultiprocessor"], a.get("ReservedSharedMemoryPerBlock", 1024)
    # want blocks of (static + reserved + pad) bytes fit on an SM, want + 1 do not
    pad = per_sm // (want + 1) + 1 - reserved - fn.shared_size_bytes
    if pad <= 0 or want * (fn.shared_size_bytes + reserved + pad) > per_sm:
        return 0
    allow_dynamic_smem(fn, pad)
    return pad if fit(pad) == want else 0


def device_tuning() -> dict:
    """The per-GPU table's entry for the current device ({} where none matches its name)."""
    name = device_name()
    return next((t for key, t in SETTINGS.device_tables.items() if key in name), {})


def _attn_shape(a: ModelArgs) -> tuple[int, int, int, int]:
    """device_tables's key for a model's attention settings: (hidden, heads, kv heads, head dim)."""
    return (a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim)


def attn_min_chunk(a: ModelArgs) -> int:
    """Flash decoding's fewest keys per split for this model on this GPU (attn_min_chunk)."""
    return SETTINGS.attn_min_chunk or device_tuning().get("attn_min_chunk", {}).get(_attn_shape(a), DECODE_MIN_CHUNK)


def _shape_switch(override: bool | None, key: str, a: ModelArgs) -> bool:
    """An on/off choice per attention shape: the setting where it is not None, else whether the per-GPU table's
    key lists this model's shape on this GPU."""
    if override is not None:
        return override
    return _attn_shape(a) in device_tuning().get(key, ())


def o_merge(a: ModelArgs) -> bool:
    """Whether the o GEMV may merge flash decoding's partials with gemv_merge_span (gemv_o_merge, else
    device_tables's "o_merge" for this model on this GPU)."""
    return _shape_switch(SETTINGS.gemv_o_merge, "o_merge", a)


def attn_cm(a: ModelArgs) -> bool:
    """Whether decode's flash decoding merges its splits in its clusters where it can (attn_cluster_merge; the
    short-context regime's graph, its splits capped at ATTN_CM_MAX): the attn_cm setting, else the per-GPU
    table's "attn_cm" for this model on this GPU."""
    return _shape_switch(SETTINGS.attn_cm, "attn_cm", a)


def attn_short(a: ModelArgs) -> tuple[int, ...]:
    """The key counts up to which flash decoding runs in a short-context regime (each a decode graph of its own
    whose grid holds only the splits its keys can use; PERFORMANCE.md changes 116, 158), ascending, () for
    none: the attn_short setting ((512, 1024); () none), else the per-GPU table's "attn_short" for this model on
    this GPU (an int or a tuple of ints)."""
    if SETTINGS.attn_short is not None:
        bounds = SETTINGS.attn_short
    else:
        bounds = device_tuning().get("attn_short", {}).get(_attn_shape(a), ())
        bounds = (bounds,) if isinstance(bounds, int) else bounds
    return tuple(sorted({int(b) for b in bounds} - {0}))


def decode_regime(bounds: tuple[int, ...], capacity: int, n_keys: int) -> int:
    """The flash-decoding regime (a decode graph of its own) that serves a step with n_keys keys, named by the most
    keys it serves: the first short-context bound (attn_short, ascending) at or above n_keys, else the capacity."""
    return next((b for b in bounds if n_keys <= b), capacity)


def decode_regimes(bounds: tuple[int, ...], capacity: int, keys: tuple[int, int] | None = None) -> list[int]:
    """The regimes that steps with keys[0]..keys[1] keys meet (every step of the cache where keys is None), ascending:
    those of both ends and each bound between them (past a bound, the next regime is the next bound's or hi's)."""
    lo, hi = (1, capacity) if keys is None else (max(1, keys[0]), min(keys[1], capacity))
    if lo > hi:
        return []
    return sorted({decode_regime(bounds, capacity, n) for n in (lo, hi, *(b for b in bounds if lo <= b < hi))})


def gemv_blocks_per_sm(K: int, tiles: int) -> float:
    """The target blocks per SM of a GEMV over K rows and `tiles` column tiles: gemv_blocks_per_sm,
    else device_tables's for this shape on this GPU, else GEMV_BASE_BLOCKS_PER_SM."""
    if SETTINGS.gemv_blocks_per_sm:
        return SETTINGS.gemv_blocks_per_sm
    return device_tuning().get("gemv_blocks_per_sm", {}).get((K, tiles * GEMV_COLS), GEMV_BASE_BLOCKS_PER_SM)


def _device_zeros(cache: dict, n: int):
    """cache's int32 [n] for the current device, zeroed when first made: the arrival counters kernels leave at zero."""
    dev = _dev_id()
    a = cache.get(dev)
    if a is None:
        # (inside a prefill graph's capture the memset would be captured, not run: _capture_prefill makes them first)
        assert not _CAPTURING[0], "a zeroed counter first made inside a graph capture"
        a = cache[dev] = cp.zeros((n,), cp.int32)
    return a


def gemv_counters():
    """The GEMV's arrival counters (zero between launches; each launch leaves them zero), per device."""
    return _device_zeros(_COUNTERS, 1 << 16)


def gemv_split(K: int, tiles: int, per_sm: float | None = None) -> tuple[int, int]:
    """(splits S, rows per split): about per_sm blocks per SM in one wave (default gemv_blocks_per_sm(K, tiles)),
    rows a multiple of GEMV_STEP; below GEMV_BASE_BLOCKS_PER_SM, never fewer than min(gemv_min_splits, the
    splits at the base). A smaller per_sm never gives more splits (gemv_partial_size relies on it)."""
    per_sm = per_sm or gemv_blocks_per_sm(K, tiles)
    want = max(1, round(per_sm * sm_count() / tiles))
    if per_sm < GEMV_BASE_BLOCKS_PER_SM:
        want = max(want, min(SETTINGS.gemv_min_splits, round(GEMV_BASE_BLOCKS_PER_SM * sm_count() / tiles)))
    rps = math.ceil(math.ceil(K / want) / GEMV_STEP) * GEMV_STEP
    return math.ceil(K / rps), rps


def o_split(K: int, tiles: int, attn_splits: int = 0, merge: bool = False) -> tuple[int, int]:
    """gemv_split for the o GEMV over flash decoding's attn_splits partials (gemv_o_blocks_per_sm up to
    GEMV_O_COARSE_SPLITS of them, GEMV_O_MERGE_COARSE_SPLITS with gemv_merge_span's merge); attn_splits 0:
    the coarsest split it may take (for checks that it fits)."""
    coarse = attn_splits <= (GEMV_O_MERGE_COARSE_SPLITS if merge else GEMV_O_COARSE_SPLITS)
    return gemv_split(K, tiles, min(SETTINGS.gemv_o_blocks_per_sm, gemv_blocks_per_sm(K, tiles)) if coarse else None)


def gemv_partial_size(K: int, ns: list[int], slots: int = 1) -> int:
    """Floats of partial sums a gemv over matrices of widths ns needs."""
    S, _ = gemv_split(K, slots * sum(math.ceil(n / GEMV_COLS) for n in ns))
    return slots * S * sum(ns)


GEMV_ATT_ROWS = 4096  # gemv_w4a16.cu: rows per split a block stages in shared memory (the merge prologue needs it)


def decode_acc_layout(D: int, G: int, E: int, qkv: int) -> tuple[int, dict[str, slice]]:
    """Accumulating decode's int64 accumulators in one buffer: [o | gate, up | router z | down | q, k, v]
    (D, G, E, D, qkv elements), the size and each part's slice; acc_o_gu and acc_d_qkv are the two
    halves cleared together. Every part but z starts 16-byte aligned (an even offset), since its
    consumers read it in pairs (the GEMV prologue's longlong2 loads, change 85): z is padded to even."""
    e = D + G + E + E % 2
    return e + D + qkv, {"acc_o": slice(0, D), "acc_gu": slice(D, D + G), "acc_z": slice(D + G, D + G + E),
                         "acc_d": slice(e, e + D), "acc_qkv": slice(e + D, e + D + qkv),
                         "acc_o_gu": slice(0, e), "acc_d_qkv": slice(e, e + D + qkv)}


def _mat_slots(mats) -> list:
    """Up to 3 matrices with the same K (q, k, v side by side) as the GEMV and GEMM kernels take them: qweight,
    qzeros, scales and N for each of 3 slots, an absent slot repeating the first's pointers with N = 0."""
    out = []
    for i in range(3):
        m = mats[i] if i < len(mats) else mats[0]
        out += [m.qweight, m.qzeros, m.scales, _i(m.N if i < len(mats) else 0)]
    return out


def gemv(x, mats: list[AwqLinear], out_kind: str, out, partial, *, ids=None, slot_w=None, ld: int = 0,
         x_slot_stride: int = 0, norm=None, resid=None, rope=None, att=None, ids_early: bool = False,
         acc_out=None, pend=None, hout=None, zero=None, ss_out=None, ss_in=None, router=None):
    """Decode projections sharing the input x [1, K] (or one x row per slot): split-K GEMV over up to
    three matrices with the reduction fused ("plain": out = [y0 | y1 | y2], "swiglu": out = silu(y0) * y1,
    "moe_sum": out = sum_j slot_w[j] * y_j). With ids [slots], the matrices are expert stacks' first
    experts (or column views of them, row length ld) and slot j uses expert ids[j].
    norm=(h, w, eps): the input is rmsnorm(h) * w (h fp32 [1, K]), computed in the kernel (x unused).
    resid=h: "plain" (one matrix) and "moe_sum" add fp16(y) into h (fp32 [1, N]) instead of writing out.
    "qkv_rope" (mats q, k, v; rope = dict(q_norm, k_norm, cos, sin, qout, kc, vc, pos0, pos_dev)): the
    per-head q/k RMSNorm, RoPE and KV-cache write of qk_norm_rope_store in the epilogue; out unused.
    att=_AttnParts (x None): the input is the flash-decoding merge of its partials, done in the prologue.
    ids_early: the ids were written before the kernel launched just before this one (decode's down
    projection: the router ran before the gate/up GEMV), so under PDL the kernel reads them and its
    first weights before waiting for its predecessor; never when the previous kernel writes them.
    Accumulating mode (decode, no split-K reduction tail): acc_out (int64 [slots, sum of N], zero) gets
    y added in fixed point by every block ("plain"; "swiglu" adds [gate | up], the consumer applies
    SwiGLU; "moe_sum": [N], the sum over the slots of slot_w[j] * y_j) and out is unused. pend (int64)
    is such an output still to be finished: with norm, the residual add h + fp16(pend) before the norm,
    the new row written to hout (h is not changed); without, the input is pend [slots, K] rounded to
    fp16, or silu(pend[:, :K]) * pend[:, K:] for pend [slots, 2K]. zero
    (int64): cleared after the PDL wait. ss_out (fp32, >= S; with norm and acc_out): the scaled norm,
    x = h * w with 1/rms left to the consumer, the splits' sums of squares stored there (returns S);
    ss_in=(ss, n, D, eps): pend came from such a GEMV, its sums are multiplied by that 1/rms first.
    router=(R, Rh, h, acc_z) (the MoE o projection: att, acc_out): more column tiles (R's columns over
    ceil(E / gemv_rt_cols) of them, then Rh's), x @ R + h @ Rh
    added into acc_z (int64 [E], fixed point) for fp16 R [K, E] and Rh [D, E] and the fp32 residual row h
    [1, D] (E <= 256, E % 8 == 0)."""
    K, g = mats[0].K, mats[0].group_size
    slots = 1 if ids is None else ids.size
    tiles = sum(math.ceil(m.N / GEMV_COLS) for m in mats)
    null = np.uint64(0)
    rt_args = (null, null, null, _i(0), _i(0), null)
    if router is not None:
        R, Rh, h_row, acc_z = router
        E = R.shape[1]
        assert att is not None and acc_out is not None and slots == 1 and out_kind == "plain"
        assert R.shape[0] == K and E <= 256 and E % 8 == 0 and R.dtype == Rh.dtype == cp.float16
        assert Rh.shape == (h_row.size, E) and h_row.dtype == cp.float32 and R.flags.c_contiguous
        assert acc_z.dtype == cp.int64 and acc_z.size == E and Rh.flags.c_contiguous
        rt_args = (R, Rh, h_row, _i(h_row.size), _i(E), acc_z)
        # R's columns over ceil(E / gemv_rt_cols) tiles (gemv_rt_tile), then Rh's tile (gemv_rt_h_tile)
        tiles += (math.ceil(E / max(8, SETTINGS.gemv_rt_cols)) if SETTINGS.gemv_rt_cols > 0 else 1) + 1
    moe2 = out_kind == "moe_sum"
    S, rps = (gemv_split(K, slots * tiles, SETTINGS.gemv_moe_blocks_per_sm) if moe2 else
              o_split(K, tiles, att.splits, att.o_merge) if att is not None else gemv_split(K, slots * tiles))
    n_total = sum(m.N for m in mats)
    assert slots * S * n_total <= partial.size and all(m.K == K for m in mats)
    assert slots * tiles + tiles <= gemv_counters().size
    assert out_kind != "swiglu" or (len(mats) == 2 and mats[0].N == mats[1].N)
    assert resid is None or (out_kind == "moe_sum" or (len(mats) == 1 and slots == 1)) and resid.size == mats[0].N
    # the prologue's vector loads (change 85): the row and hout by 16 bytes, the norm weight by 8
    assert norm is None or (norm[0].size == K and x_slot_stride == 0 and norm[0].data.ptr % 16 == 0
                            and norm[1].data.ptr % 8 == 0 and (hout is None or hout.data.ptr % 16 == 0))
    hn, wn, eps = norm if norm is not None else (np.uint64(0), np.uint64(0), 0.0)
    if acc_out is not None:
        assert resid is None and acc_out.dtype == cp.int64
        if out_kind == "moe_sum":  # sum over the slots of slot_w[j] * y_j
            assert ids is not None and acc_out.size == n_total
        else:
            assert out_kind in ("plain", "swiglu") and acc_out.size == slots * n_total
    if pend is not None:
        # the input staged in shared memory, read by 16-byte loads
        assert pend.dtype == cp.int64 and pend.data.ptr % 16 == 0 and rps <= GEMV_ATT_ROWS and att is None
        if norm is not None:
            assert pend.size == K and hout is not None and hout.size == K and slots == 1
        else:
            assert x is None and x_slot_stride == 0 and pend.size in (slots * K, slots * 2 * K)
            x = pend
    assert hout is None or pend is not None
    assert ss_out is None or (norm is not None and acc_out is not None and ss_out.size >= S)
    assert ss_in is None or (pend is not None and norm is None)
    ss_args = (ss_out if ss_out is not None else null, *((ss_in[0], _i(ss_in[1]), _i(ss_in[2])) if ss_in else
                                                          (null, _i(0), _i(0))),
               _i(pend is not None and norm is None and pend.size == slots * 2 * K))
    if ss_in is not None:
        eps = ss_in[3]
    att_args = (null, null, _i(0), _i(0))
    if att is not None:
        assert x is None and norm is None and slots == 1 and out_kind == "plain" and K == att.heads * att.hd
        assert rps <= GEMV_ATT_ROWS
        if att.merged is not None:  # merged by flash decoding's clusters: a plain row
            x = att.merged
        else:
            att_args = (att.part_o, att.part_ml, _i(att.splits), _i(att.min_chunk))
            x = att.part_o
    x = hn if x is None else x
    if out_kind == "qkv_rope":
        r = rope
        KV, hd = r["kc"].shape[1], r["kc"].shape[2]
        assert len(mats) == 3 and slots == 1 and GEMV_COLS % hd == 0 and r["qout"].size == mats[0].N
        assert mats[1].N == mats[2].N == KV * hd and mats[0].N % hd == 0
        eps = r["eps"]
        rope_args = (r["q_norm"], r["k_norm"], r["cos"], r["sin"], r["qout"], r["kc"], r["vc"], _i(KV), _i(hd),
                     _i(r["pos0"]), r["pos_dev"] if r["pos_dev"] is not None else null)
    elif att is not None and att.merged is None:  # the merge prologue reads the head size and the position here
        rope_args = (null,) * 7 + (_i(0), _i(att.hd), _i(att.n_keys - 1), att.pos_dev if att.pos_dev is not None else null)
    else:
        rope_args = (null,) * 7 + (_i(0), _i(0), _i(0), null)
    flat = _mat_slots(mats)
    om = (att is not None and att.merged is None and att.o_merge and att.splits > SETTINGS.gemv_o_merge_min_splits
          and math.ceil(tiles * S / sm_count()) <= GEMV_O_MIN_BLOCKS)
    # accumulating launches take the ACC instantiations, which hold no split-K tail code (PERFORMANCE.md change 146)
    name = gemv_name(moe2, router is not None, om, acc_out is not None and not moe2)
    pad = spread_smem("gemv", name, tiles * S * slots, 256)
    kernel("gemv", name)((tiles, S, slots), (256,), (
        x, _i(x_slot_stride), hn, wn, _f(eps), *flat, _i(len(mats)), _i(ld), ids if ids is not None else np.uint64(0),
        partial, gemv_counters(), out if out is not None else np.uint64(0), slot_w if slot_w is not None else np.uint64(0),
        resid if resid is not None else np.uint64(0), *rope_args, *att_args, _i(K), _i(rps), _i(g),
        _i(GEMV_EPI[out_kind]), _i(ids_early), acc_out if acc_out is not None else null,
        pend if pend is not None else null, hout if hout is not None else null,
        zero if zero is not None else null, _i(zero.size if zero is not None else 0), *ss_args, *rt_args),
        shared_mem=pad)
    return S if ss_out is not None else out


_DEQ: dict[int, object] = {}


def _dequant_scratch(n: int):
    """The fp16 matrix the large-M path dequantizes into: one per device, grown to the largest
    projection group met (100 MB at 8B). Every use is ordered on one stream, so reuse is safe."""
    dev = _dev_id()
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
    out = _dequant_scratch(m.K * m.N).reshape(m.K, m.N) if out is None else out
    assert out.shape == (m.K, m.N) and out.strides[1] == 2 and out.strides[0] % 16 == 0
    kernel("gemm", "awq_dequant")((_dequant_blocks(m.N, m.K),), (256,), (m.qweight, m.qzeros, m.scales, out,
                                                                         _i(m.N), _i(m.K), _i(m.group_size),
                                                                         _i(out.strides[0] // 2)))
    return out


def awq_dequant3(mats, out):
    """One to three device AwqLinears with one K and group size (q, k and v) dequantized side by side into out
    [K, sum of N] (a row-major matrix or a column slice of a wider one) by one launch of awq_dequant3: what
    awq_dequant writes for each, in one launch instead of one per matrix (PERFORMANCE.md change 230)."""
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
    dev = _dev_id()
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
    dev = _dev_id()
    if dev not in _WGMMA_OK:
        _WGMMA_OK[dev] = (int(cp.cuda.Device().compute_capability) == 90 and _cu_tmap_encode() is not None
                          and _cu_launch_ex() is not None)
    return _WGMMA_OK[dev]


def _pow2_group(group: int) -> bool:
    """gemm_wgmma.cu's group sizes: 64 << n (a K tile's group index is a shift)."""
    return group >= 64 and group & (group - 1) == 0


def wgmma_fits(mats) -> bool:
    """gemm_wgmma.cu's shape table: up to 3 matrices with one K, K % 64, N % 256, group a power of two >= 64."""
    return len(mats) <= 3 and all(m.K == mats[0].K and m.K % 64 == 0 and m.N % 256 == 0 and _pow2_group(m.group_size)
                                  and m.group_size == mats[0].group_size for m in mats)


def wgmma_max_m(K: int, N: int) -> int:
    """Most rows for which the default path takes the fused wgmma GEMM (PERFORMANCE.md change 56;
    H100, TFLOP/s at 128 / 256 / 512 rows, fused vs dequant + cuBLAS): 8B q|k|v 206 / 263 / 323 vs
    103 / 191 / 351-413, gate 266 / 319 / 351 vs 141 / 276 / 425, down 290 / 346 / 373-383 vs
    138 / 257 / 428-440; 8B o 188 / 276 / 324-352 vs 65 / 133 / 261-405 (dequant + cuBLAS pays for
    writing back an fp16 matrix that fits in L2, change 54), 30B-A3B q|k|v 155 / 161 / 240 vs 42 /
    87 / 166, o 128 / 198 / 280 vs 33 / 68 / 130. So: matrices up to 4096 x 4096 to 512 rows, larger
    ones to 256; at 2048 rows dequant + cuBLAS wins everywhere (580-640 vs 320-370)."""
    return 512 if K * N <= 4096 * 4096 else 256


def rs_range(K: int, N: int) -> tuple[int, int]:
    """The rows (least, most) for which the default path takes gemm_w4a16_rs (PERFORMANCE.md change 167;
    H200 TFLOP/s, rs as rs_choose plans it against the better of the other two paths): 8B q|k|v at 256 /
    384 / 512 rows 328 / 315 / 423 vs 285 / 300 / 370, o 315 / 329 / 437 vs 297 / 315 / 448 (the kernel
    above, which took o to 512 rows, 373), gate|up 440 / 424 / 539 vs 364 / 416 / 479, down 463 / 407 / 506
    vs 375 / 363 / 490; 30B-A3B q|k|v at 256 / 512 / 768 242 / 333 / 494 vs 175 / 268 / 324 (dequant +
    cuBLAS, the path at 768 before, 233), o at 384 / 512 / 768 239 / 317 / 330 vs 226 / 298 / 329. At 768
    rows dequant + cuBLAS wins at 8B o, gate|up and down (503-544 vs 421-480; q|k|v: 338 vs 344 and the
    kernel above's 356), and the kernel above at 128 rows (and for N < 4096, 30B-A3B o, at 256: 211 vs
    177). So: from 256 rows (384 for N < 4096) to 512 for matrices from 4096 x 4096, to 768 for smaller
    ones. The H100 agrees (change 167) but for 30B-A3B at 384 rows, 3% behind the kernel above.
    Change 227 (H200, after change 204 made rs's dequantization cheaper): below 256 rows rs is now the faster too, 8B
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
# 256 rows by 256-token blocks, the rest by a second launch of 64-token blocks (PERFORMANCE.md change 206; 0: one
# launch whatever the rows)
RS_ROWS_SPLIT_KN = 3 * 4096 * 4096


def rs_rows_split(T: int, K: int, N: int) -> int:
    """The rows of gemm()'s first rs launch where it splits a prompt's rows in two, else 0. Why: gemm_w4a16_rs's
    blocks pass over their weights at the same pace whatever their tokens (a ragged last tile whose wgmmas cover
    only its rows was as slow, change 206), so 257-320 rows in 256-token blocks cost the GPU two full passes; one
    pass of 256 tokens, then 64-token blocks of 256 channels (half the blocks per pass) cost less where the
    matrix's passes are long (H200, Qwen3-8B gate|up at 288 rows 161 against 209 µs, down 83 against 91; q|k|v
    and o gain nothing). The whole 8B prefill: -15% at 257 tokens, -10% at 320, +6% at 352 (the bound)."""
    return 256 if 256 < T <= SETTINGS.rs_rows_split_max and K * N >= RS_ROWS_SPLIT_KN else 0


_MATS: dict[tuple, list] = {}


def _mats_rec(mats) -> list:
    """[shape signature, kernel arguments or None] of a projection's matrices, kept by their ids until one of them
    is collected (a finalizer drops the entry then, before its id can be reused; a model's weights are not kept
    alive by this cache): the signature ((K, N) of each, group size, whether gemm_wgmma.cu's shape table takes
    them) keys what depends only on shapes, the prompt's path and launch plan, so that a prompt length not seen
    before plans each projection shape once, not once per layer (PERFORMANCE.md change 196); the arguments
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


def gemm_path(T: int, mats) -> str:
    """The prefill path gemm() takes for T rows of the matrices mats: "rs" or "wgmma" (the two fused
    Hopper GEMMs), "dequant" (cuBLAS) or "mma". Kept per (rows, the matrices' shape signature, the settings it
    reads): every prefill layer asks again."""
    sig = _mats_rec(mats)[0]
    key = (T, sig, SETTINGS.gemm_rs, SETTINGS.gemm_wgmma, SETTINGS.gemm_wgmma_min_m, SETTINGS.gemm_dequant_min_m, cublas_ready(), _dev_id())
    path = _GEMM_PATHS.get(key)
    if path is None:
        K, N = sig[0][0][0], sum(n for _, n in sig[0])
        hopper = wgmma_available() and sig[2]  # the two fused kernels share a shape table
        lo, hi = rs_range(K, N)
        rs = SETTINGS.gemm_rs != "0" and hopper and (SETTINGS.gemm_rs == "1" or lo <= T <= hi)
        fused = (SETTINGS.gemm_wgmma != "0" and T >= SETTINGS.gemm_wgmma_min_m and hopper
                 and (SETTINGS.gemm_wgmma == "1" or T <= wgmma_max_m(K, N)))
        path = ("rs" if rs else "wgmma" if fused else "dequant" if T >= SETTINGS.gemm_dequant_min_m and cublas_ready()
                else "mma")
        path = _remember(_GEMM_PATHS, key, path)
    return path


def wgmma_plan(T: int, N: int, K: int) -> tuple[int, int, int, int]:
    """(BM, BN, n_full, split) for T rows and N columns: the tile with the least time counted in
    waves of blocks over the SMs, each wave costing its tile's area over its relative throughput
    (64-row tiles win when 128-row ones leave most SMs idle: o and down at 128-256 rows). The tiles
    of a partial last wave split their K tiles split ways (up to wgmma_split_max, at least 8 K tiles
    each), so that wave costs 1/split; n_full tiles run whole."""
    sms, best = sm_count(), None
    tiles_ok = [SETTINGS.gemm_wgmma_tile] if SETTINGS.gemm_wgmma_tile else list(WGMMA_TILES)
    for bm, bn in tiles_ok:
        tiles = math.ceil(T / bm) * (N // bn)
        waves, tail = divmod(tiles, sms)
        split = max(1, min(SETTINGS.wgmma_split_max, sms // tail, K // 64 // 8)) if tail else 1
        cost = (waves + (1 / split if tail else 0)) * bm * bn / WGMMA_TILE_EFF[(bm, bn)]  # in tile units
        if best is None or cost < best[0]:
            best = (cost, (bm, bn, tiles - tail if split > 1 else tiles, split))
    return best[1]


_GEMM_SPLIT: dict[int, object] = {}
_GEMM_TICKETS: dict[int, object] = {}


def _gemm_split_buffers(n_part: int):
    """(partial sums, tickets) of gemm_wgmma.cu's split tiles, per device: the fp32 partials grown as needed, the
    tickets zero between launches. Every use is ordered on one stream, so reuse is safe."""
    dev = _dev_id()
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
    return _tma_gemm(_WGMMA_CALLS, x, mats, out, (tile, plan, producers),
                     lambda: _wgmma_call(x, mats, out, tile, plan, producers))


def _tma_gemm(cache: dict, x, mats, out, settings: tuple, build):
    """Launch one of gemm_wgmma.cu's fused GEMMs from its plan in cache, keyed by (the matrices' shape
    signature, x's and out's shapes and strides, settings, device), so every layer's projection of one shape
    shares it; build() makes the plan on a miss: (kernel, grid, block, shared memory, rows per TMA box of x,
    the arguments after out). The matrices' own arguments come from _mats_rec; x's descriptor and out are
    per call."""
    mrec = _mats_rec(mats)
    if mrec[1] is None:
        mrec[1] = tuple(_mat_slots(mats))
    key = (mrec[0], x.shape, x.strides, out.shape, out.strides, settings, _dev_id())
    rec = cache.get(key)
    if rec is None:
        rec = _remember(cache, key, build())
    fn, grid, block, smem, rows, tail = rec
    launch_ex(fn, grid, block, (tma_map_2d(x, rows, 64), *mrec[1], out, *tail), smem)
    return out


RS_PART_COST = 14  # K tiles: what one more K range of a tile costs gemm_w4a16_rs (fit to change 165's splits)
# a 128-token block's throughput relative to a 256-token one (the same area: 256 x 128 channels); H200,
# 2048 rows, split 1, change 167's probe: 0.77-0.84 over the 8B and 30B-A3B shapes
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
    with the least rs_cost (ties to the smaller split). Change 165's fit: o and down at 512 rows (64 tiles)
    split 2, at 256 rows split 4; q|k|v at 512 (96 tiles) stays whole. Change 167: with 256 tokens the
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
    """The register-A wgmma GEMM (gemm_wgmma.cu gemm_w4a16_rs, PERFORMANCE.md changes 164-167; gemm()'s "rs"
    path): up to 3 matrices with the same K (each N % 256 == 0), side by side in out; bt tokens per block
    (64, 128, or 256 with blocks of 128 channels); each tile's K cut into split ranges. By default
    rs_choose's bt and split (with bt given, rs_plan's split). As gemm_wgmma, everything but x's descriptor
    is worked out once per (matrices, shapes, strides, bt, split) and kept."""
    return _tma_gemm(_RS_CALLS, x, mats, out, (bt, split), lambda: _rs_call(x, mats, out, bt, split))


def _rs_call(x, mats, out, bt, split) -> tuple:
    """gemm_rs's launch plan for these shapes, laid out as _wgmma_call's."""
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
    part, ticket = _gemm_split_buffers(tiles * split * bt // 2 * (2 * bc) if split > 1 else 0)  # bt / 2 per thread
    assert split == 1 or tiles <= ticket.size
    fn = kernel("gemm90rs", f"gemm_w4a16_rs<{st}, {bt}>")
    smem = rs_smem_bytes(st, bt)
    allow_dynamic_smem(fn, smem)
    tail = (_i(T), _i(K), _i(mats[0].group_size), _i(out.strides[0] // 2), _i(split), part, ticket)
    # a warpgroup per 64 channels (the kernel traps on another block size)
    return fn, (math.ceil(T / bt), N // bc, split), (2 * bc,), smem, bt, tail


def _wgmma_call(x, mats, out, tile, plan, producers) -> tuple:
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
    part, ticket = _gemm_split_buffers(n_split * split * bm * bn)
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
        W = _dequant_scratch(K * N).reshape(K, N)
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
    """silu(x W1) * (x W3) for x [T, K] fp16 -> [T, I] fp16. On the fused wgmma and rs paths gate and up are
    one launch ([T, 2I], as q|k|v are); the dequant path multiplies them one at a time (its scratch
    holds one matrix)."""
    T, I = x.shape[0], w1.N
    path = gemm_path(T, (w1, w3))
    if path in ("wgmma", "rs"):
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


# prefill attention on attn_wgmma.cu's wgmma kernel where it runs ("auto"); "0": attention.cu's mma.sync kernel


def attn_wgmma_fits(hd: int) -> bool:
    """flash_attn_wgmma's table: head dim 128 on compute capability 9.0 (attn_wgmma not "0")."""
    return SETTINGS.attn_wgmma != "0" and hd == 128 and wgmma_available()


def fw_smem_bytes(st: int, nc: int) -> int:
    """FwSmem<st, nc>::bytes of attn_wgmma.cu (flash_attn_wgmma traps on less)."""
    return 2 * nc * 8192 + st * 4 * 8192 + 8 * (1 + 3 * st) + 1024


def attention_prefill(q, kc, vc, pos0: int, n_kv_heads: int, out=None, path: str | None = None, layer: int = 0,
                      pos_dev=None, kvmaps=None):
    """Causal flash attention. q [T, H, hd] at positions pos0.., kc/vc one layer's cache [ctx, KV, hd] or every
    layer's [L, ctx, KV, hd] with the layer to read -> [T, H*hd]. path: "wgmma" (attn_wgmma.cu) or "mma"
    (attention.cu); by default wgmma where attn_wgmma_fits. pos_dev (int32 [1]): the kernels read pos0 there
    instead (a prefill graph), and the wgmma kernel then reads K's and V's maps (tma_map_cache of pos0 + T keys)
    from kvmaps (uint8 [256], 64-byte aligned), both written before each replay."""
    T, H, hd = q.shape
    out = _empty((T, H * hd), cp.float16) if out is None else out
    if path is None:
        path = "wgmma" if attn_wgmma_fits(hd) else "mma"
    if kc.ndim == 3:  # one layer's cache: layer 0 of a one-layer stack
        kc, vc = kc[None], vc[None]
    null = np.uint64(0)
    if path == "wgmma":
        KV, n = n_kv_heads, pos0 + T
        if pos_dev is not None:  # the launch's own maps are not read: any valid ones (the whole capacity)
            assert kvmaps is not None and kvmaps.nbytes >= 256 and kvmaps.data.ptr % 64 == 0
            n = kc.shape[1]
        assert hd == 128 and H % KV == 0 and kc.shape[2:] == (KV, hd) and kc.shape[1] >= n and vc.shape == kc.shape
        assert 0 <= layer < kc.shape[0] and q.flags.c_contiguous and out.flags.c_contiguous and out.shape == (T, H * hd)
        cfg = SETTINGS.fw_config or ((4, 2, 3) if T >= FW_NC3_FROM else (4, 1, 2))
        if cfg not in FW_CONFIGS:
            forms = " ".join(",".join(map(str, c)) for c in FW_CONFIGS)
            raise KuiperError(f"fw_config {','.join(map(str, cfg))} is not a compiled form of flash_attn_wgmma "
                              f"(stages,pipe,warpgroups: {forms})")
        st, pipe, nc = cfg
        fn = kernel("attn90", fw_name(st, pipe, nc))
        smem = fw_smem_bytes(st, nc)
        allow_dynamic_smem(fn, smem)
        threads = 288 if nc == 2 else 128 * (nc + 1)  # attn_wgmma.cu FW_THREADS(nc)
        launch_ex(fn, (math.ceil(T / (64 * nc)), H), (threads,), (
            tma_map_2d(q.reshape(T, H * hd), 64, 64), tma_map_cache(kc, n), tma_map_cache(vc, n), out, _i(T),
            _i(pos0), _i(H), _i(KV), _i(layer), _f(math.log2(math.e) / math.sqrt(hd)),
            null if pos_dev is None else pos_dev, null if pos_dev is None else kvmaps), smem)
        return out
    fn = kernel("attn", f"flash_attn_prefill<{hd}>")
    smem = 512 * (hd + 8)  # attention.cu FaSmem<hd>: two stages of 64 K and 64 V rows of hd + 8 halves
    allow_dynamic_smem(fn, smem)
    fn((math.ceil(T / 64), H), (128,), (q, kc[layer], vc[layer], out, _i(T), _i(pos0), _i(H), _i(n_kv_heads),
                                        _f(math.log2(math.e) / math.sqrt(hd)),
                                        null if pos_dev is None else pos_dev), shared_mem=smem)
    return out


def decode_heads_per_block(n_heads: int, n_kv_heads: int) -> int:
    """Query heads one flash-decoding block serves (attention.cu attn_decode_gqa): the largest
    divisor of the GQA group up to attn_max_heads_per_block (registers), or the whole group when it
    is at most 8 and has no divisor in 2..that limit (groups of 5 or 7)."""
    G = n_heads // n_kv_heads
    best = max(d for d in range(1, min(G, SETTINGS.attn_max_heads_per_block) + 1) if G % d == 0)
    return G if best == 1 and G <= 8 else best


def attn_long_smem(hd: int) -> int:
    """Bytes of the long tensor-core path's second tile buffer (attn_decode_gqa's dynamic shared memory)."""
    return ATTN_LONG_TILE * (2 * hd // 8 + 1) * 16


def attention_decode(q, kc, vc, n_keys: int, n_kv_heads: int, max_splits: int, part_o, part_ml, out,
                     pos_dev=None, finish=None, min_chunk: int = DECODE_MIN_CHUNK, o_merge: bool = False,
                     max_keys: int = 0, merged=None):
    """Flash-decoding for one query q [1, H, hd] over n_keys cached positions -> out [1, H*hd].
    With pos_dev (graph replay) the length is read on the device and all max_splits splits run.
    out=None: the partials are left unmerged and returned as _AttnParts (for the o GEMV's prologue).
    finish=dict(acc, q_norm, k_norm, cos, sin, eps[, ss=(ss, n, D)]): q|k|v are the q|k|v GEMV's
    fixed-point sums acc (its accumulating mode; ss: its scaled norm's split sums of squares); the
    kernel does the q/k norm and RoPE, writing the rotated q into q and the newest key's K and V
    rows (position n_keys - 1) into the cache. A split takes at least min_chunk keys (decode_chunk): the
    splits past the keys present exit, and whoever merges reads only those that held keys. o_merge: the o
    GEMV that takes the returned partials may merge them with gemv_merge_span (see o_merge()). max_keys: the
    most keys a replay of this launch may see (with pos_dev; else n_keys): where a split can then pass
    ATTN_MMA_KEYS keys, the launch gets the long tensor-core path's tile buffer. merged (fp16 [1, H*hd], with
    out None): where attn_cluster_merge allows the launch and its clusters can be resident, the splits of each
    head group run as one thread-block cluster that merges them itself into merged, and the returned
    _AttnParts carries it (the o GEMV then stages it as a plain row); elsewhere it is ignored."""
    _, H, hd = q.shape
    assert min_chunk >= 1
    S = max_splits if pos_dev is not None else max(1, min(max_splits, math.ceil(n_keys / min_chunk)))
    assert H * S * hd <= part_o.size
    hb = decode_heads_per_block(H, n_kv_heads)
    pos_arg = pos_dev if pos_dev is not None else np.uint64(0)
    null = np.uint64(0)
    f = finish
    fin = (null, null, null, null, null, _f(0.0)) if f is None else (f["acc"], f["q_norm"], f["k_norm"], f["cos"],
                                                                      f["sin"], _f(f["eps"]))
    fin += (null, _i(0), _i(0)) if f is None or "ss" not in f else (f["ss"][0], _i(f["ss"][1]), _i(f["ss"][2]))
    assert f is None or f["acc"].dtype == cp.int64 and f["acc"].size == (H + 2 * n_kv_heads) * hd
    most = max(max_keys, n_keys) if pos_dev is not None else n_keys
    long_path = SETTINGS.attn_mma_long and f is not None and max(-(-most // S), min_chunk) > ATTN_MMA_KEYS
    args = (q, kc, vc, part_o, part_ml, _i(n_keys), pos_arg, _i(H), _i(n_kv_heads),
            _f(math.log2(math.e) / math.sqrt(hd)), *fin, _i(min_chunk))
    grid_cm = (S, n_kv_heads, H // n_kv_heads // hb)
    fn_cm = (_attn_cm_fn(f"attn_decode_gqa<{hd},{hb},false,true>", S, grid_cm[1] * grid_cm[2])
             if merged is not None and out is None and not long_path and attn_cluster_merge(S, hb, hd) else None)
    if fn_cm is not None:
        assert merged.dtype == cp.float16 and merged.size == H * hd
        launch_ex(fn_cm, grid_cm, (128,), args + (merged,), attr=_cluster_launch_attrs(S))
        return _AttnParts(part_o, part_ml, S, H, hd, n_keys, pos_dev, min_chunk, o_merge, merged=merged)
    name = f"attn_decode_gqa<{hd},{hb}{',true' if long_path else ''}>"
    grid = (n_kv_heads, H // n_kv_heads // hb, S)
    pad = spread_smem("attn", name, grid[0] * grid[1] * S, 128)
    if long_path:
        pad = max(pad, attn_long_smem(hd))
        allow_dynamic_smem(_compiled("attn", name), pad)
    kernel("attn", name)(grid, (128,), args + (np.uint64(0),), shared_mem=pad)
    parts = _AttnParts(part_o, part_ml, S, H, hd, n_keys, pos_dev, min_chunk, o_merge)
    return parts if out is None else attention_combine(parts, out)


def attn_cluster_merge(S: int, hb: int, hd: int) -> bool:
    """Whether a flash-decoding launch of S splits of hb heads of hd dims can merge in its clusters: sm_90 with
    PDL, an instantiation for hb, at most ATTN_CM_MAX splits, and each block's share of the head group's
    elements a whole number of 16-byte pushes."""
    return (hb in ATTN_CM_HB and 1 <= S <= ATTN_CM_MAX and (hb * hd) % (4 * S) == 0
            and pdl_enabled() and _cu_occupancy_clusters() is not None)


_ATTN_CM_FNS: dict[tuple, object] = {}


def _attn_cm_fn(name: str, S: int, n: int):
    """The CM instantiation for a launch of n clusters of S blocks, or None where no such cluster can be
    resident (the driver refuses clusters past 8 blocks, or a partitioned GPU's SMs cannot hold 16 blocks of a
    GPC): the launch then leaves the merge to the o GEMV."""
    key = (_dev_id(), name, S)
    if key not in _ATTN_CM_FNS:
        fn = _compiled("attncm", name)
        _ATTN_CM_FNS[key] = fn if resident_clusters(fn, S, n, 128) > 0 else None
    return _ATTN_CM_FNS[key]


def attention_combine(p, out):
    """Merge flash-decoding partials p (_AttnParts) into out [1, H*hd] fp16 (attn_decode_combine)."""
    kernel("attn", "attn_decode_combine")((p.heads,), (p.hd,), (p.part_o, p.part_ml, out, _i(p.splits), _i(p.hd),
                                                                _i(p.n_keys),
                                                                p.pos_dev if p.pos_dev is not None else np.uint64(0),
                                                                _i(p.min_chunk)))
    return out


class _AttnParts:
    """A decode step's flash-decoding partials, not yet merged: the o projection merges them in its
    GEMV prologue (gemv(att=...)); any other consumer gets attn_decode_combine's output (CupyOps._x)."""

    def __init__(self, part_o, part_ml, splits, heads, hd, n_keys, pos_dev, min_chunk, o_merge=False, merged=None):
        self.part_o, self.part_ml, self.splits, self.heads, self.hd = part_o, part_ml, splits, heads, hd
        self.n_keys, self.pos_dev, self.min_chunk, self.o_merge = n_keys, pos_dev, min_chunk, o_merge
        self.merged = merged  # the merged output (fp16 [1, H*hd]) where the clusters merged, else None
        self.shape = (1, heads * hd)
        self.layer = None  # the decoder layer (CupyOps.attention sets it)


# cluster launches' scheduling preference: 0 the driver's default, 1 spread, 2 load balancing (A/B; spread measured
# as fast as the default for the FFN half at 512 positions and ~0.5% faster at 8k, change 75)


_CL_ATTRS: dict[tuple, ctypes.Array] = {}


def _cluster_launch_attrs(CL: int) -> ctypes.Array:
    """The attributes of a decode cluster launch: cluster dimension, PDL, scheduling preference. One array per
    (size, policy): launch_ex keys its launch configurations on the object, so per-step launches reuse them."""
    key = (CL, SETTINGS.cluster_policy)
    if key not in _CL_ATTRS:
        _CL_ATTRS[key] = (_LaunchAttr * 3)(_cluster_attr(CL), _pdl_attr(), _cluster_policy_attr(SETTINGS.cluster_policy))
    return _CL_ATTRS[key]


# the one-launch FFN half: "auto" where its grid holds at least FFN_AUTO_BLOCKS_PER_SM blocks per SM (measured
# faster at Qwen3-8B's 384 blocks on H100, PERFORMANCE.md change 75), "1" wherever it is served (tests), "0" off
FFN_AUTO_BLOCKS_PER_SM = 2
FFN_THREADS, FFN_CH, FFN_MAX_SPAN = 256, 256, 1024  # ffn_decode.cu's block, channels per cluster, span limit


# the one-launch FFN kernels' cluster exchange by pushes into receive slots (st.async on mbarriers) instead of
# the cluster barrier, whose release arrive is a GPU-wide memory barrier (ffn_decode.cu FfnPush, PERFORMANCE.md
# change 124: the H100 8B step 0.9% shorter at 512 keys, 1.5% at 2000):


def ffn_cluster_plan(CL: int, TB: int, n: int, kernel: str = "ffn_decode", push: bool = True) -> dict:
    """The plan for ffn_decode.cu's kernel (ffn_decode or moe_ffn_decode) at its (CL, TB) instantiation
    over n clusters: kernel, launch attributes and how many of its clusters can be resident at once
    (all n must be: the caller checks). push: the cluster's exchange by pushes (False: through the cluster
    barrier, the form the tests compare it with)."""
    fn = _compiled("ffn", f"{kernel}<{CL}, {TB}, {FFN_XCH_PUSH}>" if push else f"{kernel}<{CL}, {TB}>")
    return dict(CL=CL, TB=TB, fn=fn, attrs=_cluster_launch_attrs(CL), clusters=resident_clusters(fn, CL, n, FFN_THREADS))


def _ffn_pairs(D: int) -> list[tuple[int, int]]:
    """ffn_decode.cu's (CL, TB) instantiations that tile the hidden size D, most blocks first."""
    return [(CL, TB) for CL, TB in FFN_PAIRS if D == 256 * CL * TB and D // CL <= FFN_MAX_SPAN]


def _ffn_first_fit(kernel: str, D: int, n: int) -> tuple[dict | None, str]:
    """(plan, why) of ffn_decode.cu's kernel over n clusters: of the (CL, TB) pairs that tile the hidden
    size D, the one with the most blocks whose clusters all fit at once (a second wave would double the
    FFN's time), or None and the counts tried."""
    tried = []
    for CL, TB in _ffn_pairs(D):
        plan = ffn_cluster_plan(CL, TB, n, kernel)
        tried.append(f"{plan['clusters']} of the {n} clusters of {CL}")
        if plan["clusters"] >= n:
            return plan, f"on: {n} clusters of {CL} blocks, {TB} down tiles per block ({plan['clusters']} fit)"
    return None, f"no (CL, TB) whose clusters all fit at once ({'; '.join(tried) or f'hidden {D} not tiled'})"


def decode_ffn_plan(a: ModelArgs) -> tuple[dict | None, str]:
    """(plan, why) for ffn_decode (the FFN half of a dense decode layer in one cluster launch): the plan
    (CL blocks per cluster, TB down column tiles per block, kernel, launch attributes) or None, and a
    line saying why not. A cluster owns 256 intermediate channels (_ffn_first_fit picks the pair)."""
    if SETTINGS.decode_ffn not in ("auto", "1"):
        return None, "off (decode_ffn=0)"
    if not pdl_enabled() or _cu_occupancy_clusters() is None:
        return None, "needs compute capability 9.0 (clusters, PDL)"
    D, I = a.hidden_size, a.intermediate_size
    if a.group_size != 128 or I % FFN_CH:
        return None, f"shape not served (group size {a.group_size}, intermediate {I})"
    n = I // FFN_CH
    plan, why = _ffn_first_fit("ffn_decode", D, n)
    # the form without a cluster launch needs only a (CL, TB) pair, not clusters that fit
    pair = plan or next((dict(CL=cl, TB=tb) for cl, tb in _ffn_pairs(D)), None)
    if pair is not None and SETTINGS.decode_ffn == "auto" and pair["CL"] * n < FFN_AUTO_BLOCKS_PER_SM * sm_count():
        return None, (f"auto: off at {pair['CL'] * n} blocks for {sm_count()} SMs (a grid this small streams the "
                      f"weights slower than the separate GEMVs; decode_ffn=1 forces it)")
    if pair is not None and SETTINGS.ffn_global in ("auto", "1"):
        g, how = ffn_global_plan(pair, n, at_cap_only=SETTINGS.ffn_global == "auto")
        if g is not None:
            return g, how
    if plan is not None and SETTINGS.decode_ffn == "auto" and (D, I) in device_tuning().get("ffn_off", ()):
        return None, (f"auto: off for this shape on the {device_name()} (the separate GEMVs measured faster "
                      f"there than the cluster launch, device_tables; decode_ffn=1 forces it)")
    return plan, why


def decode_ffn(plan: dict, x, layer, acc, eps: float):
    """One dense decode layer's FFN half (ffn_decode.cu): x a _Normed (h, the norm weight, the o
    projection's pending sums and the row they make, or neither); down's sums added into acc (int64
    [D], zero on entry: the o GEMV before clears it). plan: a cluster launch (ffn_cluster_plan) or the
    form without one (ffn_global_plan)."""
    null = np.uint64(0)
    mats = []
    for m in (layer.w1, layer.w3, layer.w2):
        mats += [m.qweight, m.qzeros, m.scales]
    xs = plan.get("xslots")
    launch_ex(plan["fn"], (plan["CL"], layer.w1.N // FFN_CH), (FFN_THREADS,), (
        x.h, x.pend if x.pend is not None else null, x.hout if x.hout is not None else null, x.w, _f(eps),
        *mats, acc, _i(x.h.size), _i(layer.w1.N), xs if xs is not None else null,
        plan["xcnt"] if xs is not None else null), 0, plan["attrs"])
    return acc


# The dense one-launch FFN without a cluster launch (ffn_decode.cu FfnSlots, PERFORMANCE.md changes 129-130): registers
# for only as many blocks per SM as its grid needs (3 or 4, FFN_GLOBAL_CAPS) spread it evenly, and a channel tile's
# blocks exchange their sums through global memory. A cluster launch cannot be spread that way: clusters reach
# ~124 of an H100's 132 SMs, where 45 of Qwen3-8B's 48 clusters of 8 fit at 3 per SM (change 128), and 94 of 32B's
# 100 clusters of 5 at 4 (so 32B ran the separate GEMVs). H100 step timer at 512 keys: 8B -2.5%, 14B -2.7% against
# the cluster launch, 32B -9.7% against the separate GEMVs; H200: 8B -3.3%, 14B -6.6%. "auto" (default) where the
# grid needs one of those counts per SM, "1" at 3 per SM wherever its whole grid fits (tests), "0" never (A/B).
FFN_GLOBAL_PER_SM = 3  # the count ffn_global=1 takes
FFN_SLOT_BYTES = 8 * FFN_CH * 8 + 8 * 4  # ffn_decode.cu sizeof(FfnSlots)


def ffn_global_plan(plan: dict, n: int, at_cap_only: bool = False, cap: int = FFN_GLOBAL_PER_SM
                    ) -> tuple[dict | None, str]:
    """(plan, why): ffn_decode's (CL, TB) pair over n channel tiles made into its form without a cluster launch
    (the CL blocks of a tile exchange through global memory, `cap` blocks per SM by its registers, one of
    FFN_GLOBAL_CAPS), or None and why not. Every block must be resident at once (a tile's blocks wait for each
    other). at_cap_only: the cap the grid needs (ceil(blocks / SMs)), and only where it is instantiated."""
    CL, sms = plan["CL"], sm_count()
    if at_cap_only:
        cap = -(-CL * n // sms)
    if cap not in FFN_GLOBAL_CAPS:
        return None, f"{CL * n} blocks on {sms} SMs: {cap} per SM is not served"
    fn = _compiled("ffn", f"ffn_decode<{CL}, {plan['TB']}, {FFN_XCH_GLOBAL}, {cap}>")
    per = blocks_per_sm(fn, FFN_THREADS)
    if per * sms < CL * n or at_cap_only and per != cap:
        return None, f"{CL * n} blocks at {per} per SM, not {cap}"
    return (dict(plan, fn=fn, attrs=_pdl_attr(), xslots=cp.zeros((n * FFN_SLOT_BYTES // 4,), cp.float32),
                 xcnt=cp.zeros((n,), cp.uint64)),
            f"on, without a cluster launch: {n} channel tiles of {CL} blocks, {plan['TB']} down tiles per block "
            f"({CL * n} blocks at {per} per SM), the exchange through global memory")


# the one-launch MoE FFN half (ffn_decode.cu's moe_ffn_decode: the top-k and the selected experts in one
# cluster launch, the router's logits from the o GEMV before it; Qwen3-30B-A3B's decode step 2.6-2.9%
# shorter on H100 with the router in the cluster, PERFORMANCE.md change 76, and 6.3% more with the logits
# from the o GEMV, change 77): "auto" (default) and "1" wherever it is served, "0" off (the routing kernel
# and the two expert GEMVs)
def decode_moe_plan(a: ModelArgs) -> tuple[dict | None, str]:
    """(plan, why) for moe_ffn_decode (a MoE decode layer's top-k and experts in one cluster launch):
    the plan or None, and a line saying why not. A cluster owns 256 channels of one selected expert,
    k * moe_intermediate / 256 clusters in all (_ffn_first_fit picks the pair)."""
    if SETTINGS.decode_moe not in ("auto", "1"):
        return None, "off (decode_moe=0)"
    if not pdl_enabled() or _cu_occupancy_clusters() is None:
        return None, "needs compute capability 9.0 (clusters, PDL)"
    D, mI, E, k = a.hidden_size, a.moe_intermediate_size, a.num_experts, a.num_experts_per_tok
    if a.group_size != 128 or mI % FFN_CH or E > MOE_MAX_EXPERTS or k > MOE_MAX_TOPK:
        return None, f"shape not served (group size {a.group_size}, expert intermediate {mI}, {E} experts, top {k})"
    return _ffn_first_fit("moe_ffn_decode", D, k * mI // FFN_CH)


def decode_moe_ffn(plan: dict, x, layer, ids, weights, acc, eps: float, k: int, norm_topk: bool, zacc):
    """One MoE decode layer's FFN half (moe_ffn_decode): x a _Normed (h, the norm weight, the o
    projection's pending sums and the row they make, or neither); the k experts picked to ids (int32
    [k]) and their weights to weights (fp32 [k]); the weighted sum of their down outputs added into acc
    (int64 [D], zero on entry: the o GEMV before clears it). zacc (int64 [E], fixed point): the router's
    logits before the 1/rms, router . (w * (h + fp32 o)), as the o GEMV's router rows add them."""
    null = np.uint64(0)
    w13, w2 = layer.experts_w13, layer.experts_w2
    E, D, mI = w13.E, x.h.size, w2.qweight.shape[1]
    launch_ex(plan["fn"], (plan["CL"], k * mI // FFN_CH), (FFN_THREADS,), (
        x.h, x.pend if x.pend is not None else null, x.hout if x.hout is not None else null, x.w, _f(eps),
        zacc, w13.qweight, w13.qzeros, w13.scales, w2.qweight, w2.qzeros, w2.scales, ids, weights, acc,
        _i(D), _i(mI), _i(E), _i(k), _i(int(norm_topk))), 0, plan["attrs"])
    return acc


class _FfnIn:
    """A dense decode layer's gate/up input, not yet launched: the down projection launches the
    whole FFN half (decode_ffn)."""

    def __init__(self, x, layer):
        self.x, self.layer, self.shape = x, layer, (1, layer.w1.N)


def qk_norm_rope_store(q, k, v, q_norm, k_norm, cos, sin, kc, vc, pos0: int, n_heads: int, eps: float,
                       out=None, pos_dev=None):
    """Per-head RMSNorm of q and k, RoPE at positions pos0.., k and v written into kc/vc [ctx, KV, hd].
    q [T, H*hd], k and v [T, KV*hd] (row strides may be wider: views of a fused buffer)."""
    T, KV, hd = q.shape[0], kc.shape[1], kc.shape[2]
    out = _empty((T, n_heads, hd), cp.float16) if out is None else out
    # 16-byte accesses: views of a q|k|v row whose head dims (64, 128) keep every start and stride aligned
    assert all(a.data.ptr % 16 == 0 and a.strides[0] % 16 == 0 and a.strides[1] == 2 for a in (q, k, v))
    heads = 4 * (512 // hd)  # per block: 4 warps of 32 / (hd / 16) heads
    kernel("rope", f"qk_norm_rope_store<{hd}>")((T, math.ceil((n_heads + 2 * KV) / heads)), (128,), (
        q, _i(q.strides[0] // 2), k, _i(k.strides[0] // 2), v, _i(v.strides[0] // 2), q_norm, k_norm, cos, sin,
        out, kc, vc, _i(n_heads), _i(KV), _i(pos0), pos_dev if pos_dev is not None else np.uint64(0), _f(eps)))
    return out


def add_rmsnorm(h, r, w, eps: float, out=None, pend=None, experts=None):
    """h [T, D] fp32 += r (fp16, or None), or (T = 1) += fp16(pend) with pend (int64 fixed point,
    gemv's accumulating mode) cleared, or += moe_finalize(*experts) (experts = (y, u2p, weights): a MoE
    prefill's expert rows, summed here instead); returns rmsnorm(h) * w in fp16."""
    T, D = h.shape
    out = _empty((T, D), cp.float16) if out is None else out
    assert pend is None or (r is None and T == 1 and pend.size == D)
    threads = math.ceil(D / 8 / 32) * 32  # one 16-byte chunk a thread (norm.cu)
    y, u2p, wts = experts if experts is not None else (None, None, None)
    k = wts.shape[1] if experts is not None else 0
    assert experts is None or (r is None and pend is None and k <= min(32, threads) and y.shape[1] == D
                               and u2p.size == T * k and wts.flags.c_contiguous)
    # a hidden size is a multiple of AWQ's group of 128
    assert D % 8 == 0 and D <= 8192 and all(a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in
                                            (h, w, out) + tuple(a for a in (r, pend, y) if a is not None))
    null = np.uint64(0)
    kernel("norm", "add_rmsnorm")((T,), (threads,), (
        h, r if r is not None else null, w, out, _i(D), _f(eps), pend if pend is not None else null,
        y if y is not None else null, u2p if u2p is not None else null, wts if wts is not None else null, _i(k)))
    return out


def lm_head(x, W, out, arg_slot=None, n_arg: int = 0):
    """x [D] fp16, W [V, D] fp16 -> out [V] fp32. arg_slot (uint64 [1], zero): the argmax of out[:n_arg]
    (NaN never) is also max'ed into it as lm_head.cu's argmax_key, for greedy decode."""
    V, D = W.shape
    slot = (arg_slot, _i(n_arg)) if arg_slot is not None else (np.uint64(0), _i(0))
    kernel("lmh", "lm_head_gemv")((math.ceil(V / 32),), (256,), (x, W, out, _i(V), _i(D), *slot))
    return out


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
    if SETTINGS.moe_route_splits != "auto":
        return max(1, min(int(SETTINGS.moe_route_splits), most))
    per_sm = 1 if warps == 16 else 2
    return max(1, min(SETTINGS.moe_route_split_max, most, per_sm * sm_count() // tiles))


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
    if (SETTINGS.moe_router != "cuda" and D % 32 == 0 and E <= MOE_MAX_EXPERTS and x.flags.c_contiguous
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
        allow_dynamic_smem(_compiled("moe", name), smem)
        fuse = maps is not None and SETTINGS.moe_route_maps and warps == 16
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
    if T >= SETTINGS.moe_router_gemm_min_t and cublas_ready():  # fp32 products of fp16 values are exact: fp32 logits
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
    dev = _dev_id()
    if dev not in _MAPS_ROOM:
        fn = _compiled("moe", "moe_expert_maps")
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


# Qwen3-MoE prefill's grouped expert GEMMs on the register-A wgmma kernel (gemm_wgmma.cu gemm_moe_rs,
# PERFORMANCE.md change 168) where it runs (compute capability 9.0) and the shapes fit it (moe_rs_fits);
# "0": gemm_w4a16.cu's mma.sync grouped GEMMs everywhere (A/B)
# gemm_moe_rs's rows per tile by the mean rows per expert (n / E): 64 below this many, 128 from it (H200 30B-A3B,
# both expert GEMMs per prefill: 32 rows per expert 15.2-15.3 ms with 64 against 15.7 with 128; 64 rows 21.8
# against 19.0; 128 rows 34.8-35.1 against 26.9-27.1; PERFORMANCE.md change 168). With change 177's narrow forms
# (H100, the pair of GEMMs alone, 64 against 128 rows per tile): 40 rows per expert 250.6 against 274.6 µs, 48 rows 252.5
# against 276.9, 56 rows 286.7 against 307.0 (a second call: 287.1 against 292.7), 60 rows 312.7 against 310.0, 64 rows
# 352.8 against 319.2: the two cost the same at 60 (change 179)


def moe_tc_fits(D: int, inter: int, group: int) -> bool:
    """gemm_moe_tc's shape table for both expert GEMMs: each N a multiple of 256 (whole column tiles), each K of
    128 (its x chunks), the group a multiple of 128 (a chunk's scales and zeros are one group's)."""
    return D % 256 == 0 and inter % 256 == 0 and group % 128 == 0


def moe_tc_tile(n: int, E: int) -> int | None:
    """gemm_moe_tc's rows per tile for n routed rows over E experts, or None where gemm_moe_rs is taken (moe_tc)."""
    if SETTINGS.moe_tc == "0" or n > SETTINGS.moe_tc_max_mean * E:
        return None
    return 16 if n <= SETTINGS.moe_tc_t16_max * E else 32


def moe_rs_fits(D: int, inter: int, group: int) -> bool:
    """gemm_moe_rs's shape table for both expert GEMMs: gate|up [D, 2 inter] and down [inter, D], each N a
    multiple of 256 (whole 32-word column tiles), each K of 64, group 64 << n."""
    return D % 256 == 0 and inter % 256 == 0 and _pow2_group(group)


def moe_rs_tile(n: int, E: int) -> int:
    """gemm_moe_rs's rows per tile for n routed rows over E experts (moe_rs_bt128_from)."""
    return 128 if n >= SETTINGS.moe_rs_bt128_from * E else 64


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
    st, wg, nw, sw = MOE_RS_FORMS[bt]
    fn = kernel("gemm90rs", moe_rs_name(st, bt, wg, nw, sw))
    smem = rs_smem_bytes(st, bt)
    allow_dynamic_smem(fn, smem)
    xmap = tma_map_2d(x, bt, 64)
    launch_ex(fn, (N // (64 * wg), _moe_grid_rows(n, E, bt)), (128 * wg,), (
        xmap, stack.qweight, stack.qzeros, stack.scales, _i(N), out, _i(K), _i(stack.group_size),
        _i(out.strides[0] // 2), offsets, tiles, _i(E), tma_map_words(stack.qweight, wg) if sw else xmap),  # (unread)
        smem)
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
    return (SETTINGS.moe_rs != "0" and w13.group_size == w2.group_size and w13.scales.shape[-1] == 2 * inter
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

# Decode has no add+RMSNorm kernels: the o / down / MoE projection adds its output into the fp32 residual stream in
# its epilogue, and the next GEMV computes rmsnorm(h) * w in its prologue; q/k RMSNorm, RoPE and the KV-cache write
# are the q|k|v GEMV's epilogue, flash decoding's merge the o GEMV's prologue. MoE prefill's finalize (the
# routing-weighted sum of each token's expert rows) is in the next add_rmsnorm (the [T, D] sum is neither written nor
# read back). Decode's GEMVs run in accumulating mode where their splits fit (no split-K reduction tail: the residual
# add, the RMSNorm's 1/rms, SwiGLU and the q/k norm + RoPE + KV write done by the consuming kernel, PERFORMANCE.md
# changes 49-50 and, for MoE layers, 52-53); gemv_acc False (tests) takes the reduction tails that wider shapes take.


class _QkvInput:
    """Decode's QKV projection not yet launched (ops.qkv's q): qk_norm_rope_store launches it with the
    norm, RoPE and cache write in its epilogue."""

    def __init__(self, x):
        self.x = x


class _Deferred:
    """A decode projection not yet launched: add_rmsnorm launches it with the residual add fused
    (run(h)), or in accumulating mode (run_acc(h), h the residual row it will be added to; it returns
    the int64 accumulator the next GEMV finishes); any other consumer gets its fp16 output (run(None))."""

    def __init__(self, run, run_acc=None):
        self.run, self.run_acc = run, run_acc


def _acc_only(what: str):
    """A _Deferred's run for a launch that exists in accumulating mode only (a fused half)."""
    def run(h):
        raise AssertionError(f"{what} runs in accumulating mode only")
    return run


class _Normed:
    """Decode's x = rmsnorm(h) * w not yet computed: a GEMV computes it in its prologue; any other
    consumer gets it from the add_rmsnorm kernel (CupyOps._x). pend: a projection's output still to
    be added to h (accumulating mode), the sum going to hout."""

    def __init__(self, h, w, pend=None, hout=None):
        self.h, self.w, self.shape, self.pend, self.hout = h, w, h.shape, pend, hout


class _ExpertRows:
    """A MoE prefill's output not yet summed: the expert rows y [T*k, D] (permuted), u2p and the routing weights
    [T, k]; the next add_rmsnorm, the layer output's one consumer, sums them as it adds them to h
    (in the next add_rmsnorm)."""

    def __init__(self, y, u2p, weights):
        self.y, self.u2p, self.weights = y, u2p, weights


class _QkvAcc:
    """Decode's q|k|v sums in accumulating mode: the attention kernel finishes them (norm, RoPE, cache)."""

    def __init__(self, q, layer):
        self.q, self.layer, self.shape = q, layer, q.shape


class _SwigluAcc:
    """Decode's gate/up sums in accumulating mode (int64 [2, I]): the down GEMV applies SwiGLU."""

    def __init__(self, acc):
        self.acc, self.shape = acc, (1, acc.size // 2)


class CupyOps:
    name = "cuda"

    def __init__(self, args: ModelArgs, weights: Weights, max_context: int, progress: bool = True,
                 settings: Settings | None = None):
        """settings: the tuning this backend runs with (cuda/settings.py; None: the active one, by default its
        defaults), made the process's active tuning."""
        if settings is not None:
            use_settings(settings)
        self.settings = SETTINGS
        self.args = a = args
        if a.num_experts:
            if a.num_experts > MOE_MAX_EXPERTS or not 0 < a.num_experts_per_tok <= min(MOE_MAX_TOPK, a.num_experts):
                raise KuiperError(f"{a.num_experts} experts with {a.num_experts_per_tok} per token: the GPU MoE "
                                  f"kernels support up to {MOE_MAX_EXPERTS} experts and {MOE_MAX_TOPK} per token")
            if a.moe_intermediate_size % 64:
                raise KuiperError(f"moe_intermediate_size={a.moe_intermediate_size} is not a multiple of 64, which "
                                  f"the grouped expert GEMM needs")
        self.routing_log = None  # a list: record each MoE layer's expert ids, prefill and eager decode (tests)
        if a.head_dim not in SUPPORTED_HEAD_DIMS:
            raise KuiperError(f"head_dim {a.head_dim} is not supported on the GPU (supported: {SUPPORTED_HEAD_DIMS})")
        for n, what in ((a.hidden_size, "hidden_size"), (a.intermediate_size, "intermediate_size"),
                        (a.q_dim, "heads*head_dim"), (a.kv_dim, "kv_heads*head_dim")):
            if n % 32:
                raise KuiperError(f"{what}={n} is not a multiple of 32, which the GPU kernels need")
        if a.group_size % 32:
            raise KuiperError(f"AWQ group size {a.group_size} is not a multiple of 32 (GPU kernels)")
        if a.hidden_size > 8192:
            raise KuiperError(f"hidden_size {a.hidden_size} > 8192 is not supported by the lm_head kernel")
        self.dev = cp.cuda.Device()
        families, groups = model_families(a, int(self.dev.compute_capability)), model_groups(a)
        # the kernels' builds side by side while the weights upload (a first run's compiles, else cache loads)
        precompile(families, self.dev.id, groups)
        self.n_sm = sm_count()
        self.attn_min_chunk = attn_min_chunk(a)
        self.attn_short = attn_short(a)
        self.o_merge = o_merge(a)
        self.attn_cm = attn_cm(a)
        self._graphs = {}  # flash decoding's regime (_attn_regime) -> (graph, its argmax's n_valid)
        self.graphs = os.environ.get("KUIPER_CUDA_GRAPHS", "1") != "0"
        self._graph = None
        self._dev_pos = None
        self._arena = _Arena()  # short prefills' activations (arena_max_t)
        # prefill graphs (prefill_graph): bucket -> (graph, its x [B, D], the allocations it holds, _BUF_GEN);
        # the buckets met once (the first prefill of a bucket runs eagerly); those whose prefill cannot be captured
        # (cuBLAS: shapes the fused GEMMs do not take, GPUs before sm_90); the graphs' shared activations; what the
        # graphs read (_pbuf: K's and V's maps, the position, the ids; _PBUF_*); prefill_graphs False runs every
        # prefill eagerly (A/B, tests)
        self._pgraphs: dict[int, tuple] = {}
        self._pseen: set[int] = set()
        self._pnever: set[int] = set()
        self._parena = _BumpArena()
        self._pbuf = self._graph_ids = self._graph_pos = None
        self.prefill_graphs = self.graphs and SETTINGS.prefill_graph_max_t > 1
        # a blocking stream: ordered with the default stream that eager kernels use, and capturable
        self._stream = cp.cuda.Stream(non_blocking=False)
        try:
            self.weights = self._upload(weights, progress)
            self._alloc_decode()
        except cp.cuda.memory.OutOfMemoryError as e:
            raise ResourceError(f"out of GPU memory loading the weights: {e}") from None
        gemv_counters()  # allocated (zeroed) before any graph capture
        # the FFN half in one launch: it clears nothing itself, so the o GEMV before it clears its accumulator
        o_clears = o_split(a.q_dim, math.ceil(a.hidden_size / GEMV_COLS))[1] <= GEMV_ATT_ROWS
        self._ffn, self.decode_ffn_why = (decode_ffn_plan(a) if self.acc_mode and o_clears else
                                          (None, "needs accumulating mode and the o GEMV's merge prologue"))
        # the MoE FFN half in one launch (routing and experts); like the dense one, its accumulator is
        # cleared by the o GEMV before it
        self._moe, self.decode_moe_why = (decode_moe_plan(a) if a.num_experts and self.acc_attn and o_clears else
                                          (None, "needs a MoE model in accumulating mode with the o GEMV's merge "
                                                 "prologue"))
        self._router_o = self._router_o_rows() if self._moe is not None else {}
        self.alloc_cache(max_context)
        # every family this model uses built (or precompile's builds waited for) before anything is timed; only
        # those of this GPU's architecture (the sm_90a modules load on compute capability 9.0 only)
        for key in (k for fam in families for k in _module_keys(fam, groups)):
            _module(key)
        cublas_ready()  # the prefill projections go through cuBLAS: load it now, not in the first prompt

    def alloc_cache(self, max_context: int) -> None:
        """Preallocated fp16 KV cache [L, ctx, KV, hd] and the RoPE tables for max_context positions."""
        a = self.args
        L, KV, hd = a.num_hidden_layers, a.num_key_value_heads, a.head_dim
        self.k_cache = self.v_cache = None
        self._arena.clear()
        # the prefill graphs hold the old cache's addresses: they, their activations and the buckets met go
        # before the pool gives its free blocks back
        self._pgraphs, self._pseen, self._parena = {}, set(), _BumpArena()
        cp.get_default_memory_pool().free_all_blocks()
        try:
            self.k_cache = cp.empty((L, max_context, KV, hd), dtype=cp.float16)
            self.v_cache = cp.empty((L, max_context, KV, hd), dtype=cp.float16)
        except cp.cuda.memory.OutOfMemoryError:
            self.k_cache = self.v_cache = None
            per = kv_bytes_per_position(a)
            free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
            raise ResourceError(f"out of GPU memory: the KV cache needs {per * max_context / 2**20:.0f} MiB for "
                                f"--max-context {max_context}; {free / 2**20:.0f} MiB are free, at most "
                                f"{free // per} positions: try a smaller --max-context") from None
        cos, sin = rope_tables(a, max_context)
        self.cos, self.sin = cp.asarray(cos), cp.asarray(sin)
        # flash-decoding splits per head group (a block serves decode_heads_per_block query heads):
        # at least two blocks per SM over all groups; for a larger cache about attn_keys_per_split
        # keys per split when full, capped at 3 blocks per SM (8 with the scalar loop). The kernel leaves splits
        # idle while the context is short (attention.cu decode_chunk).
        H = a.num_attention_heads
        groups = H // decode_heads_per_block(H, a.num_key_value_heads)
        self.attn_splits = max(1, math.ceil(SETTINGS.attn_per_sm * self.n_sm / groups),
                               min(math.ceil(max_context / SETTINGS.attn_keys_per_split),
                                   (3 if SETTINGS.attn_mma_long else 8) * self.n_sm // groups))
        self.d["part_o"] = cp.empty((H * self.attn_splits * hd,), cp.float32)
        self.d["part_ml"] = cp.empty((H * self.attn_splits * 2,), cp.float32)
        self.max_context = max_context
        self._graph, self._graphs = None, {}  # they hold the old cache's addresses

    def _router_o_rows(self) -> dict:
        """For the one-launch MoE FFN half: per MoE layer i, (R, Rh) = (W_o diag(ffn_norm) router^T
        [q_dim, E], diag(ffn_norm) router^T [D, E]) fp16: the router's logits before the 1/rms as a
        function of the attention output and of the residual row, which the o GEMV computes beside o
        (gemv_w4a16.cu gemv_rt_tile). Made once here, R from the dequantized o matrix in fp32: 1.5 MB
        per Qwen3-30B-A3B layer."""
        out = {}
        for i, L in enumerate(self.weights.layers):
            if L.router is None:
                continue
            rt = L.ffn_norm.astype(cp.float32)[:, None] * L.router.astype(cp.float32).T  # [D, E]
            wo = awq_dequant(L.wo).astype(cp.float32)  # [q_dim, D]
            out[i] = (cp.ascontiguousarray((wo @ rt).astype(cp.float16)), cp.ascontiguousarray(rt.astype(cp.float16)))
            del wo, rt
        cp.get_default_memory_pool().free_all_blocks()
        return out

    @staticmethod
    def synchronize() -> None:
        cp.cuda.get_current_stream().synchronize()

    # ------------------------------------------------------------------ loading
    def _upload(self, w: Weights, progress: bool) -> Weights:
        import cupyx
        need, pinned_bytes = device_bytes(w)  # (pinned_bytes: the untied embedding, kept in pinned host memory)
        total = need + pinned_bytes
        free, dev_total = cp.cuda.runtime.memGetInfo()
        check_weights_fit(need, free + cp.get_default_memory_pool().free_bytes(), dev_total, device_name())
        chunk = 64 << 20
        pinned = cupyx.empty_pinned((min(chunk, max(total, 1)),), dtype=np.uint8)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="upload", file=sys.stderr,
                       dynamic_ncols=True, leave=False)
        done: dict[int, object] = {}

        def up(x, share=True):  # share: reuse the copy of an array met before (a tied lm_head)
            if share and id(x) in done:
                return done[id(x)]
            d = cp.empty(x.shape, dtype=x.dtype)
            src = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
            dst = d.reshape(-1).view(cp.uint8)
            stream = cp.cuda.get_current_stream()
            for o in range(0, src.size, chunk):
                n = min(chunk, src.size - o)
                pinned[:n] = src[o:o + n]
                drop_pages(src[o:o + n])  # the file's pages, copied: no longer this process's memory
                dst[o:o + n].set(pinned[:n], stream=stream)
                stream.synchronize()  # the copy from pinned memory is asynchronous: finish it before refilling
            if bar:
                bar.update(x.nbytes)
            if share:
                done[id(x)] = d
            return d

        def lin(q, segments=1):  # AwqLinear or AwqStack (same fields), or None; qweight tiled on the GPU
            return None if q is None else type(q)(tile_qweight(up(q.qweight, False), segments), up(q.qzeros),
                                                  up(q.scales), q.group_size)

        layers = [Layer(up(L.attn_norm), up(L.ffn_norm), up(L.q_norm), up(L.k_norm), lin(L.wq), lin(L.wk),
                        lin(L.wv), lin(L.wo), lin(L.w1), lin(L.w2), lin(L.w3),
                        None if L.router is None else up(L.router), lin(L.experts_w13, 2), lin(L.experts_w2))
                  for L in w.layers]
        # An untied token-embedding table (151936 x 4096 fp16 = 1.2 GB at 8B) is read one row per token,
        # so it stays in pinned host memory, which kernels read directly over the bus (unified
        # addressing), as llama.cpp keeps it on the host: GPU memory is the 4-bit weights plus the
        # fp16 lm_head. A tied table is lm_head too and goes to the GPU. KUIPER_EMBED_ON_GPU=1: always.
        embed = None
        if pinned_bytes:
            try:
                embed = cupyx.empty_pinned(w.embed.shape, dtype=w.embed.dtype)
                rows = max(1, chunk // max(1, w.embed[0].nbytes))
                for r in range(0, w.embed.shape[0], rows):  # a chunk at a time, so its file pages go as it is copied
                    embed[r:r + rows] = w.embed[r:r + rows]
                    drop_pages(w.embed[r:r + rows])
                if bar:
                    bar.update(w.embed.nbytes)
            except (cp.cuda.runtime.CUDARuntimeError, MemoryError):  # page-locked memory refused: GPU copy
                print(f"kuiper: could not pin {w.embed.nbytes / 2**20:.0f} MiB of host memory for the token "
                      f"embeddings; keeping them on the GPU", file=sys.stderr)
                embed = None
        if embed is None:
            embed = up(w.embed)
        out = Weights(embed, up(w.final_norm), up(w.lm_head), layers)
        if bar:
            bar.close()
        cp.cuda.Device().synchronize()
        return out

    def _alloc_decode(self):
        a = self.args
        D, I, qd, kvd = a.hidden_size, a.intermediate_size, a.q_dim, a.kv_dim
        E, k, mI = a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size
        s_max = max(gemv_partial_size(D, [qd, kvd, kvd]), gemv_partial_size(qd, [D]),
                    gemv_partial_size(D, [I, I]), gemv_partial_size(I, [D]))
        if E:  # the expert GEMVs: k slots each
            s_max = max(s_max, gemv_partial_size(D, [mI, mI], k), gemv_partial_size(mI, [D], k))
        self.d = {
            "ids": cp.zeros((1,), cp.int32), "h": cp.empty((1, D), cp.float32), "x": cp.empty((1, D), cp.float16),
            "partial": cp.empty((s_max,), cp.float32),
            "qrot": cp.empty((1, a.num_attention_heads, a.head_dim), cp.float16),
            "attn": cp.empty((1, qd), cp.float16), "proj": cp.empty((1, D), cp.float16),
            "act": cp.empty((1, I), cp.float16), "logits": cp.empty((a.vocab_size,), cp.float32),
            "token": cp.zeros((1,), cp.int32), "step": cp.zeros((1,), cp.uint64), "pos": cp.zeros((1,), cp.int32),
            "hist": cp.zeros((1024,), cp.int32),
        }
        # accumulating mode: accumulators [o | gate, up | down | q, k, v], zero between steps; the second
        # residual row the adds alternate with; the scaled norms' per-split sums of squares. acc_attn:
        # the attention half of every layer (q|k|v finished by flash decoding, o by the next norm's
        # consumer: a GEMV, or the MoE router); acc_mode: the dense FFN too (its down GEMV's sums go to
        # the next layer's q|k|v GEMV)
        def fits(*shapes):
            return all(gemv_split(K_, math.ceil(N_ / GEMV_COLS))[1] <= GEMV_ATT_ROWS for K_, N_ in shapes)
        self.acc_attn = SETTINGS.gemv_acc and fits((D, qd))
        self.acc_mode = self.acc_attn and not E and fits((D, 2 * I), (I, D))
        self.acc_moe = self.acc_attn and bool(E) and mI <= GEMV_ATT_ROWS  # the experts' FFN too
        if self.acc_attn:
            G = max(2 * I, 2 * k * mI if E else 0)  # gate, up: the dense FFN's or the k experts'
            # [o | gate, up | router z | down | q, k, v]: the router's logits (the one-launch MoE FFN
            # half's, added by the o GEMV) are cleared with o by the next q|k|v GEMV
            size, parts = decode_acc_layout(D, G, E, qd + 2 * kvd)
            acc = cp.zeros((size,), cp.int64)
            self.d.update({name: acc[sl] for name, sl in parts.items()})
            self.d.update(h2=cp.empty((1, D), cp.float32),
                          ss_attn=cp.empty((4096,), cp.float32), ss_ffn=cp.empty((4096,), cp.float32))
            self._ss_n = {}  # the scaled GEMVs' split counts, for their consumers
        if E:
            self.d.update(moe_logits=cp.empty((1, E), cp.float32), moe_ids=cp.zeros((1, k), cp.int32),
                          moe_w=cp.empty((1, k), cp.float32), moe_act=cp.empty((k, mI), cp.float16),
                          moe_counter=cp.zeros((1,), cp.int32))
        self._sampled = None  # host copy of the last sampled id, whose device copy is d["token"]
        self._init_draw()

    def _init_draw(self) -> None:
        """sample_launch's pinned host buffers (the draw's id back, the penalty's history out) and the
        event that says the id has landed: the host reads it while the next step already runs."""
        import cupyx
        # [0] the draw kernels' id, [1 + position % 2] the decode graph's greedy argmax (advance_position)
        self._tok_host = cupyx.empty_pinned((3,), np.int32)
        self._read_slot = 0
        self._hist_host = cupyx.empty_pinned((self.d["hist"].size,), np.int32)
        self._tok_event = cp.cuda.Event(disable_timing=True)
        self._draw_queued = False
        # greedy decode's argmax from the graph (decode_step): the ids it covers, whether it is current
        self._last_n_valid = self._capture_argmax = self._graph_argmax_n = 0
        self._argmax_ready = False
        self.fused_draws = 0  # draws served by the graph's argmax (tests)
        # sample_token_mb's per-block results (candidates, maxima, counts) and its arrival counter
        self.d.update(smp_v=cp.empty((SMP_CAND,), cp.float32), smp_i=cp.empty((SMP_CAND,), cp.int32),
                      smp_mx=cp.empty((SMP_MAX_BLOCKS,), cp.float32), smp_n=cp.empty((SMP_MAX_BLOCKS,), cp.int32),
                      smp_counter=cp.zeros((1,), cp.int32), argmax=cp.zeros((1,), cp.uint64))

    # ------------------------------------------------------------------ the ops interface
    def embed(self, ids: list[int]):
        T, D = len(ids), self.args.hidden_size
        if T == 1:
            on_dev = ids[0] == SAMPLED_TOKEN or (self._sampled is not None and ids[0] == self._sampled)
            dev_ids = self.d["token"] if on_dev else None
            if dev_ids is None:
                dev_ids = self.d["ids"]
                dev_ids[0] = ids[0]
            h = self.d["h"]
        else:  # (a prefill graph's capture reads the ids from the buffer each replay fills)
            dev_ids = self._graph_ids if self._graph_ids is not None else cp.asarray(np.asarray(ids, dtype=np.int32))
            assert dev_ids.size == T
            h = cp.empty((T, D), cp.float32)
        table = self.weights.embed
        if isinstance(table, np.ndarray):  # pinned host memory: its address is valid on the device
            table = np.uint64(table.ctypes.data)
        kernel("norm", "embed_gather")((T,), (256,), (dev_ids, table, h, _i(D)))
        return h

    def add_rmsnorm(self, h, r, w):
        if isinstance(r, _Deferred) and r.run_acc is not None and self.acc_attn:
            # the projection adds into an accumulator; the consumer adds it to h, writing the other row
            hout = self.d["h2"] if h.data.ptr == self.d["h"].data.ptr else self.d["h"]
            return hout, _Normed(h, w, r.run_acc(h), hout)
        if isinstance(r, _Deferred):
            r.run(h)  # h += r in the projection's epilogue
            r = None
        if h.shape[0] == 1 and r is None:
            return h, _Normed(h, w)
        if isinstance(r, _ExpertRows):
            return h, add_rmsnorm(h, None, w, self.args.rms_norm_eps, experts=(r.y, r.u2p, r.weights))
        out = self.d["x"] if h.shape[0] == 1 else None
        return h, add_rmsnorm(h, r, w, self.args.rms_norm_eps, out)

    def _x(self, x):
        """A deferred decode value made concrete: a _Normed input through the add_rmsnorm kernel
        without the add, a _Deferred projection launched with its plain fp16 output."""
        if isinstance(x, _Normed):
            out = add_rmsnorm(x.h, None, x.w, self.args.rms_norm_eps, self.d["x"], pend=x.pend)
            if x.pend is not None:  # h += the pending output was done in place: the caller holds hout
                x.hout[...] = x.h
            return out
        if isinstance(x, _SwigluAcc):
            raise AssertionError("the gate/up sums of accumulating mode go to the down GEMV only")
        if isinstance(x, _Deferred):
            return x.run(None)
        if isinstance(x, _AttnParts):
            return x.merged if x.merged is not None else attention_combine(x, self.d["attn"])
        return x

    def _gemv_in(self, x) -> dict:
        """gemv()'s input arguments for x: the array, or the fused RMSNorm prologue of a _Normed."""
        if isinstance(x, _Normed):
            return {"x": None, "norm": (x.h, x.w, self.args.rms_norm_eps), "pend": x.pend, "hout": x.hout}
        if isinstance(x, _SwigluAcc):
            return {"x": None, "pend": x.acc}
        return {"x": x}

    def qkv(self, x, layer: Layer):
        a = self.args
        if x.shape[0] == 1:  # launched by qk_norm_rope_store, with the norm and RoPE in its epilogue
            return _QkvInput(x), None, None
        y = gemm(x, (layer.wq, layer.wk, layer.wv))  # one matrix for cuBLAS: k and v alone are narrow
        qd, kvd = a.q_dim, a.kv_dim
        return y[:, :qd], y[:, qd:qd + kvd], y[:, qd + kvd:]

    def qk_norm_rope_store(self, q, k, v, layer: Layer, i: int, pos0: int):
        a = self.args
        if isinstance(q, _QkvInput) and self.acc_attn:
            # q|k|v sums to their accumulator (the attention kernel finishes them); also clears the o
            # and gate/up accumulators (last read by the previous layer's gate/up and down GEMVs, next
            # written after this kernel has finished)
            self._ss_n["attn"] = gemv(mats=[layer.wq, layer.wk, layer.wv], out_kind="plain", out=None,
                                      partial=self.d["partial"], acc_out=self.d["acc_qkv"], zero=self.d["acc_o_gu"],
                                      ss_out=self.d["ss_attn"], **self._gemv_in(q.x))
            return _QkvAcc(self.d["qrot"], layer)
        if isinstance(q, _QkvInput):
            rope = dict(q_norm=layer.q_norm, k_norm=layer.k_norm, cos=self.cos, sin=self.sin, qout=self.d["qrot"],
                        kc=self.k_cache[i], vc=self.v_cache[i], pos0=pos0, pos_dev=self.d["pos"],
                        eps=a.rms_norm_eps)
            gemv(mats=[layer.wq, layer.wk, layer.wv], out_kind="qkv_rope", out=None, partial=self.d["partial"],
                 rope=rope, **self._gemv_in(q.x))
            return self.d["qrot"]
        one = q.shape[0] == 1
        return qk_norm_rope_store(q, k, v, layer.q_norm, layer.k_norm, self.cos, self.sin, self.k_cache[i],
                                  self.v_cache[i], pos0, a.num_attention_heads, a.rms_norm_eps,
                                  self.d["qrot"] if one else None, self.d["pos"] if one else self._graph_pos)

    def attention(self, q, i: int, pos0: int):
        KV = self.args.num_key_value_heads
        if q.shape[0] == 1:
            fin = None
            if isinstance(q, _QkvAcc):
                fin = dict(acc=self.d["acc_qkv"], q_norm=q.layer.q_norm, k_norm=q.layer.k_norm, cos=self.cos,
                           sin=self.sin, eps=self.args.rms_norm_eps,
                           ss=(self.d["ss_attn"], self._ss_n["attn"], self.args.hidden_size))
                q = q.q
            parts = attention_decode(q, self.k_cache[i], self.v_cache[i], pos0 + 1, KV, self._attn_split_count(pos0 + 1),
                                     self.d["part_o"], self.d["part_ml"], None,
                                     self.d["pos"] if self.graphs else None, finish=fin,
                                     min_chunk=self.attn_min_chunk, o_merge=self.o_merge,
                                     max_keys=self._attn_regime(pos0 + 1),
                                     merged=self.d["attn"] if self.attn_cm else None)
            if isinstance(parts, _AttnParts):
                parts.layer = i  # the o GEMV adds the layer's router rows where the MoE FFN half needs them
            return parts
        if self._graph_pos is not None:  # a prefill graph's capture: the position and maps read on the device
            return attention_prefill(q, self.k_cache, self.v_cache, pos0, KV, layer=i, pos_dev=self._graph_pos,
                                     kvmaps=self._pbuf[:_PBUF_POS])
        return attention_prefill(q, self.k_cache, self.v_cache, pos0, KV, layer=i)

    # ------------------------------------------------------------------ decode as one CUDA graph
    def begin_step(self, pos0: int, n_tokens: int) -> None:
        """Single-token steps read their position from device memory (so a graph can replay them). A
        forward of 2..arena_max_t tokens takes its activations from this ops' arena until end_step; a
        longer one gives the arena's arrays back to the pool first (its own are larger)."""
        global _ARENA
        self._argmax_ready = False
        if n_tokens == 1 and self._dev_pos != pos0:
            self.d["pos"].fill(pos0)
            self._dev_pos = pos0
        if 1 < n_tokens <= SETTINGS.arena_max_t:
            _ARENA = self._arena
        elif n_tokens > 1:
            self._arena.clear()

    def begin_layer(self) -> None:
        """The model's loop starts a decoder layer (the arena's slots alternate by layer)."""
        if _ARENA is not None:
            _ARENA.begin_layer()

    def end_step(self) -> None:
        global _ARENA
        _ARENA = None

    def decode_step(self, body, token: int | None, pos0: int):
        """Run `body` (the model's one-token forward) as a captured CUDA graph; logits [V] fp32.
        token None: the id the last sample_launch drew, read by the graph from d["token"] (the host
        may not know it yet)."""
        if token is None:
            assert self._draw_queued or self._sampled is not None, "no draw to decode"
        elif self._sampled is None or token != self._sampled:
            self.d["token"].fill(token)
            self._sampled = token
        self.begin_step(pos0, 1)
        self._graph, self._graph_argmax_n = self._decode_graph(self._attn_regime(pos0 + 1), body)
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
        if regime not in self._graphs:
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
            self._graphs[regime] = graph, n
        return self._graphs[regime]

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
            self.begin_step(pos0, 1)
            self._decode_graph(regime, lambda: body_at(pos0))
        self._dev_pos = None  # (d["pos"] was filled for the captures: the next step writes its own)
        return sorted(self._graphs)

    SAMPLED_TOKEN = SAMPLED_TOKEN

    def _attn_short_bound(self, n_keys: int) -> int:
        """The short-context regime (attn_short) that serves n_keys keys: the first bound at or above n_keys, else
        0 (the capacity's regime). Each regime is a decode graph of its own."""
        return decode_regime(self.attn_short, 0, n_keys)

    def _attn_regime(self, n_keys: int) -> int:
        """The most keys the decode graph that serves n_keys keys serves: its short regime's bound, else the
        capacity."""
        return decode_regime(self.attn_short, self.max_context, n_keys)

    def _attn_split_count(self, n_keys: int) -> int:
        """Flash decoding's grid of splits at n_keys keys: in a short-context regime only the splits its bound's
        keys can use (at a 33000-position capacity's split count the step at 512 keys measured 2.3% longer,
        change 116), else the capacity's. The o GEMV's merge takes the same count (_AttnParts.splits)."""
        bound = self._attn_short_bound(n_keys)
        if bound:
            # (with the clusters' merge, at most the splits one cluster holds)
            return min(self.attn_splits, math.ceil(bound / self.attn_min_chunk),
                       ATTN_CM_MAX if self.attn_cm else self.attn_splits)
        return self.attn_splits

    # ------------------------------------------------------------------ short prefills as CUDA graphs
    def prefill_graph(self, ids: list[int], pos0: int, layers):
        """A prompt's layers and final norm as one replayed CUDA graph: x [B, D] fp16, B = prefill_bucket(T), whose
        first T rows are the prompt's (the rest the padding's: ids 0 at positions pos0 + T..pos0 + B - 1, whose
        cache rows later steps overwrite before any step reads them), or None where the prefill runs eagerly: a
        prompt longer than prefill_graph_max_t, whose padded end passes the cache, or whose bucket this process has
        not met (the first prefill of a bucket runs eagerly: a capture costs as much host time as that prefill, so
        a one-off prompt does not pay it). One graph per bucket serves every position: the rotary embedding, the
        cache rows written and attention's keys come from the position the host writes before each replay, with
        the cache maps of the prompt's pos0 + B keys (change 207). layers(ids) runs the model's layers and final
        norm on a list of B ids."""
        T = len(ids)
        if not (self._prefill_graphs_on() and 1 < T <= SETTINGS.prefill_graph_max_t):
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
        top = min(SETTINGS.prefill_graph_max_t, self.max_context)
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
        rec = self._pgraphs.get(B)
        if rec is not None and rec[3] != _BUF_GEN[0]:
            del self._pgraphs[B]
            rec = None
        return rec

    def _capture_prefill(self, B: int, layers) -> tuple | None:
        """Capture layers() at B tokens: activations from the shared _BumpArena (grown and the capture retried
        while a region is too small; the graphs captured before then hold the old region and are dropped), every
        other allocation kept with the graph (the residual rows), the position, ids and the attention's cache maps
        read from self._pbuf. None where the prefill calls what a capture cannot hold (_NotCapturable); B is then
        never tried again (_pnever). Either way B counts as met (_pseen)."""
        global _ARENA
        self._pseen.add(B)
        if self._pbuf is None:
            self._pbuf = cp.zeros((_PBUF_IDS + 4 * SETTINGS.prefill_graph_max_t,), cp.uint8)  # (the pool's blocks: 512-aligned)
        # the kernels' counters that are made zeroed on first use, made now: inside a capture cp.zeros's memset is
        # captured, not run, and a capture that is retried or refused would leave them holding garbage
        gemv_counters(), moe_route_counter(), moe_route_tile_counters(), _gemm_split_buffers(0)
        pool, arena, stream = cp.get_default_memory_pool(), self._parena, self._stream
        for _ in range(64):
            keep, full, gen, refused = [], None, _BUF_GEN[0], False

            def alloc(n: int, keep=keep):
                m = pool.malloc(n)
                keep.append(m)
                return m
            arena.reset()
            prev, _ARENA = _ARENA, arena
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
                _ARENA = prev
                self._graph_ids = self._graph_pos = None
                _CAPTURING[0] = False
            if refused:
                self._pnever.add(B)
                return None
            if full is not None:
                self._pgraphs.clear()
                arena.grow(*full)
            elif gen == _BUF_GEN[0]:  # (else a module buffer grew during the capture: the retry meets the new one)
                assert x.shape[0] == B
                self._pgraphs[B] = rec = (graph, x, keep, gen)
                return rec
        raise AssertionError("a prefill graph's capture did not settle in 64 tries")

    def forget_position(self) -> None:
        """A queued step was discarded: the device's position no longer matches the host's."""
        self._dev_pos = None

    def linear(self, x, lin: AwqLinear):
        d = self.d
        if isinstance(x, _AttnParts):  # the o projection: merge the attention partials in its prologue
            if o_split(lin.K, math.ceil(lin.N / GEMV_COLS), x.splits, x.o_merge)[1] <= GEMV_ATT_ROWS and lin.N == self.args.hidden_size:
                def o_acc(h):
                    # with a one-launch FFN half, also clears the down and q|k|v accumulators (last read
                    # by this layer's q|k|v GEMV and attention, next written by that FFN and the next q|k|v)
                    rows = self._router_o.get(x.layer)  # (the MoE FFN half's logits: (R, Rh) of the layer)
                    gemv(None, [lin], "plain", None, d["partial"], att=x, acc_out=d["acc_o"],
                         zero=d["acc_d_qkv"] if self._ffn is not None or self._moe is not None else None,
                         router=(*rows, h, d["acc_z"]) if rows is not None else None)
                    return d["acc_o"]
                return _Deferred(lambda h: gemv(None, [lin], "plain", d["proj"], d["partial"], resid=h, att=x), o_acc)
        if isinstance(x, _FfnIn):  # the whole FFN half in one launch, its down sums to acc_d
            assert lin is x.layer.w2

            def ffn_half(h):
                return decode_ffn(self._ffn, x.x, x.layer, d["acc_d"], self.args.rms_norm_eps)
            return _Deferred(_acc_only("the one-launch FFN half"), ffn_half)
        if isinstance(x, _SwigluAcc):  # the down projection of accumulating mode: SwiGLU in its prologue
            ss = (d["ss_ffn"], self._ss_n["ffn"], self.args.hidden_size, self.args.rms_norm_eps)

            def down_acc(h):
                gemv(None, [lin], "plain", None, d["partial"], pend=x.acc, acc_out=d["acc_d"], ss_in=ss, zero=None)
                return d["acc_d"]
            return _Deferred(lambda h: gemv(None, [lin], "plain", d["proj"], d["partial"], pend=x.acc, resid=h,
                                            ss_in=ss), down_acc)
        x = self._x(x)
        if x.shape[0] == 1:
            if lin.N == self.args.hidden_size:  # o / down: its output only feeds the residual add
                return _Deferred(lambda h: gemv(x, [lin], "plain", self.d["proj"], self.d["partial"], resid=h))
            return gemv(x, [lin], "plain", cp.empty((1, lin.N), cp.float16), self.d["partial"])
        return gemm(x, lin)

    def gate_up_silu(self, x, layer: Layer):
        if x.shape[0] == 1:
            if self._ffn is not None and isinstance(x, _Normed):
                return _FfnIn(x, layer)  # launched by the down projection (linear)
            if self.acc_mode:  # [gate | up] sums to their accumulator (the down GEMV applies SwiGLU); clears
                # the down and q|k|v accumulators (last read by this layer's q|k|v GEMV and attention,
                # next written by the down GEMV and the next layer's q|k|v GEMV)
                self._ss_n["ffn"] = gemv(mats=[layer.w1, layer.w3], out_kind="swiglu", out=None,
                                         partial=self.d["partial"], acc_out=self.d["acc_gu"],
                                         zero=self.d["acc_d_qkv"], ss_out=self.d["ss_ffn"], **self._gemv_in(x))
                return _SwigluAcc(self.d["acc_gu"])
            # (accumulating attention half: clears the q|k|v accumulator, last read by this layer's attention)
            return gemv(mats=[layer.w1, layer.w3], out_kind="swiglu", out=self.d["act"], partial=self.d["partial"],
                        zero=self.d["acc_d_qkv"] if self.acc_attn else None, **self._gemv_in(x))
        return swiglu_prefill(x, layer.w1, layer.w3)

    def moe(self, x, layer: Layer):
        """Qwen3-MoE block, every stage on the device (see moe.cu); x [T, D] fp16 -> [T, D] fp16."""
        a, d = self.args, self.d
        k = a.num_experts_per_tok
        if isinstance(x, _Normed) and self._moe is not None:  # decode: top-k and experts in one launch (the
            # logits from this layer's o GEMV, its router rows)
            def moe_half(h):  # the weighted sum to acc_d (the next norm's consumer adds it to h)
                decode_moe_ffn(self._moe, x, layer, d["moe_ids"], d["moe_w"], d["acc_d"],
                               a.rms_norm_eps, k, a.norm_topk_prob, d["acc_z"])
                if self.routing_log is not None and not self.graphs:  # eager decode only
                    self.routing_log.append(cp.asnumpy(d["moe_ids"]))
                return d["acc_d"]
            return _Deferred(_acc_only("the one-launch MoE FFN half"), moe_half)
        if isinstance(x, _Normed):  # decode: the norm, router and top-k in one kernel, which also stores x
            # (and finishes the o projection's pending sums of accumulating mode: h + fp16(o) to x.hout)
            ids, w = moe_route_decode(x.h, x.w, a.rms_norm_eps, layer.router, k, a.norm_topk_prob, d["moe_logits"],
                                      d["x"], d["moe_ids"], d["moe_w"], d["moe_counter"], x.pend, x.hout)
            x = d["x"]
        else:
            x = self._x(x)
            ids = w = None
        if x.shape[0] == 1:
            if ids is None:
                ids, w = moe_route(x, layer.router, k, a.norm_topk_prob, d["moe_logits"], d["moe_ids"], d["moe_w"])
            if self.routing_log is not None and not self.graphs:  # eager decode only: a capture cannot copy out
                self.routing_log.append(cp.asnumpy(ids))
            # the expert gate/up GEMV clears the down and q|k|v accumulators (last read by this layer's
            # q|k|v GEMV and attention; next written by the expert down GEMV and the next q|k|v GEMV)
            zero = d["acc_d_qkv"] if self.acc_attn else None

            def run(h):
                return moe_decode(x, layer.experts_w13, layer.experts_w2, ids, w, d["partial"], d["moe_act"],
                                  d["proj"], resid=h, zero=zero)

            def run_acc(h):  # the sums to acc_d: the next norm's consumer adds them to h
                return moe_decode(x, layer.experts_w13, layer.experts_w2, ids, w, d["partial"], None, None,
                                  zero=zero, acc=(d["acc_gu"][:2 * k * a.moe_intermediate_size], d["acc_d"]))
            return _Deferred(run, run_acc if self.acc_moe else None)
        w13, w2 = layer.experts_w13, layer.experts_w2
        rs, bt = moe_experts_tile(w13, w2, x.shape[0] * k)
        maps = moe_maps_arrays(x.shape[0] * k, w13.E)  # built with the picks (moe_route_mma's last block)
        ids, w = moe_route(x, layer.router, k, a.norm_topk_prob, maps=(bt, *maps))
        if self.routing_log is not None:
            self.routing_log.append(cp.asnumpy(ids))
        # the weighted sum in the next add_rmsnorm
        return _ExpertRows(*moe_experts(x, w13, w2, ids, w, rs=rs, finalize=False, maps=maps))

    def logits(self, x, all_positions: bool = False):
        V = self.args.vocab_size
        x = self._x(x)
        if not all_positions:  # (while a decode graph is captured, greedy's argmax rides along: decode_step)
            n = self._capture_argmax
            return lm_head(cp.ascontiguousarray(x[-1]), self.weights.lm_head, self.d["logits"],
                           self.d["argmax"] if n else None, n or 0)
        out = cp.empty((x.shape[0], V), cp.float32)
        for r in range(x.shape[0]):
            lm_head(cp.ascontiguousarray(x[r]), self.weights.lm_head, out[r])
        return out

    def sample(self, logits, p: SamplingParams, rng: np.random.Generator, history: list[int], n_valid: int) -> int:
        """Penalty, temperature, top-k/top-p/min-p and the draw on the GPU; one int32 comes back."""
        self.sample_launch(logits, p, rng, history, n_valid)
        return self.sample_result()

    def sample_launch(self, logits, p: SamplingParams, rng: np.random.Generator, history: list[int],
                      n_valid: int) -> None:
        """Queue sample()'s draw without waiting for it: its id lands in d["token"] (where the next decode
        step's graph reads it, so that step may be queued at once: Qwen3.decode_sampled) and in pinned
        host memory for sample_result(). Nothing here waits for the GPU."""
        assert not self._draw_queued, "sample_result() must follow each sample_launch()"
        if logits.data.ptr % 16 or not logits.flags.c_contiguous:  # the kernel reads 16-byte vectors
            logits = cp.ascontiguousarray(logits).copy()
        hist = history[-p.repeat_last_n:] if (p.repeat_penalty != 1.0 and p.repeat_last_n) else []
        hist = hist[-1024:]
        # on the decode graphs' stream, so a step queued after the draw follows it without a cross-stream wait
        stream = self._stream
        if hist:  # from pinned memory: a pageable copy could wait for the step queued before it
            self._hist_host[:len(hist)] = hist
            cp.cuda.runtime.memcpyAsync(self.d["hist"].data.ptr, self._hist_host.ctypes.data, 4 * len(hist),
                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        d = self.d
        self._last_n_valid = n_valid
        if (p.temperature == 0 and not hist and self._argmax_ready and logits is d["logits"]
                and n_valid == self._graph_argmax_n):
            # the step's graph already drew it (greedy's argmax in lm_head, the id in advance_position)
            self._argmax_ready = False
            self.fused_draws += 1
            self._read_slot = self._argmax_slot
            self._tok_event.record(stream)
            self._draw_queued = True
            return
        self._argmax_ready = False
        self._read_slot = 0
        plan = draw_plan(n_valid, p)
        with stream:
            if getattr(self, "_rng", None) is not rng:  # a new generation: new seed, counter from zero
                self._rng, self._seed = rng, np.uint64(rng.integers(0, 2**63))
                d["step"].fill(0)
            # the id also goes straight to the pinned host int (mapped: its address is valid on the
            # device), so no copy follows the kernel
            args = (logits, _i(n_valid), d["hist"], _i(len(hist)), _f(p.repeat_penalty), _f(p.temperature),
                    _i(p.top_k), _f(p.top_p), _f(p.min_p), self._seed, d["step"], d["token"],
                    np.uint64(self._tok_host.ctypes.data))
            if plan is None:
                kernel("smp", "sample_token")((1,), (SMP_THREADS,), args)
            else:
                G, cap = plan
                kernel("smp", "sample_token_mb")((G,), (SMP_THREADS,), args + (
                    _i(SMP_CHUNK), d["smp_v"], d["smp_i"], d["smp_mx"], d["smp_n"], d["smp_counter"], _i(cap)))
        self._tok_event.record(stream)
        self._draw_queued = True

    def cancel_draw(self) -> None:
        """Wait out a queued draw whose id nobody will read (an interrupted generation)."""
        if self._draw_queued:
            self._tok_event.synchronize()
            self._draw_queued = False

    def sample_result(self) -> int:
        """The id of the draw sample_launch queued (waits for it; the pinned history buffer is free again)."""
        assert self._draw_queued, "sample_result() without sample_launch()"
        self._tok_event.synchronize()
        self._draw_queued = False
        tok = int(self._tok_host[self._read_slot])
        if tok < 0:
            raise KuiperError("the model produced no finite logit (NaN/Inf activations); the weights may be damaged")
        self._sampled = tok
        return tok

    @staticmethod
    def to_host(x) -> np.ndarray:
        return cp.asnumpy(x)
