"""Continuous batching on the CPU (kuiper_py.batch.BatchEngine over NumpyOps' paged KV blocks): every request in a
batch gets what generate() gives it alone (tokens, text, finish reasons), through chunked prefill, preemption,
cancellation and prefix caching, and the block pool ends where it started.

Exact equality is asserted with the NumPy backend's batch_invariant mode (each row's sums on their own, as a run
alone makes them); with BLAS GEMMs over the whole step the sums move in the last bits, so the default mode is held
to "equal up to a near tie"."""
import json

import numpy as np
import pytest

from conftest import run_cli
from kuiper_py.batch import BatchConfig, BatchEngine
from kuiper_py.cli import main
from kuiper_py.errors import KuiperError
from kuiper_py.backend import Seq, Step
from kuiper_py.generate import Engine, generate
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps
from kuiper_py.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def engines(tiny_bin):
    """{"exact": an engine whose CPU backend is batch invariant, "fast": one with the default BLAS steps}."""
    out = {}
    for name, inv in (("exact", True), ("fast", False)):
        eng = Engine.load(tiny_bin, "cpu")
        eng.session(1).ops.batch_invariant = inv
        out[name] = eng
    return out


def _alone(eng, prompt, n, params, **kw):
    return list(generate(eng, prompt, n, params, **kw))


def _key(recs):
    """What a request's records say, without their timings (the drawn tokens: the last record's)."""
    return [(r.token, r.text, r.finish_reason, r.gen_tokens, r.decode_steps, r.logprob) for r in recs] + \
        [recs[-1].tokens]


def _run(be, handles):
    be.run_until_done()
    return [h.take() for h in handles]


def _prompts(rng, lengths, vocab=2000):
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in lengths]


def _spy_steps(be, monkeypatch):
    """The [(tokens, pos0)] of each sequence in every step the batch engine runs."""
    seen, inner = [], be.model.forward_step

    def spy(step, all_logits=False):
        seen.append([(len(s.ids), s.pos0) for s in step.seqs])
        return inner(step, all_logits)
    monkeypatch.setattr(be.model, "forward_step", spy)
    return seen


@pytest.mark.parametrize("invariant", [True, False])
def test_a_paged_step_gives_each_sequence_the_logits_it_has_alone(tiny_bin, invariant):
    """Qwen3.forward_step over NumpyOps' block pool: two sequences at their own positions, their blocks scattered
    through the pool, each row's logits as the contiguous single-sequence cache gives them (exactly where the
    backend is batch invariant; within float32 rounding otherwise)."""
    mf = load(tiny_bin)
    rng = np.random.default_rng()
    a, b = _prompts(rng, [11, 6])
    ref = []
    for p in (a, b):
        m = Qwen3(mf, NumpyOps, 32)
        m.ops.batch_invariant = invariant
        ref.append(m.prefill(p, all_logits=True))
    m = Qwen3(mf, NumpyOps, 1)
    m.ops.batch_invariant = invariant
    m.ops.alloc_blocks(12, 4, 32)
    ta, tb = (9, 2, 5), (7, 0)
    m.forward_step(Step((Seq(tuple(a[:5]), 0, 0, ta),)))  # a's first 5 positions, then the rest beside b
    both = m.forward_step(Step((Seq(tuple(a[5:]), 5, 0, ta), Seq(tuple(b), 0, 1, tb))), all_logits=True)
    last = m.forward_step(Step((Seq((a[-1],), 11, 0, ta), Seq((b[-1],), 6, 1, tb))))
    assert both.shape == (6 + 6, mf.args.vocab_size) and last.shape == (2, mf.args.vocab_size)
    # (otherwise a step's GEMM shapes round the sums differently: float32 error against the logits' scale)
    check = np.testing.assert_array_equal if invariant else \
        (lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=1e-5 * np.abs(y).max()))
    check(both[:6], ref[0][5:])
    check(both[6:], ref[1])
    with pytest.raises(NotImplementedError):
        m.forward_step(Step((Seq((1,), 0), Seq((2,), 0, 1))))  # (no block tables: the contiguous cache holds one)


