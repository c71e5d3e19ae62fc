#!/usr/bin/env python3
"""Soak: many long generations in one process; host and GPU memory must stay flat after the first run.

    python tools/soak.py MODEL.bin [--runs 20] [--steps 1000] [--device cuda] [--json OUT.json]
Prints one row per run and a verdict (max spread over runs 2..N, as a fraction of the run-2 value).
"""
import json
import os
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kuiper_py.generate import Engine, generate  # noqa: E402
from kuiper_py.sampling import SamplingParams  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--runs", default=20, show_default=True)
@click.option("--steps", default=1000, show_default=True, help="Decode steps per run.")
@click.option("--device", default="cuda", show_default=True)
@click.option("--json", "json_out", default=None, type=click.Path())
def main(model, runs, steps, device, json_out):
    eng = Engine.load(model, device)
    ids = eng.tokenizer.encode("Write a long story about a lighthouse keeper and the sea.")
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0, repeat_penalty=1.1, seed=7)
    rows = []
    for run in range(runs):
        t0 = time.perf_counter()
        last = None
        for last in generate(eng, ids, steps + 1, params, eos_ids=[], max_context=len(ids) + steps + 1):
            pass
        row = {"run": run + 1, "decode_steps": last.decode_steps, "tok_s": last.decode_steps / last.gen_seconds,
               "seconds": time.perf_counter() - t0, "host_rss_mib": rss_bytes() / 2**20}
        if eng.device == "cuda":
            import cupy as cp
            free, total = cp.cuda.runtime.memGetInfo()
            row["gpu_pool_mib"] = cp.get_default_memory_pool().total_bytes() / 2**20
            row["gpu_used_mib"] = (total - free) / 2**20
        rows.append(row)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    verdict = {}
    for key in ("host_rss_mib", "gpu_pool_mib", "gpu_used_mib"):
        vals = [r[key] for r in rows[1:] if key in r]
        if vals:
            verdict[key] = {"min": min(vals), "max": max(vals), "spread": (max(vals) - min(vals)) / vals[0]}
    ok = all(v["spread"] <= 0.01 for v in verdict.values())
    print("verdict:", "FLAT" if ok else "GREW", json.dumps(verdict))
    if json_out:
        Path(json_out).write_text(json.dumps({"rows": rows, "verdict": verdict, "flat": ok}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
