// Prefill (M > 1) W4A16 GEMM: C[M, N] fp16 = A[M, K] fp16 x dequant(W)[K, N].
// (Dense prefill takes awq_dequant + cuBLAS by default, see there; this fused GEMM serves the MoE
// grouped GEMMs where gemm_wgmma.cu's gemm_moe_rs does not run, and ops_cupy.gemm(path="mma").)
//
// Multi-stage cp.async pipeline brings A tiles and *packed* weight tiles (with that K tile's
// group of scales and zeros) into shared memory; each K tile is dequantized once with LOP3 into
// an fp16 tile, which warps read with ldmatrix.trans into mma.sync.m16n8k16 (fp32 accumulate).
//
// Supported tile configurations (anything else is rejected on the host):
//   BM x BN x BK = 128 x 128 x 32, 8 warps as 4 x 2 (warp tile 32 x 64), 3 stages: dense, M >= 1024;
//   BM x BN x BK =  64 x 128 x 32, 4 warps as 2 x 2 (warp tile 32 x 64), 3 stages: dense M < 1024, MoE;
//   requires K % 32 == 0, group % 32 == 0, N % 32 == 0; any M >= 1 (rows past M are zero-filled).
// The larger tile halves the dequantization work per MMA (the packed K tile is dequantized once per
// block whatever BM is).
//
// Three modes share the tile code (template parameter MODE):
//   GEMM_DENSE   C = A W for one matrix;
//   GEMM_GATHER_SWIGLU  MoE GEMM1: blockIdx.y walks the tiles of every expert (tile_offsets), A rows
//                are gathered through perm_to_unperm / k (no permuted copy of the activations), the
//                block's 128 columns are 64 gate and the matching 64 up columns of the expert's
//                [gate | up] weights (interleaved in 32-column chunks), and the epilogue writes
//                silu(gate) * up: C [T*k, I], requires I % 64 == 0;
//   GEMM_GROUPED MoE GEMM2: like the dense mode per expert, A and C in permuted row order.
#include "common.cuh"

#define BN 128
#define BK 32
#define STAGES 3
#define A_PAD 8   // halves of padding per A row: 80-byte rows make ldmatrix conflict-free
#define B_PAD 8   // halves of padding per dequantized B row (272-byte rows)

#define GEMM_DENSE 0
#define GEMM_GATHER_SWIGLU 1
#define GEMM_GROUPED 2

template <int BM>
struct GemmSmem {
    half a[STAGES][BM][BK + A_PAD];
    u32 w[STAGES][BK / 4 * BN / 8][4];  // [row quad][word][row in quad]
    half s[STAGES][BN];
    u32 z[STAGES][BN / 8];
    half b[BK][BN + B_PAD];
};

// First weight column of the block's 32-column chunk cc (0..3). In the SwiGLU mode chunks
// alternate gate, up, gate, up over the block's 64 gate columns starting at n0, so each warp's
// accumulators hold a gate column and its up column side by side.
template <int MODE>
__device__ __forceinline__ int gemm_chunk_col(int n0, int cc, int N) {
    if (MODE == GEMM_GATHER_SWIGLU) return n0 + (cc >> 1) * 32 + (cc & 1) * (N / 2);
    return n0 + cc * 32;
}

