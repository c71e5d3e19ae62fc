"""The NumPy engine against Hugging Face transformers' Qwen3ForCausalLM (float32, dequantized weights)."""
import numpy as np
import pytest

from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps
from reference import hf_model

torch = pytest.importorskip("torch")

PROMPT = [785, 6722, 315, 9625, 374, 11, 323, 279, 6722, 315]


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("which", ["tiny", "untied"])
def test_prompt_logits_and_greedy_match_transformers(which, tiny_dir, tiny_bin, untied_dir, untied_bin):
    ckpt, binf = (tiny_dir, tiny_bin) if which == "tiny" else (untied_dir, untied_bin)
    hf = hf_model(ckpt)
    m = Qwen3(load(binf), NumpyOps, 64)
    ours = m.prefill(PROMPT, all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].numpy()
    assert ours.shape == ref.shape == (len(PROMPT), 151936)
    assert _rel(ours, ref) < 1e-4
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-3 * np.abs(ref).max())

    # greedy continuation of 32 tokens, identical
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    m.reset()
    lg = m.prefill(PROMPT)
    out = []
    for _ in range(32):
        t = int(np.argmax(lg))
        out.append(t)
        lg = m.decode(t)
    assert out == hf_out
    assert len(set(out)) > 4  # the synthetic model does not just repeat one token


def test_kv_cache_decode_equals_full_recompute(untied_bin):
    rng = np.random.default_rng()
    ids = rng.integers(0, 151643, size=21).tolist()
    mf = load(untied_bin)
    full = Qwen3(mf, NumpyOps, 32).prefill(ids, all_logits=True)
    m = Qwen3(mf, NumpyOps, 32)
    step = [m.prefill(ids[:9])]  # a prefill chunk, then a second chunk, then single-token decodes
    step.append(m.prefill(ids[9:14]))
    step += [m.decode(t) for t in ids[14:]]
    want = np.concatenate([full[8:9], full[13:14], full[14:]])
    np.testing.assert_allclose(np.stack(step), want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_kept_fp32_weights_give_the_same_logits(untied_bin, monkeypatch):
    """A small file's lm_head converted to float32 once and its AWQ linears dequantized once, both kept with the file's
    weights, give the logits bit for bit of the per-call conversions; a second model on the same file shares them."""
    from kuiper_py import ops_numpy
    rng = np.random.default_rng()
    ids = rng.integers(0, 151643, size=7).tolist()
    mf = load(untied_bin)
    kept = Qwen3(mf, NumpyOps, 16)
    got = [kept.prefill(ids, all_logits=True), kept.decode(ids[0])]
    blocks, wq = mf.weights._lm_f32_blocks, mf.weights.layers[-1].wq._f32_blocks
    assert isinstance(blocks, list) and isinstance(wq, list)
    Qwen3(mf, NumpyOps, 16).prefill(ids[:2])  # (a second model on the file: it finds the kept blocks)
    assert mf.weights._lm_f32_blocks is blocks and mf.weights.layers[-1].wq._f32_blocks is wq
    monkeypatch.setattr(ops_numpy, "LM_KEEP_BYTES", 0)
    monkeypatch.setattr(ops_numpy, "DEQ_KEEP_BYTES", 0)
    other = load(untied_bin)
    fresh = Qwen3(other, NumpyOps, 16)
    want = [fresh.prefill(ids, all_logits=True), fresh.decode(ids[0])]
    assert getattr(other.weights, "_lm_f32_blocks", None) is None
    assert not any(hasattr(lin, "_f32_blocks") for L in other.weights.layers for lin in (L.wq, L.wo, L.w2))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_lm_head_kept_in_what_the_linears_leave_of_the_budget(untied_bin, monkeypatch):
    """The CPU engine keeps its float32 linears when they fit DEQ_KEEP_BYTES, and the float32 lm_head when it fits
    what they leave of it, or LM_KEEP_BYTES by itself: each bound met exactly and missed by one byte."""
    from kuiper_py import ops_numpy
    mf = load(untied_bin)
    w = mf.weights
    dense = sum(lin.K * lin.N * 4 for L in w.layers for lin in (L.wq, L.wk, L.wv, L.wo, L.w1, L.w2, L.w3))
    lm = w.lm_head.shape[0] * w.lm_head.shape[1] * 4
    for lm_floor, budget, want in ((0, dense + lm, (True, True)), (0, dense + lm - 1, (True, False)),
                                   (0, dense - 1, (False, False)), (lm, 0, (False, True)), (lm - 1, 0, (False, False))):
        monkeypatch.setattr(ops_numpy, "LM_KEEP_BYTES", lm_floor)
        monkeypatch.setattr(ops_numpy, "DEQ_KEEP_BYTES", budget)
        ops = NumpyOps(mf.args, w, 8)
        assert (ops.keep_dequant, ops.keep_lm) == want, (lm_floor, budget)


def test_context_overflow_is_an_error(tiny_bin):
    from kuiper_py.errors import KuiperError
    m = Qwen3(load(tiny_bin), NumpyOps, 8)
    m.prefill([1, 2, 3, 4, 5, 6, 7])
    m.decode(8)
    with pytest.raises(KuiperError, match="context full"):
        m.decode(9)


def test_forward_brackets_layers_and_ends_step_after_an_error(tiny_bin, monkeypatch):
    """The model's side of the ops protocol a backend's per-forward state relies on (CupyOps' arena):
    begin_layer once per decoder layer between begin_step and end_step, and end_step also when a layer
    fails midway."""
    m = Qwen3(load(tiny_bin), NumpyOps, 32)
    seen = []
    for name in ("begin_step", "begin_layer", "end_step"):
        real = getattr(m.ops, name)
        monkeypatch.setattr(m.ops, name, lambda *a, _n=name, _r=real: (seen.append(_n), _r(*a))[1])
    m.prefill([1, 2, 3])
    L = m.args.num_hidden_layers
    assert seen == ["begin_step"] + ["begin_layer"] * L + ["end_step"]
    del seen[:]

    def fail(*a):
        raise RuntimeError("injected")
    monkeypatch.setattr(m.ops, "attention", fail)
    with pytest.raises(RuntimeError, match="injected"):
        m.prefill([4, 5])
    assert seen == ["begin_step", "begin_layer", "end_step"]


def test_rope_scaling_yarn_matches_transformers():
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from kuiper_py.config import ModelArgs, rope_inv_freq
    cfg = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, head_dim=128, vocab_size=10, max_position_embeddings=131072,
               rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32768})
    inv, scale = rope_inv_freq(ModelArgs.from_hf_config(cfg))
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](Qwen3Config(**cfg), "cpu")
    np.testing.assert_allclose(inv, ref_inv.numpy(), rtol=1e-6)
    assert abs(scale - ref_scale) < 1e-6


