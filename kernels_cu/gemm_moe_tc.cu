// MoE prefill's grouped expert GEMMs for few rows per expert: a batched GEMV on
// tensor cores. Why: with a few dozen rows per expert (30B-A3B prompts up to ~500 tokens) every expert's
// weights are read once per layer and each weight serves only its expert's few rows, so the GEMM should run at
// DRAM speed; gemm_moe_rs (register-A wgmma, weights staged through shared memory by bulk copies and mbarriers)
// reads them at ~1.3-1.5 TB/s there (docs/PERFORMANCE.md: its K-tile pipeline is issue-bound). Here each
// thread streams its packed words straight into registers, 16 bytes a load and a whole 128-k chunk ahead, as the
// decode GEMVs do, and only the block's x rows pass through shared memory (cp.async, 3 stages).
//
// Layout of the work. A block owns one 256-channel column tile (one 32-word tile of the tiled qweight,
// common.cuh) of one expert's TM-row tile (tile_offsets counted in tiles of TM rows; moe_tile_expert), 4 warps
// of 8 packed words (64 channels) each, over the whole K. The product is C^T = W^T x^T on mma.m16n8k16:
// channels are A's rows, tokens B's columns (NT = TM / 8 n8 tiles).
//   A: thread (g, t) = (lane / 4, lane % 4) of warp wp owns packed word w = 8 wp + g (channels 8w .. 8w + 7).
//      Its 16-byte load of step s (k 16s .. 16s + 15) is the word's row quad 4s + t: k = 16s + 4t + 0..3 (the tiled
//      layout's 4 rows of a word are contiguous). mma i (i = 0..3) takes rows g <- channel 8w + 2i and
//      g + 8 <- channel 8w + 2i + 1.
//   k order: a dot product does not care in which order k runs, so logical k (2t, 2t + 1 | 2t + 8, 2t + 9) of the
//      mma is physical k (4t, 4t + 1 | 4t + 2, 4t + 3) of the step, for A and B alike: a thread's 4 rows of its
//      word are its 4 k, and B's pair of registers is one 8-byte load of x[token][16s + 4t .. + 3].
//   so a0 = (c @ k0, c @ k1) and a1 = (c + 1 @ k0, c + 1 @ k1) pair two rows of one channel: tc_a_frags builds
//      them from the raw k0 and k1 words (a2 / a3 from k2 and k3).
// Each weight is loaded once, by one thread (gemm_moe_rs: by the 4 threads that share a word), dequantized once
// with the shared shift and masks of awq_magic, and multiplied into all NT token tiles.
// Rows past the expert's (tok_end) are zero-filled in the stage and not stored. GATHER 1 (gate|up): x is the
// [T, K] token rows and tile row r reads token perm_to_unperm[row] / k (no permuted copy, moe_gather_rows' work);
// GATHER 0 (down): x is [n, K] in permuted order.
// Supported: TM 16 or 32 (the table of ops_cupy.MOE_TC_TILES); N % 256 == 0, K % 128 == 0, group % 128 == 0
// (a chunk's scales and zeros are one group's). grid (N / 256, row tiles), block 128.
#include "common.cuh"

#define TC_CHUNK 128  // k per x stage and per pass of the weight ring (8 mma steps of 16)
#define TC_ST 3       // x stages
#define TC_RS 144     // halves per staged x row: 128 + 16 of padding, so the 8-byte B loads of a half-warp
                      // (rows g .. g + 3, 32 bytes each) fall in 32 different banks (288-byte rows)

