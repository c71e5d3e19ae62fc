"""The kernel families: which .cu file each is built from, the instantiations each holds and the compile-time
constants passed to them, and which kernels may be launched with programmatic dependent launch."""
from __future__ import annotations


GEMV_ROWS = 16  # tuning knobs of gemv_w4a16.cu (benchmarks)


GEMV_MIN_BLOCKS = 4


# the o GEMV's merge of its partials 16 splits at a time (gemv_w4a16.cu gemv_merge_span, the OM instantiations)
GEMV_O_MIN_BLOCKS = 3  # the OM instantiations' blocks per SM (80 registers), passed to gemv_w4a16.cu


GEMV_SUM_BATCH = 16  # partials the fused reduction loads at once


# gemm_wgmma.cu's tiles (BM, BN) -> (SX, SB, PS): slots of its x, W and packed-weight rings (227 KB of shared
# memory at most; the deeper packed ring measured 315 against 295 TFLOP/s at 2048 rows)
WGMMA_TILES = {(128, 128): (4, 4, 14), (64, 128): (4, 4, 14)}


# each tile's throughput relative to 128 x 128 (H100, o at 2048 rows: 287 vs 184 TFLOP/s per half-size tile pair),
# for wgmma_plan's wave arithmetic
WGMMA_TILE_EFF = {(128, 128): 1.0, (64, 128): 0.64}


# producer warpgroups of gemm_wgmma.cu (1 or 2; the kernel's NP): they take alternate K tiles, so the
# dequantization, which bounded the kernel alone (420 TFLOP/s), has twice the warps
WGMMA_PRODUCERS = (2,)


ATTN_DECODE_U = 4  # attention.cu ATTN_DECODE_U


# gemv_w4a16.cu's instantiations <MOE2, RT, OM, ACC>: the split-K form (MOE2: the MoE sum over two levels),
# o's merge of many flash-decoding splits (OM), and the accumulating decode forms (ACC), which leave out the
# split-K reduction tails, with the MoE o projection's router rows (RT: accumulating only)
GEMV_FORMS = ((False, False, False, False), (True, False, False, False), (False, False, True, False),
              *((False, rt, om, True) for rt in (False, True) for om in (False, True)))


def gemv_name(moe2: bool, rt: bool = False, om: bool = False, acc: bool = False) -> str:
    """The name expression of one gemv_w4a16 instantiation (GEMV_FORMS), every template argument written out."""
    return "gemv_w4a16<" + ", ".join("true" if f else "false" for f in (moe2, rt, om, acc)) + ">"


RS_STAGES = {64: 8, 128: 8, 256: 5}  # gemm_w4a16_rs's stages per token count (what fits in 227 KB)


# gemm_moe_rs's forms (stages, consumer warpgroups) per rows per tile: 4 warpgroups are 256 channels a block and
# one block per SM; 2 are 128 channels and two blocks per SM (4 stages each: 6 spill under the 128-register bound),
# so one block's first loads and last stores overlap the other's loop. H100, 30B-A3B's experts, 64-row tiles at
# 256-2048 tokens: gate|up -1 to -7%, down -3 to -6% with 2; 128-row tiles +1 to +8%.
# Every form runs half-width wgmmas on a tile whose expert has at most half a tile of rows left, and takes the packed
# words by 128B-swizzled 3D TMA boxes of the block's quarters only (docs/PERFORMANCE.md)
MOE_RS_FORMS = {64: (4, 2), 128: (8, 4)}  # rows per tile -> (stages, warpgroups)


MOE_RS_FORMS_ALL = tuple((bt, *f) for bt, f in MOE_RS_FORMS.items())  # compiled: (rows, stages, warpgroups)


MOE_RS_TILES = tuple(MOE_RS_FORMS)  # gemm_moe_rs's rows per tile


