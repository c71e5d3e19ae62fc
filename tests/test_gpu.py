"""CUDA kernels against NumPy references at real Qwen3 shapes and awkward sizes (device machine only).

Every output is poisoned with NaN before the kernel runs, so an element the kernel fails to write
fails the comparison; inputs are fresh random draws on every run.
"""
import ctypes
import math
import os
import types

import numpy as np
import pytest

from kuiper_py.cuda import settings as cfg
from kuiper_py import awq
from kuiper_py.loader import AwqLinear, AwqStack
from reference import cluster_plan_or_skip, dequant_reference, patch, pending_row_inputs, rand_awq_tensors, rel, tune

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")

# (K, N) projections: Qwen3-0.6B, 8B, 32B (q, kv, o, gate/up, down)
SHAPES = {
    "0.6b": dict(D=1024, q=2048, kv=1024, I=3072),
    "4b": dict(D=2560, q=4096, kv=1024, I=9728),
    "8b": dict(D=4096, q=4096, kv=1024, I=12288),
    "32b": dict(D=5120, q=8192, kv=1024, I=25600),
}


def nan_like(shape, dtype):
    return cp.full(shape, np.nan, dtype=dtype)


def rand_awq(rng, K, N, g=128):
    """Random AWQ matrix: device AwqLinear plus the float64 dequantized reference [K, N]."""
    qw, qz, sc = rand_awq_tensors(rng, K, N, g)
    ref = dequant_reference(qw, qz, sc, g)
    return oc.device_linear(AwqLinear(qw, qz, sc, g)), ref  # qweight tiled, as the loader uploads it


@pytest.mark.parametrize("model", list(SHAPES))
def test_gemv_fused_shapes(model):
    rng = np.random.default_rng()
    s = SHAPES[model]
    D, q, kv, I = s["D"], s["q"], s["kv"], s["I"]
    partial = cp.empty((max(oc.gemv_partial_size(k, ns) for k, ns in ((D, [q, kv, kv]), (q, [D]), (D, [I, I]),
                                                                      (I, [D]))),), cp.float32)
    # fused QKV (three matrices, one launch)
    mats = [rand_awq(rng, D, n) for n in (q, kv, kv)]
    x = rng.standard_normal(D).astype(np.float16)
    out = nan_like((1, q + 2 * kv), cp.float16)
    oc.gemv(cp.asarray(x)[None], [m for m, _ in mats], "plain", out, partial)
    ref = np.concatenate([x.astype(np.float64) @ r for _, r in mats])
    assert rel(cp.asnumpy(out)[0], ref) < 1e-2
    # o_proj and down_proj (one matrix, split-K)
    for K, N in ((q, D), (I, D)):
        m, r = rand_awq(rng, K, N)
        x = rng.standard_normal(K).astype(np.float16)
        out = nan_like((1, N), cp.float16)
        oc.gemv(cp.asarray(x)[None], [m], "plain", out, partial)
        assert rel(cp.asnumpy(out)[0], x.astype(np.float64) @ r) < 1e-2
    # gate/up with the SwiGLU epilogue
    (mg, rg), (mu, ru) = rand_awq(rng, D, I), rand_awq(rng, D, I)
    x = rng.standard_normal(D).astype(np.float16)
    out = nan_like((1, I), cp.float16)
    oc.gemv(cp.asarray(x)[None], [mg, mu], "swiglu", out, partial)
    g, u = x.astype(np.float64) @ rg, x.astype(np.float64) @ ru
    assert rel(cp.asnumpy(out)[0], g / (1 + np.exp(-g)) * u) < 1e-2


@pytest.mark.parametrize("K,N,g", [(128, 128, 128), (256, 384, 64), (384, 96, 32), (1024, 32, 128)])
def test_gemv_awkward_sizes(K, N, g):
    rng = np.random.default_rng()
    m, r = rand_awq(rng, K, N, g)
    x = rng.standard_normal(K).astype(np.float16)
    out = nan_like((1, N), cp.float16)
    oc.gemv(cp.asarray(x)[None], [m], "plain", out, cp.empty((oc.gemv_partial_size(K, [N]),), cp.float32))
    assert rel(cp.asnumpy(out)[0], x.astype(np.float64) @ r) < 1e-2


