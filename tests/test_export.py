"""Export: sharded and single-file, tied and untied, validation and no partial output."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kuiper_py import format as fmt
from kuiper_py.errors import KuiperError
from kuiper_py.export import export
from kuiper_py.loader import load


def _quiet(src, out):
    return export(src, out, progress=False, log=lambda m: None)


def test_sharded_tied_export(tiny_dir, tiny_bin):
    assert (tiny_dir / "model.safetensors.index.json").exists()
    mf = load(tiny_bin)
    assert mf.header.shared_classifier and "lm_head" not in {r.name for r in fmt.regions(mf.header)}
    assert mf.size == mf.header.trailer_offset + mf.header.trailer_length


def test_single_file_untied_export(untied_dir, untied_bin):
    assert (untied_dir / "model.safetensors").exists()
    mf = load(untied_bin)
    assert not mf.header.shared_classifier
    np.testing.assert_array_equal(mf.weights.lm_head, load_file(str(untied_dir / "model.safetensors"))["lm_head.weight"])


def test_export_is_deterministic(tiny_dir, tiny_bin, tmp_path):
    out = tmp_path / "again.bin"
    s = _quiet(tiny_dir, out)
    assert out.read_bytes() == tiny_bin.read_bytes()
    assert 4.0 < s["bits_per_weight"] < 4.3


def test_export_file_mode_follows_the_umask(tiny_dir, tmp_path):
    """The file gets the mode of any new file under the user's umask, not the temporary file's 0600."""
    import os
    import stat
    for umask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        old = os.umask(umask)
        try:
            out = tmp_path / f"m{umask:o}.bin"
            _quiet(tiny_dir, out)
        finally:
            os.umask(old)
        assert stat.S_IMODE(out.stat().st_mode) == mode, (oct(umask), oct(out.stat().st_mode))


def _edit_config(d, fn):
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit, msg", [
    (lambda c: c["quantization_config"].update(quant_method="bitsandbytes"), "'bitsandbytes' is not supported"),
    (lambda c: c["quantization_config"].update(bits=8), "bits=8"),
    (lambda c: c["quantization_config"].update(version="gemv"), "GEMM"),
    (lambda c: c["quantization_config"].update(zero_point=False), "zero point"),
    (lambda c: c.pop("quantization_config"), "no quantization_config"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"), "unsupported architecture"),
    (lambda c: c["quantization_config"].update(group_size=96), r"group_size=96 is not supported \(supported: 32, 64"),
    (lambda c: c["quantization_config"].update(group_size=256), r"group_size=256 is not supported"),
    (lambda c: c.update(hidden_size=96, head_dim=24), "does not divide"),
])
def test_bad_configs_are_refused(untied_dir, copy_ckpt, tmp_path, edit, msg):
    d = copy_ckpt(untied_dir)
    _edit_config(d, edit)
    out = tmp_path / "o.bin"
    with pytest.raises(KuiperError, match=msg):
        _quiet(d, out)
    assert list(tmp_path.glob("*.bin*")) == [] and not list(tmp_path.glob(".o.bin*"))


def _rewrite_tensor(d, fn):
    f = d / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


@pytest.mark.parametrize("edit, msg", [
    (lambda t: t.pop("model.layers.1.self_attn.q_norm.weight"), "missing tensor model.layers.1.self_attn.q_norm"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": t["model.layers.0.mlp.up_proj.qweight"][:, :8]}),
     "has shape"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.scales": t["model.layers.0.mlp.up_proj.scales"].astype(np.int32)}),
     "has dtype I32"),
    (lambda t: t.pop("lm_head.weight"), "lm_head"),
])
def test_bad_tensors_are_refused(untied_dir, copy_ckpt, tmp_path, edit, msg):
    d = copy_ckpt(untied_dir)
    _rewrite_tensor(d, edit)
    with pytest.raises(KuiperError, match=msg):
        _quiet(d, tmp_path / "o.bin")
    assert not any(p.name.startswith((".o.bin", "o.bin")) for p in tmp_path.iterdir())


def test_nan_scales_in_last_layer_leave_no_partial_file(untied_dir, copy_ckpt, tmp_path):
    d = copy_ckpt(untied_dir)

    def poison(t):
        s = t["model.layers.2.mlp.up_proj.scales"].copy()
        s[0, 3] = np.nan
        t["model.layers.2.mlp.up_proj.scales"] = s
    _rewrite_tensor(d, poison)
    out = tmp_path / "model.bin"
    out.write_bytes(b"old model")  # an existing file survives a failed export untouched
    with pytest.raises(KuiperError, match="model.layers.2.mlp.up_proj.scales"):
        _quiet(d, out)
    assert out.read_bytes() == b"old model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck_untied", "model.bin"]


def test_pickle_only_and_missing_config(tmp_path):
    d = tmp_path / "pt"
    d.mkdir()
    with pytest.raises(KuiperError, match="no config.json"):
        _quiet(d, tmp_path / "x.bin")
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2,
        "vocab_size": 10}))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    with pytest.raises(KuiperError, match="pickle"):
        _quiet(d, tmp_path / "x.bin")


def test_index_shard_outside_directory_and_missing_shard(tiny_dir, copy_ckpt, tmp_path):
    d = copy_ckpt(tiny_dir)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(idx["weight_map"]))
    idx["weight_map"][first] = "../evil.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(KuiperError, match="outside the model directory"):
        _quiet(d, tmp_path / "x.bin")
    idx["weight_map"][first] = "nope.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(KuiperError, match="does not exist"):
        _quiet(d, tmp_path / "x.bin")


def test_lying_safetensors_header(untied_dir, copy_ckpt, tmp_path):
    d = copy_ckpt(untied_dir)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8:8 + n])
    name = "model.layers.0.mlp.up_proj.scales"
    a, b = hdr[name]["data_offsets"]
    hdr[name]["data_offsets"] = [a, b - 2]
    new = json.dumps(hdr, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    raw[8:8 + n] = new
    f.write_bytes(bytes(raw))
    with pytest.raises(KuiperError, match=f"{name} lies"):
        _quiet(d, tmp_path / "x.bin")
