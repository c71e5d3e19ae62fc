"""Kernel builds: NVRTC compiles through CuPy (cached on disk by CuPy), built side by side in worker threads while
the weights upload (precompile), and the lookups that hand a compiled kernel to a launch."""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path

from ... import env
from ...config import ModelArgs
from ...errors import KuiperError
from . import device as _device
from .device import current_device_id
from .launch import PdlKernel, pdl_enabled
from .registry import (ATTN_DECODE_U, FAMILIES, FAMILIES_SM90, GEMV_MIN_BLOCKS, GEMV_O_MIN_BLOCKS, GEMV_ROWS,
                       GEMV_SUM_BATCH, PDL_KERNELS)

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


def kernel_dir() -> Path:
    try:
        from importlib.resources import files
        p = Path(str(files("kuiper_py.kernels_cu")))
        if (p / "common.cuh").is_file():
            return p
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[3] / "kernels_cu"


_MODULES: dict[str, object] = {}


_KERNELS: dict[tuple, object] = {}


def kernel(family: str, name: str):
    """A compiled kernel, launched with PDL where that is safe and available (PDL_KERNELS)."""
    key = (current_device_id(), family, name)
    if key not in _KERNELS:
        fn = raw_kernel(family, name)
        _KERNELS[key] = PdlKernel(fn) if name in PDL_KERNELS and pdl_enabled() else fn
    return _KERNELS[key]


def headers_tag() -> str:
    """A comment line naming the hash of kernels_cu's headers, for the end of a source that includes them:
    CuPy's disk cache is keyed on the source text, not on what it includes."""
    d = kernel_dir()
    deps = hashlib.sha1(b"".join((d / h).read_bytes() for h in sorted(os.listdir(d)) if h.endswith(".cuh")))
    return f"\n// headers {deps.hexdigest()}\n"


_FNS: dict[tuple[int, str, str], object] = {}


_BUILD = [0.0]  # seconds the caller waited for kernel modules to be built (kernel_build_seconds)


_BUILD_NOTICE_S = 2.0  # a module build that takes longer is a compile, not a cache load: say so once


_BUILD_NOTICED = [False]


_BUILD_LOCK = threading.Lock()


_BUILDING: dict[str, concurrent.futures.Future] = {}  # module key -> its build started by precompile()


BUILD_TIMES: dict[str, float] = {}  # module key -> seconds its build took (diagnosis)


# the most worker threads precompile() starts (fewer where the process may use fewer CPUs)
BUILD_THREADS = env.build_threads()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one: a container's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every OS)
        return os.cpu_count() or 1


def _build_notice() -> None:
    with _BUILD_LOCK:
        if _BUILD_NOTICED[0]:
            return
        _BUILD_NOTICED[0] = True
    from tqdm import tqdm  # (its write keeps the line clear of a progress bar being drawn: the upload's)
    tqdm.write("kuiper: compiling CUDA kernels for this GPU (their first use on this machine takes a while; CuPy "
               "caches them on disk for later runs)", file=sys.stderr)


def kernel_build_seconds() -> float:
    """Seconds this process waited for kernel modules to be built: NVRTC compiles on a machine's first run, loads
    from CuPy's disk cache after (builds that precompile() ran beside the weights' upload count only where something
    waited for them). `kuiper generate` reports it, since a first run's figures include it."""
    return _BUILD[0]


# families built as several modules (each a share of the instantiations, in the list's order), so that their
# compiles run side by side: alone, attention.cu's took 31.0 s, ffn_decode.cu's 13.5 and gemv_w4a16.cu's 7.3 of a
# first run's 83 (H200 machine); gemv was then the last build to finish (13.1 s beside the others)
MODULE_PARTS = {"attn": 4, "ffn": 3, "gemv": 3}


SM90A_FAMILIES = ("gemm90", "gemm90rs", "attn90")  # built for sm_90a (wgmma): they load on compute capability 9.0 only


# the instantiations only some models use, built as modules of their own ("family@group") that a model's load builds
# only when it needs them: the 64-dim attention forms (only the test presets: every Qwen3 has head_dim 128) and the
# MoE forms of files that dense models also use
MODULE_GROUPS = ("hd64", "moe")


