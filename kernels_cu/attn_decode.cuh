// The flash-decoding split as a device function, for attention.cu's attn_decode_gqa (one 128-thread block
// per split; its CM form merges the splits in their cluster). q and the newest key's row are read from L2
// (.cg): they were written by the kernel before or earlier in the same launch (attn_decode_gqa's q|k|v
// finish), so a line in this SM's L1 may be stale. The older rows no launch of this step writes: they stream
// through the read-only path without L1 allocation.
#pragma once
#include "common.cuh"

#ifndef ATTN_DECODE_U
#define ATTN_DECODE_U 4  // flash-decoding warp steps in flight for groups of up to 4 heads 
#endif

// 16 bytes of a cache row. fresh: the row may be the newest, written in this launch, so from L2 only;
// otherwise a row of an earlier step, unchanged for the whole launch and read once per block, so the
// non-coherent path is legal and L1 has nothing to gain (8B at 32k -2.0% per step on the H100)
__device__ __forceinline__ uint4 kv_load16(const half* p, bool fresh) {
    if (!fresh) return ld_stream16(p);
    return __ldcg(reinterpret_cast<const uint4*>(p));
}

#ifndef ATTN_KV_PF_ITERS
#define ATTN_KV_PF_ITERS 2
#endif

#define ATTN_LONG_TILE 64  // keys per tile of the long tensor-core path (attn_split_mma_long): 16 per warp

template <int HD, int HB>
struct AttnSplitSmem {                            // the merge of a block's key slots
    static constexpr int LPK = HD / 8, KPW = 32 / LPK, NG = 4 * KPW;
    static constexpr int U = HB <= 4 ? ATTN_DECODE_U : 2;  // warp steps whose loads fly together (registers)
    static constexpr int KPB = NG * U;                     // keys per block iteration
    static constexpr int o_floats = NG * HB * HD;  // [NG][HB][HD]
    static constexpr int ml_floats = NG * HB * 2;  // [NG][HB][2]
    // A staged key: its K row, its V row, then 16 bytes of padding, so the same 16 bytes of 8 keys in a
    // row fall in 8 different bank quads (the tensor-core path's ldmatrix reads 8 keys at a time)
    static constexpr int RW = HD / 8, SRW = 2 * RW + 1;  // 16-byte pieces: per row, per staged key
    static constexpr int CAP = ATTN_KV_PF_ITERS * KPB;   // keys the stage holds
    // [CAP keys][SRW] 16-byte pieces: a split's first keys copied in before the PDL wait
    static constexpr int stage_floats = CAP * SRW * 4;
    // the long tensor-core path's first tile buffer (attn_split_mma_long: 64 keys)
    static constexpr int long_floats = ATTN_LONG_TILE * SRW * 4;
    // sm_o once the loop is done, the staged keys before (or the long path's first tile): one buffer
    static constexpr int so_floats = o_floats > stage_floats ? o_floats : stage_floats;
    static constexpr int shared_floats = so_floats > long_floats ? so_floats : long_floats;
};

// A chunk of at most ATTN_KV_PF_ITERS iterations is prefetched into L2 whole, a longer one its first iteration
// only. At a short context the second iteration's rows were otherwise a DRAM round trip after the wait: Qwen3-8B at
// 512 on the H100 (64 keys per split, two iterations) -0.4% per step; two iterations of every chunk cost +0.5% at 32k

// Keys a split starts on before its wait, counted from its first: a chunk of at most ATTN_KV_PF_ITERS
// iterations whole, a longer one its first iteration.
template <int HD, int HB>
__device__ __forceinline__ int attn_early_keys(int k_begin, int k_end) {
    constexpr int KPB = AttnSplitSmem<HD, HB>::KPB;
    const int its = k_end - k_begin > ATTN_KV_PF_ITERS * KPB ? 1 : ATTN_KV_PF_ITERS;
    return min(its * KPB, k_end - k_begin);
}

