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
// MOE_SUM out = sum over slots of slot_w[slot] * y (the MoE finalize, the MOE2 instantiation only); QKV_ROPE: q/k norm, RoPE and
// the KV-cache write of a decode step (gemv_qkv_rope_epilogue). PLAIN and MOE_SUM can add
// into the fp32 residual stream instead (the residual add of the layer), and the input can be
// rmsnorm(h) * w computed in the prologue: so a decode layer needs no add+RMSNorm kernel. The
// o projection's input can be the flash-decoding partials, merged in the prologue.
//
// Accumulating mode (decode): no reduction at all. Blocks add their column sums into int64
// fixed-point accumulators (common.cuh) and exit; the consuming kernel finishes the epilogue in its
// prologue (residual add, the RMSNorm's 1/rms, SwiGLU; flash decoding does the q/k norm, RoPE and
// cache write; the MoE router adds the o projection). The tails it removes cost ~10% of a dense
// decode step, ~16% of a MoE one (docs/PERFORMANCE.md 49-50, 52-53). MoE experts: each slot's
// [gate | up] sums to its own row, the weighted sum over the slots to one row (MOE_SUM).
//
// Supported (checked on the host): N % 32 == 0, group size % ROWS == 0, K % group size == 0, ROWS % 4 == 0.
#include "common.cuh"

#define GEMV_WARPS 8          // warps per block, each on its own rows of the block's K span
#ifndef GEMV_ROWS
#define GEMV_ROWS 16          // rows per warp per step: ROWS/4 independent 16-byte loads in flight per lane
#endif
#ifndef GEMV_MIN_BLOCKS
#define GEMV_MIN_BLOCKS 4     // blocks per SM the register budget must allow (latency hiding)
#endif
static_assert(GEMV_ROWS % 8 == 0, "a step's x rows are read 8 at a time");
#define GEMV_COLS 256         // columns per block: 32 lanes x one packed word (8 columns) each
#define GEMV_FLUSH 4          // rows accumulated in fp16 before folding into fp32 (overflow bound)
static_assert(GEMV_FLUSH == 4, "awq_dot4 sums 4 rows in fp16");
#define GEMV_X_BIG 1024.f     // |x| above which a block's x is scaled down: 15 * GEMV_FLUSH * 1092 > 65504
#define GEMV_ATT_ROWS 4096    // most rows per split staged in shared memory (xsm; the attention merge needs it)

#define GEMV_EPI_PLAIN 0
#define GEMV_EPI_SWIGLU 1
#define GEMV_EPI_MOE_SUM 2
#define GEMV_EPI_QKV_ROPE 3

struct AwqMat {
    const u32* qw;    // [K, N/8] in the tiled layout (common.cuh): a column view is its own matrix
    const u32* qz;    // [K/g, ld/8]
    const half* sc;   // [K/g, ld]
    int N;            // columns used (N <= ld: a column view of a wider matrix)
    int ld;           // row length in columns
};

// A lane's addresses, fixed for its whole K loop: its packed word's column in the tiled layout
// (common.cuh awq_tiled_offset, strength-reduced: row quad q is at base + q * quad), and the group
// index as a shift when the group size is a power of two. Recomputing them per step (64-bit index
// math and an integer division) took about a fifth of the loop's instructions.
struct LaneAddr {
    const u32* base;  // row quad 0 of the lane's word
    int quad;         // words from one row quad to the next (4 x the tile's width in words)
    int gshift;       // log2(group), or -1
};

__device__ __forceinline__ LaneAddr lane_addr(const AwqMat& m, int word, int K, int group) {
    const int t = word >> 5, tw = min(32, m.N / 8 - (t << 5));
    return LaneAddr{m.qw + (size_t)t * 32 * K + (word & 31) * 4, 4 * tw,
                    (group & (group - 1)) == 0 ? __ffs(group) - 1 : -1};
}

// One step's loads for one lane: ROWS rows of its packed word (ROWS/4 16-byte row quads of the
// tiled layout), and the zero word and 8 scales of the group the rows share (group % ROWS == 0).
__device__ __forceinline__ void gemv_load_step(const AwqMat& m, const LaneAddr& a, int k0, int word, int group,
                                               u32 (&wv)[GEMV_ROWS], u32& zw, uint4& sv) {
    const u32* p = a.base + (size_t)(k0 >> 2) * a.quad;
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r += 4) {
        const uint4 v = ld_stream16(p + (r >> 2) * a.quad);
        wv[r] = v.x; wv[r + 1] = v.y; wv[r + 2] = v.z; wv[r + 3] = v.w;
    }
    const int gi = a.gshift >= 0 ? k0 >> a.gshift : k0 / group;
    zw = __ldg(m.qz + (size_t)gi * (m.ld / 8) + word);
    sv = __ldg(reinterpret_cast<const uint4*>(m.sc + (size_t)gi * m.ld + word * 8));
}

// The prologue's staging (gemv_tile): four values to xsm (8-byte aligned) as fp16 (inf past 65504,
// which only the scaled norm can reach and the rescale redoes); returns the running max |x|.
__device__ __forceinline__ float gemv_store_x4(half* xsm, const float (&f)[4], float mx) {
#pragma unroll
    for (int i = 0; i < 4; ++i) mx = fmaxf(mx, fabsf(f[i]));
    const half2 lo = __floats2half2_rn(f[0], f[1]), hi = __floats2half2_rn(f[2], f[3]);
    *reinterpret_cast<uint2*>(xsm) = make_uint2(*reinterpret_cast<const u32*>(&lo), *reinterpret_cast<const u32*>(&hi));
    return mx;
}

