"""A paged KV cache's bookkeeping: one pool of fixed-size blocks, a block table per sequence, and prefix caching.

The pool only hands out block ids; the backend holds the storage ([n_blocks, block_size, KV, head_dim] per layer)
and reads each sequence's keys through its block table. A block that a sequence has filled with block_size
positions is registered under a chained hash (its parent block's hash and its own token ids), so another sequence
whose prompt starts with the same tokens takes the same blocks instead of computing them again. Blocks nobody
references keep their hash (cached) until allocation needs them back, oldest-released first (LRU)."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

ROOT_HASH = b""  # the parent hash of a sequence's first block


def block_hash(parent: bytes, tokens) -> bytes:
    """The chained hash of a full block: sha256 over the parent block's hash and the block's token ids, so equal
    hashes mean equal prefixes (not just equal blocks)."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def chain_hashes(tokens, block_size: int) -> list[bytes]:
    """The chained hashes of every full block of `tokens`."""
    out, parent = [], ROOT_HASH
    for b0 in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[b0:b0 + block_size])
        out.append(parent)
    return out


@dataclass
class PoolStats:
    queried_blocks: int = 0  # full prompt blocks looked up in the prefix cache
    hit_blocks: int = 0  # of those, found (their KV reused)
    evicted_blocks: int = 0  # cached blocks whose hash was dropped to allocate them again


class BlockPool:
    """n_blocks blocks, each in one of three states: free (no content), cached (a hashed full block nobody
    references, evictable, in LRU order) or used (reference count > 0)."""

    def __init__(self, n_blocks: int, block_size: int, prefix_caching: bool = True):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool of {n_blocks} blocks of {block_size} positions")
        self.n_blocks, self.block_size, self.prefix_caching = n_blocks, block_size, prefix_caching
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # (a stack: block 0 is handed out first)
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed blocks, least recently released 1st
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.stats = PoolStats()

    @property
    def n_free(self) -> int:
        """Blocks an allocation can take now: the free ones and the evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_free

    @property
    def n_cached(self) -> int:
        return len(self._cached)

    def allocate(self) -> int:
        """A block for new content (reference count 1): a free one, else the least recently released cached one."""
        if self._free:
            b = self._free.pop()
        elif self._cached:
            b, _ = self._cached.popitem(last=False)
            del self._by_hash[self._hash_of.pop(b)]
            self.stats.evicted_blocks += 1
        else:
            raise MemoryError("the KV block pool is exhausted")
        self.refs[b] = 1
        return b

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest run of the given chained hashes (a prefix), not yet referenced by the
        caller: take() each to keep it."""
        got = []
        for h in hashes if self.prefix_caching else []:
            b = self._by_hash.get(h)
            if b is None:
                break
            got.append(b)
        return got

    def take(self, b: int) -> None:
        """One more reference to a block found by lookup (a cached block stops being evictable)."""
        if self.refs[b] == 0:
            del self._cached[b]
        self.refs[b] += 1

    def register(self, b: int, h: bytes) -> None:
        """Make a full block findable under its chained hash. Where another block already holds that hash (two
        sequences computed the same prefix at once), the first stays the cached one and b is freed as unhashed."""
        if self.prefix_caching and b not in self._hash_of and h not in self._by_hash:
            self._by_hash[h] = b
            self._hash_of[b] = h

    def release(self, b: int) -> None:
        """Drop one reference; an unreferenced hashed block becomes cached (most recently released), else free."""
        assert self.refs[b] > 0, f"block {b} released more often than taken"
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if b in self._hash_of:
                self._cached[b] = None
            else:
                self._free.append(b)

    def check(self) -> None:
        """The invariants: every block in exactly one state (free + cached + used == total), hashes both ways."""
        used = sum(1 for r in self.refs if r > 0)
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and not free & cached, "a block listed twice"
        assert all(self.refs[b] == 0 for b in free | cached), "a referenced block listed as free or cached"
        assert len(free) + len(cached) + used == self.n_blocks, (len(free), len(cached), used, self.n_blocks)
        assert all(self._by_hash[h] == b for b, h in self._hash_of.items()) and len(self._by_hash) == len(self._hash_of)
        assert cached <= set(self._hash_of), "an unhashed block in the cached list"


class KVCacheManager:
    """The block tables of the sequences on one pool: a sequence's table grows as its positions are computed,
    starts with the cached blocks of its prompt's prefix, and is released whole when it ends or is preempted."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.tables: dict[object, list[int]] = {}
        self._hashes: dict[object, list[bytes]] = {}  # each sequence's registered full blocks' chained hashes

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def blocks_for(self, n_positions: int) -> int:
        return -(-n_positions // self.pool.block_size)

    def admit(self, seq, tokens: list[int], max_new: int) -> int | None:
        """Open seq's table with the cached blocks of tokens' longest cached prefix of full blocks (leaving at least
        the last token to compute: its logits are needed, and a shared block is never written) and room for up to
        max_new positions after them: the positions found cached, or None, with nothing taken, when the pool
        cannot supply the other blocks."""
        assert seq not in self.tables
        pool, bs = self.pool, self.pool.block_size
        hashes = chain_hashes(tokens[:len(tokens) - 1], bs) if pool.prefix_caching else []
        hits = pool.lookup(hashes)
        start = len(hits) * bs
        need = self.blocks_for(start + min(len(tokens) - start, max_new)) - len(hits)
        if need > pool.n_free - sum(1 for b in hits if pool.refs[b] == 0):
            return None
        pool.stats.queried_blocks += len(hashes)
        pool.stats.hit_blocks += len(hits)
        for b in hits:
            pool.take(b)
        self.tables[seq] = list(hits)
        self._hashes[seq] = hashes[:len(hits)]
        self.grow(seq, start + min(len(tokens) - start, max_new))
        return start

    def grow(self, seq, n_positions: int) -> bool:
        """Room in seq's table for n_positions; False, with nothing taken, when the pool has too few blocks."""
        table = self.tables[seq]
        need = self.blocks_for(n_positions) - len(table)
        if need > self.pool.n_free:
            return False
        table.extend(self.pool.allocate() for _ in range(max(need, 0)))
        return True

    def commit(self, seq, tokens: list[int], n_computed: int) -> None:
        """Register the blocks that the first n_computed positions (of `tokens`) have filled."""
        hashes, table, bs = self._hashes[seq], self.tables[seq], self.pool.block_size
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), n_computed // bs):
            parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(parent)
            self.pool.register(table[i], parent)

    def free(self, seq) -> None:
        """Release seq's blocks, its last block first: a prompt's early blocks, which other requests share most
        often, are evicted last."""
        for b in reversed(self.tables.pop(seq, [])):
            self.pool.release(b)
        self._hashes.pop(seq, None)
