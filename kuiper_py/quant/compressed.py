"""compressed-tensors `pack-quantized` W4A16 checkpoints (llm-compressor), converted to AWQ GEMM tensors
without loss.

Layout per linear [N outputs, K inputs]: `weight_packed` int32 [N, K/8], element k of a row in bits 4(k%8) of word
k//8, each a signed code plus 8; `weight_scale` [N, K/g]; `weight_zero_point` int32 [N/8, K/g] packed the same way
along the output dimension (asymmetric only); `weight_shape` [N, K]. W = (code - zero) * scale.

Supported (anything else is refused in one line):
  quant_method         compressed-tensors, quantization_status compressed
  format               pack-quantized
  config_groups        one group targeting Linear; weights: num_bits 4, type int, strategy group,
                       group_size 32/64/128, symmetric true or false, dynamic false, actorder none or weight
                       (static order: groups stay contiguous; group/dynamic order is refused);
                       no input or output activation quantization
  ignore               exactly lm_head and, for Qwen3-MoE, the routers (plain names or `re:` patterns)
  kv_cache_scheme      none; transform_config none
"""
from __future__ import annotations

import re

import numpy as np

from .. import awq
from ..errors import KuiperError
from . import Converted, expect_dtype, expect_shape, kept_fp16, unpack_seq


def _scheme(q: dict) -> dict:
    """The one config group's weights arguments, after checking the group targets Linear layers only."""
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise KuiperError(f"compressed-tensors with {len(groups)} config groups is not supported (only one)")
    (name, grp), = groups.items()
    if not isinstance(grp, dict) or not isinstance(grp.get("weights"), dict):
        raise KuiperError(f"compressed-tensors config group {name!r} has no weights scheme")
    if grp.get("input_activations") or grp.get("output_activations"):
        raise KuiperError(f"compressed-tensors group {name!r} quantizes activations: only weight-only W4A16 is "
                          f"supported")
    if list(grp.get("targets") or []) != ["Linear"]:
        raise KuiperError(f"compressed-tensors group {name!r} targets {grp.get('targets')}: only ['Linear'] is "
                          f"supported")
    fmt = grp.get("format")
    if fmt not in (None, "pack-quantized"):
        raise KuiperError(f"compressed-tensors group {name!r} has format {fmt!r} (only pack-quantized)")
    return grp["weights"]


def check(cfg: dict) -> int:
    q = cfg["quantization_config"]
    if q.get("format") != "pack-quantized":
        raise KuiperError(f"compressed-tensors format {q.get('format')!r} is not supported (only pack-quantized "
                          f"4-bit integer weights)")
    if q.get("quantization_status", "compressed") != "compressed":
        raise KuiperError(f"compressed-tensors quantization_status {q.get('quantization_status')!r}: the weights "
                          f"are not packed (only compressed)")
    if q.get("kv_cache_scheme") or q.get("transform_config"):
        raise KuiperError("compressed-tensors with a kv_cache_scheme or transform_config is not supported")
    w = _scheme(q)
    for key, want in (("num_bits", 4), ("type", "int"), ("strategy", "group")):
        if w.get(key) != want:
            raise KuiperError(f"compressed-tensors weights {key}={w.get(key)!r} is not supported (only {want})")
    if w.get("dynamic"):
        raise KuiperError("compressed-tensors dynamic weight quantization is not supported")
    if w.get("actorder") not in (None, False, "weight", "static"):
        raise KuiperError(f"compressed-tensors actorder={w.get('actorder')!r} is not supported (none or weight)")
    check_ignore(cfg, q.get("ignore") or [])
    return w.get("group_size")


def _linear_modules(cfg: dict) -> list[str]:
    """Every quantized linear module kuiper expects, by name."""
    out = []
    moe = cfg.get("model_type") == "qwen3_moe"
    routers = set(kept_fp16(cfg))
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        out += [p + f"self_attn.{n}_proj" for n in "qkvo"]
        if moe and p + "mlp.gate" in routers:
            out += [f"{p}mlp.experts.{e}.{n}_proj" for e in range(int(cfg["num_experts"]))
                    for n in ("gate", "up", "down")]
        else:
            out += [p + f"mlp.{n}_proj" for n in ("gate", "up", "down")]
    return out


