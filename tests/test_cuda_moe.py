"""The GPU MoE stages against their NumPy references (kuiper_py/moe_ref.py), at the real Qwen3-30B-A3B
layer shapes (hidden 2048, 128 experts, 8 per token, expert intermediate 768) and token counts 1, 7
and 2048, then the whole MoE models end to end against the CPU engine (device machine only).

Outputs are poisoned (NaN, -1) before each kernel; inputs are fresh random draws. Each stage is fed
the reference's output of the stage before, so a failure names its stage.
"""
import math
import types

import numpy as np
import pytest

from conftest import slow_cases
from kuiper_py.cuda import settings as cfg
from kuiper_py import moe_ref, synth
from kuiper_py.export import export
from kuiper_py.loader import AwqStack, load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps, awq_linear, silu
from reference import (PROMPT, assert_arena_prefills_same_bits, assert_as_accurate, assert_chat_accurate,
                       assert_greedy_up_to_a_tie,
                       assert_prefill_graphs_accurate, cluster_plan_or_skip, forget_zeroed_counters,
                       decode_cluster_merge_ab, decode_logits, decode_step_twice, greedy_lockstep, pending_row_inputs,
                       rand_awq_tensors, record_calls, rel, tune)

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")

D, E, K_TOP, INTER, G = 2048, 128, 8, 768, 128
# a 2048-token prompt in the stage tests is the slow tier's (3.9, 5.9 and 7.2 s on an H100): the fast tier's longest,
# 300 tokens, already gives experts of many tiles whose last tile ends inside the expert
PROMPT_2048 = pytest.param(2048, marks=pytest.mark.slow)


def rand_stack(rng, n_exp, K, N, segments=1):
    qw, qz, sc = rand_awq_tensors(rng, K, N, G, experts=n_exp)
    return AwqStack(qw, qz, sc, G), oc.device_linear(AwqStack(qw, qz, sc, G), segments)  # as the loader uploads


DEAD = np.arange(5, E, 9)  # experts whose router row makes them lose against inputs with x >= 0


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng()
    w13, w13_d = rand_stack(rng, E, D, 2 * INTER, segments=2)  # [gate | up]: two tiled matrices
    w2, w2_d = rand_stack(rng, E, INTER, D)
    router = (rng.standard_normal((E, D)) / math.sqrt(D)).astype(np.float16)
    router[DEAD] = -1 / math.sqrt(D)  # logit ~ -36 for |N(0,1)| inputs: these experts receive no tokens
    return dict(w13=w13, w13_d=w13_d, w2=w2, w2_d=w2_d, router=router, router_d=cp.asarray(router))


def poisoned(shape, dtype):
    return cp.full(shape, -1 if np.dtype(dtype).kind == "i" else np.nan, dtype=dtype)


