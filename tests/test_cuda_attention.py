"""Attention (cuda/ops/attention.py; kernels_cu/attention.cu, attn_wgmma.cu, attn_decode.cuh, rope.cu) against
float64 references (device machine only): flash attention for prefill, flash decoding and its split partials, the
merge of the partials by the o GEMV or by the splits' clusters, and q/k norm + RoPE + the KV-cache write.

Every output is poisoned with NaN before the kernel runs, so an element the kernel fails to write
fails the comparison; inputs are fresh random draws on every run.
"""
import math

import numpy as np
import pytest

from reference import patch, rel, tune

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")
from cuda_common import nan_like, qkv_case, qkv_rope_ref, rand_awq  # noqa: E402 (after the module-level skip)


def attention_ref(q, K, V, pos0):
    """q [T, H, hd] at positions pos0.., K/V [n, KV, hd] -> [T, H*hd], one head at a time in float64."""
    T, H, hd = q.shape
    KV = K.shape[1]
    out = np.zeros((T, H, hd))
    for h in range(H):
        kh = h // (H // KV)
        s = q[:, h].astype(np.float64) @ K[:, kh].astype(np.float64).T / math.sqrt(hd)  # [T, n]
        for t in range(T):
            row = s[t, :pos0 + t + 1]
            p = np.exp(row - row.max())
            out[t, h] = (p / p.sum()) @ V[:pos0 + t + 1, kh].astype(np.float64)
    return out.reshape(T, H * hd)


def attn_path_or_skip(path: str, hd: int, monkeypatch) -> str:
    """The prefill attention path to test: "mma" anywhere, "wgmma" (the default form: 2 consumer warpgroups
    below FW_NC3_FROM tokens, 3 taking turns from there) and "wgmma-nc3" (that second form at any length, set
    here) where that kernel runs (head dim 128 on compute capability 9.0), else the test is skipped."""
    if path.startswith("wgmma") and not (hd == 128 and oc.wgmma_available()):
        pytest.skip("flash_attn_wgmma runs at head dim 128 on compute capability 9.0 only")
    if path == "wgmma-nc3":
        tune(monkeypatch, fw_config=(4, 2, 3))
    return path.split("-")[0]


@pytest.mark.parametrize("path", ["mma", "wgmma-nc3", "wgmma"])  # (fast tier: the first and last)
@pytest.mark.parametrize("H,KV,hd", [(4, 2, 64), (32, 8, 128), (64, 8, 128), (16, 8, 128), (32, 4, 128)])
@pytest.mark.parametrize("T,pos0", [(2, 0), (17, 0), (127, 5), (300, 0), (65, 70), (129, 200)])
def test_flash_attention_prefill(H, KV, hd, T, pos0, path, monkeypatch):
    """Against float64 per head. pos0 > 0: a chunk after cached positions (the causal bound is then off the
    query tiles' edges); T 129: a second query tile of one row; the cache holds 7 positions past the chunk,
    stale rows that must not be read."""
    path = attn_path_or_skip(path, hd, monkeypatch)
    rng = np.random.default_rng()
    ctx = pos0 + T + 7
    Kc = (rng.standard_normal((ctx, KV, hd)) * 2).astype(np.float16)
    Vc = rng.standard_normal((ctx, KV, hd)).astype(np.float16)
    Kc[pos0 + T:] = Vc[pos0 + T:] = np.nan  # past the keys: a kernel that read them would put NaN into its output
    q = (rng.standard_normal((T, H, hd)) * 2).astype(np.float16)
    out = nan_like((T, H * hd), cp.float16)
    oc.attention_prefill(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), pos0, KV, out, path=path)
    assert rel(cp.asnumpy(out), attention_ref(q, Kc, Vc, pos0)) < 1e-2


def _one_layer_of_nan(rng, L, ctx, n, layer, T, H, KV, hd):
    """Caches [L, ctx, KV, hd] holding random keys and values at the layer's first n positions and NaN elsewhere (so
    reading another layer or past n shows), and q [T, H, hd] on the device."""
    Kc = np.full((L, ctx, KV, hd), np.nan, np.float16)
    Vc = Kc.copy()
    Kc[layer, :n] = rng.standard_normal((n, KV, hd)) * 2
    Vc[layer, :n] = rng.standard_normal((n, KV, hd))
    return Kc, Vc, cp.asarray((rng.standard_normal((T, H, hd)) * 2).astype(np.float16))


