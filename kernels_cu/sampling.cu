// Token selection on the GPU so that only one int32 crosses to the host per step.
//
// sample_token runs in ONE block of 1024 threads over the fp32 logits, in the order of Hugging
// Face's processors: repetition penalty, temperature, top-k, top-p, min-p; then an exact draw
// from the kept softmax by the Gumbel-max trick. Top-k and top-p thresholds are found by radix
// selection on order-preserving integer keys (4 rounds of 8 bits), so nothing is sorted; with top-k
// they run on a few candidates gathered into shared memory, not on the whole vocabulary.
// A temperature of 0 is greedy (lowest index among equal maxima, like numpy.argmax).
#include "common.cuh"

#define SMP_THREADS 1024
#define SMP_CAND 4096  // top-k candidates kept in shared memory (more: the filters scan every logit)

// float -> uint32 whose unsigned order is the float order
__device__ __forceinline__ u32 fkey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// counter-based uniform in (0, 1): a 64-bit mix of (seed, step, index)
__device__ __forceinline__ float uniform01(unsigned long long seed, unsigned long long step, u32 i) {
    unsigned long long z = seed ^ (step * 0x9E3779B97F4A7C15ull) ^ ((unsigned long long)i * 0xD1B54A32D192ED03ull);
    z ^= z >> 30; z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27; z *= 0x94D049BB133111EBull;
    z ^= z >> 31;
    return ((float)(z >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// Calls f(i, x[i]) for every i < n this thread owns. One block scans the whole vocabulary while
// the rest of the GPU idles, so each pass is bound by load latency: 16-byte loads, four in flight
// per thread (a scalar strided loop took ~56 µs per pass over 151936 logits on H100). Visiting
// order is not increasing per thread, so callers break ties by index explicitly.
template <class F>
__device__ __forceinline__ void scan_logits(const float* __restrict__ x, int n, F f) {
    const int n4 = n >> 2, B = blockDim.x;
    const float4* x4 = reinterpret_cast<const float4*>(x);  // logits buffers are 256-byte aligned
    int i = threadIdx.x;
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
    for (int j = 4 * n4 + threadIdx.x; j < n; j += B) f(j, x[j]);
}

// keep (v, idx) or take (ov, oi): the larger value, the lower index among equals
__device__ __forceinline__ bool better(float ov, int oi, float v, int idx) {
    return ov > v || (ov == v && oi < idx);
}

// (value, index) argmax over the block, ties to the lower index; result valid in every thread.
__device__ void block_argmax(float& v, int& idx, float* sv, int* si) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (better(ov, oi, v, idx)) { v = ov; idx = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[wid] = v; si[wid] = idx; }
    __syncthreads();
    v = sv[lane]; idx = si[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (better(ov, oi, v, idx)) { v = ov; idx = oi; }
    }
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
            u32 k = fkey(v);
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

__global__ void __launch_bounds__(SMP_THREADS)
sample_token(float* __restrict__ logits,       // [V] scratch: penalised (and scaled when top-k is off) in place
             int n_valid,                       // ids >= n_valid (vocabulary padding) never chosen
             const int* __restrict__ hist_ids,  // [n_hist] recent tokens for the repetition penalty
             int n_hist, float penalty, float temperature, int top_k, float top_p, float min_p,
             unsigned long long seed, unsigned long long* __restrict__ step,
             int* __restrict__ out) {
    __shared__ float sv[32], hist[256], red[32];
    __shared__ int si[32], n_cand;
    __shared__ __align__(16) float tmax[SMP_THREADS];  // each thread's largest scaled logit
    __shared__ __align__(16) float cand_v[SMP_CAND];    // top-k candidates: scaled logit, vocabulary index
    __shared__ int cand_i[SMP_CAND];
    __shared__ u32 sorted_k[SMP_THREADS];               // ranked candidates' keys, descending
    __shared__ float wmax[32];                          // each warp's largest scaled logit
    // repetition penalty: every read happens before any write, so duplicate ids apply once
    if (penalty != 1.f) {
        float pv = 0.f;
        int id = -1;
        if ((int)threadIdx.x < n_hist) {
            id = hist_ids[threadIdx.x];
            if (id >= 0 && id < n_valid) { pv = logits[id]; pv = pv > 0.f ? pv / penalty : pv * penalty; }
            else id = -1;
        }
        __syncthreads();
        if (id >= 0) logits[id] = pv;
        __syncthreads();
    }
    if (temperature == 0.f) {
        float v = -INFINITY;
        int idx = 0x7fffffff;
        scan_logits(logits, n_valid, [&](int i, float x) {
            if (better(x, i, v, idx)) { v = x; idx = i; }
        });
        block_argmax(v, idx, sv, si);
        if (threadIdx.x == 0) { *out = idx == 0x7fffffff ? -1 : idx; *step += 1; }  // -1: all NaN
        return;
    }
    const float invt = 1.f / temperature;
    float mx = -INFINITY;
    scan_logits(logits, n_valid, [&](int, float x) { mx = fmaxf(mx, x * invt); });
    const float my_max = mx;
    tmax[threadIdx.x] = mx;
    {
        float wm = mx;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) wm = fmaxf(wm, __shfl_xor_sync(0xffffffffu, wm, o));
        if ((threadIdx.x & 31) == 0) wmax[threadIdx.x >> 5] = wm;
    }
    {
        int dummy = 0;
        block_argmax(mx, dummy, sv, si);
    }
    // Top-k candidates: the k-th largest of the warps' maxima (k <= 32) or of the threads' maxima is
    // a lower bound of the k-th largest logit (k distinct elements are at least it), so every element
    // the filters can keep is at or above it and only threads whose maximum reaches it rescan. The
    // candidates (a few dozen for k = 20) go to shared memory and every later pass runs on them:
    // radix passes over the whole vocabulary had all 1024 threads adding into the same few
    // histogram bins (~0.3 ms a round).
    const float* vals = logits;  // what the filters and the draw scan: all logits, or the candidates
    const int* ids = nullptr;    // candidate -> vocabulary index (nullptr: the identity)
    int n = n_valid;
    if (top_k > 0 && top_k < n_valid && top_k <= SMP_THREADS) {
        u32 floor_key;
        if (top_k <= 32) {  // every warp ranks the 32 warp maxima itself: no barrier, no histogram
            const int lane = threadIdx.x & 31;
            const u32 kv = fkey(wmax[lane]);
            int r = 0;
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                const u32 kj = fkey(wmax[j]);
                r += kj > kv || (kj == kv && j < lane);
            }
            const unsigned b = __ballot_sync(0xffffffffu, r == top_k - 1);
            floor_key = __shfl_sync(0xffffffffu, kv, __ffs(b) - 1);
        } else {
            floor_key = radix_threshold(tmax, SMP_THREADS, 0u, false, (float)top_k, mx, hist, red);
        }
        if (threadIdx.x == 0) n_cand = 0;
        __syncthreads();
        if (fkey(my_max) >= floor_key)
            scan_logits(logits, n_valid, [&](int i, float x) {
                x *= invt;
                if (fkey(x) < floor_key) return;
                const int c = atomicAdd(&n_cand, 1);
                if (c < SMP_CAND) { cand_v[c] = x; cand_i[c] = i; }
            });
        __syncthreads();
        if (n_cand <= SMP_CAND) { vals = cand_v; ids = cand_i; n = n_cand; }  // else: many ties, scan all
    }
    if (!ids) {  // the filters scan every logit: scale them in place once (each thread its own elements)
        scan_logits(logits, n_valid, [&](int i, float x) { logits[i] = x * invt; });
        __syncthreads();
    }
    u32 thr = 0;  // keep keys >= thr
    if (ids && n <= SMP_THREADS) {
        // Few candidates: rank them (by key, ties by slot) into descending order; top-k is then the
        // k-th key and top-p the first prefix whose mass reaches top_p, the thresholds the radix
        // passes would find. tmax (no longer needed) holds the sorted values.
        const int t = threadIdx.x;
        float* sorted_v = tmax;
        __syncthreads();  // every warp is past its last read of tmax
        if (t < n) {
            const u32 kv = fkey(cand_v[t]);
            int r = 0;
            for (int j = 0; j < n; ++j) {
                const u32 kj = fkey(cand_v[j]);
                r += kj > kv || (kj == kv && j < t);
            }
            sorted_k[r] = kv;
            sorted_v[r] = cand_v[t];
        }
        __syncthreads();
        if (top_k < n) thr = sorted_k[top_k - 1];
        if (top_p < 1.f) {
            if (t < 32) {
                float z = 0.f;
                for (int i = t; i < n && sorted_k[i] >= thr; i += 32) z += __expf(sorted_v[i] - mx);
                const float target = top_p * warp_sum(z);
                float carry = 0.f;
                u32 tp = thr;  // nothing reaches the target (rounding): keep all, as the radix pass does
                for (int base = 0; base < n; base += 32) {
                    const int i = base + t;
                    const bool in = i < n && sorted_k[i] >= thr;
                    float incl = in ? __expf(sorted_v[i] - mx) : 0.f;
#pragma unroll
                    for (int o = 1; o < 32; o <<= 1) {
                        const float v = __shfl_up_sync(0xffffffffu, incl, o);
                        if (t >= o) incl += v;
                    }
                    const unsigned hit = __ballot_sync(0xffffffffu, in && carry + incl >= target);
                    if (hit) { tp = sorted_k[base + __ffs(hit) - 1]; break; }
                    carry += __shfl_sync(0xffffffffu, incl, 31);
                }
                if (t == 0) red[0] = __uint_as_float(tp);
            }
            __syncthreads();
            thr = max(thr, __float_as_uint(red[0]));
        }
    } else {
        if (top_k > 0 && top_k < n)
            thr = radix_threshold(vals, n, 0u, false, (float)top_k, mx, hist, red);
        if (top_p < 1.f) {
            float z = 0.f;
            scan_logits(vals, n, [&](int, float x) {
                if (fkey(x) >= thr) z += __expf(x - mx);
            });
            z = block_sum(z, red);
            __syncthreads();
            u32 tp = radix_threshold(vals, n, thr, true, top_p * z, mx, hist, red);
            thr = max(thr, tp);
        }
    }
    if (min_p > 0.f) thr = max(thr, fkey(mx + __logf(min_p)));
    const unsigned long long st = *step;
    float best = -INFINITY;
    int idx = 0x7fffffff;
    scan_logits(vals, n, [&](int c, float x) {
        if (fkey(x) < thr) return;
        const int i = ids ? ids[c] : c;  // the draw depends on the vocabulary index, not the candidate slot
        float gmb = x - __logf(-__logf(uniform01(seed, st, (u32)i)));
        if (better(gmb, i, best, idx)) { best = gmb; idx = i; }
    });
    block_argmax(best, idx, sv, si);
    __syncthreads();
    if (threadIdx.x == 0) { *out = idx == 0x7fffffff ? -1 : idx; *step = st + 1; }
}
