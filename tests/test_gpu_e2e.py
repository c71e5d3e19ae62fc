"""End to end on the GPU against the NumPy reference engine and transformers (device machine only)."""
import json

import numpy as np
import pytest

from conftest import ROOT, run_cli, run_python
from kuiper_py.cuda import memory as mem
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps
from reference import (PROMPT, assert_arena_prefills_same_bits, assert_as_accurate, assert_chat_accurate,
                       assert_prefill_graphs_accurate, cpu_decode,
                       decode_cluster_merge_ab, decode_logits, decode_step_twice, forget_zeroed_counters, greedy_tokens,
                       prefill_graph_spy, record_calls, rel, tune)

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")


@pytest.fixture(params=["tiny", "untied"])
def model_bin(request, tiny_bin, untied_bin, tiny_dir, untied_dir):
    return (tiny_bin, tiny_dir) if request.param == "tiny" else (untied_bin, untied_dir)


def test_prefill_arena_same_bits(model_bin, monkeypatch):
    """Short dense prefills with their activations from the ops' arena against cupy.empty's: the same bits
    (reference.py assert_arena_prefills_same_bits)."""
    assert_arena_prefills_same_bits(load(model_bin[0]), monkeypatch)


def test_prefill_arena_released_after_an_error_and_by_a_long_prompt(model_bin, monkeypatch):
    """A forward that fails midway leaves no arena active (later direct kernel calls get fresh arrays), and
    a prompt past the arena_max_t setting gives the arena's arrays back before it runs."""
    m = Qwen3(load(model_bin[0]), oc.CupyOps, 64)
    m.prefill(list(range(1, 9)))
    assert m.ops.arena.slots and mem.active_arena() is None

    def fail(*a, **k):
        raise RuntimeError("injected")
    monkeypatch.setattr(m.ops, "attention", fail)
    m.reset()
    with pytest.raises(RuntimeError, match="injected"):
        m.prefill(list(range(1, 9)))
    assert mem.active_arena() is None
    monkeypatch.undo()
    tune(monkeypatch, arena_max_t=4)
    m.reset()
    m.prefill(list(range(1, 9)))
    assert not m.ops.arena.slots and mem.active_arena() is None


@pytest.fixture(scope="module")
def small_bin(ckpt_root):
    """The smallest dense preset whose every prefill projection takes the fused GEMMs on sm_90 (the tiny presets'
    narrow matrices go through cuBLAS, which a graph capture cannot hold)."""
    from kuiper_py import synth
    from kuiper_py.export import export
    out = ckpt_root / "pg-small.bin"
    if not out.exists():
        export(synth.make_checkpoint(ckpt_root / "pg-small", "small", seed=6, n_shards=1), out, progress=False,
               log=lambda m: None)
    return out


def test_prefill_graphs_match_eager_and_reference(small_bin, monkeypatch):
    """Short fresh prompts through prefill graphs (reference.assert_prefill_graphs_accurate): four prompts of the
    48-token bucket (eager, capture, two replays), two of the 112-token one, then the greedy continuation; the
    kernels' zeroed counters made again at the first capture (reference.forget_zeroed_counters)."""
    if not oc.wgmma_available():
        pytest.skip("before sm_90 the prefill projections go through cuBLAS: no prefill graph")
    served = assert_prefill_graphs_accurate(load(small_bin), (37, 40, 45, 33, 100, 97),
                                            after_first=lambda: forget_zeroed_counters(monkeypatch))
    assert served == [None, 48, 48, 48, None, 112, 112]


def test_prefill_graphs_serve_continued_prompts(small_bin):
    """A chat's later turns (pos0 > 0) through the same prefill graphs as fresh prompts (the position and
    the attention's cache maps are read on the device): three chats whose turns meet the 48-token bucket at
    positions 0, 9, 20, 33 and 46, each turn's logits as accurate as the eager prefill's, then a greedy continuation
    after two replayed turns (reference.assert_prefill_graphs_accurate)."""
    if not oc.wgmma_available():
        pytest.skip("before sm_90 the prefill projections go through cuBLAS: no prefill graph")
    served = assert_prefill_graphs_accurate(load(small_bin), ((20, 40), (33, 41), (9, 37, 45)))
    assert served == [None, None, 48, 48, None, 48, 48, 16, 48, 48]


def test_chat_on_gpu_continues_the_cache_accurately(small_bin):
    """reference.assert_chat_accurate on the small dense preset."""
    assert_chat_accurate(small_bin)


