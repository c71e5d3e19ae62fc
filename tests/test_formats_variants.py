"""Qwen3-2507 (Instruct/Thinking) and Qwen3-Coder shapes: a 262,144-token context and their own rope_theta, exported
and run on the CPU engine against transformers."""
import json

import numpy as np
import pytest

from kuiper_py import synth
from kuiper_py.export import export
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps
from reference import hf_model, hf_moe_model

torch = pytest.importorskip("torch")
PROMPT = [785, 6722, 315, 9625, 374, 11, 323, 279, 6722, 315]

# the published config.json values: (preset, its shapes, max_position_embeddings, rope_theta)
PUBLISHED = [("4b-2507", "4b", 262144, 5e6), ("30b-a3b-2507", "30b-a3b", 262144, 1e7),
             ("235b-a22b-2507", "235b-a22b", 262144, 5e6), ("coder-30b-a3b", "30b-a3b", 262144, 1e7)]


@pytest.mark.parametrize("preset, shapes, ctx, theta", PUBLISHED)
def test_variant_configs(preset, shapes, ctx, theta):
    cfg, base = synth.hf_config(preset), synth.hf_config(shapes)
    assert cfg["max_position_embeddings"] == ctx and cfg["rope_theta"] == theta
    assert base["max_position_embeddings"] == 40960 and base["rope_theta"] == 1e6
    diff = {k for k in cfg if cfg[k] != base[k]}
    assert diff == {"max_position_embeddings", "rope_theta"}
    assert synth.hf_config(preset, max_position_embeddings=1024)["max_position_embeddings"] == 1024


@pytest.mark.parametrize("preset, quant", [("tiny-2507", "gptq"), ("tiny-coder-moe", "compressed-tensors")])
def test_variant_exports_and_matches_transformers(preset, quant, tmp_path):
    """The header carries the 262,144 positions and the rope_theta, and the CPU engine's logits are transformers'
    (the AWQ twin, whose weights the other format's file holds byte for byte: test_formats_quant)."""
    awq = synth.make_checkpoint(tmp_path / "awq", preset, seed=13, tokenizer=False)
    other = synth.make_checkpoint(tmp_path / "o", preset, seed=13, tokenizer=False, quant=quant)
    export(other, tmp_path / "m.bin", progress=False, log=lambda m: None)
    cfg = json.loads((awq / "config.json").read_text())
    mf = load(tmp_path / "m.bin")
    assert mf.header.max_seq_len == 262144 == cfg["max_position_embeddings"]
    assert mf.header.rope_theta == cfg["rope_theta"] == synth.VARIANTS[preset][2]
    hf = (hf_moe_model if cfg["model_type"] == "qwen3_moe" else hf_model)(awq)
    ours = Qwen3(mf, NumpyOps, 64).prefill(PROMPT, all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].numpy()
    assert float(np.linalg.norm(ours - ref) / np.linalg.norm(ref)) < 1e-4
    # rope_theta matters: the same weights with Qwen3's 1e6 give other logits
    mf.args.rope_theta = 1e6
    assert float(np.linalg.norm(Qwen3(mf, NumpyOps, 64).prefill(PROMPT, all_logits=True) - ref)
                 / np.linalg.norm(ref)) > 1e-3


def test_synthetic_file_of_a_variant(tmp_path):
    synth.write_synthetic_file(tmp_path / "c.bin", "tiny-coder-moe", seed=1, log=lambda m: None)
    mf = load(tmp_path / "c.bin")
    assert (mf.header.max_seq_len, mf.header.rope_theta, mf.header.num_experts) == (262144, 1e7, 8)
    assert mf.trailer["config"]["rope_theta"] == 1e7
