"""gemv_rows.cu: the W4A16 projections and the fp16 lm_head for 2..16 token rows (a speculative verify step, short
prompts) against float64 references on fresh random weights, into poisoned outputs."""
from __future__ import annotations

import numpy as np
import pytest

from reference import dequant_reference, rand_awq_tensors, rel

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")
from kuiper_py.cuda.ops import rows  # noqa: E402
from kuiper_py.loader import AwqLinear  # noqa: E402
from cuda_common import rand_head  # noqa: E402 (after the module-level skip)


def rand_awq(rng, K, N, g=128):
    qw, qz, sc = rand_awq_tensors(rng, K, N, g)
    return oc.device_linear(AwqLinear(qw, qz, sc, g)), dequant_reference(qw, qz, sc, g)


@pytest.mark.parametrize("M", [2, 5, 16])
@pytest.mark.parametrize("K,Ns,g", [(4096, (4096, 1024, 1024), 128), (12288, (4096,), 128),
                                    (1024, (3072,), 64), (384, (96,), 32), (256, (416, 96), 64),
                                    (352, (256, 64), 32), (1024, (512,), 256), (1152, (288,), 384)])
def test_rows_gemm(M, K, Ns, g):
    """One to three matrices side by side (q|k|v, gate|up), narrow last column tiles, small groups and groups past
    a 128-row chunk, a K whose last chunk is short, one split and many: every output element written (poisoned
    out), within fp16 rounding of the float64 product, bit-identical on a second run (the split sums are added in
    split order), the arrival counters left zero."""
    rng = np.random.default_rng()
    pairs = [rand_awq(rng, K, n, g) for n in Ns]
    mats = tuple(m for m, _ in pairs)
    ref = np.concatenate([r for _, r in pairs], axis=1)
    x = rng.standard_normal((M, K)).astype(np.float16)
    out = cp.full((M, sum(Ns)), np.nan, cp.float16)
    rows.rows_gemm(cp.asarray(x), mats, out)
    assert rel(cp.asnumpy(out), x.astype(np.float64) @ ref) < 1e-2
    again = cp.full_like(out, np.nan)
    rows.rows_gemm(cp.asarray(x), mats, again)
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(again))
    assert int(cp.count_nonzero(rows.rows_scratch()[1])) == 0


@pytest.mark.parametrize("K,Ns", [(256, (128,)), (4096, (4096,)), (12288, (4096,)), (4096, (4096, 1024, 1024))])
def test_a_rows_sums_do_not_depend_on_the_rows_beside_it(K, Ns):
    """Each of M rows gives bitwise the same outputs as in a launch of 16 rows (its first M rows): an eager paged
    step of M rows and its bucket's graph replay, or a verify step's rows, agree to the bit. Shapes whose K split
    a cost model per row count would change (one tile of K 256; 8B's o, down and q|k|v)."""
    rng = np.random.default_rng()
    mats = tuple(rand_awq(rng, K, n)[0] for n in Ns)
    x = cp.asarray(rng.standard_normal((rows.ROWS_MAX, K)).astype(np.float16))
    full = cp.asnumpy(rows.rows_gemm(x, mats))
    for M in (2, 3, 5, 8, 9, 13):
        np.testing.assert_array_equal(cp.asnumpy(rows.rows_gemm(x[:M], mats)), full[:M])


@pytest.mark.parametrize("M", [2, 9, 16])
def test_prefill_of_few_rows_takes_rows_path(M):
    """gemm()'s dispatch sends 2..16 rows to gemv_rows (and the result is the product), for a shape that no GPU's
    table (settings rows_wgmma_min) sends to the fused GEMM."""
    rng = np.random.default_rng()
    m, r = rand_awq(rng, 2048, 4096)
    assert oc.gemm_path(M, (m,)) == "rows"
    x = rng.standard_normal((M, 2048)).astype(np.float16)
    assert rel(cp.asnumpy(oc.gemm(cp.asarray(x), m)), x.astype(np.float64) @ r) < 1e-2


@pytest.mark.parametrize("M", [1, 5, 8, 9, 16])
@pytest.mark.parametrize("V,D", [(1000, 1024), (151936 // 8, 4096)])
def test_rows_lm_head(M, V, D):
    """Logits of M rows in one pass over the head: the float64 dot products to fp32 accuracy, every row and
    vocabulary entry written (poisoned out, V not a multiple of the block's 128 rows)."""
    rng = np.random.default_rng()
    W = rand_head(rng, V, D)
    x = rng.standard_normal((M, D)).astype(np.float16)
    out = cp.full((M, V), np.nan, cp.float32)
    rows.rows_lm_head(cp.asarray(x), cp.asarray(W), out)
    ref = x.astype(np.float64) @ W.astype(np.float64).T
    got = cp.asnumpy(out)
    assert np.isfinite(got).all()
    assert np.max(np.abs(got - ref)) < 1e-4 * np.max(np.abs(ref))
