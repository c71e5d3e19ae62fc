#!/usr/bin/env python3
"""o's merge prologue outside the engine (device machine; PERFORMANCE.md change 153). Per "layer": a writer
grid shaped like flash decoding at 512 keys (128 blocks x 128 threads: 8 KV heads x 16 splits, 4 query heads
each) writes its partials, a reader grid shaped like Qwen3-8B's o GEMV (256 blocks x 256 threads: 16 K-splits
of 2 heads x 16 column tiles) merges its 2 heads over `used` splits and then streams 32 KB of weights, and a
filler grid streams 100 MB (the FFN); all three under PDL, 36 layers, three passes. Each reader block stamps
%globaltimer when it passes its wait and when its merge is in shared memory. The merge forms: every thread
loading its element's partials and all the pairs (decode_merge's loads), the pairs once per block in shared
memory (gemv_merge_span), and float4 partials over split phases (built into the engine and removed: no gain
there, change 154). --variants adds the all-pairs form's variants that change 153 reports (plain launches, no
filler, no weights before the wait, 16 copies of the partials so that no two blocks read the same line).

    python tools/probe_merge_forms.py 8 [--variants] [--json OUT.json]   # splits used (8: the H200 at 512
                                                                          # keys; 16: the H100)
"""
import json
import sys
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from kuiper_py.ops_cupy import _PdlKernel, gpu_name, headers_tag, kernel_dir  # noqa: E402

_SRC = r'''
#include "common.cuh"
// 128 blocks x 128: block (kv, s) writes 4 heads' rows of split s, like flash decoding's partials
extern "C" __global__ void writer(float* part, float* ml, int S, float v, int rep) {
    pdl_wait();
    pdl_trigger();
    const int kv = blockIdx.x / S, s = blockIdx.x % S;
    for (int r = 0; r < rep; ++r)
    for (int j = 0; j < 4; ++j) part[(size_t)r * 32 * S * 128 + ((size_t)(kv * 4 + j) * S + s) * 128 + threadIdx.x] = v + threadIdx.x;
    if (threadIdx.x < 4) { ml[((kv * 4 + threadIdx.x) * S + s) * 2] = 1.f; ml[((kv * 4 + threadIdx.x) * S + s) * 2 + 1] = 2.f; }
}
// 256 blocks x 256: block (ks, tile) merges heads 2ks, 2ks+1 over `used` splits (8 scalar loads per thread),
// then streams its share of w (32 KB); PRE: its first 4 KB of w loaded before the wait
extern "C" __global__ void __launch_bounds__(256) reader(const float* part, const float* ml, const uint4* w, int S, int used,
                                                         int pre, unsigned long long* t, float* sink, int rep, int mode) {
    part += (size_t)(blockIdx.x % rep) * 32 * S * 128;
    const int ks = blockIdx.x / 16, e = threadIdx.x, h = 2 * ks + e / 128, d = e % 128;
    const uint4* wb = w + (size_t)blockIdx.x * 2048;  // 32 KB
    uint4 a = make_uint4(0, 0, 0, 0);
    if (pre) a = ld_stream16(wb + threadIdx.x);
    pdl_wait();
    const unsigned long long t1 = globaltimer_ns();
    pdl_trigger();
    __shared__ float red[256];
    __shared__ float2 mls[2 * 16];
    __shared__ float4 acc4[4][64];
    if (mode == 0) {  // every thread loads its element's partials and all pairs (decode_merge's loads)
        float pv[16], m[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) pv[j] = j < used ? __ldcg(part + ((size_t)h * S + j) * 128 + d) : 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) m[j] = j < used ? __ldcg(ml + ((size_t)h * S + j) * 2) : 0.f;
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) s += pv[j] * exp2f(m[j]);
        red[threadIdx.x] = s;
        __syncthreads();
    } else if (mode == 1) {  // the pairs once per block into shared memory (gemv_merge_span's form)
        float pv[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) pv[j] = j < used ? __ldcg(part + ((size_t)h * S + j) * 128 + d) : 0.f;
        if (e < 2 * used) mls[e] = __ldcg(reinterpret_cast<const float2*>(ml) + (size_t)(2 * ks + e / used) * S + e % used);
        __syncthreads();
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) s += j < used ? pv[j] * exp2f(mls[(e / 128) * used + j].x) : 0.f;
        red[threadIdx.x] = s;
        __syncthreads();
    } else {  // float4: thread (phase p = e / 64, group g = e % 64: 4 elements) takes splits p, p + 4, ..
        const int p = e / 64, g = e % 64, hh = 2 * ks + g / 32, dd = (g % 32) * 4;
        float4 pv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) pv[j] = p + 4 * j < used ? __ldcg(reinterpret_cast<const float4*>(part + ((size_t)hh * S + p + 4 * j) * 128 + dd)) : make_float4(0.f, 0.f, 0.f, 0.f);
        if (e < 2 * used) mls[e] = __ldcg(reinterpret_cast<const float2*>(ml) + (size_t)(2 * ks + e / used) * S + e % used);
        __syncthreads();
        float4 a4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float w = p + 4 * j < used ? exp2f(mls[(g / 32) * used + p + 4 * j].x) : 0.f;
            a4.x += pv[j].x * w; a4.y += pv[j].y * w; a4.z += pv[j].z * w; a4.w += pv[j].w * w;
        }
        acc4[p][g] = a4;
        __syncthreads();
        const float* af = reinterpret_cast<const float*>(&acc4[0][0]);
        red[threadIdx.x] = af[e] + af[256 + e] + af[512 + e] + af[768 + e];
        __syncthreads();
    }
    const unsigned long long t2 = globaltimer_ns();
    unsigned acc = a.x;
    for (int i = threadIdx.x + (pre ? 256 : 0); i < 2048; i += 256) acc ^= ld_stream16(wb + i).y;
    if (acc == 0x9e3779b9u) sink[0] = red[(threadIdx.x + 1) & 255];
    if (threadIdx.x == 0) { t[2 * blockIdx.x] = t1; t[2 * blockIdx.x + 1] = t2; }
}
// FFN-like: 384 blocks x 256 stream `n16` words of w at offset off
extern "C" __global__ void __launch_bounds__(256) filler(const uint4* w, long long off, long long n16, float* sink) {
    pdl_wait();
    pdl_trigger();
    unsigned acc = 0;
    for (long long i = off + blockIdx.x * 256 + threadIdx.x; i < off + n16; i += (long long)gridDim.x * 256) acc ^= ld_stream16(w + i).x;
    if (acc == 0x9e3779b9u) sink[0] = 1.f;
}
'''
MODES = ("all pairs per thread", "pairs in shared memory", "float4, pairs in shared memory")
# (copies of the partials, PDL, filler, weights before the wait): the first is the step's shape
BASE = (1, True, True, True)
VARIANTS = (BASE, (1, True, True, False), (1, True, False, True), (1, False, True, True), (1, False, False, True),
            (16, True, True, True), (16, False, False, True))
