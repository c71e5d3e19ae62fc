"""Kernel builds (kuiper_py/cuda/runtime/build.py) with a stand-in for CuPy's compiler: background builds beside the
weights' upload, one notice for a slow compile, a failed build raised where its family is used, families built as
modules of shares of their kernels, and a model building only the kernel groups it uses. Runs without a GPU."""
import pytest

from kuiper_py import ops_cupy as oc
from kuiper_py.cuda.runtime import build as kb


class _FakeCupy:
    """A stand-in for the CuPy that build.py's module builds use: RawModule(...).compile() sleeps for the family's
    delay (its file's name is the key) or raises CompileException for a file in `broken`, counting builds."""

    def __init__(self, delays, broken=()):
        import contextlib
        import threading
        import types
        fake = self
        self.builds, self.names, self.lock = {}, [], threading.Lock()

        class CompileException(Exception):
            pass

        class Module:
            def __init__(self, code, options, name_expressions):
                self.file, self.kernels = code.split('"')[1].rsplit("/", 1)[-1], list(name_expressions)
                with fake.lock:
                    fake.names.append(list(name_expressions))

            def compile(self):
                import time
                with fake.lock:
                    fake.builds[self.file] = fake.builds.get(self.file, 0) + 1
                time.sleep(delays.get(self.file, 0.0))
                if self.file in broken:
                    raise CompileException("error: deliberately broken")

            def get_function(self, name):
                assert name in self.kernels, (name, self.kernels)  # (as CuPy: only a module's own instantiations)
                return (self.file, name)

        self.RawModule = Module
        self.cuda = types.SimpleNamespace(compiler=types.SimpleNamespace(CompileException=CompileException),
                                          Device=lambda i: contextlib.nullcontext())


def _fake_builds(monkeypatch, delays, broken=(), notice_s=0.1):
    """build.py with a stand-in CuPy, once the real builds still under way (an earlier test's model load on a GPU
    machine) have finished: a worker that met the stand-in would build a fake module."""
    for fut in list(kb._BUILDING.values()):
        try:
            fut.exception()
        except BaseException:  # noqa: BLE001 (cancelled: nothing to wait for)
            pass
    fake = _FakeCupy(delays, broken)
    monkeypatch.setattr(kb, "cp", fake)
    for name, value in (("_MODULES", {}), ("_FNS", {}), ("_BUILDING", {}), ("_BUILD_NOTICED", [False]),
                        ("_BUILD_NOTICE_S", notice_s)):
        monkeypatch.setattr(kb, name, value)
    return fake


def test_a_slow_kernel_build_says_once_that_it_compiles(monkeypatch, capsys):
    """build.raw_kernel with a stand-in for CuPy's RawModule: a build slower than _BUILD_NOTICE_S prints one line
    on stderr saying that kernels are being compiled (a first run's silent minute looks like a hang), a second slow
    build prints nothing more, a quick one (a disk-cache load) nothing at all; kernel_build_seconds counts the time
    waited."""
    import time
    fams = ["norm", "rope", "lmh"]
    files = [oc.FAMILIES[f][0] for f in fams]
    _fake_builds(monkeypatch, {files[0]: 0.0, files[1]: 0.4, files[2]: 0.4})
    before = oc.kernel_build_seconds()
    t0 = time.perf_counter()
    oc.raw_kernel(fams[0], oc.FAMILIES[fams[0]][1][0])
    assert capsys.readouterr().err == ""
    for f in fams[1:]:
        oc.raw_kernel(f, oc.FAMILIES[f][1][0])
    assert capsys.readouterr().err.count("compiling CUDA kernels") == 1
    assert 0.8 <= oc.kernel_build_seconds() - before <= time.perf_counter() - t0


def test_precompile_builds_families_side_by_side_once_each(monkeypatch):
    """precompile() starts every family's build at once in worker threads: four 0.5 s builds are all done within
    well under their 2 s in a row, a family raw_kernel asks for while its build runs is waited for rather than built
    again (one build each), a second precompile() of the same families starts nothing, and each kernel is its own
    family's."""
    import time
    fams = ["norm", "rope", "lmh", "gemm"]  # (one module each)
    fake = _fake_builds(monkeypatch, {oc.FAMILIES[f][0]: 0.5 for f in fams}, notice_s=60)
    t0 = time.perf_counter()
    oc.precompile(fams, 0)
    oc.precompile(fams, 0)
    got = [oc.raw_kernel(f, oc.FAMILIES[f][1][0]) for f in fams]
    assert time.perf_counter() - t0 < 1.5
    assert got == [(oc.FAMILIES[f][0], oc.FAMILIES[f][1][0]) for f in fams]
    assert fake.builds == {oc.FAMILIES[f][0]: 1 for f in fams}


def test_precompile_starts_no_more_threads_than_build_threads(monkeypatch):
    """KUIPER_BUILD_THREADS (BUILD_THREADS) caps precompile()'s workers: at 1, three 0.3 s builds run one after
    another (0.9 s at least), at 3 side by side where the process may use 3 CPUs (under 0.8 s); usable_cpus counts
    the CPUs the process may run on."""
    import os
    import time
    assert 1 <= oc.usable_cpus() <= (os.cpu_count() or 1)
    fams = ["norm", "rope", "lmh"]
    for cap, cpus, fast in ((1, 8, False), (3, 3, True)):
        fake = _fake_builds(monkeypatch, {oc.FAMILIES[f][0]: 0.3 for f in fams}, notice_s=60)
        monkeypatch.setattr(kb, "BUILD_THREADS", cap)
        monkeypatch.setattr(kb, "usable_cpus", lambda: cpus)
        t0 = time.perf_counter()
        oc.precompile(fams, 0)
        for f in fams:
            oc.raw_kernel(f, oc.FAMILIES[f][1][0])
        took = time.perf_counter() - t0
        assert (took < 0.8) if fast else (took >= 0.9), (cap, took)
        assert fake.builds == {oc.FAMILIES[f][0]: 1 for f in fams}


