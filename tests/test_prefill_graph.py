"""Prefill graphs' padding (CupyOps.prefill_graph) checked on the CPU reference engine: a prompt padded at its end
to its length bucket gives its own last logits and, once decode overwrites the padding's cache rows, its own
continuation; and the buckets themselves. The GPU side is in test_gpu_e2e.py and test_cuda_moe.py."""
import numpy as np
import pytest

from kuiper_py import ops_cupy as oc
from kuiper_py.cuda.runtime import build as kb
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps


def test_prefill_buckets():
    """Every length 2..512 maps to a bucket at or above it, buckets are monotone and fixed points, 19 of them up to
    512 (2, 4, 8, then multiples of 16), and the padding is less than the length up to 16 tokens, at most 15 rows up
    to 128 tokens, 31 up to 256, 63 beyond."""
    got = {T: oc.prefill_bucket(T) for T in range(2, 513)}
    assert all(T <= B for T, B in got.items())
    assert all(got[T] <= got[T + 1] for T in range(2, 512))
    assert all(oc.prefill_bucket(B) == B for B in got.values())
    assert len(set(got.values())) == 19 and max(got.values()) == 512
    assert {got[T] for T in range(2, 17)} == {2, 4, 8, 16} and all(got[T] < 2 * T for T in range(2, 17))
    assert all(B - T <= (15 if T <= 128 else 31 if T <= 256 else 63) for T, B in got.items())


def test_decode_regimes_are_those_the_steps_meet():
    """decode_regimes (the decode graphs a generation captures before its prompt) against every step's regime counted
    one by one, for random bounds, capacities and key ranges, and a whole cache's regimes against the bounds within it
    plus the capacity's."""
    rng = np.random.default_rng()
    for _ in range(300):
        bounds = tuple(sorted({int(b) for b in rng.integers(1, 300, size=rng.integers(0, 4))}))
        cap = int(rng.integers(1, 400))
        lo, hi = sorted(int(x) for x in rng.integers(-5, 450, size=2))
        want = sorted({oc.decode_regime(bounds, cap, n) for n in range(max(1, lo), min(hi, cap) + 1)})
        assert oc.decode_regimes(bounds, cap, (lo, hi)) == want, (bounds, cap, lo, hi)
        whole = sorted({b for b in bounds if b <= cap} | {oc.decode_regime(bounds, cap, cap)})
        assert oc.decode_regimes(bounds, cap) == whole, (bounds, cap)
    assert oc.decode_regime((512, 1024), 4096, 512) == 512 and oc.decode_regime((512, 1024), 4096, 513) == 1024
    assert oc.decode_regime((512, 1024), 4096, 1025) == 4096


def test_rs_rows_split_rule():
    """gemm()'s rs rows split applies from 257 to 320 rows, to matrices of at least 3 x 4096 x 4096
    weights only (Qwen3-8B gate|up and down, not q|k|v or o), with 256 rows in its first launch."""
    gu, down, qkv, o = (4096, 24576), (12288, 4096), (4096, 6144), (4096, 4096)
    assert [oc.rs_rows_split(T, *gu) for T in (2, 256, 257, 300, 320, 321, 352, 512)] == [0, 0, 256, 256, 256, 0, 0, 0]
    assert oc.rs_rows_split(300, *down) == 256
    assert oc.rs_rows_split(300, *qkv) == oc.rs_rows_split(300, *o) == 0


class PaddedNumpyOps(NumpyOps):
    """The reference ops serving prefill_graph as the CUDA backend does: the layers run on the prompt padded with
    id 0 to prefill_bucket(T) positions, at the cache's start or after earlier turns, where the padded
    end fits in the cache."""
    served = 0

    def prefill_graph(self, step, layers):
        ids, pos0 = step.one().ids, step.one().pos0
        B = oc.prefill_bucket(len(ids))
        if pos0 + B > self.k_cache.shape[1]:
            return None
        x = layers(list(ids) + [0] * (B - len(ids)))
        assert x.shape[0] == B
        PaddedNumpyOps.served += 1
        return x


def greedy(m, ids, n):
    lg, toks = m.prefill(ids), []
    for _ in range(n):
        toks.append(int(np.argmax(lg)))
        lg = m.decode(toks[-1])
    return toks, lg


@pytest.mark.parametrize("n", [5, 37, 129])
def test_padded_prefill_gives_the_prompts_own_logits_and_continuation(tiny_bin, n):
    mf = load(tiny_bin)
    ids = np.random.default_rng().integers(0, 151643, n).tolist()
    plain, padded = Qwen3(mf, NumpyOps, 200), Qwen3(mf, PaddedNumpyOps, 200)
    before = PaddedNumpyOps.served
    a, b = plain.prefill(ids), padded.prefill(ids)
    assert PaddedNumpyOps.served == before + 1 and padded.pos == plain.pos == n
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
    plain.reset()
    padded.reset()
    ta, la = greedy(plain, ids, 6)
    tb, lb = greedy(padded, ids, 6)
    assert ta == tb
    np.testing.assert_allclose(lb, la, rtol=1e-4, atol=1e-4 * np.abs(la).max())


def test_padded_continued_prompts_give_their_own_logits_and_continuation(tiny_bin):
    """A chat's turns padded as prefill graphs pad them, each after the ones before (pos0 > 0): every turn's last
    logits and the greedy continuation after the last turn as the unpadded engine's; the padding's cache rows past
    each turn are overwritten by the next turn or by decode before anything reads them."""
    mf = load(tiny_bin)
    rng = np.random.default_rng()
    plain, padded = Qwen3(mf, NumpyOps, 200), Qwen3(mf, PaddedNumpyOps, 200)
    before = PaddedNumpyOps.served
    for n in (7, 20, 33):
        ids = rng.integers(0, 151643, n).tolist()
        a, b = plain.prefill(ids), padded.prefill(ids)
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
    assert PaddedNumpyOps.served == before + 3 and padded.pos == plain.pos == 60
    ids = rng.integers(0, 151643, 9).tolist()
    ta, la = greedy(plain, ids, 6)
    tb, lb = greedy(padded, ids, 6)
    assert ta == tb and PaddedNumpyOps.served == before + 4
    np.testing.assert_allclose(lb, la, rtol=1e-4, atol=1e-4 * np.abs(la).max())


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
