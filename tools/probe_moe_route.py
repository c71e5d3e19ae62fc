"""Probe of Qwen3-MoE prefill routing (moe.cu moe_route_mma, the expert maps in its last block: PERFORMANCE.md change
197; its K split over blocks, moe_route_mma_split: change 198): the GPU time of one routing launch with the maps at each token count and
split count, at a real layer's shape (random x and router). The launches are queued behind a spinning kernel, so
Python's launch cost stays out and the figure is GPU time; the splits of one token count run in alternation over
several rounds. Each split's ids, weights and maps are checked against the unsplit launch's (ids and maps equal
but where the exact logits nearly tie; weights within 1e-5), outputs poisoned first. Prints a table last (µs per
launch, the median of the rounds, and the spread); --json writes the rows.

    python tools/probe_moe_route.py [--shape 30b-a3b] [--tokens 128,512,2048] [--splits 1,2,4,8,16] [--rounds 5]
"""
import json
import sys
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from kuiper_py import ops_cupy as oc  # noqa: E402
from profile_prefill import queued  # noqa: E402

SHAPES = {"30b-a3b": (2048, 128, 8), "235b-a22b": (4096, 128, 8)}  # D, E, k


def gpu_us(fn, reps: int) -> float:
    """GPU µs per call of fn, its reps launches queued behind a ~20 ms spinning kernel (profile_prefill.queued)."""
    for _ in range(2):
        fn()
    return queued(lambda: [fn() for _ in range(reps)], 4 * 10**7)[1] / reps * 1e6


@click.command()
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="30b-a3b", show_default=True)
@click.option("--tokens", default="128,512,2048", show_default=True)
@click.option("--splits", default="1,2,4,8,16", show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option("--reps", default=40, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False))
def main(shape, tokens, splits, rounds, reps, json_out):
    D, E, k = SHAPES[shape]
    rng = np.random.default_rng(0)
    router = cp.asarray((rng.standard_normal((E, D)) / np.sqrt(D)).astype(np.float16))
    rows = []
    for T in [int(v) for v in tokens.split(",")]:
        x = cp.asarray(rng.standard_normal((T, D)).astype(np.float16))
        name, warps = oc.moe_rmma_form(T, E)
        tile = oc.moe_rs_tile(T * k, E)

        def splits_for(setting):  # the splits moe_route takes with MOE_ROUTE_SPLITS = setting (forced ones clamped)
            oc.MOE_ROUTE_SPLITS = setting
            return oc.moe_route_splits(T, D, warps, oc.moe_rmma_groups(E))
        auto = splits_for("auto")
        forms = sorted({auto} | {splits_for(s) for s in splits.split(",")})
        outs = {}
        for s in forms:  # correctness first: every form against the unsplit launch
            oc.MOE_ROUTE_SPLITS = str(s)
            o = [cp.full((T, k), -1, cp.int32), cp.full((T, k), np.nan, cp.float32)]
            maps = tuple(cp.full((m,), -1, cp.int32) for m in (E, E + 1, E + 1, T * k, T * k))
            oc.moe_route(x, router, k, True, cp.full((T, E), np.nan, cp.float32), o[0], o[1], maps=(tile, *maps))
            outs[s] = [cp.asnumpy(a) for a in (*o, *maps)]
        ref = outs[forms[0]]
        for s in forms[1:]:
            same = (outs[s][0] == ref[0]).all(axis=1).mean()
            werr = float(np.abs(outs[s][1] - ref[1]).max())
            maps_ok = same < 1 or all((outs[s][i] == ref[i]).all() for i in range(2, 7))
            assert same > 0.99 and maps_ok and (same < 1 or werr < 1e-5), (T, s, same, werr)
        times = {s: [] for s in forms}
        maps = (tile, *oc.moe_maps_arrays(T * k, E))
        for _ in range(rounds):
            for s in forms:
                oc.MOE_ROUTE_SPLITS = str(s)
                times[s].append(gpu_us(lambda: oc.moe_route(x, router, k, True, maps=maps), reps))
        oc.MOE_ROUTE_SPLITS = "auto"
        for s in forms:
            rows.append({"tokens": T, "form": name if s == 1 else oc.moe_rmma_split_name(E, warps), "splits": s,
                         "auto": s == auto, "us": float(np.median(times[s])),
                         "spread": [float(min(times[s])), float(max(times[s]))]})
    if json_out:
        Path(json_out).write_text(json.dumps({"gpu": oc.gpu_name(), "shape": shape, "rows": rows}, indent=1))
    print(f"{oc.gpu_name()}, {shape} (D {D}, E {E}, k {k}): routing with the expert maps, GPU µs per launch")
    print("| tokens | form | splits | µs | spread |\n|---:|---|---:|---:|---|")
    for r in rows:
        star = " (auto)" if r["auto"] else ""
        print(f"| {r['tokens']} | {r['form']} | {r['splits']}{star} | {r['us']:.2f} | "
              f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f} |")


if __name__ == "__main__":
    main()
