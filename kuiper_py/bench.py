"""`kuiper bench`: llama-bench style ppN / tgN rows over the shared generation core."""
from __future__ import annotations

import csv
import io
import json
import time
from datetime import datetime, timezone
from typing import Callable, Iterator

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


DEPTH_CHUNK = 512  # prompt tokens a sequence prefills per step for a batch tg row's depth (untimed; bounds a step)


def tg_positions(n: int, depth: int) -> int:
    """Positions a tgN test at depth D asks for: its prompt (D tokens, at least 1) and the N + 1 tokens it draws (the
    first comes with the prompt's logits; the timed N decode steps feed back N)."""
    return max(depth, 1) + n + 1


def load_engine(model: str, n_prompt: list[int], n_gen: list[int], device: str, tp: int = 1,
                depths: list[int] = (0,)) -> Engine:
    """The engine (tp ranks), with a cache sized for the longest test."""
    eng = Engine.load(model, device, need_tokenizer=False, tp=tp)
    eng.session(max([p for p in n_prompt if p > 0] + [tg_positions(n, d) for n in n_gen if n > 0 for d in depths]
                    + [1]))
    log(f"loaded {model} in {eng.load_seconds:.2f} s on {eng.device} (map, upload, kernels)")
    return eng


def _tests(n_prompt: list[int], n_gen: list[int], depths: list[int]) -> list[tuple[int, int, int]]:
    """(prompt tokens, generated tokens, depth) of each test: ppP rows, then tgN rows at each depth D, which decode
    after a D-token prompt (1 token at depth 0), as llama-bench's -d."""
    return [(p, 0, 0) for p in n_prompt if p > 0] + [(max(d, 1), n, d) for n in n_gen if n > 0 for d in depths]


def _name(p: int, n: int, d: int, batch: int | None = None) -> str:
    """A row's test: pp512, tg128, tg128 @ d512; with batching tg128 @ b16, tg256 @ d512 b16."""
    at = " ".join(([f"d{d}"] if n and d else []) + ([f"b{batch}"] if batch is not None else []))
    return (f"pp{p}" if n == 0 else f"tg{n}") + (f" @ {at}" if at else "")


def bench_rows(eng: Engine, model: str, n_prompt: list[int], n_gen: list[int], reps: int,
               progress: Callable[[str, int, int], None] | None = None, depths: list[int] = (0,)) -> Iterator[dict]:
    """One row per test, yielded as soon as it is measured (so an interrupted sweep keeps the finished rows);
    progress(test, repetition, of) is called before each run, the warm-up ones with repetition 0. A tg row at a
    depth D times its N decode steps after a D-token prompt (the prompt untimed)."""
    rng = np.random.default_rng(0)
    V = eng.file.args.vocab_size
    for p, n, d in _tests(n_prompt, n_gen, depths):
        name = _name(p, n, d)
        samples = []
        # the first run warms up (kernel compilation, caches) and is dropped; on the GPU a prompt test drops two: the
        # second prompt of a length bucket captures its prefill graph, which the later ones replay
        warm = 2 if n == 0 and p > 1 and eng.device == "cuda" else 1
        for rep in range(reps + warm):
            if progress:
                progress(name, max(rep - warm + 1, 0), reps)
            prompt = rng.integers(0, min(V, 151643), size=p).tolist()
            secs, toks = _run_once(eng, prompt, n + (1 if n else 0))
            if rep >= warm:
                samples.append((secs, toks))
        row = _row(eng, model, p, n, name, samples, d)
        log(f"{name}: {row['avg_ts']:.2f} ± {row['stddev_ts']:.2f} tok/s")
        yield row


