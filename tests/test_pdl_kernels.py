"""The kernels launched with programmatic dependent launch (runtime registry PDL_KERNELS) each wait for the kernel
before them (pdl_wait, directly or through a __device__ helper) before they end: a PDL kernel may start while its
predecessor still runs, and "finished" is transitive down the stream only if every PDL kernel waits (common.cuh).
A check of the sources against the registry on the CPU; the GPU tests run the kernels."""
import re
from pathlib import Path

import pytest

from kuiper_py.cuda.runtime.registry import PDL_KERNELS

KERNELS = Path(__file__).resolve().parents[1] / "kernels_cu"


def _body(src: str, start: int) -> str:
    """The braces-balanced body of the function whose parameter list starts at or after start."""
    i = src.index("{", src.index(")", start))
    depth = 0
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            return src[i:j + 1]
    raise ValueError("unbalanced braces")


def _waits(src: str, name: str) -> bool | None:
    """Whether every __global__ definition of name in src calls pdl_wait() or a __device__ function of src that does;
    None where src defines no such kernel."""
    helpers = {m.group(1) for m in re.finditer(r"__device__[^;{(]*?\b(\w+)\s*\(", src)
               if "pdl_wait()" in _body(src, m.end()) and m.group(1) != "pdl_wait"}
    calls = re.compile(r"\b(" + "|".join(map(re.escape, ["pdl_wait", *sorted(helpers)])) + r")\s*(<[^;(]*?>)?\s*\(")
    bodies = [_body(src, m.end()) for m in re.finditer(r"__global__[^;{]*?\b" + re.escape(name) + r"\s*\(", src)]
    return all(calls.search(b) for b in bodies) if bodies else None


def _sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(KERNELS.glob("*.cu*"))}


@pytest.mark.parametrize("name", sorted({n.split("<")[0] for n in PDL_KERNELS}))
def test_every_pdl_kernel_waits_for_the_one_before(name):
    found = {f: w for f, s in _sources().items() if (w := _waits(s, name)) is not None}
    assert found, f"{name}: in PDL_KERNELS but no kernels_cu source defines it"
    assert all(found.values()), f"{name} is launched with PDL but does not call pdl_wait() ({found})"


def test_the_check_fails_for_a_kernel_that_does_not_wait():
    src = (KERNELS / "norm.cu").read_text()
    assert _waits(src, "add_rmsnorm") is True
    assert _waits(src.replace("pdl_wait();", ";"), "add_rmsnorm") is False
    assert _waits(src, "no_such_kernel") is None
    moe = (KERNELS / "moe.cu").read_text()  # (moe_route_mma waits inside its __device__ helper)
    assert _waits(moe, "moe_route_mma") is True
    assert _waits(moe.replace("pdl_wait();", ";"), "moe_route_mma") is False
