#!/usr/bin/env python3
"""Speculative decoding figures at batch 1, greedy, one process:

1. the verify step (a prefill of K+1 tokens, every position's logits) at K = 1, 2, 4, 8 relative to one decode step;
2. the upper bound: tokens/s with a proposal that always agrees (the target's own greedy continuation replayed: the
   verify path's own where its greedy picks part from plain decoding's at a near tie) at K = 4 against plain decoding;
3. tokens/s at forced acceptance rates (0, 0.25, 0.5, 0.75, 1): the draft model runs its steps as it would (their
   cost is real) and its guesses are replaced by the true continuation, each corrupted with probability 1 - a.
   Random weights accept nothing on real text: these rows tell what a real draft of a known acceptance rate gives.

    python tools/bench_speculative.py --target T.bin --draft D.bin [--device cuda] [-n 128] [--json F]

A MoE target (30B-A3B) answers whether verifying K tokens (more experts touched) still pays.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kuiper_py import speculative as spec  # noqa: E402
from kuiper_py.generate import Engine, generate  # noqa: E402
from kuiper_py.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0)
PROMPT_LEN = 64


def _prompt(eng) -> list[int]:
    """A fixed prompt of PROMPT_LEN ids (the tokenizer's ordinary ids; no text needed)."""
    return [(1000 + 37 * i) % 100000 for i in range(PROMPT_LEN)]


def _timed(model, fn, reps: int) -> float:
    """Median seconds of fn() over reps runs, the device synchronized around each."""
    out = []
    for _ in range(reps + 1):
        model.ops.synchronize()
        t0 = time.perf_counter()
        fn()
        model.ops.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])  # (the first run builds kernels and captures graphs)


def verify_vs_decode(eng, reps: int) -> dict:
    """Seconds of one decode step and of the verify step at each K, at the prompt's position."""
    ids = _prompt(eng)
    model = eng.session(len(ids) + 16)
    model.prefill(ids)
    pos = model.pos

    def decode():
        model.rewind(pos)
        model.decode(ids[-1])

    def verify(k):
        model.rewind(pos)
        model.prefill(ids[-1 - k:], all_logits=True)

    d = _timed(model, decode, reps)
    out = {"decode_s": d}
    for k in (1, 2, 4, 8):
        out[f"verify_k{k}_s"] = v = _timed(model, lambda: verify(k), reps)
        out[f"verify_k{k}_ratio"] = round(v / d, 3)
    return out


class CostedReplay:
    """The draft model proposes (its steps cost what they cost), then its guesses are swapped for the replayed
    continuation corrupted at a forced rate."""

    def __init__(self, draft: spec.Draft, replay: spec.Replay):
        self.draft, self.replay = draft, replay

    def start(self, max_context: int) -> None:
        self.draft.start(max_context)

    def propose(self, seq, k, params, n_valid, rng, n_prompt=0):
        self.draft.propose(seq, k, params, n_valid, rng, n_prompt)
        return self.replay.propose(seq, k, params, n_valid, rng, n_prompt)


def _tok_s(records) -> tuple[float, list[int]]:
    last = list(records)[-1]
    return last.decode_steps / max(last.gen_seconds, 1e-9), last.tokens


def _spec_run(eng, proposer, ids, n, k) -> dict:
    st = spec.Stats()
    tok_s, _ = _tok_s(spec.generate(eng, proposer, ids, n, GREEDY, k=k, stats=st))
    return {"tok_s": round(tok_s, 2), **st.as_dict()}


