// W4A16 prefill GEMM on Hopper's warpgroup MMA (wgmma, sm_90a only; ops_cupy compiles this file
// with -arch=sm_90a and only on compute capability 9.0).
//
// C [T, N] = x [T, K] W [K, N], W the tiled AWQ matrix of common.cuh (the decode GEMV's layout,
// so the weights are not stored twice). Per K tile of 64, the packed words, scales and zeros come
// into shared memory by cp.async with the x tile; every thread dequantizes (LOP3) a piece of the
// packed tile *transposed* into an fp16 W^T tile, and two warpgroups issue wgmma on it
// asynchronously: while the tensor cores work on tile kt, the threads dequantize tile kt+1 into
// the other W^T buffer. Nothing but C is written to global memory; the dequant + cuBLAS path
// writes and rereads 2 bytes per weight.
//
// Status (H100, PERFORMANCE.md change 43): correct, 310-370 TFLOP/s at 128-row tiles, against
// cuBLAS fp16's 650-750; dequant + cuBLAS is faster at 2048 rows and at 512 for most shapes and
// runs, so this path is opt-in (KUIPER_GEMM_WGMMA=1). The loop is bound by the dequantization and
// its two barriers per K tile (without the dequantization it reached 403-418 TFLOP/s, without the
// wgmma 396-491; more stages changed nothing): the next step is a producer warpgroup that
// dequantizes ahead of two consumer warpgroups.
//
// Supported configurations (the host rejects anything else and takes the dequant + cuBLAS path):
//   BM x BN x BK = 128 x 256 x 64: warpgroup g takes rows 64g.. and all 256 columns (m64n256k16);
//   BM x BN x BK =  64 x 256 x 64: warpgroup g takes all 64 rows and columns 128g.. (m64n128k16),
//                  twice the blocks for short prompts, where 128-row tiles leave SMs idle;
//   STAGES = 4 (two K tiles of load look-ahead), 256 threads, 1 block per SM;
//   K % 64 == 0, N % 256 == 0 (a block's 32 words are one tile of the tiled layout),
//   group % 64 == 0 (a K tile lies in one quantization group); any T >= 1.
//   Up to 3 matrices with the same K (q, k, v) in one launch, side by side in C.
// BN = 256 halves the rereads of x (one per column tile) against 128, which measured as the limit:
// x [T, K] is read N / BN times from L2, the 4-bit weights only T / BM times.
// Both wgmma operands are K-major with the 128-byte swizzle: row r of a tile (64 halves = 128 bytes)
// keeps its 16-byte chunk c at chunk c ^ (r & 7), and tiles start on 1024-byte boundaries.
#include "common.cuh"

#define WG_BN 256
#define WG_BK 64
#define WG_STAGES 4  // 6 measured the same (the loop is not load-latency bound)
#define WG_W_BYTES (WG_BK * WG_BN / 2)  // packed words of a K tile: [32 words][16 quads] x 16 bytes

// Byte offset of 16-byte chunk c (0..7) of row r in a 128B-swizzled K-major tile.
__device__ __forceinline__ u32 swz(int r, int c) { return (u32)(r * 128 + ((c ^ (r & 7)) << 4)); }