def test_chat_decode_graphs_captured_at_start_give_the_same_replies(small_bin, monkeypatch):
    """A chat captures each flash-decoding regime's decode graph at its start (Qwen3.warm_decode_graphs, at the
    regime's last position), where otherwise each is captured by the first step that meets it: with two regimes
    (a short bound at 256 keys, then the 512-position capacity) and turns that pass the bound, the replies are the
    same tokens as a chat without the start's captures, and no step captures another graph."""
    from kuiper_py.generate import Chat, Engine
    from kuiper_py.sampling import SamplingParams
    tune(monkeypatch, attn_short=(256,))
    rng = np.random.default_rng()
    words = ["sea", "stone", "river", "cloud", "lamp", "garden", "winter", "bridge", "violin", "harbour"]
    msgs = [" ".join(rng.choice(words, 8)) for _ in range(5)]
    replies = {}
    for warm in (True, False):
        chat = Chat(Engine.load(small_bin, "cuda"), 512, enable_thinking=False, warm=warm)
        graphs = chat.model.ops.decode_graph_cache
        assert chat.warmed_decode == ([256, 512] if warm else []) and sorted(graphs) == chat.warmed_decode
        replies[warm] = [list(chat.turn(t, 40, SamplingParams(temperature=0.0), eos_ids=[]))[-1].tokens
                         for t in msgs]
        assert chat.model.pos > 256 and sorted(graphs) == [256, 512]
    assert replies[True] == replies[False]


def test_cli_chat_cuda_matches_cpu(tiny_bin):
    lines = "Tell me a story\nAbout the sea, please\n/reset\nTell me a story\n"
    args = ["chat", "-m", tiny_bin, "--temp", "0", "-n", 16, "--json"]
    g = run_cli(*args, "--device", "cuda", input=lines)
    c = run_cli(*args, "--device", "cpu", input=lines)
    assert g.returncode == 0 and c.returncode == 0, g.stderr + c.stderr
    got, want = ([json.loads(x) for x in r.stdout.splitlines()] for r in (g, c))
    assert [x["tokens"] for x in got] == [x["tokens"] for x in want]
    assert [x["cached_tokens"] for x in got] == [x["cached_tokens"] for x in want]


def test_generate_captures_its_decode_graphs_before_the_prompt(small_bin, monkeypatch):
    """generate() captures the decode graphs of the regimes its steps will meet before it runs the prompt (so a
    generation's decode speed does not count their capture, or a first run's kernel compiles): with a short bound at
    256 keys and a 512-position cache, a 40-token prompt and 300 tokens pass the bound, and a 40-token generation does
    not. The graphs are there before the first record, no step captures another, warmup_seconds counts the captures,
    and the greedy tokens are the ones of a generation that captures them as it goes (the same engine, its graphs
    dropped). (Not against the CPU engine token for token: a random-weight model's greedy path meets near-ties
    within 40 tokens, which greedy_lockstep's tests tell apart from errors.)"""
    from kuiper_py.generate import Engine, generate
    from kuiper_py.sampling import SamplingParams
    tune(monkeypatch, attn_short=(256,))
    greedy = SamplingParams(temperature=0.0)
    prompt = np.random.default_rng().integers(0, 1000, size=40).tolist()
    eng = Engine.load(small_bin, "cuda", need_tokenizer=False)
    for n, regimes in ((300, [256, 512]), (40, [256])):
        eng.session(512).ops.decode_graph_cache.clear()
        records = generate(eng, prompt, n, greedy, max_context=512, eos_ids=[])
        assert sorted(eng.model.ops.decode_graph_cache) == regimes
        last = list(records)[-1]
        assert sorted(eng.model.ops.decode_graph_cache) == regimes and len(last.tokens) == n and last.warmup_seconds > 0
    ops = eng.model.ops
    monkeypatch.setattr(ops, "warm_decode_graphs", lambda *a, **k: [])
    ops.decode_graph_cache.clear()
    lazy = list(generate(eng, prompt, 40, greedy, max_context=512, eos_ids=[]))[-1]
    assert lazy.warmup_seconds < last.warmup_seconds and sorted(ops.decode_graph_cache) == [256]
    assert lazy.tokens == last.tokens


# The free-memory tests run in a fresh process: in a long run, memory that earlier tests left to the garbage collector
# or to CUDA's deferred frees comes back between the count and the refusal, so neither side would be what it says.
def _in_fresh_process(code: str, path) -> None:
    r = run_python("-c", code, path, cwd=ROOT)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


_UPLOAD_REFUSED = """
import sys
import cupy as cp
from kuiper_py import ops_cupy as oc
from kuiper_py.errors import ResourceError
from kuiper_py.loader import load
mf = load(sys.argv[1])
need = mf.weights.lm_head.nbytes
assert need > 32 << 20
pool = cp.get_default_memory_pool()
free, _ = cp.cuda.runtime.memGetInfo()
hold = cp.cuda.runtime.malloc(free - (16 << 20))
try:
    before, _ = cp.cuda.runtime.memGetInfo()
    used = pool.used_bytes()
    try:
        oc.CupyOps(mf.args, mf.weights, 64, progress=False)
        raise SystemExit("loaded with 16 MiB free")
    except ResourceError as e:
        assert "GiB free" in str(e), e
    after, _ = cp.cuda.runtime.memGetInfo()
    assert pool.used_bytes() == used
    assert abs(after - before) < (4 << 20), (before, after)
finally:
    cp.cuda.runtime.free(hold)
ops = oc.CupyOps(mf.args, mf.weights, 64, progress=False)
assert ops.weights.lm_head.nbytes == need
print("ok")
"""


