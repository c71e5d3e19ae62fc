"""Kernel launches through the driver (cuLaunchKernelEx through ctypes): programmatic dependent launch, thread-block
clusters, dynamic shared memory, occupancy queries and TMA descriptors."""
from __future__ import annotations

import ctypes
import struct

import numpy as np

from ... import env
from .device import current_device_id

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None

_CU_FNS: dict[str, object] = {}
_V, _I = ctypes.c_void_p, ctypes.c_int
_ARG_PACKS: dict[tuple, _ArgPack] = {}
_LAUNCH_CFGS: dict[tuple, _LaunchConfig] = {}
_TMAPS: dict[tuple, ctypes.Array] = {}


_PDL: dict[int, bool] = {}


def pdl_enabled() -> bool:
    """Programmatic dependent launch: Hopper or newer, unless KUIPER_PDL=0."""
    dev = current_device_id()
    if dev not in _PDL:
        _PDL[dev] = (env.pdl()
                     and int(cp.cuda.Device(dev).compute_capability) >= 90 and cu_launch_ex() is not None)
    return _PDL[dev]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("n_attrs", ctypes.c_uint)]


_CU_PROGRAMMATIC_STREAM_SERIALIZATION = 6


_CU_ARGTYPES = {  # the driver entry points called through ctypes (each returns a CUresult)
    "cuLaunchKernelEx": [ctypes.POINTER(_LaunchConfig), _V, ctypes.POINTER(_V), _V],
    "cuTensorMapEncodeTiled": [_V, _I, ctypes.c_uint, _V, _V, _V, _V, _V, _I, _I, _I, _I],
    "cuOccupancyMaxActiveClusters": [ctypes.POINTER(_I), _V, ctypes.POINTER(_LaunchConfig)],
    "cuFuncSetAttribute": [_V, _I, _I],
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": [ctypes.POINTER(_I), _V, _I, ctypes.c_size_t],
}


def cu_fn(name: str):
    """The driver entry point `name` (one of _CU_ARGTYPES), looked up once, or None where the driver
    lacks it (or there is no libcuda). Every launch_ex asks for cuLaunchKernelEx: one dict lookup."""
    f = _CU_FNS.get(name)
    if f is None and name not in _CU_FNS:
        try:
            f = getattr(ctypes.CDLL("libcuda.so.1"), name)
            f.argtypes, f.restype = _CU_ARGTYPES[name], ctypes.c_int
        except (OSError, AttributeError):
            f = None
        _CU_FNS[name] = f
    return f


def cu_launch_ex():
    """The driver's cuLaunchKernelEx (CuPy's launcher takes no launch attributes), or None."""
    return cu_fn("cuLaunchKernelEx")


class _ArgPack:
    """A kernel's parameters for one signature (the argument types, in order), each at its natural
    alignment in one buffer reused by every launch of that signature, with the kernelParams pointer
    array into it made once (the driver reads each parameter through its pointer, at the kernel's own
    offset and size for it). A launch then costs one struct.pack_into; a ctypes object per argument
    made the host side of a prefill layer slower than its kernels. The
    driver copies the parameters at launch (and into a graph node at capture), so the buffer can be
    refilled right after."""
    _PTR, _PLAIN, _BYTES = 0, 1, 2

    def __init__(self, args):
        fmt, off, offs, kinds = "=", 0, [], []
        for a in args:
            if isinstance(a, (ctypes.Array, ctypes.Structure)):  # a struct by value (TMA descriptor, DlArgs)
                size, align = ctypes.sizeof(a), ctypes.alignment(a)
                code, kind = f"{size}s", self._BYTES
            elif isinstance(a, cp.ndarray):
                size, align, code, kind = 8, 8, "Q", self._PTR
            elif isinstance(a, (np.int32, np.float32, np.uint64)):
                size = align = a.itemsize
                code, kind = {np.int32: "i", np.float32: "f", np.uint64: "Q"}[type(a)], self._PLAIN
            else:
                raise TypeError(f"kernel argument of type {type(a).__name__}")
            pad = -off % align
            fmt += f"{pad}x{code}" if pad else code
            offs.append(off + pad)
            kinds.append(kind)
            off += pad + size
        self.st = struct.Struct(fmt)
        self.buf = ctypes.create_string_buffer(max(off, 8))
        base = ctypes.addressof(self.buf)
        self.params = (ctypes.c_void_p * max(len(offs), 1))(*[base + o for o in offs])
        self.kinds = tuple(kinds)

    def pack(self, args):
        P, B = self._PTR, self._BYTES
        self.st.pack_into(self.buf, 0, *[a.data.ptr if k == P else bytes(a) if k == B else a
                                         for a, k in zip(args, self.kinds)])
        return self.params


def _remember(cache: dict, key, value):
    """cache[key] = value, the cache emptied first once it holds 4096 entries (the per-shape host
    caches of the launch path: a long-running process must not grow them without bound)."""
    if len(cache) >= 4096:
        cache.clear()
    cache[key] = value
    return value


