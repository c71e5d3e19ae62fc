// Attention over the fp16 KV cache (layout per layer [ctx, KV, HD]).
//
// flash_attn_prefill: causal flash attention for a chunk of T queries at positions pos0..pos0+T-1,
//   tensor cores for QK^T and PV, online softmax in registers, GQA by indexing the shared KV head.
//   64 queries x one head per block (4 warps x 16 rows), 64-key tiles double-buffered in dynamic shared
//   memory (the next tile's cp.async copies in flight while this one is multiplied; FaSmem, 69.6 KB at HD
//   128, 3 blocks per SM), heaviest query tiles first, the causal mask only on diagonal tiles (PERFORMANCE.md
//   measured). HD in {64, 128}.
//   On compute capability 9.0 at HD 128 prefill takes attn_wgmma.cu's wgmma kernel instead;
//   this one serves HD 64 and other GPUs.
// attn_decode_gqa + attn_decode_combine: flash-decoding for one query token, the KV length split
//   across blocks so that long contexts fill the GPU, each block serving a KV head's query heads;
//   a second pass merges the partial softmaxes.
#include "common.cuh"
#include "attn_decode.cuh"

#define FA_BQ 64
#define FA_BKV 64
#define FA_PAD 8

template <int HD>
union FaSmem {  // q is read into registers before the first K/V copy lands in its bytes
    half q[FA_BQ][HD + FA_PAD];
    struct {
        half k[2][FA_BKV][HD + FA_PAD];
        half v[2][FA_BKV][HD + FA_PAD];
    } kv;
};

// Issue the cp.async copies of the K/V tile at key kv0 into stage st (zero-filled past n_keys: V rows must
// not hold NaN garbage), as one commit group.
template <int HD>
__device__ __forceinline__ void fa_load_kv(FaSmem<HD>& sm, int st, int kv0, int n_keys, const half* __restrict__ Kc,
                                           const half* __restrict__ Vc, int KV, int kvh) {
    constexpr int CH = HD / 8;
    for (int c = threadIdx.x; c < FA_BKV * CH; c += 128) {
        const int r = c / CH, cc = c % CH;
        const bool ok = kv0 + r < n_keys;
        const size_t off = ((size_t)(kv0 + r) * KV + kvh) * HD + cc * 8;
        cp_async16(&sm.kv.k[st][r][cc * 8], ok ? Kc + off : Kc, ok ? 16 : 0);
        cp_async16(&sm.kv.v[st][r][cc * 8], ok ? Vc + off : Vc, ok ? 16 : 0);
    }
    cp_async_commit();
}

