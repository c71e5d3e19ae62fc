"""Decode's W4A16 GEMV (gemv_w4a16.cu): its split-K rule, the per-GPU launch choices and the launch itself."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ...config import ModelArgs
from ...loader import AwqLinear
from .. import settings as cfg
from ..memory import _COUNTERS, _device_zeros, _f, _i
from ..runtime.build import kernel, raw_kernel
from ..runtime.device import current_device_id, device_attrs, device_name, sm_count
from ..runtime.launch import allow_dynamic_smem, blocks_per_sm
from ..runtime.registry import GEMV_O_MIN_BLOCKS, GEMV_ROWS, gemv_name

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


# the grid size the split aims at: 4 blocks per SM measured best on H100 with the tiled layout and
# the first loads ahead of pdl_wait (3 and 6 tried; 3 was best before). gemv_blocks_per_sm sets it
# on every GPU and shape; unset, a GEMV takes device_tables's target for its shape on this GPU, else
# GEMV_BASE_BLOCKS_PER_SM (gemv_blocks_per_sm)
GEMV_BASE_BLOCKS_PER_SM = 4.0


# a target below the base never takes a projection under min(gemv_min_splits, its splits at the base):
# 3 per SM would give Qwen3-32B's gate/up two splits of 2560 rows, 6.6% slower per step (with
# gemv_blocks_per_sm=3 on the H200, the floor's 3 x 1792 measured 2.6% faster)
# the o GEMV (its prologue merges flash decoding's partials) aims at 3 while flash decoding has at most
# GEMV_O_COARSE_SPLITS splits: since its blocks are spread over the SMs, a grid that does not
# fill every SM's registers lets the next kernel's blocks sit resident at their PDL wait with their first
# loads out (a residency gap). Qwen3-8B's o then takes 16 splits of 256 rows instead of 32 of
# 128, two heads merged per block: 0.6% shorter steps at 512 and 8k (33 attention splits), 0.7% longer
# at 32k (65) with decode_merge, hence the bound; with gemv_merge_span (below)
# 1.3% shorter at 32k on the H100, so there the bound covers the 80 splits of a 40960-position cache
# (GEMV_O_MERGE_COARSE_SPLITS). The other projections stay at 4: 3 for all of them made
# Qwen3-32B's gate/up two splits of 2560 rows, 6.6% slower per step
GEMV_O_COARSE_SPLITS = 48


GEMV_O_MERGE_COARSE_SPLITS = 80


# split-K on the wave tail (gemm_wgmma.cu): the tiles of a partial last wave each split into up to
# this many K ranges, so that wave takes 1/split of the time (q|k|v at 512 rows: 192 tiles on 132
# SMs, 1.45 waves run as 2); 1 turns it off
GEMV_STEP = 8 * GEMV_ROWS  # rows a block's 8 warps take per step: the split granularity


GEMV_COLS = 256


GEMV_EPI = {"plain": 0, "swiglu": 1, "moe_sum": 2, "qkv_rope": 3}


SUPPORTED_HEAD_DIMS = (64, 128)


# flash decoding's fewest keys per split (common.cuh decode_chunk; the kernels' own default below): device_tables's
# "attn_min_chunk" for the model's shape, else DECODE_MIN_CHUNK; attn_min_chunk sets it
DECODE_MIN_CHUNK = 32


# the short-context regimes of flash decoding (attn_short): attn_short key counts ("512,1024"),
# "0" none, unset: device_tables's "attn_short" for the model's shape
# flash decoding's splits merged by their own cluster (attention.cu attn_decode_gqa CM) instead of in the o GEMV's
# prologue: "1" / "0" for every shape, unset: device_tables's "attn_cm"
# flash decoding's splits past ATTN_MMA_KEYS keys on tensor cores (attn_decode.cuh attn_split_mma_long), which
# needs a second 64-key tile buffer of dynamic shared memory; attn_mma_long=0: the scalar loop
# flash-decoding split size at capacity, and the most blocks per SM the splits may take: the long path's
# blocks hold ~70 KB of shared memory (3 per SM), and its splits cost little arithmetic per key
ATTN_MMA_KEYS, ATTN_LONG_TILE = 64, 64  # attn_decode.cuh


# Launches whose blocks are spread evenly over the SMs (spread_smem): "attn" (flash decoding), "gemv"
# (the decode GEMVs). Not the one-launch FFN: its clusters need
# a free slot on 8 SMs of a GPC, and capping the slots left 8B's 48 clusters no room (+15% per step); its
# form without clusters caps itself by registers (ffn_global_plan)
_SPREAD: dict[tuple, int] = {}


def spread_smem(family: str, name: str, blocks: int, threads: int) -> int:
    """Dynamic shared memory (bytes, unused by the kernel) that lets at most ceil(blocks / SMs) blocks
    of kernel `name` of `family` sit on one SM, or 0 where its registers already do (or no size does). A
    grid of fewer blocks than the SMs could hold is otherwise placed where space frees first: flash
    decoding's 264 blocks landed on ~93 SMs, up to 4 per SM, beside idle ones. Worked out once per (device, kernel, grid, block); a launch then costs one dict lookup."""
    key = (current_device_id(), family, name, blocks, threads)
    pad = _SPREAD.get(key)
    if pad is None:
        pad = _SPREAD[key] = _spread_smem(raw_kernel(family, name), blocks, threads)
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
    return table_for(cfg.SETTINGS, device_name())


