"""CupyOps as one rank of a tensor-parallel group (parallel/, docs/PARALLEL.md): what changes where the backend has a
communicator of more than one rank. Every decode and prefill projection before an all-reduce gives a plain array
(no accumulating mode, no one-launch FFN halves, no residual add fused into the projection or the next norm), the
ranks' partial sums are added in fp32 and rounded to fp16 once (as one rank's GEMV rounds its own sum), and the
residual add follows in the next add_rmsnorm. Steps run eagerly: one CUDA graph per rank with the collectives inside
is still to build. A group of one never comes here, so --tp 1 runs exactly as before."""
from __future__ import annotations

import dataclasses

from .settings import Settings
from .ops.moe import moe_decode, moe_experts, moe_route

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


def is_rank(comm) -> bool:
    """Whether a backend with this communicator is one rank of a group of several (the gate of everything here)."""
    return comm is not None and comm.size > 1


def rank_settings(s: Settings) -> Settings:
    """s with the forms that add o / down into the residual inside another kernel turned off, and without the
    prefill arena and graphs (module-level state that ranks sharing one process would clobber between turns)."""
    return dataclasses.replace(s, gemv_acc=False, decode_ffn="0", decode_moe="0", arena_max_t=0,
                               prefill_graph_max_t=0)


def all_reduce(ops, x):
    """The sum over the ranks of a projection's output (a deferred decode launch made concrete first): fp16
    [T, D], summed in fp32."""
    y = ops._x(x)
    return ops.comm.all_reduce_sum(y.astype(cp.float32)).astype(cp.float16)


def moe(ops, x, layer):
    """A MoE block on this rank's experts (expert parallelism): the router is replicated, so every rank picks the
    same k experts per token; picks held by another rank get weight 0 (and this rank's first expert, whose output
    the zero weight drops), so the all-reduce after the block sums each token's k experts once. [T, D] fp16."""
    a, d = ops.args, ops.d
    x = ops._x(x)
    T, k = x.shape[0], a.num_experts_per_tok
    if T == 1:
        ids, w = moe_route(x, layer.router, k, a.norm_topk_prob, d["moe_logits"], d["moe_ids"], d["moe_w"])
    else:
        ids, w = moe_route(x, layer.router, k, a.norm_topk_prob)
    if ops.routing_log is not None:
        ops.routing_log.append(cp.asnumpy(ids))
    e0, e1 = ops.expert_range
    mine = (ids >= e0) & (ids < e1)
    ids = cp.where(mine, ids - e0, 0).astype(cp.int32)
    w = cp.where(mine, w, 0).astype(cp.float32)
    if T == 1:
        return moe_decode(x, layer.experts_w13, layer.experts_w2, ids, w, d["partial"], d["moe_act"],
                          cp.empty((1, a.hidden_size), cp.float16))
    return moe_experts(x, layer.experts_w13, layer.experts_w2, ids, w)


def gather_logits(ops, local):
    """Every rank's slice of the vocabulary-parallel lm_head's logits, gathered into the whole row(s): [V] lands
    in the decode buffer the draws read (d["logits"]), [T, V] is a new array."""
    full = ops.comm.all_gather(local, axis=-1)
    if local.ndim == 1:
        ops.d["logits"][...] = full
        return ops.d["logits"]
    return full
