"""AutoAWQ "GEMM" packing: eight 4-bit values per int32 along the output dimension.

Nibble i (bits 4i..4i+3) of a packed word holds column AWQ_ORDER[i] of its group of eight,
so column c sits in nibble AWQ_REVERSE_ORDER[c] = {0,4,1,5,2,6,3,7}[c].
"""
from __future__ import annotations

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = np.array([4 * AWQ_REVERSE_ORDER[c] for c in range(8)], dtype=np.uint32)


def unpack(packed: np.ndarray) -> np.ndarray:
    """int32 [R, C/8] -> uint8 [R, C] of values 0..15 in logical column order."""
    p = packed.view(np.uint32)
    return ((p[:, :, None] >> _SHIFTS) & 0xF).astype(np.uint8).reshape(p.shape[0], -1)


# Column order as packed: a word's 4 bytes hold nibbles (0, 1), (2, 3), (4, 5), (6, 7), so reading every byte's low
# nibble and then every byte's high nibble gives nibbles 0, 2, 4, 6, 1, 3, 5, 7 of the word, i.e. logical columns
# STORED_COLUMNS[j] = AWQ_ORDER[nibble] at positions j = 0..7 of each group of eight (unpack_stored).
STORED_COLUMNS = np.array([AWQ_ORDER[n] for n in (0, 2, 4, 6, 1, 3, 5, 7)])
LOGICAL_FROM_STORED = np.argsort(STORED_COLUMNS)  # position in a stored group of eight of logical column c


def unpack_stored(packed: np.ndarray) -> np.ndarray:
    """int32 [R, C/8] -> float32 [R, C] of values 0..15 in stored order: position 8w + j holds logical column
    8w + STORED_COLUMNS[j] (byte masks and shifts on the bytes, no per-nibble shift of the words)."""
    R, W = packed.shape
    b = np.ascontiguousarray(packed).view(np.uint8).reshape(R, W, 4)
    out = np.empty((R, W, 8), dtype=np.float32)
    out[:, :, :4] = b & 15
    out[:, :, 4:] = b >> 4
    return out.reshape(R, W * 8)


def pack(values: np.ndarray) -> np.ndarray:
    """uint8 [R, C] of 0..15 -> int32 [R, C/8]; the inverse of unpack. Built a byte at a time (little-endian): byte
    k of a word holds nibbles 2k and 2k+1, i.e. columns AWQ_ORDER[2k] (low) and AWQ_ORDER[2k+1] (high)."""
    v = np.asarray(values, dtype=np.uint8).reshape(values.shape[0], -1, 8)
    out = v[:, :, list(AWQ_ORDER[0::2])] | (v[:, :, list(AWQ_ORDER[1::2])] << 4)
    return np.ascontiguousarray(out).view(np.int32).reshape(values.shape[0], -1)


def dequantize(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group_size: int,
               rows: slice | None = None) -> np.ndarray:
    """W [K, N] float32 = (q - z) * s, group-wise along K. `rows` dequantizes a K-slice only."""
    if rows is not None:
        k0 = rows.start or 0
        assert k0 % group_size == 0, "row slices must start on a group boundary"
        qweight = qweight[rows]
        g0, g1 = k0 // group_size, (k0 + qweight.shape[0] + group_size - 1) // group_size
        qzeros, scales = qzeros[g0:g1], scales[g0:g1]
    q = unpack(qweight).astype(np.float32)
    z = unpack(qzeros).astype(np.float32)
    s = scales.astype(np.float32)
    K = q.shape[0]
    zg = np.repeat(z, group_size, axis=0)[:K]
    sg = np.repeat(s, group_size, axis=0)[:K]
    return (q - zg) * sg
