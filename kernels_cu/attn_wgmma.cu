// Causal prefill flash attention on Hopper's warpgroup MMA (wgmma, sm_90a only; ops_cupy compiles this file
// with -arch=sm_90a and takes it on compute capability 9.0 at head dim 128; elsewhere attention.cu's
// flash_attn_prefill runs).
//
// Why: flash_attn_prefill (mma.sync, 4 warps x 16 query rows) reads every K and V fragment from shared memory
// by ldmatrix once per 16 query rows, and it ran at 171-242 TFLOP/s on the H100 at 2048-8192 tokens
// where the tensor cores allow ~3x that. Here a block of 64 NC query rows of one
// head is NC consumer warpgroups of 64 rows each:
//   - S = Q K^T is a wgmma with both operands in shared memory as TMA wrote them (128B-swizzled, K-major);
//   - the online softmax runs on S's accumulator registers;
//   - O += P V is a register-A wgmma: S's accumulator layout is already the A fragment layout, so P is S
//     rounded to fp16 in place, and V is read MN-major straight from its TMA tile.
// One load thread brings the block's Q once and K/V tiles of 64 keys into a ring of ST stages; every warpgroup
// reads each tile, so K and V leave L2 once per block, and a stage is handed back once every consumer warp's
// P V has read it. PIPE 1: a warpgroup issues tile j + 1's Q K^T before tile j's P V and runs tile j + 1's
// softmax while that P V is on the tensor cores (P double-buffered); without it (0) the softmax waits for both.
// PIPE 2 also has the warpgroups issue those wgmmas in turn (FlashAttention-3's ping-pong), so one
// warpgroup's softmax meets the next one's wgmmas rather than all softmaxes at once.
// Forms (the host's FW_CONFIGS; ops_cupy picks (4, 1, 2) below 2048 tokens and (4, 2, 3) from there), H100
// TFLOP/s at 2048 / 8192 tokens: (4, 1, 2) 340-405 / 441-493, (4, 2, 3) 342-429 /
// 501-556, (4, 1, 3) 327-396 / 471-524, (3, 0, 2) 297-346 / 402-425; flash_attn_prefill 174-246. At 512 tokens
// 3 warpgroups leave SMs idle (4 x 32 blocks of 128 rows: 172; of 192 rows: 135).
//
// Supported (the host checks, ops_cupy.attn_wgmma_fits and FW_CONFIGS): head dim 128, H % KV == 0, q [T, H*128]
// and out [T, H*128] contiguous, the K/V caches read as [L][n_keys][KV*128] (n_keys = pos0 + T; TMA reads zeros
// past them) at layer `layer`: one descriptor per cache and prompt length serves every layer, where one per layer
// cost a prefill of a new length 2 L descriptor encodes on the host; ST 3 or 4 (up to
// 181 KB at 4 stages and 3 warpgroups: 1 block per SM). Tiles of 128 keys measured slower: ptxas holds a block of
// 288 threads to 168 registers, which serialized their wgmmas, and the pipelined form spilled.
// grid (ceil(T / (64 NC)), H), block FW_THREADS(NC), FwSmem<ST, NC>::bytes of dynamic shared memory.
#include "common.cuh"
#include "wgmma.cuh"

#define FW_HD 128       // head dim
// NC consumer warpgroups of 64 query rows each, then the loads: with 2, one load warp (288 threads, which
// ptxas holds to 168 registers); with 3, a load warpgroup that gives its registers to the consumers
// (setmaxnreg: 24 for it, FW_NC3_REGS for each consumer thread, of the 128 a 512-thread block starts with)
#define FW_THREADS(NC) ((NC) == 2 ? 288 : 128 * ((NC) + 1))
#define FW_NC3_REGS 160
#define FW_BKV 64       // keys per K/V tile (the S wgmma's N)
#define FW_BOX 8192     // one TMA box: 64 rows x 64 fp16 columns (128 bytes, one swizzle row)

template <int ST, int NC>
struct FwSmem {  // byte offsets from the 1024-aligned base of dynamic shared memory; a tile is two boxes
    static constexpr int q = 0;                       // [NC warpgroups][2 column halves] Q boxes
    static constexpr int k = q + 2 * NC * FW_BOX;     // [ST][2 column halves] K boxes (64 keys)
    static constexpr int v = k + ST * 2 * FW_BOX;     // [ST][2 column halves] V boxes
    static constexpr int bar = v + ST * 2 * FW_BOX;   // Q full, K full [ST], V full [ST], empty [ST]
    static constexpr int bytes = bar + 8 * (1 + 3 * ST) + 1024;  // + the alignment slack
};

