// W4A16 prefill GEMM on Hopper's warpgroup MMA (wgmma, sm_90a only; ops_cupy compiles this file
// with -arch=sm_90a and only on compute capability 9.0).
//
// C [T, N] = x [T, K] W [K, N], W the tiled AWQ matrix of common.cuh (the decode GEMV's layout,
// so the weights are not stored twice). Warp-specialized, 4 NP + 9 warps:
//   - the loader warp brings x tiles in by TMA (zero-filled past T, 128B-swizzled by the tensor
//     map) into their own ring of SX slots, as far ahead as the consumers free them;
//   - NP producer warpgroups, warpgroup p taking K tiles p, p + NP, ..., bring the packed words,
//     scales and zeros in by cp.async (each its own PS / NP slots of a ring, PS / NP - 2 of its
//     tiles ahead: DRAM latency), dequantize them (LOP3) into an N-major fp16 W tile of a
//     ring of SB slots and arrive on that slot's "full" mbarrier (two warpgroups: the
//     dequantization alone bounded one);
//   - two consumer warpgroups wait for both tiles, run wgmma on them straight from shared memory,
//     and arrive on the slots' "empty" mbarriers once their wgmma has read them.
// Split-K on the wave tail: the host (ops_cupy.wgmma_plan) runs the tiles of a partial last wave
// as `split` blocks each over a share of K; each writes fp32 partial sums and the last of a tile to
// finish (an atomic ticket) adds the parts in part order, so repeats are bitwise equal.
// Nothing but C is written to global memory; the dequant + cuBLAS path writes and rereads 2 bytes
// per weight, which dominates at short prompts.
//
// Status (H100): 335-400 TFLOP/s at 512-2048 rows with 128 x
// 128 tiles, 215-330 at 128 rows (split tails); cuBLAS fp16 reaches 600-760. Diagnosis runs: with
// one producer wgmma alone 766 TFLOP/s, the loads and handshakes alone 630, the
// dequantization alone 420, adding up rather than overlapping; with two leaving out
// the dequantization still took q|k|v at 512 rows from 0.48 to 0.72 of cuBLAS.
//
// Supported configurations (the host's WGMMA_TILES; the host rejects other shapes and takes the
// dequant + cuBLAS path):
//   BM x BN x BK = 128 x 128 x 64: consumer g takes rows 64g.. and all 128 columns (m64n128k16);
//   BM x BN x BK =  64 x 128 x 64: consumer g takes all 64 rows and columns 64g.. (m64n64k16),
//                  twice the blocks for short prompts, where 128-row tiles leave SMs idle;
//   ring slots as many as fit in 227 KB; NP = 1 (416 threads, at most 128 registers) or 2 (544
//   threads, at most 96: a fifth warp on one SM sub-partition), 1 block per SM;
//   K % 64 == 0, N % 256 == 0 (a block's columns lie in one 32-word tile of the tiled layout),
//   group % 64 == 0 (a K tile lies in one quantization group); any T >= 1; x's row stride a
//   multiple of 16 bytes (TMA).
//   Up to 3 matrices with the same K (q, k, v) in one launch, side by side in C.
// Both wgmma operands use the 128-byte swizzle (16-byte chunk c of a 128-byte row r at chunk
// c ^ (r & 7), tiles on 1024-byte boundaries): x K-major (a row: 64 k of one token), W N-major (a
// row: 64 columns of one k), so a dequantized word (8 columns of one k) is one 16-byte store.
#include "common.cuh"
#include "wgmma.cuh"

#define WG_BK 64
// NP producer warpgroups, 2 consumer warpgroups, the x loader warp
#define WG_THREADS(NP) (128 * (NP) + 288)

// Byte offset of the 8 columns 8 wd.. of row k in a 128B-swizzled N-major tile of bn columns: 8-k
// groups of bn / 64 atoms (64 n x 8 k, 1024 bytes), row k % 8 of an atom 128 bytes, its 16-byte
// chunks XOR-swizzled by the row.
__device__ __forceinline__ u32 bmn_off(int k, int wd, int bn) {
    return (u32)((k >> 3) * (bn / 64) * 1024 + (wd >> 3) * 1024 + (k & 7) * 128 + (((wd & 7) ^ (k & 7)) << 4));
}

// The producer warpgroup's own barrier (id 1; __syncthreads is 0): the slot's scales and zeros were
// brought in by a few of its threads and are read by all of them.
__device__ __forceinline__ void producer_sync(int pg) { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + pg) : "memory"); }
// The consumers' own barrier (after the producers' ids): a split tile's partials are all stored
// before one thread takes the tile's ticket, and the ticket is read by all of them.
template <int NP>
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync %0, 256;\n" ::"n"(1 + NP) : "memory"); }

template <int BM, int BN, int SX, int SB, int PS>
struct WsSmem {  // byte offsets from the 1024-aligned base of dynamic shared memory
    static constexpr int x_tile = BM * 128;                    // [BM rows][64 halves], swizzled
    static constexpr int b_tile = BN * 128;                    // W [64 k][BN n], N-major, swizzled
    static constexpr int w_tile = BN * 32;                     // packed [BN/64][128 producers] x 16 bytes
    static constexpr int x = 0;                                // [SX] x tiles (TMA)
    static constexpr int b = x + SX * x_tile;                  // [SB] W tiles (producer stores)
    static constexpr int w = b + SB * b_tile;                  // [PS] packed tiles } the producer's
    static constexpr int s = w + PS * w_tile;                  // [PS][BN] scales   } own cp.async
    static constexpr int z = s + PS * BN * 2;                  // [PS][BN / 8] zeros} ring
    static constexpr int bar = z + PS * BN / 2;                // mbarriers: full_x, empty_x [SX], full_b, empty_b [SB]
    static constexpr int flag = bar + 16 * (SX + SB);          // a split tile's ticket, for every consumer
    static constexpr int bytes = flag + 16 + 1024;             // + the alignment slack
};

