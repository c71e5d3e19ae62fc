"""Hostile inputs, resource limits, interrupts and long runs through the real CLI (issue: hardening)."""
import ctypes
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from conftest import child_env, run_cli
from test_cli import _one_line_error


def test_model_path_fifo_dev_zero_and_directory(tmp_path, tiny_dir):
    fifo = tmp_path / "pipe.bin"
    os.mkfifo(fifo)
    _one_line_error(run_cli("info", fifo, timeout=30), match="not a regular file")  # never blocks on open
    _one_line_error(run_cli("info", "/dev/zero", timeout=30), match="not a regular file")
    # a directory that is no checkpoint: -m exports directories, so the export's check says what is missing
    _one_line_error(run_cli("generate", "-m", tmp_path, "-p", "x", timeout=30,
                            env={"KUIPER_CACHE": str(tmp_path / "kc")}), match="config.json")


def _without_dac_override():
    """preexec_fn: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so even root's
    child obeys file modes (exec would restore them from the bounding set otherwise)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_unreadable_model(tiny_bin, tmp_path):
    p = tmp_path / "locked.bin"
    p.write_bytes(tiny_bin.read_bytes()[:1000])
    p.chmod(0)
    env = child_env()
    cmd = [sys.executable, "-m", "kuiper_py"]
    try:
        probe = subprocess.run(["cat", str(p)], capture_output=True, preexec_fn=_without_dac_override)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot drop the file-permission override here: {e}")
    if probe.returncode == 0:
        pytest.skip("this process reads files whatever their mode (capabilities could not be dropped)")
    r = subprocess.run(cmd + ["info", str(p)], capture_output=True, text=True, timeout=60, env=env,
                       preexec_fn=_without_dac_override)
    _one_line_error(r, match="is not readable")


def _export_limited(src, out, limit):
    def lim():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    env = child_env()
    return subprocess.run([sys.executable, "-m", "kuiper_py", "export", str(src), "-o", str(out), "-q"],
                          capture_output=True, text=True, timeout=300, env=env, preexec_fn=lim)


def test_export_disk_full_leaves_nothing(untied_dir, tmp_path):
    out = tmp_path / "out" / "m.bin"
    out.parent.mkdir()
    r = _export_limited(untied_dir, out, 10 << 20)  # a 10 MiB file-size limit stands in for a full disk
    _one_line_error(r, code=3, match="disk full or file too large")
    assert list(out.parent.iterdir()) == []


def test_export_output_directory_problems(untied_dir, tmp_path):
    f = tmp_path / "plainfile"
    f.write_text("x")
    _one_line_error(run_cli("export", untied_dir, "-o", f / "m.bin"), match="does not exist")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    _one_line_error(run_cli("export", untied_dir, "-o", ro / "m.bin", preexec_fn=_without_dac_override),
                    match="cannot write")
    assert list(ro.iterdir()) == []


def _spawn(*args):
    env = child_env()
    return subprocess.Popen([sys.executable, "-m", "kuiper_py", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)


def test_ctrl_c_during_decode_prints_text_and_stats(tiny_bin):
    p = _spawn("generate", "-m", tiny_bin, "-p", "Once upon a time", "--raw", "--temp", "0", "-n", 100000,
               "--max-context", 4096, "--device", "cpu")
    first = p.stdout.read(8)  # some text has streamed: we are in the decode loop
    assert first
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    err = err.decode()
    assert "Traceback" not in err and "finish: interrupted" in err and "tok/s" in err
    assert len(first + out) > 8


def test_ctrl_c_during_prefill(tiny_bin):
    prompt = " ".join(f"word{i}" for i in range(3000))
    p = _spawn("generate", "-m", tiny_bin, "-p", prompt, "--raw", "-n", 4, "--device", "cpu", "-v")
    deadline = time.time() + 60
    buf = b""
    while b"prompt:" not in buf and time.time() < deadline:
        buf += p.stderr.read1(4096)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130
    assert b"Traceback" not in buf + err and b"interrupted" in buf + err


def test_tokenizer_larger_than_model_vocab_is_refused(tiny_bin, tmp_path):
    import json
    from kuiper_py import format as fmt
    b = bytearray(tiny_bin.read_bytes())
    h = fmt.Header.unpack(bytes(b[:256]))
    h.vocab_size = 1000  # fewer embedding rows than the tokenizer's 151669 tokens
    body_end = h.weights_end
    trailer = b[fmt.Header.unpack(bytes(b[:256])).trailer_offset:]
    keep = bytes(b[256:256 + body_end - 256])
    h.trailer_offset, h.trailer_length, h.flags = body_end, len(trailer), 0
    p = tmp_path / "small_vocab.bin"
    p.write_bytes(h.pack() + keep + bytes(trailer))
    json.loads(bytes(trailer))
    _one_line_error(run_cli("generate", "-m", p, "-p", "hi", "--device", "cpu"), match="only 1000 embeddings")


def test_soak_cpu_memory_is_flat(tiny_bin):
    """One process, many generations: resident memory must not grow after the first runs."""
    from kuiper_py.generate import Engine, generate
    from kuiper_py.sampling import SamplingParams

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    eng = Engine.load(tiny_bin, "cpu")
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1)
    sizes = []
    for run in range(12):
        for _ in generate(eng, eng.tokenizer.encode("Tell me about the sea"), 48, p, max_context=64):
            pass
        sizes.append(rss())
    growth = sizes[-1] - sizes[2]
    assert growth < 0.01 * sizes[2] + (1 << 20), sizes


def test_tokenizer_much_smaller_than_model_vocab_is_refused(tiny_bin, tmp_path):
    import json
    from tokenizers import Tokenizer, models
    from kuiper_py import format as fmt
    b = tiny_bin.read_bytes()
    h = fmt.Header.unpack(b[:256])
    trailer = json.loads(b[h.trailer_offset:])
    small = Tokenizer(models.WordLevel({f"w{i}": i for i in range(500)}, unk_token="w0"))
    trailer["tokenizer"] = small.to_str()
    t = json.dumps(trailer).encode()
    h.trailer_length, h.flags = len(t), 0
    p = tmp_path / "small_tok.bin"
    p.write_bytes(h.pack() + b[256:h.trailer_offset] + t)
    _one_line_error(run_cli("generate", "-m", p, "-p", "w1", "--device", "cpu"), match="only 500 tokens")


@pytest.mark.skipif(open("/proc/sys/vm/overcommit_memory").read().strip() == "1",
                    reason="with unconditional overcommit a huge allocation does not fail up front")
def test_kv_cache_too_large_for_host_memory(tmp_path):
    from kuiper_py import synth
    from kuiper_py.export import export
    d = synth.make_checkpoint(tmp_path / "ck", "tiny", seed=4, n_shards=1, max_position_embeddings=2**30)
    export(d, tmp_path / "m.bin", progress=False, log=lambda m: None)
    r = run_cli("generate", "-m", tmp_path / "m.bin", "-p", "hi", "--max-context", 2**30, "--device", "cpu")
    _one_line_error(r, code=3, match="KV cache needs")
    assert "--max-context" in r.stderr


@pytest.mark.gpu
def test_kv_cache_too_large_for_gpu_memory(tmp_path):
    pytest.importorskip("cupy")
    from kuiper_py import synth
    from kuiper_py.export import export
    d = synth.make_checkpoint(tmp_path / "ck", "tiny", seed=4, n_shards=1, max_position_embeddings=2**30)
    export(d, tmp_path / "m.bin", progress=False, log=lambda m: None)
    r = run_cli("generate", "-m", tmp_path / "m.bin", "-p", "hi", "--max-context", 2**30, "--device", "cuda")
    _one_line_error(r, code=3, match="KV cache needs")
