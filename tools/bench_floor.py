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

    python tools/bench_floor.py --preset 8b --ctx 512,32768 [--json OUT.json]
"""
import json
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

from bench_kernels import READ_CONFIGS, awq_bytes, read_chain_label, read_chain_launcher, read_chain_us, time_ms  # noqa: E402
from devcopy import copy_bandwidth  # noqa: E402
from kuiper_py.ops_cupy import gpu_name  # noqa: E402
from kuiper_py.synth import MOE_PRESETS, PRESETS, VOCAB  # noqa: E402

STRUCTURES = (5, 4, 3)


def layer_phases(preset: str, ctx: int, structure: int) -> list[tuple[str, int]]:
    """One layer's launches as (name, bytes read), the norm weights with the projection that applies them."""
    if preset in MOE_PRESETS:
        D, _, _, H, KV, hd, _, E, k, mI, _ = MOE_PRESETS[preset]
        up, down, router = k * awq_bytes(D, 2 * mI), k * awq_bytes(mI, D), E * D * 2
    else:
        D, I, _, H, KV, hd, _ = PRESETS[preset]
        up, down, router = awq_bytes(D, 2 * I), awq_bytes(I, D), 0
    qkv = awq_bytes(D, (H + 2 * KV) * hd) + D * 2 + 2 * hd * 2
    attn, o = 2 * ctx * KV * hd * 2, awq_bytes(H * hd, D) + router
    if structure == 5:
        return [("q|k|v", qkv), ("attention", attn), ("o", o), ("gate|up", up + D * 2), ("down", down)]
    if structure == 4:
        return [("q|k|v", qkv), ("attention", attn), ("o", o), ("FFN", up + down + D * 2)]
    return [("q|k|v + attention", qkv + attn), ("o", o), ("FFN", up + down + D * 2)]


def model_dims(preset: str) -> tuple[int, int, bool]:
    p = MOE_PRESETS.get(preset) or PRESETS[preset]
    return p[0], p[2], p[6]  # hidden, layers, tied


def step_floor(preset: str, ctx: int, structure: int, best_cfg: dict) -> dict:
    """The skeleton step's µs (best over the per-size configurations and each uniform one) and its bytes."""
    D, L, _ = model_dims(preset)
    phases = layer_phases(preset, ctx, structure) * L + [("lm_head", VOCAB * D * 2 + D * 2)]
    bufs = [cp.zeros(-(-n // 16) * 4, cp.uint32) for _, n in phases]
    sink = cp.zeros(1, cp.uint32)
    total = sum(n for _, n in phases)
    arms = {"each launch its own best": [best_cfg[n] for _, n in phases]}
    arms.update({f"all {read_chain_label(*c)}": [c] * len(phases) for c in READ_CONFIGS})
    launchers = {c: read_chain_launcher(*c) for c in READ_CONFIGS}
    res = []
    for name, cfgs in arms.items():
        def step(_i, cfgs=cfgs):
            for (_, n), b, c in zip(phases, bufs, cfgs):
                launchers[c](b, n, sink)
        res.append((time_ms(step, iters=3, reps=5) * 1e3, name))
    us, how = min(res)
    return {"us": us, "bytes": total, "launches": len(phases), "config": how}


@click.command()
@click.option("--preset", "presets", default="8b", show_default=True,
              help="Comma-separated synth presets (8b, 30b-a3b, ...): the shapes, no file needed.")
@click.option("--ctx", default="512,2048", show_default=True, help="Comma-separated keys in the cache.")
@click.option("--structures", default="5,4,3", show_default=True)
@click.option("--json", "json_out", default=None)
def main(presets, ctx, structures, json_out):
    ctxs = [int(c) for c in ctx.split(",")]
    structs = [int(s) for s in structures.split(",")]
    for p in presets.split(","):
        if p not in PRESETS and p not in MOE_PRESETS:
            raise click.BadParameter(f"unknown preset {p!r}", param_hint="--preset")
    if any(s not in STRUCTURES for s in structs):
        raise click.BadParameter(f"structures are {STRUCTURES}", param_hint="--structures")
    l2 = cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]
    copies = copy_bandwidth()
    out = {"gpu": gpu_name(), "copy_GBps": copies["best"], "copy_detail_GBps": copies, "launch_best": {}, "steps": []}
    for p in presets.split(","):
        sizes = sorted({n for c in ctxs for s in structs for _, n in layer_phases(p, c, s)}
                       | {VOCAB * model_dims(p)[0] * 2 + model_dims(p)[0] * 2})
        best_cfg = {}
        for n in sizes:  # each byte count alone, back to back over rotated copies (> 6x L2)
            us, cfg = read_chain_us(n, max(2, -(-6 * l2 // n)))
            best_cfg[n] = cfg
            out["launch_best"].setdefault(p, []).append({"bytes": n, "us": us, "config": read_chain_label(*cfg),
                                                         "ratio_to_copy": n / us / 1e3 / copies["best"]})
            cp.get_default_memory_pool().free_all_blocks()
        for c in ctxs:
            for s in structs:
                r = step_floor(p, c, s, best_cfg)
                cp.get_default_memory_pool().free_all_blocks()
                r.update(preset=p, context=c, structure=s, tok_s=1e6 / r["us"],
                         ratio_to_copy=r["bytes"] / r["us"] / 1e3 / copies["best"])
                out["steps"].append(r)
                print(f"# {p} at {c} keys, {s} launches per layer: {r['us']:.1f} µs ({r['config']})", file=sys.stderr)
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