def test_cpu_keep_budget_follows_the_available_memory():
    """The CPU engine keeps a file's float32 linears when they take at most a quarter of the host memory available
    (between 256 MiB and 8 GiB), read here independently from /proc/meminfo."""
    from pathlib import Path

    from kuiper_py import ops_numpy
    got = ops_numpy.deq_keep_budget()
    assert 256 << 20 <= got <= 8 << 30
    info = Path("/proc/meminfo")
    if info.exists():
        avail = next(int(line.split()[1]) * 1024 for line in info.read_text().splitlines()
                     if line.startswith("MemAvailable:"))
        want = max(256 << 20, min(8 << 30, avail // 4))
        assert abs(got - want) <= max(64 << 20, want // 20)  # (the memory available moves a little between reads)


def test_a_long_prompt_attends_a_share_of_its_rows_at_a_time(untied_bin, monkeypatch):
    """Attention scores held SCORES_BYTES at a time: two prefills whose rows are attended a few at a time (448 // keys
    rows a share: 11 + 11 + 11 + 7 rows over 40 keys, then 7 + 7 + 7 after the cached ones) give the logits of every
    position that one share per prefill gives (to the rounding of the products, whose shapes differ)."""
    from kuiper_py import ops_numpy
    rng = np.random.default_rng()
    ids = rng.integers(0, 151643, size=61).tolist()
    mf = load(untied_bin)
    a = mf.args
    matmul, shares = np.matmul, []

    def counted(x, y, *args, **kw):  # the scores' products: [H, rows, hd] @ [H, hd, keys]
        if np.ndim(x) == 3 and np.ndim(y) == 3 and np.shape(y)[1] == a.head_dim:
            shares.append(np.shape(x)[1])
        return matmul(x, y, *args, **kw)

    def logits():
        m = Qwen3(mf, NumpyOps, 64)
        return np.concatenate([m.prefill(ids[:40], all_logits=True), m.prefill(ids[40:], all_logits=True)])
    monkeypatch.setattr(ops_numpy.np, "matmul", counted)
    want = logits()
    L = a.num_hidden_layers  # (each prefill runs every layer)
    assert shares == [40] * L + [21] * L
    shares.clear()
    monkeypatch.setattr(ops_numpy, "SCORES_BYTES", 4 * a.num_attention_heads * 64 * 7)
    got = logits()
    assert shares == [11, 11, 11, 7] * L + [7, 7, 7] * L
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
