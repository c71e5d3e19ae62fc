#!/usr/bin/env python3
"""Device diagnostic: a per-block timeline of one graph-replayed decode step.

Run with KUIPER_DIAG_DEFINES=-DKUIPER_DIAG_TIMES: the decode GEMVs and flash decoding then stamp
%globaltimer in every block (entry, past the PDL wait, prologue done, loop done, end; common.cuh)
and this prints, per kernel kind averaged over the middle layers, when its blocks pass their wait,
how long the phases take, how the end times spread and the gap to the next kernel's wait. The
timer ticks in ~0.25 µs steps; the stamps add ~1% to a step.

    KUIPER_DIAG_DEFINES=-DKUIPER_DIAG_TIMES python tools/timeline_decode.py MODEL.bin [--ctx 512] [--save F.npz]
"""
import sys
import time
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from bench_e2e import warm_session  # noqa: E402
from kuiper_py import ops_cupy as oc  # noqa: E402
from kuiper_py.generate import Engine  # noqa: E402


def records(mod):
    """The block records a module's kernels appended: [n, 8] int64."""
    n = int(cp.ndarray((1,), cp.uint32, mod.get_global("g_diag_n")).get()[0])
    return cp.ndarray((n, 8), cp.uint64, mod.get_global("g_diag")).get().astype(np.int64)


@click.command()
@click.argument("model", type=click.Path(exists=True))
@click.option("--ctx", default=512)
@click.option("--save", default=None, help="write the raw records (npz)")
def main(model, ctx, save):
    eng = Engine.load(model, "cuda", need_tokenizer=False)
    m, _ = warm_session(eng, ctx, ctx + 64, np.random.default_rng(0))
    ops = m.ops
    mods = {t: oc._MODULES[t] for t in ("gemv", "attn", "ffn") if t in oc._MODULES}
    try:
        counters = [mod.get_global("g_diag_n") for mod in mods.values()]
    except Exception:  # noqa: BLE001 (CuPy raises a driver error for a missing symbol)
        raise SystemExit("built without the stamps: set KUIPER_DIAG_DEFINES=-DKUIPER_DIAG_TIMES") from None
    for _ in range(5):
        ops._graph.launch(ops._stream)
    ops._stream.synchronize()
    for c in counters:
        cp.cuda.runtime.memset(c.ptr, 0, 4)
    t0 = time.perf_counter()
    ops._graph.launch(ops._stream)
    ops._stream.synchronize()
    wall = (time.perf_counter() - t0) * 1e6
    parts = {tag: records(mod) for tag, mod in mods.items()}
    rec = np.concatenate(list(parts.values()))
    tags = np.concatenate([np.full(len(r), tag) for tag, r in parts.items()])
    t = rec[:, 2:7].astype(np.float64)
    t = (t - t[:, 0].min()) / 1000.0  # µs from the step's first stamped block
    launches = []  # a launch: one module's blocks with one id (its weight or cache pointer)
    for tag in parts:
        for ident in np.unique(rec[tags == tag, 0]):
            sel = (tags == tag) & (rec[:, 0] == ident)
            launches.append((t[sel, 0].min(), tag, t[sel]))
    launches.sort(key=lambda z: z[0])
    n_layers = m.args.num_hidden_layers
    # a layer's stamped kernels (the MoE router of KUIPER_DECODE_MOE=0 is not stamped); otherwise each
    # launch on its own row. ffn (ffn_decode.cu): its "prologue done" is gate/up done (moe_ffn_decode:
    # the experts picked), "loop done" the cluster's gate/up sums read (built with -DFFN_DIAG_LOOPEND=1 too:
    # the end of the block's own gate/up loop). (The stamps are not memory
    # operations: the compiler may move independent work across them, so sub-phase splits are rough.)
    kinds = (["qkv", "attention", "o", "gate/up", "down"] if len(launches) == 5 * n_layers else
             ["qkv", "attention", "o", "ffn"] if len(launches) == 4 * n_layers else None)
    per = len(kinds) if kinds else 1
    print(f"# {model}, context {ctx}: one step {wall:.0f} µs (host-timed, stamps on), {len(rec)} blocks, "
          f"{len(launches)} launches")
    print("| kernel | blocks | wait spread | wait -> prologue done | prologue -> loop done | end min | end median "
          "| end p90 | end max | end max -> next wait |")
    print("| --- |" + " ---: |" * 9)
    rows = {}
    for j, (_, tag, tt) in enumerate(launches):
        w0 = tt[:, 1].min()
        nxt = launches[j + 1][2][:, 1].min() if j + 1 < len(launches) else np.nan
        r = [len(tt), tt[:, 1].max() - w0, np.median(tt[:, 2] - tt[:, 1]), np.median(tt[:, 3] - tt[:, 2]),
             tt[:, 4].min() - w0, np.median(tt[:, 4]) - w0, np.percentile(tt[:, 4], 90) - w0, tt[:, 4].max() - w0,
             nxt - tt[:, 4].max()]
        if kinds and n_layers > 4 and not (2 <= j // per < n_layers - 2):
            continue  # the middle layers only
        rows.setdefault(kinds[j % per] if kinds else f"{tag} {j}", []).append(r)
    for k, v in rows.items():
        a = np.nanmean(np.array(v), axis=0)
        print(f"| {k} | {a[0]:.0f} | " + " | ".join(f"{x:.2f}" for x in a[1:]) + " |")
    print("(µs; 'wait' is the moment a block passes its PDL wait, the columns after it are measured from the "
          "launch's first such moment)")
    if save:
        np.savez(save, rec=rec, tags=np.array(tags))


if __name__ == "__main__":
    main()
