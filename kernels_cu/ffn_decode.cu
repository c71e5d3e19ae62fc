// The FFN half of a dense decode layer in one launch: RMSNorm (with the o projection's pending
// residual add), the gate and up GEMVs, SwiGLU and the down GEMV, by thread-block clusters.
//
// Separately these are two split-K GEMVs with a grid-wide hand-off between them: every down block
// needs every gate/up column, so down's blocks wait for the whole gate/up grid, drain it, and start
// with a prologue of their own (PERFORMANCE.md change 67: ~4 µs of a layer's 57 at Qwen3-8B). Here a
// cluster owns 256 intermediate channels end to end: block b of its CL blocks takes rows
// [b D/CL, (b+1) D/CL) of the channels' gate and up columns, the cluster sums the partials through
// distributed shared memory (a cluster barrier, not a grid one), and then block b takes the 256
// channels' rows of down for its D/CL output columns and adds them into the fixed-point accumulator
// (common.cuh) that the next layer's q|k|v GEMV finishes. Only the clusters' own blocks wait on each
// other; no block waits on the grid. Measured on H100 (change 75): the Qwen3-8B step 1-1.5% shorter; the
// hand-off still costs ~2.7 µs after a cluster's slowest block, and the driver places 4 blocks on some SMs
// next to empty ones.
//
// Numerics as the accumulating-mode GEMVs (gemv_w4a16.cu, scaled norm): x = (h + fp16(o)) * w in
// fp16, the 1/rms applied to the gate and up sums, SwiGLU rounded to fp16, the same 4-row fp16 dot
// with the same overflow guard.
//
// Supported (the host checks; anything else runs the separate GEMVs): group size 128, I % 256 == 0,
// D = 256 * CL * TB with (CL, TB) an instantiated pair, D / CL <= FFN_MAX_SPAN. grid (CL, I / 256),
// cluster (CL, 1, 1), block FFN_THREADS.
#include "common.cuh"

#define FFN_THREADS 256
#define FFN_WARPS 8
#define FFN_CH 256            // channels per cluster: one 32-word column tile of gate and of up
#define FFN_MAX_SPAN 1024     // gate/up rows per block, staged in shared memory as fp16
#define FFN_ROWS 16           // rows per warp step: 4 16-byte loads in flight per lane (the GEMVs' step)
#define FFN_MIN_BLOCKS 4      // per SM (64 registers): 32 rows per step need 80 registers, 3 blocks per SM,
                              // and then only 45 of Qwen3-8B's 48 clusters of 8 fit on an H100

// A lane's FFN_ROWS rows of one packed word of a tiled matrix (common.cuh's layout, full 32-word
// tiles): row quads of 16 bytes, issued together. base = the word's row quad 0; a row quad is 128 words.
__device__ __forceinline__ void ffn_load_rows(const u32* base, int k0, u32 (&w)[FFN_ROWS]) {
    const u32* p = base + (size_t)(k0 >> 2) * 128;
#pragma unroll
    for (int j = 0; j < FFN_ROWS / 4; ++j) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p + j * 128));
        w[4 * j] = v.x; w[4 * j + 1] = v.y; w[4 * j + 2] = v.z; w[4 * j + 3] = v.w;
    }
}

// A step's group data for the lane's word: the zero word and its 8 columns' scales (group 128).
__device__ __forceinline__ void ffn_load_group(const u32* qz, const half* sc, int W, int word, int k0, u32& zw,
                                               uint4& sv) {
    const int gi = k0 >> 7;
    zw = __ldg(qz + (size_t)gi * W + word);
    sv = __ldg(reinterpret_cast<const uint4*>(sc + (size_t)gi * W * 8 + word * 8));
}

// acc += the lane's FFN_ROWS rows against x[FFN_ROWS] (shared memory, 16-byte aligned)
__device__ __forceinline__ void ffn_dot(const u32 (&w)[FFN_ROWS], u32 zw, uint4 sv, const half* x, float (&acc)[8]) {
    uint4 xv[FFN_ROWS / 8];
#pragma unroll
    for (int i = 0; i < FFN_ROWS / 8; ++i) xv[i] = reinterpret_cast<const uint4*>(x)[i];
    const half* xs = reinterpret_cast<const half*>(xv);
    half2 zb[4], s2[4];
    awq_zero_bias(zw, zb);
    awq_scales8(sv, s2);
#pragma unroll
    for (int r = 0; r < FFN_ROWS; r += 4) awq_dot4_fold(w + r, xs + r, zb, s2, acc);
}

