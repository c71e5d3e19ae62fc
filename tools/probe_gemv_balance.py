#!/usr/bin/env python3
"""Probe (device machine): does balancing a decode GEMV's steps among the warps of one SM shorten it?
(docs/PERFORMANCE.md changes 88, 92, 93: an SM serves its oldest block's loads first, so the youngest block on
each SM ends last; change 159 is this probe's result.)

Variants of one W4A16 GEMV (the engine's dot product from common.cuh, a tiled weight layout, fp32 partials per
block, no split-K reduction): steps interleaved over the warps in a fixed order (the engine's form) against
steps taken from a shared-memory ticket (dynamic), at 8 warps x 3-4 blocks per SM, 16 warps x 2 and 24 warps x
1 block per SM (the last balances a whole SM's warps); the 24-warp dynamic form also with each step's sums
added in int64 fixed point (what a dynamic form needs to stay bitwise reproducible). Each block takes an equal
run of (column tile, 16-row step) units. The launches of a CUDA graph rotate over weight copies totalling
~400 MB, so the figures are DRAM figures. Per variant: µs per launch, its bandwidth over the same-run copy's,
and the median and latest block end (its last warp's loop) after the launch's first block started.

    python tools/probe_gemv_balance.py [OUT.json]
"""
import json
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
from kuiper_py.ops_cupy import kernel_dir  # noqa: E402
from tools.devcopy import copy_bandwidth  # noqa: E402

SRC = r'''
#include "common.cuh"
#define ROWS 16
// units: (tile, 16-row step), tile-major; block b takes [u0, u1), at most two tiles
template <int WARPS, bool DYN, bool FIX>
__global__ void __launch_bounds__(WARPS * 32, (WARPS == 8 ? 4 : WARPS == 16 ? 2 : 1))
bal(const u32* __restrict__ qw, const u32* __restrict__ qz, const half* __restrict__ sc, const half* __restrict__ x,
    int K, int N, float* __restrict__ part, unsigned long long* __restrict__ stamps) {
    extern __shared__ __align__(16) unsigned char dyn[];
    half* xsm = reinterpret_cast<half*>(dyn);                                   // [K]
    float* red = reinterpret_cast<float*>(dyn + 2 * K);                         // [2][WARPS][264]
    __shared__ int ticket;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int steps = K / ROWS, U = (N / 256) * steps;
    const int u0 = (int)((long long)blockIdx.x * U / gridDim.x), u1 = (int)((long long)(blockIdx.x + 1) * U / gridDim.x);
    const int tA = u0 / steps;
    const unsigned long long t0 = globaltimer_ns();
    if (threadIdx.x == 0) ticket = WARPS;
    // x rows the block needs
    const int ka = (u0 % steps) * ROWS, kb = ((u1 - 1) % steps + 1) * ROWS, two = (u1 - 1) / steps != tA;
    for (int e = 8 * threadIdx.x; e < K; e += 8 * blockDim.x) {
        const bool need = two ? (e >= ka || e < kb) : (e >= ka && e < kb);
        if (need) *reinterpret_cast<uint4*>(xsm + e) = __ldg(reinterpret_cast<const uint4*>(x + e));
    }
    __syncthreads();
    float acc[8];
    long long acc64[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) { acc[i] = 0.f; acc64[i] = 0; }
    int cur = tA, n = 0;
    const int quads = K / 4;
    for (int u = u0 + warp; u < u1; ) {
        const int t = u / steps, k0 = (u % steps) * ROWS;
        if (t != cur) {  // the warp's units increase: one switch at most
            float* row = red + (size_t)(cur - tA) * WARPS * 264 + warp * 264;
#pragma unroll
            for (int i = 0; i < 8; ++i) { row[lane * 8 + i + lane / 4] = FIX ? fix_f(acc64[i]) : acc[i]; acc[i] = 0.f; acc64[i] = 0; }
            cur = t;
        }
        const uint4* p = reinterpret_cast<const uint4*>(qw) + ((size_t)t * quads + k0 / 4) * 32 + lane;
        u32 wv[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r += 4) {
            const uint4 v = ld_stream16(p + (r / 4) * 32);
            wv[r] = v.x; wv[r + 1] = v.y; wv[r + 2] = v.z; wv[r + 3] = v.w;
        }
        const int g = k0 >> 7, word = t * 32 + lane;
        const u32 zw = __ldg(qz + (size_t)g * (N / 8) + word);
        const uint4 sv = __ldg(reinterpret_cast<const uint4*>(sc + (size_t)g * N + word * 8));
        int next;
        if (DYN) {
            int tk = 0;
            if (lane == 0) tk = atomicAdd(&ticket, 1);
            next = u0 + __shfl_sync(0xffffffffu, tk, 0);
        } else {
            next = u + WARPS;
        }
        uint4 xv[ROWS / 8];
#pragma unroll
        for (int i = 0; i < ROWS / 8; ++i) xv[i] = reinterpret_cast<const uint4*>(xsm + k0)[i];
        const half* xs = reinterpret_cast<const half*>(xv);
        half2 zb[4];
        awq_zero_bias(zw, zb);
        const half2 s2[4] = {*reinterpret_cast<const half2*>(&sv.x), *reinterpret_cast<const half2*>(&sv.y),
                             *reinterpret_cast<const half2*>(&sv.z), *reinterpret_cast<const half2*>(&sv.w)};
        if (FIX) {
            float st[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) st[i] = 0.f;
#pragma unroll
            for (int r0 = 0; r0 < ROWS; r0 += 4) awq_dot4_fold(wv + r0, xs + r0, zb, s2, st);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc64[i] += __float2ll_rn(st[i] * FIX_ONE);
        } else {
#pragma unroll
            for (int r0 = 0; r0 < ROWS; r0 += 4) awq_dot4_fold(wv + r0, xs + r0, zb, s2, acc);
        }
        ++n;
        u = next;
    }
    {
        float* row = red + (size_t)(cur - tA) * WARPS * 264 + warp * 264;
#pragma unroll
        for (int i = 0; i < 8; ++i) row[lane * 8 + i + lane / 4] = FIX ? fix_f(acc64[i]) : acc[i];
    }
    const unsigned long long t1 = globaltimer_ns();
    __syncthreads();
    for (int c = threadIdx.x; c < 256 * (1 + two); c += blockDim.x) {
        const int slot = c / 256, cc = c % 256;
        float s = 0.f;
        for (int w = 0; w < WARPS; ++w) s += red[(size_t)slot * WARPS * 264 + w * 264 + cc + cc / 32];
        part[((size_t)blockIdx.x * 2 + slot) * 256 + cc] = s;
    }
    if (threadIdx.x == 0) { stamps[3 * blockIdx.x] = t0; stamps[3 * blockIdx.x + 1] = t1; }
    // the loop end of the block's last warp
    if (lane == 0) atomicMax(stamps + 3 * blockIdx.x + 2, t1);
}
'''
NAMES = {(w, d, f): f"bal<{w},{'true' if d else 'false'},{'true' if f else 'false'}>"
         for w, d, f in [(8, False, False), (8, True, False), (24, False, False), (24, True, False), (24, True, True),
                         (16, True, False), (16, False, False)]}
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}


