// Qwen3-MoE routing, expert maps and finalize. The grouped expert GEMMs live in gemm_w4a16.cu and
// the expert GEMV (with its SwiGLU and weighted-sum epilogues) in gemv_w4a16.cu, on the same tiles
// as the dense path; this file holds what sits between them.
//
// Stage order (prefill):  route_mma (logits on tensor cores + topk, the expert maps in its last block;
//                         router_logits -> topk -> expert_maps where it does not fit) -> GEMM1 (gather +
//                         gate|up + SwiGLU) -> GEMM2 (down) -> finalize.
//   On compute capability 9.0 (gemm_wgmma.cu gemm_moe_rs, ops_cupy.moe_experts): expert_maps in tiles of
//   64 or 128 rows -> gather_rows (TMA cannot gather) -> GEMM1 (gate|up) -> silu_mul -> GEMM2 -> finalize.
//   By default finalize is taken by the next layer's add_rmsnorm (norm.cu; common.cuh expert_rows_sum8).
// Stage order (decode):   route_decode (rmsnorm + router + topk) -> expert GEMV gate|up (+SwiGLU)
//                         -> expert GEMV down (+weighted sum over the k experts).
// Everything stays on the device: expert ids are read by later kernels, never by the host, so a
// decode step still replays as one CUDA graph.
//
// Supported (checked on the host): num_experts <= 256, experts per token <= 32, D % 8 == 0.
#include "common.cuh"

#define MOE_MAP_WARPS 32    // warps of the single-block map builder

// 8 fp16 products summed in fp32 (one 16-byte load of x and of a router row).
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
    const half2* ah = reinterpret_cast<const half2*>(&a);
    const half2* bh = reinterpret_cast<const half2*>(&b);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 fa = __half22float2(ah[j]), fb = __half22float2(bh[j]);
        s += fa.x * fb.x + fa.y * fb.y;
    }
    return s;
}

// x . w in fp32 over D fp16 elements (D % 8 == 0) by one warp, the result in every lane: the
// router logit of one expert. x may be in shared memory, w (a router row) is read through L1.
// Lane l takes 16-byte chunks l, l + 32, ... from chunk `from` on, added to s in that order.
__device__ __forceinline__ float router_dot(const half* x, const half* __restrict__ w, int D, float s = 0.f,
                                            int from = 0) {
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    const uint4* wr = reinterpret_cast<const uint4*>(w);
#pragma unroll 4
    for (int i = from + (threadIdx.x & 31); i < D / 8; i += 32) s += dot8(xr[i], __ldg(wr + i));
    return warp_sum(s);
}

// logits[t, e] = x[t] . router[e] in fp32. grid (ceil(E / 8), ceil(T / MOE_LOGIT_TB)), block 256: one warp per
// expert, so a decode step spreads the router's E x D read over many SMs. The block's TB token rows are staged
// in shared memory a segment of D at a time (every load of a segment in flight at once) and each warp runs them
// over its router segment held in registers: the router is read once per TB tokens. (Per token, a 2048-token
// prefill read the whole router 2048 times, 1 GB per 30B-A3B layer from L2: 183 us on the H200; holding x in
// registers instead left too few loads in flight.) Each lane adds its chunks in
// router_dot's order (l, l + 32, ..), then warp_sum.
#define MOE_LOGIT_TB 16    // tokens per block
#define MOE_LOGIT_SEG 128  // 16-byte chunks of D per staged segment (1024 halves; 32 KB for TB rows)
__global__ void __launch_bounds__(256)
moe_router_logits(const half* __restrict__ x,       // [T, D]
                  const half* __restrict__ router,  // [E, D]
                  float* __restrict__ logits,       // [T, E]
                  int T, int D, int E) {
    __shared__ uint4 xs[MOE_LOGIT_TB][MOE_LOGIT_SEG];
    pdl_wait();
    pdl_trigger();
    const int lane = threadIdx.x & 31, e = blockIdx.x * 8 + (threadIdx.x >> 5), t0 = blockIdx.y * MOE_LOGIT_TB;
    const int nt = min(MOE_LOGIT_TB, T - t0), nc = D / 8;
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)t0 * D);
    const uint4* wr = reinterpret_cast<const uint4*>(router + (size_t)min(e, E - 1) * D);
    float s[MOE_LOGIT_TB];