// acc = a warp's share of a lane word's dot over rows row0 + k of a tiled matrix, k = k0, k0 + step, ..
// < k_end, against x[k] (shared memory); the first step's loads are already in wv, zw, sv (issued early).
__device__ __forceinline__ void ffn_span_dot(const u32* base, const u32* qz, const half* sc, int W, int word,
                                             int row0, int k0, int k_end, int step, const half* x,
                                             u32 (&wv)[FFN_ROWS], u32& zw, uint4& sv, float (&acc)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    for (int k = k0; k < k_end; k += step) {
        if (k != k0) {
            ffn_load_rows(base, row0 + k, wv);
            ffn_load_group(qz, sc, W, word, row0 + k, zw, sv);
        }
        ffn_dot(wv, zw, sv, x + k, acc);
    }
}

template <int CL, int TB>  // blocks per cluster; down column tiles per block (D = 256 CL TB)
__global__ void __launch_bounds__(FFN_THREADS, FFN_MIN_BLOCKS)
ffn_decode(const float* __restrict__ h,            // [D] residual row
           const long long* __restrict__ pend,     // [D] the o projection's pending sums, or null
           float* __restrict__ hout,               // [D] h + fp16(pend), written by cluster 0 (pend set)
           const half* __restrict__ nw, float eps, // [D] the FFN's RMSNorm weight
           const u32* gq, const u32* gz, const half* gs,  // gate [D, I] tiled, [D/128, I/8], [D/128, I]
           const u32* uq, const u32* uz, const half* us,  // up, the same
           const u32* dq, const u32* dz, const half* ds,  // down [I, D] tiled, [I/128, D/8], [I/128, D]
           long long* __restrict__ acc,            // [D] down's sums (fixed point), zero on entry
           int D, int I) {
    diag_stamp(0);  // (KUIPER_DIAG_TIMES, tools/timeline_decode.py: entry, wait, gate/up done, cluster sums, end)
    constexpr int SPW = 4;                 // gate/up: warps per matrix (warps 0, 2, .. gate; 1, 3, .. up)
    constexpr int WPT = FFN_WARPS / TB;    // down: warps per column tile
    static_assert(FFN_WARPS % TB == 0 && FFN_CH % (FFN_ROWS * WPT) == 0, "down's rows split evenly over a tile's warps");
    __shared__ __align__(16) half xsm[FFN_MAX_SPAN];             // the block's span of x
    __shared__ __align__(16) half xd[FFN_CH];                    // SwiGLU of the cluster's channels: down's x
    __shared__ float red[FFN_WARPS][FFN_CH + FFN_CH / 32];       // per-warp column sums (+1 word per 32: banks)
    __shared__ float part[2][FFN_CH];                            // this block's gate, up sums (read by the cluster)
    __shared__ float misc[2 * FFN_WARPS + 1];                    // reductions; [2 FFN_WARPS]: the span's sum of squares
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = blockIdx.x, g = blockIdx.y;  // rank in the cluster; channel tile
    const int SP = D / CL, k_lo = b * SP;      // the block's gate/up rows
    const int IW = I / 8, DW = D / 8;          // row lengths in packed words

    // gate/up: warp = (matrix, rows wr R + 4 R j of the span, R = FFN_ROWS), lane = word g*32 + lane
    const int mat = warp & 1, wr = warp >> 1;
    const u32* qb = (mat ? uq : gq) + (size_t)g * 32 * D + lane * 4;
    const u32* qz = mat ? uz : gz;
    const half* sc = mat ? us : gs;
    const int gword = g * 32 + lane;
    u32 wv[FFN_ROWS], zw;
    uint4 sv;
    // weights never change: the first step's loads fly while the kernel before us finishes (PDL)
    ffn_load_rows(qb, k_lo + wr * FFN_ROWS, wv);
    ffn_load_group(qz, sc, IW, gword, k_lo + wr * FFN_ROWS, zw, sv);
    pdl_wait();  // h, pend and acc belong to the kernels before us
    pdl_trigger();
    diag_stamp(1);

    // ---- x = (h + fp16(pend)) * w over the span, its sum of squares (the 1/rms is applied later) ----
    float mx = 0.f, ssl = 0.f;
    for (int e = tid; e < SP; e += FFN_THREADS) {
        const float hv = resid_pending(h, pend, k_lo + e);
        if (pend && g == 0) hout[k_lo + e] = hv;
        ssl += hv * hv;
        const float f = hv * __half2float(nw[k_lo + e]);
        mx = fmaxf(mx, fabsf(f));
        xsm[e] = __float2half(f);  // inf past 65504, redone below
    }
    {
        const float s = warp_sum(ssl);
        if (lane == 0) misc[FFN_WARPS + warp] = s;
    }
    const int xexp = x_scale_exp(block_max_nonneg<FFN_WARPS>(mx, reinterpret_cast<unsigned*>(misc)));  // (its barrier publishes xsm)
    if (tid == 0) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < FFN_WARPS; ++w) s += misc[FFN_WARPS + w];
        misc[2 * FFN_WARPS] = s;
    }
    if (xexp) {  // rare (massive activations): the span again from h, scaled by a power of two (exact)
        const float down = exp2f(-(float)xexp);
        for (int e = tid; e < SP; e += FFN_THREADS)
            xsm[e] = __float2half(resid_pending(h, pend, k_lo + e) * __half2float(nw[k_lo + e]) * down);
        __syncthreads();
    }

    // ---- gate and up over the span ----
    float a8[8];
    ffn_span_dot(qb, qz, sc, IW, gword, k_lo, wr * FFN_ROWS, SP, SPW * FFN_ROWS, xsm, wv, zw, sv, a8);
    diag_stamp(2);
    stash_lane_sums(red[warp], a8, xexp);

    __syncthreads();
    {  // this block's 256 gate and 256 up sums over its span
        float sg = 0.f, su = 0.f;
#pragma unroll
        for (int w = 0; w < SPW; ++w) {
            sg += red[2 * w][tid + tid / 32];
            su += red[2 * w + 1][tid + tid / 32];
        }
        part[0][tid] = sg;
        part[1][tid] = su;
    }
    cl_arrive();  // release this block's part and span sum of squares to the cluster

    // down: warp = (tile dt of the block's TB, rows dr R + WPT R j of the cluster's 256 channels). Its
    // first step's loads go out between the barrier's arrive and wait: before the arrive, its release
    // would wait for them (measured: 3.7 µs from a cluster's last gate/up block to its sums)
    const int dt = warp / WPT, dr = warp % WPT;
    const int dword = (b * TB + dt) * 32 + lane;
    const u32* db = dq + (size_t)(b * TB + dt) * 32 * I + lane * 4;
    const int d_lo = g * FFN_CH;
    ffn_load_rows(db, d_lo + dr * FFN_ROWS, wv);
    ffn_load_group(dz, ds, DW, dword, d_lo + dr * FFN_ROWS, zw, sv);
    cl_wait();

    // ---- the cluster's sums in rank order (the same bits in every block), 1/rms, SwiGLU ----
    float ss = 0.f, sg = 0.f, su = 0.f;