template <int BM, int BN, int SX, int SB, int PS, int NP>
__global__ void __launch_bounds__(WG_THREADS(NP), 1)
gemm_w4a16_ws(const __grid_constant__ TmaDesc xmap,  // x [T, K] fp16, box 64 k x BM rows, 128B swizzle
              // up to 3 matrices i (q, k, v): qweight [K, N_i/8] tiled, qzeros [K/g, N_i/8], scales
              // [K/g, N_i]; N_i = 0 for an absent one
              const u32* qw0, const u32* qz0, const half* sc0, int n_0,
              const u32* qw1, const u32* qz1, const half* sc1, int n_1,
              const u32* qw2, const u32* qz2, const half* sc2, int n_2,
              half* __restrict__ out,      // [T, ldo]: matrix i from column N_0 + .. + N_{i-1}
              int T, int K, int group, int ldo,
              // blocks [0, n_full) take whole tiles (tile = block, column tile fastest); the rest
              // take 1/split of a tile's K tiles each, split consecutive blocks per tile (the last,
              // partial wave made shorter: split-K on the wave tail)
              int n_full, int split,
              float* __restrict__ part,    // [split tiles][split][WN / 2][256] fp32 partial sums
              int* __restrict__ ticket) {  // [split tiles], zero between launches (the last block re-zeroes)
    static_assert((BM == 64 || BM == 128) && BN == 128 && 128 % (BN / 8) == 0 && SX >= 2 && SB >= 2 && PS >= 3, "unsupported tile");
    static_assert((NP == 1 || NP == 2) && PS % NP == 0 && SB % NP == 0, "producers share the rings evenly");
    typedef WsSmem<BM, BN, SX, SB, PS> L;
    constexpr int PR = PS / NP;                  // packed-weight slots of one producer warpgroup
    constexpr int PL = PR - 2;                   // its K tiles loaded ahead of the one it dequantizes
    constexpr int WN = BM == 128 ? BN : BN / 2;  // columns per consumer warpgroup
    constexpr int CT0 = 128 * NP, LT0 = CT0 + 256;  // first consumer thread, the loader warp
    extern __shared__ unsigned char smem_raw[];
    unsigned char* sm = (unsigned char*)(((size_t)smem_raw + 1023) & ~(size_t)1023);
    const u32 sbase = smem_u32(sm), full_x = sbase + L::bar, empty_x = full_x + 8 * SX;
    const u32 full_b = empty_x + 8 * SX, empty_b = full_b + 8 * SB;
    const int tid = threadIdx.x;
    // this block's tile and K range
    const int b = blockIdx.x, sb_idx = b - n_full;
    const int tile = b < n_full ? b : n_full + sb_idx / split, sp = b < n_full ? 0 : sb_idx % split;
    const int ncol = (n_0 + n_1 + n_2) / BN, nkt = K / WG_BK;
    const int kt0 = b < n_full ? 0 : nkt * sp / split, nk = (b < n_full ? nkt : nkt * (sp + 1) / split) - kt0;
    // column tile tile % ncol belongs to the first matrix whose columns reach past it
    const int c_out = (tile % ncol) * BN;
    const int mi = c_out < n_0 ? 0 : c_out < n_0 + n_1 ? 1 : 2;
    const int n0 = c_out - (mi > 0 ? n_0 : 0) - (mi > 1 ? n_1 : 0);
    const int m0 = (tile / ncol) * BM;
    if (tid == 0) {
        // the host computes L::bytes on its own: a short allocation must not corrupt memory
        if (dynamic_smem_bytes() < (u32)L::bytes) __trap();
        for (int s = 0; s < SX; ++s) {
            mbar_init(full_x + 8 * s, 1);     // the loader's expect_tx (then the bytes)
            mbar_init(empty_x + 8 * s, 8);    // every consumer warp, after its wgmma read the slot
        }
        for (int s = 0; s < SB; ++s) {
            mbar_init(full_b + 8 * s, 4);     // every warp of the slot's producer warpgroup, after its W stores
            mbar_init(empty_b + 8 * s, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
    }
    __syncthreads();

    if (tid >= LT0) {  // ---- x loader warp: TMA of x tiles into their ring, as far ahead as slots free up
        if (tid == LT0) {
            for (int kt = 0; kt < nk; ++kt) {
                const int slot = kt % SX;
                // the slot last held tile kt - SX: both consumers' wgmma must have read it
                if (kt >= SX) mbar_wait(empty_x + 8 * slot, (kt / SX - 1) & 1);
                mbar_arrive_expect_tx(full_x + 8 * slot, BM * 128);
                tma_load_2d(sbase + L::x + slot * L::x_tile, &xmap, (kt0 + kt) * WG_BK, m0, full_x + 8 * slot);
            }
        }
        return;
    }
    if (tid < CT0) {  // ---- producer warpgroup pg: loads and dequantization of K tiles kt = pg (mod NP)
        const u32* __restrict__ qw = mi == 0 ? qw0 : mi == 1 ? qw1 : qw2;
        const u32* __restrict__ qz = mi == 0 ? qz0 : mi == 1 ? qz1 : qz2;
        const half* __restrict__ sc = mi == 0 ? sc0 : mi == 1 ? sc1 : sc2;
        const int N = mi == 0 ? n_0 : mi == 1 ? n_1 : n_2, Wd = N / 8, wb = n0 >> 3;
        const u32* __restrict__ tile_w = qw + (size_t)(wb & ~31) * K;  // the 32-word tile holding our columns
        const int pg = tid >> 7, pt = tid & 127, lane = tid & 31, wo = wb & 31;
        const int mine = (nk - pg + NP - 1) / NP;  // K tiles kt = pg + NP j, j < mine
        // Packed weights, scales and zeros through this warpgroup's own cp.async ring slots (PR of
        // them), PL of its tiles ahead (DRAM latency). This thread's pieces: u = 128 j + pt (j <
        // BN / 64) is word wd = u % (BN / 8) of row quad u / (BN / 8), so 8 lanes read 128
        // contiguous bytes and store 8 chunks of one swizzled W row (no bank conflict).
        auto issue_w = [&](int jt) {
            const int slot = pg * PR + jt % PR, k0 = (kt0 + pg + NP * jt) * WG_BK;
#pragma unroll
            for (int j = 0; j < BN / 64; ++j) {
                const int u = j * 128 + pt, wd = u % (BN / 8), qq = u / (BN / 8);
                cp_async16(sm + L::w + slot * L::w_tile + (j * 128 + pt) * 16,
                           tile_w + ((size_t)(k0 / 4 + qq) * 32 + wo + wd) * 4, 16);
            }
            const int gi = k0 / group;
            if (pt < BN / 8)
                cp_async16(sm + L::s + slot * BN * 2 + pt * 16, sc + (size_t)gi * N + n0 + pt * 8, 16);
            else if (pt >= 32 && pt < 32 + BN / 32)
                cp_async16(sm + L::z + slot * BN / 2 + (pt - 32) * 16, qz + (size_t)gi * Wd + wb + (pt - 32) * 4, 16);
        };
#pragma unroll
        for (int t = 0; t < PL; ++t) {
            if (t < mine) issue_w(t);
            cp_async_commit();
        }
        for (int jt = 0; jt < mine; ++jt) {
            const int kt = pg + NP * jt, slot = kt % SB;
            if (jt + PL < mine) issue_w(jt + PL);  // its ring slot held tile jt - 2, dequantized before the last sync
            cp_async_commit();
            cp_async_wait<PL>();  // tile jt's weights are in (for this thread's copies)
            producer_sync(pg);    // ... and for every thread of the warpgroup: scales and zeros are shared
            if (kt >= SB) mbar_wait(empty_b + 8 * slot, (kt / SB - 1) & 1);  // W slot read by both consumers
            const int ws = pg * PR + jt % PR;
            unsigned char* bt = sm + L::b + slot * L::b_tile;
            const int wd = pt % (BN / 8);  // the same word column for every j (128 % (BN / 8) == 0)
            half2 zb[4], s2[4];
            awq_zero_bias(*reinterpret_cast<const u32*>(sm + L::z + ws * BN / 2 + wd * 4), zb);
            awq_scales8(*reinterpret_cast<const uint4*>(sm + L::s + ws * BN * 2 + wd * 16), s2);
#pragma unroll
            for (int j = 0; j < BN / 64; ++j) {  // 4 k x 8 n: each word's 8 columns one 16-byte store
                const int u = j * 128 + pt, qq = u / (BN / 8);
                const uint4 pk = *reinterpret_cast<const uint4*>(sm + L::w + ws * L::w_tile + u * 16);
                const u32 pw4[4] = {pk.x, pk.y, pk.z, pk.w};
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    half2 o[4];
                    awq_dequant8(pw4[r], zb, s2, o);
                    const int k = 4 * qq + r;
                    *reinterpret_cast<uint4*>(bt + bmn_off(k, wd, BN)) =
                        make_uint4(*reinterpret_cast<u32*>(&o[0]), *reinterpret_cast<u32*>(&o[1]),
                                   *reinterpret_cast<u32*>(&o[2]), *reinterpret_cast<u32*>(&o[3]));
                }
            }
            fence_proxy_async();  // this thread's W stores, visible to wgmma
            __syncwarp();  // one arrival per warp: 256 or 128 arrivals on one word serialize
            if (lane == 0) mbar_arrive(full_b + 8 * slot);
        }
        return;
    }

    // ---- consumer warpgroups (threads CT0 .. CT0 + 255)
    const int ct = tid - CT0, wg = ct >> 7;
    float d[WN / 2];  // written first by the acc = 0 wgmma of K tile 0 (nk >= 1)
    for (int kt = 0; kt < nk; ++kt) {
        const int sx = kt % SX, sb = kt % SB;
        mbar_wait(full_x + 8 * sx, (kt / SX) & 1);
        mbar_wait(full_b + 8 * sb, (kt / SB) & 1);
        wg_fence();
        const u32 xa = sbase + L::x + sx * L::x_tile + (BM == 128 ? wg * 64 * 128 : 0);
        const u32 wa = sbase + L::b + sb * L::b_tile + (BM == 128 ? 0 : wg * 1024);  // 64-row tiles: atom wg
#pragma unroll
        for (int kk = 0; kk < WG_BK / 16; ++kk)  // 16 k: two 8-k groups further on
            wgmma_f16<WN, 1>(d, wg_desc(xa + kk * 32), wg_desc_mn(wa + bmn_off(16 * kk, 0, BN), 1024, bmn_off(8, 0, BN)),
                             kt > 0 || kk > 0);
        wg_commit();
        wg_wait<1>();  // wgmma(kt - 1) has read its slot: hand it back to the producer
        if (kt > 0 && (ct & 31) == 0) {  // the warp's wgmma(kt - 1) is complete (wait_group is warp-synchronous)
            mbar_arrive(empty_x + 8 * ((kt - 1) % SX));
            mbar_arrive(empty_b + 8 * ((kt - 1) % SB));
        }
    }
    wg_wait<0>();

    if (b >= n_full) {  // a split tile: publish this part's sums; the last part of the tile to finish adds them all
        const int ts = sb_idx / split;
#pragma unroll
        for (int i = 0; i < WN / 2; ++i) part[((size_t)(ts * split + sp) * (WN / 2) + i) * 256 + ct] = d[i];
        __threadfence();  // the stores reach L2 before the ticket says so
        consumer_sync<NP>();
        int* flag = reinterpret_cast<int*>(sm + L::flag);
        if (ct == 0) *flag = atomicAdd(ticket + ts, 1);
        consumer_sync<NP>();
        if (*flag != split - 1) return;
        __threadfence();
        // the sum in part order whatever the arrival order (this part's own sums read back too):
        // repeats are bitwise equal
        const float* pt = part + (size_t)ts * split * (WN / 2) * 256 + ct;
#pragma unroll
        for (int i = 0; i < WN / 2; ++i) d[i] = __ldcg(pt + i * 256);
        for (int p = 1; p < split; ++p)
#pragma unroll
            for (int i = 0; i < WN / 2; ++i) d[i] += __ldcg(pt + ((size_t)p * (WN / 2) + i) * 256);
        if (ct == 0) ticket[ts] = 0;  // no other block of this launch touches it again
    }

    // D fragment: warp w of the warpgroup holds rows 16w + lane/4 (+8); pair i covers columns
    // 8i + 2 (lane % 4) + {0, 1} of the warpgroup's WN
    const int lane = ct & 31, w = (ct >> 5) & 3;
    const int r0 = m0 + (BM == 128 ? wg * 64 : 0) + w * 16 + (lane >> 2);
    const int c0 = c_out + (BM == 128 ? 0 : wg * WN) + 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < WN / 8; ++i) {
        if (r0 < T)
            *reinterpret_cast<half2*>(out + (size_t)r0 * ldo + c0 + 8 * i) = __floats2half2_rn(d[4 * i], d[4 * i + 1]);
        if (r0 + 8 < T)
            *reinterpret_cast<half2*>(out + (size_t)(r0 + 8) * ldo + c0 + 8 * i) =
                __floats2half2_rn(d[4 * i + 2], d[4 * i + 3]);
    }
}

