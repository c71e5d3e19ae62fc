"""The schedule as data. The decode plan: per decoder layer, which fused form of its attention half and its FFN half
runs, which int64 accumulator each launch adds into and which it clears, and the flash-decoding regimes. build() is a
pure function of the model's shape, the tuning, the GPU's facts and the cache's capacity (plus the one-launch halves'
launch configurations, which need the GPU's occupancy queries: CupyOps makes them where forms() allows one); CupyOps
builds the plan at load and again in alloc_cache, and its decode methods read it. The prefill plan (build_prefill):
for a prompt of T tokens, the GEMM path of each projection and the MoE experts' path and tile, by the rules the
prefill ops apply (gemm_rule, moe_experts_tile). describe() is the text `kuiper info MODEL --plan` prints."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import ModelArgs
from .ops.attention import decode_heads_per_block
from .ops.gemv import (GEMV_ATT_ROWS, GEMV_COLS, GEMV_O_COARSE_SPLITS, GEMV_O_MERGE_COARSE_SPLITS, Facts,
                       attn_cm, attn_min_chunk, attn_short, decode_acc_layout, decode_regime, decode_regimes,
                       gemv_split, o_merge, o_split, table_for)
from .ops.gemm import GEMM_BM, gemm_rule, rows_wgmma_min, wgmma_fits_shape
from .ops.moe import moe_rs_fits, moe_rs_tile, moe_tc_fits, moe_tc_tile
from .ops.rows import rows_fit_shape
from .runtime.registry import ATTN_CM_MAX
from .settings import Settings


@dataclass(frozen=True)
class Gpu:
    """The facts of a GPU the plan depends on."""
    name: str
    sms: int
    cc: int  # compute capability, major * 10 + minor

    @classmethod
    def current(cls) -> "Gpu":
        import cupy as cp
        from .runtime.device import device_name, sm_count
        return cls(device_name(), sm_count(), int(cp.cuda.Device().compute_capability))


def facts(settings: Settings, gpu: Gpu) -> Facts:
    """What the split rules read for this tuning on this GPU."""
    return Facts(settings, gpu.sms, table_for(settings, gpu.name))


@dataclass(frozen=True)
class Forms:
    """The model-wide choices the layers' forms follow. acc_attn: the attention half accumulates (q|k|v and o sums
    finished by their consumers, where their splits fit the staging prologue); acc_mode: the dense FFN too; acc_moe:
    the MoE experts' GEMVs too; o_fits: the o GEMV's merge prologue fits at its coarsest split, so a one-launch FFN
    half (which clears nothing itself) may follow the o GEMV that clears its accumulator."""
    acc_attn: bool
    acc_mode: bool
    acc_moe: bool
    o_fits: bool

    @property
    def ffn_half_allowed(self) -> bool:
        return self.acc_mode and self.o_fits

    def moe_half_allowed(self, a: ModelArgs) -> bool:
        return bool(a.num_experts) and self.acc_attn and self.o_fits


def forms(a: ModelArgs, settings: Settings, gpu: Gpu) -> Forms:
    """The accumulating modes this model takes on this GPU: a GEMV accumulates only where its rows per split fit
    the GEMV_ATT_ROWS its consumer stages."""
    f = facts(settings, gpu)
    D, I, qd, E, mI = a.hidden_size, a.intermediate_size, a.q_dim, a.num_experts, a.moe_intermediate_size

    def fits(*shapes):
        return all(gemv_split(K, math.ceil(N / GEMV_COLS), f=f)[1] <= GEMV_ATT_ROWS for K, N in shapes)
    acc_attn = settings.gemv_acc and fits((D, qd))
    return Forms(acc_attn, acc_attn and not E and fits((D, 2 * I), (I, D)),
                 acc_attn and bool(E) and mI <= GEMV_ATT_ROWS,
                 o_split(qd, math.ceil(D / GEMV_COLS), f=f)[1] <= GEMV_ATT_ROWS)


def is_moe_layer(a: ModelArgs, i: int) -> bool:
    """Whether decoder layer i has experts (Qwen3-MoE's mlp_only_layers and decoder_sparse_step)."""
    return bool(a.num_experts) and i not in a.mlp_only_layers and (i + 1) % a.decoder_sparse_step == 0


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a decode layer: what it reads, what it leaves for the next one, what it clears."""
    kernel: str
    does: str
    writes: str
    clears: tuple[str, ...] = ()


# the FFN half's forms: a dense layer's "ffn_half" (ffn_decode, one cluster launch), "gemv_acc" (gate|up sums to
# acc_gu, SwiGLU in the down GEMV's prologue, its sums to acc_d), "gemv" (SwiGLU in gate|up's epilogue, h += down);
# a MoE layer's "moe_half" (moe_ffn_decode), "moe_acc" (routing kernel, expert GEMVs, the weighted sum to acc_d),
# "moe" (the same, h += the weighted sum)
FFN_FORMS = ("ffn_half", "gemv_acc", "gemv", "moe_half", "moe_acc", "moe")


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer's decode forms. qkv_acc: the q|k|v GEMV sums to acc_qkv (clearing acc_o and acc_gu) and
    flash decoding finishes them (norm, RoPE, cache write); else they are its epilogue. o_acc: the o GEMV (where its
    merge prologue serves the step's splits, DecodePlan.o_prologue) sums to acc_o for the next norm's consumer; else
    h += o. o_clears: what the o GEMV clears; o_router: it adds the layer's router rows into acc_z. ffn: FFN_FORMS;
    ffn_clears: what the FFN's first launch clears."""
    moe: bool
    qkv_acc: bool
    o_acc: bool
    o_clears: tuple[str, ...]
    o_router: bool
    ffn: str
    ffn_clears: tuple[str, ...]

    @property
    def ffn_acc(self) -> bool:
        """The FFN half's output goes to acc_d (the next norm's consumer adds it to h)."""
        return self.ffn in ("ffn_half", "gemv_acc", "moe_half", "moe_acc")

    def launches(self) -> tuple[Launch, ...]:
        """The layer's launches in order (o with its merge prologue)."""
        return tuple(_attention_half(self) + _ffn_half(self))


_D_QKV = ("acc_d", "acc_qkv")  # decode_acc_layout's acc_d_qkv: cleared together
_O_GU = ("acc_o", "acc_gu", "acc_z")  # its acc_o_gu


def _attention_half(lp: LayerPlan) -> list[Launch]:
    """q|k|v, flash decoding and o: the launches every decode layer starts with."""
    router = "; the router's rows -> acc_z" if lp.o_router else ""
    if lp.qkv_acc:
        return [Launch("gemv_w4a16 q|k|v", "RMSNorm of h (+ the pending o/down sums) in its prologue", "acc_qkv",
                       _O_GU),
                Launch("attn_decode_gqa", "q/k RMSNorm, RoPE and the KV-cache write from acc_qkv, then attention",
                       "per-split partials (or the merged row)"),
                Launch("gemv_w4a16 o", "merges the splits in its prologue",
                       ("acc_o" if lp.o_acc else "h += o (epilogue)") + router, lp.o_clears)]
    return [Launch("gemv_w4a16 q|k|v", "RMSNorm of h in its prologue; q/k norm, RoPE, KV write in its epilogue",
                   "q (rotated), the cache rows"),
            Launch("attn_decode_gqa", "attention", "per-split partials (or the merged row)"),
            Launch("gemv_w4a16 o", "merges the splits in its prologue",
                   ("acc_o" if lp.o_acc else "h += o (epilogue)") + router, lp.o_clears)]


def _ffn_half(lp: LayerPlan) -> list[Launch]:
    if lp.ffn == "ffn_half":
        return [Launch("ffn_decode", "RMSNorm of h + o, gate/up, SwiGLU and down in one cluster launch", "acc_d")]
    if lp.ffn == "gemv_acc":
        return [Launch("gemv_w4a16 gate|up", "RMSNorm of h + o in its prologue", "acc_gu", lp.ffn_clears),
                Launch("gemv_w4a16 down", "SwiGLU of acc_gu in its prologue", "acc_d")]
    if lp.ffn == "gemv":
        return [Launch("gemv_w4a16 gate|up", "RMSNorm in its prologue, SwiGLU in its epilogue", "act", lp.ffn_clears),
                Launch("gemv_w4a16 down", "split-K reduction", "h += down (epilogue)")]
    if lp.ffn == "moe_half":
        return [Launch("moe_ffn_decode", "top-k of acc_z, the selected experts' gate/up, SwiGLU and down, weighted",
                       "acc_d")]
    return [Launch("moe_route_decode", "RMSNorm, router logits and top-k", "ids, weights, x"),
            Launch("gemv_w4a16 experts' gate|up", "the k experts side by side", "act", lp.ffn_clears),
            Launch("gemv_w4a16 experts' down", "the routing-weighted sum over the k slots",
                   "acc_d" if lp.ffn == "moe_acc" else "h += sum (epilogue)")]


def layer_plan(a: ModelArgs, fm: Forms, i: int, ffn_half: bool, moe_half: bool) -> LayerPlan:
    """Layer i's forms: the model's Forms and whether the one-launch FFN / MoE FFN half is configured."""
    moe = is_moe_layer(a, i)
    if moe:
        ffn = "moe_half" if moe_half else "moe_acc" if fm.acc_moe else "moe"
    else:
        ffn = "ffn_half" if ffn_half else "gemv_acc" if fm.acc_mode else "gemv"
    # a one-launch half clears nothing: the o GEMV before it clears acc_d and acc_qkv (last read by this layer's
    # q|k|v GEMV and attention, next written by that half and the next q|k|v GEMV); otherwise the FFN's first
    # GEMV does, in accumulating mode
    half = ffn_half or moe_half
    ffn_clears = () if ffn in ("ffn_half", "moe_half") or not (fm.acc_attn or ffn == "gemv_acc") else _D_QKV
    return LayerPlan(moe, fm.acc_attn, fm.acc_attn, _D_QKV if half else (), moe and moe_half, ffn, ffn_clears)


def attn_splits(a: ModelArgs, settings: Settings, sms: int, max_context: int) -> int:
    """Flash-decoding splits per head group at capacity (a block serves decode_heads_per_block query heads): at
    least attn_per_sm blocks per SM over all groups; for a larger cache about attn_keys_per_split keys per split
    when full, capped at 3 blocks per SM (8 with the scalar loop). The kernel leaves splits idle while the context
    is short (attention.cu decode_chunk)."""
    H = a.num_attention_heads
    groups = H // decode_heads_per_block(H, a.num_key_value_heads, settings)
    return max(1, math.ceil(settings.attn_per_sm * sms / groups),
               min(math.ceil(max_context / settings.attn_keys_per_split),
                   (3 if settings.attn_mma_long else 8) * sms // groups))


def split_count(bounds: tuple[int, ...], splits: int, min_chunk: int, cm: bool, n_keys: int) -> int:
    """Flash decoding's splits at n_keys keys for short-context bounds, the capacity's splits, the fewest keys per
    split and the clusters' merge (DecodePlan.split_count)."""
    bound = decode_regime(bounds, 0, n_keys)
    if bound:
        return min(splits, math.ceil(bound / min_chunk), ATTN_CM_MAX if cm else splits)
    return splits


@dataclass(frozen=True)
class DecodePlan:
    gpu: Gpu
    forms: Forms
    ffn: str  # the one-launch FFN half: its form, or why not
    moe: str  # the one-launch MoE FFN half: its form, or why not
    layers: tuple[LayerPlan, ...]
    accumulators: tuple[tuple[str, int], ...]  # (name, int64 words) of the accumulator block
    max_context: int
    attn_splits: int
    attn_short: tuple[int, ...]
    attn_cm: bool
    o_merge: bool
    attn_min_chunk: int
    o_fits: tuple[bool, bool]  # the o GEMV's merge prologue fits: up to o_coarse_splits splits, past them
    o_coarse_splits: int
    graphs: bool
    prefill_graph_max_t: int
    # the one-launch halves' launch configurations (decode_halves), None where the layers do not take them
    ffn_launch: dict | None = field(default=None, compare=False, repr=False)
    moe_launch: dict | None = field(default=None, compare=False, repr=False)

    @property
    def acc_attn(self) -> bool:
        return self.forms.acc_attn

    @property
    def acc_mode(self) -> bool:
        return self.forms.acc_mode

    @property
    def acc_moe(self) -> bool:
        return self.forms.acc_moe

    @property
    def dense(self) -> tuple[Launch, ...]:
        """A dense layer's launches (the first one's; () where the model has none)."""
        return next((lp.launches() for lp in self.layers if not lp.moe), ())

    @property
    def moe_layer(self) -> tuple[Launch, ...]:
        return next((lp.launches() for lp in self.layers if lp.moe), ())

    def o_prologue(self, splits: int) -> bool:
        """Whether the o GEMV merges flash decoding's `splits` partials in its prologue (its rows per split fit
        the staging buffer); else attn_decode_combine merges them and o is a plain GEMV with h += o."""
        return self.o_fits[splits > self.o_coarse_splits]

    def regime(self, n_keys: int) -> int:
        """The most keys the decode graph that serves n_keys keys serves: its short regime's bound, else the
        capacity (each regime is a decode graph of its own)."""
        return decode_regime(self.attn_short, self.max_context, n_keys)

    def split_count(self, n_keys: int) -> int:
        """Flash decoding's grid of splits at n_keys keys: in a short-context regime only the splits its bound's
        keys can use (at a 33000-position capacity's split count the step at 512 keys measured 2.3% longer), else
        the capacity's (with the clusters' merge, at most the splits one cluster holds). The o GEMV's merge takes
        the same count."""
        return split_count(self.attn_short, self.attn_splits, self.attn_min_chunk, self.attn_cm, n_keys)

    def describe(self) -> str:
        """The plan as text: the model-wide choices, the regimes, then each run of alike layers, one launch a
        line."""
        g = self.gpu
        out = [f"decode plan on {g.name} ({g.sms} SMs, sm_{g.cc}): CUDA graphs {_yn(self.graphs)}, "
               f"prefill graphs up to {self.prefill_graph_max_t} tokens",
               f"accumulating mode: attention {_yn(self.acc_attn)}, dense FFN {_yn(self.acc_mode)}, "
               f"MoE experts {_yn(self.acc_moe)}",
               f"one-launch FFN half: {self.ffn}", f"one-launch MoE FFN half: {self.moe}",
               f"flash decoding: {self.attn_splits} splits at capacity ({self.max_context} positions), at least "
               f"{self.attn_min_chunk} keys each; o GEMV's 16-split merge {_yn(self.o_merge)}"]
        for r in decode_regimes(self.attn_short, self.max_context):
            s, short = self.split_count(r), r in self.attn_short
            how = "in its prologue" if self.o_prologue(s) else "by attn_decode_combine, then a plain o GEMV"
            cm = " (merged by their clusters where they fit)" if self.attn_cm and short else ""
            out.append(f"  up to {min(r, self.max_context)} keys: a graph of {s} splits{cm}; o merges them {how}")
        if not self.graphs:
            out.append(f"  (eager steps: ceil(keys / {self.attn_min_chunk}) of the regime's splits, o's merge as above "
                       f"for that count)")
        if self.accumulators:
            out.append("accumulators (int64): " + ", ".join(f"{n} [{w}]" for n, w in self.accumulators))
        for lo, hi, lp in _runs(self.layers):
            out.append(f"layers {lo}-{hi} ({'MoE' if lp.moe else 'dense'}):" if hi > lo else
                       f"layer {lo} ({'MoE' if lp.moe else 'dense'}):")
            out += [f"  {i + 1}. {ln.kernel}: {ln.does} -> {ln.writes}"
                    + (f"; clears {', '.join(ln.clears)}" if ln.clears else "")
                    for i, ln in enumerate(lp.launches())]
        return "\n".join(out)


def _runs(layers):
    """(first, last, plan) of each run of consecutive layers with the same plan."""
    out = []
    for i, lp in enumerate(layers):
        if out and out[-1][2] == lp:
            out[-1][1] = i
        else:
            out.append([i, i, lp])
    return [tuple(r) for r in out]


def _yn(b: bool) -> str:
    return "on" if b else "off"


def build(a: ModelArgs, settings: Settings, gpu: Gpu, max_context: int, *, ffn=(None, "off"), moe=(None, "off"),
          graphs: bool = True, fm: Forms | None = None) -> DecodePlan:
    """The decode plan of this model on this GPU with this tuning and cache capacity. ffn, moe: the one-launch
    halves' (launch configuration or None, why), made by decode_halves where forms() allows them; fm: the forms
    the backend's buffers were sized for (default: forms() of these inputs)."""
    f, fm = facts(settings, gpu), fm or forms(a, settings, gpu)
    assert ffn[0] is None or fm.ffn_half_allowed, "the one-launch FFN half needs accumulating mode and o's prologue"
    assert moe[0] is None or fm.moe_half_allowed(a), "the one-launch MoE FFN half needs a MoE model in acc mode"
    layers = tuple(layer_plan(a, fm, i, ffn[0] is not None, moe[0] is not None) for i in range(a.num_hidden_layers))
    accs = ()
    if fm.acc_attn:
        E, k, mI = a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size
        _, parts = decode_acc_layout(a.hidden_size, max(2 * a.intermediate_size, 2 * k * mI if E else 0), E,
                                     a.q_dim + 2 * a.kv_dim)
        accs = tuple((n, parts[n].stop - parts[n].start) for n in ("acc_o", "acc_gu", "acc_z", "acc_d", "acc_qkv"))
    merge = o_merge(a, f)
    o_tiles = math.ceil(a.hidden_size / GEMV_COLS)
    coarse = GEMV_O_MERGE_COARSE_SPLITS if merge else GEMV_O_COARSE_SPLITS
    o_fits = tuple(o_split(a.q_dim, o_tiles, s, merge, f)[1] <= GEMV_ATT_ROWS for s in (coarse, coarse + 1))
    return DecodePlan(gpu, fm, ffn[1], moe[1], layers, accs, max_context,
                      attn_splits(a, settings, gpu.sms, max_context), attn_short(a, f), attn_cm(a, f), merge,
                      attn_min_chunk(a, f), o_fits, coarse, graphs, settings.prefill_graph_max_t, ffn[0], moe[0])


def describe(model) -> str:
    """The decode and prefill plans of a model loaded on the GPU (model.Qwen3 over CupyOps), as text: what `kuiper
    info MODEL --plan` prints."""
    return model.ops.plan.describe() + "\n" + model.ops.prefill_plan.describe(model.ops.max_context)


# the prompt lengths describe() shows the prefill plan at
PREFILL_SHOWN = (2, 4, 8, 16, 17, 64, 128, 256, 512, 1024, 2048, 8192)


@dataclass(frozen=True)
class PrefillPlan:
    """The prefill schedule of a model on a GPU: for T prompt rows, the path gemm() takes for each projection of a
    layer (gemm_rule: "rows" gemv_rows.cu for 2..rows_max_m rows, "wgmma" / "rs" the fused Hopper GEMMs, "dequant"
    dequantization + cuBLAS, "mma" the W4A16 MMA GEMM) and the MoE experts' path and rows per tile. projections:
    (name, K, the N of each matrix side by side, group size); experts: (E, top-k, D, expert intermediate, group,
    whether the Hopper expert GEMMs run) or None. fused_ok: the fused wgmma GEMMs run on this GPU (compute capability
    9.0, TMA descriptors and cuLaunchKernelEx); cublas: cuBLAS is loaded."""
    gpu: Gpu
    settings: Settings
    fused_ok: bool
    cublas: bool
    projections: tuple[tuple[str, int, tuple[int, ...], int], ...]
    experts: tuple[int, int, int, int, int, bool] | None

    def path(self, name: str, T: int) -> str:
        """gemm()'s path for T rows of the projection `name` (q|k|v, o, gate|up, gate, down)."""
        _, K, Ns, g = next(p for p in self.projections if p[0] == name)
        N = sum(Ns)
        wg_min = rows_wgmma_min(table_for(self.settings, self.gpu.name), K, N)
        return gemm_rule(T, K, N, rows_fit_shape(K, Ns, g), self.fused_ok and wgmma_fits_shape(K, Ns, g),
                         self.cublas, self.settings, wg_min)

    def experts_tile(self, T: int) -> tuple[bool, int]:
        """(Hopper expert GEMMs, rows per tile) of moe_experts for T tokens (T * top-k routed rows)."""
        E, k, D, inter, g, rs = self.experts
        if not rs:
            return False, GEMM_BM
        n = T * k
        tm = moe_tc_tile(n, E, self.settings) if moe_tc_fits(D, inter, g) else None
        return True, tm or moe_rs_tile(n, E, self.settings)

    def describe(self, max_t: int) -> str:
        """The plan as text: a line per prompt length of PREFILL_SHOWN up to max_t, a column per projection."""
        s = self.settings
        names = [p[0] for p in self.projections if p[0] != "gate"]
        out = [f"prefill plan on {self.gpu.name} (sm_{self.gpu.cc}): fused wgmma GEMMs {_yn(self.fused_ok)}, cuBLAS "
               f"{_yn(self.cublas)}; activations from the arena up to {s.arena_max_t} tokens, graphs up to "
               f"{s.prefill_graph_max_t} (a replay runs at its bucket's length: the paths of that length's line)",
               "tokens | " + " | ".join(names) + (" | experts (tile rows)" if self.experts else "")]
        for T in (t for t in PREFILL_SHOWN if t <= max_t):
            cells = []
            for n in names:
                p = self.path(n, T)
                if n == "gate|up" and p not in ("wgmma", "rs", "rows"):  # (swiglu_prefill: gate and up apart)
                    p = f"{self.path('gate', T)} x2"
                cells.append(p)
            if self.experts:
                rs, tile = self.experts_tile(T)
                cells.append(f"{'tc' if rs and tile <= 32 else 'rs' if rs else 'mma'} ({tile})")
            out.append(f"{T} | " + " | ".join(cells))
        return "\n".join(out)


def build_prefill(a: ModelArgs, settings: Settings, gpu: Gpu, fused_ok: bool, cublas: bool, group: int,
                  experts_group: int | None = None, experts_rs: bool = False, dense: bool | None = None,
                  experts: int | None = None) -> PrefillPlan:
    """The prefill plan of this model (weights quantized in groups of `group`, the experts' in experts_group) on this
    GPU with this tuning; experts_rs: the Hopper expert GEMMs run (moe_rs_path); dense: whether some layers have a
    dense MLP (default: a dense model, or mlp_only_layers or decoder_sparse_step > 1); experts: the experts a layer's
    stack holds (default num_experts; a tensor-parallel rank holds its share)."""
    D, qd, kvd = a.hidden_size, a.q_dim, a.kv_dim
    projs = [("q|k|v", D, (qd, kvd, kvd), group), ("o", qd, (D,), group)]
    if dense if dense is not None else (not a.num_experts or bool(a.mlp_only_layers) or a.decoder_sparse_step > 1):
        I = a.intermediate_size
        projs += [("gate|up", D, (I, I), group), ("gate", D, (I,), group), ("down", I, (D,), group)]
    moe = None
    if a.num_experts:
        eg = experts_group or group
        moe = (experts or a.num_experts, a.num_experts_per_tok, D, a.moe_intermediate_size, eg,
               experts_rs and moe_rs_fits(D, a.moe_intermediate_size, eg))
    return PrefillPlan(gpu, settings, fused_ok, cublas, tuple(projs), moe)
