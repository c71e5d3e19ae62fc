"""`kuiper export`: a Hugging Face Qwen3 4-bit checkpoint (AWQ, GPTQ, compressed-tensors) -> one ak48 file,
streamed tensor by tensor."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from . import format as fmt
from . import quant
from .config import ModelArgs
from .errors import KuiperError, ResourceError
from .st_reader import Checkpoint, bf16_to_f32


def _read_json(path: Path, required: bool):
    if not path.exists():
        if required:
            raise KuiperError(f"{path.parent} has no {path.name}: not a Hugging Face model directory")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KuiperError(f"{path} is not valid JSON: {e}") from None


def check_config(cfg: dict) -> int:
    """Refuse anything but a Qwen3 (dense or MoE) 4-bit AWQ, GPTQ or compressed-tensors checkpoint whose format
    kuiper converts (each format's table: kuiper_py/quant); return the group size."""
    arch = cfg.get("architectures") or []
    mtype = cfg.get("model_type")
    if mtype not in ("qwen3", "qwen3_moe") and not {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"} & set(arch):
        raise KuiperError(f"unsupported architecture {arch or mtype!r}: kuiper exports Qwen3ForCausalLM and "
                          f"Qwen3MoeForCausalLM")
    g = quant.check(cfg)
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("attention_bias", False):
        raise KuiperError("config has a non-silu activation or attention bias, which Qwen3 does not")
    return g


def header_from_args(a: ModelArgs, shared: bool) -> fmt.Header:
    return fmt.Header(
        dim=a.hidden_size, hidden_dim=a.intermediate_size, n_layers=a.num_hidden_layers,
        n_heads=a.num_attention_heads, n_kv_heads=a.num_key_value_heads, vocab_size=a.vocab_size,
        max_seq_len=a.max_position_embeddings, shared_classifier=shared, head_dim=a.head_dim,
        group_size=a.group_size, has_ext=True, rope_theta=a.rope_theta, rms_norm_eps=a.rms_norm_eps,
        bos_token_id=a.bos_token_id if isinstance(a.bos_token_id, int) else -1,
        eos_token_id=a.eos_token_ids[0] if a.eos_token_ids else -1, flags=fmt.FLAG_CHECKSUM,
        model_type=2 if a.num_experts else 1, version=fmt.VERSION_MOE if a.num_experts else fmt.VERSION_DENSE,
        num_experts=a.num_experts, experts_per_tok=a.num_experts_per_tok, moe_intermediate=a.moe_intermediate_size,
        norm_topk_prob=a.norm_topk_prob, decoder_sparse_step=a.decoder_sparse_step,
        mlp_only_layers=tuple(a.mlp_only_layers))


def _check_dtype(st_dtype: str, want: str, name: str) -> None:
    ok = ("I32",) if want == "int32" else ("F16", "BF16", "F32")
    if st_dtype not in ok:
        raise KuiperError(f"tensor {name} has dtype {st_dtype}, expected {' or '.join(ok)}")


def _as_file_dtype(arr: np.ndarray, st_dtype: str, want: str, name: str) -> np.ndarray:
    _check_dtype(st_dtype, want, name)
    if want == "int32" or st_dtype == "F16":
        return arr
    return (bf16_to_f32(arr) if st_dtype == "BF16" else arr).astype(np.float16)


def region_sources(r: fmt.Region) -> list[list[str]]:
    """The checkpoint tensors behind a region: one list per expert of the pieces concatenated along the
    last axis (gate then up for the stacked w13), or a single one-tensor list."""
    parts = r.name.split(".")
    if parts[0] != "experts":
        return [[fmt.hf_name(r.name)]]
    _, which, layer, kind = parts
    projs = ("gate_proj", "up_proj") if which == "w13" else ("down_proj",)
    return [[f"model.layers.{layer}.mlp.experts.{e}.{p}.{kind}" for p in projs] for e in range(r.shape[0])]


_CHUNK = 64 << 20


def _region_bytes(ck: Checkpoint, r: fmt.Region):
    """Yield the region's bytes piece by piece (one expert at a time for stacks; large tensors in 64 MiB
    zero-copy slices of the mapping, whose pages are dropped once written)."""
    for pieces in region_sources(r):
        if len(pieces) == 1 and (ck.dtype(pieces[0]) == "F16" or r.dtype == "int32"):
            n = pieces[0]
            arr = ck.get(n)
            _check_dtype(ck.dtype(n), r.dtype, n)
            flat = arr.reshape(-1).view(np.uint8)
            for o in range(0, flat.size, _CHUNK):
                part = flat[o:o + _CHUNK]
                if r.name.endswith("scales") and not np.isfinite(part.view(np.float16)).all():
                    raise KuiperError(f"tensor {n} has NaN or Inf scales")
                yield memoryview(part)
                ck.release(n, o, o + part.size)
            continue
        arrs = [_as_file_dtype(ck.get(n), ck.dtype(n), r.dtype, n) for n in pieces]
        arr = arrs[0] if len(arrs) == 1 else np.concatenate(arrs, axis=-1)
        if r.name.endswith("scales") and not np.isfinite(arr).all():
            bad = next(n for n, a in zip(pieces, arrs) if not np.isfinite(a).all())
            raise KuiperError(f"tensor {bad} has NaN or Inf scales")
        data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))  # (no second copy)
        del arrs, arr
        for n in pieces:
            ck.release(n)
        yield data


