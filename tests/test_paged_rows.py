"""The lookups a paged GPU step hands its kernels (cuda/ops/paged.py paged_rows), checked without a GPU: each token
row's sequence and position, and the block tables padded to one width, addressing the same pool rows as the CPU
backend's paged cache does."""
import numpy as np
import pytest

from kuiper_py.backend import Seq
from kuiper_py.cuda.ops.paged import paged_rows


def test_each_row_carries_its_sequence_and_own_position():
    seqs = (Seq((5,), 40, 0, (3, 9, 1)), Seq((1, 2, 3), 0, 0, (7,)), Seq((8, 9), 6, 0, (2, 4)))
    tables, tok_seq, tok_pos = paged_rows(seqs, 16)
    assert tables.dtype == tok_seq.dtype == tok_pos.dtype == np.int32
    np.testing.assert_array_equal(tables, [[3, 9, 1], [7, 0, 0], [2, 4, 0]])
    np.testing.assert_array_equal(tok_seq, [0, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(tok_pos, [40, 0, 1, 2, 6, 7])


def test_the_kernels_addressing_reaches_the_rows_the_cpu_cache_uses():
    """paged.cu's row of position p, tables[seq][p // bs] * bs + p % bs, against the CPU backend's
    block_table[p // bs], offset p % bs, for random tables and positions."""
    rng = np.random.default_rng()
    bs, n_blocks = 4, 50
    perm = rng.permutation(n_blocks).tolist()
    seqs, start = [], 0
    for n, p0 in ((1, 13), (9, 0), (3, 5)):
        need = -(-(p0 + n) // bs)
        seqs.append(Seq(tuple(range(n)), p0, 0, tuple(perm[start:start + need])))
        start += need
    tables, tok_seq, tok_pos = paged_rows(seqs, bs)
    pool = np.arange(n_blocks * bs).reshape(n_blocks, bs)  # each pool row's flat index
    for s, p in zip(tok_seq, tok_pos):
        seq = seqs[s]
        assert tables[s, p // bs] * bs + p % bs == pool[seq.block_table[p // bs], p % bs]


def test_positions_past_a_sequences_blocks_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        paged_rows((Seq((1, 2), 3, 0, (0,)),), 4)