def test_a_failed_background_build_raises_where_its_family_is_used(monkeypatch):
    """A family whose build fails in precompile()'s worker raises nothing there or for other families; raw_kernel
    builds it again when the family is used and raises that compile error as a one-line KuiperError."""
    from kuiper_py.errors import KuiperError
    fake = _fake_builds(monkeypatch, {}, broken=("rope.cu",), notice_s=60)
    oc.precompile(["norm", "rope"], 0)
    kb._BUILDING["rope"].exception()  # (its worker has finished, with the error)
    assert oc.raw_kernel("norm", "add_rmsnorm") == ("norm.cu", "add_rmsnorm")
    with pytest.raises(KuiperError, match="kernel compilation failed for rope.cu"):
        oc.raw_kernel("rope", "advance_position")
    assert fake.builds == {"norm.cu": 1, "rope.cu": 2}


def test_model_families_name_real_families():
    """model_families lists only families build.py can build, the MoE ones for MoE models only, the cluster ones from
    compute capability 9.0 on, the modules built for sm_90a (wgmma) on 9.0 only (they cannot load elsewhere)."""
    from kuiper_py.config import ModelArgs
    from kuiper_py.synth import hf_config
    known = set(oc.FAMILIES) | set(oc.FAMILIES_SM90)
    for preset in ("tiny", "tiny-moe"):
        a = ModelArgs.from_hf_config(hf_config(preset))
        for cc in (80, 86, 90, 100):
            fams = oc.model_families(a, cc)
            assert set(fams) <= known and len(fams) == len(set(fams))
            assert ("moe" in fams) == bool(a.num_experts)
            assert ("ffn" in fams) == ("attncm" in fams) == (cc >= 90)
            assert all((f in fams) == (cc == 90) for f in oc.SM90A_FAMILIES) and len(oc.SM90A_FAMILIES) == 3


def test_a_family_in_parts_is_built_as_modules_of_shares_of_its_kernels(monkeypatch):
    """A MODULE_PARTS family (attention.cu, ffn_decode.cu, gemv_w4a16.cu) is precompiled as that many modules per
    group of its kernels, whose kernels are disjoint shares of the family's, together all of them; every kernel is
    found in the module holding it, each module built once."""
    fake = _fake_builds(monkeypatch, {}, notice_s=60)
    fams = list(oc.MODULE_PARTS)
    oc.precompile(fams, 0)
    for f in fams:
        names = oc.family_names(f)[1]
        for x in names:
            assert oc.raw_kernel(f, x) == (oc.family_names(f)[0], x)
        shares = [n for n in fake.names if n[0] in names]
        groups = {oc.kernel_group(f, x) for x in names}
        assert len(shares) == len(oc.module_keys(f)) == oc.MODULE_PARTS[f] * len(groups) > 1 and all(shares)
        assert sorted(x for n in shares for x in n) == sorted(names)
        assert all(len({oc.kernel_group(f, x) for x in n}) == 1 for n in shares)
        assert len(oc.family_modules(f)) == len(shares)
    assert fake.builds == {oc.family_names(f)[0]: len(oc.module_keys(f)) for f in fams}


def test_a_model_builds_only_the_kernel_groups_it_uses(monkeypatch):
    """A model's load builds the modules of its families' common kernels and of the MODULE_GROUPS it uses: a Qwen3
    (head_dim 128, dense) none of the 64-dim attention forms nor the MoE forms of files it shares with MoE models; a
    64-dim MoE test preset every kernel of its families. A kernel of a group left out is still built when asked for."""
    from kuiper_py.config import ModelArgs
    from kuiper_py.synth import hf_config
    for preset, want in (("8b", set()), ("tiny", {"hd64"}), ("tiny-moe", {"hd64", "moe"})):
        fake = _fake_builds(monkeypatch, {}, notice_s=60)
        a = ModelArgs.from_hf_config(hf_config(preset))
        fams, groups = oc.model_families(a, 90), oc.model_groups(a)
        assert groups == want
        oc.precompile(fams, 0, groups)
        for key in (k for f in fams for k in oc.module_keys(f, groups)):
            oc.load_module(key)
        built = {x for n in fake.names for x in n}
        for f in fams:
            for x in oc.family_names(f)[1]:
                assert (x in built) == (oc.kernel_group(f, x) in groups | {""}), (preset, f, x)
        assert not any("<64" in x for x in built if x.startswith("attn_decode_gqa")) or a.head_dim == 64
        if not a.num_experts:
            assert not any(x.startswith(("moe_ffn_decode", "gemm_moe_rs")) for x in built)
            assert oc.raw_kernel("ffn", "moe_ffn_decode<8, 2, 1>") == ("ffn_decode.cu", "moe_ffn_decode<8, 2, 1>")
