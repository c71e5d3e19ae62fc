// A step of several sequences over the paged KV pool (kuiper_py.batch): each token row carries its sequence
// (tok_seq) and its position (tok_pos); position p of sequence s lives at offset p % bs of block
// tables[s * tstride + p / bs] of the pool [n_blocks, bs, KV, HD] (one layer's keys or values).
#include "common.cuh"

// The cache row of position p of the sequence whose block table starts at `table`.
__device__ __forceinline__ size_t paged_row(const int* __restrict__ table, int p, int bs) {
    return (size_t)table[p / bs] * bs + p % bs;
}

// Per-head q/k RMSNorm and rotate-half RoPE at each token's own position, k and v written into its sequence's
// block (rope.cu's qk_norm_rope_store, with the position and the cache row looked up per token). Heads 0..H-1 are
// queries, then KV keys, then KV values; a head takes HD/16 lanes, lane j holding dims 8j..8j+7 of each half.
// grid (T, ceil((H + 2 KV) / (4 * 32 / (HD / 16)))), block 128; row starts and strides 16-byte aligned.
template <int HD>
__global__ void __launch_bounds__(128)
paged_qk_norm_rope_store(const half* __restrict__ qin, int q_stride,  // [T, q_stride], H*HD used
                         const half* __restrict__ kin, int k_stride,  // [T, k_stride], KV*HD used
                         const half* __restrict__ vin, int v_stride,
                         const half* __restrict__ qn, const half* __restrict__ kn,  // [HD] norm weights
                         const float* __restrict__ cosb, const float* __restrict__ sinb,  // [ctx, HD/2]
                         half* __restrict__ qout,                     // [T, H, HD]
                         half* __restrict__ Kc, half* __restrict__ Vc,  // [n_blocks, bs, KV, HD] this layer
                         const int* __restrict__ tables, int tstride,   // [B, tstride] block ids
                         const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,  // [T]
                         int H, int KV, int bs, float eps) {
    constexpr int LH = HD / 16, HPW = 32 / LH;  // lanes per head, heads per warp
    static_assert(HD % 16 == 0 && LH <= 32 && 32 % LH == 0, "whole heads per warp");
    const int tok = blockIdx.x, lane = threadIdx.x & 31, j = lane % LH;
    const int head = (blockIdx.y * 4 + (threadIdx.x >> 5)) * HPW + lane / LH;
    const int pos = tok_pos[tok];
    const size_t row = paged_row(tables + (size_t)tok_seq[tok] * tstride, pos, bs);
    const bool is_v = head >= H + KV, live = head < H + 2 * KV, is_q = head < H;
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
    if (is_v) {  // value head: straight copy into the block
        uint4* dst = reinterpret_cast<uint4*>(Vc + (row * KV + (head - H - KV)) * HD);
        dst[j] = ra;
        dst[LH + j] = rb;
        return;
    }
    const float inv = rsqrtf(ss / HD + eps);
    float wa[8], wb[8];
    const half* nw = is_q ? qn : kn;
    unpack8(reinterpret_cast<const uint4*>(nw)[j], wa);
    unpack8(reinterpret_cast<const uint4*>(nw + HD / 2)[j], wb);
    const float* cr = cosb + (size_t)pos * (HD / 2) + 8 * j;
    const float* sr = sinb + (size_t)pos * (HD / 2) + 8 * j;
    uint4 oa, ob;
    half* ha = reinterpret_cast<half*>(&oa);
    half* hb = reinterpret_cast<half*>(&ob);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float x1 = a[i] * inv * wa[i], x2 = b[i] * inv * wb[i];
        ha[i] = __float2half(x1 * cr[i] - x2 * sr[i]);
        hb[i] = __float2half(x2 * cr[i] + x1 * sr[i]);
    }
    uint4* dst = reinterpret_cast<uint4*>(is_q ? qout + ((size_t)tok * H + head) * HD
                                               : Kc + (row * KV + (head - H)) * HD);
    dst[j] = oa;
    dst[LH + j] = ob;
}

