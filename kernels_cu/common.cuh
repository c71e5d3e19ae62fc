// Device helpers shared by the kernel families: AWQ nibble dequantization, cp.async,
// ldmatrix and mma.sync wrappers, warp reductions. Included by the .cu files (NVRTC -I).
#pragma once
#include <cuda_fp16.h>

typedef unsigned int u32;

#ifndef INFINITY  // NVRTC has no math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

// ---------------------------------------------------------------------------------------------
// Streamed reads: data a decode step reads exactly once (packed weights, lm_head rows).
// ---------------------------------------------------------------------------------------------

// A 16-byte read-only load that does not allocate in L1: a streamed line is never read again, and
// allocating it only evicts lines that are (the zeros and scales a block's warps share, the norm
// weights). 8B decode steps -0.9% on the H200, -1.5% on the H100.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// ---------------------------------------------------------------------------------------------
// AWQ 4-bit -> fp16 with the LOP3 magic-number trick.
// A packed word holds column c of its 8 in nibble {0,4,1,5,2,6,3,7}[c], so nibbles (0,4),
// (1,5), (2,6), (3,7) are the column pairs (0,1), (2,3), (4,5), (6,7): masking a nibble into the
// mantissa of 1024.0h (0x6400) yields 1024 + q, or 1024 + 16q for the upper nibble of a byte.
// ---------------------------------------------------------------------------------------------

// (a & b) | c in one instruction: LOP3 with the truth table 0xEA.
__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {
    u32 d;
    asm volatile("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The MoE grouped GEMMs' block -> expert table: the expert e with tile_offsets[e] <= tile < tile_offsets[e + 1]
// (moe.cu moe_expert_maps' prefix sum of row tiles; experts with no rows share their successor's offset, and
// the search lands on the one that owns the tile). tile < tile_offsets[E].
__device__ __forceinline__ int moe_tile_expert(const int* __restrict__ tile_offsets, int E, int tile) {
    int lo = 0, hi = E;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (tile_offsets[mid] <= tile) lo = mid; else hi = mid;
    }
    return lo;
}

// Four half2 with the biased codes of columns (0,1),(2,3),(4,5),(6,7): pairs 0 and 2 hold
// 1024+q, pairs 1 and 3 hold 1024+16q (awq_zero_bias / awq_dequant8 below undo the bias).
__device__ __forceinline__ void awq_magic(u32 w, half2 (&h)[4]) {
    const u32 lo = 0x000f000fu, hi = 0x00f000f0u, ex = 0x64006400u;
    u32 r0 = lop3_and_or(w, lo, ex);
    u32 r1 = lop3_and_or(w, hi, ex);
    u32 s = w >> 8;
    u32 r2 = lop3_and_or(s, lo, ex);
    u32 r3 = lop3_and_or(s, hi, ex);
    h[0] = *reinterpret_cast<half2*>(&r0);
    h[1] = *reinterpret_cast<half2*>(&r1);
    h[2] = *reinterpret_cast<half2*>(&r2);
    h[3] = *reinterpret_cast<half2*>(&r3);
}

// The zero points matching awq_magic's pairs: pairs 0 and 2 hold 1024+z, pairs 1 and 3 hold
// -(64+z), so awq_dequant8 recovers q - z exactly in both (see there).
__device__ __forceinline__ void awq_zero_bias(u32 zword, half2 (&zb)[4]) {
    const half2 minus_sixteenth = __float2half2_rn(-0.0625f);
    awq_magic(zword, zb);
    zb[1] = __hmul2(zb[1], minus_sixteenth);  // exact: (1024 + 16z) / 16 = 64 + z
    zb[3] = __hmul2(zb[3], minus_sixteenth);
}

// q - z exactly for one awq_magic pair h and its awq_zero_bias zb: h - (1024+z) in the lo form (pairs 0 and 2),
// h/16 - (64+z) in one fma in the hi form (pairs 1 and 3).
__device__ __forceinline__ half2 awq_qz(half2 h, half2 zb, bool hi) {
    const half2 sixteenth = __float2half2_rn(0.0625f);
    return hi ? __hfma2(h, sixteenth, zb) : __hsub2(h, zb);
}

// w = (q - z) * s for 8 columns, s2[i] the raw scales of pair i: q - z exact before the one rounding of the
// product, awq_qz's two forms written out (through awq_qz, ptxas orders gemm_w4a16.cu's and gemm_wgmma.cu's
// dequantization differently: same instructions, an unmeasured schedule). (Pre-dividing the hi form's scales by 16
// instead would push small scales into fp16's subnormal range.)
__device__ __forceinline__ void awq_dequant8(u32 w, const half2 (&zb)[4], const half2 (&s2)[4],
                                             half2 (&out)[4]) {
    const half2 sixteenth = __float2half2_rn(0.0625f);
    half2 h[4];
    awq_magic(w, h);
    out[0] = __hmul2(__hsub2(h[0], zb[0]), s2[0]);
    out[1] = __hmul2(__hfma2(h[1], sixteenth, zb[1]), s2[1]);
    out[2] = __hmul2(__hsub2(h[2], zb[2]), s2[2]);
    out[3] = __hmul2(__hfma2(h[3], sixteenth, zb[3]), s2[3]);
}

// sum over 4 rows r of (q_r - z) * x[r] for the 8 columns of a lane's packed word w[r], in fp16
// (4 rows keep 15 * 4 * |x| under fp16's 65504 for |x| <= 1024: the GEMVs' overflow guard). zb from
// awq_zero_bias of the zero word: pairs 0 and 2 take h - (1024+z), pairs 1 and 3 h/16 - (64+z) in
// one fma, both q - z exactly, so every pair multiplies x itself (no x/16 per row: one instruction
// fewer per row of a loop that is partly issue-bound).
__device__ __forceinline__ void awq_dot4(const u32* w, const half* x, const half2 (&zb)[4], half2 (&hacc)[4]) {
#pragma unroll
    for (int p = 0; p < 4; ++p) hacc[p] = __float2half2_rn(0.f);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const half2 xr = __half2half2(x[r]);
        half2 h[4];
        awq_magic(w[r], h);
#pragma unroll
        for (int p = 0; p < 4; ++p)
            hacc[p] = __hfma2(awq_qz(h[p], zb[p], p & 1), xr, hacc[p]);
    }
}

