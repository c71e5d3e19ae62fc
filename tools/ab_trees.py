#!/usr/bin/env python3
"""An older tree against this one on the same GPU, in one run (device machine): greedy tokens of the same model file,
then `tools/bench_e2e.py` figures, the trees alternated round by round, one process per run, and the medians side by
side with the change. The file is written anew by the OLD tree's maker (a newer loader reads older files; the
reverse need not hold), so both load the very same bytes. Each tree must import its own kuiper_py and compile its own
kernels_cu (an editable install of one tree would hand its kernels to the other): the tool checks, and refuses.

    git worktree add ../old REV   (or: mkdir ../old && git archive REV | tar -x -C ../old)
    python tools/ab_trees.py ../old --models 8b,30b-a3b --rounds 3 --dir /dev/shm --json ab.json
    python tools/ab_trees.py ../old --models 8b --rounds 0 --first-run     # the load times only

--first-run also times each tree's load as a machine's first run meets it (an empty CuPy kernel cache: every kernel
compiled) and again with the kernels that run cached, from `kuiper generate --json`'s timings.

Each run has a time limit (--budget for the whole): what failed or was left unrun is reported, never guessed, and the
results so far are written even when a later model fails. The table goes to stdout, progress to stderr."""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"


def log(msg: str) -> None:
    click.echo(msg, err=True)


