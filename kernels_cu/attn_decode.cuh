// The flash-decoding split as a device function, for the attention kernel (attention.cu
// attn_decode_gqa: one 128-thread block per split), the persistent decode kernel (decode_layers.cu:
// a 128-thread quarter or half of a block per split, its own named barrier) and the fused attention
// half (decode_attn.cu: 128-thread quarters of a cluster's blocks). q and the newest key's row are
// read from L2 (.cg): they were written by the kernel before or earlier in the same launch (this
// block, or another block of the grid or cluster), so a line in this SM's L1 may be stale. The older
// rows no launch of this step writes: they stream through the read-only path without L1 allocation.
#pragma once
#include "common.cuh"

#ifndef ATTN_DECODE_U
#define ATTN_DECODE_U 4  // flash-decoding warp steps in flight for groups of up to 4 heads (A/B: KUIPER_ATTN_U)
#endif

#ifndef KUIPER_ATTN_KV_NC
#define KUIPER_ATTN_KV_NC 1  // A/B: 0 reads every cache row through L2 (__ldcg) as before
#endif
// 16 bytes of a cache row. fresh: the row may be the newest, written in this launch, so from L2 only;
// otherwise a row of an earlier step, unchanged for the whole launch and read once per block, so the
// non-coherent path is legal and L1 has nothing to gain (8B at 32k -2.0% per step on the H100, change 95)
__device__ __forceinline__ uint4 kv_load16(const half* p, bool fresh) {
#if KUIPER_ATTN_KV_NC
    if (!fresh) return ld_stream16(p);
#endif
    return __ldcg(reinterpret_cast<const uint4*>(p));
}

#ifndef KUIPER_ATTN_STAGE
#define KUIPER_ATTN_STAGE 1  // 0: no shared-memory staging of a split's first keys (A/B; PERFORMANCE.md change 115)
#endif
#ifndef ATTN_KV_PF_ITERS
#define ATTN_KV_PF_ITERS 2
#endif

template <int HD, int HB>
struct AttnSplitSmem {                            // the merge of a block's key slots
    static constexpr int LPK = HD / 8, KPW = 32 / LPK, NG = 4 * KPW;
    static constexpr int U = HB <= 4 ? ATTN_DECODE_U : 2;  // warp steps whose loads fly together (registers)
    static constexpr int KPB = NG * U;                     // keys per block iteration
    static constexpr int o_floats = NG * HB * HD;  // [NG][HB][HD]
    static constexpr int ml_floats = NG * HB * 2;  // [NG][HB][2]
    // [ATTN_KV_PF_ITERS * KPB keys][K, V][HD] halves: a split's first keys copied in before the PDL wait
    static constexpr int stage_floats = ATTN_KV_PF_ITERS * KPB * HD;
    // sm_o once the loop is done, the staged keys before: one buffer
    static constexpr int shared_floats = o_floats > stage_floats ? o_floats : stage_floats;
};

#ifndef ATTN_KV_PF
#define ATTN_KV_PF 1  // 0: no L2 prefetch of the first iteration's rows (A/B; PERFORMANCE.md change 102)
#endif
// A chunk of at most ATTN_KV_PF_ITERS iterations is prefetched whole, a longer one its first iteration
// only (ATTN_KV_PF_WHOLE 0: the first ATTN_KV_PF_ITERS of every chunk; A/B). At a short context the
// second iteration's rows were otherwise a DRAM round trip after the wait: Qwen3-8B at 512 on the
// H100 (64 keys per split, two iterations) -0.4% per step; two iterations of every chunk cost +0.5%
// at 32k (change 108)
#ifndef ATTN_KV_PF_WHOLE
#define ATTN_KV_PF_WHOLE 1
#endif

// Keys a split starts on before its wait, counted from its first: a chunk of at most ATTN_KV_PF_ITERS
// iterations whole, a longer one its first iteration (change 108).
template <int HD, int HB>
__device__ __forceinline__ int attn_early_keys(int k_begin, int k_end) {
    constexpr int KPB = AttnSplitSmem<HD, HB>::KPB;
    const int its = ATTN_KV_PF_WHOLE && k_end - k_begin > ATTN_KV_PF_ITERS * KPB ? 1 : ATTN_KV_PF_ITERS;
    return min(its * KPB, k_end - k_begin);
}