@pytest.mark.parametrize("path", ["mma", "wgmma-nc3", "wgmma"])  # (fast tier: the first and last)
@pytest.mark.parametrize("T,pos0,layer", [(17, 0, 1), (130, 61, 2), (64, 0, 0)])
def test_flash_attention_prefill_one_layer_of_the_whole_cache(T, pos0, layer, path, monkeypatch):
    """The model's call: every layer's cache [L, ctx, KV, hd] and the layer to read (one TMA descriptor per cache
    and length serves all layers). Every other layer and the rows past the chunk hold NaN, so reading another
    layer or past n_keys shows; the result matches float64 and, bit for bit, the same attention on that layer's
    cache alone."""
    path = attn_path_or_skip(path, 128, monkeypatch)
    rng = np.random.default_rng()
    L, H, KV, hd = 3, 16, 4, 128
    n, ctx = pos0 + T, pos0 + T + 70
    Kc, Vc, q = _one_layer_of_nan(rng, L, ctx, n, layer, T, H, KV, hd)
    whole, alone = nan_like((T, H * hd), cp.float16), nan_like((T, H * hd), cp.float16)
    oc.attention_prefill(q, cp.asarray(Kc), cp.asarray(Vc), pos0, KV, whole, path=path, layer=layer)
    oc.attention_prefill(q, cp.asarray(Kc[layer]), cp.asarray(Vc[layer]), pos0, KV, alone, path=path)
    got = cp.asnumpy(whole)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, cp.asnumpy(alone))
    assert rel(got, attention_ref(cp.asnumpy(q), Kc[layer], Vc[layer], pos0)) < 1e-2


@pytest.mark.parametrize("path", ["mma", "wgmma-nc3", "wgmma"])  # (fast tier: the first and last)
def test_flash_attention_prefill_position_on_device(path, monkeypatch):
    """A prefill graph's attention: the position read from device memory and, on the wgmma kernel, K's
    and V's maps from a device buffer, both rewritten between launches of the same arguments (as between replays):
    each launch equals, bit for bit, the launch with that position and its own maps as arguments, and float64.
    Every other layer and the rows past each launch's keys hold NaN (a map over the whole cache would let them into
    P V); the launch's own argument says position 0."""
    path = attn_path_or_skip(path, 128, monkeypatch)
    rng = np.random.default_rng()
    L, H, KV, hd, T, layer = 2, 16, 4, 128, 48, 1
    pos_dev, maps = cp.zeros((1,), cp.int32), cp.zeros((256,), cp.uint8)
    for pos0 in (61, 0, 130):
        n, ctx = pos0 + T, 250
        Kc, Vc, q = _one_layer_of_nan(rng, L, ctx, n, layer, T, H, KV, hd)
        Kd, Vd = cp.asarray(Kc), cp.asarray(Vc)
        pos_dev.set(np.array([pos0], np.int32))
        maps.set(np.frombuffer(bytes(oc.tma_map_cache(Kd, n)) + bytes(oc.tma_map_cache(Vd, n)), np.uint8))
        dev, arg = nan_like((T, H * hd), cp.float16), nan_like((T, H * hd), cp.float16)
        oc.attention_prefill(q, Kd, Vd, 0, KV, dev, path=path, layer=layer, pos_dev=pos_dev, kvmaps=maps)
        oc.attention_prefill(q, Kd, Vd, pos0, KV, arg, path=path, layer=layer)
        got = cp.asnumpy(dev)
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, cp.asnumpy(arg))
        assert rel(got, attention_ref(cp.asnumpy(q), Kc[layer], Vc[layer], pos0)) < 1e-2


@pytest.mark.parametrize("path", ["mma", "wgmma-nc3", "wgmma"])  # (fast tier: the first and last)
def test_flash_attention_prefill_long(path, monkeypatch):
    path = attn_path_or_skip(path, 128, monkeypatch)
    rng = np.random.default_rng()
    T, H, KV, hd = 2047, 32, 8, 128
    Kc = rng.standard_normal((T, KV, hd)).astype(np.float16)
    Vc = rng.standard_normal((T, KV, hd)).astype(np.float16)
    q = rng.standard_normal((T, H, hd)).astype(np.float16)
    out = nan_like((T, H * hd), cp.float16)
    oc.attention_prefill(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), 0, KV, out, path=path)
    sel = rng.choice(T, 40, replace=False)  # check a random subset of rows against float64
    ref = np.stack([attention_ref(q[t:t + 1], Kc[:t + 1], Vc[:t + 1], t)[0] for t in sel])
    assert rel(cp.asnumpy(out)[sel], ref) < 1e-2


def test_flash_attention_prefill_paths_agree_and_default(monkeypatch):
    """Where the wgmma kernel runs it is the default at head dim 128 (here its 3-warpgroup form with turns),
    and it agrees with the mma.sync kernel (both fp32 softmax over fp16 products: within fp16 rounding of each
    other) on 4100 tokens after 300 cached positions, 40 heads over 8 KV heads (Qwen3-14B's grouping)."""
    attn_path_or_skip("wgmma", 128, monkeypatch)
    assert oc.FW_NC3_FROM <= 4100
    rng = np.random.default_rng()
    T, pos0, H, KV, hd = 4100, 300, 40, 8, 128
    Kc = cp.asarray(rng.standard_normal((pos0 + T, KV, hd)).astype(np.float16))
    Vc = cp.asarray(rng.standard_normal((pos0 + T, KV, hd)).astype(np.float16))
    q = cp.asarray((rng.standard_normal((T, H, hd)) * 2).astype(np.float16))
    a, b, c = (nan_like((T, H * hd), cp.float16) for _ in range(3))
    oc.attention_prefill(q, Kc, Vc, pos0, KV, a)
    oc.attention_prefill(q, Kc, Vc, pos0, KV, b, path="wgmma")
    oc.attention_prefill(q, Kc, Vc, pos0, KV, c, path="mma")
    assert bool(cp.all(a == b)) and bool(cp.all(cp.isfinite(b)))
    assert rel(cp.asnumpy(b), cp.asnumpy(c)) < 2e-3


