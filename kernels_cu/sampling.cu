// Token selection on the GPU so that only one int32 crosses to the host per step.
//
// The draw runs in blocks of 1024 threads over the fp32 logits, in the order of Hugging Face's
// processors: repetition penalty, temperature, top-k, top-p, min-p; then an exact draw from the kept
// softmax by the Gumbel-max trick. Top-k and top-p thresholds are found by radix selection on
// order-preserving integer keys (4 rounds of 8 bits), so nothing is sorted; with top-k they run on a
// few candidates gathered into shared memory, not on the whole vocabulary. A temperature of 0 is
// greedy (lowest index among equal maxima, like numpy.argmax). sample_token_mb spreads the scan of
// the vocabulary over many blocks (greedy, and top-k up to its candidate room); sample_token does
// everything in one block.
#include "common.cuh"

#define SMP_THREADS 1024
#define SMP_CAND 4096  // top-k candidates kept in shared memory (more: the filters scan every logit)
#define SMP_MAX_BLOCKS 256  // sample_token_mb's largest grid

// counter-based uniform in (0, 1): a 64-bit mix of (seed, step, index)
__device__ __forceinline__ float uniform01(unsigned long long seed, unsigned long long step, u32 i) {
    unsigned long long z = seed ^ (step * 0x9E3779B97F4A7C15ull) ^ ((unsigned long long)i * 0xD1B54A32D192ED03ull);
    z ^= z >> 30; z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27; z *= 0x94D049BB133111EBull;
    z ^= z >> 31;
    return ((float)(z >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// Calls f(i, x[i]) for every i in [lo, n) this thread owns (lo a multiple of 4). One block scans its
// range while the rest of the GPU idles, so each pass is bound by load latency: 16-byte loads, four in
// flight per thread (a scalar strided loop took ~56 µs per pass over 151936 logits on H100). Visiting
// order is not increasing per thread, so callers break ties by index explicitly.
template <class F>
__device__ __forceinline__ void scan_logits(const float* __restrict__ x, int n, F f, int lo = 0) {
    const int n4 = n >> 2, B = blockDim.x;
    const float4* x4 = reinterpret_cast<const float4*>(x);  // logits buffers are 256-byte aligned
    int i = (lo >> 2) + threadIdx.x;
    for (; i + 3 * B < n4; i += 4 * B) {
        float4 a[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) a[u] = x4[i + u * B];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int j = 4 * (i + u * B);
            f(j, a[u].x); f(j + 1, a[u].y); f(j + 2, a[u].z); f(j + 3, a[u].w);
        }
    }
    for (; i < n4; i += B) {
        float4 a = x4[i];
        f(4 * i, a.x); f(4 * i + 1, a.y); f(4 * i + 2, a.z); f(4 * i + 3, a.w);
    }
    for (int j = max(4 * n4, lo) + threadIdx.x; j < n; j += B) f(j, x[j]);
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
        scan_logits(x, n, [&](int, float v) {
            u32 k = float_key(v);
            if (k >= floor_key && (k & hi_mask) == prefix)
                atomicAdd(&hist[(k >> shift) & 0xFF], by_mass ? __expf(v - mx) : 1.f);
        });
        __syncthreads();
        if (threadIdx.x < 32) {
            // the highest bin b with above + weight(bins >= b) >= target (else 0), and the weight above
            // it: one warp scans from the top (lane l owns bins 8l..8l+7); a serial walk over the 256
            // bins by one thread cost ~5 µs a round
            const int l = threadIdx.x;
            float h8[8], t = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) { h8[i] = hist[8 * l + i]; t += h8[i]; }
            float incl = t;  // weight of lanes l..31
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float v = __shfl_down_sync(0xffffffffu, incl, o);
                if (l + o < 32) incl += v;
            }
            float c = above + incl - t, cum = 0.f;
            int b = -1;
#pragma unroll
            for (int i = 7; i >= 0; --i) {
                if (b < 0 && c + h8[i] >= target) { b = 8 * l + i; cum = c; }
                c += h8[i];
            }
            if (b < 0 && l == 0) { b = 0; cum = c - h8[0]; }  // nothing reaches the target: bin 0
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const int ob = __shfl_xor_sync(0xffffffffu, b, o);
                const float oc = __shfl_xor_sync(0xffffffffu, cum, o);
                if (ob > b) { b = ob; cum = oc; }
            }
            if (l == 0) {
                red[0] = __uint_as_float(prefix | ((u32)b << shift));
                red[1] = cum;
            }
        }
        __syncthreads();
        prefix = __float_as_uint(red[0]);
        above = red[1];
        __syncthreads();
    }
    return prefix;
}

