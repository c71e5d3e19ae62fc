"""ak48 header and region layout: round trips, v5 compatibility, byte offsets, loader checks."""
import json
import struct

import numpy as np
import pytest

from kuiper_py import format as fmt
from kuiper_py.errors import KuiperError
from kuiper_py.loader import load


def _header(**kw):
    d = dict(dim=256, hidden_dim=768, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=1000, max_seq_len=4096,
             shared_classifier=False, head_dim=64, group_size=128)
    d.update(kw)
    return fmt.Header(**d)


def test_header_round_trip_and_v5_bytes():
    h = _header(has_ext=True, rope_theta=5e5, rms_norm_eps=1e-5, bos_token_id=7, eos_token_id=9,
                trailer_offset=12345, trailer_length=77, flags=1, checksum=bytes(range(32)))
    b = h.pack()
    assert len(b) == 256
    # what a v5-only reader does: struct reads at the fixed offsets
    assert struct.unpack_from("<I", b, 0x00)[0] == 0x616B3438 and b[:4] == b"84ka"
    assert struct.unpack_from("<i", b, 0x04)[0] == 5
    assert struct.unpack_from("<7i", b, 0x08) == (256, 768, 3, 4, 2, 1000, 4096)
    assert b[0x24] == 0
    assert struct.unpack_from("<i", b, 0x25)[0] == 64
    assert struct.unpack_from("<i", b, 0x29)[0] == 128
    assert b[0x2D:0x30] == b"\0\0\0"
    h2 = fmt.Header.unpack(b)
    assert h2 == h


def test_plain_v5_header_has_no_extension():
    h = _header(shared_classifier=True)
    b = h.pack()
    assert not any(b[0x2D:])
    h2 = fmt.Header.unpack(b)
    assert not h2.has_ext and h2.shared_classifier


