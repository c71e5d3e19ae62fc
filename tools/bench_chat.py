#!/usr/bin/env python3
"""A chat's turns on one KV cache (generate.Chat, what `kuiper chat` runs): for each turn, the tokens the cache
already held and the ones prefilled, the time to the first reply token, and the reply's decode speed; beside it the
time to the first token of a stateless engine, which prefills the whole conversation again every turn (from an
empty cache, timed by the same generate() core with one token, the best of 3: a prompt of up to 512 tokens then
replays its bucket's prefill graph). A warm-up chat of the same shape runs first (kernels loaded, buffers grown), so
the figures are a running process's; the measured chat then starts on a new cache and captures every prefill bucket's
graph at its start (Chat's warm), whose time is printed too. Replies are greedy, from the synthetic weights, so their
text is noise; their token counts are what the next turn's prompt is made of. Table last, JSON with --json.

    python tools/bench_chat.py MODEL.bin [--turns 8] [--reply 64] [--words 40] [--ctx 4096] [--device cuda] [--json F]
"""
import json
import sys
import time
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kuiper_py.generate import Chat, Engine, generate  # noqa: E402
from kuiper_py.sampling import SamplingParams  # noqa: E402

WORDS = ("the sea stone river cloud lamp garden winter bridge violin harbour maple tell me about why how does a "
         "story of old new light long short").split()


def stateless_first_token(eng: Engine, ids: list[int], ctx: int) -> float:
    """Seconds to the first token of a fresh session on the whole prompt (the cache reset, nothing reused)."""
    t0 = time.perf_counter()
    for _ in generate(eng, ids, 1, SamplingParams(temperature=0.0), eos_ids=[], max_context=ctx):
        break
    return time.perf_counter() - t0


@click.command()
@click.argument("model", type=click.Path(exists=True))
@click.option("--turns", default=8, show_default=True)
@click.option("--reply", default=64, show_default=True, help="Tokens per reply.")
@click.option("--words", default=40, show_default=True, help="Words per user message.")
@click.option("--ctx", default=4096, show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--json", "json_out", default=None)
def main(model, turns, reply, words, ctx, device, json_out):
    eng = Engine.load(model, device)
    greedy = SamplingParams(temperature=0.0)

    def run_chat(seed: int, ctx: int, warm: bool) -> tuple[list[dict], float, list[int]]:
        rng, rows = np.random.default_rng(seed), []
        t0 = time.perf_counter()
        chat = Chat(eng, ctx, system="You are a helpful assistant.", enable_thinking=False, warm=warm)
        warm_s = time.perf_counter() - t0
        for turn in range(turns):
            text = " ".join(rng.choice(WORDS, words))
            t0 = time.perf_counter()
            first, recs = None, []
            for r in chat.turn(text, reply, greedy, eos_ids=[]):  # (eos off: every reply is `reply` tokens long)
                if first is None:
                    first = time.perf_counter() - t0
                recs.append(r)
            last = recs[-1]
            rows.append({"turn": turn, "cached": last.cached_tokens, "new": last.prompt_tokens,
                         "ids": chat.render(chat.messages[:-1]), "first_token_ms": round(first * 1e3, 2),
                         "prefill_ms": round(last.prompt_seconds * 1e3, 2),
                         "decode_tok_s": round(last.decode_steps / max(last.gen_seconds, 1e-9), 1)})
        return rows, warm_s, chat.warmed + [f"decode {r}" for r in chat.warmed_decode]

    # warm-up: the kernels loaded, buffers grown; its cache is one position shorter, so the measured chat's new
    # cache drops the graphs the warm-up captured and the measured chat captures every bucket's itself at its start
    run_chat(1, ctx - 1, warm=False)
    rows, warm_s, warmed = run_chat(0, ctx, warm=True)
    for r in rows:  # after the chat, on the same engine: each turn's whole prompt from an empty cache
        ids = r.pop("ids")
        r["prompt"] = len(ids)
        r["stateless_first_token_ms"] = round(min(stateless_first_token(eng, ids, ctx) for _ in range(3)) * 1e3, 2)
        print(json.dumps(r), file=sys.stderr, flush=True)
    name = eng.device
    if eng.device == "cuda":
        from kuiper_py.ops_cupy import gpu_name
        name = gpu_name()
    if json_out:
        Path(json_out).write_text(json.dumps({"model": str(model), "device": name, "turns": rows,
                                              "warm_s": round(warm_s, 3), "warmed": warmed}, indent=1))
    print(f"\n{Path(model).name} on {name}: a chat of {turns} turns, {words}-word messages, {reply}-token replies; "
          f"the chat's start captured {len(warmed)} graphs ({', '.join(map(str, warmed))}) in {warm_s:.2f} s")
    print("| turn | cached | new | prompt | first token ms | stateless first token ms | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['turn']} | {r['cached']} | {r['new']} | {r['prompt']} | {r['first_token_ms']:.2f} | "
              f"{r['stateless_first_token_ms']:.2f} | {r['decode_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