def export(hf_dir: str | Path, out_path: str | Path, progress: bool = True, log=None) -> dict:
    """Export a Hugging Face directory, or a hub id (resolved through the local Hugging Face cache, then the
    network), to out_path."""
    log = log or (lambda m: print(m, file=sys.stderr))
    t0 = time.perf_counter()
    if not Path(hf_dir).is_dir():
        from .hub import is_hub_id, snapshot
        if not is_hub_id(str(hf_dir)):
            raise KuiperError(f"{hf_dir} is not a directory or a Hugging Face hub id (org/name)")
        hf_dir = snapshot(str(hf_dir), progress=progress, log=log)
    hf_dir = Path(hf_dir)
    cfg = _read_json(hf_dir / "config.json", required=True)
    if not isinstance(cfg, dict):
        raise KuiperError("config.json is not a JSON object")
    args = ModelArgs.from_hf_config(cfg, group_size=check_config(cfg))
    ck = quant.open_source(cfg, Checkpoint(hf_dir))
    header, regions = plan_file(ck, args)
    if hasattr(ck, "check_values"):
        ck.check_values()

    gen = _read_json(hf_dir / "generation_config.json", required=False)
    tok = None
    if (hf_dir / "tokenizer.json").exists():
        try:
            tok = (hf_dir / "tokenizer.json").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise KuiperError(f"cannot read tokenizer.json: {e}") from None
    else:
        log("warning: no tokenizer.json in the checkpoint; `kuiper generate` will need --tokenizer")
    tok_cfg = _read_json(hf_dir / "tokenizer_config.json", required=False)
    if tok_cfg is not None and "chat_template" not in tok_cfg and (hf_dir / "chat_template.jinja").exists():
        tok_cfg["chat_template"] = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    return write_file(ck, header, regions, trailer_bytes(cfg, gen, tok, tok_cfg), out_path, progress, log, t0)


