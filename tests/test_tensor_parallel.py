"""Tensor and expert parallelism on the CPU (`--tp N`: N ranks as threads of one process, parallel.comm.LocalGroup):
the sharded forward against the one-rank forward and against transformers' model in float64, through the Python API
and the CLI, dense and MoE; the sharding rules; the refusals; the communicator itself.

Tolerance: a tensor-parallel rank runs the same float32 operations on its slices, and only the order of some sums
changes (the o and down projections' partial sums over ranks, a token's experts summed per rank then over ranks, the
lm_head's rows in other blocks). Its rounding error against the exact forward (transformers in float64 on the same
dequantized weights) is then of the size of the one-rank forward's own: the test allows twice it, and by the triangle
inequality the two float32 forwards then differ by at most three times it."""
import dataclasses
import json
import signal

import httpx
import numpy as np
import pytest

from conftest import run_cli
from kuiper_py import synth
from kuiper_py.errors import KuiperError
from kuiper_py.export import export
from kuiper_py.generate import Engine
from kuiper_py.loader import load
from kuiper_py.parallel.comm import LocalGroup
from kuiper_py.parallel.shard import check_tp, shard
from reference import assert_greedy_up_to_a_tie, hf_model, hf_moe_model

G = 32  # AWQ group size of the test files: small enough that tiny's heads and MLP split 4 ways in whole groups


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{kind: (checkpoint dir, ak48 file)}: a dense tied model and an MoE model with a dense layer, untied."""
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for kind, preset, seed in (("dense", "tiny", 11), ("moe", "tiny-moe-mixed", 12)):
        d = synth.make_checkpoint(root / preset, preset, seed=seed, n_shards=1, group_size=G)
        export(d, root / f"{preset}.bin", progress=False, log=lambda m: None)
        out[kind] = (d, root / f"{preset}.bin")
    return out


def exact_logits(kind, ckpt, ids):
    """transformers' logits [T, V] for ids, in float64 on the dequantized weights."""
    import torch
    model = (hf_model if kind == "dense" else hf_moe_model)(ckpt).double()
    if kind == "moe":
        model.set_experts_implementation("eager")  # (the grouped kernels take no float64)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp_logits_as_accurate_as_one_rank(files, kind):
    ckpt, path = files[kind]
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 151643, size=9)]
    exact = exact_logits(kind, ckpt, ids)
    one = Engine.load(path, "cpu", need_tokenizer=False).session(16).prefill(ids, all_logits=True)
    err1 = np.abs(one - exact).max()
    assert err1 < 1e-3 * np.abs(exact).max()  # the one-rank forward is the float32 reference it is known to be
    for tp in (2, 4):
        got = Engine.load(path, "cpu", need_tokenizer=False, tp=tp).session(16).prefill(ids, all_logits=True)
        err = np.abs(got - exact).max()
        print(f"{kind} tp {tp}: max |tp - float64| {err:.3g}, tp 1's {err1:.3g}, |tp - tp 1| "
              f"{np.abs(got - one).max():.3g}")
        assert err <= 2 * err1, (tp, err, err1)
        assert np.abs(got - one).max() <= 3 * err1


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp_decode_and_greedy_tokens_match_one_rank(files, kind):
    """Prefill then decode steps through the KV cache: the same greedy tokens as one rank (up to a tie closer than
    the step's own logit difference), and the MoE routes the same experts."""
    _, path = files[kind]
    prompt = [int(t) for t in np.random.default_rng(6).integers(0, 151643, size=5)]
    one = Engine.load(path, "cpu", need_tokenizer=False).session(32)
    for tp in (2, 4):
        one.reset()
        one.ops.routing_log.clear()
        par = Engine.load(path, "cpu", need_tokenizer=False, tp=tp).session(32)
        toks = assert_greedy_up_to_a_tie(one, par, prompt, 12)
        assert len(toks) == 12
        if kind == "moe":
            for r in par.ranks:  # every rank routes (the router is replicated), as one rank does
                assert len(r.ops.routing_log) == len(one.ops.routing_log)
                assert all((a == b).all() for a, b in zip(r.ops.routing_log, one.ops.routing_log))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_cli_tp_gives_the_same_text(files, kind):
    _, path = files[kind]
    args = ("-m", path, "--device", "cpu", "-p", "The tide", "--raw", "-n", "10", "--temp", "0", "--json")
    want = run_cli("generate", *args)
    assert want.returncode == 0, want.stderr
    for tp in (2, 4):
        got = run_cli("generate", *args, "--tp", tp)
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["tokens"] == json.loads(want.stdout)["tokens"]


