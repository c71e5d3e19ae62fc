"""Compile every registered kernel instantiation with nvcc, no GPU needed: each kernel module the product builds
(cuda/runtime/registry.py's families, split as cuda/runtime/build.py splits them, with the same compile-time
constants) for sm_90a, and those the product builds on compute capability 8.x for sm_80. A CPU machine with the CUDA
toolkit checks that the kernels still build.

    python tools/compile_kernels.py                      # every module for sm_90a and sm_80
    python tools/compile_kernels.py --arch sm_90a --family ffn --family gemv
    python tools/compile_kernels.py --fingerprints before.json      # then, after a change:
    python tools/compile_kernels.py --compare before.json           # which kernels' machine code changed

A fingerprint is a hash of a kernel's machine code and its attributes (registers, parameters, shared memory) in the
cubin: a kernel whose fingerprint is unchanged runs the same instructions."""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kuiper_py.cuda.runtime import build  # noqa: E402  (after the path)

ARCHS = ("sm_90a", "sm_80")


def modules(arch: str, families=None) -> list[tuple[str, str, list[str]]]:
    """(module key, .cu file, its instantiations) of every module the product builds on this architecture: on 9.0
    all of them, before it those model_families lists for a MoE model on 8.0."""
    cc = 90 if arch.startswith("sm_90") else int(arch[3:5])
    fams = build.model_families(SimpleNamespace(num_experts=1), cc)
    out = []
    for fam in dict.fromkeys(fams):
        if families and fam not in families:
            continue
        for key in build.module_keys(fam):
            fname, names = build.module_names(key)
            out.append((key, fname, names))
    return out


def source(fname: str, names: list[str]) -> str:
    """A translation unit that includes the kernel file and instantiates each name (its address taken, as NVRTC's
    name expressions do)."""
    refs = ",\n    ".join(f"(void*)&{n}" for n in names)
    return f'#include "{fname}"\nvoid* kuiper_instances[] = {{\n    {refs}\n}};\n'


def nvcc_options(family: str, arch: str, kernels: Path) -> list[str]:
    """build_options's constants for nvcc, at `arch`, the kernel sources from `kernels`."""
    opts = [o for o in build.build_options(family) if not o.startswith(("-arch", "--std", "-I"))]
    return ["-std=c++17", f"-arch={arch}", f"-I{kernels}", *opts]


def compile_module(nvcc: str, key: str, fname: str, names: list[str], arch: str, out_dir: Path,
                   kernels: Path) -> dict:
    """Compile one module to a cubin: {key, arch, ok, seconds, log, kernels (symbol -> fingerprint)}."""
    family = key.partition("#")[0].partition("@")[0]
    stem = f"{key.replace('#', '_').replace('@', '_')}.{arch}"
    src, cubin = out_dir / f"{stem}.cu", out_dir / f"{stem}.cubin"
    src.write_text(source(fname, names))
    t0 = time.perf_counter()
    p = subprocess.run([nvcc, *nvcc_options(family, arch, kernels), "-cubin", "-o", str(cubin), str(src)],
                       capture_output=True, text=True)
    res = dict(key=key, arch=arch, ok=p.returncode == 0, seconds=time.perf_counter() - t0,
               log=(p.stdout + p.stderr).strip(), kernels={})
    if res["ok"]:
        res["kernels"] = fingerprints(cubin.read_bytes())
        if len(res["kernels"]) < len(names):  # every instantiation has its own kernel
            res["ok"], res["log"] = False, f"{len(names)} instantiations, {len(res['kernels'])} kernels in the cubin"
    return res


def _sections(elf: bytes) -> dict[str, tuple[bytes, int, int]]:
    """An ELF64 file's sections by name: (contents, size, sh_info)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx]

    def name(off):
        start = names[4] + off
        return elf[start:elf.index(b"\0", start)].decode()
    return {name(h[0]): (b"" if h[1] == 8 else elf[h[4]:h[4] + h[5]], h[5], h[7]) for h in heads}


def _regcounts(secs) -> dict[str, int]:
    """Registers per function: the EIATTR_REGCOUNT entries (0x2f: symbol index, count) of the cubin's .nv.info."""
    strtab, symtab = secs[".strtab"][0], secs[".symtab"][0]

    def sym_name(i):
        off, = struct.unpack_from("<I", symtab, 24 * i)
        return strtab[off:strtab.index(b"\0", off)].decode()
    info, i, out = secs.get(".nv.info", (b"", 0, 0))[0], 0, {}
    while i + 4 <= len(info):
        fmt, attr, size = info[i], info[i + 1], struct.unpack_from("<H", info, i + 2)[0]
        if fmt != 0x04:  # (EIFMT_SVAL carries a size; the other formats are 4 bytes)
            i += 4
            continue
        if attr == 0x2F:
            sym, regs = struct.unpack_from("<II", info, i + 4)
            out[sym_name(sym)] = regs
        i += 4 + size
    return out


