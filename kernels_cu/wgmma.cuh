// Hopper (sm_90a) helpers shared by the wgmma kernels: gemm_wgmma.cu's prefill GEMMs and attn_wgmma.cu's
// prefill flash attention. Shared-memory matrix descriptors, the wgmma fence / commit / wait, wgmma with both
// operands in shared memory, TMA tensor loads, and the register-A forms (A in registers, 4 k16 steps a statement).
#pragma once
#include "common.cuh"

// Shared-memory matrix descriptor (PTX ISA "matrix descriptor") of a K-major tile: start address
// >> 4, leading byte offset unused for swizzled K-major (1), stride byte offset 1024 (8 rows of 128
// bytes) >> 4, and the 128-byte swizzle mode (1 << 62).
__device__ __forceinline__ unsigned long long wg_desc(u32 saddr) {
    return (unsigned long long)((saddr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// The same for an MN-major (N-contiguous) 128B-swizzled tile: atoms of 64 n x 8 k (1024 bytes),
// leading byte offset = the next 64 n, stride byte offset = the next 8 k.
__device__ __forceinline__ unsigned long long wg_desc_mn(u32 saddr, u32 lbo, u32 sbo) {
    return (unsigned long long)((saddr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}

// Generic-proxy shared-memory writes (the W tile's st.shared) made visible to wgmma's async proxy.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

#define WG_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_D16(i) WG_D4(i), WG_D4(i + 4), WG_D4(i + 8), WG_D4(i + 12)

// d [64 rows x N cols of the warpgroup] += A (64 x 16, descriptor da) * B (16 x N, descriptor db),
// or d = A B when acc is 0 (scale-d: the first K step overwrites, so no instruction outside wgmma
// defines d, which would serialize the wgmma pipeline); A and B scaled by 1, A K-major, B K-major
// (TB 0) or N-major (TB 1).
template <int N, int TB>
__device__ __forceinline__ void wgmma_f16(float (&d)[N / 2], unsigned long long da, unsigned long long db, int acc) {
    static_assert(N == 64 || N == 128, "m64n64k16 and m64n128k16 only");
    if constexpr (N == 128) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, %67;\n}\n"
        : WG_D16(0), WG_D16(16), WG_D16(32), WG_D16(48)
        : "l"(da), "l"(db), "r"(acc), "n"(TB));
    } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, %35;\n}\n"
        : WG_D16(0), WG_D16(16)
        : "l"(da), "l"(db), "r"(acc), "n"(TB));
    }
}

// A CUtensorMap (the driver's opaque 128-byte TMA descriptor), passed by value as a __grid_constant__.
struct alignas(64) TmaDesc {
    unsigned long long v[16];
};
// TMA: the 2D box at (c0 inner, c1 outer) of the described tensor into shared memory at dst, laid
// out as the map's swizzle says; rows past the tensor are zero-filled; completes on bar's tx count.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaDesc* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// The same for a 3D box at (c0, c1, c2) (gemm_moe_rs's swizzled packed-word stages; flash_attn_wgmma's K/V tiles
// of one layer of the whole cache).
__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaDesc* map, int c0, int c1, int c2, u32 bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

// wgmma's accumulator operands %0 .. %(n - 1) for n = 16, 32, 64, 128 (m64n32, m64n64, m64n128, m64n256 with
// f32 C): each list extends the one before
#define RS_D16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define RS_D32 RS_D16 ", " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define RS_D64 RS_D32 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define RS_D128 RS_D64 ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// Pins the accumulators at this point (an empty asm that reads and writes them), so no other
// instruction touches them between a K tile's wgmma.fence and its commit (ptxas would serialize, C7515).
template <int ND>
__device__ __forceinline__ void wg_pin(float (&d)[ND]) {
#pragma unroll
    for (int i = 0; i < ND; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The 4 k16 steps of a K tile in one asm statement: A registers a[4 kk ..], B at db0 + 2 kk (descriptor units
// of 16 bytes: 32 bytes of k per step); scale-d off for the very first (acc 0). 32 columns (tokens): the MoE
// GEMM's tiles whose expert has at most half a tile of rows left.
__device__ __forceinline__ void wgmma_rs32x4(float (&d)[16], const u32 (&a)[16], unsigned long long db0, int acc) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 b1, b2, b3;\nsetp.ne.b32 p, %33, 0;\n"
        "add.s64 b1, %32, 2;\nadd.s64 b2, %32, 4;\nadd.s64 b3, %32, 6;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {" RS_D16 "}, {%16, %17, %18, %19}, %32, p, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {" RS_D16 "}, {%20, %21, %22, %23}, b1, 1, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {" RS_D16 "}, {%24, %25, %26, %27}, b2, 1, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {" RS_D16 "}, {%28, %29, %30, %31}, b3, 1, 1, 1, 0;\n}\n"
        : WG_D16(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(a[4]), "r"(a[5]), "r"(a[6]), "r"(a[7]),
          "r"(a[8]), "r"(a[9]), "r"(a[10]), "r"(a[11]), "r"(a[12]), "r"(a[13]), "r"(a[14]), "r"(a[15]),
          "l"(db0), "r"(acc));
}

__device__ __forceinline__ void wgmma_rs64x4(float (&d)[32], const u32 (&a)[16], unsigned long long db0, int acc) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 b1, b2, b3;\nsetp.ne.b32 p, %49, 0;\n"
        "add.s64 b1, %48, 2;\nadd.s64 b2, %48, 4;\nadd.s64 b3, %48, 6;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" RS_D32 "}, {%32, %33, %34, %35}, %48, p, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" RS_D32 "}, {%36, %37, %38, %39}, b1, 1, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" RS_D32 "}, {%40, %41, %42, %43}, b2, 1, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" RS_D32 "}, {%44, %45, %46, %47}, b3, 1, 1, 1, 0;\n}\n"
        : WG_D16(0), WG_D16(16)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(a[4]), "r"(a[5]), "r"(a[6]), "r"(a[7]),
          "r"(a[8]), "r"(a[9]), "r"(a[10]), "r"(a[11]), "r"(a[12]), "r"(a[13]), "r"(a[14]), "r"(a[15]),
          "l"(db0), "r"(acc));
}

