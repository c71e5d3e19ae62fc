"""The residual add + RMSNorm and embedding gather kernels (cuda/ops/norm.py, kernels_cu/norm.cu) against NumPy
(device machine only).

Every output is poisoned with NaN before the kernel runs, so an element the kernel fails to write
fails the comparison; inputs are fresh random draws on every run.
"""
import numpy as np
import pytest

from reference import rel

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")
from cuda_common import nan_like  # noqa: E402 (after the module-level skip)


@pytest.mark.parametrize("T,D", [(1, 4096), (7, 1024), (300, 5120), (2, 8192), (65, 136)])
def test_add_rmsnorm_without_residual(T, D):
    """add_rmsnorm with no residual row (a prefill's first layer): h kept, x its RMSNorm."""
    from kuiper_py.ops_numpy import rmsnorm
    rng = np.random.default_rng()
    hs = (3 * rng.standard_normal((T, D))).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float16)
    h = cp.asarray(hs)
    x = oc.add_rmsnorm(h, None, cp.asarray(w), 1e-6, nan_like((T, D), cp.float16))
    np.testing.assert_array_equal(cp.asnumpy(h), hs)
    assert rel(cp.asnumpy(x), rmsnorm(hs, w, 1e-6)) < 2e-3


@pytest.mark.parametrize("T,D", [(1, 4096), (7, 1024), (300, 5120), (513, 2048), (3, 136)])
def test_add_rmsnorm_and_embed(T, D):
    from kuiper_py.ops_numpy import rmsnorm
    rng = np.random.default_rng()
    table = rng.standard_normal((1000, D)).astype(np.float16)
    ids = rng.integers(0, 1000, T).astype(np.int32)
    h = nan_like((T, D), cp.float32)
    oc.kernel("norm", "embed_gather")((T,), (256,), (cp.asarray(ids), cp.asarray(table), h, np.int32(D)))
    np.testing.assert_array_equal(cp.asnumpy(h), table[ids].astype(np.float32))
    r = rng.standard_normal((T, D)).astype(np.float16)
    w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float16)
    x = oc.add_rmsnorm(h, cp.asarray(r), cp.asarray(w), 1e-6, nan_like((T, D), cp.float16))
    hs = table[ids].astype(np.float32) + r.astype(np.float32)
    np.testing.assert_allclose(cp.asnumpy(h), hs, rtol=1e-6, atol=1e-6)
    assert rel(cp.asnumpy(x), rmsnorm(hs, w, 1e-6)) < 2e-3