// Of those, the keys copied into shared memory: a short chunk's (a long one's are prefetched into L2).
#ifndef ATTN_STAGE_LONG
#define ATTN_STAGE_LONG 0  // 1: a long chunk stages its first iteration too (A/B)
#endif
template <int HD, int HB>
__device__ __forceinline__ int attn_staged_keys(int k_begin, int k_end) {
    const bool lng = k_end - k_begin > ATTN_KV_PF_ITERS * AttnSplitSmem<HD, HB>::KPB;
    return lng && !ATTN_STAGE_LONG ? 0 : attn_early_keys<HD, HB>(k_begin, k_end);
}

// Keys [s * chunk, ...) of KV head kvh against query heads kvh * (H/KV) + hb * HB .. + HB - 1, by
// 128 threads (tid 0..127); writes part_o[h, s, :] and part_ml[h, s, :] of those heads. sync() is
// the 128 threads' barrier; wait() comes before any read of q or the cache (the attention kernel's
// PDL wait). Before it, the first iterations' K and V rows (a short chunk's all) are either copied
// into stage (cp.async: no registers held across the wait, and after it no round trip at all; a lane
// copies exactly the 16-byte pieces it reads back, so no barrier) or, without a stage, prefetched
// into L2. Either way their DRAM latency overlaps the predecessor's tail. (Loads into registers there
// took 155 registers against 128, and the lost occupancy cost 11% at 32k.) The newest key's rows are
// never copied early: the predecessor or wait() writes them. newest_staged: wait() writes them into
// the stage too (the attention kernel's q|k|v finish); otherwise they are read from L2 after it. L2 is
// coherent, so a prefetched line of the newest key is never stale. stage aliases sm_o (the merge
// below), so a barrier separates the loop's last stage reads from the merge's writes.
template <int HD, int HB, class Sync, class Wait>
__device__ __forceinline__ void attn_decode_split(const half* q,   // [H, HD] rotated
                                                  const half* Kc,  // [ctx, KV, HD] this layer
                                                  const half* Vc, float* part_o, float* part_ml, int kvh, int hb,
                                                  int s, int S, int n_keys, int min_chunk, int H, int KV,
                                                  float scale_log2,
                                                  float* sm_o, float* sm_ml, int tid, Sync sync, Wait wait,
                                                  const half* q_sm = nullptr,  // [HB, HD]: q from shared memory
                                                  uint4* stage = nullptr,      // [staged keys][K, V][HD / 8]
                                                  bool newest_staged = false) {
    using L = AttnSplitSmem<HD, HB>;
    constexpr int LPK = L::LPK, KPW = L::KPW, NG = L::NG;  // lanes per key, keys per warp step, key slots
    constexpr int U = L::U, KPB = L::KPB;                   // warp steps in flight, keys per block iteration
    constexpr int RW = HD / 8;                              // 16-byte pieces per row
    const int h0 = kvh * (H / KV) + hb * HB;
    const int lane = tid & 31, warp = tid >> 5;
    const int slot = warp * KPW + lane / LPK, dl = lane % LPK;  // key slot, 8-dim chunk
    const int chunk = decode_chunk(n_keys, S, min_chunk);  // in-kernel, so a captured graph serves every length
    const int k_begin = s * chunk, k_end = min(n_keys, k_begin + chunk);
    const size_t rs = (size_t)KV * HD;  // elements from one key's row to the next
    const half* kb = Kc + (size_t)kvh * HD + dl * 8;
    const half* vb = Vc + (size_t)kvh * HD + dl * 8;
    const int n_stage = stage && k_begin < k_end ? attn_staged_keys<HD, HB>(k_begin, k_end) : 0;
    if (n_stage) {
#pragma unroll
        for (int it = 0; it < ATTN_KV_PF_ITERS; ++it) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int kl = it * KPB + u * NG + slot, key = k_begin + kl;
                if (kl < n_stage && key != n_keys - 1) {
                    cp_async16(stage + 2 * kl * RW + dl, kb + (size_t)key * rs, 16);
                    cp_async16(stage + (2 * kl + 1) * RW + dl, vb + (size_t)key * rs, 16);
                }
            }
        }
    } else if (ATTN_KV_PF && k_begin < k_end && dl % 8 == 0) {  // one lane per 128-byte line of a row
        const int n_early = attn_early_keys<HD, HB>(k_begin, k_end);
#pragma unroll
        for (int it = 0; it < ATTN_KV_PF_ITERS; ++it) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int kl = it * KPB + u * NG + slot, key = k_begin + kl;
                if (kl < n_early) {
                    prefetch_l2(kb + (size_t)key * rs);
                    prefetch_l2(vb + (size_t)key * rs);
                }
            }
        }
    }
    wait();
    float qv[HB][8];
