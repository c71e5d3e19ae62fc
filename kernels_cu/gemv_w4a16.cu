// Decode (M = 1) W4A16 GEMV over AutoAWQ-packed weights, split over K, plus the split-K
// reductions that finish it (plain, SwiGLU).
//
// One launch can serve up to three matrices that share the input (Q/K/V, gate/up): blockIdx.x
// walks their column tiles back to back and the partial sums land in one [S, N0+N1+N2] buffer.
//
// Supported (checked on the host): N % 32 == 0, group size % 16 == 0, K % group size == 0.
#include "common.cuh"

#define GEMV_WARPS 8          // warps per block, each on its own ROWS-row slice of K
#define GEMV_ROWS 16          // rows per warp: 16 independent 16-byte loads in flight per lane
#define GEMV_COLS 1024        // columns per block: 32 lanes x 32 columns (four packed words)
#define GEMV_FLUSH 4          // rows accumulated in fp16 before folding into fp32 (overflow bound)

struct AwqMat {
    const u32* qw;    // [K, N/8]
    const u32* qz;    // [K/g, N/8]
    const half* sc;   // [K/g, N]
    int N;
};

// Scales and biased zeros of one lane's 32 columns for group gi; out-of-range words stay zero.
__device__ __forceinline__ void gemv_load_group(const AwqMat& m, int gi, int word0, int nwords,
                                                half2 (&zb)[4][4], half2 (&s2)[4][4]) {
    const u32* zrow = m.qz + (size_t)gi * nwords;
    const half* srow = m.sc + (size_t)gi * m.N;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        int w = word0 + j;
        u32 z = w < nwords ? zrow[w] : 0u;
        uint4 s = w < nwords ? *reinterpret_cast<const uint4*>(srow + w * 8) : make_uint4(0, 0, 0, 0);
        awq_zero_bias(z, zb[j]);
        // raw scales: the x/16 trick below already undoes the 16 of pairs 1 and 3
        s2[j][0] = *reinterpret_cast<half2*>(&s.x);
        s2[j][1] = *reinterpret_cast<half2*>(&s.y);
        s2[j][2] = *reinterpret_cast<half2*>(&s.z);
        s2[j][3] = *reinterpret_cast<half2*>(&s.w);
    }
}

// partial[split][col_off + col] = sum over split's 128-row K slice of x[k] * W[k, col], for the
// 1024 columns of column tile `tile` of m.
__device__ __forceinline__ void gemv_tile(const half* __restrict__ x, const AwqMat& m, int tile, int col_off,
                                          int n_total, float* __restrict__ partial, int split, int K, int group) {
    // per-warp column sums, reduced across warps; one pad word per 32 columns keeps the
    // lane-strided writes below off a single bank
    __shared__ float red[GEMV_WARPS][GEMV_COLS + GEMV_COLS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwords = m.N / 8;
    const int word0 = tile * (GEMV_COLS / 8) + lane * 4;
    const int k0 = split * (GEMV_WARPS * GEMV_ROWS) + warp * GEMV_ROWS;

    float acc[4][8];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;

    if (k0 < K && word0 < nwords) {
        // issue every load of the slice before the first use
        uint4 wv[GEMV_ROWS];
        const bool full = word0 + 4 <= nwords;
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            const u32* row = m.qw + (size_t)(k0 + r) * nwords + word0;
            if (full) {
                wv[r] = __ldg(reinterpret_cast<const uint4*>(row));
            } else {
                wv[r].x = row[0];
                wv[r].y = word0 + 1 < nwords ? row[1] : 0u;
                wv[r].z = word0 + 2 < nwords ? row[2] : 0u;
                wv[r].w = word0 + 3 < nwords ? row[3] : 0u;
            }
        }
        half xs[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) xs[r] = x[k0 + r];
        half2 zb[4][4], s2[4][4];
        gemv_load_group(m, k0 / group, word0, nwords, zb, s2);

        const half2 sixteenth = __float2half2_rn(0.0625f);
#pragma unroll
        for (int r0 = 0; r0 < GEMV_ROWS; r0 += GEMV_FLUSH) {
            half2 hacc[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int p = 0; p < 4; ++p) hacc[j][p] = __float2half2_rn(0.f);
#pragma unroll
            for (int r = r0; r < r0 + GEMV_FLUSH; ++r) {
                const half2 xlo = __half2half2(xs[r]);
                const half2 xhi = __hmul2(xlo, sixteenth);  // pairs 1,3 carry 16(q-z)
                const u32 words[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    half2 h[4];
                    awq_magic(words[j], h);
#pragma unroll
                    for (int p = 0; p < 4; ++p)
                        hacc[j][p] = __hfma2(__hsub2(h[p], zb[j][p]), (p & 1) ? xhi : xlo, hacc[j][p]);
                }
            }
            // fold into fp32 with the group's scale
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    float2 a = __half22float2(hacc[j][p]);
                    float2 s = __half22float2(s2[j][p]);
                    acc[j][2 * p] += a.x * s.x;
                    acc[j][2 * p + 1] += a.y * s.y;
                }
        }
    }
    // per-warp results to shared memory, then each thread sums 4 columns over the warps
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) red[warp][lane * 33 + j * 8 + i] = acc[j][i];
    __syncthreads();
    for (int c = threadIdx.x; c < GEMV_COLS; c += blockDim.x) {
        int col = tile * GEMV_COLS + c;
        if (col >= m.N) continue;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; ++w) s += red[w][c + c / 32];
        partial[(size_t)split * n_total + col_off + col] = s;
    }
}