// ---- The register-A form: dense prefill's "rs" path, and MoE prefill's grouped
// expert GEMMs (gemm_moe_rs, at the end of the file) ----
// Why: gemm_w4a16_ws stores every dequantized W tile to shared memory and each consumer's wgmma reads it
// back as B (1/64 byte of shared-memory reads plus 1/128 of stores per FLOP, x as A another 1/128), and the
// producers' dequantization, the loads and the wgmmas measured additive. Here the product is
// transposed, C^T [N, T] = W^T x^T: W^T is wgmma's A operand, dequantized by the consumer warps straight
// into A's register fragments (no W tile in shared memory), and x [T, K] from TMA is B, K-major. The first
// thread of each warpgroup issues a share of the loads: per K tile x's box, the column tile's 64-k slab of
// packed words (8 contiguous KB: one bulk copy, whichever part of it the block uses), the block's scales and zeros.
// Supported tiles (ops_cupy.RS_STAGES):
//   BT = 64 or 128 tokens x 256 channels (one 32-word column tile), 4 consumer warpgroups of 64 channels
//     (m64nBTk16), 8 stages: H200 456-475 TFLOP/s at 2048 rows against 369-393 for gemm_w4a16_ws (164);
//   BT = 256 tokens x 128 channels (half a column tile), 2 warpgroups (m64n256k16: 128 accumulators and
//     253 registers a thread), 5 stages: each dequantized A fragment serves twice the tokens, so half the
//     dequantization and packed-word reads per FLOP (499-550 at 2048 rows, 416-523 at 512).
// Sustained, these GEMMs run at the 700 W board cap (BT = 128 spends 1.5-1.6 pJ per FLOP
// against cuBLAS fp16's 1.03-1.09): energy per FLOP, not overlap, bounds them there.
// Split-K: at 512 rows q|k|v's 96 tiles and o's 64 leave SMs idle, so a tile's K tiles can be
// cut into `split` ranges (grid z), each part storing fp32 sums and the last to finish (an atomic ticket)
// adding them in part order, as gemm_w4a16_ws does for its wave tail (ops_cupy.rs_plan picks split).
// Requires N % 256 == 0 per matrix, K % 64 == 0, group % 64 == 0, any T >= 1; up to 3 matrices with the
// same K side by side in C; split <= K / 64. grid (ceil(T / BT), N / (64 RS_WG), split), block
// 128 RS_WG(BT), RsSmem::bytes of dynamic shared memory (ops_cupy.gemm_rs launches it).
#ifndef RS_REFILL_LAG
#define RS_REFILL_LAG 2  // K tiles between a stage's last use and its refill (1 or 2)
#endif
// consumer warpgroups of a block: 4 (256 channels) up to 128 tokens, 2 (128 channels) with 256 tokens,
// whose 128 accumulators per thread leave no registers for 4
#define RS_WG(BT) ((BT) == 256 ? 2 : 4)

