// Internal to the CPU codec's translation units, which ninja compiles in parallel: the encodes
// (cpu_encode_fp32.cpp, cpu_encode_fp16.cpp, of the templates in cpu_encode.h, with c10's
// BFloat16 and Half headers only) and cpu_codec.cpp (the decodes, the framing and the Python
// bindings, with torch's pybind header).
// What they share is defined here once.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LOCO_AVX512 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define LOCO_AVX2 1
#endif

#include "loco_codec.cuh"

namespace lowbitcc_cpu {

using loco::EncodeArgs;
using loco::is_fp4;
using loco::is_grid;
using loco::is_nv;
constexpr int kNoError = loco::kErrorNone;
constexpr int kInt8 = loco::kErrorInt8;
constexpr int kFp32 = loco::kErrorFp32;
constexpr int kBf16 = loco::kErrorBf16;
constexpr int kInt = loco::kFormatInt;
constexpr int kMx = loco::kFormatMxfp4;
constexpr int kNv = loco::kFormatNvfp4;
constexpr int kNvInt3 = loco::kFormatNvint3;
constexpr int kNvFp3 = loco::kFormatNvfp3;

#if defined(LOCO_AVX512)
constexpr const char* kVectorPath = "avx512";
#elif defined(LOCO_AVX2)
constexpr const char* kVectorPath = "avx2";
#else
constexpr const char* kVectorPath = "none";
#endif

// One encode (cpu_encode.h) of `a`, whose buffers the caller has checked against its shapes, of a
// source of fp32 (cpu_encode_fp32.cpp), bf16 or fp16 (cpu_encode_fp16.cpp) elements: `bits`-bit
// codes, on `threads` OpenMP threads; adds the residual^2 and input^2 into a.sums.
void encode_fp32(const EncodeArgs& a, int64_t bits, int threads);
void encode_bf16(const EncodeArgs& a, int64_t bits, int threads);
void encode_fp16(const EncodeArgs& a, int64_t bits, int threads);

}  // namespace lowbitcc_cpu