#ifndef GEMV_MERGE_BATCH
#define GEMV_MERGE_BATCH 16   // flash-decoding partials a thread of the o merge loads at once
#endif
#ifndef GEMV_O_MIN_BLOCKS
#define GEMV_O_MIN_BLOCKS 3   // per SM, the o instantiations with gemv_merge_span (OM): 80 registers
#endif

// The o projection's x, element by element (decode_merge's running max per element): the attention
// output over rows [k_lo, k_lo + span) rounded to fp16 into xsm; returns the thread's largest |x|.
__device__ __forceinline__ float gemv_merge_each(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                 int S, int min_chunk, int HD, int n_keys, int k_lo, int span,
                                                 half* xsm) {
    float mx = 0.f;
    for (int e = threadIdx.x; e < span; e += blockDim.x) {
        const int k = k_lo + e;
        const float f = __half2float(decode_merge(part_o, part_ml, k / HD, k % HD, S, HD, n_keys, min_chunk));
        mx = fmaxf(mx, fabsf(f));
        xsm[e] = __float2half(f);
    }
    return mx;
}

// The same in the OM instantiations (the host takes them on the H100 only, where they measured
// faster); rows [k_lo, k_lo + span) are whole heads of HD rows. One L2 round trip for up to
// GEMV_MERGE_BATCH splits: thread e's partials for its element are in flight in registers while
// thread i < heads x splits loads pair i (max, sum) into mls (shared memory, cap pairs); after one
// barrier each thread finds its head's weights there. decode_merge's running max (the generic
// instantiation) spreads the same loads over 4-6 dependent round trips: under the 64-register bound
// the compiler issues them between the exp2 steps, and every split past a multiple of 8 adds two
// serial round trips of its own. This form needs the 80 registers of 3
// blocks per SM (16 partials spill at 64). Every thread calls it (the barrier); more heads x splits
// than the pairs' room, or a span past the block's threads, takes gemv_merge_each.
__device__ __forceinline__ float gemv_merge_span(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                 int S, int min_chunk, int HD, int n_keys, int k_lo, int span,
                                                 half* xsm, float2* mls, int cap) {
    const int used = decode_splits_used(n_keys, S, min_chunk);
    const int h_lo = k_lo / HD, nh = (k_lo + span - 1) / HD - h_lo + 1;
    if (nh * used > min(cap, (int)blockDim.x) || span > (int)blockDim.x)
        return gemv_merge_each(part_o, part_ml, S, min_chunk, HD, n_keys, k_lo, span, xsm);
    constexpr int B = GEMV_MERGE_BATCH;
    const int e = threadIdx.x, k = k_lo + e;
    const bool mine = e < span;
    const float* po = part_o + (size_t)(k / HD) * S * HD + k % HD;  // [S] at stride HD: the element's partials
    float pv[B];  // [B] splits s0 .. s0 + B of them
#pragma unroll
    for (int j = 0; j < B; ++j) pv[j] = mine && j < used ? __ldcg(po + (size_t)j * HD) : 0.f;
    if (e < nh * used) {
        const int hh = e / used;
        mls[e] = __ldcg(reinterpret_cast<const float2*>(part_ml) + (size_t)(h_lo + hh) * S + (e - hh * used));
    }
    __syncthreads();  // mls
    if (!mine) return 0.f;
    const float2* mh = mls + (k / HD - h_lo) * used;  // (a warp's lanes read the same pairs: broadcasts)
    float M = -INFINITY;
    for (int s = 0; s < used; ++s) {
        const float2 ml = mh[s];
        if (ml.y != 0.f) M = fmaxf(M, ml.x);  // an empty split contributes nothing
    }
    float L = 0.f, od = 0.f;
    for (int s0 = 0; s0 < used; s0 += B) {
        if (s0) {
#pragma unroll
            for (int j = 0; j < B; ++j) pv[j] = s0 + j < used ? __ldcg(po + (size_t)(s0 + j) * HD) : 0.f;
        }
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const float2 ml = s0 + j < used ? mh[s0 + j] : make_float2(0.f, 0.f);
            if (ml.y != 0.f) {
                const float w = exp2f(ml.x - M);
                L += ml.y * w;
                od += pv[j] * w;
            }
        }
    }
    const half v = __float2half(L > 0.f ? od / L : 0.f);
    xsm[e] = v;
    return fabsf(__half2float(v));
}

// ---- the o projection's router rows (MoE decode, RT): z = attn R + h Rh into acc_z [E] ----
// The router's logits before the 1/rms, z = router . (ffn_norm * (h + o)), are linear in the attention
// output and the residual row h, so the o GEMV computes them beside o: R = W_o diag(ffn_norm) router^T
// [q_dim, E] and Rh = diag(ffn_norm) router^T [D, E], fp16, made at load. More column tiles: R's take
// it against the block's staged span of the attention output, the last takes Rh against the split's
// rows of h. The MoE kernel after us then reads z and starts its top-k at once, instead of a router dot
// product and a cluster exchange after its wait. R's columns may be split
// over several tiles (the host's choice: the tiles between o's and the last): a block of one R tile
// then reads what a block of an int4 tile does, instead of being the GEMV's straggler. A
// tile's row of R is E/8 16-byte chunks (E its columns, ld the row stride); lane = (row phase,
// chunk), 32 / lpr rows side by side, a warp's GEMV_ROWS rows in batches of GEMV_RT_LOADS.
#define GEMV_RT_LOADS (GEMV_ROWS / 4)  // 16-byte router loads in flight per lane: in the registers of a
                                      // step's packed words (wv), which a router tile does not use

