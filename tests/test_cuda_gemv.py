"""The decode GEMV (cuda/ops/gemv.py, kernels_cu/gemv_w4a16.cu) against NumPy references at real Qwen3 shapes
and awkward sizes (device machine only): its forms (fused q|k|v, split-K, SwiGLU, the MoE slots' weighted sum), the
RMSNorm prologue and residual epilogue, accumulating mode, and the q/k norm + RoPE + cache-write epilogue.

Every output is poisoned with NaN before the kernel runs, so an element the kernel fails to write
fails the comparison; inputs are fresh random draws on every run.
"""
import math

import numpy as np
import pytest

from conftest import slow_cases
from kuiper_py import awq
from kuiper_py.loader import AwqLinear, AwqStack
from reference import dequant_reference, rand_awq_tensors, rel

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")
from cuda_common import (SHAPES, nan_like, qkv_case, qkv_rope_ref, rand_awq,  # noqa: E402 (after the module-level skip)
                         replay_with_fresh_residual, rmsnorm_ref)


# 8B's and 32B's shapes are the slow tier's (6.7 and 14.3 s on an H100, mostly drawing them): the fast tier runs 0.6B's
# and 4B's
@pytest.mark.parametrize("model", slow_cases(SHAPES, ("8b", "32b")))
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
