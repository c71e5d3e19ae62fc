#!/usr/bin/env python3
"""Device diagnostic: a per-block timeline of one graph-replayed decode step.

Run with KUIPER_DIAG_DEFINES=-DKUIPER_DIAG_TIMES: the decode GEMVs and flash decoding then stamp
%globaltimer in every block (entry, past the PDL wait, prologue done, loop done, end; common.cuh)
and this prints, per kernel kind averaged over the middle layers, when its blocks pass their wait,
how long the phases take, how the end times spread and the gap to the next kernel's wait. The
timer ticks in 32 ns steps (H200); the records are subtracted as integers, since their absolute
nanoseconds (~1.8e18) converted to float64 first, as this tool did before session 30, round to 256 ns.
The stamps add ~1% to a step.

--waves adds the same phases per residency wave (a block's linear index // the SM count: under PDL
the first wave is resident earliest, the last wave latest; PERFORMANCE.md change 88), --ranks per
entry rank among the launch's blocks on the same SM (change 92: that rank sets a GEMV block's loop,
not its wave). --save keeps the raw records; --load reads such a file back and prints the tables
without a GPU.

    KUIPER_DIAG_DEFINES=-DKUIPER_DIAG_TIMES python tools/timeline_decode.py MODEL.bin [--ctx 512] [--cap N] [--save F.npz] [--waves] [--ranks]
    python tools/timeline_decode.py --load F.npz [--waves] [--ranks] [--layers N]
"""
import sys
import time
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DENSE_KINDS = ["qkv", "attention", "o", "gate/up", "down"]
FFN_KINDS = ["qkv", "attention", "o", "ffn"]  # the one-launch FFN (dense or MoE)


def records(mod):
    """The block records a module's kernels appended: [n, 8] int64 (common.cuh diag_record)."""
    import cupy as cp

    n = int(cp.ndarray((1,), cp.uint32, mod.get_global("g_diag_n")).get()[0])
    return cp.ndarray((n, 8), cp.uint64, mod.get_global("g_diag")).get().astype(np.int64)