// One step's A fragments of mma i = 0..3 from the thread's raw words q (rows k0..k3 of one packed word); zc / sc[c]:
// column c's zero bias and scale in both halves. Why this order: pairing two rows of a channel takes one byte_perm
// per 8 raw weights (4 per step) where pairing dequantized halves takes one per 2 (16 per step), and the kernel is
// issue-bound. byte_perm 0x5410 of words (k0, k1) keeps bytes 0-1 of each (nibbles 0-3:
// columns 0, 2, 4, 6; awq_magic's pair p of it is column 2p at (k0, k1)), 0x7632 bytes 2-3 (columns 1, 3, 5, 7:
// pair p is column 2p + 1); pair p is in the lo form for even p, the hi form for odd p, as in awq_dequant8, so each
// weight gets the same value as there.
__device__ __forceinline__ void tc_a_frags(uint4 q, const half2 (&zc)[8], const half2 (&sc)[8], u32 (&a)[4][4]) {
    half2 e01[4], o01[4], e23[4], o23[4];
    awq_magic(__byte_perm(q.x, q.y, 0x5410), e01);
    awq_magic(__byte_perm(q.x, q.y, 0x7632), o01);
    awq_magic(__byte_perm(q.z, q.w, 0x5410), e23);
    awq_magic(__byte_perm(q.z, q.w, 0x7632), o23);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const half2 v0 = __hmul2(awq_qz(e01[i], zc[2 * i], i & 1), sc[2 * i]);
        const half2 v1 = __hmul2(awq_qz(o01[i], zc[2 * i + 1], i & 1), sc[2 * i + 1]);
        const half2 v2 = __hmul2(awq_qz(e23[i], zc[2 * i], i & 1), sc[2 * i]);
        const half2 v3 = __hmul2(awq_qz(o23[i], zc[2 * i + 1], i & 1), sc[2 * i + 1]);
        a[i][0] = *reinterpret_cast<const u32*>(&v0);  // channel 2i at k0, k1
        a[i][1] = *reinterpret_cast<const u32*>(&v1);  // channel 2i + 1 at k0, k1
        a[i][2] = *reinterpret_cast<const u32*>(&v2);  // channel 2i at k2, k3
        a[i][3] = *reinterpret_cast<const u32*>(&v3);
    }
}

template <int TM, int GATHER>  // rows per tile (16 or 32), x gathered through perm_to_unperm (gate|up) or not (down)
__global__ void __launch_bounds__(128)
gemm_moe_tc(const half* __restrict__ x,          // GATHER: [T, K] tokens; else [n, K] permuted rows
            const int* __restrict__ perm_to_unperm, int k_top,  // GATHER: [n] and picks per token
            const u32* __restrict__ qw,           // [E][K, N/8] tiled
            const u32* __restrict__ qz,           // [E][K/g, N/8]
            const half* __restrict__ sc,          // [E][K/g, N]
            int N, half* __restrict__ out,        // [n, ldo] permuted rows
            int K, int group, int ldo,
            const int* __restrict__ offsets,      // [E+1] first permuted row of each expert
            const int* __restrict__ tile_offsets, // [E+1] first row tile of each expert (tiles of TM rows)
            int E) {
    static_assert(TM == 16 || TM == 32, "16 or 32 rows per tile");
    constexpr int NT = TM / 8, RPT = TM / 8;  // n8 token tiles; staged rows per thread (TM x 16 pieces / 128)
    __shared__ __align__(16) half xs[TC_ST][TM][TC_RS];
    const int tile = blockIdx.y;
    if (tile >= tile_offsets[E]) return;  // the grid is sized for the worst case
    const int e = moe_tile_expert(tile_offsets, E, tile);
    const int tok0 = offsets[e] + (tile - tile_offsets[e]) * TM, tok_end = min(offsets[e + 1], tok0 + TM);
    const int n0 = blockIdx.x * 256, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int w = 8 * (threadIdx.x >> 5) + g;  // the thread's packed word of the column tile
    // the thread's uint4 of step s: row quad 4s + t, word w of the tile's [K/4][32][4] words
    const uint4* wsrc = reinterpret_cast<const uint4*>(qw + (size_t)e * K * (N / 8) + (size_t)blockIdx.x * 32 * K)
                        + t * 32 + w;
    const half* ssrc = sc + (size_t)e * (K / group) * N + n0 + 8 * w;
    const u32* zsrc = qz + (size_t)e * (K / group) * (N / 8) + (n0 >> 3) + w;
    // the x rows this thread stages (rows threadIdx.x / 16 + 8 j, 16-byte piece threadIdx.x % 16 of each chunk)
    const half* xrow[RPT];
    int xbytes[RPT];
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
        const int row = tok0 + (threadIdx.x >> 4) + 8 * j;
        const bool in = row < tok_end;
        const int src = !in ? 0 : GATHER ? perm_to_unperm[row] / k_top : row;
        xrow[j] = x + (size_t)src * K + (threadIdx.x & 15) * 8;
        xbytes[j] = in ? 16 : 0;  // (zero-filled past the expert's rows)
    }
    const int nch = K / TC_CHUNK;
    auto stage_x = [&](int c) {  // chunk c's x into stage c % TC_ST; one commit group per call, empty past the end
        if (c < nch) {
#pragma unroll
            for (int j = 0; j < RPT; ++j)
                cp_async16(&xs[c % TC_ST][(threadIdx.x >> 4) + 8 * j][(threadIdx.x & 15) * 8], xrow[j] + c * TC_CHUNK,
                           xbytes[j]);
        }
        cp_async_commit();
    };
    stage_x(0);
    stage_x(1);
    uint4 ring[8];  // the words of the chunk being consumed; each slot refilled with the next chunk's as it is used
