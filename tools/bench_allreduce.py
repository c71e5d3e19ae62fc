#!/usr/bin/env python3
"""All-reduce benchmark for batch-1 decode (device machine with 2+ GPUs): the time per call of NCCL's all-reduce
(kuiper_py/parallel/nccl.py, in-process communicators over N GPUs, each call a group of the N ranks' calls) and of the
one-shot kernel over peer memory (kuiper_py/cuda/ops/allreduce.py), fp16, at 4-64 KB messages; each eager (one
host-launched call after another) and inside a CUDA graph (one graph of --graph-calls calls per GPU, replayed).
A microsecond figure is the slowest rank's GPU time between events around the run, divided by the calls.

    python tools/bench_allreduce.py [--gpus N] [--sizes 4,8,16,32,64] [--json OUT.json]

The table goes to stdout, progress to stderr; the JSON holds the same figures and, per size and form, the faster.
"""
import json
import sys
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FORMS = ("nccl_eager", "oneshot_eager", "nccl_graph", "oneshot_graph")


def _die(msg: str):
    click.echo(f"kuiper: error: {msg}", err=True)
    sys.exit(1)


def _gpu_count() -> int:
    try:
        import cupy as cp
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 (no CuPy, no driver)
        return 0


class Ranks:
    """Per-GPU streams, inputs and outputs of one message size, and timing across them."""

    def __init__(self, cp, devices, n_elems, dtype):
        self.cp, self.devices = cp, devices
        self.streams, self.xs, self.outs = [], [], []
        rng = np.random.default_rng()
        for d in devices:
            with cp.cuda.Device(d):
                self.streams.append(cp.cuda.Stream(non_blocking=True))
                self.xs.append(cp.asarray(rng.standard_normal(n_elems).astype(dtype)))
                self.outs.append(cp.empty(n_elems, dtype))

    def sync(self):
        for d, s in zip(self.devices, self.streams):
            with self.cp.cuda.Device(d):
                s.synchronize()

    def timed_us(self, run, calls: int) -> float:
        """GPU microseconds per call: events on every rank's stream around run(), the slowest rank."""
        cp = self.cp
        ev = []
        for d, s in zip(self.devices, self.streams):
            with cp.cuda.Device(d):
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(s)
                ev.append((e0, e1))
        run()
        for d, s, (_, e1) in zip(self.devices, self.streams, ev):
            with cp.cuda.Device(d):
                e1.record(s)
        self.sync()
        ms = []
        for d, (e0, e1) in zip(self.devices, ev):
            with cp.cuda.Device(d):
                ms.append(cp.cuda.get_elapsed_time(e0, e1))
        return max(ms) * 1e3 / calls

    def graphed_us(self, call, per_graph: int, replays: int) -> float:
        """Capture per_graph calls into one graph per GPU, replay them: GPU microseconds per call."""
        cp = self.cp
        for d, s in zip(self.devices, self.streams):
            with cp.cuda.Device(d):
                s.begin_capture()
        try:
            for _ in range(per_graph):
                call()
        finally:
            graphs = []
            for d, s in zip(self.devices, self.streams):
                with cp.cuda.Device(d):
                    graphs.append(s.end_capture())

        def replay():
            for _ in range(replays):
                for d, s, g in zip(self.devices, self.streams, graphs):
                    with cp.cuda.Device(d):
                        g.launch(s)
        replay()  # warm
        self.sync()
        return self.timed_us(replay, per_graph * replays)


def _nccl_call(cp, kn, comms, r: Ranks, keep: list):
    """One all-reduce of every rank's input through NCCL, the ranks' calls in one group (one thread drives all)."""
    def call():
        with kn.group():
            for c, d, s, x in zip(comms, r.devices, r.streams, r.xs):
                with cp.cuda.Device(d), s:
                    keep.append(c.all_reduce_sum(x))  # kept: a graph's outputs must not go back to the pool
    return call


