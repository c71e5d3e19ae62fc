// Decode (one token) through every dense decoder layer in one persistent kernel (sm_90).
//
// Why: a standalone GEMV over 4-26 MB cannot keep DRAM busy: it ramps up after its launch and
// drains at its end (a plain streaming read reaches 0.49 / 0.68 / 0.78 of copy bandwidth at
// 4 / 8 / 12.6 MB, PERFORMANCE.md change 11), and a layer pays that five times. Here one block per
// SM lives for the whole step. Its producer warp streams the block's share of every weight matrix
// of every layer into a ring of shared-memory stages with bulk async copies (TMA, mbarrier
// completion), never waiting on the math: while the consumers sit in a grid barrier, normalise,
// rotate or attend, the producer is already loading the next projection. DRAM sees one stream.
//
// Work: a unit is one AWQ group (128 rows) of one 256-column tile of the tiled qweight layout
// (common.cuh): 16 KB of packed words, contiguous, plus the group's 512 bytes of scales and 128 of
// zeros. A phase's units are ordered tile-major and block b takes units [b*U/G, (b+1)*U/G) (G
// blocks), so a block's units touch at most DL_MAXT tiles; it writes one partial-sum row per tile
// touched, and whoever consumes a column sums the partials of the blocks that covered its tile in
// a fixed order (deterministic, no atomics). Per layer, with a grid barrier after each step:
//   1 q|k|v units on rmsnorm(h) * attn_norm       2 q/k norm, RoPE, KV-cache write (one head per block)
//   3 flash-decoding splits (128 threads each)    4 o units on the splits merged for the block's rows
//   5 h += o                                      6 gate|up units on rmsnorm(h) * ffn_norm
//   7 act = silu(gate) * up                       8 down units on act
//   9 h += down
// Rounding points are those of the separate kernels (gemv_w4a16.cu), so results match them up to
// the order of fp32 additions.
//
// Supported (checked on the host, ops_cupy.decode_layers_plan): group size 128; q, k|v, hidden and
// intermediate widths multiples of 256; head_dim 64 or 128; a dense model (no MoE layer).
#include "common.cuh"
#include "attn_decode.cuh"

#ifndef DL_CW
#define DL_CW 8                      // consumer warps per block (8 or 16)
#endif
#define DL_CT (DL_CW * 32)           // consumer threads
#define DL_THREADS (DL_CT + 32)      // + the producer warp
#define DL_COLS 256                  // columns per tile: a lane owns one packed word (8 columns)
#define DL_ROWS 128                  // rows per unit: one AWQ group
#define DL_QPW (DL_ROWS / 4 / DL_CW) // row quads per consumer warp per unit
#define DL_MAXT 4                    // most tiles one block's units may touch in a phase
#define DL_W_BYTES (DL_ROWS * DL_COLS / 2)
#define DL_S_BYTES (DL_COLS * 2)
#define DL_Z_BYTES (DL_COLS / 2)
#define DL_STAGE (DL_W_BYTES + DL_S_BYTES + DL_Z_BYTES)  // one unit in the ring: 17024 bytes
#define DL_MAX_RING 32
#define DL_FIXED 2048                // barriers, block-sum scratch, a head's values, group flags
#define DL_X_BIG 1024.f              // as gemv_w4a16.cu: |x| above which a group's x is scaled down
#define DL_X_SCALE 64.f              //   by 64 (exact), so 4 rows of fp16 (q - z) x cannot overflow
static_assert(DL_CW == 8 || DL_CW == 16, "a unit's 32 row quads split evenly over the consumer warps");
// Diagnosis only (KUIPER_DL_DEFINES, wrong results): DL_DEBUG_NOSYNC drops the grid barriers,
// DL_DEBUG_NOMATH the dot products, DL_DEBUG_STREAM_ONLY everything but the ring's handshakes, to
// split a step's time (PERFORMANCE.md change 45).
#ifdef DL_DEBUG_STREAM_ONLY
#define DL_DEBUG_NOSYNC
#define DL_DEBUG_NOMATH
#define DL_STEP(call) ((void)0)
#else
#define DL_STEP(call) call
#endif

