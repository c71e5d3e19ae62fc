"""The copy bandwidth the benchmarks divide by: the better of cudaMemcpy device-to-device and a
16-byte-per-thread copy kernel over 1 GiB, read + write bytes counted (device machine)."""
import cupy as cp

_COPY = r'''
extern "C" __global__ void copy16(const float4* __restrict__ a, float4* __restrict__ b, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        b[i] = a[i];
}'''


def copy_bandwidth(reps: int = 10) -> dict:
    n = 1 << 28  # floats: 1 GiB per buffer
    a, b = cp.ones(n, cp.float32), cp.empty(n, cp.float32)
    k = cp.RawKernel(_COPY, "copy16")
    n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    runs = {"memcpy": lambda: b.data.copy_from_device(a.data, a.nbytes),
            "kernel": lambda: k((n_sm * 8,), (512,), (a, b, cp.int64(n // 4)))}
    out = {}
    for name, fn in runs.items():
        fn()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        out[name] = 2 * a.nbytes * reps / (cp.cuda.get_elapsed_time(e0, e1) / 1e3) / 1e9
    out["best"] = max(out.values())
    return out
