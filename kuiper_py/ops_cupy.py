"""The CUDA backend's names where the CLI, the engine, the tools and the tests import them from; the backend itself is
the kuiper_py.cuda package (backend.py: CupyOps; ops/: the op families; runtime/: device queries, launches, the kernel
registry and builds; settings.py: the tuning)."""
from .cuda.backend import CupyOps, _Normed
from .cuda.memory import _BUF_GEN, _I32, _i, device_linear, prefill_bucket
from .cuda.sampling import SMP_CAND, SMP_CHUNK, SMP_THREADS, draw_plan
from .cuda.runtime.device import (check_device, copy_bandwidth, cuda_available, current_device_id, device_name,
                                  gpu_memory_used_mib, gpu_name, sm_count, smem_optin)
from .cuda.runtime.launch import (PdlKernel, allow_dynamic_smem, blocks_per_sm, cu_fn, cu_launch_ex,
                                  cu_occupancy_clusters, launch_ex, pdl_attr, pdl_enabled, resident_clusters,
                                  tma_map_2d, tma_map_cache, tmap_encode)
from .cuda.runtime.registry import (FAMILIES, FAMILIES_SM90, FFN_GLOBAL_CAPS, FFN_PAIRS, FW_NC3_FROM, MOE_RS_FORMS,
                                    MOE_RS_FORMS_ALL, MOE_TC_TILES, WGMMA_PRODUCERS, WGMMA_TILES, gemv_name)
from .cuda.runtime.build import (MODULE_PARTS, SM90A_FAMILIES, family_modules, family_names, headers_tag, kernel,
                                 kernel_build_seconds, kernel_dir, kernel_group, load_module, model_families,
                                 model_groups, module_keys, precompile, raw_kernel, usable_cpus)
from .cuda.ops.gemv import (DECODE_MIN_CHUNK, attn_cm, GEMV_BASE_BLOCKS_PER_SM, GEMV_COLS, GEMV_O_COARSE_SPLITS,
                            GEMV_O_MERGE_COARSE_SPLITS, GEMV_STEP, attn_min_chunk, attn_short, decode_acc_layout,
                            decode_regime, decode_regimes, device_tuning, gemv, gemv_blocks_per_sm, gemv_counters,
                            gemv_partial_size, gemv_split, o_merge, o_split, spread_smem)
from .cuda.ops.gemm import (GEMM_BM, RS_PART_COST, RS_ROWS_SPLIT_KN, _CUBLAS, _GEMM_TICKETS, _MATS, _RS_CALLS,
                            awq_dequant, awq_dequant3, cublas_matmul, cublas_ready, dequant_scratch, gemm, gemm_path,
                            gemm_rs, gemm_split_buffers, gemm_wgmma, mats_record, rs_call, rs_choose, rs_cost, rs_plan,
                            rs_rows_split, swiglu_prefill, tma_gemm, wgmma_available, wgmma_call, wgmma_fits,
                            wgmma_plan)
from .cuda.ops.attention import (_ATTN_CM_FNS, _AttnParts, attention_combine, attention_decode, attention_prefill,
                                 attn_cluster_merge, attn_wgmma_fits, decode_heads_per_block)
from .cuda.ops.decode_halves import (FFN_THREADS, decode_ffn, decode_ffn_plan, decode_moe_ffn, ffn_cluster_plan,
                                     ffn_first_fit, ffn_global_plan)
from .cuda.ops.moe import (MOE_ROUTE_MAX_TILES, _MOE_COUNTER, _MOE_TILE_COUNTERS, _RMMA_FITS, gemm_moe_rs,
                           gemm_moe_tc, moe_decode, moe_experts, moe_experts_tile, moe_finalize, moe_gate_up_views,
                           moe_gather, moe_gemm_down, moe_gemm_gate_up, moe_maps, moe_rmma_form, moe_rmma_smem,
                           moe_rmma_split_name, moe_route, moe_route_counter, moe_route_decode, moe_route_splits,
                           moe_route_tile_counters, moe_route_wide_t, moe_rs_fits, moe_rs_path, moe_rs_tile)