struct DlMat {
    const u32* qw;    // [K, N/8] tiled (common.cuh)
    const u32* qz;    // [K/128, N/8]
    const half* sc;   // [K/128, N]
};
struct DlLayer {
    DlMat m[7];       // q, k, v, o, gate, up, down
    const half* attn_norm; const half* ffn_norm;  // [D]
    const half* q_norm; const half* k_norm;       // [hd]
    half* Kc; half* Vc;                           // [ctx, KV, hd] this layer's cache
};
struct DlArgs {       // by value (__grid_constant__); ops_cupy._DlArgs mirrors it
    const DlLayer* layers;
    float* h;         // [D] fp32 residual stream, in and out
    half* q;          // [H*hd] rotated q of the step
    float* part;      // [G][DL_MAXT][DL_COLS] partial sums
    float* att_o;     // [H, S, hd] flash-decoding partials
    float* att_ml;    // [H, S, 2]
    half* act;        // [I] silu(gate) * up
    const float* cosb; const float* sinb;  // [ctx, hd/2]
    const int* pos;   // the step's position (device memory: the step replays as a graph)
    unsigned* bar;    // [2] grid barrier and exit counters, zero at launch and left zero
    int L, D, I, H, KV, hd, S, ring;
    float eps, scale_log2;
};

// A projection phase: its matrices (consecutive in DlLayer::m), their 256-column tile counts, K.
struct DlPhase {
    int nm, mat0, K, UPT, U;  // matrices, first one, rows, units per tile (K / 128), units
    int tiles[3];
};

__device__ __forceinline__ DlPhase dl_phase(const DlArgs& a, int ph) {
    const int qd = a.H * a.hd, kvd = a.KV * a.hd;
    DlPhase p;
    p.tiles[1] = p.tiles[2] = 0;
    if (ph == 0) { p.nm = 3; p.mat0 = 0; p.K = a.D; p.tiles[0] = qd / DL_COLS; p.tiles[1] = p.tiles[2] = kvd / DL_COLS; }
    else if (ph == 1) { p.nm = 1; p.mat0 = 3; p.K = qd; p.tiles[0] = a.D / DL_COLS; }
    else if (ph == 2) { p.nm = 2; p.mat0 = 4; p.K = a.D; p.tiles[0] = p.tiles[1] = a.I / DL_COLS; }
    else { p.nm = 1; p.mat0 = 6; p.K = a.I; p.tiles[0] = a.D / DL_COLS; }
    p.UPT = p.K / DL_ROWS;
    p.U = (p.tiles[0] + p.tiles[1] + p.tiles[2]) * p.UPT;
    return p;
}

// First unit of block b (b = G: the end).
__device__ __forceinline__ int dl_start(const DlPhase& p, int b) { return (int)((long long)b * p.U / gridDim.x); }

// The consumers' own barrier (id 1): the producer warp never joins it.
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(DL_CT) : "memory"); }

// Every block past the same point; the writes before it visible to every block after it (the
// cooperative-groups grid sync: fence, count, spin, fence). The counter only grows in a launch.
__device__ __forceinline__ void dl_grid_sync(unsigned* bar, unsigned& target) {
    consumer_sync();
#ifdef DL_DEBUG_NOSYNC
    return;
#endif
    target += gridDim.x;
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(bar, 1u);
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(bar) : "memory");
        } while (v < target);
        __threadfence();
    }
    consumer_sync();
}

// consumer_sync as group_sum's barrier argument (a functor, so the call inlines).
struct DlConsumers {
    __device__ __forceinline__ void operator()() const { consumer_sync(); }
};

// 1 / rms of the residual row (other blocks wrote it this launch) by the consumer threads.
__device__ __forceinline__ float dl_rms_inv(const DlArgs& a, float* red) {
    return group_rms_inv(a.h, a.D, a.eps, red, threadIdx.x, DL_CT, DlConsumers{});
}

// Column col of tile T of a phase: the partial sums of the blocks whose units cover the tile, in
// block order. Block b covers it when its range [start(b), start(b+1)) meets [T*UPT, (T+1)*UPT);
// the first such is the last block starting at or before T*UPT, found in closed form.
__device__ __forceinline__ float dl_col_sum(const float* part, const DlPhase& p, int T, int col) {
    const long long G = gridDim.x, a0 = (long long)T * p.UPT, a1 = a0 + p.UPT;
    const int b_lo = (int)min(G - 1, ((a0 + 1) * G + p.U - 1) / p.U - 1);
    const int b_hi = (int)min(G - 1, (a1 * G + p.U - 1) / p.U - 1);
    float s = 0.f;
    for (int b = b_lo; b <= b_hi; ++b) {
        const int s0 = dl_start(p, b);
        if (s0 == dl_start(p, b + 1)) continue;  // a block without units (more blocks than units)
        s += __ldcg(part + ((size_t)b * DL_MAXT + (T - s0 / p.UPT)) * DL_COLS + col);
    }
    return s;
}

