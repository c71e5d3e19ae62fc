"""Steps of several sequences over the paged KV pool (paged.cu): each token row's sequence and position, and the
sequences' block tables, as device arrays (PagedRows); the per-token q/k norm + RoPE + block write, and attention
of every row over its own sequence's blocks. A decode step (one new token per sequence) replays a CUDA graph of its
batch bucket (decode_bucket), whose inputs the host packs into one buffer (pack_decode_inputs)."""
from __future__ import annotations

import math

import numpy as np

from .. import settings as cfg
from ..memory import _BUF_GEN, _f, _i
from ..runtime.build import kernel
from ..runtime.device import current_device_id

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None

PAGED_MAX_GROUP = 8  # paged.cu paged_attention: query heads per KV head (served by one block, at most 8)
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the batch sizes a paged decode step's graphs are captured at (max_batch)


def paged_rows(seqs, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tables [B, longest] int32 padded with 0, tok_seq [T], tok_pos [T]) of a step's sequences (backend.Seq:
    ids, pos0, block_table), its rows in order; every row's position must lie in its sequence's blocks."""
    width = max(1, max(len(s.block_table) for s in seqs))
    tables = np.zeros((len(seqs), width), np.int32)
    tok_seq, tok_pos = [], []
    for b, s in enumerate(seqs):
        end = s.pos0 + len(s.ids)
        if end > len(s.block_table) * block_size:
            raise ValueError(f"sequence {b}: positions up to {end} do not fit its {len(s.block_table)} blocks of "
                             f"{block_size}")
        tables[b, :len(s.block_table)] = s.block_table
        tok_seq += [b] * len(s.ids)
        tok_pos += range(s.pos0, end)
    return tables, np.asarray(tok_seq, np.int32), np.asarray(tok_pos, np.int32)


class PagedRows:
    """A paged step's lookups on the device: tables [B, width], tok_seq and tok_pos [T]; last: each sequence's
    last row (the rows whose logits the step returns)."""

    def __init__(self, seqs, block_size: int):
        tables, tok_seq, tok_pos = paged_rows(seqs, block_size)
        self.block_size, self.n_tokens = block_size, tok_seq.size
        self.tables, self.tok_seq, self.tok_pos = cp.asarray(tables), cp.asarray(tok_seq), cp.asarray(tok_pos)
        self.last = np.cumsum([len(s.ids) for s in seqs]) - 1
        self.ids = None  # (the token ids come from the step; a decode graph's rows read them on the device)


def decode_bucket(B: int) -> int:
    """The batch size whose graph a paged decode step of B sequences replays: the least DECODE_BUCKETS entry >= B
    (one graph serves every B up to it; its extra rows are padding)."""
    if not 1 <= B <= DECODE_BUCKETS[-1]:
        raise ValueError(f"a decode step of {B} sequences: graphs serve 1..{DECODE_BUCKETS[-1]}")
    return next(b for b in DECODE_BUCKETS if b >= B)


def decode_inputs_size(width: int) -> int:
    """int32 entries of a decode graph's input buffer for block tables `width` wide: ids [R], positions [R] and
    tables [R, width], R = the largest bucket (every bucket's graph reads the leading rows of each)."""
    R = DECODE_BUCKETS[-1]
    return R * (2 + width)


def decode_inputs_views(buf, width: int, bucket: int) -> tuple:
    """(ids [bucket], positions [bucket], tables [bucket, width]) views of a decode input buffer (NumPy or CuPy)."""
    R = DECODE_BUCKETS[-1]
    return buf[:bucket], buf[R:R + bucket], buf[2 * R:].reshape(R, width)[:bucket]


def pack_decode_inputs(seqs, bucket: int, block_size: int, pad_block: int, out: np.ndarray) -> int:
    """Write a decode step's inputs into out (int32 [decode_inputs_size(width)]): each sequence's one token id, its
    position (pos0: it attends to positions 0..pos0) and its block table, the table's unused entries pad_block; rows
    len(seqs)..bucket - 1 are padding: id 0 at position 0 in pad_block, a block outside the pool's sequences, so
    they write and read no sequence's cache. Returns how many leading int32 of out the step fills (what one copy
    to the device takes)."""
    R = DECODE_BUCKETS[-1]
    width = out.size // R - 2
    B = len(seqs)
    if not 1 <= B <= bucket <= R:
        raise ValueError(f"{B} sequences in a bucket of {bucket}")
    ids, pos, tables = decode_inputs_views(out, width, bucket)
    for b, s in enumerate(seqs):
        n = len(s.block_table)
        if len(s.ids) != 1 or s.ids[0] < 0:
            raise ValueError(f"sequence {b}: a decode step takes one token id from the host, not {s.ids}")
        if s.pos0 + 1 > n * block_size or n > width:
            raise ValueError(f"sequence {b}: position {s.pos0} in {n} blocks of {block_size} (tables hold "
                             f"{width})")
        ids[b], pos[b] = s.ids[0], s.pos0
        tables[b, :n] = s.block_table
        tables[b, n:] = pad_block
    ids[B:], pos[B:], tables[B:] = 0, 0, pad_block
    return 2 * R + bucket * width


def paged_qk_norm_rope_store(q, k, v, q_norm, k_norm, cos, sin, kb, vb, rows: PagedRows, n_heads: int,
                             eps: float):
    """Per-head RMSNorm of q and k, RoPE at each row's own position, k and v written into its sequence's block of
    kb/vb [n_blocks, block_size, KV, hd] (one layer's); q [T, H*hd], k and v [T, KV*hd] (row strides may be wider:
    views of one q|k|v product) -> q [T, H, hd] fp16."""
    T, KV, hd = q.shape[0], kb.shape[2], kb.shape[3]
    assert T == rows.n_tokens and kb.flags.c_contiguous and vb.flags.c_contiguous
    assert all(a.data.ptr % 16 == 0 and a.strides[0] % 16 == 0 and a.strides[1] == 2 for a in (q, k, v))
    out = cp.empty((T, n_heads, hd), cp.float16)
    heads = 4 * (512 // hd)  # per block: 4 warps of 32 / (hd / 16) heads
    kernel("paged", f"paged_qk_norm_rope_store<{hd}>")((T, math.ceil((n_heads + 2 * KV) / heads)), (128,), (
        q, _i(q.strides[0] // 2), k, _i(k.strides[0] // 2), v, _i(v.strides[0] // 2), q_norm, k_norm, cos, sin,
        out, kb, vb, rows.tables, _i(rows.tables.shape[1]), rows.tok_seq, rows.tok_pos, _i(n_heads), _i(KV),
        _i(rows.block_size), _f(eps)))
    return out


def paged_attention(q, kb, vb, rows: PagedRows):
    """Causal GQA of every row over its own sequence's positions 0..its own, read through the block tables:
    q [T, H, hd] fp16, kb/vb [n_blocks, block_size, KV, hd] (one layer's) -> [T, H*hd] fp16. Each row's keys are
    split over paged_splits(T) blocks, whose partials a second launch merges (in paged_scratch: graphs capture it, so
    its size is settled before a capture)."""
    T, H, hd = q.shape
    KV = kb.shape[2]
    G = H // KV
    assert T == rows.n_tokens and H % KV == 0 and G <= PAGED_MAX_GROUP and q.flags.c_contiguous
    out = cp.empty((T, H * hd), cp.float16)
    S = paged_splits(T)
    acc, ml = paged_scratch(T * H, hd) if S > 1 else (out, out)  # (unused at S = 1)
    kernel("paged", f"paged_attention<{hd}>")((T, KV, S), (128,), (
        q, kb, vb, rows.tables, _i(rows.tables.shape[1]), rows.tok_seq, rows.tok_pos, out, acc, ml, _i(H), _i(KV),
        _i(rows.block_size), _f(1.0 / math.sqrt(hd)), _i(S)))
    if S > 1:
        kernel("paged", f"paged_attention_merge<{hd}>")((T, H), (hd,), (acc, ml, out, _i(H), _i(S)))
    return out


def route_rows(T: int) -> int:
    """The rows a paged step of T rows chooses its kernels by: its decode bucket's, where T has one (an eager step
    then takes the kernels its bucket's graph replay takes, and its rows' sums are bitwise the replay's), else T."""
    return decode_bucket(T) if T <= DECODE_BUCKETS[-1] else T


def paged_splits(T: int) -> int:
    """Blocks sharing one row's keys in a paged step of T rows (flash decoding, where a step has few rows): the
    tuning's paged_splits entry for route_rows(T), so an eager step splits as its graph replay does (and each row's
    sums are the same bits); 1 past the table (a longer prefill chunk has blocks enough)."""
    return next((s for rows, s in cfg.SETTINGS.paged_splits if route_rows(T) <= rows), 1)


def paged_splits_max() -> int:
    """The most splits the tuning's table gives any step (paged_scratch's size)."""
    return max([1] + [s for _, s in cfg.SETTINGS.paged_splits])


_SCRATCH: dict[int, list] = {}


def paged_scratch(row_heads: int, hd: int) -> tuple:
    """(acc [>= row_heads * S * hd], ml [>= row_heads * S * 2]) fp32 partials of split paged
    attention, per device; grown as needed, which drops the graphs holding the old ones (_BUF_GEN). Every use is
    ordered on one stream and merged before the next layer's, so reuse is safe."""
    S = paged_splits_max()
    dev, need = current_device_id(), row_heads * S * (hd + 2)
    rec = _SCRATCH.get(dev)
    if rec is None or rec.size < need:
        if rec is not None:
            _BUF_GEN[0] += 1
        rec = _SCRATCH[dev] = cp.empty((need,), cp.float32)
    n_acc = row_heads * S * hd
    return rec[:n_acc], rec[n_acc:need]


def rows_argmax(logits, n_valid: int, out):
    """out[r] = the argmax of logits[r, :n_valid] (the lowest id of equal maxima, as NumPy's): logits [R, V] fp32
    contiguous, out int32 [>= R]; greedy draws of a paged step without its rows leaving the device."""
    R, V = logits.shape
    assert logits.flags.c_contiguous and logits.dtype == cp.float32 and 0 < n_valid <= V and out.size >= R
    kernel("paged", "rows_argmax")((R,), (1024,), (logits, _i(V), _i(n_valid), out))
    return out