def test_upload_refuses_weights_that_cannot_fit_before_copying_any(untied_bin):
    """CupyOps refuses a file whose weights exceed the GPU's free memory before it copies any of them
    (loader.check_weights_fit at the upload): with all but 16 MiB of the free memory held outside CuPy's pool, the
    untied file (a 39 MB lm_head) raises ResourceError, and the device's free memory afterwards is what it was
    before. Released, the same file loads."""
    _in_fresh_process(_UPLOAD_REFUSED, untied_bin)


_KV_REFUSED = """
import re, sys
import cupy as cp
from kuiper_py import ops_cupy as oc
from kuiper_py.errors import ResourceError
from kuiper_py.loader import load
mf = load(sys.argv[1])
a = mf.args
per = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * 2
ops = oc.CupyOps(a, mf.weights, 64, progress=False)
cp.get_default_memory_pool().free_all_blocks()
free, _ = cp.cuda.runtime.memGetInfo()
try:
    ops.alloc_cache(2 * free // per)
    raise SystemExit("a cache of twice the free memory was allocated")
except ResourceError as e:
    assert "try a smaller --max-context" in str(e), e
    n = int(re.search(r"at most (\\d+) positions", str(e)).group(1))
assert abs(n - free // per) <= (256 << 20) // per, (n, free // per)
ops.alloc_cache(64)
assert ops.k_cache.shape[1] == 64 and ops.v_cache.shape[1] == 64
print("ok")
"""


def test_kv_cache_that_cannot_fit_says_how_many_positions_would(tiny_bin):
    """A KV cache larger than the GPU's free memory is refused with a ResourceError that says how many positions the
    free memory holds (fp16 K and V of every layer's KV heads per position, counted independently here), and the
    ops stay usable: a small cache allocates afterwards."""
    _in_fresh_process(_KV_REFUSED, tiny_bin)


def test_prefill_graph_refused_where_cublas_serves(model_bin):
    """The tiny presets' prefill calls cuBLAS (matrices narrower than the fused GEMMs take): the bucket's capture
    is abandoned, the bucket marked, and every prompt runs eagerly, as accurate as before."""
    served = assert_prefill_graphs_accurate(load(model_bin[0]), (37, 40, 45))
    assert served == [None] * 4


def test_prefill_graph_lifecycle(small_bin):
    """When a prefill graph serves and when it is dropped: for a continued prompt and for all_logits too, a padded end
    past the cache (at the start or after earlier turns) or after a new cache (which also forgets the buckets met);
    captured again after a module buffer it
    holds is replaced, and after the shared activations grow (which drops every graph captured before). A graph
    captured after a regrowth is as accurate as the eager prefill."""
    if not oc.wgmma_available():
        pytest.skip("before sm_90 the prefill projections go through cuBLAS: no prefill graph")
    mf = load(small_bin)
    m, eager, cpu = Qwen3(mf, oc.CupyOps, 200), Qwen3(mf, oc.CupyOps, 200), Qwen3(mf, NumpyOps, 200)
    eager.ops.prefill_graphs = False
    served = prefill_graph_spy(m)
    rng = np.random.default_rng()

    def fresh(n, **kw):
        m.reset()
        return m.prefill(rng.integers(0, 151643, n).tolist(), **kw)
    fresh(20)
    fresh(30)
    assert served == [None, 32] and set(m.ops.prefill_graph_cache) == {32}
    g32 = m.ops.prefill_graph_cache[32][0]
    m.prefill(rng.integers(0, 151643, 20).tolist())  # continues at position 30: the same graph
    assert served == [None, 32, 32] and m.ops.prefill_graph_cache[32][0] is g32
    fresh(25, all_logits=True)  # (a verify step's form: the same graph, every row's logits after it)
    assert served == [None, 32, 32, 32]
    oc._BUF_GEN[0] += 1  # as gemm_split_buffers replacing its partial sums
    fresh(31)
    assert served[-1] == 32 and m.ops.prefill_graph_cache[32][0] is not g32
    sizes = (m.ops.prefill_arena.size(0), m.ops.prefill_arena.size(1))
    fresh(150)
    fresh(160)
    assert served[-2:] == [None, 160]
    grew = sizes != (m.ops.prefill_arena.size(0), m.ops.prefill_arena.size(1))
    assert set(m.ops.prefill_graph_cache) == ({160} if grew else {32, 160})
    ids = rng.integers(0, 151643, 29).tolist()
    for s in (m, eager, cpu):
        s.reset()
    m.ops.d["logits"].fill(np.nan)
    got = cp.asnumpy(m.prefill(ids)).copy()
    assert served[-1] == 32
    assert_as_accurate("prefill graph", got, cp.asnumpy(eager.prefill(ids)), cpu.prefill(ids))
    fresh(193)  # bucket 224 > 200 positions
    fresh(193)
    assert served[-2:] == [None, None] and 224 not in m.ops.prefill_graph_cache
    fresh(170)
    m.prefill(rng.integers(0, 151643, 20).tolist())  # 170 + 20 positions fit, 170 + its bucket's 32 do not
    assert served[-1] is None
    m.set_context(256)
    assert not m.ops.prefill_graph_cache
    fresh(30)
    assert served[-1] is None
    m.ops.prefill_graphs = False
    fresh(30)
    fresh(30)
    assert served[-2:] == [None, None]