#pragma unroll 4  // (fully unrolled, CL = 8 spills: down's first step is held in registers meanwhile)
    for (int r = 0; r < CL; ++r) {
        ss += cl_ld(cl_map(smem_u32(&misc[2 * FFN_WARPS]), r));
        sg += cl_ld(cl_map(smem_u32(&part[0][tid]), r));
        su += cl_ld(cl_map(smem_u32(&part[1][tid]), r));
    }
    const float inv = rsqrtf(ss / D + eps), gg = sg * inv, uu = su * inv;
    const float av = __half2float(__float2half(gg / (1.f + __expf(-gg)) * uu));
    // done reading the others' shared memory (av holds every value read); waited for before exit.
    // Relaxed: a release arrive would wait for down's loads in flight
    cl_arrive_relaxed();
    diag_stamp(3);
    const int dexp = x_scale_exp(block_max_nonneg<FFN_WARPS>(fabsf(av), reinterpret_cast<unsigned*>(misc)));
    xd[tid] = __float2half(dexp ? av * exp2f(-(float)dexp) : av);
    __syncthreads();

    // ---- down: the cluster's 256 channel rows x the block's TB column tiles ----
    ffn_span_dot(db, dz, ds, DW, dword, d_lo, dr * FFN_ROWS, FFN_CH, WPT * FFN_ROWS, xd, wv, zw, sv, a8);
    stash_lane_sums(red[warp], a8, dexp);
    __syncthreads();
    for (int c = tid; c < TB * FFN_CH; c += FFN_THREADS) {
        const int t = c / FFN_CH, cc = c % FFN_CH;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WPT; ++w) s += red[t * WPT + w][cc + cc / 32];
        fix_add(acc + (size_t)(b * TB + t) * FFN_CH + cc, s);
    }
    cl_wait();  // no block of the cluster still reads this block's shared memory
    diag_stamp(4);
    diag_record((unsigned long long)gq);
}
