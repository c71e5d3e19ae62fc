// Decode (M = 1) W4A16 GEMV over AutoAWQ-packed weights, split over K, with the split-K reduction
// and its epilogue fused in: the last block to finish a column tile (an atomic arrival counter)
// sums the tile's partials and writes the output, so a projection is one launch.
//
// One launch serves up to three matrices that share the input (Q/K/V, gate/up): blockIdx.x walks
// their column tiles back to back and the partial sums land in one [S, N0+N1+N2] buffer.
// blockIdx.z is a slot: MoE decode runs the selected experts of a token side by side, each
// slot reading its expert id from device memory (so the step still replays as a CUDA graph).
//
// Epilogues: PLAIN out = [y0 | y1 | y2]; SWIGLU out = silu(y0) * y1 (gate, up; N0 == N1);
// MOE_SUM out = sum over slots of slot_w[slot] * y (the MoE finalize).
//
// Weights are in the device layout [N/32, K, 4] (ops_cupy.device_layout, once at load).
// Supported (checked on the host): N % 32 == 0, group size % 32 == 0, K % group size == 0.
#include "common.cuh"

#define GEMV_WARPS 8          // warps per block = 32-column chunks per column tile
#ifndef GEMV_ROWS
#define GEMV_ROWS 4           // 16-byte loads in flight per lane per step (rows lane + 32 i)
#endif
#ifndef GEMV_MIN_BLOCKS
#define GEMV_MIN_BLOCKS 2     // blocks per SM the register budget must allow (latency hiding)
#endif
#ifndef GEMV_PREFETCH
#define GEMV_PREFETCH 0       // L2-prefetch the block's weights before waiting on the previous kernel
#endif
#define GEMV_COLS (32 * GEMV_WARPS)  // columns per block: one 32-column chunk per warp

#define GEMV_EPI_PLAIN 0
#define GEMV_EPI_SWIGLU 1
#define GEMV_EPI_MOE_SUM 2

struct AwqMat {
    const u32* qw;    // [N/32, K, 4]: the device layout (32-column chunks, rows contiguous)
    const u32* qz;    // [K/g, ld/8]
    const half* sc;   // [K/g, ld]
    int N;            // columns used (N <= ld: a column view of a wider matrix)
    int ld;           // row length of qz / sc in columns
};

// Fold a lane's fp16 sums of one group into its 32 fp32 column sums with the group's scales (raw
// scales: the x/16 of pairs 1 and 3 already undid their 16). Broadcast loads: every lane of the
// warp is in the same chunk and group.
__device__ __forceinline__ void gemv_fold(const AwqMat& m, int chunk, int g, half2 (&hacc)[16], float (&acc)[32]) {
    const uint4* sp = reinterpret_cast<const uint4*>(m.sc + (size_t)g * m.ld + chunk * 32);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint4 sv = __ldg(sp + j);
        const half2* s2 = reinterpret_cast<const half2*>(&sv);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const float2 a = __half22float2(hacc[4 * j + p]), sc = __half22float2(s2[p]);
            acc[8 * j + 2 * p] += a.x * sc.x;
            acc[8 * j + 2 * p + 1] += a.y * sc.y;
            hacc[4 * j + p] = __float2half2_rn(0.f);
        }
    }
}

// The biased zero points of a chunk's 32 columns in group g (see awq_zero_bias).
__device__ __forceinline__ void gemv_zeros(const AwqMat& m, int chunk, int g, half2 (&zb)[16]) {
    const uint4 zv = __ldg(reinterpret_cast<const uint4*>(m.qz + (size_t)g * (m.ld / 8) + chunk * 4));
    half2 t[4];
    awq_zero_bias(zv.x, t); zb[0] = t[0]; zb[1] = t[1]; zb[2] = t[2]; zb[3] = t[3];
    awq_zero_bias(zv.y, t); zb[4] = t[0]; zb[5] = t[1]; zb[6] = t[2]; zb[7] = t[3];
    awq_zero_bias(zv.z, t); zb[8] = t[0]; zb[9] = t[1]; zb[10] = t[2]; zb[11] = t[3];
    awq_zero_bias(zv.w, t); zb[12] = t[0]; zb[13] = t[1]; zb[14] = t[2]; zb[15] = t[3];
}

// One reduce-scatter stage of width S over acc[0, 2S): a lane keeps the half picked by bit S of its
// id, summed with its partner's copy of that half, in acc[0, S).
template <int S>
__device__ __forceinline__ void gemv_butterfly(float (&acc)[32], int lane) {
    const bool upper = lane & S;
#pragma unroll
    for (int i = 0; i < S; ++i) {
        const float send = upper ? acc[i] : acc[i + S];
        const float keep = upper ? acc[i + S] : acc[i];
        acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, S);
    }
}