#pragma unroll
    for (int t = 0; t < MOE_LOGIT_TB; ++t) s[t] = 0.f;
    for (int c0 = 0; c0 < nc; c0 += MOE_LOGIT_SEG) {
        constexpr int PER = MOE_LOGIT_TB * MOE_LOGIT_SEG / 256;  // chunks each thread stages
        uint4 v[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) {  // rows past T and chunks past D as zeros
            const int i = threadIdx.x + 256 * j, t = i / MOE_LOGIT_SEG, c = c0 + i % MOE_LOGIT_SEG;
            v[j] = t < nt && c < nc ? __ldg(xr + (size_t)t * nc + c) : make_uint4(0, 0, 0, 0);
        }
        uint4 w[MOE_LOGIT_SEG / 32];
#pragma unroll
        for (int j = 0; j < MOE_LOGIT_SEG / 32; ++j) {
            const int c = c0 + lane + 32 * j;
            w[j] = c < nc ? __ldg(wr + c) : make_uint4(0, 0, 0, 0);
        }
        __syncthreads();  // every warp is done with the previous segment
#pragma unroll
        for (int j = 0; j < PER; ++j) (&xs[0][0])[threadIdx.x + 256 * j] = v[j];
        __syncthreads();
#pragma unroll
        for (int t = 0; t < MOE_LOGIT_TB; ++t)
#pragma unroll
            for (int j = 0; j < MOE_LOGIT_SEG / 32; ++j)
                if (c0 + lane + 32 * j < nc) s[t] += dot8(xs[t][lane + 32 * j], w[j]);
    }
    if (e >= E) return;
#pragma unroll
    for (int t = 0; t < MOE_LOGIT_TB; ++t) {
        if (t >= nt) break;
        const float r = warp_sum(s[t]);
        if (lane == 0) logits[(size_t)(t0 + t) * E + e] = r;
    }
}