template <int ST, int BT>
struct RsSmem {  // byte offsets from the 1024-aligned base of dynamic shared memory, ST stages
    static constexpr int x = 0;                        // [ST] x [BT tokens][64 k] fp16, 128B-swizzled (TMA)
    static constexpr int w = x + ST * BT * 128;        // [ST] packed words [16 row quads][32 words][4 rows]
    static constexpr int s = w + ST * 8192;            // [ST] scales [64 RS_WG] of the stage's group
    static constexpr int z = s + ST * 512;             // [ST] zero words [8 RS_WG]
    static constexpr int bar = z + ST * 128;           // full [ST], empty [ST]
    static constexpr int bytes = bar + 16 * ST + 1024; // + the alignment slack
};

// 1024 + the codes of a packed word's nibble pair sh / 4 (columns c, c + 1 of a word's 8; sh = 0, 4, 8, 12) as
// a half2's bits: the pair's two nibbles sit 16 bits apart, so one shift and one LOP3 bias both.
__device__ __forceinline__ u32 rs_codes(u32 w, int sh) { return lop3_and_or(w >> sh, 0x000f000fu, 0x64006400u); }

// A thread's nibble pair p = sh / 4 (columns c = 2p and c + 1 of each packed word, at nibbles p and p + 4) as
// per-thread constants for rs_pair: byte_perm selectors that gather column c's byte of the words at k and k + 1
// into bytes 0 and 2 of one word (sel_c: byte p / 2 of each) and column c + 1's (sel_c1: byte 2 + p / 2), the
// nibble's mask within those bytes (low for even p, high for odd), and the (mul, zero offset) that turn the masked
// codes into q exactly: lo form 1024 + q, hi form 1024 + 16 q (awq_dequant8's two forms).
struct RsNib {
    u32 sel_c, sel_c1, mask;
    half2 mul, zoff;  // q - z = h * mul - (zb - zoff), zb = 1024 + z: lo (1, 0), hi (1/16, 960)
};
__device__ __forceinline__ RsNib rs_nib(int sh) {
    const int p = sh >> 2, b = p >> 1;
    RsNib n;
    n.sel_c = b | (4 + b) << 8;
    n.sel_c1 = (2 + b) | (6 + b) << 8;
    n.mask = p & 1 ? 0x00f000f0u : 0x000f000fu;
    n.mul = __float2half2_rn(p & 1 ? 0.0625f : 1.f);
    n.zoff = __float2half2_rn(p & 1 ? 960.f : 0.f);
    return n;
}

