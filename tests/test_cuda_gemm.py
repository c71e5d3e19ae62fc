"""The prefill GEMMs (cuda/ops/gemm.py; kernels_cu/gemm_w4a16.cu, gemm_wgmma.cu) against NumPy references at
real Qwen3 shapes and awkward sizes (device machine only): the MMA GEMM, dequantization + cuBLAS, the fused Hopper
wgmma and register-A (rs) kernels with their split-K and plans, the path choice, and prefill's SwiGLU.

Every output is poisoned with NaN before the kernel runs, so an element the kernel fails to write
fails the comparison; inputs are fresh random draws on every run.
"""

import numpy as np
import pytest

from kuiper_py.cuda import settings as cfg
from conftest import ROOT, run_python
from reference import patch, rel, tune

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")
from cuda_common import SHAPES, nan_like, rand_awq  # noqa: E402 (after the module-level skip)


@pytest.mark.parametrize("M", [2, 3, 17, 127, 300, 1030, 2047])
@pytest.mark.parametrize("K,N", [(4096, 4096), (4096, 6144), (12288, 4096), (5120, 1024), (5120, 8192),
                                 (8192, 5120), (5120, 25600), (25600, 5120), (1024, 3072)])
def test_gemm_shapes(M, K, N):
    """The fused W4A16 MMA GEMM (its tile code is also the MoE grouped GEMMs')."""
    if M == 2047 and K * N > 4096 * 6144:
        pytest.skip("reference too slow on the host for this combination")
    rng = np.random.default_rng()
    m, r = rand_awq(rng, K, N)
    x = rng.standard_normal((M, K)).astype(np.float16)
    out = nan_like((M, N), cp.float16)
    oc.gemm(cp.asarray(x), m, out, path="mma")
    ref = x.astype(np.float32) @ r.astype(np.float32)
    assert rel(cp.asnumpy(out), ref) < 1e-2


@pytest.mark.parametrize("K,N,g", [(4096, 6144, 128), (12288, 4096, 128), (384, 96, 32), (256, 416, 64)])
def test_awq_dequant(K, N, g):
    """The large-M prefill path's fp16 matrix: every element (q - z) * s rounded once, also in a
    narrower last column tile and with small groups."""
    rng = np.random.default_rng()
    m, r = rand_awq(rng, K, N, g)
    out = nan_like((K, N), cp.float16)
    oc.awq_dequant(m, out)
    got = cp.asnumpy(out).astype(np.float64)
    # q - z is exact, so one fp16 rounding of the exact product: half an ulp, or 2^-25 if subnormal
    assert np.all(np.abs(got - r) <= 2.0**-11 * np.abs(r) + 2.0**-25)


@pytest.mark.parametrize("K,Ns,g", [(4096, (4096, 1024, 1024), 128), (1024, (2048, 1024, 1024), 128),
                                    (256, (416, 96), 64), (384, (96,), 32)])
def test_awq_dequant3(K, Ns, g):
    """q, k and v dequantized side by side by one launch (awq_dequant3) into a column slice of a wider poisoned
    matrix: each matrix's columns as awq_dequant writes them (the same rounding bound), one or two matrices too
    (empty slots write nothing), and the columns beside the slice still poisoned."""
    rng = np.random.default_rng()
    pairs = [rand_awq(rng, K, n, g) for n in Ns]
    N = sum(Ns)
    wide = nan_like((K, N + 64), cp.float16)
    oc.awq_dequant3(tuple(m for m, _ in pairs), wide[:, 32:32 + N])
    got = cp.asnumpy(wide).astype(np.float64)
    r = np.concatenate([r for _, r in pairs], axis=1)
    assert np.all(np.abs(got[:, 32:32 + N] - r) <= 2.0**-11 * np.abs(r) + 2.0**-25)
    assert np.isnan(got[:, :32]).all() and np.isnan(got[:, 32 + N:]).all()