// 2^x by the MUFU alone (ex2.approx.ftz): exp2f's non-ftz form adds a denormal fixup per call, and P's
// values below 2^-126 are zeros in fp16 anyway.
__device__ __forceinline__ float fw_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int ST, int PIPE, int NC>  // K/V stages; PIPE: 1 tile j + 1's Q K^T ahead of tile j's P V, 2 and the
__global__ void __launch_bounds__(FW_THREADS(NC), 1)  // warpgroups' wgmmas issued in turn (see above); consumer
                                                      // warpgroups (2 or 3)
flash_attn_wgmma(const __grid_constant__ TmaDesc qmap,  // q [T, H*128] fp16 (rotated), boxes 64 x 64
                 const __grid_constant__ TmaDesc kmap,  // K [L][n_keys][KV*128]: every layer's cache rows
                 const __grid_constant__ TmaDesc vmap,  // V [L][n_keys][KV*128]
                 half* __restrict__ O,                  // [T, H*128]
                 int T, int pos0, int H, int KV, int layer, float scale_log2,
                 const int* __restrict__ pos_dev,       // when set, pos0 is read here (a prefill graph's replay)
                 const TmaDesc* __restrict__ kvmaps) {  // when set, [2] K and V maps in global memory instead
    // A prefill graph serves prompts at any position: the host writes the position and maps of its n_keys rows
    // into device memory before each replay. Maps over the cache's whole capacity
    // would let V rows past n_keys (stale, or never written) into P V, where a masked key's 0 times NaN is NaN.
    if (pos_dev) pos0 = *pos_dev;
    static_assert(NC == 2 || NC == 3, "2 consumer warpgroups and a load warp, or 3 and a load warpgroup");
    constexpr int BQ = 64 * NC;  // query rows per block
    typedef FwSmem<ST, NC> L;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* sm = (unsigned char*)(((size_t)smem_raw + 1023) & ~(size_t)1023);  // swizzle atoms: 1 KB
    const u32 sb = smem_u32(sm), qbar = sb + L::bar, kfull = qbar + 8, vfull = kfull + 8 * ST,
              empty = vfull + 8 * ST;
    const int tid = threadIdx.x;
    // the last query tiles have the most keys: they start first, so the grid does not end on them
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ, h = blockIdx.y, kvh = h / (H / KV);
    const int n_keys = pos0 + T;
    if (tid == 0) {
        // too little shared memory or too few threads would hang on the barriers: fail the launch instead
        if (dynamic_smem_bytes() < (u32)L::bytes || blockDim.x != FW_THREADS(NC)) __trap();
        mbar_init(qbar, 1);
        for (int s = 0; s < ST; ++s) {
            mbar_init(kfull + 8 * s, 1);
            mbar_init(vfull + 8 * s, 1);
            mbar_init(empty + 8 * s, 4 * NC);  // every consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // (the last block-wide barrier: the load warp's other lanes leave below)

    if (tid >= 128 * NC) {  // ---- the loads: one thread issues every copy ----
        if constexpr (NC == 3) asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (tid == 128 * NC) {
            const TmaDesc *km = &kmap, *vm = &vmap;
            if (kvmaps) {  // written by a copy since the last replay: the tensormap proxy must not use a stale one
                km = kvmaps, vm = kvmaps + 1;
                asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(km) : "memory");
                asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(vm) : "memory");
            }
            const int n_tiles = (min(n_keys, pos0 + q0 + BQ) + FW_BKV - 1) / FW_BKV;  // the block's causal bound
            mbar_arrive_expect_tx(qbar, 2 * NC * FW_BOX);
            for (int i = 0; i < 2 * NC; ++i)  // box i: warpgroup i / 2, column half i % 2
                tma_load_2d(sb + L::q + i * FW_BOX, &qmap, h * FW_HD + (i & 1) * 64, q0 + (i >> 1) * 64, qbar);
            for (int j = 0; j < n_tiles; ++j) {
                const int s = j % ST;
                if (j >= ST) mbar_wait(empty + 8 * s, (j / ST - 1) & 1);  // tile j - ST's P V is done
                mbar_arrive_expect_tx(kfull + 8 * s, 2 * FW_BOX);
                for (int c = 0; c < 2; ++c)
                    tma_load_3d(sb + L::k + (2 * s + c) * FW_BOX, km, kvh * FW_HD + c * 64, j * FW_BKV, layer,
                                kfull + 8 * s);
                mbar_arrive_expect_tx(vfull + 8 * s, 2 * FW_BOX);
                for (int c = 0; c < 2; ++c)
                    tma_load_3d(sb + L::v + (2 * s + c) * FW_BOX, vm, kvh * FW_HD + c * 64, j * FW_BKV, layer,
                                vfull + 8 * s);
            }
        }
        return;
    }

    if constexpr (NC == 3) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(FW_NC3_REGS) : "memory");

    // ---- consumer warpgroup wg: query rows qw0 .. qw0 + 63. Thread (warp w, lane = 4 g + t0) holds S and O
    // for rows row0 = qw0 + 16 w + g and row0 + 8: s[4 c + e] is row row0 + 8 (e >> 1), key 8 c + 2 t0 + (e & 1)
    // of the tile, o[4 c + e] the same rows at head-dim column 8 c + 2 t0 + (e & 1)
    const int wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t0 = lane & 3;
    const int qw0 = q0 + 64 * wg, row0 = qw0 + 16 * w + g, qp0 = pos0 + row0;
    // the tiles this warpgroup needs (the block's last one only the last warpgroup may need); taking turns,
    // every warpgroup runs the block's count (the extra tile wholly masked) so that the turns pair up
    const int tiles = (min(n_keys, pos0 + (PIPE == 2 ? q0 + BQ : qw0 + 64)) + FW_BKV - 1) / FW_BKV;
    // no initial values: the first wgmma of each overwrites them (scale-d off), and zeroing them here made
    // ptxas serialize every wgmma (C7515)
    constexpr int NS = FW_BKV / 2, NP = FW_BKV / 4;  // S accumulators, P registers per thread
    float s[NS], o[64];
    u32 p[NP] = {}, pn[NP] = {}, keep = 0;     // P of the tile in P V; PIPE: the next tile's
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];  // l: this thread's share of each row's sum
    const u32 qs = sb + L::q + wg * 2 * FW_BOX;

    // S = Q K^T of tile j into s (committed as one group)
    auto issue_s = [&](int j) {
        const int st = j % ST;
        const u32 ks = sb + L::k + st * 2 * FW_BOX;
        mbar_wait(kfull + 8 * st, (j / ST) & 1);
        wg_pin(s);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < FW_HD / 16; ++kk)  // 32 bytes of k per step: + 2 in descriptor units
            wgmma_f16<FW_BKV, 0>(s, wg_desc(qs + (kk >> 2) * FW_BOX) + 2 * (kk & 3),
                              wg_desc(ks + (kk >> 2) * FW_BOX) + 2 * (kk & 3), kk);
        wg_commit();
        wg_pin(s);
    };
    // O (+)= P V of tile j (committed as one group; scale-d off on the first tile)
    auto issue_pv = [&](int j, const u32 (&pj)[NP]) {
        const int st = j % ST;
        const u32 vs = sb + L::v + st * 2 * FW_BOX;
        mbar_wait(vfull + 8 * st, (j / ST) & 1);
        wg_pin(o);
        wg_fence();
        // V MN-major: its 64-column halves a box apart (leading byte offset), 8-key groups 1 KB apart (stride
        // byte offset), so each k16 step of 16 keys starts 2 KB (128 descriptor units) further
        wgmma_rs128x4<128, 1>(o, pj, wg_desc_mn(vs, FW_BOX, 1024), j > 0);
        wg_commit();
        wg_pin(o);
    };
    // tile j's S (landed in s) masked and through the online softmax in the log2 domain (a row lives in one
    // quad of lanes): m (the row's running maximum of S, times scale_log2), l and alpha (O's factor) updated, P
    // into pj. The maximum is taken on S itself (scale_log2 > 0 keeps the order), so each element costs one
    // FFMA and one MUFU.EX2. Only a tile that reaches past the warpgroup's first query needs the mask; keys past
    // n_keys lie past every real query.
    auto softmax = [&](int j, u32 (&pj)[NP]) {
        const int kv0 = j * FW_BKV;
        const bool mask = kv0 + FW_BKV - 1 > pos0 + qw0;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            if (mask && kv0 + 8 * (i >> 2) + 2 * t0 + (i & 1) > qp0 + 8 * ((i >> 1) & 1)) s[i] = -INFINITY;
            mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
        }
        float nm[2];  // -(the new maximum) in the log2 domain
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // finite: every row's first tile holds key 0, at or before its position
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float mn = fmaxf(m[r], mx[r] * scale_log2);
            alpha[r] = fw_exp2(m[r] - mn);  // 0 on the first tile (m = -inf)
            m[r] = mn;
            nm[r] = -mn;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            s[i] = fw_exp2(fmaf(s[i], scale_log2, nm[(i >> 1) & 1]));
            l[(i >> 1) & 1] += s[i];
        }
