#!/usr/bin/env python3
"""Device diagnostic: run a prefill block by block on NumPy and CuPy and print the relative error of each layer's
residual stream, block input and block output (finds which layer and block loses precision). Usage:
diag_layers.py MODEL.bin [T]"""
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
if T < 2:  # a one-token step defers its blocks' launches into the next (kuiper_py/cuda/backend.py _Deferred)
    sys.exit("diag_layers.py compares prefill ops: T must be at least 2")
ids = np.random.default_rng(0).integers(0, 151643, T).tolist()
c, g = NumpyOps(mf.args, mf.weights, T + 4), CupyOps(mf.args, mf.weights, T + 4, progress=False)
step = Step.single(ids, 0)
hc, hg = c.embed(step), g.embed(step)
rc = rg = None
for i, (lc, lg) in enumerate(zip(c.weights.layers, g.weights.layers)):
    hc, xc = c.add_rmsnorm(hc, rc, lc.attn_norm)
    hg, xg = g.add_rmsnorm(hg, rg, lg.attn_norm)
    rc, rg = c.attention(xc, lc, i, step), g.attention(xg, lg, i, step)
    print(f"L{i} h {rel(hg, hc):.2e} x {rel(xg, xc):.2e} attention {rel(rg, rc):.2e}")
    hc, xc = c.add_rmsnorm(hc, rc, lc.ffn_norm)
    hg, xg = g.add_rmsnorm(hg, rg, lg.ffn_norm)
    if lc.router is not None:
        rc, rg = c.moe(xc, lc), g.moe(xg, lg)
        print(f"   h {rel(hg, hc):.2e} x {rel(xg, xc):.2e} (MoE: its sum is taken by the next norm)")
        continue
    rc, rg = c.mlp(xc, lc), g.mlp(xg, lg)
    print(f"   h {rel(hg, hc):.2e} x {rel(xg, xc):.2e} mlp {rel(rg, rc):.2e}")
hc, xc = c.add_rmsnorm(hc, rc, c.weights.final_norm)
hg, xg = g.add_rmsnorm(hg, rg, g.weights.final_norm)
lc_, lg_ = c.logits(xc, True), g.logits(xg, True)
print(f"final x {rel(xg, xc):.2e} logits {rel(lg_, lc_):.2e}  argmax equal: "
      f"{(cp.asnumpy(lg_).argmax(-1) == lc_.argmax(-1)).mean():.2f}")
