// Qwen3's per-head q/k RMSNorm, rotate-half RoPE and the KV-cache write, fused in one pass.
// One warp per (token, head); heads 0..H-1 are queries, H..H+KV-1 keys, then KV values (copied).
// A lane holds HD/64 consecutive dims of each half, so the rotation pairs d and d + HD/2 meet in
// the same lane.
#include "common.cuh"

template <int HD>
__global__ void __launch_bounds__(128)
qk_norm_rope_store(const half* __restrict__ qin, int q_stride,   // [T, q_stride], H*HD used
                   const half* __restrict__ kin, int k_stride,   // [T, k_stride], KV*HD used
                   const half* __restrict__ vin, int v_stride,
                   const half* __restrict__ qn,                  // [HD] q_norm weight
                   const half* __restrict__ kn,                  // [HD] k_norm weight
                   const float* __restrict__ cosb,               // [ctx, HD/2]
                   const float* __restrict__ sinb,
                   half* __restrict__ qout,                      // [T, H, HD]
                   half* __restrict__ Kc,                        // [ctx, KV, HD] this layer
                   half* __restrict__ Vc,
                   int H, int KV, int pos0,
                   const int* __restrict__ pos_dev,  // when set, pos0 is read here (graph replay)
                   float eps) {
    pdl_wait();
    pdl_trigger();
    constexpr int P = HD / 64;
    const int tok = blockIdx.x, lane = threadIdx.x & 31;
    const int head = blockIdx.y * 4 + (threadIdx.x >> 5);
    if (head >= H + 2 * KV) return;
    const int pos = (pos_dev ? *pos_dev : pos0) + tok;
    const int d0 = lane * P;
    if (head >= H + KV) {  // value head: straight copy into the cache
        const int vh = head - H - KV;
        const half* src = vin + (size_t)tok * v_stride + vh * HD;
        half* dst = Vc + ((size_t)pos * KV + vh) * HD;
#pragma unroll
        for (int i = 0; i < P; ++i) { dst[d0 + i] = src[d0 + i]; dst[HD / 2 + d0 + i] = src[HD / 2 + d0 + i]; }
        return;
    }
    const bool is_q = head < H;
    const half* src = is_q ? qin + (size_t)tok * q_stride + head * HD : kin + (size_t)tok * k_stride + (head - H) * HD;
    const half* nw = is_q ? qn : kn;
    float a[P], b[P];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        a[i] = __half2float(src[d0 + i]);
        b[i] = __half2float(src[HD / 2 + d0 + i]);
        ss += a[i] * a[i] + b[i] * b[i];
    }
    const float inv = rsqrtf(warp_sum(ss) / HD + eps);
    half* dst = is_q ? qout + ((size_t)tok * H + head) * HD : Kc + ((size_t)pos * KV + (head - H)) * HD;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        float x1 = a[i] * inv * __half2float(nw[d0 + i]);
        float x2 = b[i] * inv * __half2float(nw[HD / 2 + d0 + i]);
        float c = cosb[(size_t)pos * (HD / 2) + d0 + i], s = sinb[(size_t)pos * (HD / 2) + d0 + i];
        dst[d0 + i] = __float2half(x1 * c - x2 * s);
        dst[HD / 2 + d0 + i] = __float2half(x2 * c + x1 * s);
    }
}

// The decode graph's last node: the next replay works one position further on.
// The decode step's last kernel: the next position, and with arg_slot (greedy decode's argmax from
// lm_head_gemv) the id itself (publish_token): into token, the next step's embedding, and the mapped
// pinned token_host[1 + new position % 2] (by parity, since the host may still be reading the previous
// step's while this one runs), the slot cleared for the next step.
__global__ void advance_position(int* pos, unsigned long long* arg_slot, int* token, int* token_host) {
    pdl_wait();
    const int p = *pos + 1;
    *pos = p;
    if (arg_slot) {
        const unsigned long long k = *arg_slot;
        *arg_slot = 0;
        publish_token(k ? (int)(0xFFFFFFFFu - (unsigned)k) : -1, token, token_host + 1 + (p & 1));
    }
}
