"""The real CLI as a subprocess: stdout discipline, JSON, bench, and one-line errors."""
import json

import numpy as np
import pytest

from conftest import run_cli
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps
from kuiper_py.tokenizer import ChatTokenizer


def _one_line_error(r, code=2, match=None):
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("kuiper: error")]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    if match:
        assert match in lines[0], lines[0]
    return lines[0]


def test_export_and_info(tiny_dir, tmp_path):
    out = tmp_path / "m.bin"
    r = run_cli("export", tiny_dir, "-o", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and "exported" in r.stderr and "bits per quantized weight" in r.stderr
    r = run_cli("info", out, "--verify", "--json")
    d = json.loads(r.stdout)
    assert d["checksum"] == "OK" and d["layers"] == 2 and d["shared_classifier"] is True


@pytest.mark.parametrize("preset", ["tiny", "tiny-untied", "tiny-moe-mixed"])
def test_info_memory_figures(preset, tmp_path):
    """info's memory figures against the header alone: the bytes the GPU holds and an untied embedding's pinned
    host bytes add up to the file's weight regions (everything between the 256-byte header and the weights' end),
    the pinned part is the V x D fp16 embedding when untied and nothing when tied or with KUIPER_EMBED_ON_GPU=1, and
    the KV cache takes 2 x layers x KV heads x head_dim fp16 values per position."""
    from kuiper_py import synth
    b = tmp_path / "m.bin"
    synth.write_synthetic_file(b, preset, seed=5)
    d = json.loads(run_cli("info", b, "--json").stdout)
    regions = d["weights_end"] - 256
    assert d["gpu_weight_bytes"] + d["pinned_host_bytes"] == regions
    assert d["pinned_host_bytes"] == (0 if d["shared_classifier"] else d["vocab"] * d["dim"] * 2)
    assert d["kv_bytes_per_position"] == 2 * d["layers"] * d["kv_heads"] * d["head_dim"] * 2
    g = json.loads(run_cli("info", b, "--json", env={"KUIPER_EMBED_ON_GPU": "1"}).stdout)
    assert g["pinned_host_bytes"] == 0 and g["gpu_weight_bytes"] == regions
    text = run_cli("info", b).stdout
    assert f"KV cache {d['kv_bytes_per_position'] / 1024:.1f} KiB per position" in text


def _greedy_reference(binf, prompt, n):
    mf = load(binf)
    tok = ChatTokenizer(mf.trailer)
    ids = tok.encode(prompt)
    m = Qwen3(mf, NumpyOps, len(ids) + n)
    lg, out = m.prefill(ids), []
    for _ in range(n):
        t = int(np.argmax(lg[:tok.vocab_size]))
        out.append(t)
        if len(out) < n:
            lg = m.decode(t)
    return tok, out


def test_generate_greedy_stdout_is_only_text(tiny_bin):
    tok, ids = _greedy_reference(tiny_bin, "The capital of France is", 12)
    r = run_cli("generate", "-m", tiny_bin, "-p", "The capital of France is", "--raw", "--temp", "0", "-n", 12,
                "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(ids) + "\n"
    assert "tok/s" in r.stderr and "finish: length" in r.stderr


def test_generate_json_and_stdin_and_file(tiny_bin, tmp_path):
    tok, ids = _greedy_reference(tiny_bin, "hello there", 6)
    r = run_cli("generate", "-m", tiny_bin, "-p", "-", "--raw", "--temp", "0", "-n", 6, "--json",
                "--device", "cpu", input="hello there")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["tokens"] == ids and rec["finish_reason"] == "length" and rec["text"] == tok.decode(ids)
    assert rec["timings"]["prompt_tokens"] == 2
    f = tmp_path / "p.txt"
    f.write_text("hello there")
    r2 = run_cli("generate", "-m", tiny_bin, "-f", f, "--raw", "--temp", "0", "-n", 6, "--json", "--device", "cpu")
    assert json.loads(r2.stdout)["tokens"] == ids


def test_generate_chat_sampling_and_stop(tiny_bin):
    r = run_cli("generate", "-m", tiny_bin, "-p", "Hi", "--system", "Be brief", "--no-think", "--seed", "3", "-n", 8,
                "--json", "--device", "cpu", "-v")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["prompt_tokens"] == len(ChatTokenizer(load(tiny_bin).trailer).encode(
        "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\n"))
    again = run_cli("generate", "-m", tiny_bin, "-p", "Hi", "--system", "Be brief", "--no-think", "--seed", "3", "-n", 8,
                    "--json", "--device", "cpu")
    assert json.loads(again.stdout)["tokens"] == rec["tokens"]  # same seed, same text
    tok, ids = _greedy_reference(tiny_bin, "The capital of France is", 12)
    full = tok.decode(ids)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    if stop.strip():
        r = run_cli("generate", "-m", tiny_bin, "-p", "The capital of France is", "--raw", "--temp", "0",
                    "-n", 12, "--stop", stop, "--json", "--device", "cpu")
        rec = json.loads(r.stdout)
        assert rec["finish_reason"] == "stop" and rec["text"] == full[:full.index(stop)]


def test_bench_json_fields(tiny_bin):
    r = run_cli("bench", "-m", tiny_bin, "-p", "16,32", "-n", "4", "-r", "2", "-o", "json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["test"] for x in rows] == ["pp16", "pp32", "tg4"]
    for x in rows:
        assert {"avg_ts", "stddev_ts", "avg_ns", "n_prompt", "n_gen", "model_size", "samples_ts"} <= set(x)
        assert x["avg_ts"] > 0 and len(x["samples_ts"]) == 2
    assert rows[0]["model_type"] == "qwen3 2L d128 AWQ-4bit"
    md = run_cli("bench", "-m", tiny_bin, "-p", "8", "-n", "0", "-r", "1", "--device", "cpu")
    assert "| pp8 |" in md.stdout


def test_bench_names_a_moe_model(tmp_path):
    from kuiper_py import synth
    synth.write_synthetic_file(tmp_path / "moe.bin", "tiny-moe-mixed", log=lambda m: None)
    r = run_cli("bench", "-m", tmp_path / "moe.bin", "-p", "8", "-n", "2", "-r", "1", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "| qwen3moe 3L d128 8x3 experts AWQ-4bit |" in r.stdout


def test_user_errors_are_one_line(tiny_bin, tiny_dir, tmp_path):
    _one_line_error(run_cli("generate", "-m", tmp_path / "nope.bin", "-p", "x"), match="nope.bin")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"GGUF" + bytes(300))
    _one_line_error(run_cli("info", bad), match="not an ak48")
    trunc = tmp_path / "trunc.bin"
    trunc.write_bytes(tiny_bin.read_bytes()[:5000])
    _one_line_error(run_cli("generate", "-m", trunc, "-p", "x", "--device", "cpu"), match="truncated")
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    _one_line_error(run_cli("generate", "-m", empty, "-p", "x", env={"KUIPER_CACHE": str(tmp_path / "cache")}))
    assert not list((tmp_path / "cache").rglob("*.bin"))  # nothing half-exported is left in the cache
    _one_line_error(run_cli("export", tmp_path, "-o", tmp_path / "o.bin"), match="config.json")
    _one_line_error(run_cli("generate", "-m", tiny_bin, "-p", "x", "--top-p", "2", "--device", "cpu"),
                    match="--top-p")
    _one_line_error(run_cli("generate", "-m", tiny_bin, "-p", "one two three four five six", "--raw",
                            "--max-context", "3", "--device", "cpu"), match="does not fit")
    nonutf = tmp_path / "p.txt"
    nonutf.write_bytes(b"caf\xe9")
    _one_line_error(run_cli("generate", "-m", tiny_bin, "-f", nonutf, "--device", "cpu"), match="UTF-8")
    _one_line_error(run_cli("generate", "-m", tiny_bin, "--device", "cpu"), match="-p/--prompt")
    _one_line_error(run_cli("bench", "-m", tiny_bin, "-p", "x"), match="comma-separated")
    _one_line_error(run_cli("info", bad, "--bogus-flag"))
    d = tmp_path / "damaged.bin"
    raw = bytearray(tiny_bin.read_bytes())
    raw[4096] ^= 1
    d.write_bytes(bytes(raw))
    _one_line_error(run_cli("info", d, "--verify"), match="checksum mismatch")


def test_generation_reaching_context_stops_cleanly(tiny_bin):
    r = run_cli("generate", "-m", tiny_bin, "-p", "a b c", "--raw", "--temp", "0", "-n", 50, "--max-context", 8,
                "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["finish_reason"] == "context" and "context limit" in r.stderr
    assert rec["prompt_tokens"] + len(rec["tokens"]) == 9  # 8 positions evaluated, the last sampled token not


def test_model_option_takes_a_hugging_face_directory(tiny_bin, tiny_dir, tmp_path):
    """-m DIR exports the checkpoint once into $KUIPER_CACHE and generates from it the tokens the exported file
    gives; a second run reuses the cached file (no second export)."""
    env = {"KUIPER_CACHE": str(tmp_path / "cache")}
    want = run_cli("generate", "-m", tiny_bin, "-p", "hi", "-n", "8", "--temp", "0", "--json")
    first = run_cli("generate", "-m", tiny_dir, "-p", "hi", "-n", "8", "--temp", "0", "--json", env=env)
    assert first.returncode == 0, first.stderr
    assert "exporting" in first.stderr
    assert json.loads(first.stdout)["tokens"] == json.loads(want.stdout)["tokens"]
    again = run_cli("generate", "-m", tiny_dir, "-p", "hi", "-n", "8", "--temp", "0", "--json", env=env)
    assert again.returncode == 0 and "exporting" not in again.stderr
    assert len(list((tmp_path / "cache").rglob("*.bin"))) == 1