def decode_inputs(rng, H, KV, hd, n, splits):
    """Fresh random fp16 q [1, H, hd] and n cached K and V rows [n, KV, hd] (NumPy), and flash decoding's
    partials for `splits` splits, poisoned (device): (q, Kc, Vc, part_o, part_ml)."""
    Kc = rng.standard_normal((n, KV, hd)).astype(np.float16)
    Vc = rng.standard_normal((n, KV, hd)).astype(np.float16)
    q = rng.standard_normal((1, H, hd)).astype(np.float16)
    part_o, part_ml = nan_like((H * splits * hd,), cp.float32), nan_like((H * splits * 2,), cp.float32)
    return q, Kc, Vc, part_o, part_ml


# GQA groups of 4 (8B), 8 (32B, 30B-A3B), 16 (235B: two blocks per KV head), 5 (14B), 2 and 1
@pytest.mark.parametrize("H,KV,hd", [(32, 8, 128), (64, 8, 128), (64, 4, 128), (40, 8, 128), (8, 8, 64), (4, 2, 64)])
@pytest.mark.parametrize("n", [1, 31, 1000, 32768, 4097])  # (the fast tier takes the first and last)
@pytest.mark.parametrize("splits,on_device", [(16, False), (70, True)])
@pytest.mark.parametrize("min_chunk", [32, 64, 7])
def test_flash_decoding(H, KV, hd, n, splits, on_device, min_chunk):
    """on_device: the length comes from device memory (graph replay) and all splits launch; with a
    short context most of them hold no keys, and the combine must skip exactly those. min_chunk: the
    fewest keys per split (the default, Qwen3-8B's on the H100, and one that is no power of two)."""
    if n == 32768 and (H != 32 or on_device or min_chunk != 32):
        pytest.skip("one 32k case is enough")
    if min_chunk != 32 and (H, KV) not in ((32, 8), (4, 2)):
        pytest.skip("the split rule is the same code for every grouping")
    q, Kc, Vc, part_o, part_ml = decode_inputs(np.random.default_rng(), H, KV, hd, n, splits)
    out = nan_like((1, H * hd), cp.float16)
    pos_dev = cp.full((1,), n - 1, cp.int32) if on_device else None
    oc.attention_decode(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), -1 if on_device else n, KV, splits,
                        part_o, part_ml, out, pos_dev, min_chunk=min_chunk)
    assert rel(cp.asnumpy(out), attention_ref(q, Kc, Vc, n - 1)) < 1e-2


@pytest.mark.parametrize("H,KV,hd,D", [(32, 8, 128, 4096), (64, 4, 128, 4096), (16, 8, 64, 1024), (40, 8, 128, 5120)])
@pytest.mark.parametrize("n,on_device", [(1, True), (700, False), (9000, True), (511, True)])
@pytest.mark.parametrize("min_chunk", [32, 64])
@pytest.mark.parametrize("splits,o_merge", [(16, True), (40, False), (40, True), (80, True)])
def test_o_gemv_merges_flash_decoding_partials(H, KV, hd, D, n, on_device, min_chunk, splits, o_merge):
    """The o projection with the flash-decoding merge in its prologue (x = attention output never
    materialised) and the residual add in its epilogue, against float64 attention @ W_o + h. The
    splits past the keys hold NaN: the merge must read exactly those that flash decoding wrote, for
    the fewest keys per split that both were given (min_chunk). o_merge: gemv_merge_span past 16 splits
    (one to five batches of 16 partials at 40 and 80; Qwen3-32B's 384-row span takes its per-element
    fallback), else and at 16 splits decode_merge's running max."""
    rng = np.random.default_rng()
    q, Kc, Vc, part_o, part_ml = decode_inputs(rng, H, KV, hd, n, splits)
    m, r = rand_awq(rng, H * hd, D)
    pos_dev = cp.full((1,), n - 1, cp.int32) if on_device else None
    parts = oc.attention_decode(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), -1 if on_device else n, KV, splits,
                                part_o, part_ml, None, pos_dev, min_chunk=min_chunk, o_merge=o_merge)
    h0 = rng.standard_normal((1, D)).astype(np.float32)
    h = cp.asarray(h0)
    partial = cp.empty((oc.gemv_partial_size(H * hd, [D]),), cp.float32)
    oc.gemv(None, [m], "plain", None, partial, resid=h, att=parts)
    att = attention_ref(q, Kc, Vc, n - 1).reshape(-1).astype(np.float16).astype(np.float64)
    ref = h0[0] + (att @ r).astype(np.float16)
    assert rel(cp.asnumpy(h)[0] - h0[0], ref - h0[0]) < 1e-2
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0


