"""A strict, streaming safetensors reader over mmap.

We parse the header ourselves instead of using safetensors' loader so that a header that
lies about sizes or offsets is refused with the tensor's name, BF16 can be read without
torch, and a tensor is only materialised when the exporter asks for it.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from .errors import KuiperError

_DTYPES = {"F16": np.float16, "F32": np.float32, "I32": np.int32, "BF16": np.uint16,
           "F64": np.float64, "I64": np.int64, "I8": np.int8, "U8": np.uint8, "I16": np.int16}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._f = open(self.path, "rb")
        except OSError as e:
            raise KuiperError(f"cannot open {self.path}: {e.strerror}") from None
        size = os.fstat(self._f.fileno()).st_size
        if size < 8:
            raise KuiperError(f"{self.path.name}: not a safetensors file (only {size} bytes)")
        (hlen,) = struct.unpack("<Q", self._f.read(8))
        if hlen > min(MAX_HEADER, size - 8):
            raise KuiperError(f"{self.path.name}: safetensors header length {hlen} is larger than the file")
        try:
            meta = json.loads(self._f.read(hlen))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise KuiperError(f"{self.path.name}: safetensors header is not valid JSON") from None
        if not isinstance(meta, dict):
            raise KuiperError(f"{self.path.name}: safetensors header is not a JSON object")
        meta.pop("__metadata__", None)
        self._base = 8 + hlen
        data_len = size - self._base
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in meta.items():
            try:
                dt, shape, (a, b) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise KuiperError(f"{self.path.name}: tensor {name} has a malformed header entry") from None
            if dt not in _DTYPES:
                raise KuiperError(f"{self.path.name}: tensor {name} has unsupported dtype {dt}")
            n = np.dtype(_DTYPES[dt]).itemsize
            for s in shape:
                if s < 0:
                    raise KuiperError(f"{self.path.name}: tensor {name} has a negative dimension")
                n *= s
            if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= data_len and b - a == n):
                raise KuiperError(f"{self.path.name}: header of tensor {name} lies about its size or offsets")
            self.tensors[name] = (dt, shape, a, b)
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def dtype(self, name: str) -> str:
        return self.tensors[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def get(self, name: str) -> np.ndarray:
        """A zero-copy read-only view (BF16 comes back as its uint16 bit pattern)."""
        dt, shape, a, b = self.tensors[name]
        arr = np.frombuffer(self._mm, dtype=_DTYPES[dt], count=(b - a) // np.dtype(_DTYPES[dt]).itemsize,
                            offset=self._base + a)
        return arr.reshape(shape)

    def release(self, name: str, start: int = 0, end: int | None = None) -> None:
        """Drop the mapped pages of (a byte range of) a tensor we are done with, so a streaming export's
        resident set stays near one chunk instead of growing to the whole checkpoint."""
        if self._mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        _, _, a, b = self.tensors[name]
        page = mmap.PAGESIZE
        lo = (self._base + a + start) // page * page
        hi = self._base + (b if end is None else a + end)
        if hi > lo:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self):
        # views handed out keep the mapping alive; closing the file object is enough
        self._f.close()


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Checkpoint:
    """All safetensors shards of a Hugging Face model directory, by tensor name."""

    def __init__(self, hf_dir: Path):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        files: list[Path]
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError):
                raise KuiperError(f"{index} is not a valid safetensors index") from None
            root = self.dir.resolve()
            files = []
            for shard in sorted(set(weight_map.values())):
                p = (self.dir / shard).resolve()
                if root not in p.parents:
                    raise KuiperError(f"index names shard {shard!r} outside the model directory")
                if not p.is_file():
                    raise KuiperError(f"index names shard {shard!r}, which does not exist")
                files.append(p)
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                if any(self.dir.glob("*.bin")) or any(self.dir.glob("*.pt")):
                    raise KuiperError(f"{self.dir} has only pickle weights (.bin/.pt); kuiper reads safetensors only")
                raise KuiperError(f"{self.dir} has no *.safetensors weights")
        self.shards = [SafetensorsFile(p) for p in files]
        self.where: dict[str, SafetensorsFile] = {}
        for s in self.shards:
            for name in s.tensors:
                self.where[name] = s

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise KuiperError(f"checkpoint is missing tensor {name}")
        return self.where[name].get(name)

    def dtype(self, name: str) -> str:
        return self.where[name].dtype(name)

    def release(self, name: str, start: int = 0, end: int | None = None) -> None:
        self.where[name].release(name, start, end)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.where:
            raise KuiperError(f"checkpoint is missing tensor {name}")
        return self.where[name].shape(name)
