"""Token draws on the device: the sampling kernels launched on the decode stream, the id read back through pinned
memory, greedy's draw served by the decode graph's argmax."""
from __future__ import annotations

import numpy as np

from ..errors import KuiperError
from ..sampling import SamplingParams, sample
from .memory import _f, _i
from .runtime.build import kernel
from .sampling import SMP_CAND, SMP_CHUNK, SMP_MAX_BLOCKS, SMP_THREADS, draw_plan

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


def _penalty_window(history: list[int], p: SamplingParams) -> list[int]:
    """The ids the repetition penalty looks back over: the last repeat_last_n, at most SMP_THREADS (one thread an
    id in the sampling kernels); none without a penalty."""
    return history[-p.repeat_last_n:][-SMP_THREADS:] if (p.repeat_penalty != 1.0 and p.repeat_last_n) else []


class DeviceDraws:
    """CupyOps' sampling methods (a mixin: the buffers it uses are CupyOps')."""

    def _init_draw(self) -> None:
        """sample_launch's pinned host buffers (the draw's id back, the penalty's history out) and the
        event that says the id has landed: the host reads it while the next step already runs."""
        import cupyx
        # [0] the draw kernels' id, [1 + position % 2] the decode graph's greedy argmax (advance_position)
        self._tok_host = cupyx.empty_pinned((3,), np.int32)
        self._read_slot = 0
        self._hist_host = cupyx.empty_pinned((self.d["hist"].size,), np.int32)
        self._tok_event = cp.cuda.Event(disable_timing=True)
        self._draw_queued = False
        # greedy decode's argmax from the graph (decode_step): the ids it covers, whether it is current
        self._last_n_valid = self._capture_argmax = self._graph_argmax_n = 0
        self._argmax_ready = False
        self.fused_draws = 0  # draws served by the graph's argmax (tests)
        # sample_token_mb's per-block results (candidates, maxima, counts) and its arrival counter
        self.d.update(smp_v=cp.empty((SMP_CAND,), cp.float32), smp_i=cp.empty((SMP_CAND,), cp.int32),
                      smp_mx=cp.empty((SMP_MAX_BLOCKS,), cp.float32), smp_n=cp.empty((SMP_MAX_BLOCKS,), cp.int32),
                      smp_counter=cp.zeros((1,), cp.int32), argmax=cp.zeros((1,), cp.uint64))
        # sample_rows' inputs, one pinned buffer copied to one device buffer per step: per row (temperature, top_p,
        # min_p, penalty) float32, (top_k, history start, history length, row) int32, seed and step uint64; then the
        # rows' histories; the ids come back through mapped pinned memory
        R, H = self.max_batch, SMP_THREADS
        self._rows_in = cupyx.empty_pinned((R * 48 + R * H * 4,), np.uint8)
        self.d.update(rows_in=cp.empty(self._rows_in.shape, cp.uint8), rows_tok=cp.empty((R,), cp.int32))
        self._rows_tok_host = cupyx.empty_pinned((R,), np.int32)

    def sample(self, logits, p: SamplingParams, rng: np.random.Generator, history: list[int], n_valid: int) -> int:
        """Penalty, temperature, top-k/top-p/min-p and the draw on the GPU; one int32 comes back."""
        self.sample_launch(logits, p, rng, history, n_valid)
        return self.sample_result()

    def sample_launch(self, logits, p: SamplingParams, rng: np.random.Generator, history: list[int],
                      n_valid: int) -> None:
        """Queue sample()'s draw without waiting for it: its id lands in d["token"] (where the next decode
        step's graph reads it, so that step may be queued at once: Qwen3.decode_sampled) and in pinned
        host memory for sample_result(). Nothing here waits for the GPU."""
        assert not self._draw_queued, "sample_result() must follow each sample_launch()"
        if logits.data.ptr % 16 or not logits.flags.c_contiguous:  # the kernel reads 16-byte vectors
            logits = cp.ascontiguousarray(logits).copy()
        hist = _penalty_window(history, p)
        # on the decode graphs' stream, so a step queued after the draw follows it without a cross-stream wait
        stream = self._stream
        if hist:  # from pinned memory: a pageable copy could wait for the step queued before it
            self._hist_host[:len(hist)] = hist
            cp.cuda.runtime.memcpyAsync(self.d["hist"].data.ptr, self._hist_host.ctypes.data, 4 * len(hist),
                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        d = self.d
        self._last_n_valid = n_valid
        if (p.temperature == 0 and not hist and self._argmax_ready and logits is d["logits"]
                and n_valid == self._graph_argmax_n):
            # the step's graph already drew it (greedy's argmax in lm_head, the id in advance_position)
            self._argmax_ready = False
            self.fused_draws += 1
            self._read_slot = self._argmax_slot
            self._tok_event.record(stream)
            self._draw_queued = True
            return
        self._argmax_ready = False
        self._read_slot = 0
        plan = draw_plan(n_valid, p)
        with stream:
            if getattr(self, "_rng", None) is not rng:  # a new generation: new seed, counter from zero
                self._rng, self._seed = rng, np.uint64(rng.integers(0, 2**63))
                d["step"].fill(0)
            # the id also goes straight to the pinned host int (mapped: its address is valid on the
            # device), so no copy follows the kernel
            args = (logits, _i(n_valid), d["hist"], _i(len(hist)), _f(p.repeat_penalty), _f(p.temperature),
                    _i(p.top_k), _f(p.top_p), _f(p.min_p), self._seed, d["step"], d["token"],
                    np.uint64(self._tok_host.ctypes.data))
            if plan is None:
                kernel("smp", "sample_token")((1,), (SMP_THREADS,), args)
            else:
                G, cap = plan
                kernel("smp", "sample_token_mb")((G,), (SMP_THREADS,), args + (
                    _i(SMP_CHUNK), d["smp_v"], d["smp_i"], d["smp_mx"], d["smp_n"], d["smp_counter"], _i(cap)))
        self._tok_event.record(stream)
        self._draw_queued = True

    def sample_rows(self, logits, draws, n_valid: int) -> list[int | None]:
        """Row i's draw where draws[i] (a sampling.RowDraw) is given, with its own settings, seed and counter, in one
        launch over the rows (sample_rows): the draw sample_launch makes for that sequence alone. A draw the device
        does not serve (the OpenAI penalties) is made on the host from its row, copied first: the kernel overwrites
        the logits it penalises and scales. logits [B, V] fp32 on this device, rows 16-byte aligned."""
        out: list[int | None] = [None] * len(draws)
        dev = []
        for i, d in enumerate(draws):
            if d is not None and d.params.needs_host:
                out[i] = sample(self.to_host(logits[i]), d.params, d.rng, d.history, n_valid, generated=d.generated)
            elif d is not None:
                dev.append(i)
        if not dev:
            return out
        assert len(dev) <= self.max_batch and logits.dtype == cp.float32 and logits.strides[1] == 4
        assert logits.data.ptr % 16 == 0 and logits.strides[0] % 16 == 0
        n = len(dev)
        buf = self._rows_in
        fp = buf[:16 * n].view(np.float32).reshape(n, 4)
        ip = buf[16 * n:32 * n].view(np.int32).reshape(n, 4)
        seeds = buf[32 * n:40 * n].view(np.uint64)
        steps = buf[40 * n:48 * n].view(np.uint64)
        hist = buf[48 * n:].view(np.int32)
        used = 0
        for j, i in enumerate(dev):
            d = draws[i]
            p = d.params
            h = _penalty_window(d.history, p)
            hist[used:used + len(h)] = h
            fp[j] = (p.temperature, p.top_p, p.min_p, p.repeat_penalty)
            ip[j] = (p.top_k, used, len(h), i)
            seeds[j], steps[j] = d.seed, d.step
            used += len(h)
        stream, dbuf = self._stream, self.d["rows_in"]
        nbytes = 48 * n + 4 * used
        cp.cuda.runtime.memcpyAsync(dbuf.data.ptr, buf.ctypes.data, nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                    stream.ptr)
        with stream:
            kernel("smp", "sample_rows")((n,), (SMP_THREADS,), (
                logits, _i(logits.strides[0] // 4), _i(n_valid), dbuf[:16 * n], dbuf[16 * n:32 * n],
                dbuf[32 * n:40 * n], dbuf[40 * n:48 * n], dbuf[48 * n:], self.d["rows_tok"],
                np.uint64(self._rows_tok_host.ctypes.data)))
        stream.synchronize()  # (the pinned inputs are free again, the ids have landed)
        for j, i in enumerate(dev):
            tok = int(self._rows_tok_host[j])
            if tok < 0:
                raise KuiperError("the model produced no finite logit (NaN/Inf activations); the weights may be "
                                  "damaged")
            out[i] = tok
        return out

    def cancel_draw(self) -> None:
        """Wait out a queued draw whose id nobody will read (an interrupted generation)."""
        if self._draw_queued:
            self._tok_event.synchronize()
            self._draw_queued = False

    def sample_result(self) -> int:
        """The id of the draw sample_launch queued (waits for it; the pinned history buffer is free again)."""
        assert self._draw_queued, "sample_result() without sample_launch()"
        self._tok_event.synchronize()
        self._draw_queued = False
        tok = int(self._tok_host[self._read_slot])
        if tok < 0:
            raise KuiperError("the model produced no finite logit (NaN/Inf activations); the weights may be damaged")
        self._sampled = tok
        return tok
