// The CUDA codec's kernels compiled by g++ for the host (tests/support/cuda_host.py): CUDA's
// keywords, types and intrinsics, each CUDA thread of a block one std::thread, blocks one after
// the other. __syncthreads and __syncthreads_or are barriers of the block's threads, warp
// shuffles barriers of the warp's 32 (every lane must take part, as the kernels require),
// atomics GCC's; a thread that returns leaves its block's and warp's barriers, and a shuffle in
// a warp of which a lane returned aborts (undefined on a GPU). `__shared__` variables are
// statics: one block runs at a time (in reverse order: no kernel may depend on it).
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct HostDim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local HostDim3 threadIdx, blockIdx;
inline HostDim3 blockDim, gridDim;

// The block running now: its barrier, its warps' barriers and exchange slots.
struct HostBlock {
  explicit HostBlock(unsigned threads) : block(threads) {
    for (unsigned w = 0; w < threads / 32; ++w) warps[w] = std::make_unique<std::barrier<>>(32);
  }
  std::barrier<> block;
  std::unique_ptr<std::barrier<>> warps[32];
  unsigned long long slots[32][32];
  unsigned exited[32] = {};  // per warp: the lanes that returned (a shuffle with them is UB)
  int any = 0;
};
inline HostBlock* host_block = nullptr;

inline void __syncthreads() { host_block->block.arrive_and_wait(); }
inline int __syncthreads_or(int x) {
  if (x) __atomic_fetch_or(&host_block->any, 1, __ATOMIC_SEQ_CST);
  __syncthreads();
  const int any = __atomic_load_n(&host_block->any, __ATOMIC_SEQ_CST);
  __syncthreads();
  if (threadIdx.x == 0) __atomic_store_n(&host_block->any, 0, __ATOMIC_SEQ_CST);
  __syncthreads();
  return any;
}
template <typename T> inline T host_exchange(T v, unsigned from) {
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  static_assert(sizeof(T) <= 8, "a shuffled value fits a slot");
  std::memcpy(&host_block->slots[warp][lane], &v, sizeof(T));
  host_block->warps[warp]->arrive_and_wait();
  if (__atomic_load_n(&host_block->exited[warp], __ATOMIC_SEQ_CST) != 0) {
    std::fprintf(stderr, "a warp shuffle after a lane of the warp returned (undefined on a GPU)\n");
    std::abort();
  }
  T r;
  std::memcpy(&r, &host_block->slots[warp][from], sizeof(T));
  host_block->warps[warp]->arrive_and_wait();
  return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int o) {
  return host_exchange(v, (threadIdx.x % 32) ^ (unsigned)o);
}
template <typename T> inline T __shfl_down_sync(unsigned, T v, int d) {
  const unsigned from = threadIdx.x % 32 + (unsigned)d;
  return host_exchange(v, from < 32 ? from : threadIdx.x % 32);
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_add(v);
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_add(v);
}
inline double atomicAdd(double* p, double v) { return std::atomic_ref<double>(*p).fetch_add(v); }
inline unsigned long long atomicOr(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_or(v);
}
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).exchange(v);
}

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __fadd_rn(float a, float b) { return a + b; }  // -ffp-contract=off
inline float __fmul_rn(float a, float b) { return a * b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

struct __nv_bfloat16 { unsigned short x; };
struct __half { unsigned short x; };
// CUDA's round to nearest even (cuda_bf16.hpp's host path; NaN becomes 0x7fff)
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned u = __float_as_uint(f);
  if (std::isnan(f)) return {0x7fff};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {(unsigned short)(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 v) { return __uint_as_float((unsigned)v.x << 16); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 v) { return v.x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short x) { return {x}; }
inline __half __float2half_rn(float f) {
  if (std::isnan(f)) return {0x7fff};
  _Float16 h = (_Float16)f;  // round to nearest even
  unsigned short x;
  std::memcpy(&x, &h, 2);
  return {x};
}
inline float __half2float(__half v) { _Float16 h; std::memcpy(&h, &v.x, 2); return (float)h; }
inline unsigned short __half_as_ushort(__half v) { return v.x; }
inline __half __ushort_as_half(unsigned short x) { return {x}; }

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// The kernels' vector accesses so far, by kind (cuda_codec.cu's LOCO_VECTOR_ACCESS), read and
// cleared by lowbitcc_host_vector_accesses.
inline std::atomic<unsigned long long> host_vector_accesses[8];
#define LOCO_VECTOR_ACCESS(kind) host_vector_accesses[kind].fetch_add(1, std::memory_order_relaxed)