def _measure(cp, kn, ar, devices, comms, oneshot, nbytes, iters, per_graph, replays) -> dict:
    r = Ranks(cp, devices, nbytes // 2, np.float16)
    keep: list = []
    nccl_call = _nccl_call(cp, kn, comms, r, keep)

    def oneshot_call():
        oneshot.all_reduce(r.xs, r.outs, streams=r.streams)

    oneshot_call()  # compiled, and checked against the rank-order sum
    r.sync()
    want = ar.reference_sum([cp.asnumpy(x) for x in r.xs])
    for d, o in zip(devices, r.outs):
        with cp.cuda.Device(d):
            if not np.array_equal(cp.asnumpy(o), want):
                _die(f"the one-shot all-reduce gave a wrong sum on GPU {d} at {nbytes} B")
    row = {"bytes": nbytes}
    for form, call in (("oneshot", oneshot_call), ("nccl", nccl_call)):  # (a failed NCCL capture comes last)
        call()
        r.sync()
        row[f"{form}_eager"] = r.timed_us(lambda: [call() for _ in range(iters)], iters)
        try:
            row[f"{form}_graph"] = r.graphed_us(call, per_graph, replays)
        except Exception as e:  # noqa: BLE001 (a form that cannot be captured here: said in the row)
            row[f"{form}_graph"] = None
            row[f"{form}_graph_error"] = f"{type(e).__name__}: {e}"
        keep.clear()
    for mode in ("eager", "graph"):
        t = {f: row[f"{f}_{mode}"] for f in ("nccl", "oneshot") if row.get(f"{f}_{mode}") is not None}
        row[f"faster_{mode}"] = min(t, key=t.get) if t else None
    return row


def _table(rows) -> str:
    head = f"{'KB':>5} " + " ".join(f"{f + ' us':>17}" for f in FORMS) + f"  {'faster (eager/graph)':>22}"
    lines = [head]
    for row in rows:
        cells = " ".join(f"{row[f]:>17.2f}" if row.get(f) is not None else f"{'n/a':>17}" for f in FORMS)
        faster = f"{row['faster_eager']}/{row['faster_graph']}"
        lines.append(f"{row['bytes'] / 1024:>5g} {cells}  {faster:>22}")
    return "\n".join(lines)


@click.command()
@click.option("--gpus", type=int, default=None, help="GPUs in the group (2..8; default all visible, up to 8)")
@click.option("--sizes", default="4,8,16,32,64", help="message sizes in KB, comma-separated")
@click.option("--iters", type=int, default=200, help="eager calls timed per size and form")
@click.option("--graph-calls", type=int, default=100, help="calls captured in each GPU's graph")
@click.option("--replays", type=int, default=20, help="graph replays timed")
@click.option("--blocks", type=int, default=None, help="the one-shot kernel's blocks per GPU (default: its own)")
@click.option("--json", "json_out", default=None, help="write the figures as JSON here too")
def main(gpus, sizes, iters, graph_calls, replays, blocks, json_out):
    visible = _gpu_count()
    if visible < 2:
        _die(f"bench_allreduce needs two or more GPUs; {visible} visible")
    n = min(visible, 8) if gpus is None else gpus
    if not 2 <= n <= min(visible, 8):
        _die(f"--gpus must be 2 to {min(visible, 8)} here, not {n}")
    import cupy as cp

    from kuiper_py.cuda.ops import allreduce as ar
    from kuiper_py.parallel import nccl as kn
    if not kn.available():
        _die("CuPy without NCCL: pip install nvidia-nccl for the matching CUDA")
    sizes_b = [int(float(s) * 1024) for s in sizes.split(",")]
    devices = list(range(n))
    comms = kn.NcclCommunicator.in_process(devices)
    oneshot = ar.OneShotAllReduce(devices, max_bytes=max(sizes_b), blocks=blocks or ar.DEFAULT_BLOCKS)
    rows = []
    try:
        for nbytes in sizes_b:
            click.echo(f"{nbytes} B over {n} GPUs ...", err=True)
            rows.append(_measure(cp, kn, ar, devices, comms, oneshot, nbytes, iters, graph_calls, replays))
    finally:
        for c in comms:
            c.close()
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    click.echo(f"all-reduce, fp16, {n} x {gpu}: microseconds per call")
    click.echo(_table(rows))
    for row in rows:
        for f in ("nccl", "oneshot"):
            if row.get(f"{f}_graph_error"):
                click.echo(f"{row['bytes']} B {f} graph: {row[f + '_graph_error']}", err=True)
    if json_out:
        meta = {"gpus": n, "gpu": gpu, "dtype": "float16", "iters": iters, "graph_calls": graph_calls,
                "replays": replays, "oneshot_blocks": oneshot.blocks}
        Path(json_out).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
