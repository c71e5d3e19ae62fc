// FP16 lm_head GEMV: logits[v] = sum_d x[d] * W[v, d], fp32 out. Each warp owns LMH_ROWS rows and
// reads them with 16-byte coalesced loads; x is staged once per block in shared memory.
#include "common.cuh"

#define LMH_ROWS 4

// (logit, row) -> a 64-bit key whose unsigned order is "larger logit, then lower row": greedy decode's
// argmax as one atomicMax per block. 0 means no row (every logit NaN).
__device__ __forceinline__ unsigned long long argmax_key(float v, int row) {
    return ((unsigned long long)float_key(v) << 32) | (0xFFFFFFFFu - (u32)row);
}

// grid ceil(V / (8 * LMH_ROWS)), block 256; D % 8 == 0, D <= 8192.
__global__ void __launch_bounds__(256)
lm_head_gemv(const half* __restrict__ x,   // [D]
             const half* __restrict__ W,   // [V, D]
             float* __restrict__ logits,   // [V]
             int V, int D,
             // null, or greedy decode's argmax slot: the block's best (argmax_key) of rows < n_arg (never
             // NaN) atomicMax'ed in, so the draw needs no kernel (advance_position reads and clears it)
             unsigned long long* __restrict__ arg_slot, int n_arg) {
    pdl_wait();
    pdl_trigger();
    __shared__ __align__(16) half xs[8192];
    for (int i = threadIdx.x * 8; i < D; i += blockDim.x * 8)
        *reinterpret_cast<uint4*>(&xs[i]) = *reinterpret_cast<const uint4*>(&x[i]);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int v0 = (blockIdx.x * 8 + warp) * LMH_ROWS;
    float acc[LMH_ROWS];
#pragma unroll
    for (int r = 0; r < LMH_ROWS; ++r) acc[r] = 0.f;
    for (int c = lane * 8; c < D; c += 256) {
        const uint4 xv = *reinterpret_cast<const uint4*>(&xs[c]);
        const half2* xh = reinterpret_cast<const half2*>(&xv);
#pragma unroll
        for (int r = 0; r < LMH_ROWS; ++r) {
            if (v0 + r >= V) break;
            const uint4 wv = ld_stream16(&W[(size_t)(v0 + r) * D + c]);
            const half2* wh = reinterpret_cast<const half2*>(&wv);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float2 a = __half22float2(xh[i]), b = __half22float2(wh[i]);
                acc[r] += a.x * b.x + a.y * b.y;
            }
        }
    }
    unsigned long long best = 0;
#pragma unroll
    for (int r = 0; r < LMH_ROWS; ++r) {
        float s = warp_sum(acc[r]);
        if (lane == 0 && v0 + r < V) logits[v0 + r] = s;
        if (v0 + r < n_arg && s == s) best = max(best, argmax_key(s, v0 + r));
    }
    if (arg_slot) {  // the block's best of its warps', one atomic per block (4748 for Qwen3's vocabulary)
        __shared__ unsigned long long wbest[8];
        if (lane == 0) wbest[warp] = best;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < 8; ++w) best = max(best, wbest[w]);
            if (best) atomicMax(arg_slot, best);
        }
    }
}