# (H, KV, hd, D, E): Qwen3-30B-A3B's o projection and 128 experts; 160, 64, 8. R's columns go over
# ceil(E / 64) tiles (2; 3 of 56, 56, 48 columns; 1; 1), Rh's tile takes all E (lanes per row 16, 32, 8, 1)
@pytest.mark.parametrize("H,KV,hd,D,E", [(32, 4, 128, 2048, 128), (16, 8, 64, 1024, 160), (8, 2, 128, 1024, 64),
                                         (4, 2, 64, 512, 8)])
@pytest.mark.parametrize("massive", [False, True])
@pytest.mark.parametrize("cm", [False, True])
def test_o_gemv_router_rows(H, KV, hd, D, E, massive, cm):
    """The MoE o projection in accumulating mode with the router rows as more column tiles, R [q_dim, E]
    (its columns over one or more tiles) against the attention output and Rh [D, E] against the fp32
    residual row h (fp16 both): acc_z = attention @ R + h @ Rh beside acc_o = attention @ W_o, both fixed point, against float64 on
    the merged attention output rounded to fp16 (as the kernel stages it). massive: a value channel at
    3000, so the staged span is scaled down (the overflow guard) and the router sums scaled back, and
    residual channels at 1e4. Two launches from zeroed accumulators: bitwise the same; the arrival
    counters untouched. cm: the attention output merged by flash decoding's clusters (16 splits), staged as a
    plain row."""
    if cm:
        cm_or_skip(16, oc.decode_heads_per_block(H, KV), hd)
    rng = np.random.default_rng()
    n, splits = 300, 16 if cm else 24
    q, Kc, Vc, part_o, part_ml = decode_inputs(rng, H, KV, hd, n, splits)
    if massive:
        Vc[:, 0, 3] = 3000
    m, r = rand_awq(rng, H * hd, D)
    R = (rng.standard_normal((H * hd, E)) / 50).astype(np.float16)
    Rh = (rng.standard_normal((D, E)) / 50).astype(np.float16)
    h = rng.standard_normal((1, D)).astype(np.float32)
    if massive:
        h[0, rng.choice(D, 3, replace=False)] = 1e4
    parts = oc.attention_decode(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), -1, KV, splits, part_o, part_ml,
                                None, cp.full((1,), n - 1, cp.int32),
                                merged=nan_like((1, H * hd), cp.float16) if cm else None)
    assert (parts.merged is not None) == cm
    partial = cp.empty((oc.gemv_partial_size(H * hd, [D]),), cp.float32)
    att = attention_ref(q, Kc, Vc, n - 1).reshape(-1).astype(np.float16).astype(np.float64)
    outs = []
    for _ in range(2):
        acc_o, acc_z = cp.zeros((D,), cp.int64), cp.zeros((E,), cp.int64)
        oc.gemv(None, [m], "plain", None, partial, att=parts, acc_out=acc_o,
                router=(cp.asarray(R), cp.asarray(Rh), cp.asarray(h), acc_z))
        outs.append((cp.asnumpy(acc_o), cp.asnumpy(acc_z)))
    o = outs[0][0].astype(np.float64) / 2**32
    z = outs[0][1].astype(np.float64) / 2**32
    assert rel(o, att @ r) < 1e-2
    z_ref = att @ R.astype(np.float64) + h[0].astype(np.float64) @ Rh.astype(np.float64)
    assert rel(z, z_ref) < 1e-3, rel(z, z_ref)
    for a_, b_ in zip(outs[0], outs[1]):
        np.testing.assert_array_equal(a_, b_)
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0


@pytest.mark.parametrize("H,KV,hd,T,pos0", [(32, 8, 128, 1, 9), (64, 8, 128, 37, 0), (4, 2, 64, 5, 3),
                                             (32, 4, 128, 300, 17), (16, 8, 64, 2, 40), (1, 1, 64, 3, 0)])
