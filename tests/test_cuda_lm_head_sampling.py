"""The lm_head, its fused greedy argmax (kernels_cu/lm_head.cu) and GPU sampling (cuda/sampling.py,
kernels_cu/sampling.cu) against NumPy (device machine only): draws follow the NumPy filters' softmax.

Every output is poisoned with NaN before the kernel runs, so an element the kernel fails to write
fails the comparison; inputs are fresh random draws on every run.
"""

import numpy as np
import pytest

from reference import rel, tune

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")
from cuda_common import nan_like, rand_head  # noqa: E402 (after the module-level skip)


# the fast tier runs the first and last case: the real vocabulary at 1024 wide and a small head (the 8B-wide head took
# 18.7 s on an H100, most of it drawing and checking its 622M weights on the host)
@pytest.mark.parametrize("V,D", [(151936, 1024), (151936, 4096), (1000, 128)])
def test_lm_head(V, D):
    rng = np.random.default_rng()
    W = rand_head(rng, V, D)
    x = rng.standard_normal(D).astype(np.float16)
    out = nan_like((V,), cp.float32)
    oc.lm_head(cp.asarray(x), cp.asarray(W), out)
    assert rel(cp.asnumpy(out), W.astype(np.float32) @ x.astype(np.float32)) < 1e-3


@pytest.mark.parametrize("case", ["plain", "tie", "nan", "all_nan"])
def test_lm_head_greedy_argmax(case):
    """Greedy decode's argmax in the lm_head's blocks (one atomicMax of (order-preserving key, ~id) per
    block) and advance_position's turning it into the id: numpy.argmax of the first n_valid logits the
    kernel wrote, NaN never chosen, the lower id of a tie; all NaN: -1 to the host, 0 to the device token."""
    rng = np.random.default_rng()
    V, D, n_valid = 151936, 1024, 151669
    W = rand_head(rng, V, D)
    x = rng.standard_normal(D).astype(np.float16)
    W[n_valid + 5] = x * 4  # past n_valid: the largest logit, never chosen
    if case == "tie":
        W[[777, 120000]] = x * 2  # two equal maxima: the lower id
    if case == "nan":
        W[int(rng.integers(n_valid))] = np.nan
        W[int(rng.integers(n_valid)), 3] = np.nan
    if case == "all_nan":
        W[:] = np.nan
    out = nan_like((V,), cp.float32)
    slot = cp.zeros((1,), cp.uint64)
    oc.lm_head(cp.asarray(x), cp.asarray(W), out, slot, n_valid)
    pos, tok = cp.asarray([41], cp.int32), cp.full((1,), -7, cp.int32)
    host = cp.full((3,), -9, cp.int32)  # device memory stands in for the pinned ints here
    oc.kernel("rope", "advance_position")((1,), (1,), (pos, slot, tok, host))
    logits = cp.asnumpy(out)
    got = int(cp.asnumpy(host)[1 + 42 % 2])
    assert int(pos[0]) == 42 and int(slot[0]) == 0 and int(cp.asnumpy(host)[1 + 43 % 2]) == -9
    if case == "all_nan":
        assert got == -1 and int(tok[0]) == 0
        return
    want = int(np.nanargmax(logits[:n_valid]))
    assert got == want == int(tok[0])
    if case == "tie":
        assert want == 777


def _gpu_sample(logits, params, n_valid, history=(), seed=0, n=1):
    ops = oc.CupyOps.__new__(oc.CupyOps)  # only the sampler's buffers are needed
    ops.d = {"hist": cp.zeros((1024,), cp.int32), "step": cp.zeros((1,), cp.uint64), "token": cp.zeros((1,), cp.int32)}
    ops._stream = cp.cuda.Stream(non_blocking=False)
    ops._init_draw()
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        out.append(ops.sample(cp.asarray(logits, dtype=cp.float32), params, rng, list(history), n_valid))
    return out


