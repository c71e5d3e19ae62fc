// Embedding gather and RMSNorm fused with the residual add. The residual stream h is fp32 so
// that 36-64 layers of additions do not round away the small updates; normed outputs are fp16.
#include "common.cuh"

// h[t, :] = float(table[ids[t], :]). grid T, block 256.
__global__ void embed_gather(const int* __restrict__ ids,     // [T]
                             const half* __restrict__ table,  // [V, D]
                             float* __restrict__ h,           // [T, D]
                             int D) {
    pdl_wait();
    pdl_trigger();
    const size_t row = (size_t)ids[blockIdx.x] * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) h[(size_t)blockIdx.x * D + d] = __half2float(table[row + d]);
}

// h += r (when r is not null); x = h / rms(h) * w. grid T, block up to 1024 (a multiple of 32): a
// decode step has one row, so the block must be wide and its loads unrolled, or the two passes
// become a chain of dependent memory round trips.
__global__ void add_rmsnorm(float* __restrict__ h,        // [T, D]
                            const half* __restrict__ r,   // [T, D] or null
                            const half* __restrict__ w,   // [D]
                            half* __restrict__ x,         // [T, D]
                            int D, float eps) {
    pdl_wait();
    pdl_trigger();
    __shared__ float red[32];
    float* hr = h + (size_t)blockIdx.x * D;
    const half* rr = r ? r + (size_t)blockIdx.x * D : nullptr;
    float ss = 0.f;
#pragma unroll 4
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float v = hr[d];
        if (rr) { v += __half2float(rr[d]); hr[d] = v; }
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, red) / D + eps);
#pragma unroll 4
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        x[(size_t)blockIdx.x * D + d] = __float2half(hr[d] * inv * __half2float(w[d]));
}
