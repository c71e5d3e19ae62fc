"""Every bad input of the hardening contract through the real CLI: exit code, one line, no leftovers."""
import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import run_cli, run_python
from kuiper_py import format as fmt
from test_cli import _one_line_error


def _patch_header(data: bytes, fmt_str: str, offset: int, *vals) -> bytes:
    """A crafted header: the fields patched and the header CRC recomputed, so the loader's field checks are what
    refuses it (a byte damaged without the CRC updated is test_cli_first_run's case)."""
    b = bytearray(data)
    struct.pack_into(fmt_str, b, offset, *vals)
    struct.pack_into("<I", b, fmt.HEADER_CRC_OFFSET, fmt.header_crc(b))
    return bytes(b)


BIN_CASES = {
    "wrong magic": (lambda d: b"GGUF" + d[4:], "not an ak48"),
    "unknown version": (lambda d: _patch_header(d, "<i", 4, 7), "unsupported ak48 version 7"),
    "truncated in header": (lambda d: d[:200], "shorter than"),
    "truncated in weights": (lambda d: d[:len(d) // 2], "truncated"),
    "truncated in trailer": (lambda d: d[:-10], "truncated"),
    "extra bytes": (lambda d: d + b"\0" * 64, "extra bytes"),
    "zero dim": (lambda d: _patch_header(d, "<i", 0x08, 0), "dim=0 must be positive"),
    "negative layers": (lambda d: _patch_header(d, "<i", 0x10, -3), "n_layers=-3"),
    "overflowing dims": (lambda d: _patch_header(d, "<ii", 0x08, 2**31 - 1 - 127, 2**31 - 1 - 127), "int32"),
    "dims exceeding file": (lambda d: _patch_header(d, "<i", 0x10, 1000), "inconsistent header"),
    "group size not dividing K": (lambda d: _patch_header(d, "<i", 0x29, 96), "does not divide"),
    "trailer outside file": (lambda d: _patch_header(d, "<QQ", 0x58, 10**12, 5), "trailer offset"),
    "trailer length past end": (lambda d: _patch_header(d, "<Q", 0x60, 10**9), "truncated"),
}


@pytest.mark.parametrize("case", list(BIN_CASES))
def test_bad_bin(case, tiny_bin, tmp_path):
    make, msg = BIN_CASES[case]
    p = tmp_path / "bad.bin"
    p.write_bytes(make(tiny_bin.read_bytes()))
    _one_line_error(run_cli("info", p), match=msg)
    _one_line_error(run_cli("generate", "-m", p, "-p", "x", "--device", "cpu"), match=msg)


def test_trailer_not_json_and_checksum(tiny_bin, tmp_path):
    d = bytearray(tiny_bin.read_bytes())
    h = fmt.Header.unpack(bytes(d[:256]))
    d[h.trailer_offset:h.trailer_offset + 1] = b"\xff"
    p = tmp_path / "t.bin"
    p.write_bytes(bytes(d))
    _one_line_error(run_cli("info", p), match="not valid JSON")
    d = bytearray(tiny_bin.read_bytes())
    d[300] ^= 0x40
    p.write_bytes(bytes(d))
    r = run_cli("info", p)
    assert r.returncode == 0 and "present, not verified" in r.stdout
    _one_line_error(run_cli("info", p, "--verify"), match="checksum mismatch")


def _cfg(d, fn):
    c = json.loads((d / "config.json").read_text())
    fn(c)
    (d / "config.json").write_text(json.dumps(c))


def _tensors(d, fn):
    f = d / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


def _nan_scale(t, val):
    s = t["model.layers.2.self_attn.o_proj.scales"].copy()
    s[1, 5] = val
    t["model.layers.2.self_attn.o_proj.scales"] = s


CKPT_CASES = {
    "no config": (lambda d: (d / "config.json").unlink(), "no config.json"),
    "pickle only": (lambda d: ((d / "model.safetensors").rename(d / "pytorch_model.bin")), "pickle"),
    "other architecture": (lambda d: _cfg(d, lambda c: c.update(architectures=["MistralForCausalLM"],
                                                                model_type="mistral")), "unsupported architecture"),
    "gptq": (lambda d: _cfg(d, lambda c: c["quantization_config"].update(quant_method="gptq")), "gptq"),
    "8-bit awq": (lambda d: _cfg(d, lambda c: c["quantization_config"].update(bits=8)), "bits=8"),
    "missing tensor": (lambda d: _tensors(d, lambda t: t.pop("model.layers.0.self_attn.k_norm.weight")),
                       "missing tensor model.layers.0.self_attn.k_norm.weight"),
    "wrong shape": (lambda d: _tensors(d, lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:64]})),
                    "model.norm.weight has shape"),
    "wrong dtype": (lambda d: _tensors(d, lambda t: t.update(
        {"model.layers.1.mlp.up_proj.qweight": t["model.layers.1.mlp.up_proj.qweight"].astype(np.int64)})),
        "has dtype I64"),
    "nan scales": (lambda d: _tensors(d, lambda t: _nan_scale(t, np.nan)), "model.layers.2.self_attn.o_proj.scales"),
    "inf scales": (lambda d: _tensors(d, lambda t: _nan_scale(t, np.inf)), "model.layers.2.self_attn.o_proj.scales"),
}


