"""Probe of the register-A wgmma GEMM (gemm_wgmma.cu gemm_w4a16_rs, PERFORMANCE.md changes 164-166; prefill's "rs"
path since change 167), 128 tokens x 256 channels or 256 tokens x 128 channels per block, each tile's K in 1, 2 or 4
ranges or as rs_plan splits it: TFLOP/s at the Qwen3-8B (and 30B-A3B attention) projection shapes against
cuBLAS fp16 (cupy.matmul), the fused wgmma GEMM (gemm_wgmma), the dequant + cuBLAS path, 64 tokens per block, and
(for a row count that is not a multiple of 256) the rows split in two launches, the first whole 256-row tiles then
the rest by 64-token blocks (gemm()'s form for 257-320 rows, change 206) or by the wgmma GEMM, in the same run,
weights rotated over > 6x L2 as in bench_kernels, and each form's largest error against the float32 product
of the dequantized weights (outputs poisoned with NaN first).
--power S also runs cuBLAS and the kernels back to back for S seconds each at the largest row count while
nvidia-smi samples the SM clock and board power (change 165: at 2048 rows these GEMMs run at the power cap).
Runs on compute capability 9.0 only. Prints a table last; --json writes the rows."""
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from bench_kernels import rand_awq, time_ms  # noqa: E402
from kuiper_py import ops_cupy as oc  # noqa: E402

