"""The decode plan (kuiper_py.cuda.plan) built from a backend's load-time choices, on stand-in backends (no GPU):
the launches of a layer follow accumulating mode and the one-launch halves, and describe() names them."""
from types import SimpleNamespace

import numpy as np
import pytest

from kuiper_py.cuda import plan
from kuiper_py.cuda.runtime import device
from kuiper_py.cuda.settings import Settings


def _ops(acc_attn, acc_mode, ffn, moe, experts=0):
    d = {n: np.zeros(w, np.int64) for n, w in (("acc_o", 8), ("acc_gu", 16), ("acc_z", 4), ("acc_d", 8), ("acc_qkv", 12))}
    return SimpleNamespace(args=SimpleNamespace(num_experts=experts), _ffn=object() if ffn else None,
                           _moe=object() if moe else None, acc_attn=acc_attn, acc_mode=acc_mode,
                           acc_moe=acc_attn and bool(experts), decode_ffn_why="ffn why", decode_moe_why="moe why",
                           d=d if acc_attn else {}, attn_splits=33, attn_short=(512, 1024), attn_cm=True,
                           o_merge=False, attn_min_chunk=64, graphs=True, settings=Settings())


@pytest.fixture(autouse=True)
def gpu(monkeypatch):
    monkeypatch.setattr(device, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(device, "sm_count", lambda: 132)


def test_dense_one_launch_ffn():
    p = plan.build(_ops(True, True, True, False))
    assert [ln.kernel for ln in p.dense] == ["gemv_w4a16 q|k|v", "attn_decode_gqa", "gemv_w4a16 o", "ffn_decode"]
    assert "clears acc_d and acc_qkv" in p.dense[2].writes and p.dense[3].writes == "acc_d" and p.moe_layer == ()
    text = p.describe()
    assert "NVIDIA H100" in text and "132 SMs" in text and "4. ffn_decode" in text and "acc_qkv [12]" in text
    assert "512, 1024 keys" in text and "33 splits" in text


def test_dense_separate_ffn_gemvs_and_no_accumulation():
    acc = plan.build(_ops(True, True, False, False))
    assert [ln.kernel for ln in acc.dense][3:] == ["gemv_w4a16 gate|up", "gemv_w4a16 down"]
    assert acc.dense[3].writes.startswith("acc_gu") and acc.dense[4].writes == "acc_d"
    tails = plan.build(_ops(False, False, False, False))
    assert tails.accumulators == () and tails.dense[-1].writes == "h += down (epilogue)"
    assert "accumulators" not in tails.describe()


def test_moe_layers():
    one = plan.build(_ops(True, False, False, True, experts=128))
    assert one.moe_layer[-1].kernel == "moe_ffn_decode" and "acc_z" in one.moe_layer[2].writes
    assert "clears acc_d" in one.moe_layer[2].writes and "clears acc_d" in one.dense[2].writes
    routed = plan.build(_ops(True, False, False, False, experts=128))
    assert [ln.kernel for ln in routed.moe_layer][3:] == ["moe_route_decode", "gemv_w4a16 experts' gate|up",
                                                         "gemv_w4a16 experts' down"]
    assert "MoE layer:" in routed.describe()
