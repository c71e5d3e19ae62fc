"""Groups of GPU ranks in one process (docs/PARALLEL.md): DeviceLocalGroup, N ranks on one GPU taking turns (the
tests' way to run the CUDA backend's sharding on a single GPU), and the NCCL group of one process driving N GPUs.

TurnGroup runs its ranks as threads of which exactly one runs at a time, in rank order, each handing the turn on
at its next collective: the ranks' kernels never interleave and the module-level state the backends share is
only ever touched by one of them. The rank that completes a collective combines every rank's part (in rank order)
before any rank runs on, so no part is read after its owner has reused its buffer."""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np


def _xp(x):
    """The array module of x (NumPy, or CuPy for device arrays)."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def _sum(parts):
    out = parts[0].copy()
    for p in parts[1:]:
        out += p
    return out


def _best(parts):
    """The (value, id) pair of the largest value, the lower id on a tie."""
    return min(parts, key=lambda vi: (-vi[0], vi[1]))[1]


class TurnGroup:
    """N ranks in one process that take turns (module docstring); the comm(rank) objects are comm.Communicators. An
    error in one rank stops the others at their next turn; run() raises it once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cv = threading.Condition()
        self._turn = 0
        self._slots: list[Any] = [None] * size
        self._done: Any = None
        self._error: BaseException | None = None

    def comm(self, rank: int) -> "TurnComm":
        return TurnComm(self, rank)

    def _wait_turn(self, rank: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._turn == rank or self._error is not None)
            if self._error is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} stopped: another rank failed")

    def _pass_turn(self, rank: int) -> None:
        with self._cv:
            self._turn = (rank + 1) % self.size
            self._cv.notify_all()

    def exchange(self, rank: int, x, combine: Callable[[list], Any]):
        """combine(every rank's x, in rank order), computed once by the last rank to arrive (a collective)."""
        self._slots[rank] = x
        if rank == self.size - 1:
            self._done = combine(list(self._slots))
            self._slots = [None] * self.size
        self._pass_turn(rank)
        self._wait_turn(rank)
        return self._done  # (read before this rank hands the turn on: no later collective has replaced it)

    def reduce(self, rank: int, x):
        """Rank rank's all-reduce: the rank-order sum, a copy of its own."""
        return self.exchange(rank, x, _sum).copy()

    def enter(self, rank: int):
        """A context each rank's thread runs in (DeviceLocalGroup: the rank's GPU made current)."""
        import contextlib
        return contextlib.nullcontext()

    def run(self, fn: Callable[[int], Any]) -> list:
        """fn(rank) on every rank, each in its own thread, taking turns; their results in rank order."""
        self._turn, self._error = 0, None
        out: list[Any] = [None] * self.size

        def body(r: int) -> None:
            try:
                with self.enter(r):
                    self._wait_turn(r)
                    out[r] = fn(r)
                self._pass_turn(r)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                with self._cv:
                    self._error = self._error or e
                    self._cv.notify_all()

        threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}", daemon=True)
                   for r in range(self.size)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:  # (Ctrl-C while joining: the ranks stop at their next turn)
            with self._cv:
                self._error = self._error or KeyboardInterrupt()
                self._cv.notify_all()
            raise
        if self._error is not None:
            raise self._error
        return out


