"""Serving benchmark for `kuiper serve` (or any OpenAI-compatible server), in the manner of vLLM's
benchmark_serving: requests of random prompts arrive at a rate (Poisson) or as fast as a concurrency limit lets
them; each is streamed, and time to first token (TTFT), time per output token after the first (TPOT), the gaps
between streamed chunks (ITL), end-to-end latency and throughput come out with mean and p50/p90/p99.

    python tools/bench_serve.py --base-url http://127.0.0.1:8000 -n 64 --max-concurrency 8 --input-len 512 \\
        --output-len 128
    python tools/bench_serve.py --base-url URL --single --input-len 512 --output-len 128 --json

--shared-prefix N starts every prompt with one common N-token prefix (a "system prompt", drawn once from the seed)
before its own --input-len tokens: run it against a server with and without --no-enable-prefix-caching and compare
the mean TTFT to see what prefix caching saves.

--single measures one stream alone: decode tok/s over --output-len tokens after a short prompt, and the TTFT of
an --input-len prompt (median of --repeats), the figures tools/serve_gpu_check.sh compares with `kuiper bench`.
Prompts are random token ids sent to /v1/completions (exact lengths, no cache reuse between requests unless
--shared-prefix gives them a common start); output lengths are exact through `ignore_eos`. --warmup requests
(default 1) run first, one at a time, untimed. The table goes to stdout, or one JSON object with --json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx
import numpy as np

VOCAB = 151643  # Qwen's ordinary (non-special) token ids


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    ap.add_argument("-n", "--num-prompts", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second, Poisson arrivals (default: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens of one random prefix every prompt starts with, before its own --input-len")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed requests first, one at a time (as vLLM's initial test run): the server's first-use\n"
                         "costs stay out of the figures, and with --shared-prefix the prefix is cached, as a\n"
                         "long-running server's system prompt would be (default 1; 0: none)")
    ap.add_argument("--single", action="store_true", help="one stream alone: decode tok/s and a prompt's TTFT")
    ap.add_argument("--repeats", type=int, default=5, help="(--single) TTFT and decode runs; the median is kept")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    a = ap.parse_args(argv)
    if a.warmup < 0:
        ap.error("--warmup must be 0 or more")
    if min(a.num_prompts, a.input_len, a.output_len, a.repeats) < 1 or a.request_rate <= 0:
        ap.error("--num-prompts, --input-len, --output-len, --repeats and --request-rate must be positive")
    if a.shared_prefix < 0:
        ap.error(f"--shared-prefix {a.shared_prefix} must be >= 0")
    if a.shared_prefix and a.single:
        ap.error("--shared-prefix applies to the load test, not --single")
    return a


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion: arrival-relative times of each chunk with text, and the server's token count."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, n_out, err = [], None, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    err = d["error"].get("message")
                if d.get("usage"):
                    n_out = d["usage"]["completion_tokens"]
                if any(c.get("text") for c in d.get("choices", [])):
                    times.append(time.perf_counter() - t0)
    except httpx.HTTPError as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter() - t0
    if err or not times:
        return {"ok": False, "error": err or "no text streamed"}
    n = n_out or len(times)
    return {"ok": True, "ttft": times[0], "e2e": end, "itl": list(np.diff(times)), "out": n, "in": len(prompt),
            "tpot": (end - times[0]) / (n - 1) if n > 1 else None}


def _prompts(rng, n: int, length: int, shared: int = 0) -> list[list[int]]:
    """n random prompts of `length` tokens each, after one common random prefix of `shared` tokens (drawn first)."""
    prefix = rng.integers(0, VOCAB, size=shared).tolist() if shared else []
    return [prefix + rng.integers(0, VOCAB, size=length).tolist() for _ in range(n)]


async def server_model(client: httpx.AsyncClient, name: str | None) -> str:
    if name:
        return name
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_load(a) -> dict:
    rng = np.random.default_rng(a.seed)
    prompts = _prompts(rng, a.warmup + a.num_prompts, a.input_len, a.shared_prefix)
    warm, prompts = prompts[:a.warmup], prompts[a.warmup:]
    limit = asyncio.Semaphore(a.max_concurrency or a.num_prompts)
    async with httpx.AsyncClient(base_url=a.base_url, timeout=None,
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = await server_model(client, a.model)
        for p in warm:
            r = await one_request(client, model, p, a.output_len)
            if not r["ok"]:
                raise SystemExit(f"bench_serve: the warm-up request failed: {r['error']}")

        async def limited(p):
            async with limit:
                return await one_request(client, model, p, a.output_len)
        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if a.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / a.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(results, duration, a)


def _stats(xs, scale=1000.0) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = np.asarray(xs) * scale
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99))}


def summarize(results: list[dict], duration: float, a) -> dict:
    ok = [r for r in results if r["ok"]]
    n_in, n_out = sum(r["in"] for r in ok), sum(r["out"] for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
            "duration_s": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
            "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
            "total_token_throughput": (n_in + n_out) / duration,
            "max_concurrency": a.max_concurrency, "request_rate": a.request_rate if a.request_rate != float("inf")
            else None, "input_len": a.input_len, "shared_prefix_len": a.shared_prefix, "output_len": a.output_len,
            "warmup_requests": a.warmup,
            "ttft_ms": _stats([r["ttft"] for r in ok]), "tpot_ms": _stats([r["tpot"] for r in ok]),
            "itl_ms": _stats([x for r in ok for x in r["itl"]]), "e2e_ms": _stats([r["e2e"] for r in ok])}


async def run_single(a) -> dict:
    """One stream at a time: decode tok/s after the first token over output_len tokens (after an 8-token prompt),
    and the TTFT of input_len-token prompts; medians of a.repeats runs after one warm-up each."""
    rng = np.random.default_rng(a.seed)
    async with httpx.AsyncClient(base_url=a.base_url, timeout=None) as client:
        model = await server_model(client, a.model)
        rates, ttfts = [], []
        for i in range(a.repeats + 1):
            r = await one_request(client, model, _prompts(rng, 1, 8)[0], a.output_len)
            if not r["ok"]:
                raise SystemExit(f"bench_serve: {r['error']}")
            if i:
                rates.append((r["out"] - 1) / (r["e2e"] - r["ttft"]))
        for i in range(a.repeats + 1):
            r = await one_request(client, model, _prompts(rng, 1, a.input_len)[0], 1)
            if not r["ok"]:
                raise SystemExit(f"bench_serve: {r['error']}")
            if i:
                ttfts.append(r["ttft"])
    return {"decode_tok_s": float(np.median(rates)), "decode_tokens": a.output_len,
            "ttft_ms": float(np.median(ttfts)) * 1000, "prompt_tokens": a.input_len, "repeats": a.repeats}


def table(s: dict) -> str:
    if "decode_tok_s" in s:
        return (f"one stream: decode {s['decode_tok_s']:.2f} tok/s over {s['decode_tokens']} tokens | "
                f"TTFT {s['ttft_ms']:.1f} ms for a {s['prompt_tokens']}-token prompt (median of {s['repeats']})")
    lines = [f"{'successful requests':<32}{s['completed']:>12}", f"{'failed requests':<32}{s['failed']:>12}",
             f"{'benchmark duration (s)':<32}{s['duration_s']:>12.2f}",
             f"{'total input tokens':<32}{s['total_input_tokens']:>12}",
             f"{'total output tokens':<32}{s['total_output_tokens']:>12}",
             *([f"{'shared prefix (tokens)':<32}{s['shared_prefix_len']:>12}"] if s["shared_prefix_len"] else []),
             f"{'request throughput (req/s)':<32}{s['request_throughput']:>12.2f}",
             f"{'output token throughput (tok/s)':<32}{s['output_throughput']:>12.2f}",
             f"{'total token throughput (tok/s)':<32}{s['total_token_throughput']:>12.2f}",
             "", f"{'(ms)':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        st = s[key]
        lines.append(f"{name:<8}" + "".join(f"{st[k]:>10.2f}" if st[k] is not None else f"{'-':>10}"
                                            for k in ("mean", "p50", "p90", "p99")))
    for e in s["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        s = asyncio.run(run_single(a) if a.single else run_load(a))
    except httpx.HTTPError as e:
        print(f"bench_serve: error: cannot reach {a.base_url}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(s) if a.json else table(s))
    return 0 if s.get("failed", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