// The expert maps, by one block of NW warps (blockDim.x == 32 NW). Slots s = t*k + j are ordered by
// (expert, s) -- a stable counting sort: each warp owns a contiguous slot range, counts it, and
// then places its slots in order, so the result never depends on scheduling or on NW.
//   counts [E], offsets [E+1] (exclusive prefix sum), tile_offsets [E+1] (prefix sum of
//   ceil(count / tile_m): the grouped GEMM's block -> expert table, tile_m its rows per tile: 64 for
//   gemm_w4a16.cu's, 64 or 128 for gemm_wgmma.cu's gemm_moe_rs), perm_to_unperm [n] and unperm_to_perm [n].
// cnt: NW x MOE_MAX_E ints and tot: MOE_MAX_E ints of shared memory; p2u_s: cap more ints, where perm_to_unperm is
// put together when n <= cap, then stored in order. Why: placed straight into global memory (scattered stores,
// each chunk's followed by a __syncwarp that orders them) the maps took as long as with __match_any_sync: ~21 us
// per 2048-token 30B-A3B layer on the H200 with either, ~15 with neither.
// ids are read through L2 (__ldcg): in moe_route_mma's last block other blocks wrote them; a warp's ids come
// MOE_MAP_BATCH chunks of 32 at a time, all loads in flight before the first is used.
#define MOE_MAP_BATCH 4
// The lanes whose e (an expert id below 256, or -1 for none) equals this lane's, as a mask (0 for e < 0): one ballot
// per bit of e. Why: __match_any_sync kept the maps at ~21 us per 2048-token 30B-A3B layer on the H200 with
// perm_to_unperm staged; these ballots ~15.
__device__ __forceinline__ unsigned lanes_with_same_expert(int e) {
    unsigned m = __ballot_sync(0xffffffffu, e >= 0);
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // MOE_MAX_E = 256: 8 bits
        const bool bit = (e >> i) & 1;
        const unsigned b = __ballot_sync(0xffffffffu, bit);
        m &= bit ? b : ~b;
    }
    return e >= 0 ? m : 0u;
}
// A warp's expert ids of slots c0 + 32 b + lane (b < MOE_MAP_BATCH), -1 from s1 on: every load issued before any
// is used (both passes of expert_maps_block read them this way).
__device__ __forceinline__ void map_ids_batch(const int* ids, int c0, int s1, int lane, int (&e)[MOE_MAP_BATCH]) {
#pragma unroll
    for (int b = 0; b < MOE_MAP_BATCH; ++b) {
        const int s = c0 + 32 * b + lane;
        e[b] = s < s1 ? __ldcg(ids + s) : -1;
    }
}
template <int NW>
__device__ __forceinline__ void expert_maps_block(const int* ids, int n, int E, int tile_m, int* __restrict__ counts,
                                                  int* __restrict__ offsets, int* __restrict__ tile_offsets,
                                                  int* __restrict__ perm_to_unperm, int* __restrict__ unperm_to_perm,
                                                  int* cnt, int* tot,  // cnt [NW][MOE_MAX_E], tot [MOE_MAX_E]
                                                  int* p2u_s, int cap) {  // [cap]
    const bool staged = n <= cap;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunk = ((n + NW - 1) / NW + 31) / 32 * 32;
    const int s0 = warp * chunk, s1 = min(n, s0 + chunk);
    int* my = cnt + warp * MOE_MAX_E;  // this warp's count per expert, then its write cursor
    for (int i = threadIdx.x; i < NW * MOE_MAX_E; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    for (int c0 = s0; c0 < s1; c0 += 32 * MOE_MAP_BATCH) {
        int e[MOE_MAP_BATCH];
        map_ids_batch(ids, c0, s1, lane, e);
#pragma unroll
        for (int b = 0; b < MOE_MAP_BATCH; ++b)
            if (e[b] >= 0) atomicAdd(my + e[b], 1);
    }
    __syncthreads();
    // per expert: total count, and each warp's start inside the expert's segment (still relative)
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int run = 0;
        for (int w = 0; w < NW; ++w) {
            const int c = cnt[w * MOE_MAX_E + e];
            cnt[w * MOE_MAX_E + e] = run;
            run += c;
        }
        counts[e] = run;
        tot[e] = run;
    }
    __syncthreads();
    // the offsets and tile offsets: warp 0's exclusive scan, 8 experts per lane (E <= 256), from shared memory
    // (one thread's serial pass over E counts read back from global memory took longer)
    if (warp == 0) {
        int c[MOE_MAX_E / 32], sc = 0, st = 0;
#pragma unroll
        for (int j = 0; j < MOE_MAX_E / 32; ++j) {
            const int e = lane * (MOE_MAX_E / 32) + j;
            c[j] = e < E ? tot[e] : 0;
            sc += c[j];
            st += (c[j] + tile_m - 1) / tile_m;
        }
        int off = sc, toff = st;  // inclusive over lanes, then exclusive
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, off, o), b = __shfl_up_sync(0xffffffffu, toff, o);
            if (lane >= o) {
                off += a;
                toff += b;
            }
        }
        off -= sc;
        toff -= st;
#pragma unroll
        for (int j = 0; j < MOE_MAX_E / 32; ++j) {
            const int e = lane * (MOE_MAX_E / 32) + j;
            if (e < E) {
                offsets[e] = off;
                tile_offsets[e] = toff;
                tot[e] = off;
            }
            off += c[j];
            toff += (c[j] + tile_m - 1) / tile_m;
        }
        if (lane == 31) {  // (experts past E count 0: lane 31 ends on the totals)
            offsets[E] = off;
            tile_offsets[E] = toff;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int base = tot[e];
        for (int w = 0; w < NW; ++w) cnt[w * MOE_MAX_E + e] += base;
    }
    __syncthreads();
    // place this warp's slots in slot order: rank among equal experts in each 32-slot chunk, then the
    // chunk's group leader advances the cursor
    for (int c0 = s0; c0 < s1; c0 += 32 * MOE_MAP_BATCH) {
        int e[MOE_MAP_BATCH];
        map_ids_batch(ids, c0, s1, lane, e);
#pragma unroll
        for (int b = 0; b < MOE_MAP_BATCH; ++b) {
            const int s = c0 + 32 * b + lane;
            const unsigned peers = lanes_with_same_expert(e[b]);
            if (e[b] >= 0) {
                const int pos = my[e[b]] + __popc(peers & ((1u << lane) - 1u));
                (staged ? p2u_s : perm_to_unperm)[pos] = s;
                unperm_to_perm[s] = pos;
            }
            __syncwarp();
            if (e[b] >= 0 && lane == __ffs(peers) - 1) my[e[b]] += __popc(peers);
            __syncwarp();
        }
    }
    if (staged) {
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) perm_to_unperm[i] = p2u_s[i];
    }
}

