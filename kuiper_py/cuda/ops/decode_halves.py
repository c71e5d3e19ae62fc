"""The one-launch decode halves: a dense layer's FFN (ffn_decode.cu) and a MoE layer's routing + experts
(moe_ffn_decode) as thread-block cluster launches, and the plans that decide where they run."""
from __future__ import annotations


import numpy as np

from ...config import ModelArgs
from .. import settings as cfg
from ..memory import _f, _i
from .attention import _cluster_launch_attrs
from .gemv import device_tuning
from .moe import MOE_MAX_EXPERTS, MOE_MAX_TOPK
from ..runtime.build import raw_kernel
from ..runtime.device import device_name, sm_count
from ..runtime.launch import cu_occupancy_clusters, pdl_attr, blocks_per_sm, launch_ex, pdl_enabled, resident_clusters
from ..runtime.registry import FFN_GLOBAL_CAPS, FFN_PAIRS, FFN_XCH_GLOBAL, FFN_XCH_PUSH

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


# the one-launch FFN half: "auto" where its grid holds at least FFN_AUTO_BLOCKS_PER_SM blocks per SM (measured
# faster at Qwen3-8B's 384 blocks on H100), "1" wherever it is served (tests), "0" off
FFN_AUTO_BLOCKS_PER_SM = 2


FFN_THREADS, FFN_CH, FFN_MAX_SPAN = 256, 256, 1024  # ffn_decode.cu's block, channels per cluster, span limit


def ffn_cluster_plan(CL: int, TB: int, n: int, kernel: str = "ffn_decode") -> dict:
    """The plan for ffn_decode.cu's kernel (ffn_decode or moe_ffn_decode) at its (CL, TB) instantiation
    over n clusters (the cluster's exchange by pushes into receive slots): kernel, launch attributes and how
    many of its clusters can be resident at once (all n must be: the caller checks)."""
    fn = raw_kernel("ffn", f"{kernel}<{CL}, {TB}, {FFN_XCH_PUSH}>")
    return dict(CL=CL, TB=TB, fn=fn, attrs=_cluster_launch_attrs(CL), clusters=resident_clusters(fn, CL, n, FFN_THREADS))


def _ffn_pairs(D: int) -> list[tuple[int, int]]:
    """ffn_decode.cu's (CL, TB) instantiations that tile the hidden size D, most blocks first."""
    return [(CL, TB) for CL, TB in FFN_PAIRS if D == 256 * CL * TB and D // CL <= FFN_MAX_SPAN]


def ffn_first_fit(kernel: str, D: int, n: int) -> tuple[dict | None, str]:
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
    line saying why not. A cluster owns 256 intermediate channels (ffn_first_fit picks the pair)."""
    if cfg.SETTINGS.decode_ffn not in ("auto", "1"):
        return None, "off (decode_ffn=0)"
    if not pdl_enabled() or cu_occupancy_clusters() is None:
        return None, "needs compute capability 9.0 (clusters, PDL)"
    D, I = a.hidden_size, a.intermediate_size
    if a.group_size != 128 or I % FFN_CH:
        return None, f"shape not served (group size {a.group_size}, intermediate {I})"
    n = I // FFN_CH
    plan, why = ffn_first_fit("ffn_decode", D, n)
    # the form without a cluster launch needs only a (CL, TB) pair, not clusters that fit
    pair = plan or next((dict(CL=cl, TB=tb) for cl, tb in _ffn_pairs(D)), None)
    if pair is not None and cfg.SETTINGS.decode_ffn == "auto" and pair["CL"] * n < FFN_AUTO_BLOCKS_PER_SM * sm_count():
        return None, (f"auto: off at {pair['CL'] * n} blocks for {sm_count()} SMs (a grid this small streams the "
                      f"weights slower than the separate GEMVs; decode_ffn=1 forces it)")
    if pair is not None and cfg.SETTINGS.ffn_global in ("auto", "1"):
        g, how = ffn_global_plan(pair, n, at_cap_only=cfg.SETTINGS.ffn_global == "auto")
        if g is not None:
            return g, how
    if plan is not None and cfg.SETTINGS.decode_ffn == "auto" and (D, I) in device_tuning().get("ffn_off", ()):
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


# The dense one-launch FFN without a cluster launch (ffn_decode.cu FfnSlots): registers
# for only as many blocks per SM as its grid needs (3 or 4, FFN_GLOBAL_CAPS) spread it evenly, and a channel tile's
# blocks exchange their sums through global memory. A cluster launch cannot be spread that way: clusters reach
# ~124 of an H100's 132 SMs, where 45 of Qwen3-8B's 48 clusters of 8 fit at 3 per SM, and 94 of 32B's
# 100 clusters of 5 at 4 (so 32B ran the separate GEMVs). H100 step timer at 512 keys: 8B -2.5%, 14B -2.7% against
# the cluster launch, 32B -9.7% against the separate GEMVs; H200: 8B -3.3%, 14B -6.6%. "auto" (default) where the
# grid needs one of those counts per SM, "1" at 3 per SM wherever its whole grid fits (tests), "0" never.
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
    fn = raw_kernel("ffn", f"ffn_decode<{CL}, {plan['TB']}, {FFN_XCH_GLOBAL}, {cap}>")
    per = blocks_per_sm(fn, FFN_THREADS)
    if per * sms < CL * n or at_cap_only and per != cap:
        return None, f"{CL * n} blocks at {per} per SM, not {cap}"
    return (dict(plan, fn=fn, attrs=pdl_attr(), xslots=cp.zeros((n * FFN_SLOT_BYTES // 4,), cp.float32),
                 xcnt=cp.zeros((n,), cp.uint64)),
            f"on, without a cluster launch: {n} channel tiles of {CL} blocks, {plan['TB']} down tiles per block "
            f"({CL * n} blocks at {per} per SM), the exchange through global memory")


# the one-launch MoE FFN half (ffn_decode.cu's moe_ffn_decode: the top-k and the selected experts in one
# cluster launch, the router's logits from the o GEMV before it; Qwen3-30B-A3B's decode step 2.6-2.9%
# shorter on H100 with the router in the cluster, docs/PERFORMANCE.md, and 6.3% more with the logits
# from the o GEMV): "auto" (default) and "1" wherever it is served, "0" off (the routing kernel
# and the two expert GEMVs)
def decode_moe_plan(a: ModelArgs) -> tuple[dict | None, str]:
    """(plan, why) for moe_ffn_decode (a MoE decode layer's top-k and experts in one cluster launch):
    the plan or None, and a line saying why not. A cluster owns 256 channels of one selected expert,
    k * moe_intermediate / 256 clusters in all (ffn_first_fit picks the pair)."""
    if cfg.SETTINGS.decode_moe not in ("auto", "1"):
        return None, "off (decode_moe=0)"
    if not pdl_enabled() or cu_occupancy_clusters() is None:
        return None, "needs compute capability 9.0 (clusters, PDL)"
    D, mI, E, k = a.hidden_size, a.moe_intermediate_size, a.num_experts, a.num_experts_per_tok
    if a.group_size != 128 or mI % FFN_CH or E > MOE_MAX_EXPERTS or k > MOE_MAX_TOPK:
        return None, f"shape not served (group size {a.group_size}, expert intermediate {mI}, {E} experts, top {k})"
    return ffn_first_fit("moe_ffn_decode", D, k * mI // FFN_CH)


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
