"""The one-shot all-reduce's host side without a GPU: the buffer layout the kernel writes (slots, halves, flags,
which block owns which vector), the argument checks, and the rank-order reference sum the GPU must match bit for
bit (kuiper_py/cuda/ops/allreduce.py; the kernel itself: tests/test_cuda_allreduce.py)."""
import itertools

import numpy as np
import pytest

from kuiper_py.cuda.ops import allreduce as ar
from kuiper_py.errors import KuiperError


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("cap_bytes", [16, 4096, 65536])
def test_slots_tile_the_buffer_without_overlap(n_ranks, cap_bytes):
    """Every (parity, slot) region lies inside the buffer, regions never overlap, and together they fill it."""
    cap_vec = ar.check_capacity(cap_bytes)
    size = ar.buffer_bytes(n_ranks, cap_vec)
    regions = sorted((ar.slot_offset(e, s, n_ranks, cap_vec), e % 2, s) for e in (1, 2) for s in range(n_ranks))
    starts = [r[0] for r in regions]
    assert starts == list(range(0, size, cap_vec * ar.VEC_BYTES))  # contiguous, disjoint, covering
    assert starts[-1] + cap_vec * ar.VEC_BYTES == size
    for s in range(n_ranks):  # an epoch and the epoch two later reuse a region; consecutive epochs never do
        for e in range(1, 6):
            assert ar.slot_offset(e, s, n_ranks, cap_vec) == ar.slot_offset(e + 2, s, n_ranks, cap_vec)
            assert ar.slot_offset(e, s, n_ranks, cap_vec) != ar.slot_offset(e + 1, s, n_ranks, cap_vec)


@pytest.mark.parametrize("blocks,n_ranks", [(1, 2), (8, 4), (16, 8)])
def test_flags_one_per_block_and_rank(blocks, n_ranks):
    idx = [ar.flag_index(b, r, n_ranks) for b, r in itertools.product(range(blocks), range(n_ranks))]
    assert sorted(idx) == list(range(blocks * n_ranks))


@pytest.mark.parametrize("blocks", [1, 3, 8])
def test_a_vector_has_one_owner_at_every_size(blocks):
    """The grid-stride loop: vector i is moved by the same block whatever the message's length (the parity argument
    of allreduce.cu holds per vector), and blocks share the vectors evenly."""
    for n_vec in (1, 7, ar.THREADS + 3, 3 * blocks * ar.THREADS + 5):
        owner = {}
        for b in range(blocks):  # the kernel's loop, thread by thread
            for t in range(ar.THREADS):
                for i in range(b * ar.THREADS + t, n_vec, blocks * ar.THREADS):
                    assert i not in owner
                    owner[i] = b
        assert sorted(owner) == list(range(n_vec))
        assert all(ar.vector_owner(i, blocks) == b for i, b in owner.items())


def test_capacity_rounds_to_vectors_and_has_limits():
    assert ar.check_capacity(16) == 1
    assert ar.check_capacity(17) == 2
    assert ar.check_capacity(64 << 10) == 4096
    for bad in (0, -16, ar.MAX_BYTES_LIMIT + 1):
        with pytest.raises(KuiperError):
            ar.check_capacity(bad)


def test_message_checks():
    cap = ar.check_capacity(16 << 10)
    assert ar.check_message(8 << 10, np.float16, cap) == 512
    assert ar.check_message(16 << 10, np.float32, cap, (0, 4096)) == 1024
    with pytest.raises(ValueError, match="multiple of 16"):
        ar.check_message(8 * 2 + 2, np.float16, cap)  # 9 halves
    with pytest.raises(ValueError, match="multiple of 16"):
        ar.check_message(0, np.float16, cap)
    with pytest.raises(ValueError, match="capacity"):
        ar.check_message((16 << 10) + 16, np.float16, cap)
    with pytest.raises(ValueError, match="aligned"):
        ar.check_message(32, np.float16, cap, (0, 8))
    for dtype in (np.float64, np.int32, np.int8):
        with pytest.raises(TypeError):
            ar.check_message(32, dtype, cap)


def test_rank_limits():
    for n in range(1, ar.MAX_RANKS + 1):
        ar.check_ranks(n)
    for n in (0, ar.MAX_RANKS + 1, 16):
        with pytest.raises(KuiperError, match="ranks"):
            ar.check_ranks(n)
    ar.check_ranks(2, [0, 1])
    with pytest.raises(KuiperError, match="one device per rank"):
        ar.check_ranks(2, [1, 1])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_reference_sum_is_rank_order_float32_rounded_once(dtype):
    rng = np.random.default_rng()
    xs = [rng.standard_normal(4096).astype(dtype) * 100 for _ in range(5)]
    got = ar.reference_sum(xs)
    assert got.dtype == dtype
    want = np.zeros(4096, np.float64)  # float64 sum: the float32 one is within a few rounding steps of it
    for x in xs:
        want += x.astype(np.float64)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-2 if dtype == np.float16 else 1e-5, atol=1e-2)
    # rank order matters in float32: a rotated order gives other bits somewhere (inputs spanning magnitudes)
    xs = [rng.standard_normal(4096).astype(np.float32) * s for s in (1e8, 1.0, -1e8, 1e-3)]
    assert not np.array_equal(ar.reference_sum(xs), ar.reference_sum(xs[1:] + xs[:1]))


@pytest.mark.skipif(ar.cp is not None, reason="CuPy is installed")
def test_without_cupy_the_group_says_so():
    with pytest.raises(KuiperError, match="needs CuPy"):
        ar.OneShotAllReduce([0, 1])