def _matches(entry: str, name: str) -> bool:
    return re.match(entry[3:], name) is not None if entry.startswith("re:") else entry == name


def check_ignore(cfg: dict, ignore: list) -> None:
    """The ignore list must leave unquantized exactly what kuiper keeps in fp16: lm_head and the routers."""
    for m in _linear_modules(cfg):
        hit = next((e for e in ignore if _matches(str(e), m)), None)
        if hit is not None:
            raise KuiperError(f"compressed-tensors ignore entry {hit!r} leaves {m} unquantized; kuiper needs it "
                              f"4-bit (only lm_head and the MoE routers may be ignored)")
    for m in kept_fp16(cfg):
        if m == "lm_head" and cfg.get("tie_word_embeddings"):
            continue
        if not any(_matches(str(e), m) for e in ignore):
            raise KuiperError(f"compressed-tensors ignore list {ignore} does not cover {m}, which kuiper keeps "
                              f"unquantized (add it to ignore)")


class CompressedReader(Converted):
    """A compressed-tensors pack-quantized checkpoint under AWQ names."""

    def __init__(self, cfg: dict, ck):
        w = _scheme(cfg["quantization_config"])
        self.sym = bool(w.get("symmetric", True))
        super().__init__(cfg, ck, int(w["group_size"]))

    def find_linears(self) -> set[str]:
        return {n[:-len(".weight_packed")] for n in self.ck.where if n.endswith(".weight_packed")}

    def source_tensor(self, base: str, suffix: str) -> str:
        return base + {"qweight": ".weight_packed", "qzeros": ".weight_zero_point", "scales": ".weight_scale"}[suffix]

    def check_linear(self, base: str) -> tuple[int, int]:
        """(K, N) from weight_shape, after checking it and the other tensors against weight_packed."""
        ck, g = self.ck, self.g
        expect_dtype(ck, base + ".weight_packed", ("I32",))
        N, k8 = ck.shape(base + ".weight_packed")
        if base + ".weight_g_idx" in ck:
            raise KuiperError(f"tensor {base}.weight_g_idx: group activation order is not supported")
        expect_shape(ck, base + ".weight_shape", (2,), "[out_features, in_features]")
        expect_dtype(ck, base + ".weight_shape", ("I32", "I64"))
        shape = [int(v) for v in ck.get(base + ".weight_shape")]
        if shape != [N, 8 * k8]:
            raise KuiperError(f"tensor {base}.weight_shape is {shape} but {base}.weight_packed {[N, k8]} holds "
                              f"{[N, 8 * k8]}")
        K = 8 * k8
        if K % g or N % 8:
            raise KuiperError(f"{base} has shape {[N, K]}: {K} inputs are not a multiple of group_size={g} or "
                              f"{N} outputs not of 8")
        why = f"compressed-tensors layout, from {base}.weight_shape {shape} and group_size {g}"
        expect_shape(ck, base + ".weight_scale", (N, K // g), why)
        expect_dtype(ck, base + ".weight_scale", ("F16", "BF16", "F32"))
        if not self.sym:
            if base + ".weight_zero_point" not in ck:
                raise KuiperError(f"checkpoint is missing tensor {base}.weight_zero_point (the scheme is "
                                  f"asymmetric)")
            expect_shape(ck, base + ".weight_zero_point", (N // 8, K // g), why)
            expect_dtype(ck, base + ".weight_zero_point", ("I32",))
        return K, N

    def scale_dtype(self, base: str) -> str:
        return self.ck.dtype(base + ".weight_scale")

    def convert(self, base: str, suffix: str) -> np.ndarray:
        K, N = self.dims(base)
        if suffix == "qzeros" and self.sym:
            return np.full((K // self.g, N // 8), 0x88888888, dtype=np.uint32).view(np.int32)
        src = self.source_tensor(base, suffix)
        a = self.ck.get(src)
        if suffix == "qweight":
            out = awq.pack(np.ascontiguousarray(unpack_seq(a, 1).T))
        elif suffix == "qzeros":
            out = awq.pack(np.ascontiguousarray(unpack_seq(a, 0).T))
        else:
            out = np.ascontiguousarray(a.T)
        self.ck.release(src)
        return out


reader = CompressedReader
