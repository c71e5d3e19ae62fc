// W4A16 and the fp16 lm_head for a few token rows at once (M = 2..16: a speculative verify step of K + 1
// tokens, a small batch): every weight is read and dequantized once for all rows, on tensor cores
// (mma.sync m16n8k16), so a step of M rows costs close to one decode GEMV's bytes instead of M of them.
//
// The weights stay in the decode GEMV's tiled layout (common.cuh awq_tiled_offset). No repacking is needed
// because an MMA does not care which actual k a fragment's logical k is, as long as both operands agree:
//   lane 4g + t takes rows 4t..4t+3 of packed word g (one 16-byte row quad of the tiled layout), and its
//   B fragment's logical k (2t, 2t+1 | 2t+8, 2t+9) are those rows (4t, 4t+1 | 4t+2, 4t+3); the x rows
//   (A, tokens as the MMA's m) are read at the same actual k.
// Each of the word's 8 columns is one MMA whose n index is the word: a warp covers 8 words (64 columns).
//
// A block takes one 256-column tile over a span of K in chunks of RW_CHUNK rows, streamed through a ring of
// RW_STAGES shared-memory stages by cp.async (weights, the chunk's x rows, zeros and scales): RW_STAGES - 1
// chunks are in flight while one is computed, and no register holds a load in flight, so two blocks an SM keep
// ~100 KB of reads outstanding (a register-staged form reached ~0.3 of copy bandwidth at 2-16 rows).
//
// Supported (checked on the host, cuda/ops/rows.py): M <= 16, N % 32 == 0, K % 32 == 0, group 32 or 64 or a
// multiple of 128.
#include "common.cuh"

#define RW_MAX_M 16       // token rows: the MMA's m (rows past M are zeros)
#define RW_WARPS 8        // 4 groups of 8 packed words (the block's 32-word column tile) x 2 k phases
#define RW_CHUNK 128      // rows of K a stage holds
#define RW_STAGES 4       // ring depth: RW_STAGES - 1 chunks in flight
#define RW_XLD 144        // a stage's x row stride in halves (72 words: rows g and g + 4 land 8 banks apart)
#define RW_GMAX 4         // groups a chunk may hold (group 32)
// a stage: weights [RW_CHUNK / 4 quads][32 words][16 B] (swizzled, below) | x [16][RW_XLD] | scales [RW_GMAX][256]
// | zeros [RW_GMAX][32]
#define RW_ST_W 0
#define RW_ST_X (RW_CHUNK / 4 * 32 * 16)
#define RW_ST_SC (RW_ST_X + RW_MAX_M * RW_XLD * 2)
#define RW_ST_Z (RW_ST_SC + RW_GMAX * 256 * 2)
#define RW_STAGE_BYTES (RW_ST_Z + RW_GMAX * 32 * 4)
static_assert(RW_STAGES * RW_STAGE_BYTES == 94208, "kuiper_py/cuda/ops/rows.py ROWS_SMEM launches this much");

// Two fp16 values as one MMA operand register.
__device__ __forceinline__ u32 h2u(half2 h) { return *reinterpret_cast<u32*>(&h); }

// A weight piece's 16-byte slot in a stage: row quad q, word w. Lanes 4g + t of a warp read quad 4s + t of words
// g; the XOR spreads the four quads of one word (512 B apart, one bank group) over 8 bank groups: conflict-free.
__device__ __forceinline__ int rw_slot(int q, int w) { return q * 32 + (w ^ ((q & 3) << 1)); }