def assert_draws_follow_filtered_softmax(x, p, n_valid, rng, n=3000):
    """3000 GPU draws from logits x: only tokens the NumPy filters keep, at frequencies within 0.035
    of the exact filtered softmax."""
    from kuiper_py.sampling import filter_logits
    ref = filter_logits(x[:n_valid].astype(np.float64), p)
    prob = np.exp(ref - ref.max())
    prob /= prob.sum()
    draws = _gpu_sample(x, p, n_valid, seed=int(rng.integers(1 << 30)), n=n)
    freq = np.bincount(draws, minlength=n_valid) / n
    assert set(np.nonzero(freq)[0]) <= set(np.nonzero(prob)[0])
    assert np.abs(freq - prob).max() < 0.035


def test_gpu_greedy_ties_padding_and_penalty():
    from kuiper_py.sampling import SamplingParams, sample
    rng = np.random.default_rng()
    x = rng.standard_normal(151936).astype(np.float32)
    x[151900] = 50.0  # padding id: never chosen
    x[[1234, 99999]] = 20.0  # a tie: the lower index wins, as numpy.argmax
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    assert _gpu_sample(x, greedy, 151669) == [1234]
    hist = [1234, 5, 1234, 99999]
    pen = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, repeat_penalty=30.0)
    assert _gpu_sample(x, pen, 151669, hist) == [sample(x, pen, rng, hist, 151669)]


@pytest.mark.parametrize("kw", [dict(temperature=0.6, top_k=20, top_p=0.95), dict(temperature=1.0, top_k=50, top_p=1.0)])
def test_gpu_topk_candidates_full_vocabulary(kw):
    """Top-k over the real vocabulary size, where the kernel keeps its candidates in shared memory
    (sampling.cu): frequencies match the exact filtered softmax of the NumPy code."""
    from kuiper_py.sampling import SamplingParams
    p = SamplingParams(**kw).validate()
    rng = np.random.default_rng()
    x = (rng.standard_normal(151936) * 2.0).astype(np.float32)
    top = rng.choice(151669, 40, replace=False)
    x[top] = 9.0 + rng.standard_normal(40).astype(np.float32)  # plausible tokens anywhere in the vocabulary
    x[151700] = 40.0  # padding id: never chosen
    assert_draws_follow_filtered_softmax(x, p, 151669, rng)


def test_gpu_topk_many_ties_scan_everything():
    """5000 tied maxima with top-k 20: more candidates than shared memory holds, so the filters scan
    every logit; ties at the k-th value are all kept (as NumPy's filter), so draws spread over them."""
    from kuiper_py.sampling import SamplingParams
    rng = np.random.default_rng()
    x = np.full(151936, -5.0, dtype=np.float32)
    tied = rng.choice(151669, 5000, replace=False)
    x[tied] = 3.0
    draws = _gpu_sample(x, SamplingParams(temperature=1.0, top_k=20, top_p=1.0), 151669,
                        seed=int(rng.integers(1 << 30)), n=200)
    assert set(draws) <= set(tied.tolist())
    assert len(set(draws)) > 150  # uniform over 5000: ~196 distinct expected; 20 if ties were cut


