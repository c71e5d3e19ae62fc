"""The decode GEMV's split-K rule (ops_cupy.gemv_split / o_split) on a mocked SM count: no GPU needed."""
import math

import pytest

import kuiper_py.ops_cupy as oc


@pytest.fixture
def sms(monkeypatch):
    def set_count(n):
        monkeypatch.setattr(oc, "sm_count", lambda: n)
    return set_count


@pytest.mark.parametrize("n_sm", [132, 114, 78])
@pytest.mark.parametrize("K,N", [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (8192, 5120), (2048, 5120)])
def test_gemv_split_covers_k_in_whole_steps(sms, n_sm, K, N):
    sms(n_sm)
    tiles = math.ceil(N / oc.GEMV_COLS)
    S, rps = oc.gemv_split(K, tiles)
    assert rps % oc.GEMV_STEP == 0 and S * rps >= K > (S - 1) * rps
    # fewer blocks per SM never means more splits (gemv_partial_size sizes the buffer at the default)
    for per_sm in (1.0, 2.0, 3.0, oc.GEMV_BLOCKS_PER_SM):
        assert oc.gemv_split(K, tiles, per_sm)[0] <= S


def test_o_split_coarse_only_up_to_its_attention_split_bound(sms):
    sms(132)
    # Qwen3-8B's o projection (K = 32 heads x 128, N = 4096: 16 column tiles), PERFORMANCE.md change 83
    coarse, fine = oc.o_split(4096, 16, 33), oc.o_split(4096, 16, 65)
    assert fine == oc.gemv_split(4096, 16)
    if oc.GEMV_O_BLOCKS_PER_SM == 3 and oc.GEMV_BLOCKS_PER_SM == 4:
        assert coarse == (16, 256) and fine == (32, 128)
    assert oc.o_split(4096, 16, oc.GEMV_O_COARSE_SPLITS) == coarse
    assert oc.o_split(4096, 16, oc.GEMV_O_COARSE_SPLITS + 1) == fine
    # with no split count, the coarsest split o may take: the checks that o's rows fit use it
    for K, tiles in ((4096, 16), (8192, 20), (4096, 8 + 3), (2048, 4)):
        rows = oc.o_split(K, tiles)[1]
        assert rows >= oc.o_split(K, tiles, 1)[1] and rows >= oc.o_split(K, tiles, 1000)[1]