# Up to this many routed rows per expert on the mean (n / E) the grouped expert GEMMs are gemm_moe_tc's batched GEMV
# on tensor cores (gemm_moe_tc.cu), in tiles of 16 rows up to moe_tc_t16_max on the
# mean and 32 above; "0" keeps gemm_moe_rs at every length. The bounds are whole-model crossovers (H200,
# 30B-A3B, 48 layers, GPU ms per prefill): 16-row tiles lead up to 12 rows per expert (192 tokens: 10.77 against
# 10.95), 32-row from 14 (224 tokens: 11.85 against 11.90); 32-row tiles beat gemm_moe_rs up to 56 rows (896 tokens:
# 24.16 against 24.73) and lose at 64 (1024 tokens: 26.06 against 25.42). 13 and 60 lie between those points.
MOE_TC_TILES = (16, 32)  # gemm_moe_tc's compiled rows per tile


# attn_wgmma.cu flash_attn_wgmma's (K/V stages, PIPE, consumer warpgroups) instantiations; prefill takes (4, 2, 3)
# (3 warpgroups taking turns) from FW_NC3_FROM tokens and (4, 1, 2) below, or fw_config
# ("stages,pipe,warpgroups") always. H100, docs/PERFORMANCE.md, TFLOP/s at 2048 / 8192 tokens (from position 0,
# then after T/2 cached positions): (4, 1, 2) 340-345 / 405 / 441-493 / 467-469, (4, 2, 3) 342-347 / 423-425 / 501-553
# / 529-533, (4, 1, 3) 327-337 / 394-396 / 471-521 / 494-498; at 512 tokens 3 warpgroups leave SMs idle (135 against 172)
FW_CONFIGS = ((3, 0, 2), (3, 1, 2), (4, 1, 2), (3, 1, 3), (4, 1, 3), (4, 2, 2), (4, 2, 3))


FW_NC3_FROM = 2048


def moe_rs_name(st: int, bt: int, wg: int) -> str:
    """The name expression of one gemm_moe_rs instantiation."""
    return f"gemm_moe_rs<{st}, {bt}, {wg}>"


def fw_name(st: int, pipe: int, nc: int) -> str:
    """The name expression of one flash_attn_wgmma instantiation."""
    return f"flash_attn_wgmma<{st}, {pipe}, {nc}>"


# moe_route_mma's instantiations <NG, KS> (expert groups of 32 x K parts: 8 or 16 warps), each also as
# moe_route_mma_split
MOE_RMMA_NAMES = [f"moe_route_mma{sp}<{ng}, {w // ng}>" for ng in (4, 8) for w in (8, 16) for sp in ("", "_split")]


FAMILIES = {
    "gemv": ("gemv_w4a16.cu", [gemv_name(*f) for f in GEMV_FORMS]),
    "gemm90": ("gemm_wgmma.cu", [f"gemm_w4a16_ws<{bm}, {bn}, {', '.join(map(str, r))}, {np_}>"
                                 for (bm, bn), r in WGMMA_TILES.items() for np_ in WGMMA_PRODUCERS]),
    # the register-A kernel of the same file: gemm()'s "rs" path takes 128 and 256 tokens per block
    "gemm90rs": ("gemm_wgmma.cu", [f"gemm_w4a16_rs<{st}, {bt}>" for bt, st in RS_STAGES.items()]
                  + [moe_rs_name(st, bt, wg) for bt, st, wg in MOE_RS_FORMS_ALL]),
    "gemm": ("gemm_w4a16.cu", ["gemm_w4a16<128>", "gemm_w4a16<64>", "silu_mul", "awq_dequant", "awq_dequant3", "gemm_moe_gate_up", "gemm_moe_down"]),
    # MoE prefill's grouped expert GEMMs for few rows per expert
    "moetc": ("gemm_moe_tc.cu", [f"gemm_moe_tc<{tm}, {g}>" for tm in MOE_TC_TILES for g in (0, 1)]),
    "moe": ("moe.cu", ["moe_router_logits", "moe_topk", *MOE_RMMA_NAMES, "moe_route_decode",
                       "moe_expert_maps", "moe_gather_rows",
                       "moe_finalize"]),
    # prefill flash attention on wgmma (head dim 128 on compute capability 9.0)
    "attn90": ("attn_wgmma.cu", [fw_name(*c) for c in FW_CONFIGS]),
    "attn": ("attention.cu", ["flash_attn_prefill<64>", "flash_attn_prefill<128>", "attn_decode_combine"]
                      + [f"attn_decode_gqa<{hd},{hb}{lp}>" for hd in (64, 128) for hb in range(1, 9)
                         for lp in ("", ",true")]),
    "norm": ("norm.cu", ["embed_gather", "add_rmsnorm"]),
    "rope": ("rope.cu", ["qk_norm_rope_store<64>", "qk_norm_rope_store<128>", "advance_position"]),
    "lmh": ("lm_head.cu", ["lm_head_gemv"]),
    # a few token rows at once: a verify step, short prompts (W4A16 and the lm_head on mma.sync)
    "rows": ("gemv_rows.cu", ["gemv_rows"] + [f"lm_head_rows<{nt}>" for nt in (1, 2, 4, 8)]),
    # steps of several sequences over the paged KV pool (kuiper_py.batch): per-token RoPE + block write, attention
    "paged": ("paged.cu", [f"{k}<{hd}>" for k in ("paged_qk_norm_rope_store", "paged_attention",
                                                   "paged_attention_merge") for hd in (64, 128)]
              + ["rows_argmax"]),
    "smp": ("sampling.cu", ["sample_token", "sample_token_mb", "sample_rows"]),
    "ar": ("allreduce.cu", ["allreduce_oneshot<__half>", "allreduce_oneshot<float>"]),  # --tp's one-shot all-reduce
}


