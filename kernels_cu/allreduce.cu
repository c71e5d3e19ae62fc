// The one-shot all-reduce for batch-1 decode's small vectors (4-64 KB) over GPUs that reach each other's memory
// (NVLink peer access): one kernel per rank, no host round trip, replayable inside a CUDA graph.
//
// Rank r's block b, at epoch e (its own counter, epochs[b], + 1):
//   1. writes its share of the input (the 16-byte vectors b owns) into slot r of every rank's buffer, in the half
//      chosen by e's parity,
//   2. raises flag [b][r] to e on every rank (a system-scope release),
//   3. waits until every rank's flag [b][*] on its own device has reached e (a system-scope acquire),
//   4. sums its own buffer's slots 0..N-1 in rank order in fp32 and writes the result (one rounding): every rank
//      adds the same values in the same order, so all ranks hold identical bits,
//   5. stores e as its epoch (only this block reads it; the next launch does).
// Why two halves suffice: a rank can write epoch e + 2's data only after epoch e + 1 completed, which needed every
// peer's e + 1 flag, which a peer raises only after its epoch-e launch (its reads of the other half) has finished.
// A flag may run one epoch ahead of the reader (a fast peer's next launch), hence the wait is "flag - e >= 0".
// A block owns the same vectors at every size (a grid-stride loop over a grid fixed for the object's life), so the
// parity argument holds per vector.
//
// One launch may also simulate N ranks on one device (gridDim.y = N, rank = rank0 + blockIdx.y): the single-GPU
// test of the arithmetic, the slot layout and the epoch protocol; every block must then be resident at once
// (the caller keeps blocks x N within the SM count).
#include <cuda_fp16.h>

#define AR_MAX_RANKS 8

typedef unsigned int u32;

// Release: the block's peer stores, each drained by its thread's __threadfence_system() and ordered before this
// store by the __syncthreads() in between, are visible at system scope to any thread whose acquire reads the value.
__device__ __forceinline__ void flag_release(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Acquire: the stores that preceded a peer's release of the value read here are visible to this thread and, through
// the __syncthreads() after the wait, to the block's later loads (which read L2, __ldcg, never a stale L1 line).
__device__ __forceinline__ u32 flag_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

template <typename T> struct Vec;  // 16 bytes of T, as fp32 lanes
template <> struct Vec<float> {
    static constexpr int L = 4;
    __device__ static void load(const uint4& u, float* f) {
        f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
        f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
    }
    __device__ static uint4 store(const float* f) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    }
};
template <> struct Vec<__half> {
    static constexpr int L = 8;
    __device__ static void load(const uint4& u, float* f) {
        const __half2* h = reinterpret_cast<const __half2*>(&u);
        for (int i = 0; i < 4; i++) {
            float2 p = __half22float2(h[i]);
            f[2 * i] = p.x; f[2 * i + 1] = p.y;
        }
    }
    __device__ static uint4 store(const float* f) {
        uint4 u;
        __half2* h = reinterpret_cast<__half2*>(&u);
        for (int i = 0; i < 4; i++) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
        return u;
    }
};

// peers: 2 * n_ranks pointers, every rank's buffer base then every rank's flag base (device-visible addresses);
// a buffer is [2 halves][n_ranks slots][cap_vec 16-byte vectors], a flag array [blocks][n_ranks] u32.
// in / out: this rank's n_vec vectors (rank rows rank_stride vectors apart in the simulated form).
// epochs: [gridDim.y][gridDim.x] u32 counters, one per (simulated rank, block).
template <typename T>
__device__ __forceinline__ void allreduce_body(const uint4* __restrict__ in, uint4* __restrict__ out,
                                               const unsigned long long* __restrict__ peers, u32* epochs,
                                               int n_vec, int cap_vec, int n_ranks, int rank) {
    __shared__ u32 s_epoch;
    const int b = blockIdx.x;
    if (threadIdx.x == 0) s_epoch = epochs[b] + 1;
    __syncthreads();
    const u32 e = s_epoch;
    const long long half = (long long)(e & 1) * n_ranks * cap_vec;
    const int stride = gridDim.x * blockDim.x;
    for (int i = b * blockDim.x + threadIdx.x; i < n_vec; i += stride) {
        const uint4 v = in[i];
        for (int p = 0; p < n_ranks; p++)
            reinterpret_cast<uint4*>(peers[p])[half + (long long)rank * cap_vec + i] = v;
    }
    // each thread's own peer stores drained before the barrier (the release below then need not rely on the
    // hardware carrying other warps' in-flight NVLink stores through bar.sync)
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < n_ranks)
        flag_release(reinterpret_cast<u32*>(peers[n_ranks + threadIdx.x]) + b * n_ranks + rank, e);
    if (threadIdx.x < n_ranks) {
        const u32* f = reinterpret_cast<const u32*>(peers[n_ranks + rank]) + b * n_ranks + threadIdx.x;
        while ((int)(flag_acquire(f) - e) < 0) {
        }
    }
    __syncthreads();
    const uint4* mine = reinterpret_cast<const uint4*>(peers[rank]) + half;
    for (int i = b * blockDim.x + threadIdx.x; i < n_vec; i += stride) {
        float acc[Vec<T>::L], x[Vec<T>::L];
        Vec<T>::load(__ldcg(mine + i), acc);  // L2, never a line L1 kept from an earlier epoch
        for (int p = 1; p < n_ranks; p++) {
            Vec<T>::load(__ldcg(mine + (long long)p * cap_vec + i), x);
            for (int l = 0; l < Vec<T>::L; l++) acc[l] += x[l];
        }
        out[i] = Vec<T>::store(acc);
    }
    if (threadIdx.x == 0) epochs[b] = e;
}

template <typename T>
__global__ void __launch_bounds__(256) allreduce_oneshot(const uint4* __restrict__ in, uint4* __restrict__ out,
                                                         long long rank_stride,
                                                         const unsigned long long* __restrict__ peers, u32* epochs,
                                                         int n_vec, int cap_vec, int n_ranks, int rank0) {
    const int y = blockIdx.y;
    allreduce_body<T>(in + y * rank_stride, out + y * rank_stride, peers, epochs + (long long)y * gridDim.x,
                      n_vec, cap_vec, n_ranks, rank0 + y);
}

template __global__ void allreduce_oneshot<__half>(const uint4*, uint4*, long long, const unsigned long long*, u32*,
                                                   int, int, int, int);
template __global__ void allreduce_oneshot<float>(const uint4*, uint4*, long long, const unsigned long long*, u32*,
                                                  int, int, int, int);
