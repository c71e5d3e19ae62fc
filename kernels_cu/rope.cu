// Qwen3's per-head q/k RMSNorm, rotate-half RoPE and the KV-cache write, fused in one pass; and the
// decode graph's last node, which moves the position on.
#include "common.cuh"

// Heads 0..H-1 are queries, H..H+KV-1 keys, then KV values (copied). By 16-byte accesses (2-byte loads and
// stores ran at ~0.4 of the copy rate on prefill rows: docs/PERFORMANCE.md). A head takes HD/16 lanes;
// lane j of its group holds dims 8j..8j+7 of each half, so the rotation pairs d and d + HD/2 meet in the lane,
// and the head's sum of squares is a shuffle over the group. grid (T, ceil((H + 2 KV) / (4 * 32 / (HD / 16)))),
// block 128. Every row start and stride 16-byte aligned (the host checks).
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
    constexpr int LH = HD / 16, HPW = 32 / LH;  // lanes per head, heads per warp
    static_assert(HD % 16 == 0 && LH <= 32 && 32 % LH == 0, "whole heads per warp");
    pdl_wait();
    pdl_trigger();
    const int tok = blockIdx.x, lane = threadIdx.x & 31, j = lane % LH;
    const int head = (blockIdx.y * 4 + (threadIdx.x >> 5)) * HPW + lane / LH;
    const int pos = (pos_dev ? *pos_dev : pos0) + tok;
    const bool is_v = head >= H + KV, live = head < H + 2 * KV;
    const bool is_q = head < H;
    uint4 ra = make_uint4(0, 0, 0, 0), rb = ra;
    if (live) {
        const half* src = is_q ? qin + (size_t)tok * q_stride + head * HD
                        : !is_v ? kin + (size_t)tok * k_stride + (head - H) * HD
                                : vin + (size_t)tok * v_stride + (head - H - KV) * HD;
        ra = reinterpret_cast<const uint4*>(src)[j];
        rb = reinterpret_cast<const uint4*>(src + HD / 2)[j];
    }
    float a[8], b[8];
    unpack8(ra, a);
    unpack8(rb, b);
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += a[i] * a[i] + b[i] * b[i];
#pragma unroll
    for (int o = LH / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // within the head's lanes
    if (!live) return;
    if (is_v) {  // value head: straight copy into the cache
        uint4* dst = reinterpret_cast<uint4*>(Vc + ((size_t)pos * KV + (head - H - KV)) * HD);
        dst[j] = ra;
        dst[LH + j] = rb;
        return;
    }
    const float inv = rsqrtf(ss / HD + eps);
    float wa[8], wb[8];
    const half* nw = is_q ? qn : kn;
    unpack8(reinterpret_cast<const uint4*>(nw)[j], wa);
    unpack8(reinterpret_cast<const uint4*>(nw + HD / 2)[j], wb);
    const float4* cr = reinterpret_cast<const float4*>(cosb + (size_t)pos * (HD / 2)) + 2 * j;
    const float4* sr = reinterpret_cast<const float4*>(sinb + (size_t)pos * (HD / 2)) + 2 * j;
    const float4 c0 = cr[0], c1 = cr[1], s0 = sr[0], s1 = sr[1];
    const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
    const float sn[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
    uint4 oa, ob;
    half* ha = reinterpret_cast<half*>(&oa);
    half* hb = reinterpret_cast<half*>(&ob);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float x1 = a[i] * inv * wa[i], x2 = b[i] * inv * wb[i];
        ha[i] = __float2half(x1 * c[i] - x2 * sn[i]);
        hb[i] = __float2half(x2 * c[i] + x1 * sn[i]);
    }
    uint4* dst = reinterpret_cast<uint4*>(is_q ? qout + ((size_t)tok * H + head) * HD
                                               : Kc + ((size_t)pos * KV + (head - H)) * HD);
    dst[j] = oa;
    dst[LH + j] = ob;
}

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