@pytest.mark.parametrize("source", ["x", "norm", "scaled", "moe"])
def test_gemv_massive_activations(source):
    """Real checkpoints have a few channels with activations in the thousands. The GEMV sums 4 rows of
    (q - z) * x in fp16 before scaling: four such rows against |q - z| = 15 would pass fp16's 65504
    (inf, then NaN) unless the kernel scales that input down. x given, from the RMSNorm prologue (a
    massive residual channel times a large norm weight), from the scaled norm of accumulating mode
    (x = h * w before the 1/rms, ~2e6 on those rows: past fp16's range itself), and per MoE slot."""
    rng = np.random.default_rng()
    K, N, g = 4096, 512, 128
    big = rng.choice(K // 4, 3, replace=False) * 4  # three aligned 4-row runs of massive values
    rows = (big[:, None] + np.arange(4)).ravel()
    q = rng.integers(0, 16, size=(K, N), dtype=np.uint8)
    z = rng.integers(0, 16, size=(K // g, N), dtype=np.uint8)
    q[rows] = np.where(z[rows // g] < 8, 15, 0)  # |q - z| >= 8 on those rows, one sign per column and run
    sc = (rng.random((K // g, N), dtype=np.float32) * 2 / (8 * math.sqrt(K))).astype(np.float16)
    qw, qz = awq.pack(q), awq.pack(z)
    r = dequant_reference(qw, qz, sc, g)
    m = oc.device_linear(AwqLinear(qw, qz, sc, g))
    partial = cp.empty((oc.gemv_partial_size(K, [N], 2),), cp.float32)
    out = nan_like((1, N), cp.float16)
    if source == "norm":
        h = rng.standard_normal(K).astype(np.float32)
        h[rows] = 2e4
        w = np.ones(K, np.float16)
        w[rows] = 100  # x = h / rms(h) * w: ~3000 on those rows
        x = rmsnorm_ref(h.astype(np.float64), w.astype(np.float64), 1e-6)
        oc.gemv(None, [m], "plain", out, partial, norm=(cp.asarray(h)[None], cp.asarray(w), 1e-6))
        got, ref = cp.asnumpy(out)[0], x @ r
    elif source == "scaled":
        h = rng.standard_normal(K).astype(np.float32)
        h[rows] = 2e4
        w = np.ones(K, np.float16)
        w[rows] = 100
        x = rmsnorm_ref(h.astype(np.float64), w.astype(np.float64), 1e-6)
        acc, ss = cp.zeros((N,), cp.int64), nan_like((4096,), cp.float32)
        S = oc.gemv(None, [m], "plain", None, partial, norm=(cp.asarray(h)[None], cp.asarray(w), 1e-6), acc_out=acc,
                    ss_out=ss)
        sq = float(cp.asnumpy(ss)[:S].astype(np.float64).sum())
        assert abs(sq - float((h.astype(np.float64) ** 2).sum())) < 1e-5 * sq
        got, ref = cp.asnumpy(acc).astype(np.float64) / 2**32 / math.sqrt(sq / K + 1e-6), x @ r
    else:
        x = rng.standard_normal(K).astype(np.float16)
        x[rows] = 3000
        if source == "x":
            oc.gemv(cp.asarray(x)[None], [m], "plain", out, partial)
            got, ref = cp.asnumpy(out)[0], x.astype(np.float64) @ r
        else:  # two slots of an expert stack (both expert 0), weights 0.25 and 0.75
            stack = oc.device_linear(AwqStack(qw[None], qz[None], sc[None], g))
            xs = np.stack([x, rng.standard_normal(K).astype(np.float16)])
            oc.gemv(cp.asarray(xs), [stack.expert(0)], "moe_sum", out, partial, ids=cp.zeros((2,), cp.int32),
                    slot_w=cp.asarray(np.array([0.25, 0.75], np.float32)), x_slot_stride=K)
            got, ref = cp.asnumpy(out)[0], 0.25 * (xs[0].astype(np.float64) @ r) + 0.75 * (xs[1].astype(np.float64) @ r)
    assert np.all(np.isfinite(got)) and rel(got, ref) < 1e-2


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("K,N,E,slots", [(768, 2048, 16, 8), (1536, 4096, 12, 8), (256, 768, 4, 3), (128, 256, 2, 1)])
def test_gemv_moe_weighted_sum(early, K, N, E, slots):
    """The experts' down projection with the routing-weighted sum over the token's slots fused in (the
    MoE finalize of decode), in two reduction levels (per slot over the K splits, then over the slots),
    with the ids read before or after the PDL wait: each slot its own expert (ids drawn, a
    repeat allowed), fresh weights; into out and added into a residual row; repeated launches bitwise
    equal and every arrival counter left zero."""
    rng = np.random.default_rng()
    g = 128
    qw, qz, sc = rand_awq_tensors(rng, K, N, g, experts=E)
    stack = oc.device_linear(AwqStack(qw, qz, sc, g))
    ids = rng.choice(E, slots, replace=slots > E)
    ids[-1] = ids[0]  # one expert in two slots
    w = rng.random(slots).astype(np.float32)
    xs = rng.standard_normal((slots, K)).astype(np.float16)
    ref = sum(float(w[j]) * (xs[j].astype(np.float64) @ dequant_reference(qw[ids[j]], qz[ids[j]], sc[ids[j]], g))
              for j in range(slots))
    partial = cp.empty((oc.gemv_partial_size(K, [N], slots),), cp.float32)
    args = dict(ids=cp.asarray(ids.astype(np.int32)), slot_w=cp.asarray(w), x_slot_stride=K, ids_early=early)
    outs = []
    for _ in range(3):
        out = nan_like((1, N), cp.float16)
        partial.fill(np.nan)
        oc.gemv(cp.asarray(xs), [stack.expert(0)], "moe_sum", out, partial, **args)
        outs.append(cp.asnumpy(out)[0])
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    assert np.all(np.isfinite(outs[0])) and rel(outs[0], ref) < 1e-2
    h0 = rng.standard_normal(N).astype(np.float32)
    h = cp.asarray(h0[None])
    oc.gemv(cp.asarray(xs), [stack.expert(0)], "moe_sum", None, partial, resid=h, **args)
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0
    np.testing.assert_allclose(cp.asnumpy(h)[0] - h0, outs[0].astype(np.float32), rtol=0, atol=1e-5)


def test_gemv_fused_reduction_is_deterministic_and_leaves_counters_zero():
    """The last-arriving block reduces each tile: repeated launches (as in graph replay) give the same bits."""
    rng = np.random.default_rng()
    m, r = rand_awq(rng, 12288, 4096)
    x = cp.asarray(rng.standard_normal((1, 12288)).astype(np.float16))
    partial = cp.empty((oc.gemv_partial_size(12288, [4096]),), cp.float32)
    outs = []
    for _ in range(5):
        out = nan_like((1, 4096), cp.float16)
        oc.gemv(x, [m], "plain", out, partial)
        outs.append(cp.asnumpy(out))
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    assert rel(outs[0][0], cp.asnumpy(x)[0].astype(np.float64) @ r) < 1e-2


def rmsnorm_ref(h, w, eps):
    """float64 h -> rmsnorm(h) * w rounded to fp16 (as the kernels store it), back in float64."""
    return (h / np.sqrt(np.mean(h * h) + eps) * w).astype(np.float16).astype(np.float64)


def replay_with_fresh_residual(rng, graph, stream, h0_dev, poisoned):
    """Draw a fresh residual row into h0_dev (the graph copies it in first), poison the graph's output
    buffer, replay and wait; returns the residual in float64 for the reference."""
    h0 = rng.standard_normal(h0_dev.shape[1]).astype(np.float32)
    h0_dev.set(h0[None])
    poisoned.fill(np.nan)
    graph.launch(stream)
    stream.synchronize()
    return h0.astype(np.float64)


def test_pdl_chain_of_dependent_kernels_in_a_graph():
    """The decode pattern (GEMV -> residual add + RMSNorm -> GEMV ...) captured in one graph and replayed:
    with programmatic dependent launch each kernel starts before its predecessor ends, so a missing
    wait would read stale activations. Checked against NumPy on every replay."""
    if int(cp.cuda.Device().compute_capability) >= 90 and os.environ.get("KUIPER_PDL", "1") != "0":
        assert isinstance(oc.kernel("gemv", oc.gemv_name(False)), oc._PdlKernel)
        assert isinstance(oc.kernel("norm", "add_rmsnorm"), oc._PdlKernel)
    rng = np.random.default_rng()
    D, eps = 4096, 1e-6
    mats = [rand_awq(rng, D, D) for _ in range(6)]
    w = rng.random(D).astype(np.float16) + np.float16(0.5)
    h_dev, x_dev, y_dev = cp.empty((1, D), cp.float32), cp.empty((1, D), cp.float16), cp.empty((1, D), cp.float16)
    w_dev, h0_dev = cp.asarray(w), cp.empty((1, D), cp.float32)
    partial = cp.empty((oc.gemv_partial_size(D, [D]),), cp.float32)
    stream = cp.cuda.Stream(non_blocking=False)
    with stream:
        stream.begin_capture()
        h_dev[...] = h0_dev
        oc.add_rmsnorm(h_dev, None, w_dev, eps, x_dev)
        for m, _ in mats:
            oc.gemv(x_dev, [m], "plain", y_dev, partial)
            oc.add_rmsnorm(h_dev, y_dev, w_dev, eps, x_dev)
        graph = stream.end_capture()

    for _ in range(3):
        h = replay_with_fresh_residual(rng, graph, stream, h0_dev, x_dev)
        x = rmsnorm_ref(h, w, eps)
        for _, r in mats:
            h = h + (x @ r).astype(np.float16)
            x = rmsnorm_ref(h, w, eps)
        assert rel(cp.asnumpy(x_dev)[0], x) < 1e-2
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0


def test_gemv_rmsnorm_prologue_and_residual_epilogue_in_a_graph():
    """The fused decode pattern: a GEMV whose input is rmsnorm(h) * w computed in its prologue, then
    a GEMV that adds fp16(y) into the fp32 residual h in its epilogue, three layers in one graph
    (PDL on sm_90), replayed with fresh h against NumPy; y is poisoned before every replay."""
    rng = np.random.default_rng()
    D, N, eps = 2048, 6144, 1e-6
    layers = [(rand_awq(rng, D, N), rand_awq(rng, N, D)) for _ in range(3)]
    w = rng.random(D).astype(np.float16) + np.float16(0.5)
    h_dev, y_dev, w_dev = cp.empty((1, D), cp.float32), cp.empty((1, N), cp.float16), cp.asarray(w)
    h0_dev = cp.empty((1, D), cp.float32)
    partial = cp.empty((max(oc.gemv_partial_size(D, [N]), oc.gemv_partial_size(N, [D])),), cp.float32)
    stream = cp.cuda.Stream(non_blocking=False)
    with stream:
        stream.begin_capture()
        h_dev[...] = h0_dev
        for (m1, _), (m2, _) in layers:
            oc.gemv(None, [m1], "plain", y_dev, partial, norm=(h_dev, w_dev, eps))
            oc.gemv(y_dev, [m2], "plain", None, partial, resid=h_dev)
        graph = stream.end_capture()
    for _ in range(3):
        h = replay_with_fresh_residual(rng, graph, stream, h0_dev, y_dev)
        for (_, r1), (_, r2) in layers:
            x = rmsnorm_ref(h, w, eps)
            y = (x @ r1).astype(np.float16).astype(np.float64)
            h = h + (y @ r2).astype(np.float16)
        assert rel(cp.asnumpy(h_dev)[0], h) < 1e-2
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0


@pytest.mark.parametrize("D,N1,I", [(2048, 2048, 6144), (4096, 6144, 12288), (1024, 2048, 3072)])
def test_gemv_accumulating_mode_layers_in_a_graph(D, N1, I):
    """Dense decode's accumulating mode, two layers in one graph (PDL on sm_90): a GEMV with the
    RMSNorm prologue that first adds the pending fixed-point output of the previous down projection
    (writing the new residual to the other row) and clears the o and gate/up accumulators; an o GEMV
    adding into its accumulator; a gate/up GEMV finishing the o add in its prologue, with the scaled
    norm (1/rms left to the down GEMV), adding [gate | up] and clearing the down accumulator; a down
    GEMV applying 1/rms and SwiGLU in its prologue; the final
    add_rmsnorm finishing the last add and clearing its accumulator. Replayed with fresh residuals
    against NumPy (outputs and residual rows poisoned first), then twice from the same residual:
    bitwise-equal results (integer accumulation does not depend on the blocks' order)."""
    rng = np.random.default_rng()
    eps = 1e-6
    layers = [(rand_awq(rng, D, N1), rand_awq(rng, N1, D), rand_awq(rng, D, I), rand_awq(rng, D, I),
               rand_awq(rng, I, D)) for _ in range(2)]
    w = rng.random(D).astype(np.float16) + np.float16(0.5)
    w_dev, h0_dev = cp.asarray(w), cp.empty((1, D), cp.float32)
    hrows = [cp.empty((1, D), cp.float32), cp.empty((1, D), cp.float32)]
    y1, xout = cp.empty((1, N1), cp.float16), cp.empty((1, D), cp.float16)
    acc = cp.zeros((D + 2 * I + D,), cp.int64)
    acc_o, acc_gu, acc_d, acc_o_gu = acc[:D], acc[D:D + 2 * I], acc[D + 2 * I:], acc[:D + 2 * I]
    ss_ffn = cp.empty((4096,), cp.float32)
    partial = cp.empty((max(oc.gemv_partial_size(k, ns) for k, ns in ((D, [N1]), (N1, [D]), (D, [I, I]),
                                                                      (I, [D]))),), cp.float32)
    stream = cp.cuda.Stream(non_blocking=False)
    with stream:
        stream.begin_capture()
        hrows[0][...] = h0_dev
        cur = 0
        for (m1, _), (m2, _), (mg, _), (mu, _), (md, _) in layers:
            oc.gemv(None, [m1], "plain", y1, partial, norm=(hrows[cur], w_dev, eps), pend=acc_d, hout=hrows[1 - cur],
                    zero=acc_o_gu)
            cur = 1 - cur
            oc.gemv(y1, [m2], "plain", None, partial, acc_out=acc_o)
            S = oc.gemv(None, [mg, mu], "swiglu", None, partial, norm=(hrows[cur], w_dev, eps), pend=acc_o,
                        hout=hrows[1 - cur], acc_out=acc_gu, zero=acc_d, ss_out=ss_ffn)
            cur = 1 - cur
            oc.gemv(None, [md], "plain", None, partial, pend=acc_gu, acc_out=acc_d, ss_in=(ss_ffn, S, D, eps))
        oc.add_rmsnorm(hrows[cur], None, w_dev, eps, xout, pend=acc_d)
        graph = stream.end_capture()

    def replay(h0):
        h0_dev.set(h0[None])
        for a in (y1, xout, hrows[1]):
            a.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        return cp.asnumpy(xout)[0], cp.asnumpy(hrows[cur])[0]

    for _ in range(3):
        h0 = rng.standard_normal(D).astype(np.float32)
        x_got, h_got = replay(h0)
        h = h0.astype(np.float64)
        for (_, r1), (_, r2), (_, rg), (_, ru), (_, rd) in layers:
            y = (rmsnorm_ref(h, w, eps) @ r1).astype(np.float16).astype(np.float64)
            h = h + (y @ r2).astype(np.float16)
            x = rmsnorm_ref(h, w, eps)
            g, u = x @ rg, x @ ru
            h = h + ((g / (1 + np.exp(-g)) * u).astype(np.float16).astype(np.float64) @ rd).astype(np.float16)
        assert rel(h_got, h) < 1e-2
        assert rel(x_got, rmsnorm_ref(h, w, eps)) < 1e-2
        assert int(cp.count_nonzero(acc_d)) == 0  # cleared by the final add_rmsnorm for the next step
    first = replay(h0)
    second = replay(h0)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0


@pytest.mark.parametrize("M", [2, 3, 17, 127, 300, 1030, 2047])
@pytest.mark.parametrize("K,N", [(4096, 4096), (4096, 6144), (12288, 4096), (1024, 3072), (5120, 1024),
                                 (5120, 8192), (8192, 5120), (5120, 25600), (25600, 5120)])
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
    oc._dequant_scratch(K * N).fill(np.nan)
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
    oc._dequant_scratch(D * (D + 2 * kv)).fill(np.nan)
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
    assert not oc._gemm_split_buffers(0)[1].any()


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
    assert not oc._gemm_split_buffers(0)[1].any()


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
    assert not oc._gemm_split_buffers(0)[1].any()


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
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _RS_BAD_BLOCK], cwd=root, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": root})
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
    assert not oc._gemm_split_buffers(0)[1].any()


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


def attention_ref(q, K, V, pos0):
    """q [T, H, hd] at positions pos0.., K/V [n, KV, hd] -> [T, H*hd], one head at a time in float64."""
    T, H, hd = q.shape
    KV = K.shape[1]
    out = np.zeros((T, H, hd))
    for h in range(H):
        kh = h // (H // KV)
        s = q[:, h].astype(np.float64) @ K[:, kh].astype(np.float64).T / math.sqrt(hd)  # [T, n]
        for t in range(T):
            row = s[t, :pos0 + t + 1]
            p = np.exp(row - row.max())
            out[t, h] = (p / p.sum()) @ V[:pos0 + t + 1, kh].astype(np.float64)
    return out.reshape(T, H * hd)


def attn_path_or_skip(path: str, hd: int, monkeypatch) -> str:
    """The prefill attention path to test: "mma" anywhere, "wgmma" (the default form: 2 consumer warpgroups
    below FW_NC3_FROM tokens, 3 taking turns from there) and "wgmma-nc3" (that second form at any length, set
    here) where that kernel runs (head dim 128 on compute capability 9.0), else the test is skipped."""
    if path.startswith("wgmma") and not (hd == 128 and oc.wgmma_available()):
        pytest.skip("flash_attn_wgmma runs at head dim 128 on compute capability 9.0 only")
    if path == "wgmma-nc3":
        tune(monkeypatch, fw_config=(4, 2, 3))
    return path.split("-")[0]


@pytest.mark.parametrize("path", ["mma", "wgmma", "wgmma-nc3"])
@pytest.mark.parametrize("H,KV,hd", [(32, 8, 128), (64, 8, 128), (16, 8, 128), (32, 4, 128), (4, 2, 64)])
@pytest.mark.parametrize("T,pos0", [(2, 0), (17, 0), (127, 5), (300, 0), (65, 70), (129, 200)])
def test_flash_attention_prefill(H, KV, hd, T, pos0, path, monkeypatch):
    """Against float64 per head. pos0 > 0: a chunk after cached positions (the causal bound is then off the
    query tiles' edges); T 129: a second query tile of one row; the cache holds 7 positions past the chunk,
    stale rows that must not be read."""
    path = attn_path_or_skip(path, hd, monkeypatch)
    rng = np.random.default_rng()
    ctx = pos0 + T + 7
    Kc = (rng.standard_normal((ctx, KV, hd)) * 2).astype(np.float16)
    Vc = rng.standard_normal((ctx, KV, hd)).astype(np.float16)
    Kc[pos0 + T:] = Vc[pos0 + T:] = np.nan  # past the keys: a kernel that read them would put NaN into its output
    q = (rng.standard_normal((T, H, hd)) * 2).astype(np.float16)
    out = nan_like((T, H * hd), cp.float16)
    oc.attention_prefill(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), pos0, KV, out, path=path)
    assert rel(cp.asnumpy(out), attention_ref(q, Kc, Vc, pos0)) < 1e-2


@pytest.mark.parametrize("path", ["mma", "wgmma", "wgmma-nc3"])
@pytest.mark.parametrize("T,pos0,layer", [(17, 0, 1), (130, 61, 2), (64, 0, 0)])
def test_flash_attention_prefill_one_layer_of_the_whole_cache(T, pos0, layer, path, monkeypatch):
    """The model's call: every layer's cache [L, ctx, KV, hd] and the layer to read (one TMA descriptor per cache
    and length serves all layers). Every other layer and the rows past the chunk hold NaN, so reading another
    layer or past n_keys shows; the result matches float64 and, bit for bit, the same attention on that layer's
    cache alone."""
    path = attn_path_or_skip(path, 128, monkeypatch)
    rng = np.random.default_rng()
    L, H, KV, hd = 3, 16, 4, 128
    n, ctx = pos0 + T, pos0 + T + 70
    Kc = np.full((L, ctx, KV, hd), np.nan, np.float16)
    Vc = Kc.copy()
    Kc[layer, :n] = rng.standard_normal((n, KV, hd)) * 2
    Vc[layer, :n] = rng.standard_normal((n, KV, hd))
    q = cp.asarray((rng.standard_normal((T, H, hd)) * 2).astype(np.float16))
    whole, alone = nan_like((T, H * hd), cp.float16), nan_like((T, H * hd), cp.float16)
    oc.attention_prefill(q, cp.asarray(Kc), cp.asarray(Vc), pos0, KV, whole, path=path, layer=layer)
    oc.attention_prefill(q, cp.asarray(Kc[layer]), cp.asarray(Vc[layer]), pos0, KV, alone, path=path)
    got = cp.asnumpy(whole)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, cp.asnumpy(alone))
    assert rel(got, attention_ref(cp.asnumpy(q), Kc[layer], Vc[layer], pos0)) < 1e-2


@pytest.mark.parametrize("path", ["mma", "wgmma", "wgmma-nc3"])
def test_flash_attention_prefill_position_on_device(path, monkeypatch):
    """A prefill graph's attention: the position read from device memory and, on the wgmma kernel, K's
    and V's maps from a device buffer, both rewritten between launches of the same arguments (as between replays):
    each launch equals, bit for bit, the launch with that position and its own maps as arguments, and float64.
    Every other layer and the rows past each launch's keys hold NaN (a map over the whole cache would let them into
    P V); the launch's own argument says position 0."""
    path = attn_path_or_skip(path, 128, monkeypatch)
    rng = np.random.default_rng()
    L, H, KV, hd, T, layer = 2, 16, 4, 128, 48, 1
    pos_dev, maps = cp.zeros((1,), cp.int32), cp.zeros((256,), cp.uint8)
    for pos0 in (61, 0, 130):
        n, ctx = pos0 + T, 250
        Kc = np.full((L, ctx, KV, hd), np.nan, np.float16)
        Vc = Kc.copy()
        Kc[layer, :n] = rng.standard_normal((n, KV, hd)) * 2
        Vc[layer, :n] = rng.standard_normal((n, KV, hd))
        Kd, Vd = cp.asarray(Kc), cp.asarray(Vc)
        q = cp.asarray((rng.standard_normal((T, H, hd)) * 2).astype(np.float16))
        pos_dev.set(np.array([pos0], np.int32))
        maps.set(np.frombuffer(bytes(oc.tma_map_cache(Kd, n)) + bytes(oc.tma_map_cache(Vd, n)), np.uint8))
        dev, arg = nan_like((T, H * hd), cp.float16), nan_like((T, H * hd), cp.float16)
        oc.attention_prefill(q, Kd, Vd, 0, KV, dev, path=path, layer=layer, pos_dev=pos_dev, kvmaps=maps)
        oc.attention_prefill(q, Kd, Vd, pos0, KV, arg, path=path, layer=layer)
        got = cp.asnumpy(dev)
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, cp.asnumpy(arg))
        assert rel(got, attention_ref(cp.asnumpy(q), Kc[layer], Vc[layer], pos0)) < 1e-2


@pytest.mark.parametrize("path", ["mma", "wgmma", "wgmma-nc3"])
def test_flash_attention_prefill_long(path, monkeypatch):
    path = attn_path_or_skip(path, 128, monkeypatch)
    rng = np.random.default_rng()
    T, H, KV, hd = 2047, 32, 8, 128
    Kc = rng.standard_normal((T, KV, hd)).astype(np.float16)
    Vc = rng.standard_normal((T, KV, hd)).astype(np.float16)
    q = rng.standard_normal((T, H, hd)).astype(np.float16)
    out = nan_like((T, H * hd), cp.float16)
    oc.attention_prefill(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), 0, KV, out, path=path)
    sel = rng.choice(T, 40, replace=False)  # check a random subset of rows against float64
    ref = np.stack([attention_ref(q[t:t + 1], Kc[:t + 1], Vc[:t + 1], t)[0] for t in sel])
    assert rel(cp.asnumpy(out)[sel], ref) < 1e-2


def test_flash_attention_prefill_paths_agree_and_default(monkeypatch):
    """Where the wgmma kernel runs it is the default at head dim 128 (here its 3-warpgroup form with turns),
    and it agrees with the mma.sync kernel (both fp32 softmax over fp16 products: within fp16 rounding of each
    other) on 4100 tokens after 300 cached positions, 40 heads over 8 KV heads (Qwen3-14B's grouping)."""
    attn_path_or_skip("wgmma", 128, monkeypatch)
    assert oc.FW_NC3_FROM <= 4100
    rng = np.random.default_rng()
    T, pos0, H, KV, hd = 4100, 300, 40, 8, 128
    Kc = cp.asarray(rng.standard_normal((pos0 + T, KV, hd)).astype(np.float16))
    Vc = cp.asarray(rng.standard_normal((pos0 + T, KV, hd)).astype(np.float16))
    q = cp.asarray((rng.standard_normal((T, H, hd)) * 2).astype(np.float16))
    a, b, c = (nan_like((T, H * hd), cp.float16) for _ in range(3))
    oc.attention_prefill(q, Kc, Vc, pos0, KV, a)
    oc.attention_prefill(q, Kc, Vc, pos0, KV, b, path="wgmma")
    oc.attention_prefill(q, Kc, Vc, pos0, KV, c, path="mma")
    assert bool(cp.all(a == b)) and bool(cp.all(cp.isfinite(b)))
    assert rel(cp.asnumpy(b), cp.asnumpy(c)) < 2e-3


def decode_inputs(rng, H, KV, hd, n, splits):
    """Fresh random fp16 q [1, H, hd] and n cached K and V rows [n, KV, hd] (NumPy), and flash decoding's
    partials for `splits` splits, poisoned (device): (q, Kc, Vc, part_o, part_ml)."""
    Kc = rng.standard_normal((n, KV, hd)).astype(np.float16)
    Vc = rng.standard_normal((n, KV, hd)).astype(np.float16)
    q = rng.standard_normal((1, H, hd)).astype(np.float16)
    part_o, part_ml = nan_like((H * splits * hd,), cp.float32), nan_like((H * splits * 2,), cp.float32)
    return q, Kc, Vc, part_o, part_ml


# GQA groups of 4 (8B), 8 (32B, 30B-A3B), 16 (235B: two blocks per KV head), 5 (14B), 2 and 1
@pytest.mark.parametrize("H,KV,hd", [(32, 8, 128), (64, 8, 128), (64, 4, 128), (40, 8, 128), (4, 2, 64), (8, 8, 64)])
@pytest.mark.parametrize("n", [1, 31, 1000, 4097, 32768])
@pytest.mark.parametrize("splits,on_device", [(16, False), (70, True)])
@pytest.mark.parametrize("min_chunk", [32, 64, 7])
def test_flash_decoding(H, KV, hd, n, splits, on_device, min_chunk):
    """on_device: the length comes from device memory (graph replay) and all splits launch; with a
    short context most of them hold no keys, and the combine must skip exactly those. min_chunk: the
    fewest keys per split (the default, Qwen3-8B's on the H100, and one that is no power of two)."""
    if n == 32768 and (H != 32 or on_device or min_chunk != 32):
        pytest.skip("one 32k case is enough")
    if min_chunk != 32 and (H, KV) not in ((32, 8), (4, 2)):
        pytest.skip("the split rule is the same code for every grouping")
    q, Kc, Vc, part_o, part_ml = decode_inputs(np.random.default_rng(), H, KV, hd, n, splits)
    out = nan_like((1, H * hd), cp.float16)
    pos_dev = cp.full((1,), n - 1, cp.int32) if on_device else None
    oc.attention_decode(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), -1 if on_device else n, KV, splits,
                        part_o, part_ml, out, pos_dev, min_chunk=min_chunk)
    assert rel(cp.asnumpy(out), attention_ref(q, Kc, Vc, n - 1)) < 1e-2


@pytest.mark.parametrize("name,threads,blocks_per_sm", [("attn_decode_gqa<128,4>", 128, 2), ("attn_decode_gqa<128,4>", 128, 3),
                                                         ("attn_decode_gqa<128,2>", 128, 1), ("attn_decode_gqa<64,1>", 128, 5)])
def test_spread_smem_caps_blocks_per_sm(name, threads, blocks_per_sm):
    """spread_smem's pad lets exactly ceil(blocks / SMs) blocks sit on an SM (the driver's occupancy
    calculator, asked independently here), and none where the registers already cap it lower."""
    fn = oc._compiled("attn", name)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    occ = oc._cu_fn("cuOccupancyMaxActiveBlocksPerMultiprocessor")

    def fit(smem):
        n = ctypes.c_int(-1)
        assert occ(ctypes.byref(n), fn.kernel.ptr, threads, smem) == 0
        return n.value

    blocks = sms * blocks_per_sm - sms // 2  # a partial last row: ceil gives blocks_per_sm
    pad = oc.spread_smem("attn", name, blocks, threads)
    if fit(0) <= blocks_per_sm:
        assert pad == 0
    else:
        assert pad > 0 and fit(pad) == blocks_per_sm


@pytest.mark.parametrize("H,KV,hd,D", [(32, 8, 128, 4096), (64, 4, 128, 4096), (16, 8, 64, 1024), (40, 8, 128, 5120)])
@pytest.mark.parametrize("n,on_device", [(1, True), (700, False), (9000, True), (511, True)])
@pytest.mark.parametrize("min_chunk", [32, 64])
@pytest.mark.parametrize("splits,o_merge", [(16, True), (40, False), (40, True), (80, True)])
def test_o_gemv_merges_flash_decoding_partials(H, KV, hd, D, n, on_device, min_chunk, splits, o_merge):
    """The o projection with the flash-decoding merge in its prologue (x = attention output never
    materialised) and the residual add in its epilogue, against float64 attention @ W_o + h. The
    splits past the keys hold NaN: the merge must read exactly those that flash decoding wrote, for
    the fewest keys per split that both were given (min_chunk). o_merge: gemv_merge_span past 16 splits
    (one to five batches of 16 partials at 40 and 80; Qwen3-32B's 384-row span takes its per-element
    fallback), else and at 16 splits decode_merge's running max."""
    rng = np.random.default_rng()
    q, Kc, Vc, part_o, part_ml = decode_inputs(rng, H, KV, hd, n, splits)
    m, r = rand_awq(rng, H * hd, D)
    pos_dev = cp.full((1,), n - 1, cp.int32) if on_device else None
    parts = oc.attention_decode(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), -1 if on_device else n, KV, splits,
                                part_o, part_ml, None, pos_dev, min_chunk=min_chunk, o_merge=o_merge)
    h0 = rng.standard_normal((1, D)).astype(np.float32)
    h = cp.asarray(h0)
    partial = cp.empty((oc.gemv_partial_size(H * hd, [D]),), cp.float32)
    oc.gemv(None, [m], "plain", None, partial, resid=h, att=parts)
    att = attention_ref(q, Kc, Vc, n - 1).reshape(-1).astype(np.float16).astype(np.float64)
    ref = h0[0] + (att @ r).astype(np.float16)
    assert rel(cp.asnumpy(h)[0] - h0[0], ref - h0[0]) < 1e-2
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0


# (H, KV, hd, D, E): Qwen3-30B-A3B's o projection and 128 experts; 160, 64, 8. R's columns go over
# ceil(E / 64) tiles (2; 3 of 56, 56, 48 columns; 1; 1), Rh's tile takes all E (lanes per row 16, 32, 8, 1)
@pytest.mark.parametrize("H,KV,hd,D,E", [(32, 4, 128, 2048, 128), (16, 8, 64, 1024, 160), (8, 2, 128, 1024, 64),
                                         (4, 2, 64, 512, 8)])
@pytest.mark.parametrize("massive", [False, True])
@pytest.mark.parametrize("cm", [False, True])
def test_o_gemv_router_rows(H, KV, hd, D, E, massive, cm):
    """The MoE o projection in accumulating mode with the router rows as more column tiles, R [q_dim, E]
    (its columns over one or more tiles) against the attention output and Rh [D, E] against the fp32
    residual row h (fp16 both): acc_z = attention @ R + h @ Rh beside acc_o = attention @ W_o, both fixed point, against float64 on
    the merged attention output rounded to fp16 (as the kernel stages it). massive: a value channel at
    3000, so the staged span is scaled down (the overflow guard) and the router sums scaled back, and
    residual channels at 1e4. Two launches from zeroed accumulators: bitwise the same; the arrival
    counters untouched. cm: the attention output merged by flash decoding's clusters (16 splits), staged as a
    plain row."""
    if cm:
        cm_or_skip(16, oc.decode_heads_per_block(H, KV), hd)
    rng = np.random.default_rng()
    n, splits = 300, 16 if cm else 24
    q, Kc, Vc, part_o, part_ml = decode_inputs(rng, H, KV, hd, n, splits)
    if massive:
        Vc[:, 0, 3] = 3000
    m, r = rand_awq(rng, H * hd, D)
    R = (rng.standard_normal((H * hd, E)) / 50).astype(np.float16)
    Rh = (rng.standard_normal((D, E)) / 50).astype(np.float16)
    h = rng.standard_normal((1, D)).astype(np.float32)
    if massive:
        h[0, rng.choice(D, 3, replace=False)] = 1e4
    parts = oc.attention_decode(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), -1, KV, splits, part_o, part_ml,
                                None, cp.full((1,), n - 1, cp.int32),
                                merged=nan_like((1, H * hd), cp.float16) if cm else None)
    assert (parts.merged is not None) == cm
    partial = cp.empty((oc.gemv_partial_size(H * hd, [D]),), cp.float32)
    att = attention_ref(q, Kc, Vc, n - 1).reshape(-1).astype(np.float16).astype(np.float64)
    outs = []
    for _ in range(2):
        acc_o, acc_z = cp.zeros((D,), cp.int64), cp.zeros((E,), cp.int64)
        oc.gemv(None, [m], "plain", None, partial, att=parts, acc_out=acc_o,
                router=(cp.asarray(R), cp.asarray(Rh), cp.asarray(h), acc_z))
        outs.append((cp.asnumpy(acc_o), cp.asnumpy(acc_z)))
    o = outs[0][0].astype(np.float64) / 2**32
    z = outs[0][1].astype(np.float64) / 2**32
    assert rel(o, att @ r) < 1e-2
    z_ref = att @ R.astype(np.float64) + h[0].astype(np.float64) @ Rh.astype(np.float64)
    assert rel(z, z_ref) < 1e-3, rel(z, z_ref)
    for a_, b_ in zip(outs[0], outs[1]):
        np.testing.assert_array_equal(a_, b_)
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0