@pytest.mark.parametrize("M", [2, 17, 300, 1030])
@pytest.mark.parametrize("K,N", [(4096, 6144), (12288, 4096), (5120, 25600), (1024, 3072), (384, 96)])
def test_gemm_dequant_path(M, K, N):
    """gemm()'s default prefill path, dequantize + cuBLAS, against the float64 dequantized reference;
    the scratch matrix is poisoned first, so a dequantization that skips elements shows."""
    rng = np.random.default_rng()
    m, r = rand_awq(rng, K, N, 32 if K == 384 else 128)
    oc.dequant_scratch(K * N).fill(np.nan)
    x = rng.standard_normal((M, K)).astype(np.float16)
    out = nan_like((M, N), cp.float16)
    oc.gemm(cp.asarray(x), m, out, path=None if M >= cfg.SETTINGS.gemm_dequant_min_m else "dequant")  # None: the dispatch
    assert rel(cp.asnumpy(out), x.astype(np.float32) @ r.astype(np.float32)) < 1e-2


@pytest.mark.parametrize("path", ["dequant", "mma"])
@pytest.mark.parametrize("M", [2, 300])
def test_gemm_group(M, path):
    """Prefill's q, k, v as one product: three matrices with the same K dequantized side by side into
    one scratch matrix (poisoned first) for one cuBLAS call, or three MMA GEMMs on the other path;
    then a plain call, as the next projection makes, whose scratch lines were dropped from L2."""
    rng = np.random.default_rng()
    D, kv = 4096, 1024
    mats = [rand_awq(rng, D, n) for n in (D, kv, kv)]
    ref = np.concatenate([r for _, r in mats], axis=1)
    oc.dequant_scratch(D * (D + 2 * kv)).fill(np.nan)
    x = rng.standard_normal((M, D)).astype(np.float16)
    out = nan_like((M, D + 2 * kv), cp.float16)
    oc.gemm(cp.asarray(x), tuple(m for m, _ in mats), out, path=path)
    assert rel(cp.asnumpy(out), x.astype(np.float32) @ ref.astype(np.float32)) < 1e-2
    m, r = rand_awq(rng, D, D)
    out = nan_like((M, D), cp.float16)
    oc.gemm(cp.asarray(x), m, out, path=path)
    assert rel(cp.asnumpy(out), x.astype(np.float32) @ r.astype(np.float32)) < 1e-2


@pytest.mark.parametrize("T,K,N", [(1, 64, 64), (300, 1024, 3072), (2048, 4096, 1024)])
def test_cublas_matmul(T, K, N):
    """The dequant path's direct cublasGemmEx (cublas_matmul) gives cupy.matmul's bits on contiguous operands, and on a
    stream of its own reads a column slice of a wider x and writes a column slice of a wider poisoned matrix, leaving
    the columns beside it poisoned."""
    rng = np.random.default_rng()
    xw = rng.standard_normal((T, K + 64)).astype(np.float16)
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float16)
    x, W = cp.asarray(xw[:, 32:32 + K]), cp.asarray(w)
    out = nan_like((T, N), cp.float16)
    oc.cublas_matmul(x, W, out)
    assert np.array_equal(cp.asnumpy(out), cp.asnumpy(cp.matmul(x, W)))
    wide = nan_like((T, N + 128), cp.float16)
    with cp.cuda.Stream() as s:
        oc.cublas_matmul(cp.asarray(xw)[:, 32:32 + K], W, wide[:, 64:64 + N])
        s.synchronize()
    got = cp.asnumpy(wide)
    assert rel(got[:, 64:64 + N], xw[:, 32:32 + K].astype(np.float32) @ w.astype(np.float32)) < 1e-2
    assert np.isnan(got[:, :64]).all() and np.isnan(got[:, 64 + N:]).all()


