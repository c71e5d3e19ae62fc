#!/usr/bin/env python3
"""Kernel benchmark (device machine): decode GEMV bandwidth vs a same-run device copy, prefill GEMM
throughput vs cuBLAS FP16 (cupy.matmul), at the Qwen3-8B projection shapes. Weight copies are
rotated so their total is several times the L2 cache: these are DRAM numbers.

The decode table has three parts: each shape through the standalone split-K GEMV (its reduction tail
included); the forms the engine's decode step runs (q|k|v and o adding their sums in fixed point with no
reduction tail, gate/up and down as the one-launch FFN kernel), each launched back to back as in the step
(PDL, first weights ahead of the wait); and, for each byte count, a read-only kernel in the same dependent
chain (wait for the previous launch, then stream the bytes): what a kernel of that size can reach at all.

    python tools/bench_kernels.py [--json OUT.json] [--only gemv|gemm] [--rows 128,256] [--shapes 2048x5120,4096x2048]

--only runs one of the two tables; --rows times the prefill GEMMs at those rows only, --shapes at those K x N shapes.
"""
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from kuiper_py.config import ModelArgs  # noqa: E402
from kuiper_py.loader import AwqLinear, AwqStack  # noqa: E402
from kuiper_py.ops_cupy import (_AttnParts, _Normed, awq_dequant, copy_bandwidth, decode_ffn,  # noqa: E402
                                decode_ffn_plan, gemm, gemm_path, gemv, gpu_name, headers_tag, kernel_dir, launch_ex,
                                lm_head, moe_gate_up_views, pdl_attr, pdl_enabled, sm_count, wgmma_available,
                                wgmma_fits)

DEC = {"qkv 4096->6144": [(4096, 4096), (4096, 1024), (4096, 1024)], "o 4096->4096": [(4096, 4096)],
       "gate/up 4096->2x12288": [(4096, 12288), (4096, 12288)], "down 12288->4096": [(12288, 4096)]}
PRE = {"qkv 4096->6144": (4096, 6144), "o 4096->4096": (4096, 4096), "gate 4096->12288": (4096, 12288),
       "gate|up 4096->24576": (4096, 24576),
       "down 12288->4096": (12288, 4096)}
BENCH_M = (4, 16, 128, 256, 512, 2048)


def time_ms(fn, iters=50, reps=5):
    """Median ms per call. The calls are captured into one CUDA graph and the replays are timed, so
    Python's launch cost stays out and the number is GPU time; falls back to eager launches when a
    call cannot be captured."""
    fn(0)
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    graph = None
    try:
        with s:
            s.begin_capture()
            try:
                for i in range(iters):
                    fn(i)
            finally:
                graph = s.end_capture()
    except Exception:  # noqa: BLE001 - e.g. a library call that refuses capture
        graph = None
    out = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        if graph is not None:
            graph.launch(s)
            a.record(s)
            graph.launch(s)
            b.record(s)
        else:
            a.record()
            for i in range(iters):
                fn(i)
            b.record()
        b.synchronize()
        out.append(cp.cuda.get_elapsed_time(a, b) / iters)
    return float(np.median(out))


# A read-only stream in the decode chain's dependence: under PDL it waits for the launch before it (as every
# decode kernel must for its input), lets the next one start, then reads n 16-byte words (4 in flight per
# thread, by the GEMVs' own weight load, common.cuh ld_stream16). PRE words per thread go out before the wait
# (the GEMVs' first step does the same with weights), the rest after.
_READ = r'''
#include "common.cuh"
template <int PRE>
__global__ void read_chain(const uint4* __restrict__ a, long long n, unsigned* __restrict__ sink) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    unsigned acc = 0;
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < PRE; ++j) v[j] = i + j * stride < n ? ld_stream16(a + i + j * stride) : make_uint4(0, 0, 0, 0);
    pdl_wait();
    pdl_trigger();
#pragma unroll
    for (int j = 0; j < PRE; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    for (i += PRE * stride; i < n; i += 4 * stride) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            v[j] = i + j * stride < n ? ld_stream16(a + i + j * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; practically never taken
}'''
_READ_MOD = None


READ_CONFIGS = [(pre, per_sm) for pre in (0, 1, 4) for per_sm in (2, 4, 8)]  # words ahead of the wait, blocks per SM