@pytest.mark.parametrize("H,KV,hd,T,pos0", [(32, 8, 128, 1, 9), (64, 8, 128, 37, 0), (4, 2, 64, 5, 3),
                                             (32, 4, 128, 300, 17), (16, 8, 64, 2, 40), (1, 1, 64, 3, 0)])
@pytest.mark.parametrize("dev_pos", [False, True])
def test_qk_norm_rope_kv_write(H, KV, hd, T, pos0, dev_pos):
    """q/k norm, RoPE and the cache write against NumPy; dev_pos: the position read from device memory (the decode
    step's graph, and a prefill graph's), the argument a wrong -1."""
    from kuiper_py.config import ModelArgs, rope_tables
    from kuiper_py.ops_numpy import rmsnorm, rope
    rng = np.random.default_rng()
    ctx = pos0 + T + 3
    a = ModelArgs(hidden_size=H * hd, intermediate_size=1, num_hidden_layers=1, num_attention_heads=H,
                  num_key_value_heads=KV, head_dim=hd, vocab_size=1, max_position_embeddings=ctx,
                  tie_word_embeddings=True)
    cos, sin = rope_tables(a, ctx)
    fused = rng.standard_normal((T, (H + 2 * KV) * hd)).astype(np.float16)
    qn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float16)
    kn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float16)
    buf = cp.asarray(fused)
    qd, kvd = H * hd, KV * hd
    kc, vc = nan_like((ctx, KV, hd), cp.float16), nan_like((ctx, KV, hd), cp.float16)
    out = oc.qk_norm_rope_store(buf[:, :qd], buf[:, qd:qd + kvd], buf[:, qd + kvd:], cp.asarray(qn), cp.asarray(kn),
                                cp.asarray(cos), cp.asarray(sin), kc, vc, -1 if dev_pos else pos0, H, 1e-6,
                                nan_like((T, H, hd), cp.float16), cp.full((1,), pos0, cp.int32) if dev_pos else None)
    f = fused.astype(np.float32)
    c, s = cos[pos0:pos0 + T], sin[pos0:pos0 + T]
    q_ref = rope(rmsnorm(f[:, :qd].reshape(T, H, hd), qn, 1e-6), c, s)
    k_ref = rope(rmsnorm(f[:, qd:qd + kvd].reshape(T, KV, hd), kn, 1e-6), c, s)
    assert rel(cp.asnumpy(out), q_ref) < 2e-3
    assert rel(cp.asnumpy(kc)[pos0:pos0 + T], k_ref) < 2e-3
    np.testing.assert_array_equal(cp.asnumpy(vc)[pos0:pos0 + T], fused[:, qd + kvd:].reshape(T, KV, hd))
    assert np.isnan(cp.asnumpy(kc)[:pos0]).all()  # nothing else in the cache was touched