// Where unit u of a phase lives: its packed words (16 KB contiguous in the tiled layout), its
// group's 256 scales and 32 zero words.
__device__ __forceinline__ void dl_unit_src(const DlLayer& Lr, const DlPhase& p, int u, const u32*& w,
                                            const half*& s, const u32*& z) {
    int T = u / p.UPT;
    const int g = u - T * p.UPT;
    int mi = 0;  // no loop over p.tiles: a runtime index would put the struct in local memory
    if (p.nm > 1 && T >= p.tiles[0]) {
        T -= p.tiles[0];
        mi = 1;
        if (p.nm > 2 && T >= p.tiles[1]) { T -= p.tiles[1]; mi = 2; }
    }
    const DlMat& m = Lr.m[p.mat0 + mi];
    const int N = (mi == 0 ? p.tiles[0] : mi == 1 ? p.tiles[1] : p.tiles[2]) * DL_COLS;
    w = m.qw + (size_t)T * 32 * p.K + (size_t)g * (DL_ROWS / 4) * 128;
    s = m.sc + (size_t)g * N + T * DL_COLS;
    z = m.qz + (size_t)g * (N / 8) + T * 32;
}


// One unit's dot products for this lane's 8 columns: its warp's DL_QPW row quads (16-byte loads,
// conflict-free: 32 lanes read 512 contiguous bytes), 4 rows of (q - z) x summed in fp16 and
// folded into fp32 with the group's scales, as gemv_w4a16.cu's loop (same exact q - z).
__device__ __forceinline__ void dl_unit_dot(const unsigned char* st, const half* x, bool big, float (&acc)[8]) {
#ifdef DL_DEBUG_NOMATH
    return;
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint4* w4 = reinterpret_cast<const uint4*>(st);
    uint4 wv[DL_QPW];
    uint2 xv[DL_QPW];
#pragma unroll
    for (int i = 0; i < DL_QPW; ++i) {
        const int quad = warp + i * DL_CW;
        wv[i] = w4[quad * 32 + lane];
        xv[i] = *reinterpret_cast<const uint2*>(x + quad * 4);
    }
    const u32 zw = reinterpret_cast<const u32*>(st + DL_W_BYTES + DL_S_BYTES)[lane];
    float sc[8];
    unpack8(reinterpret_cast<const uint4*>(st + DL_W_BYTES)[lane], sc);
    half2 zb[4];
    awq_zero_bias(zw, zb);  // the zero codes as awq_dot4 takes them
    float ua[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) ua[i] = 0.f;
#pragma unroll
    for (int i = 0; i < DL_QPW; ++i) {
        const u32 wr[4] = {wv[i].x, wv[i].y, wv[i].z, wv[i].w};
        half2 hacc[4];
        awq_dot4(wr, reinterpret_cast<const half*>(&xv[i]), zb, hacc);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const float2 f = __half22float2(hacc[p]);
            ua[2 * p] += f.x;
            ua[2 * p + 1] += f.y;
        }
    }
    const float mul = big ? DL_X_SCALE : 1.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += ua[i] * (sc[i] * mul);
}

// The block's sums of one tile: the consumer warps' 8 columns per lane added over the warps and
// written as the block's partial row (padding: lane-strided stores spread over the banks).
__device__ __forceinline__ void dl_tile_out(float (&acc)[8], float* red, float* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        red[warp * (DL_COLS + 8) + lane * 8 + i + lane / 4] = acc[i];
        acc[i] = 0.f;
    }
    consumer_sync();
    for (int c = threadIdx.x; c < DL_COLS; c += DL_CT) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < DL_CW; ++w) s += red[w * (DL_COLS + 8) + c + c / 32];
        out[c] = s;
    }
    consumer_sync();
}

