"""The CUDA backend (CupyOps): the same ops as ops_numpy, as cupy.RawModule kernels from kernels_cu/; the op families
are in cuda/ops, device queries, launches, the kernel registry and its builds in cuda/runtime, the tuning in
cuda/settings.py.

Activations are fp16 with an fp32 residual stream; weights stay AWQ-packed (4-bit) on the GPU.
Their qweight is rearranged once at load into the tiled layout of common.cuh (tile_qweight): the
same words, ordered so the decode GEMV reads whole contiguous spans. Decode (T = 1) runs on
preallocated buffers and allocates nothing per token.
"""
from __future__ import annotations

import numpy as np

from ..config import ModelArgs, rope_tables
from .. import env
from . import memory as mem
from . import settings as cfg
from .settings import Settings, use_settings
from .runtime.build import (kernel, kernel_build_seconds, load_module, model_families, model_groups, module_keys,
                            precompile)
from .runtime.device import device_name, gpu_memory_used_mib
from .memory import _Arena, _BumpArena, _PBUF_POS, _i
from .ops.gemv import SUPPORTED_HEAD_DIMS, decode_acc_layout, gemv, gemv_counters, gemv_partial_size
from .ops.gemm import cublas_ready, gemm, swiglu_prefill, wgmma_available
from .ops.attention import attention_combine, attention_decode, attention_prefill
from .ops.decode_halves import decode_ffn, decode_ffn_plan, decode_moe_ffn, decode_moe_plan
from .ops.moe import (MOE_MAX_EXPERTS, MOE_MAX_TOPK, moe_decode, moe_experts, moe_experts_tile, moe_maps_arrays,
                      moe_route, moe_route_decode, moe_rs_path)
from .ops.norm import add_rmsnorm, lm_head, qk_norm_rope_store
from .ops.rows import ROWS_MAX, rows_lm_head
from ..backend import SAMPLED_TOKEN, Step
from ..errors import KuiperError, ResourceError
from ..loader import Layer, Weights, kv_bytes_per_position
from .draws import DeviceDraws
from .plan import DecodePlan, Gpu, PrefillPlan, build as build_plan, build_prefill, forms as plan_forms
from .graphs import CudaGraphs
from .weights import WeightUpload
from .batched import PagedSteps
from .ops.paged import route_rows
from . import tp

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


# Decode has no add+RMSNorm kernels: the o / down / MoE projection adds its output into the fp32 residual stream in
# its epilogue, and the next GEMV computes rmsnorm(h) * w in its prologue; q/k RMSNorm, RoPE and the KV-cache write
# are the q|k|v GEMV's epilogue, flash decoding's merge the o GEMV's prologue. MoE prefill's finalize (the
# routing-weighted sum of each token's expert rows) is in the next add_rmsnorm (the [T, D] sum is neither written nor
# read back). Decode's GEMVs run in accumulating mode where their splits fit (no split-K reduction tail: the residual
# add, the RMSNorm's 1/rms, SwiGLU and the q/k norm + RoPE + KV write done by the consuming kernel,
# the MoE layers' expert GEMVs too); gemv_acc False (tensor-parallel ranks) takes the reduction tails that wider
# shapes take. Between the blocks only the residual stream's values wait: a block's last projection (_Deferred) for the
# next add_rmsnorm, and that norm (_Normed) for the next block's first GEMV.


class _Deferred:
    """A decode projection not yet launched: add_rmsnorm launches it with the residual add fused
    (run(h)), or in accumulating mode (run_acc(h), h the residual row it will be added to; it returns
    the int64 accumulator the next GEMV finishes); any other consumer gets its fp16 output (run(None))."""

    def __init__(self, run, run_acc=None):
        self.run, self.run_acc = run, run_acc


def _acc_only(what: str):
    """A _Deferred's run for a launch that exists in accumulating mode only (a fused half)."""
    def run(h):
        raise AssertionError(f"{what} runs in accumulating mode only")
    return run


class _Normed:
    """Decode's x = rmsnorm(h) * w not yet computed: a GEMV computes it in its prologue; any other
    consumer gets it from the add_rmsnorm kernel (CupyOps._x). pend: a projection's output still to
    be added to h (accumulating mode), the sum going to hout."""

    def __init__(self, h, w, pend=None, hout=None):
        self.h, self.w, self.shape, self.pend, self.hout = h, w, h.shape, pend, hout


