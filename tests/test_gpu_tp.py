"""The CUDA backend as tensor-parallel ranks (cuda/tp.py, parallel/device.py): on ONE GPU, --tp 2 and 4 through
DeviceLocalGroup (N CupyOps ranks on the one device, taking turns) against --tp 1 and the CPU engine, dense and MoE;
a communicator of one rank changes nothing; on two or more GPUs, the NCCL and one-shot groups against the one-GPU
group (device machine only)."""
import dataclasses

import numpy as np
import pytest

from kuiper_py import synth
from kuiper_py.export import export
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps
from kuiper_py.parallel.group import ParallelModel, visible_gpus
from reference import assert_greedy_up_to_a_tie, rel

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")
from kuiper_py.cuda import settings as cfg  # noqa: E402
from kuiper_py.parallel.device import DeviceLocalGroup  # noqa: E402

multi_gpu = pytest.mark.skipif(visible_gpus() < 2, reason="needs two or more GPUs")
CTX = 64


@pytest.fixture(autouse=True)
def default_settings(monkeypatch):
    """Every test starts from the default tuning, and what a rank made active (its settings) ends with the test."""
    monkeypatch.setattr(cfg, "SETTINGS", cfg.Settings())


@pytest.fixture(scope="module", params=["dense", "moe"])
def mf(request, tmp_path_factory):
    """tiny (dense, tied) or tiny-moe (8 experts, 2 per token) with AWQ groups of 32: every head count, MLP and
    expert count splits 4 ways in whole groups."""
    preset = {"dense": "tiny", "moe": "tiny-moe"}[request.param]
    root = tmp_path_factory.mktemp("gputp")
    d = synth.make_checkpoint(root / preset, preset, seed=31, n_shards=1, group_size=32, tokenizer=False)
    export(d, root / f"{preset}.bin", progress=False, log=lambda m: None)
    return load(root / f"{preset}.bin")


def _ids(n, seed=None):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 151643, size=n)]


def _run(m, ids, steps):
    """Prefill logits of every position, then the logits of decoding `steps` more tokens (host copies)."""
    out = [cp.asnumpy(m.prefill(ids, all_logits=True))]
    out += [cp.asnumpy(m.decode(t)).copy() for t in steps]
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_on_one_gpu_as_accurate_as_one_rank(mf, tp):
    """Prefill and decode logits of N ranks within the GPU's fp16 tolerance of one rank and of the CPU engine."""
    ids, steps = _ids(9), _ids(5)
    cpu = [np.asarray(x) for x in _run(Qwen3(mf, NumpyOps, CTX), ids, steps)]
    one = _run(Qwen3(mf, oc.CupyOps, CTX, settings=cfg.Settings()), ids, steps)
    par = ParallelModel(mf, oc.CupyOps, tp, CTX, group=DeviceLocalGroup(tp))
    assert all(not r.ops.graphs for r in par.ranks)  # a rank's steps run eagerly (cuda/tp.py)
    got = _run(par, ids, steps)
    for g, o, c in zip(got, one, cpu):
        assert g.shape == o.shape
        assert rel(g, c) < 1e-2 and rel(g, o) < 1e-2, (rel(g, c), rel(g, o))


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_on_one_gpu_greedy_tokens_as_the_cpu(mf, tp):
    """The same greedy tokens as the CPU engine, up to a tie closer than the two engines' logits differ."""
    prompt = _ids(6)
    cpu = Qwen3(mf, NumpyOps, CTX)
    assert_greedy_up_to_a_tie(cpu, ParallelModel(mf, oc.CupyOps, tp, CTX, group=DeviceLocalGroup(tp)), prompt, 16)


@pytest.mark.parametrize("tp", [2, 4])
def test_one_shot_all_reduce_in_the_model_gives_the_same_bits(mf, tp):
    """The all-reduces through the one-shot kernel's simulated ranks: the same rank-order fp32 sums as CuPy's, so
    the same logits bit for bit."""
    ids, steps = _ids(7), _ids(3)
    plain = _run(ParallelModel(mf, oc.CupyOps, tp, CTX, group=DeviceLocalGroup(tp)), ids, steps)
    one_shot = _run(ParallelModel(mf, oc.CupyOps, tp, CTX, group=DeviceLocalGroup(tp, oneshot=True)), ids, steps)
    for a, b in zip(plain, one_shot):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("graphs", [True, False])