// Prefill routing in one launch on tensor cores: logits[t, e] = x[t] . router[e], fp16 products summed in
// fp32 (mma.sync m16n8k16 with fp32 accumulators: products of fp16 values are exact in fp32, as in
// moe_router_logits; only the order of the sums differs), then each token's softmax, top-k and
// renormalisation (moe_topk_regs) from the block's logits in shared memory. Why: moe_router_logits' CUDA-core
// dot products took 29 µs per Qwen3-30B-A3B layer at 512 tokens (H200), the fp32 cuBLAS GEMM used from 1024
// tokens needed fp32 copies of x and the router (58 µs at 2048), and moe_topk was a launch of its own.
// A block takes 16 tokens (one m16 tile) and every expert: warp w the 32 experts of group w % NG (4 n8 tiles)
// over its chunks c = w / NG, w / NG + KS, .. of D's 32-wide chunks, whose 6 pieces per lane (2 rows of
// x, 4 router rows) come through MOE_RMMA_ST stages of cp.async in the warp's own shared memory (each lane
// reads back only what it copied: no barrier). With the pieces loaded into registers instead, nvcc placed
// each chunk's loads just before its products, one L2 round trip per chunk: 39 µs per layer.
// The KS partial sums are added in shared memory in a fixed order (the same bits on every run). Rows
// past T and experts past E read clamped rows and are not stored. Lane (g, q) = (lane / 4, lane % 4) reads
// halves 8q .. 8q + 7 of a chunk of each row: the dot product does not care in which order k runs, so the
// chunk's two mma.sync take logical k (2q, 2q + 1 | 2q + 8, 2q + 9) from halves (8q, 8q + 1 | 8q + 2, 8q + 3)
// and (8q + 4, 8q + 5 | 8q + 6, 8q + 7), for A and B alike: every operand is one 16-byte piece, no ldmatrix.
// KS = 16 / NG (16 warps, each over half the chunks) is the form while its blocks (one per SM) are one wave
// (ops_cupy.moe_route_wide_t): there a block's time is its warps' chains of chunks)
// . grid ceil(T / 16), block 32 NG KS, dynamic shared memory ops_cupy.moe_rmma_smem (the stages:
// 12 KB per warp); D % 32 == 0, E <= 32 NG.
// With a counter (one int, zero before, left zero) the last block to finish also builds the expert maps of
// the T k picks (expert_maps_block, in the stages' shared memory): one launch per MoE layer fewer than
// moe_expert_maps after it, and no grid-wide wait. Without one (nullptr) the maps are not built.
// The split form (moe_route_mma_split, grid (ceil(T / 16), S)): block (tile, y) takes chunks [y nc / S, (y + 1) nc / S) of D's nc,
// stores its 16 x E sums to plog[y], and the last of a tile's S blocks (tile_counters[tile]) adds the S parts in
// y order and runs the top-k. Why: below ~1K tokens the grid is a few blocks each reading the whole 0.5 MB router
// (30B-A3B: ~19 us of loop per layer at 128 and 512 tokens on the H200, not load-latency-bound); K
// split over blocks reads the same bytes in all, over S times the SMs. Both forms are route_mma_block below; the
// unsplit one (moe_route_mma) keeps its own code and registers.
#define MOE_RMMA_T 16   // tokens per block
#define MOE_RMMA_ST 4   // cp.async stages per warp (6 pieces of 16 bytes per lane each)
template <int NG, int KS, bool SPLIT>  // expert groups of 32: 4 (E <= 128) or 8 (E <= 256); K parts: 8 or 16 warps
__device__ __forceinline__ void route_mma_block(
        const half* __restrict__ x,       // [T, D]
        const half* __restrict__ router,  // [E, D]
        float* __restrict__ logits,       // [T, E]
        int* __restrict__ ids,            // [T, k]
        float* __restrict__ weights,      // [T, k]
        int T, int D, int E, int k, int norm_topk,
        int* __restrict__ counter,        // nullptr, or [1] zero: the maps below are built
        int tile_m, int* __restrict__ counts, int* __restrict__ offsets, int* __restrict__ tile_offsets,
        int* __restrict__ perm_to_unperm, int* __restrict__ unperm_to_perm,  // as moe_expert_maps'
        float* __restrict__ plog,          // SPLIT: [S, T, E] the blocks' partial logits
        int* __restrict__ tile_counters) { // SPLIT: [ceil(T / 16)] zero (left zero)
    constexpr int EP = NG * 32 + 4, ST = MOE_RMMA_ST, NW = NG * KS;  // a partial row's stride (+4: banks)
    constexpr int TPW = MOE_RMMA_T / NW;                              // tokens per warp in the top-k
    static_assert(NW == 8 || NW == 16, "8 or 16 warps: expert groups x K parts");
    __shared__ float part[KS][MOE_RMMA_T][EP];
    extern __shared__ uint4 stage[];  // [warp][ST][6 pieces][32 lanes]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g8 = lane >> 2, q = lane & 3;
    const int grp = warp % NG, kp = warp / NG, t0 = blockIdx.x * MOE_RMMA_T;
    const half* src[6];  // the lane's rows at its 8q offset: x rows g8, g8 + 8, router rows of the 4 n8 tiles
    src[0] = x + (size_t)min(t0 + g8, T - 1) * D + 8 * q;
    src[1] = x + (size_t)min(t0 + g8 + 8, T - 1) * D + 8 * q;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) src[2 + nt] = router + (size_t)min(grp * 32 + nt * 8 + g8, E - 1) * D + 8 * q;
    uint4* my = stage + (size_t)warp * ST * 6 * 32 + lane;
    const int nc = D / 32, S = SPLIT ? gridDim.y : 1, c_lo = SPLIT ? blockIdx.y * nc / S : 0;
    const int c_hi = SPLIT ? (blockIdx.y + 1) * nc / S : nc;
    const int mine = SPLIT ? max(0, (c_hi - c_lo - kp + KS - 1) / KS) : (nc - kp + KS - 1) / KS;  // this warp's chunks
    // chunk i of the warp's into stage i % ST, one commit group each (past the last: zeros, so every
    // iteration commits a group and the wait count stays ST - 1)
    auto issue = [&](int i) {
        const bool in = i < mine;
        const int k0 = in ? (c_lo + kp + i * KS) * 32 : 0;
        uint4* d = my + (i % ST) * 6 * 32;
#pragma unroll
        for (int p = 0; p < 6; ++p) cp_async16(d + p * 32, src[p] + k0, in ? 16 : 0);
        cp_async_commit();
    };
    pdl_wait();
    pdl_trigger();