def split_launches(rec, tags):
    """The records as launches in start order: [(first entry, tag, row indices)]. A launch is one
    module's blocks with one id (its weight or cache pointer); where several launches share an id
    (KUIPER_MOE_DIAG_SHARED: every MoE layer reads one layer's experts), its records are cut into
    launches of the grid's size (column 7) in record order: a block records at its end, and no block
    of a later launch of a module ends before every block of an earlier one (each decode kernel waits
    for the whole grid before it)."""
    out = []
    for tag in np.unique(tags):
        for ident in np.unique(rec[tags == tag, 0]):
            rows = np.flatnonzero((tags == tag) & (rec[:, 0] == ident))
            n = int(rec[rows[0], 7])
            parts = np.split(rows, len(rows) // n) if 0 < n < len(rows) and len(rows) % n == 0 else [rows]
            out.extend((rec[ix, 2].min(), str(tag), ix) for ix in parts)
    out.sort(key=lambda z: z[0])
    return out


def layer_kinds(n_launches, n_layers):
    """A layer's stamped kernels, or None where the launches do not split into layers (the MoE router
    of KUIPER_DECODE_MOE=0 is not stamped). ffn (ffn_decode.cu): its "prologue done" is gate/up done
    (moe_ffn_decode: the experts picked), "loop done" the cluster's gate/up sums read."""
    for kinds in (DENSE_KINDS, FFN_KINDS):
        if n_launches == len(kinds) * n_layers:
            return kinds
    return None


def _launches(rec, tags, n_layers):
    """The stamps in µs from the step's first ([n, 5]: subtracted as integers, see above) and
    [(j, launch's row indices, its kind)] for the launches that count: the middle layers only (the first
    and last two differ), every launch where they do not split into layers."""
    t = (rec[:, 2:7] - rec[:, 2].min()) / 1000.0
    launches = split_launches(rec, tags)
    kinds = layer_kinds(len(launches), n_layers)
    per = len(kinds) if kinds else 1
    keep = [(j, ix, kinds[j % per] if kinds else f"{tag} {j}") for j, (_, tag, ix) in enumerate(launches)
            if not (kinds and n_layers > 4) or 2 <= j // per < n_layers - 2]
    return t, launches, keep


def kernel_table(rec, tags, n_layers):
    """Per kernel kind, the mean over the middle layers of [blocks, wait spread, wait -> prologue done
    (median), prologue -> loop done (median), end min, end median, end p90, end max, end max -> the next
    launch's first wait]: µs, each launch's times from its first block past the wait."""
    t, launches, keep = _launches(rec, tags, n_layers)
    rows = {}
    for j, ix, kind in keep:
        tt = t[ix]
        w0 = tt[:, 1].min()
        nxt = t[launches[j + 1][2], 1].min() if j + 1 < len(launches) else np.nan
        rows.setdefault(kind, []).append(
            [len(tt), tt[:, 1].max() - w0, np.median(tt[:, 2] - tt[:, 1]), np.median(tt[:, 3] - tt[:, 2]),
             tt[:, 4].min() - w0, np.median(tt[:, 4]) - w0, np.percentile(tt[:, 4], 90) - w0, tt[:, 4].max() - w0,
             nxt - tt[:, 4].max()])
    return {k: np.nanmean(np.array(v), axis=0) for k, v in rows.items()}


def _linear_index(rows):
    """The blocks' linear indices in their grid (x fastest) from their records."""
    b = rows[:, 1] >> 8  # blockIdx.x + 1024 (blockIdx.y + 1024 blockIdx.z)
    bx, by, bz = b & 1023, (b >> 10) & 1023, b >> 20
    gx, gy = bx.max() + 1, by.max() + 1
    return (bz * gy + by) * gx + bx


def _grouped(rec, tags, n_layers, group):
    """Per kernel kind and group key (group(record rows) gives one key per block), the mean over the middle
    layers of [blocks, entry, prologue done, loop (prologue done -> loop done), end mean, end max]: µs from
    the launch's first block past the wait (entry < 0: resident before it)."""
    t, _, keep = _launches(rec, tags, n_layers)
    out = {}
    for _, ix, kind in keep:
        tt = t[ix] - t[ix, 1].min()
        keys = group(rec[ix])
        per = out.setdefault(kind, {})
        for key in sorted(set(keys)):
            s = np.array([k == key for k in keys])
            per.setdefault(key, []).append([s.sum(), tt[s, 0].mean(), tt[s, 2].mean(),
                                            (tt[s, 3] - tt[s, 2]).mean(), tt[s, 4].mean(), tt[s, 4].max()])
    return {k: {g: np.mean(np.array(v), axis=0) for g, v in sorted(gs.items())} for k, gs in out.items()}


def wave_table(rec, tags, n_layers, n_sm):
    """_grouped by residency wave w: the blocks whose linear index in the grid // n_sm is w."""
    return _grouped(rec, tags, n_layers, lambda rows: [int(w) for w in _linear_index(rows) // n_sm])


def sm_rank(rows):
    """Per block, (blocks of its launch on its SM, its entry rank among them: 0 = resident first; ties by
    linear index)."""
    sm, lin = rows[:, 1] & 0xFF, _linear_index(rows)
    order = np.lexsort((lin, rows[:, 2], sm))  # by SM, then entry stamp, then linear index
    first = np.r_[0, np.flatnonzero(np.diff(sm[order])) + 1]
    count = np.diff(np.r_[first, len(order)])
    rank, n_on = np.empty(len(rows), int), np.empty(len(rows), int)
    rank[order] = np.arange(len(order)) - np.repeat(first, count)
    n_on[order] = np.repeat(count, count)
    return list(zip(n_on.tolist(), rank.tolist()))


def rank_table(rec, tags, n_layers):
    """_grouped by (blocks on the SM, entry rank on the SM): change 92 found a GEMV block's loop set by
    how many blocks of its launch reached its SM before it, not by its wave."""
    return _grouped(rec, tags, n_layers, sm_rank)


def print_tables(rec, tags, n_layers, n_sm, waves, ranks=False):
    print("| kernel | blocks | wait spread | wait -> prologue done | prologue -> loop done | end min | end median "
          "| end p90 | end max | end max -> next wait |")
    print("| --- |" + " ---: |" * 9)
    for k, a in kernel_table(rec, tags, n_layers).items():
        print(f"| {k} | {a[0]:.0f} | " + " | ".join(f"{x:.2f}" for x in a[1:]) + " |")
    print("(µs; 'wait' is the moment a block passes its PDL wait, the columns after it are measured from the "
          "launch's first such moment)")
    if waves:
        _print_grouped([f"wave (block index // {n_sm})"], wave_table(rec, tags, n_layers, n_sm),
                       "(µs from the launch's first block past its wait; entry < 0: resident before it)")
    if ranks:
        _print_grouped(["blocks on its SM", "entry rank on its SM"], rank_table(rec, tags, n_layers),
                       "(µs as above; rank 0: the first of the launch's blocks to start on that SM)")


def _print_grouped(key_columns, table, note):
    """One of _grouped's tables: a row per kernel kind and group key (an int, or a tuple of key_columns' cells)."""
    print(f"\n| kernel | {' | '.join(key_columns)} | blocks | entry | prologue done | loop | end mean | end max |")
    print("| --- |" + " ---: |" * (len(key_columns) + 6))
    for k, gs in table.items():
        for key, a in gs.items():
            cells = " | ".join(str(c) for c in (key if isinstance(key, tuple) else (key,)))
            print(f"| {k} | {cells} | {a[0]:.0f} | " + " | ".join(f"{x:.2f}" for x in a[1:]) + " |")
    print(note)


@click.command()
@click.argument("model", type=click.Path(exists=True), required=False)
@click.option("--ctx", default=512)
@click.option("--cap", default=0, help="the cache's positions, at least ctx + 64 (0: ctx + 64, bench_e2e's context-sized "
              "cache; the step timer's 2200 gives o the gemv_merge_span merge past 16 capacity splits)")
@click.option("--save", default=None, help="write the raw records (npz)")
@click.option("--load", "load_path", default=None, type=click.Path(exists=True),
              help="print the tables of records saved with --save (no GPU)")
@click.option("--waves", is_flag=True, help="also the phases per residency wave")
@click.option("--ranks", is_flag=True, help="also the phases by entry rank on the block's SM")
@click.option("--layers", default=0, help="with --load: the model's layers (files saved before they were recorded)")
def main(model, ctx, cap, save, load_path, waves, ranks, layers):
    if load_path:
        z = np.load(load_path)
        n_layers = layers or (int(z["n_layers"]) if "n_layers" in z else 0)
        if not n_layers:
            raise SystemExit(f"{load_path} does not record the model's layers: pass --layers")
        rec, tags = z["rec"], z["tags"]
        n_sm = int(z["n_sm"]) if "n_sm" in z else int((rec[:, 1] & 0xFF).max()) + 1
        print(f"# {load_path}: {len(rec)} blocks, {len(split_launches(rec, tags))} launches")
        print_tables(rec, tags, n_layers, n_sm, waves, ranks)
        return
    if model is None:
        raise SystemExit("give MODEL.bin, or --load F.npz")
    if cap and cap < ctx + 64:
        raise SystemExit(f"--cap {cap} is under the context + 64 ({ctx + 64}) that the warm-up and replays step through")
    import cupy as cp

    from bench_e2e import warm_session
    from kuiper_py import ops_cupy as oc
    from kuiper_py.generate import Engine

    eng = Engine.load(model, "cuda", need_tokenizer=False)
    m, _ = warm_session(eng, ctx, cap or ctx + 64, np.random.default_rng(0))
    ops = m.ops
    mods = [(t, mod) for t in ("gemv", "attn", "attncm", "ffn") for mod in oc.family_modules(t)]
    try:
        counters = [mod.get_global("g_diag_n") for _, mod in mods]
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
    parts = [(tag, records(mod)) for tag, mod in mods]  # (a family built as several modules: each its records)
    rec = np.concatenate([r for _, r in parts])
    tags = np.concatenate([np.full(len(r), tag) for tag, r in parts])
    n_layers, n_sm = m.args.num_hidden_layers, oc.sm_count()
    print(f"# {model}, context {ctx}: one step {wall:.0f} µs (host-timed, stamps on), {len(rec)} blocks, "
          f"{len(split_launches(rec, tags))} launches")
    print_tables(rec, tags, n_layers, n_sm, waves, ranks)
    if save:
        np.savez(save, rec=rec, tags=np.array(tags), n_layers=n_layers, n_sm=n_sm)


if __name__ == "__main__":
    main()
