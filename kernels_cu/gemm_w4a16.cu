// Prefill (M > 1) W4A16 GEMM: C[M, N] fp16 = A[M, K] fp16 x dequant(W)[K, N].
//
// Multi-stage cp.async pipeline brings A tiles and *packed* weight tiles (with that K tile's
// group of scales and zeros) into shared memory; each K tile is dequantized once with LOP3 into
// an fp16 tile, which warps read with ldmatrix.trans into mma.sync.m16n8k16 (fp32 accumulate).
//
// Supported tile configurations (anything else is rejected on the host):
//   BM x BN x BK = 64 x 128 x 32, 4 warps as 2 x 2 (warp tile 32 x 64), 3 stages;
//   requires K % 32 == 0, group % 32 == 0, N % 32 == 0; any M >= 1 (rows past M are zero-filled).
#include "common.cuh"

#define BM 64
#define BN 128
#define BK 32
#define STAGES 3
#define A_PAD 8   // halves of padding per A row: 80-byte rows make ldmatrix conflict-free
#define B_PAD 8   // halves of padding per dequantized B row (272-byte rows)

struct GemmSmem {
    half a[STAGES][BM][BK + A_PAD];
    u32 w[STAGES][BK][BN / 8];
    half s[STAGES][BN];
    u32 z[STAGES][BN / 8];
    half b[BK][BN + B_PAD];
};

// Issue the async copies of K tile kt into stage st. 128 threads.
__device__ __forceinline__ void gemm_load_tile(GemmSmem& sm, int st, int kt, const half* A, const u32* qw,
                                               const u32* qz, const half* sc, int M, int N, int K, int group,
                                               int m0, int n0) {
    const int t = threadIdx.x;
    const int k0 = kt * BK;
    // A: 64 rows x 4 chunks of 8 halves
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        int c = t + i * 128, row = c >> 2, cc = c & 3;
        bool ok = m0 + row < M;
        const half* src = ok ? A + (size_t)(m0 + row) * K + k0 + cc * 8 : A;
        cp_async16(&sm.a[st][row][cc * 8], src, ok ? 16 : 0);
    }
    // packed weights: 32 rows x 4 chunks of 4 words
    {
        int row = t >> 2, cc = t & 3;
        int word = n0 / 8 + cc * 4;
        bool ok = word < N / 8;
        const u32* src = ok ? qw + (size_t)(k0 + row) * (N / 8) + word : qw;
        cp_async16(&sm.w[st][row][cc * 4], src, ok ? 16 : 0);
    }
    const int gi = k0 / group;
    if (t < 16) {  // scales: 128 halves
        int col = n0 + t * 8;
        bool ok = col < N;
        cp_async16(&sm.s[st][t * 8], ok ? sc + (size_t)gi * N + col : sc, ok ? 16 : 0);
    } else if (t < 20) {  // zeros: 16 words
        int word = n0 / 8 + (t - 16) * 4;
        bool ok = word < N / 8;
        cp_async16(&sm.z[st][(t - 16) * 4], ok ? qz + (size_t)gi * (N / 8) + word : qz, ok ? 16 : 0);
    }
}

__global__ void __launch_bounds__(128)
gemm_w4a16(const half* __restrict__ A,   // [M, K]
           const u32* __restrict__ qw,   // [K, N/8]
           const u32* __restrict__ qz,   // [K/g, N/8]
           const half* __restrict__ sc,  // [K/g, N]
           half* __restrict__ C,         // [M, N]
           int M, int N, int K, int group) {
    __shared__ __align__(16) GemmSmem sm;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
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
        if (s < KT) gemm_load_tile(sm, s, s, A, qw, qz, sc, M, N, K, group, m0, n0);
        cp_async_commit();
    }

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt visible to all; everyone is done reading the stage refilled next
        {
            int nk = kt + STAGES - 1;
            if (nk < KT) gemm_load_tile(sm, nk % STAGES, nk, A, qw, qz, sc, M, N, K, group, m0, n0);
            cp_async_commit();
        }
        const int st = kt % STAGES;
        // dequantize the packed tile: 32 rows x 16 words, 4 words per thread, 8 halves each
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int w = t + i * 128, row = w >> 4, cw = w & 15;
            half2 zb[4], s2[4], out[4];
            awq_zero_bias(sm.z[st][cw], zb);
            awq_scales8(*reinterpret_cast<const uint4*>(&sm.s[st][cw * 8]), s2);
            awq_dequant8(sm.w[st][row][cw], zb, s2, out);
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
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            int col = n0 + wn * 64 + nt * 8 + tq * 2;
            if (col >= N) continue;
            int row = m0 + wm * 32 + mt * 16 + g;
            if (row < M)
                *reinterpret_cast<half2*>(&C[(size_t)row * N + col]) = __floats2half2_rn(acc[mt][nt][0], acc[mt][nt][1]);
            if (row + 8 < M)
                *reinterpret_cast<half2*>(&C[(size_t)(row + 8) * N + col]) =
                    __floats2half2_rn(acc[mt][nt][2], acc[mt][nt][3]);
        }
}

// SwiGLU for prefill: out[i] = silu(gate[i]) * up[i] over M*I elements (fp16 in, fp32 math).
__global__ void silu_mul(const half* __restrict__ gate, const half* __restrict__ up, half* __restrict__ out,
                         int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = __half2float(gate[i]);
    out[i] = __float2half(g / (1.f + __expf(-g)) * __half2float(up[i]));
}
