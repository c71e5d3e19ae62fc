"""The decode plan (cuda/plan.py) is what runs: the kernels one eager decode step launches, layer by layer, are the
plan's launches in its order, and each decode GEMV's instantiation (accumulating or not, with the router rows or not,
the MoE weighted sum) is the form the plan names: on a dense model in accumulating mode and with the split-K tails,
on Qwen3-0.6B shapes with and without the one-launch FFN half, and on a MoE model with a dense middle layer with and
without the one-launch MoE FFN half."""
import math

import pytest

from kuiper_py import ops_cupy as oc
from kuiper_py import synth
from kuiper_py.export import export
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from reference import PROMPT, tune

pytestmark = pytest.mark.gpu

LAYER_KERNELS = ("gemv_w4a16", "attn_decode_gqa", "attn_decode_combine", "ffn_decode", "moe_ffn_decode",
                 "moe_route_decode")
# a MoE model whose middle layer is dense (hidden 2048: the one-launch MoE half's clusters of 8), as test_cuda_moe's
_MIXED = (2048, 2048, 3, 16, 4, 128, True, 16, 4, 512, (1,))


@pytest.fixture(scope="module")
def mixed_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-mixed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synth.MOE_PRESETS, "plan-mixed", _MIXED)
        d = synth.make_checkpoint(root / "ck", "plan-mixed", seed=5, n_shards=1, tokenizer=False)
    export(d, root / "m.bin", progress=False, log=lambda m: None)
    return root / "m.bin"


def _record(monkeypatch, log: list) -> None:
    """Every kernel launch of the decode ops appended to log by name (kernel() and the cluster launches)."""
    from kuiper_py.cuda.ops import attention, decode_halves, gemv, moe
    from kuiper_py.cuda.runtime import build, launch
    real_kernel, real_launch = build.kernel, launch.launch_ex

    def kernel(family, name):
        fn = real_kernel(family, name)

        def run(*a, **k):
            log.append(name)
            return fn(*a, **k)
        return run

    def launch_ex(fn, *a, **k):
        log.append(next((key[-1] for key, f in build._FNS.items() if f is fn), "?"))
        return real_launch(fn, *a, **k)
    for mod in (gemv, attention, moe):
        monkeypatch.setattr(mod, "kernel", kernel)
    for mod in (attention, decode_halves, moe):
        monkeypatch.setattr(mod, "launch_ex", launch_ex)


def _flags(name: str) -> tuple[bool, ...]:
    """gemv_w4a16<MOE2, RT, OM, ACC>'s template arguments."""
    return tuple(f.strip() == "true" for f in name[name.index("<") + 1:-1].split(","))


def _check_one_step(path, monkeypatch, **changes):
    for k, v in changes.items():
        tune(monkeypatch, **{k: v})
    m = Qwen3(load(path), oc.CupyOps, 64)
    m.ops.graphs = False  # eager: every launch goes through the ops (a graph replays them)
    m.prefill(PROMPT[:5])
    plan, n_keys = m.ops.plan, 6
    log = []
    with monkeypatch.context() as mp:
        _record(mp, log)
        m.decode(PROMPT[5])
    splits = max(1, min(plan.split_count(n_keys), math.ceil(n_keys / plan.attn_min_chunk)))  # an eager step's
    assert plan.o_prologue(splits)  # (these shapes: o merges the splits itself, no attn_decode_combine)
    want = [ln for lp in plan.layers for ln in lp.launches()]
    got = [n for n in log if n.partition("<")[0] in LAYER_KERNELS]
    assert [n.partition("<")[0] for n in got] == [ln.kernel.split()[0] for ln in want], plan.describe()
    for name, ln in zip(got, want):
        if not name.startswith("gemv_w4a16<"):
            continue
        moe2, rt, _, acc = _flags(name)
        assert moe2 == (ln.kernel == "gemv_w4a16 experts' down"), (name, ln)
        assert rt == ("router" in ln.writes), (name, ln)
        if ln.kernel in ("gemv_w4a16 q|k|v", "gemv_w4a16 o", "gemv_w4a16 gate|up", "gemv_w4a16 down"):
            assert acc == ln.writes.startswith("acc"), (name, ln)
    return plan