@pytest.mark.parametrize("dev_pos", [False, True])
def test_qk_norm_rope_kv_write(H, KV, hd, T, pos0, dev_pos):
    """q/k norm, RoPE and the cache write against NumPy; dev_pos: the position read from device memory (the decode
    step's graph, and a prefill graph's), the argument a wrong -1."""
    from kuiper_py.config import ModelArgs, rope_tables
    from kuiper_py.ops_numpy import rmsnorm, rope
    rng = np.random.default_rng()
    ctx = pos0 + T + 3
    a = ModelArgs(hidden_size=H * hd, intermediate_size=1, num_hidden_layers=1, num_attention_heads=H,
                  num_key_value_heads=KV, head_dim=hd, vocab_size=1, max_position_embeddings=ctx,
                  tie_word_embeddings=True)
    cos, sin = rope_tables(a, ctx)
    fused = rng.standard_normal((T, (H + 2 * KV) * hd)).astype(np.float16)
    qn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float16)
    kn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float16)
    buf = cp.asarray(fused)
    qd, kvd = H * hd, KV * hd
    kc, vc = nan_like((ctx, KV, hd), cp.float16), nan_like((ctx, KV, hd), cp.float16)
    out = oc.qk_norm_rope_store(buf[:, :qd], buf[:, qd:qd + kvd], buf[:, qd + kvd:], cp.asarray(qn), cp.asarray(kn),
                                cp.asarray(cos), cp.asarray(sin), kc, vc, -1 if dev_pos else pos0, H, 1e-6,
                                nan_like((T, H, hd), cp.float16), cp.full((1,), pos0, cp.int32) if dev_pos else None)
    f = fused.astype(np.float32)
    c, s = cos[pos0:pos0 + T], sin[pos0:pos0 + T]
    q_ref = rope(rmsnorm(f[:, :qd].reshape(T, H, hd), qn, 1e-6), c, s)
    k_ref = rope(rmsnorm(f[:, qd:qd + kvd].reshape(T, KV, hd), kn, 1e-6), c, s)
    assert rel(cp.asnumpy(out), q_ref) < 2e-3
    assert rel(cp.asnumpy(kc)[pos0:pos0 + T], k_ref) < 2e-3
    np.testing.assert_array_equal(cp.asnumpy(vc)[pos0:pos0 + T], fused[:, qd + kvd:].reshape(T, KV, hd))
    assert np.isnan(cp.asnumpy(kc)[:pos0]).all()  # nothing else in the cache was touched


def qkv_then_flash_decoding(case, pend, kc, vc, zero, D, H, KV, hd, pos0, splits, min_chunk, eps, cm=False):
    """A decode step's attention half as the graph runs it: the q|k|v GEMV in accumulating mode (adding the
    pending projection output pend to the residual row first, clearing the accumulator zero), then flash
    decoding finishing it at position pos0 (q/k norm, RoPE, the newest K/V row into kc, vc) over splits
    splits. Returns q rotated, the new residual row, the attention output and the splits' part_o, part_ml,
    every one poisoned before the kernels ran. cm: the splits merged by their clusters (the output is
    theirs; the caller enables ATTN_CM)."""
    cos, sin, mats, h, w, qn, kn = case
    qrot, hout = nan_like((1, H, hd), cp.float16), nan_like((1, D), cp.float32)
    acc = cp.zeros(((H + 2 * KV) * hd,), cp.int64)
    partial = cp.empty((oc.gemv_partial_size(D, [H * hd, KV * hd, KV * hd]),), cp.float32)
    part_o, part_ml = nan_like((H * splits * hd,), cp.float32), nan_like((H * splits * 2,), cp.float32)
    out = nan_like((1, H * hd), cp.float16)
    ss = nan_like((4096,), cp.float32)
    S = oc.gemv(None, [m for m, _ in mats], "plain", None, partial, norm=(cp.asarray(h[None]), cp.asarray(w), eps),
                pend=cp.asarray(pend), hout=hout, acc_out=acc, zero=zero, ss_out=ss)
    parts = oc.attention_decode(qrot, kc, vc, -1, KV, splits, part_o, part_ml, None if cm else out,
                                cp.full((1,), pos0, cp.int32),
                                finish=dict(acc=acc, q_norm=cp.asarray(qn), k_norm=cp.asarray(kn), cos=cp.asarray(cos),
                                            sin=cp.asarray(sin), eps=eps, ss=(ss, S, D)), min_chunk=min_chunk,
                                max_keys=pos0 + 1, merged=out if cm else None)
    assert not cm or parts.merged is out
    return qrot, hout, out, part_o, part_ml


@pytest.mark.parametrize("D,H,KV,hd,pos0,splits", [(4096, 32, 8, 128, 0, 16), (4096, 32, 8, 128, 777, 16),
                                                   (2048, 32, 4, 128, 300, 70), (1024, 16, 8, 64, 5, 4),
                                                   (512, 4, 2, 64, 100, 9)])