def _verify_path_continuation(eng, ids, n: int, k: int, cont: list[int]) -> tuple[list[int], int | None]:
    """The continuation the replays propose: plain decoding's greedy tokens, unless the verify steps' greedy picks part
    from them (their fp16 sums differ from a decode step's, so a near tie, a MoE router's above all, may resolve the
    other way): from there every plain token would be refused and "always agree" would not agree. Then the verify
    path's own output, replayed until it reproduces itself; with the index of the first token where it parts from
    plain decoding (None where it does not)."""
    parted, src = None, cont
    for _ in range(3):
        _, own = _tok_s(spec.generate(eng, spec.Replay(len(ids), src, 1.0), ids, n, GREEDY, k=k))
        if own == src:
            break
        if parted is None:
            parted = next((i for i, (a, b) in enumerate(zip(own, cont)) if a != b), min(len(own), len(cont)))
        src = own
    return src, parted


def throughput(eng, draft_eng, n: int, k: int, rates) -> dict:
    ids = _prompt(eng)
    _tok_s(generate(eng, ids, 8, GREEDY))  # (warm-up: kernels, graphs)
    plain, cont = _tok_s(generate(eng, ids, n, GREEDY))
    out = {"plain_tok_s": round(plain, 2), "k": k, "n": n}
    # (its untimed runs also warm up the verify shapes)
    cont, out["replay_parts_from_plain_at"] = _verify_path_continuation(eng, ids, n, k, cont)
    agree = _spec_run(eng, spec.Replay(len(ids), cont, 1.0), ids, n, k)
    out["always_agree"] = {**agree, "speedup": round(agree["tok_s"] / plain, 3)}
    if draft_eng is not None:
        draft = spec.Draft(draft_eng, eng)
        rows = []
        for a in rates:
            r = _spec_run(eng, CostedReplay(draft, spec.Replay(len(ids), cont, a, seed=1)), ids, n, k)
            rows.append({"forced_rate": a, **r, "speedup": round(r["tok_s"] / plain, 3)})
        out["draft_forced"] = rows
    return out


@click.command()
@click.option("--target", required=True, type=click.Path(exists=True), help="The target ak48 file.")
@click.option("--draft", type=click.Path(exists=True), default=None, help="A draft ak48 file (same vocabulary).")
@click.option("--device", default="auto", show_default=True)
@click.option("-n", "--n-gen", default=128, show_default=True, help="Tokens generated per run.")
@click.option("-k", "--draft-tokens", default=4, show_default=True)
@click.option("--reps", default=20, show_default=True, help="Repetitions of each timed step.")
@click.option("--rates", default="0,0.25,0.5,0.75,1", show_default=True, help="Forced acceptance rates.")
@click.option("--json", "json_out", type=click.Path(), default=None, help="Also write the figures to this file.")
def main(target, draft, device, n_gen, draft_tokens, reps, rates, json_out):
    eng = Engine.load(target, device)
    draft_eng = Engine.load(draft, eng.device, need_tokenizer=False) if draft else None
    a = eng.file.args
    res = {"target": str(target), "draft": draft, "device": eng.device, "moe": bool(a.num_experts),
           "steps": verify_vs_decode(eng, reps)}
    s = res["steps"]
    print(f"decode step {s['decode_s'] * 1e3:.3f} ms; verify step / decode step: "
          + ", ".join(f"K={k} {s[f'verify_k{k}_ratio']:.2f}x" for k in (1, 2, 4, 8)))
    res["throughput"] = t = throughput(eng, draft_eng, n_gen, draft_tokens, [float(x) for x in rates.split(",")])
    if t["replay_parts_from_plain_at"] is not None:
        print(f"the verify steps' greedy tokens part from plain decoding's at token {t['replay_parts_from_plain_at']} "
              "(a near tie): the replays propose the verify path's own continuation")
    print(f"plain decode {t['plain_tok_s']:.1f} tok/s; always-agree K={draft_tokens}: "
          f"{t['always_agree']['tok_s']:.1f} tok/s ({t['always_agree']['speedup']:.2f}x)")
    for r in t.get("draft_forced", []):
        print(f"draft, forced acceptance {r['forced_rate']:.2f}: {r['tok_s']:.1f} tok/s ({r['speedup']:.2f}x), "
              f"accepted {r['acceptance_rate']:.2f}, mean accepted length {r['mean_accepted_length']:.2f}")
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
