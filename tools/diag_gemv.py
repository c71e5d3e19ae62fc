#!/usr/bin/env python3
"""Device diagnostic: where the decode GEMV loses bandwidth. Times, in CUDA graphs over rotated
copies (DRAM, not L2), (1) a plain 16-byte streaming read kernel at the sizes of the 8B projections
and far larger, and (2) the GEMV at the same N over growing K, with several grid sizes. A fixed
per-launch cost shows as t = a + bytes / bw; the fit's a and bw are printed per series.

    python tools/diag_gemv.py [--json OUT.json]
"""
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

from bench_kernels import rand_awq, time_ms  # noqa: E402
from devcopy import copy_bandwidth  # noqa: E402
from kuiper_py import ops_cupy as oc  # noqa: E402

_READ = r'''
extern "C" __global__ void read16(const uint4* __restrict__ a, long long n, unsigned* __restrict__ sink) {
    unsigned acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        uint4 v = __ldg(a + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; practically never stores
}'''


def fit(rows):
    """Least squares t_us = a + bytes / (bw GB/s * 1e3)."""
    x = np.array([r["bytes"] for r in rows], float)
    t = np.array([r["us"] for r in rows], float)
    b, a = np.polyfit(x, t, 1)
    return a, 1.0 / b / 1e3


def main():
    out = {"gpu": oc.gpu_name(), "read": [], "gemv": []}
    copy_bw = copy_bandwidth()["best"]
    out["copy_GBps"] = copy_bw
    n_sm = oc.sm_count()
    k = cp.RawKernel(_READ, "read16")
    sink = cp.zeros(1, cp.uint32)
    for mb in (4, 8, 12.6, 25, 50, 100, 400):
        nbytes = int(mb * 2**20) // 16 * 16
        copies = max(2, math.ceil(240 * 2**20 / nbytes))
        bufs = [cp.ones(nbytes // 4, cp.uint32) for _ in range(copies)]
        for per_sm in (4, 8):
            t = time_ms(lambda i: k((n_sm * per_sm,), (512,), (bufs[i % copies], cp.int64(nbytes // 16), sink)))
            out["read"].append({"MB": mb, "blocks_per_sm": per_sm, "bytes": nbytes, "us": t * 1e3,
                                "ratio": nbytes / t / 1e6 / copy_bw})
        bufs = None
    partial = cp.empty((1 << 24,), cp.float32)
    for name, N, Ks, kind in (("gate/up N=2x12288", 12288, (1024, 2048, 4096, 8192, 16384), "swiglu"),
                              ("o/down N=4096", 4096, (2048, 4096, 12288, 32768), "plain")):
        for bps in (2, 3, 4, 6):
            oc.GEMV_BLOCKS_PER_SM = bps
            for K in Ks:
                mats = 2 if kind == "swiglu" else 1
                per = mats * (K * N // 2 + (K // 128) * N // 2 + (K // 128) * N * 2)
                copies = max(2, math.ceil(240 * 2**20 / per))
                sets = [[rand_awq(K, N) for _ in range(mats)] for _ in range(copies)]
                x = (cp.random.standard_normal((1, K)) * 0.1).astype(cp.float16)
                o = cp.empty((1, N * (1 if kind == "swiglu" else mats)), cp.float16)
                t = time_ms(lambda i: oc.gemv(x, sets[i % copies], kind, o, partial))
                S, _ = oc.gemv_split(K, mats * math.ceil(N / 256))
                out["gemv"].append({"series": name, "blocks_per_sm": bps, "K": K, "splits": S, "bytes": per,
                                    "us": t * 1e3, "ratio": per / t / 1e6 / copy_bw})
                sets = None
    print(f"# {out['gpu']}: copy {copy_bw:.0f} GB/s")
    print("| read kernel | blocks/SM | MB | us | / copy |\n| --- | ---: | ---: | ---: | ---: |")
    for r in out["read"]:
        print(f"| read16 | {r['blocks_per_sm']} | {r['MB']} | {r['us']:.1f} | {r['ratio']:.2f} |")
    for per_sm in (4, 8):
        a, bw = fit([r for r in out["read"] if r["blocks_per_sm"] == per_sm])
        print(f"fit read16 {per_sm}/SM: fixed {a:.2f} us, streaming {bw / copy_bw:.2f} of copy")
    print("| GEMV | blocks/SM | K | splits | us | / copy |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in out["gemv"]:
        print(f"| {r['series']} | {r['blocks_per_sm']} | {r['K']} | {r['splits']} | {r['us']:.1f} | {r['ratio']:.2f} |")
    for name in sorted({r["series"] for r in out["gemv"]}):
        for bps in (2, 3, 4, 6):
            a, bw = fit([r for r in out["gemv"] if r["series"] == name and r["blocks_per_sm"] == bps])
            print(f"fit {name} {bps}/SM: fixed {a:.2f} us, streaming {bw / copy_bw:.2f} of copy")
    if len(sys.argv) > 2 and sys.argv[1] == "--json":
        Path(sys.argv[2]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