// Attention of each token row over its own sequence's keys 0..tok_pos (causal within a prefill chunk), through the
// block table, fp32 online softmax, flash-decoding style: grid (T, KV, S), block 128. Block z of a row takes keys
// [z c, (z + 1) c) of its n, c = ceil(n / S) rounded up to 32, so a step of few rows (a decode step) still fills
// the GPU; a prefill chunk runs S = 1. The block serves the KV head's G = H / KV query heads (at most 8) together,
// so each key and value row is read once for the group: keys go PA_CHUNK at a time, thread t scoring key t for
// every head (its row against q in shared memory, half a 128-dim row's 16-byte pieces in flight at once); a warp
// per head folds the chunk into the head's running max and sum; then warp w adds p * v over keys w, w + 4, ... of
// the chunk, lane l for dims DPL l .. DPL l + DPL - 1 of every head of the group (one coalesced read per value
// row), and the 4 warps' sums meet in shared memory in warp order. S = 1 writes out [T, H * HD]; S > 1 writes each
// block's (acc, max, sum) to part_acc / part_ml for paged_attention_merge.
// 5 blocks per SM (96 registers, 92 bytes of spill at HD 128): more K and V rows in flight than the 3 blocks its
// 142 registers would allow. H100, 8B shapes, µs per layer at 640 / 2048 keys and 16 rows: 33.1 / 82.2 (4 blocks
// 41.4 / 83.5, 6 blocks 37.5 / 88.6).
constexpr int PA_CHUNK = 128, PA_MAX_G = 8;
template <int HD>
__global__ void __launch_bounds__(128, 5)
paged_attention(const half* __restrict__ q,                     // [T, H, HD]
                const half* __restrict__ Kc, const half* __restrict__ Vc,  // [n_blocks, bs, KV, HD] this layer
                const int* __restrict__ tables, int tstride,
                const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,
                half* __restrict__ out,                         // [T, H * HD] (S == 1)
                float* __restrict__ part_acc,                   // [T, H, S, HD] (S > 1)
                float* __restrict__ part_ml,                    // [T, H, S, 2] (S > 1)
                int H, int KV, int bs, float scale, int S) {
    constexpr int DPL = HD / 32;  // dims a lane owns in the value pass
    static_assert(DPL == 2 || DPL == 4, "HD 64 or 128");
    __shared__ float qs[PA_MAX_G * HD];
    __shared__ float ps[PA_MAX_G][PA_CHUNK];  // the chunk's scores, then its probabilities
    __shared__ int rows[PA_CHUNK];
    __shared__ float m_s[PA_MAX_G], l_s[PA_MAX_G], corr_s[PA_MAX_G];
    const int tok = blockIdx.x, kvh = blockIdx.y, z = blockIdx.z, G = H / KV, tid = threadIdx.x;
    const int w = tid >> 5, lane = tid & 31;
    const int n = tok_pos[tok] + 1, c = ((n + S - 1) / S + 31) & ~31;
    const int k0 = min(n, z * c), k1 = min(n, k0 + c);
    const int* table = tables + (size_t)tok_seq[tok] * tstride;
    const half* qg = q + ((size_t)tok * H + kvh * G) * HD;  // the group's heads are adjacent
    for (int i = tid; i < G * HD; i += 128) qs[i] = __half2float(qg[i]) * scale;
    if (tid < PA_MAX_G) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.f;
    }
    float acc[PA_MAX_G][DPL];