// The phase's input rows that this block's units read, into xs (fp16, indexed by row), one group
// per warp, with each group's massive-activation flag. SRC 0: rmsnorm(h) * w (inv given); 1: the
// flash-decoding merge of the attention partials; 2: act.
template <int SRC>
__device__ __forceinline__ void dl_stage_x(const DlArgs& a, const DlPhase& p, half* xs, unsigned char* flags,
                                           const half* w, float inv, int n_keys) {
    const int b = blockIdx.x, u0 = dl_start(p, b), u1 = dl_start(p, b + 1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int count = min(p.UPT, u1 - u0), g0 = u0 % p.UPT;
    for (int j = warp; j < count; j += DL_CW) {
        const int g = (g0 + j) % p.UPT;
        const int k0 = g * DL_ROWS + lane * 4;
        half v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int k = k0 + e;
            if (SRC == 0) v[e] = __float2half(__ldcg(a.h + k) * inv * __half2float(w[k]));
            else if (SRC == 1)
                v[e] = decode_merge(a.att_o, a.att_ml, k / a.hd, k % a.hd, a.S, a.hd, n_keys, DECODE_MIN_CHUNK);
            else v[e] = __ldcg(a.act + k);
        }
        bool big = false;
#pragma unroll
        for (int e = 0; e < 4; ++e) big |= fabsf(__half2float(v[e])) > DL_X_BIG;
        big = __any_sync(0xffffffffu, big);
        if (big) {  // rare: the group's x divided by 64 (exact), its sums multiplied back (dl_unit_dot)
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = __hmul(v[e], __float2half(1.f / DL_X_SCALE));
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) xs[k0 + e] = v[e];
        if (lane == 0) flags[g] = big;
    }
    consumer_sync();
}

// The consumer side of a projection phase: this block's units in order, each waited for in the
// ring, multiplied and handed back; a partial row per tile touched.
__device__ __forceinline__ int dl_project(const DlArgs& a, const DlPhase& p, int it, const unsigned char* ring,
                                          u32 full, u32 empty, const half* xs, const unsigned char* flags,
                                          float* red) {
    const int b = blockIdx.x, u0 = dl_start(p, b), u1 = dl_start(p, b + 1), t0 = u0 / p.UPT;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    for (int u = u0; u < u1; ++u, ++it) {
        const int s = it % a.ring;
        mbar_wait(full + 8 * s, (it / a.ring) & 1);
        const int T = u / p.UPT, g = u - T * p.UPT;
        dl_unit_dot(ring + (size_t)s * DL_STAGE, xs + g * DL_ROWS, flags[g], acc);
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(empty + 8 * s);
        if (u + 1 == u1 || (u + 1) / p.UPT != T)
            dl_tile_out(acc, red, a.part + ((size_t)b * DL_MAXT + (T - t0)) * DL_COLS);
    }
    return it;
}

// Step 2: q|k|v of a head from the partials, rounded to fp16 (as the separate kernels store
// them), then Qwen3's q/k RMSNorm and RoPE; q to a.q, k and v into the cache. One head per block.
__device__ __forceinline__ void dl_qkv_heads(const DlArgs& a, const DlLayer& Lr, const DlPhase& p, int pos,
                                             float* red, float* yv) {
    const int t = threadIdx.x, hd = a.hd, qd = a.H * hd, kvd = a.KV * hd;
    for (int item = blockIdx.x; item < a.H + 2 * a.KV; item += gridDim.x) {
        const int mat = item < a.H ? 0 : item < a.H + a.KV ? 1 : 2;
        const int head = item - (mat == 0 ? 0 : mat == 1 ? a.H : a.H + a.KV);
        const int col = (mat == 0 ? 0 : mat == 1 ? qd : qd + kvd) + head * hd + t;
        const float y = t < hd ? __half2float(__float2half(dl_col_sum(a.part, p, col / DL_COLS, col % DL_COLS))) : 0.f;
        if (mat == 2) {
            if (t < hd) Lr.Vc[((size_t)pos * a.KV + head) * hd + t] = __float2half(y);
            continue;
        }
        if (t < hd) yv[t] = y;
        const float inv = rsqrtf(group_sum(y * y, red, threadIdx.x, DL_CT, DlConsumers{}) / hd + a.eps);  // its barriers publish yv
        if (t < hd) {
            const half* nw = mat == 0 ? Lr.q_norm : Lr.k_norm;
            const int hh = hd / 2, dp = t < hh ? t + hh : t - hh;  // the rotation partner
            const float xs = y * inv * __half2float(nw[t]), xp = yv[dp] * inv * __half2float(nw[dp]);
            const float cs = a.cosb[(size_t)pos * hh + t % hh], sn = a.sinb[(size_t)pos * hh + t % hh];
            const half r = __float2half(t < hh ? xs * cs - xp * sn : xs * cs + xp * sn);
            if (mat == 0) a.q[(size_t)head * hd + t] = r;
            else Lr.Kc[((size_t)pos * a.KV + head) * hd + t] = r;
        }
        consumer_sync();  // yv read before the next head overwrites it
    }
}