// Issue the async copies of K tile kt into stage st. 2 * BM threads. a_row[r] is the source row of
// tile row r in A, or -1 (zero-filled).
template <int MODE, int BM>
__device__ __forceinline__ void gemm_load_tile(GemmSmem<BM>& sm, int st, int kt, const half* A, const int* a_row,
                                               const u32* qw, const u32* qz, const half* sc, int N, int K,
                                               int group, int n0) {
    const int t = threadIdx.x;
    const int k0 = kt * BK;
    // A: BM rows x 4 chunks of 8 halves, two per thread
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        int c = t + i * 2 * BM, row = c >> 2, cc = c & 3;
        int src_row = a_row[row];
        const half* src = src_row >= 0 ? A + (size_t)src_row * K + k0 + cc * 8 : A;
        cp_async16(&sm.a[st][row][cc * 8], src, src_row >= 0 ? 16 : 0);
    }
    // packed weights, tiled layout (common.cuh): 8 row quads x 16 words, 16 bytes (4 rows of one
    // word) each, kept as [quad][word][4] in shared memory. The SwiGLU stacks hold gate and up as
    // two matrices of N/2 columns, one after the other. Threads 0-127.
    if (t < 128) {
        const int quad = t >> 4, cw = t & 15;
        int word = gemm_chunk_col<MODE>(n0, cw >> 2, N) / 8 + (cw & 3), W = N / 8;
        const u32* base = qw;
        if (MODE == GEMM_GATHER_SWIGLU && word >= N / 16) { base += (size_t)K * (N / 16); word -= N / 16; }
        if (MODE == GEMM_GATHER_SWIGLU) W = N / 16;
        const bool ok = word < W;
        const u32* src = ok ? base + awq_tiled_offset(k0 + quad * 4, word, W, K) : qw;
        cp_async16(&sm.w[st][quad * 16 + cw][0], src, ok ? 16 : 0);
    }
    const int gi = k0 / group, u = t - (2 * BM - 32);  // the last warp loads scales and zeros
    if (u >= 0 && u < 16) {  // scales: 128 halves
        int col = gemm_chunk_col<MODE>(n0, u >> 2, N) + (u & 3) * 8;
        bool ok = col < N;
        cp_async16(&sm.s[st][u * 8], ok ? sc + (size_t)gi * N + col : sc, ok ? 16 : 0);
    } else if (u >= 16 && u < 20) {  // zeros: 16 words
        int word = gemm_chunk_col<MODE>(n0, u - 16, N) / 8;
        bool ok = word < N / 8;
        cp_async16(&sm.z[st][(u - 16) * 4], ok ? qz + (size_t)gi * (N / 8) + word : qz, ok ? 16 : 0);
    }
}

// The main loop and epilogue of one BM x BN tile. a_row / c_row (shared, BM entries) give each
// tile row's source row in A and destination row in C, -1 for rows past the end.
template <int MODE, int BM>
__device__ __forceinline__ void gemm_tile(GemmSmem<BM>& sm, const int* a_row, const int* c_row, const half* A,
                                          const u32* qw, const u32* qz, const half* sc, half* C, int N, int K,
                                          int group, int n0) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int KT = K / BK;

    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) gemm_load_tile<MODE, BM>(sm, s, s, A, a_row, qw, qz, sc, N, K, group, n0);
        cp_async_commit();
    }

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt visible to all; everyone is done reading the stage refilled next
        {
            int nk = kt + STAGES - 1;
            if (nk < KT) gemm_load_tile<MODE, BM>(sm, nk % STAGES, nk, A, a_row, qw, qz, sc, N, K, group, n0);
            cp_async_commit();
        }
        const int st = kt % STAGES;
        // dequantize the packed tile: 32 rows x 16 words, 4 words per thread, 8 halves each. A warp
        // takes one row quad x 8 words, lane = (row in quad) * 8 + word: its 4-byte reads of sm.w hit
        // 32 distinct banks, and each 8-lane phase of its 16-byte sm.b stores covers one row's 128 bytes
