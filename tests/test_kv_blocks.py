"""The paged KV cache's bookkeeping (kuiper_py.batch.blocks): the chained block hash, reference counts, LRU eviction
of cached blocks, per-sequence block tables, and the pool's invariant under a random stream of operations."""
import hashlib

import numpy as np
import pytest

from kuiper_py.batch.blocks import BlockPool, KVCacheManager, block_hash, chain_hashes


def _sha(parent: bytes, tokens) -> bytes:
    """The chained hash written out independently: sha256(parent hash || int64 little-endian token ids)."""
    return hashlib.sha256(parent + b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)).digest()


def test_the_hash_of_a_block_chains_its_parents():
    rng = np.random.default_rng()
    toks = rng.integers(0, 150_000, size=13).tolist()
    hs = chain_hashes(toks, 4)
    assert len(hs) == 3  # (13 tokens: three full blocks, the last token in none)
    want, parent = [], b""
    for b0 in (0, 4, 8):
        parent = _sha(parent, toks[b0:b0 + 4])
        want.append(parent)
    assert hs == want and block_hash(hs[0], toks[4:8]) == hs[1]
    # the same block after a different first block hashes differently: equal hashes mean equal prefixes
    other = [toks[0] + 1] + toks[1:]
    assert chain_hashes(other, 4)[1] != hs[1] and chain_hashes(toks[:8] + [7] * 4, 4)[:2] == hs[:2]


def test_reference_counts_keep_a_shared_block_until_its_last_holder_releases_it():
    pool = BlockPool(4, 2)
    b = pool.allocate()
    pool.register(b, b"h")
    assert pool.lookup([b"h"]) == [b]
    pool.take(b)  # a second sequence shares it
    assert pool.refs[b] == 2 and pool.n_used == 1
    pool.release(b)
    assert pool.n_used == 1 and pool.n_cached == 0
    pool.release(b)  # unreferenced, hashed: cached (still found), counted as free for allocation
    assert pool.n_used == 0 and pool.n_cached == 1 and pool.n_free == 4 and pool.lookup([b"h"]) == [b]
    pool.take(b)  # a hit on a cached block takes it back out of the evictable list
    assert pool.n_cached == 0 and pool.refs[b] == 1
    pool.check()
    pool.release(b)
    with pytest.raises(AssertionError):  # (released more often than taken)
        pool.release(b)


def test_cached_blocks_are_evicted_least_recently_released_first():
    pool = BlockPool(4, 1)
    blocks = [pool.allocate() for _ in range(4)]
    for i, b in enumerate(blocks):
        pool.register(b, bytes([i]))
    for b in (blocks[2], blocks[0], blocks[3], blocks[1]):  # released in this order
        pool.release(b)
    assert pool.n_free == 4 and pool.n_cached == 4
    got = [pool.allocate() for _ in range(3)]
    assert got == [blocks[2], blocks[0], blocks[3]] and pool.stats.evicted_blocks == 3
    assert pool.lookup([bytes([2])]) == [] and pool.lookup([bytes([1])]) == [blocks[1]]
    pool.check()
    # a free (never hashed) block goes before any cached one
    pool2 = BlockPool(2, 1)
    a, b = pool2.allocate(), pool2.allocate()
    pool2.register(a, b"a")
    pool2.release(a)
    pool2.release(b)
    assert pool2.allocate() == b and pool2.lookup([b"a"]) == [a]


def test_an_exhausted_pool_refuses_and_admission_takes_nothing():
    kv = KVCacheManager(BlockPool(3, 4))
    assert kv.admit("a", list(range(9)), 9) == 0 and len(kv.tables["a"]) == 3
    before = kv.pool.n_free
    assert kv.admit("b", list(range(100, 105)), 5) is None and "b" not in kv.tables and kv.pool.n_free == before
    assert not kv.grow("a", 13) and len(kv.tables["a"]) == 3
    with pytest.raises(MemoryError):
        kv.pool.allocate()
    kv.free("a")
    assert kv.pool.n_free == 3
    kv.pool.check()


def test_a_shared_prefix_is_found_by_the_next_sequence_leaving_its_last_token_to_compute():
    bs = 4
    kv = KVCacheManager(BlockPool(16, bs))
    rng = np.random.default_rng()
    prefix = rng.integers(0, 1000, size=3 * bs).tolist()
    a = prefix + [1, 2]
    assert kv.admit("a", a, len(a)) == 0
    kv.commit("a", a, len(a))  # three full blocks registered
    b = prefix + [3]
    assert kv.admit("b", b, 10) == 3 * bs
    assert kv.tables["b"][:3] == kv.tables["a"][:3] and kv.tables["b"][3] not in kv.tables["a"]
    assert kv.pool.stats.hit_blocks == 3 and all(kv.pool.refs[x] == 2 for x in kv.tables["a"][:3])
    # a prompt that is exactly the cached blocks recomputes its last block (its last token's logits are needed)
    assert kv.admit("c", prefix, 10) == 2 * bs
    kv.free("a")
    kv.free("b")
    kv.free("c")
    kv.pool.check()
    assert kv.pool.n_free == 16 and kv.pool.n_cached == 3
    # with prefix caching off, nothing is found
    off = KVCacheManager(BlockPool(16, bs, prefix_caching=False))
    off.admit("a", a, len(a))
    off.commit("a", a, len(a))
    assert off.admit("b", b, 10) == 0 and off.pool.n_cached == 0


def test_the_pool_invariant_holds_through_random_sequences_and_ends_with_every_block_back():
    rng = np.random.default_rng()
    bs, n = 4, 24
    kv = KVCacheManager(BlockPool(n, bs))
    prefixes = [rng.integers(0, 50, size=int(rng.integers(0, 12))).tolist() for _ in range(4)]
    live: dict[int, tuple[list[int], int]] = {}
    for i in range(600):
        if live and rng.random() < 0.35:
            sid = list(live)[int(rng.integers(len(live)))]
            kv.free(sid)
            del live[sid]
        elif live and rng.random() < 0.5:  # a running sequence computes a few more positions
            sid = list(live)[int(rng.integers(len(live)))]
            toks, done = live[sid]
            more = done + int(rng.integers(1, 6))
            toks = toks + rng.integers(0, 50, size=max(0, more - len(toks))).tolist()
            if kv.grow(sid, more):
                kv.commit(sid, toks, more)
                live[sid] = (toks, more)
        else:
            toks = prefixes[int(rng.integers(4))] + rng.integers(0, 50, size=int(rng.integers(1, 10))).tolist()
            start = kv.admit(i, toks, len(toks))
            if start is not None:
                assert start % bs == 0 and start < len(toks)
                kv.commit(i, toks, len(toks))
                live[i] = (toks, len(toks))
        kv.pool.check()
        used = {b for t in kv.tables.values() for b in t}
        assert kv.pool.n_used == len(used) and all(kv.pool.refs[b] == sum(t.count(b) for t in kv.tables.values())
                                                     for b in used)
    for sid in list(live):
        kv.free(sid)
    kv.pool.check()
    assert kv.pool.n_free == n and kv.pool.n_used == 0 and kv.pool.stats.hit_blocks > 0