def qkv_case(rng, D, H, KV, hd, ctx):
    """A decode q|k|v case: RoPE tables for ctx positions, random q, k, v matrices (device, reference),
    a residual row h, its norm weight w and the per-head q/k norm weights."""
    from kuiper_py.config import ModelArgs, rope_tables
    a = ModelArgs(hidden_size=D, intermediate_size=1, num_hidden_layers=1, num_attention_heads=H,
                  num_key_value_heads=KV, head_dim=hd, vocab_size=1, max_position_embeddings=ctx,
                  tie_word_embeddings=True)
    cos, sin = rope_tables(a, ctx)
    mats = [rand_awq(rng, D, n) for n in (H * hd, KV * hd, KV * hd)]
    h = rng.standard_normal(D).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float16)
    qn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float16)
    kn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float16)
    return cos, sin, mats, h, w, qn, kn


def qkv_rope_ref(h, w, mats, qn, kn, cos, sin, pos0, hd, eps):
    """NumPy q and k (per-head RMSNorm, RoPE at pos0) and v [1, heads, hd] of a decode step from the
    residual row h: x = rmsnorm(h) * w and the projections rounded to fp16 as the kernels store them."""
    from kuiper_py.ops_numpy import rmsnorm, rope
    h = np.asarray(h, np.float64)
    x = (h / np.sqrt(np.mean(h ** 2) + eps) * w).astype(np.float16).astype(np.float64)
    q, k, v = [(x @ r).astype(np.float16).astype(np.float32).reshape(1, -1, hd) for _, r in mats]
    c, s = cos[pos0:pos0 + 1], sin[pos0:pos0 + 1]
    return rope(rmsnorm(q, qn, eps), c, s), rope(rmsnorm(k, kn, eps), c, s), v