def kernel_group(family: str, name: str) -> str:
    """The MODULE_GROUPS group of a family's kernel, or "" for those every model of the family's users needs."""
    if family in ("attn", "attncm") and re.match(r"\w+<64\b", name):
        return "hd64"
    if (family, name.partition("<")[0]) in (("gemm90rs", "gemm_moe_rs"), ("ffn", "moe_ffn_decode")):
        return "moe"
    return ""


def model_groups(a: ModelArgs) -> set[str]:
    """The MODULE_GROUPS a model's kernels come from."""
    return {g for g, used in zip(MODULE_GROUPS, (a.head_dim == 64, bool(a.num_experts))) if used}


def family_names(family: str) -> tuple[str, list[str]]:
    return FAMILIES_SM90[family] if family in FAMILIES_SM90 else FAMILIES[family]


@functools.cache
def _module_of(family: str) -> dict[str, str]:
    """Each kernel of `family` -> the module key holding it, the one rule both ways (module_key, module_names,
    module_keys): per kernel_group group ("family" or "family@group"), in the list's order, part i of a
    MODULE_PARTS family ("...#i") holds the i-th of its shares of that group's kernels."""
    names = family_names(family)[1]
    n = MODULE_PARTS.get(family, 1)
    groups = {x: kernel_group(family, x) for x in names}
    out = {}
    for g in dict.fromkeys(groups.values()):
        group = [x for x in names if groups[x] == g]
        base = family + (f"@{g}" if g else "")
        out.update((x, base if n == 1 else f"{base}#{i * n // len(group)}") for i, x in enumerate(group))
    return out


def module_keys(family: str, groups=None) -> list[str]:
    """The modules a family is built as (_module_of), those of the kernels every user needs first, each group's in
    part order; groups (a set of MODULE_GROUPS names) keeps only those groups' modules beside the common ones, None
    keeps all."""
    keys = sorted(dict.fromkeys(_module_of(family).values()), key=lambda k: "@" in k)
    return [k for k in keys if groups is None or "@" not in k or k.partition("@")[2].partition("#")[0] in groups]


def module_key(family: str, name: str) -> str:
    """The module holding kernel `name` of `family` (_module_of)."""
    return _module_of(family)[name]


def module_names(key: str) -> tuple[str, list[str]]:
    """(file, the kernels it instantiates) of a module key."""
    family = key.partition("#")[0].partition("@")[0]
    return family_names(family)[0], [x for x, k in _module_of(family).items() if k == key]


def family_modules(family: str) -> list:
    """The built modules of a family (its parts in order)."""
    return [_MODULES[k] for k in module_keys(family) if k in _MODULES]


def build_options(family: str) -> tuple[str, ...]:
    """The compiler options a family is built with: the include directory, its compile-time constants and, for the
    wgmma families, the sm_90a target (tools/compile_kernels.py passes the same to nvcc)."""
    opts = ("--std=c++17", f"-I{kernel_dir()}")
    if family in ("attn", "attncm"):
        opts += (f"-DATTN_DECODE_U={ATTN_DECODE_U}",)
    if family in SM90A_FAMILIES:  # wgmma exists only in the arch-specific sm_90a target
        opts += ("-arch=sm_90a",)
    if family == "gemv":
        opts += (f"-DGEMV_ROWS={GEMV_ROWS}", f"-DGEMV_MIN_BLOCKS={GEMV_MIN_BLOCKS}",
                 f"-DGEMV_O_MIN_BLOCKS={GEMV_O_MIN_BLOCKS}", f"-DGEMV_SUM_BATCH={GEMV_SUM_BATCH}")
    return opts


def _build(key: str):
    """Build one kernel module (compile, or load CuPy's cached binary): a family, or one of its MODULE_PARTS. The
    source gets a #line so NVRTC errors name the real .cu file; CuPy keys its disk cache on the source and options,
    so a second start does not recompile."""
    family = key.partition("#")[0].partition("@")[0]
    fname, names = module_names(key)
    d = kernel_dir()
    src = f'#line 1 "{d / fname}"\n' + (d / fname).read_text() + headers_tag()
    opts = build_options(family)
    # a silent minute on a first run looks like a hang: a build still going after _BUILD_NOTICE_S says why
    notice = None if _BUILD_NOTICED[0] else threading.Timer(_BUILD_NOTICE_S, _build_notice)
    if notice is not None:
        notice.daemon = True
        notice.start()
    t0 = time.perf_counter()
    try:
        mod = cp.RawModule(code=src, options=opts, name_expressions=names)
        mod.compile()
    except cp.cuda.compiler.CompileException as e:
        raise KuiperError(f"kernel compilation failed for {fname}:\n{e}") from None
    finally:
        if notice is not None:
            notice.cancel()
        BUILD_TIMES[key] = time.perf_counter() - t0
    return mod