def test_greedy_tokens_of_a_batch_equal_each_request_alone(engines, monkeypatch):
    """Mixed prompt lengths, prompts prefilled 8 tokens a step beside the others' decode tokens, blocks of 4."""
    eng = engines["exact"]
    rng = np.random.default_rng()
    prompts = _prompts(rng, [1, 2, 5, 8, 9, 17, 31, 50])
    ns = rng.integers(3, 12, size=len(prompts)).tolist()
    want = [_alone(eng, p, n, GREEDY, eos_ids=[]) for p, n in zip(prompts, ns)]
    be = BatchEngine(eng, BatchConfig(max_context=96, block_size=4, chunk_size=8, n_blocks=200))
    steps = _spy_steps(be, monkeypatch)
    handles = [be.submit(p, GREEDY, n, eos_ids=[]) for p, n in zip(prompts, ns)]
    got = _run(be, handles)
    for p, w, g in zip(prompts, want, got):
        assert _key(g) == _key(w), len(p)
    assert max(n for s in steps for n, _ in s) == 8
    assert any(min(n for n, _ in s) == 1 and max(n for n, _ in s) > 1 for s in steps)  # decode beside a chunk
    assert be.pool.n_free == be.pool.n_blocks
    be.pool.check()


def test_a_long_prompt_joins_a_chunk_a_step_without_stalling_the_decoding_streams(engines, monkeypatch):
    """Two streams decode while a 60-token prompt arrives: every step carries both streams' next tokens beside one
    chunk of at most 8 prompt tokens, within the step's budget of 12 tokens."""
    eng = engines["fast"]
    rng = np.random.default_rng()
    be = BatchEngine(eng, BatchConfig(max_context=96, block_size=4, chunk_size=8, step_tokens=12, n_blocks=80))
    streams = [be.submit(p, GREEDY, 20, eos_ids=[]) for p in _prompts(rng, [3, 5])]
    be.step()
    assert all(len(h.take()) == 1 for h in streams)  # (both prompts fit the first step: each drew a token)
    steps = _spy_steps(be, monkeypatch)
    long = be.submit(_prompts(rng, [60])[0], GREEDY, 3, eos_ids=[])
    while long.t_first is None:
        be.step()
    assert len(steps) == 60 // 8 + 1
    for s in steps:
        assert [n for n, _ in s[:2]] == [1, 1] and len(s) == 3 and s[2][0] <= 8 and sum(n for n, _ in s) <= 12
    assert [s[2][1] for s in steps] == list(range(0, 60, 8))  # (the prompt's chunks, in order)
    assert all(len(h.take()) == len(steps) for h in streams)  # (a token for each stream every step)


def test_the_default_cpu_steps_agree_up_to_a_near_tie(engines):
    """Without batch invariance a step's GEMMs round a row's sums by the step's shape: tokens equal those of the
    request alone, or part at a step where alone's two likeliest tokens were within 1e-3 and the batch took the
    runner-up."""
    eng = engines["fast"]
    rng = np.random.default_rng()
    prompts = _prompts(rng, [3, 12, 26, 40])
    want = [_alone(eng, p, 10, GREEDY, eos_ids=[], logprobs=2) for p in prompts]
    be = BatchEngine(eng, BatchConfig(max_context=64, block_size=4, chunk_size=8, n_blocks=100))
    got = _run(be, [be.submit(p, GREEDY, 10, eos_ids=[]) for p in prompts])
    for w, g in zip(want, got):
        wt, gt = w[-1].tokens, g[-1].tokens
        k = next((i for i, (a, b) in enumerate(zip(wt, gt)) if a != b), None)
        if k is None:
            assert wt == gt
        else:
            (_, top), = [w[k].logprob]
            assert gt[k] == top[1][0] and top[0][1] - top[1][1] < 1e-3, (k, top)