@pytest.mark.parametrize("gemv_acc", [True, False])
def test_dense_decode_step_runs_its_plan(untied_bin, gemv_acc, monkeypatch):
    plan = _check_one_step(untied_bin, monkeypatch, gemv_acc=gemv_acc)
    assert {lp.ffn for lp in plan.layers} == {"gemv_acc" if gemv_acc else "gemv"}


@pytest.mark.parametrize("decode_ffn", ["1", "0"])
def test_one_launch_ffn_step_runs_its_plan(small_dense_bin, decode_ffn, monkeypatch):
    plan = _check_one_step(small_dense_bin, monkeypatch, decode_ffn=decode_ffn)
    if decode_ffn == "0":
        assert {lp.ffn for lp in plan.layers} == {"gemv_acc"}


@pytest.mark.parametrize("decode_moe", ["1", "0"])
def test_moe_decode_step_runs_its_plan(mixed_bin, decode_moe, monkeypatch):
    plan = _check_one_step(mixed_bin, monkeypatch, decode_moe=decode_moe)
    assert [lp.moe for lp in plan.layers] == [True, False, True]
    if decode_moe == "0":
        assert {lp.ffn for lp in plan.layers} == {"moe_acc", "gemv"}


@pytest.mark.parametrize("which", ["untied", "mixed"])
def test_prefill_plan_is_what_the_prefill_takes(untied_bin, mixed_bin, which, monkeypatch):
    """The prefill plan a loaded model prints (kuiper info --plan) names, for prompts of 2 to 4096 tokens, the path
    gemm() takes for each projection of every layer and moe_experts' tiles; a real prompt's GEMMs take those paths."""
    from kuiper_py.cuda.ops import gemm as gm
    from kuiper_py.cuda.plan import describe
    m = Qwen3(load(untied_bin if which == "untied" else mixed_bin), oc.CupyOps, 4096)
    pp, a = m.ops.prefill_plan, m.ops.args
    for T in (2, 3, 8, 16, 17, 64, 80, 128, 144, 256, 257, 384, 512, 513, 768, 1024, 4096):
        for layer in m.ops.weights.layers:
            assert pp.path("q|k|v", T) == oc.gemm_path(T, (layer.wq, layer.wk, layer.wv)), T
            assert pp.path("o", T) == oc.gemm_path(T, (layer.wo,)), T
            if layer.router is None:
                assert pp.path("gate|up", T) == oc.gemm_path(T, (layer.w1, layer.w3)), T
                assert pp.path("gate", T) == oc.gemm_path(T, (layer.w1,)), T
                assert pp.path("down", T) == oc.gemm_path(T, (layer.w2,)), T
            else:
                want = oc.moe_experts_tile(layer.experts_w13, layer.experts_w2, T * a.num_experts_per_tok)
                assert pp.experts_tile(T) == want, T
    taken = []
    real = gm.gemm_path

    def record(T, mats):
        taken.append((T, tuple((w.K, w.N) for w in mats), real(T, mats)))
        return taken[-1][2]
    monkeypatch.setattr(gm, "gemm_path", record)
    m.prefill(PROMPT * 10)  # (eager: the first prompt of its length bucket)
    T, D, qd, kvd = len(PROMPT) * 10, a.hidden_size, a.q_dim, a.kv_dim
    I = a.intermediate_size
    names = {((D, qd), (D, kvd), (D, kvd)): "q|k|v", ((qd, D),): "o", ((D, I), (D, I)): "gate|up", ((D, I),): "gate",
             ((I, D),): "down"}
    assert taken and all(t == T and path == pp.path(names[shapes], T) for t, shapes, path in taken)
    text = describe(m)
    assert "prefill plan on" in text and "\n128 | " in text and "\n8192 | " not in text  # (4096 positions)