def plan_file(ck, args: ModelArgs) -> tuple[fmt.Header, list[fmt.Region]]:
    """The header and regions of the file for model args (from a config check_config passed) and tensor
    source ck (a Checkpoint, or anything with its __contains__, shape, dtype, get and release), after checking
    that every tensor a region needs is there with its shape and dtype: nothing is written before this passes."""
    src = getattr(ck, "source_name", lambda n: n)
    shared = args.tie_word_embeddings or "lm_head.weight" not in ck
    if not args.tie_word_embeddings and "lm_head.weight" not in ck:
        raise KuiperError("checkpoint is missing tensor lm_head.weight and tie_word_embeddings is false")
    header = header_from_args(args, shared)
    header.validate()
    regions = fmt.regions(header)
    for r in regions:
        sources = region_sources(r)
        for pieces in sources:
            want = r.shape if len(sources) == 1 else r.shape[1:]
            for n in pieces:
                shape = tuple(ck.shape(n))
                exp = want if len(pieces) == 1 else want[:-1] + (want[-1] // len(pieces),)
                if shape != exp:
                    raise KuiperError(f"tensor {src(n)} gives {n} of shape {list(shape)}, expected {list(exp)} "
                                      f"from config.json" if src(n) != n else
                                      f"tensor {n} has shape {list(shape)}, expected {list(exp)}")
                _check_dtype(ck.dtype(n), r.dtype, src(n))
    return header, regions


def trailer_bytes(cfg: dict, gen, tok: str | None, tok_cfg) -> bytes:
    """The metadata trailer: the checkpoint's config, generation config, tokenizer.json and its config."""
    return json.dumps({"config": cfg, "generation_config": gen, "tokenizer": tok,
                       "tokenizer_config": tok_cfg, "kuiper": {"format": "ak48", "ext_version": 1}},
                      ensure_ascii=False).encode("utf-8")


def write_file(ck, header: fmt.Header, regions: list[fmt.Region], trailer: bytes, out_path: str | Path,
               progress: bool = True, log=None, t0: float | None = None) -> dict:
    """Stream plan_file's regions from ck and the trailer into out_path, through a temporary file in the same
    directory that is renamed only once complete (a failure leaves nothing behind)."""
    log = log or (lambda m: print(m, file=sys.stderr))
    t0 = time.perf_counter() if t0 is None else t0
    out_path = Path(out_path)
    header.trailer_offset = header.weights_end
    header.trailer_length = len(trailer)
    total = header.trailer_offset + len(trailer)

    out_dir = out_path.resolve().parent
    if not out_dir.is_dir():
        raise KuiperError(f"output directory {out_dir} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".partial", dir=out_dir)
    except OSError as e:
        raise KuiperError(f"cannot write to {out_dir}: {e.strerror}") from None
    n_q = n_qbytes = 0
    bar = None
    try:
        with os.fdopen(fd, "wb") as f, ThreadPoolExecutor(1) as hasher:
            head = header.pack()
            sha = hashlib.sha256(fmt.hashed_header(head))
            f.write(head)
            if progress:
                from tqdm import tqdm
                bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="export",
                           file=sys.stderr, dynamic_ncols=True)
            for r in regions:
                if r.name.endswith("qweight"):
                    n_q += int(np.prod(r.shape)) * 8
                if r.name.split(".")[-1] in ("qweight", "qzeros", "scales"):
                    n_qbytes += r.nbytes
                assert f.tell() == r.offset, r.name
                for b in _region_bytes(ck, r):
                    # hashing (user time, the GIL released) beside the write (system time): each piece is hashed
                    # and written before the next is read, as a source's pages are released once passed
                    hashed = hasher.submit(sha.update, b)
                    f.write(b)
                    hashed.result()
                    if bar:
                        bar.update(b.nbytes if isinstance(b, memoryview) else len(b))
                assert f.tell() == r.offset + r.nbytes, r.name
            sha.update(trailer)
            f.write(trailer)
            header.checksum = sha.digest()
            f.seek(0)
            f.write(header.pack())
            # mkstemp makes the file 0600: give it the mode any new file of the user's gets (0644 under umask 022),
            # so a model directory shared with another user or a service stays readable
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)
            f.flush()
            os.fsync(f.fileno())
        if bar:
            bar.update(len(trailer))
            bar.close()
        os.replace(tmp, out_path)
    except BaseException as e:
        if bar:
            bar.close()
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            if e.errno in (28, 27, 122):  # ENOSPC, EFBIG, EDQUOT
                raise ResourceError(f"export failed, disk full or file too large: {e.strerror}") from None
            raise KuiperError(f"export failed writing {out_path}: {e.strerror}") from None
        raise
    dt = time.perf_counter() - t0
    summary = {"tensors": len(regions), "bytes": total, "bits_per_weight": 8 * n_qbytes / max(n_q, 1),
               "seconds": dt, "shared_classifier": header.shared_classifier, "output": str(out_path)}
    log(f"exported {len(regions)} tensors, {total / 2**20:.1f} MiB, {summary['bits_per_weight']:.3f} bits per "
        f"quantized weight, in {dt:.1f} s -> {out_path}")
    return summary