S, LAYERS, HEADS, FILL_BYTES = 16, 36, 32, 100 << 20


class Probe:
    def __init__(self, used: int):
        mod = cp.RawModule(code=_SRC + headers_tag(), options=("--std=c++17", f"-I{kernel_dir()}"))
        self.fns = {n: mod.get_function(n) for n in ("writer", "reader", "filler")}
        self.pdl = {n: _PdlKernel(fn) for n, fn in self.fns.items()}
        self.used = used
        self.part = cp.zeros(16 * HEADS * S * 128, cp.float32)  # up to 16 copies
        self.ml = cp.zeros(HEADS * S * 2, cp.float32)
        self.big = cp.zeros(4 << 30, cp.uint8)  # the filler's 4 GiB
        self.wbuf = cp.zeros(256 * 2048 * 4 * LAYERS, cp.uint32)  # each layer's o weights, 8 MB
        self.t = cp.zeros((LAYERS, 512), cp.uint64)
        self.sink = cp.zeros(4, cp.float32)

    def run(self, mode: int, rep: int, pdl: bool, fill: bool, pre: bool) -> tuple[float, float, float]:
        """µs from each reader block's wait to its merge in shared memory (median), from the grid's first
        wait (median), and from the first wait to the last block's merge (median over layers)."""
        k = self.pdl if pdl else self.fns
        span16 = (4 << 30) // 16 - FILL_BYTES // 16
        for _ in range(3):
            for layer in range(LAYERS):
                k["writer"]((128,), (128,), (self.part, self.ml, np.int32(S), np.float32(layer), np.int32(rep)))
                k["reader"]((256,), (256,), (self.part, self.ml, self.wbuf[layer * 256 * 2048 * 4:], np.int32(S),
                                             np.int32(self.used), np.int32(pre), self.t[layer], self.sink,
                                             np.int32(rep), np.int32(mode)))
                if fill:
                    k["filler"]((384,), (256,), (self.big, np.uint64(layer * FILL_BYTES // 16 % span16),
                                                 np.uint64(FILL_BYTES // 16), self.sink))
        cp.cuda.Device().synchronize()
        tv = self.t.get().reshape(LAYERS, 256, 2).astype(np.int64)
        t1, t2 = tv[..., 0], tv[..., 1]
        from_first = (t2 - t1.min(axis=1, keepdims=True)) / 1e3
        return float(np.median((t2 - t1) / 1e3)), float(np.median(from_first)), float(np.median(from_first.max(axis=1)))


@click.command()
@click.argument("used", type=click.IntRange(1, 16), default=8)
@click.option("--variants", is_flag=True, help="Also the all-pairs form without PDL, filler or early weights, "
              "and with 16 copies of the partials (change 153's first table).")
@click.option("--json", "json_out", default=None)
def main(used, variants, json_out):
    probe = Probe(used)
    cases = [(m, *BASE) for m in range(len(MODES))]
    cases += [(0, *v) for v in VARIANTS[1:]] if variants else []
    out = {"gpu": gpu_name(), "used": used, "cases": []}
    for mode, rep, pdl, fill, pre in cases:
        a, b, c = probe.run(mode, rep, pdl, fill, pre)
        out["cases"].append({"form": MODES[mode], "copies": rep, "pdl": pdl, "filler": fill, "weights_before_wait": pre,
                             "merge_us_median": a, "from_first_wait_us_median": b, "last_block_us": c})
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))
    print(f"# {out['gpu']}: o's merge of 2 heads over {used} splits, 256 blocks (µs)")
    print("| merge form | copies of the partials | PDL | filler (100 MB per layer) | weights before wait | "
          "per block (median) | from first wait (median) | from first wait, last block |\n"
          "| --- | ---: | --- | --- | --- | ---: | ---: | ---: |")
    for r in out["cases"]:
        print(f"| {r['form']} | {r['copies']} | {r['pdl']} | {r['filler']} | {r['weights_before_wait']} | "
              f"{r['merge_us_median']:.2f} | {r['from_first_wait_us_median']:.2f} | {r['last_block_us']:.2f} |")


if __name__ == "__main__":
    main()