// As wgmma_rs64x4 with 128 columns per instruction. DSTEP: the B descriptor's advance per k16 step (16-byte
// units: 2 for a K-major 128B-swizzled tile, the GEMM's x; 128 for attn_wgmma.cu's MN-major V, 8-key groups 1 KB
// apart), TB: B transposed (MN-major).
template <int DSTEP = 2, int TB = 0>
__device__ __forceinline__ void wgmma_rs128x4(float (&d)[64], const u32 (&a)[16], unsigned long long db0, int acc) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 b1, b2, b3;\nsetp.ne.b32 p, %81, 0;\n"
        "add.s64 b1, %80, %82;\nadd.s64 b2, %80, %83;\nadd.s64 b3, %80, %84;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" RS_D64 "}, {%64, %65, %66, %67}, %80, p, 1, 1, %85;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" RS_D64 "}, {%68, %69, %70, %71}, b1, 1, 1, 1, %85;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" RS_D64 "}, {%72, %73, %74, %75}, b2, 1, 1, 1, %85;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" RS_D64 "}, {%76, %77, %78, %79}, b3, 1, 1, 1, %85;\n"
        "}\n"
        : WG_D16(0), WG_D16(16), WG_D16(32), WG_D16(48)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(a[4]), "r"(a[5]), "r"(a[6]), "r"(a[7]),
          "r"(a[8]), "r"(a[9]), "r"(a[10]), "r"(a[11]), "r"(a[12]), "r"(a[13]), "r"(a[14]), "r"(a[15]),
          "l"(db0), "r"(acc), "n"(DSTEP), "n"(2 * DSTEP), "n"(3 * DSTEP), "n"(TB));
}

// As wgmma_rs64x4 with 256 columns (tokens) per instruction (128 accumulators per thread).
__device__ __forceinline__ void wgmma_rs256x4(float (&d)[128], const u32 (&a)[16], unsigned long long db0, int acc) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 b1, b2, b3;\nsetp.ne.b32 p, %145, 0;\n"
        "add.s64 b1, %144, 2;\nadd.s64 b2, %144, 4;\nadd.s64 b3, %144, 6;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" RS_D128 "}, {%128, %129, %130, %131}, %144, p, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" RS_D128 "}, {%132, %133, %134, %135}, b1, 1, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" RS_D128 "}, {%136, %137, %138, %139}, b2, 1, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" RS_D128 "}, {%140, %141, %142, %143}, b3, 1, 1, 1, 0;\n"
        "}\n"
        : WG_D16(0), WG_D16(16), WG_D16(32), WG_D16(48), WG_D16(64), WG_D16(80), WG_D16(96), WG_D16(112)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(a[4]), "r"(a[5]), "r"(a[6]), "r"(a[7]),
          "r"(a[8]), "r"(a[9]), "r"(a[10]), "r"(a[11]), "r"(a[12]), "r"(a[13]), "r"(a[14]), "r"(a[15]),
          "l"(db0), "r"(acc));
}

// A real use of wgmma A registers (their XOR into keep, stored only where a size is negative, i.e. never):
// ptxas ends a register's life at its last use, which for wgmma's A is the instruction's issue, so it
// would build the next tile's A in the same registers while the wgmmas still read them, and serialize
// every wgmma to make that safe (C7513). Used once the wgmma group that read them is known done, it keeps
// them apart at one LOP3 per register (gemm_wgmma.cu's K tiles, attn_wgmma.cu's P).
template <int N>
__device__ __forceinline__ void wg_keep(const u32 (&a)[N], u32& keep) {
#pragma unroll
    for (int i = 0; i < N; ++i) keep ^= a[i];
}