@pytest.mark.parametrize("case", list(CKPT_CASES))
def test_bad_checkpoint(case, untied_dir, copy_ckpt, tmp_path):
    d = copy_ckpt(untied_dir)
    damage, msg = CKPT_CASES[case]
    damage(d)
    out = tmp_path / "out"
    out.mkdir()
    _one_line_error(run_cli("export", d, "-o", out / "m.bin", "-q"), match=msg)
    assert list(out.iterdir()) == []


def test_bad_index_cases(tiny_dir, copy_ckpt, tmp_path):
    for shard, msg in (("../../etc/passwd", "outside the model directory"), ("gone.safetensors", "does not exist")):
        d = copy_ckpt(tiny_dir)
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        idx["weight_map"][next(iter(idx["weight_map"]))] = shard
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))
        out = tmp_path / "o"
        out.mkdir(exist_ok=True)
        _one_line_error(run_cli("export", d, "-o", out / "m.bin", "-q"), match=msg)
        assert list(out.iterdir()) == []
        import shutil
        shutil.rmtree(d)


def test_lying_safetensors_header_cli(untied_dir, copy_ckpt, tmp_path):
    d = copy_ckpt(untied_dir)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[:8] = (n + 10**9).to_bytes(8, "little")  # header length far past the file
    f.write_bytes(bytes(raw))
    _one_line_error(run_cli("export", d, "-o", tmp_path / "m.bin", "-q"), match="larger than the file")
    assert not (tmp_path / "m.bin").exists()


@pytest.mark.parametrize("missing", ["uvicorn", "kuiper_py.serve.app"])
def test_serve_without_its_extra_says_what_to_install(tiny_bin, missing):
    """`kuiper serve` where a module it imports cannot be (made unimportable here): one line, a non-zero exit, no
    traceback; the line names the serve extra where the module is the extra's (uvicorn), and not where it is
    kuiper's own (that is a fault of ours, not an install to make)."""
    code = (f"import sys; sys.modules[{missing!r}] = None; from kuiper_py.cli import main; "
            f"main(['serve', '-m', {str(tiny_bin)!r}, '--device', 'cpu', '--port', '0'])")
    r = run_python("-c", code, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and missing in lines[0], r.stderr
    assert ("pip install 'kuiper[serve]'" in lines[0]) == (missing == "uvicorn"), r.stderr


def test_info_plan_without_a_gpu_says_so(tiny_bin):
    """`kuiper info --plan` (a GPU's plan) where no GPU is visible: one line naming --plan, not advice to pass a
    --device that info does not take; a non-zero exit."""
    code = ("import os; os.environ['CUDA_VISIBLE_DEVICES'] = ''; from kuiper_py.cli import main; "
            f"main(['info', {str(tiny_bin)!r}, '--plan'])")
    r = run_python("-c", code, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--plan" in lines[0] and "no CUDA GPU" in lines[0], r.stderr
    assert "--device" not in lines[0], r.stderr
