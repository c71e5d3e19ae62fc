"""`kuiper serve`'s batching settings (--gpu-memory-utilization, --max-num-batched-tokens, --chunked-prefill-size,
--enable-prefix-caching/--no-enable-prefix-caching) on the CPU with the tiny synthetic model: refused in one line
before anything loads where out of range or where requests run one at a time; in force on a server that batches
(its ready line says so); prefix-cache hits counted on /metrics, and none with caching off; tools/bench_serve.py
--shared-prefix against such a server."""
import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from conftest import ROOT, child_env, run_cli

CTX = 512
VOCAB = 151643  # the ordinary (non-special) token ids


def _start(model, *extra) -> tuple[subprocess.Popen, str, list[str]]:
    """A `kuiper serve` subprocess on a free port: (process, base URL, its stderr lines so far, still filling) once
    /health says 200 and the ready line is out."""
    env = child_env()
    p = subprocess.Popen([sys.executable, "-m", "kuiper_py", "serve", "-m", str(model), "--device", "cpu",
                          "--port", "0", "--max-context", str(CTX), *map(str, extra)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    lines = [p.stderr.readline()]
    m = re.search(r"http://127\.0\.0\.1:(\d+)", lines[0])
    assert m, lines[0] + p.stderr.read()
    threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True).start()
    url = f"http://127.0.0.1:{m.group(1)}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200 and any("ready on" in ln for ln in lines):
                return p, url, lines
        except httpx.TransportError:
            pass
        assert p.poll() is None, "the server died while loading:\n" + "".join(lines)
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


def _stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0
    assert p.stdout.read() == ""


@pytest.fixture(scope="module")
def cached(tiny_bin):
    """A batching server with every setting given, prefix caching on."""
    p, url, lines = _start(tiny_bin, "--max-num-seqs", 4, "--gpu-memory-utilization", 0.25,
                           "--max-num-batched-tokens", 40, "--chunked-prefill-size", 24, "--enable-prefix-caching")
    yield url, lines
    _stop(p)


@pytest.fixture(scope="module")
def uncached(tiny_bin):
    p, url, lines = _start(tiny_bin, "--max-num-seqs", 4, "--no-enable-prefix-caching")
    yield url, lines
    _stop(p)


def _one_error_line(r, *words) -> str:
    assert r.returncode != 0 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("kuiper: error: ")]
    assert len(errs) == 1, r.stderr
    assert "loading" not in r.stderr  # (refused before the model loads or a port is taken)
    for w in words:
        assert w in errs[0], (w, errs[0])
    return errs[0]


@pytest.mark.parametrize("args, words", [
    (["--max-num-seqs", 4, "--gpu-memory-utilization", 0], ["--gpu-memory-utilization 0", "(0, 1]"]),
    (["--max-num-seqs", 4, "--gpu-memory-utilization", 1.5], ["--gpu-memory-utilization 1.5"]),
    (["--max-num-seqs", 4, "--gpu-memory-utilization", -0.1], ["--gpu-memory-utilization -0.1"]),
    (["--max-num-seqs", 4, "--gpu-memory-utilization", "nan"], ["--gpu-memory-utilization nan"]),
    (["--max-num-seqs", 4, "--chunked-prefill-size", 0], ["--chunked-prefill-size 0"]),
    (["--max-num-seqs", 8, "--max-num-batched-tokens", 7], ["--max-num-batched-tokens 7", "--max-num-seqs 8"]),
    (["--gpu-memory-utilization", 0.5], ["--gpu-memory-utilization", "--max-num-seqs"]),
    (["--max-num-batched-tokens", 64, "--chunked-prefill-size", 16],
     ["--max-num-batched-tokens", "--chunked-prefill-size", "--max-num-seqs"]),
    (["--no-enable-prefix-caching"], ["--no-enable-prefix-caching", "--max-num-seqs"]),
])
def test_out_of_range_or_unbatched_settings_are_one_error_line(tmp_path, args, words):
    missing = tmp_path / "no-such-model.bin"  # (refused before the model is looked for)
    _one_error_line(run_cli("serve", "-m", missing, "--device", "cpu", "--port", 0, *args, timeout=60), *words)


def test_a_pool_too_small_for_one_sequence_names_the_setting(tiny_bin):
    r = run_cli("serve", "-m", tiny_bin, "--device", "cpu", "--port", 0, "--max-num-seqs", 2,
                "--gpu-memory-utilization", 1e-12, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and r.stdout == ""
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("kuiper: error: ")]
    assert len(errs) == 1 and "--gpu-memory-utilization" in errs[0], r.stderr
    assert r.returncode == 3  # (a resource limit: the exit code of running out of memory)