// Of those, the keys copied into shared memory: a short chunk's (a long one's are prefetched into L2).
template <int HD, int HB>
__device__ __forceinline__ int attn_staged_keys(int k_begin, int k_end) {
    const bool lng = k_end - k_begin > ATTN_KV_PF_ITERS * AttnSplitSmem<HD, HB>::KPB;
    return lng ? 0 : attn_early_keys<HD, HB>(k_begin, k_end);
}

#define ATTN_MMA_KEYS 64  // most keys of a split the tensor-core path serves: 16 per warp

// Where a split's partials go: head j's element d at o[j * ho + d], its max and sum at ml[j * hm], ml[j * hm + 1].
// Flash decoding's global partials (part_o [H, S, HD], part_ml [H, S, 2] from head h0, split s), or a block's own
// shared memory when its cluster merges the splits itself (attention.cu, CM).
struct AttnPartDst {
    float* o;
    float* ml;
    int ho, hm;
    __device__ __forceinline__ void put(int j, int d, float od, float M, float L) const {
        o[j * ho + d] = od;
        if (d == 0) { ml[j * hm] = M; ml[j * hm + 1] = L; }
    }
};

// The tensor-core paths' merge of their 4 warps' slots into split s's partials: warp w < nw's max and sum
// of head j in sm_ml [4][HB][2], its output element (j, d) at *slot(w, j, d); warps from nw on saw no keys
// and are not read. Fully unrolled, so a thread's loads of all 4 slots (and of its elements) fly together:
// as a loop over the slots it took 1.3-1.4 µs of dependent shared-memory round trips.
template <int HD, int HB, class Slot>
__device__ __forceinline__ void attn_merge_warps(const float* sm_ml, Slot slot, int nw, const AttnPartDst& dst, int tid) {
    constexpr int NW = 4, EPT = (HB * HD + 127) / 128;
#pragma unroll
    for (int k = 0; k < EPT; ++k) {
        const int e = tid + 128 * k;
        if (e < HB * HD) {
            const int j = e / HD, d = e % HD;
            float mw[NW], lw[NW], ow[NW], M = -INFINITY;
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                const bool on = w < nw;
                mw[w] = on ? sm_ml[(w * HB + j) * 2] : -INFINITY;
                lw[w] = on ? sm_ml[(w * HB + j) * 2 + 1] : 0.f;
                ow[w] = on ? *slot(w, j, d) : 0.f;
                M = fmaxf(M, mw[w]);
            }
            float Lsum = 0.f, od = 0.f;
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                const float wt = exp2f(mw[w] - M);  // 0 for a warp without keys
                Lsum += lw[w] * wt;
                od += ow[w] * wt;
            }
            dst.put(j, d, od, M, Lsum);
        }
    }
}