// partial[split][col_off + c] for the 32 columns c of chunk `chunk` of m over rows
// [split*rps, (split+1)*rps). Lane l takes rows l, l+32, ... of each 32*ROWS-row step with one
// 16-byte load per row (its 32 columns), so each warp load is 512 contiguous bytes and a warp's
// whole span is one contiguous run. A butterfly then leaves column l's total in lane l.
__device__ __forceinline__ void gemv_chunk(const half* __restrict__ x, const AwqMat& m, int chunk, int col_off,
                                           int n_total, float* __restrict__ partial, int split, int rps, int K,
                                           int group) {
    const int lane = threadIdx.x & 31;
    if (chunk * 32 >= m.N) return;
    const int k_end = min(K, (split + 1) * rps);
    const uint4* wp = reinterpret_cast<const uint4*>(m.qw) + (size_t)chunk * K;
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    half2 hacc[16], zb[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) hacc[i] = __float2half2_rn(0.f);
    const half2 sixteenth = __float2half2_rn(0.0625f);
    int g = split * rps / group;
    gemv_zeros(m, chunk, g, zb);
    for (int k0 = split * rps; k0 < k_end; k0 += 32 * GEMV_ROWS) {
        // issue every load of the step before the first use; rows past K (the last split) get x = 0
        uint4 wv[GEMV_ROWS];
        half xs[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            const int k = k0 + 32 * r + lane;
            const bool ok = k0 + 32 * r < k_end;  // K % 32 == 0: a 32-row block is all in or all out
            wv[r] = ok ? __ldg(wp + k) : make_uint4(0, 0, 0, 0);
            xs[r] = ok ? x[k] : __float2half(0.f);
        }
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            const int gr = (k0 + 32 * r) / group;
            if (gr != g && k0 + 32 * r < k_end) {  // warp-uniform: a new group starts at this 32-row block
                if (r > 0) gemv_fold(m, chunk, g, hacc, acc);  // at r = 0 the step-end fold already ran
                g = gr;
                gemv_zeros(m, chunk, g, zb);
            }
            const half2 xlo = __half2half2(xs[r]);
            const half2 xhi = __hmul2(xlo, sixteenth);  // pairs 1,3 carry 16(q-z)
            const u32 w4[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                half2 h[4];
                awq_magic(w4[j], h);
#pragma unroll
                for (int p = 0; p < 4; ++p)
                    hacc[4 * j + p] = __hfma2(__hsub2(h[p], zb[4 * j + p]), (p & 1) ? xhi : xlo, hacc[4 * j + p]);
            }
        }
        // at most GEMV_ROWS rows per lane in fp16 before the fold (overflow bound): fold every step
        gemv_fold(m, chunk, g, hacc, acc);
    }
    // reduce-scatter over the lanes: lane l ends with column l
    gemv_butterfly<16>(acc, lane);
    gemv_butterfly<8>(acc, lane);
    gemv_butterfly<4>(acc, lane);
    gemv_butterfly<2>(acc, lane);
    gemv_butterfly<1>(acc, lane);
    partial[(size_t)split * n_total + col_off + chunk * 32 + lane] = acc[0];
}

// Pull the block's weight span (each warp's contiguous rows, then the groups' zeros and scales)
// toward L2. Issued before pdl_wait(): under programmatic dependent launch the block streams its
// weights while the previous kernel finishes, since weights never depend on it.
__device__ __forceinline__ void gemv_prefetch(const AwqMat& m, int tile, int split, int rps, int K, int group) {
    const int k0 = split * rps, k1 = min(K, k0 + rps);
    const int chunk = tile * GEMV_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (chunk * 32 >= m.N) return;
    const char* base = reinterpret_cast<const char*>(m.qw + (size_t)chunk * K * 4);
    for (size_t b = (size_t)k0 * 16 + lane * 128; b < (size_t)k1 * 16; b += 32 * 128) prefetch_l2(base + b);
    for (int g = k0 / group + lane; g < (k1 + group - 1) / group; g += 32) {
        prefetch_l2(m.qz + (size_t)g * (m.ld / 8) + chunk * 4);
        prefetch_l2(m.sc + (size_t)g * m.ld + chunk * 32);
    }
}

// sum_i w_i * p[i * stride] over n partials (w == null: weights 1; else w_i = w[i / per_w]), loads
// issued eight at a time: the reduction runs on one block per tile, so L2 latency, not bandwidth,
// bounds it.
__device__ __forceinline__ float gemv_sum_partials(const float* p, int n, size_t stride, const float* w, int per_w) {
    float s = 0.f;
    for (int i = 0; i < n; i += 8) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = i + j < n ? __ldcg(p + (size_t)(i + j) * stride) : 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s += (w && i + j < n) ? w[(i + j) / per_w] * v[j] : v[j];
    }
    return s;
}

