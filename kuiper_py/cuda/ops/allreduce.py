"""The one-shot all-reduce over peer memory (kernels_cu/allreduce.cu) for batch-1 decode's small vectors: N GPUs of
one process, each rank's kernel pushing its input into every rank's buffer, one flag per block and rank, and every rank
summing the N slots in rank order (identical bits on all ranks). The epochs live in device memory, so a captured CUDA
graph replays it. OneShotAllReduce.on_one_device runs the same kernel with N simulated ranks on one GPU (tests).

The layout helpers at the top need no GPU (tests/test_allreduce_cpu.py)."""
from __future__ import annotations

import numpy as np

from ...errors import KuiperError

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None

MAX_RANKS = 8  # allreduce.cu AR_MAX_RANKS (NVLink peers of one host)
VEC_BYTES = 16  # the kernel moves 16-byte vectors
THREADS = 256  # allreduce.cu __launch_bounds__
DEFAULT_BLOCKS = 8  # 8 x 256 threads x 16 bytes = 32 KB per grid-stride pass: one pass up to 32 KB
DEFAULT_MAX_BYTES = 64 << 10
MAX_BYTES_LIMIT = 1 << 20  # one-shot pays N x the message on every link: beyond ~1 MB NCCL's ring wins anyway
KERNELS = {np.dtype(np.float16): "allreduce_oneshot<__half>", np.dtype(np.float32): "allreduce_oneshot<float>"}


def check_ranks(n_ranks: int, devices: list[int] | None = None) -> None:
    """A group size the kernel supports (1..MAX_RANKS; distinct devices where they are given)."""
    if not 1 <= n_ranks <= MAX_RANKS:
        raise KuiperError(f"the one-shot all-reduce takes 1 to {MAX_RANKS} ranks, not {n_ranks}")
    if devices is not None and len(set(devices)) != len(devices):
        raise KuiperError(f"the one-shot all-reduce needs one device per rank, got {devices}")