@pytest.mark.parametrize("kw,hist", [
    (dict(temperature=0.0, top_k=0, top_p=1.0), []),
    (dict(temperature=0.0, top_k=0, top_p=1.0, repeat_penalty=1.5), [7, 151668, 8191, 8192, 7]),
    (dict(temperature=0.6, top_k=20, top_p=0.95), []),
    (dict(temperature=1.0, top_k=50, top_p=1.0), []),
    (dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.3), [3, 8192, 70000, 3]),
    (dict(temperature=1.0, top_k=409, top_p=0.99), []),  # sample_token_mb's most candidates per block
    (dict(temperature=1.0, top_k=410, top_p=0.99), []),  # past them: one block
])
def test_gpu_multi_block_draw_equals_one_block(kw, hist, monkeypatch):
    """sample_token_mb (10 blocks over the vocabulary, then the last block's filters and draw on the union
    of their candidates) draws exactly the ids sample_token does: same seeds, same penalties, ties and NaN
    logits among them, the most plausible tokens in different blocks."""
    from kuiper_py.sampling import SamplingParams
    p = SamplingParams(**kw).validate()
    assert oc.draw_plan(151669, p) == ((10, 409) if p.temperature == 0 or p.top_k <= 409 else None)
    rng = np.random.default_rng()
    x = (rng.standard_normal(151936) * 2.0).astype(np.float32)
    top = rng.choice(151669, 60, replace=False)
    x[top] = 9.0 + rng.standard_normal(60).astype(np.float32)
    x[top[:3]] = x[top[3]]  # ties among the plausible ones
    x[rng.choice(151669, 5, replace=False)] = np.nan
    x[151700] = 40.0  # padding id: never chosen
    seed = int(rng.integers(1 << 30))
    draws = {}
    for mb in (False, True):
        tune(monkeypatch, sample_mb=mb)
        draws[mb] = _gpu_sample(x, p, 151669, hist, seed=seed, n=200)
    assert draws[True] == draws[False]
    assert all(0 <= t < 151669 for t in draws[True])
    if p.temperature:
        assert len(set(draws[True])) > 3


def test_gpu_multi_block_draw_overflow_and_all_nan(monkeypatch):
    """A block of sample_token_mb with more tied candidates than it may keep sends the last block to the
    draw over every logit (the same draws as one block); all-NaN logits give -1, an error."""
    from kuiper_py.errors import KuiperError
    from kuiper_py.sampling import SamplingParams
    rng = np.random.default_rng()
    x = np.full(151936, -5.0, dtype=np.float32)
    x[16384 * 3:16384 * 3 + 600] = 3.0  # 600 tied maxima in one block's range (room for 409)
    x[rng.choice(151669, 30, replace=False)] = 3.0
    p = SamplingParams(temperature=1.0, top_k=20, top_p=1.0)
    seed = int(rng.integers(1 << 30))
    draws = {}
    for mb in (False, True):
        tune(monkeypatch, sample_mb=mb)
        draws[mb] = _gpu_sample(x, p, 151669, seed=seed, n=100)
    assert draws[True] == draws[False] and len(set(draws[True])) > 50
    tune(monkeypatch, sample_mb=True)
    nan = np.full(151936, np.nan, dtype=np.float32)
    for kw in (dict(temperature=0.0, top_k=0, top_p=1.0), dict(temperature=1.0, top_k=20, top_p=1.0)):
        with pytest.raises(KuiperError, match="no finite logit"):
            _gpu_sample(nan, SamplingParams(**kw), 151669)


@pytest.mark.parametrize("n_valid", [1, 3, 4097, 151669])
def test_gpu_greedy_every_position(n_valid):
    """The vectorised scan (16-byte loads, a scalar tail when n_valid % 4) finds the maximum wherever it
    lies, and the lower index of a tie, as numpy.argmax."""
    from kuiper_py.sampling import SamplingParams
    rng = np.random.default_rng()
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    for pos in sorted({0, n_valid - 1, int(rng.integers(n_valid)), n_valid // 2}):
        x = rng.standard_normal(n_valid + 7).astype(np.float32)
        x[n_valid:] = 99.0  # past n_valid: never chosen
        x[pos] = 10.0
        twin = int(rng.integers(n_valid))
        x[twin] = 10.0
        assert _gpu_sample(x, greedy, n_valid) == [int(np.argmax(x[:n_valid]))]


@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.7, top_k=5, top_p=1.0),
                                dict(temperature=1.0, top_k=0, top_p=0.8), dict(temperature=0.6, top_k=20, top_p=0.95),
                                dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2)])