// grid (column tiles of the (up to 3) matrices side by side, splits S over K), block 256, dynamic shared memory
// RW_STAGES * RW_STAGE_BYTES. The rows of split s are [s * rph, min(K, (s + 1) * rph)), rph % RW_CHUNK == 0.
// Output: out [M, ldo] fp16, the matrices' columns side by side; with S > 1 each block writes its sums to partial
// [S, M, Ntot] and the last block of a column tile (counters, zero between launches and left zero) sums them in
// split order (deterministic).
extern "C" __global__ void __launch_bounds__(256, 2)
gemv_rows(const half* __restrict__ x, int M, int K, int group,
          const u32* __restrict__ qw0, const u32* __restrict__ qz0, const half* __restrict__ sc0, int N0,
          const u32* __restrict__ qw1, const u32* __restrict__ qz1, const half* __restrict__ sc1, int N1,
          const u32* __restrict__ qw2, const u32* __restrict__ qz2, const half* __restrict__ sc2, int N2,
          half* __restrict__ out, int ldo, float* __restrict__ partial, unsigned* __restrict__ counters,
          int S, int rph) {
    extern __shared__ __align__(128) unsigned char smem[];
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
    const int W = N / 8, tw = min(32, W - tile * 32);  // the tile's packed words (tw % 4 == 0)
    const int k_lo = blockIdx.y * rph, k_hi = min(K, k_lo + rph);
    const int chunks = (k_hi - k_lo + RW_CHUNK - 1) / RW_CHUNK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wl = (warp & 3) * 8 + g;  // the lane's packed word in the tile (past tw: computed, never stored)
    const int kp = warp >> 2;           // the warp's k phase: it takes every other k16 step
    const int gshift = (group & (group - 1)) == 0 ? __ffs(group) - 1 : -1;
    const u32* wtile = qw + (size_t)tile * 32 * K;  // the tile: [K / 4 quads][tw words][4 rows]

    // Chunk c's cp.async pieces into its stage, every thread a share: the weights, zeros and scales (issue_w), which
    // may go out before the kernel before us has finished (PDL), and the rows of x (issue_x), which may not.
    auto issue_w = [&](int c) {
        if (c >= chunks) return;
        unsigned char* st = smem + (c % RW_STAGES) * RW_STAGE_BYTES;
        const int c0 = k_lo + c * RW_CHUNK, rows = min(RW_CHUNK, k_hi - c0), nq = rows / 4;
        const u32* src = wtile + (size_t)(c0 / 4) * tw * 4;  // the chunk's quads, contiguous
        for (int i = threadIdx.x; i < nq * tw; i += 256) {
            const int q = i / tw, w = i - q * tw;
            cp_async16(st + RW_ST_W + rw_slot(q, w) * 16, src + (size_t)i * 4, 16);
        }
        const int g0 = gshift >= 0 ? c0 >> gshift : c0 / group;
        const int ng = group >= RW_CHUNK ? 1 : (rows + group - 1) / group;
        for (int i = threadIdx.x; i < ng * (tw + tw / 4); i += 256) {
            const int gi = i / (tw + tw / 4), r = i - gi * (tw + tw / 4);
            if (r < tw)  // 8 scales of word r
                cp_async16(st + RW_ST_SC + (gi * 256 + r * 8) * 2, sc + (size_t)(g0 + gi) * N + tile * 256 + r * 8, 16);
            else         // 4 zero words
                cp_async16(st + RW_ST_Z + (gi * 32 + (r - tw) * 4) * 4, qz + (size_t)(g0 + gi) * W + tile * 32 + (r - tw) * 4, 16);
        }
    };
    auto issue_x = [&](int c) {  // x rows [M, rows]; then the chunk's commit group (empty past the end)
        if (c < chunks) {
            unsigned char* st = smem + (c % RW_STAGES) * RW_STAGE_BYTES;
            const int c0 = k_lo + c * RW_CHUNK, p8 = min(RW_CHUNK, k_hi - c0) / 8;
            for (int i = threadIdx.x; i < M * p8; i += 256) {
                const int m = i / p8, p = i - m * p8;
                cp_async16(st + RW_ST_X + (m * RW_XLD + p * 8) * 2, x + (size_t)m * K + c0 + p * 8, 16);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int c = 0; c < RW_STAGES - 1; ++c) issue_w(c);
    pdl_wait();  // x, the partials and the counters belong to the kernels before us
    pdl_trigger();
#pragma unroll
    for (int c = 0; c < RW_STAGES - 1; ++c) issue_x(c);  // (the first commit group holds the first chunks' weights)

    const bool row_lo = g < M, row_hi = g + 8 < M;  // the A rows this lane supplies hold tokens
    float acc[8][4];
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[c][i] = 0.f;

    for (int c = 0; c < chunks; ++c) {
        cp_async_wait<RW_STAGES - 2>();  // this thread's pieces of chunk c have landed
        __syncthreads();                 // everyone's have; and every warp is done with chunk c - 1's stage
        issue_w(c + RW_STAGES - 1);      // into chunk c - 1's stage
        issue_x(c + RW_STAGES - 1);
        const unsigned char* st = smem + (c % RW_STAGES) * RW_STAGE_BYTES;
        const uint4* ws = reinterpret_cast<const uint4*>(st + RW_ST_W);
        const half* xs = reinterpret_cast<const half*>(st + RW_ST_X);
        const u32* zs = reinterpret_cast<const u32*>(st + RW_ST_Z);
        const uint4* ss = reinterpret_cast<const uint4*>(st + RW_ST_SC);
        const int steps = min(RW_CHUNK, k_hi - k_lo - c * RW_CHUNK) / 16;
        half2 zb[4], s2[4];
        int gcur = -1;
        for (int s = kp; s < steps; s += 2) {
            const int gl = group >= RW_CHUNK ? 0 : (16 * s) >> gshift;  // the step's group in the chunk
            if (gl != gcur) {
                gcur = gl;
                awq_zero_bias(zs[gl * 32 + wl], zb);
                awq_scales8(ss[gl * 32 + wl], s2);
            }
            const uint4 wv = ws[rw_slot(4 * s + t, wl)];
            // A: tokens g and g + 8 at actual k 4t..4t+3 of this step (logical 2t, 2t+1 | 2t+8, 2t+9)
            const int kk = 16 * s + 4 * t;
            const uint2 xlo = row_lo ? *reinterpret_cast<const uint2*>(&xs[g * RW_XLD + kk]) : make_uint2(0, 0);
            const uint2 xhi = row_hi ? *reinterpret_cast<const uint2*>(&xs[(g + 8) * RW_XLD + kk]) : make_uint2(0, 0);
            const u32 a[4] = {xlo.x, xhi.x, xlo.y, xhi.y};
            // B: (q - z) * s of the word's 8 columns at the lane's 4 rows, one MMA per column
            half2 d0[4], d1[4], d2[4], d3[4];
            awq_dequant8(wv.x, zb, s2, d0);
            awq_dequant8(wv.y, zb, s2, d1);
            awq_dequant8(wv.z, zb, s2, d2);
            awq_dequant8(wv.w, zb, s2, d3);
#pragma unroll
            for (int p = 0; p < 4; ++p) {  // columns 2p (low halves) and 2p + 1 (high halves)
                mma_16816(acc[2 * p], a, h2u(__lows2half2(d0[p], d1[p])), h2u(__lows2half2(d2[p], d3[p])));
                mma_16816(acc[2 * p + 1], a, h2u(__highs2half2(d0[p], d1[p])), h2u(__highs2half2(d2[p], d3[p])));
            }
        }
    }
    cp_async_wait_all();  // (only empty groups are left)
    __syncthreads();      // every warp done with the stages: red takes their place
    // C: acc[c] = (token g, words 2t, 2t+1 of the warp's 8) | (token g + 8, same) at column c of those words.
    // The two k phases meet in red; phase 0 adds its own sums and stores.
    float (*red)[257] = reinterpret_cast<float (*)[257]>(smem);  // [16][257] (257: stores spread over the banks)
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