#pragma unroll
    for (int s = 0; s < 8; ++s) ring[s] = ld_stream16(wsrc + s * 128);
    uint4 sraw = __ldg(reinterpret_cast<const uint4*>(ssrc));
    u32 zraw = __ldg(zsrc);
    float acc[4][NT][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;
    for (int c = 0; c < nch; ++c) {
        half2 zb[4], s2[4];
        awq_zero_bias(zraw, zb);
        awq_scales8(sraw, s2);
        half2 zc[8], scb[8];  // column c's zero bias and scale in both halves
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            zc[2 * p] = __low2half2(zb[p]);
            zc[2 * p + 1] = __high2half2(zb[p]);
            scb[2 * p] = __low2half2(s2[p]);
            scb[2 * p + 1] = __high2half2(s2[p]);
        }
        if (c + 1 < nch) {  // the next chunk's group (a chunk lies in one group: group % 128 == 0)
            const int gi = (c + 1) * TC_CHUNK / group;
            sraw = __ldg(reinterpret_cast<const uint4*>(ssrc + (size_t)gi * N));
            zraw = __ldg(zsrc + (size_t)gi * (N / 8));
        }
        cp_async_wait<TC_ST - 2>();  // chunk c's rows landed (this thread's pieces) ...
        __syncthreads();             // ... and every thread's; every warp is done with chunk c - 1's stage
        stage_x(c + TC_ST - 1);      // into chunk c - 1's stage
        const half* xc = &xs[c % TC_ST][g][4 * t];
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            const uint4 q = ring[s];
            if (c + 1 < nch) ring[s] = ld_stream16(wsrc + (size_t)((c + 1) * 8 + s) * 128);
            u32 af[4][4];
            tc_a_frags(q, zc, scb, af);
            u32 b[NT][2];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const uint2 v = *reinterpret_cast<const uint2*>(xc + 8 * j * TC_RS + 16 * s);
                b[j][0] = v.x;
                b[j][1] = v.y;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) mma_16816(acc[i][j], af[i], b[j][0], b[j][1]);
        }
    }
    // C fragment of mma (i, j): acc[v] (row g, token 2t + v) and acc[v + 2] (row g + 8, token 2t + v), rows g and
    // g + 8 the channels 8w + 2i and 8w + 2i + 1
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int v = 0; v < 2; ++v) {
            const int tok = tok0 + 8 * j + 2 * t + v;
            if (tok < tok_end) {
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    *reinterpret_cast<half2*>(out + (size_t)tok * ldo + n0 + 8 * w + 2 * i) =
                        __floats2half2_rn(acc[i][j][v], acc[i][j][v + 2]);
            }
        }
}