def pdl_attr() -> _LaunchAttr:
    """The programmatic-stream-serialization launch attribute (PDL)."""
    attr = _LaunchAttr(_CU_PROGRAMMATIC_STREAM_SERIALIZATION, 0)
    attr.value[0] = 1
    return attr


class PdlKernel:
    """A kernel launched through cuLaunchKernelEx with the programmatic-stream-serialization
    attribute (captured into CUDA graphs as a programmatic edge); same call form as CuPy's."""

    def __init__(self, fn):
        self.ptr = getattr(fn, "kernel", fn).ptr  # RawKernel -> its CUfunction (its module stays in _MODULES)
        self.attr = pdl_attr()

    def __call__(self, grid, block, args, shared_mem: int = 0):
        launch_ex(self.ptr, grid, block, args, smem=shared_mem, attr=self.attr)


def launch_ex(fn, grid, block, args, smem: int = 0, attr=None):
    """Launch a kernel (a RawKernel or a CUfunction handle) through cuLaunchKernelEx, with launch
    attributes (one _LaunchAttr, a ctypes array of them, or None): CuPy's launcher takes no attributes
    (PDL, cluster dimensions) and cannot pass a struct by value (a __grid_constant__ TMA descriptor)."""
    sig = tuple(map(type, args))
    pack = _ARG_PACKS.get(sig)
    if pack is None:
        pack = _ARG_PACKS[sig] = _ArgPack(args)
    params = pack.pack(args)
    ptr = fn if isinstance(fn, int) else getattr(fn, "kernel", fn).ptr
    stream = cp.cuda.get_current_stream().ptr
    key = (tuple(grid), tuple(block), smem, stream, id(attr))
    cfg = _LAUNCH_CFGS.get(key)
    if cfg is None:  # configurations repeat (a prefill's layers): made once, each holding its attribute
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        cfg = _launch_config(grid, block, smem, stream, attr)
        _remember(_LAUNCH_CFGS, key, cfg)
    err = cu_launch_ex()(ctypes.byref(cfg), ptr, params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")


def _launch_config(grid, block, smem: int, stream: int, attr) -> _LaunchConfig:
    """A CUlaunchConfig holding its attributes (one _LaunchAttr, an array of them, or None)."""
    if attr is None:
        ptr, n = None, 0
    elif isinstance(attr, ctypes.Array):
        ptr, n = ctypes.cast(attr, ctypes.POINTER(_LaunchAttr)), len(attr)
    else:
        ptr, n = ctypes.pointer(attr), 1
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem, stream, ptr, n)
    cfg.keep = attr
    return cfg


def _cu_tmap_encode():
    """The driver's cuTensorMapEncodeTiled (CUDA 12.0+), or None."""
    return cu_fn("cuTensorMapEncodeTiled")


def tmap_encode(dtype: int, ptr: int, dims, strides, box):
    """cuTensorMapEncodeTiled into a new 128-byte map: CUtensorMapDataType dtype, dims innermost first, byte
    strides of the outer dims, box sizes; element strides 1, interleave none, the 128-byte swizzle, L2
    promotion 128B, out-of-bounds elements filled with zeros."""
    n = len(dims)
    m = (ctypes.c_uint64 * 16)()
    d, st = (ctypes.c_uint64 * n)(*dims), (ctypes.c_uint64 * (n - 1))(*strides)
    bx, el = (ctypes.c_uint32 * n)(*box), (ctypes.c_uint32 * n)(*([1] * n))
    err = _cu_tmap_encode()(ctypes.addressof(m), dtype, n, ptr, ctypes.addressof(d), ctypes.addressof(st),
                          ctypes.addressof(bx), ctypes.addressof(el), 0, 3, 2, 0)
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err}")
    return m


def tma_map_2d(a, box_rows: int, box_cols: int):
    """A CUtensorMap (128 bytes, for a __grid_constant__ TmaDesc) of the fp16 matrix a [rows, cols]
    (row stride a multiple of 16 bytes): boxes of box_rows x box_cols with the 128-byte swizzle
    (box_cols * 2 == 128), rows past the end zero-filled. Kept per (address, shape, stride, box):
    a prefill's activation buffers come back from the pool at the same addresses."""
    key = (current_device_id(), a.data.ptr, a.shape, a.strides, box_rows, box_cols)
    m = _TMAPS.get(key)
    if m is not None:
        return m
    assert a.dtype == cp.float16 and a.strides[1] == 2 and a.strides[0] % 16 == 0 and a.data.ptr % 16 == 0
    assert box_cols * 2 == 128
    # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6
    return _remember(_TMAPS, key, tmap_encode(6, a.data.ptr, (a.shape[1], a.shape[0]), (a.strides[0],),
                                              (box_cols, box_rows)))


