"""Qwen3-MoE as the staged pipeline the GPU runs (TensorRT-LLM / FlashInfer style), in plain NumPy.

Each function is the reference for one GPU stage: routing, the expert maps, token gathering, the grouped
gate|up GEMM with its SwiGLU epilogue, the grouped down GEMM, and the finalize (un-permute and weighted
sum). NumpyOps.moe runs exactly these, so the stages are checked end to end against transformers.
"""
from __future__ import annotations

import numpy as np

from .loader import AwqStack
from .ops_numpy import awq_linear, silu


def route(x: np.ndarray, router: np.ndarray, k: int, norm_topk_prob: bool):
    """Router logits in fp32, softmax, top-k (ties to the lower expert id), optional renormalisation.
    x [T, D], router fp16 [E, D] -> ids int32 [T, k], weights fp32 [T, k]."""
    logits = x.astype(np.float32) @ router.astype(np.float32).T
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(p, ids, axis=-1)
    if norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w.astype(np.float32)


def expert_maps(ids: np.ndarray, n_experts: int):
    """The maps every later stage uses. Flattened slots s = t*k + j are sorted by (expert, s):
    counts [E], expert_first_token_offset [E+1] (exclusive prefix sum), permuted_row_to_unpermuted_row
    [T*k] (slot of each permuted row) and its inverse unpermuted_row_to_permuted_row [T*k]."""
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=n_experts).astype(np.int32)
    offsets = np.zeros(n_experts + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    perm_to_unperm = np.argsort(flat, kind="stable").astype(np.int32)
    unperm_to_perm = np.empty_like(perm_to_unperm)
    unperm_to_perm[perm_to_unperm] = np.arange(flat.size, dtype=np.int32)
    return counts, offsets, perm_to_unperm, unperm_to_perm


def gather(x: np.ndarray, perm_to_unperm: np.ndarray, k: int) -> np.ndarray:
    """Expand and permute the hidden states so each expert's rows are contiguous: [T*k, D]."""
    return x[perm_to_unperm // k]


def grouped_gemm1_swiglu(xp: np.ndarray, offsets: np.ndarray, w13: AwqStack) -> np.ndarray:
    """Rows of expert e times its gate|up weights (N = 2I), SwiGLU in the epilogue: [T*k, I]."""
    inter = w13.scales.shape[-1] // 2
    out = np.zeros((xp.shape[0], inter), dtype=np.float32)
    for e in range(w13.E):
        a, b = int(offsets[e]), int(offsets[e + 1])
        if a == b:  # an expert that received no tokens does no work
            continue
        hg = awq_linear(xp[a:b], w13.expert(e))
        out[a:b] = silu(hg[:, :inter]) * hg[:, inter:]
    return out


def grouped_gemm2(act: np.ndarray, offsets: np.ndarray, w2: AwqStack) -> np.ndarray:
    """Rows of expert e times its down weights: [T*k, D]."""
    out = np.zeros((act.shape[0], w2.scales.shape[-1]), dtype=np.float32)
    for e in range(w2.E):
        a, b = int(offsets[e]), int(offsets[e + 1])
        if a != b:
            out[a:b] = awq_linear(act[a:b], w2.expert(e))
    return out


def finalize(yp: np.ndarray, unperm_to_perm: np.ndarray, w: np.ndarray, residual: np.ndarray | None = None):
    """Un-permute and sum each token's k expert outputs weighted by the router: [T, D] (+ residual)."""
    T, k = w.shape
    out = (yp[unperm_to_perm].reshape(T, k, -1) * w[:, :, None]).sum(axis=1)
    return out if residual is None else out + residual
