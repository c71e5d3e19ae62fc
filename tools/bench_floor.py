#!/usr/bin/env python3
"""The decode step's floor (device machine): what batch-1 decode could reach if every kernel of the step did
nothing but read its bytes. The step is rebuilt as its chain of dependent launches, each a read-only kernel
(bench_kernels.read_chain: PDL wait for the launch before, then stream the bytes with 16-byte no-allocate
loads) over that launch's real byte count, every layer with its own buffers (so DRAM, not L2), captured in
one CUDA graph and replayed. Its effective bandwidth, as a ratio to the same-run copy, bounds what any engine
of that launch structure can report in bench_e2e: the ramp, drain and hand-off of each launch are in it, the
arithmetic, reductions and cross-block exchanges are not.

Structures (launches per layer):
  5  q|k|v, attention, o (+ router), gate|up, down     (the H200's 8B plan, separate FFN GEMVs)
  4  q|k|v, attention, o (+ router), FFN in one launch (the engine's default; MoE: the selected experts)
  3  q|k|v with attention, o (+ router), FFN           (a layer's device-wide dependencies: attention needs
     only its own heads' q|k|v columns, but o needs every head, the FFN every output of o, and the next
     layer's q|k|v every output of down)
  4r, 3r (MoE models) as 4 and 3, with the FFN launch routed: which experts it reads is known only from
     the router's logits, which the launch before it wrote. Each block reads the E logits through L2 after
     its wait and ranks them with the engine's own top-k (common.cuh moe_topk_pick, as moe_ffn_decode
     does), then streams the k picked experts' bytes from a pool of all E experts per layer. The plain
     structures stream fixed buffers from the wait on, a dependency no MoE engine can skip.

    python tools/bench_floor.py --preset 8b --ctx 512,32768 [--json OUT.json]
    python tools/bench_floor.py --preset 30b-a3b --ctx 512 --structures 4,4r,3,3r
"""
import json
import sys
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

from bench_kernels import READ_CONFIGS, awq_bytes, read_chain_label, read_chain_launcher, read_chain_us, time_ms  # noqa: E402
from devcopy import copy_bandwidth  # noqa: E402
from kuiper_py.ops_cupy import _pdl_attr, gpu_name, headers_tag, kernel_dir, launch_ex, pdl_enabled, sm_count  # noqa: E402
from kuiper_py.synth import MOE_PRESETS, PRESETS, VOCAB  # noqa: E402

STRUCTURES = ("5", "4", "3", "4r", "3r")
ROUTED_PER_SM = (1, 2, 4, 8)  # the routed launch's grid sizes tried (it reads nothing before its wait)

# The routed FFN launch: wait for the launch before (whose output the logits are), let the next one start,
# then warp 0 of every block reads the E logits through L2 and picks k of them with the engine's top-k,
# and the block streams its grid-stride share of the k picked experts ([pe] 16-byte words each, expert e
# at pool + e pe), 4 loads in flight per thread as read_chain.
_ROUTED = r'''
#include "common.cuh"
extern "C" __global__ void read_routed(const uint4* __restrict__ pool, long long pe,  // [E][pe] words
                            const float* __restrict__ logits, int E, int k,  // [E]
                            unsigned* __restrict__ sink) {
    __shared__ long long base[32];  // [k] word offset of each picked expert
    pdl_wait();
    pdl_trigger();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float p[MOE_MAX_E / 32];
#pragma unroll
        for (int j = 0; j < MOE_MAX_E / 32; ++j) p[j] = lane + 32 * j < E ? __ldcg(logits + lane + 32 * j) : -INFINITY;
        int id = 0;
        float v = 0.f;
        moe_topk_pick(p, k, -INFINITY, id, v);
        if (lane < k) base[lane] = (long long)id * pe;
    }
    __syncthreads();
    const long long n = (long long)k * pe, stride = (long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    uint4 w[4];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const long long x = i + j * stride;
            const int s = x < n ? (int)(x / pe) : 0;
            w[j] = x < n ? ld_stream16(pool + base[s] + (x - s * pe)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) acc ^= w[j].x ^ w[j].y ^ w[j].z ^ w[j].w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; practically never taken
}'''
_ROUTED_FN = None