@pytest.mark.parametrize("min_chunk", [32, 64])
def test_qkv_accumulating_gemv_finished_by_flash_decoding(D, H, KV, hd, pos0, splits, min_chunk):
    """Decode's q|k|v GEMV in accumulating mode (fixed-point sums, no reduction tail; it adds the
    previous down projection's pending output to the residual first, and leaves the RMSNorm's 1/rms
    to its consumer) and the flash-decoding kernel that applies it and finishes q, k and v (per-head
    norm, RoPE, the newest K/V row into the cache) before
    attending, against NumPy: the rotated q, the cache rows and the attention output. Every other
    cache row must be left as it was; outputs are poisoned first. min_chunk moves the newest key to
    another split (the one that writes it)."""
    rng = np.random.default_rng()
    ctx, eps = pos0 + 4, 1e-6
    case = qkv_case(rng, D, H, KV, hd, ctx)
    cos, sin, mats, h, w, qn, kn = case
    pend = (rng.standard_normal(D) * 2**32).astype(np.int64)  # a pending projection output of ~N(0, 1)
    k_old = rng.standard_normal((ctx, KV, hd)).astype(np.float16)
    v_old = rng.standard_normal((ctx, KV, hd)).astype(np.float16)
    kc, vc = cp.asarray(k_old), cp.asarray(v_old)
    kc[pos0].fill(np.nan)
    vc[pos0].fill(np.nan)
    zero = cp.asarray(rng.integers(-2**40, 2**40, size=5000))  # another accumulator the GEMV clears
    qrot, hout, out, _, _ = qkv_then_flash_decoding(case, pend, kc, vc, zero, D, H, KV, hd, pos0, splits, min_chunk,
                                                    eps)
    assert int(cp.count_nonzero(zero)) == 0
    hs = h.astype(np.float64) + (pend / 2**32).astype(np.float16)
    np.testing.assert_allclose(cp.asnumpy(hout)[0], hs, rtol=1e-6, atol=1e-6)
    q_ref, k_ref, v = qkv_rope_ref(hs, w, mats, qn, kn, cos, sin, pos0, hd, eps)
    assert rel(cp.asnumpy(qrot), q_ref) < 1e-2
    assert rel(cp.asnumpy(kc)[pos0:pos0 + 1], k_ref) < 1e-2
    assert rel(cp.asnumpy(vc)[pos0:pos0 + 1], v) < 1e-2
    others = np.delete(np.arange(ctx), pos0)
    np.testing.assert_array_equal(cp.asnumpy(kc)[others], k_old[others])
    np.testing.assert_array_equal(cp.asnumpy(vc)[others], v_old[others])
    K_ref, V_ref = k_old.astype(np.float32), v_old.astype(np.float32)
    K_ref[pos0], V_ref[pos0] = k_ref[0], v[0]
    assert rel(cp.asnumpy(out), attention_ref(q_ref.astype(np.float16), K_ref, V_ref, pos0)) < 1e-2


def cm_or_skip(S, hb, hd):
    """Skips where this GPU or the shape cannot take flash decoding's merge by its clusters."""
    if not oc.attn_cluster_merge(S, hb, hd):
        pytest.skip("no cluster merge for this GPU or shape (sm_90, S <= 16, whole 16-byte pushes)")


def flash_decoding_asked_to_merge(H, KV, hd, n, splits):
    """Flash decoding over n fresh random keys (the length from device memory, 32 keys per split at least) with
    a poisoned merged output offered to its clusters and poisoned partials: (q, K, V as NumPy, merged, part_o,
    part_ml, the returned _AttnParts)."""
    q, Kc, Vc, part_o, part_ml = decode_inputs(np.random.default_rng(), H, KV, hd, n, splits)
    merged = nan_like((1, H * hd), cp.float16)
    parts = oc.attention_decode(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), -1, KV, splits, part_o, part_ml,
                                None, cp.full((1,), n - 1, cp.int32), min_chunk=32, merged=merged)
    return q, Kc, Vc, merged, part_o, part_ml, parts


# 8B's heads (4 per block), 235B's (8 query heads per KV head, 4 per block: two blocks), 2 and 1 per block
@pytest.mark.parametrize("H,KV,hd", [(32, 8, 128), (64, 4, 128), (4, 2, 64), (8, 8, 64)])
@pytest.mark.parametrize("n", [1, 31, 300, 513, 1000])
@pytest.mark.parametrize("splits", [1, 2, 8, 16])
def test_flash_decoding_merged_by_its_clusters(H, KV, hd, n, splits):
    """The splits of a head group as one cluster that merges them (attn_decode_gqa CM: each block pushes its
    partial to the elements' owners, st.async on mbarriers) into the fp16 attention output, against float64
    attention. The length comes from device memory, so at 1 and 31 keys most splits are empty and must add
    nothing; the global partials are never written (left NaN), and the output is poisoned first."""
    cm_or_skip(splits, oc.decode_heads_per_block(H, KV), hd)
    q, Kc, Vc, merged, part_o, part_ml, parts = flash_decoding_asked_to_merge(H, KV, hd, n, splits)
    assert parts.merged is merged
    assert rel(cp.asnumpy(merged), attention_ref(q, Kc, Vc, n - 1)) < 1e-2
    assert bool(cp.isnan(part_o).all()) and bool(cp.isnan(part_ml).all())