#pragma unroll
    for (int i = 0; i < ST - 1; ++i) issue(i);
    float acc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
    for (int i = 0; i < mine; ++i) {
        issue(i + ST - 1);  // into the stage chunk i - 1 used: its pieces are in registers, consumed
        cp_async_wait<ST - 1>();
        asm volatile("" ::: "memory");  // (the reads below stay after the wait)
        const uint4* d = my + (i % ST) * 6 * 32;
        const uint4 va = d[0], vb = d[32];
        const u32 a_lo[4] = {va.x, vb.x, va.y, vb.y}, a_hi[4] = {va.z, vb.z, va.w, vb.w};
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const uint4 w = d[(2 + nt) * 32];
            mma_16816(acc[nt], a_lo, w.x, w.y);
            mma_16816(acc[nt], a_hi, w.z, w.w);
        }
    }
    cp_async_wait_all();  // (the zero groups past the end)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {  // C fragment: rows g8 and g8 + 8, columns 2q and 2q + 1 of the n8 tile
        const int e = grp * 32 + nt * 8 + 2 * q;
        part[kp][g8][e] = acc[nt][0];
        part[kp][g8][e + 1] = acc[nt][1];
        part[kp][g8 + 8][e] = acc[nt][2];
        part[kp][g8 + 8][e + 1] = acc[nt][3];
    }
    __syncthreads();
    if constexpr (SPLIT) {  // the block's part to plog[y]; the tile's last block goes on with every part (block-uniform)
        for (int i = threadIdx.x; i < MOE_RMMA_T * E; i += blockDim.x) {
            const int r = i / E, e = i - r * E;
            if (t0 + r < T) {
                float v = part[0][r][e];
#pragma unroll
                for (int j = 1; j < KS; ++j) v += part[j][r][e];
                plog[((size_t)blockIdx.y * T + t0 + r) * E + e] = v;
            }
        }
        if (!block_arrives_last(tile_counters + blockIdx.x, S)) return;
    }
    // warp w: tokens TPW w .. TPW w + TPW - 1 of the block; lane l holds experts l, l + 32, .. (moe_topk_regs' layout)
