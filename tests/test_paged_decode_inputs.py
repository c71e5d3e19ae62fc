"""The host side of the CUDA backend's decode graphs (cuda/ops/paged.py), checked without a GPU: the batch bucket a
decode step replays, the one buffer its inputs are packed into (what the graph's kernels address through it, that
padding rows reach only the spare block, that one copy of its head carries the step), and the batch engine's
greedy draws taken from the backend's argmax_rows with the logits left where they are."""
import numpy as np
import pytest

from kuiper_py.backend import SAMPLED_TOKEN, Seq
from kuiper_py.batch import BatchConfig, BatchEngine
from kuiper_py.cuda.ops.paged import (DECODE_BUCKETS, decode_bucket, decode_inputs_size, decode_inputs_views,
                                      pack_decode_inputs, paged_splits, paged_splits_max)
from kuiper_py.generate import Engine, generate
from kuiper_py.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


def test_paged_attention_splits_by_the_steps_decode_bucket(monkeypatch):
    """A paged step's attention splits each row's keys by its decode bucket's entry in the tuning's table (an eager
    step of 5 rows as its 8-row graph replay), one block a row past the table; by default 16 up to 64 rows."""
    from reference import tune
    assert [paged_splits(t) for t in (1, 5, 64, 65, 512)] == [16, 16, 16, 1, 1] and paged_splits_max() == 16
    tune(monkeypatch, paged_splits=((4, 16), (16, 8), (64, 2)))
    got = {t: paged_splits(t) for t in (1, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65)}
    assert got == {1: 16, 3: 16, 4: 16, 5: 8, 8: 8, 9: 8, 16: 8, 17: 2, 32: 2, 33: 2, 64: 2, 65: 1}
    assert paged_splits_max() == 16
    tune(monkeypatch, paged_splits=())
    assert paged_splits(1) == 1 and paged_splits_max() == 1


def test_a_step_replays_the_smallest_bucket_that_holds_it():
    for B in range(1, 65):
        b = decode_bucket(B)
        assert b in DECODE_BUCKETS and b >= B and all(c < B for c in DECODE_BUCKETS if c < b)
    assert [decode_bucket(B) for B in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 40, 64)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, 64]
    for B in (0, 65):
        with pytest.raises(ValueError, match="graphs serve 1..64"):
            decode_bucket(B)


def _random_decode_step(rng, B, bs, width, n_blocks):
    """B sequences of one token each at random positions, each with distinct random blocks covering it."""
    free = list(rng.permutation(n_blocks))
    seqs = []
    for _ in range(B):
        pos0 = int(rng.integers(0, width * bs))
        need = pos0 // bs + 1
        table = tuple(int(free.pop()) for _ in range(need + int(need < width and rng.integers(0, 2))))
        seqs.append(Seq((int(rng.integers(0, 150000)),), pos0, 0, table))
    return seqs


