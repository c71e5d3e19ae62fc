"""Probe of prefill flash attention: attention.cu's mma.sync kernel (flash_attn_prefill) against attn_wgmma.cu's
wgmma kernel (flash_attn_wgmma, compute capability 9.0, head dim 128; PERFORMANCE.md change 170) on the
Qwen3-8B grouping (32 query heads over 8 KV heads) and Qwen3-30B-A3B's (32 over 4), causal, the whole prompt
at position 0 and a chunk after cached positions. TFLOP/s counts the causal work (4 x keys x head dim per
query and head: QK^T and PV over the keys at or before each query), timed as CUDA-graph replays (bench_kernels'
time_ms); the two kernels' outputs are compared with each other (largest relative difference) and with
float64 on a few rows. Prints a table last; --json writes the rows."""
import json
import math
import sys
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from bench_kernels import time_ms  # noqa: E402
from kuiper_py import ops_cupy as oc  # noqa: E402


def ref_rows(q, K, V, pos0, rows):
    """float64 attention of the given query rows: [len(rows), H*hd]."""
    T, H, hd = q.shape
    KV = K.shape[1]
    out = np.zeros((len(rows), H, hd))
    for i, t in enumerate(rows):
        n = pos0 + t + 1
        for h in range(H):
            kh = h // (H // KV)
            s = K[:n, kh].astype(np.float64) @ q[t, h].astype(np.float64) / math.sqrt(hd)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ V[:n, kh].astype(np.float64)
    return out.reshape(len(rows), H * hd)


@click.command()
@click.option("--tokens", default="512,2048,8192", help="prompt lengths")
@click.option("--configs", default=None, help="flash_attn_wgmma (stages, pipelined, consumer warpgroups) configurations to "
              "time beside the default, e.g. 3x0x2,4x1x3 (ops_cupy.FW_CONFIGS)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(tokens, configs, json_path):
    if not oc.wgmma_available():
        raise click.ClickException("flash_attn_wgmma needs compute capability 9.0")
    rng = np.random.default_rng()
    rows = []
    for name, H, KV in (("8B 32/8", 32, 8), ("30B-A3B 32/4", 32, 4)):
        for T in map(int, tokens.split(",")):
            for pos0 in (0, T // 2):
                hd, n = 128, pos0 + T
                Kn = rng.standard_normal((n, KV, hd)).astype(np.float16)
                Vn = rng.standard_normal((n, KV, hd)).astype(np.float16)
                qn = (rng.standard_normal((T, H, hd)) * 2).astype(np.float16)
                K, V, q = cp.asarray(Kn), cp.asarray(Vn), cp.asarray(qn)
                flop = 4.0 * H * hd * sum(pos0 + t + 1 for t in range(T))
                r = {"shape": name, "tokens": T, "pos0": pos0}
                sel = rng.choice(T, 4, replace=False)
                ref = ref_rows(qn, Kn, Vn, pos0, sel)
                outs = {}

                def timed(key, path):
                    """One form timed into r[key], its output (poisoned first) kept in outs[key]."""
                    o = outs[key] = cp.full((T, H * hd), np.nan, cp.float16)
                    ms = time_ms(lambda i: oc.attention_prefill(q, K, V, pos0, KV, o, path=path), iters=10)
                    got = cp.asnumpy(o).astype(np.float64)
                    r[key] = {"us": ms * 1e3, "tflops": flop / ms / 1e9,
                              "rel_f64": float(np.abs(got[sel] - ref).max() / np.abs(ref).max())}
                timed("mma", "mma")
                timed("wgmma", "wgmma")
                default = oc.FW_CONFIG
                for cfg in ([tuple(map(int, c.split("x"))) for c in configs.split(",")] if configs else []):
                    oc.FW_CONFIG = cfg
                    timed("wgmma " + "x".join(map(str, cfg)), "wgmma")
                oc.FW_CONFIG = default
                a, b = cp.asnumpy(outs["mma"]).astype(np.float64), cp.asnumpy(outs["wgmma"]).astype(np.float64)
                r["rel_between"] = float(np.abs(a - b).max() / np.abs(a).max())
                rows.append(r)
    if json_path:
        Path(json_path).write_text(json.dumps({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                               "rows": rows}, indent=1))
    print(f"{'shape':14} {'T':>5} {'pos0':>5} | {'mma us':>8} {'TFLOP/s':>7} | {'wgmma us':>8} {'TFLOP/s':>7} | "
          f"{'x':>5} | {'rel mma/wg':>10} {'f64 wg':>8}")
    for r in rows:
        m, w = r["mma"], r["wgmma"]
        print(f"{r['shape']:14} {r['tokens']:5d} {r['pos0']:5d} | {m['us']:8.1f} {m['tflops']:7.1f} | {w['us']:8.1f} "
              f"{w['tflops']:7.1f} | {m['us'] / w['us']:5.2f} | {r['rel_between']:10.2e} {w['rel_f64']:8.2e}"
              + "".join(f" | {k} {v['tflops']:.1f} ({v['rel_f64']:.1e})" for k, v in r.items() if k.startswith("wgmma ")))


if __name__ == "__main__":
    main()
