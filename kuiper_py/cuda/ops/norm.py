"""Row-wise kernels: q/k RMSNorm + RoPE + the KV-cache write, the residual add + RMSNorm, the lm_head GEMV."""
from __future__ import annotations

import math

import numpy as np

from ..memory import _empty, _f, _i
from ..runtime.build import kernel

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


def qk_norm_rope_store(q, k, v, q_norm, k_norm, cos, sin, kc, vc, pos0: int, n_heads: int, eps: float,
                       out=None, pos_dev=None):
    """Per-head RMSNorm of q and k, RoPE at positions pos0.., k and v written into kc/vc [ctx, KV, hd].
    q [T, H*hd], k and v [T, KV*hd] (row strides may be wider: views of a fused buffer)."""
    T, KV, hd = q.shape[0], kc.shape[1], kc.shape[2]
    out = _empty((T, n_heads, hd), cp.float16) if out is None else out
    # 16-byte accesses: views of a q|k|v row whose head dims (64, 128) keep every start and stride aligned
    assert all(a.data.ptr % 16 == 0 and a.strides[0] % 16 == 0 and a.strides[1] == 2 for a in (q, k, v))
    heads = 4 * (512 // hd)  # per block: 4 warps of 32 / (hd / 16) heads
    kernel("rope", f"qk_norm_rope_store<{hd}>")((T, math.ceil((n_heads + 2 * KV) / heads)), (128,), (
        q, _i(q.strides[0] // 2), k, _i(k.strides[0] // 2), v, _i(v.strides[0] // 2), q_norm, k_norm, cos, sin,
        out, kc, vc, _i(n_heads), _i(KV), _i(pos0), pos_dev if pos_dev is not None else np.uint64(0), _f(eps)))
    return out


def add_rmsnorm(h, r, w, eps: float, out=None, pend=None, experts=None):
    """h [T, D] fp32 += r (fp16, or None), or (T = 1) += fp16(pend) with pend (int64 fixed point,
    gemv's accumulating mode) cleared, or += moe_finalize(*experts) (experts = (y, u2p, weights): a MoE
    prefill's expert rows, summed here instead); returns rmsnorm(h) * w in fp16."""
    T, D = h.shape
    out = _empty((T, D), cp.float16) if out is None else out
    assert pend is None or (r is None and T == 1 and pend.size == D)
    threads = math.ceil(D / 8 / 32) * 32  # one 16-byte chunk a thread (norm.cu)
    y, u2p, wts = experts if experts is not None else (None, None, None)
    k = wts.shape[1] if experts is not None else 0
    assert experts is None or (r is None and pend is None and k <= min(32, threads) and y.shape[1] == D
                               and u2p.size == T * k and wts.flags.c_contiguous)
    # a hidden size is a multiple of AWQ's group of 128
    assert D % 8 == 0 and D <= 8192 and all(a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in
                                            (h, w, out) + tuple(a for a in (r, pend, y) if a is not None))
    null = np.uint64(0)
    kernel("norm", "add_rmsnorm")((T,), (threads,), (
        h, r if r is not None else null, w, out, _i(D), _f(eps), pend if pend is not None else null,
        y if y is not None else null, u2p if u2p is not None else null, wts if wts is not None else null, _i(k)))
    return out


def lm_head(x, W, out, arg_slot=None, n_arg: int = 0):
    """x [D] fp16, W [V, D] fp16 -> out [V] fp32. arg_slot (uint64 [1], zero): the argmax of out[:n_arg]
    (NaN never) is also max'ed into it as lm_head.cu's argmax_key, for greedy decode."""
    V, D = W.shape
    slot = (arg_slot, _i(n_arg)) if arg_slot is not None else (np.uint64(0), _i(0))
    kernel("lmh", "lm_head_gemv")((math.ceil(V / 32),), (256,), (x, W, out, _i(V), _i(D), *slot))
    return out