def main():
    mod = cp.RawModule(code=SRC, options=("--std=c++17", f"-I{kernel_dir()}"),
                       name_expressions=list(NAMES.values()))
    dev = cp.cuda.Device()
    n_sm = dev.attributes["MultiProcessorCount"]
    copy = copy_bandwidth()["best"]
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()} {n_sm} SMs, copy {copy:.0f} GB/s", file=sys.stderr)
    rows, res = [], {}
    rng = np.random.default_rng(0)
    for sname, (K, N) in SHAPES.items():
        wbytes = K * N // 2 + K // 128 * N * 2 + K // 128 * N // 2
        copies = max(2, int(np.ceil(400e6 / wbytes)))
        qw = [cp.asarray(rng.integers(0, 2**32, size=K * N // 8, dtype=np.uint32)) for _ in range(copies)]
        qz = [cp.asarray(rng.integers(0, 2**32, size=K // 128 * N // 8, dtype=np.uint32)) for _ in range(copies)]
        sc = [cp.asarray((rng.random(K // 128 * N) * 1e-3).astype(np.float16)) for _ in range(copies)]
        x = cp.asarray(rng.standard_normal(K).astype(np.float16))
        for (W, D, F), name in NAMES.items():
            fn = mod.get_function(name)
            for per_sm in ([3, 4] if W == 8 else [2] if W == 16 else [1]):
                B = per_sm * n_sm
                smem = 2 * K + 2 * W * 264 * 4
                fn.max_dynamic_shared_size_bytes = smem
                part = cp.zeros(B * 2 * 256, cp.float32)
                st = cp.zeros(3 * B, cp.uint64)
                L = 4 * copies
                s = cp.cuda.Stream(non_blocking=True)
                with s:
                    s.begin_capture()
                    for i in range(L):
                        j = i % copies
                        fn((B,), (W * 32,), (qw[j], qz[j], sc[j], x, np.int32(K), np.int32(N), part, st), shared_mem=smem)
                    g = s.end_capture()
                g.launch(s)
                s.synchronize()
                ts = []
                for _ in range(5):
                    with s:  # (ordered before the replay on its stream)
                        st.fill(0)
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record(s)
                    g.launch(s)
                    e1.record(s)
                    e1.synchronize()
                    ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / L)
                us = float(np.median(ts))
                # (a timing probe: the partial sums are not checked; the stamps are the last launch's)
                stv = st.get().reshape(B, 3).astype(np.int64)
                end = stv[:, 2] - stv[:, 0].min()
                spread = (np.percentile(end, 50) / 1e3, end.max() / 1e3)
                gbps = wbytes / (us * 1e-6) / 1e9
                rows.append((sname, name, per_sm, us, gbps / copy, *spread))
                res[f"{sname} {name} {per_sm}"] = dict(us=us, ratio=gbps / copy, end_med=spread[0], end_max=spread[1])
                print(f"{sname:8s} {name:22s} {per_sm}/SM {us:7.2f} us {gbps/copy:5.3f} of copy  end med {spread[0]:6.2f} max {spread[1]:6.2f}",
                      file=sys.stderr, flush=True)
        del qw, qz, sc
    print(f"{'shape':8s} {'variant':22s} {'per SM':>6s} {'us':>7s} {'/copy':>6s} {'end med':>8s} {'end max':>8s}")
    for r in rows:
        print(f"{r[0]:8s} {r[1]:22s} {r[2]:6d} {r[3]:7.2f} {r[4]:6.3f} {r[5]:8.2f} {r[6]:8.2f}")
    if len(sys.argv) > 1:
        json.dump(dict(copy=copy, rows=res), open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
