"""Steps of several sequences on the GPU (CupyOps over a paged KV pool, cuda/batched.py and kernels_cu/paged.cu):
the paged kernels against NumPy on random pools and block tables, a model's paged steps against NumpyOps' paged
steps, decode steps replayed as a CUDA graph per batch bucket against the same steps run eagerly, and BatchEngine's
greedy tokens against each request run alone on the GPU (device machine only)."""
import math

import numpy as np
import pytest

from kuiper_py.backend import Seq, Step
from kuiper_py.batch import BatchConfig, BatchEngine
from kuiper_py.generate import Engine, generate
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps, rmsnorm, rope
from kuiper_py.sampling import SamplingParams
from reference import GREEDY, gpu_near_tie, rel, tune

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")
from kuiper_py.cuda.ops.paged import (PagedRows, paged_attention, paged_qk_norm_rope_store,  # noqa: E402
                                      rows_argmax)


def _random_step(rng, n_blocks, bs, lengths, pos0s):
    """A step of sequences with `lengths` new tokens at positions pos0s, each given distinct random blocks of the
    pool (enough for its positions, in shuffled order)."""
    free = list(rng.permutation(n_blocks))
    seqs = []
    for n, p0 in zip(lengths, pos0s):
        need = -(-(p0 + n) // bs)
        table = tuple(int(free.pop()) for _ in range(need))
        seqs.append(Seq(tuple(range(n)), p0, 0, table))
    return Step(tuple(seqs))


def _rows_of(step):
    """(sequence index, position) of each of the step's token rows."""
    return [(b, s.pos0 + t) for b, s in enumerate(step.seqs) for t in range(len(s.ids))]


# (new tokens, first position) per sequence: a step of few rows (keys split over blocks), one of more than
# PAGED_SPLIT_MAX_T rows (one block per row), and decode rows with more keys than one block's chunk at each split
ATTN_STEPS = {"mixed": ([1, 1, 7, 20, 1], [0, 37, 0, 9, 100]), "long_chunk": ([70, 1, 3], [30, 200, 0]),
              "far_decode": ([1, 1, 1], [0, 700, 2500])}


@pytest.mark.parametrize("H,KV,hd", [(4, 2, 64), (16, 2, 64), (32, 8, 128), (64, 8, 128), (16, 16, 128),
                                     (40, 8, 128)])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("case", list(ATTN_STEPS))
def test_paged_attention_against_numpy(H, KV, hd, bs, case):
    """Decode rows and prefill chunks of several sequences (mixed lengths, chunks after cached positions) over a
    pool whose unused rows are NaN: each row attends to its own sequence's positions 0..its own only."""
    rng = np.random.default_rng()
    lengths, pos0s = ATTN_STEPS[case]
    n_blocks = sum(-(-(p + n) // bs) for n, p in zip(lengths, pos0s)) + 8
    step = _random_step(rng, n_blocks, bs, lengths, pos0s)
    Kp = np.full((n_blocks, bs, KV, hd), np.nan, np.float16)
    Vp = Kp.copy()
    for s in step.seqs:  # the positions each sequence holds (the rest stays NaN)
        for p in range(s.pos0 + len(s.ids)):
            blk, off = s.block_table[p // bs], p % bs
            Kp[blk, off] = rng.standard_normal((KV, hd)) * 2
            Vp[blk, off] = rng.standard_normal((KV, hd))
    T = step.n_tokens
    q = (rng.standard_normal((T, H, hd)) * 2).astype(np.float16)
    got = paged_attention(cp.asarray(q), cp.asarray(Kp), cp.asarray(Vp), PagedRows(step.seqs, bs))
    ref = np.empty((T, H, hd))
    for t, (b, pos) in enumerate(_rows_of(step)):
        tab = step.seqs[b].block_table
        keys = [(tab[p // bs], p % bs) for p in range(pos + 1)]
        K = np.stack([Kp[k] for k in keys]).astype(np.float64)  # [n, KV, hd]
        V = np.stack([Vp[k] for k in keys]).astype(np.float64)
        for h in range(H):
            kh = h // (H // KV)
            s = K[:, kh] @ q[t, h].astype(np.float64) / math.sqrt(hd)
            p = np.exp(s - s.max())
            ref[t, h] = (p / p.sum()) @ V[:, kh]
    assert rel(cp.asnumpy(got), ref.reshape(T, H * hd)) < 1e-2


@pytest.mark.parametrize("H,KV,hd", [(4, 2, 64), (32, 8, 128)])
def test_paged_qk_norm_rope_store_against_numpy(H, KV, hd):
    """Each row's q/k normed and rotated at its own sequence's position, k and v written to that position's block
    row and no other (the pool's other rows keep their NaN); q, k, v views of one q|k|v product."""
    rng = np.random.default_rng()
    bs, n_blocks = 8, 32
    step = _random_step(rng, n_blocks, bs, [1, 5, 12, 1], [40, 0, 3, 7])
    T = step.n_tokens
    qkv = rng.standard_normal((T, (H + 2 * KV) * hd)).astype(np.float16)
    qn, kn = (rng.uniform(0.5, 1.5, hd).astype(np.float16) for _ in range(2))
    ang = np.arange(64)[:, None] * 1e6 ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    Kp = cp.full((n_blocks, bs, KV, hd), np.nan, cp.float16)
    Vp = Kp.copy()
    d = cp.asarray(qkv)
    qd, kvd = H * hd, KV * hd
    got = paged_qk_norm_rope_store(d[:, :qd], d[:, qd:qd + kvd], d[:, qd + kvd:], cp.asarray(qn), cp.asarray(kn),
                                   cp.asarray(cos), cp.asarray(sin), Kp, Vp, PagedRows(step.seqs, bs), H, 1e-6)
    pos = np.array([p for _, p in _rows_of(step)])
    q = rope(rmsnorm(qkv[:, :qd].reshape(T, H, hd), qn, 1e-6), cos[pos], sin[pos])
    k = rope(rmsnorm(qkv[:, qd:qd + kvd].reshape(T, KV, hd), kn, 1e-6), cos[pos], sin[pos])
    v = qkv[:, qd + kvd:].reshape(T, KV, hd)
    assert rel(cp.asnumpy(got), q) < 1e-2
    Kh, Vh = cp.asnumpy(Kp), cp.asnumpy(Vp)
    written = np.zeros((n_blocks, bs), bool)
    for t, (b, p) in enumerate(_rows_of(step)):
        blk, off = step.seqs[b].block_table[p // bs], p % bs
        written[blk, off] = True
        assert rel(Kh[blk, off], k[t]) < 1e-2
        np.testing.assert_array_equal(Vh[blk, off], v[t])
    assert np.isnan(Kh[~written]).all() and np.isnan(Vh[~written]).all()


# the steps a batch engine makes: prefill chunks over 16 rows (the prefill GEMMs) and under (gemv_rows.cu) beside
# decode rows, sequences joining later, steps of one decode row
def _steps(prompts, table):
    a, b, c = prompts
    ta, tb, tc = table
    return [
        Step((Seq(tuple(a[:20]), 0, 0, ta), Seq(tuple(b[:5]), 0, 0, tb))),
        Step((Seq(tuple(a[20:]), 20, 0, ta), Seq(tuple(b[5:6]), 5, 0, tb), Seq(tuple(c), 0, 0, tc))),
        Step((Seq((a[1],), len(a), 0, ta), Seq((b[2],), 6, 0, tb), Seq((c[0],), len(c), 0, tc))),
        Step((Seq((b[3],), 7, 0, tb),)),
        Step((Seq((a[4], a[5]), len(a) + 1, 0, ta), Seq((c[1],), len(c) + 1, 0, tc))),
    ]


@pytest.mark.parametrize("which", ["tiny", "moe"])
def test_paged_steps_match_numpy_paged_steps(which, tiny_bin, moe_bin):
    """Qwen3.forward_step on CupyOps and NumpyOps over the same block pools and steps: each step's logits (each
    sequence's last row) within the GPU end-to-end tolerance, and one step's every row (all_logits)."""
    mf = load(tiny_bin if which == "tiny" else moe_bin)
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 2000, size=n).tolist() for n in (29, 6, 3)]
    bs, n_blocks = 4, 40
    perm = rng.permutation(n_blocks).tolist()
    table = (tuple(perm[:10]), tuple(perm[10:14]), tuple(perm[14:17]))
    gpu, cpu = Qwen3(mf, oc.CupyOps, 16), Qwen3(mf, NumpyOps, 1)
    for m in (gpu, cpu):
        m.ops.alloc_blocks(n_blocks, bs, 64)
    for i, step in enumerate(_steps(prompts, table)):
        all_rows = i == 1
        g = cp.asnumpy(gpu.forward_step(step, all_logits=all_rows))
        c = cpu.forward_step(step, all_logits=all_rows)
        assert g.shape == c.shape == ((step.n_tokens if all_rows else step.batch), mf.args.vocab_size)
        assert rel(g, c) < 1e-2, i


def _near_tie(mf, ctx, a, b, n_valid):
    """Whether tokens a and b are the CPU reference's top two after ctx at a tie the GPU's own error hides, or the
    GPU's prefill of ctx routes some token to other experts than the reference (reference.gpu_near_tie; test_cuda_moe
    compares up to such a token for the same reason)."""
    tie, routes_differ = gpu_near_tie(mf, ctx, n_valid)
    return {a, b} == tie or routes_differ


@pytest.mark.parametrize("which", ["tiny", "moe"])
@pytest.mark.parametrize("n_req", [8, 24])
def test_batch_engine_greedy_tokens_equal_each_request_alone(which, n_req, tiny_bin, moe_bin):
    """n_req requests of mixed prompt lengths through BatchEngine on the GPU (prompts prefilled 8 tokens a step
    beside the others' decode rows, blocks of 4; 24 requests: decode steps of 17-24 rows, bucket 32): each
    request's greedy tokens equal those of it run alone on the GPU, up to a near tie at the first difference; the
    pool's free count ends where it started."""
    path = tiny_bin if which == "tiny" else moe_bin
    mf = load(path)
    rng = np.random.default_rng()
    lens = [1, 2, 5, 8, 9, 17, 31, 50] + rng.integers(1, 40, size=n_req - 8).tolist()
    prompts = [rng.integers(0, 2000, size=int(n)).tolist() for n in lens]
    ns = rng.integers(3, 12, size=len(prompts)).tolist()
    eng = Engine.load(path, "cuda", need_tokenizer=False)
    alone = [list(generate(eng, p, n, GREEDY, eos_ids=[]))[-1].tokens for p, n in zip(prompts, ns)]
    ops = eng.session(1).ops
    free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
    assert 0 < ops.kv_pool_blocks(4, 0.5) * ops.block_bytes(4) <= free // 2  # (a share of the free memory)
    be = BatchEngine(eng, BatchConfig(max_context=96, block_size=4, chunk_size=8, n_blocks=25 * n_req))
    free0 = be.pool.n_free
    handles = [be.submit(p, GREEDY, n, eos_ids=[]) for p, n in zip(prompts, ns)]
    be.run_until_done()
    assert be.steps < sum(ns) + sum(-(-len(p) // 8) for p in prompts)  # (sequences shared steps)
    assert ops.paged_graph_steps > 0  # (the decode steps replayed their buckets' graphs)
    for p, want, h in zip(prompts, alone, handles):
        got = h.out
        assert len(got) == len(want) and h.finish_reason == "length"
        if got != want:
            j = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
            assert _near_tie(mf, p + want[:j], got[j], want[j], eng.n_valid_tokens), (len(p), j)
    assert be.pool.n_free == free0


def test_decode_step_eager_and_replayed_take_the_same_gemms(small_dense_bin, monkeypatch):
    """A decode step of 5 sequences, run eagerly and as its bucket's graph (8 rows, 3 of them padding), gives bitwise
    the same logits where this GPU's table (settings rows_wgmma_min) sends 8 rows of o and down to the fused wgmma
    GEMM and 5 to gemv_rows: the eager step takes its bucket's kernels (an entry made for the test's Qwen3-0.6B
    shapes, which the fused GEMMs take; the tiny files' are too narrow)."""
    if not oc.wgmma_available():
        pytest.skip("the fused wgmma GEMM needs sm_90")
    mf = load(small_dense_bin)
    a = mf.args
    o, down = (a.num_attention_heads * a.head_dim, a.hidden_size), (a.intermediate_size, a.hidden_size)
    tune(monkeypatch, device_tables={"": {"rows_wgmma_min": {o: 8, down: 8}}})
    m = Qwen3(mf, oc.CupyOps, 16)
    ops = m.ops
    layer = ops.weights.layers[0]
    assert [oc.gemm_path(T, (layer.wo,)) for T in (5, 8)] == ["rows", "wgmma"]  # (the table applies)
    rng = np.random.default_rng()
    S, bs = 8, 4
    ops.alloc_blocks(8 * S, bs, 64)
    perm = rng.permutation(8 * S).tolist()
    tables = [tuple(perm[7 * i:7 * i + 7]) for i in range(S)]
    lens = rng.integers(2, 13, size=S).tolist()
    m.forward_step(Step(tuple(Seq(tuple(rng.integers(0, 2000, size=n).tolist()), 0, 0, t)
                              for n, t in zip(lens, tables))))
    rows = rng.choice(S, 5, replace=False).tolist()
    step = Step(tuple(Seq((int(rng.integers(0, 2000)),), lens[b], 0, tables[b]) for b in rows))
    k0, v0 = ops.k_blocks.copy(), ops.v_blocks.copy()
    ops.paged_graphs = False
    eager = cp.asnumpy(m.forward_step(step))
    ops.k_blocks[...], ops.v_blocks[...] = k0, v0
    ops.paged_graphs = True
    replays = ops.paged_graph_steps
    got = cp.asnumpy(m.forward_step(step))
    assert ops.paged_graph_steps == replays + 1
    np.testing.assert_array_equal(got, eager)


def test_rows_argmax_takes_the_lowest_id_of_equal_maxima_below_n_valid():
    """paged.cu rows_argmax against NumPy's argmax over each row's first n_valid ids: random rows, a row with its
    maximum three times, a row of -inf only, a row whose larger values lie past n_valid."""
    rng = np.random.default_rng()
    R, V = 16, 151936
    n_valid = int(rng.integers(V // 2, V))
    x = rng.standard_normal((R, V)).astype(np.float32)
    x[1, [int(rng.integers(0, 1000)), 9000, n_valid - 1]] = 50.0
    x[2] = -np.inf
    x[3, n_valid:] = 99.0
    out = cp.full((R,), -1, cp.int32)
    rows_argmax(cp.asarray(x), n_valid, out)
    np.testing.assert_array_equal(cp.asnumpy(out), np.argmax(x[:, :n_valid], axis=1))


@pytest.mark.parametrize("which", ["tiny", "moe"])
@pytest.mark.parametrize("S", [16, 48])
def test_decode_graphs_give_the_eager_steps_logits_bitwise(which, S, tiny_bin, moe_bin):
    """Of S sequences, paged decode steps of 1, 3 and 16 sequences (buckets 1, 4 and 16: the middle one with a
    padding row; S = 48 also 40 and 20, buckets 64 and 32 with 24 and 12 padding rows), then buckets 4 and 1 replayed
    over other sequences at other positions: each step's logits and greedy ids are bitwise those of the same step run
    eagerly from the same pool, and it leaves the pool's blocks bitwise as the eager step does (the padding rows
    write none of them)."""
    mf = load(tiny_bin if which == "tiny" else moe_bin)
    rng = np.random.default_rng()
    bs, n_blocks, V = 4, 8 * S, mf.args.vocab_size
    n_valid = int(rng.integers(V // 2, V + 1))
    m = Qwen3(mf, oc.CupyOps, 16)
    ops = m.ops
    assert ops.graphs and ops.max_batch == 64  # (KUIPER_CUDA_GRAPHS unset)
    ops.alloc_blocks(n_blocks, bs, 64)
    perm = rng.permutation(n_blocks).tolist()
    tables = [tuple(perm[7 * i:7 * i + 7]) for i in range(S)]  # 28 positions each
    lens = rng.integers(2, 13, size=S).tolist()  # (2 or more: the prompts step is no decode step)
    m.forward_step(Step(tuple(Seq(tuple(rng.integers(0, 2000, size=n).tolist()), 0, 0, t)
                              for n, t in zip(lens, tables))))  # the prompts, eagerly
    wide = [rng.choice(S, 40, replace=False).tolist(), rng.choice(S, 20, replace=False).tolist()] if S > 16 else []
    for rows in ([int(rng.integers(S))], rng.choice(S, 3, replace=False).tolist(),
                 rng.choice(S, 16, replace=False).tolist(), *wide, rng.choice(S, 3, replace=False).tolist(),
                 [int(rng.integers(S))]):
        step = Step(tuple(Seq((int(rng.integers(0, 2000)),), lens[b], 0, tables[b]) for b in rows))
        k0, v0 = ops.k_blocks.copy(), ops.v_blocks.copy()
        ops.paged_graphs = False
        eager = cp.asnumpy(m.forward_step(step))
        k1, v1 = ops.k_blocks[:, :n_blocks].copy(), ops.v_blocks[:, :n_blocks].copy()
        ops.k_blocks[...], ops.v_blocks[...] = k0, v0  # (in place: the graphs hold the pool's address)
        ops.paged_graphs = True
        replays = ops.paged_graph_steps
        out = m.forward_step(step)
        ids = ops.argmax_rows(out, n_valid)
        got = cp.asnumpy(out)
        assert ops.paged_graph_steps == replays + 1
        assert got.shape == eager.shape == (len(rows), V)
        np.testing.assert_array_equal(got, eager)
        np.testing.assert_array_equal(ids, np.argmax(eager[:, :n_valid], axis=1))
        assert cp.array_equal(ops.k_blocks[:, :n_blocks], k1) and cp.array_equal(ops.v_blocks[:, :n_blocks], v1)
        for b in rows:
            lens[b] += 1


@pytest.mark.parametrize("which", ["tiny", "moe"])
def test_batch_engine_with_decode_graphs_draws_what_eager_steps_draw(which, tiny_bin, moe_bin):
    """Twelve requests through BatchEngine, greedy and seeded sampled ones together (prompts prefilled 8 tokens a
    step): with decode graphs every request's tokens and finish equal those of the same run with eager steps."""
    path = tiny_bin if which == "tiny" else moe_bin
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 2000, size=int(n)).tolist() for n in rng.integers(1, 40, size=12)]
    ns = rng.integers(3, 14, size=len(prompts)).tolist()
    params = [GREEDY if i % 4 else SamplingParams(temperature=0.9, top_k=40, seed=int(rng.integers(1 << 31)))
              for i in range(len(prompts))]
    eng = Engine.load(path, "cuda", need_tokenizer=False)
    ops = eng.session(1).ops
    runs = []
    for graphs in (True, False):
        ops.paged_graphs = graphs
        replays = ops.paged_graph_steps
        be = BatchEngine(eng, BatchConfig(max_context=64, block_size=4, chunk_size=8, n_blocks=250))
        handles = [be.submit(p, sp, n, eos_ids=[]) for p, sp, n in zip(prompts, params, ns)]
        be.run_until_done()
        assert (ops.paged_graph_steps > replays) == graphs
        assert be.pool.n_free == be.pool.n_blocks
        runs.append([(h.out, h.finish_reason) for h in handles])
    assert runs[0] == runs[1]