// Shared memory of one sampling block (1024 threads).
struct SmpSmem {
    float sv[32], hist[256], red[32];
    int si[32], n_cand;
    __align__(16) float tmax[SMP_THREADS];  // each thread's largest scaled logit
    __align__(16) float cand_v[SMP_CAND];   // top-k candidates: scaled logit, vocabulary index
    int cand_i[SMP_CAND];
    u32 sorted_k[SMP_THREADS];              // ranked candidates' keys, descending
    float wmax[32];                         // each warp's largest scaled logit
    int off[SMP_MAX_BLOCKS + 1];            // sample_token_mb: each block's first slot in the union
};

// The repetition penalty on the ids of [lo, hi): every read happens before any write, so duplicate
// ids apply once.
__device__ void smp_penalty(float* logits, int lo, int hi, const int* hist_ids, int n_hist, float penalty) {
    float pv = 0.f;
    int id = -1;
    if ((int)threadIdx.x < n_hist) {
        id = hist_ids[threadIdx.x];
        if (id >= lo && id < hi) { pv = logits[id]; pv = pv > 0.f ? pv / penalty : pv * penalty; }
        else id = -1;
    }
    __syncthreads();
    if (id >= 0) logits[id] = pv;
    __syncthreads();
}

// Greedy over [lo, n): (value, index) of the largest logit, the lower index among equals; idx stays
// 0x7fffffff when every logit is NaN. Valid in every thread.
__device__ void smp_argmax(const float* logits, int lo, int n, float& v, int& idx, SmpSmem& S) {
    v = -INFINITY;
    idx = 0x7fffffff;
    scan_logits(logits, n, [&](int i, float x) {
        if (better(x, i, v, idx)) { v = x; idx = i; }
    }, lo);
    block_argmax(v, idx, S.sv, S.si);
}

