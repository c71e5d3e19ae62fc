"""Qwen3-MoE: v6 export layout and the NumPy engine against transformers' Qwen3MoeForCausalLM."""
import json

import numpy as np
import pytest

from kuiper_py import format as fmt
from kuiper_py import synth
from kuiper_py.errors import KuiperError
from kuiper_py.export import export
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps
from kuiper_py.st_reader import Checkpoint
from reference import hf_moe_model

torch = pytest.importorskip("torch")
PROMPT = [785, 6722, 315, 9625, 374, 11, 323, 279, 6722, 315, 9856, 374]


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-moe-mixed"])
def moe(request, tmp_path_factory):
    if request.param == "tiny-moe":  # (the session's, shared with other files)
        return request.getfixturevalue("moe_dir"), request.getfixturevalue("moe_bin")
    root = tmp_path_factory.mktemp(request.param)
    d = synth.make_checkpoint(root / "ck", request.param, seed=11, n_shards=2, tokenizer=False)
    export(d, root / "m.bin", progress=False, log=lambda m: None)
    return d, root / "m.bin"


def test_v6_header_and_expert_stacks(moe):
    d, binf = moe
    cfg = json.loads((d / "config.json").read_text())
    mf = load(binf)
    h = mf.header
    assert (h.version, h.model_type, h.num_experts, h.experts_per_tok) == (6, 2, cfg["num_experts"],
                                                                          cfg["num_experts_per_tok"])
    assert h.mlp_only_layers == tuple(cfg["mlp_only_layers"]) and mf.verify_checksum() is True
    ck = Checkpoint(d)
    for i, layer in enumerate(mf.weights.layers):
        if i in cfg["mlp_only_layers"]:
            assert layer.router is None and layer.w1 is not None
            continue
        e = cfg["num_experts"] - 1
        np.testing.assert_array_equal(layer.router, ck.get(f"model.layers.{i}.mlp.gate.weight"))
        w13 = layer.experts_w13.expert(e)
        for k in ("qweight", "qzeros", "scales"):
            want = np.concatenate([ck.get(f"model.layers.{i}.mlp.experts.{e}.gate_proj.{k}"),
                                   ck.get(f"model.layers.{i}.mlp.experts.{e}.up_proj.{k}")], axis=-1)
            np.testing.assert_array_equal(getattr(w13, k), want)
        np.testing.assert_array_equal(layer.experts_w2.expert(e).scales,
                                      ck.get(f"model.layers.{i}.mlp.experts.{e}.down_proj.scales"))
    # the region table accounts for every byte
    r = fmt.regions(h)
    assert r[-1].offset + r[-1].nbytes == h.weights_end == h.trailer_offset


def test_matches_transformers_routing_logits_and_greedy(moe):
    d, binf = moe
    hf = hf_moe_model(d)
    routes = []
    hooks = [m.mlp.gate.register_forward_hook(lambda mod, inp, out: routes.append(out[2].numpy()))
             for m in hf.model.layers if hasattr(m.mlp, "experts")]
    m = Qwen3(load(binf), NumpyOps, 64)
    ours = m.prefill(PROMPT, all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].numpy()
    for h in hooks:
        h.remove()
    assert len(routes) == len(m.ops.routing_log) > 0
    for a, b in zip(m.ops.routing_log, routes):
        np.testing.assert_array_equal(np.sort(a, axis=-1), np.sort(b, axis=-1))  # same experts per token
    assert float(np.linalg.norm(ours - ref) / np.linalg.norm(ref)) < 1e-4
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(PROMPT):].tolist()
    m.reset()
    lg, out = m.prefill(PROMPT), []
    for _ in range(24):
        t = int(np.argmax(lg))
        out.append(t)
        lg = m.decode(t)
    assert out == hf_out


def test_decode_equals_recompute_and_single_token(moe):
    _, binf = moe
    mf = load(binf)
    ids = np.random.default_rng().integers(0, 151643, 9).tolist()
    full = Qwen3(mf, NumpyOps, 16).prefill(ids, all_logits=True)
    m = Qwen3(mf, NumpyOps, 16)
    steps = [m.prefill(ids[:1])] + [m.decode(t) for t in ids[1:]]  # a token count of 1 throughout
    np.testing.assert_allclose(np.stack(steps), full, rtol=0, atol=2e-4 * np.abs(full).max())


