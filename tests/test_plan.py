"""The decode plan (kuiper_py.cuda.plan), built on the CPU from a model's shape, the tuning and a GPU's facts: its
per-layer forms against the derivation CupyOps made before the plan existed (the load-time flags and the decode
methods' branches, restated here over the active-settings split rules on a mocked device), for the synthetic presets
(Qwen3 0.6B-32B and 30B-A3B shapes among them) on several GPUs, settings and cache sizes; and describe()."""
import dataclasses
import math

import numpy as np
import pytest

from kuiper_py.config import ModelArgs
from kuiper_py.cuda import plan
from kuiper_py.cuda import settings as cfg
from kuiper_py.cuda.ops import gemv as gv
from kuiper_py.cuda.ops.attention import decode_heads_per_block
from kuiper_py.cuda.settings import Settings
from kuiper_py.quant import kept_fp16
from kuiper_py.synth import MOE_PRESETS, PRESETS, hf_config
from reference import patch, tune

GPUS = [plan.Gpu("NVIDIA H100 80GB HBM3", 132, 90), plan.Gpu("NVIDIA H200", 132, 90),
        plan.Gpu("NVIDIA H100 PCIe", 114, 90), plan.Gpu("NVIDIA A100-SXM4-80GB", 108, 80)]
TUNINGS = [{}, {"gemv_acc": False}, {"gemv_blocks_per_sm": 3.0}, {"gemv_blocks_per_sm": 1.0},
           {"gemv_o_blocks_per_sm": 4.0, "gemv_o_merge": True}, {"gemv_min_splits": 1, "gemv_blocks_per_sm": 2.0},
           {"gemv_o_blocks_per_sm": 0.1, "gemv_min_splits": 1},  # o's prologue only past the coarse bound
           {"attn_short": (25, 300), "attn_cm": True, "attn_min_chunk": 7}, {"attn_mma_long": False,
                                                                             "attn_max_heads_per_block": 2}]
CONTEXTS = (64, 4096, 40960)


def _args(preset: str) -> ModelArgs:
    return ModelArgs.from_hf_config(hf_config(preset))


def _router_layers(preset: str) -> set[int]:
    """The layers with a router, as the exporter keeps them (an independent reading of mlp_only_layers)."""
    return {int(n.split(".")[2]) for n in kept_fp16(hf_config(preset)) if n.endswith(".mlp.gate")}


