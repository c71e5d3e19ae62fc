// The FFN half of a decode layer in one launch of thread-block clusters: ffn_decode for a dense layer
// (RMSNorm with the o projection's pending residual add, the gate and up GEMVs, SwiGLU, the down GEMV)
// and moe_ffn_decode for a Qwen3-MoE layer (the same, after routing, on the selected experts). Shared
// phases first, then the two kernels.
//
// Separately these are two split-K GEMVs with a grid-wide hand-off between them: every down block
// needs every gate/up column, so down's blocks wait for the whole gate/up grid, drain it, and start
// with a prologue of their own (docs/PERFORMANCE.md: ~4 µs of a layer's 57 at Qwen3-8B). Here a
// cluster owns 256 intermediate channels end to end: block b of its CL blocks takes rows
// [b D/CL, (b+1) D/CL) of the channels' gate and up columns, the cluster sums the partials through
// distributed shared memory (no grid-wide step), and then block b takes the 256
// channels' rows of down for its D/CL output columns and adds them into the fixed-point accumulator
// (common.cuh) that the next layer's q|k|v GEMV finishes. Only the clusters' own blocks wait on each
// other; no block waits on the grid. Measured on H100: the Qwen3-8B step 1-1.5% shorter; the
// hand-off still costs ~2.7 µs after a cluster's slowest block, and the driver places 4 blocks on some SMs
// next to empty ones. The cluster's exchange is by pushes into each block's receive slots on an
// mbarrier (FfnPush below). Where the
// grid needs 3 or 4 blocks per SM (Qwen3-8B, 14B and 32B on 132 SMs), the host runs the form without a
// cluster launch instead: registers for only that many blocks per SM spread it evenly, and a tile's blocks
// exchange through global memory (FfnSlots below).
//
// Numerics as the accumulating-mode GEMVs (gemv_w4a16.cu, scaled norm): x = (h + fp16(o)) * w in
// fp16, the 1/rms applied to the gate and up sums, SwiGLU rounded to fp16, the same 4-row fp16 dot
// with the same overflow guard.
//
// Supported (the host checks; anything else runs the separate GEMVs): group size 128, I % 256 == 0,
// D = 256 * CL * TB with (CL, TB) an instantiated pair, D / CL <= FFN_MAX_SPAN. grid (CL, I / 256),
// cluster (CL, 1, 1) (the global exchange: no cluster, the whole grid resident at once), block FFN_THREADS.
#include "common.cuh"

#define FFN_THREADS 256
#define FFN_WARPS 8
#define FFN_CH 256            // channels per cluster: one 32-word column tile of gate and of up
#define FFN_MAX_SPAN 1024     // gate/up rows per block, staged in shared memory as fp16
#define FFN_ROWS 16           // rows per warp step: 4 16-byte loads in flight per lane (the GEMVs' step)
#define FFN_SPW 4             // gate/up: warps per matrix (warps 0, 2, .. gate; 1, 3, .. up)
#define FFN_MIN_BLOCKS 4      // per SM (64 registers): 32 rows per step need 80 registers, 3 blocks per SM,
                              // and then only 45 of Qwen3-8B's 48 clusters of 8 fit on an H100
#ifndef FFN_PF_STEPS
#define FFN_PF_STEPS 1  // ffn_decode's gate/up steps after the first whose rows go towards L2 before the
                        // PDL wait (0: none, A/B; the global form at 3 blocks per
                        // SM: 0 steps +2.5%, 2 steps +0.7% per H100 8B step)
#endif

// A lane's FFN_ROWS rows of one packed word of a tiled matrix (common.cuh's layout, full 32-word
// tiles): row quads of 16 bytes, issued together. base = the word's row quad 0; a row quad is 128 words.
__device__ __forceinline__ void ffn_load_rows(const u32* base, int k0, u32 (&w)[FFN_ROWS]) {
    const u32* p = base + (size_t)(k0 >> 2) * 128;
#pragma unroll
    for (int j = 0; j < FFN_ROWS / 4; ++j) {
        const uint4 v = ld_stream16(p + j * 128);
        w[4 * j] = v.x; w[4 * j + 1] = v.y; w[4 * j + 2] = v.z; w[4 * j + 3] = v.w;
    }
}

