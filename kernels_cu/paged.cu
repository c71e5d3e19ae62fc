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
// block table, with an online softmax in fp32. grid (T, KV), block 32 * (H / KV) (at most 8 warps): warp w serves
// query head kvh * (H / KV) + w. Keys go 32 at a time: lane l scores key c + l (its whole row against q in shared
// memory), then the warp folds the chunk into its running max, sum and output (lane l holding dims l, l + 32, ...).
template <int HD>
__global__ void __launch_bounds__(256)
paged_attention(const half* __restrict__ q,                     // [T, H, HD]
                const half* __restrict__ Kc, const half* __restrict__ Vc,  // [n_blocks, bs, KV, HD] this layer
                const int* __restrict__ tables, int tstride,
                const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,
                half* __restrict__ out,                         // [T, H * HD]
                int H, int KV, int bs, float scale) {
    constexpr int DL = HD / 32;
    __shared__ float qs[8][HD];
    const int tok = blockIdx.x, kvh = blockIdx.y, G = H / KV;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (w >= G) return;
    const int head = kvh * G + w, n = tok_pos[tok] + 1;
    const int* table = tables + (size_t)tok_seq[tok] * tstride;
    for (int d = lane; d < HD; d += 32) qs[w][d] = __half2float(q[((size_t)tok * H + head) * HD + d]) * scale;
    __syncwarp();
    float acc[DL];
#pragma unroll
    for (int i = 0; i < DL; ++i) acc[i] = 0.f;
    float m = -INFINITY, l = 0.f;
    for (int c = 0; c < n; c += 32) {
        const int key = c + lane;
        float s = -INFINITY;
        if (key < n) {
            const uint4* kr = reinterpret_cast<const uint4*>(Kc + (paged_row(table, key, bs) * KV + kvh) * HD);
            s = 0.f;
#pragma unroll
            for (int d8 = 0; d8 < HD / 8; ++d8) {
                float f[8];
                unpack8(kr[d8], f);
#pragma unroll
                for (int i = 0; i < 8; ++i) s += f[i] * qs[w][d8 * 8 + i];
            }
        }
        float cm = s;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
        const float mn = fmaxf(m, cm);  // finite: key c < n is scored
        const float p = key < n ? __expf(s - mn) : 0.f, corr = __expf(m - mn);
        float ps = p;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        l = l * corr + ps;
#pragma unroll
        for (int i = 0; i < DL; ++i) acc[i] *= corr;
        const int cnt = min(32, n - c);
        for (int t = 0; t < cnt; ++t) {
            const float pt = __shfl_sync(0xffffffffu, p, t);
            const half* vr = Vc + (paged_row(table, c + t, bs) * KV + kvh) * HD;
#pragma unroll
            for (int i = 0; i < DL; ++i) acc[i] += pt * __half2float(vr[lane + 32 * i]);
        }
        m = mn;
    }
    half* o = out + (size_t)tok * H * HD + head * HD;
#pragma unroll
    for (int i = 0; i < DL; ++i) o[lane + 32 * i] = __float2half(acc[i] / l);
}

// Each row's argmax over ids 0..n-1 (the lowest id of equal maxima, as NumPy's argmax; NaN never wins): the greedy
// draws of a paged step, so its [rows, ld] logits need not leave the device. grid (rows), block 1024.
__global__ void __launch_bounds__(1024)
rows_argmax(const float* __restrict__ logits, int ld, int n, int* __restrict__ out) {
    const float* row = logits + (size_t)blockIdx.x * ld;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {  // ids rising: a thread keeps its first maximum
        const float v = row[i];
        if (v > bv || (v == bv && bi == 0x7fffffff)) {
            bv = v;
            bi = i;
        }
    }
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    if (lane == 0) {
        sv[w] = bv;
        si[w] = bi;
    }
    __syncthreads();
    if (w != 0) return;
    const int nw = blockDim.x >> 5;
    bv = lane < nw ? sv[lane] : -INFINITY;
    bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    if (lane == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
}