@pytest.mark.parametrize("D,H,KV,hd,pos0,dev_pos", [(4096, 32, 8, 128, 0, False), (4096, 32, 8, 128, 777, True),
                                                    (1024, 16, 8, 64, 5, True), (512, 4, 2, 64, 3, False)])
def test_qkv_gemv_with_norm_rope_and_cache_write_epilogue(D, H, KV, hd, pos0, dev_pos):
    """Decode's fused QKV: rmsnorm(h) * w in the prologue, the q/k RMSNorm, RoPE and KV-cache write in
    the epilogue, against NumPy (dequantized weights, ops_numpy's rmsnorm and rope)."""
    rng = np.random.default_rng()
    ctx, eps = pos0 + 4, 1e-6
    cos, sin, mats, h, w, qn, kn = qkv_case(rng, D, H, KV, hd, ctx)
    kc, vc = nan_like((ctx, KV, hd), cp.float16), nan_like((ctx, KV, hd), cp.float16)
    qout = nan_like((1, H, hd), cp.float16)
    pos_dev = cp.full((1,), pos0, cp.int32) if dev_pos else None
    rope_args = dict(q_norm=cp.asarray(qn), k_norm=cp.asarray(kn), cos=cp.asarray(cos), sin=cp.asarray(sin),
                     qout=qout, kc=kc, vc=vc, pos0=-1 if dev_pos else pos0, pos_dev=pos_dev, eps=eps)
    partial = cp.empty((oc.gemv_partial_size(D, [H * hd, KV * hd, KV * hd]),), cp.float32)
    hd_dev = cp.asarray(h[None])
    oc.gemv(None, [m for m, _ in mats], "qkv_rope", None, partial, norm=(hd_dev, cp.asarray(w), eps), rope=rope_args)
    q_ref, k_ref, v = qkv_rope_ref(h, w, mats, qn, kn, cos, sin, pos0, hd, eps)
    assert rel(cp.asnumpy(qout), q_ref) < 1e-2
    assert rel(cp.asnumpy(kc)[pos0:pos0 + 1], k_ref) < 1e-2
    assert rel(cp.asnumpy(vc)[pos0:pos0 + 1], v) < 1e-2
    others = np.delete(np.arange(ctx), pos0)
    assert np.isnan(cp.asnumpy(kc)[others]).all() and np.isnan(cp.asnumpy(vc)[others]).all()
    np.testing.assert_array_equal(cp.asnumpy(hd_dev)[0], h)  # the prologue only reads the residual
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0