def test_prefill_logits_match_reference_and_transformers(model_bin):
    import torch
    from reference import hf_model
    binf, ckpt = model_bin
    mf = load(binf)
    gpu = Qwen3(mf, oc.CupyOps, 64).prefill(PROMPT, all_logits=True)
    ref = Qwen3(mf, NumpyOps, 64).prefill(PROMPT, all_logits=True)
    with torch.no_grad():
        hf = hf_model(ckpt)(torch.tensor([PROMPT])).logits[0].numpy()
    g = cp.asnumpy(gpu)
    assert rel(g, ref) < 1e-2
    assert rel(g, hf) < 1e-2


def test_greedy_64_tokens_identical_to_reference(model_bin):
    binf, _ = model_bin
    mf = load(binf)
    out = {name: greedy_tokens(Qwen3(mf, ops, len(PROMPT) + 64), PROMPT, 64)
           for name, ops in (("cpu", NumpyOps), ("gpu", oc.CupyOps))}
    assert out["gpu"] == out["cpu"]
    assert len(set(out["gpu"])) > 8


def test_decode_after_prefill_equals_full_prefill(untied_bin):
    rng = np.random.default_rng()
    ids = rng.integers(0, 151643, size=150).tolist()  # crosses the 64-row attention tile
    mf = load(untied_bin)
    full = cp.asnumpy(Qwen3(mf, oc.CupyOps, 160).prefill(ids, all_logits=True))
    m = Qwen3(mf, oc.CupyOps, 160)
    steps = [cp.asnumpy(m.prefill(ids[:100])).copy()]
    steps += [cp.asnumpy(m.decode(t)).copy() for t in ids[100:]]
    assert rel(np.stack(steps), full[99:]) < 1e-2


def test_cli_generate_cuda_matches_cpu(tiny_bin):
    args = ["generate", "-m", tiny_bin, "-p", "Tell me a story", "--temp", "0", "-n", 40, "--json"]
    g = run_cli(*args, "--device", "cuda")
    c = run_cli(*args, "--device", "cpu")
    assert g.returncode == 0 and c.returncode == 0, g.stderr + c.stderr
    assert json.loads(g.stdout)["tokens"] == json.loads(c.stdout)["tokens"]
    assert "GPU" in g.stderr
    b = run_cli("bench", "-m", tiny_bin, "-p", "64", "-n", "16", "-r", "2", "-o", "json", "--device", "cuda")
    assert b.returncode == 0, b.stderr
    assert {r["test"] for r in json.loads(b.stdout)} == {"pp64", "tg16"}


def test_queued_ahead_generation_equals_serial(untied_bin, monkeypatch):
    """generate() queues each step on the device's drawn token before the host reads it (a stop then
    takes the queued step back): the same tokens, positions and following logits as the serial loop."""
    from kuiper_py.generate import Engine, generate
    from kuiper_py.sampling import SamplingParams
    prompt = np.random.default_rng().integers(0, 151643, size=20).tolist()
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repeat_penalty=1.3, seed=11)
    ahead = []
    orig = Qwen3.decode_sampled

    def counted(self):
        ahead.append(self.pos)
        return orig(self)
    monkeypatch.setattr(Qwen3, "decode_sampled", counted)

    def run(queued, eos):
        eng = Engine.load(untied_bin, "cuda", need_tokenizer=False)
        m = eng.session(64)
        ahead.clear()
        with monkeypatch.context() as mp:
            if not queued:  # the serial loop: sample() back to the host, then decode() of its token
                mp.setattr(Qwen3, "can_queue_ahead", property(lambda self: False))
            recs = list(generate(eng, prompt, 24, params, eos_ids=eos, max_context=64))
        return m, [(r.token, r.finish_reason, r.decode_steps) for r in recs], len(ahead)

    _, ref, n = run(False, [])
    assert n == 0
    _, got, n = run(True, [])
    assert got == ref and ref[-1][1] == "length" and n == ref[-1][2]  # every step queued ahead
    eos = [ref[7][0]]  # stop at the first occurrence of the 8th token
    serial, ref, _ = run(False, eos)
    queued, got, n = run(True, eos)
    assert got == ref and ref[-1][1] == "stop"
    assert n == ref[-1][2] + 1 and queued.pos == serial.pos  # the step queued ahead of the stop was undone
    more = [151644, 872, 198]
    a, b = cp.asnumpy(queued.prefill(more)), cp.asnumpy(serial.prefill(more))
    np.testing.assert_array_equal(a, b)
    t = int(np.argmax(a))
    np.testing.assert_array_equal(cp.asnumpy(queued.decode(t)), cp.asnumpy(serial.decode(t)))


