"""tools/compile_kernels.py: every registered kernel instantiation compiles with nvcc for sm_90a and sm_80 on a CPU
machine (skipped where the CUDA toolkit is missing); a broken kernel source fails it."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "compile_kernels.py"

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA toolkit's nvcc")


def _run(*args):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=1800)


def test_small_families_build_for_both_architectures(tmp_path):
    prints = tmp_path / "prints.json"
    r = _run("--family", "norm", "--family", "rope", "--family", "lmh", "--fingerprints", str(prints))
    assert r.returncode == 0, r.stderr
    assert "6 of 6 modules built" in r.stderr
    got = json.loads(prints.read_text())
    # each instantiation is a kernel of its own in the cubin: norm 2, rope 3, lm_head 1
    assert {arch: len(k) for arch, k in got.items()} == {"sm_90a": 6, "sm_80": 6}
    same = _run("--family", "rope", "--arch", "sm_80", "--compare", str(prints))
    assert same.returncode == 0 and "sm_80 changed" not in same.stdout


def test_a_broken_kernel_fails_the_build(tmp_path):
    kernels = tmp_path / "kernels_cu"
    shutil.copytree(ROOT / "kernels_cu", kernels)
    src = kernels / "rope.cu"
    src.write_text(src.read_text().replace("advance_position(int* pos", "advance_position(int* pos, undeclared_t x", 1))
    r = _run("--family", "rope", "--arch", "sm_80", "--kernels", str(kernels))
    assert r.returncode == 1 and "FAIL" in r.stderr and "undeclared_t" in r.stderr
    assert "0 of 1 modules built" in r.stderr


@pytest.mark.slow
def test_every_registered_kernel_builds():
    """Every module the product builds (about 3 minutes on 2 CPU cores)."""
    r = _run()
    assert r.returncode == 0, r.stderr
    assert "FAIL" not in r.stderr