// Split-K GEMV of up to three matrices sharing x. Matrices come as flat arguments (three AwqMat
// worth) so any launcher can pass them. grid (column tiles of all matrices, S), block 256.
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_w4a16(const half* __restrict__ x,  // [K]
           const u32* qw0, const u32* qz0, const half* sc0, int N0,
           const u32* qw1, const u32* qz1, const half* sc1, int N1,
           const u32* qw2, const u32* qz2, const half* sc2, int N2, int n_mats,
           float* __restrict__ partial,  // [S, N0+N1+N2]
           int K, int group) {
    const AwqMat m0{qw0, qz0, sc0, N0}, m1{qw1, qz1, sc1, N1}, m2{qw2, qz2, sc2, N2};
    // which matrix and column tile this block serves
    int tile = blockIdx.x, col_off = 0;
    AwqMat m = m0;
    int t0 = (m0.N + GEMV_COLS - 1) / GEMV_COLS;
    if (tile >= t0 && n_mats > 1) {
        tile -= t0; col_off = m0.N; m = m1;
        int t1 = (m1.N + GEMV_COLS - 1) / GEMV_COLS;
        if (tile >= t1 && n_mats > 2) { tile -= t1; col_off += m1.N; m = m2; }
    }
    const int n_total = m0.N + (n_mats > 1 ? m1.N : 0) + (n_mats > 2 ? m2.N : 0);
    gemv_tile(x, m, tile, col_off, n_total, partial, blockIdx.y, K, group);
}

// MoE decode: the same GEMV over the experts picked for the token, their ids read from device
// memory (so the step replays as a graph). Weights are expert stacks [E, K, N/8], [E, K/g, N/8],
// [E, K/g, N]; slot j = blockIdx.z uses x + j*x_slot_stride (0: all slots share x) and writes
// partial [k, S, N]. grid (ceil(N / 1024), S, k), block 256.
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_w4a16_experts(const half* __restrict__ x, int x_slot_stride,
                   const u32* qw, const u32* qz, const half* sc, int N,
                   const int* __restrict__ ids,  // [k] expert of each slot
                   float* __restrict__ partial,  // [k, S, N]
                   int K, int group) {
    const size_t e = (size_t)ids[blockIdx.z];
    const AwqMat m{qw + e * K * (N / 8), qz + e * (K / group) * (N / 8), sc + e * (K / group) * N, N};
    gemv_tile(x + (size_t)blockIdx.z * x_slot_stride, m, blockIdx.x, 0, N,
              partial + (size_t)blockIdx.z * gridDim.y * N, blockIdx.y, K, group);
}

// out[n] = sum_s partial[s, n] (fp16), n < N.
__global__ void splitk_reduce(const float* __restrict__ partial, int S, int N, half* __restrict__ out) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    float s = 0.f;
    for (int i = 0; i < S; ++i) s += partial[(size_t)i * N + n];
    out[n] = __float2half(s);
}

// SwiGLU epilogue: partial holds [gate (I) | up (I)] per split; out[i] = silu(gate) * up.
__global__ void splitk_reduce_swiglu(const float* __restrict__ partial, int S, int I, half* __restrict__ out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= I) return;
    float g = 0.f, u = 0.f;
    for (int s = 0; s < S; ++s) {
        g += partial[(size_t)s * 2 * I + i];
        u += partial[(size_t)s * 2 * I + I + i];
    }
    out[i] = __float2half(g / (1.f + __expf(-g)) * u);
}