def test_greedy_draw_in_graph_equals_draw_kernel(untied_bin, monkeypatch):
    """Greedy decode's draw inside the decode graph (the lm_head's argmax, advance_position's id) gives
    the tokens the sampling kernel draws (handed a copy of the same logits, which the graph's argmax does not
    serve), queued ahead or not, and takes over every decode step's draw."""
    from kuiper_py.generate import Engine, generate
    from kuiper_py.sampling import SamplingParams
    prompt = np.random.default_rng().integers(0, 151643, size=20).tolist()
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    out = {}
    for fused in (False, True):
        eng = Engine.load(untied_bin, "cuda", need_tokenizer=False)
        m = eng.session(64)
        if not fused:
            launch = m.ops.sample_launch
            monkeypatch.setattr(m.ops, "sample_launch", lambda logits, *a: launch(logits.copy(), *a))
        recs = list(generate(eng, prompt, 30, greedy, eos_ids=[], max_context=64))
        out[fused] = [r.token for r in recs]
        assert m.ops.fused_draws == (29 if fused else 0)  # every draw but the prompt's
        with monkeypatch.context() as mp:  # the serial loop too
            mp.setattr(Qwen3, "can_queue_ahead", property(lambda self: False))
            assert [r.token for r in generate(eng, prompt, 30, greedy, eos_ids=[], max_context=64)] == out[fused]
    assert out[True] == out[False] and len(set(out[True])) > 5


def test_decode_plan_describes_the_loaded_backend(untied_bin):
    """The decode plan (cuda/plan.py) of a loaded backend follows its load-time choices and names every launch of a
    layer; `describe` is what `kuiper info MODEL --plan` prints."""
    from kuiper_py.cuda.plan import describe
    for path in (untied_bin,):
        m = Qwen3(load(path), oc.CupyOps, 64)
        p = m.ops.plan
        assert (p.acc_attn, p.acc_mode, p.attn_splits) == (m.ops.acc_attn, m.ops.acc_mode, m.ops.attn_splits)
        assert p.dense[0].kernel == "gemv_w4a16 q|k|v" and bool(p.moe_layer) == bool(m.args.num_experts)
        text = describe(m)
        assert text.startswith("decode plan on ") and f"{len(p.dense)}. " in text


def test_graph_decode_equals_eager_decode(untied_bin):
    rng = np.random.default_rng()
    ids = rng.integers(0, 151643, size=40).tolist()
    mf = load(untied_bin)
    runs = [decode_logits(mf, ids, 10, 64, graphs) for graphs in (False, True)]
    assert rel(runs[1], runs[0]) < 1e-3  # same kernels; only the split count of attention differs


@pytest.mark.parametrize("bounds", ["25", "14,25"])
def test_short_context_attention_regime_switch(untied_bin, bounds, monkeypatch):
    """attn_short: up to 25 keys flash decoding's grid holds only the splits 25 keys can use (the o GEMV's
    merge the same count), past it the capacity's; with a second bound at 14 keys, up to 14 keys a grid of
    the splits 14 keys can use. The decode graph of each regime is captured once, the host picks one per
    step. Logits across the switches (positions 10-39, min_chunk 7 so that the short regimes have 2 and 4
    splits against the capacity's) against the capacity's grid alone, with graphs and eagerly."""
    rng = np.random.default_rng()
    ids = rng.integers(0, 151643, size=40).tolist()
    mf = load(untied_bin)
    tune(monkeypatch, attn_min_chunk=7)
    tune(monkeypatch, attn_short=())
    ref = decode_logits(mf, ids, 10, 64, True)
    want = tuple(int(b) for b in bounds.split(","))
    tune(monkeypatch, attn_short=want)
    for graphs in (True, False):
        m = Qwen3(mf, oc.CupyOps, 64)
        assert m.ops.attn_short == want and m.ops.plan.split_count(25) == 4 < m.ops.attn_splits
        assert m.ops.plan.split_count(14) == (2 if len(want) == 2 else 4)
        m.ops.graphs = graphs
        m.prefill(ids[:10])
        got = np.stack([cp.asnumpy(m.decode(t)).copy() for t in ids[10:]])
        assert len(m.ops.decode_graph_cache) == ((1 + len(want)) if graphs else 0)
        assert rel(got, ref) < 1e-3


