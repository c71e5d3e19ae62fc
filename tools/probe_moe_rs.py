"""Probe of Qwen3-MoE prefill's grouped expert GEMMs (gemm_wgmma.cu gemm_moe_rs, PERFORMANCE.md changes 168-179, and
gemm_moe_tc.cu gemm_moe_tc, change 199): each compiled form (gemm_moe_rs: rows per tile, stages, consumer warpgroups,
narrow, swizzled: ops_cupy.MOE_RS_FORMS_ALL; gemm_moe_tc: rows per tile, MOE_TC_TILES, gate|up reading the token rows
through perm_to_unperm) timed alone on the
gate|up and down GEMMs of a real MoE layer shape (random weights, random routing), the forms of one tile size in
alternation over several rounds so a slow spell of the GPU lands on all of them. One launch reads every expert's
weights (30B-A3B: 201 MB for gate|up, more than the L2 several times over), so the numbers are DRAM numbers.
Each form's output is checked against gemm_w4a16.cu's mma.sync grouped GEMMs (an independent kernel: gate|up
through SwiGLU, down as is), outputs poisoned with NaN first. Runs on compute capability 9.0 only. Prints a
table last (µs per launch, the median of the rounds, and the spread; the weights' bytes over the median as TB/s);
--json writes the rows. --tc-only times gemm_moe_tc alone (and the rs form its tile size would replace).

    python tools/probe_moe_rs.py [--shape 30b-a3b] [--tokens 128,256,512,1024] [--rounds 3] [--tc-only]"""
import json
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from bench_kernels import time_ms  # noqa: E402
from kuiper_py import ops_cupy as oc  # noqa: E402
from kuiper_py.loader import AwqStack  # noqa: E402

SHAPES = {"30b-a3b": (2048, 768, 128, 8), "235b-a22b": (4096, 1536, 128, 8)}  # D, expert intermediate, E, k