def check_capacity(max_bytes: int) -> int:
    """max_bytes rounded up to whole vectors, refused past MAX_BYTES_LIMIT; returns the capacity in vectors."""
    if not 0 < max_bytes <= MAX_BYTES_LIMIT:
        raise KuiperError(f"one-shot all-reduce capacity must be 1 B to {MAX_BYTES_LIMIT} B, not {max_bytes}")
    return -(-max_bytes // VEC_BYTES)


def check_message(nbytes: int, dtype, cap_vec: int, ptrs=()) -> int:
    """The message's length in 16-byte vectors, or a clear error: a dtype with a kernel, whole vectors, within the
    capacity, every pointer 16-byte aligned."""
    if np.dtype(dtype) not in KERNELS:
        raise TypeError(f"the one-shot all-reduce sums float16 or float32, not {np.dtype(dtype)}")
    if nbytes <= 0 or nbytes % VEC_BYTES:
        raise ValueError(f"the one-shot all-reduce needs a multiple of {VEC_BYTES} bytes, got {nbytes}")
    n_vec = nbytes // VEC_BYTES
    if n_vec > cap_vec:
        raise ValueError(f"{nbytes} bytes exceed the one-shot all-reduce's capacity of {cap_vec * VEC_BYTES}")
    if any(p % VEC_BYTES for p in ptrs):
        raise ValueError("the one-shot all-reduce's inputs and outputs must be 16-byte aligned")
    return n_vec


def buffer_bytes(n_ranks: int, cap_vec: int) -> int:
    """Bytes of one rank's peer-visible buffer: two halves (epoch parity) of n_ranks slots of cap_vec vectors."""
    return 2 * n_ranks * cap_vec * VEC_BYTES


def slot_offset(epoch: int, slot: int, n_ranks: int, cap_vec: int) -> int:
    """Byte offset in a rank's buffer where rank `slot` writes at `epoch` (allreduce.cu's `half` + slot)."""
    assert 0 <= slot < n_ranks
    return ((epoch & 1) * n_ranks + slot) * cap_vec * VEC_BYTES


def flag_index(block: int, rank: int, n_ranks: int) -> int:
    """Index of the flag in a rank's flag array that `rank`'s block `block` raises."""
    return block * n_ranks + rank


def vector_owner(i: int, blocks: int) -> int:
    """The block that moves vector i at every message size (the kernel's grid-stride loop over a fixed grid)."""
    return i % (blocks * THREADS) // THREADS


def reference_sum(xs: list[np.ndarray]) -> np.ndarray:
    """What every rank must hold: the ranks' inputs summed in rank order in float32, rounded once to their dtype."""
    acc = xs[0].astype(np.float32)
    for x in xs[1:]:
        acc = acc + x.astype(np.float32)
    return acc.astype(xs[0].dtype)


def enable_peer_access(devices: list[int]) -> None:
    """Let every device of the group read and write every other's memory (already enabled is fine)."""
    for d in devices:
        for p in devices:
            if p == d:
                continue
            if not cp.cuda.runtime.deviceCanAccessPeer(d, p):
                raise KuiperError(f"GPU {d} cannot access GPU {p}'s memory: the one-shot all-reduce needs peer access")
            with cp.cuda.Device(d):
                try:
                    cp.cuda.runtime.deviceEnablePeerAccess(p)
                except cp.cuda.runtime.CUDARuntimeError as e:
                    if e.status != 704:  # cudaErrorPeerAccessAlreadyEnabled
                        raise


def _kernel_on(device: int, name: str):
    """allreduce.cu's kernel loaded on `device` (build.kernel() caches one function per name, not per device)."""
    from ..runtime import build
    with cp.cuda.Device(device):
        build.kernel("ar", name)  # builds (or loads) the module
        return build.load_module(build.module_key("ar", name)).get_function(name)


def _checked_out(out, x):
    """A caller's output array, if it can take x's sum."""
    if out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
        raise ValueError("an all-reduce output must be a contiguous array of its input's shape and dtype")
    return out


class OneShotAllReduce:
    """One all-reduce group: rank r's buffer, flags and epochs on devices[r] (or all on one device, simulated)."""

    def __init__(self, devices: list[int], max_bytes: int = DEFAULT_MAX_BYTES, blocks: int = DEFAULT_BLOCKS,
                 simulated: bool = False):
        if cp is None:
            raise KuiperError("the one-shot all-reduce needs CuPy")
        self.n = len(devices)
        check_ranks(self.n, None if simulated else devices)
        if not 1 <= blocks <= 64:
            raise KuiperError(f"the one-shot all-reduce's grid takes 1 to 64 blocks, not {blocks}")
        self.devices, self.blocks, self.simulated = list(devices), blocks, simulated
        self.cap_vec = check_capacity(max_bytes)
        if not simulated:
            enable_peer_access(self.devices)
        elif blocks * self.n > cp.cuda.Device(devices[0]).attributes["MultiProcessorCount"]:
            raise KuiperError("simulated ranks wait on each other: blocks x ranks must fit the SMs at once")
        self._bufs, self._flags, self._epochs, self._peers = [], [], [], []
        for d in self.devices:
            with cp.cuda.Device(d):
                self._bufs.append(cp.zeros(buffer_bytes(self.n, self.cap_vec) // 4, dtype=cp.uint32))
                self._flags.append(cp.zeros(self.blocks * self.n, dtype=cp.uint32))
                if not (simulated and self._epochs):  # one counter per block; simulated: rank y's are row y
                    self._epochs.append(cp.zeros((self.n if simulated else 1, self.blocks), dtype=cp.uint32))
        table = np.array([b.data.ptr for b in self._bufs] + [f.data.ptr for f in self._flags], dtype=np.uint64)
        for d in self.devices:
            with cp.cuda.Device(d):
                self._peers.append(cp.asarray(table))
        for d in self.devices:
            cp.cuda.Device(d).synchronize()  # zeroed everywhere before any rank's kernel can raise a flag
        self._fns = {}

    @classmethod
    def on_one_device(cls, n_ranks: int, device: int = 0, **kw) -> "OneShotAllReduce":
        """N simulated ranks on one GPU, reduced by one launch (gridDim.y = N): the single-GPU test form."""
        return cls([device] * n_ranks, simulated=True, **kw)

    def _fn(self, device: int, dtype):
        key = (device, np.dtype(dtype))
        if key not in self._fns:
            self._fns[key] = _kernel_on(device, KERNELS[key[1]])
        return self._fns[key]

    def _args(self, x, out, rank: int, n_vec: int, stride: int):
        epochs = self._epochs[0 if self.simulated else rank]
        return (x, out, np.int64(stride), self._peers[rank], epochs, np.int32(n_vec), np.int32(self.cap_vec),
                np.int32(self.n), np.int32(rank))

    def all_reduce(self, xs, outs=None, streams=None):
        """Multi-GPU: xs[r] on devices[r] (same shape and dtype, contiguous); returns outs[r] = the rank-order sum,
        each launched on streams[r] (default: the device's current stream). Simulated: xs is one [N, ...] array and
        so is the result."""
        if self.simulated:
            return self._simulated(xs, outs, streams)
        if len(xs) != self.n:
            raise ValueError(f"{len(xs)} inputs for a group of {self.n}")
        if any(x.shape != xs[0].shape or x.dtype != xs[0].dtype or not x.flags.c_contiguous for x in xs):
            raise ValueError("the ranks' inputs must be contiguous arrays of one shape and dtype")
        result = []
        for r, (d, x) in enumerate(zip(self.devices, xs)):  # every check before any launch: a rank launched alone
            with cp.cuda.Device(d):                          # would wait for its peers' flags forever
                out = cp.empty_like(x) if outs is None else _checked_out(outs[r], x)
                if x.device.id != d or out.device.id != d:
                    raise ValueError(f"rank {r}'s input and output must be on GPU {d}")
                n_vec = check_message(x.nbytes, x.dtype, self.cap_vec, (x.data.ptr, out.data.ptr))
                result.append(out)
        for r, (d, x, out) in enumerate(zip(self.devices, xs, result)):
            with cp.cuda.Device(d):
                with streams[r] if streams is not None else cp.cuda.get_current_stream():
                    self._fn(d, x.dtype)((self.blocks, 1), (THREADS,), self._args(x, out, r, n_vec, 0))
        return result

    def _simulated(self, x, out, streams):
        if x.ndim < 2 or x.shape[0] != self.n or not x.flags.c_contiguous:
            raise ValueError(f"simulated ranks take one contiguous [{self.n}, ...] array")
        d = self.devices[0]
        with cp.cuda.Device(d):
            out = cp.empty_like(x) if out is None else _checked_out(out, x)
            n_vec = check_message(x.nbytes // self.n, x.dtype, self.cap_vec, (x.data.ptr, out.data.ptr))
            with streams[0] if streams is not None else cp.cuda.get_current_stream():
                self._fn(d, x.dtype)((self.blocks, self.n), (THREADS,), self._args(x, out, 0, n_vec, n_vec))
        return out

    def epochs(self) -> list[np.ndarray]:
        """Each rank's per-block epoch counters (host copies): how many all-reduces it has run."""
        if self.simulated:
            return list(self._epochs[0].get())
        return [e.get()[0] for e in self._epochs]
