#!/usr/bin/env python3
"""Where a prefill's time goes (device machine): the GPU time of each kernel of one prefill, summed by kernel name
(torch.profiler's CUPTI trace, which records CuPy's launches as well; torch is needed for this tool only), and the
host's side: the wall time of the prefill against the time the host takes to enqueue it while the GPU is held busy
by a spinning kernel, and the GPU time of the queued work. Where the enqueue time comes near the GPU time, the
prefill is host-bound. With --fresh LO:HI, also the wall time of prefills at lengths LO..HI-1, each run once, none
seen before in the process: what a chat's turns meet, where a per-length cache of the host side (not kept)
had made repeated lengths faster and new ones slower. Prefills run eagerly unless --graphs lets the repeated ones
replay prefill graphs. With --turns AFTER, instead: a chat's next turn, each prompt length prefilled
after AFTER to AFTER + 80 cached positions (a different count each round), through the prefill graphs and eagerly in
alternating order, wall and GPU time. Table last, JSON with --json.

    python tools/profile_prefill.py MODEL.bin [--prompts 512,2048] [--reps 5] [--fresh 100:140] [--graphs] [--json F]
    python tools/profile_prefill.py MODEL.bin --prompts 20,100,300 --turns 200 [--reps 7]
"""
import collections
import functools
import json
import sys
import time
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from kuiper_py.generate import Engine  # noqa: E402
from kuiper_py.ops_cupy import gpu_name  # noqa: E402

_SPIN = r'''extern "C" __global__ void spin(long long n) { long long t = clock64(); while (clock64() - t < n) {} }'''


@functools.cache
def _spinner():
    return cp.RawKernel(_SPIN, "spin")


def queued(fn, cycles: int) -> tuple[float, float]:
    """(enqueue, gpu) seconds of fn()'s launches queued behind a kernel spinning `cycles` clocks (8e8: ~0.4 s), so
    none waits for the GPU: enqueue = the host's time to queue them, gpu = their GPU time from the spinner's end
    (CUDA events on the current stream). """
    s = cp.cuda.get_current_stream()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    _spinner()((1,), (1,), (np.int64(cycles),))
    a.record(s)
    t0 = time.perf_counter()
    fn()
    enq = time.perf_counter() - t0
    b.record(s)
    b.synchronize()
    return enq, cp.cuda.get_elapsed_time(a, b) / 1e3


def prefill_wall(m, ids, reset: bool = True) -> float:
    """Wall seconds of one prefill of ids from position 0 (reset False: at the session's current position), the
    device synchronised before and after."""
    if reset:
        m.reset()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    m.prefill(ids)
    cp.cuda.Device().synchronize()
    return time.perf_counter() - t0


def host_and_gpu(m, ids, reps):
    """(wall, enqueue, gpu) seconds per rep: wall = prefill_wall's; enqueue and gpu = queued()'s, behind a ~0.4 s
    spinning kernel."""
    wall, enq, gpu = [], [], []
    for _ in range(reps):
        wall.append(prefill_wall(m, ids))
        m.reset()
        e, g = queued(lambda: m.prefill(ids), 8 * 10**8)
        enq.append(e)
        gpu.append(g)
    return wall, enq, gpu


def fresh_walls(eng, ids, lo: int, hi: int):
    """Wall seconds of one prefill at each length lo..hi-1 (synchronised), in a new session after a warm-up at hi
    (compiles, the pool): every length is new to the process's per-shape host state."""
    m = eng.session(hi + 1)
    m.prefill(ids[:hi])
    cp.cuda.Device().synchronize()
    return [prefill_wall(m, ids[:n]) for n in range(lo, hi)]