def fingerprints(cubin: bytes) -> dict[str, str]:
    """Each kernel's fingerprint: a hash of its machine code (.text.K), its register count and its static shared
    memory (.nv.shared.K's size). Nothing that depends on the other kernels of its module (symbol and section
    indices), so a kernel compiled beside others prints the same."""
    secs = _sections(cubin)
    regs = _regcounts(secs)
    out = {}
    for sec, (code, _, _) in secs.items():
        if sec.startswith(".text."):
            k = sec[len(".text."):]
            shared = secs.get(f".nv.shared.{k}", (b"", 0, 0))[1]
            out[k] = hashlib.sha1(code + struct.pack("<ii", regs.get(k, -1), shared)).hexdigest()[:16]
    return out


def compare(old: dict, new: dict) -> list[str]:
    """Lines naming each kernel whose fingerprint changed, those renamed with the same code, and those only one side
    has."""
    lines = []
    for arch in sorted(set(old) | set(new)):
        a, b = old.get(arch, {}), new.get(arch, {})
        lines += [f"{arch} changed: {k}" for k in sorted(set(a) & set(b)) if a[k] != b[k]]
        gone, added = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        by_print = {b[k]: k for k in added}
        renamed = {k: by_print.pop(a[k]) for k in gone if a[k] in by_print}
        lines += [f"{arch} same code, renamed: {k} -> {v}" for k, v in renamed.items()]
        lines += [f"{arch} removed: {k}" for k in gone if k not in renamed]
        lines += [f"{arch} new: {k}" for k in sorted(by_print.values())]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", choices=ARCHS, help="target (repeatable; default: both)")
    ap.add_argument("--family", action="append", help="only these kernel families (repeatable)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="nvcc processes at once")
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    ap.add_argument("--kernels", type=Path, default=build.kernel_dir(), help="the kernel sources (default: kernels_cu)")
    ap.add_argument("--fingerprints", type=Path, help="write {arch: {kernel: fingerprint}} here (JSON)")
    ap.add_argument("--compare", type=Path, help="a fingerprints file: list the kernels that differ from it")
    args = ap.parse_args(argv)
    if shutil.which(args.nvcc) is None:
        print(f"compile_kernels: error: nvcc not found ({args.nvcc})", file=sys.stderr)
        return 2
    jobs = [(m, arch) for arch in args.arch or ARCHS for m in modules(arch, args.family)]
    results = []
    with tempfile.TemporaryDirectory(prefix="kuiper-nvcc-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futs = [pool.submit(compile_module, args.nvcc, *m, arch, Path(tmp), args.kernels.resolve()) for m, arch in jobs]
        for f in concurrent.futures.as_completed(futs):
            r = f.result()
            results.append(r)
            print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['arch']:7} {r['key']:16} {len(r['kernels']):3} kernels "
                  f"{r['seconds']:6.1f} s", file=sys.stderr)
            if not r["ok"]:
                print(r["log"], file=sys.stderr)
    failed = [r for r in results if not r["ok"]]
    prints: dict[str, dict] = {}
    for r in results:
        prints.setdefault(r["arch"], {}).update(r["kernels"])
    print(f"{len(results) - len(failed)} of {len(results)} modules built, "
          f"{sum(len(k) for k in prints.values())} kernels", file=sys.stderr)
    if args.fingerprints:
        args.fingerprints.write_text(json.dumps(prints, indent=1, sort_keys=True))
    if args.compare:
        diff = compare(json.loads(args.compare.read_text()), prints)
        print("\n".join(diff) if diff else "every kernel's machine code is unchanged")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