// The largest scaled logit of [lo, n) (returned, valid in every thread) and, with 0 < top_k <= SMP_THREADS,
// every element of the range that can be among its top_k gathered into S.cand_v / cand_i (S.n_cand of
// them, which may exceed SMP_CAND: then only the first SMP_CAND are stored). The k-th largest of the
// warps' maxima (k <= 32) or of the threads' maxima is a lower bound of the range's k-th largest logit (k
// distinct elements are at least it), so every element the filters can keep is at or above it and only
// threads whose maximum reaches it rescan. The candidates are a few dozen for k = 20: radix passes over
// the whole vocabulary had all 1024 threads adding into the same few histogram bins (~0.3 ms a round).
// Since a range's k-th largest is at most the vocabulary's, the candidates of all ranges hold the top k.
__device__ float smp_gather(const float* logits, int lo, int n, float invt, int top_k, SmpSmem& S) {
    float mx = -INFINITY;
    scan_logits(logits, n, [&](int, float x) { mx = fmaxf(mx, x * invt); }, lo);
    const float my_max = mx;
    S.tmax[threadIdx.x] = mx;
    {
        float wm = mx;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) wm = fmaxf(wm, __shfl_xor_sync(0xffffffffu, wm, o));
        if ((threadIdx.x & 31) == 0) S.wmax[threadIdx.x >> 5] = wm;
    }
    {
        int dummy = 0;
        block_argmax(mx, dummy, S.sv, S.si);
    }
    if (threadIdx.x == 0) S.n_cand = 0;
    if (top_k <= 0 || top_k > SMP_THREADS) {
        __syncthreads();
        return mx;
    }
    u32 floor_key;
    if (top_k <= 32) {  // every warp ranks the 32 warp maxima itself: no barrier, no histogram
        const int lane = threadIdx.x & 31;
        const u32 kv = float_key(S.wmax[lane]);
        int r = 0;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const u32 kj = float_key(S.wmax[j]);
            r += kj > kv || (kj == kv && j < lane);
        }
        const unsigned b = __ballot_sync(0xffffffffu, r == top_k - 1);
        floor_key = __shfl_sync(0xffffffffu, kv, __ffs(b) - 1);
    } else {
        floor_key = radix_threshold(S.tmax, SMP_THREADS, 0u, false, (float)top_k, mx, S.hist, S.red);
    }
    __syncthreads();
    if (float_key(my_max) >= floor_key)
        scan_logits(logits, n, [&](int i, float x) {
            x *= invt;
            if (x != x || float_key(x) < floor_key) return;  // NaN is never drawn: not a candidate either
            const int c = atomicAdd(&S.n_cand, 1);
            if (c < SMP_CAND) { S.cand_v[c] = x; S.cand_i[c] = i; }
        }, lo);
    __syncthreads();
    return mx;
}

// Top-k, top-p and min-p over vals [n] (scaled logits; ids[c] their vocabulary indices, or null: the
// identity), whose maximum is mx, then the Gumbel-max draw into *out. vals of all n_valid logits are
// scaled in place first (each thread its own elements).
__device__ void smp_finish(float* vals, const int* ids, int n, float mx, float invt, int top_k, float top_p,
                           float min_p, unsigned long long seed, unsigned long long* step, int* out,
                           int* out_host, SmpSmem& S) {
    if (!ids) {  // the filters scan every logit: scale them in place once (each thread its own elements)
        scan_logits(vals, n, [&](int i, float x) { vals[i] = x * invt; });
        __syncthreads();
    }
    u32 thr = 0;  // keep keys >= thr
    if (ids && n <= SMP_THREADS) {
        // Few candidates: rank them (by key, ties by slot) into descending order; top-k is then the
        // k-th key and top-p the first prefix whose mass reaches top_p, the thresholds the radix
        // passes would find. tmax (no longer needed) holds the sorted values.
        const int t = threadIdx.x;
        float* sorted_v = S.tmax;
        __syncthreads();  // every warp is past its last read of tmax
        if (t < n) {
            const u32 kv = float_key(vals[t]);
            int r = 0;
            for (int j = 0; j < n; ++j) {
                const u32 kj = float_key(vals[j]);
                r += kj > kv || (kj == kv && j < t);
            }
            S.sorted_k[r] = kv;
            sorted_v[r] = vals[t];
        }
        __syncthreads();
        if (top_k > 0 && top_k < n) thr = S.sorted_k[top_k - 1];
        if (top_p < 1.f) {
            if (t < 32) {
                float z = 0.f;
                for (int i = t; i < n && S.sorted_k[i] >= thr; i += 32) z += __expf(sorted_v[i] - mx);
                const float target = top_p * warp_sum(z);
                float carry = 0.f;
                u32 tp = thr;  // nothing reaches the target (rounding): keep all, as the radix pass does
                for (int base = 0; base < n; base += 32) {
                    const int i = base + t;
                    const bool in = i < n && S.sorted_k[i] >= thr;
                    float incl = in ? __expf(sorted_v[i] - mx) : 0.f;
#pragma unroll
                    for (int o = 1; o < 32; o <<= 1) {
                        const float v = __shfl_up_sync(0xffffffffu, incl, o);
                        if (t >= o) incl += v;
                    }
                    const unsigned hit = __ballot_sync(0xffffffffu, in && carry + incl >= target);
                    if (hit) { tp = S.sorted_k[base + __ffs(hit) - 1]; break; }
                    carry += __shfl_sync(0xffffffffu, incl, 31);
                }
                if (t == 0) S.red[0] = __uint_as_float(tp);
            }
            __syncthreads();
            thr = max(thr, __float_as_uint(S.red[0]));
        }
    } else {
        if (top_k > 0 && top_k < n)
            thr = radix_threshold(vals, n, 0u, false, (float)top_k, mx, S.hist, S.red);
        if (top_p < 1.f) {
            float z = 0.f;
            scan_logits(vals, n, [&](int, float x) {
                if (float_key(x) >= thr) z += __expf(x - mx);
            });
            z = block_sum(z, S.red);
            __syncthreads();
            u32 tp = radix_threshold(vals, n, thr, true, top_p * z, mx, S.hist, S.red);
            thr = max(thr, tp);
        }
    }
    if (min_p > 0.f) thr = max(thr, float_key(mx + __logf(min_p)));
    const unsigned long long st = *step;
    float best = -INFINITY;
    int idx = 0x7fffffff;
    if (ids) {  // shared memory: a plain strided loop
        for (int c = threadIdx.x; c < n; c += blockDim.x) {
            const float x = vals[c];
            if (float_key(x) < thr) continue;
            const int i = ids[c];  // the draw depends on the vocabulary index, not the candidate slot
            const float gmb = x - __logf(-__logf(uniform01(seed, st, (u32)i)));
            if (better(gmb, i, best, idx)) { best = gmb; idx = i; }
        }
    } else {
        scan_logits(vals, n, [&](int i, float x) {
            if (float_key(x) < thr) return;
            const float gmb = x - __logf(-__logf(uniform01(seed, st, (u32)i)));
            if (better(gmb, i, best, idx)) { best = gmb; idx = i; }
        });
    }
    block_argmax(best, idx, S.sv, S.si);
    __syncthreads();
    if (threadIdx.x == 0) {
        publish_token(idx == 0x7fffffff ? -1 : idx, out, out_host);
        *step = st + 1;
    }
}