#pragma unroll
    for (int j = 0; j < HB; ++j) {
        unpack8(q_sm ? *reinterpret_cast<const uint4*>(q_sm + j * HD + dl * 8)
                     : __ldcg(reinterpret_cast<const uint4*>(q + (size_t)(h0 + j) * HD + dl * 8)), qv[j]);
#pragma unroll
        for (int i = 0; i < 8; ++i) qv[j][i] *= scale_log2;
    }
    if (n_stage) cp_async_wait_all();  // this lane's own copies (the newest key's rows: wait()'s barrier)
    float acc[HB][8], m[HB], l[HB];
#pragma unroll
    for (int j = 0; j < HB; ++j) {
        m[j] = -INFINITY;
        l[j] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
    }
    // the trip count is uniform across the 128 threads so every lane reaches the shuffles
    for (int base = k_begin; base < k_end; base += KPB) {
        uint4 kraw[U], vraw[U];
        bool valid[U];
        const bool fresh = k_end == n_keys && base + KPB >= n_keys;  // this iteration can hold the newest key
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int key = base + u * NG + slot, kl = key - k_begin;
            valid[u] = key < k_end;
            if (kl < n_stage && (key != n_keys - 1 || newest_staged)) {  // kl < n_stage: a valid key
                kraw[u] = stage[2 * kl * RW + dl];
                vraw[u] = stage[(2 * kl + 1) * RW + dl];
            } else {
                const size_t off = (size_t)(valid[u] ? key : k_begin) * rs;  // invalid slots load a real row
                kraw[u] = kv_load16(kb + off, fresh);
                vraw[u] = kv_load16(vb + off, fresh);
            }
        }
        float dot[U][HB];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[8];
            unpack8(kraw[u], kf);
#pragma unroll
            for (int j = 0; j < HB; ++j) {
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) d += qv[j][i] * kf[i];
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                dot[u][j] = valid[u] ? d : -INFINITY;
            }
        }
#pragma unroll
        for (int j = 0; j < HB; ++j) {
            float mn = m[j];
#pragma unroll
            for (int u = 0; u < U; ++u) mn = fmaxf(mn, dot[u][j]);
            if (mn == -INFINITY) continue;  // no valid key yet in this slot
            const float corr = exp2f(m[j] - mn);
            m[j] = mn;
            l[j] *= corr;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[j][i] *= corr;
#pragma unroll
            for (int u = 0; u < U; ++u) dot[u][j] = exp2f(dot[u][j] - mn);  // p; 0 for invalid keys
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float vf[8];
            unpack8(vraw[u], vf);
#pragma unroll
            for (int j = 0; j < HB; ++j) {
                if (m[j] == -INFINITY) continue;
                const float p = dot[u][j];
                l[j] += p;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[j][i] += p * vf[i];
            }
        }
    }
    if (n_stage) sync();  // the merge's writes below reuse the stage
    // merge the NG key slots
#pragma unroll
    for (int j = 0; j < HB; ++j) {
#pragma unroll
        for (int i = 0; i < 8; ++i) sm_o[(slot * HB + j) * HD + dl * 8 + i] = acc[j][i];
        if (dl == 0) { sm_ml[(slot * HB + j) * 2] = m[j]; sm_ml[(slot * HB + j) * 2 + 1] = l[j]; }
    }
    sync();
    for (int e = tid; e < HB * HD; e += 128) {
        const int j = e / HD, d = e % HD;
        float M = -INFINITY;
#pragma unroll
        for (int g = 0; g < NG; ++g) M = fmaxf(M, sm_ml[(g * HB + j) * 2]);
        float Lsum = 0.f, od = 0.f;
        if (M != -INFINITY)
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                const float w = exp2f(sm_ml[(g * HB + j) * 2] - M);  // 0 for a slot that saw no key
                Lsum += sm_ml[(g * HB + j) * 2 + 1] * w;
                od += sm_o[(g * HB + j) * HD + d] * w;
            }
        const size_t ps = (size_t)(h0 + j) * S + s;
        part_o[ps * HD + d] = od;
        if (d == 0) { part_ml[ps * 2] = M; part_ml[ps * 2 + 1] = Lsum; }
    }
}
