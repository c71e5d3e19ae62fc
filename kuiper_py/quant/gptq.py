"""GPTQ checkpoints (AutoGPTQ / GPTQModel layout), converted to AWQ GEMM tensors without loss.

Layout: `qweight` int32 [K/8, N], row k in bits 4(k%8) of word k//8; `qzeros` int32 [K/g, N/8], column n in
bits 4(n%8); `scales` [K/g, N]; `g_idx` int32 [K]. W[k, n] = (q - z) * s. checkpoint_format `gptq` (v1) stores
each zero point minus one, `gptq_v2` stores it as is.

Supported (anything else is refused in one line):
  quant_method        gptq
  bits                4
  group_size          32, 64, 128 (not -1, per channel)
  checkpoint_format   gptq (v1), gptq_v2
  sym                 true or false
  desc_act            false, or true with every g_idx equal to k // group_size (no real activation order)
  lm_head             false (kuiper keeps lm_head and the MoE routers in fp16)
  pack_dtype          int32;  dynamic (per-module overrides): none
"""
from __future__ import annotations

import numpy as np

from .. import awq
from ..errors import KuiperError
from . import Converted, expect_dtype, expect_shape, unpack_seq


def version(q: dict) -> str:
    v = str(q.get("checkpoint_format", q.get("format", "gptq"))).lower()
    if v not in ("gptq", "gptq_v2"):
        raise KuiperError(f"GPTQ checkpoint_format {v!r} is not supported (supported: gptq, gptq_v2)")
    return v


def check(cfg: dict) -> int:
    q = cfg["quantization_config"]
    if q.get("bits") != 4:
        raise KuiperError(f"GPTQ bits={q.get('bits')} is not supported (only 4-bit)")
    version(q)
    g = q.get("group_size")
    if g == -1:
        raise KuiperError("GPTQ group_size=-1 (one scale per output channel) is not supported "
                          "(supported: 32, 64, 128)")
    if q.get("lm_head"):
        raise KuiperError("GPTQ with a quantized lm_head (lm_head: true) is not supported")
    if str(q.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
        raise KuiperError(f"GPTQ pack_dtype={q.get('pack_dtype')} is not supported (only int32)")
    if q.get("dynamic"):
        raise KuiperError("GPTQ per-module overrides (dynamic) are not supported")
    return g


class GptqReader(Converted):
    """A GPTQ checkpoint under AWQ names."""

    def __init__(self, cfg: dict, ck):
        q = cfg["quantization_config"]
        self.v1 = version(q) == "gptq"
        super().__init__(cfg, ck, int(q["group_size"]))

    def find_linears(self) -> set[str]:
        return {n[:-len(".qweight")] for n in self.ck.where if n.endswith(".qweight")}

    def source_tensor(self, base: str, suffix: str) -> str:
        return f"{base}.{suffix}"

    def check_linear(self, base: str) -> tuple[int, int]:
        """(K, N) from qweight, after checking qzeros, scales and g_idx against it."""
        ck, g = self.ck, self.g
        expect_dtype(ck, base + ".qweight", ("I32",))
        k8, N = ck.shape(base + ".qweight")
        K = 8 * k8
        if K % g or N % 8:
            raise KuiperError(f"tensor {base}.qweight has shape {[k8, N]}: {K} inputs are not a multiple of "
                              f"group_size={g} or {N} outputs not of 8")
        why = f"gptq layout, from {base}.qweight {[k8, N]} and group_size {g}"
        expect_shape(ck, base + ".qzeros", (K // g, N // 8), why)
        expect_dtype(ck, base + ".qzeros", ("I32",))
        expect_shape(ck, base + ".scales", (K // g, N), why)
        expect_dtype(ck, base + ".scales", ("F16", "BF16"))
        if base + ".g_idx" in ck:
            expect_shape(ck, base + ".g_idx", (K,), why)
            expect_dtype(ck, base + ".g_idx", ("I32", "I64"))
        return K, N

    def scale_dtype(self, base: str) -> str:
        return self.ck.dtype(base + ".scales")

    def check_values(self) -> None:
        """Refuse a real activation order, a g_idx out of range and (v1) a zero point of 16, before writing."""
        for base in sorted(self.linears):
            K, _ = self.dims(base)
            if base + ".g_idx" in self.ck:
                gi = self.ck.get(base + ".g_idx")
                if gi.min() < 0 or gi.max() >= K // self.g:
                    raise KuiperError(f"tensor {base}.g_idx has values outside 0..{K // self.g - 1}")
                if not np.array_equal(gi, np.arange(K) // self.g):
                    raise KuiperError(f"tensor {base}.g_idx is not k // group_size: activation order (desc_act) "
                                      f"is not supported; re-quantize with desc_act=false")
            if self.v1 and (unpack_seq(self.ck.get(base + ".qzeros"), 1) == 15).any():
                raise KuiperError(f"tensor {base}.qzeros holds a v1 zero point of 16 (stored 15), which 4 bits "
                                  f"cannot hold")

    def convert(self, base: str, suffix: str) -> np.ndarray:
        a = self.ck.get(f"{base}.{suffix}")
        if suffix == "qweight":
            out = awq.pack(unpack_seq(a, 0))
        elif suffix == "qzeros":
            z = unpack_seq(a, 1)
            out = awq.pack(z + 1 if self.v1 else z)
        else:
            return a
        self.ck.release(f"{base}.{suffix}")
        return out


reader = GptqReader
