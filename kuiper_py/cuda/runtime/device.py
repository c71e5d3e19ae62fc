"""Device queries: which GPU this is, its attributes and memory, read once per device, and the copy bandwidth the
benchmarks divide by."""
from __future__ import annotations

from ...errors import KuiperError

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


def cuda_available() -> bool:
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


def check_device() -> None:
    if not cuda_available():
        raise KuiperError("--device cuda: no CUDA GPU is visible (use --device cpu)")
    major, minor = cp.cuda.Device().compute_capability[:-1], cp.cuda.Device().compute_capability[-1]
    if int(major) < 8:
        raise KuiperError(f"GPU compute capability {major}.{minor} is below 8.0 (cp.async, ldmatrix and "
                          f"mma.sync need Ampere or newer)")


def gpu_name() -> str:
    """The current device's name: device_name()'s cached value (the name the tools' JSON records)."""
    return device_name()


_COPY16 = r'''
extern "C" __global__ void copy16(const float4* __restrict__ a, float4* __restrict__ b, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        b[i] = a[i];
}'''


def copy_bandwidth(reps: int = 10) -> dict:
    """The device copy bandwidth (GB/s, read + write bytes) every benchmark ratio divides by: cudaMemcpy
    device-to-device and a 16-byte-per-thread copy kernel over 1 GiB, and the better of the two."""
    n = 1 << 28  # floats: 1 GiB per buffer
    a, b = cp.ones(n, cp.float32), cp.empty(n, cp.float32)
    k = cp.RawKernel(_COPY16, "copy16")
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


def gpu_memory_used_mib() -> float:
    """Device memory this process holds through CuPy's pool (weights, KV cache, workspace)."""
    return cp.get_default_memory_pool().total_bytes() / 2**20


_OPTIN: dict[int, int] = {}


def smem_optin() -> int:
    """The current device's most shared memory per block with the opt-in (cudaDevAttrMaxSharedMemoryPerBlockOptin)."""
    dev = current_device_id()
    if dev not in _OPTIN:
        _OPTIN[dev] = cp.cuda.runtime.deviceGetAttribute(97, dev)
    return _OPTIN[dev]


def current_device_id() -> int:
    """The current device's ordinal (the runtime call; building a cupy Device object per launch showed up
    in prefill's host time)."""
    return cp.cuda.runtime.getDevice()


_DEV_ATTRS: dict[int, dict] = {}


_DEV_NAMES: dict[int, str] = {}


def device_attrs() -> dict:
    """The current device's attributes, read once (Device.attributes reads every attribute, too slow
    for a per-launch call)."""
    dev = current_device_id()
    if dev not in _DEV_ATTRS:
        _DEV_ATTRS[dev] = cp.cuda.Device(dev).attributes
    return _DEV_ATTRS[dev]


def sm_count() -> int:
    """Streaming multiprocessors of the current device."""
    return device_attrs()["MultiProcessorCount"]


def device_name() -> str:
    """The current device's name ("NVIDIA H200", "NVIDIA H100 80GB HBM3"), read once."""
    dev = current_device_id()
    if dev not in _DEV_NAMES:
        name = cp.cuda.runtime.getDeviceProperties(dev)["name"]
        _DEV_NAMES[dev] = name.decode() if isinstance(name, bytes) else str(name)
    return _DEV_NAMES[dev]