// awq_dot4, then the 4 rows' sums folded into the fp32 accumulators with the group's raw scales s2:
// one 4-row piece of every decode GEMV's inner loop.
__device__ __forceinline__ void awq_dot4_fold(const u32* w, const half* x, const half2 (&zb)[4], const half2 (&s2)[4],
                                              float (&acc)[8]) {
    half2 hacc[4];
    awq_dot4(w, x, zb, hacc);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const float2 a = __half22float2(hacc[p]), sc = __half22float2(s2[p]);
        acc[2 * p] += a.x * sc.x;
        acc[2 * p + 1] += a.y * sc.y;
    }
}

// A lane's 8 column sums (its packed word's columns) into its warp's row of a per-warp reduction array,
// times 2^e (undoing a span's x_scale_exp): column c at c + c/32, so the lane-strided stores spread over
// the banks (the row holds 256 + 8 floats). The decode GEMVs then sum each column over the warps.
__device__ __forceinline__ void stash_lane_sums(float* row, const float (&acc)[8], int e = 0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < 8; ++i) row[lane * 8 + i + lane / 4] = e ? ldexpf(acc[i], e) : acc[i];
}

// Block-wide max of non-negative floats (their bit patterns order the same) over NW warps; red: NW words.
template <int NW>
__device__ __forceinline__ float block_max_nonneg(float v, unsigned* red) {
    const unsigned m = __reduce_max_sync(0xffffffffu, __float_as_uint(v));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    unsigned r = 0;
#pragma unroll
    for (int i = 0; i < NW; ++i) r = max(r, red[i]);
    return __uint_as_float(r);
}

// The power of two a span of x is divided by so that 4 rows of (q - z) x stay finite in fp16
// (15 * 4 * 1092 > 65504: the decode GEMVs' overflow guard), from the span's largest |x|.
__device__ __forceinline__ int x_scale_exp(float mx) { return mx > 1024.f ? min(64, (int)ceilf(log2f(mx / 1024.f))) : 0; }

