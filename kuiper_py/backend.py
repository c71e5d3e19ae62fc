"""The interface between the Qwen3 forward (model.py) and a backend that runs it (ops_numpy.NumpyOps on the CPU,
cuda.backend.CupyOps on a GPU): what one step carries, and the methods the forward and the generation loop call.

A step carries B >= 1 sequences, each with its own new tokens, its position (tokens already cached) and its KV-cache
slot, so a server that batches requests, or a verify step of speculative decoding per sequence, is one Step of
several Seqs. A backend whose max_batch is 1 takes `step.one()`, which refuses B > 1; one that runs
more (NumPy, CUDA) is a PagedBackend: each Seq then carries its block table into a pool of KV blocks
(kuiper_py.batch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from .loader import Layer, Weights
from .sampling import RowDraw, SamplingParams

SAMPLED_TOKEN = -1  # a token id meaning "the id the backend's last draw produced" (read on the device)


@dataclass(frozen=True)
class Seq:
    """One sequence's part of a step: its new token ids, the positions already in its cache, its cache slot; on a
    paged cache, its block table (position p lives at offset p % block_size of block block_table[p // block_size])."""
    ids: tuple[int, ...]
    pos0: int
    slot: int = 0
    block_table: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Step:
    """What one forward runs: B >= 1 sequences (prefill or decode), each at its own position and slot."""
    seqs: tuple[Seq, ...]

    @classmethod
    def single(cls, ids, pos0: int, slot: int = 0) -> Step:
        """A step of one sequence."""
        return cls((Seq(tuple(ids), pos0, slot),))

    @property
    def batch(self) -> int:
        return len(self.seqs)

    @property
    def n_tokens(self) -> int:
        return sum(len(s.ids) for s in self.seqs)

    def one(self) -> Seq:
        """The step's only sequence: for kernels that run one sequence (in slot 0) a step."""
        if len(self.seqs) != 1 or self.seqs[0].slot != 0:
            raise NotImplementedError(f"a step of {len(self.seqs)} sequences (slots "
                                      f"{[s.slot for s in self.seqs]}): this backend runs one sequence a step")
        return self.seqs[0]


@runtime_checkable
class Collectives(Protocol):
    """What a backend does to run as one rank of a tensor-parallel group (parallel/, docs/PARALLEL.md); every Backend
    has it, a backend outside a group (no communicator) being a group of one.

    Such a backend is built on its rank's shards (parallel.shard.RankFile: its heads, MLP columns, experts and
    vocabulary rows) and a parallel.comm.Communicator. The forward calls all_reduce on the output of the o projection
    and of the MLP or MoE block (row-parallel: each rank holds a partial sum); logits() returns the whole vocabulary's
    row on every rank (the lm_head is vocabulary-parallel, the backend gathers or reduces it), so draws and callers
    see what one rank would."""

    def all_reduce(self, x) -> Any:
        """The element-wise sum of x over the group's ranks; x itself (no copy, no arithmetic) in a group of one."""


@runtime_checkable
class Backend(Collectives, Protocol):
    """The methods model.Qwen3 and generate.py call; a backend declares what it can do through its attributes rather
    than by which methods it has."""
    name: str  # "cpu", "cuda"
    args: Any  # config.ModelArgs
    weights: Weights
    graphs: bool  # steps run as captured graphs (decode_step, prefill_graph, the warm_* methods do something)
    queues_draws: bool  # draws on the device, so a step can be queued before the host reads the last token
    max_batch: int  # the most sequences a Step may carry
    SAMPLED_TOKEN: int

    # the cache and a step's frame
    def alloc_cache(self, max_context: int) -> None: ...
    def begin_step(self, step: Step) -> None: ...
    def begin_layer(self) -> None: ...
    def end_step(self) -> None: ...
    def forget_position(self) -> None: ...
    def synchronize(self) -> None: ...
    # on a GPU {"gpu_name", "gpu_mib" (memory this process holds), "kernel_build_s" (waited for builds)}; {} on a CPU
    def device_stats(self) -> dict[str, Any]: ...

    # the forward's blocks (h, x, r are the backend's values: r, a block's output, is added to the residual stream h by
    # the next add_rmsnorm, which also gives the next block's input x = rmsnorm(h) * w; a backend may hold either
    # back to fuse it into the launches of its producer or consumer, as its plan says)
    def embed(self, step: Step) -> Any: ...
    def add_rmsnorm(self, h, r, w) -> tuple[Any, Any]: ...
    # q, k, v; their RMSNorms and RoPE; the new keys and values into layer i's cache; causal GQA over the cache; o
    def attention(self, x, layer: Layer, i: int, step: Step) -> Any: ...
    def mlp(self, x, layer: Layer) -> Any: ...  # down(silu(gate(x)) * up(x))
    def moe(self, x, layer: Layer) -> Any: ...  # Qwen3-MoE: the router's top-k experts' MLPs, weighted
    def logits(self, x, all_positions: bool = False) -> Any: ...

    # graphs (no-ops where `graphs` is False)
    def decode_step(self, body: Callable[[], Any], step: Step) -> Any: ...
    def prefill_graph(self, step: Step, layers: Callable[[list[int]], Any]) -> Any | None: ...
    def warm_prefill_graphs(self, layers: Callable[[list[int]], Any]) -> list[int]: ...
    def warm_decode_graphs(self, body_at: Callable[[int], Any], n_valid: int,
                           keys: tuple[int, int] | None = None) -> list[int]: ...

    # draws
    def sample(self, logits, p: SamplingParams, rng: np.random.Generator, history: list[int], n_valid: int) -> int: ...
    def sample_launch(self, logits, p: SamplingParams, rng: np.random.Generator, history: list[int],
                      n_valid: int) -> None: ...
    def sample_result(self) -> int: ...
    def cancel_draw(self) -> None: ...
    def to_host(self, x) -> np.ndarray: ...
    def argmax_rows(self, logits, n_valid: int) -> np.ndarray: ...  # each row's argmax over ids < n_valid (host ints)
    def sample_rows(self, logits, draws: Sequence[RowDraw | None], n_valid: int) -> list[int | None]: ...
    # row i's draw (its own settings and seed) where draws[i] is given; its logits may be overwritten


@runtime_checkable
class PagedBackend(Backend, Protocol):
    """A backend that runs Steps of several sequences (max_batch > 1) over a pool of KV blocks; its logits() gives
    each sequence's last-token row [B, V] for such a step."""

    def kv_pool_blocks(self, block_size: int, utilization: float) -> int: ...
    def alloc_blocks(self, n_blocks: int, block_size: int, max_context: int) -> None: ...