@pytest.mark.parametrize("splits", [8, 16])
def test_clusters_that_cannot_be_resident_leave_the_merge_to_o(splits, monkeypatch):
    """Where no cluster of S blocks can be resident (resident_clusters 0: a driver refusing 16-block clusters, a
    partitioned GPU), flash decoding runs its plain splits: the partials are written for the o GEMV to merge and
    the merged buffer is left as it was; the partials merged by attn_decode_combine match float64 attention."""
    H, KV, hd, n = 32, 8, 128, 700
    cm_or_skip(splits, oc.decode_heads_per_block(H, KV), hd)
    patch(monkeypatch, "_ATTN_CM_FNS", {})
    asked = []
    patch(monkeypatch, "resident_clusters", lambda fn, CL, n, threads, smem=0: asked.append(CL) or 0)
    q, Kc, Vc, merged, part_o, part_ml, parts = flash_decoding_asked_to_merge(H, KV, hd, n, splits)
    assert asked == [splits] and parts.merged is None and bool(cp.isnan(merged).all())
    out = oc.attention_combine(parts, nan_like((1, H * hd), cp.float16))
    assert rel(cp.asnumpy(out), attention_ref(q, Kc, Vc, n - 1)) < 1e-2


@pytest.mark.parametrize("D,H,KV,hd", [(4096, 32, 8, 128), (2048, 32, 4, 128), (512, 4, 2, 64)])
@pytest.mark.parametrize("pos0,splits,min_chunk", [(0, 16, 64), (512, 16, 64), (700, 16, 64), (1000, 16, 64),
                                                   (300, 16, 32), (40, 8, 32), (100, 4, 32)])
def test_qkv_finished_then_merged_by_clusters(D, H, KV, hd, pos0, splits, min_chunk):
    """Decode's q|k|v GEMV (accumulating) finished by flash decoding on its tensor-core path, the splits merged
    by their clusters, against NumPy (the cache row written, the attention output over the old rows and the
    new one), and against the same splits' global partials merged by attn_decode_combine (within 1e-3: the
    bitwise comparison with the o GEMV's own merge is test_o_gemv_on_cluster_merge_equals_its_own_merge)."""
    hb = oc.decode_heads_per_block(H, KV)
    cm_or_skip(splits, hb, hd)
    rng = np.random.default_rng()
    ctx, eps = pos0 + 4, 1e-6
    case = qkv_case(rng, D, H, KV, hd, ctx)
    pend = (rng.standard_normal(D) * 2**32).astype(np.int64)
    k_old = rng.standard_normal((ctx, KV, hd)).astype(np.float16)
    v_old = rng.standard_normal((ctx, KV, hd)).astype(np.float16)
    outs = {}
    for cm in (False, True):
        kc, vc = cp.asarray(k_old), cp.asarray(v_old)
        outs[cm] = qkv_then_flash_decoding(case, pend, kc, vc, cp.zeros((8,), cp.int64), D, H, KV, hd, pos0, splits,
                                           min_chunk, eps, cm=cm)
    qrot, hout, out, _, _ = outs[True]
    hs = case[3].astype(np.float64) + (pend / 2**32).astype(np.float16)
    q_ref, k_ref, v = qkv_rope_ref(hs, case[4], case[2], case[5], case[6], case[0], case[1], pos0, hd, eps)
    K_ref, V_ref = k_old.astype(np.float32), v_old.astype(np.float32)
    K_ref[pos0], V_ref[pos0] = k_ref[0], v[0]
    assert rel(cp.asnumpy(out), attention_ref(q_ref.astype(np.float16), K_ref, V_ref, pos0)) < 1e-2
    np.testing.assert_array_equal(cp.asnumpy(hout), cp.asnumpy(outs[False][1]))
    np.testing.assert_array_equal(cp.asnumpy(qrot), cp.asnumpy(outs[False][0]))
    assert rel(cp.asnumpy(out), cp.asnumpy(outs[False][2])) < 1e-3