def check_wgmma(rng, M, run_qkv, run_lone, repeats=1):
    """The fused Hopper GEMM's two cases against the float64 dequantized reference: q, k and v in one
    launch of run_qkv(x, mats, out) (the block picks its matrix by column), rows past M and a ragged
    last row tile, each of `repeats` launches bitwise equal to the first; then a lone matrix with
    64-row groups and more K tiles than stages through run_lone(x, mats, out)."""
    D, kv = 1024, 256
    mats = [rand_awq(rng, D, n) for n in (D, kv, kv)]
    ref = np.concatenate([r for _, r in mats], axis=1)
    x = rng.standard_normal((M, D)).astype(np.float16)
    outs = []
    for _ in range(repeats):
        out = nan_like((M, D + 2 * kv), cp.float16)
        run_qkv(cp.asarray(x), tuple(m for m, _ in mats), out)
        outs.append(cp.asnumpy(out))
    assert rel(outs[0], x.astype(np.float32) @ ref.astype(np.float32)) < 1e-2
    for o in outs[1:]:
        assert np.array_equal(outs[0], o)
    m, r = rand_awq(rng, 3072, 512, 64)
    x = rng.standard_normal((M, 3072)).astype(np.float16)
    out = nan_like((M, 512), cp.float16)
    run_lone(cp.asarray(x), (m,), out)
    assert rel(cp.asnumpy(out), x.astype(np.float32) @ r.astype(np.float32)) < 1e-2


@pytest.mark.parametrize("producers", oc.WGMMA_PRODUCERS)
@pytest.mark.parametrize("tile", list(oc.WGMMA_TILES))
@pytest.mark.parametrize("M", [1, 17, 300, 1030])
def test_gemm_wgmma(M, tile, producers):
    """The fused Hopper GEMM (short-prompt prefill path, gemm_wgmma.cu), each tile and producer count
    in whole tiles (check_wgmma's q|k|v case); the lone matrix through gemm()'s default plan."""
    if not oc.wgmma_available():
        pytest.skip("wgmma needs compute capability 9.0")
    check_wgmma(np.random.default_rng(), M,
                lambda x, mats, out: oc.gemm_wgmma(x, mats, out, tile=tile, producers=producers),
                lambda x, mats, out: oc.gemm(x, mats[0], out, path="wgmma"))


@pytest.mark.parametrize("split", [1, 2, 3, 16])
@pytest.mark.parametrize("bt", [128, 256])
@pytest.mark.parametrize("M", [1, 17, 300, 1030])
def test_gemm_rs_prototype(M, bt, split):
    """The register-A wgmma GEMM (gemm_wgmma.cu gemm_w4a16_rs) at each width
    and split on check_wgmma's cases, bt tokens per block (256: blocks of 128 channels, half a column tile, 5
    stages): q|k|v side by side with ragged last token tiles, two launches bitwise equal (split parts are
    added in a fixed order whatever order they finish in), and the lone matrix with 64-row groups and more
    K tiles than its stages; each tile's K in `split` ranges (3: uneven, 16: one K tile each for q|k|v),
    the tickets left at zero."""
    if not oc.wgmma_available():
        pytest.skip("wgmma needs compute capability 9.0")

    def run(x, mats, out):
        return oc.gemm_rs(x, mats, out, bt, split)

    check_wgmma(np.random.default_rng(), M, run, run, repeats=2)
    assert not oc.gemm_split_buffers(0)[1].any()


@pytest.mark.parametrize("T,N,K", [(512, 6144, 4096), (512, 4096, 4096), (512, 12288, 4096), (2048, 6144, 4096),
                                   (1, 4096, 4096), (512, 4096, 512)])