// The warp's ffn_load_rows rows from k0 towards L2, holding no register and not waiting: the 4 row
// quads of 512 bytes, one 128-byte line per lane 0-15. tile0 = the column tile's row quad 0.
__device__ __forceinline__ void ffn_prefetch_rows(const u32* tile0, int k0) {
    const int lane = threadIdx.x & 31;
    if (lane < 16) prefetch_l2(tile0 + (lane & 3) * 32 + (size_t)((k0 >> 2) + (lane >> 2)) * 128);
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

// ---- the phases both kernels share, in the order they run ----

// x = (h + fp16(pend)) * w over the block's span [k_lo, k_lo + SP) into xsm, in fp16 divided by 2^xexp
// (returned; nonzero only where the span's largest |x| passes 1024), its sum of squares to
// misc[2 FFN_WARPS] (the 1/rms is applied to sums later); the row h + fp16(pend) to hout where pend and
// write_h are set (one cluster writes it).
__device__ __forceinline__ int ffn_stage_x(const float* __restrict__ h, const long long* __restrict__ pend,
                                           float* __restrict__ hout, bool write_h, const half* __restrict__ nw,
                                           int k_lo, int SP, half* xsm, float* misc) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float mx = 0.f, ssl = 0.f;
    // two elements per thread by 8- and 16-byte loads, all issued before any is used (SP and k_lo
    // even): 8B's 512-row span is one L2 round trip after the PDL wait, not two
    for (int e = 2 * tid; e < SP; e += 2 * FFN_THREADS) {
        const int k = k_lo + e;
        const float2 hv = resid_pending2(h, pend, k / 2);
        const half2 w2 = __ldg(reinterpret_cast<const half2*>(nw + k));
        if (pend && write_h) *reinterpret_cast<float2*>(hout + k) = hv;
        ssl += hv.x * hv.x;
        ssl += hv.y * hv.y;
        const float f0 = hv.x * __low2float(w2), f1 = hv.y * __high2float(w2);
        mx = fmaxf(mx, fmaxf(fabsf(f0), fabsf(f1)));
        *reinterpret_cast<half2*>(xsm + e) = __floats2half2_rn(f0, f1);  // inf past 65504, redone below
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
    return xexp;
}

// The block's gate and up sums of channel tid, from each lane's 8 column sums a8 over the span (warp =
// matrix warp & 1; times 2^xexp, undoing the span's scaling).
__device__ __forceinline__ float2 ffn_block_gu(const float (&a8)[8], int xexp, float (*red)[FFN_CH + FFN_CH / 32]) {
    const int tid = threadIdx.x, warp = tid >> 5;
    stash_lane_sums(red[warp], a8, xexp);
    __syncthreads();
    float sg = 0.f, su = 0.f;
#pragma unroll
    for (int w = 0; w < FFN_SPW; ++w) {
        sg += red[2 * w][tid + tid / 32];
        su += red[2 * w + 1][tid + tid / 32];
    }
    return make_float2(sg, su);
}

// SwiGLU rounded to fp16 of the cluster's gate and up sums sg, su of a channel, from the spans' summed
// squares ss (inv: the row's 1/rms). Every exchange ends here, so they give the same bits.
__device__ __forceinline__ float ffn_swiglu(float ss, float sg, float su, int D, float eps, float& inv) {
    inv = rsqrtf(ss / D + eps);
    const float gg = sg * inv, uu = su * inv;
    return __half2float(__float2half(gg / (1.f + __expf(-gg)) * uu));
}

// ---- the exchange by pushes (ffn_decode and moe_ffn_decode <CL, TB, FFN_XCH_PUSH>;
// docs/PERFORMANCE.md) ----
// Why: a cluster barrier's release arrive compiles to MEMBAR.ALL.GPU, a wait for every memory
// operation of the thread to be visible GPU-wide, and the sums would then be read back by DSMEM round trips.
// Here each block stores its gate and up sums and its span's sum of squares straight into every block's
// receive slots (st.async: fire and forget, each completing bytes on the receiver's mbarrier), and a
// block waits only on its own mbarrier for all CL slots; no barrier or fence remains on the path.
template <int CL>
struct FfnPush {
    float2 gu[CL][FFN_CH];  // [rank][channel] (gate, up) sums of block rank
    float ss[CL];           // [rank] its span's sum of squares
    unsigned long long bar; // completes when all CL ranks' bytes have landed
    static constexpr u32 bytes = CL * (FFN_CH * 8 + 4);
};

// Before the PDL wait: the receive barrier armed for the cluster's bytes (ffn_push_send's cl_wait pairs with it)
template <int CL>
__device__ __forceinline__ void ffn_push_init(FfnPush<CL>& px) {
    cl_push_arm(smem_u32(&px.bar), FfnPush<CL>::bytes);
}

// The block's gate/up sums (a8 per lane, as ffn_part_sums) and span sum of squares into slot `rank`
// of every block of the cluster.
template <int CL>
__device__ __forceinline__ void ffn_push_send(const float (&a8)[8], int xexp, float (*red)[FFN_CH + FFN_CH / 32],
                                              const float* misc, FfnPush<CL>& px, int rank) {
    const int tid = threadIdx.x;
    const float2 v = ffn_block_gu(a8, xexp, red);
    cl_wait();  // every block's barrier initialised (their arrives went out before their PDL waits)
    const u32 slot = smem_u32(&px.gu[rank][tid]), sss = smem_u32(&px.ss[rank]), bar = smem_u32(&px.bar);
#pragma unroll
    for (int r = 0; r < CL; ++r) {
        st_async_v2(cl_map(slot, r), v, cl_map(bar, r));
        if (tid == 0) st_async_f32(cl_map(sss, r), misc[2 * FFN_WARPS], cl_map(bar, r));
    }
}

// After this block's mbarrier completes: the cluster's gate and up sums of channel tid and its spans' sums
// of squares from the receive slots, added in rank order (the same bits in every block), the 1/rms, SwiGLU
// rounded to fp16.
template <int CL>
__device__ __forceinline__ float ffn_push_swiglu(FfnPush<CL>& px, int D, float eps, float& inv) {
    const int tid = threadIdx.x;
    mbar_wait_cluster(smem_u32(&px.bar), 0);  // the barrier's one phase: armed once per launch
    float ss = 0.f, sg = 0.f, su = 0.f;
#pragma unroll
    for (int r = 0; r < CL; ++r) {
        ss += px.ss[r];
        const float2 v = px.gu[r][tid];
        sg += v.x;
        su += v.y;
    }
    return ffn_swiglu(ss, sg, su, D, eps, inv);
}
template <int CL>
__device__ __forceinline__ float ffn_push_swiglu(FfnPush<CL>& px, int D, float eps) {
    float inv;
    return ffn_push_swiglu<CL>(px, D, eps, inv);
}

// ---- the exchange through global memory (ffn_decode<CL, TB, FFN_XCH_GLOBAL>) ----
// Why: a cluster launch is placed by GPC (clusters reach ~124 of an H100's 132 SMs), and the dense FFN's
// 384 blocks land up to 4 per SM next to SMs holding 0 or 1; the SMs holding 4 end the FFN last (PERFORMANCE.md
// measured). Without clusters, and with registers for only as many blocks per SM as it needs (MINB), the
// grid spreads evenly (capped by shared-memory padding instead, its blocks could only land as the o GEMV's
// left); the CL blocks of a channel tile (blockIdx.y) then exchange their sums through L2: each
// stores its slot and adds 1 to the tile's counter (release), and waits until the counter has counted all CL of this launch
// (acquire loads). The counter only grows (64 bits: no wrap, no reset), so a
// launch's target is the next multiple of CL above the count it reads after its PDL wait. All CL blocks of a
// tile must be resident at once: the host launches this form only where the whole grid fits on the GPU (a
// wait that never ends, say with another process's kernels holding SMs under MPS, traps after 2^26 polls).
struct FfnSlots {           // one channel tile's exchange, in global memory
    float2 gu[8][FFN_CH];   // [rank][channel] (gate, up) sums of block rank (CL <= 8)
    float ss[8];            // [rank] its span's sum of squares
};

__device__ __forceinline__ unsigned long long ld_relaxed_u64(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long ld_acquire_u64(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// The block's sums (as ffn_push_send) into slot `rank` of its tile, then its arrival on cnt.
__device__ __forceinline__ void ffn_global_send(const float (&a8)[8], int xexp, float (*red)[FFN_CH + FFN_CH / 32],
                                                const float* misc, FfnSlots* xs, unsigned long long* cnt, int rank) {
    const int tid = threadIdx.x;
    const float2 v = ffn_block_gu(a8, xexp, red);
    __stcg(&xs->gu[rank][tid], v);
    if (tid == 0) __stcg(&xs->ss[rank], misc[2 * FFN_WARPS]);
    __syncthreads();  // the block's stores before its arrival (thread 0's release covers them: cumulativity)
    if (tid == 0) asm volatile("red.release.gpu.global.add.u64 [%0], 1;\n" ::"l"(cnt) : "memory");
}

// After the tile's counter reaches target: as ffn_push_swiglu, from the slots in global memory (the same
// sums in the same rank order, so the same bits).
template <int CL>
__device__ __forceinline__ float ffn_global_swiglu(const FfnSlots* xs, const unsigned long long* cnt,
                                                   unsigned long long target, int D, float eps) {
    const int tid = threadIdx.x;
    if (tid == 0) {
        long long spins = 0;
        // acquire loads (LDG.STRONG.GPU + CCTL.IVALL), not relaxed polling and a fence: the fence is a
        // MEMBAR.ALL.GPU, which also waits for down's first loads issued just before
        while (ld_acquire_u64(cnt) < target)  // pairs with the peers' release adds
            if (++spins > (1ll << 26)) __trap();  // a peer never arrived (not all blocks resident): fail loudly
    }
    __syncthreads();  // thread 0's acquire before every thread's reads of the slots
    float ss = 0.f, sg = 0.f, su = 0.f;
    float2 v[CL];
    float s[CL];
#pragma unroll
    for (int r = 0; r < CL; ++r) {
        v[r] = __ldcg(&xs->gu[r][tid]);
        s[r] = __ldcg(&xs->ss[r]);
    }
#pragma unroll
    for (int r = 0; r < CL; ++r) {
        ss += s[r];
        sg += v[r].x;
        su += v[r].y;
    }
    float inv;
    return ffn_swiglu(ss, sg, su, D, eps, inv);
}

// down's x: the SwiGLU av of channel tid, divided by 2^dexp (returned) where the largest |av| passes
// 1024. Starts with the relaxed arrive that says this block is done reading the others' shared memory
// (av holds every value read); the kernel waits for it before exit (arrive false: the push exchange,
// which reads no other block's memory).
__device__ __forceinline__ int ffn_stage_xd(float av, half* xd, float* misc) {
    const int dexp = x_scale_exp(block_max_nonneg<FFN_WARPS>(fabsf(av), reinterpret_cast<unsigned*>(misc)));
    xd[threadIdx.x] = __float2half(dexp ? av * exp2f(-(float)dexp) : av);
    __syncthreads();
    return dexp;
}

// down's sums: each lane's 8 column sums a8 over its warp's rows (warp = (tile warp / WPT, rows)) times
// 2^dexp, summed over a tile's warps, times wgt, added into acc's columns of the block's TB tiles.
template <int TB>
__device__ __forceinline__ void ffn_down_store(const float (&a8)[8], int dexp, int b, float wgt,
                                               long long* __restrict__ acc, float (*red)[FFN_CH + FFN_CH / 32]) {
    constexpr int WPT = FFN_WARPS / TB;  // warps per column tile
    const int tid = threadIdx.x, warp = tid >> 5;
    stash_lane_sums(red[warp], a8, dexp);
    __syncthreads();
    for (int c = tid; c < TB * FFN_CH; c += FFN_THREADS) {
        const int t = c / FFN_CH, cc = c % FFN_CH;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WPT; ++w) s += red[t * WPT + w][cc + cc / 32];
        fix_add(acc + (size_t)(b * TB + t) * FFN_CH + cc, s * wgt);
    }
}

// ---- the kernels ----

// XCH: the exchange of the CL blocks' sums: FFN_XCH_PUSH pushes into receive slots (FfnPush), FFN_XCH_GLOBAL
// slots in global memory without a cluster launch (FfnSlots).
// MINB: blocks per SM that __launch_bounds__ asks registers for (the global exchange: 3 or 4, which caps it there)
#define FFN_XCH_PUSH 1
#define FFN_XCH_GLOBAL 2
template <int CL, int TB, int XCH, int MINB = FFN_MIN_BLOCKS>  // blocks per cluster; down column
__global__ void __launch_bounds__(FFN_THREADS, MINB)                             // tiles per block (D = 256 CL TB)
ffn_decode(const float* __restrict__ h,            // [D] residual row
           const long long* __restrict__ pend,     // [D] the o projection's pending sums, or null
           float* __restrict__ hout,               // [D] h + fp16(pend), written by cluster 0 (pend set)
           const half* __restrict__ nw, float eps, // [D] the FFN's RMSNorm weight
           const u32* gq, const u32* gz, const half* gs,  // gate [D, I] tiled, [D/128, I/8], [D/128, I]
           const u32* uq, const u32* uz, const half* us,  // up, the same
           const u32* dq, const u32* dz, const half* ds,  // down [I, D] tiled, [I/128, D/8], [I/128, D]
           long long* __restrict__ acc,            // [D] down's sums (fixed point), zero on entry
           int D, int I,
           FfnSlots* xslots, unsigned long long* xcnt) {  // FFN_XCH_GLOBAL: [I/256] slots, arrival counts
    constexpr bool PUSH = XCH == FFN_XCH_PUSH, GLOBAL = XCH == FFN_XCH_GLOBAL;
    static_assert(PUSH || GLOBAL, "the exchange by pushes or through global memory");
    static_assert(!GLOBAL || CL <= 8, "FfnSlots holds 8 ranks");
    constexpr int WPT = FFN_WARPS / TB;    // down: warps per column tile
    static_assert(FFN_WARPS % TB == 0 && FFN_CH % (FFN_ROWS * WPT) == 0, "down's rows split evenly over a tile's warps");
    __shared__ __align__(16) half xsm[FFN_MAX_SPAN];             // the block's span of x
    __shared__ __align__(16) half xd[FFN_CH];                    // SwiGLU of the cluster's channels: down's x
    __shared__ float red[FFN_WARPS][FFN_CH + FFN_CH / 32];       // per-warp column sums (+1 word per 32: banks)
    __shared__ float misc[2 * FFN_WARPS + 1];                    // reductions; [2 FFN_WARPS]: the span's sum of squares
    __shared__ __align__(16) FfnPush<PUSH ? CL : 1> px;          // PUSH: the receive slots
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = blockIdx.x, g = blockIdx.y;  // rank in the cluster; channel tile
    const int SP = D / CL, k_lo = b * SP;      // the block's gate/up rows
    if constexpr (PUSH) ffn_push_init<CL>(px);
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
    // and the next step's rows towards L2: otherwise they go out only after the prologue and the first
    // step's sums, a DRAM round trip with DRAM idle (H100: -0.4 to -0.8% per 8B step, H200 neutral; two
    // steps, down's, the MoE kernel's or the GEMVs' measured slower, the GEMVs +6% on the H200)
#pragma unroll
    for (int s = 1; s <= FFN_PF_STEPS; ++s)
        if ((wr + s * FFN_SPW) * FFN_ROWS < SP) ffn_prefetch_rows(qb - lane * 4, k_lo + (wr + s * FFN_SPW) * FFN_ROWS);
    pdl_wait();  // h, pend and acc belong to the kernels before us
    pdl_trigger();
    // GLOBAL: the count this launch's CL arrivals take the tile's counter to (read early: off the path; the
    // kernels before have finished, so it holds whole launches and at most CL - 1 arrivals of this one)
    const unsigned long long target = GLOBAL ? (ld_relaxed_u64(xcnt + g) / CL + 1) * CL : 0;

    const int xexp = ffn_stage_x(h, pend, hout, g == 0, nw, k_lo, SP, xsm, misc);
    float a8[8];
    ffn_span_dot(qb, qz, sc, IW, gword, k_lo, wr * FFN_ROWS, SP, FFN_SPW * FFN_ROWS, xsm, wv, zw, sv, a8);
    if constexpr (PUSH) {
        ffn_push_send<CL>(a8, xexp, red, misc, px, b);
    } else {
        ffn_global_send(a8, xexp, red, misc, xslots + g, xcnt + g, b);
    }

    // down's first step's loads go out between the sends and the wait for the others' sums
    const int dt = warp / WPT, dr = warp % WPT;
    const int dword = (b * TB + dt) * 32 + lane;
    const u32* db = dq + (size_t)(b * TB + dt) * 32 * I + lane * 4;
    const int d_lo = g * FFN_CH;
    ffn_load_rows(db, d_lo + dr * FFN_ROWS, wv);
    ffn_load_group(dz, ds, DW, dword, d_lo + dr * FFN_ROWS, zw, sv);
    int dexp;
    if constexpr (PUSH) {
        dexp = ffn_stage_xd(ffn_push_swiglu<CL>(px, D, eps), xd, misc);
    } else {
        dexp = ffn_stage_xd(ffn_global_swiglu<CL>(xslots + g, xcnt + g, target, D, eps), xd, misc);
    }
    ffn_span_dot(db, dz, ds, DW, dword, d_lo, dr * FFN_ROWS, FFN_CH, WPT * FFN_ROWS, xd, wv, zw, sv, a8);
    ffn_down_store<TB>(a8, dexp, b, 1.f, acc, red);
}

// A Qwen3-MoE decode layer's FFN half in one launch: RMSNorm, softmax and top-k of the router's logits,
// and the k selected experts' gate and up, SwiGLU and down with the routing-weighted sum. Separately that
// is the routing kernel and two expert GEMVs, each waiting for the whole grid before it (the routing
// kernel's last block picks the experts, and no expert weight can load before it has). The logits
// come from the o GEMV before us (its router rows, gemv_w4a16.cu gemv_rt_tile: z = router . (w * (h +
// o)) without the 1/rms), so every block reads the same E words, runs the same top-k on the same bits,
// and all clusters agree without a grid-wide step. Cluster g then owns 256 channels of one selected
// expert: slot g / (mI / 256), channel tile g % (mI / 256); from there it is ffn_decode with the
// expert's matrices and its routing weight applied to down's sums; the weights (softmax of z / rms, the
// 1/rms known after the cluster's exchange) are only needed there. Cluster 0's block 0 also stores the
// ids and weights (read by tests only). Measured on H100: with the
// router dot product and its cluster exchange in this kernel, the Qwen3-30B-A3B decode step was
// 2.6-2.9% shorter than the routing kernel and expert GEMVs; with the logits from the o GEMV, see 77.
//
// Supported (the host checks): as ffn_decode, with mI % 256 == 0 for I, E <= MOE_MAX_E, k <= 32.
// grid (CL, k mI / 256), cluster (CL, 1, 1), block FFN_THREADS.
#ifndef MOE_FFN_MIN_BLOCKS
#define MOE_FFN_MIN_BLOCKS 2  // per SM (128 registers)
#endif

template <int CL, int TB, int XCH>  // XCH: as ffn_decode's (pushes only: a cluster launch)
__global__ void __launch_bounds__(FFN_THREADS, MOE_FFN_MIN_BLOCKS)
moe_ffn_decode(const float* __restrict__ h,            // [D] residual row
               const long long* __restrict__ pend,     // [D] the o projection's pending sums, or null
               float* __restrict__ hout,               // [D] h + fp16(pend), written by cluster 0 (pend set)
               const half* __restrict__ nw, float eps, // [D] the norm weight
               const long long* __restrict__ zacc,     // [E] the router's logits before the 1/rms (fixed point):
                                                       // router . (w * (h + o)), the o GEMV's router rows
               const u32* wq, const u32* wz, const half* ws,  // [gate | up] stack: [E][2][D, mI] tiled, [E, D/128, 2 mI/8],
                                                               // [E, D/128, 2 mI]
               const u32* dq, const u32* dz, const half* ds,  // down stack: [E][mI, D] tiled, [E, mI/128, D/8], [E, mI/128, D]
               int* __restrict__ ids_out, float* __restrict__ w_out,  // [k] the experts picked and their weights
               long long* __restrict__ acc,            // [D] the weighted sum of down's outputs (fixed point), zero on entry
               int D, int mI, int E, int k, int norm_topk) {
    static_assert(XCH == FFN_XCH_PUSH, "the MoE kernel runs as a cluster launch only");
    constexpr int WPT = FFN_WARPS / TB;
    static_assert(FFN_WARPS % TB == 0 && FFN_CH % (FFN_ROWS * WPT) == 0, "down's rows split evenly over a tile's warps");
    __shared__ __align__(16) half xsm[FFN_MAX_SPAN];
    __shared__ __align__(16) half xd[FFN_CH];
    __shared__ float red[FFN_WARPS][FFN_CH + FFN_CH / 32];
    __shared__ float misc[2 * FFN_WARPS + 1];
    __shared__ float lg[MOE_MAX_E];     // the logits, -inf past E
    __shared__ int sel_id[32];
    __shared__ float sel_z[32];
    __shared__ __align__(16) FfnPush<CL> px;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = blockIdx.x, g = blockIdx.y;
    const int SP = D / CL, k_lo = b * SP;
    const int slot = g / (mI / FFN_CH), t = g % (mI / FFN_CH);
    ffn_push_init<CL>(px);

    // ---- the router's logits before the 1/rms, z = router . (w * (h + o)): the o GEMV's router rows
    // computed them (gemv_rt_tile), so the top-k starts as soon as zacc's E words are read ----
    pdl_wait();  // pend, zacc and acc belong to the kernels before us
    pdl_trigger();
    const long long za = tid < E ? __ldcg(zacc + tid) : 0;
    const int xexp = ffn_stage_x(h, pend, hout, g == 0, nw, k_lo, SP, xsm, misc);

    // ---- top-k of z (1/rms > 0 keeps the order; the weights apply it later). The same bits in every
    // block: every cluster picks the same experts ----
    lg[tid] = tid < E ? fix_f(za) : -INFINITY;
    __syncthreads();
    if (warp == 0) {  // (a block-wide rank count in one pass measured 4 µs slower per layer)
        float p[MOE_MAX_E / 32];
#pragma unroll
        for (int j = 0; j < MOE_MAX_E / 32; ++j) p[j] = lg[lane + 32 * j];
        int my_id = 0;
        float my_z = 0.f;
        moe_topk_pick(p, k, -INFINITY, my_id, my_z);
        if (lane < k) {
            sel_id[lane] = my_id;
            sel_z[lane] = my_z;
        }
    }
    __syncthreads();
    const int ex = sel_id[slot];

    // ---- ffn_decode on the expert's 256 channels t*256.. of gate, up and down ----
    const int W2 = mI / 4;  // [gate | up]'s zero row in words (its scale row: 8 W2 halves)
    const int mat = warp & 1, wr = warp >> 1;
    const size_t mat_words = (size_t)D * (mI / 8);
    const u32* qb = wq + (size_t)ex * 2 * mat_words + (mat ? mat_words : 0) + (size_t)t * 32 * D + lane * 4;
    const u32* qz = wz + (size_t)ex * (D / 128) * W2;
    const half* sc = ws + (size_t)ex * (D / 128) * W2 * 8;
    const int gword = (mat ? mI / 8 : 0) + t * 32 + lane;
    // (x is staged before the top-k: with the expert's first loads issued before the stage instead, the
    // 30B-A3B step measured 0.8% longer)
    u32 wv[FFN_ROWS], zw;
    uint4 sv;
    ffn_load_rows(qb, k_lo + wr * FFN_ROWS, wv);
    ffn_load_group(qz, sc, W2, gword, k_lo + wr * FFN_ROWS, zw, sv);
    float a8[8];
    ffn_span_dot(qb, qz, sc, W2, gword, k_lo, wr * FFN_ROWS, SP, FFN_SPW * FFN_ROWS, xsm, wv, zw, sv, a8);
    ffn_push_send<CL>(a8, xexp, red, misc, px, b);

    // down's first step's loads go out between the sends and the wait (as ffn_decode's)
    const int DW = D / 8;
    const int dt = warp / WPT, dr = warp % WPT;
    const int dword = (b * TB + dt) * 32 + lane;
    const u32* db = dq + (size_t)ex * mI * DW + (size_t)(b * TB + dt) * 32 * mI + lane * 4;
    const u32* dzz = dz + (size_t)ex * (mI / 128) * DW;
    const half* dss = ds + (size_t)ex * (mI / 128) * D;
    const int d_lo = t * FFN_CH, dstep = WPT * FFN_ROWS;
    ffn_load_rows(db, d_lo + dr * FFN_ROWS, wv);
    ffn_load_group(dzz, dss, DW, dword, d_lo + dr * FFN_ROWS, zw, sv);
    float inv;  // the row's 1/rms
    const int dexp = ffn_stage_xd(ffn_push_swiglu<CL>(px, D, eps, inv), xd, misc);
    // the routing weight: the softmax of inv * z (its largest is the first pick), renormalised over the
    // picks with norm_topk; each warp sums the denominator itself (the same bits in every warp)
    float wgt;
    {
        const float z0 = sel_z[0];
        float tsum = 0.f;
        if (norm_topk) {
            if (lane < k) tsum = __expf(inv * (sel_z[lane] - z0));
        } else {
            for (int e = lane; e < E; e += 32) tsum += __expf(inv * (lg[e] - z0));
        }
        const float den = warp_sum(tsum);
        wgt = __expf(inv * (sel_z[slot] - z0)) / den;
        if (g == 0 && b == 0 && warp == 0 && lane < k) {
            ids_out[lane] = sel_id[lane];
            w_out[lane] = __expf(inv * (sel_z[lane] - z0)) / den;
        }
    }
    ffn_span_dot(db, dzz, dss, DW, dword, d_lo, dr * FFN_ROWS, FFN_CH, dstep, xd, wv, zw, sv, a8);
    ffn_down_store<TB>(a8, dexp, b, wgt, acc, red);
}