// Two A registers from the raw words w0, w1 (one packed word at k and k + 1): ra = (c at k, c at k + 1), rb =
// (c + 1 at k, c + 1 at k + 1). Why pair the raw words: one byte_perm then yields both k of a channel, so the codes
// need no shift and no regrouping afterwards: 2 byte_perms, 2 LOP3s, 2 HFMA2s and 2 HMUL2s for 4 weights, where
// dequantizing each word's column pair and regrouping took 2 more. nz_c = -(z_c in the
// form's scale) and s_c in both halves; each weight is (q - z) * s, q - z exact before the one rounding, as in
// awq_dequant8.
__device__ __forceinline__ void rs_pair(u32 w0, u32 w1, const RsNib& n, half2 nz_c, half2 nz_c1, half2 s_c,
                                        half2 s_c1, u32& ra, u32& rb) {
    u32 e0 = lop3_and_or(__byte_perm(w0, w1, n.sel_c), n.mask, 0x64006400u);
    u32 e1 = lop3_and_or(__byte_perm(w0, w1, n.sel_c1), n.mask, 0x64006400u);
    half2 v0 = __hmul2(__hfma2(*reinterpret_cast<half2*>(&e0), n.mul, nz_c), s_c);
    half2 v1 = __hmul2(__hfma2(*reinterpret_cast<half2*>(&e1), n.mul, nz_c1), s_c1);
    ra = *reinterpret_cast<u32*>(&v0);
    rb = *reinterpret_cast<u32*>(&v1);
}

// shared-memory loads by address (the stage pointers are shared addresses: no generic loads)
__device__ __forceinline__ u32 lds32(u32 a) {
    u32 v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ uint2 lds64(u32 a) {
    uint2 v;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
    return v;
}

// One K tile of a consumer: its 16 A registers from the stage's packed words (shared addresses st_w,
// st_s, st_z), then 4 wgmmas on x (committed as one group). wi: the thread's word of the 32-word tile, wl
// the same word of the block's scales and zeros; sh: its nibble pair's shift; t0: lane % 4.
// SWZ (gemm_moe_rs's swizzled stages): the words at st_w + w_lo / w_hi + kk KKS instead (rs_block computes them).
template <int ND, int SWZ = 0, int KKS = 0>
__device__ __forceinline__ void rs_k_tile(float (&d)[ND], u32 (&af)[16], u32 st_w, u32 st_s, u32 st_z, u32 xs,
                                          int wi, int wl, int sh, int t0, int first, u32 w_lo = 0, u32 w_hi = 0) {
    u32 zw = rs_codes(lds32(st_z + wl * 4), sh);
    const RsNib nib = rs_nib(sh);
    const half2 nz = __hsub2(nib.zoff, *reinterpret_cast<half2*>(&zw));  // -(1024 + z) or -(64 + z), both columns
    const half2 nz_c = __low2half2(nz), nz_c1 = __high2half2(nz);
    u32 sw = lds32(st_s + (wl * 8 + sh / 2) * 2);
    const half2 s2 = *reinterpret_cast<half2*>(&sw), s_c = __low2half2(s2), s_c1 = __high2half2(s2);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const int qa = 4 * kk + (t0 >> 1), ra = 2 * (t0 & 1);  // k = 16 kk + 2 t0 (+1) and + 8 (+9)
        uint2 lo, hi;
        if constexpr (SWZ) {
            lo = lds64(st_w + w_lo + kk * KKS);
            hi = lds64(st_w + w_hi + kk * KKS);
        } else {
            lo = lds64(st_w + ((qa * 32 + wi) * 4 + ra) * 4);
            hi = lds64(st_w + (((qa + 2) * 32 + wi) * 4 + ra) * 4);
        }
        rs_pair(lo.x, lo.y, nib, nz_c, nz_c1, s_c, s_c1, af[4 * kk], af[4 * kk + 1]);
        rs_pair(hi.x, hi.y, nib, nz_c, nz_c1, s_c, s_c1, af[4 * kk + 2], af[4 * kk + 3]);
    }
    wg_pin(d);
    wg_fence();
    if constexpr (ND == 16) wgmma_rs32x4(d, af, wg_desc(xs), !first);
    else if constexpr (ND == 32) wgmma_rs64x4(d, af, wg_desc(xs), !first);
    else if constexpr (ND == 64) wgmma_rs128x4(d, af, wg_desc(xs), !first);
    else wgmma_rs256x4(d, af, wg_desc(xs), !first);
    wg_commit();
    wg_pin(d);
}