def run(tree: Path, argv: list[str], timeout: float, env=None) -> subprocess.CompletedProcess | None:
    """argv run with the tree as its working directory and first on the path (None: it ran past timeout)."""
    try:
        return subprocess.run([sys.executable, *argv], cwd=tree, capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return None


def bench_reps(old: Path, new: Path) -> dict:
    """{"old"|"new": the --prefill-reps its bench_e2e is given, None for its default}, so that both report medians of
    as many prefills after as much back-to-back work: a tree whose bench lacks the option times 3 eager prefills and 3
    graph replays."""
    has = {name: "--prefill-reps" in (t / "tools" / "bench_e2e.py").read_text()
           for name, t in (("old", old), ("new", new))}
    return {name: None if all(has.values()) or not has[name] else 3 for name in has}


def generate_json(tree: Path, path: Path, n: int, timeout: float, what: str, env=None) -> dict | None:
    """`kuiper generate --json` of n greedy tokens after PROMPT, on the tree: its JSON (None, logged as `what`, where it
    failed or ran out of time)."""
    r = run(tree, ["-m", "kuiper_py", "generate", "-m", str(path), "-p", PROMPT, "-n", str(n), "--raw", "--temp", "0",
                   "--json"], timeout, env)
    try:
        return json.loads(r.stdout)
    except (AttributeError, ValueError):
        log(f"# {what} failed: {r.stderr.strip()[-300:] if r else 'out of time'}")
        return None


def first_difference(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def medians(runs: list[dict]) -> dict[str, float]:
    """bench_e2e JSON records -> {"decode 512": tok/s, "prefill 128": ..., "prefill 128 graph": ...}, medians."""
    cells: dict[str, list[float]] = {}
    for r in runs:
        for d in r["decode"]:
            cells.setdefault(f"decode {d['context']}", []).append(d["tok_s"])
        for p in r["prefill"]:
            cells.setdefault(f"prefill {p['prompt']}", []).append(p["tok_s"])
            if p.get("tok_s_graph"):
                cells.setdefault(f"prefill {p['prompt']} graph", []).append(p["tok_s_graph"])
    return {k: statistics.median(v) for k, v in cells.items()}


@click.command()
@click.argument("old", type=click.Path(exists=True, file_okay=False))
@click.option("--models", default="8b,30b-a3b", show_default=True, help="synthetic presets, comma-separated")
@click.option("--rounds", type=int, default=3, show_default=True, help="bench_e2e runs of each tree per model")
@click.option("--ctx", default="512,8192", show_default=True)
@click.option("--prompts", default="128,512,2048", show_default=True)
@click.option("--tokens", type=int, default=48, show_default=True, help="greedy tokens compared")
@click.option("--dir", "model_dir", default="/dev/shm", show_default=True, help="where the model files go")
@click.option("--budget", type=float, default=3600.0, show_default=True, help="seconds for the whole comparison")
@click.option("--first-run", is_flag=True, help="also time each tree's load with an empty kernel cache, then cached")
@click.option("--json", "json_out", default=None, help="write the results here")
def main(old, models, rounds, ctx, prompts, tokens, model_dir, budget, first_run, json_out):
    t0, old, new = time.monotonic(), Path(old).resolve(), ROOT
    left = lambda: budget - (time.monotonic() - t0)  # noqa: E731
    for tree in (old, new):
        check_tree(tree)
    res = {"old": str(old), "new": str(new), "models": {}}
    reps = bench_reps(old, new)
    try:
        for m in models.split(","):
            res["models"][m] = compare(m, old, new, rounds, ctx, prompts, tokens, Path(model_dir), left, first_run,
                                       reps)
    finally:
        report(res, json_out)
    failed = [m for m, out in res["models"].items() if out.get("error")]
    if failed:
        raise click.ClickException(f"{', '.join(failed)}: {res['models'][failed[0]]['error']}")


def check_tree(tree: Path) -> None:
    """Refuse a tree whose kuiper_py or kernel sources resolve outside it."""
    code = "import kuiper_py, kuiper_py.ops_cupy as oc; print(kuiper_py.__file__); print(oc.kernel_dir())"
    r = run(tree, ["-c", code], 120)
    paths = r.stdout.split() if r is not None and r.returncode == 0 else []
    if len(paths) != 2 or not all(Path(p).resolve().is_relative_to(tree) for p in paths):
        raise click.ClickException(f"{tree}: its kuiper_py or kernels resolve to {paths or 'nothing'}, not inside it "
                                   f"(an editable install of another tree?); run where no kuiper is installed")


def compare(m, old, new, rounds, ctx, prompts, tokens, model_dir: Path, left, first_run, reps) -> dict:
    """One model: the file by the old tree's maker, greedy tokens of both, then the bench rounds alternated."""
    out = {"greedy": None, "runs": {"old": [], "new": []}, "unrun": 0, "error": None, "prefill_reps": reps}
    path = model_dir / f"ab-{m}.bin"
    log(f"# writing {path} with the old tree's maker")
    path.unlink(missing_ok=True)
    r = run(old, ["tools/make_synthetic.py", str(path), "--ak48", "--preset", m], max(1.0, left()))
    if r is None or r.returncode:
        out["error"] = f"the old tree could not write {m}: " + (r.stderr.strip()[-300:] if r else "out of time")
        return out
    toks = {}
    for name, tree in (("old", old), ("new", new)):
        js = generate_json(tree, path, tokens, max(1.0, min(300.0, left())), f"{m} greedy on the {name} tree")
        if js is not None:
            toks[name] = js["tokens"]
    if len(toks) == 2:
        out["greedy"] = {"equal": first_difference(toks["old"], toks["new"]),
                         "old": len(toks["old"]), "new": len(toks["new"])}
    if first_run:
        out["load"] = {name: load_times(m, name, tree, path, left) for name, tree in (("old", old), ("new", new))}
    for i in range(rounds):
        for name, tree in (("old", old), ("new", new)) if i % 2 == 0 else (("new", new), ("old", old)):
            if left() < 60:
                out["unrun"] += 1
                continue
            js = model_dir / f"ab-{m}-{name}-{i}.json"
            js.unlink(missing_ok=True)
            n_reps = [] if reps[name] is None else ["--prefill-reps", str(reps[name])]
            r = run(tree, ["tools/bench_e2e.py", str(path), "--ctx", ctx, "--prompts", prompts, "--no-hf",
                           "--json", str(js), *n_reps], left() - 5)
            if r is None or r.returncode or not js.exists():
                log(f"# {m} bench on the {name} tree failed: {r.stderr.strip()[-300:] if r else 'out of time'}")
                continue
            out["runs"][name].append(json.loads(js.read_text()))
            log(f"# {m} {name} round {i + 1} done ({left():.0f} s left)")
    return out


def load_times(m: str, name: str, tree: Path, path: Path, left) -> dict | None:
    """`kuiper generate --json` timings (load_s, warmup_s, kernel_build_s) of one token with an empty CuPy kernel cache
    ("first": a machine's first run compiles every kernel it launches) and then with that cache ("cached")."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="ab-cupy-") as cache:
        env = dict(os.environ, CUPY_CACHE_DIR=cache)
        for key in ("first", "cached"):
            js = generate_json(tree, path, 1, max(1.0, min(900.0, left())), f"{m} {key} load on the {name} tree", env)
            if js is None:
                return None
            out[key] = {k: js["timings"].get(k) for k in ("load_s", "warmup_s", "kernel_build_s")}
    log(f"# {m} {name} load timed ({left():.0f} s left)")
    return out


def report(res: dict, json_out) -> None:
    """The table per model on stdout (medians, change of new against old), and the JSON."""
    for m, out in res["models"].items():
        g = out["greedy"]
        same = f"{g['equal']} of {max(g['old'], g['new'])} tokens equal" if g else "not compared"
        click.echo(f"\n{m}: greedy {same}; bench runs old {len(out['runs']['old'])}, new {len(out['runs']['new'])}"
                   + (f", {out['unrun']} left unrun" if out["unrun"] else "")
                   + (f"; {out['error']}" if out["error"] else ""))
        mo, mn = medians(out["runs"]["old"]), medians(out["runs"]["new"])
        out["medians"] = {"old": mo, "new": mn}
        click.echo("| tok/s | old | new | change |\n| --- | --- | --- | --- |")
        for k in dict.fromkeys([*mo, *mn]):
            o, n = mo.get(k), mn.get(k)
            change = f"{100 * (n / o - 1):+.1f}%" if o and n else "-"
            click.echo(f"| {k} | {o or float('nan'):.1f} | {n or float('nan'):.1f} | {change} |")
        if out.get("load"):
            click.echo("| load s | old | new |\n| --- | --- | --- |")
            for key in ("first", "cached"):
                for k in ("load_s", "warmup_s", "kernel_build_s"):
                    cell = [(out["load"][t] or {}).get(key, {}).get(k) for t in ("old", "new")]
                    click.echo(f"| {key} {k} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cell) + " |")
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
