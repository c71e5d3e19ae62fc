"""Attention: prefill flash attention (mma.sync or wgmma) and decode's flash decoding with its merge forms."""
from __future__ import annotations

import ctypes
import math

import numpy as np

from ...errors import KuiperError
from .. import settings as cfg
from ..memory import _empty, _f, _i
from .gemm import wgmma_available
from .gemv import ATTN_LONG_TILE, ATTN_MMA_KEYS, DECODE_MIN_CHUNK, spread_smem
from ..runtime.build import kernel, raw_kernel
from ..runtime.device import current_device_id
from ..runtime.launch import (_LaunchAttr, _cluster_attr, _cluster_policy_attr, allow_dynamic_smem,
                              cu_occupancy_clusters, launch_ex, pdl_attr, pdl_enabled, resident_clusters, tma_map_2d,
                              tma_map_cache)
from ..runtime.registry import ATTN_CM_HB, ATTN_CM_MAX, FW_CONFIGS, FW_NC3_FROM, fw_name

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


def attn_wgmma_fits(hd: int) -> bool:
    """flash_attn_wgmma's table: head dim 128 on compute capability 9.0 (attn_wgmma not "0")."""
    return cfg.SETTINGS.attn_wgmma != "0" and hd == 128 and wgmma_available()


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
        form = cfg.SETTINGS.fw_config or ((4, 2, 3) if T >= FW_NC3_FROM else (4, 1, 2))
        if form not in FW_CONFIGS:
            forms = " ".join(",".join(map(str, c)) for c in FW_CONFIGS)
            raise KuiperError(f"fw_config {','.join(map(str, form))} is not a compiled form of flash_attn_wgmma "
                              f"(stages,pipe,warpgroups: {forms})")
        st, pipe, nc = form
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


def decode_heads_per_block(n_heads: int, n_kv_heads: int, settings=None) -> int:
    """Query heads one flash-decoding block serves (attention.cu attn_decode_gqa): the largest
    divisor of the GQA group up to attn_max_heads_per_block (registers), or the whole group when it
    is at most 8 and has no divisor in 2..that limit (groups of 5 or 7)."""
    G = n_heads // n_kv_heads
    limit = (settings or cfg.SETTINGS).attn_max_heads_per_block
    best = max(d for d in range(1, min(G, limit) + 1) if G % d == 0)
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
    long_path = cfg.SETTINGS.attn_mma_long and f is not None and max(-(-most // S), min_chunk) > ATTN_MMA_KEYS
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
        allow_dynamic_smem(raw_kernel("attn", name), pad)
    kernel("attn", name)(grid, (128,), args + (np.uint64(0),), shared_mem=pad)
    parts = _AttnParts(part_o, part_ml, S, H, hd, n_keys, pos_dev, min_chunk, o_merge)
    return parts if out is None else attention_combine(parts, out)


def attn_cluster_merge(S: int, hb: int, hd: int) -> bool:
    """Whether a flash-decoding launch of S splits of hb heads of hd dims can merge in its clusters: sm_90 with
    PDL, an instantiation for hb, at most ATTN_CM_MAX splits, and each block's share of the head group's
    elements a whole number of 16-byte pushes."""
    return (hb in ATTN_CM_HB and 1 <= S <= ATTN_CM_MAX and (hb * hd) % (4 * S) == 0
            and pdl_enabled() and cu_occupancy_clusters() is not None)


_ATTN_CM_FNS: dict[tuple, object] = {}


def _attn_cm_fn(name: str, S: int, n: int):
    """The CM instantiation for a launch of n clusters of S blocks, or None where no such cluster can be
    resident (the driver refuses clusters past 8 blocks, or a partitioned GPU's SMs cannot hold 16 blocks of a
    GPC): the launch then leaves the merge to the o GEMV."""
    key = (current_device_id(), name, S)
    if key not in _ATTN_CM_FNS:
        fn = raw_kernel("attncm", name)
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
    GEMV prologue (gemv(att=...)), or attn_decode_combine merges them first (CupyOps._decode_attention)."""

    def __init__(self, part_o, part_ml, splits, heads, hd, n_keys, pos_dev, min_chunk, o_merge=False, merged=None):
        self.part_o, self.part_ml, self.splits, self.heads, self.hd = part_o, part_ml, splits, heads, hd
        self.n_keys, self.pos_dev, self.min_chunk, self.o_merge = n_keys, pos_dev, min_chunk, o_merge
        self.merged = merged  # the merged output (fp16 [1, H*hd]) where the clusters merged, else None
        self.shape = (1, heads * hd)


_CL_ATTRS: dict[tuple, ctypes.Array] = {}


def _cluster_launch_attrs(CL: int) -> ctypes.Array:
    """The attributes of a decode cluster launch: cluster dimension, PDL, scheduling preference. One array per
    (size, policy): launch_ex keys its launch configurations on the object, so per-step launches reuse them."""
    key = (CL, cfg.SETTINGS.cluster_policy)
    if key not in _CL_ATTRS:
        _CL_ATTRS[key] = (_LaunchAttr * 3)(_cluster_attr(CL), pdl_attr(), _cluster_policy_attr(key[1]))
    return _CL_ATTRS[key]
