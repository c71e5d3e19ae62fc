// W4A16 and the fp16 lm_head for a few token rows at once (M = 2..16: a speculative verify step of K + 1
// tokens, a small batch): every weight is read and dequantized once for all rows, on tensor cores
// (mma.sync m16n8k16), so a step of M rows costs close to one decode GEMV's bytes instead of M of them.
//
// The weights stay in the decode GEMV's tiled layout (common.cuh awq_tiled_offset). No repacking is needed
// because an MMA does not care which actual k a fragment's logical k is, as long as both operands agree:
//   lane 4g + t loads rows 4t..4t+3 of packed word g (one 16-byte load of the tiled layout), and its
//   B fragment's logical k (2t, 2t+1 | 2t+8, 2t+9) are those rows (4t, 4t+1 | 4t+2, 4t+3); the x rows
//   (A, tokens as the MMA's m) are read from shared memory at the same actual k.
// Each of the word's 8 columns is one MMA whose n index is the word: a warp covers 8 words (64 columns).
//
// Supported (checked on the host, cuda/ops/rows.py): M <= 16, N % 8 == 0, group % 16 == 0, K % 32 == 0.
#include "common.cuh"

#define RW_MAX_M 16       // token rows: the MMA's m (rows past M are zeros)
#define RW_WARPS 8        // 4 groups of 8 packed words (the block's 32-word column tile) x 2 k phases
#ifndef RW_U
#define RW_U 2            // k16 steps of one batch of loads (two batches in flight: 4 16-byte loads per lane)
#endif
#ifndef RW_MIN_BLOCKS
#define RW_MIN_BLOCKS 2   // blocks per SM the register budget must allow (103 registers at RW_U 2)
#endif
#define RW_SPAN 512       // most rows of K one block takes (its x span in shared memory)

// Two fp16 values as one MMA operand register.
__device__ __forceinline__ u32 h2u(half2 h) { return *reinterpret_cast<u32*>(&h); }