// lanes per row of R: E/8 chunks rounded up to a power of two (E <= 256)
__device__ __forceinline__ int gemv_rt_lpr(int E) {
    return E <= 64 ? (E <= 32 ? (E <= 16 ? (E <= 8 ? 1 : 2) : 4) : 8) : (E <= 128 ? 16 : 32);
}

// The lane's rows k0 + sub + RP j (j in [j0, j0 + GEMV_RT_LOADS), below k0 + GEMV_ROWS and k_end) of R
// (row stride ld), its chunk c (zeros where out of range); lane = (sub, c), RP = 32 / lpr rows side by side
__device__ __forceinline__ void gemv_rt_load(const half* rt, int ld, int E, int k0, int j0, int k_end,
                                             u32 (&rv)[GEMV_ROWS]) {
    const int lane = threadIdx.x & 31, lpr = gemv_rt_lpr(E), c = lane % lpr, sub = lane / lpr, RP = 32 / lpr;
#pragma unroll
    for (int j = 0; j < GEMV_RT_LOADS; ++j) {
        const int r = sub + RP * (j0 + j), k = k0 + r;
        const uint4 v = (r < GEMV_ROWS && k < k_end && c * 8 < E)
                            ? __ldg(reinterpret_cast<const uint4*>(rt + (size_t)k * ld) + c) : make_uint4(0, 0, 0, 0);
        rv[4 * j] = v.x; rv[4 * j + 1] = v.y; rv[4 * j + 2] = v.z; rv[4 * j + 3] = v.w;
    }
}

