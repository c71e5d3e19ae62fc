"""Prefill graphs' padding (CupyOps.prefill_graph) checked on the CPU reference engine: a prompt padded at its end
to its length bucket gives its own last logits and, once decode overwrites the padding's cache rows, its own
continuation; and the buckets themselves. The GPU side is in test_gpu_e2e.py and test_cuda_moe.py."""
import numpy as np
import pytest

from kuiper_py import ops_cupy as oc
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps


def test_prefill_buckets():
    """Every length 2..512 maps to a bucket at or above it, buckets are monotone and fixed points, 19 of them up to
    512 (2, 4, 8, then multiples of 16), and the padding is less than the length up to 16 tokens, at most 15 rows up
    to 128 tokens, 31 up to 256, 63 beyond."""
    got = {T: oc.prefill_bucket(T) for T in range(2, 513)}
    assert all(T <= B for T, B in got.items())
    assert all(got[T] <= got[T + 1] for T in range(2, 512))
    assert all(oc.prefill_bucket(B) == B for B in got.values())
    assert len(set(got.values())) == 19 and max(got.values()) == 512
    assert {got[T] for T in range(2, 17)} == {2, 4, 8, 16} and all(got[T] < 2 * T for T in range(2, 17))
    assert all(B - T <= (15 if T <= 128 else 31 if T <= 256 else 63) for T, B in got.items())


def test_decode_regimes_are_those_the_steps_meet():
    """decode_regimes (the decode graphs a generation captures before its prompt) against every step's regime counted
    one by one, for random bounds, capacities and key ranges, and a whole cache's regimes against the bounds within it
    plus the capacity's."""
    rng = np.random.default_rng()
    for _ in range(300):
        bounds = tuple(sorted({int(b) for b in rng.integers(1, 300, size=rng.integers(0, 4))}))
        cap = int(rng.integers(1, 400))
        lo, hi = sorted(int(x) for x in rng.integers(-5, 450, size=2))
        want = sorted({oc.decode_regime(bounds, cap, n) for n in range(max(1, lo), min(hi, cap) + 1)})
        assert oc.decode_regimes(bounds, cap, (lo, hi)) == want, (bounds, cap, lo, hi)
        whole = sorted({b for b in bounds if b <= cap} | {oc.decode_regime(bounds, cap, cap)})
        assert oc.decode_regimes(bounds, cap) == whole, (bounds, cap)
    assert oc.decode_regime((512, 1024), 4096, 512) == 512 and oc.decode_regime((512, 1024), 4096, 513) == 1024
    assert oc.decode_regime((512, 1024), 4096, 1025) == 4096


def test_rs_rows_split_rule():
    """gemm()'s rs rows split applies from 257 to 320 rows, to matrices of at least 3 x 4096 x 4096
    weights only (Qwen3-8B gate|up and down, not q|k|v or o), with 256 rows in its first launch."""
    gu, down, qkv, o = (4096, 24576), (12288, 4096), (4096, 6144), (4096, 4096)
    assert [oc.rs_rows_split(T, *gu) for T in (2, 256, 257, 300, 320, 321, 352, 512)] == [0, 0, 256, 256, 256, 0, 0, 0]
    assert oc.rs_rows_split(300, *down) == 256
    assert oc.rs_rows_split(300, *qkv) == oc.rs_rows_split(300, *o) == 0


class PaddedNumpyOps(NumpyOps):
    """The reference ops serving prefill_graph as the CUDA backend does: the layers run on the prompt padded with
    id 0 to prefill_bucket(T) positions, at the cache's start or after earlier turns, where the padded
    end fits in the cache."""
    served = 0

    def prefill_graph(self, step, layers):
        ids, pos0 = step.one().ids, step.one().pos0
        B = oc.prefill_bucket(len(ids))
        if pos0 + B > self.k_cache.shape[1]:
            return None
        x = layers(list(ids) + [0] * (B - len(ids)))
        assert x.shape[0] == B
        PaddedNumpyOps.served += 1
        return x


def greedy(m, ids, n):
    lg, toks = m.prefill(ids), []
    for _ in range(n):
        toks.append(int(np.argmax(lg)))
        lg = m.decode(toks[-1])
    return toks, lg


@pytest.mark.parametrize("n", [5, 37, 129])
def test_padded_prefill_gives_the_prompts_own_logits_and_continuation(tiny_bin, n):
    mf = load(tiny_bin)
    ids = np.random.default_rng().integers(0, 151643, n).tolist()
    plain, padded = Qwen3(mf, NumpyOps, 200), Qwen3(mf, PaddedNumpyOps, 200)
    before = PaddedNumpyOps.served
    a, b = plain.prefill(ids), padded.prefill(ids)
    assert PaddedNumpyOps.served == before + 1 and padded.pos == plain.pos == n
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
    plain.reset()
    padded.reset()
    ta, la = greedy(plain, ids, 6)
    tb, lb = greedy(padded, ids, 6)
    assert ta == tb
    np.testing.assert_allclose(lb, la, rtol=1e-4, atol=1e-4 * np.abs(la).max())


def test_padded_continued_prompts_give_their_own_logits_and_continuation(tiny_bin):
    """A chat's turns padded as prefill graphs pad them, each after the ones before (pos0 > 0): every turn's last
    logits and the greedy continuation after the last turn as the unpadded engine's; the padding's cache rows past
    each turn are overwritten by the next turn or by decode before anything reads them."""
    mf = load(tiny_bin)
    rng = np.random.default_rng()
    plain, padded = Qwen3(mf, NumpyOps, 200), Qwen3(mf, PaddedNumpyOps, 200)
    before = PaddedNumpyOps.served
    for n in (7, 20, 33):
        ids = rng.integers(0, 151643, n).tolist()
        a, b = plain.prefill(ids), padded.prefill(ids)
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
    assert PaddedNumpyOps.served == before + 3 and padded.pos == plain.pos == 60
    ids = rng.integers(0, 151643, 9).tolist()
    ta, la = greedy(plain, ids, 6)
    tb, lb = greedy(padded, ids, 6)
    assert ta == tb and PaddedNumpyOps.served == before + 4
    np.testing.assert_allclose(lb, la, rtol=1e-4, atol=1e-4 * np.abs(la).max())