// Shared-memory matrix descriptor (PTX ISA "matrix descriptor"): start address >> 4, leading byte
// offset unused for swizzled K-major (1), stride byte offset 1024 (8 rows of 128 bytes) >> 4, and
// the 128-byte swizzle mode (1 << 62).
__device__ __forceinline__ unsigned long long wg_desc(u32 saddr) {
    return (unsigned long long)((saddr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// Generic-proxy shared-memory writes (cp.async, st.shared) made visible to wgmma's async proxy.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

#define WG_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_D16(i) WG_D4(i), WG_D4(i + 4), WG_D4(i + 8), WG_D4(i + 12)

// d [64 rows x N cols of the warpgroup] += A (64 x 16, descriptor da) * B (16 x N, W^T descriptor
// db), or d = A B when acc is 0 (scale-d: the first K step overwrites, so no instruction outside
// wgmma defines d, which would serialize the wgmma pipeline); A and B scaled by 1, both K-major.
template <int N>
__device__ __forceinline__ void wgmma_f16(float (&d)[N / 2], unsigned long long da, unsigned long long db, int acc);
template <>
__device__ __forceinline__ void wgmma_f16<128>(float (&d)[64], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_D16(0), WG_D16(16), WG_D16(32), WG_D16(48)
        : "l"(da), "l"(db), "r"(acc));
}
template <>
__device__ __forceinline__ void wgmma_f16<256>(float (&d)[128], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : WG_D16(0), WG_D16(16), WG_D16(32), WG_D16(48), WG_D16(64), WG_D16(80), WG_D16(96), WG_D16(112)
        : "l"(da), "l"(db), "r"(acc));
}

template <int BM>
struct WgSmem {  // byte offsets from the 1024-aligned base of dynamic shared memory
    static constexpr int x_tile = BM * 128;                       // [BM rows][64 halves]
    static constexpr int b_tile = WG_BN * 128;                    // W^T [256 n][64 k]
    static constexpr int x = 0;                                   // [STAGES] x tiles
    static constexpr int b = WG_STAGES * x_tile;                  // [2] W^T tiles
    static constexpr int w = b + 2 * b_tile;                      // [STAGES] packed tiles
    static constexpr int s = w + WG_STAGES * WG_W_BYTES;          // [STAGES][256] scales
    static constexpr int z = s + WG_STAGES * WG_BN * 2;           // [STAGES][32] zero words
    static constexpr int bytes = z + WG_STAGES * 128 + 1024;      // + the alignment slack
};

template <int BM>
__global__ void __launch_bounds__(256, 1)
gemm_w4a16_wgmma(const half* __restrict__ x,  // [T, ldx]
                 // up to 3 matrices i (q, k, v): qweight [K, N_i/8] tiled, qzeros [K/g, N_i/8], scales
                 // [K/g, N_i]; N_i = 0 for an absent one
                 const u32* qw0, const u32* qz0, const half* sc0, int n_0,
                 const u32* qw1, const u32* qz1, const half* sc1, int n_1,
                 const u32* qw2, const u32* qz2, const half* sc2, int n_2,
                 half* __restrict__ out,      // [T, ldo]: matrix i from column N_0 + .. + N_{i-1}
                 int T, int K, int group, int ldx, int ldo) {
    typedef WgSmem<BM> L;
    constexpr int PREF = WG_STAGES - 2;       // K tiles loaded ahead: the slot of tile kt-2 is free at kt
    constexpr int WN = BM == 128 ? 256 : 128;  // columns per warpgroup
    extern __shared__ unsigned char smem_raw[];
    unsigned char* sm = (unsigned char*)(((size_t)smem_raw + 1023) & ~(size_t)1023);
    const u32 sbase = smem_u32(sm);
    const int tid = threadIdx.x, wg = tid >> 7;
    // column tile blockIdx.x belongs to the first matrix whose columns reach past it
    const int c_out = blockIdx.x * WG_BN;
    const int mi = c_out < n_0 ? 0 : c_out < n_0 + n_1 ? 1 : 2;
    const int n0 = c_out - (mi > 0 ? n_0 : 0) - (mi > 1 ? n_1 : 0);
    const u32* __restrict__ qw = mi == 0 ? qw0 : mi == 1 ? qw1 : qw2;
    const u32* __restrict__ qz = mi == 0 ? qz0 : mi == 1 ? qz1 : qz2;
    const half* __restrict__ sc = mi == 0 ? sc0 : mi == 1 ? sc1 : sc2;
    const int N = mi == 0 ? n_0 : mi == 1 ? n_1 : n_2, Wd = N / 8, wb = n0 >> 3;  // wb: a multiple of 32 (one tile)
    const int m0 = blockIdx.y * BM, nk = K / WG_BK;

    auto load = [&](int kt, int slot) {
        const int k0 = kt * WG_BK;
#pragma unroll
        for (int i = 0; i < BM / 32; ++i) {  // x: BM rows x 8 chunks
            const int c = tid + 256 * i, r = c >> 3, cc = c & 7;
            const bool ok = m0 + r < T;
            cp_async16(sm + L::x + slot * L::x_tile + swz(r, cc), x + (size_t)(ok ? m0 + r : 0) * ldx + k0 + cc * 8,
                       ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {  // packed words: (quad q, word wd) -> smem [wd][q], contiguous dequant reads
            const int c = tid + 256 * i, q = c >> 5, wd = c & 31;
            cp_async16(sm + L::w + slot * WG_W_BYTES + (wd * 16 + q) * 16,
                       qw + (size_t)wb * K + ((size_t)(k0 / 4 + q) * 32 + wd) * 4, 16);
        }
        const int gi = k0 / group;
        if (tid < 32)
            cp_async16(sm + L::s + slot * WG_BN * 2 + tid * 16, sc + (size_t)gi * N + n0 + tid * 8, 16);
        else if (tid < 40)
            cp_async16(sm + L::z + slot * 128 + (tid - 32) * 16, qz + (size_t)gi * Wd + wb + (tid - 32) * 4, 16);
    };

    float d[WN / 2];  // written first by the acc = 0 wgmma of K tile 0 (K >= 64)

#pragma unroll
    for (int s = 0; s < PREF; ++s) {
        if (s < nk) load(s, s);
        cp_async_commit();
    }
    const int q = tid & 15;  // this thread's dequant pieces: row quad q of words tid/16 and tid/16 + 16
    for (int kt = 0; kt < nk; ++kt) {
        const int slot = kt % WG_STAGES;
        cp_async_wait<PREF - 1>();
        __syncthreads();  // tile kt is in for every thread; wgmma(kt-2) is done in both warpgroups
        if (kt + PREF < nk) load(kt + PREF, (kt + PREF) % WG_STAGES);
        cp_async_commit();

        unsigned char* bt = sm + L::b + (kt & 1) * L::b_tile;
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // dequantize 4 k x 8 n, transposed into W^T rows n = 8 wd + i, k = 4q..
            const int wd = (tid >> 4) + 16 * j;
            const uint4 pw = *reinterpret_cast<const uint4*>(sm + L::w + slot * WG_W_BYTES + (wd * 16 + q) * 16);
            half2 zb[4], s2[4], o[4][4];
            awq_zero_bias(*reinterpret_cast<const u32*>(sm + L::z + slot * 128 + wd * 4), zb);
            awq_scales8(*reinterpret_cast<const uint4*>(sm + L::s + slot * WG_BN * 2 + wd * 16), s2);
            awq_dequant8(pw.x, zb, s2, o[0]);
            awq_dequant8(pw.y, zb, s2, o[1]);
            awq_dequant8(pw.z, zb, s2, o[2]);
            awq_dequant8(pw.w, zb, s2, o[3]);
            const u32 off = (q & 1) << 3;  // the quad's 8 bytes in its 16-byte chunk q / 2
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const u32 r0 = *reinterpret_cast<u32*>(&o[0][p]), r1 = *reinterpret_cast<u32*>(&o[1][p]);
                const u32 r2 = *reinterpret_cast<u32*>(&o[2][p]), r3 = *reinterpret_cast<u32*>(&o[3][p]);
                const int n = wd * 8 + 2 * p;
                // column n takes the low halves of rows k..k+3, column n + 1 the high halves
                *reinterpret_cast<uint2*>(bt + swz(n, q >> 1) + off) =
                    make_uint2(__byte_perm(r0, r1, 0x5410), __byte_perm(r2, r3, 0x5410));
                *reinterpret_cast<uint2*>(bt + swz(n + 1, q >> 1) + off) =
                    make_uint2(__byte_perm(r0, r1, 0x7632), __byte_perm(r2, r3, 0x7632));
            }
        }
        fence_proxy_async();
        __syncthreads();  // W^T tile kt complete and visible to the async proxy

        wg_fence();
        const u32 xa = sbase + L::x + slot * L::x_tile + (BM == 128 ? wg * 64 * 128 : 0);
        const u32 ba = sbase + L::b + (kt & 1) * L::b_tile + (BM == 128 ? 0 : wg * 128 * 128);
#pragma unroll
        for (int kk = 0; kk < WG_BK / 16; ++kk)  // 16 k = 32 bytes further along the swizzled rows
            wgmma_f16<WN>(d, wg_desc(xa + kk * 32), wg_desc(ba + kk * 32), kt > 0 || kk > 0);
        wg_commit();
        wg_wait<1>();  // wgmma(kt-1) done: its x slot and W^T buffer may be refilled
    }
    wg_wait<0>();

    // D fragment: warp w of the warpgroup holds rows 16w + lane/4 (+8); pair i covers columns
    // 8i + 2 (lane % 4) + {0, 1} of the warpgroup's WN
    const int lane = tid & 31, w = (tid >> 5) & 3;
    const int r0 = m0 + (BM == 128 ? wg * 64 : 0) + w * 16 + (lane >> 2);
    const int c0 = c_out + (BM == 128 ? 0 : wg * 128) + 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < WN / 8; ++i) {
        if (r0 < T)
            *reinterpret_cast<half2*>(out + (size_t)r0 * ldo + c0 + 8 * i) = __floats2half2_rn(d[4 * i], d[4 * i + 1]);
        if (r0 + 8 < T)
            *reinterpret_cast<half2*>(out + (size_t)(r0 + 8) * ldo + c0 + 8 * i) =
                __floats2half2_rn(d[4 * i + 2], d[4 * i + 3]);
    }
}
