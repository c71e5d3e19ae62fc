"""Helpers shared by the CUDA kernel test files (tests/test_cuda_*.py): Qwen3 projection shapes, NaN-poisoned
outputs, random AWQ matrices with their float64 references, and the decode-step references that more than one kernel
family's tests compare against. The test files import it after their module-level skip (no CuPy); its own
importorskip lines give it the same cp and oc."""
import numpy as np
import pytest

from kuiper_py.loader import AwqLinear
from reference import dequant_reference, rand_awq_tensors

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


def rand_head(rng, V, D):
    """A random fp16 lm_head [V, D] on the host with rows of norm ~1, drawn on the GPU from a seed rng gives: the real
    vocabulary's head is 155M-622M values, whose host draw took 3-4 s of each test (an H100 host)."""
    W = cp.random.RandomState(int(rng.integers(2**31))).standard_normal((V, D), dtype=cp.float32)
    W *= float(1 / np.sqrt(D))
    return cp.asnumpy(W.astype(cp.float16))


def rand_awq(rng, K, N, g=128):
    """Random AWQ matrix: device AwqLinear plus the float64 dequantized reference [K, N]."""
    qw, qz, sc = rand_awq_tensors(rng, K, N, g)
    ref = dequant_reference(qw, qz, sc, g)
    return oc.device_linear(AwqLinear(qw, qz, sc, g)), ref  # qweight tiled, as the loader uploads it


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