def read_chain_launcher(pre: int, per_sm: int):
    """launch(buf, nbytes, sink): one read_chain launch under PDL with this configuration."""
    global _READ_MOD
    if _READ_MOD is None:
        _READ_MOD = cp.RawModule(code=_READ + headers_tag(), options=("-std=c++17", f"-I{kernel_dir()}"),
                                 name_expressions=[f"read_chain<{p}>" for p in (0, 1, 4)])
    fn = _READ_MOD.get_function(f"read_chain<{pre}>")
    grid, attr = (sm_count() * per_sm,), pdl_attr() if pdl_enabled() else None
    return lambda buf, nbytes, sink: launch_ex(fn, grid, (256,), (buf, np.uint64(nbytes // 16), sink), 0, attr)


def read_chain_label(pre: int, per_sm: int) -> str:
    return f"{per_sm} blocks per SM, {pre} word{'s' * (pre != 1)} ahead of the wait"


def read_chain_us(nbytes: int, copies: int) -> tuple[float, tuple[int, int]]:
    """Best µs per launch of read_chain over `copies` rotated buffers of nbytes each, over grid sizes and the
    words read before the wait, and the configuration (pre, per_sm) that gave it (read_chain_label names it)."""
    bufs = [cp.zeros(nbytes // 16 * 4, cp.uint32) for _ in range(copies)]
    sink = cp.zeros(1, cp.uint32)
    best = (float("inf"), (0, 0))
    for cfg in READ_CONFIGS:
        launch = read_chain_launcher(*cfg)
        t = time_ms(lambda i: launch(bufs[i % copies], nbytes, sink))
        best = min(best, (t * 1e3, cfg))
    return best


def awq_bytes(K, N):
    """The bytes a [K, N] AWQ matrix streams: 4-bit weights, 4-bit zeros and fp16 scales per 128-row group."""
    return K * N // 2 + (K // 128) * N // 2 + (K // 128) * N * 2


def decode_row(shape, form, us, nbytes, copy_bw, copies=None):
    """One row of the decode table: nbytes read in us µs, as GB/s and a ratio to the copy bandwidth."""
    bw = nbytes / us / 1e3
    row = {"shape": shape, "form": form, "us": us, "GBps": bw, "ratio_to_copy": bw / copy_bw, "weight_bytes": nbytes}
    if copies is not None:
        row["rotated_copies"] = copies
    return row


def rand_awq(K, N):
    qw = cp.random.randint(-2**31, 2**31 - 1, size=(K, N // 8), dtype=cp.int64).astype(cp.int32)
    qz = cp.random.randint(-2**31, 2**31 - 1, size=(K // 128, N // 8), dtype=cp.int64).astype(cp.int32)
    sc = (cp.random.random((K // 128, N), dtype=cp.float32) * 1e-3).astype(cp.float16)
    return AwqLinear(qw, qz, sc, 128)


def main(only: str | None, rows: tuple[int, ...], shapes: dict | None):
    out = {"gpu": gpu_name(), "decode": [], "prefill": []}
    pre = shapes or PRE
    l2 = cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]
    copy_res = copy_bandwidth()
    copy_bw = copy_res["best"]  # GB/s, read + write
    out["copy_GBps"], out["copy_detail_GBps"] = copy_bw, copy_res
    if only != "gemm":
        partial = cp.empty((1 << 23,), cp.float32)
        for name, mats in DEC.items():
            per = sum(awq_bytes(K, N) for K, N in mats)
            copies = max(2, math.ceil(6 * l2 / per))
            sets = [[rand_awq(K, N) for K, N in mats] for _ in range(copies)]
            K = mats[0][0]
            x = (cp.random.standard_normal((1, K)) * 0.1).astype(cp.float16)
            nout = sum(N for _, N in mats) if "gate" not in name else mats[0][1]
            o = cp.empty((1, nout), cp.float16)
            kind = "swiglu" if "gate" in name else "plain"
            t = time_ms(lambda i: gemv(x, sets[i % copies], kind, o, partial))
            out["decode"].append(decode_row(name, "split-K GEMV", t * 1e3, per, copy_bw, copies))
            if "gate" not in name:  # q|k|v and o as decode runs them: fixed-point sums, no reduction tail
                acc = cp.zeros((nout,), cp.int64)
                t = time_ms(lambda i: gemv(x, sets[i % copies], "plain", None, partial, acc_out=acc))
                out["decode"].append(decode_row(name, "decode (accumulating)", t * 1e3, per, copy_bw, copies))
            if name.startswith("o "):  # as decode runs o at 512 keys: merging flash decoding's 8 splits first
                H, hd, S = 32, 128, 8
                part_o = cp.random.standard_normal(H * S * hd, dtype=cp.float32)
                ml = cp.stack([cp.random.standard_normal(H * S, dtype=cp.float32),
                               cp.random.random(H * S, dtype=cp.float32) * 64 + 1], axis=1).ravel()
                att = _AttnParts(part_o, ml, S, H, hd, 512, None, 64)
                t = time_ms(lambda i: gemv(None, sets[i % copies], "plain", None, partial, att=att, acc_out=acc))
                out["decode"].append(decode_row(name, "decode (accumulating, merging 8 attention splits)", t * 1e3,
                                                per, copy_bw, copies))
            sets = None
        # gate/up and down as decode runs them: one launch (ffn_decode.cu), the plan the engine takes for 8B
        D, I = 4096, 12288
        plan, why = decode_ffn_plan(ModelArgs(hidden_size=D, intermediate_size=I, num_hidden_layers=36,
                                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                              vocab_size=151936, max_position_embeddings=40960,
                                              tie_word_embeddings=False))
        mats = [(D, I), (D, I), (I, D)]
        per = sum(awq_bytes(K, N) for K, N in mats)
        if plan is not None:
            copies = max(2, math.ceil(6 * l2 / per))
            layers = [SimpleNamespace(**dict(zip(("w1", "w3", "w2"), (rand_awq(K, N) for K, N in mats))))
                      for _ in range(copies)]
            xn = _Normed(cp.random.standard_normal(D, dtype=cp.float32), (cp.random.random(D) + 0.5).astype(cp.float16))
            acc = cp.zeros((D,), cp.int64)
            t = time_ms(lambda i: decode_ffn(plan, xn, layers[i % copies], acc, 1e-6))
            form = "one-launch FFN, " + ("global exchange" if "xslots" in plan else f"clusters of {plan['CL']}")
            out["decode"].append(decode_row("gate/up + down 4096->2x12288->4096", form, t * 1e3, per, copy_bw, copies))
            layers = None
        else:
            print(f"# one-launch FFN not run: {why}", file=sys.stderr)
        V, D = 151936, 4096
        W = [(cp.random.standard_normal((V, D), dtype=cp.float32) * 0.02).astype(cp.float16) for _ in range(2)]
        x = cp.random.standard_normal(D, dtype=cp.float32).astype(cp.float16)
        lo = cp.empty(V, cp.float32)
        t = time_ms(lambda i: lm_head(x, W[i % 2], lo))
        out["decode"].append(decode_row("lm_head 4096->151936 (fp16)", "lm_head GEMV", t * 1e3, V * D * 2, copy_bw, 2))
        W = None
        # Qwen3-30B-A3B decode: the 8 selected experts of one layer (of 128) in one launch each
        E, k, D3, I3 = 128, 8, 2048, 768
        for name, K, N in (("30B-A3B experts gate|up 8x(2048->2x768)", D3, 2 * I3), ("30B-A3B experts down 8x(768->2048)", I3, D3)):
            per_exp = awq_bytes(K, N)
            copies = max(2, math.ceil(6 * l2 / (per_exp * E)))
            stacks = []
            for _ in range(copies):
                qw = cp.random.randint(-2**31, 2**31 - 1, size=(E, K, N // 8), dtype=cp.int64).astype(cp.int32)
                qz = cp.random.randint(-2**31, 2**31 - 1, size=(E, K // 128, N // 8), dtype=cp.int64).astype(cp.int32)
                sc = (cp.random.random((E, K // 128, N), dtype=cp.float32) * 1e-3).astype(cp.float16)
                stacks.append(AwqStack(qw, qz, sc, 128))
            ids = cp.asarray(np.random.default_rng(0).choice(E, k, replace=False).astype(np.int32))
            w = cp.full((k,), 1.0 / k, cp.float32)
            if N == 2 * I3:
                x = (cp.random.standard_normal((1, K)) * 0.1).astype(cp.float16)
                o = cp.empty((k, I3), cp.float16)

                def run(i):
                    gemv(x, list(moe_gate_up_views(stacks[i % copies])), "swiglu", o, partial, ids=ids, ld=N)
            else:
                x = (cp.random.standard_normal((k, K)) * 0.1).astype(cp.float16)
                o = cp.empty((1, N), cp.float16)

                def run(i):
                    gemv(x, [stacks[i % copies].expert(0)], "moe_sum", o, partial, ids=ids, slot_w=w, x_slot_stride=K,
                         ids_early=True)  # as decode calls it (ids_early: written long before)
            t = time_ms(run)
            out["decode"].append(decode_row(name, "expert GEMV", t * 1e3, k * per_exp, copy_bw, copies))
        stacks = None
        # the same byte counts through a read-only kernel in the same dependent chain
        for name, nbytes in {r["shape"]: r["weight_bytes"] for r in out["decode"]}.items():
            us, cfg = read_chain_us(nbytes, max(2, math.ceil(6 * l2 / nbytes)))
            out["decode"].append(decode_row(name, f"read-only ({read_chain_label(*cfg)})", us, nbytes, copy_bw))
    for name, (K, N) in (pre.items() if only != "gemv" else ()):
        # weights rotated over > 6x L2 on both sides, as for the GEMV: each layer's weights come from DRAM
        nq, nf = max(2, math.ceil(6 * l2 / (K * N // 2))), max(2, math.ceil(6 * l2 / (K * N * 2)))
        ms = [rand_awq(K, N) for _ in range(nq)]
        Wf = [(cp.random.standard_normal((K, N), dtype=cp.float32) * 0.02).astype(cp.float16) for _ in range(nf)]
        t_dq = time_ms(lambda i: awq_dequant(ms[i % nq]), iters=20)  # the dequant path's first half alone
        for M in rows:
            a = cp.random.standard_normal((M, K), dtype=cp.float32).astype(cp.float16)
            c = cp.empty((M, N), cp.float16)
            t_mma = time_ms(lambda i: gemm(a, ms[i % nq], c, path="mma"), iters=20)
            t_deq = time_ms(lambda i: gemm(a, ms[i % nq], c, path="dequant"), iters=20)
            t_cublas = time_ms(lambda i: cp.matmul(a, Wf[i % nf], out=c), iters=20)
            hopper = wgmma_available() and wgmma_fits((ms[0],))  # the fused Hopper kernels
            t_wg = time_ms(lambda i: gemm(a, ms[i % nq], c, path="wgmma"), iters=20) if hopper else None
            t_rs = time_ms(lambda i: gemm(a, ms[i % nq], c, path="rs"), iters=20) if hopper else None
            path = gemm_path(M, (ms[0],))
            t_ours = {"dequant": t_deq, "mma": t_mma, "wgmma": t_wg, "rs": t_rs}[path]
            fl = 2 * M * K * N
            out["prefill"].append({"shape": name, "M": M, "path": path, "ours_TFLOPs": fl / t_ours / 1e9,
                                   "mma_TFLOPs": fl / t_mma / 1e9, "dequant_cublas_TFLOPs": fl / t_deq / 1e9,
                                   "wgmma_TFLOPs": fl / t_wg / 1e9 if t_wg else None,
                                   "rs_TFLOPs": fl / t_rs / 1e9 if t_rs else None,
                                   "cublas_TFLOPs": fl / t_cublas / 1e9, "ratio": t_cublas / t_ours,
                                   "dequant_us": t_dq * 1e3, "dequant_GBps": K * N * 2.5 / t_dq / 1e6,
                                   "rotated_copies": [nq, nf]})
        ms = Wf = None
    print(f"# {out['gpu']}: device copy {copy_bw:.0f} GB/s (read + write; memcpy {copy_res['memcpy']:.0f}, kernel {copy_res['kernel']:.0f})")
    print("| decode shape | form | MB | us | GB/s | / copy |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for r in out["decode"]:
        print(f"| {r['shape']} | {r['form']} | {r['weight_bytes'] / 1e6:.1f} | {r['us']:.1f} | {r['GBps']:.0f} | "
              f"{r['ratio_to_copy']:.2f} |")
    print("| prefill GEMM | M | path taken | MMA TFLOP/s | wgmma TFLOP/s | rs TFLOP/s | dequant+cuBLAS TFLOP/s | "
          "cuBLAS fp16 TFLOP/s | ours / cuBLAS | dequant alone µs (GB/s) |\n"
          "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in out["prefill"]:
        wg, rs = (f"{r[k]:.1f}" if r[k] else "-" for k in ("wgmma_TFLOPs", "rs_TFLOPs"))
        print(f"| {r['shape']} | {r['M']} | {r['path']} | {r['mma_TFLOPs']:.1f} | {wg} | {rs} | {r['dequant_cublas_TFLOPs']:.1f} | "
              f"{r['cublas_TFLOPs']:.1f} | {r['ratio']:.2f} | {r['dequant_us']:.1f} ({r['dequant_GBps']:.0f}) |")
    return out


@click.command()
@click.option("--json", "json_out", default=None, help="write the tables as JSON here too")
@click.option("--only", type=click.Choice(["gemv", "gemm"]), default=None, help="run one of the two tables")
@click.option("--rows", default=",".join(map(str, BENCH_M)), help="prefill GEMM rows (M), comma-separated")
@click.option("--shapes", default=None, help="prefill GEMM shapes KxN,KxN instead of the Qwen3-8B ones")
def cli(json_out, only, rows, shapes):
    shapes = {f"{k}->{n}": (int(k), int(n)) for k, n in (v.split("x") for v in shapes.split(","))} if shapes else None
    out = main(only, tuple(int(v) for v in rows.split(",")), shapes)
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    cli()
