#!/usr/bin/env python3
"""Device diagnostic: where a graph-replayed decode step spends its GPU time, kernel by kernel.

CUPTI (through torch.profiler) records every kernel of the process, CuPy's and graph-launched ones
included. Prints, per kernel name, the count and GPU microseconds per step, then the step's span, the
union of busy intervals (PDL overlaps neighbours) and the idle time between steps (sampling, host).

    python tools/profile_decode.py MODEL.bin [--ctx 512] [--steps 20] [--json F]
"""
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from bench_e2e import GREEDY, greedy_step, timed_greedy_steps, warm_session  # noqa: E402
from kuiper_py.generate import Engine  # noqa: E402
from kuiper_py.ops_cupy import gpu_name  # noqa: E402
from kuiper_py.sampling import SamplingParams  # noqa: E402


def busy(intervals):
    """Length of the union of [start, end) intervals (sorted by start)."""
    tot, cur_s, cur_e = 0.0, None, None
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                tot += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return tot + (cur_e - cur_s if cur_e is not None else 0.0)


def resample(ops, lg, sp, rng, n):
    """n sampler calls on the same logits lg, restored before each (sample() may rescale them in place)."""
    for _ in range(n):
        ops.d["logits"][...] = lg
        ops.sample(ops.d["logits"], sp, rng, [], 151669)


@click.command()
@click.argument("model", type=click.Path(exists=True))
@click.option("--ctx", default=512)
@click.option("--steps", default=20)
@click.option("--timeline", default=16, help="print this many kernels of one step with their start gaps")
@click.option("--json", "json_out", default=None)
def main(model, ctx, steps, timeline, json_out):
    import torch
    from torch.profiler import ProfilerActivity, profile
    eng = Engine.load(model, "cuda", need_tokenizer=False)
    rng = np.random.default_rng(0)
    m, tok = warm_session(eng, ctx, ctx + 3 * steps + 16, rng)
    # without the profiler: the host loop (graph, sample, one int back) against back-to-back replays
    tok, loop = timed_greedy_steps(m, tok, steps, rng)
    ops = m.ops
    t0 = time.perf_counter()
    for _ in range(steps):
        ops._graph.launch(ops._stream)
    ops._stream.synchronize()
    replay = (time.perf_counter() - t0) / steps
    ops._dev_pos = None  # the replays advanced the device position; the next step refills it
    smp = {}
    for name, sp in (("greedy", GREEDY), ("t0.6 k20 p0.95", SamplingParams())):
        lg = ops.d["logits"].copy()
        t0 = time.perf_counter()
        resample(ops, lg, sp, rng, steps)
        smp[name] = (time.perf_counter() - t0) / steps * 1e6
    print(f"# host loop {loop * 1e3:.3f} ms/step, graph replay alone {replay * 1e3:.3f} ms/step "
          f"(host + sampling gap {(loop - replay) * 1e6:.0f} µs); sample() incl. its sync: "
          + ", ".join(f"{k} {v:.0f} µs" for k, v in smp.items()))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = greedy_step(m, tok, rng)
        cp.cuda.Device().synchronize()
        wall = (time.perf_counter() - t0) / steps
        # the sampler alone with the default parameters (t 0.6, top-k 20, top-p 0.95)
        resample(ops, ops.d["logits"].copy(), SamplingParams(), rng, 5)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    ks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace["traceEvents"]
                if e.get("cat") == "kernel" and e.get("ph") == "X")
    smp_k = [e - s for s, e, n in ks if n.startswith("sample_token")]
    smp_default_us = float(np.mean(smp_k[-5:]))
    # steps start at each sample_token's end: split the timeline there (the 5 default-parameter
    # samples at the end are left out)
    ends = [e for s, e, n in ks if n.startswith("sample_token")][:-5]
    ks = [k for k in ks if k[1] <= ends[-1]]
    per = defaultdict(lambda: [0, 0.0])
    for s, e, n in ks:
        short = n.split("(")[0].split("<")[0]
        per[short][0] += 1
        per[short][1] += e - s
    span = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else float("nan")
    inside = [(s, e) for s, e, n in ks if ends[0] <= s and e <= ends[-1]]
    union = busy(inside) / max(len(ends) - 1, 1)
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])
    res = {"gpu": gpu_name(), "context": ctx, "wall_ms": wall * 1e3, "loop_ms": loop * 1e3,
           "replay_ms": replay * 1e3, "sample_us": smp, "sample_kernel_default_us": smp_default_us,
           "span_us": span, "busy_us": union,
           "kernels": {k: {"per_step": c / steps, "us_per_step": t / steps} for k, (c, t) in rows}}
    print(f"# {res['gpu']}: decode at context {ctx}, {steps} steps; wall {wall * 1e3:.3f} ms/step, "
          f"GPU timeline {span:.0f} µs/step, busy (union) {union:.0f} µs, idle {span - union:.0f} µs; "
          f"sample_token with t 0.6 / top-k 20 / top-p 0.95: {smp_default_us:.1f} µs")
    print("| kernel | per step | µs/step | µs each |\n|---|---:|---:|---:|")
    for k, (c, t) in rows:
        print(f"| {k} | {c / steps:.0f} | {t / steps:.1f} | {t / c:.2f} |")
    if timeline and len(ends) > 2:  # one step's first kernels: start relative to the previous kernel's end
        one = [(s, e, n.split("(")[0]) for s, e, n in ks if ends[1] <= s < ends[2]][:timeline]
        print("| # | kernel | start - prev end µs | dur µs |\n|---:|---|---:|---:|")
        prev = ends[1]
        for i, (s, e, n) in enumerate(one):
            print(f"| {i} | {n[:40]} | {s - prev:.2f} | {e - s:.2f} |")
            prev = e
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
