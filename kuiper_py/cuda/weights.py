"""Weight upload: the AWQ tensors copied to the GPU through pinned memory with their qweight tiled, the embedding
where it is read, and the MoE router rows the o GEMV computes."""
from __future__ import annotations

import sys

import numpy as np

from ..loader import Layer, Weights, check_weights_fit, device_bytes, drop_pages
from .memory import tile_qweight
from .ops.gemm import awq_dequant
from .runtime.device import device_name

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


class WeightUpload:
    """CupyOps' weight upload (a mixin)."""

    def _router_o_rows(self) -> dict:
        """For the one-launch MoE FFN half: per MoE layer i, (R, Rh) = (W_o diag(ffn_norm) router^T
        [q_dim, E], diag(ffn_norm) router^T [D, E]) fp16: the router's logits before the 1/rms as a
        function of the attention output and of the residual row, which the o GEMV computes beside o
        (gemv_w4a16.cu gemv_rt_tile). Made once here, R from the dequantized o matrix in fp32: 1.5 MB
        per Qwen3-30B-A3B layer."""
        out = {}
        for i, L in enumerate(self.weights.layers):
            if L.router is None:
                continue
            rt = L.ffn_norm.astype(cp.float32)[:, None] * L.router.astype(cp.float32).T  # [D, E]
            wo = awq_dequant(L.wo).astype(cp.float32)  # [q_dim, D]
            out[i] = (cp.ascontiguousarray((wo @ rt).astype(cp.float16)), cp.ascontiguousarray(rt.astype(cp.float16)))
            del wo, rt
        cp.get_default_memory_pool().free_all_blocks()
        return out

    # ------------------------------------------------------------------ loading
    def _upload(self, w: Weights, progress: bool) -> Weights:
        import cupyx
        need, pinned_bytes = device_bytes(w)  # (pinned_bytes: the untied embedding, kept in pinned host memory)
        total = need + pinned_bytes
        free, dev_total = cp.cuda.runtime.memGetInfo()
        check_weights_fit(need, free + cp.get_default_memory_pool().free_bytes(), dev_total, device_name())
        chunk = 64 << 20
        pinned = cupyx.empty_pinned((min(chunk, max(total, 1)),), dtype=np.uint8)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="upload", file=sys.stderr,
                       dynamic_ncols=True, leave=False)
        done: dict[int, object] = {}

        def up(x, share=True):  # share: reuse the copy of an array met before (a tied lm_head)
            if share and id(x) in done:
                return done[id(x)]
            d = cp.empty(x.shape, dtype=x.dtype)
            src = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
            dst = d.reshape(-1).view(cp.uint8)
            stream = cp.cuda.get_current_stream()
            for o in range(0, src.size, chunk):
                n = min(chunk, src.size - o)
                pinned[:n] = src[o:o + n]
                drop_pages(src[o:o + n])  # the file's pages, copied: no longer this process's memory
                dst[o:o + n].set(pinned[:n], stream=stream)
                stream.synchronize()  # the copy from pinned memory is asynchronous: finish it before refilling
            if bar:
                bar.update(x.nbytes)
            if share:
                done[id(x)] = d
            return d

        def lin(q, segments=1):  # AwqLinear or AwqStack (same fields), or None; qweight tiled on the GPU
            return None if q is None else type(q)(tile_qweight(up(q.qweight, False), segments), up(q.qzeros),
                                                  up(q.scales), q.group_size)

        layers = [Layer(up(L.attn_norm), up(L.ffn_norm), up(L.q_norm), up(L.k_norm), lin(L.wq), lin(L.wk),
                        lin(L.wv), lin(L.wo), lin(L.w1), lin(L.w2), lin(L.w3),
                        None if L.router is None else up(L.router), lin(L.experts_w13, 2), lin(L.experts_w2))
                  for L in w.layers]
        # An untied token-embedding table (151936 x 4096 fp16 = 1.2 GB at 8B) is read one row per token,
        # so it stays in pinned host memory, which kernels read directly over the bus (unified
        # addressing), as llama.cpp keeps it on the host: GPU memory is the 4-bit weights plus the
        # fp16 lm_head. A tied table is lm_head too and goes to the GPU. KUIPER_EMBED_ON_GPU=1: always.
        embed = None
        if pinned_bytes:
            try:
                embed = cupyx.empty_pinned(w.embed.shape, dtype=w.embed.dtype)
                rows = max(1, chunk // max(1, w.embed[0].nbytes))
                for r in range(0, w.embed.shape[0], rows):  # a chunk at a time, so its file pages go as it is copied
                    embed[r:r + rows] = w.embed[r:r + rows]
                    drop_pages(w.embed[r:r + rows])
                if bar:
                    bar.update(w.embed.nbytes)
            except (cp.cuda.runtime.CUDARuntimeError, MemoryError):  # page-locked memory refused: GPU copy
                print(f"kuiper: could not pin {w.embed.nbytes / 2**20:.0f} MiB of host memory for the token "
                      f"embeddings; keeping them on the GPU", file=sys.stderr)
                embed = None
        if embed is None:
            embed = up(w.embed)
        out = Weights(embed, up(w.final_norm), up(w.lm_head), layers)
        if bar:
            bar.close()
        cp.cuda.Device().synchronize()
        return out
