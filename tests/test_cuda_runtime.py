"""The launch machinery (cuda/runtime/launch.py; spread_smem in cuda/ops/gemv.py) on real kernels (device
machine only): programmatic dependent launch in a captured graph, launch_ex's parameter layout, spread_smem's
occupancy cap.

Every output is poisoned with NaN before the kernel runs, so an element the kernel fails to write
fails the comparison; inputs are fresh random draws on every run.
"""
import ctypes
import os

import numpy as np
import pytest

from reference import rel

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")
from cuda_common import (nan_like, rand_awq, replay_with_fresh_residual,  # noqa: E402 (after the module-level skip)
                         rmsnorm_ref)


def test_pdl_chain_of_dependent_kernels_in_a_graph():
    """The decode pattern (GEMV -> residual add + RMSNorm -> GEMV ...) captured in one graph and replayed:
    with programmatic dependent launch each kernel starts before its predecessor ends, so a missing
    wait would read stale activations. Checked against NumPy on every replay."""
    if int(cp.cuda.Device().compute_capability) >= 90 and os.environ.get("KUIPER_PDL", "1") != "0":
        assert isinstance(oc.kernel("gemv", oc.gemv_name(False)), oc.PdlKernel)
        assert isinstance(oc.kernel("norm", "add_rmsnorm"), oc.PdlKernel)
    rng = np.random.default_rng()
    D, eps = 4096, 1e-6
    mats = [rand_awq(rng, D, D) for _ in range(6)]
    w = rng.random(D).astype(np.float16) + np.float16(0.5)
    h_dev, x_dev, y_dev = cp.empty((1, D), cp.float32), cp.empty((1, D), cp.float16), cp.empty((1, D), cp.float16)
    w_dev, h0_dev = cp.asarray(w), cp.empty((1, D), cp.float32)
    partial = cp.empty((oc.gemv_partial_size(D, [D]),), cp.float32)
    stream = cp.cuda.Stream(non_blocking=False)
    with stream:
        stream.begin_capture()
        h_dev[...] = h0_dev
        oc.add_rmsnorm(h_dev, None, w_dev, eps, x_dev)
        for m, _ in mats:
            oc.gemv(x_dev, [m], "plain", y_dev, partial)
            oc.add_rmsnorm(h_dev, y_dev, w_dev, eps, x_dev)
        graph = stream.end_capture()

    for _ in range(3):
        h = replay_with_fresh_residual(rng, graph, stream, h0_dev, x_dev)
        x = rmsnorm_ref(h, w, eps)
        for _, r in mats:
            h = h + (x @ r).astype(np.float16)
            x = rmsnorm_ref(h, w, eps)
        assert rel(cp.asnumpy(x_dev)[0], x) < 1e-2
    assert int(cp.count_nonzero(oc.gemv_counters())) == 0


@pytest.mark.parametrize("name,threads,blocks_per_sm", [("attn_decode_gqa<128,4>", 128, 2), ("attn_decode_gqa<128,4>", 128, 3),
                                                         ("attn_decode_gqa<128,2>", 128, 1), ("attn_decode_gqa<64,1>", 128, 5)])
def test_spread_smem_caps_blocks_per_sm(name, threads, blocks_per_sm):
    """spread_smem's pad lets exactly ceil(blocks / SMs) blocks sit on an SM (the driver's occupancy
    calculator, asked independently here), and none where the registers already cap it lower."""
    fn = oc.raw_kernel("attn", name)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    occ = oc.cu_fn("cuOccupancyMaxActiveBlocksPerMultiprocessor")

    def fit(smem):
        n = ctypes.c_int(-1)
        assert occ(ctypes.byref(n), fn.kernel.ptr, threads, smem) == 0
        return n.value

    blocks = sms * blocks_per_sm - sms // 2  # a partial last row: ceil gives blocks_per_sm
    pad = oc.spread_smem("attn", name, blocks, threads)
    if fit(0) <= blocks_per_sm:
        assert pad == 0
    else:
        assert pad > 0 and fit(pad) == blocks_per_sm


_ARGS_PROBE = r"""
struct alignas(64) Desc { unsigned long long v[16]; };
extern "C" __global__ void args_probe(int a, const float* p, float f, const __grid_constant__ Desc d,
                                      unsigned long long u, int b, double* out) {
    out[0] = a; out[1] = (double)(unsigned long long)p; out[2] = f;
    for (int i = 0; i < 16; ++i) out[3 + i] = (double)d.v[i];
    out[19] = (double)u; out[20] = b;
}
"""


@pytest.mark.parametrize("attr", [False, True])
def test_launch_ex_parameter_layout(attr):
    """launch_ex packs a signature's parameters into one reused buffer: a kernel taking an int, a
    pointer, a float, a 64-byte aligned struct by value (as the TMA descriptor is: the kernel's offset
    for it is padded) and a uint64 and int after it reads back every value, launch after launch with
    fresh values (the buffer is refilled), with and without a launch attribute."""
    if oc.cu_launch_ex() is None:
        pytest.skip("no cuLaunchKernelEx")
    fn = cp.RawModule(code=_ARGS_PROBE, options=("--std=c++17",)).get_function("args_probe")
    rng = np.random.default_rng()
    for _ in range(3):
        a, b = (int(v) for v in rng.integers(-2**31, 2**31, 2))
        f, u = float(np.float32(rng.standard_normal())), int(rng.integers(0, 2**52))
        p = cp.empty((7,), cp.float32)
        vals = [int(v) for v in rng.integers(0, 2**52, 16)]
        desc = (ctypes.c_uint64 * 16)(*vals)  # what tma_map_2d returns
        out = nan_like((21,), cp.float64)
        oc.launch_ex(fn, (1,), (1,), (np.int32(a), p, np.float32(f), desc, np.uint64(u), np.int32(b), out),
                     attr=oc.pdl_attr() if attr else None)
        want = [a, p.data.ptr, f, *vals, u, b]
        assert out.get().tolist() == [float(v) for v in want]
