"""AWQ unpacking against an independent nibble-by-nibble reference."""
import numpy as np
import pytest

from kuiper_py import awq
from reference import dequant_reference, unpack_loop


def test_unpack_matches_independent_reference():
    rng = np.random.default_rng()
    packed = rng.integers(-2**31, 2**31, size=(37, 24), dtype=np.int64).astype(np.int32)
    np.testing.assert_array_equal(awq.unpack(packed), unpack_loop(packed))


def test_pack_is_inverse_of_unpack():
    rng = np.random.default_rng()
    v = rng.integers(0, 16, size=(19, 64), dtype=np.uint8)
    np.testing.assert_array_equal(awq.unpack(awq.pack(v)), v)
    np.testing.assert_array_equal(unpack_loop(awq.pack(v)), v)


def test_known_word():
    # column c lives in nibble {0,4,1,5,2,6,3,7}[c]: value c+1 in column c gives these nibbles
    word = awq.pack(np.arange(1, 9, dtype=np.uint8)[None, :])[0, 0].view(np.uint32)
    nibbles = [(int(word) >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [1, 3, 5, 7, 2, 4, 6, 8]


def test_dequantize_matches_reference_and_row_blocks():
    rng = np.random.default_rng()
    K, N, g = 512, 64, 128
    qw = awq.pack(rng.integers(0, 16, size=(K, N), dtype=np.uint8))
    qz = awq.pack(rng.integers(0, 16, size=(K // g, N), dtype=np.uint8))
    s = rng.random((K // g, N), dtype=np.float32).astype(np.float16)
    W = awq.dequantize(qw, qz, s, g)
    np.testing.assert_allclose(W, dequant_reference(qw, qz, s, g), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(awq.dequantize(qw, qz, s, g, rows=slice(256, 384)), W[256:384])


def test_unpack_stored_is_unpack_in_stored_column_order():
    """unpack_stored (byte masks, the CPU engine's linear) against the nibble-by-nibble reference: the same values,
    position 8w + j holding logical column 8w + STORED_COLUMNS[j], and LOGICAL_FROM_STORED undoing it."""
    rng = np.random.default_rng()
    packed = rng.integers(-2**31, 2**31, size=(29, 12), dtype=np.int64).astype(np.int32)
    ref = unpack_loop(packed).astype(np.float32)
    got = awq.unpack_stored(packed)
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_array_equal(got, ref.reshape(29, 12, 8)[:, :, awq.STORED_COLUMNS].reshape(29, 96))
    np.testing.assert_array_equal(got.reshape(29, 12, 8)[:, :, awq.LOGICAL_FROM_STORED].reshape(29, 96), ref)


@pytest.mark.parametrize("K, N, T, block_bytes", [(512, 64, 1, 8 << 20), (1024, 256, 5, 3 * 128 * 256 * 4),
                                                   (384, 128, 2, 1)])
def test_awq_linear_matches_the_dequantized_product(K, N, T, block_bytes, monkeypatch):
    """ops_numpy.awq_linear (per group on the packed form's factors, in blocks of rows: one block, blocks of 3 groups
    over 8, one group each) against x @ W in float64 with W from the nibble-by-nibble reference dequantization."""
    from kuiper_py import ops_numpy
    from kuiper_py.loader import AwqLinear
    monkeypatch.setattr(ops_numpy, "BLOCK_BYTES", block_bytes)
    rng = np.random.default_rng()
    g = 128
    qw = rng.integers(-2**31, 2**31, size=(K, N // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2**31, 2**31, size=(K // g, N // 8), dtype=np.int64).astype(np.int32)
    s = (rng.random((K // g, N), dtype=np.float32) / 16).astype(np.float16)
    x = rng.standard_normal((T, K)).astype(np.float32)
    want = x.astype(np.float64) @ dequant_reference(qw, qz, s, g).astype(np.float64)
    got = ops_numpy.awq_linear(x, AwqLinear(qw, qz, s, g))
    assert got.dtype == np.float32 and got.shape == (T, N)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