@pytest.mark.parametrize("graphs", [True, False])
def test_cluster_merged_attention_decode_same_bits(untied_bin, graphs, monkeypatch):
    """Decode with flash decoding's splits merged by their own clusters (16 splits in the graph's short regime,
    2-16 eagerly, where the count allows) gives bitwise the logits of the o GEMV merging the same partials in
    its prologue with gemv_merge_span (forced here at every split count), within 1e-2 of the CPU reference."""
    ids = np.random.default_rng().integers(0, 151643, size=60).tolist()
    mf = load(untied_bin)
    got = decode_cluster_merge_ab(mf, ids, 10, monkeypatch, graphs)
    np.testing.assert_array_equal(got["1"], got["0"])
    ref = Qwen3(mf, NumpyOps, 64)
    ref.prefill(ids[:10])
    cpu = np.stack([ref.decode(t) for t in ids[10:]])
    assert rel(got["1"], cpu) < 1e-2


@pytest.mark.parametrize("min_chunk", [100, 333])
def test_long_splits_on_tensor_cores_decode(untied_bin, min_chunk, monkeypatch):
    """Flash decoding's splits past 64 keys on tensor cores (attn_split_mma_long: 64-key tiles, the last
    partial) in graph-replayed decode steps at 3000-3005 cached positions, against the scalar loop and the
    CPU reference. min_chunk forces long splits on this small model (its capacity would give 32 keys)."""
    rng = np.random.default_rng()
    ids = rng.integers(0, 151643, size=3006).tolist()
    mf = load(untied_bin)
    tune(monkeypatch, attn_min_chunk=min_chunk)
    got = {}
    for on in (True, False):
        tune(monkeypatch, attn_mma_long=on)
        m = Qwen3(mf, oc.CupyOps, 3100)
        m.prefill(ids[:3000])
        got[on] = np.stack([cp.asnumpy(m.decode(t)).copy() for t in ids[3000:]])
        assert len(m.ops.decode_graph_cache) == 1
    ref = Qwen3(mf, NumpyOps, 3100)
    ref.prefill(ids[:3000])
    cpu = np.stack([ref.decode(t) for t in ids[3000:]])
    assert_as_accurate("long tensor-core splits", got[True], got[False], cpu)


def test_accumulating_decode_against_reduction_tails_and_reference(untied_bin, monkeypatch):
    """Dense decode's accumulating mode (the default; split-K sums added in fixed point, residual add
    and SwiGLU in the consuming GEMV) against the last-block reductions and the NumPy reference, graph
    and eager; and one step repeated from the same cache: bitwise the same logits."""
    rng = np.random.default_rng()
    ids = rng.integers(0, 151643, size=40).tolist()
    mf = load(untied_bin)
    cpu = cpu_decode(mf, ids, 10)
    errs = {}
    for acc in (True, False):
        tune(monkeypatch, gemv_acc=acc)
        assert Qwen3(mf, oc.CupyOps, 8).ops.acc_mode == acc
        for graphs in (True, False):
            errs[acc, graphs] = rel(decode_logits(mf, ids, 10, 64, graphs), cpu)
    print("rel to the CPU reference (accumulating, graphs):", errs)
    for acc, graphs in errs:
        assert errs[acc, graphs] < 1e-2
        assert errs[True, graphs] < 1.5 * errs[False, graphs]
    tune(monkeypatch, gemv_acc=True)
    ops, a, b = decode_step_twice(mf, ids, 10, 64)
    assert np.array_equal(a, b)
    assert int(cp.count_nonzero(ops.d["acc_d"])) == 0


# ---------------------------------------------------------------------------------------------
# Synthetic files of a preset's shapes with `layers` layers (two of Qwen3-0.6B's for the prefill paths below).


def _synth_bin(ckpt_root, name, preset, layers):
    from kuiper_py import synth
    from kuiper_py.export import export
    out = ckpt_root / f"da-{name}.bin"
    if not out.exists():
        d = synth.make_checkpoint(ckpt_root / f"da-{name}", preset, seed=7, n_shards=1, layers=layers)
        export(d, out, progress=False, log=lambda m: None)
    return out