// The tensor-core form of a short split whose keys (at most ATTN_MMA_KEYS, all staged, zero rows up to
// a multiple of 16) and q (q_sm, [HB][HD]) are in shared memory. Why: the scalar loop spends ~1.1 µs
// on one 32-key iteration even with its code cached (16 lanes per key, four dependent shuffles per
// dot product, one warp per scheduler), and its 8-slot merge another ~0.7 (H200 timeline,
// docs/PERFORMANCE.md). Here warp w takes keys 16w..16w+15: S = q K^T by mma.m16n8k16 (heads
// as rows 0..HB-1 of the 16, K rows straight from the stage by ldmatrix), its softmax in registers,
// and P V with the S accumulators reused as P's A fragments (no trip through shared memory). P goes
// in as fp16 hi + lo, two MMAs, so P V keeps fp32's precision where fp16 P alone would round to 2^-11.
// A warp's output then lands on its own keys' K rows (no other warp reads them), and one barrier
// later the 4 warps' results are merged as the scalar path merges its slots.
template <int HD, int HB, class Sync>
__device__ __forceinline__ void attn_split_mma(uint4* stage, const half* q_sm, int nk, float scale_log2,
                                               const AttnPartDst& dst,
                                               float* sm_ml,  // [4][HB][2]
                                               int tid, Sync sync) {
    static_assert(HD % 16 == 0 && HB <= 8, "heads are rows 0..7 of the MMA's 16; dims in k-steps of 16");
    using L = AttnSplitSmem<HD, HB>;
    constexpr int SRW = L::SRW, RW = L::RW, KS = HD / 16, HF = HD / 2;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3, kw = warp * 16;
    cp_async_wait_all();
    sync();  // every thread's copies (and wait()'s newest row) visible to every warp
    // warp w's output element (j, d): on its own keys' K rows, two per head (floats; K's last reader is w)
    auto o_at = [&](int w, int j, int d) {
        return reinterpret_cast<float*>(stage + (size_t)(16 * w + 2 * j + d / HF) * SRW) + d % HF;
    };
    float mrow = -INFINITY, lrow = 0.f;  // head g's max (log2 domain) and sum over this warp's keys
    if (kw < nk) {                        // warp-uniform
        float sc[2][4] = {};               // [key n-tile][C fragment]: S for keys kw..kw+7, kw+8..kw+15
        // ldmatrix x4: matrix i = lane / 8 is keys (i / 2) * 8.., dims chunk + i % 2
        const uint4* kp = stage + (size_t)(kw + (lane & 7) + ((lane >> 4) << 3)) * SRW + ((lane >> 3) & 1);
        const u32* qrow = reinterpret_cast<const u32*>(q_sm + (g < HB ? g : 0) * HD);
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            u32 a[4] = {g < HB ? qrow[8 * ks + t] : 0u, 0u, g < HB ? qrow[8 * ks + 4 + t] : 0u, 0u};
            u32 b[4];
            ldmatrix_x4(b, kp + 2 * ks);
            mma_16816(sc[0], a, b[0], b[1]);
            mma_16816(sc[1], a, b[2], b[3]);
        }
        // row g's 16 scores sit in its quad (lanes 4g..4g+3), 4 each: c0, c1 of both n-tiles
        float p[2][2], mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                p[n][i] = kw + 8 * n + 2 * t + i < nk ? sc[n][i] * scale_log2 : -INFINITY;
                mx = fmaxf(mx, p[n][i]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));  // finite: key kw is valid
        float ps = 0.f;
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                p[n][i] = exp2f(p[n][i] - mx);
                ps += p[n][i];
            }
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        ps += __shfl_xor_sync(0xffffffffu, ps, 2);
        mrow = mx;
        lrow = ps;
        // P's A fragments (row g, keys 2t.. and 2t+8..: the C layout of the two n-tiles); rows g + 8 are 0
        u32 ah[4] = {pack_half2(p[0][0], p[0][1]), 0u, pack_half2(p[1][0], p[1][1]), 0u}, al[4];
        {
            const half2 h0v = *reinterpret_cast<const half2*>(&ah[0]), h1v = *reinterpret_cast<const half2*>(&ah[2]);
            al[0] = pack_half2(p[0][0] - __low2float(h0v), p[0][1] - __high2float(h0v));
            al[2] = pack_half2(p[1][0] - __low2float(h1v), p[1][1] - __high2float(h1v));
            al[1] = al[3] = 0u;
        }
        // ldmatrix x4 trans: matrix i is keys (i % 2) * 8.., dims chunk 2c + i / 2
        const uint4* vp = stage + (size_t)(kw + (lane & 7) + (((lane >> 3) & 1) << 3)) * SRW + RW + (lane >> 4);
        float ov[HD / 16][2][2];  // [dim pair c][n-tile 2c + e][row g's two columns]
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {  // two halves of the dims: 8 n-tiles of accumulators at a time
            float oc[HD / 16][4] = {};
#pragma unroll
            for (int c = 0; c < KS / 2; ++c) {
                u32 b[4];
                ldmatrix_x4_trans(b, vp + 2 * (hh * KS / 2 + c));
                mma_16816(oc[2 * c], ah, b[0], b[1]);
                mma_16816(oc[2 * c], al, b[0], b[1]);
                mma_16816(oc[2 * c + 1], ah, b[2], b[3]);
                mma_16816(oc[2 * c + 1], al, b[2], b[3]);
            }
#pragma unroll
            for (int c = 0; c < KS / 2; ++c)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    ov[hh * KS / 2 + c][e][0] = oc[2 * c + e][0];
                    ov[hh * KS / 2 + c][e][1] = oc[2 * c + e][1];
                }
        }
        __syncwarp();  // the warp's K reads are done before its rows are overwritten
        if (g < HB)
