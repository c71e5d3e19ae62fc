// Embedding gather and RMSNorm fused with the residual add. The residual stream h is fp32 so
// that 36-64 layers of additions do not round away the small updates; normed outputs are fp16.
#include "common.cuh"

// h[t, :] = float(table[ids[t], :]). grid T, block 256, D % 8 == 0. The table may be pinned host
// memory read over the bus: every 16-byte load of the row is issued before any is used, so a row
// costs one bus round trip, not one per 256 elements.
#define EMBED_MAX_VEC 4  // 16-byte loads per thread: D <= 256 * 8 * EMBED_MAX_VEC = 8192
__global__ void embed_gather(const int* __restrict__ ids,     // [T]
                             const half* __restrict__ table,  // [V, D] device or pinned host memory
                             float* __restrict__ h,           // [T, D]
                             int D) {
    pdl_wait();
    pdl_trigger();
    const uint4* row = reinterpret_cast<const uint4*>(table + (size_t)ids[blockIdx.x] * D);
    float4* out = reinterpret_cast<float4*>(h + (size_t)blockIdx.x * D);
    const int nv = D / 8;
    uint4 v[EMBED_MAX_VEC];
#pragma unroll
    for (int j = 0; j < EMBED_MAX_VEC; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < nv) v[j] = row[i];
    }
#pragma unroll
    for (int j = 0; j < EMBED_MAX_VEC; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i >= nv) continue;
        float f[8];
        unpack8(v[j], f);
        out[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
        out[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
}

// h += r (when r is not null); x = h / rms(h) * w. Each thread one 8-element chunk by 16-byte loads and
// stores, the row kept in registers between the two passes (2- and 4-byte accesses ran at ~0.6 of the copy
// rate on prefill rows: docs/PERFORMANCE.md), so a decode row costs one round trip per pass, not a loop
// of them. grid T, block ceil(D / 8 / 32) * 32, D % 8 == 0 and D <= 8192. Each thread sums its 8 squares in
// order, then block_sum.
// pend (T = 1, instead of r): a decode projection's pending output in fixed point (gemv_w4a16's
// accumulating mode), added as its fp16 rounding and cleared for the next step.
// y (instead of r): a MoE prefill's expert rows, r = fp16(sum_j wts[t, j] * y[u2p[t*k + j]]) by the helpers
// moe.cu moe_finalize uses (the same bits), without writing r and reading it back; k <= 32 and <= the block.
__global__ void add_rmsnorm(float* __restrict__ h,          // [T, D]
                            const half* __restrict__ r,     // [T, D] or null
                            const half* __restrict__ w,     // [D]
                            half* __restrict__ x,           // [T, D]
                            int D, float eps,
                            long long* __restrict__ pend,   // [D] or null
                            const half* __restrict__ y,     // [T*k, D] permuted expert rows, or null
                            const int* __restrict__ u2p,    // [T*k] unpermuted -> permuted row
                            const float* __restrict__ wts,  // [T, k] routing weights
                            int k) {
    pdl_wait();
    pdl_trigger();
    __shared__ float red[32];
    __shared__ int yrow[32];
    __shared__ float ywt[32];
    const int c = threadIdx.x;
    if (y) expert_rows_stage(u2p, wts, blockIdx.x, k, yrow, ywt);
    const bool on = c < D / 8;
    float4* hr = reinterpret_cast<float4*>(h + (size_t)blockIdx.x * D) + 2 * c;
    float v[8];
    float ss = 0.f;
    if (on) {
        const float4 a = hr[0], b = hr[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        if (y) {
            float s[8];
            expert_rows_sum8(y, yrow, ywt, k, D, c, s);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] += __half2float(__float2half_rn(s[i]));
        } else if (r) {
            float f[8];
            unpack8(reinterpret_cast<const uint4*>(r + (size_t)blockIdx.x * D)[c], f);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] += f[i];
        } else if (pend) {
            longlong2* p = reinterpret_cast<longlong2*>(pend) + 4 * c;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const longlong2 q = p[i];
                v[2 * i] += fix_h(q.x);
                v[2 * i + 1] += fix_h(q.y);
                p[i] = make_longlong2(0, 0);
            }
        }
        if (y || r || pend) {
            hr[0] = make_float4(v[0], v[1], v[2], v[3]);
            hr[1] = make_float4(v[4], v[5], v[6], v[7]);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) ss += v[i] * v[i];
    }
    const float inv = rsqrtf(block_sum(ss, red) / D + eps);
    if (on) {
        float f[8];
        unpack8(reinterpret_cast<const uint4*>(w)[c], f);
        uint4 o;
        half2* oh = reinterpret_cast<half2*>(&o);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            oh[i] = __halves2half2(__float2half(v[2 * i] * inv * f[2 * i]), __float2half(v[2 * i + 1] * inv * f[2 * i + 1]));
        reinterpret_cast<uint4*>(x + (size_t)blockIdx.x * D)[c] = o;
    }
}
