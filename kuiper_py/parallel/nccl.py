"""comm.Communicator over NCCL through CuPy (cupy.cuda.nccl), for ranks on GPUs: x is a CuPy array on the rank's
device and every collective is queued on the rank's stream (so a captured CUDA graph can hold it).

Two ways to build a group: one process per GPU, each calling NcclCommunicator(rank, size, rendezvous) (rank 0 makes
NCCL's unique id and the Rendezvous hands it to the others: threads of one process, a file on a shared disk, or
whatever a multi-node launcher provides), or one process driving every GPU (NcclCommunicator.in_process), whose
collectives a single thread must issue inside group() (NCCL's groupStart/groupEnd) or from one thread per rank."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ..errors import KuiperError
from .comm import Rendezvous

try:
    import cupy as cp
    from cupy.cuda import nccl
except ImportError:  # pragma: no cover - CPU-only installs, or CuPy built without NCCL
    cp = nccl = None


def available() -> bool:
    """Whether CuPy and its NCCL binding import."""
    return nccl is not None


def _require() -> None:
    if nccl is None:
        raise KuiperError("--tp over GPUs needs CuPy with NCCL (pip install 'kuiper[cuda13]' and nvidia-nccl)")


def _datatype(dtype) -> int:
    types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
             np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int32): nccl.NCCL_INT32,
             np.dtype(np.int64): nccl.NCCL_INT64}
    try:
        return types[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"NCCL collectives of {np.dtype(dtype)} are not supported here") from None


def uid_to_bytes(uid) -> bytes:
    """NCCL's unique id as bytes for a Rendezvous (CuPy returns bytes, older releases a tuple of 128 signed chars;
    the first byte records which)."""
    if isinstance(uid, (bytes, bytearray)):
        return b"b" + bytes(uid)
    return b"t" + bytes(c & 0xFF for c in uid)


def uid_from_bytes(raw: bytes):
    """uid_to_bytes' inverse, in the form this CuPy's NcclCommunicator takes."""
    body = raw[1:]
    if raw[:1] == b"b":
        return body
    return tuple(c - 256 if c > 127 else c for c in body)


@contextmanager
def group():
    """NCCL's groupStart/groupEnd: one thread issuing the collectives of several ranks of one process."""
    nccl.groupStart()
    try:
        yield
    finally:
        nccl.groupEnd()


def _on_device(method):
    """Run a collective with its communicator's GPU current: in one process driving several GPUs, rank r's buffers
    must be made on rank r's device, whichever device the caller left current."""
    import functools

    @functools.wraps(method)
    def run(self, *a, **k):
        with self.device:
            return method(self, *a, **k)
    return run


class NcclCommunicator:
    """comm.Communicator of one GPU rank (rank r uses device r unless told otherwise)."""

    def __init__(self, rank: int, size: int, rendezvous: Rendezvous | None = None, device: int | None = None,
                 stream=None, _comm=None):
        _require()
        self.rank, self.size = rank, size
        self.device = cp.cuda.Device(rank if device is None else device)
        self.stream = stream  # None: the stream current at each call
        if _comm is None:
            if rendezvous is None:
                raise ValueError("a rank of a new NCCL group needs a rendezvous")
            raw = rendezvous.share(rank, lambda: uid_to_bytes(nccl.get_unique_id()))
            with self.device:
                _comm = nccl.NcclCommunicator(size, uid_from_bytes(raw), rank)
        self._comm = _comm

    @classmethod
    def in_process(cls, devices: list[int]) -> list["NcclCommunicator"]:
        """One communicator per device of this process (ncclCommInitAll), rank i on devices[i]."""
        _require()
        comms = nccl.NcclCommunicator.initAll(list(devices))
        return [cls(i, len(devices), device=d, _comm=c) for i, (c, d) in enumerate(zip(comms, devices))]

    def _stream_ptr(self) -> int:
        return (self.stream or cp.cuda.get_current_stream()).ptr

    @_on_device
    def all_reduce_sum(self, x):
        x = cp.ascontiguousarray(x)
        out = cp.empty_like(x)
        self._comm.allReduce(x.data.ptr, out.data.ptr, x.size, _datatype(x.dtype), nccl.NCCL_SUM,
                             self._stream_ptr())
        return out

    @_on_device
    def all_gather(self, x, axis: int = -1):
        """Every rank's x (the same shape on each) concatenated along axis in rank order."""
        x = cp.ascontiguousarray(x)
        buf = cp.empty((self.size,) + x.shape, dtype=x.dtype)
        self._comm.allGather(x.data.ptr, buf.data.ptr, x.size, _datatype(x.dtype), self._stream_ptr())
        return cp.concatenate(list(buf), axis=axis)

    @_on_device
    def argmax(self, local, offset: int) -> int:
        """Each rank's best (value, id) gathered as float64 pairs (ids exact), the best of them on the device; ties go
        to the lower id."""
        i = cp.argmax(local)
        pair = cp.stack([local[i].astype(cp.float64), (i + offset).astype(cp.float64)])
        pairs = self.all_gather(pair[None], axis=0)  # [size, 2]
        best = pairs[:, 0] == pairs[:, 0].max()
        return int(cp.where(best, pairs[:, 1], cp.inf).min())

    @_on_device
    def barrier(self) -> None:
        self.all_reduce_sum(cp.zeros(1, dtype=cp.float32))
        (self.stream or cp.cuda.get_current_stream()).synchronize()

    def close(self) -> None:
        """Free the NCCL communicator (every rank of the group does)."""
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