#pragma unroll
    for (int tt = 0; tt < TPW; ++tt) {
        const int r = TPW * warp + tt, t = t0 + r;
        if (t >= T) break;
        float p[MOE_MAX_E / 32];
#pragma unroll
        for (int j = 0; j < MOE_MAX_E / 32; ++j) {
            const int e = lane + 32 * j;
            float s = -INFINITY;
            if (e < E) {
                if constexpr (SPLIT) {  // the parts in y order (other blocks wrote them: through L2)
                    s = __ldcg(plog + (size_t)t * E + e);
                    for (int y = 1; y < S; ++y) s += __ldcg(plog + ((size_t)y * T + t) * E + e);
                } else {
                    s = part[0][r][e];
#pragma unroll
                    for (int i = 1; i < KS; ++i) s += part[i][r][e];
                }
                logits[(size_t)t * E + e] = s;
            }
            p[j] = s;
        }
        moe_topk_regs(p, E, k, norm_topk, ids + (size_t)t * k, weights + (size_t)t * k);
    }
    // (every thread gets here: the stages are free since the barrier above)
    if (counter == nullptr || !block_arrives_last(counter, gridDim.x)) return;  // (SPLIT: the tiles' last blocks)
    // the stages' 12 NW KB: cnt and tot ((NW + 1) KB), then perm_to_unperm's staging (the picks of up to ~2.8K tokens
    // at k = 8 in the 8-warp form, ~5.6K in the 16-warp one)
    int* cnt = reinterpret_cast<int*>(stage);
    expert_maps_block<NW>(ids, T * k, E, tile_m, counts, offsets, tile_offsets, perm_to_unperm, unperm_to_perm, cnt,
                          cnt + NW * MOE_MAX_E, cnt + (NW + 1) * MOE_MAX_E,
                          (int)(dynamic_smem_bytes() / 4) - (NW + 1) * MOE_MAX_E);
}

// The unsplit form: launch bounds without a block count, so ptxas keeps it at 64-70 registers as before the split
// form existed (with a count of 1 it takes 96, and each launch ~0.6-0.9 us longer).
template <int NG, int KS = 8 / NG>
__global__ void __launch_bounds__(NG * KS * 32)
moe_route_mma(const half* __restrict__ x, const half* __restrict__ router, float* __restrict__ logits,
              int* __restrict__ ids, float* __restrict__ weights, int T, int D, int E, int k, int norm_topk,
              int* __restrict__ counter, int tile_m, int* __restrict__ counts, int* __restrict__ offsets,
              int* __restrict__ tile_offsets, int* __restrict__ perm_to_unperm, int* __restrict__ unperm_to_perm) {
    route_mma_block<NG, KS, false>(x, router, logits, ids, weights, T, D, E, k, norm_topk, counter, tile_m, counts,
                                   offsets, tile_offsets, perm_to_unperm, unperm_to_perm, nullptr, nullptr);
}

// The split form (gridDim.y = S): the 8-warp block at 2 per SM by its stages, which ptxas needs told (without the
// count it spilled at 64 registers).
template <int NG, int KS = 8 / NG>
__global__ void __launch_bounds__(NG * KS * 32, NG * KS == 8 ? 2 : 1)
moe_route_mma_split(const half* __restrict__ x, const half* __restrict__ router, float* __restrict__ logits,
                    int* __restrict__ ids, float* __restrict__ weights, int T, int D, int E, int k, int norm_topk,
                    int* __restrict__ counter, int tile_m, int* __restrict__ counts, int* __restrict__ offsets,
                    int* __restrict__ tile_offsets, int* __restrict__ perm_to_unperm,
                    int* __restrict__ unperm_to_perm, float* __restrict__ plog, int* __restrict__ tile_counters) {
    route_mma_block<NG, KS, true>(x, router, logits, ids, weights, T, D, E, k, norm_topk, counter, tile_m, counts,
                                  offsets, tile_offsets, perm_to_unperm, unperm_to_perm, plog, tile_counters);
}