template <int HD>
__global__ void __launch_bounds__(128, 3)
flash_attn_prefill(const half* __restrict__ Q,   // [T, H, HD] (rotated)
                   const half* __restrict__ Kc,  // [ctx, KV, HD] this layer
                   const half* __restrict__ Vc,  // [ctx, KV, HD]
                   half* __restrict__ O,         // [T, H, HD]
                   int T, int pos0, int H, int KV, float scale_log2,
                   const int* __restrict__ pos_dev) {  // when set, pos0 is read here (a prefill graph's replay)
    if (pos_dev) pos0 = *pos_dev;
    // sizeof(FaSmem<HD>) of dynamic shared memory (ops_cupy.attention_prefill); no size check here: a trap's
    // registers pushed HD 128 past its 168 (3 blocks per SM) into spills
    extern __shared__ __align__(16) unsigned char fa_smem[];
    FaSmem<HD>& sm = *reinterpret_cast<FaSmem<HD>*>(fa_smem);
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    // the last query tiles have the most keys: they start first, so the grid does not end on them
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FA_BQ, h = blockIdx.y, kvh = h / (H / KV);
    const int g = lane >> 2, tq = lane & 3;
    constexpr int CH = HD / 8;  // 16-byte chunks per row

    for (int c = t; c < FA_BQ * CH; c += 128) {
        int r = c / CH, cc = c % CH;
        bool ok = q0 + r < T;
        cp_async16(&sm.q[r][cc * 8], ok ? Q + ((size_t)(q0 + r) * H + h) * HD + cc * 8 : Q, ok ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    u32 qf[HD / 16][4];  // this warp's 16 query rows as A fragments, kept for the whole loop
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
        ldmatrix_x4(qf[kk], &sm.q[warp * 16 + (lane & 15)][kk * 16 + (lane >> 4) * 8]);
    __syncthreads();  // every warp holds its q: the K/V stages may overwrite it

    float o[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
    const int qpos0 = pos0 + q0 + warp * 16 + g;  // absolute position of row g (row g+8 is +8)
    const int n_keys = pos0 + T;
    const int kv_end = min(n_keys, pos0 + q0 + FA_BQ);  // causal bound of this query tile

    fa_load_kv<HD>(sm, 0, 0, n_keys, Kc, Vc, KV, kvh);
    for (int kv0 = 0; kv0 < kv_end; kv0 += FA_BKV) {
        const int st = (kv0 / FA_BKV) & 1;
        if (kv0 + FA_BKV < kv_end) fa_load_kv<HD>(sm, st ^ 1, kv0 + FA_BKV, n_keys, Kc, Vc, KV, kvh);
        else cp_async_commit();  // an empty group: the wait below still means "this tile has landed"
        cp_async_wait<1>();
        __syncthreads();  // this tile's copies by every thread are visible
        const half (*sk)[HD + FA_PAD] = sm.kv.k[st];
        const half (*sv)[HD + FA_PAD] = sm.kv.v[st];

        float s[FA_BKV / 8][4];
#pragma unroll
        for (int i = 0; i < FA_BKV / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
            for (int np = 0; np < FA_BKV / 16; ++np) {
                u32 kf[4];  // non-transposed: K rows are B's columns
                ldmatrix_x4(kf, &sk[np * 16 + (lane >> 4) * 8 + (lane & 7)][kk * 16 + ((lane >> 3) & 1) * 8]);
                mma_16816(s[np * 2], qf[kk], kf[0], kf[1]);
                mma_16816(s[np * 2 + 1], qf[kk], kf[2], kf[3]);
            }
        // mask, scale into log2 domain, online softmax (each row lives in one quad of lanes). A tile wholly
        // before the warp's first query and inside the keys needs no mask (all but the diagonal tiles).
        const bool unmasked = kv0 + FA_BKV - 1 <= pos0 + q0 + warp * 16 && kv0 + FA_BKV <= n_keys;
        float mnew[2] = {mrow[0], mrow[1]};
#pragma unroll
        for (int nt = 0; nt < FA_BKV / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = s[nt][e] * scale_log2;
                if (!unmasked) {
                    const int key = kv0 + nt * 8 + tq * 2 + (e & 1), qp = qpos0 + (e >> 1) * 8;
                    if (key > qp || key >= n_keys) v = -INFINITY;
                }
                s[nt][e] = v;
                mnew[e >> 1] = fmaxf(mnew[e >> 1], v);
            }
        float corr[2], rsum[2] = {0.f, 0.f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mnew[r] = fmaxf(mnew[r], __shfl_xor_sync(0xffffffffu, mnew[r], 1));
            mnew[r] = fmaxf(mnew[r], __shfl_xor_sync(0xffffffffu, mnew[r], 2));
            corr[r] = mnew[r] == -INFINITY ? 1.f : exp2f(mrow[r] - mnew[r]);
            mrow[r] = mnew[r];
        }
#pragma unroll
        for (int nt = 0; nt < FA_BKV / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float m = mrow[e >> 1];
                float p = m == -INFINITY ? 0.f : exp2f(s[nt][e] - m);
                s[nt][e] = p;
                rsum[e >> 1] += p;
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            rsum[r] += __shfl_xor_sync(0xffffffffu, rsum[r], 1);
            rsum[r] += __shfl_xor_sync(0xffffffffu, rsum[r], 2);
            lrow[r] = lrow[r] * corr[r] + rsum[r];
        }
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) {
            o[i][0] *= corr[0]; o[i][1] *= corr[0];
            o[i][2] *= corr[1]; o[i][3] *= corr[1];
        }
        // O += P V: the S accumulators of two adjacent 8-key tiles form one A fragment
#pragma unroll
        for (int ks = 0; ks < FA_BKV / 16; ++ks) {
            u32 pf[4];
            pf[0] = pack_half2(s[2 * ks][0], s[2 * ks][1]);
            pf[1] = pack_half2(s[2 * ks][2], s[2 * ks][3]);
            pf[2] = pack_half2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
            pf[3] = pack_half2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
            for (int np = 0; np < HD / 16; ++np) {
                u32 vf[4];
                ldmatrix_x4_trans(vf, &sv[ks * 16 + (lane & 15)][np * 16 + (lane >> 4) * 8]);
                mma_16816(o[np * 2], pf, vf[0], vf[1]);
                mma_16816(o[np * 2 + 1], pf, vf[2], vf[3]);
            }
        }
        __syncthreads();  // every warp is done with stage st before the next iteration copies into it
    }
    float inv[2] = {lrow[0] > 0.f ? 1.f / lrow[0] : 0.f, lrow[1] > 0.f ? 1.f / lrow[1] : 0.f};
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt) {
        int col = nt * 8 + tq * 2;
        int r0 = q0 + warp * 16 + g;
        if (r0 < T)
            *reinterpret_cast<half2*>(&O[((size_t)r0 * H + h) * HD + col]) =
                __floats2half2_rn(o[nt][0] * inv[0], o[nt][1] * inv[0]);
        if (r0 + 8 < T)
            *reinterpret_cast<half2*>(&O[((size_t)(r0 + 8) * H + h) * HD + col]) =
                __floats2half2_rn(o[nt][2] * inv[1], o[nt][3] * inv[1]);
    }
}

// ---------------------------------------------------------------------------------------------
// Flash-decoding with the GQA group shared. Block (kv head, head subgroup, split) of 128 threads
// runs HB query heads of one KV head over one chunk of keys, so each K/V row leaves memory once per
// group: a block per query head re-read it H/KV times through L2, which bound long contexts
// (~1.3 TB/s of KV at 8k on H100). LPK = HD/8 lanes own a key (16 bytes of its K and V each); a
// warp holds 32/LPK keys per step and issues U steps of loads before it uses any, so each lane has
// 2U 16-byte loads in flight. The grid has S splits sized on the host for the cache's capacity (a
// graph is captured once); the keys present now are cut into chunks of at least min_chunk
// (common.cuh decode_chunk), so at a short context only the first splits work and the rest exit.
// ---------------------------------------------------------------------------------------------

// The decode step's q, k and v from the q|k|v GEMV's fixed-point sums (its accumulating mode, so it
// has no reduction tail): per-head RMSNorm and RoPE as rope.cu's qk_norm_rope_store, with the same
// rounding points (sums, times the GEMV's deferred 1/rms of its scaled norm, rounded to fp16
// first). Warp w rotates query head h0 + w into q_sm [nh, HD] (and into the global q when q_out is
// set: one split's blocks do it, for the record). A block whose split holds the newest key also
// writes that key's K and V rows into the cache, which it reads back after the block barrier;
// blocks of the split's other head subgroups write the same bits, and later steps read them from
// there. Every load of a warp's tasks is issued before any is used: one L2 round trip.
#ifndef ATTN_FINISH_MT
// tasks per warp in flight: 4 warps finish 4 query heads and the newest key's k and v in one round trip
#define ATTN_FINISH_MT 2
#endif
template <int HD>
__device__ __forceinline__ void decode_finish_qkv(const long long* __restrict__ acc,  // [(H + 2 KV) * HD]
                                                  half* q_sm, half* q_out, half* Kc, half* Vc, const half* qn,
                                                  const half* kn, const float* cosb, const float* sinb, float eps,
                                                  int h0, int nh, int kvh, int H, int KV, int pos, bool newest,
                                                  // the GEMV's splits' sums of squares (its deferred 1/rms), or null
                                                  const float* ss_in, int ss_n, int ss_D,
                                                  // the newest key's K and V rows in the split's stage, or null
                                                  half* k_stage, half* v_stage) {
    constexpr int P = HD / 64, HH = HD / 2;  // a lane holds dims d and d + HH, the rotation's pairs
    constexpr int MT = ATTN_FINISH_MT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int ntask = nh + (newest ? 2 : 0);
    float cs[P], sn[P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
        cs[i] = cosb[(size_t)pos * HH + lane * P + i];
        sn[i] = sinb[(size_t)pos * HH + lane * P + i];
    }
    for (int t0 = warp; t0 < ntask; t0 += MT * nwarps) {  // warp-uniform: the shuffles below are safe
        long long ra[MT][P], rb[MT][P];
        float wa[MT][P], wb[MT][P];
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            const int t = t0 + j * nwarps;
            if (t >= ntask) continue;
            const bool isq = t < nh, isk = t == nh;
            const long long* src = acc + (isq ? (size_t)(h0 + t) * HD : (size_t)(H + (isk ? 0 : KV) + kvh) * HD);
            const half* nw = isq ? qn : kn;
#pragma unroll
            for (int i = 0; i < P; ++i) {
                const int d = lane * P + i;
                ra[j][i] = __ldcg(src + d);
                rb[j][i] = __ldcg(src + HH + d);
                wa[j][i] = __half2float(nw[d]);
                wb[j][i] = __half2float(nw[d + HH]);
            }
        }
        // the 1/rms after the tasks' loads are issued: its partial sums' loads fly beside them, one L2
        // round trip instead of two
        const float sc = ss_in ? deferred_rms_inv(ss_in, ss_n, ss_D, eps) : 1.f;
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            const int t = t0 + j * nwarps;
            if (t >= ntask) continue;
            const bool isq = t < nh, isv = t == nh + 1;
            float a[P], b[P], ss = 0.f;
#pragma unroll
            for (int i = 0; i < P; ++i) {
                a[i] = __half2float(__float2half(fix_f(ra[j][i]) * sc));
                b[i] = __half2float(__float2half(fix_f(rb[j][i]) * sc));
                ss += a[i] * a[i] + b[i] * b[i];
            }
            if (isv) {  // v: stored as the fp16 projection output
                half* dst = Vc + ((size_t)pos * KV + kvh) * HD;
#pragma unroll
                for (int i = 0; i < P; ++i) {
                    dst[lane * P + i] = __float2half(a[i]);
                    dst[HH + lane * P + i] = __float2half(b[i]);
                    if (v_stage) {
                        v_stage[lane * P + i] = __float2half(a[i]);
                        v_stage[HH + lane * P + i] = __float2half(b[i]);
                    }
                }
                continue;
            }
            const float inv = rsqrtf(warp_sum(ss) / HD + eps);
#pragma unroll
            for (int i = 0; i < P; ++i) {
                const int d = lane * P + i;
                const float xa = a[i] * inv * wa[j][i], xb = b[i] * inv * wb[j][i];
                const half lo = __float2half(xa * cs[i] - xb * sn[i]), hi = __float2half(xb * cs[i] + xa * sn[i]);
                if (isq) {
                    q_sm[t * HD + d] = lo;
                    q_sm[t * HD + d + HH] = hi;
                    if (q_out) { q_out[(size_t)(h0 + t) * HD + d] = lo; q_out[(size_t)(h0 + t) * HD + d + HH] = hi; }
                } else {
                    half* dst = Kc + ((size_t)pos * KV + kvh) * HD;
                    dst[d] = lo;
                    dst[d + HH] = hi;
                    if (k_stage) {
                        k_stage[d] = lo;
                        k_stage[d + HH] = hi;
                    }
                }
            }
        }
    }
}

