"""Whole-model prefill A/B in one process: the GPU time of one prefill under each of several settings of
`kuiper_py.ops_cupy`'s module-level path choices, the settings alternating (forward, then backward order) over
several rounds, so every form sees the same machine, clocks and pool (PERFORMANCE.md changes 199-202 quote it).

    python tools/ab_prefill.py MODEL.bin --prompts 128,512 \
        --form rs:MOE_TC=0 --form tc16:MOE_TC_MAX_MEAN=1e9,MOE_TC_T16_MAX=1e9 --form tc32:MOE_TC_MAX_MEAN=1e9,MOE_TC_T16_MAX=0

Each form is NAME:ATTR=VALUE[,ATTR=VALUE...]; an attribute not named by a form keeps its default. Only choices the
ops read at call time can be switched this way (compile-time settings, KUIPER_DIAG_DEFINES, need one process each).
A prefill is timed by CUDA events around it after a spinning kernel has given the host time to queue it, so the
figure is GPU time, not the host's; prefills run eagerly (no prefill graphs: one captured under a form would replay
under the next). Prints a table last; --json writes every sample."""
import json
import sys
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kuiper_py import ops_cupy as oc  # noqa: E402  (imports without CuPy: the forms parse on any machine)

def parse_form(text: str):
    """'NAME:A=1,B=x' -> (NAME, {A: ..., B: ...}), each attribute one ops_cupy has that holds a str, int, float or
    bool, each value converted to that attribute's type (MOE_TC is the string "0", MOE_TC_MAX_MEAN a float)."""
    name, _, body = text.partition(":")
    if not name or not body:
        raise click.BadParameter(f"{text!r}: expected NAME:ATTR=VALUE[,ATTR=VALUE...]")
    sets = {}
    for item in body.split(","):
        attr, eq, val = item.partition("=")
        kind = type(getattr(oc, attr, None))
        if not eq or kind not in (str, int, float, bool):
            raise click.BadParameter(f"{item!r}: not ATTR=VALUE of a str, int, float or bool ops_cupy attribute")
        try:
            sets[attr] = val in ("1", "true", "True") if kind is bool else kind(val)
        except ValueError:
            raise click.BadParameter(f"{item!r}: {attr} holds a {kind.__name__}") from None
    return name, sets


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompts", default="128,512", show_default=True, help="prompt lengths, comma-separated")
@click.option("--form", "forms", multiple=True, required=True, help="NAME:ATTR=VALUE[,...] (at least two)")
@click.option("--rounds", default=4, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False))
def main(model, prompts, forms, rounds, json_out):
    parsed = dict(parse_form(f) for f in forms)
    import cupy as cp
    from profile_prefill import queued

    from kuiper_py.generate import Engine
    defaults = {a: getattr(oc, a) for sets in parsed.values() for a in sets}
    lens = [int(v) for v in prompts.split(",")]
    eng = Engine.load(model, "cuda", need_tokenizer=False)
    m = eng.session(max(lens) + 1)
    m.ops.prefill_graphs = False  # a graph captured under one form would replay under the next
    rng = np.random.default_rng(0)

    def use(name):
        for a, v in defaults.items():
            setattr(oc, a, parsed[name].get(a, v))

    def gpu_ms(ids):
        m.reset()
        cp.cuda.get_current_stream().synchronize()
        return queued(lambda: m.prefill(ids), 2 * 10**8)[1] * 1e3

    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "forms": list(forms), "prompts": []}
    names = list(parsed)
    try:
        for p in lens:
            ids = rng.integers(0, 151643, p).tolist()
            for name in names:  # compiles, tensor maps, the pool's blocks
                use(name)
                for _ in range(2):
                    m.reset()
                    m.prefill(ids)
            ms = {name: [] for name in names}
            for r in range(rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    use(name)
                    ms[name].append(gpu_ms(ids))
            res["prompts"].append({"prompt": p, "gpu_ms": ms})
            print(f"{p} tokens: " + ", ".join(f"{n} {np.median(v):.3f}" for n, v in ms.items()), file=sys.stderr)
    finally:
        for a, v in defaults.items():
            setattr(oc, a, v)
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))
    print(f"{res['gpu']}: GPU ms per prefill, median of {rounds} [min-max]")
    print("| tokens | " + " | ".join(names) + " |\n|---:|" + "---:|" * len(names))
    for r in res["prompts"]:
        print(f"| {r['prompt']} | " + " | ".join(
            f"{np.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]" for v in r["gpu_ms"].values()) + " |")


if __name__ == "__main__":
    main()
