"""AutoAWQ GEMM checkpoints: already the ak48 layout, read as they are.

Supported (anything else is refused in one line):
  quant_method    awq
  bits            4
  zero_point      true
  version         gemm
  group_size      32, 64, 128
  modules_to_not_convert   lm_head; for Qwen3-MoE also the router (gate, mlp.gate)
"""
from __future__ import annotations

from ..errors import KuiperError


def check(cfg: dict) -> int:
    q = cfg["quantization_config"]
    if q.get("bits", q.get("w_bit")) != 4:
        raise KuiperError(f"AWQ bits={q.get('bits', q.get('w_bit'))} is not supported (only 4-bit)")
    if q.get("zero_point", True) is not True:
        raise KuiperError("AWQ without zero point is not supported")
    if str(q.get("version", "gemm")).lower() != "gemm":
        raise KuiperError(f"AWQ version {q.get('version')!r} is not supported (only GEMM packing)")
    skip = q.get("modules_to_not_convert") or []
    allowed = ("lm_head",) + (("gate", "mlp.gate") if cfg.get("model_type") == "qwen3_moe" else ())
    if any(m for m in skip if m not in allowed):
        raise KuiperError(f"modules_to_not_convert={skip} is not supported (only {', '.join(allowed)} may stay "
                          f"unquantized)")
    return q.get("group_size", q.get("q_group_size", 128))


def reader(cfg: dict, ck):
    return ck
