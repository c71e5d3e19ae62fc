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
        return self.group.exchange(self.rank, x, _sum).copy()

    def all_gather(self, x, axis: int = -1):
        return self.group.exchange(self.rank, x, lambda parts: _xp(x).concatenate(parts, axis=axis)).copy()

    def argmax(self, local, offset: int) -> int:
        i = int(_xp(local).argmax(local))
        return self.group.exchange(self.rank, (float(local[i]), offset + i), _best)

    def barrier(self) -> None:
        self.group.exchange(self.rank, None, lambda parts: None)


class DeviceLocalGroup(TurnGroup):
    """N ranks in one process, all on one GPU (the current one, or device), each with its own CupyOps over its
    shards, summing with CuPy: the sharding of the CUDA backend testable on a single GPU."""

    def __init__(self, size: int, device: int | None = None) -> None:
        import cupy
        super().__init__(size)
        self.device = cupy.cuda.Device(device).id if device is not None else cupy.cuda.Device().id

    def devices(self) -> list[int]:
        return [self.device] * self.size

    def enter(self, rank: int):
        import cupy
        return cupy.cuda.Device(self.device)


class NcclGroup:
    """One process driving N GPUs: rank r's CupyOps on device r with NCCL's in-process communicators
    (ncclCommInitAll); the ranks run at once, a thread each (NCCL needs every rank's call in flight together)."""

    def __init__(self, size: int) -> None:
        from .nccl import NcclCommunicator
        self.size = size
        self._comms = NcclCommunicator.in_process(list(range(size)))

    def devices(self) -> list[int]:
        return list(range(self.size))

    def comm(self, rank: int):
        return self._comms[rank]

    def enter(self, rank: int):
        import cupy
        return cupy.cuda.Device(rank)

    def run(self, fn: Callable[[int], Any]) -> list:
        from .comm import LocalGroup

        def on_device(r: int):
            with self.enter(r):
                return fn(r)
        # (LocalGroup's threads and error collection; its barrier is not used by these communicators)
        return LocalGroup(self.size).run(on_device)

    def close(self) -> None:
        for c in self._comms:
            c.close()