def test_region_offsets_follow_v5_order():
    h = _header()
    L, D, hd, V, I, g = 3, 256, 64, 1000, 768, 128
    q, kv = 4 * hd, 2 * hd
    off = 256
    expect = {}

    def put(name, nbytes):
        nonlocal off
        expect[name] = off
        off += nbytes

    for i in range(L):
        put(f"attn_norm.{i}", 2 * D)
    for i in range(L):
        put(f"ffn_norm.{i}", 2 * D)
    put("final_norm", 2 * D)
    put("embed", 2 * V * D)
    dims = {"wq": (D, q), "wk": (D, kv), "wv": (D, kv), "wo": (q, D), "w1": (D, I), "w2": (I, D), "w3": (D, I)}
    for p in ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]:
        K, N = dims[p]
        for i in range(L):
            put(f"{p}.{i}.qweight", 4 * K * N // 8)
            put(f"{p}.{i}.qzeros", 4 * (K // g) * N // 8)
            put(f"{p}.{i}.scales", 2 * (K // g) * N)
    put("lm_head", 2 * V * D)
    for i in range(L):
        put(f"q_norm.{i}", 2 * hd)
    for i in range(L):
        put(f"k_norm.{i}", 2 * hd)
    got = {r.name: r.offset for r in fmt.regions(h)}
    assert got == expect
    assert h.weights_end == off
    shared = {r.name for r in fmt.regions(_header(shared_classifier=True))}
    assert "lm_head" not in shared


@pytest.mark.parametrize("kw, msg", [
    (dict(n_heads=3), "multiple of n_kv_heads"),
    (dict(dim=200), "does not divide dim"),
    (dict(head_dim=0), "must be positive"),
    (dict(n_layers=-1), "must be positive"),
])
def test_bad_headers_are_refused(kw, msg):
    h = _header(**kw)
    b = bytearray(256)
    struct.pack_into("<Ii7iBii", b, 0, fmt.MAGIC, 5, h.dim, h.hidden_dim, h.n_layers, h.n_heads, h.n_kv_heads,
                     h.vocab_size, h.max_seq_len, 0, h.head_dim, h.group_size)
    with pytest.raises(KuiperError, match=msg):
        fmt.Header.unpack(bytes(b))


def test_loader_views_are_zero_copy_and_match_checkpoint(tiny_bin, tiny_dir):
    from kuiper_py.st_reader import Checkpoint
    mf = load(tiny_bin)
    ck = Checkpoint(tiny_dir)
    w = mf.weights
    assert mf.verify_checksum() is True
    assert w.lm_head is w.embed  # tied
    assert not w.embed.flags.owndata and not w.embed.flags.writeable
    L0 = w.layers[0]
    np.testing.assert_array_equal(L0.wq.qweight, ck.get("model.layers.0.self_attn.q_proj.qweight"))
    np.testing.assert_array_equal(w.layers[1].w2.scales, ck.get("model.layers.1.mlp.down_proj.scales"))
    np.testing.assert_array_equal(w.layers[1].k_norm, ck.get("model.layers.1.self_attn.k_norm.weight"))
    np.testing.assert_array_equal(w.embed, ck.get("model.embed_tokens.weight"))
    assert mf.trailer["config"]["model_type"] == "qwen3"
    assert mf.args.eos_token_ids[:2] == [151645, 151643]


def _strip_to_v5(src, dst):
    """What KuiperLLama's exporter writes: the same bytes up to the weights' end, zero padding."""
    b = bytearray(src.read_bytes())
    h = fmt.Header.unpack(bytes(b[:256]))
    b[0x2D:256] = bytes(256 - 0x2D)
    dst.write_bytes(bytes(b[:h.trailer_offset]))


def test_plain_v5_file_loads_with_tokenizer_dir(tiny_bin, tiny_dir, tmp_path):
    v5 = tmp_path / "plain.bin"
    _strip_to_v5(tiny_bin, v5)
    mf = load(v5, tokenizer_dir=tiny_dir)
    assert not mf.header.has_ext and mf.verify_checksum() is None
    assert mf.trailer["tokenizer"] and mf.args.rope_theta == 1e6
    ref = load(tiny_bin)
    np.testing.assert_array_equal(mf.weights.layers[1].w3.qweight, ref.weights.layers[1].w3.qweight)


def test_truncated_extra_and_corrupt_files(tiny_bin, tmp_path):
    data = tiny_bin.read_bytes()
    for n, msg in [(100, "shorter than"), (300, "truncated"), (len(data) - 1, "truncated")]:
        p = tmp_path / f"t{n}.bin"
        p.write_bytes(data[:n])
        with pytest.raises(KuiperError, match=msg):
            load(p)
    p = tmp_path / "extra.bin"
    p.write_bytes(data + b"x")
    with pytest.raises(KuiperError, match="extra bytes"):
        load(p)
    p = tmp_path / "magic.bin"
    p.write_bytes(b"GGUF" + data[4:])
    with pytest.raises(KuiperError, match="not an ak48"):
        load(p)
    bad = bytearray(data)
    bad[1000] ^= 0xFF
    p = tmp_path / "flip.bin"
    p.write_bytes(bytes(bad))
    assert load(p).verify_checksum() is False


def test_trailer_must_be_json(tiny_bin, tmp_path):
    b = bytearray(tiny_bin.read_bytes())
    h = fmt.Header.unpack(bytes(b[:256]))
    b[h.trailer_offset] = ord("#")
    p = tmp_path / "t.bin"
    p.write_bytes(bytes(b))
    with pytest.raises(KuiperError, match="not valid JSON"):
        load(p)
    assert json.loads(tiny_bin.read_bytes()[h.trailer_offset:])["config"]["hidden_size"] == 128


def test_drop_pages_releases_the_mapping_and_keeps_the_bytes(tmp_path):
    """loader.drop_pages (the GPU upload's release of what it has copied): the view's pages leave this process's
    resident memory, its bytes read back the same (faulted in from the file again), and an array that is not a
    view of the mapping is left alone."""
    import mmap

    from kuiper_py.loader import drop_pages

    def mapped_rss_kib():
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("Rss:"):
                return int(line.split()[1])

    data = np.random.default_rng().integers(0, 256, size=96 << 20, dtype=np.uint8)
    f = tmp_path / "blob"
    data.tofile(f)
    with open(f, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mm, np.uint8, count=64 << 20, offset=16 << 20).reshape(4096, -1)
    assert int(view.sum(dtype=np.uint64)) == int(data[16 << 20:80 << 20].sum(dtype=np.uint64))  # resident now
    before = mapped_rss_kib()
    drop_pages(view)
    after = mapped_rss_kib()
    assert before - after > 60 * 1024  # ~64 MiB of the file's pages no longer resident
    np.testing.assert_array_equal(view.reshape(-1), data[16 << 20:80 << 20])  # read back from the file
    drop_pages(np.ones(10))  # not a view of a mapping: nothing happens
    drop_pages(view[:0])


def test_weights_that_cannot_fit_are_refused_before_the_upload():
    from kuiper_py.errors import ResourceError
    from kuiper_py.loader import check_weights_fit

    check_weights_fit(100 << 30, 100 << 30, 141 << 30, "NVIDIA H200")  # exactly what is free: tried
    with pytest.raises(ResourceError, match=r"need 116\.0 GiB of GPU memory; the NVIDIA H100 has 78\.5 GiB free of 79\.6"):
        check_weights_fit(116 << 30, int(78.5 * 2**30), int(79.6 * 2**30), "NVIDIA H100")