#pragma unroll
        for (int i = 0; i < 512 / (2 * BM); ++i) {
            const int wi = (t >> 5) + i * (BM / 16), lane = t & 31;
            const int row = (wi >> 1) * 4 + (lane >> 3), cw = (wi & 1) * 8 + (lane & 7);
            half2 zb[4], s2[4], out[4];
            awq_zero_bias(sm.z[st][cw], zb);
            awq_scales8(*reinterpret_cast<const uint4*>(&sm.s[st][cw * 8]), s2);
            awq_dequant8(sm.w[st][(row >> 2) * 16 + cw][row & 3], zb, s2, out);
            *reinterpret_cast<uint4*>(&sm.b[row][cw * 8]) = *reinterpret_cast<uint4*>(out);
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            u32 af[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
                ldmatrix_x4(af[mt], &sm.a[st][wm * 32 + mt * 16 + (lane & 15)][kk + (lane >> 4) * 8]);
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                u32 bf[4];
                ldmatrix_x4_trans(bf, &sm.b[kk + (lane & 15)][wn * 64 + np * 16 + (lane >> 4) * 8]);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_16816(acc[mt][np * 2], af[mt], bf[0], bf[1]);
                    mma_16816(acc[mt][np * 2 + 1], af[mt], bf[2], bf[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    const int g = lane >> 2, tq = lane & 3;
    if constexpr (MODE == GEMM_GATHER_SWIGLU) {
        // nt < 4: gate columns n0 + wn*32 + nt*8 + 2tq (+1); nt + 4: the same up columns
        const int I = N / 2;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                int col = n0 + wn * 32 + nt * 8 + tq * 2;
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    int r = c_row[wm * 32 + mt * 16 + g + hh * 8];
                    if (r < 0) continue;
                    float g0 = acc[mt][nt][2 * hh], g1 = acc[mt][nt][2 * hh + 1];
                    float u0 = acc[mt][nt + 4][2 * hh], u1 = acc[mt][nt + 4][2 * hh + 1];
                    *reinterpret_cast<half2*>(&C[(size_t)r * I + col]) = __floats2half2_rn(
                        g0 / (1.f + __expf(-g0)) * u0, g1 / (1.f + __expf(-g1)) * u1);
                }
            }
    } else {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                int col = n0 + wn * 64 + nt * 8 + tq * 2;
                if (col >= N) continue;
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    int r = c_row[wm * 32 + mt * 16 + g + hh * 8];
                    if (r >= 0)
                        *reinterpret_cast<half2*>(&C[(size_t)r * N + col]) =
                            __floats2half2_rn(acc[mt][nt][2 * hh], acc[mt][nt][2 * hh + 1]);
                }
            }
    }
}

template <int BM>
__global__ void __launch_bounds__(2 * BM)
gemm_w4a16(const half* __restrict__ A,   // [M, K]
           const u32* __restrict__ qw,   // [K, N/8], tiled layout (common.cuh)
           const u32* __restrict__ qz,   // [K/g, N/8]
           const half* __restrict__ sc,  // [K/g, N]
           half* __restrict__ C,         // [M, N]
           int M, int N, int K, int group) {
    __shared__ __align__(16) GemmSmem<BM> sm;
    __shared__ int rows[BM];
    const int m0 = blockIdx.y * BM;
    if (threadIdx.x < BM) rows[threadIdx.x] = m0 + (int)threadIdx.x < M ? m0 + (int)threadIdx.x : -1;
    __syncthreads();
    gemm_tile<GEMM_DENSE, BM>(sm, rows, rows, A, qw, qz, sc, C, N, K, group, blockIdx.x * BN);
}

// MoE grouped GEMMs over the expert stacks (weights [E, K, N/8], [E, K/g, N/8], [E, K/g, N]).
// blockIdx.y enumerates the row tiles of all experts (tile_offsets from moe_expert_maps; blocks
// past the last tile exit), blockIdx.x the column tiles (64 output columns in the SwiGLU mode).
//   gather_swiglu: A = x [T, K] read through perm_to_unperm / k; C = act [T*k, N/2] (permuted).
//   grouped:       A = act [T*k, K] (permuted); C = y [T*k, N] (permuted).
template <int MODE>
__device__ __forceinline__ void gemm_moe(const half* A, const u32* qw, const u32* qz, const half* sc, half* C,
                                         const int* offsets, const int* tile_offsets,
                                         const int* perm_to_unperm, int top_k, int E, int N, int K, int group) {
    constexpr int BM = 64;  // the expert maps count row tiles of this size (ops_cupy passes GEMM_BM as tile_m)
    __shared__ __align__(16) GemmSmem<BM> sm;
    __shared__ int a_row[BM], c_row[BM];
    const int tile = blockIdx.y;
    if (tile >= tile_offsets[E]) return;  // the grid is sized for the worst case
    const int e = moe_tile_expert(tile_offsets, E, tile);
    const int r0 = offsets[e] + (tile - tile_offsets[e]) * BM, r1 = offsets[e + 1];
    if (threadIdx.x < BM) {
        int r = r0 + (int)threadIdx.x;
        bool ok = r < r1;
        c_row[threadIdx.x] = ok ? r : -1;
        a_row[threadIdx.x] = !ok ? -1 : (MODE == GEMM_GATHER_SWIGLU ? perm_to_unperm[r] / top_k : r);
    }
    __syncthreads();
    const size_t kw = (size_t)K * (N / 8), gw = (size_t)(K / group) * (N / 8), gs = (size_t)(K / group) * N;
    const int n0 = blockIdx.x * (MODE == GEMM_GATHER_SWIGLU ? BN / 2 : BN);
    gemm_tile<MODE, BM>(sm, a_row, c_row, A, qw + e * kw, qz + e * gw, sc + e * gs, C, N, K, group, n0);
}