class _ExpertRows:
    """A MoE prefill's output not yet summed: the expert rows y [T*k, D] (permuted), u2p and the routing weights
    [T, k]; the next add_rmsnorm, the layer output's one consumer, sums them as it adds them to h
    (in the next add_rmsnorm)."""

    def __init__(self, y, u2p, weights):
        self.y, self.u2p, self.weights = y, u2p, weights


class CupyOps(WeightUpload, CudaGraphs, DeviceDraws, PagedSteps):
    """backend.PagedBackend on one GPU (graphs: set per instance, KUIPER_CUDA_GRAPHS); a Step of several sequences
    with block tables runs through PagedSteps (cuda/batched.py)."""
    name = "cuda"
    queues_draws = True

    def __init__(self, args: ModelArgs, weights: Weights, max_context: int, progress: bool = True,
                 settings: Settings | None = None, comm=None, expert_range: tuple[int, int] | None = None):
        """settings: the tuning this backend runs with (cuda/settings.py; None: the active one, by default its
        defaults), made the process's active tuning. comm (parallel.comm.Communicator) of more than one rank: this
        backend is that rank (cuda/tp.py), args and weights its shards, expert_range its MoE experts."""
        self.comm, self.expert_range = comm, expert_range
        if tp.is_rank(comm):
            settings = tp.rank_settings(settings or cfg.SETTINGS)
        if settings is not None:
            use_settings(settings)
        self.settings = cfg.SETTINGS
        self.args = a = args
        if a.num_experts:
            if a.num_experts > MOE_MAX_EXPERTS or not 0 < a.num_experts_per_tok <= min(MOE_MAX_TOPK, a.num_experts):
                raise KuiperError(f"{a.num_experts} experts with {a.num_experts_per_tok} per token: the GPU MoE "
                                  f"kernels support up to {MOE_MAX_EXPERTS} experts and {MOE_MAX_TOPK} per token")
            if a.moe_intermediate_size % 64:
                raise KuiperError(f"moe_intermediate_size={a.moe_intermediate_size} is not a multiple of 64, which "
                                  f"the grouped expert GEMM needs")
        self.routing_log = None  # a list: record each MoE layer's expert ids, prefill and eager decode (tests)
        if a.head_dim not in SUPPORTED_HEAD_DIMS:
            raise KuiperError(f"head_dim {a.head_dim} is not supported on the GPU (supported: {SUPPORTED_HEAD_DIMS})")
        for n, what in ((a.hidden_size, "hidden_size"), (a.intermediate_size, "intermediate_size"),
                        (a.q_dim, "heads*head_dim"), (a.kv_dim, "kv_heads*head_dim")):
            if n % 32:
                raise KuiperError(f"{what}={n} is not a multiple of 32, which the GPU kernels need")
        if a.group_size % 32:
            raise KuiperError(f"AWQ group size {a.group_size} is not a multiple of 32 (GPU kernels)")
        if a.hidden_size > 8192:
            raise KuiperError(f"hidden_size {a.hidden_size} > 8192 is not supported by the lm_head kernel")
        self.dev = cp.cuda.Device()
        families, groups = model_families(a, int(self.dev.compute_capability)), model_groups(a)
        # the kernels' builds side by side while the weights upload (a first run's compiles, else cache loads)
        precompile(families, self.dev.id, groups)
        self.gpu = Gpu.current()
        self._prefill_plan = None
        self.n_sm = self.gpu.sms
        # the model-wide forms (accumulating modes) the plan's layers follow; the buffers are sized for them
        self._forms = plan_forms(a, self.settings, self.gpu)
        self.decode_graph_cache = {}  # flash decoding's regime (plan.regime) -> (graph, its argmax's n_valid)
        self.graphs = env.cuda_graphs() and not tp.is_rank(comm)  # (a rank's steps run eagerly: cuda/tp.py)
        self._graph = None
        self._dev_pos = None
        self.arena = _Arena()  # short prefills' activations (arena_max_t)
        # prefill graphs (prefill_graph): bucket -> (graph, its x [B, D], the allocations it holds, _BUF_GEN);
        # the buckets met once (the first prefill of a bucket runs eagerly); those whose prefill cannot be captured
        # (cuBLAS: shapes the fused GEMMs do not take, GPUs before sm_90); the graphs' shared activations; what the
        # graphs read (_pbuf: K's and V's maps, the position, the ids; _PBUF_*); prefill_graphs False runs every
        # prefill eagerly (tests)
        self.prefill_graph_cache: dict[int, tuple] = {}
        self._pseen: set[int] = set()
        self._pnever: set[int] = set()
        self.prefill_arena = _BumpArena()
        self._pbuf = self._graph_ids = self._graph_pos = None
        self.prefill_graphs = self.graphs and cfg.SETTINGS.prefill_graph_max_t > 1
        # a blocking stream: ordered with the default stream that eager kernels use, and capturable
        self._stream = cp.cuda.Stream(non_blocking=False)
        try:
            self.weights = self._upload(weights, progress)
            self._alloc_decode()
        except cp.cuda.memory.OutOfMemoryError as e:
            raise ResourceError(f"out of GPU memory loading the weights: {e}") from None
        gemv_counters()  # allocated (zeroed) before any graph capture
        # each decoder layer's index by its weights (the layer ops receive the Layer): its plan entry
        self._layer_i = {id(layer): i for i, layer in enumerate(self.weights.layers)}
        # the one-launch FFN / MoE FFN halves' launch configurations, where the plan's forms allow them (they
        # clear nothing themselves: the o GEMV before them clears their accumulator)
        self.ffn_plan, self.decode_ffn_why = (decode_ffn_plan(a) if self._forms.ffn_half_allowed else
                                              (None, "needs accumulating mode and the o GEMV's merge prologue"))
        self.moe_plan, self.decode_moe_why = (decode_moe_plan(a) if self._forms.moe_half_allowed(a) else
                                              (None, "needs a MoE model in accumulating mode with the o GEMV's "
                                                     "merge prologue"))
        self._router_o = self._router_o_rows() if self.moe_plan is not None else {}
        self.alloc_cache(max_context)
        # every family this model uses built (or precompile's builds waited for) before anything is timed; only
        # those of this GPU's architecture (the sm_90a modules load on compute capability 9.0 only)
        for key in (k for fam in families for k in module_keys(fam, groups)):
            load_module(key)
        cublas_ready()  # the prefill projections go through cuBLAS: load it now, not in the first prompt

    # the plan's model-wide choices, under the names the rest of the backend and the tests read
    acc_attn = property(lambda self: self._forms.acc_attn)
    acc_mode = property(lambda self: self._forms.acc_mode)
    acc_moe = property(lambda self: self._forms.acc_moe)
    attn_splits = property(lambda self: self.plan.attn_splits)
    attn_short = property(lambda self: self.plan.attn_short)
    attn_min_chunk = property(lambda self: self.plan.attn_min_chunk)
    attn_cm = property(lambda self: self.plan.attn_cm)
    o_merge = property(lambda self: self.plan.o_merge)

    def _make_plan(self, max_context: int) -> DecodePlan:
        """The decode schedule this backend runs (cuda/plan.py) at this cache capacity; every layer's weights
        match its plan entry's kind."""
        p = build_plan(self.args, cfg.SETTINGS, self.gpu, max_context, ffn=(self.ffn_plan, self.decode_ffn_why),
                       moe=(self.moe_plan, self.decode_moe_why), graphs=self.graphs, fm=self._forms)
        assert all(p.layers[i].moe == (layer.router is not None) for i, layer in enumerate(self.weights.layers))
        return p

    @property
    def prefill_plan(self) -> PrefillPlan:
        """The prefill schedule this backend's prompts take (cuda/plan.py build_prefill), made on first use."""
        if self._prefill_plan is None:
            ls = self.weights.layers
            moe = next((layer for layer in ls if layer.router is not None), None)
            self._prefill_plan = build_prefill(
                self.args, cfg.SETTINGS, self.gpu, wgmma_available(), cublas_ready(), ls[0].wq.group_size,
                moe.experts_w13.group_size if moe else None,
                moe is not None and moe_rs_path(moe.experts_w13, moe.experts_w2),
                dense=any(layer.router is None for layer in ls), experts=moe.experts_w13.E if moe else None)
        return self._prefill_plan

    def _lp(self, layer: Layer):
        """The plan entry of a decoder layer."""
        return self.plan.layers[self._layer_i[id(layer)]]

    def alloc_cache(self, max_context: int) -> None:
        """Preallocated fp16 KV cache [L, ctx, KV, hd] and the RoPE tables for max_context positions."""
        a = self.args
        L, KV, hd = a.num_hidden_layers, a.num_key_value_heads, a.head_dim
        self.k_cache = self.v_cache = None
        self.arena.clear()
        # the prefill graphs hold the old cache's addresses: they, their activations and the buckets met go
        # before the pool gives its free blocks back
        self.prefill_graph_cache, self._pseen, self.prefill_arena = {}, set(), _BumpArena()
        cp.get_default_memory_pool().free_all_blocks()
        try:
            self.k_cache = cp.empty((L, max_context, KV, hd), dtype=cp.float16)
            self.v_cache = cp.empty((L, max_context, KV, hd), dtype=cp.float16)
        except cp.cuda.memory.OutOfMemoryError:
            self.k_cache = self.v_cache = None
            per = kv_bytes_per_position(a)
            free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
            raise ResourceError(f"out of GPU memory: the KV cache needs {per * max_context / 2**20:.0f} MiB for "
                                f"--max-context {max_context}; {free / 2**20:.0f} MiB are free, at most "
                                f"{free // per} positions: try a smaller --max-context") from None
        cos, sin = rope_tables(a, max_context)
        self.cos, self.sin = cp.asarray(cos), cp.asarray(sin)
        # the plan at this capacity: flash decoding's splits (plan.attn_splits) follow it
        self.plan = self._make_plan(max_context)
        H = a.num_attention_heads
        self.d["part_o"] = cp.empty((H * self.attn_splits * hd,), cp.float32)
        self.d["part_ml"] = cp.empty((H * self.attn_splits * 2,), cp.float32)
        self.max_context = max_context
        self._graph, self.decode_graph_cache = None, {}  # they hold the old cache's addresses

    @staticmethod
    def synchronize() -> None:
        cp.cuda.get_current_stream().synchronize()

    @staticmethod
    def device_stats() -> dict:
        return {"gpu_name": device_name(), "gpu_mib": gpu_memory_used_mib(), "kernel_build_s": kernel_build_seconds()}

    def _alloc_decode(self):
        a = self.args
        D, I, qd, kvd = a.hidden_size, a.intermediate_size, a.q_dim, a.kv_dim
        E, k, mI = a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size
        s_max = max(gemv_partial_size(D, [qd, kvd, kvd]), gemv_partial_size(qd, [D]),
                    gemv_partial_size(D, [I, I]), gemv_partial_size(I, [D]))
        if E:  # the expert GEMVs: k slots each
            s_max = max(s_max, gemv_partial_size(D, [mI, mI], k), gemv_partial_size(mI, [D], k))
        self.d = {
            "ids": cp.zeros((1,), cp.int32), "h": cp.empty((1, D), cp.float32), "x": cp.empty((1, D), cp.float16),
            "partial": cp.empty((s_max,), cp.float32),
            "qrot": cp.empty((1, a.num_attention_heads, a.head_dim), cp.float16),
            "attn": cp.empty((1, qd), cp.float16), "proj": cp.empty((1, D), cp.float16),
            "act": cp.empty((1, I), cp.float16), "logits": cp.empty((a.vocab_size,), cp.float32),
            "token": cp.zeros((1,), cp.int32), "step": cp.zeros((1,), cp.uint64), "pos": cp.zeros((1,), cp.int32),
            "hist": cp.zeros((1024,), cp.int32),
        }
        # accumulating mode: accumulators [o | gate, up | down | q, k, v], zero between steps; the second
        # residual row the adds alternate with; the scaled norms' per-split sums of squares. acc_attn:
        # the attention half of every layer (q|k|v finished by flash decoding, o by the next norm's
        # consumer: a GEMV, or the MoE router); acc_mode: the dense FFN too (its down GEMV's sums go to
        # the next layer's q|k|v GEMV)
        if self.acc_attn:
            G = max(2 * I, 2 * k * mI if E else 0)  # gate, up: the dense FFN's or the k experts'
            # [o | gate, up | router z | down | q, k, v]: the router's logits (the one-launch MoE FFN
            # half's, added by the o GEMV) are cleared with o by the next q|k|v GEMV
            size, parts = decode_acc_layout(D, G, E, qd + 2 * kvd)
            acc = cp.zeros((size,), cp.int64)
            self.d.update({name: acc[sl] for name, sl in parts.items()})
            self.d.update(h2=cp.empty((1, D), cp.float32),
                          ss_attn=cp.empty((4096,), cp.float32), ss_ffn=cp.empty((4096,), cp.float32))
            self._ss_n = {}  # the scaled GEMVs' split counts, for their consumers
        if E:
            self.d.update(moe_logits=cp.empty((1, E), cp.float32), moe_ids=cp.zeros((1, k), cp.int32),
                          moe_w=cp.empty((1, k), cp.float32), moe_act=cp.empty((k, mI), cp.float16),
                          moe_counter=cp.zeros((1,), cp.int32))
        self._sampled = None  # host copy of the last sampled id, whose device copy is d["token"]
        self._init_draw()


    # ------------------------------------------------------------------ the ops interface
    def embed(self, step: Step):
        if self._paged is not None:
            return self._paged_embed(step)
        ids = step.one().ids
        T, D = len(ids), self.args.hidden_size
        if T == 1:
            on_dev = ids[0] == SAMPLED_TOKEN or (self._sampled is not None and ids[0] == self._sampled)
            dev_ids = self.d["token"] if on_dev else None
            if dev_ids is None:
                dev_ids = self.d["ids"]
                dev_ids[0] = ids[0]
            h = self.d["h"]
        else:  # (a prefill graph's capture reads the ids from the buffer each replay fills)
            dev_ids = self._graph_ids if self._graph_ids is not None else cp.asarray(np.asarray(ids, dtype=np.int32))
            assert dev_ids.size == T
            h = cp.empty((T, D), cp.float32)
        table = self.weights.embed
        if isinstance(table, np.ndarray):  # pinned host memory: its address is valid on the device
            table = np.uint64(table.ctypes.data)
        kernel("norm", "embed_gather")((T,), (256,), (dev_ids, table, h, _i(D)))
        return h

    def add_rmsnorm(self, h, r, w):
        eps = self.args.rms_norm_eps
        if isinstance(r, _ExpertRows):  # a MoE prefill's expert rows: their weighted sum added in this kernel
            return h, add_rmsnorm(h, None, w, eps, experts=(r.y, r.u2p, r.weights))
        if self._paged is not None:
            return h, add_rmsnorm(h, r, w, eps)
        if isinstance(r, _Deferred):  # a decode block's last projection, launched now
            if r.run_acc is not None:
                # it adds into an accumulator (its plan entry's form); the consumer adds it to h, writing the
                # other row
                hout = self.d["h2"] if h.data.ptr == self.d["h"].data.ptr else self.d["h"]
                return hout, _Normed(h, w, r.run_acc(h), hout)
            r.run(h)  # h += r in the projection's epilogue
            r = None
        if h.shape[0] == 1 and r is None:
            return h, _Normed(h, w)
        return h, add_rmsnorm(h, r, w, eps, self.d["x"] if h.shape[0] == 1 else None)

    def _x(self, x):
        """A deferred decode value made concrete: a _Normed input through the add_rmsnorm kernel without the add, a
        _Deferred projection launched with its plain fp16 output."""
        if isinstance(x, _Normed):
            out = add_rmsnorm(x.h, None, x.w, self.args.rms_norm_eps, self.d["x"], pend=x.pend)
            if x.pend is not None:  # h += the pending output was done in place: the caller holds hout
                x.hout[...] = x.h
            return out
        if isinstance(x, _Deferred):
            return x.run(None)
        return x

    def _gemv_in(self, x) -> dict:
        """gemv()'s input arguments for a block's input x: the array, or the fused RMSNorm prologue of a _Normed."""
        if isinstance(x, _Normed):
            return {"x": None, "norm": (x.h, x.w, self.args.rms_norm_eps), "pend": x.pend, "hout": x.hout}
        return {"x": x}

    def attention(self, x, layer: Layer, i: int, step: Step):
        """The attention block of layer i. A one-token decode step runs the plan's launches: the q|k|v GEMV (the
        RMSNorm in its prologue; q/k norm, RoPE and the cache write in its epilogue, or its sums accumulated for
        flash decoding to finish), flash decoding, and the o GEMV (merging the splits' partials in its prologue, or
        a plain o GEMV after attn_decode_combine where the plan's o prologue does not take that many splits), which is
        held back (_Deferred) for the next add_rmsnorm to launch with the residual add fused."""
        if self._paged is not None:
            return self._paged_attention_block(x, layer, i)
        pos0 = step.one().pos0
        if x.shape[0] == 1:
            return self._decode_attention(x, layer, i, pos0)
        a = self.args
        qd, kvd = a.q_dim, a.kv_dim
        y = gemm(x, (layer.wq, layer.wk, layer.wv))  # one matrix for cuBLAS: k and v alone are narrow
        q = qk_norm_rope_store(y[:, :qd], y[:, qd:qd + kvd], y[:, qd + kvd:], layer.q_norm, layer.k_norm, self.cos,
                               self.sin, self.k_cache[i], self.v_cache[i], pos0, a.num_attention_heads,
                               a.rms_norm_eps, None, self._graph_pos)
        KV = a.num_key_value_heads
        if self._graph_pos is not None:  # a prefill graph's capture: the position and maps read on the device
            o_in = attention_prefill(q, self.k_cache, self.v_cache, pos0, KV, layer=i, pos_dev=self._graph_pos,
                                     kvmaps=self._pbuf[:_PBUF_POS])
        else:
            o_in = attention_prefill(q, self.k_cache, self.v_cache, pos0, KV, layer=i)
        return gemm(o_in, layer.wo)

    def _decode_attention(self, x, layer: Layer, i: int, pos0: int):
        a, d, p = self.args, self.d, self.plan
        lp = p.layers[i]
        mats = [layer.wq, layer.wk, layer.wv]
        if lp.qkv_acc:
            # q|k|v sums to their accumulator (flash decoding finishes them: norm, RoPE, cache); also clears the o
            # and gate/up accumulators (last read by the previous layer's gate/up and down GEMVs, next written after
            # this kernel has finished)
            self._ss_n["attn"] = gemv(mats=mats, out_kind="plain", out=None, partial=d["partial"],
                                      acc_out=d["acc_qkv"], zero=d["acc_o_gu"], ss_out=d["ss_attn"],
                                      **self._gemv_in(x))
            fin = dict(acc=d["acc_qkv"], q_norm=layer.q_norm, k_norm=layer.k_norm, cos=self.cos, sin=self.sin,
                       eps=a.rms_norm_eps, ss=(d["ss_attn"], self._ss_n["attn"], a.hidden_size))
        else:
            rope = dict(q_norm=layer.q_norm, k_norm=layer.k_norm, cos=self.cos, sin=self.sin, qout=d["qrot"],
                        kc=self.k_cache[i], vc=self.v_cache[i], pos0=pos0, pos_dev=d["pos"], eps=a.rms_norm_eps)
            gemv(mats=mats, out_kind="qkv_rope", out=None, partial=d["partial"], rope=rope, **self._gemv_in(x))
            fin = None
        parts = attention_decode(d["qrot"], self.k_cache[i], self.v_cache[i], pos0 + 1, a.num_key_value_heads,
                                 p.split_count(pos0 + 1), d["part_o"], d["part_ml"], None,
                                 d["pos"] if self.graphs else None, finish=fin, min_chunk=p.attn_min_chunk,
                                 o_merge=p.o_merge, max_keys=p.regime(pos0 + 1),
                                 merged=d["attn"] if p.attn_cm else None)
        wo = layer.wo
        if p.o_prologue(parts.splits):  # the o GEMV merges the partials in its prologue
            def o_acc(h):
                # with a one-launch FFN half, also clears the down and q|k|v accumulators (last read by this
                # layer's q|k|v GEMV and attention, next written by that FFN and the next q|k|v)
                rows = self._router_o[i] if lp.o_router else None  # (the MoE FFN half's logits: (R, Rh))
                gemv(None, [wo], "plain", None, d["partial"], att=parts, acc_out=d["acc_o"],
                     zero=d["acc_d_qkv"] if lp.o_clears else None,
                     router=(*rows, h, d["acc_z"]) if rows is not None else None)
                return d["acc_o"]
            return _Deferred(lambda h: gemv(None, [wo], "plain", d["proj"], d["partial"], resid=h, att=parts),
                             o_acc if lp.o_acc else None)
        y = parts.merged if parts.merged is not None else attention_combine(parts, d["attn"])
        return _Deferred(lambda h: gemv(y, [wo], "plain", d["proj"], d["partial"], resid=h))

    # ------------------------------------------------------------------ decode as one CUDA graph
    def begin_step(self, step: Step) -> None:
        if self._begin_paged(step):
            return
        s = step.one()
        self._begin(s.pos0, len(s.ids))

    def _begin(self, pos0: int, n_tokens: int) -> None:
        """Single-token steps read their position from device memory (so a graph can replay them). A
        forward of 2..arena_max_t tokens takes its activations from this ops' arena until end_step; a
        longer one gives the arena's arrays back to the pool first (its own are larger)."""
        self._argmax_ready = False
        self._paged = None
        if n_tokens == 1 and self._dev_pos != pos0:
            self.d["pos"].fill(pos0)
            self._dev_pos = pos0
        if 1 < n_tokens <= cfg.SETTINGS.arena_max_t:
            mem.use_arena(self.arena)
        elif n_tokens > 1:
            self.arena.clear()

    def begin_layer(self) -> None:
        """The model's loop starts a decoder layer (the arena's slots alternate by layer)."""
        arena = mem.active_arena()
        if arena is not None:
            arena.begin_layer()

    def end_step(self) -> None:
        mem.use_arena(None)
        self._paged = None




    SAMPLED_TOKEN = SAMPLED_TOKEN

    def forget_position(self) -> None:
        """A queued step was discarded: the device's position no longer matches the host's."""
        self._dev_pos = None

    def all_reduce(self, x):
        """backend.Collectives: the ranks' partial o / down / MoE outputs summed (cuda/tp.py); x itself without
        a communicator of several ranks."""
        return tp.all_reduce(self, x) if tp.is_rank(self.comm) else x

    def mlp(self, x, layer: Layer):
        """The SwiGLU MLP block. A one-token decode step takes the plan's form: the whole FFN half in one launch
        (ffn_half), gate|up accumulated with SwiGLU in the down GEMV's prologue (gemv_acc), or the gate|up GEMV with
        SwiGLU in its epilogue then down (gemv); the block's last launch (the down GEMV, or the whole one-launch half)
        is held back (_Deferred) for the next add_rmsnorm."""
        if self._paged is not None:
            return self._paged_mlp(x, layer)
        if x.shape[0] > 1:
            return gemm(swiglu_prefill(x, layer.w1, layer.w3), layer.w2)
        a, d, lp, w2 = self.args, self.d, self._lp(layer), layer.w2
        if lp.ffn == "ffn_half":  # its down sums to acc_d (the next norm's consumer adds them to h)
            assert isinstance(x, _Normed), "the one-launch FFN half computes its input's RMSNorm itself"
            return _Deferred(_acc_only("the one-launch FFN half"),
                             lambda h: decode_ffn(self.ffn_plan, x, layer, d["acc_d"], a.rms_norm_eps))
        # (where it clears the down and q|k|v accumulators: last read by this layer's q|k|v GEMV and attention,
        # next written by the down GEMV and the next layer's q|k|v GEMV)
        zero = d["acc_d_qkv"] if lp.ffn_clears else None
        if lp.ffn == "gemv_acc":  # [gate | up] sums to their accumulator; the down GEMV applies SwiGLU
            self._ss_n["ffn"] = gemv(mats=[layer.w1, layer.w3], out_kind="swiglu", out=None, partial=d["partial"],
                                     acc_out=d["acc_gu"], zero=zero, ss_out=d["ss_ffn"], **self._gemv_in(x))
            acc, ss = d["acc_gu"], (d["ss_ffn"], self._ss_n["ffn"], a.hidden_size, a.rms_norm_eps)

            def down_acc(h):
                gemv(None, [w2], "plain", None, d["partial"], pend=acc, acc_out=d["acc_d"], ss_in=ss, zero=None)
                return d["acc_d"]
            return _Deferred(lambda h: gemv(None, [w2], "plain", d["proj"], d["partial"], pend=acc, resid=h,
                                            ss_in=ss), down_acc)
        act = gemv(mats=[layer.w1, layer.w3], out_kind="swiglu", out=d["act"], partial=d["partial"], zero=zero,
                   **self._gemv_in(x))
        return _Deferred(lambda h: gemv(act, [w2], "plain", d["proj"], d["partial"], resid=h))

    def moe(self, x, layer: Layer):
        """Qwen3-MoE block, every stage on the device (see moe.cu); x [T, D] fp16 -> [T, D] fp16."""
        if tp.is_rank(self.comm):
            return tp.moe(self, x, layer)
        a = self.args
        k = a.num_experts_per_tok
        lp = self._lp(layer)
        if self._paged is None and x.shape[0] == 1:
            return self._decode_moe(x, layer, lp)
        x = self._x(x)
        w13, w2 = layer.experts_w13, layer.experts_w2
        # (a paged step's expert tiles as its decode bucket's: an eager step takes its graph replay's kernels)
        rs, bt = moe_experts_tile(w13, w2, (x.shape[0] if self._paged is None else route_rows(x.shape[0])) * k)
        maps = moe_maps_arrays(x.shape[0] * k, w13.E)  # built with the picks (moe_route_mma's last block)
        ids, w = moe_route(x, layer.router, k, a.norm_topk_prob, maps=(bt, *maps))
        if self.routing_log is not None:
            self.routing_log.append(cp.asnumpy(ids))
        # the weighted sum in the next add_rmsnorm
        return _ExpertRows(*moe_experts(x, w13, w2, ids, w, rs=rs, finalize=False, maps=maps))

    def _decode_moe(self, x, layer: Layer, lp):
        """A one-token decode step's MoE block, in the plan's form: top-k and the experts in one launch (moe_half,
        the router's logits from this layer's o GEMV), or the norm, router and top-k in one kernel, then the experts'
        GEMVs (their sums accumulated where the plan says: moe_acc); held back (_Deferred) for the next add_rmsnorm."""
        a, d = self.args, self.d
        k = a.num_experts_per_tok
        normed = isinstance(x, _Normed)  # (the block's input, its RMSNorm not yet computed: every single-rank step)
        if normed and lp.ffn == "moe_half":
            def moe_half(h):  # the weighted sum to acc_d (the next norm's consumer adds it to h)
                decode_moe_ffn(self.moe_plan, x, layer, d["moe_ids"], d["moe_w"], d["acc_d"],
                               a.rms_norm_eps, k, a.norm_topk_prob, d["acc_z"])
                if self.routing_log is not None and not self.graphs:  # eager decode only
                    self.routing_log.append(cp.asnumpy(d["moe_ids"]))
                return d["acc_d"]
            return _Deferred(_acc_only("the one-launch MoE FFN half"), moe_half)
        if normed:  # the norm, router and top-k in one kernel, which also stores x (and finishes the o
            # projection's pending sums of accumulating mode: h + fp16(o) to x.hout)
            ids, w = moe_route_decode(x.h, x.w, a.rms_norm_eps, layer.router, k, a.norm_topk_prob, d["moe_logits"],
                                      d["x"], d["moe_ids"], d["moe_w"], d["moe_counter"], x.pend, x.hout)
            x = d["x"]
        else:
            ids, w = moe_route(x, layer.router, k, a.norm_topk_prob, d["moe_logits"], d["moe_ids"], d["moe_w"])
        if self.routing_log is not None and not self.graphs:  # eager decode only: a capture cannot copy out
            self.routing_log.append(cp.asnumpy(ids))
        # the expert gate/up GEMV clears the down and q|k|v accumulators where the plan says (last read by this
        # layer's q|k|v GEMV and attention; next written by the expert down GEMV and the next q|k|v GEMV)
        zero = d["acc_d_qkv"] if lp.ffn_clears else None

        def run(h):
            return moe_decode(x, layer.experts_w13, layer.experts_w2, ids, w, d["partial"], d["moe_act"],
                              d["proj"], resid=h, zero=zero)

        def run_acc(h):  # the sums to acc_d: the next norm's consumer adds them to h
            return moe_decode(x, layer.experts_w13, layer.experts_w2, ids, w, d["partial"], None, None,
                              zero=zero, acc=(d["acc_gu"][:2 * k * a.moe_intermediate_size], d["acc_d"]))
        return _Deferred(run, run_acc if lp.ffn == "moe_acc" else None)

    def logits(self, x, all_positions: bool = False):
        if tp.is_rank(self.comm):  # vocabulary-parallel: this rank's rows, then every rank's gathered
            return tp.gather_logits(self, self._local_logits(x, all_positions))
        V = self.args.vocab_size
        x = self._x(x)
        if self._paged is not None:
            return self._paged_logits(x, all_positions)
        if not all_positions:  # (while a decode graph is captured, greedy's argmax rides along: decode_step)
            n = self._capture_argmax
            return lm_head(cp.ascontiguousarray(x[-1]), self.weights.lm_head, self.d["logits"],
                           self.d["argmax"] if n else None, n or 0)
        out = cp.empty((x.shape[0], V), cp.float32)
        x = cp.ascontiguousarray(x)
        for r in range(0, x.shape[0], ROWS_MAX):  # (each launch reads the head once for up to ROWS_MAX rows)
            rows_lm_head(x[r:r + ROWS_MAX], self.weights.lm_head, out[r:r + ROWS_MAX])
        return out

    def _local_logits(self, x, all_positions: bool):
        """A rank's logits over its own vocabulary rows: [V_rank] of the last row, or [T, V_rank]."""
        x, W = cp.ascontiguousarray(self._x(x)), self.weights.lm_head
        if not all_positions:
            return lm_head(cp.ascontiguousarray(x[-1]), W, cp.empty((W.shape[0],), cp.float32))
        out = cp.empty((x.shape[0], W.shape[0]), cp.float32)
        for r in range(0, x.shape[0], ROWS_MAX):
            rows_lm_head(x[r:r + ROWS_MAX], W, out[r:r + ROWS_MAX])
        return out

    @staticmethod
    def to_host(x) -> np.ndarray:
        return cp.asnumpy(x)
