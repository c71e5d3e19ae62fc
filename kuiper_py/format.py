"""The ak48 file: a 256-byte header, fixed weight regions, and an optional JSON trailer.

Bytes 0x00-0x2C and the region order are KuiperLLama's version-5 Qwen3 AWQ layout, so a
reader that knows only v5 reads our dense files. Everything v5 lacks lives in the header
padding (the "KPX1" extension at 0x30) and in a JSON trailer after the last region.
docs/FORMAT.md has the table; `regions()` below is the single source of truth for it.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from .errors import KuiperError

MAGIC = 0x616B3438  # "ak48"
VERSION_DENSE = 5
VERSION_MOE = 6  # Qwen3-MoE: same core header, MoE fields after the extension, expert stacks
HEADER_SIZE = 256
EXT_MAGIC = 0x3158504B  # b"KPX1" read little-endian
EXT_VERSION = 1
MODEL_TYPES = {1: "qwen3", 2: "qwen3_moe"}
MAX_MOE_LAYERS = 128  # the mlp_only_layers bitmap has 128 bits
MAX_EXPERTS = 4096
INT32_MAX = 2**31 - 1

# v5 core: magic, version, 7 x i32 dims, u8 shared_classifier, head_dim, group_size (packed, no alignment)
_CORE = struct.Struct("<Ii7iBii")  # 0x00..0x2C
# our extension in the zero padding
_EXT = struct.Struct("<IIddiiIIQQ32s")  # 0x30..0x87
EXT_OFFSET = 0x30
CHECKSUM_OFFSET = EXT_OFFSET + _EXT.size - 32  # the sha256 covers header[:CHECKSUM_OFFSET] + body
FLAG_CHECKSUM = 1
FLAG_HEADER_CRC = 2  # a CRC-32 of header bytes 0x00-0xFB sits in its last 4 bytes; files before it lack both
HEADER_CRC_OFFSET = HEADER_SIZE - 4
# v6 only: num_experts, experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
# reserved, mlp_only_layers as a 128-bit little-endian bitmap
_MOE = struct.Struct("<IIIIII16s")
MOE_OFFSET = EXT_OFFSET + _EXT.size  # 0x88..0xAF


def hashed_header(head: bytes) -> bytes:
    """The header bytes the checksum covers: everything before the checksum, and for v6 the MoE block (the header
    CRC, written after the SHA-256, counts as the zeros it replaced, so files from before it hash the same)."""
    version = struct.unpack_from("<i", head, 4)[0]
    moe = head[MOE_OFFSET:HEADER_CRC_OFFSET] + bytes(4) if version == VERSION_MOE else b""
    return head[:CHECKSUM_OFFSET] + moe


def header_crc(head: bytes) -> int:
    """The header CRC: cheap enough to check at every load, so a damaged field is refused before it is used."""
    return zlib.crc32(head[:HEADER_CRC_OFFSET])

PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
HF_PROJ = {
    "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj", "w1": "mlp.gate_proj", "w2": "mlp.down_proj", "w3": "mlp.up_proj",
}


@dataclass
class Header:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    max_seq_len: int
    shared_classifier: bool
    head_dim: int
    group_size: int
    version: int = VERSION_DENSE
    # extension (absent in plain v5 files: has_ext False)
    has_ext: bool = False
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    bos_token_id: int = -1
    eos_token_id: int = -1
    model_type: int = 1
    flags: int = 0
    trailer_offset: int = 0
    trailer_length: int = 0
    checksum: bytes = b"\0" * 32
    header_crc: bool = field(default=False, compare=False)  # read: the header carried its CRC (pack writes one)
    # v6 (MoE)
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()

    @property
    def is_moe(self) -> bool:
        return self.version == VERSION_MOE

    def moe_layer(self, i: int) -> bool:
        return (self.is_moe and self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def pack(self) -> bytes:
        for name in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                     "max_seq_len", "head_dim", "group_size"):
            v = getattr(self, name)
            if not 0 < v <= INT32_MAX:
                raise KuiperError(f"header field {name}={v} does not fit a positive int32")
        buf = bytearray(HEADER_SIZE)
        _CORE.pack_into(buf, 0, MAGIC, self.version, self.dim, self.hidden_dim, self.n_layers,
                        self.n_heads, self.n_kv_heads, self.vocab_size, self.max_seq_len,
                        int(self.shared_classifier), self.head_dim, self.group_size)
        if self.has_ext:  # every extended header is written with its CRC
            _EXT.pack_into(buf, EXT_OFFSET, EXT_MAGIC, EXT_VERSION, self.rope_theta, self.rms_norm_eps,
                           self.bos_token_id, self.eos_token_id, self.model_type, self.flags | FLAG_HEADER_CRC,
                           self.trailer_offset, self.trailer_length, self.checksum)
        if self.is_moe:
            if not self.has_ext or any(not 0 <= i < MAX_MOE_LAYERS for i in self.mlp_only_layers):
                raise KuiperError("MoE header needs the extension and mlp_only_layers below 128")
            bitmap = sum(1 << i for i in set(self.mlp_only_layers)).to_bytes(16, "little")
            _MOE.pack_into(buf, MOE_OFFSET, self.num_experts, self.experts_per_tok, self.moe_intermediate,
                           int(self.norm_topk_prob), self.decoder_sparse_step, 0, bitmap)
        if self.has_ext:
            struct.pack_into("<I", buf, HEADER_CRC_OFFSET, header_crc(buf))
        return bytes(buf)

    @classmethod
    def unpack(cls, buf: bytes) -> "Header":
        if len(buf) < HEADER_SIZE:
            raise KuiperError(f"file is {len(buf)} bytes, shorter than the {HEADER_SIZE}-byte ak48 header")
        (magic, version, dim, hidden, nl, nh, nkv, vocab, msl, shared, hd, gs) = _CORE.unpack_from(buf, 0)
        if magic != MAGIC:
            raise KuiperError(f"not an ak48 model file (magic 0x{magic:08x}, expected 0x{MAGIC:08x})")
        if version not in (VERSION_DENSE, VERSION_MOE):
            raise KuiperError(f"unsupported ak48 version {version} (this kuiper reads versions 5 and 6)")
        h = cls(dim, hidden, nl, nh, nkv, vocab, msl, bool(shared), hd, gs, version)
        ext = _EXT.unpack_from(buf, EXT_OFFSET)
        crc_end = HEADER_SIZE
        if ext[0] == EXT_MAGIC:
            if ext[1] != EXT_VERSION:
                raise KuiperError(f"unsupported ak48 extension version {ext[1]}")
            if ext[7] & FLAG_HEADER_CRC:
                crc_end = HEADER_CRC_OFFSET
                if struct.unpack_from("<I", buf, HEADER_CRC_OFFSET)[0] != header_crc(buf):
                    raise KuiperError("header checksum mismatch: the file's 256-byte header is damaged "
                                      "(export the model again)")
        if shared not in (0, 1):
            raise KuiperError(f"header shared_classifier flag is {shared}, expected 0 or 1")
        if ext[0] == EXT_MAGIC:
            (_, _, h.rope_theta, h.rms_norm_eps, h.bos_token_id, h.eos_token_id, h.model_type,
             h.flags, h.trailer_offset, h.trailer_length, h.checksum) = ext
            h.header_crc, h.flags = bool(h.flags & FLAG_HEADER_CRC), h.flags & ~FLAG_HEADER_CRC
            h.has_ext = True
            if version == VERSION_MOE:
                (h.num_experts, h.experts_per_tok, h.moe_intermediate, ntp, h.decoder_sparse_step, rsv,
                 bitmap) = _MOE.unpack_from(buf, MOE_OFFSET)
                if ntp not in (0, 1) or rsv:
                    raise KuiperError("MoE header has a bad norm_topk_prob flag or reserved field")
                h.norm_topk_prob = bool(ntp)
                bits = int.from_bytes(bitmap, "little")
                h.mlp_only_layers = tuple(i for i in range(MAX_MOE_LAYERS) if bits >> i & 1)
                rest = buf[MOE_OFFSET + _MOE.size:crc_end]
            else:
                rest = buf[EXT_OFFSET + _EXT.size:crc_end]
            if any(rest) or any(buf[0x2D:EXT_OFFSET]):
                raise KuiperError("header reserved bytes are not zero: damaged or unknown variant")
        elif version == VERSION_MOE:
            raise KuiperError("ak48 version 6 (MoE) file without its header extension")
        elif any(buf[0x2D:HEADER_SIZE]):
            raise KuiperError("header padding is not zero and carries no kuiper extension: unknown variant")
        h.validate()
        return h

    def validate(self) -> None:
        """Every field and derived size checked with Python integers before anything is mapped."""
        for name in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                     "max_seq_len", "head_dim", "group_size"):
            if getattr(self, name) <= 0:
                raise KuiperError(f"header field {name}={getattr(self, name)} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise KuiperError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise KuiperError(f"head_dim={self.head_dim} must be even for RoPE")
        g = self.group_size
        for what, k in (("dim", self.dim), ("hidden_dim", self.hidden_dim),
                        ("n_heads*head_dim", self.n_heads * self.head_dim)):
            if k % g:
                raise KuiperError(f"group_size={g} does not divide {what}={k}")
        for what, n in (("dim", self.dim), ("hidden_dim", self.hidden_dim),
                        ("n_kv_heads*head_dim", self.n_kv_heads * self.head_dim)):
            if n % 8:
                raise KuiperError(f"{what}={n} is not a multiple of 8 (AWQ packs 8 columns per int32)")
        for a, b in ((self.n_heads, self.head_dim), (self.vocab_size, self.dim), (self.hidden_dim, self.dim)):
            if a * b > INT32_MAX:
                raise KuiperError(f"a weight of {a}x{b} elements exceeds the int32 index range")
        if self.is_moe:
            if self.model_type != 2:
                raise KuiperError(f"version 6 file with model_type {self.model_type}, expected 2 (qwen3_moe)")
            if not 0 < self.n_layers <= MAX_MOE_LAYERS:
                raise KuiperError(f"MoE n_layers={self.n_layers} must be in 1..{MAX_MOE_LAYERS}")
            if not 0 < self.num_experts <= MAX_EXPERTS or not 0 < self.experts_per_tok <= self.num_experts:
                raise KuiperError(f"MoE num_experts={self.num_experts} / experts_per_tok={self.experts_per_tok} "
                                  f"out of range")
            if self.moe_intermediate <= 0 or self.moe_intermediate % g or self.decoder_sparse_step <= 0:
                raise KuiperError(f"MoE moe_intermediate_size={self.moe_intermediate} (multiple of the group "
                                  f"size) or decoder_sparse_step={self.decoder_sparse_step} out of range")
            if self.num_experts * self.moe_intermediate * 2 * self.dim > 2**40:
                raise KuiperError("MoE expert stack too large")
        elif self.has_ext and self.model_type != 1:
            raise KuiperError(f"version 5 file with model_type {self.model_type}, expected 1 (qwen3)")
        if self.has_ext:
            if self.model_type not in MODEL_TYPES:
                raise KuiperError(f"unknown model_type {self.model_type} in header")
            if not (self.rope_theta > 0 and self.rope_theta < 1e12) or not (0 < self.rms_norm_eps < 1):
                raise KuiperError("header rope_theta or rms_norm_eps out of range")

    @property
    def weights_end(self) -> int:
        """End of the last weight region, by formula in Python integers (no region list is built, so a
        hostile layer count cannot make us loop or allocate before the size check)."""
        if self.is_moe:  # n_layers <= 128 and num_experts <= 4096 are validated: the list is small
            r = regions(self)[-1]
            return r.offset + r.nbytes
        L, D, V, hd, g = self.n_layers, self.dim, self.vocab_size, self.head_dim, self.group_size
        fp16 = 2 * (2 * L * D + D + V * D + (0 if self.shared_classifier else V * D) + 2 * L * hd)
        quant = 0
        for p in PROJECTIONS:
            K, N = proj_dims(self, p)
            quant += K * N // 2 + (K // g) * (N // 8) * 4 + (K // g) * N * 2
        return HEADER_SIZE + fp16 + L * quant


@dataclass(frozen=True)
class Region:
    name: str  # e.g. "attn_norm.3", "wq.0.qweight", "embed"
    dtype: str  # "float16" or "int32"
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = np.dtype(self.dtype).itemsize
        for s in self.shape:
            n *= s
        return n


def proj_dims(h: Header, proj: str) -> tuple[int, int]:
    """(K, N) = (in_features, out_features) of a projection."""
    q, kv = h.n_heads * h.head_dim, h.n_kv_heads * h.head_dim
    return {"wq": (h.dim, q), "wk": (h.dim, kv), "wv": (h.dim, kv), "wo": (q, h.dim),
            "w1": (h.dim, h.hidden_dim), "w2": (h.hidden_dim, h.dim), "w3": (h.dim, h.hidden_dim)}[proj]


def regions(h: Header) -> list[Region]:
    """Every region of a v5 dense file in file order, with byte offsets."""
    out: list[Region] = []
    off = HEADER_SIZE

    def add(name, dtype, shape):
        nonlocal off
        r = Region(name, dtype, tuple(int(s) for s in shape), off)
        out.append(r)
        off += r.nbytes

    L, D = h.n_layers, h.dim
    for i in range(L):
        add(f"attn_norm.{i}", "float16", (D,))
    for i in range(L):
        add(f"ffn_norm.{i}", "float16", (D,))
    add("final_norm", "float16", (D,))
    add("embed", "float16", (h.vocab_size, D))
    g = h.group_size
    dense = [i for i in range(L) if not h.moe_layer(i)]
    for p in PROJECTIONS:
        K, N = proj_dims(h, p)
        for i in (range(L) if p in ("wq", "wk", "wv", "wo") else dense):
            add(f"{p}.{i}.qweight", "int32", (K, N // 8))
            add(f"{p}.{i}.qzeros", "int32", (K // g, N // 8))
            add(f"{p}.{i}.scales", "float16", (K // g, N))
    if h.is_moe:
        E, I = h.num_experts, h.moe_intermediate
        moe = [i for i in range(L) if h.moe_layer(i)]
        for i in moe:
            add(f"router.{i}", "float16", (E, D))
        # experts stacked per layer so one launch serves them all; gate|up concatenated along N
        for name, (K, N) in (("w13", (D, 2 * I)), ("w2", (I, D))):
            for i in moe:
                add(f"experts.{name}.{i}.qweight", "int32", (E, K, N // 8))
                add(f"experts.{name}.{i}.qzeros", "int32", (E, K // g, N // 8))
                add(f"experts.{name}.{i}.scales", "float16", (E, K // g, N))
    if not h.shared_classifier:
        add("lm_head", "float16", (h.vocab_size, D))
    for i in range(L):
        add(f"q_norm.{i}", "float16", (h.head_dim,))
    for i in range(L):
        add(f"k_norm.{i}", "float16", (h.head_dim,))
    return out


def n_params(h: Header) -> int:
    """Parameter count: 8 per packed int32 of the quantized weights, one per element elsewhere."""
    n = 0
    for r in regions(h):
        last = r.name.split(".")[-1]
        size = 1
        for d in r.shape:
            size *= d
        if last == "qweight":
            n += size * 8
        elif last not in ("qzeros", "scales"):
            n += size
    return n


def hf_name(region_name: str) -> str:
    """The Hugging Face tensor a region comes from."""
    parts = region_name.split(".")
    if parts[0] in PROJECTIONS:
        return f"model.layers.{parts[1]}.{HF_PROJ[parts[0]]}.{parts[2]}"
    simple = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
              "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
    if parts[0] in simple:
        return f"model.layers.{parts[1]}.{simple[parts[0]]}"
    if parts[0] == "router":
        return f"model.layers.{parts[1]}.mlp.gate.weight"
    return {"final_norm": "model.norm.weight", "embed": "model.embed_tokens.weight",
            "lm_head": "lm_head.weight"}[parts[0]]
