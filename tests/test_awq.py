"""AWQ unpacking against an independent nibble-by-nibble reference."""
import numpy as np

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