// A router tile's whole job once x is at hand: the warp's steps over rows [k_first, k_end) (first batch
// already in rv), x[k] = xsm[k - k_lo] (fp16, the staged span) or xg[k] (fp32, global, xg set), per-lane
// fp32 sums of 8 columns, summed over row phases and warps, times 2^xexp, into rt_acc.
__device__ __forceinline__ void gemv_rt_tile(const half* rt, int ld, int E, long long* rt_acc, const half* xsm,
                                             const float* xg, int k_lo, int k_first, int k_end, int xexp,
                                             u32 (&rv)[GEMV_ROWS], float (*red)[GEMV_COLS + GEMV_COLS / 32]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int lpr = gemv_rt_lpr(E), c = lane % lpr, sub = lane / lpr, RP = 32 / lpr;
    float a[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = 0.f;
    for (int k0 = k_first; k0 < k_end; k0 += GEMV_WARPS * GEMV_ROWS) {
        for (int j0 = 0; j0 * RP < GEMV_ROWS; j0 += GEMV_RT_LOADS) {
            if (k0 != k_first || j0 != 0) gemv_rt_load(rt, ld, E, k0, j0, k_end, rv);
#pragma unroll
            for (int j = 0; j < GEMV_RT_LOADS; ++j) {
                const int r = sub + RP * (j0 + j);
                if (r >= GEMV_ROWS || k0 + r >= k_end) continue;
                const float xv = xg ? __ldcg(xg + k0 + r) : __half2float(xsm[k0 + r - k_lo]);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 f = __half22float2(*reinterpret_cast<const half2*>(&rv[4 * j + i]));
                    a[2 * i] += xv * f.x;
                    a[2 * i + 1] += xv * f.y;
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
        for (int o = lpr; o < 32; o <<= 1) a[i] += __shfl_xor_sync(0xffffffffu, a[i], o);  // over the row phases
    if (sub == 0 && c * 8 < E) {
#pragma unroll
        for (int i = 0; i < 8; ++i) red[warp][c * 8 + i] = a[i];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; ++w) s += red[w][e];
        fix_add(rt_acc + e, xexp ? ldexpf(s, xexp) : s);
    }
}

// The residual row's router tile: rows [split rph, (split + 1) rph) of Rh against h (fp32) into rt_acc,
// its first step's rows loaded before the PDL wait. Not inlined: inlined beside gemv_tile it raised the
// RT instantiation's spills under the 64-register bound (360 bytes against 272).
__device__ __noinline__ void gemv_rt_h_tile(const half* rh, const float* h, int D, int E, long long* rt_acc,
                                            int split, int S) {
    __shared__ float red[GEMV_WARPS][GEMV_COLS + GEMV_COLS / 32];
    const int rph = (D + S - 1) / S, k_lo = split * rph, k_end = min(D, k_lo + rph);
    const int k_first = k_lo + (threadIdx.x >> 5) * GEMV_ROWS;
    u32 rv[GEMV_ROWS];
    if (k_first < k_end) gemv_rt_load(rh, E, E, k_first, 0, k_end, rv);
    pdl_wait();  // h was written by the kernels before us
    pdl_trigger();
    gemv_rt_tile(rh, E, E, rt_acc, nullptr, h, k_lo, k_first, k_end, 0, rv, red);
}

// partial[split][col_off + col] = sum over rows [split*rps, (split+1)*rps) of x[k] * W[k, col] for
// the 256 columns of column tile `tile` of m. Lane l owns packed word tile*32 + l of every row;
// warp w takes rows w*ROWS.. of each 8*ROWS-row step. Narrow tiles keep the split count (and so
// the fused reduction's reads) small while the grid still fills the GPU.
template <bool RT, bool OM>  // OM: the o merge of gemv_merge_span (80 registers)
__device__ __forceinline__ void gemv_tile(const half* __restrict__ x, const AwqMat& m, int tile, int col_off,
                                          int n_total, float* __restrict__ partial, int split, int rps, int K,
                                          int group, bool wait, const float* hn, const half* wn, float eps,
                                          const float* att_o, const float* att_ml, int att_S, int att_mc, int hd,
                                          int pos0, const int* pos_dev, long long* acc_out, const long long* pend,
                                          float* hout, float* ss_out, const float* ss_in, int ss_n, int ss_D,
                                          bool pend_glu, const float* acc_w, const half* rt, int rt_ld,
                                          int rt_E, long long* rt_acc) {
    // +1 word per 32: lane-strided stores spread over banks. Aligned: OM's merge stages float2 pairs in it, and
    // a kernel's shared layout depends on what else its module holds (4-byte aligned, it faulted in one)
    __shared__ __align__(16) float red[GEMV_WARPS][GEMV_COLS + GEMV_COLS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int word = tile * (GEMV_COLS / 8) + lane;
    const int k_end = min(K, (split + 1) * rps);

    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;

    // The first step's weight loads go out before pdl_wait(): weights never change, so under PDL
    // their DRAM latency overlaps the previous kernel's tail instead of starting after it.
    const int k_first = split * rps + warp * GEMV_ROWS;
    const bool active = word < m.N / 8;
    u32 wv[GEMV_ROWS], zw = 0;
    uint4 sv = make_uint4(0, 0, 0, 0);
    const LaneAddr la = lane_addr(m, word, K, group);
    if (active && k_first < k_end) gemv_load_step(m, la, k_first, word, group, wv, zw, sv);
    // the router tile (RT, rt set): its first step's fp16 rows, also ahead of the wait (into wv)
    if constexpr (RT) {
        if (rt && k_first < k_end) gemv_rt_load(rt, rt_ld, rt_E, k_first, 0, k_end, wv);
    }
    // the merge's length: written at the end of the previous step (advance_position), finished under
    // PDL's transitive waits, so it may be read before ours (from L2: this SM's L1 may hold an older
    // line), and the merge's loads then go out right after the wait (H100 8B -0.6% per step). Not in
    // the router-row instantiation (RT), where the register it holds across the wait adds spills.
    constexpr bool pos_early = !RT;  // the o projection reads the position before its PDL wait
    const int n_keys_early = pos_early && att_o ? (pos_dev ? __ldcg(pos_dev) : pos0) + 1 : 0;
    if (wait) {
        pdl_wait();  // x, partials and counters belong to the kernels before us
        pdl_trigger();
    }
    // The block's span of x goes to shared memory once (xsm): the loop then reads a step's 16 values
    // with two 16-byte loads instead of each lane recomputing or reloading every row's x (2 loads,
    // 2 multiplies and a conversion per row: a fifth of the loop's issue slots). Its three sources:
    // - RMSNorm (hn != null): x = h / rms(h) * w, rounded to fp16 as add_rmsnorm does. Every block
    //   needs the whole row's sum of squares, so each computes it (K floats from L2) while its first
    //   weight loads are in flight: no norm kernel and no serial tail;
    // - the flash-decoding merge (att_o != null, the o projection): the attention output merged
    //   element by element from the splits' partials, so decode needs no combine kernel (each column
    //   tile's block repeats the merge of its rows: L2 reads, no extra launch or serial step);
    // - x itself.
    // The loop sums GEMV_FLUSH rows of (q - z) * x in fp16 before scaling into fp32: 15 * 4 * |x| must
    // stay under 65504, so a span holding |x| > GEMV_X_BIG (massive activations, which real
    // checkpoints have in a few channels) is divided by the power of two that brings it under (exact) and
    // the block's sums multiplied back. Found out once per block, in the barrier that publishes xsm.
    __shared__ __align__(16) half xsm[GEMV_ATT_ROWS];
    const int k_lo = split * rps;
    const bool x_in_smem = k_end - k_lo <= GEMV_ATT_ROWS;  // always for att_o (checked on the host)
    // scaled (ss_out set, accumulating mode): the RMSNorm's 1/rms is left to the consumer, which
    // multiplies the sums by it, so no block reads the whole row: x = h * w over the block's span,
    // and the column-tile-0 blocks store their span's sum of squares in ss_out[split] (the consumer
    // sums the splits in a fixed order). Reading the row in every block had cost ~6% of a decode step
    // in L2 traffic (528 blocks x 48 KB per projection).
    const bool scaled = ss_out != nullptr;
    float inv = 0.f;
    if (hn && !scaled) {
        __shared__ float nred[32];
        inv = row_rms_inv(hn, K, eps, nred, pend);
    }
    float mx = 0.f;  // the span's largest |x|
    int xexp = 0;    // x was divided by 2^xexp
    if (x_in_smem) {
        const int span = k_end - k_lo;
        float ssl = 0.f;
        if (att_o) {
            const int n_keys = pos_early ? n_keys_early : (pos_dev ? *pos_dev : pos0) + 1;
            // (red is free until the loop's sums: block_max's barrier below ends the merge's reads)
            mx = OM ? gemv_merge_span(att_o, att_ml, att_S, att_mc, hd, n_keys, k_lo, span, xsm,
                                      reinterpret_cast<float2*>(&red[0][0]), (int)(sizeof(red) / sizeof(float2)))
                    : gemv_merge_each(att_o, att_ml, att_S, att_mc, hd, n_keys, k_lo, span, xsm);
        } else {
            // Four consecutive elements per thread (k_lo and span are multiples of 4), all of an
            // iteration's loads issued before any is used: this runs after the PDL wait, where every
            // dependent L2 round trip lengthens the step, and a span of 4 x 256 rows is one round trip
            // instead of four. One loop per source, so each holds only its own loads in
            // registers beside the first step's weights (one loop for all spilled).
            const int e0 = 4 * threadIdx.x, step = 4 * blockDim.x;
            if (hn) {
#pragma unroll 1
                for (int e = e0; e < span; e += step) {
                    const int k = k_lo + e;
                    // the residual add of the projection before us, done here (see gemv_w4a16)
                    const float4 h4 = resid_pending4(hn + k, pend ? pend + k : nullptr, 0);
                    const uint2 w4 = __ldg(reinterpret_cast<const uint2*>(wn + k));
                    if (pend && blockIdx.x == 0) *reinterpret_cast<float4*>(hout + k) = h4;
                    const float hv[4] = {h4.x, h4.y, h4.z, h4.w};
                    const half* w = reinterpret_cast<const half*>(&w4);
                    float f[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        ssl += hv[i] * hv[i];
                        const float wi = __half2float(w[i]);
                        f[i] = scaled ? hv[i] * wi : __half2float(__float2half(hv[i] * inv * wi));
                    }
                    mx = gemv_store_x4(xsm + e, f, mx);
                }
            } else if (pend) {
                // a projection's sums, rounded to fp16 as its output, or SwiGLU of the gate/up GEMV's
                // sums [gate K | up K], times the producer's deferred 1/rms. Two elements per thread (a
                // span of 512 in one round trip); four, or these loads issued before the deferred 1/rms's,
                // spilled beside the first step's weights.
                const float pinv = ss_in ? deferred_rms_inv(ss_in, ss_n, ss_D, eps) : 1.f;
                for (int e = 2 * threadIdx.x; e < span; e += 2 * blockDim.x) {
                    const longlong2 y = __ldcg(reinterpret_cast<const longlong2*>(pend + k_lo + e));
                    const longlong2 u = pend_glu ? __ldcg(reinterpret_cast<const longlong2*>(pend + K + k_lo + e))
                                                 : make_longlong2(0, 0);
                    const long long yy[2] = {y.x, y.y}, uu[2] = {u.x, u.y};
                    float f[2];
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const float g = fix_f(yy[i]) * pinv;
                        f[i] = __half2float(__float2half(pend_glu ? g / (1.f + __expf(-g)) * (fix_f(uu[i]) * pinv) : g));
                        mx = fmaxf(mx, fabsf(f[i]));
                    }
                    *reinterpret_cast<half2*>(xsm + e) = __floats2half2_rn(f[0], f[1]);
                }
            } else {
                for (int e = e0; e < span; e += step) {
                    float f[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) f[i] = __half2float(x[k_lo + e + i]);  // (a slot's x: 2-byte aligned)
                    mx = gemv_store_x4(xsm + e, f, mx);
                }
            }
        }
        if (scaled && blockIdx.x == 0) {
            __shared__ float sred[32];
            const float t = block_sum(ssl, sred);
            if (threadIdx.x == 0) ss_out[split] = t;
        }
        {  // the block's max |x|
            __shared__ unsigned wmax[GEMV_WARPS];
            mx = block_max_nonneg<GEMV_WARPS>(mx, wmax);
        }
        if (mx > GEMV_X_BIG) {  // rare: rescale the span in place (scaled: from h again, h * w may pass fp16's range)
            xexp = x_scale_exp(mx);
            const float down = exp2f(-(float)xexp);
            for (int e = threadIdx.x; e < k_end - k_lo; e += blockDim.x) {
                const int k = k_lo + e;
                if (scaled) {
                    xsm[e] = __float2half(resid_pending(hn, pend, k) * __half2float(wn[k]) * down);
                } else {
                    xsm[e] = __float2half(__half2float(xsm[e]) * down);
                }
            }
            __syncthreads();
        }
    }

    if (active) {
        for (int k0 = k_first; k0 < k_end; k0 += GEMV_WARPS * GEMV_ROWS) {
            if (k0 != k_first) gemv_load_step(m, la, k0, word, group, wv, zw, sv);
            uint4 xv[GEMV_ROWS / 8];  // the step's x rows, 16-byte loads (k0 % 16 == 0)
            const half* xs = reinterpret_cast<const half*>(xv);
            if (x_in_smem || !hn) {  // (a span longer than xsm: a single split of K > GEMV_ATT_ROWS, unguarded)
                const uint4* src = x_in_smem ? reinterpret_cast<const uint4*>(xsm + (k0 - k_lo))
                                             : reinterpret_cast<const uint4*>(x + k0);
#pragma unroll
                for (int i = 0; i < GEMV_ROWS / 8; ++i) xv[i] = x_in_smem ? src[i] : __ldg(src + i);
            } else {
                half* xw = reinterpret_cast<half*>(xv);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) xw[r] = __float2half(hn[k0 + r] * inv * __half2float(wn[k0 + r]));
            }
            half2 zb[4];
            awq_zero_bias(zw, zb);  // the zero codes as awq_dot4 takes them
            // raw scales: awq_dot4 sums (q - z) * x in every pair
            const half2 s2[4] = {*reinterpret_cast<const half2*>(&sv.x), *reinterpret_cast<const half2*>(&sv.y),
                                 *reinterpret_cast<const half2*>(&sv.z), *reinterpret_cast<const half2*>(&sv.w)};
#pragma unroll
            for (int r0 = 0; r0 < GEMV_ROWS; r0 += GEMV_FLUSH) awq_dot4_fold(wv + r0, xs + r0, zb, s2, acc);
        }
    }
    if constexpr (RT) {
        if (rt) {  // the router rows: fp32 sums, no overflow guard needed beyond undoing xexp
            gemv_rt_tile(rt, rt_ld, rt_E, rt_acc, xsm, nullptr, k_lo, k_first, k_end, xexp, wv, red);
            return;
        }
    }
    // per-warp results to shared memory, then each thread sums one column over the warps
    stash_lane_sums(red[warp], acc, xexp);
    __syncthreads();
    for (int c = threadIdx.x; c < GEMV_COLS; c += blockDim.x) {
        int col = tile * GEMV_COLS + c;
        if (col >= m.N) continue;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; ++w) s += red[w][c + c / 32];
        if (acc_out) fix_add(acc_out + col_off + col, acc_w ? __ldcg(acc_w) * s : s);
        else partial[(size_t)split * n_total + col_off + col] = s;
    }
}

// sum_i p[i * stride] over n partials, loads
// issued GEMV_SUM_BATCH at a time: the reduction runs on one block per tile after every split has
// arrived, so each batch is one L2 round trip on the step's critical path (32 splits: 2 round trips,
// not 4 as with batches of 8; 32 at a time spills under the 64-register bound).
#ifndef GEMV_SUM_BATCH
#define GEMV_SUM_BATCH 16
#endif
__device__ __forceinline__ float gemv_sum_partials(const float* p, int n, size_t stride) {
    float s = 0.f;
    for (int i = 0; i < n; i += GEMV_SUM_BATCH) {
        float v[GEMV_SUM_BATCH];
#pragma unroll
        for (int j = 0; j < GEMV_SUM_BATCH; ++j) v[j] = i + j < n ? __ldcg(p + (size_t)(i + j) * stride) : 0.f;
#pragma unroll
        for (int j = 0; j < GEMV_SUM_BATCH; ++j) s += v[j];
    }
    return s;
}

// Two columns' sums at once (SwiGLU's gate and up), their loads in the same batches.
__device__ __forceinline__ float2 gemv_sum_partials2(const float* p, const float* q, int n, size_t stride) {
    float2 s = make_float2(0.f, 0.f);
    for (int i = 0; i < n; i += GEMV_SUM_BATCH / 2) {
        float a[GEMV_SUM_BATCH / 2], b[GEMV_SUM_BATCH / 2];
#pragma unroll
        for (int j = 0; j < GEMV_SUM_BATCH / 2; ++j) {
            a[j] = i + j < n ? __ldcg(p + (size_t)(i + j) * stride) : 0.f;
            b[j] = i + j < n ? __ldcg(q + (size_t)(i + j) * stride) : 0.f;
        }
#pragma unroll
        for (int j = 0; j < GEMV_SUM_BATCH / 2; ++j) { s.x += a[j]; s.y += b[j]; }
    }
    return s;
}

// The QKV epilogue: a tile's 256 columns are whole heads (every matrix starts a new tile and
// 256 % hd == 0), so the block holding the tile's sums also does Qwen3's per-head q/k RMSNorm,
// the RoPE rotation and the KV-cache write (rope.cu's qk_norm_rope_store, same rounding points):
// decode needs no separate kernel for them. One column per thread (blockDim == GEMV_COLS).
__device__ __forceinline__ void gemv_qkv_rope_epilogue(const float* part, int tile, int col_off, int mat, int N,
                                                       int n_total, int S, float eps, const half* qn,
                                                       const half* kn, const float* cosb, const float* sinb,
                                                       half* qout, half* Kc, half* Vc, int KV, int hd, int pos) {
    __shared__ float yv[GEMV_COLS];
    __shared__ float wss[GEMV_WARPS];
    const int c = threadIdx.x, col = tile * GEMV_COLS + c;
    const bool valid = col < N;
    // the unfused path stores q, k, v in fp16 before normalising: round the same way
    const float y = valid ? __half2float(__float2half(gemv_sum_partials(part + col_off + col, S, n_total)))
                          : 0.f;
    const int head = col / hd, d = col % hd;
    if (mat == 2) {  // v: the whole block is value columns
        if (valid) Vc[((size_t)pos * KV + head) * hd + d] = __float2half(y);
        return;
    }
    yv[c] = y;
    const float sq = warp_sum(y * y);
    if ((c & 31) == 0) wss[c >> 5] = sq;
    __syncthreads();
    float ss = 0.f;
    for (int i = 0; i < hd / 32; ++i) ss += wss[(c / hd) * (hd / 32) + i];  // the warps of this head
    if (!valid) return;
    const float inv = rsqrtf(ss / hd + eps);
    const half* nw = mat == 0 ? qn : kn;
    const int hh = hd / 2, dp = d < hh ? d + hh : d - hh;  // the rotation partner
    const float xs = y * inv * __half2float(nw[d]), xp = yv[c - d + dp] * inv * __half2float(nw[dp]);
    const float cs = cosb[(size_t)pos * hh + d % hh], sn = sinb[(size_t)pos * hh + d % hh];
    const half r = __float2half(d < hh ? xs * cs - xp * sn : xs * cs + xp * sn);
    if (mat == 0) qout[(size_t)head * hd + d] = r;
    else Kc[((size_t)pos * KV + head) * hd + d] = r;
}

// The split-K GEMV with its fused reduction. grid (column tiles of all matrices, S, slots), block 256.
// counters must be zero before the first launch; every launch leaves them zero.
// MOE2 (the MoE weighted sum only): the reduction in two levels, so the experts' down projection can
// split K as finely as the dense GEMVs. The last block of a (slot, tile) sums that slot's S partials
// times its routing weight into the slot's first partial row; the last slot to finish a tile sums
// the slots. In one level a single block per tile read slots x S partials, so the split aimed at one
// block per SM. It is its own instantiation: beside every other epilogue
// the second level spilled under the 64-register bound of 4 blocks per SM; alone it fits.
// OM: the o projection with gemv_merge_span's merge, at the 80 registers of GEMV_O_MIN_BLOCKS per SM
// (the host takes it for DEVICE_TUNING's "o_merge" shapes past 16 splits, where o's grid fits 3 per SM).
// ACC: accumulating mode only (acc_out set), so the split-K reduction tails and epilogues are not in the
// kernel: about 2200 fewer instructions, and the decode step measured 1.8% (30B-A3B) / 0.5% (8B) shorter
//. The decode kernels run from cold instruction caches every layer, so code they hold but
// never run still costs.
template <bool MOE2, bool RT = false, bool OM = false, bool ACC = false>
__global__ void __launch_bounds__(GEMV_WARPS * 32, OM ? GEMV_O_MIN_BLOCKS : GEMV_MIN_BLOCKS)
gemv_w4a16(const half* __restrict__ x, int x_slot_stride,  // [slots, x_slot_stride] or [K] (stride 0)
           const float* __restrict__ hn,         // [K] fp32 residual stream or null: x = rmsnorm(hn) * wn
           const half* __restrict__ wn, float eps,  // [K] the norm's weight
           const u32* qw0, const u32* qz0, const half* sc0, int N0,
           const u32* qw1, const u32* qz1, const half* sc1, int N1,
           const u32* qw2, const u32* qz2, const half* sc2, int N2, int n_mats,
           int ld,                               // row length of every matrix, 0: each its own N
           const int* __restrict__ expert_ids,   // [slots] or null: matrices are expert stacks
           float* __restrict__ partial,          // [slots, S, N0+N1+N2]
           int* __restrict__ counters,           // arrival counts, one per output tile
           half* __restrict__ out,               // PLAIN [slots, N0+N1+N2]; SWIGLU [slots, N0]; MOE_SUM [N0]
           const float* __restrict__ slot_w,     // [slots] (MOE_SUM)
           float* __restrict__ resid,            // [N0] or null: PLAIN (one matrix) and MOE_SUM add
                                                 // fp16(y) into this fp32 residual stream, not out
           // QKV_ROPE (matrices q, k, v): per-head norm weights, RoPE tables, rotated q out, the cache
           const half* __restrict__ qn, const half* __restrict__ kn,     // [hd]
           const float* __restrict__ cosb, const float* __restrict__ sinb,  // [ctx, hd/2]
           half* __restrict__ qout,              // [H, hd]
           half* __restrict__ Kc, half* __restrict__ Vc,  // [ctx, KV, hd] this layer
           int KV, int hd, int pos0, const int* __restrict__ pos_dev,  // pos_dev set: position read there
           // the flash-decoding merge prologue (x unused): attention partials [H, att_S, hd] and [H, att_S, 2]
           // of a decode at position pos_dev / pos0 (as QKV_ROPE's), merged into x
           const float* __restrict__ att_o, const float* __restrict__ att_ml, int att_S,
           int att_mc,                           // the split's fewest keys (common.cuh decode_chunk)
           int K, int rps,                       // rows per split (a multiple of GEMV_WARPS * GEMV_ROWS)
           int group, int epi,
           int ids_early,                        // the ids were written before the previous kernel
           // Accumulating mode (decode): no split-K reduction tail. Every block adds its column
           // sums into acc_out (fixed point, common.cuh) and exits; the consumer finishes the epilogue
           // in its prologue (pend): the residual add + RMSNorm (hn + pend, tile-0 blocks writing the
           // new residual row to hout) or SwiGLU (x = silu(pend[:K]) * pend[K:]). zero_p: accumulators
           // this kernel clears after its PDL wait, for projections two or more launches later.
           // MoE experts: acc_out [slots, N0+N1] (gate/up) or [N0], the slots' sums times slot_w (MOE_SUM);
           // pend [slots, 2K], each slot's SwiGLU input
           long long* __restrict__ acc_out,      // [N0+N1+N2] or null
           const long long* __restrict__ pend,   // [K] (with hn) or [2K] (SwiGLU input) or null
           float* __restrict__ hout,             // [K] the new residual row (with hn and pend)
           long long* __restrict__ zero_p, int zero_n,
           // scaled norm (with hn, accumulating): x = (h [+ pend]) * wn, the 1/rms deferred, the
           // column-tile-0 blocks writing their span's sum of squares to ss_out [S]
           float* __restrict__ ss_out,
           // a pend input from a scaled GEMV: its ss_n split sums of squares of a row of ss_D
           const float* __restrict__ ss_in, int ss_n, int ss_D,
           int pend_glu,                         // pend input [gate K | up K]: x = silu(g) * u
           // RT (the MoE o projection, accumulating): more column tiles, the router rows R [K, rt_E]
           // (its columns split evenly, in multiples of 8, over the tiles between o's and the last)
           // against the input and Rh [rt_D, rt_E] (the last tile) against the residual row rt_h [rt_D]
           // (fp32), their sums added into rt_acc [rt_E]
           const half* __restrict__ rt, const half* __restrict__ rt_hw, const float* __restrict__ rt_h, int rt_D,
           int rt_E, long long* __restrict__ rt_acc) {
    const int slot = blockIdx.z, S = gridDim.y;
    // which matrix and column tile this block serves
    int tile = blockIdx.x, col_off = 0, mat = 0;
    AwqMat m{qw0, qz0, sc0, N0, ld ? ld : N0};
    const int t0 = (N0 + GEMV_COLS - 1) / GEMV_COLS;
    if (tile >= t0 && n_mats > 1) {
        tile -= t0; col_off = N0; mat = 1; m = AwqMat{qw1, qz1, sc1, N1, ld ? ld : N1};
        int t1 = (N1 + GEMV_COLS - 1) / GEMV_COLS;
        if (tile >= t1 && n_mats > 2) {
            tile -= t1; col_off += N1; mat = 2; m = AwqMat{qw2, qz2, sc2, N2, ld ? ld : N2};
        }
    }
    if (expert_ids) {  // expert e of a stack: whole [K, ld] matrices one after another
        // Ids from the kernel just before us: no weight load can go ahead of pdl_wait. Decode's down
        // projection reads ids the router wrote before the gate/up GEMV, which has itself waited
        // for the router (PDL's "finished" is transitive), so they and its first weight loads may
        // go ahead (ids_early). Read from L2 (.cg): before the wait, this SM's L1 may still hold
        // the line from an earlier layer's ids (measured: plain loads routed to stale experts).
        if (!ids_early) {
            pdl_wait();
            pdl_trigger();
        }
        const size_t e = (size_t)__ldcg(expert_ids + slot);
        m.qw += e * K * (m.ld / 8);
        m.qz += e * (K / group) * (m.ld / 8);
        m.sc += e * (K / group) * m.ld;
    }
    const int n_total = N0 + (n_mats > 1 ? N1 : 0) + (n_mats > 2 ? N2 : 0);
    float* part = partial + (size_t)slot * S * n_total;
    const bool msum = epi == GEMV_EPI_MOE_SUM;
    // R's tiles: gridDim.x - 1 - t0 of them (one matrix), part p taking columns [p EC, p EC + EC)
    const int rparts = RT ? (int)gridDim.x - 1 - t0 : 0, rp = blockIdx.x - t0;
    const bool rtile = RT && rp >= 0 && rp < rparts;
    const int rEC = RT ? (rt_E / 8 + rparts - 1) / rparts * 8 : 0, rc0 = rtile ? rp * rEC : 0;
    if (RT && blockIdx.x == gridDim.x - 1) gemv_rt_h_tile(rt_hw, rt_h, rt_D, rt_E, rt_acc, blockIdx.y, S);
    else gemv_tile<RT, OM>(x + (size_t)slot * x_slot_stride, m, tile, col_off, n_total, part, blockIdx.y, rps, K, group,
              !expert_ids || ids_early, hn, wn, eps, att_o, att_ml, att_S, att_mc, hd, pos0, pos_dev,
              acc_out && !msum ? acc_out + (size_t)slot * n_total : acc_out,
              pend ? pend + (size_t)slot * (pend_glu ? 2 * K : K) : pend, hout, ss_out, ss_in, ss_n, ss_D, pend_glu,
              acc_out && msum ? slot_w + slot : nullptr, rtile ? rt + rc0 : nullptr, rt_E, min(rEC, rt_E - rc0),
              rt_acc + rc0);
    if (zero_p) {  // after the wait (in gemv_tile): the accumulators' last readers have finished
        const int nb = gridDim.x * gridDim.y * gridDim.z;
        const int b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
        for (int i = b * blockDim.x + threadIdx.x; i < zero_n; i += nb * blockDim.x) zero_p[i] = 0;
    }
    if (ACC || acc_out) return;

    if (MOE2) {  // level 1: this slot's tile over its S splits; level 2: the tile over the slots
        if (!block_arrives_last(&counters[slot * gridDim.x + blockIdx.x], S)) return;
        const float w = slot_w[slot];
        for (int c = threadIdx.x; c < GEMV_COLS; c += blockDim.x) {
            const int col = tile * GEMV_COLS + c;
            if (col < m.N) part[col] = w * gemv_sum_partials(part + col, S, n_total);
        }
        if (!block_arrives_last(&counters[gridDim.z * gridDim.x + blockIdx.x], gridDim.z)) return;
        for (int c = threadIdx.x; c < GEMV_COLS; c += blockDim.x) {
            const int col = tile * GEMV_COLS + c;
            if (col >= m.N) continue;
            const float acc = gemv_sum_partials(partial + col, gridDim.z, (size_t)S * n_total);
            if (resid) resid[col] += __half2float(__float2half(acc));
            else out[col] = __float2half(acc);
        }
        return;
    }
    // arrival: the last of the tile's blocks reduces it (partials published by the fence first); MOE_SUM is
    // MOE2's above
    int cidx, arrivals;
    if (epi == GEMV_EPI_SWIGLU) { cidx = slot * t0 + tile; arrivals = 2 * S; }
    else { cidx = slot * gridDim.x + blockIdx.x; arrivals = S; }
    if (!block_arrives_last(&counters[cidx], arrivals)) return;
    if (epi == GEMV_EPI_QKV_ROPE) {
        gemv_qkv_rope_epilogue(part, tile, col_off, mat, m.N, n_total, S, eps, qn, kn, cosb, sinb, qout, Kc, Vc, KV,
                               hd, pos_dev ? *pos_dev : pos0);
        return;
    }
    for (int c = threadIdx.x; c < GEMV_COLS; c += blockDim.x) {
        const int col = tile * GEMV_COLS + c;
        if (col >= m.N) continue;
        if (epi == GEMV_EPI_PLAIN) {
            float s = gemv_sum_partials(part + col_off + col, S, n_total);
            if (resid) resid[col] += __half2float(__float2half(s));
            else out[(size_t)slot * n_total + col_off + col] = __float2half(s);
        } else {  // SWIGLU
            const float2 gu = gemv_sum_partials2(part + col, part + N0 + col, S, n_total);
            const float g = gu.x, u = gu.y;
            out[(size_t)slot * N0 + col] = __float2half(g / (1.f + __expf(-g)) * u);
        }
    }
}