// Scales of 8 consecutive columns (one 16-byte load) as awq_dequant8 wants them.
__device__ __forceinline__ void awq_scales8(uint4 raw, half2 (&s2)[4]) {
    s2[0] = *reinterpret_cast<half2*>(&raw.x);
    s2[1] = *reinterpret_cast<half2*>(&raw.y);
    s2[2] = *reinterpret_cast<half2*>(&raw.z);
    s2[3] = *reinterpret_cast<half2*>(&raw.w);
}

// ---------------------------------------------------------------------------------------------
// The GPU's tiled qweight layout (made once at load, ops_cupy.tile_qweight). A [K, W]-word AWQ
// matrix is cut into 32-word (256-column) column tiles stored one after another, each as
// [K/4][tile width][4 rows]: one 16-byte load brings a lane 4 rows of its 8 columns, and a warp's
// 32 lanes read 512 contiguous bytes, so a GEMV block streams whole DRAM pages instead of 128-byte
// pieces of rows 12 KB apart. The nibble order inside a word is AutoAWQ's, unchanged.
// ---------------------------------------------------------------------------------------------
// Word offset of packed word w of row k (k % 4 == 0 gives the start of a 16-byte row quad).
__device__ __forceinline__ size_t awq_tiled_offset(int k, int w, int W, int K) {
    const int t = w >> 5, tw = min(32, W - (t << 5));  // the last tile may be narrower
    return (size_t)t * 32 * K + ((size_t)(k >> 2) * tw + (w & 31)) * 4 + (k & 3);
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90+). A kernel launched with the PDL attribute may start
// while the kernel before it still runs. Before pdl_wait() it may only read weights; pdl_wait()
// returns once the predecessor has finished and its writes are visible. Every PDL kernel waits in
// every block before it ends, so "finished" is transitive down the stream. pdl_trigger() lets the
// next kernel's blocks start (and wait there) while this one works. Both are no-ops on
// sm_80 and in plain launches.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Thread-block clusters (sm_90): distributed shared memory and the cluster barrier.
// a shared-memory address of this block as seen from block `rank` of the cluster
__device__ __forceinline__ u32 cl_map(u32 addr, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
// arrive without ordering memory: for a block whose reads of the others' shared memory have completed
// (their values consumed) and that has loads in flight a release would wait for
__device__ __forceinline__ void cl_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cl_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
// Fire-and-forget stores into block `addr`'s cluster peer (a cl_map address), each completing its bytes on the
// receiver's mbarrier `bar` (also cl_map'd): a cluster exchange with no barrier or fence on the sender's path.
__device__ __forceinline__ void st_async_f32(u32 addr, float v, u32 bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n"
                 ::"r"(addr), "r"(__float_as_uint(v)), "r"(bar) : "memory");
}
__device__ __forceinline__ void st_async_v2(u32 addr, float2 v, u32 bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];\n"
                 ::"r"(addr), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(bar) : "memory");
}
__device__ __forceinline__ void st_async_v4(u32 addr, float4 v, u32 bar) {  // addr 16-byte aligned
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n"
                 ::"r"(addr), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
                 "r"(__float_as_uint(v.w)), "r"(bar) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Async copies, ldmatrix and mma (sm_80+).
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// The launch's dynamic shared memory in bytes, as the host gave it: kernels whose layout the host sizes on its own
// check it (a short allocation must fail the launch, not corrupt memory), or size a staging area by it.
__device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 d;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(d));
    return d;
}

// 16-byte global->shared copy; bytes past src_bytes are zero-filled (ragged tile edges).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// Every cp.async of this thread complete and visible to it; a compiler barrier too, so the shared-memory
// reads that follow are not hoisted above it.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// mbarrier handshakes between producers and consumers in one block (CTA scope; arrive releases,
// the parity wait acquires, so a slot's shared-memory writes are visible to the waiting side;
// expect_tx is sm_90+: the wgmma GEMM and the persistent decode kernel).
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// The same wait acquiring at cluster scope: for bytes other blocks of the cluster stored (st.async).
__device__ __forceinline__ void mbar_wait_cluster(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// Before the PDL wait, by every thread: the receive mbarrier `bar` (this block's shared address) armed for the
// `bytes` the cluster's st.async pushes will bring, then the relaxed arrive that the senders' cl_wait() pairs
// with (the init's release fence orders it), so no block pushes into a barrier not yet initialised.
__device__ __forceinline__ void cl_push_arm(u32 bar, u32 bytes) {
    if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        mbar_arrive_expect_tx(bar, bytes);
    }
    cl_arrive_relaxed();
}