def qkv_then_flash_decoding(case, pend, kc, vc, zero, D, H, KV, hd, pos0, splits, min_chunk, eps, cm=False):
    """A decode step's attention half as the graph runs it: the q|k|v GEMV in accumulating mode (adding the
    pending projection output pend to the residual row first, clearing the accumulator zero), then flash
    decoding finishing it at position pos0 (q/k norm, RoPE, the newest K/V row into kc, vc) over splits
    splits. Returns q rotated, the new residual row, the attention output and the splits' part_o, part_ml,
    every one poisoned before the kernels ran. cm: the splits merged by their clusters (the output is
    theirs; the caller enables ATTN_CM)."""
    cos, sin, mats, h, w, qn, kn = case
    qrot, hout = nan_like((1, H, hd), cp.float16), nan_like((1, D), cp.float32)
    acc = cp.zeros(((H + 2 * KV) * hd,), cp.int64)
    partial = cp.empty((oc.gemv_partial_size(D, [H * hd, KV * hd, KV * hd]),), cp.float32)
    part_o, part_ml = nan_like((H * splits * hd,), cp.float32), nan_like((H * splits * 2,), cp.float32)
    out = nan_like((1, H * hd), cp.float16)
    ss = nan_like((4096,), cp.float32)
    S = oc.gemv(None, [m for m, _ in mats], "plain", None, partial, norm=(cp.asarray(h[None]), cp.asarray(w), eps),
                pend=cp.asarray(pend), hout=hout, acc_out=acc, zero=zero, ss_out=ss)
    parts = oc.attention_decode(qrot, kc, vc, -1, KV, splits, part_o, part_ml, None if cm else out,
                                cp.full((1,), pos0, cp.int32),
                                finish=dict(acc=acc, q_norm=cp.asarray(qn), k_norm=cp.asarray(kn), cos=cp.asarray(cos),
                                            sin=cp.asarray(sin), eps=eps, ss=(ss, S, D)), min_chunk=min_chunk,
                                max_keys=pos0 + 1, merged=out if cm else None)
    assert not cm or parts.merged is out
    return qrot, hout, out, part_o, part_ml


@pytest.mark.parametrize("D,H,KV,hd,pos0,splits", [(4096, 32, 8, 128, 0, 16), (4096, 32, 8, 128, 777, 16),
                                                   (2048, 32, 4, 128, 300, 70), (1024, 16, 8, 64, 5, 4),
                                                   (512, 4, 2, 64, 100, 9)])
