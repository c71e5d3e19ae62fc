"""mmap an ak48 file and build layer objects over zero-copy views. Nothing is dequantized here."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import format as fmt
from .config import ModelArgs, rope_inv_freq
from .errors import KuiperError, ResourceError


@dataclass
class AwqLinear:
    qweight: Any  # int32 [K, N/8]
    qzeros: Any  # int32 [K/g, N/8]
    scales: Any  # fp16 [K/g, N]
    group_size: int

    @property
    def K(self) -> int:
        return self.qweight.shape[0]

    @property
    def N(self) -> int:
        return self.scales.shape[1]


@dataclass
class AwqStack:
    """All experts of one MoE layer: AWQ tensors with a leading expert axis."""
    qweight: Any  # int32 [E, K, N/8]
    qzeros: Any  # int32 [E, K/g, N/8]
    scales: Any  # fp16 [E, K/g, N]
    group_size: int

    @property
    def E(self) -> int:
        return self.qweight.shape[0]

    def expert(self, e: int) -> AwqLinear:
        return AwqLinear(self.qweight[e], self.qzeros[e], self.scales[e], self.group_size)


@dataclass
class Layer:
    attn_norm: Any  # fp16 [D]
    ffn_norm: Any  # fp16 [D]
    q_norm: Any  # fp16 [head_dim]
    k_norm: Any  # fp16 [head_dim]
    wq: AwqLinear
    wk: AwqLinear
    wv: AwqLinear
    wo: AwqLinear
    w1: AwqLinear | None  # gate (None in MoE layers)
    w2: AwqLinear | None  # down
    w3: AwqLinear | None  # up
    router: Any = None  # fp16 [E, D] in MoE layers
    experts_w13: AwqStack | None = None  # gate|up of every expert, N = 2 * moe_intermediate
    experts_w2: AwqStack | None = None  # down of every expert


@dataclass
class Weights:
    embed: Any  # fp16 [V, D]
    final_norm: Any  # fp16 [D]
    lm_head: Any  # fp16 [V, D]; the embedding itself when shared
    layers: list[Layer] = field(default_factory=list)


@dataclass
class ModelFile:
    path: Path
    header: fmt.Header
    args: ModelArgs
    weights: Weights
    trailer: dict | None
    size: int
    _mm: Any = None

    def verify_checksum(self) -> bool | None:
        """True/False when the file carries a checksum, None when it has none (plain v5)."""
        h = self.header
        if not (h.has_ext and h.flags & fmt.FLAG_CHECKSUM):
            return None
        sha = hashlib.sha256(fmt.hashed_header(bytes(self._mm[:fmt.HEADER_SIZE])))
        step = 64 << 20
        for off in range(fmt.HEADER_SIZE, self.size, step):
            end = min(off + step, self.size)
            sha.update(memoryview(self._mm)[off:end])
            _drop_range(self._mm, off, end)  # hashed pages need not stay resident
        return sha.digest() == h.checksum


def device_arrays(w: Weights) -> list:
    """Every array of w that the GPU engine copies to the device, once each (a tied lm_head is the embedding): the
    embedding (an untied one stays in pinned host memory by default, cuda/weights.py), the final norm, an untied
    lm_head, and each layer's norms, AWQ linears or expert stacks and router."""
    arrays = [w.embed, w.final_norm] + ([] if w.lm_head is w.embed else [w.lm_head])
    for layer in w.layers:
        arrays += [layer.attn_norm, layer.ffn_norm, layer.q_norm, layer.k_norm]
        for p in ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "experts_w13", "experts_w2"):
            lin = getattr(layer, p)
            if lin is not None:
                arrays += [lin.qweight, lin.qzeros, lin.scales]
        if layer.router is not None:
            arrays.append(layer.router)
    return arrays