def tma_map_cache(c, n: int):
    """A CUtensorMap of the first n rows of every layer of a KV cache c [L, ctx, KV, hd] (fp16, contiguous) as
    [L][n][KV*hd], boxes of 64 rows x 64 columns of one layer with the 128-byte swizzle, rows past n zero-filled
    (flash_attn_wgmma's K and V). One map per cache and length serves every layer: a map per layer made a prefill
    of a length not seen before encode 2 L of them."""
    key = (current_device_id(), c.data.ptr, c.shape, n)
    m = _TMAPS.get(key)
    if m is not None:
        return m
    L, ctx, KV, hd = c.shape
    W = KV * hd
    assert c.dtype == cp.float16 and c.flags.c_contiguous and c.data.ptr % 16 == 0 and 0 < n <= ctx and W % 64 == 0
    return _remember(_TMAPS, key, tmap_encode(6, c.data.ptr, (W, n, L), (W * 2, ctx * W * 2), (64, 64, 1)))


def tma_map_words(qw, wg: int):
    """A CUtensorMap of a tiled qweight (int32, contiguous; common.cuh's layout, whole 32-word tiles) as
    [row quads][4 quarters][32 words] (a quarter: 8 words x 4 rows, 128 bytes), boxes of 32 x wg x 16 (the quarters
    of wg consumer warpgroups over one 64-k tile) with the 128-byte swizzle, for gemm_moe_rs."""
    key = (current_device_id(), qw.data.ptr, qw.size, wg)
    m = _TMAPS.get(key)
    if m is not None:
        return m
    assert qw.dtype == cp.int32 and qw.flags.c_contiguous and qw.size % 128 == 0 and qw.data.ptr % 16 == 0
    # CU_TENSOR_MAP_DATA_TYPE_UINT32 = 2
    return _remember(_TMAPS, key, tmap_encode(2, qw.data.ptr, (32, 4, qw.size // 128), (128, 512), (32, wg, 16)))


_DYN_SMEM: dict[int, int] = {}


def allow_dynamic_smem(fn, nbytes: int) -> None:
    """Lets kernel fn (a RawKernel or CuPy Function) launch with nbytes of dynamic shared memory: past 48 KB the
    driver wants the size asked for. The attribute is set (and read) once per kernel and size, not per launch."""
    ptr = getattr(fn, "kernel", fn).ptr
    if _DYN_SMEM.get(ptr, -1) >= nbytes:
        return
    if fn.max_dynamic_shared_size_bytes < nbytes:
        fn.max_dynamic_shared_size_bytes = nbytes
    _DYN_SMEM[ptr] = nbytes  # (past the early return: more than any size set before)


def blocks_per_sm(fn, threads: int, smem: int = 0) -> int:
    """How many blocks of kernel fn (threads each, smem bytes of dynamic shared memory) fit on one SM by
    the driver's occupancy calculator, or -1 where it cannot say."""
    occ = cu_fn("cuOccupancyMaxActiveBlocksPerMultiprocessor")
    if occ is None:
        return -1
    n = ctypes.c_int(0)
    return -1 if occ(ctypes.byref(n), getattr(fn, "kernel", fn).ptr, threads, smem) else n.value


_CU_FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


_CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY = 5


def cu_occupancy_clusters():
    """The driver's cuOccupancyMaxActiveClusters, or None."""
    return cu_fn("cuOccupancyMaxActiveClusters")


def resident_clusters(fn, CL: int, n: int, threads: int, smem: int = 0) -> int:
    """How many clusters of CL blocks (threads each, smem bytes of dynamic shared memory) of kernel fn can be
    resident at once (the GPU's GPCs bound it: an H100 holds 62 clusters of 8 of ffn_decode's blocks), or 0 where the driver refuses the size.
    n: the clusters of the launch."""
    ptr = getattr(fn, "kernel", fn).ptr
    if smem:
        allow_dynamic_smem(fn, smem)
    if CL > 8 and not allow_nonportable_clusters(fn):
        return 0
    cfg = _launch_config((CL, n, 1), (threads, 1, 1), smem, 0, _cluster_attr(CL))
    k = ctypes.c_int(0)
    err = cu_occupancy_clusters()(ctypes.byref(k), ptr, ctypes.byref(cfg))
    return 0 if err else k.value


def allow_nonportable_clusters(fn) -> bool:
    """Lets kernel fn launch clusters of more than 8 blocks: Hopper has 16-block clusters, but they are
    "non-portable" and the driver wants them asked for. False where the driver refuses."""
    set_attr = cu_fn("cuFuncSetAttribute")
    ptr = getattr(fn, "kernel", fn).ptr
    return set_attr is not None and not set_attr(ptr, _CU_FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)


def _cluster_policy_attr(policy: int) -> _LaunchAttr:
    """The cluster scheduling policy preference: 0 the driver's default, 1 spread, 2 load balancing."""
    attr = _LaunchAttr(_CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY, 0)
    attr.value[0] = policy
    return attr


def _cluster_attr(CL: int) -> _LaunchAttr:
    attr = _LaunchAttr(_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, 0)
    attr.value[0] = CL | (1 << 32)  # {x, y, z} = {CL, 1, 1} as three uint32
    attr.value[1] = 1
    return attr
