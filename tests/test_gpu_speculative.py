"""Speculative decoding on the GPU (device machine only): greedy output with a draft model and with prompt lookup
equals plain greedy decoding on dense and MoE synthetic files, for K = 1, 4, 8 and at the context limit. The verify
step is a prefill (GEMM) where plain decoding runs GEMV steps: fp16 sums in another order may flip a near tie, so a
divergence must be one (the CPU engine's float32 logits of the two tokens within TIE of each other)."""
import pytest

from kuiper_py import speculative as spec
from kuiper_py.generate import Engine, generate
from kuiper_py.sampling import SamplingParams

from test_speculative import spec_files

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0)
TIE = 2e-2  # logits of two tokens closer than this are a tie the fp16 paths may order either way


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return spec_files(tmp_path_factory.mktemp("gpu_spec"), (("dense", "small", 21), ("moe", "small-moe", 22),
                                                            ("other", "small", 23)))


@pytest.fixture(scope="module")
def engines(files):
    out = {k: Engine.load(v, "cuda") for k, v in files.items()}
    out.update({"self_" + k: Engine.load(files[k], "cuda") for k in ("dense", "moe")})
    out.update({"cpu_" + k: Engine.load(files[k], "cpu") for k in ("dense", "moe")})
    return out


def _tokens(recs):
    recs = list(recs)
    return recs[-1].tokens, recs[-1].finish_reason


def _assert_same_up_to_a_tie(cpu: Engine, ids, got, want):
    """got == want, or they part at a token whose two candidates the float32 CPU engine finds tied."""
    if got == want:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert i < min(len(got), len(want)), (got, want)
    model = cpu.session(len(ids) + i + 1)
    logits = model.prefill(ids + want[:i])
    assert abs(float(logits[got[i]]) - float(logits[want[i]])) < TIE, (i, got[i], want[i])


@pytest.mark.parametrize("target", ["dense", "moe"])
@pytest.mark.parametrize("kind", ["draft", "self", "lookup"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_gpu_greedy_equals_plain(engines, target, kind, k):
    eng = engines[target]
    ids = [(17 * i + 5) % 1000 for i in range(24)] * 2  # (a repeated prompt: lookup has something to find)
    want, _ = _tokens(generate(eng, ids, 48, GREEDY))
    prop = spec.Lookup(3) if kind == "lookup" else spec.Draft(engines["other" if kind == "draft" else "self_" + target], eng)
    st = spec.Stats()
    got, _ = _tokens(spec.generate(eng, prop, ids, 48, GREEDY, k=k, stats=st))
    _assert_same_up_to_a_tie(engines["cpu_" + target], ids, got, want)
    assert st.steps > 0
    if kind == "self" and got == want:
        assert st.accepted > 0


@pytest.mark.parametrize("target", ["dense", "moe"])
def test_gpu_greedy_at_the_context_limit(engines, target):
    eng = engines[target]
    ids = [(29 * i + 3) % 1000 for i in range(20)]
    for extra in (1, 3, 6):
        want = _tokens(generate(eng, ids, 40, GREEDY, max_context=len(ids) + extra))
        got = _tokens(spec.generate(eng, spec.Draft(engines["self_" + target], eng), ids, 40, GREEDY, k=4,
                                    max_context=len(ids) + extra))
        assert got[1] == want[1] == "context"
        _assert_same_up_to_a_tie(engines["cpu_" + target], ids, got[0], want[0])