#pragma unroll
            for (int c = 0; c < KS; ++c)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    *reinterpret_cast<float2*>(o_at(warp, g, 16 * c + 8 * e + 2 * t)) =
                        make_float2(ov[c][e][0], ov[c][e][1]);
    }
    if (t == 0 && g < HB) {
        sm_ml[(warp * HB + g) * 2] = mrow;
        sm_ml[(warp * HB + g) * 2 + 1] = lrow;
    }
    sync();
    static_assert(ATTN_MMA_KEYS == 4 * 16, "4 warps of 16 keys");
    attn_merge_warps<HD, HB>(sm_ml, o_at, (nk + 15) >> 4, dst, tid);  // (warp 0 always saw keys)
}

#define ATTN_LONG_PRE 2  // tiles of a long split copied before the PDL wait (docs/PERFORMANCE.md)

// The long path's copies of tile i's rows into buf (one of two tile buffers [ATTN_LONG_TILE][SRW]): warp
// `warp` copies only the 16 keys it reads itself, so a warp's cp.async group and __syncwarp order them
// and the loop needs no block barrier. Keys past the split are zero-filled (P is 0 there, but 0 x NaN
// garbage is not). newest: 0 skips the newest key (before the PDL wait, its rows are not written yet),
// 1 copies every key, 2 only the newest.
template <int HD, int HB>
__device__ __forceinline__ void attn_long_copy(uint4* buf, const half* Kc, const half* Vc, size_t rs, int kvh,
                                               int k_begin, int k_end, int n_keys, int i, int warp, int lane,
                                               int newest) {
    using L = AttnSplitSmem<HD, HB>;
    constexpr int RW = L::RW, SRW = L::SRW;
#pragma unroll
    for (int j = 0; j < 16 * 2 * RW / 32; ++j) {
        const int idx = lane + 32 * j, r = idx / (2 * RW), c = idx % (2 * RW);
        const int kl = 16 * warp + r, key = k_begin + ATTN_LONG_TILE * i + kl;
        const bool is_new = key == n_keys - 1;
        if (newest == 0 ? is_new : newest == 2 ? !is_new : false) continue;
        uint4* dst = buf + (size_t)kl * SRW + c;
        if (key < k_end)
            cp_async16(dst, (c < RW ? Kc : Vc) + (size_t)key * rs + (size_t)kvh * HD + (c % RW) * 8, 16);
        else
            cp_async16(dst, Kc, 0);
    }
}

