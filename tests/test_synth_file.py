"""synth.write_synthetic_file: an ak48 file drawn straight from a preset's shapes (no Hugging Face checkpoint on
disk), which must be the file `kuiper export` makes of make_checkpoint's checkpoint in everything but the
weights' values: the same header, regions and trailer, a valid checksum, and a model that runs."""
import dataclasses

import numpy as np
import pytest

from kuiper_py import synth
from kuiper_py.export import export
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps


def _quiet(m):
    pass


@pytest.mark.parametrize("preset", ["tiny", "tiny-untied", "tiny-moe-mixed"])
def test_direct_file_is_the_exported_layout(preset, tmp_path):
    ck = synth.make_checkpoint(tmp_path / "ck", preset, seed=5)
    export(ck, tmp_path / "via.bin", progress=False, log=_quiet)
    synth.write_synthetic_file(tmp_path / "direct.bin", preset, seed=5, log=_quiet)
    via, direct = load(tmp_path / "via.bin"), load(tmp_path / "direct.bin")
    assert direct.verify_checksum() is True
    hv, hd = dataclasses.asdict(via.header), dataclasses.asdict(direct.header)
    assert hv.pop("checksum") != hd.pop("checksum")  # other weights, so another checksum
    assert hv == hd
    assert via.trailer == direct.trailer  # config, generation config, tokenizer and template
    assert (tmp_path / "via.bin").stat().st_size == (tmp_path / "direct.bin").stat().st_size
    # each region's bytes differ (random values), and the codes' and zeros' value ranges are the synthetic ones
    lv, ld = via.weights.layers[0], direct.weights.layers[0]
    assert not np.array_equal(np.asarray(lv.wq.qweight), np.asarray(ld.wq.qweight))
    z = (np.asarray(ld.wq.qzeros).view(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    assert z.min() >= 6 and z.max() <= 9
    s = np.asarray(ld.wq.scales, dtype=np.float32)
    K = ld.wq.qweight.shape[0]
    assert 0.74 / (6.5 * np.sqrt(K)) <= s.min() and s.max() <= 1.26 / (6.5 * np.sqrt(K))


def test_direct_file_runs_and_is_deterministic(tmp_path):
    synth.write_synthetic_file(tmp_path / "a.bin", "tiny-moe", seed=2, log=_quiet)
    synth.write_synthetic_file(tmp_path / "b.bin", "tiny-moe", seed=2, log=_quiet)
    synth.write_synthetic_file(tmp_path / "c.bin", "tiny-moe", seed=3, log=_quiet)
    a, b, c = ((tmp_path / f"{n}.bin").read_bytes() for n in "abc")
    assert a == b and a != c
    m = Qwen3(load(tmp_path / "a.bin"), NumpyOps, 32)
    lg = m.prefill([785, 6722, 315, 9625, 374])
    steps = [lg]
    for _ in range(6):
        steps.append(m.decode(int(np.argmax(steps[-1]))))
    steps = np.stack(steps)
    assert np.isfinite(steps).all()
    assert steps[:, :151643].std(axis=1).min() > 0.1  # logits spread, not a constant row


def test_direct_file_layers_override_and_no_partial_file(tmp_path):
    s = synth.write_synthetic_file(tmp_path / "one.bin", "small-moe", layers=1, log=_quiet)
    f = load(tmp_path / "one.bin")
    assert f.args.num_hidden_layers == 1 and f.args.num_experts == 16 and f.args.hidden_size == 256
    assert len(f.weights.layers) == 1 and f.weights.layers[0].experts_w13.E == 16
    assert s["bytes"] == (tmp_path / "one.bin").stat().st_size
    from kuiper_py.errors import KuiperError
    with pytest.raises(KuiperError, match="does not exist"):
        synth.write_synthetic_file(tmp_path / "nodir" / "x.bin", "tiny", log=_quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.bin"]
