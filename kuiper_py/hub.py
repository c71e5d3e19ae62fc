"""Models by name: Hugging Face hub ids resolved through huggingface_hub, and a cache of exported files.

`resolve_model(arg)` is what a `-m` option takes: an existing file as is; a Hugging Face directory or a hub id
(`Qwen/Qwen3-8B-AWQ`, optionally `@revision`) exported once into the kuiper cache ($KUIPER_CACHE, default
~/.cache/kuiper) and reused from then on, keyed on the source's identity (the hub commit, or the directory's
path and its files' sizes and modification times).
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

from .errors import KuiperError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+(@[A-Za-z0-9_./-]+)?$")
PATTERNS = ["*.json", "*.safetensors", "*.jinja"]


def is_hub_id(arg: str) -> bool:
    """org/name or org/name@revision, and no such path on disk."""
    return bool(_HUB_ID.match(arg)) and not Path(arg).exists() and not arg.endswith((".bin", ".safetensors"))


def _split(arg: str) -> tuple[str, str | None]:
    repo, _, rev = arg.partition("@")
    return repo, rev or None


def cache_root() -> Path:
    return Path(os.environ.get("KUIPER_CACHE") or Path.home() / ".cache" / "kuiper")


def _local_snapshot(arg: str) -> Path | None:
    """The hub id's snapshot directory in the Hugging Face cache, or None (no network)."""
    from huggingface_hub import snapshot_download

    repo, rev = _split(arg)
    try:
        return Path(snapshot_download(repo, revision=rev, local_files_only=True, allow_patterns=PATTERNS))
    except Exception:  # not cached (LocalEntryNotFoundError and kin)
        return None


def _hub_commit(arg: str) -> str | None:
    """The commit the hub names for the id's revision (one small request), or None when it cannot be asked."""
    from huggingface_hub import HfApi

    repo, rev = _split(arg)
    try:
        return HfApi().model_info(repo, revision=rev).sha
    except Exception:  # offline, unknown id, no access: the download says why, or an earlier export serves
        return None


def snapshot(arg: str, progress: bool = True, log=None) -> Path:
    """The local snapshot directory of a hub id: from the Hugging Face cache if it is there (no network), else
    downloaded (config, tokenizer and safetensors files only) with a progress bar on stderr."""
    from huggingface_hub import snapshot_download

    log = log or (lambda m: print(m, file=sys.stderr))
    local = _local_snapshot(arg)
    if local is not None:
        return local
    repo, rev = _split(arg)
    log(f"{arg} is not in the Hugging Face cache: downloading it from the hub")
    try:
        if not progress:
            from huggingface_hub.utils import disable_progress_bars
            disable_progress_bars()
        return Path(snapshot_download(repo, revision=rev, allow_patterns=PATTERNS))
    except Exception as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise KuiperError(f"{arg} is not in the Hugging Face cache and cannot be downloaded: {why}") from None


def _dir_key(d: Path) -> str:
    """A directory's identity: its resolved path and each config/weights file's name, size and mtime."""
    h = hashlib.sha256(str(d.resolve()).encode())
    for p in sorted(d.iterdir()):
        if p.suffix in (".json", ".safetensors", ".jinja"):
            st = p.stat()
            h.update(f"\0{p.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def cached_path(arg: str, progress: bool = True, log=None) -> tuple[Path, Path]:
    """(the cache file for a directory or hub id, the directory it is exported from)."""
    d = Path(arg)
    if d.is_dir():
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", d.resolve().name) or "model"
        return cache_root() / "dirs" / f"{name}-{_dir_key(d)}.bin", d
    repo, rev = _split(arg)
    folder = cache_root() / "hub" / repo.replace("/", "--")
    src = _local_snapshot(arg)
    if src is None:
        sha = _hub_commit(arg)  # (a file exported from the hub's current commit needs no download)
        if sha and (folder / f"{sha}.bin").is_file():
            return folder / f"{sha}.bin", folder / f"{sha}.bin"
        try:
            src = snapshot(arg, progress, log)
        except KuiperError:
            # neither the Hugging Face cache nor the network has it: a file exported earlier still serves
            done = sorted((p for p in folder.glob("*.bin") if rev in (None, p.stem)),
                          key=lambda p: p.stat().st_mtime)
            if not done:
                raise
            (log or (lambda m: print(m, file=sys.stderr)))(f"{arg} is unreachable: using {done[-1]}, exported "
                                                           f"earlier")
            return done[-1], done[-1]
    return folder / f"{src.name}.bin", src  # src.name: the snapshot's commit


def resolve_model(arg: str, progress: bool = True, log=None) -> Path:
    """The ak48 file for a -m argument: an existing file as is; a Hugging Face directory or hub id exported once
    into the cache (progress on stderr) and the cached file from then on."""
    from .export import export

    log = log or (lambda m: print(m, file=sys.stderr))
    p = Path(arg)
    if p.is_file():
        return p
    if not p.is_dir() and not is_hub_id(arg):
        raise KuiperError(f"{arg}: no such model file, Hugging Face directory or hub id (org/name)")
    out, src = cached_path(arg, progress, log)
    if out.is_file():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KuiperError(f"cannot create the kuiper cache {out.parent}: {e.strerror} (set KUIPER_CACHE)") from None
    log(f"exporting {arg} once into {out}")
    export(src, out, progress=progress, log=log)
    return out
