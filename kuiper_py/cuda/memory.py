"""Device memory the ops share: the qweight tiling the kernels read, the arenas a short prefill's activations come
from (use_arena: the one a forward being enqueued takes), prefill graph buckets, zeroed counters and launch-argument
scalars."""
from __future__ import annotations

import math

import numpy as np

from ..errors import KuiperError
from .runtime.device import current_device_id

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None


def tile_qweight(q, segments: int = 1):
    """AWQ qweight [..., K, W] (int32, NumPy or CuPy) -> the tiled layout of common.cuh, same shape and
    words: 32-word column tiles one after another, each [K/4][tile width][4]. segments > 1 splits
    the columns into that many matrices first ([gate | up] expert stacks), each tiled on its own."""
    xp = cp.get_array_module(q) if cp is not None else np
    *lead, K, W = q.shape
    if segments > 1:
        q = xp.moveaxis(q.reshape(*lead, K, segments, W // segments), -2, -3)  # [..., seg, K, W/seg]
        return tile_qweight(q).reshape(*lead, K, W)
    assert K % 4 == 0
    Wf = W // 32 * 32
    n = len(lead)
    full = q[..., :Wf].reshape(*lead, K // 4, 4, Wf // 32, 32)
    parts = [xp.ascontiguousarray(full.transpose(*range(n), n + 2, n, n + 3, n + 1)).reshape(*lead, -1)]
    if W > Wf:  # a narrower last tile
        tail = q[..., Wf:].reshape(*lead, K // 4, 4, W - Wf)
        parts.append(xp.ascontiguousarray(tail.transpose(*range(n), n, n + 2, n + 1)).reshape(*lead, -1))
    return xp.concatenate(parts, axis=-1).reshape(*lead, K, W)


def device_linear(lin, segments: int = 1):
    """An AwqLinear or AwqStack copied to the GPU with its qweight tiled (what the kernels read)."""
    return type(lin)(tile_qweight(cp.asarray(lin.qweight), segments), cp.asarray(lin.qzeros),
                     cp.asarray(lin.scales), lin.group_size)


# A multi-token forward of at most this many tokens takes its activations from the CupyOps' _Arena instead of
# cupy.empty: short prefills are host-bound, and the ~18 allocations of a MoE layer were
# ~3.5 ms of a 512-token Qwen3-30B-A3B prefill's ~18 ms of enqueue on the H200. 0 turns it off. Longer
# prompts are GPU-bound, and their activations are large: they keep the pool, which reuses one layer's blocks
_ARENA = None  # the _Arena of the forward being enqueued, or None: set only through use_arena


def use_arena(arena):
    """Make `arena` (an _Arena, a capture's _BumpArena, or None for the pool) the one the prefill ops' outputs come
    from until the next call; returns the previous one. One per process, like CuPy's current stream: CupyOps sets it
    for a short forward's enqueue (begin_step .. end_step) and a prefill graph's capture."""
    global _ARENA
    prev, _ARENA = _ARENA, arena
    return prev


def active_arena():
    """The arena use_arena set last (None: outputs come from CuPy's pool)."""
    return _ARENA


class _Arena:
    """Activation arrays of a short multi-token forward, kept from one forward to the next. A layer's n-th
    allocation gets slot (layer parity, n): the same array as two layers before, whose values that layer's
    own kernels and the next layer's first norm (the residual's input) have consumed in stream order
    before anything of this layer is enqueued. So nothing a layer produces is overwritten before it is
    read, provided that no value lives past the next layer, which holds for the model's loop (the
    residual stream h is not taken from here). A request of another shape or dtype replaces its slot."""

    def __init__(self):
        # (shape, dtype, array): the shape and dtype kept beside the array so a hit is a tuple compare and an
        # identity test, not reads of CuPy attributes on every allocation of the prefill path
        self.slots: dict[tuple[int, int], tuple] = {}
        self.half = self.seq = 0

    def begin_layer(self) -> None:
        self.half ^= 1
        self.seq = 0

    def take(self, shape: tuple, dtype):
        key = (self.half, self.seq)
        self.seq += 1
        hit = self.slots.get(key)
        if hit is not None and hit[0] == shape and hit[1] is dtype:
            return hit[2]
        a = cp.empty(shape, dtype)
        self.slots[key] = (shape, dtype, a)
        return a

    def clear(self) -> None:
        self.slots.clear()


# Prefill graphs (CupyOps.prefill_graph): a prompt of 2..prefill_graph_max_t tokens, at the cache's start or after
# earlier turns, runs, from the second time its length bucket is met, as one CUDA graph captured at the bucket's
# length (the prompt padded at its end), so the host enqueues one graph launch instead of ~7 kernel launches per
# layer. 0 turns them off.
# what a replay reads, in one device buffer the host fills before each (one copy): K's and V's cache maps of the
# prompt's keys at bytes 0 and 128 (64-byte aligned, for flash_attn_wgmma), the position at _PBUF_POS, the padded
# ids from _PBUF_IDS
_PBUF_POS, _PBUF_IDS = 256, 260


# bumped whenever a module-level device buffer is replaced by a larger one (dequant_scratch, gemm_split_buffers):
# a graph captured before holds the old address, so it is dropped
_BUF_GEN = [0]


def prefill_bucket(T: int) -> int:
    """The length a T-token prefill graph runs at: T rounded up to a power of two up to 16 tokens (a speculative verify
    step of K + 1 tokens: its projections' cost grows with the rows), to a multiple of 16 up to 128, of 32 up to 256,
    of 64 beyond (19 graphs up to 512 tokens; at most 16, 32 or 64 rows of padding, 12% at most past 128 tokens)."""
    if T <= 16:
        return 1 << max(1, (T - 1).bit_length())
    step = 16 if T <= 128 else 32 if T <= 256 else 64
    return -(-T // step) * step


class _NotCapturable(Exception):
    """A prefill met a call that a graph capture cannot hold (cuBLAS through CuPy): its bucket runs eagerly."""


_CAPTURING = [False]  # a prefill graph is being captured


class _ArenaFull(Exception):
    """A _BumpArena region is too small for this capture: grow it and capture again."""


class _BumpArena:
    """The activations of every prefill graph: two regions (layer parity, as _Arena's slots alternate), each
    handed out from its start again at each layer of its parity. Graphs replay one at a time on one stream and
    no value lives past the next layer (_Arena's rule), so all buckets share the same bytes. A request past a
    region's end raises _ArenaFull with the bytes that layer needs, so that the capture is retried after grow."""
    ALIGN = 512  # as CuPy's pool: every TMA and 16-byte access stays aligned

    def __init__(self):
        self.regions = [None, None]
        self.off = [0, 0]
        self.half = 0

    def size(self, h: int) -> int:
        return 0 if self.regions[h] is None else self.regions[h].nbytes

    def reset(self) -> None:
        self.off = [0, 0]
        self.half = 0

    def begin_layer(self) -> None:
        self.half ^= 1
        self.off[self.half] = 0

    def take(self, shape: tuple, dtype):
        h, o = self.half, self.off[self.half]
        n = -(-math.prod(shape) * np.dtype(dtype).itemsize // self.ALIGN) * self.ALIGN
        if o + n > self.size(h):
            raise _ArenaFull(h, o + n)
        self.off[h] = o + n
        return cp.ndarray(shape, dtype, memptr=self.regions[h].data + o)

    def grow(self, h: int, nbytes: int) -> None:
        """Region h a quarter above nbytes (the layer's later requests fit in most cases, so a capture meets few
        retries), rounded up to 2 MiB; the old region's bytes go back to the pool."""
        nbytes = -(-nbytes * 5 // 4 // (2 << 20)) * (2 << 20)
        self.regions[h] = None
        self.regions[h] = cp.empty((nbytes,), cp.uint8)


def _empty(shape: tuple, dtype):
    """cp.empty, or the active forward's arena slot (_ARENA): the prefill path's output arrays."""
    return cp.empty(shape, dtype) if _ARENA is None else _ARENA.take(shape, dtype)


_I32: dict[int, np.int32] = {}


def _i(v):
    """A kernel's int32 argument, refused (not wrapped) when it does not fit. The same sizes recur on every
    layer of every prefill: each value's np.int32 is made once (a dict hit costs a tenth of the check and the
    conversion, ~1800 times per 48-layer prefill)."""
    r = _I32.get(v)
    if r is None:
        if not -2**31 <= int(v) < 2**31:
            raise KuiperError(f"a kernel size argument ({v}) exceeds the int32 range; use a smaller --max-context")
        r = np.int32(v)
        if len(_I32) < 65536:
            _I32[v] = r
    return r


def _f(v):
    return np.float32(v)


_NULL = np.uint64(0)  # a null pointer argument


_COUNTERS: dict[int, object] = {}


def _device_zeros(cache: dict, n: int):
    """cache's int32 [n] for the current device, zeroed when first made: the arrival counters kernels leave at zero."""
    dev = current_device_id()
    a = cache.get(dev)
    if a is None:
        # (inside a prefill graph's capture the memset would be captured, not run: _capture_prefill makes them first)
        assert not _CAPTURING[0], "a zeroed counter first made inside a graph capture"
        a = cache[dev] = cp.zeros((n,), cp.int32)
    return a
