"""Speculative decoding on the GPU (device machine only): greedy output with a draft model and with prompt lookup
equals plain greedy decoding on dense and MoE synthetic files, for K = 1, 4, 8 and at the context limit. The verify
step is a prefill (GEMM) where plain decoding runs GEMV steps: fp16 sums in another order may flip a near tie, so a
divergence must be one, by the criterion the other GPU tests use (reference.greedy_lockstep): the two tokens are the
CPU engine's top two, closer than the GPU's logits differ from the CPU's at that step."""
import numpy as np
import pytest

from kuiper_py import speculative as spec
from kuiper_py.generate import Engine, generate
from kuiper_py.sampling import SamplingParams

from test_speculative import spec_files

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return spec_files(tmp_path_factory.mktemp("gpu_spec"), (("dense", "small", 21), ("moe", "small-moe", 22),
                                                            ("other", "small", 23)))


@pytest.fixture(scope="module")
def engines(files):
    out = {k: Engine.load(v, "cuda") for k, v in files.items()}
    out.update({"self_" + k: Engine.load(files[k], "cuda") for k in ("dense", "moe")})
    return out


@pytest.fixture(scope="module")
def cpu_engine(files):
    """The float32 CPU engine of a target, loaded the first time a divergence needs it."""
    loaded = {}

    def get(target):
        if target not in loaded:
            loaded[target] = Engine.load(files[target], "cpu")
        return loaded[target]
    return get


def _tokens(recs):
    recs = list(recs)
    return recs[-1].tokens, recs[-1].finish_reason


def _assert_same_up_to_a_tie(cpu_engine, gpu: Engine, ids, got, want):
    """got == want, or they part at a token where the two candidates are the float32 CPU engine's top two and closer
    than the GPU's logits there differ from the CPU's (a tie neither engine resolves)."""
    if got == want:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert i < min(len(got), len(want)), (got, want)
    ctx = ids + want[:i]
    c = np.asarray(cpu_engine().session(len(ctx) + 1).prefill(ctx), np.float64).ravel()
    g = np.asarray(cp.asnumpy(gpu.session(len(ctx) + 1).prefill(ctx)), np.float64).ravel()[:c.size]
    err = float(np.abs(g - c).max())
    assert set(np.argsort(c)[-2:].tolist()) == {got[i], want[i]}, (i, got[i], want[i])
    assert abs(c[got[i]] - c[want[i]]) < err, (i, got[i], want[i], abs(c[got[i]] - c[want[i]]), err)


@pytest.mark.parametrize("target", ["dense", "moe"])
@pytest.mark.parametrize("kind", ["draft", "self", "lookup"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_gpu_greedy_equals_plain(engines, cpu_engine, target, kind, k):
    eng = engines[target]
    ids = [(17 * i + 5) % 1000 for i in range(24)] * 2  # (a repeated prompt: lookup has something to find)
    want, _ = _tokens(generate(eng, ids, 48, GREEDY))
    prop = spec.Lookup(3) if kind == "lookup" else spec.Draft(engines["other" if kind == "draft" else "self_" + target], eng)
    st = spec.Stats()
    got, _ = _tokens(spec.generate(eng, prop, ids, 48, GREEDY, k=k, stats=st))
    _assert_same_up_to_a_tie(lambda: cpu_engine(target), eng, ids, got, want)
    assert st.steps > 0
    if kind == "self" and got == want:
        assert st.accepted > 0


@pytest.mark.parametrize("target", ["dense", "moe"])
def test_gpu_greedy_at_the_context_limit(engines, cpu_engine, target):
    eng = engines[target]
    ids = [(29 * i + 3) % 1000 for i in range(20)]
    for extra in (1, 3, 6):
        want = _tokens(generate(eng, ids, 40, GREEDY, max_context=len(ids) + extra))
        got = _tokens(spec.generate(eng, spec.Draft(engines["self_" + target], eng), ids, 40, GREEDY, k=4,
                                    max_context=len(ids) + extra))
        assert got[1] == want[1] == "context"
        _assert_same_up_to_a_tie(lambda: cpu_engine(target), eng, ids, got[0], want[0])
