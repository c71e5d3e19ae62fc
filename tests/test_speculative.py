"""Speculative decoding (kuiper_py.speculative, generate --draft/--lookup) on the CPU: greedy output equals plain
greedy decoding token for token, and sampled output is distributed as plain sampling's (chi-squared)."""
import dataclasses
import json
import shutil

import numpy as np
import pytest

from kuiper_py import speculative as spec
from kuiper_py import synth
from kuiper_py.export import export
from kuiper_py.generate import Engine, generate
from kuiper_py.sampling import SamplingParams, sample

from conftest import run_cli

ALPHA = 1e-3  # the chi-squared tests' significance


def spec_files(d, files) -> dict:
    """{name: exported ak48 path} for (name, preset, seed) triples: quantized random float weights (a varied greedy
    path, not one id repeated)."""
    out = {}
    for name, preset, seed in files:
        out[name] = d / f"{name}.bin"
        export(synth.make_checkpoint(d / name, preset, seed=seed, n_shards=1), out[name], progress=False,
               log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def files(tiny_bin, moe_bin, untied_bin):
    """The session's files: a dense and an MoE target, and a random draft of another shape (tiny-untied)."""
    return {"dense": tiny_bin, "moe": moe_bin, "other": untied_bin}


@pytest.fixture(scope="module")
def engines(files):
    """The targets, and the drafts (the other file; the targets' files again: a draft has its own cache) loaded as
    the CLI loads a draft, without a tokenizer (~0.8 s each here)."""
    out = {k: Engine.load(files[k], "cpu") for k in ("dense", "moe")}
    out["other"] = Engine.load(files["other"], "cpu", need_tokenizer=False)
    out.update({"self_" + k: Engine.load(files[k], "cpu", need_tokenizer=False) for k in ("dense", "moe")})
    return out


def _records(recs):
    recs = list(recs)
    return [(r.token, r.text, r.finish_reason) for r in recs], recs[-1].tokens


@pytest.fixture(scope="module")
def plain(engines):
    """plain(target, ids, n, params, **options): plain generate()'s records on engines[target], each request decoded
    once per module (the greedy tests ask for the same reference at every K)."""
    memo = {}

    def get(target, ids, n, params, **kw):
        key = (target, tuple(ids), n, repr(params), repr(sorted(kw.items())))
        if key not in memo:
            memo[key] = _records(generate(engines[target], ids, n, params, **kw))
        return memo[key]
    return get


def _prompt(eng, text="one two three one two three one two"):
    return eng.tokenizer.encode(text)


def _proposer(kind, engines, target):
    if kind == "lookup":
        return spec.Lookup(2)
    return spec.Draft(engines["other" if kind == "draft" else "self_" + target], engines[target])


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("target", ["dense", "moe"])
@pytest.mark.parametrize("kind", ["draft", "self", "lookup"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_equals_plain(engines, plain, target, kind, k):
    """A random draft (rejections), the target itself as draft (acceptances) and prompt lookup: the records equal
    plain greedy decoding's."""
    eng = engines[target]
    ids = _prompt(eng)
    want = plain(target, ids, 40, GREEDY)
    stats = spec.Stats()
    got = _records(spec.generate(eng, _proposer(kind, engines, target), ids, 40, GREEDY, k=k, stats=stats))
    assert got == want
    assert stats.steps > 0 and stats.accepted <= stats.proposed
    if kind == "self":
        assert stats.accepted == stats.proposed > 0


@pytest.mark.parametrize("target", ["dense", "moe"])
def test_greedy_with_penalties_equals_plain(engines, target):
    """The penalties see each verified position's own history (the accepted guesses before it)."""
    eng = engines[target]
    ids = _prompt(eng)
    params = SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=16, presence_penalty=0.5,
                            frequency_penalty=0.3)
    want = _records(generate(eng, ids, 40, params))
    for kind in ("self", "lookup"):
        assert _records(spec.generate(eng, _proposer(kind, engines, target), ids, 40, params, k=4)) == want


@pytest.mark.parametrize("target", ["dense", "moe"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_at_the_context_limit(engines, plain, target, k):
    """The last steps before --max-context shrink K: the same tokens and the 'context' finish as plain decoding."""
    eng = engines[target]
    ids = _prompt(eng)
    for extra in (1, 2, 9):
        ctx = len(ids) + extra
        want = plain(target, ids, 50, GREEDY, max_context=ctx)
        assert want[0][-1][2] == "context"
        for kind in ("self", "lookup"):
            got = _records(spec.generate(eng, _proposer(kind, engines, target), ids, 50, GREEDY, k=k, max_context=ctx))
            assert got == want, (extra, kind)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_with_stop_strings_and_eos(engines, plain, k):
    eng = engines["dense"]
    ids = _prompt(eng)
    recs, toks = plain("dense", ids, 30, GREEDY)
    text = "".join(t for _, t, _ in recs)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    eos = [toks[len(toks) // 2]]
    for kw in (dict(stop=[stop]), dict(eos_ids=eos), dict(stop=["\x00never"], eos_ids=eos)):
        want = plain("dense", ids, 30, GREEDY, **kw)
        assert want[0][-1][2] == "stop"
        for kind in ("self", "lookup", "draft"):
            assert _records(spec.generate(eng, _proposer(kind, engines, "dense"), ids, 30, GREEDY, k=k, **kw)) == want


def test_replay_proposer_forces_acceptance(engines):
    """The benchmark's proposer: the true continuation replayed is always accepted, a corrupted one never."""
    eng = engines["dense"]
    ids = _prompt(eng)
    _, cont = _records(generate(eng, ids, 25, GREEDY))
    for rate, want in ((1.0, 1.0), (0.0, 0.0)):
        st = spec.Stats()
        _, got = _records(spec.generate(eng, spec.Replay(len(ids), cont, rate), ids, 25, GREEDY, k=4, stats=st))
        assert got == cont and st.accepted == want * st.proposed and st.proposed > 0


def test_lookup_proposes_the_latest_continuation():
    lk = spec.Lookup(2)
    seq = [5, 6, 1, 2, 7, 8, 9, 1, 2, 3, 4, 1, 2]
    assert lk.propose(seq, 3, None, 100, None)[0] == [3, 4, 1]
    assert lk.propose(seq, 10, None, 100, None)[0] == [3, 4, 1, 2]
    assert lk.propose([1, 2, 3, 4], 3, None, 100, None)[0] == []


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray, sims: int = 20000) -> float:
    """Pearson's goodness of fit of counts to probabilities, its p-value calibrated by simulation: the share of
    `sims` multinomial samples of the same size drawn from probs whose statistic is at least the observed one. The
    chi-squared approximation is not used: with one outcome at ~99% of 800 draws, the rest expect ~6 hits between
    them and the approximation read p < 1e-3 for 0.26% of samples drawn from probs themselves (40,000 simulated,
    2.6 times the significance), where the simulated p-value's rate is the significance itself."""
    if counts[probs == 0].any():  # (an outcome of probability zero)
        return 0.0
    keep = probs > 0
    counts, probs = counts[keep], probs[keep] / probs[keep].sum()
    n = int(counts.sum())
    exp = probs * n

    def stat(c):
        return ((c - exp) ** 2 / exp).sum(axis=-1)
    null = stat(np.random.default_rng(12345).multinomial(n, probs, size=sims))
    return float((1 + (null >= stat(counts) - 1e-9).sum()) / (sims + 1))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=0, top_p=1.0),
                                    SamplingParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05,
                                                   repeat_penalty=1.3)])
def test_distribution_is_what_the_plain_sampler_draws(params):
    """distribution() against sampling.sample()'s empirical frequencies on fresh random logits."""
    rng = np.random.default_rng()
    logits = rng.standard_normal(40).astype(np.float32)
    hist = rng.integers(0, 40, 10).tolist()
    p = spec.distribution(logits, params, hist, [], 40)
    n = 20000
    counts = np.bincount([sample(logits, params, rng, hist, 40) for _ in range(n)], minlength=40)
    assert _chi2_pvalue(counts, p) > ALPHA


@pytest.mark.parametrize("one_hot", [False, True])
def test_verify_first_token_is_distributed_as_the_target(one_hot):
    """verify() on fresh random p and q (a sampled draft, or a fixed guess as prompt lookup makes): the first
    token it yields is distributed as p, and a guess is kept with probability min(1, p/q)."""
    rng = np.random.default_rng()
    V, n = 12, 20000
    rows = (rng.standard_normal((3, V)) * 1.5).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    p0 = spec.distribution(rows[0], params, [], [], V)
    q = rng.dirichlet(np.ones(V), size=2)
    first = np.zeros(V)
    for _ in range(n):
        guesses = [int(rng.integers(V)) if one_hot else spec.draw(q[0], rng), spec.draw(q[1], rng)]
        out = spec.verify(rows, guesses, None if one_hot else list(q), params, [], [], V, rng)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
    assert _chi2_pvalue(first, p0) > ALPHA


def _exact_joint(eng, ids, params, depth):
    """The target's exact probabilities of every sequence of `depth` tokens (small support through top-k)."""
    model = eng.session(len(ids) + depth)
    out = {}

    def walk(prefix, prob):
        if len(prefix) == depth:
            out[tuple(prefix)] = prob
            return
        model.reset()
        x = model.prefill(ids + prefix)
        p = spec.distribution(x, params, ids + prefix, prefix, eng.n_valid_tokens)
        for t in np.flatnonzero(p):
            walk(prefix + [int(t)], prob * p[t])
    walk([], 1.0)
    return out


class _Sharper(spec.Draft):
    """The target as its own draft, drawing at a quarter of the temperature from its top 4: q overlaps p (and puts
    mass on an id outside p's top 3) but differs from it, as a trained draft's does."""

    def propose(self, seq, k, params, n_valid, rng, n_prompt=0):
        q_params = dataclasses.replace(params, temperature=params.temperature / 4, top_k=4)
        return super().propose(seq, k, q_params, n_valid, rng, n_prompt)


@pytest.fixture(scope="module")
def hot(engines):
    """The sampled cases' setting, worked out once: the prompt, top-k 3 at temperature 8, the target's exact joint
    probabilities of the first three tokens, and its greedy continuation (which Replay replays)."""
    eng = engines["dense"]
    ids = _prompt(eng, "a b a b a b a")
    params = SamplingParams(temperature=8.0, top_k=3, top_p=1.0)
    _, cont = _records(generate(eng, ids, 3, GREEDY))
    return ids, params, _exact_joint(eng, ids, params, 3), cont


@pytest.mark.parametrize("kind", ["sharper", "self", "replay"])
def test_sampled_output_matches_the_targets_distribution(engines, hot, kind):
    """Top-k 3 at temperature 8: the first three tokens of 800 seeded speculative runs against the target's exact
    joint probabilities (27 cells, 22 of them expecting 5 draws or more). At temperature 1 the tiny model puts ~99%
    on one outcome: there a rejection resampled from p instead of max(0, p - q) (replay) and a greedy bonus token
    (self) went unnoticed (p-values 0.03 and 0.58); at 8 both fail (p < 1e-4), as do a guess always kept, kept with
    min(1, q/p) or kept whenever p gives it mass (sharper, replay; with q = p these change nothing). Each run
    verifies one guess (max_tokens 3 leaves room for one before the bonus token). The proposals:
    - sharper: q overlapping p but unlike it (_Sharper): ~70% of the guesses kept with probability min(1, p/q), the
      rest resampled from max(0, p - q). (The random draft of another shape, the other file, is not run here: its
      top 3 and the target's are disjoint, every guess is rejected and the output is plain sampling's at any
      temperature; the greedy cases run it.)
    - self: q = p, every guess kept (p/q is 1 within 1e-5: the draft's logits come from other shapes), then the
      bonus token.
    - replay: q one-hot, as prompt lookup proposes: the greedy path, ~40% kept, corrupted 30% of the time (an id
      outside the top 3, always rejected)."""
    eng = engines["dense"]
    ids, params, exact, cont = hot
    params = dataclasses.replace(params)
    keys = list(exact)
    counts = np.zeros(len(keys))
    seeds = np.random.default_rng().integers(0, 2**31, 800)
    st = spec.Stats()
    for s in seeds:
        params.seed = int(s)
        prop = (spec.Replay(len(ids), cont, 0.7, seed=int(s)) if kind == "replay" else
                _Sharper(engines["self_dense"], eng) if kind == "sharper" else _proposer(kind, engines, "dense"))
        _, got = _records(spec.generate(eng, prop, ids, 3, params, k=2, stats=st))
        counts[keys.index(tuple(got))] += 1
    assert _chi2_pvalue(counts, np.array([exact[k] for k in keys])) > ALPHA
    if kind == "self":
        assert st.accepted >= 0.99 * st.proposed > 0, st
    else:
        assert 0 < st.accepted < st.proposed, st  # (both the acceptance and the resample ran)


def test_cli_generate_with_draft_and_lookup(files):
    plain = run_cli("generate", "-m", files["dense"], "-p", "one two one two", "-n", "24", "--temp", "0",
                    "--device", "cpu", "--json")
    assert plain.returncode == 0, plain.stderr
    want = json.loads(plain.stdout)
    for extra in (["--draft", files["dense"], "--draft-tokens", "3"], ["--lookup", "2"]):
        r = run_cli("generate", "-m", files["dense"], "-p", "one two one two", "-n", "24", "--temp", "0",
                    "--device", "cpu", "--json", *extra)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert (got["text"], got["tokens"]) == (want["text"], want["tokens"])
        s = got["timings"]["speculative"]
        assert s["proposed"] >= s["accepted"] >= 0 and s["verify_steps"] > 0 and "mean_accepted_length" in s
        r = run_cli("generate", "-m", files["dense"], "-p", "one two one two", "-n", "24", "--temp", "0",
                    "--device", "cpu", "-v", *extra)
        assert r.returncode == 0 and r.stdout.strip() == want["text"].strip()
        assert "accepted" in r.stderr


def test_cli_rejects_bad_speculative_flags(files, tmp_path):
    base = ["generate", "-m", files["dense"], "-p", "hi", "-n", "4", "--device", "cpu"]
    for extra, msg in ((["--lookup", "0"], "--lookup"), (["--draft-tokens", "0", "--lookup", "2"], "--draft-tokens"),
                       (["--draft", files["dense"], "--lookup", "2"], "one of"),
                       (["--draft", tmp_path / "none.bin"], "none.bin")):
        r = run_cli(*base, *extra)
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("kuiper: error:") and msg in r.stderr


def other_tokenizer_file(tiny_dir, tmp_path):
    """The tiny checkpoint exported with one more added token: a draft whose tokenizer differs from the target's."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_dir, ck)
    tj = json.loads((ck / "tokenizer.json").read_text())
    tj["added_tokens"].append({**tj["added_tokens"][-1], "id": tj["added_tokens"][-1]["id"] + 1,
                               "content": "<|kuiper_extra|>"})
    (ck / "tokenizer.json").write_text(json.dumps(tj))
    other = tmp_path / "other_tok.bin"
    export(ck, other, progress=False, log=lambda m: None)
    return other


def test_cli_draft_with_another_tokenizer_is_one_error_line(files, tiny_dir, tmp_path):
    other = other_tokenizer_file(tiny_dir, tmp_path)
    r = run_cli("generate", "-m", files["dense"], "-p", "hi", "-n", "4", "--device", "cpu", "--draft", other)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("kuiper: error: --draft") and "tokenizer" in r.stderr


def test_bench_tool_runs_on_the_cpu(files, tmp_path):
    """tools/bench_speculative.py end to end on tiny files: every figure present, the always-agree proposal and
    forced rate 1 accept every guess, rate 0 none."""
    import subprocess
    import sys
    from conftest import ROOT
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_speculative.py"), "--target", files["dense"],
                        "--draft", files["other"], "--device", "cpu", "-n", "10", "--reps", "2", "--rates", "0,1",
                        "--json", out], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert all(f"verify_k{k}_ratio" in res["steps"] for k in (1, 2, 4, 8))
    t = res["throughput"]
    assert t["always_agree"]["acceptance_rate"] == 1.0 and t["always_agree"]["proposed"] > 0
    assert t["replay_parts_from_plain_at"] is None  # (on the CPU the verify steps pick plain decoding's tokens)
    rates = {row["forced_rate"]: row["acceptance_rate"] for row in t["draft_forced"]}
    assert rates == {0.0: 0.0, 1.0: 1.0}
    assert "always-agree" in r.stdout


@pytest.mark.parametrize("extra", [["--lookup", "2"], ["--draft", "DENSE", "--draft-tokens", "8"]])
def test_cli_chat_speculative_equals_plain(files, extra):
    """Three turns on one cache (the later ones reuse the earlier turns' prefix, a stop string ends one): the
    replies and their tokens equal plain chat's; each reply reports its guesses."""
    extra = [files["dense"] if a == "DENSE" else a for a in extra]
    msgs = "say one two one two\nand again\nonce more\n"
    base = ["chat", "-m", files["dense"], "-n", "20", "--temp", "0", "--device", "cpu", "--json", "--stop", "ab",
            "--seed", "1"]
    want = run_cli(*base, input=msgs)
    got = run_cli(*base, *extra, "-v", input=msgs)
    assert want.returncode == got.returncode == 0, got.stderr
    plain = [json.loads(line) for line in want.stdout.splitlines()]
    mine = [json.loads(line) for line in got.stdout.splitlines()]
    # (not compared: how much of each prompt the cache held; a speculative reply's last token is not fed back)
    skip = ("timings", "prompt_tokens", "cached_tokens")
    assert len(mine) == 3 and [{k: v for k, v in d.items() if k not in skip} for d in mine] == \
        [{k: v for k, v in d.items() if k not in skip} for d in plain]
    assert mine[1]["cached_tokens"] > 0
    assert all(d["timings"]["speculative"]["verify_steps"] > 0 for d in mine)
    assert got.stderr.count("guesses accepted") == 4  # (a line per reply and the chat's total)
