"""The decode schedule as data: which launches a decode layer runs on this model and GPU, what each fixed-point
accumulator carries between them and which kernel clears it, and the flash-decoding regimes, built once per backend
from the choices CupyOps made at load (accumulating mode, the one-launch halves, the per-GPU table). describe() is the
text `kuiper info MODEL --plan` prints."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a decode layer: what it reads, what it leaves for the next one."""
    kernel: str
    does: str
    writes: str


@dataclass(frozen=True)
class DecodePlan:
    gpu: str
    sms: int
    acc_attn: bool  # the attention half accumulates (q|k|v and o sums finished by their consumers)
    acc_mode: bool  # the dense FFN too
    acc_moe: bool  # a MoE layer's expert GEMVs too
    ffn: str  # the one-launch FFN half: its form, or why not
    moe: str  # the one-launch MoE FFN half: its form, or why not
    dense: tuple[Launch, ...]  # a dense layer's launches, in order
    moe_layer: tuple[Launch, ...]  # a MoE layer's ((): the model has none)
    accumulators: tuple[tuple[str, int], ...]  # (name, int64 words) of the accumulator block
    attn_splits: int
    attn_short: tuple[int, ...]
    attn_cm: bool
    o_merge: bool
    attn_min_chunk: int
    graphs: bool
    prefill_graph_max_t: int

    def describe(self) -> str:
        """The plan as text, one launch a line."""
        out = [f"decode plan on {self.gpu} ({self.sms} SMs): CUDA graphs {'on' if self.graphs else 'off'}, "
               f"prefill graphs up to {self.prefill_graph_max_t} tokens",
               f"accumulating mode: attention {_yn(self.acc_attn)}, dense FFN {_yn(self.acc_mode)}, "
               f"MoE experts {_yn(self.acc_moe)}",
               f"one-launch FFN half: {self.ffn}", f"one-launch MoE FFN half: {self.moe}",
               f"flash decoding: {self.attn_splits} splits at capacity, at least {self.attn_min_chunk} keys each; "
               f"short-context graphs up to {', '.join(map(str, self.attn_short)) or 'none'} keys"
               f"{' (splits merged by their clusters)' if self.attn_cm else ''}; o GEMV's 16-split merge "
               f"{_yn(self.o_merge)}"]
        if self.accumulators:
            out.append("accumulators (int64): " + ", ".join(f"{n} [{w}]" for n, w in self.accumulators))
        for title, launches in (("dense layer", self.dense), ("MoE layer", self.moe_layer)):
            if launches:
                out.append(f"{title}:")
                out += [f"  {i + 1}. {ln.kernel}: {ln.does} -> {ln.writes}" for i, ln in enumerate(launches)]
        return "\n".join(out)


def _yn(b: bool) -> str:
    return "on" if b else "off"


def _attention_half(acc_attn: bool, clears_after_o: str) -> list[Launch]:
    """q|k|v, flash decoding and o: the launches every decode layer starts with."""
    if acc_attn:
        return [Launch("gemv_w4a16 q|k|v", "RMSNorm of h (+ the pending o/down sums) in its prologue",
                       "acc_qkv; clears acc_o and acc_gu"),
                Launch("attn_decode_gqa", "q/k RMSNorm, RoPE and the KV-cache write from acc_qkv, then attention",
                       "per-split partials (or the merged row)"),
                Launch("gemv_w4a16 o", "merges the splits in its prologue", "acc_o" + clears_after_o)]
    return [Launch("gemv_w4a16 q|k|v", "RMSNorm of h in its prologue; q/k norm, RoPE, KV write in its epilogue",
                   "q (rotated), the cache rows"),
            Launch("attn_decode_gqa", "attention", "per-split partials"),
            Launch("gemv_w4a16 o", "merges the splits in its prologue", "h += o (epilogue)")]


def build(ops) -> DecodePlan:
    """The plan of a loaded CupyOps (its flags and plans, set at construction)."""
    from .runtime.device import device_name, sm_count
    a = ops.args
    one_ffn, one_moe = ops._ffn is not None, ops._moe is not None
    dense = _attention_half(ops.acc_attn, "; clears acc_d and acc_qkv" if one_ffn or one_moe else "")
    if one_ffn:
        dense.append(Launch("ffn_decode", "RMSNorm of h + o, gate/up, SwiGLU and down in one cluster launch",
                            "acc_d"))
    elif ops.acc_mode:
        dense += [Launch("gemv_w4a16 gate|up", "RMSNorm of h + o in its prologue", "acc_gu; clears acc_d and acc_qkv"),
                  Launch("gemv_w4a16 down", "SwiGLU of acc_gu in its prologue", "acc_d")]
    else:
        dense += [Launch("gemv_w4a16 gate|up", "RMSNorm in its prologue, SwiGLU in its epilogue", "act"),
                  Launch("gemv_w4a16 down", "split-K reduction", "h += down (epilogue)")]
    moe_layer = []
    if a.num_experts:
        moe_layer = _attention_half(ops.acc_attn, "; clears acc_d and acc_qkv; the router's rows -> acc_z" if one_moe
                                    else "; clears acc_d and acc_qkv" if one_ffn else "")
        if one_moe:
            moe_layer.append(Launch("moe_ffn_decode", "top-k of acc_z, the selected experts' gate/up, SwiGLU and "
                                    "down, weighted", "acc_d"))
        else:
            moe_layer += [Launch("moe_route_decode", "RMSNorm, router logits and top-k", "ids, weights, x"),
                          Launch("gemv_w4a16 experts' gate|up", "the k experts side by side", "act"),
                          Launch("gemv_w4a16 experts' down", "the routing-weighted sum over the k slots",
                                 "acc_d" if ops.acc_moe else "h += sum (epilogue)")]
    accs = ()
    if ops.acc_attn:
        accs = tuple((n, int(ops.d[n].size)) for n in ("acc_o", "acc_gu", "acc_z", "acc_d", "acc_qkv") if n in ops.d)
    return DecodePlan(device_name(), sm_count(), ops.acc_attn, ops.acc_mode, ops.acc_moe, ops.decode_ffn_why,
                      ops.decode_moe_why, tuple(dense), tuple(moe_layer), accs, ops.attn_splits, ops.attn_short,
                      ops.attn_cm, ops.o_merge, ops.attn_min_chunk, ops.graphs, ops.settings.prefill_graph_max_t)


def describe(model) -> str:
    """The decode plan of a model loaded on the GPU (model.Qwen3 over CupyOps), as text: what `kuiper info MODEL
    --plan` prints."""
    return build(model.ops).describe()