def rand_stack(E, K, N):
    """Random AWQ tensors of E experts on the device. The packed words are uniformly random, so they need no
    tiling (any rearrangement of them is as random), and both kernels read the same buffer."""
    qw = cp.random.randint(-2**31, 2**31 - 1, size=(E, K, N // 8), dtype=cp.int64).astype(cp.int32)
    qz = cp.random.randint(-2**31, 2**31 - 1, size=(E, K // 128, N // 8), dtype=cp.int64).astype(cp.int32)
    sc = (cp.random.random((E, K // 128, N), dtype=cp.float32) * 2 / (8 * K ** 0.5)).astype(cp.float16)
    return AwqStack(qw, qz, sc, 128)


def rel_err(got, ref) -> float:
    """Largest |got - ref| over the largest |ref| (NaN left in got counts as infinite)."""
    g, r = got.astype(cp.float32), ref.astype(cp.float32)
    return float(cp.nan_to_num(cp.abs(g - r), nan=cp.inf).max() / cp.abs(r).max())


@click.command()
@click.option("--shape", type=click.Choice(list(SHAPES)), default="30b-a3b")
@click.option("--tokens", default="256,512,1024,2048", help="prefill token counts (rows routed = tokens x k)")
@click.option("--rounds", default=3, help="alternating rounds over the forms")
@click.option("--json", "json_out", default=None)
@click.option("--tc-only", is_flag=True, help="gemm_moe_tc's forms and gemm_moe_rs's default 64-row form only")
def main(shape, tokens, rounds, json_out, tc_only):
    if not oc.wgmma_available():
        raise click.ClickException("needs compute capability 9.0 (sm_90a)")
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    D, inter, E, k = SHAPES[shape]
    w13, w2 = rand_stack(E, D, 2 * inter), rand_stack(E, inter, D)  # [gate | up], down
    saved = dict(oc.MOE_RS_FORMS)
    out = []
    try:
        for T in (int(v) for v in tokens.split(",")):
            x = cp.random.standard_normal((T, D), dtype=cp.float32).astype(cp.float16)
            ids = cp.argsort(cp.random.random((T, E), dtype=cp.float32), axis=1)[:, :k].astype(cp.int32)
            # the independent reference: the mma.sync grouped GEMMs on their own maps
            _, offs_m, tiles_m, p2u_m, _ = oc.moe_maps(ids, E)
            act_ref_m = oc.moe_gemm_gate_up(x, w13, offs_m, tiles_m, p2u_m, k)  # [n, inter] permuted (mma maps)
            act = cp.random.standard_normal((T * k, inter), dtype=cp.float32).astype(cp.float16)  # down's input
            down_ref = oc.moe_gemm_down(act, w2, offs_m, tiles_m)
            for tm in oc.MOE_TC_TILES:  # gemm_moe_tc: gate|up straight from the token rows
                _, offs, tiles, p2u, _ = oc.moe_maps(ids, E, tile_m=tm)
                assert bool((p2u == p2u_m).all()), "the maps of both tile sizes permute the rows alike"
                row = {"shape": shape, "tokens": T, "rows_per_tile": tm}
                gu = cp.full((T * k, 2 * inter), cp.nan, cp.float16)
                oc.gemm_moe_tc(x, w13, offs, tiles, tm, out=gu, p2u=p2u, k=k)
                a = oc.silu_mul(gu, gu[:, inter:], inter, 2 * inter)
                y = cp.full((T * k, D), cp.nan, cp.float16)
                oc.gemm_moe_tc(act, w2, offs, tiles, tm, out=y)
                row["tc_err"] = max(rel_err(a, act_ref_m), rel_err(y, down_ref))
                times = {"tc_gu": [], "tc_down": []}
                for _ in range(rounds):
                    times["tc_gu"].append(1e3 * time_ms(
                        lambda i: oc.gemm_moe_tc(x, w13, offs, tiles, tm, out=gu, p2u=p2u, k=k), iters=10, reps=3))
                    times["tc_down"].append(1e3 * time_ms(
                        lambda i: oc.gemm_moe_tc(act, w2, offs, tiles, tm, out=y), iters=10, reps=3))
                row["us"] = times
                out.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
            for bt in sorted({f[0] for f in oc.MOE_RS_FORMS_ALL}):
                if tc_only and bt != 64:
                    continue
                forms = [f for f in oc.MOE_RS_FORMS_ALL if f[0] == bt and (not tc_only or f[1:] == saved[bt])]
                _, offs, tiles, p2u, _ = oc.moe_maps(ids, E, tile_m=bt)
                xp = oc.moe_gather(x, p2u, k)
                # the same permutation either way (rows of an expert in token order): check it, then the
                # mma.sync path's activations are the rs path's row for row
                assert bool((p2u == p2u_m).all()), "the maps of both tile sizes permute the rows alike"
                row = {"shape": shape, "tokens": T, "rows_per_tile": bt}
                name = {f: f"st{f[1]}wg{f[2]}" + ("narrow" if f[3] else "") + ("swz" if f[4] else "") for f in forms}
                for f in forms:
                    oc.MOE_RS_FORMS[bt] = f[1:]
                    gu = cp.full((T * k, 2 * inter), cp.nan, cp.float16)
                    oc.gemm_moe_rs(xp, w13, offs, tiles, bt, out=gu)
                    a = oc.silu_mul(gu, gu[:, inter:], inter, 2 * inter)
                    y = cp.full((T * k, D), cp.nan, cp.float16)
                    oc.gemm_moe_rs(act, w2, offs, tiles, bt, out=y)
                    row[f"{name[f]}_err"] = max(rel_err(a, act_ref_m), rel_err(y, down_ref))
                gu, y = cp.empty((T * k, 2 * inter), cp.float16), cp.empty((T * k, D), cp.float16)
                times = {f"{name[f]}_{g}": [] for f in forms for g in ("gu", "down")}
                for _ in range(rounds):
                    for f in forms:
                        oc.MOE_RS_FORMS[bt] = f[1:]
                        times[f"{name[f]}_gu"].append(1e3 * time_ms(
                            lambda i: oc.gemm_moe_rs(xp, w13, offs, tiles, bt, out=gu), iters=10, reps=3))
                        times[f"{name[f]}_down"].append(1e3 * time_ms(
                            lambda i: oc.gemm_moe_rs(act, w2, offs, tiles, bt, out=y), iters=10, reps=3))
                row["us"] = times
                out.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        oc.MOE_RS_FORMS.clear()
        oc.MOE_RS_FORMS.update(saved)
    if json_out:
        Path(json_out).write_text(json.dumps({"gpu": gpu, "rows": out, "default_forms": saved}, indent=1))
    print(f"# {gpu}, {shape} expert GEMMs: µs per launch, median of {rounds} alternating rounds (min-max); "
          f"largest error against the mma.sync grouped GEMMs / largest |reference|; default forms {saved}")
    wbytes = {g: E * K * N // 2 + E * (K // 128) * (2 * N + N // 2) for g, K, N in (("gu", D, 2 * inter), ("down", inter, D))}
    print("| tokens | rows per tile | form (tc, or rs: stages, warpgroups, narrow, swizzled) | gate\\|up µs | down µs | "
          "gate\\|up / down TB/s | error |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in out:
        for key in sorted({kk.rsplit("_", 1)[0] for kk in r["us"]}):
            cells, rates = [], []
            for g in ("gu", "down"):
                v = sorted(r["us"][f"{key}_{g}"])
                cells.append(f"{v[len(v) // 2]:.1f} ({v[0]:.1f}-{v[-1]:.1f})")
                rates.append(f"{wbytes[g] / (v[len(v) // 2] * 1e-6) / 1e12:.2f}")
            print(f"| {r['tokens']} | {r['rows_per_tile']} | {key} | {cells[0]} | {cells[1]} | {' / '.join(rates)} | "
                  f"{r[key + '_err']:.1e} |")


if __name__ == "__main__":
    main()
