"""The one-launch FFN half of a dense decode layer (cuda/ops/decode_halves.py, kernels_cu/ffn_decode.cu)
against float64 NumPy (device machine only), through its cluster exchange and its global-memory exchange.

Every output is poisoned with NaN before the kernel runs, so an element the kernel fails to write
fails the comparison; inputs are fresh random draws on every run.
"""
import types

import numpy as np
import pytest

from reference import cluster_plan_or_skip, pending_row_inputs, rel

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")
from cuda_common import nan_like, rand_awq, rmsnorm_ref  # noqa: E402 (after the module-level skip)


@pytest.mark.parametrize("massive", [False, True])
@pytest.mark.parametrize("CL,TB", oc.FFN_PAIRS)
def test_ffn_decode_cluster_kernel(CL, TB, massive):
    """The FFN half of a dense decode layer in one cluster launch (ffn_decode.cu), every (CL, TB)
    instantiation at D = 256 CL TB and three clusters of channels, against float64 NumPy: the o
    projection's pending fixed-point sums added to the residual (the new row written exactly), RMSNorm,
    gate and up, SwiGLU, down into a fixed-point accumulator. massive: three residual channels at 1e5
    with norm weight 40 (x = h * w = 4e6 before the deferred 1/rms, past fp16's range; SwiGLU outputs
    in the thousands), so both of the kernel's overflow guards run. Launched twice: bitwise the same."""
    plan = cluster_plan_or_skip("ffn_decode", CL, TB, 3)
    _ffn_decode_launches(CL, TB, massive, [plan, plan])


def _ffn_decode_launches(CL, TB, massive, plans):
    """decode_ffn through each plan in turn on one fresh draw (D = 256 CL TB, three channel tiles): the new
    residual row exact, the first launch's sums against float64 NumPy, every launch bitwise equal to it."""
    rng = np.random.default_rng()
    D, I, eps = 256 * CL * TB, 3 * 256, 1e-6
    (mg, rg), (mu, ru), (md, rd) = rand_awq(rng, D, I), rand_awq(rng, D, I), rand_awq(rng, I, D)
    h, w, pend, row = pending_row_inputs(rng, D, massive)
    x = rmsnorm_ref(row.astype(np.float64), w.astype(np.float64), eps)
    g, u = x @ rg, x @ ru
    ref = (g / (1 + np.exp(-g)) * u).astype(np.float16).astype(np.float64) @ rd
    layer = types.SimpleNamespace(w1=mg, w3=mu, w2=md)
    outs = []
    for p in plans:
        hout, acc = nan_like((1, D), cp.float32), cp.zeros((D,), cp.int64)
        xin = types.SimpleNamespace(h=cp.asarray(h)[None], w=cp.asarray(w), pend=cp.asarray(pend), hout=hout)
        oc.decode_ffn(p, xin, layer, acc, eps)
        np.testing.assert_array_equal(cp.asnumpy(hout)[0], row)
        outs.append(cp.asnumpy(acc))
    y = outs[0].astype(np.float64) / 2**32
    assert np.isfinite(y).all() and rel(y, ref) < 1e-2, rel(y, ref)
    for o in outs[1:]:
        np.testing.assert_array_equal(outs[0], o)


@pytest.mark.parametrize("cap", oc.FFN_GLOBAL_CAPS)
@pytest.mark.parametrize("massive", [False, True])
@pytest.mark.parametrize("CL,TB", oc.FFN_PAIRS)
def test_ffn_decode_global_exchange(CL, TB, massive, cap):
    """The dense one-launch FFN without a cluster launch (ops_cupy.ffn_global_plan): the CL blocks of a
    channel tile exchange their sums through global memory (an arrival counter that only grows), against
    float64 NumPy as test_ffn_decode_cluster_kernel, launched three times on the same counters, and
    bitwise equal to the cluster's push exchange (the same sums in the same order). cap: the instantiation's
    blocks per SM (its registers)."""
    push = cluster_plan_or_skip("ffn_decode", CL, TB, 3)
    plan, why = oc.ffn_global_plan(push, 3, cap=cap)
    assert plan is not None, why
    assert oc.blocks_per_sm(plan["fn"], oc.FFN_THREADS) == cap
    _ffn_decode_launches(CL, TB, massive, [plan] * 3 + [push])
    assert int(plan["xcnt"].sum()) == 3 * CL * 3  # every block counted itself in, once per launch