def _old(a: ModelArgs, router_layers: set[int], max_context: int, ffn_served: bool, moe_served: bool) -> dict:
    """What CupyOps decided before the plan, on the active settings and the mocked device: its load-time flags
    (_alloc_decode, __init__, alloc_cache) and, per layer, the branches its decode methods took."""
    s = cfg.SETTINGS
    D, I, qd, E, mI = a.hidden_size, a.intermediate_size, a.q_dim, a.num_experts, a.moe_intermediate_size

    def fits(*shapes):
        return all(gv.gemv_split(K, math.ceil(N / gv.GEMV_COLS))[1] <= gv.GEMV_ATT_ROWS for K, N in shapes)
    acc_attn = s.gemv_acc and fits((D, qd))
    acc_mode = acc_attn and not E and fits((D, 2 * I), (I, D))
    acc_moe = acc_attn and bool(E) and mI <= gv.GEMV_ATT_ROWS
    o_clears = gv.o_split(qd, math.ceil(D / gv.GEMV_COLS))[1] <= gv.GEMV_ATT_ROWS
    ffn = ffn_served and acc_mode and o_clears
    moe = moe_served and bool(E) and acc_attn and o_clears
    H = a.num_attention_heads
    groups = H // decode_heads_per_block(H, a.num_key_value_heads)
    n_sm = gv.sm_count()
    splits = max(1, math.ceil(s.attn_per_sm * n_sm / groups),
                 min(math.ceil(max_context / s.attn_keys_per_split), (3 if s.attn_mma_long else 8) * n_sm // groups))
    merge = gv.o_merge(a)
    layers = []
    for i in range(a.num_hidden_layers):
        if i in router_layers:
            form = "moe_half" if moe else "moe_acc" if acc_moe else "moe"
            clears = not moe and acc_attn  # moe(): zero = acc_d_qkv if acc_attn
        else:
            form = "ffn_half" if ffn else "gemv_acc" if acc_mode else "gemv"
            clears = form == "gemv_acc" or form == "gemv" and acc_attn  # the gate|up GEMV's zero
        layers.append(dict(qkv_acc=acc_attn, o_acc=acc_attn, o_clears=ffn or moe, o_router=moe and i in router_layers,
                           ffn=form, ffn_clears=clears))
    return dict(acc=(acc_attn, acc_mode, acc_moe), o_clears=o_clears, layers=layers, splits=splits, merge=merge,
                o_fits=lambda S: gv.o_split(qd, math.ceil(D / gv.GEMV_COLS), S, merge)[1] <= gv.GEMV_ATT_ROWS,
                short=gv.attn_short(a), cm=gv.attn_cm(a), min_chunk=gv.attn_min_chunk(a))


def _plan(a, settings, gpu, max_context, ffn_served, moe_served):
    """plan.build as CupyOps calls it: the one-launch halves' configurations only where the forms allow them."""
    fm = plan.forms(a, settings, gpu)
    ffn = ({"CL": 8}, "on") if ffn_served and fm.ffn_half_allowed else (None, "off")
    moe = ({"CL": 4}, "on") if moe_served and fm.moe_half_allowed(a) else (None, "off")
    return plan.build(a, settings, gpu, max_context, ffn=ffn, moe=moe)


@pytest.mark.parametrize("preset", list(PRESETS) + list(MOE_PRESETS))
def test_plan_decisions_match_the_backends_old_derivation(preset, monkeypatch):
    a, routers = _args(preset), _router_layers(preset)
    checked, prologue = set(), set()
    for gpu in GPUS:
        patch(monkeypatch, "sm_count", lambda n=gpu.sms: n)
        patch(monkeypatch, "device_name", lambda n=gpu.name: n)
        for changes in TUNINGS:
            monkeypatch.setattr(cfg, "SETTINGS", Settings())
            tune(monkeypatch, **changes)
            settings = cfg.SETTINGS
            for ctx in CONTEXTS:
                for served in ((False, False), (True, True), (True, False), (False, True)):
                    old, p = _old(a, routers, ctx, *served), _plan(a, settings, gpu, ctx, *served)
                    assert (p.acc_attn, p.acc_mode, p.acc_moe) == old["acc"] and p.forms.o_fits == old["o_clears"]
                    assert len(p.layers) == a.num_hidden_layers
                    for i, (lp, want) in enumerate(zip(p.layers, old["layers"])):
                        assert lp.moe == (i in routers), i
                        got = dict(qkv_acc=lp.qkv_acc, o_acc=lp.o_acc, o_clears=bool(lp.o_clears),
                                   o_router=lp.o_router, ffn=lp.ffn, ffn_clears=bool(lp.ffn_clears))
                        assert got == want, (preset, gpu, changes, ctx, served, i)
                        assert lp.ffn_acc == (lp.ffn in ("ffn_half", "gemv_acc", "moe_half", "moe_acc"))
                    assert (p.attn_splits, p.o_merge, p.attn_short, p.attn_cm, p.attn_min_chunk) == (
                        old["splits"], old["merge"], old["short"], old["cm"], old["min_chunk"])
                    assert all(p.o_prologue(S) == old["o_fits"](S) for S in range(1, 300))
                    checked.add((p.acc_attn, p.layers[-1].ffn))
                    prologue.add(p.o_fits)
    assert len(checked) >= 2  # the tunings reach more than one form of every preset
    if a.q_dim > gv.GEMV_ATT_ROWS:  # and the o GEMV's two split regimes
        assert prologue == {(False, True), (True, True)}, prologue


def test_the_real_qwen3_shapes_take_their_measured_forms():
    """Qwen3-8B, 32B and 0.6B, and 30B-A3B on an H100 with the default tuning: every layer accumulates its
    attention half; the dense FFNs accumulate; 30B-A3B's experts too, and with its one-launch MoE half the o
    GEMV adds the router rows."""
    h100 = GPUS[0]
    for preset in ("8b", "32b", "0.6b"):
        p = _plan(_args(preset), Settings(), h100, 40960, True, True)
        assert p.acc_attn and p.acc_mode and {lp.ffn for lp in p.layers} == {"ffn_half"}, preset
    p = _plan(_args("30b-a3b"), Settings(), h100, 40960, False, True)
    assert {lp.ffn for lp in p.layers} == {"moe_half"} and all(lp.o_router and lp.o_clears for lp in p.layers)
    routed = _plan(_args("30b-a3b"), Settings(), h100, 40960, False, False)
    assert {lp.ffn for lp in routed.layers} == {"moe_acc"} and not any(lp.o_clears for lp in routed.layers)


def test_launches_and_describe_follow_the_forms():
    h100 = GPUS[0]
    p = _plan(_args("8b"), Settings(), h100, 4096, True, False)
    assert [ln.kernel for ln in p.dense] == ["gemv_w4a16 q|k|v", "attn_decode_gqa", "gemv_w4a16 o", "ffn_decode"]
    assert p.dense[2].clears == ("acc_d", "acc_qkv") and p.dense[3].writes == "acc_d" and p.moe_layer == ()
    text = p.describe()
    assert "NVIDIA H100" in text and "132 SMs" in text and "layers 0-35 (dense):" in text
    assert "4. ffn_decode" in text and f"acc_qkv [{4096 + 2 * 1024}]" in text
    assert f"{p.attn_splits} splits at capacity (4096 positions)" in text
    sep = _plan(_args("8b"), Settings(), h100, 4096, False, False)
    assert [ln.kernel for ln in sep.dense][3:] == ["gemv_w4a16 gate|up", "gemv_w4a16 down"]
    assert sep.dense[3].clears == ("acc_d", "acc_qkv") and sep.dense[4].writes == "acc_d" and not sep.dense[2].clears
    tails = _plan(_args("8b"), dataclasses.replace(Settings(), gemv_acc=False), h100, 4096, True, True)
    assert tails.accumulators == () and tails.dense[-1].writes == "h += down (epilogue)"
    assert "accumulators" not in tails.describe() and tails.ffn == "off"
    # a MoE model with a dense layer (mlp_only_layers): each run of alike layers is listed with its launches
    mixed = _plan(_args("tiny-moe-mixed"), Settings(), h100, 64, False, True)
    assert [lp.moe for lp in mixed.layers] == [True, False, True]
    text = mixed.describe()
    assert "layer 0 (MoE):" in text and "layer 1 (dense):" in text and "layer 2 (MoE):" in text


def test_short_regimes_pick_their_bound_and_split_count():
    """Each short-context bound is a regime: n_keys goes to the first bound at or above it, whose keys set the
    split count (capped by the capacity's and, with the clusters' merge, by ATTN_CM_MAX); past the last bound
    the capacity's regime and split count."""
    for cm in (False, True):
        s = dataclasses.replace(Settings(), attn_short=(512, 1024), attn_cm=cm, attn_min_chunk=32,
                                attn_keys_per_split=1000)
        p = plan.build(_args("8b"), s, GPUS[0], 33000)
        assert p.attn_splits == 33
        assert [p.regime(n) for n in (1, 512, 513, 1024, 1025)] == [512, 512, 1024, 1024, 33000]
        assert [p.split_count(n) for n in (1, 512, 513, 1024, 1025)] == [16, 16, 16 if cm else 32,
                                                                         16 if cm else 32, 33]
        assert "up to 512 keys: a graph of 16 splits" in p.describe()


class _Mat:
    """A stand-in AwqLinear: the shape facts gemm_path reads."""

    def __init__(self, K: int, N: int, group: int):
        self.K, self.N, self.group_size = K, N, group


class _Stack:
    """A stand-in AwqStack: the shape facts moe_experts_tile reads (w13 [E, D, 2 inter], w2 [E, inter, D])."""

    def __init__(self, E: int, K: int, N: int, group: int):
        self.E, self.group_size = E, group
        self.scales = np.zeros((1, 1, N), np.float16)
        self.qweight = np.zeros((1, K, 1), np.int32)


def _gpu_facts(monkeypatch, gpu: plan.Gpu, fused: bool, cublas: bool) -> None:
    """gemm_path's device queries answered for `gpu` (no CuPy on this host)."""
    from kuiper_py.cuda.ops import gemm as gm
    from kuiper_py.cuda.ops import moe as mo
    monkeypatch.setattr(gm, "device_tuning", lambda: gv.table_for(cfg.SETTINGS, gpu.name))
    monkeypatch.setattr(gm, "cublas_ready", lambda: cublas)
    monkeypatch.setattr(gm, "wgmma_available", lambda: fused)
    monkeypatch.setattr(mo, "wgmma_available", lambda: fused)
    monkeypatch.setattr(gm, "current_device_id", lambda: 0)
    monkeypatch.setattr(gm, "_GEMM_PATHS", {})  # (paths kept under these stand-in facts stay out of the real cache)


PROMPT_ROWS = sorted({*range(2, 40), 63, 64, 65, 79, 80, 81, 127, 128, 143, 144, 145, 200, 223, 224, 255, 256, 257,
                      300, 383, 384, 385, 511, 512, 513, 767, 768, 769, 1024, 2048, 8192})


@pytest.mark.parametrize("preset", ["8b", "0.6b", "32b", "30b-a3b", "tiny-moe-mixed", "small"])
@pytest.mark.parametrize("gpu", GPUS[:2] + GPUS[3:])
@pytest.mark.parametrize("tuning", [{}, {"gemm_rs": "0"}, {"gemm_wgmma": "0", "rows_max_m": 8},
                                    {"gemm_dequant_min_m": 4096, "gemm_wgmma_min_m": 64}])
def test_prefill_plan_paths_are_what_the_prefill_gemms_take(preset, gpu, tuning, monkeypatch):
    """Every projection's path in the prefill plan, at prompt lengths around each rule's bounds, is the one
    gemm_path picks for that layer's matrices (stand-ins of the same shapes, this GPU's facts mocked); and the
    experts' tiles are moe_experts_tile's. Without the fused kernels (sm_80) no path is wgmma or rs, without cuBLAS
    none is dequant, and gemv_rows serves 2..rows_max_m rows only."""
    from kuiper_py.cuda.ops import gemm as gm
    from kuiper_py.cuda.ops.moe import moe_experts_tile, moe_rs_path
    tune(monkeypatch, **tuning)
    st, a = cfg.SETTINGS, _args(preset)
    fused = gpu.cc == 90
    for cublas in (True, False):
        _gpu_facts(monkeypatch, gpu, fused, cublas)
        g = 128 if a.hidden_size % 128 == 0 else 64
        D, qd, kvd, I = a.hidden_size, a.q_dim, a.kv_dim, a.intermediate_size
        inter = a.moe_intermediate_size
        w13, w2 = _Stack(a.num_experts, D, 2 * inter, g), _Stack(a.num_experts, inter, D, g)
        pp = plan.build_prefill(a, st, gpu, fused, cublas, g, g, bool(a.num_experts) and moe_rs_path(w13, w2))
        mats = {"q|k|v": (_Mat(D, qd, g), _Mat(D, kvd, g), _Mat(D, kvd, g)), "o": (_Mat(qd, D, g),),
                "gate|up": (_Mat(D, I, g), _Mat(D, I, g)), "gate": (_Mat(D, I, g),), "down": (_Mat(I, D, g),)}
        names = [p[0] for p in pp.projections]
        assert names[:2] == ["q|k|v", "o"] and (len(names) == 5) == (not a.num_experts or bool(a.mlp_only_layers))
        for name in names:
            for T in PROMPT_ROWS:
                got = pp.path(name, T)
                assert got == gm.gemm_path(T, mats[name]), (name, T)
                assert fused or got not in ("wgmma", "rs")
                assert cublas or got != "dequant"
                assert (got == "rows") <= (2 <= T <= st.rows_max_m)
        if a.num_experts:
            for T in PROMPT_ROWS:  # (moe_experts_tile deciding the Hopper path itself)
                assert pp.experts_tile(T) == moe_experts_tile(w13, w2, T * a.num_experts_per_tok), T


def test_prefill_plan_describe_shows_each_length_and_the_measured_choices(monkeypatch):
    """describe() prints a line per prompt length up to the cache's capacity, a column per projection (and the
    experts of a MoE model); on the H100 an 8B prompt of 8 tokens takes gemv_rows for q|k|v and gate|up and the fused
    wgmma GEMM for o and down (its table's rows_wgmma_min), 2048 tokens dequantization + cuBLAS."""
    h100 = GPUS[0]
    pp = plan.build_prefill(_args("8b"), Settings(), h100, True, True, 128)
    lines = pp.describe(1024).splitlines()
    assert lines[0].startswith("prefill plan on NVIDIA H100") and lines[1] == "tokens | q|k|v | o | gate|up | down"
    rows = {int(ln.split(" | ")[0]): ln.split(" | ")[1:] for ln in lines[2:]}
    assert sorted(rows) == [t for t in plan.PREFILL_SHOWN if t <= 1024]
    assert rows[8] == ["rows", "wgmma", "rows", "wgmma"] and rows[2] == ["rows"] * 4
    assert pp.path("q|k|v", 2048) == "dequant"
    moe = plan.build_prefill(_args("30b-a3b"), Settings(), h100, True, True, 128, 128, True)
    text = moe.describe(64)
    assert "| experts (tile rows)" in text and "gate|up" not in text and text.count("\n") == 2 + 5
    # dense layers by decoder_sparse_step (every other layer sparse), and a tensor-parallel rank's share of experts
    mixed = plan.build_prefill(dataclasses.replace(_args("30b-a3b"), decoder_sparse_step=2), Settings(), h100, True,
                               True, 128, 128, True)
    assert [p[0] for p in mixed.projections] == ["q|k|v", "o", "gate|up", "gate", "down"]
    rank = plan.build_prefill(_args("30b-a3b"), Settings(), h100, True, True, 128, 128, True, experts=32)
    assert rank.experts[0] == 32 and rank.experts_tile(512) != moe.experts_tile(512)