// grid (column tiles of the (up to 3) matrices side by side, splits S over K); block 256. The rows of split s are
// [s * rph, min(K, (s + 1) * rph)), rph % 32 == 0 and rph <= RW_SPAN. Output: out [M, ldo] fp16, the matrices'
// columns side by side; with S > 1 each block writes its sums to partial [S, M, Ntot] and the last block of a column
// tile (counters, zero between launches and left zero) sums them in split order (deterministic).
extern "C" __global__ void __launch_bounds__(256, RW_MIN_BLOCKS)
gemv_rows(const half* __restrict__ x, int M, int K, int group,
          const u32* __restrict__ qw0, const u32* __restrict__ qz0, const half* __restrict__ sc0, int N0,
          const u32* __restrict__ qw1, const u32* __restrict__ qz1, const half* __restrict__ sc1, int N1,
          const u32* __restrict__ qw2, const u32* __restrict__ qz2, const half* __restrict__ sc2, int N2,
          half* __restrict__ out, int ldo, float* __restrict__ partial, unsigned* __restrict__ counters,
          int S, int rph) {
    __shared__ __align__(16) half xs[RW_MAX_M * RW_SPAN];
    __shared__ float red[RW_MAX_M][257];  // (257: the lanes' stores spread over the banks)
    __shared__ bool last;
    // which matrix this block's column tile is in
    const int T0 = (N0 / 8 + 31) / 32, T1 = (N1 / 8 + 31) / 32;
    int tile = blockIdx.x, c_off = 0;
    const u32* qw = qw0; const u32* qz = qz0; const half* sc = sc0; int N = N0;
    if (tile >= T0) {
        tile -= T0; c_off = N0; qw = qw1; qz = qz1; sc = sc1; N = N1;
        if (tile >= T1) { tile -= T1; c_off += N1; qw = qw2; qz = qz2; sc = sc2; N = N2; }
    }
    const int Ntot = N0 + N1 + N2;
    const int W = N / 8, tw = min(32, W - tile * 32);  // the tile's packed words
    const int k_lo = blockIdx.y * rph, k_hi = min(K, k_lo + rph), span = k_hi - k_lo;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wl = (warp & 3) * 8 + g;  // the lane's packed word in the tile
    const int kp = warp >> 2;           // the warp's k phase: it takes every other k16 step
    const bool active = wl < tw;
    const int word = tile * 32 + wl;    // in the matrix
    const u32* wp = qw + (size_t)tile * 32 * K + wl * 4;  // row quad 0 of the lane's word; quad q at + q * 4 tw
    const int gshift = (group & (group - 1)) == 0 ? __ffs(group) - 1 : -1;
    const int steps = span / 16;
    // Loads of one batch: RW_U k16 steps s0, s0 + 2, ... (weights, and each new group's zeros and scales).
    // Two batches are in flight: the next is issued before the current one is computed, and the first before x is
    // staged, so a warp keeps 2 x RW_U 16-byte loads outstanding instead of waiting out each batch's latency.
    struct Batch { uint4 wv[RW_U]; u32 zw[RW_U]; uint4 sv[RW_U]; int gu[RW_U]; };
    auto load = [&](Batch& b, int s0) {
#pragma unroll
        for (int u = 0; u < RW_U; ++u) {
            const int s = s0 + 2 * u;
            const int k0 = k_lo + 16 * s;
            b.gu[u] = s < steps ? (gshift >= 0 ? k0 >> gshift : k0 / group) : -1;
            const bool fresh = u == 0 || b.gu[u] != b.gu[u - 1];  // (warp-uniform)
            if (s < steps && active) {
                b.wv[u] = ld_stream16(wp + (size_t)(k0 / 4 + t) * 4 * tw);
                if (fresh) {
                    b.zw[u] = __ldg(qz + (size_t)b.gu[u] * W + word);
                    b.sv[u] = __ldg(reinterpret_cast<const uint4*>(sc + (size_t)b.gu[u] * N + word * 8));
                } else {
                    b.zw[u] = b.zw[u - 1]; b.sv[u] = b.sv[u - 1];
                }
            } else {
                b.wv[u] = make_uint4(0, 0, 0, 0); b.zw[u] = 0; b.sv[u] = make_uint4(0, 0, 0, 0);
            }
        }
    };
    Batch cur, nxt;
    load(cur, kp);
    // the block's x rows [M, span] to shared memory (16-byte pieces; rows past M are never read)
#pragma unroll 4
    for (int i = threadIdx.x * 8; i < M * span; i += blockDim.x * 8) {
        const int m = i / span, k = i - m * span;
        *reinterpret_cast<uint4*>(&xs[m * RW_SPAN + k]) = *reinterpret_cast<const uint4*>(&x[(size_t)m * K + k_lo + k]);
    }
    __syncthreads();

    const bool row_lo = g < M, row_hi = g + 8 < M;  // the A rows this lane supplies hold tokens
    float acc[8][4];
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[c][i] = 0.f;

    for (int s0 = kp; s0 < steps; s0 += 2 * RW_U) {
        if (s0 + 2 * RW_U < steps) load(nxt, s0 + 2 * RW_U);
        half2 zb[4], s2[4];  // the zero biases and scales of the group of the steps below (converted once a group)
#pragma unroll
        for (int u = 0; u < RW_U; ++u) {
            const int s = s0 + 2 * u;
            if (s >= steps) break;
            if (u == 0 || cur.gu[u] != cur.gu[u - 1]) {
                awq_zero_bias(cur.zw[u], zb);
                awq_scales8(cur.sv[u], s2);
            }
            // A: tokens g and g + 8 at actual k 4t..4t+3 of this step (logical 2t, 2t+1 | 2t+8, 2t+9)
            const int kk = 16 * s + 4 * t;
            const uint2 xlo = row_lo ? *reinterpret_cast<const uint2*>(&xs[g * RW_SPAN + kk]) : make_uint2(0, 0);
            const uint2 xhi = row_hi ? *reinterpret_cast<const uint2*>(&xs[(g + 8) * RW_SPAN + kk]) : make_uint2(0, 0);
            const u32 a[4] = {xlo.x, xhi.x, xlo.y, xhi.y};
            // B: (q - z) * s of the word's 8 columns at the lane's 4 rows, one MMA per column
            half2 d0[4], d1[4], d2[4], d3[4];
            awq_dequant8(cur.wv[u].x, zb, s2, d0);
            awq_dequant8(cur.wv[u].y, zb, s2, d1);
            awq_dequant8(cur.wv[u].z, zb, s2, d2);
            awq_dequant8(cur.wv[u].w, zb, s2, d3);
#pragma unroll
            for (int p = 0; p < 4; ++p) {  // columns 2p (low halves) and 2p + 1 (high halves)
                mma_16816(acc[2 * p], a, h2u(__lows2half2(d0[p], d1[p])), h2u(__lows2half2(d2[p], d3[p])));
                mma_16816(acc[2 * p + 1], a, h2u(__highs2half2(d0[p], d1[p])), h2u(__highs2half2(d2[p], d3[p])));
            }
        }
        cur = nxt;
    }
    // C: acc[c] = (token g, words 2t, 2t+1 of the warp's 8) | (token g + 8, same) at column c of those words.
    // The two k phases meet in red; phase 0 adds its own sums and stores.
    const int w0 = (warp & 3) * 8 + 2 * t;  // the first of the lane's two words in the tile
    if (kp == 1) {
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            red[g][w0 * 8 + c] = acc[c][0];
            red[g][(w0 + 1) * 8 + c] = acc[c][1];
            red[g + 8][w0 * 8 + c] = acc[c][2];
            red[g + 8][(w0 + 1) * 8 + c] = acc[c][3];
        }
    }
    __syncthreads();
    if (kp == 0) {
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            red[g][w0 * 8 + c] += acc[c][0];
            red[g][(w0 + 1) * 8 + c] += acc[c][1];
            red[g + 8][w0 * 8 + c] += acc[c][2];
            red[g + 8][(w0 + 1) * 8 + c] += acc[c][3];
        }
    }
    __syncthreads();
    const int cols = tw * 8, col0 = c_off + tile * 256;  // the tile's columns in out / partial
    if (S == 1) {
        for (int i = threadIdx.x; i < M * cols; i += blockDim.x) {
            const int m = i / cols, c = i - m * cols;
            out[(size_t)m * ldo + col0 + c] = __float2half(red[m][c]);
        }
        return;
    }
    const int c4 = cols / 4;  // (cols % 8 == 0, Ntot % 8 == 0, col0 % 8 == 0: float4 pieces are aligned)
    for (int i = threadIdx.x; i < M * c4; i += blockDim.x) {
        const int m = i / c4, c = (i - m * c4) * 4;
        __stcg(reinterpret_cast<float4*>(&partial[((size_t)blockIdx.y * M + m) * Ntot + col0 + c]),
               make_float4(red[m][c], red[m][c + 1], red[m][c + 2], red[m][c + 3]));
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == (unsigned)(S - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Sums in split order (deterministic), 4 columns a thread and 8 splits' loads in flight: a serial chain of
    // S x M x cols / 256 dependent L2 loads would cost more than the weights themselves at 16 rows.
    const size_t sstep = (size_t)M * Ntot / 4;  // one split, in float4
    for (int i = threadIdx.x; i < M * c4; i += blockDim.x) {
        const int m = i / c4, c = (i - m * c4) * 4;
        const float4* p = reinterpret_cast<const float4*>(&partial[(size_t)m * Ntot + col0 + c]);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s0 = 0; s0 < S; s0 += 8) {
            float4 r[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) r[j] = s0 + j < S ? __ldcg(p + (s0 + j) * sstep) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (s0 + j < S) { v.x += r[j].x; v.y += r[j].y; v.z += r[j].z; v.w += r[j].w; }
        }
        half* o = out + (size_t)m * ldo + col0 + c;
        o[0] = __float2half(v.x); o[1] = __float2half(v.y); o[2] = __float2half(v.z); o[3] = __float2half(v.w);
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // for the next launch (and a graph's next replay)
}

#define LM_U 4  // lm_head_rows: 32-column chunks of k a lane has in flight

// logits [M, V] fp32 = x [M, D] . W [V, D]^T for M <= 8 NT token rows: vocabulary rows as the MMA's m (16 per warp,
// read once for all tokens), tokens as its n. Lane 4g + t loads 16 bytes of rows g and g + 8 at actual k 8t..8t+7 of
// each 32-column chunk: logical k (2t, 2t+1 | 2t+8, 2t+9) are actual (8t, 8t+1 | 8t+2, 8t+3) in the chunk's first
// MMA, (8t+4, 8t+5 | 8t+6, 8t+7) in its second; x's fragments (B) come from global memory (L1) at the same k.
// grid ceil(V / 128), block 256; D % 32 == 0.
template <int NT>
__global__ void __launch_bounds__(256)
lm_head_rows(const half* __restrict__ x, int M, const half* __restrict__ W, float* __restrict__ logits, int V, int D) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int v0 = (blockIdx.x * RW_WARPS + warp) * 16;
    if (v0 >= V) return;
    const int ra = min(v0 + g, V - 1), rb = min(v0 + g + 8, V - 1);  // (rows past V: computed, not stored)
    const half* pa = W + (size_t)ra * D + 8 * t;
    const half* pb = W + (size_t)rb * D + 8 * t;
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
    for (int k0 = 0; k0 < D; k0 += 32 * LM_U) {
        uint4 wa[LM_U], wb[LM_U];
#pragma unroll
        for (int u = 0; u < LM_U; ++u) {
            const int k = k0 + 32 * u;
            wa[u] = k < D ? ld_stream16(pa + k) : make_uint4(0, 0, 0, 0);
            wb[u] = k < D ? ld_stream16(pb + k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < LM_U; ++u) {
            const int k = k0 + 32 * u;
            if (k >= D) break;
            const u32 a1[4] = {wa[u].x, wb[u].x, wa[u].y, wb[u].y};
            const u32 a2[4] = {wa[u].z, wb[u].z, wa[u].w, wb[u].w};
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int tok = 8 * n + g;
                const uint4 xv = tok < M ? __ldg(reinterpret_cast<const uint4*>(x + (size_t)tok * D + k + 8 * t))
                                         : make_uint4(0, 0, 0, 0);
                mma_16816(acc[n], a1, xv.x, xv.y);
                mma_16816(acc[n], a2, xv.z, xv.w);
            }
        }
    }
    // C: (vocab row g | g + 8, tokens 2t, 2t + 1 of the n tile)
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int tok = 8 * n + 2 * t;
        if (v0 + g < V) {
            if (tok < M) logits[(size_t)tok * V + v0 + g] = acc[n][0];
            if (tok + 1 < M) logits[(size_t)(tok + 1) * V + v0 + g] = acc[n][1];
        }
        if (v0 + g + 8 < V) {
            if (tok < M) logits[(size_t)tok * V + v0 + g + 8] = acc[n][2];
            if (tok + 1 < M) logits[(size_t)(tok + 1) * V + v0 + g + 8] = acc[n][3];
        }
    }
}
