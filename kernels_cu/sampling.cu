// Token selection on the GPU so that only one int32 crosses to the host per step.
//
// sample_token runs in ONE block of 1024 threads over the fp32 logits, in the order of Hugging
// Face's processors: repetition penalty, temperature, top-k, top-p, min-p; then an exact draw
// from the kept softmax by the Gumbel-max trick. Top-k and top-p thresholds are found by radix
// selection on order-preserving integer keys (4 rounds of 8 bits), so nothing is sorted.
// A temperature of 0 is greedy (lowest index among equal maxima, like numpy.argmax).
#include "common.cuh"

#define SMP_THREADS 1024

// float -> uint32 whose unsigned order is the float order
__device__ __forceinline__ u32 fkey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// counter-based uniform in (0, 1): a 64-bit mix of (seed, step, index)
__device__ __forceinline__ float uniform01(unsigned long long seed, unsigned long long step, u32 i) {
    unsigned long long z = seed ^ (step * 0x9E3779B97F4A7C15ull) ^ ((unsigned long long)i * 0xD1B54A32D192ED03ull);
    z ^= z >> 30; z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27; z *= 0x94D049BB133111EBull;
    z ^= z >> 31;
    return ((float)(z >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// (value, index) argmax over the block, ties to the lower index; result valid in every thread.
__device__ void block_argmax(float& v, int& idx, float* sv, int* si) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[wid] = v; si[wid] = idx; }
    __syncthreads();
    v = sv[lane]; idx = si[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
}

// Radix-select the largest key threshold such that the weight (count, or softmax mass when
// by_mass) of elements with key >= threshold reaches `target`. Elements below `floor_key` are out.
__device__ u32 radix_threshold(const float* x, int n, u32 floor_key, bool by_mass, float target, float mx,
                               float* hist, float* red) {
    u32 prefix = 0;
    float above = 0.f;  // weight of elements whose key is above the current prefix range
#pragma unroll 1
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0.f;
        __syncthreads();
        const u32 hi_mask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            u32 k = fkey(x[i]);
            if (k < floor_key || (k & hi_mask) != prefix) continue;
            atomicAdd(&hist[(k >> shift) & 0xFF], by_mass ? __expf(x[i] - mx) : 1.f);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float cum = above;
            int b = 255;
            for (; b > 0; --b) {
                if (cum + hist[b] >= target) break;
                cum += hist[b];
            }
            red[0] = __uint_as_float(prefix | ((u32)b << shift));
            red[1] = cum;
        }
        __syncthreads();
        prefix = __float_as_uint(red[0]);
        above = red[1];
        __syncthreads();
    }
    return prefix;
}

__global__ void __launch_bounds__(SMP_THREADS)
sample_token(float* __restrict__ logits,       // [V] scratch: penalised and scaled in place
             int n_valid,                       // ids >= n_valid (vocabulary padding) never chosen
             const int* __restrict__ hist_ids,  // [n_hist] recent tokens for the repetition penalty
             int n_hist, float penalty, float temperature, int top_k, float top_p, float min_p,
             unsigned long long seed, unsigned long long* __restrict__ step,
             int* __restrict__ out) {
    __shared__ float sv[32], hist[256], red[32];
    __shared__ int si[32];
    // repetition penalty: every read happens before any write, so duplicate ids apply once
    if (penalty != 1.f) {
        float pv = 0.f;
        int id = -1;
        if ((int)threadIdx.x < n_hist) {
            id = hist_ids[threadIdx.x];
            if (id >= 0 && id < n_valid) { pv = logits[id]; pv = pv > 0.f ? pv / penalty : pv * penalty; }
            else id = -1;
        }
        __syncthreads();
        if (id >= 0) logits[id] = pv;
        __syncthreads();
    }
    if (temperature == 0.f) {
        float v = -INFINITY;
        int idx = 0x7fffffff;
        for (int i = threadIdx.x; i < n_valid; i += blockDim.x) {
            float x = logits[i];
            if (x > v) { v = x; idx = i; }  // strided scan keeps the first maximum per thread
        }
        block_argmax(v, idx, sv, si);
        if (threadIdx.x == 0) { *out = idx == 0x7fffffff ? -1 : idx; *step += 1; }  // -1: all NaN
        return;
    }
    const float invt = 1.f / temperature;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < n_valid; i += blockDim.x) {
        float x = logits[i] * invt;
        logits[i] = x;
        mx = fmaxf(mx, x);
    }
    {
        int dummy = 0;
        block_argmax(mx, dummy, sv, si);
    }
    u32 thr = 0;  // keep keys >= thr
    if (top_k > 0 && top_k < n_valid)
        thr = radix_threshold(logits, n_valid, 0u, false, (float)top_k, mx, hist, red);
    if (top_p < 1.f) {
        float z = 0.f;
        for (int i = threadIdx.x; i < n_valid; i += blockDim.x)
            if (fkey(logits[i]) >= thr) z += __expf(logits[i] - mx);
        z = block_sum(z, red);
        __syncthreads();
        u32 tp = radix_threshold(logits, n_valid, thr, true, top_p * z, mx, hist, red);
        thr = max(thr, tp);
    }
    if (min_p > 0.f) thr = max(thr, fkey(mx + __logf(min_p)));
    const unsigned long long st = *step;
    float best = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n_valid; i += blockDim.x) {
        float x = logits[i];
        if (fkey(x) < thr) continue;
        float gmb = x - __logf(-__logf(uniform01(seed, st, (u32)i)));
        if (gmb > best) { best = gmb; idx = i; }
    }
    block_argmax(best, idx, sv, si);
    __syncthreads();
    if (threadIdx.x == 0) { *out = idx == 0x7fffffff ? -1 : idx; *step = st + 1; }
}