#define ATTN_CM_MAX 16  // most splits one cluster merges (16 is Hopper's non-portable cluster size)

// CM's shared memory: this block's split partials, and what the cluster's S blocks push to it for its
// share of the HB x HD elements (E / S of them, e = j HD + d; rank r merges [r E / S, (r + 1) E / S)).
template <int HD, int HB>
struct AttnCmSmem {
    static constexpr int E = HB * HD;
    float o[E];                        // [HB][HD] this split's unnormalised partial
    float rx_o[E];                     // [S][E / S] every split's partial of this block's elements
    float ml[HB][2];                   // this split's max (log2 domain) and sum per head
    float2 rx_ml[ATTN_CM_MAX][HB];     // [S][HB] every split's max and sum
    unsigned long long bar;            // completes when all S blocks' bytes have landed
};
template <bool C, class T, class F> struct attn_pick { using type = T; };  // (no std::conditional under NVRTC)
template <class T, class F> struct attn_pick<false, T, F> { using type = F; };

// CM, after the split: its partial (in c.o, c.ml) pushed to the cluster, then this block's E / S elements
// merged over all S splits into out (the head group's [HB][HD] rows of the output). An empty split pushed
// (max -inf, sum 0) and adds nothing; a block exits only once all bytes pushed to it have landed.
template <int HD, int HB>
__device__ __forceinline__ void attn_cm_merge(AttnCmSmem<HD, HB>& c, int s, int S, half* out) {
    constexpr int E = HB * HD;
    const int per = E / S, tid = threadIdx.x;  // (the host: E % (4 S) == 0, S <= ATTN_CM_MAX)
    __syncthreads();  // the split's partial complete in c.o / c.ml
    cl_wait();        // every block's barrier armed (their arrives went out before their PDL waits)
    const u32 bar = smem_u32(&c.bar);
    for (int e = 4 * tid; e < E; e += 4 * 128) {
        const int r = e / per;
        st_async_v4(cl_map(smem_u32(c.rx_o + s * per + e % per), r), *reinterpret_cast<const float4*>(c.o + e),
                    cl_map(bar, r));
    }
    if (tid < S * HB) {
        const int r = tid / HB, j = tid % HB;
        st_async_v2(cl_map(smem_u32(&c.rx_ml[s][j]), r), make_float2(c.ml[j][0], c.ml[j][1]), cl_map(bar, r));
    }
    mbar_wait_cluster(bar, 0);  // the barrier's one phase: armed once per launch
    // unrolled over ATTN_CM_MAX splits, predicated past S: a thread's loads of all splits fly together
    for (int i = tid; i < per; i += 128) {
        const int e = s * per + i, j = e / HD;
        float2 ml[ATTN_CM_MAX];
        float M = -INFINITY;
#pragma unroll
        for (int t = 0; t < ATTN_CM_MAX; ++t) {
            ml[t] = t < S ? c.rx_ml[t][j] : make_float2(0.f, 0.f);
            if (ml[t].y != 0.f) M = fmaxf(M, ml[t].x);
        }
        float L = 0.f, od = 0.f;
#pragma unroll
        for (int t = 0; t < ATTN_CM_MAX; ++t) {
            if (ml[t].y != 0.f) {
                const float w = exp2f(ml[t].x - M);
                L += ml[t].y * w;
                od += c.rx_o[t * per + i] * w;
            }
        }
        out[e] = __float2half(L > 0.f ? od / L : 0.f);
    }
}

