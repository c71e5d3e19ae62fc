"""The collectives a tensor-parallel rank calls, behind one interface (Communicator), and the rendezvous that
starts a group (Rendezvous: how rank 0's NCCL unique id reaches the other ranks).

LocalGroup runs N ranks in one process as lock-step threads that sum with NumPy: the CPU engine's `--tp N` and the
tests' reference for the sharding. nccl.NcclCommunicator is the same interface over NCCL on GPUs."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

TP_SIZES = (1, 2, 4, 8)


@runtime_checkable
class Communicator(Protocol):
    """One rank's view of its group. Every rank calls each collective in the same order (a rank that skips one
    deadlocks the group); x is the backend's array (NumPy here, CuPy for NCCL)."""
    rank: int
    size: int

    def all_reduce_sum(self, x) -> Any:
        """The element-wise sum of every rank's x (same shape and dtype on each); every rank gets the same sum."""

    def all_gather(self, x, axis: int = -1) -> Any:
        """Every rank's x concatenated along axis in rank order (the vocabulary-parallel lm_head's logits)."""

    def argmax(self, local, offset: int) -> int:
        """The id of the largest value over all ranks' slices, local holding ids offset..offset+len-1; ties go to
        the lower id (as np.argmax over the whole). A greedy draw without gathering the logits."""

    def barrier(self) -> None:
        """Return once every rank has called it."""


class Rendezvous(Protocol):
    """How the ranks of a group agree on rank 0's bytes (NCCL's unique id). One process's ranks share memory
    (LocalRendezvous); a multi-node launch supplies one over its own channel (a file on a shared disk, a TCP
    store, MPI's broadcast)."""

    def share(self, rank: int, make: Callable[[], bytes]) -> bytes:
        """Rank 0 calls make() and publishes its bytes; every rank returns them."""


class LocalRendezvous:
    """Rendezvous for ranks that are threads of one process."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._value = b""

    def share(self, rank: int, make: Callable[[], bytes]) -> bytes:
        if rank == 0:
            self._value = make()
            self._ready.set()
        self._ready.wait()
        return self._value


class FileRendezvous:
    """Rendezvous through a file every rank can read (a shared disk between nodes): rank 0 writes it atomically,
    the others wait for it up to timeout seconds. The launcher picks a fresh path per group."""

    def __init__(self, path: str | Path, timeout: float = 300.0) -> None:
        self.path, self.timeout = Path(path), timeout

    def share(self, rank: int, make: Callable[[], bytes]) -> bytes:
        if rank == 0:
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            tmp.write_bytes(make())
            os.replace(tmp, self.path)  # readers never see a partial id
        deadline = time.monotonic() + self.timeout
        while not self.path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous: rank {rank} waited {self.timeout:.0f} s for {self.path}")
            time.sleep(0.05)
        return self.path.read_bytes()


class LocalGroup:
    """N ranks in one process, each a thread (run): every collective waits for all ranks at a barrier and each rank
    combines the contributions in rank order, so every rank gets bit-identical results. An error in one rank breaks
    the barrier, so the others stop instead of waiting forever."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list[Any] = [None] * size

    def comm(self, rank: int) -> "LocalComm":
        return LocalComm(self, rank)

    def exchange(self, rank: int, x) -> list:
        """Every rank's x, in rank order (a collective: all ranks call it)."""
        self._slots[rank] = x
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()  # no rank overwrites its slot before every rank has read them all
        return got

    def run(self, fn: Callable[[int], Any]) -> list:
        """fn(rank) on every rank, each in its own thread; their results in rank order. The first error a rank
        raises is raised here (the others', a broken barrier, follow from it)."""
        self._barrier.reset()
        out: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def body(r: int) -> None:
            try:
                out[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                errors[r] = e
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}", daemon=True)
                   for r in range(1, self.size)]
        for t in threads:
            t.start()
        try:
            body(0)  # rank 0 on the caller's thread
            for t in threads:
                t.join()
        except BaseException:  # (Ctrl-C while joining: the other ranks stop at their next collective)
            self._barrier.abort()
            raise
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                     next((e for e in errors if e is not None), None))
        if first is not None:
            raise first
        return out


class LocalComm:
    """Communicator of one LocalGroup rank."""

    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce_sum(self, x: np.ndarray) -> np.ndarray:
        parts = self.group.exchange(self.rank, x)
        out = np.array(parts[0], copy=True)
        for p in parts[1:]:
            out += p
        return out

    def all_gather(self, x: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.concatenate(self.group.exchange(self.rank, x), axis=axis)

    def argmax(self, local: np.ndarray, offset: int) -> int:
        i = int(np.argmax(local))
        best = self.group.exchange(self.rank, (float(local[i]), offset + i))
        return min(best, key=lambda vi: (-vi[0], vi[1]))[1]

    def barrier(self) -> None:
        self.group.exchange(self.rank, None)