#pragma unroll
        for (int kk = 0; kk < FW_BKV / 16; ++kk)  // keys 16 kk ..: A rows (row0, k 2 t0), (row0 + 8, ..), (row0, k 8 + 2 t0), ..
#pragma unroll
            for (int i = 0; i < 4; ++i) pj[4 * kk + i] = pack_half2(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
    };
    auto rescale_o = [&] {
#pragma unroll
        for (int i = 0; i < 64; ++i) o[i] *= alpha[(i >> 1) & 1];
    };

    // PIPE 2: warpgroup wg issues a batch of wgmmas only in its turn (named barrier 1 + wg, completed by the
    // warpgroup before it passing the turn on), so that one warpgroup's softmax runs while the next one's
    // wgmmas hold the tensor cores rather than all of them at once; the last warpgroup's final pass would
    // have no taker, so it is left out, and it hands the first turn to warpgroup 0
    auto turn_take = [&] {
        if constexpr (PIPE == 2) asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory");
    };
    auto turn_pass = [&](bool last) {
        if constexpr (PIPE == 2)
            if (!last || wg != NC - 1) asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (wg + 1) % NC) : "memory");
    };
    if constexpr (PIPE == 2)
        if (wg == NC - 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");

    mbar_wait(qbar, 0);
    if constexpr (PIPE != 0) {
        // tile j + 1's Q K^T is issued ahead of tile j's P V, and its softmax runs while that P V does
        turn_take();
        issue_s(0);
        turn_pass(false);
        wg_wait<0>();
        softmax(0, p);
        for (int j = 0; j + 1 < tiles; ++j) {  // (the last tile after the loop: no conditions inside it)
            turn_take();
            issue_s(j + 1);
            issue_pv(j, p);
            turn_pass(false);
            wg_wait<1>();  // S of tile j + 1 (groups complete in order; P V of tile j may still run)
            softmax(j + 1, pn);
            wg_wait<0>();  // P V of tile j: its stage is free
            wg_keep(p, keep);
            if (lane == 0) mbar_arrive(empty + 8 * (j % ST));
            rescale_o();
#pragma unroll
            for (int i = 0; i < NP; ++i) p[i] = pn[i];
        }
        turn_take();
        issue_pv(tiles - 1, p);
        turn_pass(true);
        wg_wait<0>();
        wg_keep(p, keep);
    } else {
        for (int j = 0; j < tiles; ++j) {
            issue_s(j);
            wg_wait<0>();  // S of tile j, and tile j - 1's P V
            wg_keep(p, keep);
            if (j > 0 && lane == 0) mbar_arrive(empty + 8 * ((j - 1) % ST));
            softmax(j, p);
            if (j > 0) rescale_o();
            issue_pv(j, p);
        }
        wg_wait<0>();
        wg_keep(p, keep);
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const float inv0 = 1.f / l[0], inv1 = 1.f / l[1];
    const int ldo = H * FW_HD;
    half* out = O + (size_t)h * FW_HD + 2 * t0;
#pragma unroll
    for (int c = 0; c < FW_HD / 8; ++c) {
        if (row0 < T)
            *reinterpret_cast<half2*>(out + (size_t)row0 * ldo + 8 * c) = __floats2half2_rn(o[4 * c] * inv0, o[4 * c + 1] * inv0);
        if (row0 + 8 < T)
            *reinterpret_cast<half2*>(out + (size_t)(row0 + 8) * ldo + 8 * c) =
                __floats2half2_rn(o[4 * c + 2] * inv1, o[4 * c + 3] * inv1);
    }
    if (T < 0) O[0] = __ushort_as_half((unsigned short)(keep ^ pn[0]));  // never: keep's only use (wg_keep)
}