def test_gpu_sampling_distribution(kw):
    """Empirical frequencies of the GPU sampler match the exact filtered softmax of the NumPy code."""
    from kuiper_py.sampling import SamplingParams
    p = SamplingParams(**kw).validate()
    rng = np.random.default_rng()
    x = np.full(2000, -30.0, dtype=np.float32)
    x[:12] = rng.standard_normal(12) * 1.5  # a few plausible tokens over a long flat tail
    assert_draws_follow_filtered_softmax(x, p, 2000, rng)


@pytest.mark.parametrize("mb", [False, True])
def test_gpu_sample_rows_draws_what_each_row_draws_alone(mb, monkeypatch):
    """sample_rows (a step of several sequences: one launch, each row its own settings, seed, counter and history)
    draws for every row the id the one-sequence sampler draws from that row alone at that counter (same seed:
    sampling.device_seed, as generate() takes it); a row the device does not serve (an OpenAI penalty) draws on the
    host with its rng, a row without a draw is left alone; its ids come back for rows given in any order. The
    one-sequence draw is taken both ways: in one block, and over several blocks (sample_mb, the default)."""
    from kuiper_py.sampling import RowDraw, SamplingParams, device_seed, sample
    tune(monkeypatch, sample_mb=mb)
    rng = np.random.default_rng()
    V, n_valid = 151936, 151669
    settings = [dict(temperature=0.0, top_k=0, top_p=1.0),
                dict(temperature=0.0, top_k=0, top_p=1.0, repeat_penalty=1.5),
                dict(temperature=0.6, top_k=20, top_p=0.95),
                dict(temperature=1.0, top_k=0, top_p=0.9),
                dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.3, repeat_last_n=3),
                dict(temperature=1.0, top_k=2000, top_p=1.0),  # past the one-block gather: every logit
                dict(temperature=0.7, top_k=20, top_p=1.0, presence_penalty=0.5)]  # the host's draw
    R = len(settings) + 1  # the last row draws nothing
    x = (rng.standard_normal((R, V)) * 2.0).astype(np.float32)
    for r in range(R):  # a few plausible tokens per row, some tied, the padding ids large
        top = rng.choice(n_valid, 40, replace=False)
        x[r, top] = 9.0 + rng.standard_normal(40).astype(np.float32)
        x[r, top[:2]] = x[r, top[2]]
        x[r, n_valid + 3] = 50.0
    draws, want = [], []
    for r, kw in enumerate(settings):
        p = SamplingParams(**kw, seed=int(rng.integers(1 << 30))).validate()
        hist = rng.choice(n_valid, 6).tolist() + [int(np.argmax(x[r, :n_valid]))]
        gen = hist[-2:]
        step = int(rng.integers(0, 4))
        if p.needs_host:
            want.append(sample(x[r], p, np.random.default_rng(p.seed), hist, n_valid, generated=gen))
        else:  # the one-sequence sampler's draw number step (its rng seeds it as device_seed does)
            want.append(_gpu_sample(x[r], p, n_valid, hist, seed=p.seed, n=step + 1)[-1])
        draws.append(RowDraw(p, np.random.default_rng(p.seed), device_seed(p), step, hist, gen))
    order = rng.permutation(R)  # rows in a shuffled order: each draw finds its own row
    xs = cp.asarray(x[order])
    ops = oc.CupyOps.__new__(oc.CupyOps)
    ops.d = {"hist": cp.zeros((1024,), cp.int32), "step": cp.zeros((1,), cp.uint64), "token": cp.zeros((1,), cp.int32)}
    ops._stream = cp.cuda.Stream(non_blocking=False)
    ops._init_draw()
    got = ops.sample_rows(xs, [draws[i] if i < len(draws) else None for i in order], n_valid)
    assert [got[list(order).index(i)] for i in range(len(draws))] == want
    assert got[list(order).index(R - 1)] is None
    assert np.array_equal(cp.asnumpy(xs[list(order).index(R - 1)]), x[R - 1])  # (untouched)
    assert len(set(want[2:])) > 2