__global__ void __launch_bounds__(128)
gemm_moe_gate_up(const half* __restrict__ x,            // [T, K]
                 const u32* __restrict__ qw,            // [E, 2, K, I/8]: gate, up, each tiled
                 const u32* __restrict__ qz,            // [E, K/g, 2I/8]
                 const half* __restrict__ sc,           // [E, K/g, 2I]
                 half* __restrict__ act,                // [T*k, I] permuted rows
                 const int* __restrict__ offsets,       // [E+1]
                 const int* __restrict__ tile_offsets,  // [E+1]
                 const int* __restrict__ perm_to_unperm,  // [T*k]
                 int top_k, int E, int N, int K, int group) {
    gemm_moe<GEMM_GATHER_SWIGLU>(x, qw, qz, sc, act, offsets, tile_offsets, perm_to_unperm, top_k, E, N, K, group);
}

__global__ void __launch_bounds__(128)
gemm_moe_down(const half* __restrict__ act,           // [T*k, K] permuted rows
              const u32* __restrict__ qw,             // [E, K, N/8], each expert tiled
              const u32* __restrict__ qz,             // [E, K/g, N/8]
              const half* __restrict__ sc,            // [E, K/g, N]
              half* __restrict__ y,                   // [T*k, N] permuted rows
              const int* __restrict__ offsets,        // [E+1]
              const int* __restrict__ tile_offsets,   // [E+1]
              int E, int N, int K, int group) {
    gemm_moe<GEMM_GROUPED>(act, qw, qz, sc, y, offsets, tile_offsets, nullptr, 1, E, N, K, group);
}

// Dense prefill dequantizes the weights once per call into an fp16 scratch matrix and hands the
// product to cuBLAS (ops_cupy.gemm, the path vLLM and llama.cpp take for big batches): cuBLAS's
// FP16 GEMM outruns this file's mma.sync tile ~3x at M >= 512, and was faster at every M measured
// down to 4; writing K x N halves costs about one extra weight pass. A thread owns one 16-byte tiled load
// (4 rows of one packed word) and writes those rows' 8 columns with 16-byte stores, so a warp
// reads 512 contiguous bytes and writes four 512-byte row spans. The output row stride ldw lets
// several matrices with the same K (q, k, v) land side by side in one [K, ldw] matrix, so cuBLAS
// multiplies them in one call.
// Thread i of a matrix's grid of ceil(N/256) column tiles x (K/4) row quads x 32 words: consecutive threads take
// consecutive words of one row quad inside a 32-word tile; threads past the matrix return.
__device__ __forceinline__ void dequant_quad(const u32* __restrict__ qw,   // [K, N/8], tiled layout (common.cuh)
                                             const u32* __restrict__ qz,   // [K/g, N/8]
                                             const half* __restrict__ sc,  // [K/g, N]
                                             half* __restrict__ W,         // [K, ldw] row-major, columns [0, N)
                                             int N, int K, int group, int ldw, size_t i) {
    const int Wd = N / 8;
    const int t = (int)(i / ((size_t)(K / 4) * 32)), r = (int)(i % ((size_t)(K / 4) * 32));
    if (t * 32 >= Wd) return;
    const int tw = min(32, Wd - t * 32);
    if (r >= (K / 4) * tw) return;  // a narrower last tile has fewer words per quad
    const int k = (r / tw) * 4, w = t * 32 + r % tw;
    const uint4 q = *reinterpret_cast<const uint4*>(qw + awq_tiled_offset(k, w, Wd, K));
    const int gi = k / group;  // group % 4 == 0: the quad's four rows share a group
    half2 zb[4], s2[4], o[4];
    awq_zero_bias(qz[(size_t)gi * Wd + w], zb);
    awq_scales8(*reinterpret_cast<const uint4*>(sc + (size_t)gi * N + w * 8), s2);
    const u32 rows[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        awq_dequant8(rows[j], zb, s2, o);
        *reinterpret_cast<uint4*>(W + (size_t)(k + j) * ldw + w * 8) = *reinterpret_cast<uint4*>(o);
    }
}