def test_cli_chat_and_bench_take_tp(files):
    _, path = files["moe"]
    want = run_cli("chat", "-m", path, "--device", "cpu", "-n", "6", "--temp", "0", "--json", input="hi\n")
    got = run_cli("chat", "-m", path, "--device", "cpu", "-n", "6", "--temp", "0", "--json", "--tp", "2",
                  input="hi\n")
    assert want.returncode == 0 and got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["tokens"] == json.loads(want.stdout)["tokens"]
    r = run_cli("bench", "-m", path, "--device", "cpu", "-p", "4", "-n", "2", "-r", "1", "-o", "json", "--tp", "4")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)) == 2


def test_serve_tp_answers_as_generate(files):
    from test_serve import start_server
    _, path = files["dense"]
    want = run_cli("generate", "-m", path, "--device", "cpu", "-p", "Once", "--raw", "-n", "6", "--temp", "0",
                   "--json")
    p, url = start_server(path, "--max-context", 64, "--tp", 2)
    try:
        got = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 6, "temperature": 0},
                         timeout=120).json()
        assert got["choices"][0]["text"] == json.loads(want.stdout)["text"]
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0


def one_error_line(r, *want):
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kuiper: error: "), r.stderr
    assert all(w in lines[0] for w in want), lines[0]
    assert r.stdout == ""


@pytest.mark.parametrize("cmd", ["generate", "chat", "bench", "serve"])
def test_refusals_are_one_line(files, tiny_bin, cmd):
    _, path = files["dense"]
    extra = {"generate": ("-p", "x"), "chat": (), "bench": ("-p", "4", "-n", "2"), "serve": ("--port", "0")}[cmd]
    cases = [(path, "3", ["--tp 3", "1, 2, 4, 8"]),
             (path, "8", ["4 attention heads"]),
             (tiny_bin, "4", ["AWQ groups of 128"]),  # (the conftest file: groups of 128, 64 rows a rank)
             (tiny_bin, "2", ["intermediate size 384"])]
    for model, tp, want in cases:
        one_error_line(run_cli(cmd, "-m", model, "--device", "cpu", "--tp", tp, *extra, input=""), *want)


def test_gpu_tp_refused_in_one_line(files):
    _, path = files["dense"]
    r = run_cli("generate", "-m", path, "--device", "cuda", "-p", "x", "--tp", "2")
    one_error_line(r, "--tp 2")
    assert "GPUs" in r.stderr or "not yet supported on the GPU" in r.stderr


def test_shapes_that_do_not_split_are_refused(files):
    mf = load(files["moe"][1])
    with pytest.raises(KuiperError, match="6 experts do not spread evenly over 4 ranks"):
        check_tp(dataclasses.replace(mf.args, num_experts=6), mf.weights, 4)
    with pytest.raises(KuiperError, match="3 KV heads neither split"):
        check_tp(dataclasses.replace(mf.args, num_key_value_heads=3), mf.weights, 2)