def routed_launcher(per_sm: int):
    """launch(pool, pe_words, logits, E, k, sink): one read_routed launch under PDL."""
    global _ROUTED_FN
    if _ROUTED_FN is None:
        mod = cp.RawModule(code=_ROUTED + headers_tag(), options=("-std=c++17", f"-I{kernel_dir()}"))
        _ROUTED_FN = mod.get_function("read_routed")
    grid, attr = (sm_count() * per_sm,), _pdl_attr() if pdl_enabled() else None
    return lambda pool, pe, logits, E, k, sink: launch_ex(  # (pe as 8 bytes: the kernel's long long)
        _ROUTED_FN, grid, (256,), (pool, np.uint64(pe), logits, np.int32(E), np.int32(k), sink), 0, attr)


def expert_bytes(preset: str) -> int:
    """One expert's gate|up and down, as the routed launch reads them (a whole number of 16-byte words)."""
    D, _, _, _, _, _, _, _, _, mI, _ = MOE_PRESETS[preset]
    return -(-(awq_bytes(D, 2 * mI) + awq_bytes(mI, D)) // 16) * 16


def layer_phases(preset: str, ctx: int, structure: str) -> list[tuple[str, int]]:
    """One layer's launches as (name, bytes read), the norm weights with the projection that applies them.
    A routed structure's FFN is named "FFN routed" and counts the k experts' bytes only (the norm weight's
    D x 2 bytes are not read by it)."""
    if structure.endswith("r"):
        ph = layer_phases(preset, ctx, structure[:-1])
        return ph[:-1] + [("FFN routed", MOE_PRESETS[preset][8] * expert_bytes(preset))]
    if preset in MOE_PRESETS:
        D, _, _, H, KV, hd, _, E, k, mI, _ = MOE_PRESETS[preset]
        up, down, router = k * awq_bytes(D, 2 * mI), k * awq_bytes(mI, D), E * D * 2
    else:
        D, I, _, H, KV, hd, _ = PRESETS[preset]
        up, down, router = awq_bytes(D, 2 * I), awq_bytes(I, D), 0
    qkv = awq_bytes(D, (H + 2 * KV) * hd) + D * 2 + 2 * hd * 2
    attn, o = 2 * ctx * KV * hd * 2, awq_bytes(H * hd, D) + router
    if structure == "5":
        return [("q|k|v", qkv), ("attention", attn), ("o", o), ("gate|up", up + D * 2), ("down", down)]
    if structure == "4":
        return [("q|k|v", qkv), ("attention", attn), ("o", o), ("FFN", up + down + D * 2)]
    return [("q|k|v + attention", qkv + attn), ("o", o), ("FFN", up + down + D * 2)]


def model_dims(preset: str) -> tuple[int, int, bool]:
    p = MOE_PRESETS.get(preset) or PRESETS[preset]
    return p[0], p[2], p[6]  # hidden, layers, tied


def expert_pools(preset: str) -> list[tuple]:
    """Per layer, (all E experts' bytes [E][pe] as uint32 words x 4, the router's logits [E]): fresh random logits,
    so every layer picks its own k experts (distinct DRAM for every layer)."""
    _, L, _ = model_dims(preset)
    E = MOE_PRESETS[preset][7]
    pe = expert_bytes(preset) // 16
    return [(cp.zeros(E * pe * 4, cp.uint32), cp.random.standard_normal(E, dtype=cp.float32)) for _ in range(L)]


def step_floor(preset: str, ctx: int, structure: str, best_cfg: dict, pools=None) -> dict:
    """The skeleton step's µs (best over the per-size configurations and each uniform one) and its bytes.
    A routed structure's FFN launches read its layer's `pools` entry (expert_pools) at every grid size of
    ROUTED_PER_SM."""
    D, L, _ = model_dims(preset)
    layer = layer_phases(preset, ctx, structure)
    phases = layer * L + [("lm_head", VOCAB * D * 2 + D * 2)]
    routed = [name == "FFN routed" for name, _ in phases]
    # what each launch reads: its own buffer, or a routed FFN's layer pool and logits
    bufs = [pools[li] if name == "FFN routed" else cp.zeros(-(-n // 16) * 4, cp.uint32)
            for li in range(L) for name, n in layer] + [cp.zeros(-(-phases[-1][1] // 16) * 4, cp.uint32)]
    sink = cp.zeros(1, cp.uint32)
    total = sum(n for _, n in phases)
    launchers = {c: read_chain_launcher(*c) for c in READ_CONFIGS}
    if any(routed):
        E, k, pe = MOE_PRESETS[preset][7], MOE_PRESETS[preset][8], expert_bytes(preset) // 16
        rl = {r: routed_launcher(r) for r in ROUTED_PER_SM}
    res = []
    for rps in ROUTED_PER_SM if any(routed) else (None,):
        suffix = f"; routed launches {rps} blocks per SM" if rps else ""
        arms = {"each launch its own best" + suffix: [best_cfg.get(n) for _, n in phases]}
        arms.update({f"all {read_chain_label(*c)}{suffix}": [c] * len(phases) for c in READ_CONFIGS})
        for name, cfgs in arms.items():
            def step(_i, cfgs=cfgs, rps=rps):
                for (_, n), b, c, r in zip(phases, bufs, cfgs, routed):
                    if r:
                        rl[rps](b[0], pe, b[1], E, k, sink)
                    else:
                        launchers[c](b, n, sink)
            res.append((time_ms(step, iters=3, reps=5) * 1e3, name))
    us, how = min(res)
    return {"us": us, "bytes": total, "launches": len(phases), "config": how,
            "arms": [{"us": t, "config": name} for t, name in sorted(res)]}


@click.command()
@click.option("--preset", "presets", default="8b", show_default=True,
              help="Comma-separated synth presets (8b, 30b-a3b, ...): the shapes, no file needed.")
@click.option("--ctx", default="512,2048", show_default=True, help="Comma-separated keys in the cache.")
@click.option("--structures", default="5,4,3", show_default=True)
@click.option("--json", "json_out", default=None)
def main(presets, ctx, structures, json_out):
    ctxs = [int(c) for c in ctx.split(",")]
    structs = structures.split(",")
    for p in presets.split(","):
        if p not in PRESETS and p not in MOE_PRESETS:
            raise click.BadParameter(f"unknown preset {p!r}", param_hint="--preset")
        if p not in MOE_PRESETS and any(s.endswith("r") for s in structs):
            raise click.BadParameter(f"routed structures need a MoE preset, not {p!r}", param_hint="--structures")
    if any(s not in STRUCTURES for s in structs):
        raise click.BadParameter(f"structures are {', '.join(STRUCTURES)}", param_hint="--structures")
    l2 = cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]
    copies = copy_bandwidth()
    out = {"gpu": gpu_name(), "copy_GBps": copies["best"], "copy_detail_GBps": copies, "launch_best": {}, "steps": []}
    for p in presets.split(","):
        sizes = sorted({n for c in ctxs for s in structs for name, n in layer_phases(p, c, s) if name != "FFN routed"}
                       | {VOCAB * model_dims(p)[0] * 2 + model_dims(p)[0] * 2})
        pools = expert_pools(p) if any(s.endswith("r") for s in structs) else None
        best_cfg = {}
        for n in sizes:  # each byte count alone, back to back over rotated copies (> 6x L2)
            us, cfg = read_chain_us(n, max(2, -(-6 * l2 // n)))
            best_cfg[n] = cfg
            out["launch_best"].setdefault(p, []).append({"bytes": n, "us": us, "config": read_chain_label(*cfg),
                                                         "ratio_to_copy": n / us / 1e3 / copies["best"]})
            cp.get_default_memory_pool().free_all_blocks()
        for c in ctxs:
            for s in structs:
                r = step_floor(p, c, s, best_cfg, pools)
                cp.get_default_memory_pool().free_all_blocks()
                r.update(preset=p, context=c, structure=s, tok_s=1e6 / r["us"],
                         ratio_to_copy=r["bytes"] / r["us"] / 1e3 / copies["best"])
                out["steps"].append(r)
                print(f"# {p} at {c} keys, {s} launches per layer: {r['us']:.1f} µs ({r['config']})", file=sys.stderr)
        del pools
        cp.get_default_memory_pool().free_all_blocks()
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))
    print(f"# {out['gpu']}: device copy {copies['best']:.0f} GB/s; read-only skeleton of the decode step")
    print("| model | keys | launches per layer | MB per step | floor µs | floor tok/s | floor / copy |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in out["steps"]:
        print(f"| {r['preset']} | {r['context']} | {r['structure']} | {r['bytes'] / 1e6:.0f} | {r['us']:.1f} | "
              f"{r['tok_s']:.1f} | {r['ratio_to_copy']:.2f} |")


if __name__ == "__main__":
    main()
