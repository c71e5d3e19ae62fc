"""The CUDA backend's tuning: one frozen Settings per process, built once from its defaults (the forms that measured
fastest, docs/PERFORMANCE.md) and the per-GPU table below; tests and benchmarks construct their own
(`dataclasses.replace(Settings(), attn_min_chunk=64)`) and pass it to CupyOps. No environment variable sets these:
docs/RUNTIME.md lists the few user-facing ones."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

# per-GPU decode tuning of measured shapes, keyed on a substring of the device's name (the way vLLM keys
# its kernel tables); shapes not listed keep the defaults. The rules that read it: kuiper_py/cuda/ops/gemv.py
# (gemv_blocks_per_sm, attn_min_chunk, attn_short, o_merge, attn_cm), gemm.py gemm_path (rows_wgmma_min) and
# decode_halves.py decode_ffn_plan (ffn_off).
# "gemv_blocks_per_sm": {(K, N): target} for a decode GEMV over K rows and N columns (all its fused matrices').
# H200: Qwen3-8B with separate gate/up and down GEMVs at 3 per SM, -2.6% per step at 512, -2.0% at 8k; Qwen3-4B
# with q|k|v and gate/up at 3, -3.4%; measured slower there: 14B's FFN at 3 (+0.5 to 2%), 32B's (+3%); 0.6B,
# 1.7B and 30B-A3B unchanged. H100: Qwen3-4B at 3, -1.5 to -1.9%; 8B's FFN GEMVs at 3 (one-launch FFN off), +1.6%.
# "ffn_off": {(hidden, intermediate)} where the one-launch FFN's cluster launch is off under decode_ffn="auto";
# its form without a cluster launch is taken first where it applies (H200 8B -3.3% per step at 512 against the
# separate GEMVs), so the H200 entry does not decide there.
# "attn_min_chunk": {(hidden, heads, kv heads, head dim): keys} flash decoding's fewest keys per split.
# H100: Qwen3-8B at 64, -1.8% per step at 512 (8 splits for the o GEMV's merge to read, not 16), 14B -0.7%;
# 30B-A3B at 64 since its short splits' keys are staged before the wait: -1.2% at 512, -3.4% at 1100; 4B
# neutral. H200: 30B-A3B at 64 measured +0.5% at 512 and -3.8% at 1100, so it keeps 32; 8B at 64 -0.7% at 512
# and at 2000, neutral at 8000 (o merges 8 splits instead of 16).
# "attn_short": {(hidden, heads, kv heads, head dim): keys or (keys, ...)} flash decoding's short-context regimes:
# up to each bound a decode graph of its own launches only the splits the bound's keys can use. With a
# 33000-position cache at 512 keys: H100 8B -2.3%, H200 8B -0.6% (-0.5% at 1000), H200 30B-A3B -2.4%
# (+0.4 to +0.8% at 1000 keys). 8B's second bound at 512 (8 splits, clusters of 8 with attn_cm) -1.5% on the
# H200 and -1.1 to -1.4% on the H100 at 412-511 keys; without attn_cm +1.1% (H200), and 30B-A3B (H200, no
# attn_cm) +1.0%, so they keep one bound (30B-A3B with attn_cm: the same as one bound at 412 keys).
# "o_merge": {(hidden, heads, kv heads, head dim)} the o GEMV's one-batch merge past 16 splits (gemv_merge_span).
# H100 step timer: 8B -4.0 to -4.6% at 2000 keys, -0.7% at 8k, -1.3% at 32k (o at 3 per SM), 30B-A3B -1.9 to
# -2.1% at 2000 (at 512 keys, 16 splits, +0.2% and +1.3%: the short graph keeps decode_merge); 14B and 4B mixed
# (4B +1.8% at 512, -1.9% at 2000; 14B within 0.4%), so they keep decode_merge. H200 with a 33000-position
# cache: 8B -1.7% at 2000 keys, -1.5% at 8k, -1.2% at 32k, neutral at 512; 30B-A3B off (-0.3% at 2000, +0.3% at 8k).
# "attn_cm": {(hidden, heads, kv heads, head dim)} flash decoding's short-context graph merges its splits in its
# own clusters (attention.cu CM), so the o GEMV stages a plain row instead of merging in its prologue.
# Qwen3-8B, step timer with a 2200-position cache: H200 -0.85% at 512 keys, -2.85% at 900; H100 +0.1% at 512,
# -2.8% at 900. 30B-A3B (its short graph then has 16 splits instead of 32): H200 -1.0% at 412 keys, +0.15%
# at 530, -1.2% at 700, -5.0% at 900, so on; H100 +1.9% at 412, +2.3% at 530, -0.1% at 700, -0.8% at 900, so off.
# "rows_wgmma_min": {(K, N): rows} from which 2-16 rows of a K x N projection take the fused wgmma GEMM (one 64-row
# tile) instead of gemv_rows. H100, µs per call with weights from DRAM, gemv_rows at 2 / 8 / 16 rows
# against wgmma at 16: Qwen3-8B q|k|v 16.5 / 18.0 / 21.0 against 22.4 (stays on gemv_rows), o 13.6 / 15.0 / 17.9
# against 14.5, down 26.4 / 30.8 / 38.6 against 30.7, gate|up 43.3 / 46.1 / 52.6 against 56.8 (stays on gemv_rows).
_QWEN3_4B_AT_3 = {(2560, 6144): 3.0, (2560, 19456): 3.0}  # Qwen3-4B's q|k|v and gate|up
DEVICE_TABLES = {
    "H200": {"ffn_off": {(4096, 12288)},  # Qwen3-8B
             "gemv_blocks_per_sm": {(4096, 24576): 3.0, (12288, 4096): 3.0, **_QWEN3_4B_AT_3},  # 8B gate|up, down
             "attn_min_chunk": {(4096, 32, 8, 128): 64},  # Qwen3-8B
             # Qwen3-8B (a graph of 8 splits up to 512 keys, with attn_cm), 30B-A3B
             "attn_short": {(4096, 32, 8, 128): (512, 1024), (2048, 32, 4, 128): 1024},
             "o_merge": {(4096, 32, 8, 128)},  # Qwen3-8B
             "attn_cm": {(4096, 32, 8, 128), (2048, 32, 4, 128)}},  # Qwen3-8B, 30B-A3B
    "H100": {"gemv_blocks_per_sm": dict(_QWEN3_4B_AT_3),
             "rows_wgmma_min": {(4096, 4096): 8, (12288, 4096): 8},  # Qwen3-8B o, down
             "attn_min_chunk": {(4096, 32, 8, 128): 64, (5120, 40, 8, 128): 64,  # Qwen3-8B, 14B
                                (2048, 32, 4, 128): 64},  # Qwen3-30B-A3B
             "attn_short": {(4096, 32, 8, 128): (512, 1024), (2048, 32, 4, 128): 1024},  # Qwen3-8B, 30B-A3B
             "o_merge": {(4096, 32, 8, 128), (2048, 32, 4, 128)},  # Qwen3-8B, 30B-A3B
             "attn_cm": {(4096, 32, 8, 128)}},  # Qwen3-8B
}


@dataclass(frozen=True)
class Settings:
    """Launch shapes and path choices the CUDA backend reads at run time. None / "auto": decided per model and GPU
    (the per-GPU table, then the rules in kuiper_py/cuda/ops/: gemv.py, gemm.py gemm_path,
    decode_halves.py, moe.py, attention.py); a value: that choice for every model (tests force paths with
    these)."""
    # decode GEMVs: blocks per SM the split aims at (None: the table's, else 4), the fewest splits below 4 per SM,
    # the o GEMV's target and its gemv_merge_span merge (None: the table's "o_merge"; past this many splits), the
    # MoE weighted sum's target, the MoE o GEMV's router columns per tile (0: one tile), accumulating mode
    gemv_blocks_per_sm: float | None = None
    gemv_min_splits: int = 3
    gemv_o_blocks_per_sm: float = 3.0
    gemv_o_merge: bool | None = None
    gemv_o_merge_min_splits: int = 16
    gemv_moe_blocks_per_sm: float | None = None
    gemv_rt_cols: int = 64
    gemv_acc: bool = True
    # flash decoding: query heads per block, blocks per SM at least, fewest keys per split (0: the table's, else
    # 32), split size at capacity, the short-context regimes' key bounds and cluster merge (None: the table's),
    # splits past 64 keys on tensor cores (False: the scalar loop, tests)
    attn_max_heads_per_block: int = 4
    attn_per_sm: float = 2.0
    attn_min_chunk: int = 0
    attn_keys_per_split: int = 1024
    attn_short: tuple[int, ...] | None = None
    attn_cm: bool | None = None
    attn_mma_long: bool = True
    # the one-launch FFN / MoE FFN halves ("auto", "1": wherever served, "0": off), the FFN's form without a
    # cluster launch ("auto", "1", "0"), cluster launches' scheduling preference (0 default, 1 spread, 2 balance)
    decode_ffn: str = "auto"
    ffn_global: str = "auto"
    decode_moe: str = "auto"
    cluster_policy: int = 1  # spread: as fast as the default for the FFN half at 512 positions, ~0.5% faster at 8k
    # prefill GEMMs: rows from which dequant + cuBLAS may run; the wgmma GEMM ("auto", "1" from gemm_wgmma_min_m
    # rows, "0") and one tile for every shape (None: the wave rule); the register-operand GEMM ("auto", "1", "0");
    # its two-launch bound; the wave tail's K splits
    gemm_dequant_min_m: int = 2
    # prefills of 2 to this many rows (a speculative verify step, a short prompt) take gemv_rows.cu (0: never)
    rows_max_m: int = 16
    gemm_wgmma: str = "auto"
    gemm_wgmma_min_m: int = 1
    gemm_wgmma_tile: tuple[int, int] | None = None
    gemm_rs: str = "auto"
    rs_rows_split_max: int = 320
    wgmma_split_max: int = 4
    # prefill attention: the wgmma kernel ("auto", "0") and one of its compiled forms for every prompt
    attn_wgmma: str = "auto"
    fw_config: tuple[int, int, int] | None = None
    # MoE prefill: gemm_moe_rs ("auto", "0"), its 128-row tiles from this mean of rows per expert; gemm_moe_tc
    # ("auto", "0") up to this mean, 16-row tiles up to the second; the router ("mma", "cuda") and its fp32 GEMM
    # from this many tokens (cuda form); 16-warp routing up to this many tokens (None: 16 x the SMs); the expert
    # maps in the routing launch; its K splits ("auto" or a count) and their most
    moe_rs: str = "auto"
    moe_rs_bt128_from: int = 60  # H100, 30B-A3B's expert GEMMs: 64- and 128-row tiles cost the same at 60
    moe_tc: str = "auto"
    moe_tc_max_mean: float = 60.0
    moe_tc_t16_max: float = 13.0
    moe_router: str = "mma"
    moe_router_gemm_min_t: int = 1024  # H100 30B-A3B, 2048 tokens: 3.3-3.4 against 5.1 ms; at 512 no gain
    moe_route_wide_t: int | None = None  # while 16-token blocks are one wave: H100 30B-A3B 512 tokens -2%
    moe_route_maps: bool = True
    moe_route_splits: str = "auto"
    moe_route_split_max: int = 8
    # prefills of at most this many tokens take the arena's activations / run as CUDA graphs (0: never)
    arena_max_t: int = 512
    prefill_graph_max_t: int = 512
    # paged attention: (most rows, blocks sharing each row's keys) of a step, by its decode bucket's rows; 1 past them
    paged_splits: tuple = ((64, 16),)
    # sampling over several blocks where top-k allows (False: one block always, tests)
    sample_mb: bool = True
    # per-GPU exceptions, keyed on a substring of the device's name
    device_tables: Mapping = field(default_factory=lambda: DEVICE_TABLES)


# The active tuning: the defaults, or what the CupyOps being built was given (one backend per process); the ops read
# it at each call (tests swap it, reference.tune).
SETTINGS = Settings()


def use_settings(settings: Settings) -> None:
    """Make `settings` the active tuning (CupyOps does at construction)."""
    global SETTINGS
    SETTINGS = settings