def test_sampled_tokens_with_per_request_seeds_equal_each_request_alone(engines):
    eng = engines["exact"]
    rng = np.random.default_rng()
    prompts = _prompts(rng, [4, 11, 23, 7, 30])
    params = [SamplingParams(temperature=float(rng.uniform(0.5, 1.2)), top_k=int(rng.integers(0, 60)),
                             top_p=float(rng.uniform(0.7, 1.0)), repeat_penalty=float(rng.choice([1.0, 1.3])),
                             presence_penalty=float(rng.choice([0.0, 0.5])), seed=int(rng.integers(1 << 31)))
              for _ in prompts]
    want = [_alone(eng, p, 12, sp, eos_ids=[]) for p, sp in zip(prompts, params)]
    be = BatchEngine(eng, BatchConfig(max_context=64, block_size=4, chunk_size=6, n_blocks=100))
    got = _run(be, [be.submit(p, sp, 12, eos_ids=[]) for p, sp in zip(prompts, params)])
    assert [_key(g) for g in got] == [_key(w) for w in want]
    assert len({tuple(g[-1].tokens) for g in got}) == len(got)


def test_preempted_sequences_resume_with_the_same_tokens(engines):
    """A pool of 16 blocks of 4 for six sequences growing to 40 positions: the newest are preempted (their blocks
    released, computed again later from prompt and drawn tokens) rather than failing."""
    eng = engines["exact"]
    rng = np.random.default_rng()
    prompts = _prompts(rng, [10, 14, 6, 18, 9, 12])
    want = [_alone(eng, p, 22, GREEDY, eos_ids=[]) for p in prompts]
    be = BatchEngine(eng, BatchConfig(max_context=40, block_size=4, chunk_size=8, n_blocks=16))
    handles = [be.submit(p, GREEDY, 22, eos_ids=[]) for p in prompts]
    got = _run(be, handles)
    assert sum(h.request.preemptions for h in handles) > 0
    for w, g in zip(want, got):
        assert [r.token for r in g] == [r.token for r in w] and g[-1].tokens == w[-1].tokens
    assert be.pool.n_free == 16
    be.pool.check()


def test_cancelled_requests_free_their_blocks(engines):
    eng = engines["fast"]
    rng = np.random.default_rng()
    be = BatchEngine(eng, BatchConfig(max_context=64, block_size=4, chunk_size=8, n_blocks=64, max_seqs=3,
                                      prefix_caching=False))
    handles = [be.submit(p, GREEDY, 30, eos_ids=[]) for p in _prompts(rng, [9, 13, 5, 7])]
    for _ in range(4):
        be.step()
    tables = be.sched.kv.tables
    assert handles[3].request not in tables  # (max_seqs 3: the fourth waits)
    held = len(tables[handles[1].request])
    used = be.pool.n_used
    for h in handles:
        h.take()
    handles[1].cancel()
    handles[3].cancel()
    be.step()
    assert handles[1].done and handles[1].finish_reason == "cancelled" and handles[1].take() == []
    assert handles[3].finish_reason == "cancelled" and handles[3].request not in tables
    assert be.pool.n_used <= used - held + 2  # (the two left may each have taken a block this step)
    be.run_until_done()
    assert handles[1].take() == [] and handles[0].take()[-1].finish_reason == "length"
    assert be.pool.n_free == 64 and be.active == 0
    be.pool.check()