def _metric(url: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, flags=re.M)
    assert m, name
    return float(m.group(1))


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                   "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_settings_are_in_force_and_requests_are_served(cached):
    url, lines = cached
    ready = next(ln for ln in lines if "ready on" in ln)
    assert "batching up to 4 requests, 40 tokens a step, prefill chunks of 24" in ready, ready
    assert "prefix caching on" in ready
    blocks = int(re.search(r"a KV pool of (\d+) blocks of 16 positions", ready).group(1))
    assert blocks >= CTX // 16
    rng = np.random.default_rng()
    prompts = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in rng.integers(30, 90, size=5)]
    got = [None] * len(prompts)  # (five at once: four run, one waits; the long ones prefill 24 tokens a step)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _complete(url, prompts[i], 5)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, g in zip(prompts, got):
        assert g["usage"]["prompt_tokens"] == len(p) and g["usage"]["completion_tokens"] == 5


def _shared_prefix_pair(url: str, rng) -> tuple[float, float]:
    """Two requests in turn whose prompts share a 64-token prefix (4 whole blocks) and then differ: how much the
    prefix-cache counters grew (queries, hits)."""
    q0, h0 = _metric(url, "kuiper_prefix_cache_queries_total"), _metric(url, "kuiper_prefix_cache_hits_total")
    prefix = rng.integers(0, VOCAB, size=64).tolist()
    for first in rng.choice(VOCAB, size=2, replace=False).tolist():
        _complete(url, prefix + [first] + rng.integers(0, VOCAB, size=4).tolist(), 3)
    return (_metric(url, "kuiper_prefix_cache_queries_total") - q0,
            _metric(url, "kuiper_prefix_cache_hits_total") - h0)


def test_a_shared_prefix_counts_prefix_cache_hits(cached, uncached):
    rng = np.random.default_rng()
    queries, hits = _shared_prefix_pair(cached[0], rng)
    assert (queries, hits) == (2 * 64, 64)  # (each prompt looks up its 4 whole blocks; the second finds them)
    assert _shared_prefix_pair(uncached[0], rng) == (0, 0)
    assert "prefix caching off" in next(ln for ln in uncached[1] if "ready on" in ln)


def test_requests_one_at_a_time_count_the_prefix_they_reuse(tiny_bin):
    """--max-num-seqs 1: each request reuses the prefix it shares with the one before (the last prompt token always
    computed): queries count every prompt's tokens but its last, hits the 64 shared ones."""
    p, url, lines = _start(tiny_bin)
    try:
        assert "batching" not in next(ln for ln in lines if "ready on" in ln)
        assert _shared_prefix_pair(url, np.random.default_rng()) == (2 * 68, 64)
    finally:
        _stop(p)


def _bench(url: str, *args) -> dict:
    cmd = [sys.executable, str(ROOT / "tools" / "bench_serve.py"), "--base-url", url, "--json", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_bench_serve_shared_prefix(cached, uncached):
    """--shared-prefix 48: four requests of a common 48-token prefix and 8 tokens of their own each; on the caching
    server the later ones find the prefix's 3 whole blocks, on the other none do; after the default warm-up request
    (untimed, not counted) every timed one does."""
    url = cached[0]
    h0 = _metric(url, "kuiper_prefix_cache_hits_total")
    s = _bench(url, "-n", 4, "--max-concurrency", 1, "--input-len", 8, "--output-len", 3, "--shared-prefix", 48,
               "--warmup", 0, "--seed", 1)
    assert s["completed"] == 4 and s["failed"] == 0 and s["shared_prefix_len"] == 48 and s["input_len"] == 8
    assert s["total_input_tokens"] == 4 * (48 + 8) and s["total_output_tokens"] == 4 * 3
    assert s["ttft_ms"]["mean"] > 0 and s["warmup_requests"] == 0
    assert _metric(url, "kuiper_prefix_cache_hits_total") - h0 == 3 * 48
    h1 = _metric(url, "kuiper_prefix_cache_hits_total")
    w = _bench(url, "-n", 4, "--max-concurrency", 1, "--input-len", 8, "--output-len", 3, "--shared-prefix", 48,
               "--seed", 2)
    assert w["completed"] == 4 and w["warmup_requests"] == 1 and w["total_input_tokens"] == 4 * (48 + 8)
    assert _metric(url, "kuiper_prefix_cache_hits_total") - h1 == 4 * 48
    u = _bench(uncached[0], "-n", 2, "--input-len", 8, "--output-len", 2, "--shared-prefix", 48)
    assert u["completed"] == 2 and u["total_input_tokens"] == 2 * 56
    assert _metric(uncached[0], "kuiper_prefix_cache_hits_total") == 0
    plain = _bench(url, "-n", 2, "--input-len", 8, "--output-len", 2)
    assert plain["shared_prefix_len"] == 0 and plain["total_input_tokens"] == 16
    table = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_serve.py"), "--base-url", url, "-n", "2",
                            "--input-len", "4", "--output-len", "2", "--shared-prefix", "16"],
                           capture_output=True, text=True, timeout=300)
    assert table.returncode == 0 and re.search(r"shared prefix \(tokens\)\s+16", table.stdout), table.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_serve.py"), "--shared-prefix", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--shared-prefix" in bad.stderr and "Traceback" not in bad.stderr