__global__ void __launch_bounds__(256)
awq_dequant(const u32* __restrict__ qw,   // [K, N/8], tiled layout (common.cuh)
            const u32* __restrict__ qz,   // [K/g, N/8]
            const half* __restrict__ sc,  // [K/g, N]
            half* __restrict__ W,         // [K, ldw] row-major, columns [0, N) written
            int N, int K, int group, int ldw) {
    dequant_quad(qw, qz, sc, W, N, K, group, ldw, (size_t)blockIdx.x * blockDim.x + threadIdx.x);
}

// Up to three matrices with the same K (q, k and v) side by side in one launch: blockIdx.y picks the matrix and
// its first column (0, N0, N0 + N1), so the host pays one launch where it paid three.
// A slot with N 0 writes nothing; the columns stay 16-byte aligned (every N % 8 == 0).
__global__ void __launch_bounds__(256)
awq_dequant3(const u32* __restrict__ qw0, const u32* __restrict__ qz0, const half* __restrict__ sc0, int N0,
             const u32* __restrict__ qw1, const u32* __restrict__ qz1, const half* __restrict__ sc1, int N1,
             const u32* __restrict__ qw2, const u32* __restrict__ qz2, const half* __restrict__ sc2, int N2,
             half* __restrict__ W,  // [K, ldw] row-major, columns [0, N0 + N1 + N2) written
             int K, int group, int ldw) {
    // grid: (the widest matrix's blocks of awq_dequant, the matrices)
    const int m = blockIdx.y;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (m == 0) dequant_quad(qw0, qz0, sc0, W, N0, K, group, ldw, i);
    else if (m == 1) dequant_quad(qw1, qz1, sc1, W + N0, N1, K, group, ldw, i);
    else dequant_quad(qw2, qz2, sc2, W + N0 + N1, N2, K, group, ldw, i);
}

// SwiGLU for prefill: out[t, c] = silu(gate[t, c]) * up[t, c] over n = M*I elements (fp16 in, fp32
// math), 8 per thread with 16-byte accesses. gate and up rows lie ld elements apart: ld == I for
// separate matrices, 2I for the halves of one [M, 2I] product (gate and up in one GEMM launch).
// n, I and ld % 8 == 0; the arrays 16-byte aligned.
__global__ void silu_mul(const half* __restrict__ gate,  // [M, ld]: columns 0 .. I-1 read
                         const half* __restrict__ up,    // [M, ld]: columns 0 .. I-1 read
                         half* __restrict__ out,         // [M, I]
                         int n, int I, int ld) {
    const int i = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    const size_t src = (size_t)(i / I) * ld + i % I;
    uint4 gv = *reinterpret_cast<const uint4*>(gate + src), uv = *reinterpret_cast<const uint4*>(up + src), ov;
    const half2* g2 = reinterpret_cast<const half2*>(&gv);
    const half2* u2 = reinterpret_cast<const half2*>(&uv);
    half2* o2 = reinterpret_cast<half2*>(&ov);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 g = __half22float2(g2[j]), u = __half22float2(u2[j]);
        o2[j] = __floats2half2_rn(g.x / (1.f + __expf(-g.x)) * u.x, g.y / (1.f + __expf(-g.y)) * u.y);
    }
    *reinterpret_cast<uint4*>(out + i) = ov;
}