// One block of gemm_w4a16_rs: tokens tok0 .. tok0 + BT - 1 of x (those from tok_end on are computed, not
// stored) times channels n0 .. n0 + 64 WG - 1 of one matrix (qw, qz, sc, N columns), stored at out's
// column c_out; K tiles kt0 .. kt0 + nk - 1 (part z of split, tile ts of the split buffers). WG: consumer
// warpgroups (RS_WG(BT), or 2 for the MoE form that runs 2 blocks per SM). NTOK: the tokens the wgmmas compute,
// BT or, for a MoE tile whose expert has at most BT / 2 rows left, BT / 2 (half the tensor-core work; the stages
// still hold BT rows of x, of which the first NTOK are read).
// SWZ: the packed words come by a 3D TMA box (wmap: [row quads][4 quarters][32 words], 128B-swizzled) of only
// the block's WG quarters, starting at row quad wrq0 of the column tile, instead of the whole 8 KB bulk copy.
template <int ST, int BT, int WG = RS_WG(BT), int NTOK = BT, int SWZ = 0>
__device__ __forceinline__ void rs_block(const TmaDesc* xmap, const u32* __restrict__ qw, const u32* __restrict__ qz,
                                         const half* __restrict__ sc, int N, int n0, int c_out, int tok0, int tok_end,
                                         half* __restrict__ out, int K, int group, int ldo, int split, int z, int ts,
                                         float* __restrict__ part, int* __restrict__ ticket,
                                         const TmaDesc* wmap = nullptr, int wrq0 = 0) {
    static_assert(WG == 2 || WG == 4, "a block is 2 or 4 consumer warpgroups of 64 channels");
    static_assert(NTOK == BT || NTOK * 2 == BT, "the wgmmas cover the tile's tokens or their first half");
    constexpr int NT = 128 * WG;
    typedef RsSmem<ST, BT> L;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* sm = (unsigned char*)(((size_t)smem_raw + 1023) & ~(size_t)1023);
    const u32 sbase = smem_u32(sm), full = sbase + L::bar, empty = full + 8 * ST;
    const int tid = threadIdx.x, kt0 = z * (K / WG_BK) / split, nk = (z + 1) * (K / WG_BK) / split - kt0;
    if (tid == 0) {
        // too little shared memory, or too few threads for the consumer warpgroups (their empty barriers
        // would never complete: a hang), fails the launch instead
        if (dynamic_smem_bytes() < (u32)L::bytes || blockDim.x != NT || (group & (group - 1)) != 0) __trap();
        for (int s = 0; s < ST; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 4 * WG);  // every consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // ---- loads into a K tile's stage: the first ST now, then each as the stage is handed back (in the consumer
    // loop below). The loads of a K tile: x by TMA, the column tile's 8 KB of packed words, the block's scales and zeros by
    // bulk copies, each from the first thread of a warpgroup (copy c by warpgroup c % WG). Those threads are
    // consumers too, and their warpgroups' wgmmas wait for their issue: from thread 0 alone, as first written
    // (a division by the group, the addresses rebuilt per tile: ~95 instructions at a quarter of its scheduler's
    // issue slots) it took ~800 cycles of a ~1600-cycle K tile and the consumers waited for data a third of the
    // time (H100, MoE at 512 tokens); now the pointers are made once, the group index is a
    // shift and the copies are spread. Warpgroup 0's arrive.expect_tx may come after another
    // warpgroup's bytes have landed: the tx-count goes below zero and the phase still waits for that arrival.
    const u32* w_src = qw + (size_t)(n0 >> 8) * 32 * K + (size_t)kt0 * 2048;  // full 32-word tiles: [K/4][32][4]
    const half* s_src = sc + n0;
    const u32* z_src = qz + (n0 >> 3);
    const int gsh = 31 - __clz(group >> 6);  // group = 64 << gsh (a power of two: wgmma_fits, moe_rs_fits)
    const int wgi = tid >> 7;  // this thread's warpgroup (its first thread issues copies wgi, wgi + WG, ...)
    auto issue = [&](int kt, int s) {  // kt: the part's own K tile count, s = kt % ST its stage
        const int gi = (kt0 + kt) >> gsh;
        if (wgi == 0) {
            mbar_arrive_expect_tx(full + 8 * s, BT * 128 + (SWZ ? 2048 * WG : 8192) + 160 * WG);
            tma_load_2d(sbase + L::x + s * BT * 128, xmap, (kt0 + kt) * WG_BK, tok0, full + 8 * s);
        }
        if constexpr (SWZ) {  // the block's quarters of the tile's 16 row quads (WG x 2 KB)
            if (wgi == 1 % WG)
                tma_load_3d(sbase + L::w + s * 8192, wmap, 0, (n0 >> 6) & 3, wrq0 + (kt0 + kt) * 16, full + 8 * s);
        } else {  // the whole column tile's 8 KB (one copy: copies cost per instruction), of which a
                  // 2-warpgroup block reads half
            if (wgi == 1 % WG) bulk_g2s(sbase + L::w + s * 8192, w_src + (size_t)kt * 2048, 8192, full + 8 * s);
        }
        if (wgi == 2 % WG) bulk_g2s(sbase + L::s + s * 512, s_src + (size_t)gi * N, 128 * WG, full + 8 * s);
        if (wgi == 3 % WG) bulk_g2s(sbase + L::z + s * 128, z_src + (size_t)gi * (N / 8), 32 * WG, full + 8 * s);
    };
    const bool issuer = (tid & 127) == 0;
    if (issuer)
        for (int kt = 0; kt < min(ST, nk); ++kt) issue(kt, kt);

    // ---- consumer warpgroup g: channels 64 g .. 64 g + 63 of the block. Thread (warp w, lane = 4 t1 + t0)
    // holds A rows m = 16 w + t1 and m + 8 as the column pair (c, c + 1), c = 8 wl + 2 (t1 & 3), of the block's
    // word wl = 8 g + 2 w + t1 / 4 (word wi of its column tile): one nibble pair of each packed word it reads
    // (rows map to channels freely: the epilogue undoes it).
    const int g = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31, t0 = lane & 3, t1 = lane >> 2;
    const int wl = 8 * g + 2 * w + (t1 >> 2), wi = 8 * ((n0 >> 6) & 3) + wl, sh = 4 * (t1 & 3);
    // SWZ: 128-byte row r = row quad x WG + quarter (= g) of the stage, its 16-byte chunks XORed with r % 8 by the
    // 128B swizzle. Row quads qa and qa + 1 (one LDS64's lanes) are WG rows apart, so their words land in other
    // banks: one wavefront per load instead of two (with the plain layout both sit 512 bytes apart, in one bank).
    // kk adds 4 WG rows (a multiple of 8: the same XOR), so each thread's two offsets are fixed.
    const int r_lo = (t0 >> 1) * WG + g, r_hi = r_lo + 2 * WG;
    const u32 w_lo = r_lo * 128 + (((wl & 7) ^ (r_lo & 7)) << 4) + 8 * (t0 & 1);
    const u32 w_hi = r_hi * 128 + (((wl & 7) ^ (r_hi & 7)) << 4) + 8 * (t0 & 1);
    float d[NTOK / 2];
    u32 fa[16] = {}, fb[16] = {};  // two K tiles' A registers: one is read by wgmma while the other is built
    u32 keep = 0;
    // The loop runs U K tiles per pass: with U = ST each tile's stage is a constant, so every shared address
    // below is one base register plus an immediate (with k % ST the compiler rebuilt ~35 addresses per tile:
    // the consumers' instructions per K tile fell by a quarter); an odd ST keeps U = 2 (the A
    // register buffers alternate by tile parity)
    constexpr int U = ST % 2 == 0 ? ST : 2;
    u32 ph = 0;  // (kt / ST) & 1 when U = ST: the parity of this pass's full barriers
    for (int kt = 0; kt < nk; kt += U, ph ^= (U == ST)) {
#pragma unroll
        for (int h = 0; h < U; ++h) {
            const int k = kt + h;
            if (k >= nk) break;
            const int s = U == ST ? h : k % ST;
            mbar_wait(full + 8 * s, U == ST ? ph : (k / ST) & 1);
            rs_k_tile<NTOK / 2, SWZ, 512 * WG>(d, h & 1 ? fb : fa, sbase + L::w + s * 8192, sbase + L::s + s * 512,
                                              sbase + L::z + s * 128, sbase + L::x + s * BT * 128, wi, wl, sh, t0,
                                              k == 0, w_lo, w_hi);
            wg_wait<1>();  // K tile k - 1's wgmmas are done: its stage and its A registers are free
            wg_keep(h & 1 ? fa : fb, keep);  // K tile k - 1's A registers live until here: tile k's were built in others
            if (k > 0 && lane == 0) mbar_arrive(empty + 8 * (U == ST ? (h + ST - 1) % ST : (k - 1) % ST));
            // the stage of tile k - RS_REFILL_LAG refilled once every warp is done with it (a lag of 2: the
            // other warpgroups have had a tile's time to hand it back, so the issuing threads rarely wait)
            if (issuer && k >= RS_REFILL_LAG && k - RS_REFILL_LAG + ST < nk) {
                const int r = k - RS_REFILL_LAG, sr = U == ST ? (h + ST - RS_REFILL_LAG) % ST : r % ST;  // r's stage
                mbar_wait(empty + 8 * sr, U == ST ? (h >= RS_REFILL_LAG ? ph : ph ^ 1u) : (r / ST) & 1);
                issue(r + ST, sr);
            }
        }
    }
    wg_wait<0>();
    if (tok_end < 0) out[0] = __ushort_as_half((unsigned short)keep);  // never: keep's only use (wg_keep)
    if (split > 1) {  // K split: each part stores its sums, the last of the tile to finish adds them
        __shared__ int last;
        float* pt = part + (size_t)ts * split * (NTOK / 2) * NT + tid;
#pragma unroll
        for (int i = 0; i < NTOK / 2; ++i) pt[((size_t)z * (NTOK / 2) + i) * NT] = d[i];
        __threadfence();  // the stores reach L2 before the ticket says so
        __syncthreads();
        if (tid == 0) last = atomicAdd(ticket + ts, 1) == split - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        // the sum in part order whatever the arrival order (this part's own sums read back too): repeats
        // are bitwise equal
#pragma unroll
        for (int i = 0; i < NTOK / 2; ++i) d[i] = __ldcg(pt + (size_t)i * NT);
        for (int q = 1; q < split; ++q)
#pragma unroll
            for (int i = 0; i < NTOK / 2; ++i) d[i] += __ldcg(pt + ((size_t)q * (NTOK / 2) + i) * NT);
        if (tid == 0) ticket[ts] = 0;  // no other block of this launch touches it again
    }
    // D fragment: d[4 j + v0 + 2 v1] is (row m + 8 v1, token 8 j + 2 t0 + v0), rows m, m + 8 the channels c, c + 1
    const int col = c_out + 8 * wl + 2 * (t1 & 3);
#pragma unroll
    for (int j = 0; j < NTOK / 8; ++j) {
#pragma unroll
        for (int v0 = 0; v0 < 2; ++v0) {
            const int tok = tok0 + 8 * j + 2 * t0 + v0;
            if (tok < tok_end)
                *reinterpret_cast<half2*>(out + (size_t)tok * ldo + col) = __floats2half2_rn(d[4 * j + v0], d[4 * j + v0 + 2]);
        }
    }
}

template <int ST, int BT>  // stages, tokens per block (64, 128 or 256: the wgmmas' N)
__global__ void __launch_bounds__(128 * RS_WG(BT), 1)
gemm_w4a16_rs(const __grid_constant__ TmaDesc xmap,  // x [T, K] fp16, box 64 k x BT rows, 128B swizzle
              const u32* qw0, const u32* qz0, const half* sc0, int n_0,  // as gemm_w4a16_ws
              const u32* qw1, const u32* qz1, const half* sc1, int n_1,
              const u32* qw2, const u32* qz2, const half* sc2, int n_2,
              half* __restrict__ out,  // [T, ldo]
              int T, int K, int group, int ldo,
              int split,                     // gridDim.z: K tile ranges per tile (1: no split)
              float* __restrict__ part,      // [tiles][split][BT / 2][threads] fp32 partial sums (split > 1)
              int* __restrict__ ticket) {    // [tiles], zero between launches (split > 1)
    static_assert(BT == 64 || BT == 128 || BT == 256, "m64n64k16, m64n128k16 or m64n256k16");
    const int tok0 = blockIdx.x * BT, c_out = blockIdx.y * 64 * RS_WG(BT);  // token tiles fastest: a column
    const int mi = c_out < n_0 ? 0 : c_out < n_0 + n_1 ? 1 : 2;  // tile's weights are read from L2 after the first
    const int n0 = c_out - (mi > 0 ? n_0 : 0) - (mi > 1 ? n_1 : 0);
    rs_block<ST, BT>(&xmap, mi == 0 ? qw0 : mi == 1 ? qw1 : qw2, mi == 0 ? qz0 : mi == 1 ? qz1 : qz2,
                     mi == 0 ? sc0 : mi == 1 ? sc1 : sc2, mi == 0 ? n_0 : mi == 1 ? n_1 : n_2, n0, c_out, tok0, T,
                     out, K, group, ldo, split, blockIdx.z, blockIdx.y * gridDim.x + blockIdx.x, part, ticket);
}

// The MoE grouped form: one launch over every expert of a layer, x the rows of
// all experts in permuted order (moe.cu moe_gather_rows for the gate|up GEMM, the activations for down), each
// expert's rows contiguous (offsets). blockIdx.y walks the row tiles of all experts (tile_offsets counted in
// tiles of BT rows by moe_expert_maps; blocks past the last tile exit), blockIdx.x the column tiles. A tile's
// TMA box may run into the next expert's rows: they are multiplied and not stored. No split. WG 2 (64-row
// tiles by default, ops_cupy.MOE_RS_FORMS): blocks of 128 channels, two per SM, so one block's pipeline fill and
// stores overlap the other's K loop (-1 to -7% at 30B-A3B's shapes on the H100).
//   qw [E][K, N/8] tiled, qz [E][K/g, N/8], sc [E][K/g, N] (an expert's [gate | up] is one [K, 2I] tiled
//   matrix: its gate tiles then its up tiles); out [n, ldo] permuted rows.
// Narrow tiles: a tile whose expert has at most BT / 2 rows from the tile's first runs its wgmmas on those BT / 2
// tokens only (m64n32 for 64-row tiles, m64n64 for 128): random routing at 512 tokens leaves ~55% of 30B-A3B's
// 64-row tiles so, at 256 tokens nearly all, and at 2048 the last tile of an expert past 128 rows.
// The packed words come by wmap's swizzled 3D boxes (rs_block SWZ), the block's quarters of each tile only.
template <int ST, int BT, int WG = RS_WG(BT)>  // WG 2: 128 channels a block, 2 per SM
__global__ void __launch_bounds__(128 * WG, WG == 2 && BT <= 128 ? 2 : 1)
gemm_moe_rs(const __grid_constant__ TmaDesc xmap,  // x [n, K] fp16 (permuted rows), box 64 k x BT rows
            const u32* __restrict__ qw, const u32* __restrict__ qz, const half* __restrict__ sc, int N,
            half* __restrict__ out, int K, int group, int ldo,
            const int* __restrict__ offsets,       // [E+1] first permuted row of each expert
            const int* __restrict__ tile_offsets,  // [E+1] first row tile of each expert (tiles of BT rows)
            int E,
            const __grid_constant__ TmaDesc wmap) {  // qw as [E K N / 1024 row quads][4][32] u32, box 32 x WG x 16
    static_assert(BT == 64 || BT == 128, "m64n64k16 or m64n128k16 (2 or 4 consumer warpgroups)");
    const int tile = blockIdx.y;
    if (tile >= tile_offsets[E]) return;  // the grid is sized for the worst case; the whole block leaves
    const int e = moe_tile_expert(tile_offsets, E, tile), n0 = blockIdx.x * 64 * WG;
    // the column tile's first row quad in wmap: expert e's tiles, then tile n0 / 256's K / 4 row quads
    const int wrq0 = (e * (N >> 8) + (n0 >> 8)) * (K >> 2);
    const int tok0 = offsets[e] + (tile - tile_offsets[e]) * BT, tok_end = offsets[e + 1];
    if (tok_end - tok0 <= BT / 2) {  // block-uniform: the whole block takes one of the two forms
        rs_block<ST, BT, WG, BT / 2, 1>(&xmap, qw + (size_t)e * K * (N / 8), qz + (size_t)e * (K / group) * (N / 8),
                                        sc + (size_t)e * (K / group) * N, N, n0, n0, tok0, tok_end, out, K, group, ldo,
                                        1, 0, 0, nullptr, nullptr, &wmap, wrq0);
        return;
    }
    rs_block<ST, BT, WG, BT, 1>(&xmap, qw + (size_t)e * K * (N / 8), qz + (size_t)e * (K / group) * (N / 8),
                                sc + (size_t)e * (K / group) * N, N, n0, n0, tok0, tok_end, out, K, group, ldo, 1, 0,
                                0, nullptr, nullptr, &wmap, wrq0);
}
