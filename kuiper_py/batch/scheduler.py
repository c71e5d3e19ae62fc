"""Continuous batching: which sequences a step runs, and how many of each one's tokens.

Requests join (waiting) and leave (finished, cancelled) between steps. A step holds, within a budget of tokens:
first the next token of every running sequence that is decoding, then a chunk of each running sequence still
prefilling its prompt, then the first chunk of waiting requests admitted in arrival order while the pool has
blocks for them. So a long prompt enters the batch a chunk at a time and no decoding stream stalls behind it. When
a running sequence needs a block the pool has not got, the newest running sequence is preempted: its blocks are
released and it waits again at the front of the queue with its prompt and the tokens it has drawn, to be computed
again (the prefix cache often still holds its blocks)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..sampling import SamplingParams
from .blocks import KVCacheManager


@dataclass(eq=False)
class Request:
    """One sequence: its prompt, the tokens drawn so far, how many of its positions the cache holds."""
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # prompt + drawn tokens
    computed: int = 0  # positions of `tokens` whose keys and values are in the cache
    cached_tokens: int = 0  # prompt positions found in the prefix cache on first admission
    preemptions: int = 0
    admitted: bool = False
    rng: np.random.Generator | None = None  # the request's own draws (its seed), as if it ran alone

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def drawn(self) -> list[int]:
        return self.tokens[len(self.prompt):]


class Scheduler:
    def __init__(self, kv: KVCacheManager, chunk_size: int, max_seqs: int, step_tokens: int):
        if chunk_size < 1 or max_seqs < 1 or step_tokens < 1:
            raise ValueError(f"chunk size {chunk_size}, max sequences {max_seqs}, step tokens {step_tokens}")
        self.kv, self.chunk_size, self.max_seqs, self.step_tokens = kv, chunk_size, max_seqs, step_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first

    def add(self, r: Request) -> None:
        self.waiting.append(r)

    def remove(self, r: Request) -> None:
        """A finished or cancelled request leaves; its blocks go back to the pool."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self.kv.free(r)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> list[tuple[Request, int]]:
        """The next step: (request, new tokens) pairs, each sequence's tokens tokens[computed:computed + n]."""
        out: dict[Request, int] = {}
        budget = self.step_tokens
        decoding = [r for r in self.running if len(r.tokens) - r.computed == 1]
        prefilling = [r for r in self.running if len(r.tokens) - r.computed > 1]
        for r in decoding + prefilling:
            n = min(len(r.tokens) - r.computed, self.chunk_size, budget)
            if r not in self.running or n == 0:  # (preempted by an earlier one, or no budget left)
                continue
            while not self.kv.grow(r, r.computed + n):
                victim = self.running[-1]
                budget += out.pop(victim, 0)
                self._preempt(victim)
                if victim is r:
                    break
            else:
                out[r] = n
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            r = self.waiting[0]
            start = self.kv.admit(r, r.tokens, min(self.chunk_size, budget))
            if start is None:  # (the pool has no room now: it waits for blocks to come back)
                break
            self.waiting.popleft()
            if not r.admitted:
                r.cached_tokens, r.admitted = start, True
            r.computed = start
            self.running.append(r)
            out[r] = min(len(r.tokens) - start, self.chunk_size, budget)
            budget -= out[r]
        return list(out.items())

    def advance(self, r: Request, n: int) -> None:
        """n more of r's positions computed: the blocks they filled join the prefix cache."""
        r.computed += n
        self.kv.commit(r, r.tokens, r.computed)

    def _preempt(self, r: Request) -> None:
        """Release r's blocks and requeue it first; it is computed again from its prompt and drawn tokens."""
        self.running.remove(r)
        self.kv.free(r)
        r.computed = 0
        r.preemptions += 1
        self.waiting.appendleft(r)
