// The attention half of a dense decode layer in one launch: the q|k|v GEMV (with the RMSNorm and the
// previous down projection's residual add in its prologue), the q/k norm, RoPE and KV-cache write,
// flash decoding, the merge, and the o GEMV, by one or two thread-block clusters per KV head.
// Opt-in (KUIPER_DECODE_ATTN=1): on H100 it measured slower than those three launches (PERFORMANCE.md
// change 74).
//
// Why: as three launches (q|k|v GEMV, flash decoding, o GEMV) the span from the q|k|v GEMV's wait to
// the gate/up GEMV's is ~23 µs per Qwen3-8B layer for ~23 MB of weights (~8 µs at the copy rate;
// PERFORMANCE.md changes 67-71): every hand-off is a grid-wide wait, and no weight load can start
// before its kernel does. Here a KV head's cluster of CL blocks (one per SM) owns its query heads
// end to end, so the hand-offs are cluster barriers, partial sums move through distributed shared
// memory, and every block's weights (its K span of the group's q|k|v columns, its columns of the o
// rows the group produces) are bulk-copied into shared memory at the kernel's start, before the PDL
// wait: they stream while the predecessor drains and while attention runs. Where both do not fit
// (o_late: Qwen3-8B's 4 query heads per cluster), o's weights are copied after the q|k|v dot product,
// over q|k|v's from 64 KB on, while the heads are finished and attention runs.
//
// Clusters: on H100 at most 7 clusters of 16 blocks are co-resident (its GPCs), fewer than Qwen3-8B's
// 8 KV heads, so a KV head may take NS = G / QH clusters of CL blocks, each serving QH of its query
// heads and computing the head's k and v itself (the same bits in both; k and v weights are read
// NS times, ~4% more bytes per 8B step for NS = 2). Cluster (c, half), block b:
//   q|k|v: rows [RB b, RB b + RB) (RB = D / CL) of its (QH+2)*128 columns, partial sums to shared memory;
//   head finish: warp w of block b finishes column block t = b + w CL < QH + 2 over the cluster
//     (DSMEM), with the deferred 1/rms, q/k RMSNorm and RoPE; q stays in shared memory, k and v go
//     to the cache;
//   flash decoding: 4 splits of 128 threads per block, split s = j CL + b of S = 4 CL;
//   merge: block b merges elements [b E/CL, (b+1) E/CL) of the cluster's E = QH*128 outputs;
//   o: columns [OC b, OC b + OC) (OC = D / CL, whole 256-column tiles) over the cluster's E rows,
//     added into the fixed-point accumulator (gemv_w4a16.cu's accumulating mode: the gate/up GEMV
//     finishes it). The NS * KV clusters each add their heads' share.
// Supported (checked on the host, ops_cupy.decode_attn_plan): head_dim 128, QH in {2, 4}, D / CL 256
// or 512, group size 128, KV even.
#include "common.cuh"
#include "attn_decode.cuh"

#define DA_HD 128
#define DA_THREADS 512
#define DA_FIXED 12288      // bytes of small shared arrays before the weight regions

// 16 rows of one packed word from shared memory (4 row quads of the tiled layout, `qstride` words
// apart) against x[16], folded into acc[8] with the group's scales: gemv_w4a16's step.
__device__ __forceinline__ void da_dot16(const u32* w, int qstride, const half* x, const half2 (&zb)[4],
                                         const half2 (&s2)[4], float (&acc)[8]) {
#pragma unroll
    for (int r = 0; r < 16; r += 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(w + (r >> 2) * qstride);
        const u32 wv[4] = {v.x, v.y, v.z, v.w};
        awq_dot4_fold(wv, x + r, zb, s2, acc);
    }
}