@pytest.mark.parametrize("B", [1, 3, 16, 17, 40, 64, None])
def test_packed_inputs_address_each_sequences_rows_and_padding_only_the_spare_block(B):
    """Each row's id and position, and paged.cu's row of every position it attends to (tables[row][p // bs] * bs +
    p % bs) the one its own block table gives; padding rows (B..bucket) attend to position 0 of the spare block
    only; the returned head of the buffer holds all of it (the rest may be anything on the device)."""
    rng = np.random.default_rng()
    B = B or int(rng.integers(1, 65))  # (None: a random batch)
    bs, width, n_blocks = 4, 9, 64 * 9
    pad = n_blocks  # the block after the pool's
    seqs = _random_decode_step(rng, B, bs, width, n_blocks)
    bucket = decode_bucket(B)
    host = np.full(decode_inputs_size(width), -5, np.int32)
    n = pack_decode_inputs(seqs, bucket, bs, pad, host)
    assert n == 2 * 64 + bucket * width
    dev = np.full_like(host, -7)  # what one copy of the head leaves on the device
    dev[:n] = host[:n]
    ids, pos, tables = decode_inputs_views(dev, width, bucket)
    assert ids.shape == pos.shape == (bucket,) and tables.shape == (bucket, width)
    for b in range(bucket):
        if b < B:
            s = seqs[b]
            assert ids[b] == s.ids[0] and pos[b] == s.pos0
            for p in range(s.pos0 + 1):
                assert tables[b, p // bs] * bs + p % bs == s.block_table[p // bs] * bs + p % bs
            assert (tables[b, len(s.block_table):] == pad).all()
        else:
            assert ids[b] == 0 and pos[b] == 0 and tables[b, 0] == pad


def test_a_smaller_step_leaves_nothing_of_a_larger_one_in_its_rows():
    rng = np.random.default_rng()
    bs, width, n_blocks = 8, 6, 200
    host = np.zeros(decode_inputs_size(width), np.int32)
    pack_decode_inputs(_random_decode_step(rng, 64, bs, width, 64 * width), 64, bs, 64 * width, host)
    for B, bucket in ((3, 4), (20, 32)):
        small = _random_decode_step(rng, B, bs, width, n_blocks)
        pack_decode_inputs(small, bucket, bs, n_blocks, host)
        ids, pos, tables = decode_inputs_views(host, width, bucket)
        assert (ids[B:] == 0).all() and (pos[B:] == 0).all() and (tables[B:] == n_blocks).all()
        assert [int(i) for i in ids[:B]] == [s.ids[0] for s in small]


@pytest.mark.parametrize("seq,bucket,match", [
    (Seq((1, 2), 3, 0, (0,)), 1, "one token id"),
    (Seq((SAMPLED_TOKEN,), 3, 0, (0,)), 1, "one token id"),
    (Seq((1,), 4, 0, (0,)), 1, "position 4 in 1 blocks"),
    (Seq((1,), 0, 0, (0,) * 7), 1, "tables hold 6"),
])
def test_steps_the_graphs_cannot_run_are_refused(seq, bucket, match):
    host = np.zeros(decode_inputs_size(6), np.int32)
    with pytest.raises(ValueError, match=match):
        pack_decode_inputs([seq], bucket, 4, 99, host)
    with pytest.raises(ValueError, match="2 sequences in a bucket of 1"):
        pack_decode_inputs([Seq((1,), 0, 0, (0,))] * 2, 1, 4, 99, host)


@pytest.fixture(scope="module")
def engine(tiny_bin):
    eng = Engine.load(tiny_bin, "cpu")
    eng.session(1).ops.batch_invariant = True
    return eng


def test_greedy_draws_take_each_rows_argmax_and_leave_the_logits_on_the_backend(engine, monkeypatch):
    """Greedy requests (no penalty, no logprobs) draw from the backend's argmax_rows, never copying a step's logits
    to the host, and get the tokens each gets alone; with a sampled request in the batch every row draws through
    the backend's sample_rows (still no copy), the sampled one its own seeded tokens; a request asking for logprobs
    brings its row (only its row) over."""
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 2000, size=int(n)).tolist() for n in (3, 9, 1, 14)]
    want = [list(generate(engine, p, 6, GREEDY, eos_ids=[]))[-1].tokens for p in prompts]
    ops = engine.session(1).ops
    copies, argmaxes = [], []
    to_host, argmax_rows, sample_rows = ops.to_host, ops.argmax_rows, ops.sample_rows
    monkeypatch.setattr(ops, "to_host", lambda x: copies.append(x.shape) or to_host(x))
    monkeypatch.setattr(ops, "argmax_rows", lambda x, n: argmaxes.append(x.shape) or argmax_rows(x, n))
    row_draws = []
    monkeypatch.setattr(ops, "sample_rows", lambda x, d, n: row_draws.append(d) or sample_rows(x, d, n))
    be = BatchEngine(engine, BatchConfig(max_context=48, block_size=4, chunk_size=5, n_blocks=60))
    hs = [be.submit(p, GREEDY, 6, eos_ids=[]) for p in prompts]
    be.run_until_done()
    assert [h.out for h in hs] == want
    assert copies == [] and len(argmaxes) >= 6
    sampled = SamplingParams(temperature=0.8, seed=int(rng.integers(1 << 31)))
    alone = list(generate(engine, prompts[1], 5, sampled, eos_ids=[]))[-1].tokens
    hs = [be.submit(prompts[0], GREEDY, 5, eos_ids=[]), be.submit(prompts[1], sampled, 5, eos_ids=[])]
    be.run_until_done()
    assert hs[0].out == want[0][:5] and hs[1].out == alone
    assert copies == [] and row_draws and all(len(d) == 2 for d in row_draws)
    assert [d[1].step for d in row_draws if d[1] is not None] == list(range(5))
    hs = [be.submit(prompts[0], GREEDY, 3, eos_ids=[], logprobs=2), be.submit(prompts[1], sampled, 3, eos_ids=[])]
    be.run_until_done()
    assert hs[0].out == want[0][:3] and hs[1].out == alone[:3]
    assert copies and all(c == copies[0] and len(c) == 1 for c in copies)  # one row [V] at a time


def test_a_backend_with_graphs_gets_each_paged_decode_step_as_one(tiny_bin):
    """Qwen3.forward_step hands a paged step of one new token per sequence to a graph backend's decode_step (with
    the forward as its body, which gives the eager step's logits), and runs prefill chunks and all_logits steps
    itself."""
    from kuiper_py.backend import Step
    from kuiper_py.loader import load
    from kuiper_py.model import Qwen3
    from kuiper_py.ops_numpy import NumpyOps

    calls = []

    class GraphOps(NumpyOps):
        graphs = True

        def decode_step(self, body, step):  # (eagerly, as CupyOps does where a bucket has no graph)
            calls.append(step)
            self.begin_step(step)
            try:
                return body()
            finally:
                self.end_step()

    m = Qwen3(load(tiny_bin), GraphOps, 1)
    m.ops.alloc_blocks(8, 4, 16)
    rng = np.random.default_rng()
    a, b = (rng.integers(0, 2000, size=n).tolist() for n in (5, 3))
    m.forward_step(Step((Seq(tuple(a), 0, 0, (1, 2)), Seq(tuple(b), 0, 0, (4,)))))
    m.forward_step(Step((Seq((a[0],), 5, 0, (1, 2)),)), all_logits=True)
    assert calls == []
    dec = Step((Seq((a[1],), 6, 0, (1, 2)), Seq((b[2],), 3, 0, (4,))))
    k0 = m.ops.k_blocks.copy()
    got = m.forward_step(dec)
    assert calls == [dec] and got.shape == (2, m.args.vocab_size)
    m.ops.k_blocks[:] = k0
    m.ops.graphs = False
    np.testing.assert_array_equal(m.forward_step(dec), got)
    assert calls == [dec]
