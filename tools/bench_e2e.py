#!/usr/bin/env python3
"""End-to-end benchmark (device machine), batch 1, on an ak48 file with real Qwen3 shapes (8B, 30B-A3B):
decode tok/s at several contexts with the effective bandwidth (bytes read per step / step time) as a
ratio to a same-run device copy (MoE: only the selected experts' bytes count); prefill tok/s, each prompt after a
fresh KV cache and activations (set_context: the first prompt of a session, and the memory figure) and warm
(profile_prefill's fresh_walls: after a warm-up prefill, 8 lengths just under the prompt's that the process has not
run, as a chat's next turn meets them), both eager, and graph (a fresh prompt whose length bucket the process has met
before replays its prefill graph; up to 512 tokens); the same through Hugging Face transformers in FP16
(sdpa, same dequantized weights); peak GPU memory of both.

    python tools/bench_e2e.py MODEL.bin [--ctx 512,8192,32768] [--prompts 128,512,2048,8192] [--no-hf] [--json F]
"""
import json
import sys
import time
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from profile_prefill import fresh_walls, prefill_wall  # noqa: E402
from kuiper_py import format as fmt  # noqa: E402
from kuiper_py.generate import Engine  # noqa: E402
from kuiper_py import ops_cupy as oc  # noqa: E402
from kuiper_py.ops_cupy import copy_bandwidth, gpu_name  # noqa: E402
from kuiper_py.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


def greedy_step(m, tok, rng):
    """One greedy decode step of session m after token tok; the next token (one int back to the host)."""
    return m.ops.sample(m.decode(tok), GREEDY, rng, [], 151669)


def warm_session(eng, ctx, capacity, rng):
    """A session of `capacity` positions holding a random ctx-token prompt, after 4 greedy decode
    steps (graph capture and warm-up): (session, last token)."""
    m = eng.session(capacity)
    tok = m.ops.sample(m.prefill(rng.integers(0, 151643, ctx).tolist()), GREEDY, rng, [], 151669)
    for _ in range(4):
        tok = greedy_step(m, tok, rng)
    cp.cuda.Device().synchronize()
    return m, tok


def timed_greedy_steps(m, tok, steps, rng, serial=False):
    """`steps` greedy decode steps as kuiper generate runs them: each step queued on the device's drawn
    token before the host reads that token (Qwen3.decode_sampled). serial: the host reads each token
    before it queues the next step. (last token, wall seconds per step)."""
    t0 = time.perf_counter()
    if serial or not m.can_queue_ahead:
        for _ in range(steps):
            tok = greedy_step(m, tok, rng)
        return tok, (time.perf_counter() - t0) / steps
    m.ops.sample_launch(m.decode(tok), GREEDY, rng, [], 151669)
    for _ in range(steps - 1):
        logits = m.decode_sampled()
        tok = m.ops.sample_result()
        m.ops.sample_launch(logits, GREEDY, rng, [], 151669)
    tok = m.ops.sample_result()
    return tok, (time.perf_counter() - t0) / steps


def step_bytes(mf, ctx):
    """Bytes one decode step must read: every weight region once (a separate embedding table only for
    the one row it gathers), plus the KV cache up to ctx."""
    h, a = mf.header, mf.args
    weights = h.weights_end - fmt.HEADER_SIZE
    if not h.shared_classifier:
        weights -= (h.vocab_size - 1) * h.dim * 2
    for L in mf.weights.layers:  # MoE: only the k selected experts of each layer are read
        if L.experts_w13 is not None:
            stacks = sum(x.nbytes for st in (L.experts_w13, L.experts_w2) for x in (st.qweight, st.qzeros, st.scales))
            weights -= stacks * (a.num_experts - a.num_experts_per_tok) // a.num_experts
    return weights + 2 * a.num_hidden_layers * ctx * a.kv_dim * 2