// The tensor-core form of a split longer than ATTN_MMA_KEYS (q in q_sm from the q|k|v finish): tiles of
// 64 keys through two buffers (buf0, buf1: [ATTN_LONG_TILE][SRW] 16-byte pieces; the first ATTN_LONG_PRE
// tiles were copied before the PDL wait, but for the newest key), warp w taking keys 16w..16w+15 of every tile
// with an online softmax of its own. Why: the scalar loop spends ~1.1 µs per 32 keys on shuffles and
// exp2f with one warp per scheduler, so a split of 250-1000 keys was bound by its
// arithmetic, not by its bytes (30B-A3B at 8k keys: ~0.27 of copy in attention; this form took 9-12%
// off its step there; 3 or 4 buffers measured slower). Transposed against
// attn_split_mma, S^T = K q^T and O^T = V^T P^T: the heads are the MMA's 8 columns, so no half of a
// 16-row fragment is wasted, O is 4 accumulators per 16 dims, and P's C layout reaches the B operand by
// movmatrix. P goes in as fp16 hi + lo (fp32 precision, as attn_split_mma). Each warp's l stays a per-lane
// partial until the end (it only ever scales by the column's shared max).
template <int HD, int HB, class Sync>
__device__ __forceinline__ void attn_split_mma_long(uint4* buf0, uint4* buf1, const half* q_sm, const half* Kc,
                                                    const half* Vc, size_t rs, int kvh, int k_begin, int k_end,
                                                    int n_keys, float scale_log2, const AttnPartDst& dst,
                                                    float* sm_ml,  // [4][HB][2]
                                                    int tid, Sync sync) {
    static_assert(HD % 16 == 0 && HB <= 8, "heads are the MMA's 8 columns; dims in steps of 16");
    using L = AttnSplitSmem<HD, HB>;
    constexpr int SRW = L::SRW, RW = L::RW, KS = HD / 16, T = ATTN_LONG_TILE;
    constexpr int OST = HD + 4;  // a head's row in the merge slots: +4 floats, so the 4 heads' stores spread over banks
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int nk = k_end - k_begin, nt = (nk + T - 1) / T;
    // the newest key, when this split holds it and it lies in a tile copied before the wait: now
    const int kl_new = n_keys - 1 - k_begin;
    const bool mine_new = k_end == n_keys && kl_new < ATTN_LONG_PRE * T && (kl_new % T) / 16 == warp;
    if (mine_new) {
        attn_long_copy<HD, HB>(kl_new < T ? buf0 : buf1, Kc, Vc, rs, kvh, k_begin, k_end, n_keys, kl_new / T, warp,
                               lane, 2);
        cp_async_commit();
    }
    // q^T as B fragments (dims 16ks.. of head g; heads past HB are zero columns)
    u32 qb[KS][2];
    {
        const u32* qrow = reinterpret_cast<const u32*>(q_sm + (g < HB ? g : 0) * HD);
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            qb[ks][0] = g < HB ? qrow[8 * ks + t] : 0u;
            qb[ks][1] = g < HB ? qrow[8 * ks + 4 + t] : 0u;
        }
    }
    float o[KS][4];  // O^T: dims 16c + g (+8) x heads 2t, 2t + 1
#pragma unroll
    for (int c = 0; c < KS; ++c) o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // heads 2t, 2t + 1 (l: this lane's keys)
    const int krow = 16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8, kcol = lane >> 4;  // ldmatrix rows for K
    const int vrow = 16 * warp + (lane & 7) + ((lane >> 4) & 1) * 8, vcol = RW + ((lane >> 3) & 1);  // for V^T
    for (int i = 0; i < nt; ++i) {
        if (i == 0 && mine_new)
            cp_async_wait<0>();
        else
            cp_async_wait<1>();  // tile i landed; tile i + 1 may still fly
        __syncwarp();            // and every lane's copies of it visible to the warp
        uint4* b = i & 1 ? buf1 : buf0;
        const int kw = T * i + 16 * warp;  // the warp's first key of the tile, from the split's start
        if (kw < nk) {                     // warp-uniform
            float sc[4] = {0.f, 0.f, 0.f, 0.f};  // S^T: keys kw + g, kw + g + 8 x heads 2t, 2t + 1
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                u32 a[4];
                ldmatrix_x4(a, b + (size_t)krow * SRW + kcol + 2 * ks);
                mma_16816(sc, a, qb[ks][0], qb[ks][1]);
            }
            const bool v0 = kw + g < nk, v1 = kw + g + 8 < nk;
            const float x0 = v0 ? sc[0] * scale_log2 : -INFINITY, x1 = v0 ? sc[1] * scale_log2 : -INFINITY;
            const float x2 = v1 ? sc[2] * scale_log2 : -INFINITY, x3 = v1 ? sc[3] * scale_log2 : -INFINITY;
            float mx0 = fmaxf(x0, x2), mx1 = fmaxf(x1, x3);
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) {  // over the 8 key rows g of the column
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
            }
            const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);  // finite: key kw is valid
            const float c0 = exp2f(m0 - n0), c1 = exp2f(m1 - n1);   // 0 on the warp's first tile
            m0 = n0;
            m1 = n1;
            const float p0 = exp2f(x0 - n0), p1 = exp2f(x1 - n1), p2 = exp2f(x2 - n0), p3 = exp2f(x3 - n1);
            l0 = l0 * c0 + p0 + p2;
            l1 = l1 * c1 + p1 + p3;