// Step 3: the flash-decoding splits that hold keys, 128 consumer threads per split.
template <int HD, int HB>
__device__ __forceinline__ void dl_attention(const DlArgs& a, const DlLayer& Lr, int n_keys, float* scratch) {
    using SM = AttnSplitSmem<HD, HB>;
    constexpr int NSUB = DL_CT / 128;
    const int sub = threadIdx.x / 128, tid = threadIdx.x % 128;
    float* sm_o = scratch + sub * (SM::o_floats + SM::ml_floats);
    float* sm_ml = sm_o + SM::o_floats;
    const int used = decode_splits_used(n_keys, a.S, DECODE_MIN_CHUNK);
    const int nhb = a.H / a.KV / HB, items = a.KV * nhb * used;
    for (int item = blockIdx.x * NSUB + sub; item < items; item += gridDim.x * NSUB) {
        const int s = item % used, r = item / used;
        attn_decode_split<HD, HB>(a.q, Lr.Kc, Lr.Vc, a.att_o, a.att_ml, r / nhb, r % nhb, s, a.S, n_keys,
                                  DECODE_MIN_CHUNK, a.H, a.KV,
                                  a.scale_log2, sm_o, sm_ml, tid,
                                  [sub] { asm volatile("bar.sync %0, 128;\n" ::"r"(2 + sub) : "memory"); },
                                  [] {});  // q and the newest key were written before a grid barrier
        asm volatile("bar.sync %0, 128;\n" ::"r"(2 + sub) : "memory");  // scratch free for the next split
    }
}

// Steps 5 and 9: h += fp16(sum of the projection's partials), the residual add of gemv_w4a16.cu.
__device__ __forceinline__ void dl_residual(const DlArgs& a, const DlPhase& p) {
    for (int n = blockIdx.x * DL_CT + threadIdx.x; n < a.D; n += gridDim.x * DL_CT)
        a.h[n] = __ldcg(a.h + n) + __half2float(__float2half(dl_col_sum(a.part, p, n / DL_COLS, n % DL_COLS)));
}

// Step 7: act = silu(gate) * up from the fp32 sums, as gemv_w4a16.cu's SwiGLU epilogue.
__device__ __forceinline__ void dl_swiglu(const DlArgs& a, const DlPhase& p) {
    const int tg = a.I / DL_COLS;
    for (int n = blockIdx.x * DL_CT + threadIdx.x; n < a.I; n += gridDim.x * DL_CT) {
        const float g = dl_col_sum(a.part, p, n / DL_COLS, n % DL_COLS);
        const float u = dl_col_sum(a.part, p, tg + n / DL_COLS, n % DL_COLS);
        a.act[n] = __float2half(g / (1.f + __expf(-g)) * u);
    }
}