def test_rs_plan(T, N, K):
    """rs_plan's split leaves every part at least 8 K tiles (or 1 split), and no other split within its
    bounds costs less in its model (waves of parts, each a part's K tiles plus RS_PART_COST)."""
    s = oc.rs_plan(T, N, K)
    tiles, sms, nk = -(-T // 128) * (N // 256), oc.sm_count(), K // 64
    assert s == 1 or nk // s >= 8

    def cost(t):
        return -(-tiles * t // sms) * (nk / t + oc.RS_PART_COST)
    assert all(cost(t) >= cost(s) for t in range(1, max(1, min(8, nk // 8)) + 1))


@pytest.mark.parametrize("T,N,K", [(256, 6144, 4096), (384, 5120, 2048), (512, 4096, 4096), (512, 24576, 4096),
                                   (768, 5120, 2048), (300, 1536, 1024), (1, 2048, 4096)])
def test_rs_choose(T, N, K):
    """rs_choose's (tokens per block, split): one of the path's two block widths with rs_plan's split for it,
    and no other width and split within rs_plan's bounds costs less in rs_cost."""
    bt, s = oc.rs_choose(T, N, K)
    assert bt in (128, 256) and s == oc.rs_plan(T, N, K, bt)
    nk = K // 64
    assert all(oc.rs_cost(T, N, K, b, t) >= oc.rs_cost(T, N, K, bt, s)
               for b in (128, 256) for t in range(1, max(1, min(8, nk // 8)) + 1))


@pytest.mark.parametrize("M", [80, 144, 200, 256, 300, 512, 700])  # (80-255: the short prompts rs serves)
def test_gemm_rs_path(M):
    """gemm()'s "rs" path (gemm_w4a16_rs as rs_choose plans it) on check_wgmma's cases: q|k|v side by side,
    two launches bitwise equal (the repeat through the launch record the first one kept), and the lone matrix
    (64-row groups)."""
    if not oc.wgmma_available():
        pytest.skip("wgmma needs compute capability 9.0")

    def run(x, mats, out):
        return oc.gemm(x, mats, out, path="rs")

    check_wgmma(np.random.default_rng(), M, run, run, repeats=2)
    assert not oc.gemm_split_buffers(0)[1].any()


@pytest.mark.parametrize("M", [257, 300, 320])
def test_gemm_rs_rows_split(monkeypatch, M):
    """gemm()'s "rs" path with its rows split in two launches (rs_rows_split: the first 256 rows by
    256-token blocks, the rest by 64-token blocks; the weight bound lowered to 0 so check_wgmma's small matrices
    take it): q|k|v side by side and the lone matrix against the reference, every row written (outputs poisoned),
    two runs bitwise equal, and both launches seen with their row counts."""
    if not oc.wgmma_available():
        pytest.skip("wgmma needs compute capability 9.0")
    patch(monkeypatch, "RS_ROWS_SPLIT_KN", 0)
    seen = []
    real = oc.gemm_rs

    def spy(x, mats, out, bt=None, split=None):
        seen.append((x.shape[0], bt))
        return real(x, mats, out, bt, split)
    patch(monkeypatch, "gemm_rs", spy)

    def run(x, mats, out):
        return oc.gemm(x, mats, out, path="rs")

    check_wgmma(np.random.default_rng(), M, run, run, repeats=2)
    assert seen == [(256, 256), (M - 256, 64)] * 3
    assert not oc.gemm_split_buffers(0)[1].any()


def test_gemm_path_routes_rs(monkeypatch):
    """gemm_path's choice at the Qwen3-8B and 30B-A3B shapes on Hopper: the fused wgmma kernel for short
    prompts, rs inside rs_range, dequant + cuBLAS past it; GEMM_RS=0 never rs, =1 always (when the
    shapes fit)."""
    if not oc.wgmma_available() or not oc.cublas_ready():
        pytest.skip("needs compute capability 9.0 and cuBLAS")

    class Mat:  # gemm_path reads only K, N, group_size (and ids), not the arrays
        def __init__(self, K, N):
            self.K, self.N, self.group_size = K, N, 128

    def mats(K, *Ns):
        return tuple(Mat(K, n) for n in Ns)
    qkv, o, gu, down = mats(4096, 4096, 1024, 1024), mats(4096, 4096), mats(4096, 12288, 12288), mats(12288, 4096)
    qkv30, o30 = mats(2048, 4096, 512, 512), mats(4096, 2048)
    tune(monkeypatch, gemm_rs="auto")
    tune(monkeypatch, gemm_wgmma="auto")
    for m in (qkv, gu, down):  # (rs from 80 rows for matrices past 4096 x 4096)
        assert ([oc.gemm_path(T, m) for T in (64, 79, 80, 128, 256, 512, 768, 2048)] ==
                ["wgmma", "wgmma", "rs", "rs", "rs", "rs", "dequant", "dequant"])
    assert ([oc.gemm_path(T, o) for T in (128, 143, 144, 256, 512, 768, 2048)] ==
            ["wgmma", "wgmma", "rs", "rs", "rs", "dequant", "dequant"])
    assert [oc.gemm_path(T, qkv30) for T in (128, 223, 224, 256, 768, 1024)] == ["wgmma", "wgmma", "rs", "rs", "rs",
                                                                                 "dequant"]
    assert [oc.gemm_path(T, o30) for T in (256, 384, 768, 1024)] == ["wgmma", "rs", "rs", "dequant"]
    tune(monkeypatch, gemm_rs="0")
    assert oc.gemm_path(512, o) == "wgmma" and oc.gemm_path(512, qkv) == "dequant"
    tune(monkeypatch, gemm_rs="1")  # (2 to rows_max_m rows take gemv_rows first, unless rows_max_m is 0)
    assert oc.gemm_path(16, qkv) == "rows" and oc.gemm_path(17, qkv) == "rs" and oc.gemm_path(4096, down) == "rs"
    tune(monkeypatch, rows_max_m=0)
    assert oc.gemm_path(4, qkv) == "rs"
    assert oc.gemm_path(512, mats(4096, 4096, 384)) == "dequant"  # N % 256: not in the fused kernels' table


_RS_BAD_BLOCK = """
import cupy as cp, numpy as np
from kuiper_py import ops_cupy as oc
from kuiper_py.loader import AwqLinear
K, N = 256, 256
m = oc.device_linear(AwqLinear(np.zeros((K, N // 8), np.int32), np.zeros((K // 128, N // 8), np.int32),
                               np.ones((K // 128, N), np.float16), 128))
x, out = cp.zeros((128, K), cp.float16), cp.zeros((128, N), cp.float16)
oc._RS_CALLS.clear()
oc.gemm_rs(x, (m,), out, 128, 1)  # the right launch first: it keeps its record
cp.cuda.Device().synchronize()
print("right block ran", flush=True)
(key, rec), = oc._RS_CALLS.items()
oc._RS_CALLS[key] = rec[:2] + ((128,),) + rec[3:]  # one warpgroup for four consumer warpgroups' barriers
oc.gemm_rs(x, (m,), out, 128, 1)
cp.cuda.Device().synchronize()
"""


def test_gemm_rs_traps_on_wrong_block():
    """gemm_w4a16_rs launched with fewer threads than its consumer warpgroups fails with a CUDA error (its
    blockDim trap) instead of hanging on barriers no warp will complete."""
    if not oc.wgmma_available():
        pytest.skip("wgmma needs compute capability 9.0")
    r = run_python("-c", _RS_BAD_BLOCK, timeout=120, cwd=ROOT)
    assert "right block ran" in r.stdout, r.stderr[-2000:]  # the error below is the wrong block's
    assert r.returncode != 0 and "CUDA" in r.stderr.upper(), r.stderr[-2000:]


@pytest.mark.parametrize("producers", oc.WGMMA_PRODUCERS)
@pytest.mark.parametrize("tile", list(oc.WGMMA_TILES))
@pytest.mark.parametrize("M,full,split", [(1, 0, 2), (300, 5, 3), (1030, 1, 4), (130, 7, 16)])
def test_gemm_wgmma_split(M, full, split, tile, producers):
    """gemm_wgmma.cu's split-K on the wave tail: the tiles past the first `full` each split into
    `split` K ranges (uneven ones for 3, one K tile each for 16), the last block of a tile to finish
    adding the parts. check_wgmma's cases; the q|k|v launch repeated bitwise equal (the parts are
    added in a fixed order, whatever the order blocks finish in) and the tickets left at zero."""
    if not oc.wgmma_available():
        pytest.skip("wgmma needs compute capability 9.0")
    check_wgmma(np.random.default_rng(), M,
                lambda x, mats, out: oc.gemm_wgmma(x, mats, out, plan=(*tile, full, split), producers=producers),
                lambda x, mats, out: oc.gemm_wgmma(x, mats, out, plan=(*tile, full // 2, split), producers=producers),
                repeats=2)
    assert not oc.gemm_split_buffers(0)[1].any()


@pytest.mark.parametrize("T,N,K", [(512, 6144, 4096), (512, 4096, 4096), (512, 5120, 2048), (2048, 4096, 12288),
                                   (128, 4096, 4096), (17, 6144, 4096)])
def test_wgmma_plan(T, N, K):
    """wgmma_plan covers every tile exactly once: n_full whole tiles plus the rest split, the split
    tiles fit in one wave, each part keeps at least 8 K tiles."""
    bm, bn, n_full, split = oc.wgmma_plan(T, N, K)
    tiles = -(-T // bm) * (N // bn)
    assert (bm, bn) in oc.WGMMA_TILES and 0 <= n_full <= tiles
    if split > 1:
        assert (tiles - n_full) * split <= oc.sm_count() and K // 64 // split >= 8
    else:
        assert n_full == tiles


def test_gemm_wgmma_shape_table():
    """Shapes outside gemm_wgmma.cu's table (N % 256, group % 64, mixed K) never take that path."""
    rng = np.random.default_rng()
    ok, _ = rand_awq(rng, 256, 512)
    narrow, _ = rand_awq(rng, 256, 384)
    small_group, _ = rand_awq(rng, 256, 512, 32)
    other_k, _ = rand_awq(rng, 512, 512)
    assert oc.wgmma_fits((ok, ok, ok)) and not oc.wgmma_fits((ok, ok, ok, ok))
    assert not oc.wgmma_fits((narrow,)) and not oc.wgmma_fits((small_group,)) and not oc.wgmma_fits((ok, other_k))


def test_gemm_falls_back_to_mma_without_cublas(monkeypatch, capfd):
    """A machine whose cuBLAS cannot be loaded: one stderr line, and prefill still runs (MMA GEMM)."""
    rng = np.random.default_rng()
    m, r = rand_awq(rng, 1024, 3072)
    dev = cp.cuda.Device().id

    def no_cublas(*a, **k):
        raise RuntimeError("libcublas.so: cannot open shared object file")
    patch(monkeypatch, "_CUBLAS", {})
    tune(monkeypatch, gemm_wgmma="0")  # as off Hopper: the fused wgmma GEMM would take 300 rows
    monkeypatch.setattr(oc.cp, "matmul", no_cublas)
    x = rng.standard_normal((300, 1024)).astype(np.float16)
    out = nan_like((300, 3072), cp.float16)
    oc.gemm(cp.asarray(x), m, out)
    assert oc._CUBLAS[dev] is False and "cuBLAS unavailable" in capfd.readouterr().err
    assert rel(cp.asnumpy(out), x.astype(np.float32) @ r.astype(np.float32)) < 1e-2


@pytest.mark.parametrize("model,T", [("0.6b", 1), ("0.6b", 17), ("0.6b", 600), ("0.6b", 1000), ("8b", 17),
                                     ("8b", 300), ("8b", 700)])
def test_swiglu_prefill(model, T):
    """Prefill's SwiGLU, silu(x W1) * (x W3), against the float64 dequantized reference on every path:
    gate and up in one launch of either fused Hopper kernel ([T, 2I], rows ld = 2I apart for silu_mul;
    wgmma for short prompts, rs for mid-size ones) or one dequant + cuBLAS product each (long prompts, or
    off Hopper)."""
    rng = np.random.default_rng()
    D, I = SHAPES[model]["D"], SHAPES[model]["I"]
    (w1, r1), (w3, r3) = rand_awq(rng, D, I), rand_awq(rng, D, I)
    x = (rng.standard_normal((T, D)) * 0.5).astype(np.float16)
    g, u = x.astype(np.float64) @ r1, x.astype(np.float64) @ r3
    want = g / (1 + np.exp(-g)) * u
    out = nan_like((T, I), cp.float16)
    oc.swiglu_prefill(cp.asarray(x), w1, w3, out)
    got = cp.asnumpy(out)
    assert rel(got, want) < 1e-2
