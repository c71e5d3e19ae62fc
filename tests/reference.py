"""Independent references for the tests: AWQ unpacking written differently, and the HF oracle."""
import functools
import json

import numpy as np

from kuiper_py.sampling import SamplingParams


@functools.lru_cache(maxsize=None)
def reference_engine(path):
    """A CPU Engine for the model file at path, loaded once per test process (its tokenizer takes ~0.4 s to parse):
    for references only, never the engine a test checks. generate() starts each request of it at position 0, so its
    output is a fresh session's."""
    from kuiper_py.generate import Engine
    return Engine.load(path, "cpu")


def tune(monkeypatch, **changes):
    """The CUDA backend's active Settings with these fields changed, for the rest of the test (cuda/settings.py's
    SETTINGS, which every CupyOps built without settings of its own runs with)."""
    import dataclasses
    from kuiper_py.cuda import settings as cfg
    monkeypatch.setattr(cfg, "SETTINGS", dataclasses.replace(cfg.SETTINGS, **changes))


def patch(monkeypatch, name, value):
    """Rebind `name` for the rest of the test in every kuiper_py module that holds the object ops_cupy exports under
    it (the CUDA backend's modules import their names from one another; `cp` in every module that has one)."""
    import sys
    from kuiper_py import ops_cupy as oc
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("kuiper_py") and m is not None and name in vars(m)]
    assert mods, f"no kuiper_py module has {name}"
    old = vars(oc)[name] if name in vars(oc) else vars(mods[0])[name]
    for mod in mods:
        if vars(mod)[name] is old or name == "cp":
            monkeypatch.setattr(mod, name, value)

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
PROMPT = [785, 6722, 315, 9625, 374, 11, 323, 279, 6722, 315, 9856, 374, 19846, 13]

# AutoAWQ packs column AWQ_PACK_ORDER[i] of each group of eight into nibble i
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def unpack_loop(packed):
    """int32 [R, C/8] -> int [R, C], nibble by nibble through the pack order (not the reverse table)."""
    p = np.asarray(packed).astype(np.int64) & 0xFFFFFFFF
    R, C8 = p.shape
    out = np.zeros((R, C8 * 8), dtype=np.int64)
    for nib in range(8):
        col = AWQ_PACK_ORDER[nib]
        out[:, col::8] = (p >> (4 * nib)) & 0xF
    return out


def dequant_reference(qweight, qzeros, scales, group_size):
    q = unpack_loop(qweight).astype(np.float64)
    z = unpack_loop(qzeros).astype(np.float64)
    s = np.asarray(scales).astype(np.float64)
    g = np.arange(q.shape[0]) // group_size
    return (q - z[g]) * s[g]