// The whole draw in one block over the (penalised) logits [n_valid]: the vocabulary's top-k candidates,
// or every logit when top-k is off or the candidates overflow shared memory.
__device__ void smp_one_block(float* logits, int n_valid, float temperature, int top_k, float top_p, float min_p,
                              unsigned long long seed, unsigned long long* step, int* out, int* out_host,
                              SmpSmem& S) {
    if (temperature == 0.f) {
        float v;
        int idx;
        smp_argmax(logits, 0, n_valid, v, idx, S);
        if (threadIdx.x == 0) {
            publish_token(idx == 0x7fffffff ? -1 : idx, out, out_host);  // -1: all NaN
            *step += 1;
        }
        return;
    }
    const float invt = 1.f / temperature;
    const bool gather = top_k > 0 && top_k < n_valid && top_k <= SMP_THREADS;
    const float mx = smp_gather(logits, 0, n_valid, invt, gather ? top_k : 0, S);
    if (gather && S.n_cand <= SMP_CAND)
        smp_finish(S.cand_v, S.cand_i, S.n_cand, mx, invt, top_k, top_p, min_p, seed, step, out, out_host, S);
    else  // many ties, or top-k off: the filters scan every logit
        smp_finish(logits, nullptr, n_valid, mx, invt, top_k, top_p, min_p, seed, step, out, out_host, S);
}