@pytest.mark.parametrize("min_chunk", [32, 64])
def test_qkv_accumulating_gemv_finished_by_flash_decoding(D, H, KV, hd, pos0, splits, min_chunk):
    """Decode's q|k|v GEMV in accumulating mode (fixed-point sums, no reduction tail; it adds the
    previous down projection's pending output to the residual first, and leaves the RMSNorm's 1/rms
    to its consumer) and the flash-decoding kernel that applies it and finishes q, k and v (per-head
    norm, RoPE, the newest K/V row into the cache) before
    attending, against NumPy: the rotated q, the cache rows and the attention output. Every other
    cache row must be left as it was; outputs are poisoned first. min_chunk moves the newest key to
    another split (the one that writes it)."""
    rng = np.random.default_rng()
    ctx, eps = pos0 + 4, 1e-6
    case = qkv_case(rng, D, H, KV, hd, ctx)
    cos, sin, mats, h, w, qn, kn = case
    pend = (rng.standard_normal(D) * 2**32).astype(np.int64)  # a pending projection output of ~N(0, 1)
    k_old = rng.standard_normal((ctx, KV, hd)).astype(np.float16)
    v_old = rng.standard_normal((ctx, KV, hd)).astype(np.float16)
    kc, vc = cp.asarray(k_old), cp.asarray(v_old)
    kc[pos0].fill(np.nan)
    vc[pos0].fill(np.nan)
    zero = cp.asarray(rng.integers(-2**40, 2**40, size=5000))  # another accumulator the GEMV clears
    qrot, hout, out, _, _ = qkv_then_flash_decoding(case, pend, kc, vc, zero, D, H, KV, hd, pos0, splits, min_chunk,
                                                    eps)
    assert int(cp.count_nonzero(zero)) == 0
    hs = h.astype(np.float64) + (pend / 2**32).astype(np.float16)
    np.testing.assert_allclose(cp.asnumpy(hout)[0], hs, rtol=1e-6, atol=1e-6)
    q_ref, k_ref, v = qkv_rope_ref(hs, w, mats, qn, kn, cos, sin, pos0, hd, eps)
    assert rel(cp.asnumpy(qrot), q_ref) < 1e-2
    assert rel(cp.asnumpy(kc)[pos0:pos0 + 1], k_ref) < 1e-2
    assert rel(cp.asnumpy(vc)[pos0:pos0 + 1], v) < 1e-2
    others = np.delete(np.arange(ctx), pos0)
    np.testing.assert_array_equal(cp.asnumpy(kc)[others], k_old[others])
    np.testing.assert_array_equal(cp.asnumpy(vc)[others], v_old[others])
    K_ref, V_ref = k_old.astype(np.float32), v_old.astype(np.float32)
    K_ref[pos0], V_ref[pos0] = k_ref[0], v[0]
    assert rel(cp.asnumpy(out), attention_ref(q_ref.astype(np.float16), K_ref, V_ref, pos0)) < 1e-2


def cm_or_skip(S, hb, hd):
    """Skips where this GPU or the shape cannot take flash decoding's merge by its clusters."""
    if not oc.attn_cluster_merge(S, hb, hd):
        pytest.skip("no cluster merge for this GPU or shape (sm_90, S <= 16, whole 16-byte pushes)")


def flash_decoding_asked_to_merge(H, KV, hd, n, splits):
    """Flash decoding over n fresh random keys (the length from device memory, 32 keys per split at least) with
    a poisoned merged output offered to its clusters and poisoned partials: (q, K, V as NumPy, merged, part_o,
    part_ml, the returned _AttnParts)."""
    q, Kc, Vc, part_o, part_ml = decode_inputs(np.random.default_rng(), H, KV, hd, n, splits)
    merged = nan_like((1, H * hd), cp.float16)
    parts = oc.attention_decode(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), -1, KV, splits, part_o, part_ml,
                                None, cp.full((1,), n - 1, cp.int32), min_chunk=32, merged=merged)
    return q, Kc, Vc, merged, part_o, part_ml, parts


# 8B's heads (4 per block), 235B's (8 query heads per KV head, 4 per block: two blocks), 2 and 1 per block
@pytest.mark.parametrize("H,KV,hd", [(32, 8, 128), (64, 4, 128), (4, 2, 64), (8, 8, 64)])
@pytest.mark.parametrize("n", [1, 31, 300, 513, 1000])
@pytest.mark.parametrize("splits", [1, 2, 8, 16])
def test_flash_decoding_merged_by_its_clusters(H, KV, hd, n, splits):
    """The splits of a head group as one cluster that merges them (attn_decode_gqa CM: each block pushes its
    partial to the elements' owners, st.async on mbarriers) into the fp16 attention output, against float64
    attention. The length comes from device memory, so at 1 and 31 keys most splits are empty and must add
    nothing; the global partials are never written (left NaN), and the output is poisoned first."""
    cm_or_skip(splits, oc.decode_heads_per_block(H, KV), hd)
    q, Kc, Vc, merged, part_o, part_ml, parts = flash_decoding_asked_to_merge(H, KV, hd, n, splits)
    assert parts.merged is merged
    assert rel(cp.asnumpy(merged), attention_ref(q, Kc, Vc, n - 1)) < 1e-2
    assert bool(cp.isnan(part_o).all()) and bool(cp.isnan(part_ml).all())


@pytest.mark.parametrize("splits", [8, 16])
def test_clusters_that_cannot_be_resident_leave_the_merge_to_o(splits, monkeypatch):
    """Where no cluster of S blocks can be resident (resident_clusters 0: a driver refusing 16-block clusters, a
    partitioned GPU), flash decoding runs its plain splits: the partials are written for the o GEMV to merge and
    the merged buffer is left as it was; the partials merged by attn_decode_combine match float64 attention."""
    H, KV, hd, n = 32, 8, 128, 700
    cm_or_skip(splits, oc.decode_heads_per_block(H, KV), hd)
    patch(monkeypatch, "_ATTN_CM_FNS", {})
    asked = []
    patch(monkeypatch, "resident_clusters", lambda fn, CL, n, threads, smem=0: asked.append(CL) or 0)
    q, Kc, Vc, merged, part_o, part_ml, parts = flash_decoding_asked_to_merge(H, KV, hd, n, splits)
    assert asked == [splits] and parts.merged is None and bool(cp.isnan(merged).all())
    out = oc.attention_combine(parts, nan_like((1, H * hd), cp.float16))
    assert rel(cp.asnumpy(out), attention_ref(q, Kc, Vc, n - 1)) < 1e-2


@pytest.mark.parametrize("D,H,KV,hd", [(4096, 32, 8, 128), (2048, 32, 4, 128), (512, 4, 2, 64)])
@pytest.mark.parametrize("pos0,splits,min_chunk", [(0, 16, 64), (512, 16, 64), (700, 16, 64), (1000, 16, 64),
                                                   (300, 16, 32), (40, 8, 32), (100, 4, 32)])
def test_qkv_finished_then_merged_by_clusters(D, H, KV, hd, pos0, splits, min_chunk):
    """Decode's q|k|v GEMV (accumulating) finished by flash decoding on its tensor-core path, the splits merged
    by their clusters, against NumPy (the cache row written, the attention output over the old rows and the
    new one), and against the same splits' global partials merged by attn_decode_combine (within 1e-3: the
    bitwise comparison with the o GEMV's own merge is test_o_gemv_on_cluster_merge_equals_its_own_merge)."""
    hb = oc.decode_heads_per_block(H, KV)
    cm_or_skip(splits, hb, hd)
    rng = np.random.default_rng()
    ctx, eps = pos0 + 4, 1e-6
    case = qkv_case(rng, D, H, KV, hd, ctx)
    pend = (rng.standard_normal(D) * 2**32).astype(np.int64)
    k_old = rng.standard_normal((ctx, KV, hd)).astype(np.float16)
    v_old = rng.standard_normal((ctx, KV, hd)).astype(np.float16)
    outs = {}
    for cm in (False, True):
        kc, vc = cp.asarray(k_old), cp.asarray(v_old)
        outs[cm] = qkv_then_flash_decoding(case, pend, kc, vc, cp.zeros((8,), cp.int64), D, H, KV, hd, pos0, splits,
                                           min_chunk, eps, cm=cm)
    qrot, hout, out, _, _ = outs[True]
    hs = case[3].astype(np.float64) + (pend / 2**32).astype(np.float16)
    q_ref, k_ref, v = qkv_rope_ref(hs, case[4], case[2], case[5], case[6], case[0], case[1], pos0, hd, eps)
    K_ref, V_ref = k_old.astype(np.float32), v_old.astype(np.float32)
    K_ref[pos0], V_ref[pos0] = k_ref[0], v[0]
    assert rel(cp.asnumpy(out), attention_ref(q_ref.astype(np.float16), K_ref, V_ref, pos0)) < 1e-2
    np.testing.assert_array_equal(cp.asnumpy(hout), cp.asnumpy(outs[False][1]))
    np.testing.assert_array_equal(cp.asnumpy(qrot), cp.asnumpy(outs[False][0]))
    assert rel(cp.asnumpy(out), cp.asnumpy(outs[False][2])) < 1e-3