def test_prefill_rs_path_matches_reference(ckpt_root, monkeypatch):
    """A 600-token prefill of two Qwen3-0.6B-shaped layers, every projection on the "rs" path (inside each
    shape's rs_range; 600 rows: ragged last token tiles) on Hopper, against the CPU engine's logits at every
    position and against the same GPU prefill with the rs path turned off."""
    if not oc.wgmma_available():
        pytest.skip("the rs path needs compute capability 9.0")
    mf = load(_synth_bin(ckpt_root, "0.6b", "0.6b", 2))
    ids = np.random.default_rng().integers(0, 151643, size=600).tolist()
    calls = record_calls(monkeypatch, "gemm_rs", lambda *a, **k: a[1])
    tune(monkeypatch, gemm_rs="auto")
    rs = cp.asnumpy(Qwen3(mf, oc.CupyOps, 608).prefill(ids, all_logits=True))
    assert len(calls) == 2 * 4  # q|k|v, o, gate|up, down in each layer
    tune(monkeypatch, gemm_rs="0")
    other = cp.asnumpy(Qwen3(mf, oc.CupyOps, 608).prefill(ids, all_logits=True))
    assert len(calls) == 8
    ref = Qwen3(mf, NumpyOps, 608).prefill(ids, all_logits=True)
    assert np.isfinite(rs).all()
    assert rel(rs, ref) < 1e-2 and rel(rs, other) < 1e-2


def test_new_prompt_length_plans_each_shape_once_not_each_layer(ckpt_root, monkeypatch):
    """A prompt length the process has not seen (what every turn of a chat meets) plans each projection shape's
    fused GEMM once and encodes one TMA descriptor per KV cache, however many layers share them (docs/PERFORMANCE.md: plans and descriptors per layer made a new length's host side ~6 ms slower on 30B-A3B). Two
    layers of Qwen3-0.6B shapes on Hopper; the logits of the new length equal those of a fresh engine's."""
    if not oc.wgmma_available():
        pytest.skip("the fused GEMMs and flash_attn_wgmma need compute capability 9.0")
    mf = load(_synth_bin(ckpt_root, "0.6b", "0.6b", 2))
    ids = np.random.default_rng().integers(0, 151643, size=120).tolist()
    m = Qwen3(mf, oc.CupyOps, 128)
    m.prefill(ids[:100])
    shapes = lambda x, mats, *a: tuple((w.K, w.N) for w in mats)  # noqa: E731
    wg, rs = record_calls(monkeypatch, "wgmma_call", shapes), record_calls(monkeypatch, "rs_call", shapes)
    encodes = record_calls(monkeypatch, "tmap_encode", lambda dtype, ptr, *a: ptr)
    m.reset()
    new = cp.asnumpy(m.prefill(ids[:113], all_logits=True))
    builds = wg + rs
    assert len(mf.weights.layers) == 2 and len(builds) == len(set(builds)) == 4  # q|k|v, o, gate|up, down
    caches = {m.ops.k_cache.data.ptr, m.ops.v_cache.data.ptr}
    assert sorted(p for p in encodes if p in caches) == sorted(caches)
    assert not [p for p in encodes if p not in caches and any(
        c.data.ptr <= p < c.data.ptr + c.nbytes for c in (m.ops.k_cache, m.ops.v_cache))]  # no per-layer map
    monkeypatch.undo()
    fresh = cp.asnumpy(Qwen3(mf, oc.CupyOps, 128).prefill(ids[:113], all_logits=True))
    assert np.isfinite(new).all()
    np.testing.assert_array_equal(new, fresh)


def test_prefill_attention_wgmma_path_matches_reference(ckpt_root, monkeypatch):
    """A 700-token prefill of two Qwen3-0.6B-shaped layers (head dim 128) with its attention on attn_wgmma.cu
    (Hopper's default: both layers' launches counted), in two chunks (500 tokens, then 200 at position 500),
    against the CPU engine's logits at every position and against the same prefill on attention.cu's kernel."""
    if not oc.wgmma_available():
        pytest.skip("flash_attn_wgmma needs compute capability 9.0")
    mf = load(_synth_bin(ckpt_root, "0.6b", "0.6b", 2))
    ids = np.random.default_rng().integers(0, 151643, size=700).tolist()
    paths = record_calls(monkeypatch, "attention_prefill",
                          lambda *a, **k: k.get("path") or ("wgmma" if oc.attn_wgmma_fits(a[0].shape[2]) else "mma"))

    def run(ops):
        m = Qwen3(mf, ops, 704)
        return np.concatenate([np.asarray(cp.asnumpy(m.prefill(ids[:500], all_logits=True))),
                               np.asarray(cp.asnumpy(m.prefill(ids[500:], all_logits=True)))])
    wg = run(oc.CupyOps)
    assert paths == ["wgmma"] * 4
    tune(monkeypatch, attn_wgmma="0")
    mma = run(oc.CupyOps)
    assert paths[4:] == ["mma"] * 4
    ref = run(NumpyOps)
    assert np.isfinite(wg).all()
    assert rel(wg, ref) < 1e-2 and rel(wg, mma) < 1e-2