// One bulk async copy (sm_90) of `bytes` (a multiple of 16) from global memory into this block's
// shared memory, completing on mbarrier `bar` (expect_tx), with an L2 cache policy (the decode kernels
// stream weights evict-first): the persistent decode kernel and the fused attention half.
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar, unsigned long long pol) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol) : "memory");
}
// The same without a cache hint (the prefill GEMM: a column slice's weights are read again from L2 by its
// other token tiles, which run beside it).
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// A float as an unsigned int of the same order (negative values below positive ones): what redux.sync
// and atomicMax can take the maximum of, and what radix selection splits (the MoE top-k, the sampler,
// greedy decode's argmax in the lm_head).
__device__ __forceinline__ unsigned float_key(float v) {
    const unsigned u = __float_as_uint(v);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

// A drawn id to the decode step's device token and, if set, a mapped pinned host int: -1 (no finite
// logit) goes to the host, which raises, and 0 to the device, so a step queued behind it reads a real row.
__device__ __forceinline__ void publish_token(int tok, int* dev, int* host) {
    *dev = max(tok, 0);
    if (host) *(volatile int*)host = tok;
}

// Starts the 128-byte line holding p towards L2 without waiting or holding a register: flash
// decoding's first K/V rows and the one-launch FFN's next step, before their PDL waits.
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

// D += A(16x16 row) * B(16x8 col), fp16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 8x8 fp16 matrix whose fragment the warp holds (lane 4g + t: row g, columns 2t, 2t + 1), transposed
// in registers: an MMA's C layout becomes another's B operand without a trip through shared memory.
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

// ---------------------------------------------------------------------------------------------
// Fixed-point accumulators: decode GEMVs add their blocks' split-K sums into int64 words with 32
// fraction bits (red.global.add.u64) instead of a last-block reduction. Integer addition does not
// depend on the order the blocks arrive in, so the sums stay bitwise reproducible; |y| < 2^31.
// ---------------------------------------------------------------------------------------------
#define FIX_ONE 4294967296.f  // 2^32
__device__ __forceinline__ void fix_add(long long* a, float v) {
    atomicAdd(reinterpret_cast<unsigned long long*>(a), (unsigned long long)__float2ll_rn(v * FIX_ONE));
}
// The accumulated value rounded to fp16 and back: the rounding point of a projection's fp16 output.
// Through double, which holds |a| < 2^53 exactly: via float it would round twice (24, then 11 bits).
__device__ __forceinline__ float fix_h(long long a) {
    return __half2float(__double2half(__ll2double_rn(a) * (1.0 / 4294967296.0)));
}
__device__ __forceinline__ float fix_f(long long a) { return __ll2float_rn(a) * (1.f / FIX_ONE); }

// ---------------------------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over nthreads threads (tid 0.., whole warps, up to 1024) that share the barrier sync();
// every one gets the result. `red` needs 32 floats. Its first barrier also publishes the threads'
// earlier shared-memory writes.
template <class Sync>
__device__ __forceinline__ float group_sum(float v, float* red, int tid, int nthreads, Sync sync) {
    const int lane = tid & 31, wid = tid >> 5, nw = (nthreads + 31) >> 5;
    v = warp_sum(v);
    sync();
    if (lane == 0) red[wid] = v;
    sync();
    v = lane < nw ? red[lane] : 0.f;
    return warp_sum(v);
}

// Sum over the whole block; every thread gets the result. `red` needs 32 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
    return group_sum(v, red, threadIdx.x, blockDim.x, [] { __syncthreads(); });
}

// Keep (v, idx) or take (ov, oi): the larger value, the lower index among equals (NumPy's argmax; NaN never wins).
__device__ __forceinline__ bool better(float ov, int oi, float v, int idx) {
    return ov > v || (ov == v && oi < idx);
}

// (value, index) argmax over the block (whole warps), ties to the lower index; the result in every thread.
// sv and si need 32 entries each.
__device__ void block_argmax(float& v, int& idx, float* sv, int* si) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (better(ov, oi, v, idx)) { v = ov; idx = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[wid] = v; si[wid] = idx; }
    __syncthreads();
    v = lane < nw ? sv[lane] : -INFINITY;
    idx = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (better(ov, oi, v, idx)) { v = ov; idx = oi; }
    }
}

