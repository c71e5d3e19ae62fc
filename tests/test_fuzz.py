"""Property-based fuzzing of the ak48 header parser and loader (fixed budget, fits CI).

Every case must end in KuiperError or a model that loads with all its views inside the mapping and
runs a forward step; any other exception is a failure.
"""
import hashlib
import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kuiper_py import format as fmt
from kuiper_py.errors import KuiperError
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def small_model_bytes(seed=0, shared=True) -> bytes:
    """A valid, small ak48 file (1 layer, d 128, vocab 40) with a checksum and a trailer."""
    rng = np.random.default_rng(seed)
    h = fmt.Header(dim=128, hidden_dim=128, n_layers=1, n_heads=1, n_kv_heads=1, vocab_size=40, max_seq_len=64,
                   shared_classifier=shared, head_dim=128, group_size=128, has_ext=True, flags=fmt.FLAG_CHECKSUM)
    body = bytearray()
    for r in fmt.regions(h):
        if r.dtype == "int32":
            body += rng.integers(-2**31, 2**31, size=r.nbytes // 4, dtype=np.int64).astype(np.int32).tobytes()
        else:
            body += (rng.random(r.nbytes // 2, dtype=np.float32) * 0.02).astype(np.float16).tobytes()
    trailer = json.dumps({"config": {"model_type": "qwen3", "eos_token_id": 3}}).encode()
    h.trailer_offset, h.trailer_length = h.weights_end, len(trailer)
    head = h.pack()
    h.checksum = hashlib.sha256(head[:fmt.CHECKSUM_OFFSET] + bytes(body) + trailer).digest()
    return h.pack() + bytes(body) + trailer


VALID = small_model_bytes()


def check_loads_or_refuses(path):
    try:
        mf = load(path)
    except KuiperError:
        return None
    base = np.frombuffer(mf._mm, dtype=np.uint8)
    lo, hi = base.ctypes.data, base.ctypes.data + mf.size
    views = [mf.weights.embed, mf.weights.final_norm, mf.weights.lm_head]
    for layer in mf.weights.layers:
        views += [layer.attn_norm, layer.ffn_norm, layer.q_norm, layer.k_norm]
        for p in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            lin = getattr(layer, p)
            views += [lin.qweight, lin.qzeros, lin.scales]
    for v in views:
        assert lo <= v.ctypes.data and v.ctypes.data + v.nbytes <= hi
    mf.verify_checksum()
    with np.errstate(all="ignore"):
        Qwen3(mf, NumpyOps, 2).prefill([0, 1])
    return mf


def test_valid_small_model_loads(tmp_path):
    p = tmp_path / "m.bin"
    p.write_bytes(VALID)
    mf = check_loads_or_refuses(p)
    assert mf is not None and mf.verify_checksum() is True


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8),
       st.booleans())
def test_mutated_files(tmp_path, edits, in_header):
    b = bytearray(VALID)
    for off, val in edits:
        b[off % 0x90 if in_header else off] = val  # bias half the cases toward the header and extension
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(b))
    mf = check_loads_or_refuses(p)
    if mf is not None and bytes(b) != VALID:
        # every byte is covered: hashed, the checksum itself, or reserved-zero (refused when set)
        want = False if (mf.header.has_ext and mf.header.flags & fmt.FLAG_CHECKSUM) else None
        assert mf.verify_checksum() is want


@SETTINGS
@given(st.integers(0, len(VALID) + 10))
def test_truncated_or_extended_at_any_offset(tmp_path, n):
    data = VALID[:n] if n <= len(VALID) else VALID + b"\0" * (n - len(VALID))
    p = tmp_path / "t.bin"
    p.write_bytes(data)
    if n == len(VALID):
        assert check_loads_or_refuses(p) is not None
    else:
        with pytest.raises(KuiperError):
            load(p)


I32 = st.one_of(st.integers(-2**31, 2**31 - 1), st.sampled_from([0, 1, 2, 8, 64, 128, 4096, 151936, 2**31 - 1]))


@SETTINGS
@given(st.tuples(*[I32] * 9), st.integers(0, 255), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
       st.booleans(), st.binary(max_size=512))
def test_random_header_fields(tmp_path, dims, shared, toff, tlen, ext, tail):
    b = bytearray(256)
    dim, hidden, nl, nh, nkv, vocab, msl, hd, gs = dims
    struct.pack_into("<Ii7iBii", b, 0, fmt.MAGIC, 5, dim, hidden, nl, nh, nkv, vocab, msl, shared, hd, gs)
    if ext:
        struct.pack_into("<IIddiiIIQQ", b, 0x30, fmt.EXT_MAGIC, 1, 1e6, 1e-6, -1, -1, 1, 0, toff, tlen)
    p = tmp_path / "h.bin"
    p.write_bytes(bytes(b) + tail)
    check_loads_or_refuses(p)