@pytest.mark.parametrize("H,KV,hd,D", [(32, 8, 128, 4096), (32, 4, 128, 2048)])
@pytest.mark.parametrize("n", [1, 200, 513, 1000])
def test_o_gemv_on_cluster_merge_equals_its_own_merge(H, KV, hd, D, n, monkeypatch):
    """The o projection (accumulating) on the output the clusters merged is bitwise the o projection that
    merges the same splits' partials in its prologue with gemv_merge_span: the clusters' merge does the same
    operations in the same split order. Both against float64 attention @ W_o."""
    hb = oc.decode_heads_per_block(H, KV)
    splits = 16
    cm_or_skip(splits, hb, hd)
    tune(monkeypatch, gemv_o_merge_min_splits=0)  # gemv_merge_span at 16 splits
    rng = np.random.default_rng()
    Kc = cp.asarray(rng.standard_normal((n, KV, hd)).astype(np.float16))
    Vc = cp.asarray(rng.standard_normal((n, KV, hd)).astype(np.float16))
    q = rng.standard_normal((1, H, hd)).astype(np.float16)
    m, r = rand_awq(rng, H * hd, D)
    partial = cp.empty((oc.gemv_partial_size(H * hd, [D]),), cp.float32)
    pos = cp.full((1,), n - 1, cp.int32)
    accs = {}
    for cm in (False, True):
        part_o, part_ml = nan_like((H * splits * hd,), cp.float32), nan_like((H * splits * 2,), cp.float32)
        parts = oc.attention_decode(cp.asarray(q), Kc, Vc, -1, KV, splits, part_o, part_ml, None, pos, min_chunk=64,
                                    o_merge=True, merged=nan_like((1, H * hd), cp.float16) if cm else None)
        assert (parts.merged is not None) == cm
        acc = cp.zeros((D,), cp.int64)
        oc.gemv(None, [m], "plain", None, partial, att=parts, acc_out=acc)
        accs[cm] = cp.asnumpy(acc)
    np.testing.assert_array_equal(accs[True], accs[False])
    att = attention_ref(q, cp.asnumpy(Kc), cp.asnumpy(Vc), n - 1).reshape(-1).astype(np.float16).astype(np.float64)
    assert rel(accs[True].astype(np.float64) / 2**32, att @ r) < 1e-2




@pytest.mark.parametrize("D,H,KV,hd,hb", [(4096, 32, 8, 128, 4), (2048, 32, 4, 128, 4), (2048, 32, 4, 128, 8),
                                         (1024, 8, 8, 128, 4), (1024, 16, 8, 64, 4)])
@pytest.mark.parametrize("pos0", [0, 14, 16, 47, 63, 300, 777, 1100, 2047, 2100, 5000])
@pytest.mark.parametrize("min_chunk", [32, 64])
@pytest.mark.parametrize("long_path", ["mma", "scalar"])
def test_flash_decoding_split_partials(D, H, KV, hd, hb, pos0, min_chunk, long_path, monkeypatch):
    """Every split's partial softmax (part_o, part_ml: the log2-domain max, the sum and the unnormalised
    output) against float64 over the split's own keys, from the q and cache rows the kernel itself
    wrote, so nothing but the split's arithmetic is compared, to 1e-5. Short contexts take the
    tensor-core path (at most 64 keys per split, all staged; tiles of 16 keys partly past the split's
    end at 15, 47, 49 keys). Longer splits take the long tensor-core path (mma: tiles of 64 keys through
    two buffers, the last tile partly past the split's end at 69 and 132 keys, whole at 128; the newest
    key in a tile copied after the wait at 1101 and 2048 keys, in one the loop copies at 5001) or the
    scalar loop. 8 heads per block (hb 8): the whole GQA group of 30B-A3B as the MMA's 8 columns. fp16 P
    in the P V product would miss by ~1e-4."""
    if long_path == "scalar" and pos0 < 1100:
        pytest.skip("short splits: the same path either way")
    tune(monkeypatch, attn_mma_long=long_path == "mma")
    tune(monkeypatch, attn_max_heads_per_block=hb)
    rng = np.random.default_rng()
    splits, ctx = 16, pos0 + 4
    case = qkv_case(rng, D, H, KV, hd, ctx)
    pend = (rng.standard_normal(D) * 2**32).astype(np.int64)
    kc = cp.asarray(rng.standard_normal((ctx, KV, hd)).astype(np.float16))
    vc = cp.asarray(rng.standard_normal((ctx, KV, hd)).astype(np.float16))
    qrot, _, _, part_o, part_ml = qkv_then_flash_decoding(case, pend, kc, vc, cp.zeros((8,), cp.int64), D, H, KV, hd,
                                                          pos0, splits, min_chunk, 1e-6)
    n = pos0 + 1
    chunk = max(-(-n // splits), min_chunk)
    q = cp.asnumpy(qrot)[0].astype(np.float64)
    K, V = cp.asnumpy(kc)[:n].astype(np.float64), cp.asnumpy(vc)[:n].astype(np.float64)
    po = cp.asnumpy(part_o).reshape(H, splits, hd).astype(np.float64)
    pml = cp.asnumpy(part_ml).reshape(H, splits, 2).astype(np.float64)
    got, ref = {"ml": [], "o": []}, {"ml": [], "o": []}
    for hh in range(H):
        kh = hh // (H // KV)
        for s in range(-(-n // chunk)):
            keys = slice(s * chunk, min(n, (s + 1) * chunk))
            sc = K[keys, kh] @ q[hh] * (math.log2(math.e) / math.sqrt(hd))
            p = np.exp2(sc - sc.max())
            got["ml"].append(pml[hh, s])
            ref["ml"].append([sc.max(), p.sum()])
            got["o"].append(po[hh, s] / pml[hh, s, 1])
            ref["o"].append(p @ V[keys, kh] / p.sum())
    for part in ("ml", "o"):
        assert rel(np.array(got[part]), np.array(ref[part])) < 1e-5, part


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


@pytest.mark.parametrize("V,D", [(151936, 4096), (151936, 1024), (1000, 128)])
def test_lm_head(V, D):
    rng = np.random.default_rng()
    W = (rng.standard_normal((V, D)) / math.sqrt(D)).astype(np.float16)
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
    W = (rng.standard_normal((V, D)) / math.sqrt(D)).astype(np.float16)
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

_ARGS_PROBE = r"""
struct alignas(64) Desc { unsigned long long v[16]; };
extern "C" __global__ void args_probe(int a, const float* p, float f, const __grid_constant__ Desc d,
                                      unsigned long long u, int b, double* out) {
    out[0] = a; out[1] = (double)(unsigned long long)p; out[2] = f;
    for (int i = 0; i < 16; ++i) out[3 + i] = (double)d.v[i];
    out[19] = (double)u; out[20] = b;
}
"""


@pytest.mark.parametrize("attr", [False, True])
def test_launch_ex_parameter_layout(attr):
    """launch_ex packs a signature's parameters into one reused buffer: a kernel taking an int, a
    pointer, a float, a 64-byte aligned struct by value (as the TMA descriptor is: the kernel's offset
    for it is padded) and a uint64 and int after it reads back every value, launch after launch with
    fresh values (the buffer is refilled), with and without a launch attribute."""
    if oc._cu_launch_ex() is None:
        pytest.skip("no cuLaunchKernelEx")
    fn = cp.RawModule(code=_ARGS_PROBE, options=("--std=c++17",)).get_function("args_probe")
    rng = np.random.default_rng()
    for _ in range(3):
        a, b = (int(v) for v in rng.integers(-2**31, 2**31, 2))
        f, u = float(np.float32(rng.standard_normal())), int(rng.integers(0, 2**52))
        p = cp.empty((7,), cp.float32)
        vals = [int(v) for v in rng.integers(0, 2**52, 16)]
        desc = (ctypes.c_uint64 * 16)(*vals)  # what tma_map_2d returns
        out = nan_like((21,), cp.float64)
        oc.launch_ex(fn, (1,), (1,), (np.int32(a), p, np.float32(f), desc, np.uint64(u), np.int32(b), out),
                     attr=oc._pdl_attr() if attr else None)
        want = [a, p.data.ptr, f, *vals, u, b]
        assert out.get().tolist() == [float(v) for v in want]
