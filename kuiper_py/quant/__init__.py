"""4-bit checkpoint formats, each converted losslessly to the AutoAWQ GEMM tensors an ak48 file holds.

A format module has `check(cfg) -> group size` (refusing, in one line, anything outside its table of what is
supported) and a reader class that shows a Checkpoint under AWQ names (`<linear>.qweight`, `.qzeros`,
`.scales`), computed from the format's own tensors, so the exporter writes every format through one path.
"""
from __future__ import annotations

import numpy as np

from ..errors import KuiperError

SUFFIXES = ("qweight", "qzeros", "scales")


def method(cfg: dict) -> str:
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        raise KuiperError("config.json has no quantization_config: kuiper needs a 4-bit AWQ, GPTQ or "
                          "compressed-tensors checkpoint")
    return str(q.get("quant_method", "")).lower()


def _module(cfg: dict):
    from . import awq_ckpt, compressed, gptq
    m = method(cfg)
    mods = {"awq": awq_ckpt, "gptq": gptq, "compressed-tensors": compressed}
    if m not in mods:
        raise KuiperError(f"quantization method {m!r} is not supported (supported: {', '.join(mods)})")
    return mods[m]


def check(cfg: dict) -> int:
    """The checkpoint's group size, after its format's checks of the quantization_config."""
    g = _module(cfg).check(cfg)
    if g not in (32, 64, 128):
        raise KuiperError(f"group_size={g!r} is not supported (supported: 32, 64, 128)")  # (a string shows quoted)
    return g


def open_source(cfg: dict, ck):
    """ck (a Checkpoint) as the exporter reads it: AWQ names, whatever the format."""
    return _module(cfg).reader(cfg, ck)


def kept_fp16(cfg: dict) -> list[str]:
    """Linear modules kuiper keeps unquantized: lm_head and, for Qwen3-MoE, each layer's router."""
    out = ["lm_head"]
    if cfg.get("model_type") == "qwen3_moe":
        only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        out += [f"model.layers.{i}.mlp.gate" for i in range(int(cfg["num_hidden_layers"]))
                if i not in only and (i + 1) % step == 0]
    return out


def unpack_seq(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words with eight 4-bit values each, value i in bits 4i..4i+3 (GPTQ's and compressed-tensors'
    order), unpacked along axis (0 or 1) to uint8 0..15."""
    R, C = words.shape
    b = np.ascontiguousarray(words).view(np.uint8).reshape(R, C, 4)  # little-endian: value 2i in byte i's low bits
    v = np.empty((R, C, 8), dtype=np.uint8)
    v[:, :, 0::2] = b & 15
    v[:, :, 1::2] = b >> 4
    if axis == 1:
        return v.reshape(R, C * 8)
    return v.transpose(0, 2, 1).reshape(R * 8, C)


def pack_seq(values: np.ndarray, axis: int) -> np.ndarray:
    """The inverse of unpack_seq: uint8 0..15 packed eight per int32 along axis (0 or 1)."""
    v = values.astype(np.uint32)
    if axis == 0:
        v = v.reshape(-1, 8, v.shape[1]).transpose(0, 2, 1)
    else:
        v = v.reshape(v.shape[0], -1, 8)
    out = np.zeros(v.shape[:2], dtype=np.uint32)
    for i in range(8):
        out |= v[:, :, i] << np.uint32(4 * i)
    return out.view(np.int32)


class Converted:
    """Base of the format readers: a Checkpoint under AWQ names. Subclasses name their linears (`linears`),
    check one linear's tensors and give its (K, N) (`dims`), and convert each AWQ tensor (`convert`)."""

    def __init__(self, cfg: dict, ck, group_size: int):
        self.ck, self.cfg, self.g = ck, cfg, group_size
        self.linears = self.find_linears()
        self._dims: dict[str, tuple[int, int]] = {}
        quantized = sorted(set(kept_fp16(cfg)) & self.linears)
        if quantized:
            raise KuiperError(f"{quantized[0]} is quantized in this checkpoint; kuiper needs lm_head and the MoE "
                              f"routers unquantized")

    def _split(self, name: str):
        base, _, suffix = name.rpartition(".")
        return (base, suffix) if suffix in SUFFIXES and base in self.linears else (None, None)

    def __contains__(self, name: str) -> bool:
        return self._split(name)[0] is not None or name in self.ck

    def dims(self, base: str) -> tuple[int, int]:
        if base not in self._dims:
            self._dims[base] = self.check_linear(base)
        return self._dims[base]

    def shape(self, name: str) -> tuple[int, ...]:
        base, suffix = self._split(name)
        if base is None:
            return self.ck.shape(name)
        K, N = self.dims(base)
        return {"qweight": (K, N // 8), "qzeros": (K // self.g, N // 8), "scales": (K // self.g, N)}[suffix]

    def dtype(self, name: str) -> str:
        base, suffix = self._split(name)
        if base is None:
            return self.ck.dtype(name)
        return self.scale_dtype(base) if suffix == "scales" else "I32"

    def get(self, name: str) -> np.ndarray:
        base, suffix = self._split(name)
        if base is None:
            return self.ck.get(name)
        self.dims(base)
        return self.convert(base, suffix)

    def release(self, name: str, start: int = 0, end: int | None = None) -> None:
        if self._split(name)[0] is None:
            self.ck.release(name, start, end)

    def source_name(self, name: str) -> str:
        """The checkpoint tensor behind an AWQ name, for error messages."""
        base, suffix = self._split(name)
        return name if base is None else self.source_tensor(base, suffix)

    def check_values(self) -> None:
        """Value checks that must pass before anything is written (default: none)."""


def expect_shape(ck, name: str, want: tuple, why: str) -> None:
    if name not in ck:
        raise KuiperError(f"checkpoint is missing tensor {name}")
    got = tuple(ck.shape(name))
    if got != tuple(want):
        raise KuiperError(f"tensor {name} has shape {list(got)}, expected {list(want)} ({why})")


def expect_dtype(ck, name: str, ok: tuple[str, ...]) -> None:
    if ck.dtype(name) not in ok:
        raise KuiperError(f"tensor {name} has dtype {ck.dtype(name)}, expected {' or '.join(ok)}")
