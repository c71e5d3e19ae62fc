#!/usr/bin/env python3
"""An older tree against this one on the same GPU, in one run (device machine): greedy tokens of the same model file,
then `tools/bench_e2e.py` figures, the trees alternated round by round, one process per run, and the medians side by
side with their ratio. The file is written by the OLD tree's maker (a newer loader reads older files; the reverse
need not hold), so both load the very same bytes.

    git worktree add ../old REV   (or: mkdir ../old && git archive REV | tar -x -C ../old)
    python tools/ab_trees.py ../old --models 8b,30b-a3b --rounds 3 --dir /dev/shm --json ab.json

Each run has a time limit (--budget for the whole): what is left unrun is reported, never guessed. The table goes to
stdout, progress to stderr."""
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"


def log(msg: str) -> None:
    click.echo(msg, err=True)


def run(tree: Path, argv: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    """argv run with the tree as its working directory and first on the path (None: it ran past timeout)."""
    try:
        return subprocess.run([sys.executable, *argv], cwd=tree, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
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
@click.option("--json", "json_out", default=None, help="write the results here")
def main(old, models, rounds, ctx, prompts, tokens, model_dir, budget, json_out):
    t0, old, new = time.monotonic(), Path(old).resolve(), ROOT
    left = lambda: budget - (time.monotonic() - t0)  # noqa: E731
    res = {"old": str(old), "new": str(new), "models": {}}
    for m in models.split(","):
        out = res["models"][m] = {"greedy": None, "runs": {"old": [], "new": []}, "unrun": 0}
        path = Path(model_dir) / f"ab-{m}.bin"
        if not path.exists():
            log(f"# writing {path} with the old tree's maker")
            r = run(old, ["tools/make_synthetic.py", str(path), "--ak48", "--preset", m], left())
            if r is None or r.returncode:
                raise click.ClickException(f"the old tree could not write {m}: {r.stderr[-500:] if r else 'timeout'}")
        toks = {}
        for name, tree in (("old", old), ("new", new)):
            r = run(tree, ["-m", "kuiper_py", "generate", "-m", str(path), "-p", PROMPT, "-n", str(tokens), "--raw",
                           "--temp", "0", "--json"], min(300.0, left()))
            toks[name] = json.loads(r.stdout)["tokens"] if r is not None and r.returncode == 0 else None
            if toks[name] is None:
                log(f"# {m} greedy on the {name} tree failed: {r.stderr[-500:] if r else 'timeout'}")
        if None not in toks.values():
            out["greedy"] = {"equal": first_difference(toks["old"], toks["new"]), "of": len(toks["new"])}
        for i in range(rounds):
            for name, tree in (("old", old), ("new", new)) if i % 2 == 0 else (("new", new), ("old", old)):
                if left() < 60:
                    out["unrun"] += 1
                    continue
                js = Path(model_dir) / f"ab-{m}-{name}-{i}.json"
                r = run(tree, ["tools/bench_e2e.py", str(path), "--ctx", ctx, "--prompts", prompts, "--no-hf",
                               "--json", str(js)], left() - 5)
                if r is None or r.returncode or not js.exists():
                    log(f"# {m} bench on the {name} tree failed: {r.stderr[-500:] if r else 'timeout'}")
                    continue
                out["runs"][name].append(json.loads(js.read_text()))
                log(f"# {m} {name} round {i + 1} done ({left():.0f} s left)")
    for m, out in res["models"].items():
        g = out["greedy"]
        click.echo(f"\n{m}: greedy " + (f"{g['equal']} of {g['of']} tokens equal" if g else "not compared")
                   + f"; bench runs old {len(out['runs']['old'])}, new {len(out['runs']['new'])}"
                   + (f", {out['unrun']} left unrun" if out["unrun"] else ""))
        mo, mn = medians(out["runs"]["old"]), medians(out["runs"]["new"])
        out["medians"] = {"old": mo, "new": mn}
        click.echo("| tok/s | old | new | new/old |\n| --- | --- | --- | --- |")
        for k in mn:
            if k in mo:
                click.echo(f"| {k} | {mo[k]:.1f} | {mn[k]:.1f} | {100 * (mn[k] / mo[k] - 1):+.1f}% |")
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
