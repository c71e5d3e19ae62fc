"""`kuiper bench`: llama-bench style ppN / tgN rows over the shared generation core."""
from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timezone

import numpy as np

from . import format as fmt
from .generate import Engine, generate, log
from .sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


def _run_once(eng: Engine, prompt: list[int], n_gen: int) -> tuple[float, int]:
    """(seconds, tokens) of the timed part: the prefill for pp, the decode steps for tg."""
    last = None
    for last in generate(eng, prompt, n_gen, GREEDY, eos_ids=[], max_context=len(prompt) + n_gen):
        pass
    if n_gen == 0:
        return last.prompt_seconds, last.prompt_tokens
    return last.gen_seconds, last.decode_steps


def run_bench(model: str, n_prompt: list[int], n_gen: list[int], reps: int, device: str) -> list[dict]:
    eng = Engine.load(model, device, need_tokenizer=False)
    eng.session(max([p for p in n_prompt if p > 0] + [n + 1 for n in n_gen if n > 0] + [1]))
    log(f"loaded {model} in {eng.load_seconds:.2f} s on {eng.device} (map, upload, kernels)")
    rng = np.random.default_rng(0)
    V = eng.file.args.vocab_size
    tests = [(p, 0) for p in n_prompt if p > 0] + [(1, n) for n in n_gen if n > 0]
    rows = []
    for p, n in tests:
        name = f"pp{p}" if n == 0 else f"tg{n}"
        samples = []
        # the first run warms up (kernel compilation, caches) and is dropped; on the GPU a prompt test drops two: the
        # second prompt of a length bucket captures its prefill graph, which the later ones replay
        warm = 2 if n == 0 and p > 1 and eng.device == "cuda" else 1
        for rep in range(reps + warm):
            prompt = rng.integers(0, min(V, 151643), size=p).tolist()
            secs, toks = _run_once(eng, prompt, n + (1 if n else 0))
            if rep >= warm:
                samples.append((secs, toks))
        ns = np.array([s * 1e9 for s, _ in samples])
        ts = np.array([t / s for s, t in samples])
        row = {
            "backends": "CUDA" if eng.device == "cuda" else "CPU", "model_filename": str(model),
            "model_type": model_label(eng.file.args),
            "model_size": eng.file.size, "model_n_params": fmt.n_params(eng.file.header),
            "n_prompt": p if n == 0 else 0, "n_gen": n, "test": name,
            "test_time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "avg_ns": int(ns.mean()), "stddev_ns": int(ns.std(ddof=1)) if len(ns) > 1 else 0,
            "avg_ts": float(ts.mean()), "stddev_ts": float(ts.std(ddof=1)) if len(ts) > 1 else 0.0,
            "samples_ns": [int(x) for x in ns], "samples_ts": [float(x) for x in ts],
        }
        if eng.device == "cuda":
            from .ops_cupy import gpu_memory_used_mib, gpu_name
            row["gpu_info"] = gpu_name()
            row["gpu_mem_mib"] = round(gpu_memory_used_mib(), 1)
        rows.append(row)
        log(f"{name}: {row['avg_ts']:.2f} ± {row['stddev_ts']:.2f} tok/s")
    if eng.device == "cuda" and rows:
        log(f"GPU memory in use: {rows[-1]['gpu_mem_mib']:.0f} MiB (file {eng.file.size / 2**20:.0f} MiB)")
    return rows


def model_label(a) -> str:
    """The table's model column: architecture, layers, width and, for Qwen3-MoE, experts x experts per token."""
    moe = f" {a.num_experts}x{a.num_experts_per_tok} experts" if a.num_experts else ""
    return f"qwen3{'moe' if a.num_experts else ''} {a.num_hidden_layers}L d{a.hidden_size}{moe} AWQ-4bit"


def render(rows: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        keys = [k for k in rows[0] if not k.startswith("samples")] if rows else []
        w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue().rstrip("\n")
    lines = ["| model | size | params | backend | test | t/s |", "| --- | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model_type']} | {r['model_size'] / 2**30:.2f} GiB | {r['model_n_params'] / 1e9:.2f} B | "
                     f"{r['backends']} | {r['test']} | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} |")
    return "\n".join(lines)