// True, in every thread, for the block that arrives last of `arrivals` blocks at *counter, which it
// resets to zero for the next launch: the fused reductions that need every block's global writes.
// Each block's writes are published (fence) before it counts; the last one fences again before
// reading the others'.
__device__ __forceinline__ bool block_arrives_last(int* counter, int arrivals) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1) == arrivals - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// 8 fp16 (one 16-byte load's worth) -> fp32
__device__ __forceinline__ void unpack8(const uint4& raw, float* f) {
    const half2* hp = reinterpret_cast<const half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 t = __half22float2(hp[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

// A MoE prefill token's routing-weighted expert rows (moe.cu moe_finalize, norm.cu add_rmsnorm): its k (<= 32,
// <= the block) permuted row indices and weights staged in shared memory by the block, then columns 8c..8c+7 of
// sum_j wt[j] * y[row[j]] summed in fp32 in j order, the k rows' 16-byte loads issued together (one column per
// thread by 2-byte loads ran at ~0.4 of the copy rate). The two kernels share this
// so their sums are the same bits.
__device__ __forceinline__ void expert_rows_stage(const int* __restrict__ u2p,    // [T*k]
                                                  const float* __restrict__ wts,  // [T, k]
                                                  int t, int k, int* row, float* wt) {
    if (threadIdx.x < k) {
        row[threadIdx.x] = u2p[(size_t)t * k + threadIdx.x];
        wt[threadIdx.x] = wts[(size_t)t * k + threadIdx.x];
    }
    __syncthreads();
}
__device__ __forceinline__ void expert_rows_sum8(const half* __restrict__ y,  // [T*k, D] permuted rows
                                                 const int* row, const float* wt, int k, int D, int c, float* s) {
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = 0.f;
#pragma unroll 8
    for (int j = 0; j < k; ++j) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(y + (size_t)row[j] * D) + c);
        const half* hv = reinterpret_cast<const half*>(&v);
        const float w = wt[j];
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] += w * __half2float(hv[i]);
    }
}

// Elements 4i..4i+3 of the row h + fp16(pend) (pend null: h), by 16-byte loads from L2.
__device__ __forceinline__ float4 resid_pending4(const float* __restrict__ h, const long long* pend, int i) {
    float4 v = __ldcg(reinterpret_cast<const float4*>(h) + i);
    if (pend) {
        const longlong2 a = __ldcg(reinterpret_cast<const longlong2*>(pend) + 2 * i);
        const longlong2 b = __ldcg(reinterpret_cast<const longlong2*>(pend) + 2 * i + 1);
        v = make_float4(v.x + fix_h(a.x), v.y + fix_h(a.y), v.z + fix_h(b.x), v.w + fix_h(b.y));
    }
    return v;
}
// Elements 2i, 2i+1 of the row h + fp16(pend) (pend null: h), by 8- and 16-byte loads from L2.
__device__ __forceinline__ float2 resid_pending2(const float* __restrict__ h, const long long* pend, int i) {
    float2 v = __ldcg(reinterpret_cast<const float2*>(h) + i);
    if (pend) {
        const longlong2 p = __ldcg(reinterpret_cast<const longlong2*>(pend) + i);
        v = make_float2(v.x + fix_h(p.x), v.y + fix_h(p.y));
    }
    return v;
}
// A float4's sum of squares, in the order every row norm here adds them.
__device__ __forceinline__ float sumsq4(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }

// 1 / rms(h) for one fp32 row of D (D % 4 == 0) by a group of threads (group_sum's arguments): the
// prologues that normalise a decode row in the kernel that consumes it (each block reads the row
// from L2 itself; .cg loads, since in the persistent decode kernel other blocks wrote it in the
// same launch). pend (or null): a projection's pending output y [D] in fixed point (gemv_w4a16's
// accumulating mode), so the row is h + fp16(y), the residual its add produces.
template <class Sync>
__device__ __forceinline__ float group_rms_inv(const float* __restrict__ h, int D, float eps, float* red, int tid,
                                               int nthreads, Sync sync, const long long* pend = nullptr) {
    float ss = 0.f;
    for (int i = tid; i < D / 4; i += nthreads) ss += sumsq4(resid_pending4(h, pend, i));
    return rsqrtf(group_sum(ss, red, tid, nthreads, sync) / D + eps);
}