def batch_rows(eng: Engine, model: str, n_prompt: list[int], n_gen: list[int], batches: list[int], reps: int,
               progress: Callable[[str, int, int], None] | None = None, depths: list[int] = (0,)) -> Iterator[dict]:
    """llama-batched-bench's rows through the batch engine: `ppP @ bB`, B prompts of P tokens prefilled together,
    and `tgN @ bB` (`tgN @ dD bB`), B sequences decoding N tokens together after a 1-token (D-token) prompt each,
    the prompts untimed; aggregate tok/s over all sequences; each row's n_seq is B, its n_depth D. A backend that
    runs one sequence a step is refused here, before any row."""
    from .batch import BatchConfig, BatchEngine
    p_max, b_max, d_max = max(n_prompt + [1]), max(batches), max(depths)
    ctx = max([p_max] + [tg_positions(n, d) for n in n_gen if n > 0 for d in depths])
    chunk = max(p_max, min(d_max, DEPTH_CHUNK))
    be = BatchEngine(eng, BatchConfig(max_context=ctx, max_seqs=b_max, chunk_size=chunk, step_tokens=b_max * chunk,
                                      n_blocks=b_max * -(-ctx // 16), prefix_caching=False))
    return _batch_rows(be, model, n_prompt, n_gen, batches, reps, progress, depths)


def _batch_rows(be, model: str, n_prompt: list[int], n_gen: list[int], batches: list[int], reps: int,
                progress, depths: list[int] = (0,)) -> Iterator[dict]:
    eng = be.engine
    rng = np.random.default_rng(0)
    V = min(eng.file.args.vocab_size, 151643)
    for p, n, d in _tests(n_prompt, n_gen, depths):
        for b in batches:
            name = _name(p, n, d, b)
            samples = []
            for rep in range(reps + 1):  # (the first run warms up and is dropped)
                if progress:
                    progress(name, rep, reps)
                secs = _run_batch(be, [rng.integers(0, V, size=p).tolist() for _ in range(b)], n)
                if rep:
                    samples.append((secs, b * (p if n == 0 else n)))
            row = dict(_row(eng, model, p, n, name, samples, d), n_seq=b)
            log(f"{name}: {row['avg_ts']:.2f} ± {row['stddev_ts']:.2f} tok/s")
            yield row


def _run_batch(be, prompts: list[list[int]], n_gen: int) -> float:
    """Seconds of the timed part: the prompts' prefill (n_gen 0), or the n_gen decode steps after it."""
    eng = be.engine
    t0 = time.perf_counter()
    handles = [be.submit(pr, GREEDY, n_gen + 1 if n_gen else 1, eos_ids=[]) for pr in prompts]
    while any(h.t_first is None for h in handles):
        be.step()
    eng.model.ops.synchronize()
    if n_gen:
        t0 = time.perf_counter()
        be.run_until_done()
        eng.model.ops.synchronize()
    else:
        be.run_until_done()
    return time.perf_counter() - t0


def _row(eng: Engine, model: str, p: int, n: int, name: str, samples: list[tuple[float, int]],
         depth: int = 0) -> dict:
    ns = np.array([s * 1e9 for s, _ in samples])
    ts = np.array([t / s for s, t in samples])
    row = {
        "backends": "CUDA" if eng.device == "cuda" else "CPU", "model_filename": str(model),
        "model_type": model_label(eng.file.args),
        "model_size": eng.file.size, "model_n_params": fmt.n_params(eng.file.header),
        "n_prompt": p if n == 0 else 0, "n_gen": n, "n_depth": depth, "test": name,
        "test_time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "avg_ns": int(ns.mean()), "stddev_ns": int(ns.std(ddof=1)) if len(ns) > 1 else 0,
        "avg_ts": float(ts.mean()), "stddev_ts": float(ts.std(ddof=1)) if len(ts) > 1 else 0.0,
        "samples_ns": [int(x) for x in ns], "samples_ts": [float(x) for x in ts],
    }
    dev = eng.model.ops.device_stats()
    if dev:
        row["gpu_info"] = dev["gpu_name"]
        row["gpu_mem_mib"] = round(dev["gpu_mib"], 1)
    return row


def model_label(a) -> str:
    """The table's model column: architecture, layers, width and, for Qwen3-MoE, experts x experts per token."""
    moe = f" {a.num_experts}x{a.num_experts_per_tok} experts" if a.num_experts else ""
    return f"qwen3{'moe' if a.num_experts else ''} {a.num_hidden_layers}L d{a.hidden_size}{moe} AWQ-4bit"


MD_HEAD = "| model | size | params | backend | test | t/s |\n| --- | ---: | ---: | --- | ---: | ---: |"


def render_row(row: dict, out: str, index: int) -> str:
    """One finished row as the output format prints it (index 0 also carries the table's head), so rows can be
    printed as they finish; render_end closes what the format needs closed."""
    if out == "jsonl":
        return json.dumps(row)
    if out == "json":  # llama-bench's form: "[" first, the rows comma-separated, "]" at the end
        body = "\n".join("  " + ln for ln in json.dumps(row, indent=2).splitlines())
        return ("[\n" if index == 0 else ",\n") + body
    if out == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=[k for k in row if not k.startswith("samples")], extrasaction="ignore")
        if index == 0:
            w.writeheader()
        w.writerow(row)
        return buf.getvalue().rstrip("\n")
    line = (f"| {row['model_type']} | {row['model_size'] / 2**30:.2f} GiB | {row['model_n_params'] / 1e9:.2f} B | "
            f"{row['backends']} | {row['test']} | {row['avg_ts']:.2f} ± {row['stddev_ts']:.2f} |")
    return (MD_HEAD + "\n" if index == 0 else "") + line


def render_end(out: str, rows: int) -> str | None:
    """What follows the last row (or stands alone when there is none): None when nothing does."""
    if out == "json":
        return "\n]" if rows else "[]"
    if out == "md" and not rows:
        return MD_HEAD
    return None


def render(rows: list[dict], out: str) -> str:
    """All rows at once, as the row-by-row printing gives them."""
    parts = [render_row(r, out, i) for i, r in enumerate(rows)]
    end = render_end(out, len(rows))
    text = "\n".join(parts) if out != "json" else "".join(parts)
    return text + (end or "")