def _arrays(w):
    out = {"embed": w.embed, "lm_head": w.lm_head}
    for i, L in enumerate(w.layers):
        for p in ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "experts_w13", "experts_w2"):
            lin = getattr(L, p)
            if lin is not None:
                out.update({f"{p}.{i}.{t}": getattr(lin, t) for t in ("qweight", "qzeros", "scales")})
        if L.router is not None:
            out[f"router.{i}"] = L.router
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_holds_views_of_its_part_of_the_file(files, kind, tp):
    """Every shard is a view into the mapped file (no rank copies the file or a tensor of it), the split tensors'
    shards partition them (each byte with one rank), and q|k|v / o / gate|up / down have the shapes the rules say."""
    mf = load(files[kind][1])
    full = _arrays(mf.weights)
    ranks = [_arrays(shard(mf, r, tp).weights) for r in range(tp)]
    a = mf.args
    for name, whole in full.items():
        parts = [r[name] for r in ranks]
        for p in parts:
            assert not p.flags.owndata and np.shares_memory(p, whole), name
        split = not name.startswith(("embed", "router")) and not (tp > a.num_key_value_heads and
                                                                  name.startswith(("wk.", "wv.")))
        if split:
            assert sum(p.nbytes for p in parts) == whole.nbytes, name
            assert not any(np.shares_memory(parts[i], parts[j]) for i in range(tp) for j in range(i)), name
    r0 = shard(mf, 0, tp)
    L0, L = r0.weights.layers[0], mf.weights.layers[0]
    assert L0.wq.N == L.wq.N // tp and L0.wo.K == L.wo.K // tp
    assert L0.wk.N == a.head_dim * max(1, a.num_key_value_heads // tp)
    assert r0.args.num_attention_heads == a.num_attention_heads // tp
    if kind == "moe":
        assert L0.experts_w13.E == a.num_experts // tp and L0.router is L.router
    else:
        assert L0.w1.N == a.intermediate_size // tp and L0.w2.K == a.intermediate_size // tp


def test_local_group_collectives():
    rng = np.random.default_rng()
    n = 4
    xs = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(n)]
    g = LocalGroup(n)
    sums = g.run(lambda r: g.comm(r).all_reduce_sum(xs[r]))
    want = xs[0].copy()
    for x in xs[1:]:
        want += x
    assert all(np.array_equal(s, want) for s in sums)  # every rank the same bits
    gathered = g.run(lambda r: g.comm(r).all_gather(xs[r], axis=-1))
    assert all(np.array_equal(x, np.concatenate(xs, axis=-1)) for x in gathered)
    v = rng.standard_normal(40).astype(np.float32)
    v[[7, 33]] = v.max() + 1  # a tie across ranks 0 and 3: the lower id wins, as np.argmax
    parts = np.split(v, n)
    assert g.run(lambda r: g.comm(r).argmax(parts[r], r * 10)) == [7] * n
    g.run(lambda r: g.comm(r).barrier())


def test_an_error_in_one_rank_ends_every_rank():
    g = LocalGroup(3)

    def body(r):
        if r == 2:
            raise KuiperError("rank 2 failed")
        return g.comm(r).all_reduce_sum(np.ones(2, np.float32))  # ranks 0 and 1 would wait for rank 2

    with pytest.raises(KuiperError, match="rank 2 failed"):
        g.run(body)
    assert g.run(lambda r: g.comm(r).all_reduce_sum(np.ones(2, np.float32)).tolist()) == [[3.0, 3.0]] * 3


def test_combinations_not_served_yet_are_refused_in_one_line(files):
    """--tp above 1 with batching (bench --batch, serve --max-num-seqs), batching with speculation, a GPU --tp and
    batching on a backend that runs one sequence a step: each one line before anything loads or listens."""
    _, path = files["dense"]
    one_error_line(run_cli("bench", "-m", path, "--device", "cpu", "-p", "4", "-n", "2", "--batch", "2", "--tp", "2"),
                   "--batch", "--tp 2")
    one_error_line(run_cli("serve", "-m", path, "--device", "cpu", "--port", "0", "--max-num-seqs", "2", "--tp", "2"),
                   "--max-num-seqs", "--tp 2")
    one_error_line(run_cli("serve", "-m", path, "--device", "cpu", "--port", "0", "--max-num-seqs", "2",
                           "--lookup", "2"), "--max-num-seqs", "speculative")
    r = run_cli("serve", "-m", path, "--device", "cuda", "--port", "0", "--tp", "2")
    one_error_line(r, "--tp 2")
    r = run_cli("serve", "-m", path, "--device", "cuda", "--port", "0", "--max-num-seqs", "2")
    one_error_line(r)