// LP: the long tensor-core path's instantiation (its second tile buffer in dynamic shared memory, which
// the host passes where a split may be longer than ATTN_MMA_KEYS, ops_cupy.attention_decode). A separate
// kernel, so the short-context launches keep the code they had (with the long path beside it in the same
// kernel, the H100's 30B-A3B step at 512 keys measured 1.3% longer).
// CM (sm_90, a cluster launch of grid (S, KV, H / KV / HB), cluster (S, 1, 1)): the S split blocks of a
// head group merge their partials themselves and write the attention output, fp16 [H, HD], to merged.
// Each block pushes its partial of every element to the element's owner (st.async into the owner's
// shared memory, completing on its mbarrier) and its max/sum pairs to all; the owner merges as the o
// GEMV's gemv_merge_span does (the same operations in the same split order). Why: the o GEMV's merge
// prologue, every o block reading all splits' partials of its rows from L2 after its PDL wait, took
// ~2.6 us of o's ~6 us on the H200; here the exchange is one DSMEM
// hop inside a kernel already running, and o stages a plain fp16 row.
template <int HD, int HB, bool LP = false, bool CM = false>
__global__ void __launch_bounds__(128)
attn_decode_gqa(half* __restrict__ q,         // [H, HD] rotated (written here with qkv_acc)
                half* __restrict__ Kc,        // [ctx, KV, HD] this layer
                half* __restrict__ Vc,
                float* __restrict__ part_o,   // [H, S, HD] unnormalised
                float* __restrict__ part_ml,  // [H, S, 2] running max (log2 domain) and sum
                int n_keys, const int* __restrict__ pos_dev,  // when set, n_keys = *pos_dev + 1
                int H, int KV, float scale_log2,
                // null, or the q|k|v GEMV's fixed-point sums: q/k norm, RoPE and the cache write here
                const long long* __restrict__ qkv_acc, const half* __restrict__ qn, const half* __restrict__ kn,
                const float* __restrict__ cosb, const float* __restrict__ sinb, float eps,
                const float* __restrict__ ss_in, int ss_n, int ss_D,  // the scaled GEMV's sums of squares
                int min_chunk,                                         // fewest keys per split (decode_chunk)
                half* __restrict__ merged) {                           // CM: [H, HD] the merged output
    using L = AttnSplitSmem<HD, HB>;
    // the merge's slots, and before them the staged keys (attn_decode_split)
    __shared__ __align__(16) float sm_o[L::shared_floats];
    __shared__ float sm_ml[L::ml_floats];
    __shared__ __align__(16) half q_sm[HB * HD];
    // The position was written at the end of the previous step (advance_position), long finished
    // under PDL's transitive waits; L2 (.cg), as a line in this SM's L1 may be older.
    if (pos_dev) n_keys = __ldcg(pos_dev) + 1;
    const int kvh = CM ? blockIdx.y : blockIdx.x, hb = CM ? blockIdx.z : blockIdx.y;
    const int s = CM ? blockIdx.x : blockIdx.z, S = CM ? gridDim.x : gridDim.z, chunk = decode_chunk(n_keys, S, min_chunk);
    __shared__ __align__(16) typename attn_pick<CM, AttnCmSmem<HD, HB>, char>::type cm;
    float *own_o = nullptr, *own_ml = nullptr;  // CM: the split's partials into this block's shared memory
    if constexpr (CM) {  // the receive barrier armed before the PDL wait (off the path)
        cl_push_arm(smem_u32(&cm.bar), AttnCmSmem<HD, HB>::E * 4 + S * HB * 8);
        own_o = cm.o;
        own_ml = &cm.ml[0][0];
    }
    const bool has_keys = s * chunk < n_keys;  // splits past the keys present write nothing that is read
    uint4* stage = reinterpret_cast<uint4*>(sm_o);
    extern __shared__ __align__(16) unsigned char attn_dyn[];  // LP: [64][SRW] 16-byte pieces
    uint4* stage2 = LP ? reinterpret_cast<uint4*>(attn_dyn) : nullptr;
    // the newest key's rows, which the finish writes, into the stage when it holds them
    const int newest_kl = n_keys - 1 - s * chunk;
    half* k_stage = nullptr;
    if (stage && qkv_acc && newest_kl >= 0 && newest_kl < attn_staged_keys<HD, HB>(s * chunk, min(n_keys, (s + 1) * chunk)))
        k_stage = reinterpret_cast<half*>(stage + (size_t)newest_kl * L::SRW);
    attn_decode_split<HD, HB>(q, Kc, Vc, part_o, part_ml, kvh, hb, s, S, n_keys, min_chunk, H, KV, scale_log2,
                              sm_o, sm_ml, threadIdx.x, [] { __syncthreads(); }, [&] {
                                  pdl_wait();  // q and the newest key come from the kernel before
                                  pdl_trigger();
                                  if (qkv_acc && has_keys) {
                                      decode_finish_qkv<HD>(qkv_acc, q_sm, s == 0 ? q : nullptr, Kc, Vc, qn, kn,
                                                            cosb, sinb, eps, kvh * (H / KV) + hb * HB, HB,
                                                            kvh, H, KV, n_keys - 1, s == (n_keys - 1) / chunk,
                                                            ss_in, ss_n, ss_D, k_stage, k_stage ? k_stage + HD : nullptr);
                                      __syncthreads();  // q_sm, the stage and the block's cache writes visible
                                  }
                              }, qkv_acc ? q_sm : nullptr, stage, qkv_acc != nullptr, stage2,
                              own_o, own_ml);
    if constexpr (CM) attn_cm_merge<HD, HB>(cm, s, S, merged + (size_t)(kvh * (H / KV) + hb * HB) * HD);
}

// out[h, :] = merged softmax(V) over the splits that held keys. One block of HD threads per head.
// (Decode normally merges in the o-projection GEMV's prologue instead: gemv_w4a16.cu.)
__global__ void attn_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                    half* __restrict__ out, int S, int HD,
                                    int n_keys, const int* __restrict__ pos_dev,  // as the split kernel's
                                    int min_chunk) {
    pdl_wait();
    pdl_trigger();
    const int h = blockIdx.x, d = threadIdx.x;
    if (pos_dev) n_keys = *pos_dev + 1;
    out[(size_t)h * HD + d] = decode_merge(part_o, part_ml, h, d, S, HD, n_keys, min_chunk);
}