def kernel_times(m, ids):
    """{kernel name: (launches, GPU µs)} of one prefill."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    m.reset()
    cp.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        m.prefill(ids)
        cp.cuda.Device().synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("(")[0]
            agg[name][0] += 1
            agg[name][1] += e.device_time_total
    return dict(sorted(agg.items(), key=lambda kv: -kv[1][1]))


def turn_times(eng, prompts, after: int, reps: int, rng):
    """{prompt length: {"graph" | "eager": (wall ms, GPU ms) lists}} of a turn that continues a cache of after + 10 r
    positions in round r (the graph's first two rounds, its bucket's eager first meeting and its capture, left out)."""
    m = eng.session(after + 10 * (reps + 2) + max(prompts) + 64)
    prefix = rng.integers(0, 151643, after + 10 * (reps + 2)).tolist()
    out = {}
    for n in prompts:
        ids = rng.integers(0, 151643, n).tolist()
        t = {"graph": ([], []), "eager": ([], [])}
        for r in range(reps + 2):
            for form in (("graph", "eager") if r % 2 else ("eager", "graph")):
                m.ops.prefill_graphs = form == "graph"
                m.reset()
                m.prefill(prefix[:after + 10 * r])
                t[form][0].append(prefill_wall(m, ids, reset=False) * 1e3)
                m.reset()
                m.prefill(prefix[:after + 10 * r])
                cp.cuda.Device().synchronize()
                t[form][1].append(queued(lambda: m.prefill(ids), 2 * 10**8)[1] * 1e3)
        out[n] = {f: (w[2:], g[2:]) for f, (w, g) in t.items()}
    return out


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompts", default="512,2048", show_default=True)
@click.option("--reps", default=5, show_default=True)
@click.option("--fresh", default=None, help="LO:HI: one prefill at each length LO..HI-1, none seen before")
@click.option("--graphs", is_flag=True, help="let repeated prompts replay prefill graphs (default: every prefill eager)")
@click.option("--turns", "after", type=int, default=None,
              help="AFTER: time each prompt as a chat's next turn after AFTER+ cached positions, graph against eager")
@click.option("--json", "json_out", type=click.Path(dir_okay=False))
def main(model, prompts, reps, fresh, graphs, after, json_out):
    eng = Engine.load(model, "cuda", need_tokenizer=False)
    if after is not None:
        lens = [int(x) for x in prompts.split(",")]
        tt = turn_times(eng, lens, after, reps, np.random.default_rng(0))
        if json_out:
            Path(json_out).write_text(json.dumps({"gpu": gpu_name(), "after": after, "turns": tt}, indent=1))
        print(f"{gpu_name()}: a turn after {after}-{after + 10 * (reps + 1)} cached positions, medians of {reps}")
        print("| tokens | graph wall ms (GPU) | eager wall ms (GPU) |\n|---:|---:|---:|")
        for n, r in tt.items():
            print(f"| {n} | " + " | ".join(f"{np.median(r[f][0]):.2f} ({np.median(r[f][1]):.2f})"
                                          for f in ("graph", "eager")) + " |")
        return
    eng.session(max([int(x) for x in prompts.split(",")] + [1])).ops.prefill_graphs = graphs
    rng = np.random.default_rng(0)
    res = {"gpu": gpu_name(), "prefill": []}
    if fresh:  # first, before any other length has been run
        lo, hi = (int(v) for v in fresh.split(":"))
        res["fresh"] = {"lengths": [lo, hi], "wall_ms": [x * 1e3 for x in
                                                         fresh_walls(eng, rng.integers(0, 151643, hi).tolist(), lo, hi)]}
    for p in [int(x) for x in prompts.split(",")]:
        m = eng.session(p)
        ids = rng.integers(0, 151643, p).tolist()
        for _ in range(3):  # compiles, tensor maps, the pool's blocks
            m.reset()
            m.prefill(ids)
        cp.cuda.Device().synchronize()
        wall, enq, gpu = host_and_gpu(m, ids, reps)
        kt = kernel_times(m, ids)
        res["prefill"].append({"prompt": p, "wall_ms": [x * 1e3 for x in wall], "enqueue_ms": [x * 1e3 for x in enq],
                               "gpu_ms": [x * 1e3 for x in gpu],
                               "kernels": {k: {"launches": n, "us": t} for k, (n, t) in kt.items()}})
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))
    print(f"{res['gpu']}")
    if fresh:
        w = res["fresh"]["wall_ms"]
        print(f"\nnew lengths {fresh} (one prefill each): wall median {np.median(w):.2f} ms [{min(w):.2f}-{max(w):.2f}]")
    for r in res["prefill"]:
        med = {k: float(np.median(r[k])) for k in ("wall_ms", "enqueue_ms", "gpu_ms")}
        tot = sum(v["us"] for v in r["kernels"].values())
        print(f"\n{r['prompt']} tokens: wall {med['wall_ms']:.2f} ms ({r['prompt'] / med['wall_ms'] * 1e3:.0f} tok/s), "
              f"host enqueue {med['enqueue_ms']:.2f} ms, GPU {med['gpu_ms']:.2f} ms (medians of {reps}); "
              f"kernel time {tot / 1e3:.2f} ms")
        print("| kernel | launches | ms | share |\n|---|---:|---:|---:|")
        for k, v in list(r["kernels"].items())[:14]:
            print(f"| {k[:60]} | {v['launches']} | {v['us'] / 1e3:.3f} | {v['us'] / tot:.1%} |")


if __name__ == "__main__":
    main()