def under_load(run, seconds: float, flop: float) -> dict:
    """run(i) back to back for `seconds` while nvidia-smi samples this GPU every 100 ms: TFLOP/s over the
    span, the median SM clock (MHz) and board power (W), and whether the power cap throttled it."""
    run(0)
    cp.cuda.Device().synchronize()
    smi = subprocess.Popen(["nvidia-smi", "-i", str(cp.cuda.Device().id), "-lms", "100", "--format=csv,noheader,nounits",
                            "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.sw_power_cap"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    time.sleep(0.3)
    start, end, n, t0 = cp.cuda.Event(), cp.cuda.Event(), 0, time.time()
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            run(n)
            n += 1
        cp.cuda.Device().synchronize()
    end.record()
    end.synchronize()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    rows = [r.split(", ") for r in (lines[3:] or lines)]  # the first samples straddle the start
    if not rows:
        raise click.ClickException("nvidia-smi gave no samples")
    med = sorted(float(r[0]) for r in rows), sorted(float(r[1]) for r in rows)
    return {"tflops": flop * n / cp.cuda.get_elapsed_time(start, end) / 1e9, "clock_mhz": med[0][len(rows) // 2],
            "power_w": med[1][len(rows) // 2], "power_capped": any(r[2].strip() == "Active" for r in rows)}


SHAPES = {"qkv 4096->6144": (4096, [4096, 1024, 1024]), "o 4096->4096": (4096, [4096]),
          "gate 4096->12288": (4096, [12288]), "gate|up 4096->2x12288": (4096, [12288, 12288]),
          "down 12288->4096": (12288, [4096]),
          "30b qkv 2048->5120": (2048, [4096, 512, 512]), "30b o 4096->2048": (4096, [2048])}


@click.command()
@click.option("--rows", default="256,512,1024,2048", help="token counts to time")
@click.option("--shapes", default="", help="comma-separated prefixes of the shape names (default: all)")
@click.option("--power", default=0.0, help="also run cuBLAS and each kernel back to back this many seconds at the "
              "largest row count, sampling the SM clock and board power (nvidia-smi)")
@click.option("--forms", "only", default="", help="comma-separated form names to run (default: all; the table "
              "shows '-' for the others)")
@click.option("--json", "json_out", default=None)
def main(rows, shapes, power, only, json_out):
    if not oc.wgmma_available():
        raise click.ClickException("needs compute capability 9.0 (sm_90a)")
    l2 = cp.cuda.Device().attributes["L2CacheSize"]
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if power and not shutil.which("nvidia-smi"):
        raise click.ClickException("--power needs nvidia-smi")
    out, loads = [], []
    for name, (K, Ns) in SHAPES.items():
        if shapes and not any(name.startswith(p) for p in shapes.split(",")):
            continue
        N = sum(Ns)
        nq = max(2, math.ceil(6 * l2 / (K * N // 2)))
        ms = [[rand_awq(K, n) for n in Ns] for _ in range(nq)]
        Wf = [(cp.random.standard_normal((K, N), dtype=cp.float32) * 0.02).astype(cp.float16)
              for _ in range(max(2, math.ceil(6 * l2 / (K * N * 2))))]
        ref_w = cp.concatenate([oc.awq_dequant(m).copy() for m in ms[0]], axis=1).astype(cp.float32)
        for M in (int(v) for v in rows.split(",")):
            x = (cp.random.standard_normal((M, K), dtype=cp.float32) * 0.5).astype(cp.float16)
            ref = x.astype(cp.float32) @ ref_w
            c = cp.empty((M, N), cp.float16)
            forms = {f"rs{bt}s{sp}": lambda i, c=c, sp=sp, bt=bt: oc.gemm_rs(x, ms[i % nq], c, bt, sp)
                     for bt in (128, 256) for sp in (1, 2, 4)}
            forms["rs_plan"] = lambda i, c=c: oc.gemm_rs(x, ms[i % nq], c, 128)
            forms["rs256"] = lambda i, c=c: oc.gemm_rs(x, ms[i % nq], c, 256)
            forms["rs64"] = lambda i, c=c: oc.gemm_rs(x, ms[i % nq], c, 64)
            forms["wgmma"] = lambda i, c=c: oc.gemm_wgmma(x, ms[i % nq], c)
            if M % 256:  # rows split: the first 256 by 256-token blocks, the rest by a second launch
                h = M // 256 * 256
                forms["hyb_rs"] = lambda i, c=c, h=h: (oc.gemm_rs(x[:h], ms[i % nq], c[:h], 256),
                                                       oc.gemm_rs(x[h:], ms[i % nq], c[h:], 64))
                forms["hyb_wg"] = lambda i, c=c, h=h: (oc.gemm_rs(x[:h], ms[i % nq], c[:h], 256),
                                                       oc.gemm_wgmma(x[h:], ms[i % nq], c[h:]))
            forms["dequant"] = lambda i, c=c: oc.gemm(x, tuple(ms[i % nq]), c, path="dequant")
            if only:
                forms = {f: run for f, run in forms.items() if f in only.split(",")}
            r = {"shape": name, "M": M, "plan": oc.rs_plan(M, N, K), "plan256": oc.rs_plan(M, N, K, 256)}
            for f, run in forms.items():
                c.fill(cp.nan)
                run(0)
                r[f + "_err"] = float(cp.nan_to_num(cp.abs(c.astype(cp.float32) - ref), nan=cp.inf).max()
                                      / cp.abs(ref).max())
            fl = 2 * M * K * N
            r["cublas"] = fl / time_ms(lambda i: cp.matmul(x, Wf[i % len(Wf)], out=c), iters=20) / 1e9
            for f, run in forms.items():
                r[f] = fl / time_ms(run, iters=20) / 1e9
            out.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if power and M == max(int(v) for v in rows.split(",")):
                forms["cublas"] = lambda i, c=c: cp.matmul(x, Wf[i % len(Wf)], out=c)
                for f in ("cublas", "rs_plan", "rs256", "wgmma", "dequant"):
                    loads.append({"shape": name, "M": M, "form": f, **under_load(forms[f], power, fl)})
                    print(json.dumps(loads[-1]), file=sys.stderr, flush=True)
    if json_out:
        Path(json_out).write_text(json.dumps({"gpu": gpu, "rows": out, "under_load": loads}, indent=1))
    print(f"# {gpu}: TFLOP/s (ratio to cuBLAS fp16), largest error / largest |reference|")
    names = ["rs128s1", "rs128s2", "rs128s4", "rs_plan", "rs256s1", "rs256s2", "rs256s4", "rs256", "rs64", "wgmma",
             "dequant", "hyb_rs", "hyb_wg"]
    print("| shape | M | cuBLAS | rs 128 tokens, split 1 | 2 | 4 | as planned (split) | rs 256 tokens, split 1 | 2 | 4 "
          "| as planned (split) | rs 64 tokens | wgmma (gemm_w4a16_ws) | dequant + cuBLAS | rows split, rs 64 after 256 "
          "| rows split, wgmma after 256 | largest error |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in names) + " | --- |")
    for r in out:
        cells = [f"{r[f]:.0f} ({r[f] / r['cublas']:.2f})" if f in r else "-" for f in names]
        cells[3] += f" ({r['plan']})"
        cells[7] += f" ({r['plan256']})"
        print(f"| {r['shape']} | {r['M']} | {r['cublas']:.0f} | {' | '.join(cells)} | "
              f"{max([r[f + '_err'] for f in names if f in r] or [float('nan')]):.1e} |")
    if loads:
        print(f"\n# {gpu}, each form back to back for {power:g} s: TFLOP/s, median SM clock, median board power")
        print("| shape | M | form | TFLOP/s | SM clock (MHz) | power (W) | power cap throttled |")
        print("| --- | ---: | --- | ---: | ---: | ---: | --- |")
        for r in loads:
            print(f"| {r['shape']} | {r['M']} | {r['form']} | {r['tflops']:.0f} | {r['clock_mhz']:.0f} | {r['power_w']:.0f} | "
                  f"{'yes' if r['power_capped'] else 'no'} |")


if __name__ == "__main__":
    main()