def assert_same_topk(ids, ids_ref, logits64, tie=1e-5):
    """ids equal to the reference's, except that experts whose exact (float64) logits are within `tie`
    of each other may trade places: fp32 sums in another order can flip such a near tie. A flipped
    row must still be a valid top-k in the exact logits, and flips must stay rare (< 1% of tokens)."""
    bad = np.flatnonzero((ids != ids_ref).any(axis=1))
    assert len(bad) <= max(1, len(ids) // 100), f"{len(bad)} of {len(ids)} tokens routed differently"
    k = ids.shape[1]
    for t in bad:
        lg = logits64[t]
        kth = np.sort(lg)[::-1][k - 1]
        assert len(set(ids[t])) == k and (lg[ids[t]] >= kth - tie).all(), (t, ids[t], ids_ref[t])
        assert (np.diff(lg[ids[t]]) <= tie).all(), (t, ids[t], ids_ref[t])  # still in descending order


@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("T", [1, 7, PROMPT_2048])
def test_moe_stages_match_reference(layer, T, norm_topk):
    rng = np.random.default_rng()
    x = np.abs(rng.standard_normal((T, D))).astype(np.float16)
    xd = cp.asarray(x)
    n = T * K_TOP

    # 1. routing
    ids_ref, w_ref = moe_ref.route(x.astype(np.float32), layer["router"], K_TOP, norm_topk)
    ids, w = oc.moe_route(xd, layer["router_d"], K_TOP, norm_topk, poisoned((T, E), np.float32),
                          poisoned((T, K_TOP), np.int32), poisoned((T, K_TOP), np.float32))
    assert_same_topk(cp.asnumpy(ids), ids_ref, x.astype(np.float64) @ layer["router"].T.astype(np.float64))
    assert rel(cp.asnumpy(w), w_ref) < 1e-5
    if norm_topk:
        assert np.allclose(cp.asnumpy(w).sum(axis=1), 1.0, atol=1e-5)

    # 2. expert maps
    counts_ref, offsets_ref, p2u_ref, u2p_ref = moe_ref.expert_maps(ids_ref, E)
    ids_d = cp.asarray(ids_ref)
    maps = tuple(poisoned((m,), np.int32) for m in (E, E + 1, E + 1, n, n))
    counts, offsets, tiles, p2u, u2p = oc.moe_maps(ids_d, E, out=maps)
    assert (counts_ref[DEAD] == 0).all()  # experts that receive no tokens are part of every case
    np.testing.assert_array_equal(cp.asnumpy(counts), counts_ref)
    np.testing.assert_array_equal(cp.asnumpy(offsets), offsets_ref)
    np.testing.assert_array_equal(cp.asnumpy(p2u), p2u_ref)
    np.testing.assert_array_equal(cp.asnumpy(u2p), u2p_ref)
    tiles_ref = np.concatenate([[0], np.cumsum((counts_ref + 63) // 64)])
    np.testing.assert_array_equal(cp.asnumpy(tiles), tiles_ref)

    # 3. gather + grouped gate|up GEMM + SwiGLU
    act_ref = moe_ref.grouped_gemm1_swiglu(moe_ref.gather(x.astype(np.float32), p2u_ref, K_TOP), offsets_ref,
                                           layer["w13"])
    act = oc.moe_gemm_gate_up(xd, layer["w13_d"], offsets, tiles, p2u, K_TOP, out=poisoned((n, INTER), np.float16))
    assert rel(cp.asnumpy(act), act_ref) < 1e-2

    # 4. grouped down GEMM (on the reference's activations, rounded as the GPU stores them)
    act16 = act_ref.astype(np.float16)
    y_ref = moe_ref.grouped_gemm2(act16.astype(np.float32), offsets_ref, layer["w2"])
    y = oc.moe_gemm_down(cp.asarray(act16), layer["w2_d"], offsets, tiles, out=poisoned((n, D), np.float16))
    assert rel(cp.asnumpy(y), y_ref) < 1e-2

    # 5. finalize
    y16 = y_ref.astype(np.float16)
    out_ref = moe_ref.finalize(y16.astype(np.float32), u2p_ref, w_ref)
    out = oc.moe_finalize(cp.asarray(y16), u2p, cp.asarray(w_ref), out=poisoned((T, D), np.float16))
    assert rel(cp.asnumpy(out), out_ref) < 1e-3

    # decode path: the expert GEMVs over the selected experts, ids and weights from device memory
    if T == 1:
        full_ref = moe_ref.finalize(moe_ref.grouped_gemm2(act_ref, offsets_ref, layer["w2"]), u2p_ref, w_ref)
        S = max(oc.gemv_partial_size(D, [INTER, INTER], K_TOP), oc.gemv_partial_size(INTER, [D], K_TOP))
        got = oc.moe_decode(xd, layer["w13_d"], layer["w2_d"], ids_d, cp.asarray(w_ref),
                            poisoned((S,), np.float32), poisoned((K_TOP, INTER), np.float16),
                            poisoned((1, D), np.float16))
        assert rel(cp.asnumpy(got), full_ref) < 1e-2
        # accumulating mode: the slots' [gate | up] sums and the weighted sum in fixed point (accumulators
        # zero before), SwiGLU in the down GEMV's prologue; a neighbour accumulator cleared on the way
        gu, yacc = cp.zeros((K_TOP, 2 * INTER), cp.int64), cp.zeros((D,), cp.int64)
        zero = cp.full((999,), 7, cp.int64)
        oc.moe_decode(xd, layer["w13_d"], layer["w2_d"], ids_d, cp.asarray(w_ref), poisoned((S,), np.float32),
                      None, None, zero=zero, acc=(gu, yacc))
        gu_ref = np.concatenate([awq_linear(x.astype(np.float32), layer["w13"].expert(e)) for e in ids_ref[0]])
        assert rel(cp.asnumpy(gu).astype(np.float64) / 2**32, gu_ref) < 1e-2
        assert rel(cp.asnumpy(yacc).astype(np.float64) / 2**32, full_ref[0]) < 1e-2
        assert int(cp.count_nonzero(zero)) == 0


def row_rel(got, ref):
    """The largest relative error of one row (a wrong or unwritten row cannot hide in the whole's norm)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float((np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)).max())


def rs_form_ids(form):
    return f"{form[0]}rows-{form[1]}st-{form[2]}wg"


def expert_half_refs(layer, T: int):
    """moe_ref's expert half of T random tokens (x >= 0, so the DEAD experts receive none): x, the picks (ids, w),
    the maps (counts, offsets, p2u, u2p), the gathered rows xp, gate|up gu [n, 2I], the fp16 SwiGLU act16, down y
    on act16 and the finalized out: what the Hopper grouped GEMMs' stage tests compare each stage with."""
    rng = np.random.default_rng()
    x = np.abs(rng.standard_normal((T, D))).astype(np.float16)
    ids, w = moe_ref.route(x.astype(np.float32), layer["router"], K_TOP, True)
    counts, offsets, p2u, u2p = moe_ref.expert_maps(ids, E)
    assert (counts[DEAD] == 0).all()
    xp = moe_ref.gather(x, p2u, K_TOP)
    gu = moe_ref.grouped_gemm2(xp.astype(np.float32), offsets, layer["w13"])  # [n, 2I]: gate | up
    act16 = (silu(gu[:, :INTER]) * gu[:, INTER:]).astype(np.float16)
    y = moe_ref.grouped_gemm2(act16.astype(np.float32), offsets, layer["w2"])
    out = moe_ref.finalize(moe_ref.grouped_gemm2(
        moe_ref.grouped_gemm1_swiglu(xp.astype(np.float32), offsets, layer["w13"]), offsets, layer["w2"]), u2p, w)
    return types.SimpleNamespace(x=x, n=T * K_TOP, ids=ids, w=w, counts=counts, offsets=offsets, p2u=p2u, u2p=u2p,
                                 xp=xp, gu=gu, act16=act16, y=y, out=out)


def check_experts_at_235b_shapes(rows: int, T: int, gate_up, down):
    """A grouped GEMM pair at Qwen3-235B-A22B's expert shapes (hidden 4096, expert intermediate 1536: 12 column tiles
    of gate|up, 16 of down, K 4096 and 1536) on 16 of its experts, T tokens routed at random (expert 0 empty, expert
    1 in more than two tiles of `rows`, so a tile ends inside an expert), every row against moe_ref with poisoned
    outputs. gate_up(x [T, D] on the device, w13, offsets, tiles, p2u, k, out), down(act, w2, offsets, tiles, out)."""
    rng = np.random.default_rng()
    Db, Ib, Eb, kb = 4096, 1536, 16, 8
    w13, w13_d = rand_stack(rng, Eb, Db, 2 * Ib, segments=2)
    w2, w2_d = rand_stack(rng, Eb, Ib, Db)
    # every token picks expert 1 and 7 distinct others of 2..15; expert 0 none
    ids = np.stack([np.concatenate([[1], rng.choice(np.arange(2, Eb), kb - 1, replace=False)])
                    for _ in range(T)]).astype(np.int32)
    counts, offsets, p2u, _ = moe_ref.expert_maps(ids, Eb)
    assert counts[0] == 0 and counts[1] > 2 * rows
    n = T * kb
    _, offs, tiles, p2u_d, _ = oc.moe_maps(cp.asarray(ids), Eb, tile_m=rows)
    x = rng.standard_normal((T, Db)).astype(np.float16)
    xp_ref = moe_ref.gather(x, p2u, kb)
    gu = gate_up(cp.asarray(x), w13_d, offs, tiles, p2u_d, kb, poisoned((n, 2 * Ib), np.float16))
    assert row_rel(cp.asnumpy(gu), moe_ref.grouped_gemm2(xp_ref.astype(np.float32), offsets, w13)) < 5e-3
    act = (rng.standard_normal((n, Ib)) * 0.5).astype(np.float16)
    y = down(cp.asarray(act), w2_d, offs, tiles, poisoned((n, Db), np.float16))
    assert row_rel(cp.asnumpy(y), moe_ref.grouped_gemm2(act.astype(np.float32), offsets, w2)) < 5e-3


def rs_form_or_skip(monkeypatch, form) -> int:
    """Makes gemm_moe_rs take `form` (rows per tile, stages, warpgroups) for its row count, which it returns,
    or skips where the kernel does not run."""
    if not oc.wgmma_available():
        pytest.skip("gemm_moe_rs needs compute capability 9.0")
    monkeypatch.setitem(oc.MOE_RS_FORMS, form[0], form[1:])
    tune(monkeypatch, moe_tc="0")  # (moe_experts' rs path is gemm_moe_rs at every length)
    return form[0]


@pytest.mark.parametrize("form", oc.MOE_RS_FORMS_ALL, ids=rs_form_ids)
@pytest.mark.parametrize("T", [1, 7, 300, PROMPT_2048])
def test_moe_rs_stages_match_reference(layer, T, form, monkeypatch):
    """Prefill's expert half on the Hopper path (gemm_wgmma.cu gemm_moe_rs) in each
    compiled form (rows per tile, stages, consumer warpgroups): the expert maps in tiles of those rows,
    the rows gathered per expert, the grouped gate|up and down GEMMs, each stage against moe_ref with poisoned
    outputs; then moe_experts whole, on this path and on the mma.sync one, against moe_ref's pipeline. Experts
    with no tokens are part of every case (DEAD)."""
    bt = rs_form_or_skip(monkeypatch, form)
    r = expert_half_refs(layer, T)
    n, ids_d = r.n, cp.asarray(r.ids)
    maps = tuple(poisoned((m,), np.int32) for m in (E, E + 1, E + 1, n, n))
    counts, offsets, tiles, p2u, u2p = oc.moe_maps(ids_d, E, out=maps, tile_m=bt)
    np.testing.assert_array_equal(cp.asnumpy(tiles), np.concatenate([[0], np.cumsum((r.counts + bt - 1) // bt)]))
    np.testing.assert_array_equal(cp.asnumpy(p2u), r.p2u)

    xp = oc.moe_gather(cp.asarray(r.x), p2u, K_TOP, out=poisoned((n, D), np.float16))
    np.testing.assert_array_equal(cp.asnumpy(xp), r.xp)

    gu = oc.gemm_moe_rs(xp, layer["w13_d"], offsets, tiles, bt, out=poisoned((n, 2 * INTER), np.float16))
    assert row_rel(cp.asnumpy(gu), r.gu) < 5e-3

    y = oc.gemm_moe_rs(cp.asarray(r.act16), layer["w2_d"], offsets, tiles, bt, out=poisoned((n, D), np.float16))
    assert row_rel(cp.asnumpy(y), r.y) < 5e-3

    for rs in (True, False):
        got = oc.moe_experts(cp.asarray(r.x), layer["w13_d"], layer["w2_d"], ids_d, cp.asarray(r.w), rs=rs)
        assert row_rel(cp.asnumpy(got), r.out) < 1e-2, rs


# the 235B-shape checks (4 s each on an H100) run one form in the fast tier, whose stage sweeps run every form
@pytest.mark.parametrize("form", slow_cases(oc.MOE_RS_FORMS_ALL, oc.MOE_RS_FORMS_ALL[1:]), ids=rs_form_ids)
def test_gemm_moe_rs_at_235b_shapes(form, monkeypatch):
    """gemm_moe_rs (each compiled form, its gate|up on the gathered rows) at Qwen3-235B-A22B's expert shapes
    (check_experts_at_235b_shapes)."""
    bt = rs_form_or_skip(monkeypatch, form)
    check_experts_at_235b_shapes(
        bt, 2 * bt + 20,
        lambda x, w, offs, tiles, p2u, k, out: oc.gemm_moe_rs(oc.moe_gather(x, p2u, k), w, offs, tiles, bt, out=out),
        lambda act, w, offs, tiles, out: oc.gemm_moe_rs(act, w, offs, tiles, bt, out=out))


@pytest.mark.parametrize("tm", oc.MOE_TC_TILES)
@pytest.mark.parametrize("T", [1, 7, 300, PROMPT_2048])
def test_moe_tc_stages_match_reference(layer, T, tm, monkeypatch):
    """Prefill's expert half on gemm_moe_tc (the batched GEMV on tensor cores for few rows per expert) in tiles of tm rows: gate|up reading the token rows through perm_to_unperm, down on permuted rows,
    each against moe_ref with poisoned outputs; then moe_experts whole on that path against moe_ref's pipeline.
    Experts with no tokens are part of every case (DEAD); 300 and 2048 tokens give experts of many tiles, whose
    last tile ends inside the expert."""
    r = expert_half_refs(layer, T)
    n, ids_d = r.n, cp.asarray(r.ids)
    _, offsets, tiles, p2u, u2p = oc.moe_maps(ids_d, E, tile_m=tm)
    np.testing.assert_array_equal(cp.asnumpy(tiles), np.concatenate([[0], np.cumsum((r.counts + tm - 1) // tm)]))

    gu = oc.gemm_moe_tc(cp.asarray(r.x), layer["w13_d"], offsets, tiles, tm, out=poisoned((n, 2 * INTER), np.float16),
                        p2u=p2u, k=K_TOP)
    assert row_rel(cp.asnumpy(gu), r.gu) < 5e-3

    y = oc.gemm_moe_tc(cp.asarray(r.act16), layer["w2_d"], offsets, tiles, tm, out=poisoned((n, D), np.float16))
    assert row_rel(cp.asnumpy(y), r.y) < 5e-3

    tune(monkeypatch, moe_tc="auto")
    tune(monkeypatch, moe_tc_max_mean=1e9)
    tune(monkeypatch, moe_tc_t16_max=1e9 if tm == 16 else 0)
    assert oc.moe_experts_tile(layer["w13_d"], layer["w2_d"], n, rs=True) == (True, tm)
    calls = record_calls(monkeypatch, "gemm_moe_tc", lambda *a, **kw: a[4])
    got = oc.moe_experts(cp.asarray(r.x), layer["w13_d"], layer["w2_d"], ids_d, cp.asarray(r.w), rs=True)
    assert calls == [tm, tm]
    assert row_rel(cp.asnumpy(got), r.out) < 1e-2


@pytest.mark.parametrize("tm", slow_cases(oc.MOE_TC_TILES, oc.MOE_TC_TILES[1:]))
def test_gemm_moe_tc_at_235b_shapes(tm):
    """gemm_moe_tc (16- and 32-row tiles, its gate|up reading the token rows through the permutation) at
    Qwen3-235B-A22B's expert shapes (check_experts_at_235b_shapes)."""
    check_experts_at_235b_shapes(
        tm, 2 * tm + 5,
        lambda x, w, offs, tiles, p2u, k, out: oc.gemm_moe_tc(x, w, offs, tiles, tm, out=out, p2u=p2u, k=k),
        lambda act, w, offs, tiles, out: oc.gemm_moe_tc(act, w, offs, tiles, tm, out=out))


def test_moe_rs_path_taken_where_it_fits(layer, monkeypatch):
    """moe_rs_path: the 30B-A3B-shaped stacks take gemm_moe_rs on compute capability 9.0 unless MOE_RS=0;
    tiny-moe's hidden size of 128 (no whole 256-column tile) never does; moe_rs_tile by the mean rows."""
    assert oc.moe_rs_path(layer["w13_d"], layer["w2_d"]) == oc.wgmma_available()
    tune(monkeypatch, moe_rs="0")
    assert not oc.moe_rs_path(layer["w13_d"], layer["w2_d"])
    assert not oc.moe_rs_fits(128, 128, 128) and oc.moe_rs_fits(2048, 768, 128) and not oc.moe_rs_fits(2048, 832, 128)
    assert oc.moe_rs_fits(2048, 768, 64) and not oc.moe_rs_fits(2048, 768, 192)  # groups 64 << n only
    tune(monkeypatch, moe_rs_bt128_from=64)
    assert oc.moe_rs_tile(64 * E - 1, E) == 64 and oc.moe_rs_tile(64 * E, E) == 128


@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("pending", [False, True])
def test_moe_route_decode_fuses_norm_router_topk(layer, norm_topk, pending):
    """Decode's one-kernel routing: x = rmsnorm(h) * w (fp16) stored for the experts, then the same
    experts and weights as the reference routes for that x; launched twice on fresh inputs (the
    arrival counter must be left at zero), outputs poisoned each time. pending: the o projection's
    sums of accumulating mode (int64, 32 fraction bits) still to be added, the new row h + fp16(o)
    stored to hout and normalised; h itself unchanged."""
    rng = np.random.default_rng()
    counter = cp.zeros((1,), cp.int32)
    for _ in range(2):
        h = (rng.standard_normal((1, D)) * 3).astype(np.float32)
        w = (rng.random(D) + 0.5).astype(np.float16)
        xout, logits = poisoned((1, D), np.float16), poisoned((E,), np.float32)
        pend = hout = None
        row = h
        if pending:
            y = rng.standard_normal(D) * 2
            pend, hout = cp.asarray((y * 2**32).astype(np.int64)), poisoned((1, D), np.float32)
            row = h + (cp.asnumpy(pend) / 2**32).astype(np.float16).astype(np.float32)  # fp32 add of fp16(y)
        h_dev = cp.asarray(h)
        ids, wts = oc.moe_route_decode(h_dev, cp.asarray(w), 1e-6, layer["router_d"], K_TOP, norm_topk,
                                       logits, xout, poisoned((1, K_TOP), np.int32),
                                       poisoned((1, K_TOP), np.float32), counter, pend, hout)
        if pending:
            np.testing.assert_array_equal(cp.asnumpy(hout), row)
            np.testing.assert_array_equal(cp.asnumpy(h_dev), h)
        h64 = row.astype(np.float64)
        x_ref = (h64 / np.sqrt(np.mean(h64 * h64) + 1e-6) * w).astype(np.float16)
        x = cp.asnumpy(xout)
        assert rel(x, x_ref) < 2e-3
        ids_ref, w_ref = moe_ref.route(x.astype(np.float32), layer["router"], K_TOP, norm_topk)
        assert_same_topk(cp.asnumpy(ids), ids_ref, x.astype(np.float64) @ layer["router"].T.astype(np.float64))
        assert rel(cp.asnumpy(wts), w_ref) < 1e-5
        assert int(counter[0]) == 0


@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_route_decode_topk_matches_prefill_topk_with_ties(layer, norm_topk):
    """The decode router's top-k gives the prefill top-k kernel's (moe_topk, run on the logits the
    router wrote) ids and weights bit for bit, tied experts included: four router rows are equal and
    far ahead, so ids 3, 7, 11, 20 must come first, in id order (the reference's stable sort)."""
    rng = np.random.default_rng()
    router = layer["router"].copy()
    router[[3, 7, 11, 20]] = np.float16(2 / math.sqrt(D))  # x > 0 below: these four tie at the top
    router_d = cp.asarray(router)
    counter = cp.zeros((1,), cp.int32)
    for _ in range(2):
        h = (np.abs(rng.standard_normal((1, D))) + 0.1).astype(np.float32)
        w = (rng.random(D) + 0.5).astype(np.float16)
        logits = poisoned((E,), np.float32)
        ids, wts = oc.moe_route_decode(cp.asarray(h), cp.asarray(w), 1e-6, router_d, K_TOP, norm_topk, logits,
                                       poisoned((1, D), np.float16), poisoned((1, K_TOP), np.int32),
                                       poisoned((1, K_TOP), np.float32), counter)
        ids_w, wts_w = poisoned((1, K_TOP), np.int32), poisoned((1, K_TOP), np.float32)
        oc.kernel("moe", "moe_topk")((1,), (256,), (logits, ids_w, wts_w, np.int32(1), np.int32(E), np.int32(K_TOP),
                                                     np.int32(int(norm_topk))))
        np.testing.assert_array_equal(cp.asnumpy(ids), cp.asnumpy(ids_w))
        np.testing.assert_array_equal(cp.asnumpy(wts), cp.asnumpy(wts_w))
        assert cp.asnumpy(ids)[0, :4].tolist() == [3, 7, 11, 20]
        assert int(counter[0]) == 0


def tied_logits(rng, T, n_exp, k):
    """T rows of logits drawn from 9 values (2.0 the largest), so that most top-k picks are among exact ties:
    rows [0, T/4) with k + 3 more 2.0s at the lowest ids, rows [T/4, T/2) the same rows reversed (those
    2.0s at the highest ids), the rest as drawn."""
    lg = (rng.integers(-4, 5, size=(T, n_exp)) * 0.5).astype(np.float32)
    q = T // 4
    lg[:q, : min(k + 3, n_exp)] = 2.0
    lg[q: 2 * q] = lg[:q, ::-1]
    return lg


@pytest.mark.parametrize("n_exp,k", [(128, 8), (256, 8), (60, 4), (8, 8), (33, 1), (200, 32)])
def test_moe_topk_picks_as_a_stable_sort_with_many_ties(n_exp, k):
    """moe_topk (common.cuh moe_topk_pick: per round, each lane's best entry by a tree of comparisons,
    then the warp's) against NumPy's stable sort of the logits, on tied_logits: the ids in order, ties to
    the lower id, and the softmax weights."""
    rng = np.random.default_rng()
    T = 64
    lg = tied_logits(rng, T, n_exp, k)
    ids_ref = np.argsort(-lg, axis=1, kind="stable")[:, :k]
    p = np.exp(lg.astype(np.float64) - lg.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    for norm_topk in (True, False):
        ids, wts = poisoned((T, k), np.int32), poisoned((T, k), np.float32)
        oc.kernel("moe", "moe_topk")(((T + 7) // 8,), (256,), (cp.asarray(lg), ids, wts, np.int32(T), np.int32(n_exp),
                                                              np.int32(k), np.int32(int(norm_topk))))
        np.testing.assert_array_equal(cp.asnumpy(ids), ids_ref)
        w_ref = np.take_along_axis(p, ids_ref, axis=1)
        if norm_topk:
            w_ref /= w_ref.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(cp.asnumpy(wts), w_ref, rtol=1e-5)


@pytest.mark.parametrize("n_exp,k,dim", [(E, K_TOP, D), (60, 4, 256), (200, 8, 4096), (8, 2, 128), (256, 8, 2048),
                                         (33, 1, 96)])
@pytest.mark.parametrize("T", [1, 15, 17, 300, 2048])
@pytest.mark.parametrize("path", ["mma8", "mma16", "mma8s", "mma16s", "cuda"])
def test_moe_route_logits_and_picks(n_exp, k, dim, T, path, monkeypatch):
    """moe_route's two paths, moe_route_mma (the logits on tensor cores, the softmax and top-k in the same
    launch; its 8- and 16-warp forms at every T) and "cuda" (moe_router_logits or the fp32 cuBLAS GEMM, then
    moe_topk), against float64: every
    logit within the fp32 bound of a chain of D / 16 sums (4e-5 of sum |x_i r_i|, the row's absolute
    products), the ids the exact logits' top-k (experts whose exact logits lie within that bound may trade
    places: assert_same_topk), the weights the softmax of the kernel's own logits over its picks. Outputs
    poisoned; 33 experts and D = 96 leave a partial expert group and an odd chunk count."""
    tune(monkeypatch, moe_router="cuda" if path == "cuda" else "mma")
    tune(monkeypatch, moe_route_wide_t=1 << 30 if path.startswith("mma16") else 0)
    tune(monkeypatch, moe_route_splits="3" if path.endswith("s") else "1")  # (3: uneven chunk ranges)
    rng = np.random.default_rng()
    x = rng.standard_normal((T, dim)).astype(np.float16)
    router = (rng.standard_normal((n_exp, dim)) / math.sqrt(dim)).astype(np.float16)
    x64, r64 = x.astype(np.float64), router.astype(np.float64)
    lg64 = x64 @ r64.T
    bound = 4e-5 * (np.abs(x64) @ np.abs(r64).T)
    calls = record_calls(monkeypatch, "kernel", lambda family, name: name)
    ng = 4 if n_exp <= 128 else 8
    warps = 16 if path.startswith("mma16") else 8
    split = "_split" if path.endswith("s") and oc.moe_route_splits(T, dim, warps, ng) > 1 else ""
    launches = ([f"moe_route_mma{split}<{ng}, {8 // ng}>"] if path.startswith("mma8") else
                [f"moe_route_mma{split}<{ng}, {16 // ng}>"] if path.startswith("mma16") else
                ["moe_topk"] if T >= cfg.SETTINGS.moe_router_gemm_min_t else ["moe_router_logits", "moe_topk"])
    for norm_topk in (True, False):
        lg, ids, w = poisoned((T, n_exp), np.float32), poisoned((T, k), np.int32), poisoned((T, k), np.float32)
        del calls[:]
        oc.moe_route(cp.asarray(x), cp.asarray(router), k, norm_topk, lg, ids, w)
        assert calls == launches
        got, ids = cp.asnumpy(lg), cp.asnumpy(ids)
        assert (np.abs(got - lg64) <= bound).all(), np.abs(got - lg64).max()
        ids_ref = np.argsort(-lg64, axis=1, kind="stable")[:, :k]
        assert_same_topk(ids, ids_ref, lg64, tie=float(bound.max()))
        p = np.exp(got.astype(np.float64) - got.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        w_ref = np.take_along_axis(p, ids, axis=1)
        if norm_topk:
            w_ref /= w_ref.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(cp.asnumpy(w), w_ref, rtol=1e-5)


def test_moe_route_mma_form_by_token_count(monkeypatch):
    """moe_route takes moe_route_mma's 16-warp form up to moe_route_wide_t() tokens (unset: 16 per SM) and its 8-warp
    form above."""
    tune(monkeypatch, moe_router="mma")
    calls = record_calls(monkeypatch, "kernel", lambda family, name: name)
    router = cp.asarray((np.random.default_rng().standard_normal((128, 64)) / 8).astype(np.float16))
    tune(monkeypatch, moe_route_wide_t=None)
    wide = oc.moe_route_wide_t()
    assert wide == 16 * oc.sm_count()
    tune(monkeypatch, moe_route_splits="1")
    for T, name in ((wide, "moe_route_mma<4, 4>"), (wide + 1, "moe_route_mma<4, 2>")):
        del calls[:]
        oc.moe_route(cp.ones((T, 64), cp.float16), router, 8, True)
        assert calls == [name]


@pytest.mark.parametrize("n_exp,k", [(128, 8), (256, 8), (60, 4), (33, 1), (200, 32)])
@pytest.mark.parametrize("wide_t", [0, 1 << 30])
def test_moe_route_mma_picks_as_a_stable_sort_with_many_ties(n_exp, k, wide_t, monkeypatch):
    """moe_route_mma's top-k (8- and 16-warp forms) on exactly representable logits with many ties
    (tied_logits: each logit a multiple of 0.5, made as x . router with x a one-hot row and the router holding
    the logits): the ids of NumPy's stable sort (ties to the lower id), as moe_topk gives them."""
    tune(monkeypatch, moe_route_wide_t=wide_t)
    rng = np.random.default_rng()
    T, dim = 64, 128
    lg = tied_logits(rng, T, n_exp, k)
    x = np.zeros((T, dim), np.float16)
    x[np.arange(T), np.arange(T) % dim] = 1.0
    router = np.zeros((n_exp, dim), np.float16)
    router[:, :T] = lg.T  # logit (t, e) = router[e, t]
    ids, w = poisoned((T, k), np.int32), poisoned((T, k), np.float32)
    lgd = poisoned((T, n_exp), np.float32)
    oc.moe_route(cp.asarray(x), cp.asarray(router), k, True, lgd, ids, w)
    np.testing.assert_array_equal(cp.asnumpy(lgd), lg)
    np.testing.assert_array_equal(cp.asnumpy(ids), np.argsort(-lg, axis=1, kind="stable")[:, :k])


@pytest.mark.parametrize("n_exp,k", [(E, K_TOP), (256, 8), (60, 4), (33, 1), (200, 32)])
@pytest.mark.parametrize("T", [1, 7, 17, 300, 2048, 4100])
@pytest.mark.parametrize("form", ["mma8", "mma16", "mma16s", "separate", "cuda"])
def test_moe_route_builds_the_expert_maps(n_exp, k, T, form, monkeypatch):
    """moe_route's maps: moe_route_mma's last block (its 16-warp form), moe_expert_maps after it (the 8-warp form,
    MOE_ROUTE_MAPS off) or after moe_topk ("cuda") build the expert maps of the picks they made, equal to NumPy's
    stable argsort of those ids (moe_ref.expert_maps) and the tile offsets for 64 and 128 rows per tile. Outputs
    poisoned; two launches in a row with fresh inputs (the arrival counter must be left at zero by the first);
    the launches are the routing's alone where the maps ride in it. 4100 tokens leave warps whose slot range ends
    inside a batch of loads; routers with low rows leave experts without tokens."""
    tune(monkeypatch, moe_router="cuda" if form == "cuda" else "mma")
    tune(monkeypatch, moe_route_wide_t=0 if form == "mma8" else 1 << 30)
    tune(monkeypatch, moe_route_maps=form != "separate")
    tune(monkeypatch, moe_route_splits="4" if form == "mma16s" else "1")
    calls = record_calls(monkeypatch, "kernel", lambda family, name: name)
    rng = np.random.default_rng()
    dim = 512 if form == "mma16s" else 128  # (split: 16 chunks of D, 4 per split over 4 or 2 K parts)
    router = (rng.standard_normal((n_exp, dim)) / math.sqrt(dim)).astype(np.float16)
    router[::7] = -1 / math.sqrt(dim)  # with x >= 0 these experts lose (unless k is most of E)
    n = T * k
    for tile_m in (64, 128):
        x = np.abs(rng.standard_normal((T, dim))).astype(np.float16)
        maps = tuple(poisoned((m,), np.int32) for m in (n_exp, n_exp + 1, n_exp + 1, n, n))
        ids = poisoned((T, k), np.int32)
        del calls[:]
        oc.moe_route(cp.asarray(x), cp.asarray(router), k, True, poisoned((T, n_exp), np.float32), ids,
                     poisoned((T, k), np.float32), maps=(tile_m, *maps))
        form_name, warps = oc.moe_rmma_form(T, n_exp)
        if form.startswith("mma16") and warps == 16:  # (the 16-warp form where it fits: one launch)
            split = oc.moe_route_splits(T, dim, warps, 4 if n_exp <= 128 else 8) > 1
            assert split == (form == "mma16s" and T > 1)
            assert calls == [oc.moe_rmma_split_name(n_exp, warps) if split else form_name]
        else:
            assert calls[-1] == "moe_expert_maps"
        assert int(oc.moe_route_counter()[0]) == 0 and int(cp.count_nonzero(oc.moe_route_tile_counters())) == 0
        ids = cp.asnumpy(ids)
        assert ((ids >= 0) & (ids < n_exp)).all()
        counts_ref, offsets_ref, p2u_ref, u2p_ref = moe_ref.expert_maps(ids, n_exp)
        if k < n_exp // 2 and T >= 300:
            assert (counts_ref[::7] == 0).all()
        counts, offsets, tiles, p2u, u2p = (cp.asnumpy(a) for a in maps)
        np.testing.assert_array_equal(counts, counts_ref)
        np.testing.assert_array_equal(offsets, offsets_ref)
        np.testing.assert_array_equal(tiles, np.concatenate([[0], np.cumsum(-(-counts_ref // tile_m))]))
        np.testing.assert_array_equal(p2u, p2u_ref)
        np.testing.assert_array_equal(u2p, u2p_ref)


@pytest.mark.parametrize("T,dim,k", [(1, D, K_TOP), (7, 136, 3), (300, 4096, 8), (33, 2048, 32), (5, 2056, 1)])
def test_moe_finalize_weighted_sum(T, dim, k):
    """moe_finalize (8 columns per thread, the k rows' loads together) against float64: out[t] = sum_j
    w[t, j] y[u2p[t k + j]] summed in fp32 in j order and rounded to fp16, so within one fp16 ulp of the
    exact sum plus fp32's bound for k sums (k 2^-23 sum_j |w_j y_j|, which matters where the terms cancel).
    Rows are a random permutation; output poisoned. D = 136 and 2056 leave threads without a full pass of
    256 8-column pieces."""
    rng = np.random.default_rng()
    n = T * k
    y = rng.standard_normal((n, dim)).astype(np.float16)
    u2p = rng.permutation(n).astype(np.int32)
    w = rng.random((T, k)).astype(np.float32)
    rows = y.astype(np.float64)[u2p.reshape(T, k)]
    ref = np.einsum("tj,tjd->td", w.astype(np.float64), rows)
    bound = (np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
             + k * 2.0**-23 * np.einsum("tj,tjd->td", w.astype(np.float64), np.abs(rows)))
    out = oc.moe_finalize(cp.asarray(y), cp.asarray(u2p), cp.asarray(w), out=poisoned((T, dim), np.float16))
    got = cp.asnumpy(out).astype(np.float64)
    assert (np.abs(got - ref) <= bound).all(), np.abs(got - ref).max()


@pytest.mark.parametrize("T,dim,k", [(1, D, K_TOP), (7, 136, 3), (300, 4096, 8), (33, 2048, 32), (5, 2056, 1)])
def test_add_rmsnorm_sums_expert_rows_as_moe_finalize(T, dim, k):
    """add_rmsnorm with a MoE prefill's expert rows (the routing-weighted sum in the same kernel,
    as the MoE prefill runs it): the new residual and x bitwise equal to moe_finalize then add_rmsnorm from the same
    residual, and x within fp16 rounding of NumPy's RMSNorm of h + the float64 weighted sum. x poisoned."""
    from kuiper_py.ops_numpy import rmsnorm
    rng = np.random.default_rng()
    n = T * k
    y = cp.asarray(rng.standard_normal((n, dim)).astype(np.float16))
    u2p = cp.asarray(rng.permutation(n).astype(np.int32))
    wts = cp.asarray(rng.random((T, k)).astype(np.float32))
    h0 = (3 * rng.standard_normal((T, dim))).astype(np.float32)
    nw = cp.asarray((1 + 0.1 * rng.standard_normal(dim)).astype(np.float16))
    h_sep, h_fused = cp.asarray(h0), cp.asarray(h0)
    r = oc.moe_finalize(y, u2p, wts, out=poisoned((T, dim), np.float16))
    x_sep = oc.add_rmsnorm(h_sep, r, nw, 1e-6, poisoned((T, dim), np.float16))
    x_fused = oc.add_rmsnorm(h_fused, None, nw, 1e-6, poisoned((T, dim), np.float16), experts=(y, u2p, wts))
    np.testing.assert_array_equal(cp.asnumpy(h_fused), cp.asnumpy(h_sep))
    np.testing.assert_array_equal(cp.asnumpy(x_fused), cp.asnumpy(x_sep))
    rows = cp.asnumpy(y).astype(np.float64)[cp.asnumpy(u2p).reshape(T, k)]
    h_ref = h0 + np.einsum("tj,tjd->td", cp.asnumpy(wts).astype(np.float64), rows)
    assert rel(cp.asnumpy(x_fused), rmsnorm(h_ref, cp.asnumpy(nw), 1e-6)) < 2e-3


def test_moe_prefill_arena_same_bits(moe_bin, monkeypatch):
    """Short prefills with their activations from the ops' arena, reused from prefill to prefill, against
    cupy.empty's (the arena_max_t setting): the same bits at every position (reference.py)."""
    assert_arena_prefills_same_bits(load(moe_bin), monkeypatch)


# ---------------------------------------------------------------------------------------------
# The one-launch MoE FFN half (ffn_decode.cu's moe_ffn_decode: RMSNorm, softmax and top-k of the logits
# the o GEMV computed, and the selected experts' SwiGLU FFN with the weighted sum, every cluster routing
# for itself), against float64 NumPy. (CL, TB, experts, top-k, expert intermediate): every (CL, TB)
# instantiation; Qwen3-30B-A3B's layer (the module's fixture, 24 clusters of 8) and 160 experts (past a
# top-k lane's first 4 values) among them.
_MOE_FFN_CASES = [(8, 1, E, K_TOP, INTER), (4, 1, 160, 4, 256), (8, 2, 64, 8, 512), (4, 2, 32, 3, 512),
                  (5, 2, 32, 4, 256), (5, 4, 16, 2, 256)]


@pytest.mark.parametrize("massive", [False, True])
@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("CL,TB,n_exp,k,inter", _MOE_FFN_CASES)
def test_moe_ffn_decode_cluster_kernel(layer, CL, TB, n_exp, k, inter, norm_topk, massive):
    """The row h + fp16(pending o) (written to hout exactly), its RMSNorm, softmax and top-k of the
    router's logits (given before the 1/rms in fixed point, as the o GEMV's router rows add them; the
    kernel applies the 1/rms of the row), and the picked experts' gate/up, SwiGLU and down times their
    routing weights, summed into a fixed-point accumulator. The picks must be a top-k of the exact
    (float64) logits, ties within 2e-3 allowed; the weights and the output are
    checked against the exact values for the experts picked. massive: three residual channels at 1e5
    with norm weight 40 (past fp16's range before the deferred 1/rms), so the overflow guards run.
    Launched twice on the same inputs with poisoned outputs: bitwise the same."""
    rng = np.random.default_rng()
    Dm = 256 * CL * TB
    plan = cluster_plan_or_skip("moe_ffn_decode", CL, TB, k * inter // 256)
    if (Dm, n_exp, inter) == (D, E, INTER):
        w13, w13_d, w2, w2_d, router = layer["w13"], layer["w13_d"], layer["w2"], layer["w2_d"], layer["router"]
    else:
        (w13, w13_d), (w2, w2_d) = rand_stack(rng, n_exp, Dm, 2 * inter, segments=2), rand_stack(rng, n_exp, inter, Dm)
        router = (rng.standard_normal((n_exp, Dm)) / math.sqrt(Dm)).astype(np.float16)
    h, w, pend, row = pending_row_inputs(rng, Dm, massive)
    r64 = row.astype(np.float64)
    x = r64 / np.sqrt(np.mean(r64 * r64) + 1e-6) * w.astype(np.float64)
    logits = router.astype(np.float64) @ x
    p = np.exp(logits - logits.max())
    p /= p.sum()
    lay = types.SimpleNamespace(experts_w13=w13_d, experts_w2=w2_d)
    # the logits before the 1/rms in fixed point, as the o GEMV's router rows add them: router . (w * row)
    zacc = cp.asarray(np.round(router.astype(np.float64) @ (r64 * w.astype(np.float64)) * 2**32).astype(np.int64))
    outs = []
    for pl in [plan, plan]:
        hout, acc = poisoned((1, Dm), np.float32), cp.zeros((Dm,), cp.int64)
        ids, wts = poisoned((1, k), np.int32), poisoned((1, k), np.float32)
        xin = types.SimpleNamespace(h=cp.asarray(h)[None], w=cp.asarray(w), pend=cp.asarray(pend), hout=hout)
        oc.decode_moe_ffn(pl, xin, lay, ids, wts, acc, 1e-6, k, norm_topk, zacc)
        np.testing.assert_array_equal(cp.asnumpy(hout)[0], row)
        outs.append((cp.asnumpy(ids)[0], cp.asnumpy(wts)[0], cp.asnumpy(acc)))
    got_ids, got_w, got = outs[0]
    kth = np.sort(logits)[::-1][k - 1]
    assert len(set(got_ids.tolist())) == k and (logits[got_ids] >= kth - 2e-3).all(), (got_ids, np.argsort(-logits)[:k])
    assert (np.diff(logits[got_ids]) <= 2e-3).all()  # in descending order
    w_ref = p[got_ids] / (p[got_ids].sum() if norm_topk else 1.0)
    assert rel(got_w, w_ref) < 1e-3
    ref = np.zeros(Dm)
    for e, we in zip(got_ids, w_ref):
        gu = awq_linear(x[None].astype(np.float32), w13.expert(int(e)))[0].astype(np.float64)
        g, u = gu[:inter], gu[inter:]
        act = (g / (1 + np.exp(-g)) * u).astype(np.float16).astype(np.float32)
        ref += we * awq_linear(act[None], w2.expert(int(e)))[0]
    y = got.astype(np.float64) / 2**32
    assert np.isfinite(y).all() and rel(y, ref) < 1e-2, rel(y, ref)
    for other in outs[1:]:
        for a_, b_ in zip(outs[0], other):
            np.testing.assert_array_equal(a_, b_)


@pytest.mark.parametrize("CL,TB,n_exp,k", [(8, 1, E, K_TOP), (4, 1, 160, 4), (4, 1, 256, 8), (4, 2, 32, 3)])
def test_moe_ffn_decode_picks_as_a_stable_sort_with_many_ties(CL, TB, n_exp, k):
    """moe_ffn_decode's own top-k (every block picks for itself from the o GEMV's fixed-point logits:
    warp 0's moe_topk_pick on the shared logits) against NumPy's stable sort, on rows of tied_logits (2.0s
    forced at the lowest ids, at the highest, none): the ids in order, ties to the lower id, in one
    cluster launch. 160 experts: past a lane's first 4 entries; 256: all 8 of every lane's entries."""
    rng = np.random.default_rng()
    Dm, inter = 256 * CL * TB, 256
    (_, w13_d), (_, w2_d) = rand_stack(rng, n_exp, Dm, 2 * inter, segments=2), rand_stack(rng, n_exp, inter, Dm)
    lay = types.SimpleNamespace(experts_w13=w13_d, experts_w2=w2_d)
    h, w, pend, _ = pending_row_inputs(rng, Dm, False)
    for draw, z in enumerate(tied_logits(rng, 4, n_exp, k)[:3]):
        ids_ref = np.argsort(-z, kind="stable")[:k]
        zacc = cp.asarray(np.round(z.astype(np.float64) * 2**32).astype(np.int64))
        plan = cluster_plan_or_skip("moe_ffn_decode", CL, TB, k * inter // 256)
        ids, wts = poisoned((1, k), np.int32), poisoned((1, k), np.float32)
        xin = types.SimpleNamespace(h=cp.asarray(h)[None], w=cp.asarray(w), pend=cp.asarray(pend),
                                    hout=poisoned((1, Dm), np.float32))
        oc.decode_moe_ffn(plan, xin, lay, ids, wts, cp.zeros((Dm,), cp.int64), 1e-6, k, True, zacc)
        np.testing.assert_array_equal(cp.asnumpy(ids)[0], ids_ref, err_msg=f"draw {draw}")


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-moe-mixed"])
def moe_bin(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    d = synth.make_checkpoint(root / "ck", request.param, seed=11, n_shards=1, tokenizer=False)
    export(d, root / "m.bin", progress=False, log=lambda m: None)
    return root / "m.bin"


def test_decode_plan_of_a_moe_model(moe_bin):
    """A MoE model's decode plan has a MoE layer's launches, the one-launch MoE half where the backend took it."""
    m = Qwen3(load(moe_bin), oc.CupyOps, 64)
    p = m.ops.plan
    assert p.moe_layer and (p.moe_layer[-1].kernel == "moe_ffn_decode") == (m.ops.moe_plan is not None)
    assert "(MoE):" in p.describe()  # (its run of MoE layers)


def test_moe_model_prefill_routing_and_greedy_match_cpu(moe_bin):
    mf = load(moe_bin)
    cpu = Qwen3(mf, NumpyOps, len(PROMPT) + 40)
    gpu = Qwen3(mf, oc.CupyOps, len(PROMPT) + 40)
    gpu.ops.routing_log = []
    ref = cpu.prefill(PROMPT, all_logits=True)
    got = cp.asnumpy(gpu.prefill(PROMPT, all_logits=True))
    assert rel(got, ref) < 1e-2
    assert len(gpu.ops.routing_log) == len(cpu.ops.routing_log) > 0
    np.testing.assert_array_equal(gpu.ops.routing_log[0], cpu.ops.routing_log[0])
    for g, c in zip(gpu.ops.routing_log, cpu.ops.routing_log):  # the same experts for every token and layer
        np.testing.assert_array_equal(np.sort(g, axis=1), np.sort(c, axis=1))  # (order within top-k: near ties)
    # greedy continuation, decode steps replayed as a CUDA graph on the GPU. The same tokens, up to a tie
    # that the numerics cannot resolve: tiny-moe-mixed's step 30 has the CPU's two best logits 0.047
    # apart while GPU and CPU logits differ by ~0.17 at every step (fp16 activations; the same with the
    # scalar or the tensor-core flash decoding), so either token is a correct greedy choice there.
    cpu.reset()
    gpu.reset()
    toks = assert_greedy_up_to_a_tie(cpu, gpu, PROMPT, 32)
    assert len(set(toks)) > 4


@pytest.mark.parametrize("prompts,expect", [((37, 40, 45, 33), [None, 48, 48, 48, 48]),
                                            (((20, 40), (33, 41)), [None, None, 48, 48, 48, 48])])
def test_moe_prefill_graphs_match_eager_and_reference(tmp_path, monkeypatch, prompts, expect):
    """MoE prompts through prefill graphs (reference.assert_prefill_graphs_accurate) on small-moe's shapes with a
    head dim of 128 (so that k and v are 256 wide and every dense projection takes the fused GEMMs; narrower ones go
    through cuBLAS, where a capture is refused): the padding's rows are routed and computed too, and leave the
    prompt's rows and continuation as accurate as the eager prefill's; fresh prompts, and chats whose later turns
    replay the graph at pos0 > 0."""
    if not oc.wgmma_available():
        pytest.skip("before sm_90 the prefill projections go through cuBLAS: no prefill graph")
    monkeypatch.setitem(synth.MOE_PRESETS, "pg-moe", (256, 512, 2, 4, 2, 128, True, 16, 4, 256, ()))
    d = synth.make_checkpoint(tmp_path / "ck", "pg-moe", seed=7, n_shards=1, tokenizer=False)
    export(d, tmp_path / "m.bin", progress=False, log=lambda m: None)
    served = assert_prefill_graphs_accurate(load(tmp_path / "m.bin"), prompts,
                                            after_first=lambda: forget_zeroed_counters(monkeypatch))
    assert served == expect


def test_moe_chat_on_gpu_continues_the_cache_accurately(tmp_path):
    """reference.assert_chat_accurate on small-moe's shapes with a head dim of 128 (every dense projection on the
    fused GEMMs, so every bucket's graph is captured at the chat's start)."""
    if not oc.wgmma_available():
        pytest.skip("before sm_90 the prefill projections go through cuBLAS: no prefill graph")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synth.MOE_PRESETS, "pg-moe", (256, 512, 2, 4, 2, 128, True, 16, 4, 256, ()))
        d = synth.make_checkpoint(tmp_path / "ck", "pg-moe", seed=8, n_shards=1)
    export(d, tmp_path / "m.bin", progress=False, log=lambda m: None)
    assert_chat_accurate(tmp_path / "m.bin")


def test_moe_prefill_graph_refused_where_cublas_serves(moe_bin):
    """The tiny MoE presets' k and v projections (128 wide) go through cuBLAS: the capture is abandoned and every
    prompt runs eagerly, as accurate as before."""
    served = assert_prefill_graphs_accurate(load(moe_bin), (37, 40, 45), ctx=len(PROMPT) + 100)
    assert served == [None] * 4


def test_moe_prefill_rs_path_matches_cpu_and_mma_path(tmp_path, monkeypatch):
    """A whole small-moe prefill (hidden and expert intermediate 256: the grouped expert GEMMs on gemm_moe_rs, and
    on gemm_moe_tc with its bound raised) against the CPU engine at every position, and against the same prefill on
    the mma.sync grouped GEMMs (MOE_RS=0). A token whose experts differ from the CPU's in some layer (a near tie that fp16
    activations may flip) legitimately differs: at least 95% of the 300 must route the same, and those are
    compared (1e-2, as the tiny models' prefill test). Rows are checked one by one in the stage tests above:
    here the largest row's error is set by the draw (0.0085 and 0.056 in two draws on this path, 0.0077 on
    the mma.sync one; H200), through tokens whose neighbours were rerouted."""
    if not oc.wgmma_available():
        pytest.skip("gemm_moe_rs needs compute capability 9.0")
    d = synth.make_checkpoint(tmp_path / "ck", "small-moe", seed=5, n_shards=1, tokenizer=False)
    export(d, tmp_path / "m.bin", progress=False, log=lambda m: None)
    mf = load(tmp_path / "m.bin")
    assert oc.moe_rs_path(oc.device_linear(mf.weights.layers[0].experts_w13, 2),
                          oc.device_linear(mf.weights.layers[0].experts_w2))
    ids = np.random.default_rng().integers(0, 151643, size=300).tolist()
    cpu = Qwen3(mf, NumpyOps, 320)
    ref = cpu.prefill(ids, all_logits=True)
    got, both = {}, np.ones(len(ids), bool)
    calls = record_calls(monkeypatch, "gemm_moe_rs", lambda *a, **k: ("rs", a[4]))
    tc_calls = record_calls(monkeypatch, "gemm_moe_tc", lambda *a, **k: ("tc", a[4]))
    tune(monkeypatch, moe_tc_max_mean=1e9)  # ("tc": gemm_moe_tc at 75 rows per expert, in 32-row tiles)
    tune(monkeypatch, moe_tc_t16_max=0)
    for rs, tc in (("auto", "0"), ("auto", "auto"), ("0", "0")):
        tune(monkeypatch, moe_rs=rs)
        tune(monkeypatch, moe_tc=tc)
        gpu = Qwen3(mf, oc.CupyOps, 320)
        gpu.ops.routing_log = []
        got[rs + tc] = cp.asnumpy(gpu.prefill(ids, all_logits=True))
        # both layers' gate|up and down on gemm_moe_rs (75 rows per expert: 128-row tiles), on gemm_moe_tc, or none
        assert calls + tc_calls == {"auto0": [("rs", 128)] * 4, "autoauto": [("tc", 32)] * 4, "00": []}[rs + tc]
        calls.clear()
        tc_calls.clear()
        same = np.ones(len(ids), bool)
        for g, c in zip(gpu.ops.routing_log, cpu.ops.routing_log, strict=True):
            same &= (np.sort(g, axis=1) == np.sort(c, axis=1)).all(axis=1)
        assert same.mean() >= 0.95, (rs, tc, same.mean())
        assert np.isfinite(got[rs + tc]).all() and rel(got[rs + tc][same], ref[same]) < 1e-2, (rs, tc)
        both &= same
    assert rel(got["auto0"][both], got["00"][both]) < 1e-2 and rel(got["autoauto"][both], got["00"][both]) < 1e-2


def test_moe_decode_graph_equals_eager_and_prefill(moe_bin):
    """Graph replay equals eager decode closely; decode equals prefill up to the first token whose
    experts differ between the two in some layer. Decode and prefill use different kernels, so a
    near-tied router may pick another expert there; that token's keys and values then differ, and
    every later token legitimately differs too. A draw rerouted within the first 10 decode tokens
    compares too little and is redrawn (three draws at most); a wrong kernel fails with or without
    rerouting."""
    mf = load(moe_bin)
    for _ in range(3):
        ids = np.random.default_rng().integers(0, 151643, size=40).tolist()
        pre = Qwen3(mf, oc.CupyOps, 64)
        pre.ops.routing_log = []
        full = cp.asnumpy(pre.prefill(ids, all_logits=True))
        graph = decode_logits(mf, ids, 10, 64, True)
        m = Qwen3(mf, oc.CupyOps, 64)
        m.ops.graphs = False
        m.prefill(ids[:10])
        m.ops.routing_log = []
        eager = np.stack([cp.asnumpy(m.decode(t)).copy() for t in ids[10:]])
        assert rel(graph, eager) < 1e-3
        n_moe = len(pre.ops.routing_log)
        assert n_moe > 0 and len(m.ops.routing_log) == 30 * n_moe
        same = [all(set(pre.ops.routing_log[layer][10 + t]) == set(m.ops.routing_log[t * n_moe + layer][0])
                    for layer in range(n_moe)) for t in range(30)]
        first = same.index(False) if False in same else 30
        if first >= 10:
            assert rel(eager[:first], full[10:10 + first]) < 1e-2
            return
    pytest.fail("decode and prefill chose different experts within the first 10 decode tokens in 3 draws")


def _cpu_decode_routed(mf, ids, n_prefill):
    """The CPU engine's logits for the decode steps of ids after a prefill of ids[:n_prefill], and its
    routing log of those steps ([step * MoE layers + layer] -> ids [1, k])."""
    cpu = Qwen3(mf, NumpyOps, 64)
    cpu.prefill(ids[:n_prefill])
    cpu.ops.routing_log = []
    ref = np.stack([cpu.decode(t) for t in ids[n_prefill:]])
    return ref, [np.asarray(r).reshape(1, -1) for r in cpu.ops.routing_log]


def _first_rerouted(log, ref_log, n_steps):
    """The first decode step at which some MoE layer picked other experts than in ref_log (n_steps if none)."""
    n = len(ref_log) // n_steps
    assert n > 0 and len(log) == len(ref_log) == n * n_steps
    for t in range(n_steps):
        if any(set(log[t * n + i].ravel()) != set(ref_log[t * n + i].ravel()) for i in range(n)):
            return t
    return n_steps


def test_moe_accumulating_decode(moe_bin, monkeypatch):
    """MoE models decode in accumulating mode (q|k|v finished by flash decoding, o's sums added to the
    residual by the router kernel, the experts' [gate | up] sums finished by the expert down GEMV, its
    weighted sum added by the next layer's q|k|v GEMV): against the last-block reductions
    (GEMV_ACC=0) and the CPU engine, eager decode, compared up to the first token whose experts
    differ from the CPU's in some layer (a near-tied router; three draws at most); graph replay equal to
    eager; one step repeated from the same cache bitwise equal, the accumulators left zero."""
    mf = load(moe_bin)
    for acc in (True, False):
        tune(monkeypatch, gemv_acc=acc)
        ops = Qwen3(mf, oc.CupyOps, 8).ops
        assert ops.acc_attn == ops.acc_moe == acc and not ops.acc_mode
    compared = 0
    for _ in range(3):
        ids = np.random.default_rng().integers(0, 151643, size=40).tolist()
        ref, cpu_log = _cpu_decode_routed(mf, ids, 10)
        got, first = {}, 30
        for acc in (True, False):
            tune(monkeypatch, gemv_acc=acc)
            m = Qwen3(mf, oc.CupyOps, 64)
            m.ops.graphs = False
            m.prefill(ids[:10])
            m.ops.routing_log = []
            got[acc] = np.stack([cp.asnumpy(m.decode(t)).copy() for t in ids[10:]])
            first = min(first, _first_rerouted(m.ops.routing_log, cpu_log, 30))
            if acc:
                np.testing.assert_allclose(decode_logits(mf, ids, 10, 64, True), got[acc], rtol=0, atol=1e-3 *
                                           np.abs(got[acc]).max())
        if first >= 10:
            e_acc, e_tails = rel(got[True][:first], ref[:first]), rel(got[False][:first], ref[:first])
            print("rel to the CPU reference (accumulating, tails):", e_acc, e_tails, "tokens", first)
            assert e_acc < 1e-2 and e_tails < 1e-2 and e_acc < 1.5 * e_tails
            compared = first
            break
    assert compared >= 10
    tune(monkeypatch, gemv_acc=True)
    ops, a, b = decode_step_twice(mf, ids, 10, 64)
    assert np.array_equal(a, b)
    assert int(cp.count_nonzero(ops.d["acc_qkv"])) == int(cp.count_nonzero(ops.d["acc_d"])) == 0


# The one-launch MoE FFN half end to end, at shapes it serves: a 1024-wide model (clusters of 4, 32
# experts, 4 per token) and a 2048-wide one (clusters of 8, as Qwen3-30B-A3B) whose middle layer is a
# dense MLP (mlp_only_layers), against the separate routing kernel and expert GEMVs
# (DECODE_MOE=0) and the CPU engine. Layout: hidden, dense intermediate, layers, heads, kv heads,
# head_dim, tied, experts, top-k, expert intermediate, mlp_only_layers.
_FUSED_MOE = {"m1k": (1024, 1024, 2, 8, 2, 128, True, 32, 4, 256, ()),
              "m2k-mixed": (2048, 2048, 3, 16, 4, 128, True, 16, 4, 512, (1,))}


# the 2048-wide model is the slow tier's (its three tests took 23 s of a warm fast tier on an H100; the 30B-A3B cluster
# of 8 stays in the fast tier through test_moe_ffn_decode_cluster_kernel)
@pytest.fixture(scope="module", params=slow_cases(_FUSED_MOE, ("m2k-mixed",)))
def fused_moe_bin(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synth.MOE_PRESETS, request.param, _FUSED_MOE[request.param])
        d = synth.make_checkpoint(root / "ck", request.param, seed=5, n_shards=1, tokenizer=False)
    export(d, root / "m.bin", progress=False, log=lambda m: None)
    return root / "m.bin"


def _fused_moe_decode(mf, ids, n_prefill, graphs, on, monkeypatch):
    """Logits of decoding ids[n_prefill:] after a prefill with the one-launch MoE FFN on or off, and the
    routing log of the decode steps (eager only: [step * MoE layers + layer] -> ids [1, k])."""
    tune(monkeypatch, decode_moe="1" if on else "0")
    m = Qwen3(mf, oc.CupyOps, 64)
    assert (m.ops.moe_plan is not None) == on, m.ops.decode_moe_why
    m.ops.graphs = graphs
    m.prefill(ids[:n_prefill])
    m.ops.routing_log = []
    if on:  # poison what the separate path writes: a stale read by the fused path would pass unnoticed
        for key in ("moe_logits", "moe_act", "moe_w", "x", "qrot", "part_o", "part_ml"):
            m.ops.d[key].fill(np.nan)
        m.ops.d["moe_ids"].fill(-1)
    out = np.stack([cp.asnumpy(m.decode(t)).copy() for t in ids[n_prefill:]])
    return m, out, m.ops.routing_log


def test_one_launch_moe_matches_separate_kernels_and_reference(fused_moe_bin, monkeypatch):
    """Eager decode against the separate kernels and the CPU engine, compared up to the first token
    whose experts differ from the CPU's in some layer (a near-tied router; three draws at most); graph
    replay equal to eager decode."""
    mf = load(fused_moe_bin)
    for _ in range(3):
        ids = np.random.default_rng().integers(0, 151643, size=40).tolist()
        ref, cpu_log = _cpu_decode_routed(mf, ids, 10)
        m, fused, log_f = _fused_moe_decode(mf, ids, 10, False, True, monkeypatch)
        print("plan:", m.ops.decode_moe_why)
        assert int(cp.count_nonzero(m.ops.d["acc_d"])) == 0  # the final norm finished the last sums and cleared them
        _, separate, log_s = _fused_moe_decode(mf, ids, 10, False, False, monkeypatch)
        first = min(_first_rerouted(log_f, cpu_log, 30), _first_rerouted(log_s, cpu_log, 30))
        if first >= 10:
            assert_as_accurate("one-launch MoE", fused[:first], separate[:first], ref[:first])
            _, graph, _ = _fused_moe_decode(mf, ids, 10, True, True, monkeypatch)
            assert rel(graph, fused) < 1e-3
            return
    pytest.fail("the GPU and the CPU chose different experts within the first 10 decode tokens in 3 draws")


def test_one_launch_moe_on_cluster_merged_attention_same_bits(fused_moe_bin, monkeypatch):
    """The MoE decode layer with flash decoding's splits merged by their clusters (the o GEMV and its router
    rows staging the merged row) gives bitwise the logits of the o GEMV's own gemv_merge_span merge (forced),
    graph-replayed in the short regime's 16 splits."""
    ids = np.random.default_rng().integers(0, 151643, size=40).tolist()
    got = decode_cluster_merge_ab(load(fused_moe_bin), ids, 10, monkeypatch)
    np.testing.assert_array_equal(got["1"], got["0"])
    assert np.isfinite(got["1"]).all()


def test_one_launch_moe_greedy_and_deterministic(fused_moe_bin, monkeypatch):
    """Greedy tokens (eager decode, the GPU fed the CPU engine's tokens) equal to the CPU's up to the first
    decode step whose experts differ from the CPU's in some layer (after a near-tied router both
    continuations are right; at least 10 tokens compared, three random prompts at most). A token that
    differs before any rerouting must be a tie the numerics cannot resolve, as in
    test_moe_model_prefill_routing_and_greedy_match_cpu: the GPU's pick the CPU's runner-up, and the CPU's
    top-2 gap under the step's largest GPU - CPU logit difference. One step repeated from the same cache
    bitwise equal, the accumulators left zero."""
    mf = load(fused_moe_bin)
    tune(monkeypatch, decode_moe="1")
    for _ in range(3):
        prompt = np.random.default_rng().integers(0, 151643, size=8).tolist()
        cpu, gpu = Qwen3(mf, NumpyOps, len(prompt) + 24), Qwen3(mf, oc.CupyOps, len(prompt) + 24)
        gpu.ops.graphs = False
        cpu.ops.routing_log, gpu.ops.routing_log = [], []
        toks, tie = greedy_lockstep(cpu, gpu, prompt, 24)
        lg, lc = ([np.asarray(r).reshape(-1, np.asarray(r).shape[-1]) for r in m.ops.routing_log] for m in (gpu, cpu))
        n_moe = sum(1 for r in lc if r.shape[0] == len(prompt))  # the prefill's entries come first
        if any(not np.array_equal(np.sort(a_, axis=1), np.sort(b_, axis=1)) for a_, b_ in zip(lg[:n_moe], lc[:n_moe])):
            continue  # the prefill itself rerouted (its kernels are not the ones under test)
        steps = (len(lc) - n_moe) // n_moe  # decode steps both ran (step s makes token s + 1)
        first = _first_rerouted(lg[n_moe:], lc[n_moe:], steps) if steps else 0
        if tie is not None and first >= len(toks):  # token len(toks) differs, made by a step that routed alike
            gap, err, got_tok, runner_up = tie
            assert got_tok == runner_up and gap < err, (prompt, len(toks), tie)
        if min(len(toks), first + 1) >= 10:
            break
    else:
        pytest.fail("the GPU and the CPU chose different experts (or tied) within the first 10 tokens in 3 draws")
    ops, a, b = decode_step_twice(mf, PROMPT, len(PROMPT) - 1, 64)
    assert ops.moe_plan is not None
    assert np.array_equal(a, b)  # fixed-point sums, rank-ordered cluster sums: bitwise the same
    assert int(cp.count_nonzero(ops.d["acc_qkv"])) == int(cp.count_nonzero(ops.d["acc_d"])) == 0