// 1 / rms of a row whose sum of squares a scaled GEMV (gemv_w4a16.cu) left in n split partials,
// summed in a fixed order by every warp: no barrier, the same bits in every block.
__device__ __forceinline__ float deferred_rms_inv(const float* ss, int n, int D, float eps) {
    float t = 0.f;
    for (int i = threadIdx.x & 31; i < n; i += 32) t += __ldcg(ss + i);
    return rsqrtf(warp_sum(t) / D + eps);
}

// Element i of the residual row h + fp16(pend) that a projection's pending output makes (pend null:
// h itself): what a consumer of accumulating mode normalises, and stores as the new row.
__device__ __forceinline__ float resid_pending(const float* __restrict__ h, const long long* pend, int i) {
    return pend ? h[i] + fix_h(__ldcg(pend + i)) : h[i];
}

// group_rms_inv over the whole block (its barrier: __syncthreads).
__device__ __forceinline__ float row_rms_inv(const float* __restrict__ h, int D, float eps, float* red,
                                             const long long* pend = nullptr) {
    return group_rms_inv(h, D, eps, red, threadIdx.x, blockDim.x, [] { __syncthreads(); }, pend);
}

// ---------------------------------------------------------------------------------------------
// Flash-decoding's split rule and merge (attention.cu writes the partials; the merge runs in
// attn_decode_combine or in the o-projection GEMV's prologue).
// ---------------------------------------------------------------------------------------------
#define DECODE_MIN_CHUNK 32  // fewest keys per split where the host passes none (the persistent and fused kernels)

// Keys per split for n_keys keys over S splits, at least min_chunk (the split kernel and every merge
// agree on it; the host picks min_chunk per model and GPU, docs/PERFORMANCE.md: fewer splits at a
// short context mean fewer partials for the merge to read).
__device__ __forceinline__ int decode_chunk(int n_keys, int S, int min_chunk) {
    return max((n_keys + S - 1) / S, min_chunk);
}

// The splits that hold keys under decode_chunk's rule: the ones a merge reads.
__device__ __forceinline__ int decode_splits_used(int n_keys, int S, int min_chunk) {
    const int chunk = decode_chunk(n_keys, S, min_chunk);
    return min(S, (n_keys + chunk - 1) / chunk);
}

// Element d of head h of the attention output: the splits' partial softmaxes (part_o [H, S, HD]
// unnormalised, part_ml [H, S, 2] max in the log2 domain and sum) merged over the splits that held
// keys, rounded to fp16. One pass with a running max, so a split's three loads do not wait for a
// max over all splits, unrolled so the splits' loads are in flight together: a merge is L2-latency
// bound, not bandwidth bound.
__device__ __forceinline__ half decode_merge(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                             int h, int d, int S, int HD, int n_keys, int min_chunk) {
    const int used = decode_splits_used(n_keys, S, min_chunk);
    const float* ml = part_ml + (size_t)h * S * 2;
    const float* po = part_o + (size_t)h * S * HD + d;
    float M = -INFINITY, L = 0.f, od = 0.f;
#pragma unroll 8
    for (int s = 0; s < used; ++s) {
        const float ms = __ldcg(ml + 2 * s), ls = __ldcg(ml + 2 * s + 1), os = __ldcg(po + (size_t)s * HD);
        if (ls == 0.f) continue;  // an empty split contributes nothing
        const float mn = fmaxf(M, ms), a = exp2f(M - mn), b = exp2f(ms - mn);  // a = 0 while M is -inf
        L = L * a + ls * b;
        od = od * a + os * b;
        M = mn;
    }
    return __float2half(L > 0.f ? od / L : 0.f);
}

// ---------------------------------------------------------------------------------------------
// Qwen3-MoE top-k pieces shared by moe.cu's router kernels and ffn_decode.cu's one-launch MoE FFN.
// ---------------------------------------------------------------------------------------------
#define MOE_MAX_E 256  // experts held per warp lane: 8 per lane

// The better of two (probability, expert) candidates: higher probability, ties to the lower id
// (the reference's stable sort).
__device__ __forceinline__ bool moe_better(float pa, int ea, float pb, int eb) {
    return pa > pb || (pa == pb && ea < eb);
}

