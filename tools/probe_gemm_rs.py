"""Probe of the register-A wgmma GEMM prototype (gemm_wgmma.cu gemm_w4a16_rs, PERFORMANCE.md change 164):
TFLOP/s at the Qwen3-8B projection shapes against cuBLAS fp16 (cupy.matmul) and the fused wgmma GEMM
(gemm_wgmma) in the same run, weights rotated over > 6x L2 as in bench_kernels, and each form's largest
error against the float32 product of the dequantized weights (outputs poisoned with NaN first).
Runs on compute capability 9.0 only. Prints a table last; --json writes the rows."""
import json
import math
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from bench_kernels import rand_awq, time_ms  # noqa: E402
from kuiper_py import ops_cupy as oc  # noqa: E402

SHAPES = {"qkv 4096->6144": (4096, [4096, 1024, 1024]), "o 4096->4096": (4096, [4096]),
          "gate 4096->12288": (4096, [12288]), "down 12288->4096": (12288, [4096])}


@click.command()
@click.option("--rows", default="128,512,2048", help="token counts to time")
@click.option("--json", "json_out", default=None)
def main(rows, json_out):
    if not oc.wgmma_available():
        raise click.ClickException("needs compute capability 9.0 (sm_90a)")
    l2 = cp.cuda.Device().attributes["L2CacheSize"]
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    out = []
    for name, (K, Ns) in SHAPES.items():
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
            forms = {"rs64": lambda i, c=c: oc.gemm_rs(x, ms[i % nq], c, 64),
                     "rs128": lambda i, c=c: oc.gemm_rs(x, ms[i % nq], c, 128),
                     "wgmma": lambda i, c=c: oc.gemm_wgmma(x, ms[i % nq], c)}
            r = {"shape": name, "M": M}
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
    if json_out:
        Path(json_out).write_text(json.dumps({"gpu": gpu, "rows": out}, indent=1))
    print(f"# {gpu}: TFLOP/s (ratio to cuBLAS fp16), largest error / largest |reference|")
    print("| shape | M | cuBLAS | rs 64 | rs 128 | wgmma (gemm_w4a16_ws) | errors rs64 / rs128 / wgmma |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in out:
        cells = " | ".join(f"{r[f]:.0f} ({r[f] / r['cublas']:.2f})" for f in ("rs64", "rs128", "wgmma"))
        print(f"| {r['shape']} | {r['M']} | {r['cublas']:.0f} | {cells} | "
              f"{r['rs64_err']:.1e} / {r['rs128_err']:.1e} / {r['wgmma_err']:.1e} |")


if __name__ == "__main__":
    main()