def _soak(eng, n_requests):
    """n_requests mixed requests joining a running batch a few at a time (shared prefixes, greedy and sampled,
    eos and stop strings, cancellations, a pool small enough to preempt): the pool's free count afterwards."""
    rng = np.random.default_rng()
    be = BatchEngine(eng, BatchConfig(max_context=48, block_size=4, chunk_size=8, n_blocks=60, max_seqs=16))
    start = be.pool.n_free
    heads = _prompts(rng, [0, 4, 8, 13])
    live, left = [], n_requests
    while left or be.active:
        for _ in range(int(min(left, rng.integers(0, 4)))):
            p = heads[int(rng.integers(4))] + rng.integers(0, 2000, size=int(rng.integers(1, 24))).tolist()
            sp = GREEDY if rng.random() < 0.5 else SamplingParams(temperature=0.8, seed=int(rng.integers(1 << 31)))
            live.append(be.submit(p, sp, int(rng.integers(0, 7)), stop=["a"] if rng.random() < 0.2 else None,
                                  eos_ids=None if rng.random() < 0.5 else []))
            left -= 1
        for h in live:
            if not h.done and rng.random() < 0.02:
                h.cancel()
        be.step()
        be.pool.check()
    assert all(h.done for h in live) and len(live) == n_requests
    return start, be.pool.n_free, sum(h.request.preemptions for h in live), be.pool.stats.hit_blocks


def test_a_soak_of_500_mixed_requests_gives_every_block_back(engines):
    start, end, _, hits = _soak(engines["fast"], 500)
    assert end == start and hits > 0


def test_prefix_caching_reuses_a_shared_prefix_and_gives_the_same_tokens(engines):
    eng = engines["exact"]
    rng = np.random.default_rng()
    system = _prompts(rng, [13])[0]  # three full blocks of 4 and a token
    prompts = [system + s for s in _prompts(rng, [3, 1, 6, 9])]
    runs = {}
    for caching in (True, False):
        be = BatchEngine(eng, BatchConfig(max_context=48, block_size=4, chunk_size=8, n_blocks=80,
                                          prefix_caching=caching))
        first = _run(be, [be.submit(prompts[0], GREEDY, 6, eos_ids=[])])
        rest = _run(be, [be.submit(p, GREEDY, 6, eos_ids=[]) for p in prompts[1:]])
        runs[caching] = (first + rest, be.pool.stats.hit_blocks)
    (cached, hits), (plain, no_hits) = runs[True], runs[False]
    assert hits == 3 * 3 and no_hits == 0
    assert [r[-1].cached_tokens for r in cached] == [0, 12, 12, 12] and plain[1][-1].cached_tokens == 0
    assert [r[-1].prompt_tokens for r in cached] == [len(prompts[0])] + [len(p) - 12 for p in prompts[1:]]
    assert [[x.token for x in r] for r in cached] == [[x.token for x in r] for r in plain]
    want = [_alone(eng, p, 6, GREEDY, eos_ids=[]) for p in prompts]
    assert [r[-1].tokens for r in cached] == [w[-1].tokens for w in want]


def test_stop_strings_eos_logprobs_and_context_end_as_alone(engines):
    """Within a context of 20 positions: a stop string from the middle of the greedy text, an end-of-sequence id
    drawn at the sixth token, log-probabilities, and a reply cut by the context's end."""
    eng = engines["exact"]
    rng = np.random.default_rng()
    p = _prompts(rng, [9])[0]
    full = _alone(eng, p, 16, GREEDY, eos_ids=[], max_context=20)
    text = "".join(r.text for r in full)
    stop = text[len(text) // 2:len(text) // 2 + 2] if len(text) > 4 else "zz"
    cases = [dict(stop=[stop], eos_ids=[]), dict(eos_ids=[full[5].token]), dict(eos_ids=[], logprobs=3)]
    be = BatchEngine(eng, BatchConfig(max_context=20, block_size=4, chunk_size=4, n_blocks=40))
    handles = [be.submit(p, GREEDY, 16, **c) for c in cases] + [be.submit(p, GREEDY, 0)]
    got = _run(be, handles)
    for c, g in zip(cases, got):
        assert _key(g) == _key(_alone(eng, p, 16, GREEDY, max_context=20, **c)), c
    assert got[1][-1].finish_reason == "stop" and got[2][-1].finish_reason == "context"
    assert [(r.token, r.finish_reason) for r in got[3]] == [(None, "length")]


def test_a_request_that_cannot_fit_is_an_error(engines):
    be = BatchEngine(engines["fast"], BatchConfig(max_context=16, block_size=4, n_blocks=8))
    with pytest.raises(KuiperError, match="does not fit"):
        be.submit(list(range(17)), GREEDY, 1)
    with pytest.raises(KuiperError, match="empty"):
        be.submit([], GREEDY, 1)
    with pytest.raises(KuiperError, match="cannot hold one sequence") as e:
        BatchEngine(engines["fast"], BatchConfig(max_context=64, block_size=4, n_blocks=8))
    assert e.value.exit_code == 3  # (a resource limit, as out of memory)


def test_bench_batch_rows(tiny_bin):
    r = run_cli("bench", "-m", tiny_bin, "-p", "4", "-n", "3", "-r", "1", "--batch", "1,3", "-o", "json",
                "--device", "cpu")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["test"], x["n_seq"]) for x in rows] == [("pp4 @ b1", 1), ("pp4 @ b3", 3), ("tg3 @ b1", 1),
                                                       ("tg3 @ b3", 3)]
    assert all(x["avg_ts"] > 0 for x in rows)
    bad = run_cli("bench", "-m", tiny_bin, "--batch", "0", "--device", "cpu")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert [ln for ln in bad.stderr.splitlines() if ln.startswith("kuiper: error")] != []