def table_for(settings, name: str) -> dict:
    """The per-GPU table's entry of settings for a device named name ({} where none matches)."""
    return next((t for key, t in settings.device_tables.items() if key in name), {})


class Facts(NamedTuple):
    """What the split and attention rules read: the tuning, the SM count and the per-GPU table's entry. The rules
    take one to decide for a GPU other than the current one (cuda/plan.py); None: the active tuning on this GPU."""
    settings: object
    sms: int
    table: dict


def _st(f: Facts | None) -> tuple:
    """(settings, table) of facts f, or the active ones on this GPU."""
    return (cfg.SETTINGS, device_tuning()) if f is None else (f.settings, f.table)


def _attn_shape(a: ModelArgs) -> tuple[int, int, int, int]:
    """device_tables's key for a model's attention settings: (hidden, heads, kv heads, head dim)."""
    return (a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim)


def attn_min_chunk(a: ModelArgs, f: Facts | None = None) -> int:
    """Flash decoding's fewest keys per split for this model on this GPU (attn_min_chunk)."""
    s, table = _st(f)
    return s.attn_min_chunk or table.get("attn_min_chunk", {}).get(_attn_shape(a), DECODE_MIN_CHUNK)


def _shape_switch(override: bool | None, key: str, a: ModelArgs, table: dict) -> bool:
    """An on/off choice per attention shape: the setting where it is not None, else whether the per-GPU table's
    key lists this model's shape on this GPU."""
    if override is not None:
        return override
    return _attn_shape(a) in table.get(key, ())


def o_merge(a: ModelArgs, f: Facts | None = None) -> bool:
    """Whether the o GEMV may merge flash decoding's partials with gemv_merge_span (gemv_o_merge, else
    device_tables's "o_merge" for this model on this GPU)."""
    s, table = _st(f)
    return _shape_switch(s.gemv_o_merge, "o_merge", a, table)


def attn_cm(a: ModelArgs, f: Facts | None = None) -> bool:
    """Whether decode's flash decoding merges its splits in its clusters where it can (attn_cluster_merge; the
    short-context regime's graph, its splits capped at ATTN_CM_MAX): the attn_cm setting, else the per-GPU
    table's "attn_cm" for this model on this GPU."""
    s, table = _st(f)
    return _shape_switch(s.attn_cm, "attn_cm", a, table)


def attn_short(a: ModelArgs, f: Facts | None = None) -> tuple[int, ...]:
    """The key counts up to which flash decoding runs in a short-context regime (each a decode graph of its own
    whose grid holds only the splits its keys can use), ascending, () for
    none: the attn_short setting ((512, 1024); () none), else the per-GPU table's "attn_short" for this model on
    this GPU (an int or a tuple of ints)."""
    s, table = _st(f)
    if s.attn_short is not None:
        bounds = s.attn_short
    else:
        bounds = table.get("attn_short", {}).get(_attn_shape(a), ())
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


def gemv_blocks_per_sm(K: int, tiles: int, f: Facts | None = None) -> float:
    """The target blocks per SM of a GEMV over K rows and `tiles` column tiles: gemv_blocks_per_sm,
    else device_tables's for this shape on this GPU, else GEMV_BASE_BLOCKS_PER_SM."""
    s = cfg.SETTINGS if f is None else f.settings
    if s.gemv_blocks_per_sm:
        return s.gemv_blocks_per_sm
    table = device_tuning() if f is None else f.table
    return table.get("gemv_blocks_per_sm", {}).get((K, tiles * GEMV_COLS), GEMV_BASE_BLOCKS_PER_SM)