#pragma unroll
    for (int g = 0; g < PA_MAX_G; ++g)
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] = 0.f;
    __syncthreads();
    for (int c0 = k0; c0 < k1; c0 += PA_CHUNK) {
        const int cnt = min(PA_CHUNK, k1 - c0);
        if (tid < cnt) {  // thread tid scores key c0 + tid for every head of the group
            const size_t row = paged_row(table, c0 + tid, bs);
            rows[tid] = (int)row;
            const uint4* kr = reinterpret_cast<const uint4*>(Kc + (row * KV + kvh) * HD);
            float sc[PA_MAX_G];
#pragma unroll
            for (int g = 0; g < PA_MAX_G; ++g) sc[g] = 0.f;
#pragma unroll
            for (int h = 0; h < HD / 64; ++h) {  // half a 128-dim row's pieces in flight at once
                uint4 kv[8];
#pragma unroll
                for (int d = 0; d < 8; ++d) kv[d] = __ldg(kr + h * 8 + d);
#pragma unroll
                for (int d = 0; d < 8; ++d) {
                    float f[8];
                    unpack8(kv[d], f);
                    const int d8 = h * 8 + d;
#pragma unroll
                    for (int g = 0; g < PA_MAX_G; ++g)
                        if (g < G) {
#pragma unroll
                            for (int i = 0; i < 8; ++i) sc[g] += f[i] * qs[g * HD + d8 * 8 + i];
                        }
                }
            }
#pragma unroll
            for (int g = 0; g < PA_MAX_G; ++g)
                if (g < G) ps[g][tid] = sc[g];
        }
        __syncthreads();
        for (int g = w; g < G; g += 4) {  // a warp per head: the chunk's max, its probabilities and their sum
            float cm = -INFINITY;
            for (int j = lane; j < cnt; j += 32) cm = fmaxf(cm, ps[g][j]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
            const float mo = m_s[g], mn = fmaxf(mo, cm);  // finite: the chunk has a key
            float sum = 0.f;
            for (int j = lane; j < cnt; j += 32) {
                const float p = __expf(ps[g][j] - mn);
                ps[g][j] = p;
                sum += p;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) {
                const float cr = __expf(mo - mn);  // 0 on the first chunk (mo = -inf)
                corr_s[g] = cr;
                l_s[g] = l_s[g] * cr + sum;
                m_s[g] = mn;
            }
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < PA_MAX_G; ++g)
            if (g < G) {
                const float cr = corr_s[g];
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[g][i] *= cr;
            }
        const half* vbase = Vc + (size_t)kvh * HD + lane * DPL;
#pragma unroll 4
        for (int t = w; t < cnt; t += 4) {
            float v[DPL];
            if constexpr (DPL == 4) {
                const uint2 raw = __ldg(reinterpret_cast<const uint2*>(vbase + (size_t)rows[t] * KV * HD));
                const float2 a = __half22float2(*reinterpret_cast<const half2*>(&raw.x));
                const float2 b = __half22float2(*reinterpret_cast<const half2*>(&raw.y));
                v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
            } else {
                const float2 a = __half22float2(__ldg(reinterpret_cast<const half2*>(vbase + (size_t)rows[t] * KV * HD)));
                v[0] = a.x; v[1] = a.y;
            }
#pragma unroll
            for (int g = 0; g < PA_MAX_G; ++g)
                if (g < G) {
                    const float p = ps[g][t];
#pragma unroll
                    for (int i = 0; i < DPL; ++i) acc[g][i] += p * v[i];
                }
        }
        __syncthreads();  // (the next chunk overwrites ps and rows)
    }
    // the 4 warps' sums, in warp order, through shared memory (ps's [8][128] floats hold G x HD for one warp at a time)
    float* red = &ps[0][0];
    for (int ww = 1; ww < 4; ++ww) {
        if (w == ww) {
#pragma unroll
            for (int g = 0; g < PA_MAX_G; ++g)
                if (g < G) {
#pragma unroll
                    for (int i = 0; i < DPL; ++i) red[g * HD + lane * DPL + i] = acc[g][i];
                }
        }
        __syncthreads();
        if (w == 0) {
#pragma unroll
            for (int g = 0; g < PA_MAX_G; ++g)
                if (g < G) {
#pragma unroll
                    for (int i = 0; i < DPL; ++i) acc[g][i] += red[g * HD + lane * DPL + i];
                }
        }
        __syncthreads();
    }
    if (w == 0) {
#pragma unroll
        for (int g = 0; g < PA_MAX_G; ++g) {
            if (g >= G) break;
            const int head = kvh * G + g;
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane * DPL + i;
                if (S == 1)
                    out[(size_t)tok * H * HD + head * HD + d] = __float2half(acc[g][i] / l_s[g]);
                else
                    part_acc[(((size_t)tok * H + head) * S + z) * HD + d] = acc[g][i];  // (0 for a block with no keys)
            }
        }
    }
    if (S > 1 && tid < G) {
        float* ml = part_ml + (((size_t)tok * H + kvh * G + tid) * S + z) * 2;
        ml[0] = m_s[tid];  // -inf, sum 0: a block past the row's keys
        ml[1] = l_s[tid];
    }
}

// paged_attention's S blocks of each (row, head) combined: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
// grid (T, H), block HD.
template <int HD>
__global__ void __launch_bounds__(HD)
paged_attention_merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml, half* __restrict__ out,
                      int H, int S) {
    const int tok = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    const size_t base = (size_t)tok * H + head;
    const float* ml = part_ml + base * S * 2;
    float M = -INFINITY;
    for (int s = 0; s < S; ++s) M = fmaxf(M, ml[2 * s]);
    float L = 0.f, a = 0.f;
    for (int s = 0; s < S; ++s) {
        if (ml[2 * s] == -INFINITY) continue;  // a block with no keys
        const float e = __expf(ml[2 * s] - M);
        L += e * ml[2 * s + 1];
        a += e * part_acc[(base * S + s) * HD + d];
    }
    out[base * HD + d] = __float2half(a / L);
}

// Each row's argmax over ids 0..n-1 (the lowest id of equal maxima, as NumPy's argmax; NaN never wins): the greedy
// draws of a paged step, so its [rows, ld] logits need not leave the device. grid (rows), block 1024.
__global__ void __launch_bounds__(1024)
rows_argmax(const float* __restrict__ logits, int ld, int n, int* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* row = logits + (size_t)blockIdx.x * ld;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (better(row[i], i, bv, bi)) {
            bv = row[i];
            bi = i;
        }
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
}
