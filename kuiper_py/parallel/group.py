"""A tensor-parallel group driven as one model: N ranks (model.Qwen3 over their shards, each with a backend that
holds a Communicator) run every call in lock step, and the group answers what rank 0 answers (every rank computes
the same logits). The CPU's ranks are threads of one process (comm.LocalGroup); the GPU's are one process driving
N GPUs over NCCL (device.NcclGroup), or, for tests on one GPU, N ranks taking turns on it (device.DeviceLocalGroup)."""
from __future__ import annotations

import contextlib

from ..errors import KuiperError
from ..model import Qwen3
from .comm import LocalGroup
from .shard import check_tp, shard


def visible_gpus() -> int:
    """CUDA devices this process sees (0 without CuPy or a driver)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: none visible
        return 0


def check_request(model_file, tp: int, device: str) -> None:
    """Refuse, with one line, a --tp this model or device cannot run."""
    check_tp(model_file.args, model_file.weights, tp)
    if device == "cuda" and tp > 1:
        n = visible_gpus()
        if n < tp:
            raise KuiperError(f"--tp {tp} needs {tp} GPUs; {n} visible")
        from . import nccl
        if not nccl.available():
            raise KuiperError(f"--tp {tp} on the GPU needs CuPy with NCCL (cupy.cuda.nccl does not import)")


class ParallelModel:
    """model.Qwen3's interface over a group of tp ranks (tp > 1) in one process."""

    can_queue_ahead = False  # the CPU's draws are on the host

    def __init__(self, model_file, ops_cls, tp: int, max_context: int, group=None):
        """group: the ranks' group (comm.LocalGroup, device.DeviceLocalGroup, device.NcclGroup); None: the CPU's
        threads, or NCCL over tp GPUs for the CUDA backend (check_request has seen them)."""
        if group is None:
            if getattr(ops_cls, "name", "") == "cuda":
                from .device import gpu_group
                group = gpu_group(tp, 2 * model_file.args.hidden_size)
            else:
                group = LocalGroup(tp)
        self.group = group
        self.ranks = []
        for r in range(tp):
            f = shard(model_file, r, tp)
            with self._on_rank(r):  # (a GPU rank's weights and buffers on its device)
                self.ranks.append(Qwen3(f, ops_cls, max_context, comm=group.comm(r), expert_range=f.plan.experts))
        self.args = model_file.args

    def _on_rank(self, r: int):
        enter = getattr(self.group, "enter", None)
        return enter(r) if enter is not None else contextlib.nullcontext()

    def _all(self, name: str, *args):
        """Rank r's model.<name>(*args) on every rank at once; rank 0's answer."""
        return self.group.run(lambda r: getattr(self.ranks[r], name)(*args))[0]

    @property
    def ops(self):
        """Rank 0's backend: its draws and host copies serve the group (its logits are the whole vocabulary's)."""
        return self.ranks[0].ops

    @property
    def pos(self) -> int:
        return self.ranks[0].pos

    @property
    def max_context(self) -> int:
        return self.ranks[0].max_context

    def set_context(self, max_context: int) -> None:
        self._all("set_context", max_context)

    def reset(self) -> None:
        self._all("reset")

    def prefill(self, ids, all_logits: bool = False):
        return self._all("prefill", ids, all_logits)

    def decode(self, token: int):
        return self._all("decode", token)

    def decode_sampled(self):
        return self._all("decode_sampled")

    def discard(self) -> None:
        self._all("discard")

    def rewind(self, pos: int) -> None:
        self._all("rewind", pos)

    def warm_prefill_graphs(self) -> list[int]:
        return self._all("warm_prefill_graphs") if self.ops.graphs else []

    def warm_decode_graphs(self, n_valid: int, keys=None) -> list[int]:
        return self._all("warm_decode_graphs", n_valid, keys) if self.ops.graphs else []