#pragma unroll
            for (int c = 0; c < KS; ++c) {
                o[c][0] *= c0;
                o[c][1] *= c1;
                o[c][2] *= c0;
                o[c][3] *= c1;
            }
            // P^T's B fragments: rows of key g (g + 8) and heads 2t, 2t + 1 transposed to head g, keys 2t..
            const u32 h0p = pack_half2(p0, p1), h1p = pack_half2(p2, p3);
            const half2 h0v = *reinterpret_cast<const half2*>(&h0p), h1v = *reinterpret_cast<const half2*>(&h1p);
            const u32 bh0 = movmatrix_trans(h0p), bh1 = movmatrix_trans(h1p);
            const u32 bl0 = movmatrix_trans(pack_half2(p0 - __low2float(h0v), p1 - __high2float(h0v)));
            const u32 bl1 = movmatrix_trans(pack_half2(p2 - __low2float(h1v), p3 - __high2float(h1v)));
#pragma unroll
            for (int c = 0; c < KS; ++c) {
                u32 a[4];
                ldmatrix_x4_trans(a, b + (size_t)vrow * SRW + vcol + 2 * c);
                mma_16816(o[c], a, bh0, bh1);
                mma_16816(o[c], a, bl0, bl1);
            }
        }
        __syncwarp();  // the warp's reads of b are done before its copies of tile i + 2 land there
        if (i + 2 < nt) attn_long_copy<HD, HB>(b, Kc, Vc, rs, kvh, k_begin, k_end, n_keys, i + 2, warp, lane, 1);
        cp_async_commit();  // (empty past the last tile: the wait counts stay uniform)
    }
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {  // the column sums over the 8 key rows
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    cp_async_wait<0>();  // (only empty groups can be left: nothing may land after the slots are written)
    sync();              // every warp is done with the buffers: buf0 takes the 4 warps' slots
    float* slots = reinterpret_cast<float*>(buf0);  // [4][HB][OST]
    float* ow = slots + warp * HB * OST;
    const int ja = 2 * t, jb = 2 * t + 1;
#pragma unroll
    for (int c = 0; c < KS; ++c) {
        if (ja < HB) {
            ow[ja * OST + 16 * c + g] = o[c][0];
            ow[ja * OST + 16 * c + g + 8] = o[c][2];
        }
        if (jb < HB) {
            ow[jb * OST + 16 * c + g] = o[c][1];
            ow[jb * OST + 16 * c + g + 8] = o[c][3];
        }
    }
    if (g == 0) {
        if (ja < HB) { sm_ml[(warp * HB + ja) * 2] = m0; sm_ml[(warp * HB + ja) * 2 + 1] = l0; }
        if (jb < HB) { sm_ml[(warp * HB + jb) * 2] = m1; sm_ml[(warp * HB + jb) * 2 + 1] = l1; }
    }
    sync();
    attn_merge_warps<HD, HB>(sm_ml, [&](int w, int j, int d) { return slots + (w * HB + j) * OST + d; }, 4, dst,
                             tid);  // (every warp wrote its slot, -inf / 0 / 0 without keys)
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
                                                  bool newest_staged = false,
                                                  uint4* stage2 = nullptr,     // [64][SRW]: the long path's second tile
                                                  float* own_o = nullptr,      // [HB][HD] and
                                                  float* own_ml = nullptr) {   // [HB][2]: the partials here instead
    using L = AttnSplitSmem<HD, HB>;
    constexpr int LPK = L::LPK, KPW = L::KPW, NG = L::NG;  // lanes per key, keys per warp step, key slots
    constexpr int U = L::U, KPB = L::KPB;                   // warp steps in flight, keys per block iteration
    constexpr int RW = L::RW;                               // 16-byte pieces per row
    const int h0 = kvh * (H / KV) + hb * HB;
    const AttnPartDst dst = own_o ? AttnPartDst{own_o, own_ml, HD, 2}
                                  : AttnPartDst{part_o + ((size_t)h0 * S + s) * HD, part_ml + ((size_t)h0 * S + s) * 2,
                                                S * HD, 2 * S};
    const int lane = tid & 31, warp = tid >> 5;
    const int slot = warp * KPW + lane / LPK, dl = lane % LPK;  // key slot, 8-dim chunk
    const int chunk = decode_chunk(n_keys, S, min_chunk);  // in-kernel, so a captured graph serves every length
    const int k_begin = s * chunk, k_end = min(n_keys, k_begin + chunk);
    const size_t rs = (size_t)KV * HD;  // elements from one key's row to the next
    const half* kb = Kc + (size_t)kvh * HD + dl * 8;
    const half* vb = Vc + (size_t)kvh * HD + dl * 8;
    const int n_stage = stage && k_begin < k_end ? attn_staged_keys<HD, HB>(k_begin, k_end) : 0;
    constexpr int SRW = L::SRW;
    // the tensor-core path: a short split wholly staged, q and the newest key's rows from wait()
    const bool mma = q_sm && newest_staged && n_stage == k_end - k_begin && n_stage > 0 &&
                     n_stage <= (ATTN_MMA_KEYS < L::CAP ? ATTN_MMA_KEYS : L::CAP);
    // the long tensor-core path: a split past the short one's keys, q from wait(), two tile buffers
    const bool mma_long = !mma && stage2 && stage && q_sm && newest_staged &&
                          k_end - k_begin > ATTN_MMA_KEYS;
    if (mma_long) {  // the first ATTN_LONG_PRE tiles but the newest key, a group each
#pragma unroll
        for (int i = 0; i < ATTN_LONG_PRE; ++i) {
            attn_long_copy<HD, HB>(i ? stage2 : stage, Kc, Vc, rs, kvh, k_begin, k_end, n_keys, i, warp, lane, 0);
            cp_async_commit();
        }
    } else if (mma) {  // whole rows, 16 bytes a thread in turn; rows past the keys up to a multiple of 16 zeroed
        const int nk16 = (n_stage + 15) & ~15;
        for (int i = tid; i < nk16 * 2 * RW; i += 128) {
            const int kl = i / (2 * RW), c = i % (2 * RW), key = k_begin + kl;
            if (kl >= n_stage)
                cp_async16(stage + kl * SRW + c, Kc, 0);
            else if (key != n_keys - 1)
                cp_async16(stage + kl * SRW + c, (c < RW ? Kc : Vc) + (size_t)key * rs + (size_t)kvh * HD + (c % RW) * 8, 16);
        }
    } else if (n_stage) {
#pragma unroll
        for (int it = 0; it < ATTN_KV_PF_ITERS; ++it) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int kl = it * KPB + u * NG + slot, key = k_begin + kl;
                if (kl < n_stage && key != n_keys - 1) {
                    cp_async16(stage + kl * SRW + dl, kb + (size_t)key * rs, 16);
                    cp_async16(stage + kl * SRW + RW + dl, vb + (size_t)key * rs, 16);
                }
            }
        }
    } else if (k_begin < k_end && dl % 8 == 0) {  // one lane per 128-byte line of a row
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
    if (mma_long) {
        attn_split_mma_long<HD, HB>(stage, stage2, q_sm, Kc, Vc, rs, kvh, k_begin, k_end, n_keys, scale_log2, dst,
                                    sm_ml, tid, sync);
        return;
    }
    if (mma) {
        attn_split_mma<HD, HB>(stage, q_sm, n_stage, scale_log2, dst, sm_ml, tid, sync);
        return;
    }
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
                kraw[u] = stage[kl * SRW + dl];
                vraw[u] = stage[kl * SRW + RW + dl];
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
        dst.put(j, d, od, M, Lsum);
    }
}