@pytest.mark.parametrize("H,KV,hd,D", [(32, 8, 128, 4096), (32, 4, 128, 2048)])
@pytest.mark.parametrize("n", [1, 200, 513, 1000])
def test_o_gemv_on_cluster_merge_equals_its_own_merge(H, KV, hd, D, n, monkeypatch):
    """The o projection (accumulating) on the output the clusters merged is bitwise the o projection that
    merges the same splits' partials in its prologue with gemv_merge_span: the clusters' merge does the same
    operations in the same split order. Both against float64 attention @ W_o."""
    hb = oc.decode_heads_per_block(H, KV)
    splits = 16
    cm_or_skip(splits, hb, hd)
    tune(monkeypatch, gemv_o_merge_min_splits=0)  # gemv_merge_span at 16 splits
    rng = np.random.default_rng()
    Kc = cp.asarray(rng.standard_normal((n, KV, hd)).astype(np.float16))
    Vc = cp.asarray(rng.standard_normal((n, KV, hd)).astype(np.float16))
    q = rng.standard_normal((1, H, hd)).astype(np.float16)
    m, r = rand_awq(rng, H * hd, D)
    partial = cp.empty((oc.gemv_partial_size(H * hd, [D]),), cp.float32)
    pos = cp.full((1,), n - 1, cp.int32)
    accs = {}
    for cm in (False, True):
        part_o, part_ml = nan_like((H * splits * hd,), cp.float32), nan_like((H * splits * 2,), cp.float32)
        parts = oc.attention_decode(cp.asarray(q), Kc, Vc, -1, KV, splits, part_o, part_ml, None, pos, min_chunk=64,
                                    o_merge=True, merged=nan_like((1, H * hd), cp.float16) if cm else None)
        assert (parts.merged is not None) == cm
        acc = cp.zeros((D,), cp.int64)
        oc.gemv(None, [m], "plain", None, partial, att=parts, acc_out=acc)
        accs[cm] = cp.asnumpy(acc)
    np.testing.assert_array_equal(accs[True], accs[False])
    att = attention_ref(q, cp.asnumpy(Kc), cp.asnumpy(Vc), n - 1).reshape(-1).astype(np.float16).astype(np.float64)
    assert rel(accs[True].astype(np.float64) / 2**32, att @ r) < 1e-2


@pytest.mark.parametrize("D,H,KV,hd,hb", [(4096, 32, 8, 128, 4), (2048, 32, 4, 128, 4), (2048, 32, 4, 128, 8),
                                         (1024, 8, 8, 128, 4), (1024, 16, 8, 64, 4)])
@pytest.mark.parametrize("pos0", [0, 14, 16, 47, 63, 300, 777, 1100, 2047, 2100, 5000])
@pytest.mark.parametrize("min_chunk", [32, 64])
@pytest.mark.parametrize("long_path", ["mma", "scalar"])
def test_flash_decoding_split_partials(D, H, KV, hd, hb, pos0, min_chunk, long_path, monkeypatch):
    """Every split's partial softmax (part_o, part_ml: the log2-domain max, the sum and the unnormalised
    output) against float64 over the split's own keys, from the q and cache rows the kernel itself
    wrote, so nothing but the split's arithmetic is compared, to 1e-5. Short contexts take the
    tensor-core path (at most 64 keys per split, all staged; tiles of 16 keys partly past the split's
    end at 15, 47, 49 keys). Longer splits take the long tensor-core path (mma: tiles of 64 keys through
    two buffers, the last tile partly past the split's end at 69 and 132 keys, whole at 128; the newest
    key in a tile copied after the wait at 1101 and 2048 keys, in one the loop copies at 5001) or the
    scalar loop. 8 heads per block (hb 8): the whole GQA group of 30B-A3B as the MMA's 8 columns. fp16 P
    in the P V product would miss by ~1e-4."""
    if long_path == "scalar" and pos0 < 1100:
        pytest.skip("short splits: the same path either way")
    tune(monkeypatch, attn_mma_long=long_path == "mma")
    tune(monkeypatch, attn_max_heads_per_block=hb)
    rng = np.random.default_rng()
    splits, ctx = 16, pos0 + 4
    case = qkv_case(rng, D, H, KV, hd, ctx)
    pend = (rng.standard_normal(D) * 2**32).astype(np.int64)
    kc = cp.asarray(rng.standard_normal((ctx, KV, hd)).astype(np.float16))
    vc = cp.asarray(rng.standard_normal((ctx, KV, hd)).astype(np.float16))
    qrot, _, _, part_o, part_ml = qkv_then_flash_decoding(case, pend, kc, vc, cp.zeros((8,), cp.int64), D, H, KV, hd,
                                                          pos0, splits, min_chunk, 1e-6)
    n = pos0 + 1
    chunk = max(-(-n // splits), min_chunk)
    q = cp.asnumpy(qrot)[0].astype(np.float64)
    K, V = cp.asnumpy(kc)[:n].astype(np.float64), cp.asnumpy(vc)[:n].astype(np.float64)
    po = cp.asnumpy(part_o).reshape(H, splits, hd).astype(np.float64)
    pml = cp.asnumpy(part_ml).reshape(H, splits, 2).astype(np.float64)
    got, ref = {"ml": [], "o": []}, {"ml": [], "o": []}
    for hh in range(H):
        kh = hh // (H // KV)
        for s in range(-(-n // chunk)):
            keys = slice(s * chunk, min(n, (s + 1) * chunk))
            sc = K[keys, kh] @ q[hh] * (math.log2(math.e) / math.sqrt(hd))
            p = np.exp2(sc - sc.max())
            got["ml"].append(pml[hh, s])
            ref["ml"].append([sc.max(), p.sum()])
            got["o"].append(po[hh, s] / pml[hh, s, 1])
            ref["o"].append(p @ V[keys, kh] / p.sum())
    for part in ("ml", "o"):
        assert rel(np.array(got[part]), np.array(ref[part])) < 1e-5, part