def rand_awq_tensors(rng, K, N, g=128, experts=0):
    """Random AWQ tensors as a checkpoint holds them (qweight, qzeros, scales; packed by kuiper_py.awq,
    which dequant_reference does not use), with a leading expert axis when experts > 0. Scales average
    1 / (8 sqrt(K)), so products of unit-variance inputs stay near unit size."""
    from kuiper_py import awq

    def one():
        qw = awq.pack(rng.integers(0, 16, size=(K, N), dtype=np.uint8))
        qz = awq.pack(rng.integers(0, 16, size=(K // g, N), dtype=np.uint8))
        return qw, qz, (rng.random((K // g, N), dtype=np.float32) * 2 / (8 * np.sqrt(K))).astype(np.float16)

    if not experts:
        return one()
    return tuple(np.stack(t) for t in zip(*(one() for _ in range(experts))))


def hf_model(ckpt_dir):
    """transformers' Qwen3ForCausalLM in float32 on the dequantized weights of a synthetic checkpoint."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from safetensors.numpy import load_file

    cfg = json.loads((ckpt_dir / "config.json").read_text())
    g = cfg.pop("quantization_config")["group_size"]
    cfg["torch_dtype"] = "float32"
    sd = {}
    for f in sorted(ckpt_dir.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    state = {}
    for name, a in sd.items():
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            W = dequant_reference(a, sd[base + ".qzeros"], sd[base + ".scales"], g)
            state[base + ".weight"] = torch.from_numpy(W.T.astype(np.float32).copy())
        elif not name.endswith((".qzeros", ".scales")):
            state[name] = torch.from_numpy(a.astype(np.float32))
    model = Qwen3ForCausalLM(Qwen3Config(**cfg))
    model.load_state_dict(state, strict=not cfg.get("tie_word_embeddings"))
    if cfg.get("tie_word_embeddings"):
        model.tie_weights()
    return model.float().eval()


def hf_moe_model(ckpt_dir):
    """transformers' Qwen3MoeForCausalLM in float32 on the dequantized weights (experts fused as
    transformers stores them: gate_up_proj [E, 2I, D], down_proj [E, D, I])."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from safetensors.numpy import load_file

    cfg = json.loads((ckpt_dir / "config.json").read_text())
    g = cfg.pop("quantization_config")["group_size"]
    sd = {}
    for f in sorted(ckpt_dir.glob("*.safetensors")):
        sd.update(load_file(str(f)))

    def W(base):  # nn.Linear weight [out, in]
        return dequant_reference(sd[base + ".qweight"], sd[base + ".qzeros"], sd[base + ".scales"], g).T

    state = {}
    for name, a in sd.items():
        if ".mlp.experts." in name or name.endswith((".qweight", ".qzeros", ".scales")):
            continue
        state[name] = torch.from_numpy(a.astype(np.float32))
    for name in sd:
        if name.endswith(".qweight") and ".mlp.experts." not in name:
            base = name[: -len(".qweight")]
            state[base + ".weight"] = torch.from_numpy(W(base).astype(np.float32).copy())
    E = cfg["num_experts"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.0.gate_proj.qweight" not in sd:
            continue
        gu = np.stack([np.concatenate([W(f"{p}.{e}.gate_proj"), W(f"{p}.{e}.up_proj")]) for e in range(E)])
        dn = np.stack([W(f"{p}.{e}.down_proj") for e in range(E)])
        state[f"{p}.gate_up_proj"] = torch.from_numpy(gu.astype(np.float32))
        state[f"{p}.down_proj"] = torch.from_numpy(dn.astype(np.float32))
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
    model.load_state_dict(state, strict=not cfg.get("tie_word_embeddings"))
    if cfg.get("tie_word_embeddings"):
        model.tie_weights()
    return model.float().eval()


def rel(a, b):
    """Relative L2 error of a against b, in float64; a must be finite (poisoned outputs are NaN)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "non-finite output (unwritten or overflow)"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# A MoE router's near tie: its k-th and (k+1)-th logits closer than this many of the row's standard deviations. The
# GPU's fp16 activations may pick either expert there, and every later logit then legitimately differs from the
# reference's (simulated on the CPU: router inputs perturbed by 2e-3 relative flipped picks at gaps up to 1e-2 sd).
ROUTER_TIE_SD = 0.02


class RouterTies:
    """A context in which the CPU reference's MoE routers (moe_ref.route, the NumPy backend's) note each near tie they
    meet (ROUTER_TIE_SD) as (call, row): the route calls counted from the context's start, in the order a forward
    makes them; those in `flip` take the (k+1)-th expert instead of the k-th, weighted as the router weights it."""

    def __init__(self, flip=()):
        self.flip, self.near, self.calls = set(flip), [], 0

    def __enter__(self):
        from kuiper_py import moe_ref
        self._mod, self._real = moe_ref, moe_ref.route
        moe_ref.route = self._route
        return self

    def __exit__(self, *exc):
        self._mod.route = self._real

    def _route(self, x, router, k, norm_topk_prob):
        ids, w = self._real(x, router, k, norm_topk_prob)
        logits = x.astype(np.float32) @ router.astype(np.float32).T
        order = np.argsort(-logits, axis=-1, kind="stable")
        if k < logits.shape[1]:  # (every expert picked: no tie to resolve)
            top = np.take_along_axis(logits, order[:, k - 1:k + 1], axis=-1)
            gap = (top[:, 0] - top[:, 1]) / logits.std(axis=-1)
            self.near += [(self.calls, int(t)) for t in np.nonzero(gap < ROUTER_TIE_SD)[0]]
        for t in [t for c, t in self.flip if c == self.calls]:
            p = np.exp(logits[t] - logits[t].max())
            p /= p.sum()
            ids[t] = np.concatenate([order[t, :k - 1], order[t, k:k + 1]])
            w[t] = p[ids[t]] / (p[ids[t]].sum() if norm_topk_prob else 1)
        self.calls += 1
        return ids, w


def reference_up_to_router_ties(got, run_cpu, ok=None, max_flips=32):
    """The CPU reference got is checked against: run_cpu()'s output (a fresh CPU computation, the same route calls
    each time), or, where that fails ok(reference) (default: got within the e2e bound, 1e-2), the first of those with
    one near tie of its routers (RouterTies) resolved the other way that passes it: where the GPU's fp16 activations
    resolved a router's near tie the other way, its every later logit follows the other expert, as accurate against
    that resolution. Where none passes, the one closest to got (the check then fails on it). Returns (reference, the
    flipped tie or None). A dense model meets no tie: run_cpu()'s output."""
    ok = ok or (lambda r: rel(got, r) < 1e-2)
    with RouterTies() as ties:
        ref = run_cpu()
    if ok(ref):
        return ref, None
    best, flipped = ref, None
    for tie in ties.near[:max_flips]:
        with RouterTies([tie]):
            alt = run_cpu()
        if ok(alt):
            best, flipped = alt, tie
            break
        if rel(got, alt) < rel(got, best):
            best, flipped = alt, tie
    if flipped is not None:
        print(f"reference with router near tie {flipped} (call, row) the other way: rel {rel(got, ref):.2e} -> "
              f"{rel(got, best):.2e}")
    return best, flipped


def gpu_near_tie(mf, ctx, n_valid):
    """The CPU reference's top two tokens after ctx when their logits are closer than the GPU's own largest logit
    error there (a tie neither side resolves; a set of two ids), else an empty set; and whether a GPU path picks
    other experts than the reference for some token and layer of ctx (a MoE router at a tie that fp16 paths resolve
    differently: every later logit may then legitimately differ; False in a dense model). The GPU's two paths both
    count: the single-sequence prefill and a paged step of ctx (the batch engine's kernels)."""
    import cupy as cp
    from kuiper_py import ops_cupy as oc
    from kuiper_py.backend import Seq, Step
    from kuiper_py.model import Qwen3
    from kuiper_py.ops_numpy import NumpyOps
    cpu = Qwen3(mf, NumpyOps, len(ctx) + 1)
    ref = cpu.prefill(ctx)[:n_valid]
    m = Qwen3(mf, oc.CupyOps, len(ctx) + 1)
    m.ops.routing_log = []
    gpu = cp.asnumpy(m.prefill(ctx))[:n_valid]
    bs = 4
    nb = -(-(len(ctx) + 1) // bs)
    mp = Qwen3(mf, oc.CupyOps, len(ctx) + 1)
    mp.ops.alloc_blocks(nb, bs, len(ctx) + 1)
    mp.ops.routing_log = []
    paged = cp.asnumpy(mp.forward_step(Step((Seq(tuple(ctx), 0, 0, tuple(range(nb))),))))[0][:n_valid]
    err = max(float(np.abs(gpu - ref).max()), float(np.abs(paged - ref).max()))
    i1, i2 = (int(i) for i in np.argsort(ref)[::-1][:2])
    tie = {i1, i2} if abs(float(ref[i1]) - float(ref[i2])) < err else set()
    # (a one-token prefill replays the decode graph, which logs no routing: only the paged path's log then)
    logs = [log for log in (m.ops.routing_log, mp.ops.routing_log) if log or len(ctx) > 1]
    routes = [(g, c) for log in logs for g, c in zip(log, cpu.ops.routing_log, strict=True)]
    return tie, any(set(g[t].tolist()) != set(c[t].tolist()) for g, c in routes for t in range(len(ctx)))


def greedy_tokens(model, prompt, n, n_vocab=151669):
    """n greedy tokens from a fresh Qwen3 session (prefill, then decode each token but the last)."""
    rng = np.random.default_rng(0)
    lg, toks = model.prefill(prompt), []
    for _ in range(n):
        toks.append(model.ops.sample(lg, GREEDY, rng, prompt + toks, n_vocab))
        if len(toks) < n:
            lg = model.decode(toks[-1])
    return toks


def greedy_lockstep(ref, dut, prompt, n, n_vocab=151669):
    """n greedy tokens of ref (the CPU reference) and dut side by side, each fed ref's token: the steps both
    chose alike, and None, or the first step where dut chose otherwise with (ref's top-2 logit gap, the
    largest |dut - ref| logit difference at that step, dut's token, ref's runner-up). A tie closer than the
    step's own numerical difference is one neither side resolves; past it the contexts would differ."""
    rng = np.random.default_rng(0)
    lr, ld, toks = ref.prefill(prompt), dut.prefill(prompt), []
    for _ in range(n):
        tr = ref.ops.sample(lr, GREEDY, rng, prompt + toks, n_vocab)
        td = dut.ops.sample(ld, GREEDY, rng, prompt + toks, n_vocab)
        if td != tr:
            a = np.asarray(lr, np.float64).ravel()[:n_vocab]
            b = np.asarray(ld.get() if hasattr(ld, "get") else ld, np.float64).ravel()[:n_vocab]
            top = np.argsort(a)[::-1][:2]
            return toks, (float(a[top[0]] - a[top[1]]), float(np.abs(b - a).max()), td, int(top[1]))
        toks.append(tr)
        if len(toks) < n:
            lr, ld = ref.decode(tr), dut.decode(tr)
    return toks, None


def assert_greedy_up_to_a_tie(ref, dut, prompt, n):
    """greedy_lockstep's tokens, asserting that where dut parted from ref it chose ref's runner-up at a tie closer
    than the step's own logit difference (a tie neither side resolves)."""
    toks, tie = greedy_lockstep(ref, dut, prompt, n)
    if tie is not None:
        gap, err, got_tok, runner_up = tie
        assert got_tok == runner_up and gap < err, (len(toks), tie)
    return toks


def decode_logits(mf, ids, n_prefill, max_context, graphs):
    """GPU logits [len(ids) - n_prefill, V] of decoding ids[n_prefill:] one by one after a prefill,
    with the step replayed as a CUDA graph or launched eagerly."""
    import cupy as cp
    from kuiper_py.model import Qwen3
    from kuiper_py.ops_cupy import CupyOps
    m = Qwen3(mf, CupyOps, max_context)
    m.ops.graphs = graphs
    m.prefill(ids[:n_prefill])
    return np.stack([cp.asnumpy(m.decode(t)).copy() for t in ids[n_prefill:]])


def decode_cluster_merge_ab(mf, ids, n_prefill, monkeypatch, graphs=True):
    """{"0": logits, "1": logits} of decoding ids[n_prefill:] after a prefill with flash decoding's clusters'
    merge off and on (the attn_cm setting), the o GEMV's own merge forced to gemv_merge_span at every split count and
    a short-context regime of 16 splits (4 keys per split at least, up to 64 keys); skips where the GPU cannot
    merge in clusters."""
    import cupy as cp
    import pytest
    from kuiper_py import ops_cupy as oc
    from kuiper_py.model import Qwen3
    tune(monkeypatch, attn_min_chunk=4)
    tune(monkeypatch, attn_short=(64,))
    tune(monkeypatch, gemv_o_merge=True)
    tune(monkeypatch, gemv_o_merge_min_splits=0)
    got = {}
    for cm in ("0", "1"):
        tune(monkeypatch, attn_cm=cm == "1")
        m = Qwen3(mf, oc.CupyOps, 64)
        m.ops.graphs = graphs
        a = m.ops.args
        if cm == "1":
            hb = oc.decode_heads_per_block(a.num_attention_heads, a.num_key_value_heads)
            if not oc.attn_cluster_merge(16, hb, a.head_dim):
                pytest.skip("no cluster merge on this GPU or shape")
            assert m.ops.plan.split_count(20) == 16
        m.prefill(ids[:n_prefill])
        got[cm] = np.stack([cp.asnumpy(m.decode(t)).copy() for t in ids[n_prefill:]])
    assert any(fn is not None for fn in oc._ATTN_CM_FNS.values())  # the clusters' instantiation ran
    return got


def decode_step_twice(mf, ids, n_prefill, max_context):
    """A GPU model prefilled with ids[:n_prefill] decodes ids[n_prefill] twice from the same cache
    position (the step replayed as a CUDA graph): (its ops, first logits, second logits)."""
    import cupy as cp
    from kuiper_py.model import Qwen3
    from kuiper_py.ops_cupy import CupyOps
    m = Qwen3(mf, CupyOps, max_context)
    m.prefill(ids[:n_prefill])
    a = cp.asnumpy(m.decode(ids[n_prefill])).copy()
    m.pos -= 1
    b = cp.asnumpy(m.decode(ids[n_prefill])).copy()
    return m.ops, a, b


def cpu_decode(mf, ids, n_prefill):
    """The NumPy engine's logits [len(ids) - n_prefill, V] for the decode steps of ids after a prefill."""
    from kuiper_py.model import Qwen3
    from kuiper_py.ops_numpy import NumpyOps
    ref = Qwen3(mf, NumpyOps, 96)
    ref.prefill(ids[:n_prefill])
    return np.stack([ref.decode(t) for t in ids[n_prefill:]])


def record_calls(monkeypatch, name, note):
    """Replaces ops_cupy's function `name` by a wrapper that appends note(*args, **kwargs) to the returned list,
    then calls the real one: which path each launch of a prefill took."""
    from kuiper_py import ops_cupy as oc
    seen, real = [], getattr(oc, name)

    def wrapper(*a, **k):
        seen.append(note(*a, **k))
        return real(*a, **k)
    patch(monkeypatch, name, wrapper)
    return seen


def accuracy_failures(fused, separate, cpu) -> list[str]:
    """The conditions of assert_as_accurate that fused misses (none: it holds)."""
    e_fused, e_sep, between = rel(fused, cpu), rel(separate, cpu), rel(fused, separate)
    return [c for c, held in ((f"e_fused {e_fused:.2e} < 1e-2", e_fused < 1e-2),
                              (f"e_fused {e_fused:.2e} < 1.5 * e_sep {e_sep:.2e}", e_fused < 1.5 * e_sep),
                              (f"between {between:.2e} < 2 * e_sep {e_sep:.2e}", between < 2 * e_sep)) if not held]


def assert_as_accurate(name, fused, separate, cpu):
    """A fused decode path's logits against the separate kernels' and the CPU reference's. Both GPU
    paths round activations to fp16 at the same points but sum in different fp32 orders, so a value
    near a rounding boundary can land on either side and the difference compounds over the layers:
    the property to hold is accuracy against the independent reference, as good as the separate
    kernels' (plus the e2e tests' 1e-2 bound)."""
    assert np.isfinite(fused).all()
    print(f"rel to the CPU reference: {name} {rel(fused, cpu):.2e}, separate kernels {rel(separate, cpu):.2e}; "
          f"between them {rel(fused, separate):.2e}")
    failed = accuracy_failures(fused, separate, cpu)
    assert not failed, failed


def cluster_plan_or_skip(kernel, CL, TB, n_clusters):
    """ops_cupy.ffn_cluster_plan for ffn_decode.cu's kernel (ffn_decode or moe_ffn_decode) at its (CL, TB)
    instantiation over n_clusters, or a skip where clusters or the driver's occupancy query are missing
    (before sm_90); its clusters must all be resident."""
    import pytest
    from kuiper_py import ops_cupy as oc
    if not oc.pdl_enabled() or oc.cu_occupancy_clusters() is None:
        pytest.skip("thread-block clusters need compute capability 9.0")
    plan = oc.ffn_cluster_plan(CL, TB, n_clusters, kernel)
    assert plan["clusters"] >= n_clusters
    return plan


def pending_row_inputs(rng, D, massive):
    """A one-token FFN half's inputs in accumulating mode: the residual row h (fp32), the norm weight w
    (fp16), the o projection's pending sums (int64, 32 fraction bits) and the row they make, h + fp16(o)
    added in fp32 as the kernels add it. massive: three channels at 1e5 with norm weight 40 (x = h * w
    past fp16's range before the deferred 1/rms), so the kernels' overflow guards run."""
    h = rng.standard_normal(D).astype(np.float32)
    w = (rng.random(D) + 0.5).astype(np.float16)
    if massive:
        rows = rng.choice(D, 3, replace=False)
        h[rows], w[rows] = 1e5, 40
    pend = np.round(rng.standard_normal(D) * 2**32).astype(np.int64)
    row = h + (pend.astype(np.float64) / 2**32).astype(np.float16).astype(np.float32)
    return h, w, pend, row


def assert_arena_prefills_same_bits(mf, monkeypatch, lengths=(37, 37, 12, 5)):
    """Prefills of the given lengths on one GPU model (a reset before each but the last, which continues the
    one before it at its position), every position's logits, with the activations from the ops' arena
    (the arena_max_t setting's default for these lengths) and from cupy.empty (arena_max_t 0): the
    same bits. Before each arena prefill its arrays are poisoned (NaN, -1), so a value read before this
    prefill wrote it shows; the arena is inactive between forwards."""
    import cupy as cp
    from kuiper_py import ops_cupy as oc
    from kuiper_py.cuda import memory as mem
    from kuiper_py.model import Qwen3
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 151643, size=n).tolist() for n in lengths]
    got = {}
    for on in (True, False):
        tune(monkeypatch, arena_max_t=512 if on else 0)
        m = Qwen3(mf, oc.CupyOps, 128)
        out = []
        for j, ids in enumerate(prompts):
            if j < len(prompts) - 1:
                m.reset()
            for _, _, a in m.ops.arena.slots.values():
                a.fill(-1 if a.dtype.kind == "i" else np.nan)
            out.append(cp.asnumpy(m.prefill(ids, all_logits=True)))
            assert mem.active_arena() is None
            assert bool(m.ops.arena.slots) == on
        got[on] = out
    for a, b in zip(got[True], got[False]):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)


def prefill_graph_spy(m):
    """A list that records, for each prefill of GPU session m, the bucket its graph ran at (None: eager)."""
    served, orig = [], m.ops.prefill_graph

    def spy(step, layers):
        x = orig(step, layers)
        served.append(None if x is None else x.shape[0])
        return x
    m.ops.prefill_graph = spy
    return served


def forget_zeroed_counters(monkeypatch):
    """Make the kernels' lazily made, zeroed counters (the wgmma GEMM's split tickets, the MoE routing's counters)
    be made again on their next use, and leave poisoned (-1) blocks of their sizes in CuPy's pool for that use to
    get: counters made inside a graph capture that is then retried would keep the poison (their memset captured,
    never run), and the prefills that use them go wrong."""
    import cupy as cp
    from kuiper_py import ops_cupy as oc
    for name in ("_GEMM_TICKETS", "_MOE_COUNTER", "_MOE_TILE_COUNTERS"):
        patch(monkeypatch, name, {})
    blocks = [cp.full((n,), -1, cp.int32) for n in (1, oc.MOE_ROUTE_MAX_TILES, 4096) for _ in range(8)]
    cp.cuda.Device().synchronize()
    del blocks


def assert_prefill_graphs_accurate(mf, prompts, ctx=160, n_greedy=12, after_first=None):
    """Prompts on one GPU session with prefill graphs, d["logits"] poisoned (NaN) before each: an int is a fresh
    prompt of that length, a tuple one chat's turns (the cache reset before its first, each later turn continuing at
    the position the ones before left: pos0 > 0). The first prompt of a length bucket runs eagerly, the second
    captures the bucket's graph, later ones replay it at whatever position (returns the buckets served,
    prefill_graph_spy). Every prompt's last logits as accurate against the CPU reference as an eager GPU session's
    (the prompts of one bucket are different draws: each replay reads its own ids and position; a MoE router's near
    tie may go either way: reference_up_to_router_ties); then, after the
    last chat's turns but its last again, the greedy continuation of its last turn equals the CPU's up to a tie
    neither side resolves (the padding's cache rows are overwritten by decode before any step reads them).
    after_first() runs after the first prompt (before the first capture)."""
    import cupy as cp
    from kuiper_py import ops_cupy as oc
    from kuiper_py.model import Qwen3
    from kuiper_py.ops_numpy import NumpyOps
    rng = np.random.default_rng()
    m, eager, cpu = Qwen3(mf, oc.CupyOps, ctx), Qwen3(mf, oc.CupyOps, ctx), Qwen3(mf, NumpyOps, ctx)
    eager.ops.prefill_graphs = False
    served = prefill_graph_spy(m)
    def cpu_turns():  # the CPU reference's logits after the chat's turns so far, from a fresh session
        s = Qwen3(mf, NumpyOps, ctx)
        return [s.prefill(ids) for ids in turns][-1]
    for chat in (p if isinstance(p, tuple) else (p,) for p in prompts):
        for s in (m, eager):
            s.reset()
        turns = []
        for n in chat:
            turns.append(rng.integers(0, 151643, n).tolist())
            m.ops.d["logits"].fill(np.nan)
            got = cp.asnumpy(m.prefill(turns[-1])).copy()
            sep = cp.asnumpy(eager.prefill(turns[-1]))
            ref, _ = reference_up_to_router_ties(got, cpu_turns, ok=lambda r: not accuracy_failures(got, sep, r))
            assert_as_accurate("prefill graph", got, sep, ref)
            if after_first is not None and len(served) == 1:
                after_first()
    m.reset()
    cpu.reset()
    for ids in turns[:-1]:
        m.prefill(ids)
        cpu.prefill(ids)
    assert_greedy_up_to_a_tie(cpu, m, turns[-1], n_greedy)
    return served


def assert_chat_accurate(binf, turns=6):
    """A chat (generate.Chat) on the GPU: each turn's prefill continues the cache its earlier turns left (the previous
    reply's rows written by the decode graphs, queued ahead of the host), at a position > 0, through the prefill
    graph of its bucket, every bucket's captured when the chat began (Chat's warm, Qwen3.warm_prefill_graphs); each
    turn's logits (poisoned before it) are as accurate against a fresh CPU prefill of the whole rendered conversation
    as the e2e bound asks (up to a MoE router's near tie resolved the other way: reference_up_to_router_ties)."""
    import cupy as cp
    from kuiper_py import ops_cupy as oc
    from kuiper_py.generate import Chat, Engine
    from kuiper_py.model import Qwen3
    from kuiper_py.ops_numpy import NumpyOps
    rng = np.random.default_rng()
    words = ["sea", "stone", "river", "cloud", "lamp", "garden", "winter", "bridge", "violin", "harbour"]
    chat = Chat(Engine.load(binf, "cuda"), 512, system="Answer briefly.", enable_thinking=False)
    m, seen = chat.model, []
    served, real = prefill_graph_spy(m), m.prefill

    def prefill(ids, *a, **kw):
        m.ops.d["logits"].fill(np.nan)
        lg = real(ids, *a, **kw)
        seen.append((m.pos - len(ids), cp.asnumpy(lg).copy()))
        return lg
    m.prefill = prefill
    for turn in range(turns):
        recs = list(chat.turn(" ".join(rng.choice(words, 6)), 12, GREEDY))
        ids = chat.render(chat.messages[:-1])
        assert seen[-1][0] == recs[-1].cached_tokens == len(ids) - recs[-1].prompt_tokens
        assert (recs[-1].cached_tokens > 0) == (turn > 0)
        ref, tie = reference_up_to_router_ties(seen[-1][1],
                                               lambda: Qwen3(chat.engine.file, NumpyOps, len(ids)).prefill(ids))
        err = rel(seen[-1][1], ref)
        print(f"turn {turn}: {recs[-1].cached_tokens} cached + {recs[-1].prompt_tokens} new tokens, graph "
              f"{served[-1]}, rel to the CPU {err:.2e}{'' if tie is None else ' (a router tie the other way)'}")
        assert err < 1e-2
    if oc.wgmma_available():  # every turn replayed its bucket's graph, the first meeting of a bucket too
        assert chat.warmed == sorted({oc.prefill_bucket(t) for t in range(2, 513)})
        assert None not in served and len(served) == turns
    else:
        assert chat.warmed == []