def test_bench_batch_refuses_a_backend_that_runs_one_sequence(tiny_bin, monkeypatch, capsys):
    monkeypatch.setattr(NumpyOps, "max_batch", 1)
    with pytest.raises(SystemExit) as e:
        main(["bench", "-m", str(tiny_bin), "-p", "0", "-n", "2", "--batch", "1,16", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert e.value.code != 0 and out == ""
    lines = [ln for ln in err.splitlines() if ln.startswith("kuiper: error")]
    assert len(lines) == 1 and "max_batch 1" in lines[0] and "Traceback" not in err


def test_the_server_worker_steps_concurrent_jobs_together(tiny_bin, engines):
    """EngineWorker(max_seqs=4) on the CPU: six jobs at once run through the BatchEngine, four at a time; each
    gets the records it gets alone, a cancelled one ends early, and every block comes back."""
    import threading

    from kuiper_py.serve.engine_worker import EngineWorker, Job
    from kuiper_py.serve.metrics import Metrics

    w = EngineWorker(str(tiny_bin), "cpu", 64, 8, Metrics(), max_seqs=4)
    w.start()
    try:
        assert w.ready.wait(120) and w.error is None and w.batch is not None and w.cache is None
        w.batch.model.ops.batch_invariant = True
        rng = np.random.default_rng()
        prompts = _prompts(rng, [3, 9, 17, 5, 12, 7])
        got = [[] for _ in prompts]
        ended = [threading.Event() for _ in prompts]

        def emit(i):
            return lambda item: ended[i].set() if item is None else got[i].append(item)
        jobs = [Job(p, 8, GREEDY, emit(i), eos_ids=[]) for i, p in enumerate(prompts)]
        jobs.append(Job(prompts[0], 40, GREEDY, lambda item: None, eos_ids=[]))
        jobs[-1].cancelled.set()  # (cancelled before it ran: it ends without records)
        for j in jobs:
            w.submit(j)
        assert all(e.wait(120) for e in ended)
        for p, g in zip(prompts, got):
            assert _key(g) == _key(_alone(engines["exact"], p, 8, GREEDY, eos_ids=[]))
        assert w.batch.pool.n_free == w.batch.pool.n_blocks and not w.active
        assert w.batch.steps < 6 * 8 // 2  # (stepped together: one at a time takes 6 x 8 steps)
        text = w.metrics.render().decode()
        assert "kuiper_generation_tokens_total 48.0" in text and "kuiper_num_requests_running 0.0" in text
    finally:
        w.stop()
    assert EngineWorker(str(tiny_bin), "cpu", 64, 8, Metrics()).max_seqs == 1  # (one job at a time by default)
