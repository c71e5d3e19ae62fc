"""NumPy backend: the plain float32 Qwen3 ops, the oracle the CUDA kernels must match.

Kept obviously right rather than fast: weights stay packed in the mapped file and each
linear dequantizes group-aligned row blocks on the fly. A file whose float32 forms fit the host
(DEQ_KEEP_BYTES: a quarter of its available memory; the lm_head in what the linears leave of it) keeps the
same blocks after their first use, which gives the same sums.
"""
from __future__ import annotations

import os

import numpy as np

from . import awq
from .config import ModelArgs, rope_tables
from .errors import ResourceError
from .loader import AwqLinear, Layer, Weights
from .backend import SAMPLED_TOKEN, Seq, Step
from .sampling import SamplingParams, sample

BLOCK_BYTES = 4 << 20  # float32 bytes of a linear's dequantized rows per block (dequant_blocks), whole groups
_LM_BLOCK = 16384  # lm_head rows converted to float32 at a time
# float32 bytes of one array of attention scores [heads, query rows, keys]: a longer prompt's rows are attended a
# share at a time (a whole 13,890-token prompt's scores and their temporaries held 18 GB on the tiny test model)
SCORES_BYTES = 256 << 20
# an fp32 lm_head up to this size (the test presets' and Qwen3-0.6B's 622 MB), or up to what the kept linears leave of
# DEQ_KEEP_BYTES (30B-A3B's and 8B's, 1.2 and 2.5 GB, on a host with ~20 GB free), is converted once and kept
# (kept_blocks): otherwise a decode step spends ~1 s converting the head
LM_KEEP_BYTES = 1 << 30


