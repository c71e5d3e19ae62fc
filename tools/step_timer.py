#!/usr/bin/env python3
"""The step timer (device machine): the decode step's CUDA graph replayed back to back, the figure
docs/PERFORMANCE.md's A/B rows quote as "step timer" (µs per step).

The model is loaded, a random prompt of --ctx tokens prefilled, and two decode steps capture and warm the
graph. Then, per round, three times over: the session is rewound to the prompt's end and the device
position reset, --replays graph launches are queued back to back between two events, and the round keeps
the fastest of the three. Each replay advances the device position, so a timing steps through keys ctx to
ctx + replays - 1 in the graph captured at ctx (keep that range inside one graph regime: flash decoding's
short-context graph serves up to 1024 keys on the GPUs the per-GPU table lists). No host work sits between
replays (no sampling, no token read back), so the figure is the GPU's step alone; `tools/bench_e2e.py`
times the loop kuiper generate runs.

A/B comparisons (two trees) run one process per arm, alternating, on the same machine: the spread between a process's rounds is the noise floor.
--cap sets the KV cache's positions (default max(2200, ctx + replays + 100)): the cache's capacity sets flash
decoding's split count and with it which o merge the graph takes (gemv_merge_span past 16 splits), so
figures compare only at the same --cap.

    python tools/step_timer.py MODEL.bin --ctx 512 [--cap N] [--rounds 2] [--label A] [--save-logits F.npy] [--json OUT.json]
"""
import json
import sys
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--ctx", default=512, show_default=True, type=click.IntRange(1), help="Keys in the cache at the timed step.")
@click.option("--cap", default=0, type=click.IntRange(0), help="KV cache positions (0: max(2200, ctx + replays + 100)).")
@click.option("--rounds", default=2, show_default=True, type=click.IntRange(1))
@click.option("--replays", default=100, show_default=True, type=click.IntRange(1), help="Graph launches per timing.")
@click.option("--label", default="", help="A name for this arm in the table and the JSON.")
@click.option("--save-logits", default=None, help="Write the timed step's logits (.npy), to check that two arms agree.")
@click.option("--json", "json_out", default=None)
def main(model, ctx, cap, rounds, replays, label, save_logits, json_out):
    import cupy as cp

    from kuiper_py import ops_cupy as oc
    from kuiper_py.generate import Engine

    cap = cap or max(2200, ctx + replays + 100)
    if cap < ctx + replays + 2:  # each replay advances the device position and writes its K/V row
        raise SystemExit(f"--cap {cap} is under the {ctx}-token prompt + {replays} replays + 2 steps the timing writes")
    m = Engine.load(model, "cuda", need_tokenizer=False).session(cap)  # as bench_e2e loads
    if not m.ops.graphs:
        raise SystemExit("the step timer replays the decode graph: unset KUIPER_CUDA_GRAPHS=0")
    rng = np.random.default_rng(0)
    m.prefill(rng.integers(0, 151643, ctx).tolist())
    p0 = m.pos
    m.rewind(p0)
    m.decode(1000)  # captures the graph
    m.rewind(p0)
    logits = cp.asnumpy(cp.asarray(m.decode(1000)))
    if save_logits:
        np.save(save_logits, logits)
    graph, stream = m.ops._graph, m.ops._stream
    per_round = []
    for _ in range(rounds):
        best = float("inf")
        for _ in range(3):
            m.rewind(p0)
            m.ops.d["pos"].fill(p0)
            stream.synchronize()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            for _ in range(replays):
                graph.launch(stream)
            e1.record(stream)
            e1.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(e0, e1) * 1e3 / replays)
        per_round.append(best)
    out = {"gpu": oc.gpu_name(), "model": str(model), "label": label, "context": ctx, "cap": cap,
           "replays": replays, "us_per_step": per_round}
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))
    print(f"# {out['gpu']}: {Path(model).name}, {ctx} keys, {cap}-position cache, {replays} replays x 3 per round")
    print("| arm | keys | µs per step, each round |\n| --- | ---: | --- |")
    print(f"| {label or '-'} | {ctx} | {' / '.join(f'{x:.1f}' for x in per_round)} |")


if __name__ == "__main__":
    main()