template <int QH>
__global__ void __launch_bounds__(DA_THREADS, 1)
decode_attn_half(const float* __restrict__ h,         // [D] residual row
                 const long long* __restrict__ pend,  // [D] the previous down projection's sums, or null
                 float* __restrict__ hout,            // [D] h + fp16(pend), written by cluster 0 (pend set)
                 const half* __restrict__ nw, float eps,  // [D] attention RMSNorm weight
                 const u32* qw_q, const u32* qz_q, const half* sc_q,  // [D, H*128] tiled, zeros, scales
                 const u32* qw_k, const u32* qz_k, const half* sc_k,  // [D, KV*128]
                 const u32* qw_v, const u32* qz_v, const half* sc_v,
                 const u32* qw_o, const u32* qz_o, const half* sc_o,  // [H*128, D]
                 const half* __restrict__ qn, const half* __restrict__ kn,          // [128] q/k norm weights
                 const float* __restrict__ cosb, const float* __restrict__ sinb,    // [ctx, 64]
                 half* __restrict__ Kc, half* __restrict__ Vc,                      // [ctx, KV, 128] this layer
                 const int* __restrict__ pos_dev,                                   // the position
                 float* __restrict__ part_o, float* __restrict__ part_ml,           // [H, 4 CL, 128], [H, 4 CL, 2]
                 long long* __restrict__ acc_o,                                     // [D] o sums (zero on entry)
                 long long* __restrict__ zero_p, int zero_n,                        // cleared after the wait
                 int D, int H, int KV, float scale_log2,
                 int o_late) {  // o's weights copied after the q|k|v dot, into its space (no room before)
    constexpr int NWQ = QH * 16, NW = NWQ + 32;      // packed words per row: q, then k (16), v (16)
    constexpr int E = QH * DA_HD;                    // the cluster's attention outputs = its o rows
    constexpr int NH = QH + 2;                       // column blocks to finish: q heads, k, v
    using AS = AttnSplitSmem<DA_HD, QH>;
    static_assert(QH % 2 == 0 && QH <= 4, "q columns in whole 256-column tiles; o_floats of 4 splits <= 64 KB");
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int CL = gridDim.x, b = blockIdx.x, NS = gridDim.y / KV;
    const int c = blockIdx.y / NS, hq0 = c * (H / KV) + (blockIdx.y % NS) * QH;  // KV head, first query head
    const int qd = H * DA_HD, kvd = KV * DA_HD;
    const int RB = D / CL, NQ = RB / 4, NCH = RB / 64;  // q|k|v rows per block, row quads, 64-row chunks
    const int OT = D / CL / 256;                        // o column tiles per block
    const int WPT = (DA_THREADS / 32) / OT, RW = E / WPT;  // o: warps per tile, rows per warp

    // ---- shared memory: small arrays, then the weight regions ----
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem);  // [NCH] q|k|v stages, then o
    half* xsm = reinterpret_cast<half*>(smem + 128);                        // [RB <= 512] x span
    float* part_sm = reinterpret_cast<float*>(smem + 128 + 1024);          // [NW * 8] q|k|v partial sums
    float* misc = part_sm + NW * 8;                                         // [64]: ss, reductions
    half* qrot_sm = reinterpret_cast<half*>(misc + 64);                     // [4][128] q heads finished here
    half* qatt_sm = qrot_sm + 4 * DA_HD;                                    // [E] the cluster's q
    half* merged_sm = qatt_sm + E;                                          // [E / CL] merged outputs
    half* xo_sm = merged_sm + E;                                            // [E] o's input
    float* att_ml = reinterpret_cast<float*>(xo_sm + E);                    // [4][AS::ml_floats]
    static_assert(128 + 1024 + NW * 32 + 256 + 4 * DA_HD * 2 + 3 * E * 2 + 4 * AS::ml_floats * 4 <= DA_FIXED,
                  "DA_FIXED");
    unsigned char* WQ = smem + DA_FIXED;                                    // [QH/2][NQ][32][4] words
    unsigned char* WK = WQ + QH * RB * 64;                                  // [NQ][16][4]
    unsigned char* WV = WK + RB * 64;
    // [OT][E/4][32][4]: after q|k|v's weights, or (o_late) over them past the first 64 KB
    unsigned char* WO = o_late ? WQ + 65536 : WV + RB * 64;
    float* red = reinterpret_cast<float*>(WQ);      // q|k|v partials [NCH][NW*8] (WQ is dead by then)
    float* sm_o = reinterpret_cast<float*>(WQ);     // attention scratch [4][AS::o_floats] (<= 64 KB)
    float* red_o = reinterpret_cast<float*>(WQ);    // o partials [16][256 + 8], after attention
    const u32 bar0 = smem_u32(bars), bar_o = bar0 + 8 * NCH;

    // o: tiles b*OT.., rows [hq0 128, hq0 128 + E): contiguous per tile, in 16 KB pieces (warp 0)
    auto copy_o = [&](unsigned long long pol) {
        for (int i = lane; i < OT * (E / 128); i += 32) {
            const int t = i / (E / 128), p = i % (E / 128);
            bulk_g2s(smem_u32(WO + (size_t)t * E * 128 + (size_t)p * 16384),
                    qw_o + (size_t)(b * OT + t) * 32 * qd + (size_t)(hq0 * DA_HD / 4) * 128 + (size_t)p * 4096, 16384,
                    bar_o, pol);
        }
    };
    // ---- before the PDL wait: start every weight copy, load the zeros and scales ----
    if (tid == 0) {
        for (int i = 0; i <= NCH; ++i) mbar_init(bar0 + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp == 0) {
        unsigned long long pol;  // weights are read once per step: keep h, the cache and partials in L2
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
        if (lane == 0) {
            for (int s = 0; s < NCH; ++s) mbar_arrive_expect_tx(bar0 + 8 * s, (QH / 2) * 8192 + 2 * 4096);
            mbar_arrive_expect_tx(bar_o, OT * E * 128);
        }
        __syncwarp();
        // chunk s: row quads [16s, 16s+16) of the span. q: QH/2 whole tiles (8 KB contiguous each);
        // k and v: half of one tile (256 bytes of every row quad)
        for (int s = 0; s < NCH; ++s) {
            const int quad0 = b * NQ + s * 16;  // global row quad
            for (int i = lane; i < QH / 2 + 32; i += 32) {
                if (i < QH / 2) {
                    const int t = hq0 / 2 + i;  // q tile
                    bulk_g2s(smem_u32(WQ + ((size_t)(i * NQ + s * 16) * 128) * 4),
                            qw_q + (size_t)t * 32 * D + (size_t)quad0 * 128, 8192, bar0 + 8 * s, pol);
                } else {
                    const int j = i - QH / 2, isv = j >= 16, q = j & 15;
                    const u32* src = (isv ? qw_v : qw_k) + (size_t)(c >> 1) * 32 * D + (size_t)(quad0 + q) * 128 +
                                     (c & 1) * 64;
                    bulk_g2s(smem_u32((isv ? WV : WK) + (size_t)(s * 16 + q) * 256), src, 256, bar0 + 8 * s, pol);
                }
            }
        }
        if (!o_late) copy_o(pol);
    }
    // this thread's (q|k|v word, 64-row chunk) pairs, p = tid and tid + 512, with their groups' zero
    // words and scales
    const int NP = NW * NCH;
    u32 zq[2] = {0, 0};
    uint4 sq[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int p = tid + k * DA_THREADS, qw_ = p % NW, qrc = p / NW;
        if (p >= NP) break;
        const int gi = (b * RB + qrc * 64) / 128;
        if (qw_ < NWQ) {
            const int gw = hq0 * 16 + qw_;
            zq[k] = __ldg(qz_q + (size_t)gi * (qd / 8) + gw);
            sq[k] = __ldg(reinterpret_cast<const uint4*>(sc_q + (size_t)gi * qd + gw * 8));
        } else {
            const bool isv = qw_ >= NWQ + 16;
            const int gw = c * 16 + (qw_ - NWQ) % 16;
            zq[k] = __ldg((isv ? qz_v : qz_k) + (size_t)gi * (kvd / 8) + gw);
            sq[k] = __ldg(reinterpret_cast<const uint4*>((isv ? sc_v : sc_k) + (size_t)gi * kvd + gw * 8));
        }
    }
    // o: lane = word of tile ot, warp = rows [wr RW, wr RW + RW) of the cluster's E
    const int ot = warp / WPT, wr = warp % WPT;
    const int ogi = (hq0 * DA_HD + wr * RW) / 128, oword = (b * OT + ot) * 32 + lane;
    const u32 zo = __ldg(qz_o + (size_t)ogi * (D / 8) + oword);
    const uint4 so = __ldg(reinterpret_cast<const uint4*>(sc_o + (size_t)ogi * D + oword * 8));

    pdl_wait();  // h, pend and the accumulators belong to the kernels before us
    pdl_trigger();
    const int pos = __ldcg(pos_dev), n_keys = pos + 1;
    {  // accumulators whose last reader has finished (the down GEMV before us)
        const int nb = gridDim.x * gridDim.y, bi = blockIdx.y * CL + b;
        for (int i = bi * DA_THREADS + tid; i < zero_n; i += nb * DA_THREADS) zero_p[i] = 0;
    }

    // ---- x = (h + fp16(pend)) * w over the span; its sum of squares (the 1/rms is applied later) ----
    float hv = 0.f, ssl = 0.f, f = 0.f;
    if (tid < RB) {
        const int k = b * RB + tid;
        hv = pend ? __ldcg(h + k) + fix_h(__ldcg(pend + k)) : __ldcg(h + k);
        if (pend && blockIdx.y == 0) hout[k] = hv;
        ssl = hv * hv;
        f = hv * __half2float(nw[k]);
    }
    const float ss_blk = block_sum(ssl, misc + 32);
    __syncthreads();  // block_sum's scratch is block_max_nonneg's
    const int xexp = x_scale_exp(block_max_nonneg<DA_THREADS / 32>(fabsf(f), reinterpret_cast<unsigned*>(misc + 32)));
    if (tid < RB) xsm[tid] = __float2half(f * exp2f(-(float)xexp));
    if (tid == 0) misc[0] = ss_blk;
    __syncthreads();

    // ---- q|k|v partial sums over the span: a pair waits for its own chunk's copies only ----
    float acc[2][8];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[k][i] = 0.f;
        const int p = tid + k * DA_THREADS, qw_ = p % NW, qrc = p / NW;
        if (p >= NP) break;
        mbar_wait(bar0 + 8 * qrc, 0);
        const u32* w;
        int qs;  // words from one row quad to the next
        if (qw_ < NWQ) { w = reinterpret_cast<const u32*>(WQ) + ((size_t)(qw_ / 32) * NQ * 32 + (qw_ % 32)) * 4; qs = 128; }
        else if (qw_ < NWQ + 16) { w = reinterpret_cast<const u32*>(WK) + (qw_ - NWQ) * 4; qs = 64; }
        else { w = reinterpret_cast<const u32*>(WV) + (qw_ - NWQ - 16) * 4; qs = 64; }
        w += (size_t)(qrc * 16) * qs;
        half2 zb[4];
        awq_zero_bias(zq[k], zb);
        const half2 s2[4] = {*reinterpret_cast<const half2*>(&sq[k].x), *reinterpret_cast<const half2*>(&sq[k].y),
                             *reinterpret_cast<const half2*>(&sq[k].z), *reinterpret_cast<const half2*>(&sq[k].w)};
#pragma unroll 1
        for (int r = 0; r < 64; r += 16) da_dot16(w + (r / 4) * qs, qs, xsm + qrc * 64 + r, zb, s2, acc[k]);
    }
    __syncthreads();  // q|k|v weights read by every thread: their space becomes the partials' (and o's)
    if (o_late && warp == 0) {
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // our reads before the copies' writes
        unsigned long long pol;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
        copy_o(pol);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int p = tid + k * DA_THREADS, qw_ = p % NW, qrc = p / NW;
        if (p >= NP) break;
        float4* dst = reinterpret_cast<float4*>(red + qrc * NW * 8 + qw_ * 8);
        dst[0] = make_float4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]);
        dst[1] = make_float4(acc[k][4], acc[k][5], acc[k][6], acc[k][7]);
    }
    __syncthreads();
    for (int col = tid; col < NW * 8; col += DA_THREADS) {
        float s = 0.f;
        for (int r = 0; r < NCH; ++r) s += red[r * NW * 8 + col];
        part_sm[col] = ldexpf(s, xexp);
    }
    cl_sync();  // #1: every block's partials and sum of squares

    // ---- head finish: warp w of block b finishes column block t = b + w CL (q heads, then k, v) ----
    if (b + warp * CL < NH) {
        const int t = b + warp * CL;
        const float tot = warp_sum(lane < CL ? cl_ld(cl_map(smem_u32(misc), lane)) : 0.f);  // rank order
        const float inv = rsqrtf(tot / D + eps);
        constexpr int HH = DA_HD / 2;
        float a[2] = {0.f, 0.f}, bb[2] = {0.f, 0.f};
        const u32 base = smem_u32(part_sm + t * DA_HD);
        for (int r = 0; r < CL; ++r) {
            const u32 rb = cl_map(base, r);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                a[i] += cl_ld(rb + 4 * (lane * 2 + i));
                bb[i] += cl_ld(rb + 4 * (HH + lane * 2 + i));
            }
        }
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            a[i] = __half2float(__float2half(a[i] * inv));
            bb[i] = __half2float(__float2half(bb[i] * inv));
            ss += a[i] * a[i] + bb[i] * bb[i];
        }
        if (t == QH + 1) {  // v: stored as the fp16 projection output
            half* dst = Vc + ((size_t)pos * KV + c) * DA_HD;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                dst[lane * 2 + i] = __float2half(a[i]);
                dst[HH + lane * 2 + i] = __float2half(bb[i]);
            }
        } else {
            const float hinv = rsqrtf(warp_sum(ss) / DA_HD + eps);
            const half* hw = t < QH ? qn : kn;
            half* qdst = qrot_sm + warp * DA_HD;  // q head t lives in block t % CL, slot t / CL
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int d = lane * 2 + i;
                const float cs = cosb[(size_t)pos * HH + d], sn = sinb[(size_t)pos * HH + d];
                const float xa = a[i] * hinv * __half2float(hw[d]), xb = bb[i] * hinv * __half2float(hw[d + HH]);
                const half lo = __float2half(xa * cs - xb * sn), hi = __float2half(xb * cs + xa * sn);
                if (t < QH) {
                    qdst[d] = lo;
                    qdst[d + HH] = hi;
                } else {
                    half* dst = Kc + ((size_t)pos * KV + c) * DA_HD;
                    dst[d] = lo;
                    dst[d + HH] = hi;
                }
            }
        }
    }
    cl_sync();  // #2: q in blocks' shared memory, the newest k and v in the cache

    // ---- flash decoding: 4 splits of 128 threads ----
    if (tid < E / 8) {  // the cluster's q heads
        const int j = tid / 16, piece = tid % 16;
        *reinterpret_cast<uint4*>(qatt_sm + j * DA_HD + piece * 8) =
            cl_ld16(cl_map(smem_u32(qrot_sm + (j / CL) * DA_HD + piece * 8), j % CL));
    }
    __syncthreads();
    const int S = 4 * CL;
    {
        const int j = tid >> 7;
        attn_decode_split<DA_HD, QH>(nullptr, Kc, Vc, part_o, part_ml, c, (blockIdx.y % NS), j * CL + b, S, n_keys,
                                     DECODE_MIN_CHUNK, H, KV, scale_log2, sm_o + j * AS::o_floats,
                                     att_ml + j * AS::ml_floats, tid & 127,
                                     [j] { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + j) : "memory"); }, [] {},
                                     qatt_sm);
    }
    cl_sync();  // #3: the splits' partials (global memory, read through L2)

    // ---- merge elements [b E/CL, (b+1) E/CL): a warp per element, lanes over the splits ----
    {
        const int epb = E / CL, used = decode_splits_used(n_keys, S, DECODE_MIN_CHUNK);
        for (int e = warp; e < epb; e += DA_THREADS / 32) {
            const int ge = b * epb + e, hh = hq0 + ge / DA_HD, d = ge % DA_HD;
            float M = -INFINITY, L = 0.f, od = 0.f;
            for (int s = lane; s < used; s += 32) {
                const float ms = __ldcg(part_ml + ((size_t)hh * S + s) * 2), ls = __ldcg(part_ml + ((size_t)hh * S + s) * 2 + 1);
                const float os = __ldcg(part_o + ((size_t)hh * S + s) * DA_HD + d);
                if (ls == 0.f) continue;
                const float mn = fmaxf(M, ms), wa = exp2f(M - mn), wb = exp2f(ms - mn);
                L = L * wa + ls * wb;
                od = od * wa + os * wb;
                M = mn;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float M2 = __shfl_xor_sync(0xffffffffu, M, o), L2 = __shfl_xor_sync(0xffffffffu, L, o);
                const float o2 = __shfl_xor_sync(0xffffffffu, od, o);
                const float mn = fmaxf(M, M2);
                const float wa = L > 0.f ? exp2f(M - mn) : 0.f, wb = L2 > 0.f ? exp2f(M2 - mn) : 0.f;
                // both lanes of a pair add the same two products (addition commutes): the same bits
                L = L * wa + L2 * wb;
                od = od * wa + o2 * wb;
                M = mn;
            }
            if (lane == 0) merged_sm[e] = __float2half(L > 0.f ? od / L : 0.f);
        }
    }
    cl_sync();  // #4: merged outputs

    // ---- o: the cluster's E inputs, then this block's OT column tiles over them ----
    if (tid < E / 8) {
        const int ge = tid * 8, epb = E / CL;
        *reinterpret_cast<uint4*>(xo_sm + ge) = cl_ld16(cl_map(smem_u32(merged_sm + ge % epb), ge / epb));
    }
    cl_arrive();  // #5 (arrive): this block reads no other block's shared memory after here
    __syncthreads();
    float mo = 0.f;
    for (int e = tid; e < E; e += DA_THREADS) mo = fmaxf(mo, fabsf(__half2float(xo_sm[e])));
    const int oexp = x_scale_exp(block_max_nonneg<DA_THREADS / 32>(mo, reinterpret_cast<unsigned*>(misc + 32)));
    if (oexp) {  // rare: rescale the input (exact powers of two)
        __syncthreads();
        for (int e = tid; e < E; e += DA_THREADS) xo_sm[e] = __float2half(__half2float(xo_sm[e]) * exp2f(-(float)oexp));
        __syncthreads();
    }
    float oacc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) oacc[i] = 0.f;
    mbar_wait(bar_o, 0);
    {
        half2 zb[4];
        awq_zero_bias(zo, zb);
        const half2 s2[4] = {*reinterpret_cast<const half2*>(&so.x), *reinterpret_cast<const half2*>(&so.y),
                             *reinterpret_cast<const half2*>(&so.z), *reinterpret_cast<const half2*>(&so.w)};
        const u32* w = reinterpret_cast<const u32*>(WO + (size_t)ot * E * 128) + ((size_t)(wr * RW / 4) * 32 + lane) * 4;
#pragma unroll 1
        for (int r = 0; r < RW; r += 16) da_dot16(w + (r / 4) * 128, 128, xo_sm + wr * RW + r, zb, s2, oacc);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) red_o[warp * (256 + 8) + lane * 8 + i + lane / 4] = oacc[i];
    __syncthreads();
    for (int t = tid; t < OT * 256; t += DA_THREADS) {
        const int tt = t / 256, col = t % 256;
        float s = 0.f;
        for (int w = 0; w < WPT; ++w) s += red_o[(tt * WPT + w) * (256 + 8) + col + col / 32];
        fix_add(acc_o + (size_t)b * OT * 256 + t, ldexpf(s, oexp));
    }
    cl_wait();  // #5: no block of the cluster still reads this block's shared memory
}
