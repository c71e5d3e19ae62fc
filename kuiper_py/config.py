"""ModelArgs: the model's shape and constants, from a Hugging Face config.json or an ak48 header."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import KuiperError


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    group_size: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_type: str = "qwen3"
    # Qwen3-MoE (num_experts 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], group_size: int = 128) -> "ModelArgs":
        try:
            n_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_parameters") or {}
            theta = cfg.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
            scaling = cfg.get("rope_scaling")
            if scaling is None and rope.get("rope_type", "default") != "default":
                scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            eos = cfg.get("eos_token_id")
            return cls(
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=n_heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads", n_heads)),
                head_dim=int(cfg.get("head_dim") or hidden // n_heads),
                vocab_size=int(cfg["vocab_size"]),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                group_size=int(group_size),
                rope_theta=float(theta),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_scaling=scaling,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
                model_type=str(cfg.get("model_type", "qwen3")),
                num_experts=int(cfg.get("num_experts", 0) or 0) if cfg.get("model_type") == "qwen3_moe" else 0,
                num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
                mlp_only_layers=tuple(int(i) for i in (cfg.get("mlp_only_layers") or [])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise KuiperError(f"config.json is missing or has a bad field: {e}") from None

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim


def rope_inv_freq(args: ModelArgs) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling factor, as transformers computes them."""
    try:
        inv, scale = _rope_inv_freq(args)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        raise KuiperError(f"bad rope_scaling {args.rope_scaling!r}: {e}") from None
    if not (np.isfinite(inv).all() and np.isfinite(scale)):
        raise KuiperError(f"rope_scaling {args.rope_scaling!r} gives non-finite frequencies")
    return inv, scale


def _rope_inv_freq(args: ModelArgs) -> tuple[np.ndarray, float]:
    d = args.head_dim
    base = args.rope_theta
    inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    sc = args.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind in (None, "default"):
        return inv, 1.0
    factor = float(sc.get("factor", 1.0))
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "yarn":
        orig = float(sc.get("original_max_position_embeddings", args.max_position_embeddings))
        beta_fast = float(sc.get("beta_fast", 32))
        beta_slow = float(sc.get("beta_slow", 1))
        mscale = sc.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def dim_for(rot):
            return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo = max(math.floor(dim_for(beta_fast)), 0)
        hi = min(math.ceil(dim_for(beta_slow)), d - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extrap = 1.0 - ramp
        inv = (inv / factor) * (1 - extrap) + inv * extrap
        return inv, float(mscale)
    raise KuiperError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, yarn)")


def rope_tables(args: ModelArgs, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables [n_pos, head_dim/2] in float32 (rotate-half convention)."""
    inv, scale = rope_inv_freq(args)
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv[None, :]
    return (np.cos(ang) * scale).astype(np.float32), (np.sin(ang) * scale).astype(np.float32)
