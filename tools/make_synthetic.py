#!/usr/bin/env python3
"""Write a synthetic Qwen3 AWQ checkpoint (random weights, real HF layout and Qwen tokenizer), or with --ak48
an ak48 file of the same shapes directly (no checkpoint on disk: for Qwen3-235B-A22B, whose checkpoint and
file do not both fit on the device machines' disks; synth.write_synthetic_file).

    python tools/make_synthetic.py OUT_DIR --preset tiny|tiny-untied|small|0.6b|1.7b|4b|8b|14b|32b|
        tiny-moe|tiny-moe-mixed|small-moe|30b-a3b|235b-a22b
    python tools/make_synthetic.py OUT.bin --ak48 --preset 235b-a22b
"""
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kuiper_py.errors import KuiperError  # noqa: E402
from kuiper_py.synth import MOE_PRESETS, PRESETS, make_checkpoint, write_synthetic_file  # noqa: E402


@click.command()
@click.argument("out", type=click.Path())
@click.option("--preset", type=click.Choice(list(PRESETS) + list(MOE_PRESETS)), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--shards", type=int, default=2, show_default=True)
@click.option("--layers", type=int, default=None, help="Override the preset's layer count.")
@click.option("--mode", type=click.Choice(["quantize", "direct"]), default=None,
              help="quantize random float weights, or draw 4-bit codes directly (default by size).")
@click.option("--ak48", is_flag=True, help="Write OUT as an ak48 file directly, without a checkpoint.")
def main(out, preset, seed, shards, layers, mode, ak48):
    if ak48:
        if mode == "quantize":
            raise click.UsageError("--ak48 draws the codes directly; --mode quantize needs the checkpoint route")
        try:
            write_synthetic_file(out, preset, seed=seed, layers=layers, progress=sys.stderr.isatty())
        except KuiperError as e:
            raise click.ClickException(str(e)) from None
        return
    p = make_checkpoint(out, preset, seed=seed, n_shards=shards, layers=layers, mode=mode)
    click.echo(f"wrote {preset} checkpoint to {p}", err=True)


if __name__ == "__main__":
    main()