def _available_bytes() -> int:
    """The host memory available now (MemAvailable; 0 where it cannot be read)."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            avail = next((int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:")), 0)
    except OSError:
        pass
    if not avail and hasattr(os, "sysconf"):
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            avail = 0
    return avail


def deq_keep_budget() -> int:
    """Float32 bytes of dense linears a file may keep (kept_blocks): a quarter of the host memory available when
    the module loads, at most 8 GiB, at least 256 MiB (the test presets': 50 MB for "small"). Qwen3-0.6B's 1.8 GB
    fit on a host with 8 GB free: its CPU decode then reads float32 weights instead of dequantizing every linear
    each token (5.6 against 0.25 tok/s on the 2-core CI host); 1.7B's 6.9 GB rarely do."""
    return max(256 << 20, min(8 << 30, _available_bytes() // 4))


# a file whose dense AWQ linears all dequantize to at most this keeps each one's float32 blocks after its first use
DEQ_KEEP_BYTES = deq_keep_budget()


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float32)


def dequant_blocks(lin: AwqLinear):
    """W [K, N] = (q - z) * s as float32 blocks of group-aligned rows, columns in the packed words' stored order
    (awq.unpack_stored; awq_linear puts its product back in logical order): (first row, block [rows, N]). Each block
    is unpacked by byte masks and scaled in place, group by group, about BLOCK_BYTES at a time so it stays in cache
    (2.5-3x faster than awq.dequantize's per-nibble shifts and per-row copies of z and s on a 2-core host)."""
    g, N = lin.group_size, lin.N
    z = awq.unpack_stored(lin.qzeros)
    s = lin.scales.reshape(-1, N // 8, 8)[:, :, awq.STORED_COLUMNS].reshape(-1, N).astype(np.float32)
    step = max(g, BLOCK_BYTES // (4 * N) // g * g)
    for k0 in range(0, lin.K, step):
        W = awq.unpack_stored(lin.qweight[k0:k0 + step])
        for j in range(0, W.shape[0], g):  # (a last group may be short)
            W[j:j + g] -= z[(k0 + j) // g]
            W[j:j + g] *= s[(k0 + j) // g]
        yield k0, W


def kept_blocks(owner, name: str, blocks, keep: bool):
    """The float32 blocks of a weight, as iterated from `blocks` (a lazy generator of (first row, block)), kept on
    `owner` (the loaded file's weights, or one of their linears) as `name` after the first use where `keep` (a file
    whose float32 form fits the budget), so every NumpyOps on that file iterates the same blocks again; else
    `blocks` itself."""
    got = getattr(owner, name, None)
    if got is None and keep:
        got = list(blocks)
        setattr(owner, name, got)
    return blocks if got is None else got


def awq_linear(x: np.ndarray, lin: AwqLinear, blocks=None, per_row: bool = False) -> np.ndarray:
    """x [T, K] float32 @ dequant(W) [K, N] -> [T, N] float32; blocks: dequant_blocks(lin) kept from before.
    per_row: each row its own product (a row's sums then do not depend on the other rows, as a BLAS GEMM's do)."""
    T = x.shape[0]
    out = np.zeros((T, lin.N), dtype=np.float32)
    for k0, W in dequant_blocks(lin) if blocks is None else blocks:
        if per_row:
            for t in range(T):
                out[t:t + 1] += x[t:t + 1, k0:k0 + W.shape[0]] @ W
        else:
            out += x[:, k0:k0 + W.shape[0]] @ W
    return out.reshape(T, -1, 8)[:, :, awq.LOGICAL_FROM_STORED].reshape(T, lin.N)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE. x [T, heads, hd], cos/sin [T, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class NumpyOps:
    """backend.PagedBackend on the CPU in float32 (the GPU's reference): no graphs, draws on the host. A step of one
    sequence without a block table uses the contiguous cache (alloc_cache); a step of several runs over the pool of
    KV blocks (alloc_blocks), each sequence through its block table.

    batch_invariant: every row's linears, attention and logits computed on their own, so a sequence's numbers do
    not depend on which others share its step or how its prompt was cut into chunks (slower: one GEMV per row)."""
    name = "cpu"
    graphs = False
    queues_draws = False
    max_batch = 256
    SAMPLED_TOKEN = SAMPLED_TOKEN
    batch_invariant = False

    def __init__(self, args: ModelArgs, weights: Weights, max_context: int, comm=None,
                 expert_range: tuple[int, int] | None = None):
        """One rank of a tensor-parallel group where comm (parallel.comm.Communicator) is given: args and weights
        are then the rank's (parallel.shard.RankFile), expert_range the MoE experts it holds (start, stop)."""
        self.args = args
        self.weights = weights
        self.comm = comm
        self.expert_range = expert_range
        self.routing_log: list[np.ndarray] = []  # [T, k] expert ids per MoE layer call, for tests
        self.k_blocks = self.v_blocks = None  # the paged pool's storage (alloc_blocks)
        self._step: Step | None = None  # the step running (its sequences' rows, for logits)
        dense = [lin for L in weights.layers for lin in (L.wq, L.wk, L.wv, L.wo, L.w1, L.w2, L.w3) if lin is not None]
        ranks = 1 if comm is None else comm.size  # (a group's ranks share the host: each keeps its part of the budget)
        dense_f32 = sum(lin.K * lin.N * 4 for lin in dense)
        self.keep_dequant = dense_f32 * ranks <= DEQ_KEEP_BYTES
        # the float32 lm_head is kept where it fits what the linears leave of the budget (or LM_KEEP_BYTES)
        self.keep_lm = weights.lm_head.size * 4 * ranks <= max(
            LM_KEEP_BYTES, DEQ_KEEP_BYTES - (dense_f32 * ranks if self.keep_dequant else 0))
        self.alloc_cache(max_context)

    def alloc_cache(self, max_context: int) -> None:
        a = self.args
        shape = (a.num_hidden_layers, max_context, a.num_key_value_heads, a.head_dim)
        self.k_cache = self.v_cache = None
        try:
            self.k_cache = np.zeros(shape, dtype=np.float32)
            self.v_cache = np.zeros(shape, dtype=np.float32)
        except MemoryError:
            need = 2 * 4 * a.num_hidden_layers * max_context * a.kv_dim
            raise ResourceError(f"out of host memory: the KV cache needs {need / 2**20:.0f} MiB for --max-context "
                                f"{max_context}; try a smaller --max-context") from None
        self.cos, self.sin = rope_tables(a, max_context)

    def block_bytes(self, block_size: int) -> int:
        a = self.args
        return 2 * 4 * a.num_hidden_layers * block_size * a.kv_dim

    def kv_pool_blocks(self, block_size: int, utilization: float) -> int:
        """Blocks that `utilization` of the host memory available now holds."""
        return int(_available_bytes() * utilization) // self.block_bytes(block_size)

    def alloc_blocks(self, n_blocks: int, block_size: int, max_context: int) -> None:
        """The pool's storage: keys and values [layers, n_blocks, block_size, KV, head_dim], and RoPE tables for
        positions up to max_context."""
        a = self.args
        shape = (a.num_hidden_layers, n_blocks, block_size, a.num_key_value_heads, a.head_dim)
        self.k_blocks = self.v_blocks = None
        try:
            self.k_blocks = np.zeros(shape, dtype=np.float32)
            self.v_blocks = np.zeros(shape, dtype=np.float32)
        except MemoryError:
            raise ResourceError(f"out of host memory: {n_blocks} KV blocks need "
                                f"{n_blocks * self.block_bytes(block_size) / 2**20:.0f} MiB") from None
        self.block_size = block_size
        self.pool_cos, self.pool_sin = rope_tables(a, max_context)

    @staticmethod
    def synchronize() -> None:
        pass

    @staticmethod
    def device_stats() -> dict:
        return {}

    def begin_step(self, step: Step) -> None:
        """A step of one sequence in the contiguous cache, or of up to max_batch with block tables."""
        if any(s.block_table is None for s in step.seqs):
            step.one()
        elif step.batch > self.max_batch or self.k_blocks is None:
            raise NotImplementedError(f"a paged step of {step.batch} sequences needs alloc_blocks() and at most "
                                      f"{self.max_batch} sequences")
        self._step = step

    def forget_position(self) -> None:
        pass

    def begin_layer(self) -> None:
        pass

    def end_step(self) -> None:
        pass

    def embed(self, step: Step) -> np.ndarray:
        ids = [t for s in step.seqs for t in s.ids]
        return self.weights.embed[np.asarray(ids, dtype=np.int64)].astype(np.float32)

    def add_rmsnorm(self, h, r, w):
        if r is not None:
            h = h + r
        return h, rmsnorm(h, w, self.args.rms_norm_eps)

    def all_reduce(self, x):
        """backend.Collectives: the sum of the ranks' partial results; x itself without a communicator."""
        return x if self.comm is None else self.comm.all_reduce_sum(x)

    def attention(self, x, layer: Layer, i: int, step: Step):
        """The attention block: q, k, v; their RMSNorms and RoPE; the new keys and values into the cache; causal GQA
        over each sequence's cache; o."""
        q, k, v = self._linear(x, layer.wq), self._linear(x, layer.wk), self._linear(x, layer.wv)
        q = self._qk_norm_rope_store(q, k, v, layer, i, step)
        return self._linear(self._attend_cache(q, i, step), layer.wo)

    def mlp(self, x, layer: Layer):
        """The SwiGLU MLP: down(silu(gate(x)) * up(x))."""
        return self._linear(silu(self._linear(x, layer.w1)) * self._linear(x, layer.w3), layer.w2)

    def _linear(self, x, lin: AwqLinear):
        blocks = kept_blocks(lin, "_f32_blocks", dequant_blocks(lin), self.keep_dequant)
        return awq_linear(x, lin, blocks, per_row=self.batch_invariant)

    @staticmethod
    def _rows(step: Step):
        """(seq, first row, last row + 1) of each sequence's rows in the step's [T, ...] arrays."""
        r = 0
        for seq in step.seqs:
            yield seq, r, r + len(seq.ids)
            r += len(seq.ids)

    def _store(self, i: int, seq: Seq, k, v) -> None:
        """A sequence's new keys and values into its cache: contiguous, or through its block table."""
        p = np.arange(seq.pos0, seq.pos0 + len(seq.ids))
        if seq.block_table is None:
            self.k_cache[i, p] = k
            self.v_cache[i, p] = v
        else:
            blk, off = np.asarray(seq.block_table)[p // self.block_size], p % self.block_size
            self.k_blocks[i, blk, off] = k
            self.v_blocks[i, blk, off] = v

    def _keys(self, i: int, seq: Seq, n: int):
        """A sequence's first n cached keys and values [n, KV, hd]."""
        if seq.block_table is None:
            return self.k_cache[i, :n], self.v_cache[i, :n]
        a, bs = self.args, self.block_size
        blk = np.asarray(seq.block_table[:-(-n // bs)])
        shape = (-1, a.num_key_value_heads, a.head_dim)
        return self.k_blocks[i, blk].reshape(shape)[:n], self.v_blocks[i, blk].reshape(shape)[:n]

    def _qk_norm_rope_store(self, q, k, v, layer: Layer, i: int, step: Step):
        a = self.args
        T = q.shape[0]
        q = rmsnorm(q.reshape(T, a.num_attention_heads, a.head_dim), layer.q_norm, a.rms_norm_eps)
        k = rmsnorm(k.reshape(T, a.num_key_value_heads, a.head_dim), layer.k_norm, a.rms_norm_eps)
        v = v.reshape(T, a.num_key_value_heads, a.head_dim)
        out = np.empty_like(q)
        for seq, r0, r1 in self._rows(step):
            cos, sin = (self.cos, self.sin) if seq.block_table is None else (self.pool_cos, self.pool_sin)
            cos, sin = cos[seq.pos0:seq.pos0 + r1 - r0], sin[seq.pos0:seq.pos0 + r1 - r0]
            self._store(i, seq, rope(k[r0:r1], cos, sin), v[r0:r1])
            out[r0:r1] = rope(q[r0:r1], cos, sin)
        return out

    def _attend_cache(self, q, i: int, step: Step):
        """Causal GQA over each sequence's cache. q [T, H, hd], a sequence's rows at its positions pos0.. ->
        [T, H*hd]."""
        T, H, hd = q.shape
        out = np.empty((T, H * hd), dtype=np.float32)
        for seq, r0, r1 in self._rows(step):
            K, V = self._keys(i, seq, seq.pos0 + r1 - r0)
            if self.batch_invariant:  # each row over exactly the keys it sees
                for t in range(r0, r1):
                    n = seq.pos0 + t - r0 + 1
                    out[t] = self._attend(q[t:t + 1], K[:n], V[:n], n - 1)
            else:
                out[r0:r1] = self._attend(q[r0:r1], K, V, seq.pos0)
        return out

    def _attend(self, q, K, V, pos0: int):
        """q [T, H, hd] at positions pos0.. over keys and values [n, KV, hd] -> [T, H*hd], SCORES_BYTES of scores
        at a time (each row's softmax is its own: a share of the rows gives the same values, to rounding)."""
        T, H, hd = q.shape
        n = K.shape[0]
        group = H // self.args.num_key_value_heads
        Kh = np.repeat(K, group, axis=1).transpose(1, 2, 0)  # [H, hd, n]
        Vh = np.repeat(V, group, axis=1).transpose(1, 0, 2)  # [H, n, hd]
        rows = max(1, SCORES_BYTES // (4 * H * n))
        out = np.empty((T, H * hd), dtype=np.float32)
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            s = np.matmul(q[t0:t1].transpose(1, 0, 2), Kh) / np.sqrt(hd)  # [H, rows, n]
            mask = np.arange(n)[None, :] > (pos0 + np.arange(t0, t1))[:, None]
            s = np.where(mask[None], -np.inf, s)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            p = s / s.sum(axis=-1, keepdims=True)
            out[t0:t1] = np.matmul(p, Vh).transpose(1, 0, 2).reshape(t1 - t0, H * hd)
        return out

    def moe(self, x, layer: Layer):
        """Qwen3-MoE block through the staged pipeline of moe_ref (the GPU's stages). Each call's expert
        choice is appended to routing_log (tests)."""
        from . import moe_ref  # moe_ref builds on this module's awq_linear and silu

        a = self.args
        if self.batch_invariant and x.shape[0] > 1:  # (a row's experts' GEMMs then do not see the other rows)
            return np.concatenate([self.moe(x[t:t + 1], layer) for t in range(x.shape[0])])
        ids, w = moe_ref.route(x, layer.router, a.num_experts_per_tok, a.norm_topk_prob)
        self.routing_log.append(ids)
        n = a.num_experts
        if self.expert_range is not None:  # other ranks' experts: a spare id past this rank's, weighted 0
            e0, e1 = self.expert_range
            mine = (ids >= e0) & (ids < e1)
            ids, w, n = np.where(mine, ids - e0, e1 - e0).astype(np.int32), np.where(mine, w, 0), e1 - e0 + 1
        _, offsets, p2u, u2p = moe_ref.expert_maps(ids, n)
        xp = moe_ref.gather(x, p2u, a.num_experts_per_tok)
        act = moe_ref.grouped_gemm1_swiglu(xp, offsets, layer.experts_w13)
        yp = moe_ref.grouped_gemm2(act, offsets, layer.experts_w2)
        return moe_ref.finalize(yp, u2p, w)

    sample = staticmethod(sample)

    def sample_launch(self, logits, p: SamplingParams, rng: np.random.Generator, history: list[int],
                      n_valid: int) -> None:
        """The draw, made now (the host draws): sample_result returns it."""
        self._drawn = self.sample(logits, p, rng, history, n_valid)

    def sample_result(self) -> int:
        tok, self._drawn = self._drawn, None
        return tok

    def cancel_draw(self) -> None:
        self._drawn = None

    # no graphs: the model runs every step eagerly
    def decode_step(self, body, step: Step):
        self.begin_step(step)
        try:
            return body()
        finally:
            self.end_step()

    @staticmethod
    def prefill_graph(step: Step, layers):
        return None

    @staticmethod
    def warm_prefill_graphs(layers) -> list[int]:
        return []

    @staticmethod
    def warm_decode_graphs(body_at, n_valid: int, keys: tuple[int, int] | None = None) -> list[int]:
        return []

    @staticmethod
    def argmax_rows(logits, n_valid: int) -> np.ndarray:
        return np.argmax(logits[:, :n_valid], axis=1)

    @staticmethod
    def sample_rows(logits, draws, n_valid: int) -> list[int | None]:
        return [None if d is None else sample(logits[i], d.params, d.rng, d.history, n_valid, generated=d.generated)
                for i, d in enumerate(draws)]

    @staticmethod
    def to_host(x) -> np.ndarray:
        return x

    def logits(self, x, all_positions: bool = False) -> np.ndarray:
        """float32 logits of the last row [V] (of each sequence's last row [B, V] in a paged step), or of every
        row [T, V] with all_positions."""
        step = self._step
        paged = step is not None and step.seqs[0].block_table is not None and x.shape[0] == step.n_tokens
        if not all_positions:
            x = x[[r1 - 1 for _, _, r1 in self._rows(step)]] if paged else x[-1:]
        W = self.weights.lm_head  # [V, D] fp16, converted _LM_BLOCK rows at a time
        out = np.empty((x.shape[0], W.shape[0]), dtype=np.float32)
        blocks = ((r0, W[r0:r0 + _LM_BLOCK].astype(np.float32)) for r0 in range(0, W.shape[0], _LM_BLOCK))
        for r0, Wf in kept_blocks(self.weights, "_lm_f32_blocks", blocks, self.keep_lm):
            if self.batch_invariant:
                for t in range(x.shape[0]):
                    out[t, r0:r0 + Wf.shape[0]] = x[t] @ Wf.T
            else:
                out[:, r0:r0 + Wf.shape[0]] = x @ Wf.T
        if self.comm is not None:  # vocabulary-parallel lm_head: every rank gets the whole row
            out = self.comm.all_gather(out, axis=-1)
        return out if all_positions or paged else out[0]