// Softmax over one token's E logits, top-k, optional renormalisation, by one warp (common.cuh's
// moe_topk_regs). Logits are read through L2 (__ldcg): in the fused decode router other blocks wrote
// them moments ago.
__device__ __forceinline__ void moe_topk_warp(const float* __restrict__ row, int E, int k, int norm_topk,
                                              int* __restrict__ ids, float* __restrict__ weights) {
    const int lane = threadIdx.x & 31;
    float p[MOE_MAX_E / 32];
#pragma unroll
    for (int j = 0; j < MOE_MAX_E / 32; ++j) p[j] = lane + 32 * j < E ? __ldcg(row + lane + 32 * j) : -INFINITY;
    moe_topk_regs(p, E, k, norm_topk, ids, weights);
}

// moe_topk_warp for T tokens. grid ceil(T / 8), block 256: one warp per token.
__global__ void moe_topk(const float* __restrict__ logits,  // [T, E]
                         int* __restrict__ ids,             // [T, k]
                         float* __restrict__ weights,       // [T, k]
                         int T, int E, int k, int norm_topk) {
    pdl_wait();
    pdl_trigger();
    const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (t >= T) return;
    moe_topk_warp(logits + (size_t)t * E, E, k, norm_topk, ids + (size_t)t * k, weights + (size_t)t * k);
}

// Decode routing in one launch (T = 1), replacing add_rmsnorm + moe_router_logits + moe_topk:
// x = rmsnorm(h) * w in fp16 (every block sums the row's squares from L2 itself, the rounding of
// add_rmsnorm), logits = x . router[e] in fp32 (one warp per expert), and the last block to arrive
// (an atomic counter, left at zero) runs the softmax and top-k. Block 0 stores x for the experts'
// GEMV. grid ceil(E / 8), block 256; D % 8 == 0, D <= MOE_ROUTE_MAX_D.
#define MOE_ROUTE_MAX_D 8192
#define MOE_ROUTE_V (MOE_ROUTE_MAX_D / 4 / 256)  // float4 of the row per thread (block 256)
#define MOE_ROUTE_PRE 8  // a lane's first 16-byte router loads, issued before pdl_wait: all of D <= 2048
__global__ void __launch_bounds__(256)
moe_route_decode(const float* __restrict__ h,       // [D] fp32 residual stream
                 const half* __restrict__ nw,       // [D] the norm's weight
                 float eps,
                 const half* __restrict__ router,   // [E, D]
                 float* __restrict__ logits,        // [E]
                 half* __restrict__ xout,           // [D]
                 int* __restrict__ ids,             // [k]
                 float* __restrict__ weights,       // [k]
                 int* __restrict__ counter,         // zero before and after
                 int D, int E, int k, int norm_topk,
                 // or null: the o projection's pending output in fixed point (gemv_w4a16.cu's
                 // accumulating mode), so the row is h + fp16(pend), which block 0 stores to hout
                 const long long* __restrict__ pend, float* __restrict__ hout) {
    __shared__ __align__(16) half xs[MOE_ROUTE_MAX_D];
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, e = blockIdx.x * 8 + (threadIdx.x >> 5);
    // The router is a weight: its row's first loads fly while the kernel before us finishes (PDL).
    const uint4* wr = reinterpret_cast<const uint4*>(router + (size_t)min(e, E - 1) * D);
    uint4 wpre[MOE_ROUTE_PRE];
#pragma unroll
    for (int j = 0; j < MOE_ROUTE_PRE; ++j)
        if (lane + 32 * j < D / 8) wpre[j] = __ldg(wr + lane + 32 * j);
    pdl_wait();
    pdl_trigger();
    // The row h (+ fp16(pend)) is read from L2 once and held in registers for both the sum of squares
    // and x: a second read was one more L2 round trip on the critical path of every MoE layer.
    // Same sums in the same order as row_rms_inv, so the same bits.
    float4 hv[MOE_ROUTE_V];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < MOE_ROUTE_V; ++j) {
        const int i = threadIdx.x + j * 256;
        if (i < D / 4) {
            hv[j] = resid_pending4(h, pend, i);
            ss += sumsq4(hv[j]);
        }
    }
    const float inv = rsqrtf(block_sum(ss, red) / D + eps);
