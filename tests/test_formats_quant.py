"""GPTQ and compressed-tensors checkpoints: each written here from an AutoAWQ twin's codes, zeros and scales with the
format's own packer (compressed-tensors' pack_to_int32; a loop over AutoGPTQ's documented layout), exported, and
checked two ways: the file's weights equal the AWQ twin's byte for byte, and the CPU engine's greedy tokens equal
transformers' on the weights dequantized by the format's own unpacker."""
import json
import shutil

import numpy as np
import pytest

from kuiper_py import format as fmt
from kuiper_py import synth
from kuiper_py.errors import KuiperError
from kuiper_py.export import export
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps
from reference import unpack_loop

torch = pytest.importorskip("torch")
ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
from safetensors.torch import load_file, save_file  # noqa: E402

PROMPT = [785, 6722, 315, 9625, 374, 11, 323, 279, 6722, 315, 9856, 374]
SUFFIXES = (".qweight", ".qzeros", ".scales")


def _quiet(src, out):
    return export(src, out, progress=False, log=lambda m: None)


# --- the formats' own layouts, written independently of kuiper_py ------------------------------------------------

def gptq_pack(q, z, s, g, v1):
    """AutoGPTQ's documented packing: qweight[i, n] holds rows 8i..8i+7 of column n, row 8i+j in bits 4j;
    qzeros[r, c] holds columns 8c..8c+7 of group r, column 8c+j in bits 4j, v1 storing zero - 1."""
    K, N = q.shape
    qw = np.zeros((K // 8, N), dtype=np.uint32)
    for j in range(8):
        qw |= q[j::8].astype(np.uint32) << (4 * j)
    zs = z.astype(np.int64) - (1 if v1 else 0)
    assert zs.min() >= 0
    qz = np.zeros((K // g, N // 8), dtype=np.uint32)
    for j in range(8):
        qz |= zs[:, j::8].astype(np.uint32) << (4 * j)
    return {"qweight": torch.from_numpy(qw.view(np.int32)), "qzeros": torch.from_numpy(qz.view(np.int32)),
            "scales": s.clone(), "g_idx": torch.arange(K, dtype=torch.int32) // g}


def gptq_dequant(t, base, g, v1):
    """W [N, K] from a GPTQ linear, nibble by nibble through g_idx."""
    qw = t[base + ".qweight"].numpy().view(np.uint32)
    qz = t[base + ".qzeros"].numpy().view(np.uint32)
    gi = t[base + ".g_idx"].numpy()
    K, N = 8 * qw.shape[0], qw.shape[1]
    q = np.stack([(qw >> (4 * j)) & 15 for j in range(8)], axis=1).reshape(K, N).astype(np.float64)
    z = np.stack([(qz >> (4 * j)) & 15 for j in range(8)], axis=2).reshape(qz.shape[0], N).astype(np.float64)
    z += 1 if v1 else 0
    s = t[base + ".scales"].to(torch.float64).numpy()
    return ((q - z[gi]) * s[gi]).T


def ct_pack(q, z, s, sym):
    """compressed-tensors' own packer on signed codes (code - 8), weights [N, K]."""
    out = {"weight_packed": ct_helpers.pack_to_int32(torch.from_numpy((q.T.astype(np.int16) - 8).astype(np.int8)), 4),
           "weight_scale": s.T.contiguous(), "weight_shape": torch.tensor([q.shape[1], q.shape[0]])}
    if not sym:
        zp = torch.from_numpy((z.T.astype(np.int16) - 8).astype(np.int8))
        out["weight_zero_point"] = ct_helpers.pack_to_int32(zp, 4, packed_dim=0)
    return out


def ct_dequant(t, base, g, sym):
    """W [N, K] through compressed-tensors' own unpacker."""
    shape = torch.Size(t[base + ".weight_shape"].tolist())
    q = ct_helpers.unpack_from_int32(t[base + ".weight_packed"], 4, shape).to(torch.float64)
    s = t[base + ".weight_scale"].to(torch.float64)
    if sym:
        zp = torch.zeros_like(s)
    else:
        zp = ct_helpers.unpack_from_int32(t[base + ".weight_zero_point"], 4, s.shape, packed_dim=0).to(torch.float64)
    k = torch.arange(shape[1]) // g
    return ((q - zp[:, k]) * s[:, k]).numpy()


# --- checkpoints ------------------------------------------------------------------------------------------------

def _shards(d):
    return sorted(d.glob("*.safetensors"))


def convert_twin(awq_dir, out, quant, g, sym):
    """The AWQ twin rewritten in another format with that format's packer (above); norms, embeddings, routers and
    lm_head copied as they are. Codes and zeros come from the independent nibble-by-nibble AWQ unpacker."""
    shutil.copytree(awq_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = synth.quantization_config(quant, g, sym, cfg["model_type"] == "qwen3_moe")
    (out / "config.json").write_text(json.dumps(cfg))
    wm = {}
    for f in _shards(out):
        t, new = load_file(str(f)), {}
        for name, a in t.items():
            if name.endswith(".qweight"):
                base = name[:-len(".qweight")]
                q = unpack_loop(a.numpy()).astype(np.uint8)
                z = unpack_loop(t[base + ".qzeros"].numpy()).astype(np.uint8)
                s = t[base + ".scales"]
                parts = (gptq_pack(q, z, s, g, quant == "gptq") if quant.startswith("gptq")
                         else ct_pack(q, z, s, sym))
                new.update({f"{base}.{k}": v for k, v in parts.items()})
            elif not name.endswith((".qzeros", ".scales")):
                new[name] = a
        save_file(new, str(f), metadata={"format": "pt"})
        wm.update({k: f.name for k in new})
    if (out / "model.safetensors.index.json").exists():
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return out


def hf_oracle(d, quant, g, sym):
    """transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM in float32 on the weights dequantized by the format's
    own unpacker (experts fused as transformers stores them)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = "float32"
    t = {}
    for f in _shards(d):
        t.update(load_file(str(f)))
    key = ".qweight" if quant.startswith("gptq") else ".weight_packed"

    def W(base):
        return (gptq_dequant(t, base, g, quant == "gptq") if quant.startswith("gptq")
                else ct_dequant(t, base, g, sym))

    state = {n: a.to(torch.float32) for n, a in t.items() if n.endswith(".weight")
             and ".mlp.experts." not in n}
    for n in t:
        if n.endswith(key) and ".mlp.experts." not in n:
            base = n[:-len(key)]
            state[base + ".weight"] = torch.from_numpy(W(base).astype(np.float32))
    moe = cfg["model_type"] == "qwen3_moe"
    if moe:
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}.mlp.experts"
            if f"{p}.0.gate_proj{key}" not in t:
                continue
            E = cfg["num_experts"]
            gu = np.stack([np.concatenate([W(f"{p}.{e}.gate_proj"), W(f"{p}.{e}.up_proj")]) for e in range(E)])
            state[f"{p}.gate_up_proj"] = torch.from_numpy(gu.astype(np.float32))
            state[f"{p}.down_proj"] = torch.from_numpy(np.stack([W(f"{p}.{e}.down_proj") for e in range(E)])
                                                       .astype(np.float32))
    model = (Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)) if moe else Qwen3ForCausalLM(Qwen3Config(**cfg)))
    model.load_state_dict(state, strict=not cfg.get("tie_word_embeddings"))
    if cfg.get("tie_word_embeddings"):
        model.tie_weights()
    return model.float().eval()


def weights_and_header(path):
    mf = load(path)
    h = {k: v for k, v in vars(mf.header).items() if k not in ("checksum", "trailer_length")}
    assert mf.verify_checksum() is True
    return path.read_bytes()[fmt.HEADER_SIZE:mf.header.weights_end], h


CASES = [  # (preset, shards, format, group size, symmetric, bf16)
    ("tiny", 2, "gptq", 128, True, False),              # dense, tied, sharded: Qwen's own GPTQ-Int4 scheme
    ("tiny-untied", 1, "gptq_v2", 64, False, False),    # dense, untied, single file
    ("tiny-moe", 2, "gptq", 32, False, True),           # MoE, v1 asymmetric, bf16 scales and norms
    ("tiny", 2, "compressed-tensors", 32, False, True),
    ("tiny-untied", 1, "compressed-tensors", 128, True, False),
    ("tiny-moe-mixed", 2, "compressed-tensors", 64, False, False),  # MoE with a dense layer
]


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """(preset, ...) -> (AWQ twin dir, its file, the format's dir, its file), built once per module."""
    root, made = tmp_path_factory.mktemp("twins"), {}

    def get(preset, shards, quant, g, sym, bf16):
        key = (preset, shards, quant, g, sym, bf16)
        if key not in made:
            name = "-".join(map(str, key))
            a = synth.make_checkpoint(root / f"awq-{name}", preset, seed=len(made) + 7, n_shards=shards,
                                      group_size=g, sym=sym, bf16=bf16, tokenizer=False)
            b = convert_twin(a, root / f"fmt-{name}", quant, g, sym)
            _quiet(a, root / f"awq-{name}.bin")
            _quiet(b, root / f"fmt-{name}.bin")
            made[key] = (a, root / f"awq-{name}.bin", b, root / f"fmt-{name}.bin")
        return made[key]
    return get


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_export_equals_the_awq_twin(case, twins):
    """Same codes, zeros and scales: the exported weights are the AWQ twin's, byte for byte, as is the header."""
    _, awq_bin, _, fmt_bin = twins(*case)
    wa, ha = weights_and_header(awq_bin)
    wf, hf = weights_and_header(fmt_bin)
    assert ha == hf and ha["group_size"] == case[3]
    assert wa == wf


@pytest.mark.parametrize("case", CASES[1::2] + CASES[2:3], ids=lambda c: "-".join(map(str, c)))
def test_greedy_tokens_equal_transformers(case, twins):
    """The exported file on the CPU engine against transformers on the format's own dequantization."""
    _, _, d, binf = twins(*case)
    hf = hf_oracle(d, case[2], case[3], case[4])
    m = Qwen3(load(binf), NumpyOps, 64)
    ours = m.prefill(PROMPT, all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].numpy()
    assert float(np.linalg.norm(ours - ref) / np.linalg.norm(ref)) < 1e-4
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    m.reset()
    lg, got = m.prefill(PROMPT), []
    for _ in range(16):
        got.append(int(np.argmax(lg)))
        lg = m.decode(got[-1])
    assert got == want and len(set(got)) > 3


@pytest.mark.parametrize("quant, sym", [("gptq", True), ("gptq_v2", False), ("compressed-tensors", False),
                                        ("compressed-tensors", True)])
def test_synth_writes_what_the_formats_own_packer_writes(quant, sym, tmp_path):
    """synth.make_checkpoint(quant=...) holds the tensors the format's packer makes of the AWQ twin's values."""
    a = synth.make_checkpoint(tmp_path / "awq", "tiny-moe", seed=4, n_shards=1, group_size=64, sym=sym,
                              tokenizer=False, layers=1)
    b = synth.make_checkpoint(tmp_path / "f", "tiny-moe", seed=4, n_shards=1, group_size=64, sym=sym,
                              tokenizer=False, layers=1, quant=quant)
    want = load_file(str(convert_twin(a, tmp_path / "ref", quant, 64, sym) / "model.safetensors"))
    got = load_file(str(b / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for n in want:
        assert torch.equal(got[n].to(want[n].dtype), want[n]), n
    assert json.loads((b / "config.json").read_text()) == json.loads((tmp_path / "ref" / "config.json").read_text())


# --- refusals: one line, nothing written -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One-layer GPTQ v1 (asymmetric) and compressed-tensors (asymmetric) MoE checkpoints to damage."""
    root = tmp_path_factory.mktemp("bad")
    return {q: synth.make_checkpoint(root / q, "tiny-moe", seed=9, n_shards=1, layers=1, group_size=64,
                                     quant=q, tokenizer=False) for q in ("gptq", "compressed-tensors")}


def _refused(d, tmp_path, msg):
    out = tmp_path / "o.bin"
    with pytest.raises(KuiperError, match=msg) as e:
        _quiet(d, out)
    assert "\n" not in str(e.value)
    assert not any(p.name.startswith((".o.bin", "o.bin")) for p in tmp_path.iterdir())
    return str(e.value)


def _edit(d, tensors=None, config=None):
    if tensors:
        f = d / "model.safetensors"
        t = load_file(str(f))
        tensors(t)
        save_file(t, str(f))
    if config:
        c = json.loads((d / "config.json").read_text())
        config(c["quantization_config"])
        (d / "config.json").write_text(json.dumps(c))


Q = "model.layers.0.self_attn.q_proj"
E = "model.layers.0.mlp.experts.3.down_proj"


def _set(name, fn):
    return lambda t: t.update({name: fn(t[name])})


@pytest.mark.parametrize("quant, tensors, config, msg", [
    ("gptq", _set(Q + ".qzeros", lambda a: a[:, :4].contiguous()), None, rf"{Q}.qzeros has shape \[2, 4\], expected"),
    ("gptq", _set(E + ".scales", lambda a: a[:1].contiguous()), None, rf"{E}.scales has shape"),
    ("gptq", _set(Q + ".qweight", lambda a: a[:, :64].contiguous()), None, rf"{Q}.qzeros has shape .*from {Q}.qweight"),
    ("gptq", _set(Q + ".g_idx", lambda a: a + 1), None, rf"{Q}.g_idx has values outside 0..1"),
    ("gptq", _set(Q + ".g_idx", lambda a: a.flip(0)), None, "activation order"),
    ("gptq", _set(Q + ".qzeros", lambda a: a | 0xF), None, "zero point of 16"),
    ("gptq", None, lambda q: q.update(bits=8), "GPTQ bits=8"),
    ("gptq", None, lambda q: q.update(group_size=-1), "per output channel"),
    ("gptq", None, lambda q: q.update(group_size=96), r"group_size=96 is not supported \(supported: 32, 64, 128\)"),
    ("gptq", None, lambda q: q.update(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    ("gptq", None, lambda q: q.update(lm_head=True), "quantized lm_head"),
    ("compressed-tensors", _set(Q + ".weight_shape", lambda a: a.flip(0)), None, rf"{Q}.weight_shape is \[128, 256\]"),
    ("compressed-tensors", lambda t: t.pop(E + ".weight_zero_point"), None, rf"missing tensor {E}.weight_zero_point"),
    ("compressed-tensors", _set(Q + ".weight_scale", lambda a: a[:, :1].contiguous()), None, rf"{Q}.weight_scale"),
    ("compressed-tensors", None, lambda q: q.update(format="float-quantized"), "format 'float-quantized'"),
    ("compressed-tensors", None, lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "num_bits=8"),
    ("compressed-tensors", None, lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="channel"),
     "strategy='channel'"),
    ("compressed-tensors", None, lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"),
     "type='float'"),
    ("compressed-tensors", None, lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"),
     "actorder='group'"),
    ("compressed-tensors", None, lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int"}), "quantizes activations"),
    ("compressed-tensors", None, lambda q: q.update(ignore=["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"]),
     r"ignore entry 're:\.\*self_attn\.\*' leaves model.layers.0.self_attn.q_proj unquantized"),
    ("compressed-tensors", None, lambda q: q.update(ignore=["lm_head"]), "does not cover model.layers.0.mlp.gate"),
    ("compressed-tensors", None, lambda q: q["config_groups"]["group_0"]["weights"].update(group_size="64"),
     r"group_size='64' is not supported"),
])
def test_bad_inputs_are_refused(small, copy_ckpt, tmp_path, quant, tensors, config, msg):
    d = copy_ckpt(small[quant])
    _edit(d, tensors, config)
    _refused(d, tmp_path, msg)


def test_trivial_activation_order_and_weight_actorder_are_converted(small, copy_ckpt, tmp_path):
    """desc_act: true with g_idx = k // g, and compressed-tensors' actorder 'weight' (groups stay contiguous), hold
    the plain layout: both export."""
    d = copy_ckpt(small["gptq"])
    _edit(d, config=lambda q: q.update(desc_act=True))
    _quiet(d, tmp_path / "a.bin")
    d = copy_ckpt(small["compressed-tensors"])
    _edit(d, config=lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="weight"))
    _quiet(d, tmp_path / "b.bin")
    assert load(tmp_path / "a.bin").verify_checksum() and load(tmp_path / "b.bin").verify_checksum()


def test_cli_refusal_is_one_line(small, copy_ckpt, tmp_path):
    from conftest import run_cli
    d = copy_ckpt(small["gptq"])
    _edit(d, tensors=_set(Q + ".g_idx", lambda a: a.flip(0)))
    r = run_cli("export", d, "-o", tmp_path / "o.bin")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kuiper: error:") and "activation order" in lines[0], r.stderr
    assert not (tmp_path / "o.bin").exists()


def test_quantized_lm_head_is_refused(tmp_path):
    d = synth.make_checkpoint(tmp_path / "g", "tiny-untied", seed=3, n_shards=1, layers=1, quant="gptq_v2",
                              tokenizer=False)
    t = load_file(str(d / "model.safetensors"))
    lm = t.pop("lm_head.weight")
    t["lm_head.qweight"] = torch.zeros((lm.shape[1] // 8, lm.shape[0]), dtype=torch.int32)
    save_file(t, str(d / "model.safetensors"))
    _refused(d, tmp_path, "lm_head is quantized in this checkpoint")