// One block for the whole vocabulary (top-k off or beyond sample_token_mb's candidates). out_host:
// null, or a mapped pinned int the id is also written to (no copy back to the host).
__global__ void __launch_bounds__(SMP_THREADS)
sample_token(float* __restrict__ logits,       // [V] scratch: penalised (and scaled when top-k is off) in place
             int n_valid,                       // ids >= n_valid (vocabulary padding) never chosen
             const int* __restrict__ hist_ids,  // [n_hist] recent tokens for the repetition penalty
             int n_hist, float penalty, float temperature, int top_k, float top_p, float min_p,
             unsigned long long seed, unsigned long long* __restrict__ step,
             int* __restrict__ out, int* out_host) {
    __shared__ SmpSmem S;
    if (penalty != 1.f) smp_penalty(logits, 0, n_valid, hist_ids, n_hist, penalty);
    smp_one_block(logits, n_valid, temperature, top_k, top_p, min_p, seed, step, out, out_host, S);
}

// A step of several sequences: block r draws row rp[r].w of logits [*, ld] with that row's own settings, seed and
// counter (the draws sample_token would make for each sequence alone). fp[r] = (temperature, top_p, min_p, penalty),
// rp[r] = (top_k, first history id in hist, history length <= SMP_THREADS, row); out[r] on the device and, mapped
// pinned, out_host[r]. grid (rows drawn), block SMP_THREADS; ld % 4 == 0 (scan_logits' 16-byte loads).
__global__ void __launch_bounds__(SMP_THREADS)
sample_rows(float* __restrict__ logits, int ld, int n_valid, const float4* __restrict__ fp, const int4* __restrict__ rp,
            const unsigned long long* __restrict__ seeds, unsigned long long* __restrict__ steps,
            const int* __restrict__ hist, int* __restrict__ out, int* out_host) {
    __shared__ SmpSmem S;
    const int r = blockIdx.x;
    const float4 f = fp[r];
    const int4 p = rp[r];
    float* row = logits + (size_t)p.w * ld;
    if (f.w != 1.f) smp_penalty(row, 0, n_valid, hist + p.y, p.z, f.w);
    smp_one_block(row, n_valid, f.x, p.x, f.y, f.z, seeds[r], steps + r, out + r, out_host + r, S);
}