#pragma unroll
    for (int j = 0; j < MOE_ROUTE_V; ++j) {
        const int i = threadIdx.x + j * 256;
        if (i < D / 4) {
            const float4 v = hv[j];
            const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                xs[4 * i + c] = __float2half(f[c] * inv * __half2float(nw[4 * i + c]));
                if (blockIdx.x == 0) {
                    xout[4 * i + c] = xs[4 * i + c];
                    if (pend) hout[4 * i + c] = f[c];
                }
            }
        }
    }
    __syncthreads();
    if (e < E) {
        const uint4* xr = reinterpret_cast<const uint4*>(xs);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < MOE_ROUTE_PRE; ++j)
            if (lane + 32 * j < D / 8) s += dot8(xr[lane + 32 * j], wpre[j]);
        s = router_dot(xs, router + (size_t)e * D, D, s, 32 * MOE_ROUTE_PRE);  // the rest, if D > 2048
        if (lane == 0) logits[e] = s;
    }
    if (!block_arrives_last(counter, gridDim.x) || threadIdx.x >= 32) return;
    moe_topk_warp(logits, E, k, norm_topk, ids, weights);
}

// The expert maps (expert_maps_block) in a launch of their own: one block of MOE_MAP_WARPS warps, its dynamic shared
// memory the staging of perm_to_unperm (4 n bytes where the host gives them: ops_cupy.moe_maps). moe_route_mma
// builds the maps in its last block instead where the host asks it to (ops_cupy.moe_route's maps).
__global__ void __launch_bounds__(MOE_MAP_WARPS * 32)
moe_expert_maps(const int* __restrict__ ids,  // [n] flattened [T, k]
                int n, int E, int tile_m,
                int* __restrict__ counts, int* __restrict__ offsets, int* __restrict__ tile_offsets,
                int* __restrict__ perm_to_unperm, int* __restrict__ unperm_to_perm) {
    __shared__ int cnt[MOE_MAP_WARPS * MOE_MAX_E];
    __shared__ int tot[MOE_MAX_E];
    extern __shared__ int p2u_s[];
    expert_maps_block<MOE_MAP_WARPS>(ids, n, E, tile_m, counts, offsets, tile_offsets, perm_to_unperm, unperm_to_perm,
                                     cnt, tot, p2u_s, (int)(dynamic_smem_bytes() / 4));
}

// xp[r] = x[perm_to_unperm[r] / k]: the rows of every expert contiguous, for gemm_moe_rs's TMA loads (which
// cannot gather). grid n, block 128, 16-byte copies; D % 8 == 0.
__global__ void moe_gather_rows(const half* __restrict__ x,              // [T, D]
                                const int* __restrict__ perm_to_unperm,  // [n = T*k]
                                half* __restrict__ xp,                   // [n, D]
                                int D, int k) {
    const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)(perm_to_unperm[blockIdx.x] / k) * D);
    uint4* dst = reinterpret_cast<uint4*>(xp + (size_t)blockIdx.x * D);
    for (int i = threadIdx.x; i < D / 8; i += blockDim.x) dst[i] = src[i];
}

// out[t] = sum_j weights[t, j] * y[unperm_to_perm[t*k + j]] (common.cuh expert_rows_sum8: fp32 sum in j order; fp16
// out). The residual add happens in the next add_rmsnorm, which by default takes this sum itself (norm.cu,
// docs/PERFORMANCE.md). grid T, block 256: each thread 8 columns at a time. D % 8 == 0, k <= 32.
__global__ void __launch_bounds__(256)
moe_finalize(const half* __restrict__ y,               // [T*k, D] permuted rows
             const int* __restrict__ unperm_to_perm,   // [T*k]
             const float* __restrict__ weights,        // [T, k]
             half* __restrict__ out,                   // [T, D]
             int D, int k) {
    __shared__ int row[32];
    __shared__ float wt[32];
    const int t = blockIdx.x;
    expert_rows_stage(unperm_to_perm, weights, t, k, row, wt);
    for (int c = threadIdx.x; c < D / 8; c += blockDim.x) {
        float s[8];
        expert_rows_sum8(y, row, wt, k, D, c, s);
        uint4 o;
        half2* oh = reinterpret_cast<half2*>(&o);
#pragma unroll
        for (int i = 0; i < 4; ++i) oh[i] = __floats2half2_rn(s[2 * i], s[2 * i + 1]);
        reinterpret_cast<uint4*>(out + (size_t)t * D)[c] = o;
    }
}
