"""Which part of the weights each tensor-parallel rank holds (Megatron-style; docs/PARALLEL.md):

- attention: rank r holds heads r*H/tp.. of q and the KV heads they read (split over ranks, or one each, repeated,
  when tp exceeds the KV heads); q|k|v column-parallel, o row-parallel (an all-reduce follows it);
- dense MLP: gate|up column-parallel, down row-parallel (an all-reduce follows it);
- MoE: the experts spread over the ranks (expert parallelism), the router replicated: each rank adds its own experts'
  weighted outputs and the all-reduce after the block combines them;
- lm_head vocabulary-parallel (a contiguous block of rows per rank); embedding and norms replicated.

AWQ tensors are cut on their packed layout: columns in whole packed words (8 columns), rows in whole quantization
groups, so every shard is a plain AWQ linear. Every shard is a NumPy view of the model file's mapping: a rank reads
(and a GPU rank would upload) only its own bytes."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ModelArgs
from ..errors import KuiperError
from ..loader import AwqLinear, AwqStack, Layer, Weights
from .comm import TP_SIZES


@dataclass(frozen=True)
class Plan:
    """The ranges rank `rank` of `tp` holds (start, stop), in heads, columns, experts or vocabulary rows."""
    rank: int
    tp: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]  # dense MLP columns (intermediate_size)
    experts: tuple[int, int] | None  # None in a dense model
    vocab: tuple[int, int]


@dataclass
class RankFile:
    """What a rank builds its model from (the shape of loader.ModelFile that model.Qwen3 reads): the rank's own
    ModelArgs (its head counts and intermediate size) and its shards of the weights."""
    args: ModelArgs
    weights: Weights
    plan: Plan


def check_tp(args: ModelArgs, weights: Weights, tp: int) -> None:
    """Refuse, with one line, a --tp the model's shapes do not split into whole heads, words and AWQ groups."""
    H, KV, hd, g = args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.group_size
    if tp not in TP_SIZES:
        raise KuiperError(f"--tp {tp}: choose one of {', '.join(map(str, TP_SIZES))}")
    if tp == 1:
        return
    if H % tp:
        raise KuiperError(f"--tp {tp}: the model's {H} attention heads do not split over {tp} ranks")
    if (KV % tp if tp <= KV else tp % KV):
        raise KuiperError(f"--tp {tp}: the model's {KV} KV heads neither split over {tp} ranks nor repeat evenly "
                          f"across them")
    rows = H // tp * hd
    if rows % g:
        raise KuiperError(f"--tp {tp}: each rank's {rows} rows of the attention output projection are not whole "
                          f"AWQ groups of {g}")
    if any(L.w1 is not None for L in weights.layers):
        inter = args.intermediate_size
        if inter % (tp * g):
            raise KuiperError(f"--tp {tp}: the MLP's intermediate size {inter} does not split over {tp} ranks in "
                              f"whole AWQ groups of {g}")
    if any(L.experts_w13 is not None for L in weights.layers) and args.num_experts % tp:
        raise KuiperError(f"--tp {tp}: the model's {args.num_experts} experts do not spread evenly over {tp} ranks")


def plan(args: ModelArgs, rank: int, tp: int) -> Plan:
    """Rank `rank`'s ranges (check_tp has accepted tp)."""
    H, KV, V = args.num_attention_heads, args.num_key_value_heads, args.vocab_size
    h = H // tp
    kv = (rank * KV // tp, (rank + 1) * KV // tp) if tp <= KV else (rank * KV // tp, rank * KV // tp + 1)
    i = args.intermediate_size // tp
    E = args.num_experts
    experts = (rank * E // tp, (rank + 1) * E // tp) if E else None
    return Plan(rank, tp, (rank * h, (rank + 1) * h), kv, (rank * i, (rank + 1) * i), experts,
                (rank * V // tp, (rank + 1) * V // tp))


def columns(lin: AwqLinear, c0: int, c1: int) -> AwqLinear:
    """Output columns c0..c1 of an AWQ linear (whole packed words): views, no copy."""
    assert c0 % 8 == 0 and c1 % 8 == 0, (c0, c1)
    return AwqLinear(lin.qweight[:, c0 // 8:c1 // 8], lin.qzeros[:, c0 // 8:c1 // 8], lin.scales[:, c0:c1],
                     lin.group_size)


def rows(lin: AwqLinear, k0: int, k1: int) -> AwqLinear:
    """Input rows k0..k1 of an AWQ linear (whole quantization groups): views, no copy."""
    g = lin.group_size
    assert k0 % g == 0 and k1 % g == 0, (k0, k1, g)
    return AwqLinear(lin.qweight[k0:k1], lin.qzeros[k0 // g:k1 // g], lin.scales[k0 // g:k1 // g], g)


def experts(stack: AwqStack, e0: int, e1: int) -> AwqStack:
    """Experts e0..e1 of a layer's stack: views, no copy."""
    return AwqStack(stack.qweight[e0:e1], stack.qzeros[e0:e1], stack.scales[e0:e1], stack.group_size)


def _layer(L: Layer, p: Plan, hd: int) -> Layer:
    q0, q1 = (h * hd for h in p.heads)
    k0, k1 = (h * hd for h in p.kv_heads)
    dense = L.w1 is not None
    moe = L.experts_w13 is not None
    return Layer(L.attn_norm, L.ffn_norm, L.q_norm, L.k_norm,
                 columns(L.wq, q0, q1), columns(L.wk, k0, k1), columns(L.wv, k0, k1), rows(L.wo, q0, q1),
                 columns(L.w1, *p.inter) if dense else None, rows(L.w2, *p.inter) if dense else None,
                 columns(L.w3, *p.inter) if dense else None, L.router,
                 experts(L.experts_w13, *p.experts) if moe else None,
                 experts(L.experts_w2, *p.experts) if moe else None)


def shard(model_file, rank: int, tp: int) -> RankFile:
    """Rank `rank`'s RankFile of a loaded model file (loader.ModelFile) split tp ways."""
    a, w = model_file.args, model_file.weights
    check_tp(a, w, tp)
    p = plan(a, rank, tp)
    args = dataclasses.replace(a, num_attention_heads=p.heads[1] - p.heads[0],
                               num_key_value_heads=p.kv_heads[1] - p.kv_heads[0],
                               intermediate_size=p.inter[1] - p.inter[0])
    weights = Weights(w.embed, w.final_norm, w.lm_head[p.vocab[0]:p.vocab[1]],
                      [_layer(L, p, a.head_dim) for L in w.layers])
    return RankFile(args, weights, p)