def hf_model(mf):
    """transformers Qwen3ForCausalLM in fp16 on the GPU with our file's dequantized weights."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = dict(mf.trailer["config"])
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float16"
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**cfg, attn_implementation="sdpa"))
    shifts = cp.asarray([0, 16, 4, 20, 8, 24, 12, 28], dtype=cp.uint32)

    def deq(lin):
        q = ((cp.asarray(lin.qweight).view(cp.uint32)[:, :, None] >> shifts) & 15).reshape(lin.K, -1)
        z = ((cp.asarray(lin.qzeros).view(cp.uint32)[:, :, None] >> shifts) & 15).reshape(lin.K // 128, -1)
        s = cp.asarray(lin.scales)
        g = cp.arange(lin.K) // 128
        w = ((q.astype(cp.float16) - z[g].astype(cp.float16)) * s[g]).T.copy()
        return torch.from_dlpack(w).clone()  # torch-owned, so its peak-memory counter sees it

    w = mf.weights
    sd = {"model.embed_tokens.weight": torch.from_numpy(np.asarray(w.embed)).cuda(),
          "model.norm.weight": torch.from_numpy(np.asarray(w.final_norm)).cuda(),
          "lm_head.weight": torch.from_numpy(np.asarray(w.lm_head)).cuda()}
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w1": "mlp.gate_proj", "w2": "mlp.down_proj", "w3": "mlp.up_proj"}
    for i, L in enumerate(w.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.from_numpy(np.asarray(L.attn_norm)).cuda()
        sd[p + "post_attention_layernorm.weight"] = torch.from_numpy(np.asarray(L.ffn_norm)).cuda()
        sd[p + "self_attn.q_norm.weight"] = torch.from_numpy(np.asarray(L.q_norm)).cuda()
        sd[p + "self_attn.k_norm.weight"] = torch.from_numpy(np.asarray(L.k_norm)).cuda()
        for k, n in names.items():
            sd[p + n + ".weight"] = deq(getattr(L, k))
    model.load_state_dict(sd, assign=True, strict=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config, device="cuda")
    return model.eval()


@click.command()
@click.argument("model", type=click.Path(exists=True))
@click.option("--ctx", default="512,8192,32768")
@click.option("--prompts", default="128,512,2048,8192")
@click.option("--steps", default=64)
@click.option("--no-hf", is_flag=True)
@click.option("--json", "json_out", default=None)
# a 128-token prefill is host-bound (~7 ms on an H100, 8B), and one machine's host jitter moved a median of 3 by 25%
# between runs of one tree; tools/ab_trees.py sets 3 against a tree whose bench times 3
@click.option("--prefill-reps", default=9, show_default=True,
              help="timed prefills per prompt length, eager and graph replays each: their median is reported")
def main(model, ctx, prompts, steps, no_hf, json_out, prefill_reps):
    ctxs, pls = [int(x) for x in ctx.split(",")], [int(x) for x in prompts.split(",")]
    copies = copy_bandwidth()
    res = {"gpu": gpu_name(), "copy_GBps": copies["best"], "copy_detail_GBps": copies, "decode": [], "prefill": []}
    eng = Engine.load(model, "cuda", need_tokenizer=False)
    rng = np.random.default_rng(0)
    mf = eng.file
    for c in ctxs:
        m, tok = warm_session(eng, c, c + steps + 8, rng)  # prompt, 4 warm-up steps, timed steps
        p0 = m.pos  # both loops over the same positions (the split count of attention follows the length)
        _, dt_serial = timed_greedy_steps(m, tok, steps, rng, serial=True)
        m.rewind(p0)
        _, dt = timed_greedy_steps(m, tok, steps, rng)
        by = step_bytes(mf, c + 4 + steps // 2)
        res["decode"].append({"context": c, "tok_s": 1 / dt, "step_ms": dt * 1e3, "bytes_per_step": by,
                              "eff_GBps": by / dt / 1e9, "ratio_to_copy": by / dt / 1e9 / res["copy_GBps"],
                              "tok_s_serial": 1 / dt_serial})
    for p in pls:
        m = eng.session(p)
        m.ops.prefill_graphs = False  # tok/s and warm tok/s: eager prefills, as a prompt meets them the first time
        ids = rng.integers(0, 151643, p).tolist()
        ts = []
        for rep in range(prefill_reps + 1):  # (the first untimed)
            m.set_context(p)  # frees the pool's cached blocks and allocates a KV cache for p positions
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            m.prefill(ids)
            cp.cuda.Device().synchronize()
            if rep:
                ts.append(time.perf_counter() - t0)
        # the pool keeps every block the prefill used: its size now is this prompt's peak footprint
        # (weights, a KV cache for p positions, the prefill's activations)
        mib = cp.get_default_memory_pool().total_bytes() / 2**20
        # warm: a kept session at 8 lengths just under p that this process has not run, as a chat's next turn meets
        # them (tok/s: each prefill's own tokens over its time)
        warm = [n / s for n, s in zip(range(p - 8, p), fresh_walls(eng, ids, p - 8, p))]
        # graph: a fresh prompt of a length bucket met before replays its prefill graph; the first
        # prefill of the bucket ran eagerly, the second captured it; None where no graph serves p tokens
        m = eng.session(p)
        m.ops.prefill_graphs = True
        gs = [prefill_wall(m, ids) for _ in range(prefill_reps + 2)][2:]
        served = oc.prefill_bucket(p) in m.ops.prefill_graph_cache
        res["prefill"].append({"prompt": p, "tok_s": p / float(np.median(ts)), "tok_s_warm": float(np.median(warm)),
                               "tok_s_graph": p / float(np.median(gs)) if served else None, "gpu_mib": mib,
                               "gpu_mib_graph": cp.get_default_memory_pool().total_bytes() / 2**20,
                               # every timed run in order: a drift across them shows here, not in the median
                               "eager_ms": [round(t * 1e3, 3) for t in ts],
                               "graph_ms": [round(t * 1e3, 3) for t in gs] if served else None})
    res["ours_gpu_mib"] = cp.get_default_memory_pool().total_bytes() / 2**20
    emb = eng.model.ops.weights.embed  # an untied embedding table stays in pinned host memory (cuda/weights.py)
    res["ours_host_pinned_mib"] = emb.nbytes / 2**20 if isinstance(emb, np.ndarray) else 0.0
    eng.model = None
    cp.get_default_memory_pool().free_all_blocks()
    if not no_hf and not mf.args.num_experts:  # the transformers side is the dense Qwen3 model
        import torch
        hf = hf_model(mf)
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # the peak still counts the weights, which stay allocated
        hf_pre = {}
        with torch.no_grad():
            for p in pls:
                x = torch.randint(0, 151643, (1, p), device="cuda")
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                ts = []
                for rep in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    hf(x, use_cache=False, logits_to_keep=1)
                    torch.cuda.synchronize()
                    if rep:
                        ts.append(time.perf_counter() - t0)
                hf_pre[p] = (p / float(np.median(ts)), torch.cuda.max_memory_allocated() / 2**20)
            hf_dec = {}
            for c in ctxs[:1]:
                x = torch.randint(0, 151643, (1, c), device="cuda")
                out = hf(x, use_cache=True, logits_to_keep=1)
                pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                for i in range(steps + 4):
                    if i == 4:
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                    out = hf(nxt, past_key_values=pkv, use_cache=True)
                    pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                hf_dec[c] = steps / (time.perf_counter() - t0)
        res["hf_peak_gpu_mib"] = max([torch.cuda.max_memory_allocated() / 2**20] + [v[1] for v in hf_pre.values()])
        for r in res["prefill"]:
            r["hf_tok_s"], r["hf_gpu_mib"] = hf_pre[r["prompt"]]
            r["ratio_to_hf"] = r["tok_s"] / r["hf_tok_s"]
            r["mem_ratio_to_hf"] = r["gpu_mib"] / r["hf_gpu_mib"]
        for r in res["decode"]:
            if r["context"] in hf_dec:
                r["hf_tok_s"] = hf_dec[r["context"]]
                r["ratio_to_hf"] = r["tok_s"] / r["hf_tok_s"]
    print(f"# {res['gpu']}: device copy {res['copy_GBps']:.0f} GB/s; kuiper GPU memory {res['ours_gpu_mib']:.0f} MiB"
          f" (+ {res['ours_host_pinned_mib']:.0f} MiB embedding table in pinned host memory)"
          + (f"; transformers fp16 peak {res['hf_peak_gpu_mib']:.0f} MiB" if "hf_peak_gpu_mib" in res else ""))
    print("| decode ctx | tok/s | ms/step | eff. GB/s | / copy | host-serial tok/s | HF fp16 tok/s | x HF |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["decode"]:
        print(f"| {r['context']} | {r['tok_s']:.1f} | {r['step_ms']:.2f} | {r['eff_GBps']:.0f} | "
              f"{r['ratio_to_copy']:.2f} | {r['tok_s_serial']:.1f} | {r.get('hf_tok_s', float('nan')):.1f} | "
              f"{r.get('ratio_to_hf', float('nan')):.2f} |")
    print("| prefill tokens | tok/s | warm tok/s | graph tok/s | HF fp16 tok/s | x HF | GPU MiB | HF GPU MiB | mem / HF |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["prefill"]:
        g = "-" if r["tok_s_graph"] is None else f"{r['tok_s_graph']:.0f}"
        print(f"| {r['prompt']} | {r['tok_s']:.0f} | {r['tok_s_warm']:.0f} | {g} | {r.get('hf_tok_s', float('nan')):.0f} | "
              f"{r.get('ratio_to_hf', float('nan')):.2f} | {r['gpu_mib']:.0f} | {r.get('hf_gpu_mib', float('nan')):.0f} | "
              f"{r.get('mem_ratio_to_hf', float('nan')):.2f} |")
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