def embed_pinned(w: Weights) -> bool:
    """Whether the GPU engine keeps w's token embeddings in pinned host memory rather than on the GPU: an untied
    table, which is read one row per token (a tied one is the lm_head too); KUIPER_EMBED_ON_GPU=1 keeps it on the GPU."""
    return w.lm_head is not w.embed and os.environ.get("KUIPER_EMBED_ON_GPU", "0") != "1"


def device_bytes(w: Weights) -> tuple[int, int]:
    """(bytes the GPU engine copies to the GPU, bytes it pins in host memory): device_arrays, the embedding on the
    host side where embed_pinned. What the upload checks against free GPU memory and `kuiper info` reports."""
    pinned = w.embed.nbytes if embed_pinned(w) else 0
    return sum(x.nbytes for x in device_arrays(w)) - pinned, pinned


def kv_bytes_per_position(a: ModelArgs) -> int:
    """Bytes of the fp16 KV cache per position: K and V of every layer's KV heads."""
    return 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * 2


def drop_pages(a: np.ndarray) -> None:
    """Let the kernel drop the resident pages of the model file that array a (a view of load()'s mapping) lies
    on, once its bytes have been copied elsewhere (the GPU upload): they are the file's own clean pages, so a
    later read faults them in again, and until then they no longer count as this process's memory (the whole
    Qwen3-235B-A22B's upload left ~120 GB resident). Pages it shares with a neighbour at either end go too.
    No-op for an array that is not such a view, or where madvise is missing."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer's base: a memoryview of the mapping
        base = base.obj
    if not isinstance(base, mmap.mmap) or a.nbytes == 0:
        return
    start = a.__array_interface__["data"][0] - np.frombuffer(base, np.uint8, count=1).__array_interface__["data"][0]
    _drop_range(base, start, start + a.nbytes)


def _drop_range(mm: mmap.mmap, start: int, end: int) -> None:
    """madvise(MADV_DONTNEED) over the whole pages of mapping mm that bytes [start, end) touch: a hint, so a
    platform without it or a refusal changes nothing."""
    if not hasattr(mmap, "MADV_DONTNEED") or end <= start:
        return
    lo = start // mmap.PAGESIZE * mmap.PAGESIZE
    hi = min(-(-end // mmap.PAGESIZE) * mmap.PAGESIZE, len(mm))
    try:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError):
        pass


def check_weights_fit(need: int, free: int, total: int, device: str) -> None:
    """Refuse a GPU load whose weights alone (need bytes) exceed what the device has free, before any is
    uploaded: otherwise the upload fails only once the memory runs out (the whole Qwen3-235B-A22B, ~116 GiB, on
    an 80 GB GPU: ~20 s of copying first). need counts only arrays that go to the GPU, so a refusal is never
    wrong (the KV cache and workspace come on top)."""
    if need > free:
        raise ResourceError(f"the model's weights need {need / 2**30:.1f} GiB of GPU memory; the {device} has "
                            f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f}")


def _open_regular(path: Path):
    try:
        st = os.stat(path)
    except OSError as e:
        raise KuiperError(f"cannot open model {path}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise KuiperError(f"model path {path} is a directory, not an ak48 file (export it with `kuiper export`)")
    if not stat.S_ISREG(st.st_mode):
        raise KuiperError(f"model path {path} is not a regular file")
    try:
        return open(path, "rb"), st.st_size
    except OSError as e:
        raise KuiperError(f"cannot open model {path}: {e.strerror}") from None


def load(path: str | Path, tokenizer_dir: str | Path | None = None) -> ModelFile:
    path = Path(path)
    f, size = _open_regular(path)
    with f:
        h = fmt.Header.unpack(f.read(fmt.HEADER_SIZE))
        _check_size(h, size)
        regions = fmt.regions(h)  # bounded now: every layer's regions are inside the file
        assert regions[-1].offset + regions[-1].nbytes == h.weights_end
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def view(r: fmt.Region) -> np.ndarray:
        return np.frombuffer(mm, dtype=r.dtype, count=r.nbytes // np.dtype(r.dtype).itemsize,
                             offset=r.offset).reshape(r.shape)

    v = {r.name: view(r) for r in regions}
    trailer = None
    if h.has_ext and h.trailer_length:
        try:
            trailer = json.loads(bytes(mm[h.trailer_offset:h.trailer_offset + h.trailer_length]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise KuiperError("model file's metadata trailer is not valid JSON") from None
        if not isinstance(trailer, dict) or not isinstance(trailer.get("config"), dict):
            raise KuiperError("model file's metadata trailer has no config object")
    if tokenizer_dir is not None:
        trailer = dict(trailer or {})
        trailer.update(tokenizer_from_dir(Path(tokenizer_dir)))
    args = args_from(h, trailer)
    g = h.group_size

    def lin(p, i):
        if f"{p}.{i}.qweight" not in v:
            return None
        return AwqLinear(v[f"{p}.{i}.qweight"], v[f"{p}.{i}.qzeros"], v[f"{p}.{i}.scales"], g)

    def stack(name, i):
        if f"experts.{name}.{i}.qweight" not in v:
            return None
        return AwqStack(*(v[f"experts.{name}.{i}.{k}"] for k in ("qweight", "qzeros", "scales")), g)

    layers = [Layer(v[f"attn_norm.{i}"], v[f"ffn_norm.{i}"], v[f"q_norm.{i}"], v[f"k_norm.{i}"],
                    *(lin(p, i) for p in fmt.PROJECTIONS), v.get(f"router.{i}"), stack("w13", i), stack("w2", i))
              for i in range(h.n_layers)]
    w = Weights(v["embed"], v["final_norm"], v["embed"] if h.shared_classifier else v["lm_head"], layers)
    return ModelFile(path, h, args, w, trailer, size, mm)


def _check_size(h: fmt.Header, size: int) -> None:
    """Refuse a file whose size is not the one its header implies, telling a truncated or padded file from a
    header whose dimension fields disagree with the rest of it (a damaged field, named where one explains it)."""
    end = h.weights_end
    trailer = h.trailer_length if h.has_ext else 0
    recorded = h.trailer_offset if h.has_ext and trailer else None  # the writer's own record of weights_end
    if end + trailer == size and (recorded is None or recorded == end):
        return
    # the weights' end that the file itself vouches for: its trailer record when its size agrees, else its size
    target = recorded if recorded is not None and recorded + trailer == size else size - trailer
    field = _explaining_field(h, target) if target != end else None
    if field:
        raise KuiperError(f"inconsistent header: field {field}={_field_value(h, field)} implies weights ending at "
                          f"byte {end}, but the file's {size} bytes fit the other fields (a damaged header)")
    if recorded is not None and recorded + trailer == size:
        raise KuiperError(f"inconsistent header: its dimension fields imply weights ending at byte {end}, its "
                          f"trailer_offset field says {recorded} (a damaged header)")
    if recorded is not None and recorded != end:
        raise KuiperError(f"header trailer offset {recorded} is not the end of the weights ({end})")
    if size < end + trailer:
        raise KuiperError(f"model file is truncated: {size} bytes, the header implies {end + trailer}")
    raise KuiperError(f"model file has {size - end - trailer} unexpected extra bytes after the {end + trailer} "
                      f"the header implies")


_CORE_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "head_dim", "group_size")


def _field_value(h: fmt.Header, name: str) -> int:
    return int(getattr(h, name))


def _explaining_field(h: fmt.Header, target: int) -> str | None:
    """The one core field for which another value (one byte of it changed, or shared_classifier toggled) gives
    weights ending at target, or None when none or several do. Dense files only: their size is a formula."""
    if h.is_moe:
        return None
    hits = []
    for name in ("shared_classifier",) + _CORE_FIELDS:
        v = _field_value(h, name)
        alts = [1 - v] if name == "shared_classifier" else \
            {v ^ (b << (8 * i)) for i in range(4) for b in range(1, 256)}
        for alt in alts:
            c = dataclasses.replace(h, **{name: bool(alt) if name == "shared_classifier" else alt})
            try:
                c.validate()
            except KuiperError:
                continue
            if c.weights_end == target:
                hits.append(name)
                break
    return hits[0] if len(hits) == 1 else None


def args_from(h: fmt.Header, trailer: dict | None) -> ModelArgs:
    cfg = (trailer or {}).get("config") or {}
    gen = (trailer or {}).get("generation_config") or {}
    if not isinstance(cfg, dict) or not isinstance(gen, dict):
        raise KuiperError("model metadata: config and generation_config must be objects")
    a = ModelArgs(
        hidden_size=h.dim, intermediate_size=h.hidden_dim, num_hidden_layers=h.n_layers,
        num_attention_heads=h.n_heads, num_key_value_heads=h.n_kv_heads, head_dim=h.head_dim,
        vocab_size=h.vocab_size, max_position_embeddings=h.max_seq_len,
        tie_word_embeddings=h.shared_classifier, group_size=h.group_size,
        model_type=fmt.MODEL_TYPES[h.model_type] if h.has_ext else "qwen3",
        num_experts=h.num_experts, num_experts_per_tok=h.experts_per_tok, moe_intermediate_size=h.moe_intermediate,
        norm_topk_prob=h.norm_topk_prob, decoder_sparse_step=h.decoder_sparse_step,
        mlp_only_layers=tuple(h.mlp_only_layers))
    if h.has_ext:
        a.rope_theta, a.rms_norm_eps = h.rope_theta, h.rms_norm_eps
        a.bos_token_id = h.bos_token_id if h.bos_token_id >= 0 else None
        a.eos_token_ids = [h.eos_token_id] if h.eos_token_id >= 0 else []
    elif cfg:
        a.rope_theta = float(cfg.get("rope_theta", a.rope_theta))
        a.rms_norm_eps = float(cfg.get("rms_norm_eps", a.rms_norm_eps))
    if cfg:
        # only what the header lacks; the trailer is input from outside, so every field is type-checked
        rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling is not None and not isinstance(scaling, dict):
            raise KuiperError("model metadata: rope_scaling is not an object")
        a.rope_scaling = scaling
        eos_cfg = cfg.get("eos_token_id")
        a.eos_token_ids = _merge_ids(a.eos_token_ids, [eos_cfg] if isinstance(eos_cfg, int) else
                                     list(eos_cfg) if isinstance(eos_cfg, list) else [])
        if a.bos_token_id is None and isinstance(cfg.get("bos_token_id"), int):
            a.bos_token_id = cfg["bos_token_id"]
    eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
    a.eos_token_ids = _merge_ids(a.eos_token_ids, [eos] if isinstance(eos, int) else
                                 list(eos) if isinstance(eos, list) else [])
    rope_inv_freq(a)  # refuses unsupported or malformed rope_scaling now, not mid-generation
    return a


def _merge_ids(a: list, b: list) -> list[int]:
    out = list(a)
    for x in b:
        if isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 and x not in out:
            out.append(x)
    return out


def tokenizer_from_dir(d: Path) -> dict:
    """The trailer's tokenizer keys, read from a Hugging Face directory (for plain v5 files)."""
    if not (d / "tokenizer.json").is_file():
        raise KuiperError(f"--tokenizer {d}: no tokenizer.json there")
    out: dict[str, Any] = {"tokenizer": (d / "tokenizer.json").read_text(encoding="utf-8")}
    for key, name in (("tokenizer_config", "tokenizer_config.json"), ("generation_config", "generation_config.json"),
                      ("config", "config.json")):
        if (d / name).is_file():
            try:
                out[key] = json.loads((d / name).read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise KuiperError(f"--tokenizer {d}: {name} is not valid JSON") from None
    return out
