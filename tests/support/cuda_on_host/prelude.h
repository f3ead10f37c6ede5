// The CUDA codec's kernels compiled by g++ for the host (tests/codec/test_cuda_decodes_on_host.py):
// the CUDA keywords, types and intrinsics the decodes use, each thread of a launch run in turn
// by the caller (threadIdx and blockIdx set before each call). Only kernels that need no
// cooperation between threads can run (the decodes without their own row check: no
// __syncthreads_or); the intrinsics of the others abort.
#pragma once
#include <cmath>
#include <cstdlib>
#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct HostDim3 { unsigned x = 0, y = 0, z = 0; };
inline HostDim3 threadIdx, blockIdx, blockDim, gridDim;

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
inline __half __float2half_rn(float f) {
  if (std::isnan(f)) return {0x7fff};
  _Float16 h = (_Float16)f;  // round to nearest even
  unsigned short x;
  std::memcpy(&x, &h, 2);
  return {x};
}
inline float __half2float(__half v) { _Float16 h; std::memcpy(&h, &v.x, 2); return (float)h; }
inline unsigned short __half_as_ushort(__half v) { return v.x; }

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// what only cooperating threads do: never called by the kernels run here
template <typename T> inline T __shfl_xor_sync(unsigned, T, int) { std::abort(); }
template <typename T> inline T __shfl_down_sync(unsigned, T, int) { std::abort(); }
inline void __syncthreads() { std::abort(); }
inline int __syncthreads_or(int) { std::abort(); }
inline void __threadfence() { std::abort(); }
template <typename T> inline T atomicAdd(T*, T) { std::abort(); }
template <typename T> inline T atomicOr(T*, T) { std::abort(); }
template <typename T> inline T atomicExch(T*, T) { std::abort(); }