// The split-K GEMV with its fused reduction. grid (column tiles of all matrices, S, slots), block 256.
// counters must be zero before the first launch; every launch leaves them zero.
__global__ void __launch_bounds__(GEMV_WARPS * 32, GEMV_MIN_BLOCKS)
gemv_w4a16(const half* __restrict__ x, int x_slot_stride,  // [slots, x_slot_stride] or [K] (stride 0)
           const u32* qw0, const u32* qz0, const half* sc0, int N0,
           const u32* qw1, const u32* qz1, const half* sc1, int N1,
           const u32* qw2, const u32* qz2, const half* sc2, int N2, int n_mats,
           int ld,                               // row length of every matrix, 0: each its own N
           const int* __restrict__ expert_ids,   // [slots] or null: matrices are expert stacks
           float* __restrict__ partial,          // [slots, S, N0+N1+N2]
           int* __restrict__ counters,           // arrival counts, one per output tile
           half* __restrict__ out,               // PLAIN [slots, N0+N1+N2]; SWIGLU [slots, N0]; MOE_SUM [N0]
           const float* __restrict__ slot_w,     // [slots] (MOE_SUM)
           int K, int rps,                       // rows per split (a multiple of GEMV_WARPS * GEMV_ROWS)
           int group, int epi) {
    const int slot = blockIdx.z, S = gridDim.y;
    // which matrix and column tile this block serves
    int tile = blockIdx.x, col_off = 0;
    AwqMat m{qw0, qz0, sc0, N0, ld ? ld : N0};
    const int t0 = (N0 + GEMV_COLS - 1) / GEMV_COLS;
    if (tile >= t0 && n_mats > 1) {
        tile -= t0; col_off = N0; m = AwqMat{qw1, qz1, sc1, N1, ld ? ld : N1};
        int t1 = (N1 + GEMV_COLS - 1) / GEMV_COLS;
        if (tile >= t1 && n_mats > 2) { tile -= t1; col_off += N1; m = AwqMat{qw2, qz2, sc2, N2, ld ? ld : N2}; }
    }
#if GEMV_PREFETCH
    if (!expert_ids) gemv_prefetch(m, tile, blockIdx.y, rps, K, group);  // expert ids come from the predecessor
#endif
    pdl_wait();  // from here on: x, the ids, partials and counters belong to the kernels before us
    pdl_trigger();
    if (expert_ids) {  // expert e of a stack: whole matrices one after another
        const size_t e = (size_t)expert_ids[slot];
        m.qw += e * K * (m.ld / 8);
        m.qz += e * (K / group) * (m.ld / 8);
        m.sc += e * (K / group) * m.ld;
    }
    const int n_total = N0 + (n_mats > 1 ? N1 : 0) + (n_mats > 2 ? N2 : 0);
    float* part = partial + (size_t)slot * S * n_total;
    gemv_chunk(x + (size_t)slot * x_slot_stride, m, tile * GEMV_WARPS + (threadIdx.x >> 5), col_off, n_total, part,
               blockIdx.y, rps, K, group);

    // arrival: the last of the tile's blocks reduces it (partials published by the fence first)
    int cidx, arrivals;
    if (epi == GEMV_EPI_SWIGLU) { cidx = slot * t0 + tile; arrivals = 2 * S; }
    else if (epi == GEMV_EPI_MOE_SUM) { cidx = blockIdx.x; arrivals = S * gridDim.z; }
    else { cidx = slot * gridDim.x + blockIdx.x; arrivals = S; }
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        is_last = atomicAdd(&counters[cidx], 1) == arrivals - 1;
        if (is_last) counters[cidx] = 0;  // every arrival is in: ready for the next launch
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int c = threadIdx.x; c < GEMV_COLS; c += blockDim.x) {
        const int col = tile * GEMV_COLS + c;
        if (col >= m.N) continue;
        if (epi == GEMV_EPI_PLAIN) {
            float s = gemv_sum_partials(part + col_off + col, S, n_total, nullptr, 1);
            out[(size_t)slot * n_total + col_off + col] = __float2half(s);
        } else if (epi == GEMV_EPI_SWIGLU) {
            float g = gemv_sum_partials(part + col, S, n_total, nullptr, 1);
            float u = gemv_sum_partials(part + N0 + col, S, n_total, nullptr, 1);
            out[(size_t)slot * N0 + col] = __float2half(g / (1.f + __expf(-g)) * u);
        } else {  // slots' partials are contiguous: [slots * S, n_total], weight of row q is slot_w[q / S]
            float acc = gemv_sum_partials(partial + col, S * gridDim.z, n_total, slot_w, S);
            out[col] = __float2half(acc);
        }
    }
}