def test_a_group_of_one_changes_nothing(mf, graphs):
    """A CupyOps given a communicator of one rank computes what one built without it does, bit for bit (the same
    settings, graphs and fused forms), prefill and decode."""
    ids, steps = _ids(9), _ids(6)
    runs = []
    for comm in (None, DeviceLocalGroup(1).comm(0)):
        kw = {} if comm is None else {"comm": comm, "expert_range": (0, mf.args.num_experts) if mf.args.num_experts
                                      else None}
        m = Qwen3(mf, oc.CupyOps, CTX, **kw)
        m.ops.graphs = graphs
        assert m.ops.settings == cfg.Settings()
        runs.append(_run(m, ids, steps))
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


def test_rank_settings_leave_the_defaults_alone():
    """A rank's tuning is the default one but for the fused residual forms, the arena and the prefill graphs."""
    from kuiper_py.cuda.tp import rank_settings
    s = rank_settings(cfg.Settings())
    assert not s.gemv_acc and s.decode_ffn == s.decode_moe == "0" and s.arena_max_t == s.prefill_graph_max_t == 0
    assert dataclasses.replace(s, gemv_acc=True, decode_ffn="auto", decode_moe="auto", arena_max_t=512,
                               prefill_graph_max_t=512) == cfg.Settings()


@multi_gpu
@pytest.mark.parametrize("form", ["nccl", "oneshot"])
def test_ranks_on_several_gpus_equal_the_one_gpu_group(mf, form):
    """--tp N over N GPUs (one process, a thread per rank; NCCL or the one-shot kernel over peer memory) against the
    same ranks taking turns on one GPU: the same logits within fp32 summation order, the same greedy tokens."""
    from kuiper_py.parallel.device import NcclGroup, PeerGroup
    tp = 4 if visible_gpus() >= 4 else 2
    ids, steps = _ids(9), _ids(5)
    group = NcclGroup(tp) if form == "nccl" else PeerGroup(tp)
    par = ParallelModel(mf, oc.CupyOps, tp, CTX, group=group)
    assert [r.ops.dev.id for r in par.ranks] == list(range(tp))
    got = _run(par, ids, steps)
    ref = _run(ParallelModel(mf, oc.CupyOps, tp, CTX, group=DeviceLocalGroup(tp)), ids, steps)
    for g, r in zip(got, ref):
        assert rel(g, r) < 1e-3
    par.reset()
    assert_greedy_up_to_a_tie(Qwen3(mf, NumpyOps, CTX), par, _ids(6), 12)


@multi_gpu
def test_gpu_group_keeps_the_faster_all_reduce():
    """gpu_group times the one-shot form and NCCL at the message it is given and keeps the faster: with a timer that
    says one form is slower, the group's all-reduces take the other (the one-shot's epoch counter counts its calls),
    and both forms give the rank-order sum."""
    from kuiper_py.parallel.device import gpu_group, time_all_reduce
    tp = 2
    for slow in ("oneshot", "nccl"):
        g = gpu_group(tp, 8192, timer=lambda grp, n: 1.0 if grp.oneshot == (slow == "oneshot") else 0.5)
        assert g.oneshot == (slow == "nccl")
        assert time_all_reduce(g, 8192, reps=3) > 0
        xs = []
        for r in range(tp):
            with g.enter(r):
                xs.append(cp.full((4096,), r + 1, cp.float16))
        out = g.run(lambda r: g.reduce(r, xs[r]))
        for r in range(tp):
            assert float(cp.asnumpy(out[r]).min()) == float(cp.asnumpy(out[r]).max()) == tp * (tp + 1) / 2
        g.close()


@multi_gpu
def test_cli_tp_on_gpus_runs_and_refuses_more_than_visible(tmp_path):
    """`kuiper generate --device cuda --tp 2` (NCCL, one process) prints text; a --tp past the visible GPUs is
    refused in one line."""
    from conftest import run_cli
    d = synth.make_checkpoint(tmp_path / "tiny", "tiny", seed=5, n_shards=1, group_size=32)
    path = tmp_path / "tiny.bin"
    export(d, path, progress=False, log=lambda m: None)
    args = ("generate", "-m", path, "-p", "Hello there", "-n", "8", "--temp", "0", "--device", "cuda")
    r = run_cli(*args, "--tp", "2")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert "--tp 2: all-reduce" in r.stderr  # (the startup's choice of NCCL or the one-shot form, logged)
    if visible_gpus() < 4:
        r = run_cli(*args, "--tp", "4")
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("kuiper: error: --tp 4 needs 4 GPUs")
