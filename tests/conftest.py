"""Shared fixtures: synthetic checkpoints (built once per session, under pytest-xdist once per worker: tiny_dir,
untied_dir, moe_dir) and their exported ak48 files (tiny_bin, untied_bin, moe_bin). Tests read them; a test that damages
one works on copy_ckpt's copy."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# On a small host (CI's 2 cores) one BLAS / OpenMP thread per process, set before NumPy and torch load and inherited by
# the CLI and server subprocesses: the test models are tiny, and a thread per core in each of the test process and its
# subprocesses oversubscribes the host, where OpenBLAS's spinning threads made each lm_head product ~5x slower. Under
# pytest-xdist (-n) each worker takes its share of the cores. A value already in the environment (or -t/--threads in a
# CLI test) wins.
_CORES = os.cpu_count() or 1
_THREADS = 1 if _CORES <= 4 else max(1, _CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
if _THREADS < _CORES:
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(_THREADS))

# A run started in the background of a shell without job control (`cmd &` in a script) inherits SIGINT ignored, and so
# would every CLI it starts (an ignored signal stays ignored across exec), where the Ctrl-C tests need a terminal's
# Ctrl-C: a handler here is reset to the default in the children, whose Python then raises KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from kuiper_py import synth  # noqa: E402 (after the thread settings)
from kuiper_py.export import export  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _has_gpu() -> bool:
    try:
        from kuiper_py.ops_cupy import cuda_available
        return cuda_available()
    except Exception:
        return False


# The fast GPU tier, `pytest -m "gpu and not slow"`: every GPU test function runs, a parametrized one on two of its
# cases (the first and last of those the test has not marked slow itself: its heaviest shapes), the end-to-end and
# checkpoint-format files on their first case only; the other cases (the exhaustive shape sweeps) carry the `slow`
# mark: 205 s on an H200 with a warm kernel cache (a fresh machine compiles the kernels first).
FAST_CASES, FAST_CASES_BY_FILE = 2, {"test_gpu_e2e.py": 1, "test_gpu_formats.py": 1}


def slow_cases(values, slow) -> list:
    """A parametrize's (or a module fixture's) values with those in `slow` marked for the slow tier: the fast tier
    picks its cases among the rest (_mark_slow_sweeps)."""
    return [pytest.param(v, marks=pytest.mark.slow) if v in slow else v for v in values]


def _mark_slow_sweeps(items) -> None:
    """The `slow` mark on the GPU cases left out of the fast tier (see FAST_CASES)."""
    sweeps = {}
    for it in items:
        if "gpu" in it.keywords and getattr(it, "callspec", None) is not None:
            sweeps.setdefault((str(it.path), it.originalname), []).append(it)
    for (path, _), cases in sweeps.items():
        free = [it for it in cases if it.get_closest_marker("slow") is None]  # (not marked slow by the test)
        keep = min(len(free), FAST_CASES_BY_FILE.get(Path(path).name, FAST_CASES))
        picks = {round(i * (len(free) - 1) / (keep - 1)) for i in range(keep)} if keep > 1 else {0}
        for i, it in enumerate(free):
            if i not in picks:
                it.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # (before -m deselects by mark)
def pytest_collection_modifyitems(config, items):
    _mark_slow_sweeps(items)
    if _has_gpu() and not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    # (under pytest-xdist, as the CPU suite runs, several workers would share one GPU: its tests run without -n)
    skip = pytest.mark.skip(reason="GPU tests run without -n" if _has_gpu() else "needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session")
def tiny_dir(ckpt_root):
    """Tied embeddings (like Qwen3-0.6B), 2 shards."""
    return synth.make_checkpoint(ckpt_root / "tiny", "tiny", seed=1, n_shards=2)


@pytest.fixture(scope="session")
def untied_dir(ckpt_root):
    """Separate lm_head (like Qwen3-8B), single file."""
    return synth.make_checkpoint(ckpt_root / "untied", "tiny-untied", seed=2, n_shards=1)


@pytest.fixture(scope="session")
def moe_dir(ckpt_root):
    """Qwen3-MoE (tiny-moe: every layer sparse, 8 experts, 2 per token), 2 shards."""
    return synth.make_checkpoint(ckpt_root / "moe", "tiny-moe", seed=11, n_shards=2)


@pytest.fixture(scope="session")
def small_dense_bin(ckpt_root):
    """Two layers of Qwen3-0.6B: shapes the fused Hopper GEMMs take (the tiny files' are too narrow)."""
    out = ckpt_root / "da-0.6b.bin"
    d = synth.make_checkpoint(ckpt_root / "da-0.6b", "0.6b", seed=7, n_shards=1, layers=2)
    export(d, out, progress=False, log=lambda m: None)
    return out


@pytest.fixture(scope="session")
def tiny_bin(tiny_dir, ckpt_root):
    out = ckpt_root / "tiny.bin"
    export(tiny_dir, out, progress=False, log=lambda m: None)
    return out


@pytest.fixture(scope="session")
def untied_bin(untied_dir, ckpt_root):
    out = ckpt_root / "untied.bin"
    export(untied_dir, out, progress=False, log=lambda m: None)
    return out


@pytest.fixture(scope="session")
def moe_bin(moe_dir, ckpt_root):
    out = ckpt_root / "moe.bin"
    export(moe_dir, out, progress=False, log=lambda m: None)
    return out


@pytest.fixture
def copy_ckpt(tmp_path):
    """A fresh writable copy of a checkpoint directory, for tests that damage it."""
    def _copy(src):
        dst = tmp_path / ("ck_" + Path(src).name)
        shutil.copytree(src, dst)
        return dst
    return _copy


def child_env(**extra) -> dict:
    """The environment of a CLI or server subprocess: this one's, with the checkout first on PYTHONPATH (the
    entries already there kept: packages installed with `pip --target` stay importable) and `extra` on top."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def run_cli(*args, input=None, timeout=300, env=None, preexec_fn=None):
    """Run the real CLI as a subprocess; returns CompletedProcess with text stdout/stderr."""
    return run_python("-m", "kuiper_py", *args, input=input, timeout=timeout, env=env, preexec_fn=preexec_fn)


def run_python(*args, input=None, timeout=300, env=None, preexec_fn=None, cwd=None):
    """Run a fresh Python (`-c CODE ...`, `-m MODULE ...`) with the checkout on its path; CompletedProcess with text
    stdout/stderr."""
    e = child_env(**(env or {}))
    return subprocess.run([sys.executable, *map(str, args)], input=input, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=e, preexec_fn=preexec_fn)