# compiled on demand, on compute capability 9.0+ only (thread-block clusters, bulk copies)
FFN_PAIRS = ((8, 2), (8, 1), (5, 4), (5, 2), (4, 2), (4, 1))  # ffn_decode.cu's (CL, TB) instantiations


# ffn_decode.cu's cluster exchange by pushes (FfnPush) rather than through the cluster barrier: the H100 8B step
# 0.9% shorter at 512 keys, 1.5% at 2000
FFN_XCH_PUSH, FFN_XCH_GLOBAL = 1, 2  # ffn_decode.cu's exchange template argument


# blocks per SM of the dense one-launch FFN without a cluster launch (ffn_global_plan): the caps it is instantiated
# and taken at (2, Qwen3-4B's on an H100, measured 3.6% slower than the separate GEMVs)
FFN_GLOBAL_CAPS = (3, 4)


ATTN_CM_HB = (1, 2, 4, 8)  # heads per block of attention.cu's cluster-merge instantiations (attn_decode_gqa CM)


ATTN_CM_MAX = 16  # attention.cu ATTN_CM_MAX: the most splits one cluster merges


FAMILIES_SM90 = {"attncm": ("attention.cu", [f"attn_decode_gqa<{hd},{hb},false,true>" for hd in (64, 128)
                                             for hb in ATTN_CM_HB]),
                 "ffn": ("ffn_decode.cu", [f"ffn_decode<{cl}, {tb}, {FFN_XCH_PUSH}>" for cl, tb in FFN_PAIRS]
                         + [f"ffn_decode<{cl}, {tb}, {FFN_XCH_GLOBAL}, {m}>" for m in FFN_GLOBAL_CAPS
                            for cl, tb in FFN_PAIRS]
                         + [f"moe_ffn_decode<{cl}, {tb}, {FFN_XCH_PUSH}>" for cl, tb in FFN_PAIRS])}


# Kernels that call pdl_wait() before touching anything but weights (common.cuh), so they may be
# launched with programmatic dependent launch: on sm_90 the next kernel's blocks become resident
# while the current kernel drains. These are the decode step's kernels and some prefill ones (routing, the
# 16-byte norm and RoPE forms).
PDL_KERNELS = {*(gemv_name(*f) for f in GEMV_FORMS), "embed_gather", "add_rmsnorm", "gemv_rows",
               "qk_norm_rope_store<64>", "qk_norm_rope_store<128>",
               "advance_position", "attn_decode_combine", "lm_head_gemv", "moe_router_logits", "moe_topk", *MOE_RMMA_NAMES,
               "moe_route_decode"} | {
               f"attn_decode_gqa<{hd},{hb}{lp}>" for hd in (64, 128) for hb in range(1, 9) for lp in ("", ",true")}