def precompile(families, device_id: int, groups=None) -> None:
    """Start building the kernel modules of `families` (of their MODULE_GROUPS only `groups`', as module_keys picks)
    that are not built yet, in worker threads (NVRTC releases the GIL), on device device_id: a first run compiled them
    one after another as each was first used (87.0 s for Qwen3-8B on the H200 machine), now side by side while the
    weights upload (20.8 s; 11.9 s with the groups, parts and threads). raw_kernel waits for a
    module's build; a build that failed there is redone in the caller, so its error is raised where the family is
    used."""
    with _BUILD_LOCK:
        keys = [k for f in families for k in module_keys(f, groups)]
        todo = [k for k in dict.fromkeys(keys) if k not in _MODULES and k not in _BUILDING]
        if not todo:
            return
        work = queue.SimpleQueue()
        for f in todo:
            _BUILDING[f] = fut = concurrent.futures.Future()
            work.put((f, fut))

    def worker():
        # daemon threads, not a ThreadPoolExecutor: the interpreter joins those at exit, so an error or Ctrl-C
        # during a first run's load would wait for every compile (an abandoned one leaves CuPy a temp file at most)
        with cp.cuda.Device(device_id):
            while True:
                try:
                    f, fut = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    fut.set_result(_build(f))
                except BaseException as e:  # noqa: BLE001 (given to raw_kernel, which builds again and raises)
                    fut.set_exception(e)

    for _ in range(min(len(todo), usable_cpus(), BUILD_THREADS)):
        threading.Thread(target=worker, name="kuiper-build", daemon=True).start()


def model_families(a: ModelArgs, cc: int) -> list[str]:
    """The kernel families a model's prefill and decode use on compute capability cc (e.g. 90), which the load builds
    (precompile's list): one missing is built at its first use."""
    # cluster launches and bulk copies from 9.0 on; the wgmma modules are built for sm_90a, which loads on 9.0 only
    hopper, sm90a, moe = cc >= 90, cc == 90, bool(a.num_experts)
    # the longest compiles first, so the last to finish starts early (seconds alone on the H200 machine's host,
    # attn 31.0, ffn 13.5, gemv 7.3, gemm90rs 7.0, attncm 6.9, moe 6.2, smp 4.2, attn90 2.5, moetc 1.2,
    # gemm 1.2, gemm90 0.8, the rest 0.1-0.2)
    fams = ["attn"] + ["ffn"] * hopper + ["gemv"] + ["gemm90rs"] * sm90a + ["attncm"] * hopper + ["moe"] * moe
    fams += ["smp"] + ["attn90"] * sm90a + ["moetc"] * (hopper and moe) + ["gemm"] + ["gemm90"] * sm90a
    return fams + ["norm", "rope", "lmh", "rows"]


def _function_device() -> int:
    """The device whose context a function is loaded into: the current one (0 without CuPy: stand-in builds)."""
    return 0 if _device.cp is None else current_device_id()


def raw_kernel(family: str, name: str):
    """A compiled kernel, looked up once (CuPy's get_function builds a new RawKernel per call, and
    attention_decode asks on every launch); its module built here, or by precompile()'s worker. One per device: a
    function is loaded into one device's context (one process driving several GPUs: --tp)."""
    key = (_function_device(), family, name)
    fn = _FNS.get(key)
    if fn is None:
        fn = _FNS[key] = load_module(module_key(family, name)).get_function(name)
    return fn


def load_module(key: str):
    """The built module of a module key: built here, or precompile()'s build waited for (one that failed there is
    built again here, which raises its error)."""
    if key not in _MODULES:
        t0 = time.perf_counter()
        try:
            fut, mod = _BUILDING.get(key), None
            if fut is not None:
                try:
                    mod = fut.result()
                except Exception:  # noqa: BLE001 (built again below, which raises the error here)
                    mod = None
            _MODULES[key] = mod if mod is not None else _build(key)
        finally:
            _BUILD[0] += time.perf_counter() - t0
    return _MODULES[key]
