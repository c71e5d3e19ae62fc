#!/usr/bin/env python3
"""Write a synthetic Qwen3 AWQ checkpoint (random weights, real HF layout and Qwen tokenizer), or with --ak48
an ak48 file of the same shapes directly (no checkpoint on disk: for Qwen3-235B-A22B, whose checkpoint and
file do not both fit on the device machines' disks). The same command as `kuiper synth`: a failure is one
line on stderr and leaves no partial directory or file.

    python tools/make_synthetic.py OUT_DIR --preset tiny|tiny-untied|small|0.6b|1.7b|4b|8b|14b|32b|
        tiny-moe|tiny-moe-mixed|small-moe|30b-a3b|235b-a22b
    python tools/make_synthetic.py OUT.bin --ak48 --preset 235b-a22b
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kuiper_py.cli import main  # noqa: E402

if __name__ == "__main__":
    main(["synth", *sys.argv[1:]])
