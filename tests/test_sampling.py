"""Sampling: greedy, filters, penalties, validation, padding ids, determinism."""
import numpy as np
import pytest

from kuiper_py.errors import KuiperError
from kuiper_py.sampling import (SamplingParams, apply_openai_penalties, apply_repetition_penalty, filter_logits, sample,
                                 token_logprobs)


def _p(**kw):
    d = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    d.update(kw)
    return SamplingParams(**d).validate()


def test_greedy_and_padding_ids_never_sampled():
    rng = np.random.default_rng()
    x = rng.standard_normal(1000).astype(np.float32)
    x[990] = 100.0  # a padding row the tokenizer does not know
    assert sample(x, _p(temperature=0.0), rng, [], n_valid=980) == int(np.argmax(x[:980]))
    for _ in range(50):
        assert sample(x, _p(), rng, [], n_valid=980) < 980


def test_top_k_one_is_greedy_and_top_k_limits_support():
    rng = np.random.default_rng()
    x = rng.standard_normal(500)
    assert all(sample(x, _p(top_k=1), rng, [], 500) == int(np.argmax(x)) for _ in range(20))
    top5 = set(np.argsort(-x)[:5].tolist())
    assert {sample(x, _p(top_k=5), rng, [], 500) for _ in range(300)} <= top5


def test_top_p_and_min_p_masks():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    kept = np.isfinite(filter_logits(x, _p(top_p=0.7)))
    assert kept.tolist() == [True, True, False, False]
    kept = np.isfinite(filter_logits(x, _p(top_p=0.8)))
    assert kept.tolist() == [True, True, False, False] or kept.tolist() == [True, True, True, False]
    kept = np.isfinite(filter_logits(x, _p(min_p=0.25)))  # keep p >= 0.25 * 0.5
    assert kept.tolist() == [True, True, True, False]


def test_distribution_follows_temperature():
    rng = np.random.default_rng(123)
    probs = np.array([0.6, 0.3, 0.1])
    x = np.log(probs)
    n = 6000
    counts = np.bincount([sample(x, _p(), rng, [], 3) for _ in range(n)], minlength=3)
    assert np.all(np.abs(counts / n - probs) < 0.03)
    hot = np.bincount([sample(x, _p(temperature=0.25), rng, [], 3) for _ in range(2000)], minlength=3)
    assert hot[0] / 2000 > 0.9  # p^4 renormalised: 0.6^4 / (0.6^4 + 0.3^4 + 0.1^4) = 0.94


def test_repetition_penalty_rule():
    x = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    y = apply_repetition_penalty(x, [0, 1, 1], 2.0)
    assert y.tolist() == [1.0, -4.0, 1.0]
    assert x.tolist() == [2.0, -2.0, 1.0]


def test_seed_determinism():
    x = np.random.default_rng().standard_normal(3000)
    a = [sample(x, _p(), np.random.default_rng(7), [], 3000) for _ in range(5)]
    b = [sample(x, _p(), np.random.default_rng(7), [], 3000) for _ in range(5)]
    assert a == b


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                dict(min_p=1.0), dict(min_p=-0.1), dict(repeat_penalty=0.0),
                                dict(temperature=float("nan"))])
def test_out_of_range_values_are_errors(kw):
    with pytest.raises(KuiperError):
        _p(**kw)


def test_defaults_from_generation_config():
    p = SamplingParams.from_generation_config({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True})
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.6, 20, 0.95, 0.0)
    assert SamplingParams.from_generation_config({"do_sample": False}).temperature == 0.0
    assert SamplingParams.from_generation_config({"temperature": 0.6}, temperature=0.0).temperature == 0.0


def test_top_p_after_top_k_equals_the_whole_vocabulary_sort():
    """top-p sorts only the tokens top-k kept: the same mask as a stable sort of the whole vocabulary (ties
    included), for fresh random logits and parameters, at the vocabulary's real size too."""
    rng = np.random.default_rng()

    def whole_sort(x, p):
        x = x / p.temperature
        if p.top_k and p.top_k < x.size:
            x = np.where(x < np.partition(x, -p.top_k)[-p.top_k], -np.inf, x)
        order = np.argsort(-x, kind="stable")
        mass = np.cumsum(np.exp(x[order] - x[order[0]]))
        cut = int(np.searchsorted(mass / mass[-1], p.top_p)) + 1
        x = x.copy()
        x[order[cut:]] = -np.inf
        return x
    for k in range(500):
        V = int(rng.integers(2, 400)) if k % 50 else 151643
        x = rng.standard_normal(V) * rng.uniform(0.1, 10)
        if rng.random() < 0.5:
            x = np.round(x, 1)  # ties
        p = _p(temperature=float(rng.uniform(0.1, 2)), top_k=int(rng.integers(0, V + 3)),
               top_p=float(rng.choice([rng.uniform(0.01, 1.0), 0.999999999])))
        np.testing.assert_array_equal(filter_logits(x, p), whole_sort(x, p))


def test_openai_penalties_count_generated_ids():
    rng = np.random.default_rng()
    x = rng.standard_normal(300).astype(np.float32)
    gen = rng.integers(0, 300, size=40).tolist()
    want = x.astype(np.float64).copy()
    for i in set(gen):
        want[i] -= 0.7 * gen.count(i) + 0.3
    got = apply_openai_penalties(x, gen, presence=0.3, frequency=0.7)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert apply_openai_penalties(x, [], 1.0, 1.0) is x
    # greedy with a frequency penalty on the repeated winner moves to the runner-up
    order = np.argsort(-x)
    p = _p(temperature=0.0, frequency_penalty=2.0)
    margin = float(x[order[0]] - x[order[1]])
    reps = int(margin / 2.0) + 1
    assert sample(x, p, rng, [], 300, generated=[int(order[0])] * reps) == int(order[1])
    assert sample(x, p, rng, [int(order[0])] * reps, 300) == int(order[0])  # (the prompt is not counted)
    assert p.needs_host and not _p().needs_host


def test_token_logprobs_match_torch_log_softmax():
    import torch
    rng = np.random.default_rng()
    x = (rng.standard_normal(1000) * 4).astype(np.float32)
    x[995] = 50.0  # padding: outside n_valid, not part of the distribution
    ref = torch.log_softmax(torch.from_numpy(x[:990]).double(), dim=0)
    tok = int(rng.integers(0, 990))
    lp, top = token_logprobs(x, tok, 5, n_valid=990)
    assert abs(lp - float(ref[tok])) < 1e-9
    vals, ids = torch.topk(ref, 5)
    assert [i for i, _ in top] == ids.tolist()
    np.testing.assert_allclose([v for _, v in top], vals.numpy(), atol=1e-9)
    assert token_logprobs(x, tok, 0, 990)[1] == []


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-3.0)])
def test_openai_penalty_range(kw):
    with pytest.raises(KuiperError):
        _p(**kw)
