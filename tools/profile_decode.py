#!/usr/bin/env python3
"""Where a decode step's time goes (device machine): every kernel launch of eager decode steps timed
with CUDA events and summed by kernel, as a share of the step. Eager launches add host gaps that the
captured graph does not have; the per-kernel GPU times are what this table is for.

    python tools/profile_decode.py MODEL.bin [--ctx 512] [--steps 16]
"""
import sys
import time
from collections import defaultdict
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from kuiper_py import ops_cupy  # noqa: E402
from kuiper_py.generate import Engine  # noqa: E402


@click.command()
@click.argument("model", type=click.Path(exists=True))
@click.option("--ctx", default=512)
@click.option("--steps", default=16)
def main(model, ctx, steps):
    eng = Engine.load(model, "cuda", need_tokenizer=False)
    m = eng.session(ctx + steps + 8)
    m.ops.graphs = False
    rng = np.random.default_rng(0)
    m.prefill(rng.integers(0, 151643, ctx).tolist())
    for t in rng.integers(0, 151643, 4):  # warm-up
        m.decode(int(t))
    cp.cuda.Device().synchronize()
    times, counts, events = defaultdict(float), defaultdict(int), []
    real_kernel = ops_cupy.kernel

    def timed_kernel(family, name):
        fn = real_kernel(family, name)

        def launch(*a, **k):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            fn(*a, **k)
            e1.record()
            events.append((name, e0, e1))
        return launch

    ops_cupy.kernel = timed_kernel
    t0 = time.perf_counter()
    for t in rng.integers(0, 151643, steps):
        m.decode(int(t))
    cp.cuda.Device().synchronize()
    wall = (time.perf_counter() - t0) / steps
    ops_cupy.kernel = real_kernel
    for name, e0, e1 in events:
        times[name] += cp.cuda.get_elapsed_time(e0, e1) / steps
        counts[name] += 1
    total = sum(times.values())
    print(f"# {ops_cupy.gpu_name()}: {Path(model).name}, ctx {ctx}: kernels {total:.3f} ms/step "
          f"(eager wall {wall * 1e3:.3f} ms/step)")
    print("| kernel | launches/step | ms/step | us/launch | share |\n|---|---:|---:|---:|---:|")
    for name in sorted(times, key=times.get, reverse=True):
        n = counts[name] / steps
        print(f"| {name} | {n:.0f} | {times[name]:.3f} | {times[name] / n * 1e3:.1f} | {times[name] / total:.2f} |")


if __name__ == "__main__":
    main()