// The same draw by gridDim.x blocks, each over `chunk` logits (a multiple of 4), so the vocabulary is read
// by many SMs at once instead of one (sample_token: ~25 µs per greedy step on H100, most of it one block's
// load latency). Each block applies the penalty to its ids and leaves its argmax (greedy) or its maximum
// and top-k candidates in g_*; the last block to arrive merges them: the argmax of the blocks', or the
// filters and the draw over the union of candidates, which holds the vocabulary's top k (smp_gather).
// A block with more than cap candidates (many ties) sends the last block to the one-block draw over every
// logit. Greedy, or 0 < top_k <= cap with cap * gridDim.x <= SMP_CAND (checked on the host).
__global__ void __launch_bounds__(SMP_THREADS)
sample_token_mb(float* __restrict__ logits, int n_valid, const int* __restrict__ hist_ids, int n_hist,
                float penalty, float temperature, int top_k, float top_p, float min_p, unsigned long long seed,
                unsigned long long* __restrict__ step, int* __restrict__ out, int* out_host, int chunk,
                float* __restrict__ g_v,  // [blocks, cap] candidates' scaled logits (greedy: [blocks] maxima)
                int* __restrict__ g_i,    // [blocks, cap] their vocabulary indices (greedy: [blocks] argmaxes)
                float* __restrict__ g_mx, // [blocks] largest scaled logit
                int* __restrict__ g_n,    // [blocks] candidates found
                int* __restrict__ counter, int cap) {  // arrivals: zero before the first launch, left zero
    __shared__ SmpSmem S;
    const int b = blockIdx.x, lo = b * chunk, hi = min(n_valid, lo + chunk);
    if (penalty != 1.f) smp_penalty(logits, lo, hi, hist_ids, n_hist, penalty);
    const float invt = temperature == 0.f ? 1.f : 1.f / temperature;
    if (temperature == 0.f) {
        float v;
        int idx;
        smp_argmax(logits, lo, hi, v, idx, S);
        if (threadIdx.x == 0) { g_v[b] = v; g_i[b] = idx; }
    } else {
        const float mx = smp_gather(logits, lo, hi, invt, top_k, S);
        const int nc = S.n_cand;
        for (int c = threadIdx.x; c < min(nc, cap); c += blockDim.x) {
            g_v[(size_t)b * cap + c] = S.cand_v[c];
            g_i[(size_t)b * cap + c] = S.cand_i[c];
        }
        if (threadIdx.x == 0) { g_mx[b] = mx; g_n[b] = nc; }
    }
    if (!block_arrives_last(counter, gridDim.x)) return;
    const int G = gridDim.x;
    if (temperature == 0.f) {
        float v = -INFINITY;
        int idx = 0x7fffffff;
        for (int j = threadIdx.x; j < G; j += blockDim.x) {
            const float ov = __ldcg(g_v + j);
            const int oi = __ldcg(g_i + j);
            if (oi != 0x7fffffff && better(ov, oi, v, idx)) { v = ov; idx = oi; }
        }
        block_argmax(v, idx, S.sv, S.si);
        if (threadIdx.x == 0) {
            publish_token(idx == 0x7fffffff ? -1 : idx, out, out_host);  // -1: all NaN
            *step += 1;
        }
        return;
    }
    // the union of the blocks' candidates into shared memory, in block order: their counts first, all
    // loaded at once (a loop of dependent L2 loads cost ~10 µs)
    float mx = -INFINITY;
    bool over = false;
    for (int j = threadIdx.x; j < G; j += blockDim.x) {
        const int nj = __ldcg(g_n + j);
        S.off[j + 1] = nj;
        over |= nj > cap;
        mx = fmaxf(mx, __ldcg(g_mx + j));
    }
    {
        int dummy = 0;
        block_argmax(mx, dummy, S.sv, S.si);  // (its barriers publish S.off)
    }
    if (__syncthreads_or(over)) {  // a block held more than cap candidates: every logit, in one block
        smp_one_block(logits, n_valid, temperature, top_k, top_p, min_p, seed, step, out, out_host, S);
        return;
    }
    if (threadIdx.x == 0) {
        S.off[0] = 0;
        for (int j = 0; j < G; ++j) S.off[j + 1] += S.off[j];
        S.n_cand = S.off[G];
    }
    __syncthreads();
    for (int j = threadIdx.x >> 5; j < G; j += blockDim.x >> 5) {  // a warp per block's list
        const int off = S.off[j], nj = S.off[j + 1] - off;
        for (int c = threadIdx.x & 31; c < nj; c += 32) {
            S.cand_v[off + c] = __ldcg(g_v + (size_t)j * cap + c);
            S.cand_i[off + c] = __ldcg(g_i + (size_t)j * cap + c);
        }
    }
    __syncthreads();
    int n = S.n_cand;
    if (n > SMP_THREADS) {
        // more than the ranking path takes: keep the union's top k (the exact k-th largest key, ties
        // included), as the one-block draw's candidates would be; through registers, since the slots
        // are rewritten while others are still unread
        constexpr int R = SMP_CAND / SMP_THREADS;
        const u32 tk = radix_threshold(S.cand_v, n, 0u, false, (float)top_k, mx, S.hist, S.red);
        float v[R];
        int id[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int c = threadIdx.x + r * SMP_THREADS;
            v[r] = c < n ? S.cand_v[c] : 0.f;
            id[r] = c < n && float_key(v[r]) >= tk ? S.cand_i[c] : -1;
        }
        __syncthreads();
        if (threadIdx.x == 0) S.n_cand = 0;
        __syncthreads();
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (id[r] < 0) continue;
            const int c = atomicAdd(&S.n_cand, 1);
            S.cand_v[c] = v[r];
            S.cand_i[c] = id[r];
        }
        __syncthreads();
        n = S.n_cand;
    }
    smp_finish(S.cand_v, S.cand_i, n, mx, invt, top_k, top_p, min_p, seed, step, out, out_host, S);
}