def test_routing_without_renormalisation(moe, tmp_path):
    d, binf = moe
    mf = load(binf)
    mf.args.norm_topk_prob = False
    ops = NumpyOps(mf.args, mf.weights, 4)
    layer = next(L for L in mf.weights.layers if L.router is not None)
    x = np.random.default_rng().standard_normal((5, mf.args.hidden_size)).astype(np.float32)
    y = ops.moe(x, layer)
    logits = x @ layer.router.astype(np.float32).T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    k = mf.args.num_experts_per_tok
    want = np.zeros_like(x)
    from kuiper_py.ops_numpy import awq_linear, silu
    inter = mf.args.moe_intermediate_size
    for t in range(5):
        for e in np.argsort(-p[t])[:k]:
            hg = awq_linear(x[t:t + 1], layer.experts_w13.expert(int(e)))
            want[t] += p[t, e] * awq_linear(silu(hg[:, :inter]) * hg[:, inter:], layer.experts_w2.expert(int(e)))[0]
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())  # fp32 rounding


def test_moe_header_validation():
    h = fmt.Header(dim=128, hidden_dim=256, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=100, max_seq_len=64,
                   shared_classifier=True, head_dim=64, group_size=128, version=6, has_ext=True, model_type=2,
                   num_experts=4, experts_per_tok=5, moe_intermediate=128)
    with pytest.raises(KuiperError, match="experts_per_tok"):
        fmt.Header.unpack(h.pack())
    h.experts_per_tok, h.model_type = 2, 1
    with pytest.raises(KuiperError, match="model_type"):
        fmt.Header.unpack(h.pack())


@pytest.mark.parametrize("T", [1, 7, 2048])
def test_staged_pipeline_maps_and_direct_equivalence(moe, T):
    """The stage references: consistent maps (experts contiguous, inverse permutation, empty experts) and
    the staged result equal to a direct per-token computation."""
    from kuiper_py import moe_ref
    from kuiper_py.ops_numpy import awq_linear, silu
    _, binf = moe
    mf = load(binf)
    a = mf.args
    layer = next(L for L in mf.weights.layers if L.router is not None)
    rng = np.random.default_rng()
    x = rng.standard_normal((T, a.hidden_size)).astype(np.float32)
    ids, w = moe_ref.route(x, layer.router, a.num_experts_per_tok, a.norm_topk_prob)
    counts, offsets, p2u, u2p = moe_ref.expert_maps(ids, a.num_experts)
    k = a.num_experts_per_tok
    assert counts.sum() == T * k and offsets[0] == 0 and offsets[-1] == T * k
    assert np.array_equal(np.sort(p2u), np.arange(T * k)) and np.array_equal(p2u[u2p], np.arange(T * k))
    expert_of_row = ids.reshape(-1)[p2u]
    assert np.all(np.diff(expert_of_row) >= 0)  # each expert's rows contiguous, experts ascending
    for e in range(a.num_experts):
        assert np.all(expert_of_row[offsets[e]:offsets[e + 1]] == e)
    if T * k < a.num_experts:
        assert (counts == 0).any()  # fewer slots than experts: some experts receive no tokens
    xp = moe_ref.gather(x, p2u, k)
    act = moe_ref.grouped_gemm1_swiglu(xp, offsets, layer.experts_w13)
    y = moe_ref.finalize(moe_ref.grouped_gemm2(act, offsets, layer.experts_w2), u2p, w)
    inter = a.moe_intermediate_size
    sel = range(T) if T <= 7 else rng.choice(T, 6, replace=False)
    for t in sel:
        want = np.zeros(a.hidden_size)
        for j in range(k):
            e = int(ids[t, j])
            hg = awq_linear(x[t:t + 1], layer.experts_w13.expert(e))
            want += w[t, j] * awq_linear(silu(hg[:, :inter]) * hg[:, inter:], layer.experts_w2.expert(e))[0]
        np.testing.assert_allclose(y[t], want, rtol=0, atol=1e-5 * np.abs(want).max())
