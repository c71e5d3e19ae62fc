"""GPTQ and compressed-tensors files on the GPU against the CPU engine, and a Qwen3-2507 model's flash decoding at
128k cached keys (device machine only)."""
import math

import numpy as np
import pytest

from kuiper_py import synth
from kuiper_py.export import export
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps
from reference import PROMPT, assert_greedy_up_to_a_tie, rel

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
oc = pytest.importorskip("kuiper_py.ops_cupy")


def _bin(root, name, preset, **kw):
    d = synth.make_checkpoint(root / name, preset, seed=21, tokenizer=False, **kw)
    export(d, root / f"{name}.bin", progress=False, log=lambda m: None)
    return root / f"{name}.bin"


@pytest.fixture(scope="module", params=[("tiny", "gptq", 128, True, False),
                                        ("tiny-untied", "gptq_v2", 64, False, True),
                                        ("tiny-moe", "compressed-tensors", 128, False, True),
                                        ("tiny", "compressed-tensors", 32, True, False)],
                ids=lambda p: "-".join(map(str, p)))
def fmt_bin(request, tmp_path_factory):
    preset, quant, g, sym, bf16 = request.param
    return _bin(tmp_path_factory.mktemp("gpufmt"), quant, preset, quant=quant, group_size=g, sym=sym, bf16=bf16)


def test_format_files_greedy_tokens_equal_cpu(fmt_bin):
    """Prefill logits close to the CPU engine's and the same greedy tokens, up to a tie the two engines' rounding
    cannot resolve (then the GPU picked the CPU's runner-up, closer than their logits differ)."""
    mf = load(fmt_bin)
    cpu, gpu = Qwen3(mf, NumpyOps, len(PROMPT) + 40), Qwen3(mf, oc.CupyOps, len(PROMPT) + 40)
    assert rel(cp.asnumpy(gpu.prefill(PROMPT, all_logits=True)), cpu.prefill(PROMPT, all_logits=True)) < 1e-2
    cpu.reset()
    gpu.reset()
    toks = assert_greedy_up_to_a_tie(cpu, gpu, PROMPT, 32)
    assert len(toks) >= 8 and len(set(toks)) > 4


def _attention_ref(q, K, V):
    """One query at the last of n positions, q [1, H, hd], K/V [n, KV, hd] -> [1, H*hd], in float64."""
    _, H, hd = q.shape
    KV = K.shape[1]
    out = np.zeros((H, hd))
    for h in range(H):
        kh = h // (H // KV)
        s = K[:, kh].astype(np.float64) @ q[0, h].astype(np.float64) / math.sqrt(hd)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ V[:, kh].astype(np.float64)
    return out.reshape(1, H * hd)


# the slow tier's (11.2 s on an H100, drawing 268M keys on the host): the fast tier reaches 128k keys through
# test_2507_model_decode_at_128k_equals_its_prefill
@pytest.mark.slow
@pytest.mark.parametrize("preset,splits,on_device", [("4b-2507", 16, False), ("30b-a3b-2507", 70, True),
                                                     ("235b-a22b-2507", 70, True)])
def test_flash_decoding_at_128k_keys(preset, splits, on_device):
    """Flash decoding over 131,072 cached keys with a 2507 model's heads (4B: 32 q / 8 kv, 30B-A3B: 32 / 4,
    235B-A22B: 64 / 4; head dim 128), the length given or read from device memory, against float64."""
    D, I, L, H, KV, hd, *_ = synth.preset_dims(preset)
    n = 131072
    rng = np.random.default_rng()
    Kc = rng.standard_normal((n, KV, hd)).astype(np.float16)
    Vc = rng.standard_normal((n, KV, hd)).astype(np.float16)
    q = rng.standard_normal((1, H, hd)).astype(np.float16)
    part_o = cp.full((H * splits * hd,), np.nan, cp.float32)
    part_ml = cp.full((H * splits * 2,), np.nan, cp.float32)
    out = cp.full((1, H * hd), np.nan, cp.float16)
    pos_dev = cp.full((1,), n - 1, cp.int32) if on_device else None
    oc.attention_decode(cp.asarray(q), cp.asarray(Kc), cp.asarray(Vc), -1 if on_device else n, KV, splits,
                        part_o, part_ml, out, pos_dev)
    assert rel(cp.asnumpy(out), _attention_ref(q, Kc, Vc)) < 1e-2


def test_2507_model_decode_at_128k_equals_its_prefill(tmp_path):
    """A tiny Qwen3-2507 file (262,144 positions, rope_theta 5e6): one decode step at position 131,072 (flash
    decoding over every cached key, RoPE at that position) gives the logits of a prefill of the same 131,073
    tokens (the prefill's attention kernel, tested against its own reference in test_cuda_attention.py)."""
    binf = _bin(tmp_path, "t2507", "tiny-2507")
    mf = load(binf)
    assert mf.args.max_position_embeddings == 262144 and mf.args.rope_theta == 5e6
    n = 131072
    ids = np.random.default_rng().integers(0, 151643, size=n + 1).tolist()
    full = cp.asnumpy(Qwen3(mf, oc.CupyOps, n + 1).prefill(ids)).copy()
    m = Qwen3(mf, oc.CupyOps, n + 1)
    m.prefill(ids[:n])
    step = cp.asnumpy(m.decode(ids[n])).copy()
    assert np.isfinite(step).all() and rel(step, full) < 1e-2