// Shared memory (dynamic): [0, DL_FIXED) the ring's mbarriers, block-sum scratch, a head's values
// and the group flags; then a region that is xs + the tile reduction in projection steps and the
// attention scratch in step 3 (xbytes, from the host); then the ring of a.ring stages.
template <int HD, int HB>
__global__ void __launch_bounds__(DL_THREADS, 1)
decode_layers(const __grid_constant__ DlArgs a, int xbytes) {
    extern __shared__ __align__(128) unsigned char sm[];
    const u32 full = smem_u32(sm), empty = full + 8 * DL_MAX_RING;
    float* red32 = reinterpret_cast<float*>(sm + 16 * DL_MAX_RING);          // 32 floats (group_sum)
    float* yv = red32 + 32;                                                  // [hd]
    unsigned char* flags = reinterpret_cast<unsigned char*>(yv + 128);      // [K / 128], K <= 32768
    half* xs = reinterpret_cast<half*>(sm + DL_FIXED);                       // [K]
    float* red = reinterpret_cast<float*>(sm + DL_FIXED) + (xbytes - DL_CW * (DL_COLS + 8) * 4) / 4;
    float* scratch = reinterpret_cast<float*>(sm + DL_FIXED);
    unsigned char* ring = sm + DL_FIXED + xbytes;
    if (threadIdx.x == 0) {
        // the host sizes the ring: a short allocation must not corrupt memory
        if (a.ring > DL_MAX_RING || dynamic_smem_bytes() < (u32)(DL_FIXED + xbytes + a.ring * DL_STAGE)) __trap();
        for (int s = 0; s < a.ring; ++s) {
            mbar_init(full + 8 * s, 1);       // the producer's expect_tx, then the bytes
            mbar_init(empty + 8 * s, DL_CW);  // every consumer warp, after its reads of the stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the copy engine
    }
    __syncthreads();

    if (threadIdx.x >= DL_CT) {  // ---- producer: the block's units of every phase of every layer
        if (threadIdx.x == DL_CT) {
            unsigned long long pol;  // weights are read once per step: do not let them push out h, q, partials
            asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
            int it = 0;
            for (int l = 0; l < a.L; ++l) {
                const DlLayer& Lr = a.layers[l];
                for (int ph = 0; ph < 4; ++ph) {
                    const DlPhase p = dl_phase(a, ph);
                    const int u1 = dl_start(p, blockIdx.x + 1);
                    for (int u = dl_start(p, blockIdx.x); u < u1; ++u, ++it) {
                        const int s = it % a.ring;
                        if (it >= a.ring) mbar_wait(empty + 8 * s, (it / a.ring - 1) & 1);
                        const u32* w; const half* sc; const u32* z;
                        dl_unit_src(Lr, p, u, w, sc, z);
                        const u32 dst = smem_u32(ring) + s * DL_STAGE;
                        mbar_arrive_expect_tx(full + 8 * s, DL_STAGE);
                        bulk_g2s(dst, w, DL_W_BYTES, full + 8 * s, pol);
                        bulk_g2s(dst + DL_W_BYTES, sc, DL_S_BYTES, full + 8 * s, pol);
                        bulk_g2s(dst + DL_W_BYTES + DL_S_BYTES, z, DL_Z_BYTES, full + 8 * s, pol);
                    }
                }
            }
        }
        return;
    }

    // ---- consumers
    pdl_wait();  // h and the position come from the kernels before
    const int pos = __ldcg(a.pos), n_keys = pos + 1;
    unsigned target = 0;
    int it = 0;
    const DlPhase p_qkv = dl_phase(a, 0), p_o = dl_phase(a, 1), p_gu = dl_phase(a, 2), p_dn = dl_phase(a, 3);
    for (int l = 0; l < a.L; ++l) {
        const DlLayer& Lr = a.layers[l];
        DL_STEP(dl_stage_x<0>(a, p_qkv, xs, flags, Lr.attn_norm, dl_rms_inv(a, red32), 0));
        it = dl_project(a, p_qkv, it, ring, full, empty, xs, flags, red);
        dl_grid_sync(a.bar, target);
        DL_STEP(dl_qkv_heads(a, Lr, p_qkv, pos, red32, yv));
        dl_grid_sync(a.bar, target);
        DL_STEP((dl_attention<HD, HB>(a, Lr, n_keys, scratch)));
        dl_grid_sync(a.bar, target);
        DL_STEP(dl_stage_x<1>(a, p_o, xs, flags, nullptr, 0.f, n_keys));
        it = dl_project(a, p_o, it, ring, full, empty, xs, flags, red);
        dl_grid_sync(a.bar, target);
        DL_STEP(dl_residual(a, p_o));
        dl_grid_sync(a.bar, target);
        DL_STEP(dl_stage_x<0>(a, p_gu, xs, flags, Lr.ffn_norm, dl_rms_inv(a, red32), 0));
        it = dl_project(a, p_gu, it, ring, full, empty, xs, flags, red);
        dl_grid_sync(a.bar, target);
        DL_STEP(dl_swiglu(a, p_gu));
        dl_grid_sync(a.bar, target);
        DL_STEP(dl_stage_x<2>(a, p_dn, xs, flags, nullptr, 0.f, 0));
        it = dl_project(a, p_dn, it, ring, full, empty, xs, flags, red);
        dl_grid_sync(a.bar, target);
        DL_STEP(dl_residual(a, p_dn));
        if (l + 1 < a.L) dl_grid_sync(a.bar, target);
    }
    // Leave the counters at zero for the next launch: the last block to get here knows that every
    // block is past its last grid barrier, so nobody reads bar[0] any more.
    consumer_sync();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(a.bar + 1, 1u) == gridDim.x - 1) {
            a.bar[0] = 0;
            a.bar[1] = 0;
        }
    }
}