// The k largest of a warp's values (lane l holds entries l, l + 32, .. in p), ties to the lower index,
// in descending order: lane r < k gets pick r's index and value; picked = the sum of the picks' values.
// Picked entries are set to `gone`, which must not be above any candidate. A lane's best remaining entry
// comes from a tree of comparisons (3 deep, not a chain of 8): the 30B-A3B decode top-k took 1.41 µs on
// the MoE kernel's critical path with the chain, 1.09 with the tree. (Sorting each lane's 8 entries once
// and taking heads was faster still, but its 400 more instructions made the step 2% slower.)
__device__ __forceinline__ void moe_topk_pick(float (&p)[MOE_MAX_E / 32], int k, float gone, int& my_id, float& my_v,
                                              float& picked) {
    static_assert(MOE_MAX_E / 32 == 8, "the tree below holds a lane's 8 entries");
    const int lane = threadIdx.x & 31;
    for (int r = 0; r < k; ++r) {
        // this lane's best remaining expert: pairs, then quads, then the 8
        float tv[4];
        int te[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const bool s = moe_better(p[2 * j + 1], lane + 32 * (2 * j + 1), p[2 * j], lane + 64 * j);
            tv[j] = s ? p[2 * j + 1] : p[2 * j];
            te[j] = s ? lane + 32 * (2 * j + 1) : lane + 64 * j;
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const bool s = moe_better(tv[2 * j + 1], te[2 * j + 1], tv[2 * j], te[2 * j]);
            tv[j] = s ? tv[2 * j + 1] : tv[2 * j];
            te[j] = s ? te[2 * j + 1] : te[2 * j];
        }
        const bool s1 = moe_better(tv[1], te[1], tv[0], te[0]);
        float bp = s1 ? tv[1] : tv[0];
        int be = s1 ? te[1] : te[0];
        {  // the warp's best: the largest value (as an order-preserving key), then the lowest id holding it
            const unsigned key = float_key(bp), top = __reduce_max_sync(0xffffffffu, key);
            be = (int)__reduce_min_sync(0xffffffffu, key == top ? (unsigned)be : 0xffffffffu);
            bp = __uint_as_float(top & 0x80000000u ? top ^ 0x80000000u : ~top);
        }
        // the owner retires the winner; lane r keeps slot r
#pragma unroll
        for (int j = 0; j < MOE_MAX_E / 32; ++j)
            if (lane + 32 * j == be) p[j] = gone;
        picked += bp;
        if (lane == r) { my_v = bp; my_id = be; }
    }
}

// The same without the sum, for a caller that weighs the picks itself (moe_ffn_decode: raw logits)
__device__ __forceinline__ void moe_topk_pick(float (&p)[MOE_MAX_E / 32], int k, float gone, int& my_id, float& my_v) {
    float unused = 0.f;
    moe_topk_pick(p, k, gone, my_id, my_v, unused);
}

// Softmax over one token's E logits, top-k, optional renormalisation, by one warp: lane l holds the
// logits of experts l, l + 32, .. in p (-inf past E). Lane r < k writes slot r of ids and weights
// (global or shared memory). Deterministic: the same logits give the same bits in every warp.
__device__ __forceinline__ void moe_topk_regs(float (&p)[MOE_MAX_E / 32], int E, int k, int norm_topk,
                                              int* ids, float* weights) {
    const int lane = threadIdx.x & 31;
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < MOE_MAX_E / 32; ++j) mx = fmaxf(mx, p[j]);
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < MOE_MAX_E / 32; ++j) {
        p[j] = lane + 32 * j < E ? __expf(p[j] - mx) : 0.f;
        sum += p[j];
    }
    const float inv = 1.f / warp_sum(sum);
#pragma unroll
    for (int j = 0; j < MOE_MAX_E / 32; ++j) p[j] = lane + 32 * j < E ? p[j] * inv : -1.f;

    float picked = 0.f, my_w = 0.f;
    int my_id = 0;
    moe_topk_pick(p, k, -2.f, my_id, my_w, picked);  // (probabilities >= 0; -1 past E)
    if (lane < k) {
        ids[lane] = my_id;
        weights[lane] = norm_topk ? my_w / picked : my_w;
    }
}
