#!/usr/bin/env python3
"""Write a synthetic Qwen3 AWQ checkpoint (random weights, real HF layout and Qwen tokenizer).

    python tools/make_synthetic.py OUT_DIR --preset tiny|tiny-untied|small|0.6b|1.7b|4b|8b|14b|32b|
        tiny-moe|tiny-moe-mixed|small-moe|30b-a3b|235b-a22b
"""
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kuiper_py.synth import MOE_PRESETS, PRESETS, make_checkpoint  # noqa: E402


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--preset", type=click.Choice(list(PRESETS) + list(MOE_PRESETS)), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--shards", type=int, default=2, show_default=True)
@click.option("--layers", type=int, default=None, help="Override the preset's layer count.")
@click.option("--mode", type=click.Choice(["quantize", "direct"]), default=None,
              help="quantize random float weights, or draw 4-bit codes directly (default by size).")
def main(out_dir, preset, seed, shards, layers, mode):
    p = make_checkpoint(out_dir, preset, seed=seed, n_shards=shards, layers=layers, mode=mode)
    click.echo(f"wrote {preset} checkpoint to {p}", err=True)


if __name__ == "__main__":
    main()