from .cuda.ops.norm import add_rmsnorm, lm_head, qk_norm_rope_store

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None

__all__ = [
    "CupyOps", "DECODE_MIN_CHUNK", "FAMILIES", "FAMILIES_SM90", "FFN_GLOBAL_CAPS", "FFN_PAIRS", "FFN_THREADS",
    "FW_NC3_FROM", "GEMM_BM", "GEMV_BASE_BLOCKS_PER_SM", "GEMV_COLS", "GEMV_O_COARSE_SPLITS",
    "GEMV_O_MERGE_COARSE_SPLITS", "GEMV_STEP", "MODULE_PARTS", "MOE_ROUTE_MAX_TILES", "MOE_RS_FORMS",
    "MOE_RS_FORMS_ALL", "MOE_TC_TILES", "PdlKernel", "RS_PART_COST", "RS_ROWS_SPLIT_KN", "SM90A_FAMILIES", "SMP_CAND",
    "SMP_CHUNK", "SMP_THREADS", "WGMMA_PRODUCERS", "WGMMA_TILES", "_ATTN_CM_FNS", "_AttnParts", "_BUF_GEN", "_CUBLAS",
    "_GEMM_TICKETS", "_I32", "_MATS", "_MOE_COUNTER", "_MOE_TILE_COUNTERS", "_Normed", "_RMMA_FITS", "_RS_CALLS", "_i",
    "add_rmsnorm", "allow_dynamic_smem", "attention_combine", "attention_decode", "attention_prefill",
    "attn_cluster_merge", "attn_cm", "attn_min_chunk", "attn_short", "attn_wgmma_fits", "awq_dequant", "awq_dequant3",
    "blocks_per_sm", "check_device", "copy_bandwidth", "cu_fn", "cu_launch_ex", "cu_occupancy_clusters",
    "cublas_matmul", "cublas_ready", "cuda_available", "current_device_id", "decode_acc_layout", "decode_ffn",
    "decode_ffn_plan", "decode_heads_per_block", "decode_moe_ffn", "decode_regime", "decode_regimes", "dequant_scratch",
    "device_linear", "device_name", "device_tuning", "draw_plan", "family_modules", "family_names", "ffn_cluster_plan",
    "ffn_first_fit", "ffn_global_plan", "gemm", "gemm_moe_rs", "gemm_moe_tc", "gemm_path", "gemm_rs",
    "gemm_split_buffers", "gemm_wgmma", "gemv", "gemv_blocks_per_sm", "gemv_counters", "gemv_name", "gemv_partial_size",
    "gemv_split", "gpu_memory_used_mib", "gpu_name", "headers_tag", "kernel", "kernel_build_seconds", "kernel_dir",
    "kernel_group", "launch_ex", "lm_head", "load_module", "mats_record", "model_families", "model_groups",
    "module_keys", "moe_decode", "moe_experts", "moe_experts_tile", "moe_finalize", "moe_gate_up_views", "moe_gather",
    "moe_gemm_down", "moe_gemm_gate_up", "moe_maps", "moe_rmma_form", "moe_rmma_smem", "moe_rmma_split_name",
    "moe_route", "moe_route_counter", "moe_route_decode", "moe_route_splits", "moe_route_tile_counters",
    "moe_route_wide_t", "moe_rs_fits", "moe_rs_path", "moe_rs_tile", "o_merge", "o_split", "pdl_attr", "pdl_enabled",
    "precompile", "prefill_bucket", "qk_norm_rope_store", "raw_kernel", "resident_clusters", "rs_call", "rs_choose",
    "rs_cost", "rs_plan", "rs_rows_split", "sm_count", "smem_optin", "spread_smem", "swiglu_prefill", "tma_gemm",
    "tma_map_2d", "tma_map_cache", "tmap_encode", "usable_cpus", "wgmma_available", "wgmma_call", "wgmma_fits",
    "wgmma_plan", "cp"]