def gemv_counters():
    """The GEMV's arrival counters (zero between launches; each launch leaves them zero), per device."""
    return _device_zeros(_COUNTERS, 1 << 16)


def gemv_split(K: int, tiles: int, per_sm: float | None = None, f: Facts | None = None) -> tuple[int, int]:
    """(splits S, rows per split): about per_sm blocks per SM in one wave (default gemv_blocks_per_sm(K, tiles)),
    rows a multiple of GEMV_STEP; below GEMV_BASE_BLOCKS_PER_SM, never fewer than min(gemv_min_splits, the
    splits at the base). A smaller per_sm never gives more splits (gemv_partial_size relies on it)."""
    per_sm = per_sm or gemv_blocks_per_sm(K, tiles, f)
    sms, s = (sm_count(), cfg.SETTINGS) if f is None else (f.sms, f.settings)
    want = max(1, round(per_sm * sms / tiles))
    if per_sm < GEMV_BASE_BLOCKS_PER_SM:
        want = max(want, min(s.gemv_min_splits, round(GEMV_BASE_BLOCKS_PER_SM * sms / tiles)))
    rps = math.ceil(math.ceil(K / want) / GEMV_STEP) * GEMV_STEP
    return math.ceil(K / rps), rps


def o_split(K: int, tiles: int, attn_splits: int = 0, merge: bool = False, f: Facts | None = None
            ) -> tuple[int, int]:
    """gemv_split for the o GEMV over flash decoding's attn_splits partials (gemv_o_blocks_per_sm up to
    GEMV_O_COARSE_SPLITS of them, GEMV_O_MERGE_COARSE_SPLITS with gemv_merge_span's merge); attn_splits 0:
    the coarsest split it may take (for checks that it fits)."""
    coarse = attn_splits <= (GEMV_O_MERGE_COARSE_SPLITS if merge else GEMV_O_COARSE_SPLITS)
    s = cfg.SETTINGS if f is None else f.settings
    return gemv_split(K, tiles, min(s.gemv_o_blocks_per_sm, gemv_blocks_per_sm(K, tiles, f)) if coarse else None, f)


def gemv_partial_size(K: int, ns: list[int], slots: int = 1) -> int:
    """Floats of partial sums a gemv over matrices of widths ns needs."""
    S, _ = gemv_split(K, slots * sum(math.ceil(n / GEMV_COLS) for n in ns))
    return slots * S * sum(ns)


GEMV_ATT_ROWS = 4096  # gemv_w4a16.cu: rows per split a block stages in shared memory (the merge prologue needs it)


def decode_acc_layout(D: int, G: int, E: int, qkv: int) -> tuple[int, dict[str, slice]]:
    """Accumulating decode's int64 accumulators in one buffer: [o | gate, up | router z | down | q, k, v]
    (D, G, E, D, qkv elements), the size and each part's slice; acc_o_gu and acc_d_qkv are the two
    halves cleared together. Every part but z starts 16-byte aligned (an even offset), since its
    consumers read it in pairs (the GEMV prologue's longlong2 loads): z is padded to even."""
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
        tiles += (math.ceil(E / max(8, cfg.SETTINGS.gemv_rt_cols)) if cfg.SETTINGS.gemv_rt_cols > 0 else 1) + 1
    moe2 = out_kind == "moe_sum"
    S, rps = (gemv_split(K, slots * tiles, cfg.SETTINGS.gemv_moe_blocks_per_sm) if moe2 else
              o_split(K, tiles, att.splits, att.o_merge) if att is not None else gemv_split(K, slots * tiles))
    n_total = sum(m.N for m in mats)
    assert slots * S * n_total <= partial.size and all(m.K == K for m in mats)
    assert slots * tiles + tiles <= gemv_counters().size
    assert out_kind != "swiglu" or (len(mats) == 2 and mats[0].N == mats[1].N)
    assert resid is None or (out_kind == "moe_sum" or (len(mats) == 1 and slots == 1)) and resid.size == mats[0].N
    # the prologue's vector loads: the row and hout by 16 bytes, the norm weight by 8
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
    om = (att is not None and att.merged is None and att.o_merge and att.splits > cfg.SETTINGS.gemv_o_merge_min_splits
          and math.ceil(tiles * S / sm_count()) <= GEMV_O_MIN_BLOCKS)
    # accumulating launches take the ACC instantiations, which hold no split-K tail code
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