# ---------------------------------------------------------------------------------------------
# The one-launch FFN half (ffn_decode.cu: RMSNorm, gate/up, SwiGLU and down of a dense decode layer
# in one cluster launch) at shapes it serves: two layers of Qwen3-0.6B (clusters of 4 blocks, one
# down tile each) and of a 2048-wide model (clusters of 8, Qwen3-8B's cluster size; the CPU reference
# of wider models takes minutes). The kernel test in test_cuda_ffn_decode.py covers every instantiation against NumPy.
_W2K = (2048, 3072, 2, 16, 8, 128, True)  # hidden, intermediate, layers, heads, kv heads, head_dim, tied


@pytest.fixture(scope="module", params=["0.6b", "w2k"])
def ffn_bin(request, ckpt_root):
    from kuiper_py import synth
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synth.PRESETS, "w2k", _W2K)
        return _synth_bin(ckpt_root, request.param, request.param, 2)


def _ffn_decode(mf, ids, n_prefill, graphs, on, monkeypatch, ctx=96):
    tune(monkeypatch, decode_ffn="1" if on else "0")
    m = Qwen3(mf, oc.CupyOps, ctx)
    assert (m.ops.ffn_plan is not None) == on, m.ops.decode_ffn_why
    m.ops.graphs = graphs
    m.prefill(ids[:n_prefill])
    if on:  # poison the decode buffers: a stale value read by the fused path would pass unnoticed
        for k in ("act", "qrot", "part_o", "part_ml"):
            m.ops.d[k].fill(np.nan)
    return m, np.stack([cp.asnumpy(m.decode(t)).copy() for t in ids[n_prefill:]])


@pytest.mark.parametrize("graphs", [True, False])
def test_one_launch_ffn_half_matches_separate_kernels_and_reference(ffn_bin, graphs, monkeypatch):
    rng = np.random.default_rng()
    ids = rng.integers(0, 151643, size=30).tolist()  # 20 decode steps
    mf = load(ffn_bin)
    m, fused = _ffn_decode(mf, ids, 10, graphs, True, monkeypatch)
    print("plan:", m.ops.decode_ffn_why)
    assert int(cp.count_nonzero(m.ops.d["acc_d"])) == 0  # the final norm finished the last down sums and cleared them
    _, separate = _ffn_decode(mf, ids, 10, graphs, False, monkeypatch)
    assert_as_accurate("one-launch FFN", fused, separate, cpu_decode(mf, ids, 10))


@pytest.mark.parametrize("graphs", [True, False])
def test_one_launch_ffn_global_exchange(ffn_bin, graphs, monkeypatch):
    """The one-launch FFN without a cluster launch (ops_cupy.ffn_global_plan, forced: these shapes need
    fewer than 3 blocks per SM) in real decode steps: the same logits, bit for bit, as the cluster launch
    (the same sums in the same order), after the poisoned buffers of _ffn_decode; greedy tokens equal to
    the CPU's."""
    rng = np.random.default_rng()
    ids = rng.integers(0, 151643, size=30).tolist()
    mf = load(ffn_bin)
    tune(monkeypatch, ffn_global="1")
    m, glob = _ffn_decode(mf, ids, 10, graphs, True, monkeypatch)
    assert m.ops.ffn_plan.get("xslots") is not None, m.ops.decode_ffn_why
    assert int(cp.count_nonzero(m.ops.d["acc_d"])) == 0
    tune(monkeypatch, ffn_global="0")
    m2, clus = _ffn_decode(mf, ids, 10, graphs, True, monkeypatch)
    assert m2.ops.ffn_plan.get("xslots") is None
    np.testing.assert_array_equal(glob, clus)
    if graphs:
        tune(monkeypatch, ffn_global="1")
        assert greedy_tokens(Qwen3(mf, oc.CupyOps, len(PROMPT) + 24), PROMPT, 24) == \
            greedy_tokens(Qwen3(mf, NumpyOps, len(PROMPT) + 24), PROMPT, 24)


def test_one_launch_ffn_half_greedy_and_deterministic(ffn_bin, monkeypatch):
    mf = load(ffn_bin)
    tune(monkeypatch, decode_ffn="1")
    fused = greedy_tokens(Qwen3(mf, oc.CupyOps, len(PROMPT) + 24), PROMPT, 24)
    assert fused == greedy_tokens(Qwen3(mf, NumpyOps, len(PROMPT) + 24), PROMPT, 24)
    ops, a, b = decode_step_twice(mf, PROMPT, len(PROMPT) - 1, 64)
    assert ops.ffn_plan is not None
    assert np.array_equal(a, b)  # fixed-point sums, rank-ordered cluster sums: bitwise the same