class TurnComm:
    """Communicator of one TurnGroup rank: sums and gathers in rank order, so every rank gets the same bits (each
    its own copy)."""

    def __init__(self, group: TurnGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce_sum(self, x):
        return self.group.reduce(self.rank, x)

    def all_gather(self, x, axis: int = -1):
        return self.group.exchange(self.rank, x, lambda parts: _xp(x).concatenate(parts, axis=axis)).copy()

    def argmax(self, local, offset: int) -> int:
        i = int(_xp(local).argmax(local))
        return self.group.exchange(self.rank, (float(local[i]), offset + i), _best)

    def barrier(self) -> None:
        self.group.exchange(self.rank, None, lambda parts: None)


def _fits(oneshot, x) -> bool:
    """Whether x is a message the one-shot all-reduce takes (fp16/fp32, whole 16-byte vectors, its capacity);
    larger ones (a long prompt's rows) are summed another way."""
    return (oneshot is not None and x.dtype.name in ("float16", "float32") and x.nbytes % 16 == 0
            and x.nbytes <= oneshot.cap_vec * 16 and x.flags.c_contiguous)


class DeviceLocalGroup(TurnGroup):
    """N ranks in one process, all on one GPU (the current one, or device), each with its own CupyOps over its
    shards, summing with CuPy in rank order: the sharding of the CUDA backend testable on a single GPU. oneshot:
    the all-reduces of the messages it takes go through the one-shot kernel's simulated ranks
    (cuda/ops/allreduce.py; the same rank-order fp32 sum)."""

    def __init__(self, size: int, device: int | None = None, oneshot: bool = False) -> None:
        import cupy
        super().__init__(size)
        self.device = cupy.cuda.Device(device).id if device is not None else cupy.cuda.Device().id
        self._oneshot = None
        if oneshot:
            from ..cuda.ops.allreduce import OneShotAllReduce
            self._oneshot = OneShotAllReduce.on_one_device(size, self.device)

    def reduce(self, rank: int, x):
        if not _fits(self._oneshot, x):
            return super().reduce(rank, x)
        import cupy
        return self.exchange(rank, x, lambda parts: self._oneshot.all_reduce(cupy.stack(parts)))[rank].copy()

    def devices(self) -> list[int]:
        return [self.device] * self.size

    def enter(self, rank: int):
        import cupy
        return cupy.cuda.Device(self.device)


class NcclGroup(TurnGroup):
    """One process driving N GPUs: rank r's CupyOps on device r, NCCL's in-process communicators (ncclCommInitAll).
    The ranks take turns on the host as in TurnGroup (their launches are queued, so the GPUs still run side by
    side); the rank completing a collective issues every rank's NCCL call in one group (groupStart/groupEnd, the
    form NCCL asks of a thread driving several devices), each on its device's current stream."""

    def __init__(self, size: int) -> None:
        from .nccl import NcclCommunicator
        super().__init__(size)
        self._comms = NcclCommunicator.in_process(list(range(size)))

    def devices(self) -> list[int]:
        return list(range(self.size))

    def enter(self, rank: int):
        import cupy
        return cupy.cuda.Device(rank)

    def _nccl_sum(self, parts):
        from . import nccl
        with nccl.group():
            return [c.all_reduce_sum(x) for c, x in zip(self._comms, parts)]

    def _nccl_gather(self, parts, axis: int):
        """Every rank's gathered copy; the concatenations queued after groupEnd has queued the gathers."""
        import cupy
        from . import nccl
        bufs = []
        with nccl.group():
            for c, x in zip(self._comms, parts):
                with c.device:
                    x = cupy.ascontiguousarray(x)
                    buf = cupy.empty((self.size,) + x.shape, dtype=x.dtype)
                    c._comm.allGather(x.data.ptr, buf.data.ptr, x.size, nccl._datatype(x.dtype), c._stream_ptr())
                    bufs.append((buf, x))  # (x kept alive until the gather has run)
        out = []
        for c, (buf, _) in zip(self._comms, bufs):
            with c.device:
                out.append(cupy.concatenate(list(buf), axis=axis))
        return out

    def reduce(self, rank: int, x):
        return self.exchange(rank, x, self._nccl_sum)[rank]

    def comm(self, rank: int) -> "_NcclTurnComm":
        return _NcclTurnComm(self, rank)

    def close(self) -> None:
        for c in self._comms:
            c.close()


class _NcclTurnComm(TurnComm):
    """Communicator of an NcclGroup rank: the sums and gathers over NCCL."""

    def all_gather(self, x, axis: int = -1):
        return self.group.exchange(self.rank, x, lambda parts: self.group._nccl_gather(parts, axis))[self.rank]


class PeerGroup(NcclGroup):
    """NcclGroup whose all-reduces go through the one-shot kernel over peer memory (cuda/ops/allreduce.py) where
    the message fits it (NCCL for larger ones and for the gathers): the rank completing a collective launches every
    rank's kernel, each on its device's current stream. oneshot False: NCCL for every message (gpu_group's choice
    where NCCL measured faster)."""

    def __init__(self, size: int) -> None:
        from ..cuda.ops.allreduce import OneShotAllReduce
        super().__init__(size)
        try:
            self._oneshot = OneShotAllReduce(self.devices())
        except BaseException:
            self.close()  # (NCCL's communicators, made above)
            raise
        self.oneshot = True

    def reduce(self, rank: int, x):
        import cupy
        with cupy.cuda.Device(rank):
            x = cupy.ascontiguousarray(x)
        if not self.oneshot or not _fits(self._oneshot, x):
            return super().reduce(rank, x)
        return self.exchange(rank, x, self._oneshot.all_reduce)[rank]


def time_all_reduce(group: TurnGroup, nbytes: int, reps: int = 50) -> float:
    """Seconds per all-reduce of an fp16 message of nbytes on every rank of group (one untimed call first: NCCL's
    and the kernels' first-use costs), the host's turns included as a step pays them."""
    import time
    import cupy
    xs = []
    for r in range(group.size):
        with group.enter(r):
            xs.append(cupy.ones((max(8, nbytes // 2),), cupy.float16))

    def calls(n: int) -> None:
        group.run(lambda r: [group.reduce(r, xs[r]) for _ in range(n)])
        for r in range(group.size):
            with group.enter(r):
                cupy.cuda.Device().synchronize()

    calls(1)
    t0 = time.perf_counter()
    calls(reps)
    return (time.perf_counter() - t0) / reps


def gpu_group(tp: int, nbytes: int, timer: Callable[[TurnGroup, int], float] = time_all_reduce) -> NcclGroup:
    """The group `--tp N` runs on GPUs: NCCL, or the one-shot all-reduce over peer memory where every pair of the
    GPUs has peer access and it all-reduced the decode step's message (nbytes: one hidden row) faster than NCCL
    here, timed at startup (a few milliseconds); the choice and both times go to the log. timer: (group, nbytes) ->
    seconds per call."""
    import cupy
    from ..generate import log
    rt = cupy.cuda.runtime
    if not all(rt.deviceCanAccessPeer(d, p) for d in range(tp) for p in range(tp) if p != d):
        log(f"--tp {tp}: all-reduce through NCCL (no peer access between every pair of the {tp} GPUs)")
        return NcclGroup(tp)
    try:
        group = PeerGroup(tp)
    except Exception as e:  # noqa: BLE001 - the one-shot form cannot be set up here: NCCL alone
        log(f"--tp {tp}: all-reduce through NCCL (the one-shot form failed to start: {e})")
        return NcclGroup(tp)
    t_one = timer(group, nbytes)
    group.oneshot = False
    t_nccl = timer(group, nbytes)
    group.oneshot = t_one < t_nccl
    log(f"--tp {tp}: all-reduce of {nbytes} B: one-shot {t_one * 1e6:.1f} us, NCCL {t_nccl * 1e6:.1f} us per call: "
        f"{'one-shot' if group.oneshot else 'NCCL'}")
    return group
