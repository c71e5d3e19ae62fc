#!/usr/bin/env python3
"""Device diagnostic: run the forward op by op on NumPy and CuPy and print the relative error of each
intermediate (finds which op loses precision). Usage: diag_layers.py MODEL.bin [T]"""
import sys

import numpy as np

sys.path.insert(0, ".")
from kuiper_py.backend import Step  # noqa: E402
from kuiper_py.loader import load  # noqa: E402
from kuiper_py.ops_cupy import CupyOps, cp  # noqa: E402
from kuiper_py.ops_numpy import NumpyOps  # noqa: E402


def rel(g, c):
    g = cp.asnumpy(g).astype(np.float64).reshape(c.shape)
    return float(np.linalg.norm(g - c) / (np.linalg.norm(c) + 1e-30))


mf = load(sys.argv[1])
T = int(sys.argv[2]) if len(sys.argv) > 2 else 14
if T < 2:  # a one-token step defers and fuses ops across calls (kuiper_py/cuda/backend.py _Normed, _Deferred)
    sys.exit("diag_layers.py compares prefill ops: T must be at least 2")
ids = np.random.default_rng(0).integers(0, 151643, T).tolist()
c, g = NumpyOps(mf.args, mf.weights, T + 4), CupyOps(mf.args, mf.weights, T + 4, progress=False)
step = Step.single(ids, 0)
hc, hg = c.embed(step), g.embed(step)
rc = rg = None
for i, (lc, lg) in enumerate(zip(c.weights.layers, g.weights.layers)):
    hc, xc = c.add_rmsnorm(hc, rc, lc.attn_norm)
    hg, xg = g.add_rmsnorm(hg, rg, lg.attn_norm)
    qc, kc, vc = c.qkv(xc, lc)
    qg, kg, vg = g.qkv(xg, lg)
    print(f"L{i} h {rel(hg, hc):.2e} x {rel(xg, xc):.2e} q {rel(qg, qc):.2e} k {rel(kg, kc):.2e} v {rel(vg, vc):.2e}")
    qrc, qrg = c.qk_norm_rope_store(qc, kc, vc, lc, i, step), g.qk_norm_rope_store(qg, kg, vg, lg, i, step)
    ac, ag = c.attention(qrc, i, step), g.attention(qrg, i, step)
    rc, rg = c.linear(ac, lc.wo), g.linear(ag, lg.wo)
    print(f"   qrot {rel(qrg, qrc):.2e} attn {rel(ag, ac):.2e} o {rel(rg, rc):.2e}")
    hc, xc = c.add_rmsnorm(hc, rc, lc.ffn_norm)
    hg, xg = g.add_rmsnorm(hg, rg, lg.ffn_norm)
    mc, mg = c.gate_up_silu(xc, lc), g.gate_up_silu(xg, lg)
    rc, rg = c.linear(mc, lc.w2), g.linear(mg, lg.w2)
    print(f"   h {rel(hg, hc):.2e} x {rel(xg, xc):.2e} act {rel(mg, mc):.2e} down {rel(rg, rc):.2e}")
hc, xc = c.add_rmsnorm(hc, rc, c.weights.final_norm)
hg, xg = g.add_rmsnorm(hg, rg, g.weights.final_norm)
lc_, lg_ = c.logits(xc, True), g.logits(xg, True)
print(f"final x {rel(xg, xc):.2e} logits {rel(lg_, lc_):.2e}  argmax equal: "
      f"{(cp.asnumpy(lg_).argmax(-1) == lc_.argmax(-1)).mean():.2f}")
