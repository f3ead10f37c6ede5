// The CPU codec's encode kernels (C++/OpenMP) built from loco_codec.cuh; bit-exact with reference.py.
// Templates on the source's element type, instantiated by cpu_encode_fp32.cpp (fp32) and
// cpu_encode_fp16.cpp (bf16, fp16), which ninja compiles in parallel with cpu_codec.cpp and
// without torch's headers (c10's BFloat16 and Half only); cpu_codec.cpp checks the arguments and calls them (cpu_codec.h).
//
// encode: one pass per group of G elements: read the source (fp32/bf16/fp16, times `factor`),
//   add the stored error, group max, quantize, pack codes and the scale (fp32, or an E8M0 byte
//   for MXFP4, or an E4M3 byte for the is_nv formats, NVFP4 and the 3-bit ones, whose block of
//   16 groups is read before its E8M0 byte is known: encode_nv_block) straight into the message
//   rows, LoCo-update the error and store it back (int8 + scale, fp32 or bf16) in place. The
//   explicit AVX-512 path covers int codes with G = 128; the AVX2 path those where the build has
//   no AVX-512, and on every AVX2 build MXFP4 with G = 32 (four groups a call, encode_block)
//   and the is_nv formats, NVFP4 and the 3-bit nvint3 and nvfp3 (a block of 16 groups a call,
//   their grid read from loco::grid); everything else runs the portable loops (whose quantize
//   loop the compiler vectorizes: quantize_group; 3-bit codes are packed by a scalar loop,
//   pack_codes).
//
// Shapes: the source is a flat tensor of `numel` elements seen as `rows` rows of `m` elements
// (element r*m + j; indices >= numel read as 0). ng = ceil(m / G) groups per row, mp = ng * G.
// Messages are uint8 [rows, P]; the header (bytes 0..31) is written by Python. The error state
// is [rows * mp] elements (int8 codes with [rows * ng] fp32 scales, or fp32, or bf16).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <type_traits>
#include <vector>

#include "cpu_codec.h"

namespace lowbitcc_cpu {
namespace {

inline const c10::BFloat16* error_bf16(const EncodeArgs& a) {
  return reinterpret_cast<const c10::BFloat16*>(a.ebf16);
}
inline c10::BFloat16* error_bf16_out(const EncodeArgs& a) {
  return reinterpret_cast<c10::BFloat16*>(a.ebf16);
}

constexpr int kLanes = 8;  // G is a multiple of 8
// The default group sizes (int codes; MXFP4), compiled with G known so that the per-group loops
// have no tails.
constexpr int kFastGroup = 128;
constexpr int kMxGroup = 32;
constexpr int kStatLanes = 16;  // lanes of the statistics sums (one AVX-512 register)

// max |v| over v[0..G), or NaN if any v is NaN or +-Inf (the group is then non-finite).
// On the bit patterns with the sign cleared, unsigned order is the order of |v| for finite
// values, and NaN/Inf patterns (>= 0x7f800000) exceed every finite one: an integer max that
// vectorizes, exact in any order.
inline float group_amax(const float* v, int G) {
  uint32_t lane[kLanes] = {0};
  for (int j = 0; j < G; j += kLanes)
    for (int k = 0; k < kLanes; ++k) {
      uint32_t bits;
      std::memcpy(&bits, v + j + k, sizeof(bits));
      bits &= 0x7fffffffu;
      lane[k] = bits > lane[k] ? bits : lane[k];
    }
  uint32_t top = 0;
  for (int k = 0; k < kLanes; ++k) top = lane[k] > top ? lane[k] : top;
  if (top >= 0x7f800000u) return loco::quiet_nan();
  float amax;
  std::memcpy(&amax, &top, sizeof(amax));
  return amax;
}

// Packs G codes (G a multiple of 8) into G * BITS / 8 bytes, element j at bit BITS * j (the
// codes of an is_grid format are their fields, int codes go as code_to_field): a byte of
// 8 / BITS fields at a time where whole fields fill a byte (2, 4 and 8 bits), else every 8
// codes as the BITS bytes of one little-endian word (3 bits: a group of 16 in 6 bytes).
template <int BITS, int FMT>
inline void pack_codes(const int8_t* codes, int G, uint8_t* out) {
  const auto field = [](int8_t code) {
    return is_grid(FMT) ? (uint32_t)code : loco::code_to_field(code, BITS);
  };
  if constexpr (8 % BITS == 0) {
    constexpr int kPer = 8 / BITS;
    for (int b = 0; b < G / kPer; ++b) {
      uint32_t byte = 0;
      for (int k = 0; k < kPer; ++k) byte |= field(codes[b * kPer + k]) << (BITS * k);
      out[b] = (uint8_t)byte;
    }
  } else {
    for (int c = 0; c < G / 8; ++c) {
      uint64_t word = 0;
      for (int k = 0; k < 8; ++k) word |= (uint64_t)field(codes[8 * c + k]) << (BITS * k);
      for (int b = 0; b < BITS; ++b) out[BITS * c + b] = (uint8_t)(word >> (8 * b));
    }
  }
}

// The scale of a group whose max |y| is amax, in format FMT (loco::group_scale for int codes,
// loco::mx_scale for MXFP4, whose scale is 2^-k with inv exact, loco::nv_scale under the block
// byte `block` for the is_nv formats, whose codes need no inv), written into slot gcol of the
// scales of its message row. A non-finite group's slot gets NaN (int), 0xFF (MXFP4) or 0x7F
// (is_nv).
template <int BITS, int FMT>
inline loco::GroupScale store_scale(float amax, uint8_t* row_msg, int64_t gcol,
                                    uint32_t block = 0) {
  if constexpr (is_nv(FMT)) {
    const loco::ByteScale s = loco::nv_scale(amax, block, FMT);
    row_msg[loco::kHeaderBytes + gcol] = (uint8_t)s.byte;
    return {s.scale, s.inv, s.finite};
  } else if constexpr (FMT == kMx) {
    const loco::ByteScale s = loco::mx_scale(loco::float_as_bits(amax));
    row_msg[loco::kHeaderBytes + gcol] = (uint8_t)s.byte;
    return {s.scale, s.inv, s.finite};
  } else {
    const loco::GroupScale s = loco::group_scale(amax, loco::qmax(BITS));
    std::memcpy(row_msg + loco::kHeaderBytes + 4 * gcol, &s.scale, sizeof(float));
    return s;
  }
}

// The LoCo update of loco::update_error, as a compile-time case so the quantize loop has no
// branch: nothing kept (feedback off), e' = r (beta 0), e' = r * (1 - beta) (no state applied),
// e' = e * beta + r * (1 - beta).
enum Update : int { kKeepNothing = 0, kKeepResidual = 1, kDampResidual = 2, kBlend = 3 };

// The update case of a call with error storage MODE (loco::update_error's branches).
template <int MODE>
inline int update_case(const EncodeArgs& a) {
  const bool with_error = MODE != kNoError && a.has_error;
  return MODE == kNoError ? kKeepNothing
         : a.beta == 0.0f ? kKeepResidual
         : with_error     ? kBlend
                          : kDampResidual;
}

// Quantizes the G compensated values y of a finite group (format FMT, scale s) into codes
// (is_grid formats: fields), writes the residuals to r and replaces e by the new
// error (per UPDATE). Adds the squared residual and the squared y, in fp64 per lane, to rs and
// is (statistics only: their summation order differs from the reference's).
template <int FMT, bool SR, int UPDATE>
inline void quantize_group(const float* __restrict y, float* __restrict e, float* __restrict r,
                           int8_t* __restrict codes, int G, const loco::GroupScale& s, float qf,
                           const EncodeArgs& a, int64_t off, double* rs, double* is) {
  const float inv = s.inv, scale = s.scale, beta = a.beta, omb = a.omb;
  const uint32_t k0 = a.k0, k1 = a.k1, base = (uint32_t)off;
#pragma omp simd
  for (int j = 0; j < G; ++j) {
    const float v = y[j];
    float t;
    if constexpr (is_nv(FMT)) {
      t = loco::nv_code(v, scale, FMT);
      codes[j] = (int8_t)loco::nv_field(v, scale, FMT);
    } else if constexpr (FMT == kMx) {
      t = loco::fp4_code(v, inv);
      codes[j] = (int8_t)loco::fp4_field(v, inv);
    } else {
      t = SR ? loco::code_stochastic(v, inv, loco::uniform24(base + (uint32_t)j, k0, k1), qf)
             : loco::code_nearest(v, inv, qf);
      codes[j] = (int8_t)t;
    }
    const float res = loco::residual(v, t, scale);
    r[j] = res;
    if (UPDATE == kKeepResidual) e[j] = res;
    if (UPDATE == kDampResidual) e[j] = res * omb;
    if (UPDATE == kBlend) e[j] = e[j] * beta + res * omb;
  }
  int j = 0;
  for (; j + kStatLanes <= G; j += kStatLanes)
    for (int k = 0; k < kStatLanes; ++k) {
      rs[k] += (double)r[j + k] * (double)r[j + k];
      is[k] += (double)y[j + k] * (double)y[j + k];
    }
  for (int k = 0; j + k < G; ++k) {
    rs[k] += (double)r[j + k] * (double)r[j + k];
    is[k] += (double)y[j + k] * (double)y[j + k];
  }
}

#ifdef LOCO_AVX512
// AVX-512 form of encode_group for its common case: fp32 source, nearest rounding, G = 128 (the
// whole group in 8 registers), no/int8/fp32 error state, a finite group. Each vector operation
// is the 16-lane form of the same loco:: function, with the same IEEE operations in the same
// order (the build has no FMA contraction), so the bytes are the generic path's; the property
// tests check it against the reference. Anything else (and a non-finite group) returns false
// before writing, and the generic path runs.
namespace avx512 {

#define LOCO_VEC_INLINE inline __attribute__((always_inline))

constexpr int kV = 16;                  // fp32 lanes per register
constexpr int kVecs = kFastGroup / kV;  // registers per group
constexpr int kPrefetch = 8 * kFastGroup;  // source elements read ahead

LOCO_VEC_INLINE __m512i abs_bits(__m512 v) {
  return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
}

// group_amax over 8 registers: the unsigned max of the sign-cleared bit patterns, NaN if any
// lane is NaN or +-Inf.
LOCO_VEC_INLINE float amax(const __m512 (&v)[kVecs]) {
  __m512i m = abs_bits(v[0]);
  for (int i = 1; i < kVecs; ++i) m = _mm512_max_epu32(m, abs_bits(v[i]));
  const uint32_t top = _mm512_reduce_max_epu32(m);
  if (top >= 0x7f800000u) return loco::quiet_nan();
  float out;
  std::memcpy(&out, &top, sizeof(out));
  return out;
}

// loco::code_nearest(y, inv, q) for the members y of the group whose scale gave inv:
// roundscale(.., nearest) is rintf in the default rounding mode, and the clamp to [-q, q] there
// never acts, so it is left out. Proof: |y| <= amax and inv = fl(q / amax) <= (q / amax)(1 + u),
// u = 2^-24, so |fl(y * inv)| <= q (1 + u)^2 < q + 0.5 and rintf gives at most q; inv = 0 gives
// 0. (Stochastic rounding, floor(t + u) with u up to 1, does need the clamp.)
LOCO_VEC_INLINE __m512 code_nearest(__m512 y, __m512 inv) {
  return _mm512_roundscale_ps(_mm512_mul_ps(y, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// loco::residual: y - (t + 0) * scale.
LOCO_VEC_INLINE __m512 residual(__m512 y, __m512 t, __m512 scale) {
  return _mm512_sub_ps(y, _mm512_mul_ps(_mm512_add_ps(t, _mm512_setzero_ps()), scale));
}

// acc[0..1] += v * v in fp64 (statistics: the fused multiply-add is fine here).
LOCO_VEC_INLINE void square_add(__m512d (&acc)[2], __m512 v) {
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
  acc[0] = _mm512_fmadd_pd(lo, lo, acc[0]);
  acc[1] = _mm512_fmadd_pd(hi, hi, acc[1]);
}

// acc[0..1] += v, widened to fp64.
LOCO_VEC_INLINE void add_halves(__m512d (&acc)[2], __m512 v) {
  acc[0] = _mm512_add_pd(acc[0], _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  acc[1] = _mm512_add_pd(acc[1], _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
}

// Writes the 16 codes t (integral floats in [-q, q]) as loco::code_to_field fields.
template <int BITS>
LOCO_VEC_INLINE void pack16(__m512 t, uint8_t* out) {
  const __m512i field = _mm512_add_epi32(_mm512_cvtps_epi32(t), _mm512_set1_epi32(1 << (BITS - 1)));
  if (BITS == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(field));
  } else if (BITS == 4) {
    // 64-bit lane = f_even | f_odd << 32; OR-ing in itself >> 28 puts f_even | f_odd << 4 in its
    // low byte.
    const __m512i pair = _mm512_or_si512(field, _mm512_srli_epi64(field, 28));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(pair));
  } else {
    // as above twice: 64-bit lanes give f0 | f1 << 2, then 128-bit pairs of them give 4 fields
    const __m512i pair = _mm512_and_si512(_mm512_or_si512(field, _mm512_srli_epi64(field, 30)),
                                          _mm512_set1_epi64(0xf));
    const __m512i quad = _mm512_or_si512(pair, _mm512_bsrli_epi128(_mm512_slli_epi64(pair, 4), 8));
    const __m512i lo = _mm512_maskz_compress_epi64(0x55, quad);  // lanes 0, 2, 4, 6
    const __m128i bytes = _mm512_cvtepi64_epi8(lo);
    std::memcpy(out, &bytes, 4);
  }
}

template <int BITS, int MODE, int UPDATE>
bool encode_group(const float* x, const EncodeArgs& a, int64_t gi, int64_t row, int64_t gcol,
                  double* res_sq, double* in_sq) {
  const int64_t off = gi * kFastGroup;
  const bool with_error = MODE != kNoError && a.has_error;
  __m512 y[kVecs], e[kVecs];
  const __m512 factor = _mm512_set1_ps(a.factor);
  for (int i = 0; i < kVecs; ++i) {
    // an address, not a pointer into the source: it may lie past its end (a prefetch is a hint)
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(x) +
                                               sizeof(float) * (kPrefetch + i * kV)),
                 _MM_HINT_T0);
    y[i] = _mm512_loadu_ps(x + i * kV);
    if (a.scale_input) y[i] = _mm512_mul_ps(y[i], factor);
  }
  if (with_error) {
    if (MODE == kInt8) {
      const __m512 s = _mm512_set1_ps(a.escales[gi]);
      const int8_t* c = a.ecodes + off;
      for (int i = 0; i < kVecs; ++i) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i * kV));
        e[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), s);
      }
    } else {
      for (int i = 0; i < kVecs; ++i) e[i] = _mm512_loadu_ps(a.ef32 + off + i * kV);
    }
    for (int i = 0; i < kVecs; ++i) y[i] = _mm512_add_ps(y[i], e[i]);
  }
  const loco::GroupScale s = loco::group_scale(amax(y), loco::qmax(BITS));
  if (!s.finite) return false;

  uint8_t* row_msg = a.msgs + row * a.P;
  std::memcpy(row_msg + loco::kHeaderBytes + 4 * gcol, &s.scale, sizeof(float));
  uint8_t* packed = row_msg + loco::kHeaderBytes + loco::scale_field_bytes(a.ng, kInt) +
                    gcol * kFastGroup * BITS / 8;
  const __m512 inv = _mm512_set1_ps(s.inv), scale = _mm512_set1_ps(s.scale);
  const __m512 beta = _mm512_set1_ps(a.beta), omb = _mm512_set1_ps(a.omb);
  __m512 r2 = _mm512_setzero_ps(), y2 = _mm512_setzero_ps();  // fp32 sums of squares over the group, lane-wise
  for (int i = 0; i < kVecs; ++i) {
    const __m512 t = code_nearest(y[i], inv);
    pack16<BITS>(t, packed + i * kV * BITS / 8);
    const __m512 res = residual(y[i], t, scale);
    r2 = _mm512_add_ps(r2, _mm512_mul_ps(res, res));
    y2 = _mm512_add_ps(y2, _mm512_mul_ps(y[i], y[i]));
    if (UPDATE == kKeepResidual) e[i] = res;
    if (UPDATE == kDampResidual) e[i] = _mm512_mul_ps(res, omb);
    if (UPDATE == kBlend) e[i] = _mm512_add_ps(_mm512_mul_ps(e[i], beta), _mm512_mul_ps(res, omb));
  }
  __m512d rd[2] = {_mm512_loadu_pd(res_sq), _mm512_loadu_pd(res_sq + 8)};
  __m512d yd[2] = {_mm512_loadu_pd(in_sq), _mm512_loadu_pd(in_sq + 8)};
  if (_mm512_cmp_ps_mask(_mm512_add_ps(r2, y2), _mm512_set1_ps(3.4028234663852886e38f),
                         _CMP_GT_OQ)) {
    // squares beyond the fp32 range (values above ~1e19): redo the sums in fp64
    for (int i = 0; i < kVecs; ++i) {
      square_add(rd, residual(y[i], code_nearest(y[i], inv), scale));
      square_add(yd, y[i]);
    }
  } else {
    add_halves(rd, r2);
    add_halves(yd, y2);
  }
  for (int h = 0; h < 2; ++h) {
    _mm512_storeu_pd(res_sq + 8 * h, rd[h]);
    _mm512_storeu_pd(in_sq + 8 * h, yd[h]);
  }

  if (MODE == kFp32) {
    for (int i = 0; i < kVecs; ++i) _mm512_storeu_ps(a.ef32 + off + i * kV, e[i]);
  } else if (MODE == kInt8) {
    const loco::GroupScale es = loco::group_scale(amax(e), 127);
    int8_t* c = a.ecodes + off;
    if (es.finite) {
      const __m512 einv = _mm512_set1_ps(es.inv);
      for (int i = 0; i < kVecs; ++i)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i * kV),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(code_nearest(e[i], einv))));
    } else {
      _mm512_storeu_si512(c, _mm512_setzero_si512());
      _mm512_storeu_si512(c + 64, _mm512_setzero_si512());
    }
    a.escales[gi] = es.scale;
  }
  return true;
}

// encode_group's dispatch onto the vector path; false: not its case, run the generic path.
template <typename T, int BITS, int FMT, int MODE, bool SR, int GS>
LOCO_VEC_INLINE bool try_encode_group(const T* x, const EncodeArgs& a, int64_t gi, int64_t row,
                             int64_t gcol, int64_t valid, double* rs, double* is) {
  if constexpr (std::is_same_v<T, float> && FMT == kInt && !SR && GS == kFastGroup &&
                MODE != kBf16) {
    if (valid != kFastGroup) return false;
    switch (update_case<MODE>(a)) {
      case kKeepNothing: return encode_group<BITS, MODE, kKeepNothing>(x, a, gi, row, gcol, rs, is);
      case kKeepResidual: return encode_group<BITS, MODE, kKeepResidual>(x, a, gi, row, gcol, rs, is);
      case kDampResidual: return encode_group<BITS, MODE, kDampResidual>(x, a, gi, row, gcol, rs, is);
      default: return encode_group<BITS, MODE, kBlend>(x, a, gi, row, gcol, rs, is);
    }
  } else {
    return false;
  }
}

#undef LOCO_VEC_INLINE
}  // namespace avx512
#endif

#if defined(__AVX2__)
// AVX2 form of the same case as the AVX-512 one (fp32 source, nearest rounding, G = 128,
// no/int8/fp32 error state, a finite group) for 4- and 8-bit int codes (where the build has no
// AVX-512), and of MXFP4 with G = 32 and NVFP4 (every AVX2 build, AVX-512 ones too): the group
// in G / 8 registers of 8 lanes, each operation the 8-lane form of the same loco:: function in
// the same order (no FMA contraction), so the bytes are the generic path's; 2-bit codes, and
// anything else, take the generic path. The property tests check it against the reference.
namespace avx2 {

#define LOCO_VEC_INLINE inline __attribute__((always_inline))

constexpr int kV = 8;                   // fp32 lanes per register
constexpr int kPrefetch = 8 * kFastGroup;  // source elements read ahead

LOCO_VEC_INLINE __m256i abs_bits(__m256 v) {
  return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
}

// group_amax over a group's registers (see the AVX-512 form).
template <int kVecs>
LOCO_VEC_INLINE float amax(const __m256 (&v)[kVecs]) {
  __m256i m = abs_bits(v[0]);
  for (int i = 1; i < kVecs; ++i) m = _mm256_max_epu32(m, abs_bits(v[i]));
  __m128i x = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xB1));
  const uint32_t top = static_cast<uint32_t>(_mm_cvtsi128_si32(x));
  if (top >= 0x7f800000u) return loco::quiet_nan();
  float out;
  std::memcpy(&out, &top, sizeof(out));
  return out;
}

// loco::code_nearest without the clamp (see the AVX-512 form for why it never acts).
LOCO_VEC_INLINE __m256 code_nearest(__m256 y, __m256 inv) {
  return _mm256_round_ps(_mm256_mul_ps(y, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// loco::residual: y - (t + 0) * scale.
LOCO_VEC_INLINE __m256 residual(__m256 y, __m256 t, __m256 scale) {
  return _mm256_sub_ps(y, _mm256_mul_ps(_mm256_add_ps(t, _mm256_setzero_ps()), scale));
}

// acc[0..1] += v * v in fp64.
LOCO_VEC_INLINE void square_add(__m256d (&acc)[2], __m256 v) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  acc[0] = _mm256_add_pd(acc[0], _mm256_mul_pd(lo, lo));
  acc[1] = _mm256_add_pd(acc[1], _mm256_mul_pd(hi, hi));
}

// acc[0..1] += v, widened to fp64.
LOCO_VEC_INLINE void add_halves(__m256d (&acc)[2], __m256 v) {
  acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

// The statistics' fp64 lanes (res_sq and in_sq, 8 each) held in registers by one block encode.
// `add` takes fp32 lane sums of squares (residuals r2, inputs y2) unless they left fp32's range
// (values above ~1e19): then it adds nothing and returns false, and the caller adds the same
// squares in fp64 (square_add on r and y).
struct Sums {
  __m256d r[2], y[2];

  LOCO_VEC_INLINE Sums(const double* res_sq, const double* in_sq)
      : r{_mm256_loadu_pd(res_sq), _mm256_loadu_pd(res_sq + 4)},
        y{_mm256_loadu_pd(in_sq), _mm256_loadu_pd(in_sq + 4)} {}

  LOCO_VEC_INLINE bool add(__m256 r2, __m256 y2) {
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(r2, y2),
                                         _mm256_set1_ps(3.4028234663852886e38f), _CMP_GT_OQ)))
      return false;
    add_halves(r, r2);
    add_halves(y, y2);
    return true;
  }

  LOCO_VEC_INLINE void store(double* res_sq, double* in_sq) const {
    for (int h = 0; h < 2; ++h) {
      _mm256_storeu_pd(res_sq + 4 * h, r[h]);
      _mm256_storeu_pd(in_sq + 4 * h, y[h]);
    }
  }
};

// loco::fp4_code and loco::fp4_field of the 8 values y of a finite MXFP4 group with reciprocal
// scale inv (|y * inv| <= 6). e2m1_round's seven steps are IEEE round-half-even onto E2M1's
// grid, done here directly: below 1 (E2M1's subnormals, spacing 1/2) as round(2a) / 2, from 1 up
// as fp32 rounded to one mantissa bit (add just under half an ulp of that bit plus its parity,
// then clear the bits below it). The magnitude index is round(2a) below 1 and
// 2 + 2 * exponent + mantissa bit from 1 up, which is the fp32 bits shifted right by 22, minus
// 252. The code takes v's sign; the field's sign bit is set for v < -0.25.
LOCO_VEC_INLINE __m256 fp4_code(__m256 y, __m256 inv, __m256i* field) {
  const __m256 v = _mm256_mul_ps(y, inv);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_andnot_ps(sign, v);
  const __m256 twice = _mm256_round_ps(_mm256_add_ps(a, a),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i parity = _mm256_and_si256(_mm256_srli_epi32(bits, 22), _mm256_set1_epi32(1));
  const __m256i up = _mm256_and_si256(
      _mm256_add_epi32(bits, _mm256_add_epi32(parity, _mm256_set1_epi32(0x1fffff))),
      _mm256_set1_epi32(static_cast<int>(0xffc00000u)));
  const __m256 below = _mm256_cmp_ps(a, _mm256_set1_ps(1.0f), _CMP_LT_OQ);
  const __m256 val = _mm256_blendv_ps(_mm256_castsi256_ps(up),
                                      _mm256_mul_ps(twice, _mm256_set1_ps(0.5f)), below);
  const __m256i index =
      _mm256_blendv_epi8(_mm256_sub_epi32(_mm256_srli_epi32(up, 22), _mm256_set1_epi32(252)),
                         _mm256_cvttps_epi32(twice), _mm256_castps_si256(below));
  const __m256 negative = _mm256_cmp_ps(v, _mm256_set1_ps(-0.25f), _CMP_LT_OQ);
  *field = _mm256_or_si256(index, _mm256_and_si256(_mm256_castps_si256(negative),
                                                   _mm256_set1_epi32(8)));
  return _mm256_or_ps(val, _mm256_and_ps(sign, v));
}

// The 32 lanes of f[0..3] as bytes in lane order (each value in 0..255, or in -128..127 with
// SIGNED): two saturating packs, which interleave the 128-bit halves, and one permute that puts
// the 4-byte runs back in order.
template <bool SIGNED>
LOCO_VEC_INLINE __m256i bytes32(const __m256i* f) {
  const __m256i words = SIGNED ? _mm256_packs_epi16(_mm256_packs_epi32(f[0], f[1]),
                                                    _mm256_packs_epi32(f[2], f[3]))
                               : _mm256_packus_epi16(_mm256_packus_epi32(f[0], f[1]),
                                                     _mm256_packus_epi32(f[2], f[3]));
  return _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Writes the 32 BITS-bit fields of f[0..3] (one per 32-bit lane, already in range) in lane
// order: 32 bytes (8 bits), 16 (4 bits, the even lane in the low nibble) or 12 (3 bits, each
// register's 8 fields the 3 bytes of one little-endian word, field k at bit 3k).
template <int BITS>
LOCO_VEC_INLINE void pack32_fields(const __m256i* f, uint8_t* out) {
  if constexpr (BITS == 3) {
    // lane k shifted to bit 3k, then each register's lanes summed (their bits do not overlap):
    // two rounds of pairwise sums leave register i's halves in lane i of each 128-bit half
    const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    __m256i s[4];
    for (int i = 0; i < 4; ++i) s[i] = _mm256_sllv_epi32(f[i], shifts);
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]),
                                        _mm256_hadd_epi32(s[2], s[3]));
    alignas(16) uint32_t words[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(words),
                    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
    for (int i = 0; i < 4; ++i) std::memcpy(out + 3 * i, words + i, 3);  // little-endian
    return;
  }
  const __m256i bytes = bytes32<false>(f);
  if (BITS == 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
  } else {
    // each 16-bit lane: even byte * 1 + odd byte * 16; then one byte per 16-bit lane, the low
    // 8 of each 128-bit half
    const __m256i pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(pairs, pairs), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
  }
}

// encode_group for NG consecutive groups gi .. gi + NG - 1 of one row (columns gcol ..; their
// source, error state, scales and codes lie one after the other). Each stage runs for every
// group before the next stage starts, so that the groups' chains of dependent steps (group
// max, scale, codes, error max, error scale) overlap: one MXFP4 group alone is too short to
// keep the core busy. Returns false before writing any code if a group is non-finite (the
// caller then encodes them one at a time); the bytes are those of NG calls with NG = 1.
template <int BITS, int FMT, int GS, int MODE, int UPDATE, int NG>
bool encode_block(const float* x, const EncodeArgs& a, int64_t gi, int64_t row, int64_t gcol,
                  double* res_sq, double* in_sq) {
  constexpr int kVecs = GS / kV;  // registers per group
  static_assert(kVecs % 4 == 0, "fields and error codes are packed 4 registers at a time");
  const bool with_error = MODE != kNoError && a.has_error;
  __m256 y[NG][kVecs], e[NG][kVecs];
  const __m256 factor = _mm256_set1_ps(a.factor);
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < kVecs; ++i) {
      const float* p = x + g * GS + i * kV;
      // an address, not a pointer into the source: it may lie past its end (a prefetch is a hint)
      if (i % 2 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) +
                                                   sizeof(float) * kPrefetch),
                     _MM_HINT_T0);
      y[g][i] = _mm256_loadu_ps(p);
      if (a.scale_input) y[g][i] = _mm256_mul_ps(y[g][i], factor);
    }
  if (with_error) {
    for (int g = 0; g < NG; ++g) {
      const int64_t off = (gi + g) * GS;
      if (MODE == kInt8) {
        const __m256 s = _mm256_set1_ps(a.escales[gi + g]);
        const int8_t* c = a.ecodes + off;
        for (int i = 0; i < kVecs; ++i) {
          const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i * kV));
          e[g][i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s);
        }
      } else {
        for (int i = 0; i < kVecs; ++i) e[g][i] = _mm256_loadu_ps(a.ef32 + off + i * kV);
      }
      for (int i = 0; i < kVecs; ++i) y[g][i] = _mm256_add_ps(y[g][i], e[g][i]);
    }
  }
  float top[NG];
  for (int g = 0; g < NG; ++g) top[g] = amax<kVecs>(y[g]);
  for (int g = 0; g < NG; ++g)
    if (top[g] != top[g]) return false;  // amax is NaN for a group holding a NaN or an Inf
  uint8_t* row_msg = a.msgs + row * a.P;
  loco::GroupScale s[NG];
  for (int g = 0; g < NG; ++g) s[g] = store_scale<BITS, FMT>(top[g], row_msg, gcol + g);
  uint8_t* packed =
      row_msg + loco::kHeaderBytes + loco::scale_field_bytes(a.ng, FMT) + gcol * GS * BITS / 8;
  const __m256 beta = _mm256_set1_ps(a.beta), omb = _mm256_set1_ps(a.omb);
  __m256 r2 = _mm256_setzero_ps(), y2 = _mm256_setzero_ps();  // fp32 sums of squares, lane-wise
  __m256 t[NG][kVecs];
  for (int g = 0; g < NG; ++g) {
    const __m256 inv = _mm256_set1_ps(s[g].inv), scale = _mm256_set1_ps(s[g].scale);
    __m256i field[kVecs];
    for (int i = 0; i < kVecs; ++i) {
      if constexpr (FMT == kMx) {
        t[g][i] = fp4_code(y[g][i], inv, &field[i]);
      } else {
        t[g][i] = code_nearest(y[g][i], inv);
        field[i] =
            _mm256_add_epi32(_mm256_cvtps_epi32(t[g][i]), _mm256_set1_epi32(1 << (BITS - 1)));
      }
      if (i % 4 == 3)
        pack32_fields<BITS>(field + i - 3, packed + (g * GS + (i - 3) * kV) * BITS / 8);
      const __m256 res = residual(y[g][i], t[g][i], scale);
      r2 = _mm256_add_ps(r2, _mm256_mul_ps(res, res));
      y2 = _mm256_add_ps(y2, _mm256_mul_ps(y[g][i], y[g][i]));
      if (UPDATE == kKeepResidual) e[g][i] = res;
      if (UPDATE == kDampResidual) e[g][i] = _mm256_mul_ps(res, omb);
      if (UPDATE == kBlend)
        e[g][i] = _mm256_add_ps(_mm256_mul_ps(e[g][i], beta), _mm256_mul_ps(res, omb));
    }
  }
  Sums sums(res_sq, in_sq);
  if (!sums.add(r2, y2)) {
    for (int g = 0; g < NG; ++g) {
      const __m256 scale = _mm256_set1_ps(s[g].scale);
      for (int i = 0; i < kVecs; ++i) {
        square_add(sums.r, residual(y[g][i], t[g][i], scale));
        square_add(sums.y, y[g][i]);
      }
    }
  }
  sums.store(res_sq, in_sq);

  if (MODE == kFp32) {
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < kVecs; ++i) _mm256_storeu_ps(a.ef32 + (gi + g) * GS + i * kV, e[g][i]);
  } else if (MODE == kInt8) {
    loco::GroupScale es[NG];
    for (int g = 0; g < NG; ++g) es[g] = loco::group_scale(amax<kVecs>(e[g]), 127);
    for (int g = 0; g < NG; ++g) {
      int8_t* c = a.ecodes + (gi + g) * GS;
      if (es[g].finite) {
        const __m256 einv = _mm256_set1_ps(es[g].inv);
        __m256i codes[kVecs];
        for (int i = 0; i < kVecs; ++i) codes[i] = _mm256_cvtps_epi32(code_nearest(e[g][i], einv));
        for (int i = 0; i < kVecs; i += 4)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * kV), bytes32<true>(codes + i));
      } else {
        std::memset(c, 0, GS);
      }
      a.escales[gi + g] = es[g].scale;
    }
  }
  return true;
}

template <int BITS, int FMT, int GS, int MODE, int UPDATE>
LOCO_VEC_INLINE bool encode_group(const float* x, const EncodeArgs& a, int64_t gi, int64_t row,
                                  int64_t gcol, double* res_sq, double* in_sq) {
  return encode_block<BITS, FMT, GS, MODE, UPDATE, 1>(x, a, gi, row, gcol, res_sq, in_sq);
}

// encode_group's dispatch onto the vector path; false: not its case, run the generic path.
template <typename T, int BITS, int FMT, int MODE, bool SR, int GS>
LOCO_VEC_INLINE bool try_encode_group(const T* x, const EncodeArgs& a, int64_t gi, int64_t row,
                                      int64_t gcol, int64_t valid, double* rs, double* is) {
  if constexpr (std::is_same_v<T, float> && !SR && MODE != kBf16 && BITS != 2 &&
                ((FMT == kInt && GS == kFastGroup) || (FMT == kMx && GS == kMxGroup))) {
    if (valid != GS) return false;
    switch (update_case<MODE>(a)) {
      case kKeepNothing: return encode_group<BITS, FMT, GS, MODE, kKeepNothing>(x, a, gi, row, gcol, rs, is);
      case kKeepResidual: return encode_group<BITS, FMT, GS, MODE, kKeepResidual>(x, a, gi, row, gcol, rs, is);
      case kDampResidual: return encode_group<BITS, FMT, GS, MODE, kDampResidual>(x, a, gi, row, gcol, rs, is);
      default: return encode_group<BITS, FMT, GS, MODE, kBlend>(x, a, gi, row, gcol, rs, is);
    }
  } else {
    return false;
  }
}

// Groups of 32 encoded by one encode_block call on the MXFP4 vector path.
constexpr int kMxBlock = 4;

// The vector path for the kMxBlock groups gi ... of one row (the caller checked that they lie
// in one row and hold valid elements only); false: not its case, or a group is non-finite.
template <typename T, int BITS, int FMT, int MODE, bool SR>
LOCO_VEC_INLINE bool try_encode_block(const T* x, const EncodeArgs& a, int64_t gi, int64_t row,
                                      int64_t gcol, double* rs, double* is) {
  if constexpr (std::is_same_v<T, float> && !SR && MODE != kBf16 && FMT == kMx) {
    constexpr int GS = kMxGroup, NG = kMxBlock;
    switch (update_case<MODE>(a)) {
      case kKeepNothing: return encode_block<BITS, FMT, GS, MODE, kKeepNothing, NG>(x, a, gi, row, gcol, rs, is);
      case kKeepResidual: return encode_block<BITS, FMT, GS, MODE, kKeepResidual, NG>(x, a, gi, row, gcol, rs, is);
      case kDampResidual: return encode_block<BITS, FMT, GS, MODE, kDampResidual, NG>(x, a, gi, row, gcol, rs, is);
      default: return encode_block<BITS, FMT, GS, MODE, kBlend, NG>(x, a, gi, row, gcol, rs, is);
    }
  } else {
    return false;
  }
}

// The grid of an is_nv format FMT (loco::grid), which the vector block encode below reads, and
// its count of midpoints (7 for NVFP4's E2M1, 3 for the 3-bit grids).
template <int FMT>
constexpr loco::Grid kNvGrid = loco::grid(FMT);
template <int FMT>
constexpr int kNvMids = loco::grid_levels(kNvGrid<FMT>) - 1;

// loco::nv_code and loco::nv_field of the 8 values y of a finite group of an is_nv format FMT
// whose midpoints times its scale are mid[...] (NVFP4: 0.25 S, 0.75 S, ..., 5 S): the index
// counts the midpoints below |y| (> on the even ones, >= on the odd ones: ties to the even
// index), the value is the grid's at the index (its magnitudes in one register) with y's sign,
// the field's sign bit (bit 3 of NVFP4's, bit 2 of the 3-bit formats') is set for y < 0 with a
// non-zero index.
template <int FMT>
LOCO_VEC_INLINE __m256 nv_code(__m256 y, const __m256 (&mid)[kNvMids<FMT>], __m256i* field) {
  constexpr loco::Grid g = kNvGrid<FMT>;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_andnot_ps(sign, y);
  __m256i index = _mm256_setzero_si256();
  for (int k = 0; k < kNvMids<FMT>; ++k)
    index = _mm256_sub_epi32(index, _mm256_castps_si256(_mm256_cmp_ps(
                                        a, mid[k], k % 2 ? _CMP_GE_OQ : _CMP_GT_OQ)));
  const __m256 magnitudes = _mm256_setr_ps(g.mag[0], g.mag[1], g.mag[2], g.mag[3], g.mag[4],
                                           g.mag[5], g.mag[6], g.mag[7]);
  const __m256 y_sign = _mm256_and_ps(sign, y);
  // the sign bit moved to the field's, where the index is not 0 (|y| above the first midpoint)
  const __m256i negative = _mm256_and_si256(
      _mm256_srli_epi32(_mm256_castps_si256(y_sign), 32 - g.bits),
      _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(a, mid[0], _CMP_GT_OQ)),
                       _mm256_set1_epi32(static_cast<int>(loco::grid_sign(g)))));
  *field = _mm256_or_si256(index, negative);
  return _mm256_or_ps(_mm256_permutevar8x32_ps(magnitudes, index), y_sign);
}

// The max |v| of 8 groups of two registers each (g[k][0..1], the sign-cleared bit patterns, as
// group_amax orders them), group k in lane k: a transposing reduction (unpack, unpack, swap of
// halves) instead of 8 horizontal ones.
LOCO_VEC_INLINE __m256i group_max_bits8(const __m256 (*g)[2]) {
  __m256i m[8], t[4];
  for (int k = 0; k < 8; ++k) m[k] = _mm256_max_epu32(abs_bits(g[k][0]), abs_bits(g[k][1]));
  for (int k = 0; k < 4; ++k)
    t[k] = _mm256_max_epu32(_mm256_unpacklo_epi32(m[2 * k], m[2 * k + 1]),
                            _mm256_unpackhi_epi32(m[2 * k], m[2 * k + 1]));
  const __m256i u0 = _mm256_max_epu32(_mm256_unpacklo_epi64(t[0], t[1]),
                                      _mm256_unpackhi_epi64(t[0], t[1]));
  const __m256i u1 = _mm256_max_epu32(_mm256_unpacklo_epi64(t[2], t[3]),
                                      _mm256_unpackhi_epi64(t[2], t[3]));
  return _mm256_max_epu32(_mm256_permute2x128_si256(u0, u1, 0x20),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
}

// loco::nv_scale of 8 finite groups of an is_nv format FMT (their max |y| bit patterns `top`)
// under block byte `block`: the E4M3 bytes into `bytes` and the scales S, the same IEEE
// operations per lane.
template <int FMT>
LOCO_VEC_INLINE __m256 nv_scale8(__m256i top, uint32_t block, __m256i* bytes) {
  const __m256 t = _mm256_mul_ps(_mm256_div_ps(_mm256_castsi256_ps(top),
                                               _mm256_set1_ps(loco::grid_top(kNvGrid<FMT>))),
                                 _mm256_set1_ps(loco::bits_as_float((254u - block) << 23)));
  const __m256 m = _mm256_max_ps(
      _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(512.0f)),
                      _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC),
      _mm256_set1_ps(1.0f));
  const __m256i up = _mm256_and_si256(
      _mm256_add_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0xfffff)),
      _mm256_set1_epi32(~0xfffff));
  const __m256i normal = _mm256_or_si256(
      _mm256_slli_epi32(_mm256_sub_epi32(_mm256_srli_epi32(up, 23), _mm256_set1_epi32(120)), 3),
      _mm256_and_si256(_mm256_srli_epi32(up, 20), _mm256_set1_epi32(7)));
  const __m256 sub = _mm256_cmp_ps(t, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
  *bytes = _mm256_blendv_epi8(normal, _mm256_cvttps_epi32(m), _mm256_castps_si256(sub));
  const __m256i exp = _mm256_srli_epi32(*bytes, 3), man = _mm256_and_si256(*bytes,
                                                                           _mm256_set1_epi32(7));
  const __m256 value = _mm256_blendv_ps(
      _mm256_castsi256_ps(_mm256_or_si256(
          _mm256_slli_epi32(_mm256_add_epi32(exp, _mm256_set1_epi32(120)), 23),
          _mm256_slli_epi32(man, 20))),
      _mm256_mul_ps(_mm256_cvtepi32_ps(man), _mm256_set1_ps(0.001953125f)),
      _mm256_castsi256_ps(_mm256_cmpeq_epi32(exp, _mm256_setzero_si256())));
  return _mm256_mul_ps(value, _mm256_set1_ps(loco::bits_as_float(block << 23)));
}

// loco::group_scale(amax, 127) of 8 groups (their max |e| bit patterns `top`): scales and
// reciprocals, a non-finite group's scale NaN and reciprocal 0, a reciprocal that overflows 0.
LOCO_VEC_INLINE __m256 error_scale8(__m256i top, __m256* inv) {
  const __m256 amax = _mm256_castsi256_ps(top), q = _mm256_set1_ps(127.0f);
  const __m256 finite = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800000), top));
  const __m256 r = _mm256_div_ps(q, _mm256_blendv_ps(q, amax, finite));
  const __m256 ok = _mm256_and_ps(
      _mm256_and_ps(finite, _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ)),
      _mm256_cmp_ps(r, _mm256_set1_ps(3.4028234663852886e38f), _CMP_LE_OQ));
  *inv = _mm256_and_ps(r, ok);
  return _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                          _mm256_div_ps(amax, q), finite);
}

// encode_nv_block's vector form for a whole block (kNvBlock groups of 16, every element within
// the row and the source) of an is_nv format FMT, an fp32 source under nearest rounding with
// no, int8 or fp32 error state: each stage for every group before the next, pairs of groups
// packed together (32 fields: 16 bytes of NVFP4's, 12 of the 3-bit formats'), the statistics
// flushed to fp64 after each pair. Returns false before writing anything if a group is
// non-finite (the caller then runs the generic path).
template <int FMT, int MODE, int UPDATE>
bool encode_nv_block(const float* x, const EncodeArgs& a, int64_t row, int64_t b,
                     double* res_sq, double* in_sq) {
  constexpr int G = loco::kNvGroup, NG = loco::kNvBlock, kVecs = G / kV;
  constexpr int kBits = kNvGrid<FMT>.bits, kMids = kNvMids<FMT>;
  static_assert(kVecs == 2 && NG % 2 == 0, "pairs of groups fill the 4 registers of a pack");
  const bool with_error = MODE != kNoError && a.has_error;
  const int64_t gi0 = row * a.ng + b * NG;
  __m256 y[NG][kVecs], e[NG][kVecs];
  const __m256 factor = _mm256_set1_ps(a.factor);
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < kVecs; ++i) {
      y[g][i] = _mm256_loadu_ps(x + g * G + i * kV);
      if (a.scale_input) y[g][i] = _mm256_mul_ps(y[g][i], factor);
    }
  if (with_error) {
    for (int g = 0; g < NG; ++g) {
      const int64_t off = (gi0 + g) * G;
      for (int i = 0; i < kVecs; ++i) {
        if (MODE == kInt8) {
          const __m128i bytes =
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.ecodes + off + i * kV));
          e[g][i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                                  _mm256_set1_ps(a.escales[gi0 + g]));
        } else {
          e[g][i] = _mm256_loadu_ps(a.ef32 + off + i * kV);
        }
        y[g][i] = _mm256_add_ps(y[g][i], e[g][i]);
      }
    }
  }
  const __m256i top[2] = {group_max_bits8(y), group_max_bits8(y + 8)};
  const __m256i both = _mm256_max_epu32(top[0], top[1]);
  uint32_t lanes[kV];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), both);
  uint32_t block_top = 0;
  for (int k = 0; k < kV; ++k) block_top = std::max(block_top, lanes[k]);
  if (block_top >= 0x7f800000u) return false;  // a NaN or an Inf in a group
  const uint32_t block = loco::nv_block_byte(block_top, FMT);
  uint8_t* row_msg = a.msgs + row * a.P;
  row_msg[loco::kHeaderBytes + a.ng + b] = (uint8_t)block;
  alignas(32) float S[NG], mids[kMids][NG];
  alignas(32) uint32_t bytes[NG];
  for (int h = 0; h < 2; ++h) {
    __m256i e4m3;
    const __m256 scales = nv_scale8<FMT>(top[h], block, &e4m3);
    _mm256_store_ps(S + h * kV, scales);
    for (int k = 0; k < kMids; ++k)
      _mm256_store_ps(mids[k] + h * kV,
                      _mm256_mul_ps(scales, _mm256_set1_ps(loco::grid_mid(kNvGrid<FMT>, k))));
    _mm256_store_si256(reinterpret_cast<__m256i*>(bytes + h * kV), e4m3);
  }
  for (int g = 0; g < NG; ++g) row_msg[loco::kHeaderBytes + b * NG + g] = (uint8_t)bytes[g];
  uint8_t* packed =
      row_msg + loco::kHeaderBytes + loco::scale_field_bytes(a.ng, FMT) + b * NG * G * kBits / 8;
  const __m256 beta = _mm256_set1_ps(a.beta), omb = _mm256_set1_ps(a.omb);
  Sums sums(res_sq, in_sq);
  for (int g = 0; g < NG; g += 2) {
    __m256i field[2 * kVecs];
    __m256 t[2][kVecs];
    __m256 r2 = _mm256_setzero_ps(), y2 = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_broadcast_ss(S + g + h);
      __m256 mid[kMids];
      for (int k = 0; k < kMids; ++k) mid[k] = _mm256_broadcast_ss(mids[k] + g + h);
      for (int i = 0; i < kVecs; ++i) {
        const __m256 v = y[g + h][i];
        t[h][i] = nv_code<FMT>(v, mid, &field[h * kVecs + i]);
        const __m256 res = residual(v, t[h][i], scale);
        r2 = _mm256_add_ps(r2, _mm256_mul_ps(res, res));
        y2 = _mm256_add_ps(y2, _mm256_mul_ps(v, v));
        __m256& en = e[g + h][i];
        if (UPDATE == kKeepResidual) en = res;
        if (UPDATE == kDampResidual) en = _mm256_mul_ps(res, omb);
        if (UPDATE == kBlend) en = _mm256_add_ps(_mm256_mul_ps(en, beta), _mm256_mul_ps(res, omb));
      }
    }
    pack32_fields<kBits>(field, packed + g * G * kBits / 8);
    if (!sums.add(r2, y2))
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < kVecs; ++i) {
          square_add(sums.r, residual(y[g + h][i], t[h][i], _mm256_set1_ps(S[g + h])));
          square_add(sums.y, y[g + h][i]);
        }
  }
  sums.store(res_sq, in_sq);
  if (MODE == kFp32) {
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < kVecs; ++i) _mm256_storeu_ps(a.ef32 + (gi0 + g) * G + i * kV, e[g][i]);
  } else if (MODE == kInt8) {
    alignas(32) float einv[NG];
    alignas(32) uint32_t etop[NG];
    for (int h = 0; h < 2; ++h) {
      const __m256i t = group_max_bits8(e + h * kV);
      __m256 inv;
      _mm256_storeu_ps(a.escales + gi0 + h * kV, error_scale8(t, &inv));
      _mm256_store_ps(einv + h * kV, inv);
      _mm256_store_si256(reinterpret_cast<__m256i*>(etop + h * kV), t);
    }
    for (int g = 0; g < NG; g += 2) {
      __m256i codes[2 * kVecs];
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < kVecs; ++i)
          codes[h * kVecs + i] =
              _mm256_cvtps_epi32(code_nearest(e[g + h][i], _mm256_set1_ps(einv[g + h])));
      int8_t* c = a.ecodes + (gi0 + g) * G;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), bytes32<true>(codes));
      for (int h = 0; h < 2; ++h)
        if (etop[g + h] >= 0x7f800000u) std::memset(c + h * G, 0, G);
    }
  }
  return true;
}

// encode_nv_block's dispatch onto the vector path; false: not its case, or a non-finite group.
template <typename T, int FMT, int MODE>
LOCO_VEC_INLINE bool try_encode_nv_block(const T* x, const EncodeArgs& a, int64_t row, int64_t b,
                                         double* rs, double* is) {
  if constexpr (std::is_same_v<T, float> && MODE != kBf16) {
    switch (update_case<MODE>(a)) {
      case kKeepNothing: return encode_nv_block<FMT, MODE, kKeepNothing>(x, a, row, b, rs, is);
      case kKeepResidual: return encode_nv_block<FMT, MODE, kKeepResidual>(x, a, row, b, rs, is);
      case kDampResidual: return encode_nv_block<FMT, MODE, kDampResidual>(x, a, row, b, rs, is);
      default: return encode_nv_block<FMT, MODE, kBlend>(x, a, row, b, rs, is);
    }
  } else {
    return false;
  }
}

#undef LOCO_VEC_INLINE
}  // namespace avx2
#endif

// The source elements of group gcol of `row` that exist (within the row and the source).
inline int64_t valid_elements(const EncodeArgs& a, int64_t row, int64_t gcol, int G) {
  const int64_t col0 = gcol * G;
  const int64_t limit = std::min<int64_t>(G, std::max<int64_t>(0, a.m - col0));
  return std::max<int64_t>(0, std::min<int64_t>(limit, a.numel - (row * a.m + col0)));
}

// Reads group gi (column gcol of `row`) into y: its `valid` source elements times the factor,
// zeros after them, plus the stored error, which e receives (with feedback applied). The
// scratch buffers y and e (G floats) belong to the calling thread; every loop runs over the
// whole group with no data-dependent branch, so it vectorizes.
template <typename T, int MODE>
inline __attribute__((always_inline)) void load_group(const T* src, const EncodeArgs& a, int64_t gi, int64_t row, int64_t gcol, int G,
                int64_t valid, float* y, float* e) {
  const T* x = src + row * a.m + gcol * G;
  const int64_t off = gi * G;
  const bool with_error = MODE != kNoError && a.has_error;
  if (valid == G) {
    if (a.scale_input) {
#pragma omp simd
      for (int j = 0; j < G; ++j) y[j] = static_cast<float>(x[j]) * a.factor;
    } else {
#pragma omp simd
      for (int j = 0; j < G; ++j) y[j] = static_cast<float>(x[j]);
    }
  } else {
    for (int64_t j = 0; j < valid; ++j)
      y[j] = a.scale_input ? static_cast<float>(x[j]) * a.factor : static_cast<float>(x[j]);
    for (int64_t j = valid; j < G; ++j) y[j] = 0.0f;
  }
  if (with_error) {
    if (MODE == kInt8) {
      const float s = a.escales[gi];
      const int8_t* c = a.ecodes + off;
#pragma omp simd
      for (int j = 0; j < G; ++j) e[j] = loco::dequantize_one(c[j], s);
    } else if (MODE == kFp32) {
#pragma omp simd
      for (int j = 0; j < G; ++j) e[j] = a.ef32[off + j];
    } else {
#pragma omp simd
      for (int j = 0; j < G; ++j) e[j] = static_cast<float>(error_bf16(a)[off + j]);
    }
#pragma omp simd
    for (int j = 0; j < G; ++j) y[j] = y[j] + e[j];
  }
}

// Encodes group gi whose compensated values y and error e `load_group` read, given its max
// |y| (`amax`) and, for NVFP4, its block byte: the scale, the packed codes and the error state
// written, the statistics added; returns false if the group is non-finite. Scratch buffers r
// (G floats) and codes (G int8) belong to the calling thread.
template <int BITS, int FMT, int MODE, bool SR>
inline __attribute__((always_inline)) bool emit_group(const EncodeArgs& a, int64_t gi, int64_t row, int64_t gcol, int G, float amax,
                uint32_t block, float* y, float* e, float* r, int8_t* codes, double* res_sq,
                double* in_sq) {
  const int64_t off = gi * G;
  uint8_t* row_msg = a.msgs + row * a.P;
  uint8_t* packed =
      row_msg + loco::kHeaderBytes + loco::scale_field_bytes(a.ng, FMT) + gcol * G * BITS / 8;
  const loco::GroupScale s = store_scale<BITS, FMT>(amax, row_msg, gcol, block);
  if (!s.finite) {
#pragma omp simd
    for (int j = 0; j < G; ++j) codes[j] = 0;
    pack_codes<BITS, FMT>(codes, G, packed);
    return false;
  }
  const float qf = (float)loco::qmax(BITS);
  switch (update_case<MODE>(a)) {
    case kKeepNothing: quantize_group<FMT, SR, kKeepNothing>(y, e, r, codes, G, s, qf, a, off, res_sq, in_sq); break;
    case kKeepResidual: quantize_group<FMT, SR, kKeepResidual>(y, e, r, codes, G, s, qf, a, off, res_sq, in_sq); break;
    case kDampResidual: quantize_group<FMT, SR, kDampResidual>(y, e, r, codes, G, s, qf, a, off, res_sq, in_sq); break;
    default: quantize_group<FMT, SR, kBlend>(y, e, r, codes, G, s, qf, a, off, res_sq, in_sq);
  }
  pack_codes<BITS, FMT>(codes, G, packed);
  if (MODE == kInt8) {
    const loco::GroupScale es = loco::group_scale(group_amax(e, G), 127);
    int8_t* c = a.ecodes + off;
    if (es.finite) {
#pragma omp simd
      for (int j = 0; j < G; ++j) c[j] = (int8_t)loco::code_nearest(e[j], es.inv, 127.0f);
    } else {
#pragma omp simd
      for (int j = 0; j < G; ++j) c[j] = 0;
    }
    a.escales[gi] = es.scale;
  } else if (MODE == kFp32) {
#pragma omp simd
    for (int j = 0; j < G; ++j) a.ef32[off + j] = e[j];
  } else if (MODE == kBf16) {
#pragma omp simd
    for (int j = 0; j < G; ++j) error_bf16_out(a)[off + j] = c10::BFloat16(e[j]);
  }
  return true;
}

// Encodes group gi of the source; returns false if the group is non-finite. Scratch buffers y,
// e, r (G floats) and codes (G int8) belong to the calling thread.
template <typename T, int BITS, int FMT, int MODE, bool SR, int GS>
bool encode_group(const T* src, const EncodeArgs& a, int64_t gi, int64_t row, int64_t gcol,
                  float* y, float* e, float* r, int8_t* codes, double* res_sq, double* in_sq) {
  const int G = GS ? GS : a.G;
  const int64_t valid = valid_elements(a, row, gcol, G);
#if defined(LOCO_AVX512)
  if (avx512::try_encode_group<T, BITS, FMT, MODE, SR, GS>(src + row * a.m + gcol * G, a, gi,
                                                           row, gcol, valid, res_sq, in_sq))
    return true;
#elif defined(LOCO_AVX2)
  if (avx2::try_encode_group<T, BITS, FMT, MODE, SR, GS>(src + row * a.m + gcol * G, a, gi, row,
                                                         gcol, valid, res_sq, in_sq))
    return true;
#endif
  load_group<T, MODE>(src, a, gi, row, gcol, G, valid, y, e);
  return emit_group<BITS, FMT, MODE, SR>(a, gi, row, gcol, G, group_amax(y, G), 0, y, e, r, codes,
                                         res_sq, in_sq);
}

// Encodes block b of `row` (its groups gcol = b * kNvBlock ...) in FMT, an is_nv format: every
// group read first (y and e hold kNvBlock * G floats of the calling thread), the block byte from
// the largest finite group max written after the row's E4M3 bytes, then each group encoded
// under it. Marks bad[g] for each non-finite group g. Whole blocks of an fp32 source take the
// AVX2 block encode where the build has AVX2; every other block the portable loops.
template <typename T, int FMT, int MODE>
void encode_nv_block(const T* src, const EncodeArgs& a, int64_t row, int64_t b, float* y,
                     float* e, float* r, int8_t* codes, uint8_t* bad, double* res_sq,
                     double* in_sq) {
  constexpr int G = loco::kNvGroup;
  const int64_t first = b * loco::kNvBlock;
  const int n = (int)std::min<int64_t>(loco::kNvBlock, a.ng - first);
#if defined(__AVX2__)
  const int64_t end = (first + loco::kNvBlock) * G;  // the block's end within the row
  if (n == loco::kNvBlock && end <= a.m && row * a.m + end <= a.numel &&
      avx2::try_encode_nv_block<T, FMT, MODE>(src + row * a.m + first * G, a, row, b, res_sq,
                                              in_sq)) {
    std::memset(bad + row * a.ng + first, 0, n);
    return;
  }
#endif
  float top[loco::kNvBlock];
  uint32_t block_top = 0;
  for (int g = 0; g < n; ++g) {
    const int64_t gcol = first + g;
    load_group<T, MODE>(src, a, row * a.ng + gcol, row, gcol, G, valid_elements(a, row, gcol, G),
                        y + g * G, e + g * G);
    top[g] = group_amax(y + g * G, G);
    const uint32_t bits = loco::float_as_bits(top[g]);
    if (loco::finite(top[g]) && bits > block_top) block_top = bits;
  }
  const uint32_t block = loco::nv_block_byte(block_top, FMT);
  a.msgs[row * a.P + loco::kHeaderBytes + a.ng + b] = (uint8_t)block;
  constexpr int kBits = loco::grid(FMT).bits;
  for (int g = 0; g < n; ++g) {
    const int64_t gi = row * a.ng + first + g;
    bad[gi] = !emit_group<kBits, FMT, MODE, false>(a, gi, row, first + g, G, top[g], block,
                                                   y + g * G, e + g * G, r, codes, res_sq, in_sq);
  }
}

// encode_all for an is_nv format FMT: each thread takes a contiguous range of the rows' blocks.
template <typename T, int FMT, int MODE>
void encode_nv_all(const T* src, const EncodeArgs& a, uint8_t* bad, double& res_sq,
                   double& in_sq, int threads) {
  constexpr int G = loco::kNvGroup, kSpan = loco::kNvBlock * loco::kNvGroup;
  const int64_t blocks = (a.ng + loco::kNvBlock - 1) / loco::kNvBlock, tasks = a.rows * blocks;
  double rs = 0.0, is = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : rs, is)
  {
    std::vector<float> y(kSpan), e(kSpan), r(G);
    std::vector<int8_t> codes(G);
    double lane_rs[kStatLanes] = {0.0}, lane_is[kStatLanes] = {0.0};
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task)
      encode_nv_block<T, FMT, MODE>(src, a, task / blocks, task % blocks, y.data(), e.data(),
                                    r.data(), codes.data(), bad, lane_rs, lane_is);
    for (int k = 0; k < kStatLanes; ++k) {
      rs += lane_rs[k];
      is += lane_is[k];
    }
  }
  res_sq = rs;
  in_sq = is;
}

template <typename T, int BITS, int FMT, int MODE, bool SR>
void encode_all(const T* src, const EncodeArgs& a, uint8_t* bad, double& res_sq, double& in_sq,
                int threads) {
  constexpr int kFast = FMT == kMx ? kMxGroup : kFastGroup;
  const int64_t groups = a.rows * a.ng;
  double rs = 0.0, is = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : rs, is)
  {
    std::vector<float> y(a.G), e(a.G), r(a.G);
    std::vector<int8_t> codes(a.G);
    double lane_rs[kStatLanes] = {0.0}, lane_is[kStatLanes] = {0.0};
    const auto one = [&](int64_t gi, int64_t row, int64_t gcol) {
      bad[gi] = a.G == kFast
                    ? !encode_group<T, BITS, FMT, MODE, SR, kFast>(src, a, gi, row, gcol, y.data(),
                                                                  e.data(), r.data(), codes.data(),
                                                                  lane_rs, lane_is)
                    : !encode_group<T, BITS, FMT, MODE, SR, 0>(src, a, gi, row, gcol, y.data(),
                                                              e.data(), r.data(), codes.data(),
                                                              lane_rs, lane_is);
    };
    // this thread's contiguous range of groups (as schedule(static)), with its row and column
    // kept as counters
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t lo = groups * t / nt, hi = groups * (t + 1) / nt;
    int64_t row = lo / a.ng, gcol = lo % a.ng;
    for (int64_t gi = lo; gi < hi;) {
      int64_t step = 1;
#if defined(__AVX2__)
      constexpr int64_t NB = avx2::kMxBlock;
      if (FMT == kMx && a.G == kMxGroup && gi + NB <= hi && gcol + NB <= a.ng &&
          (gcol + NB) * kMxGroup <= a.m && row * a.m + (gcol + NB) * kMxGroup <= a.numel) {
        step = NB;
        const T* x = src + row * a.m + gcol * kMxGroup;
        if (avx2::try_encode_block<T, BITS, FMT, MODE, SR>(x, a, gi, row, gcol, lane_rs, lane_is))
          std::memset(bad + gi, 0, NB);
        else
          for (int64_t g = 0; g < NB; ++g) one(gi + g, row, gcol + g);
      }
#endif
      if (step == 1) one(gi, row, gcol);
      gi += step;
      gcol += step;
      while (gcol >= a.ng) {
        gcol -= a.ng;
        ++row;
      }
    }
    for (int k = 0; k < kStatLanes; ++k) {
      rs += lane_rs[k];
      is += lane_is[k];
    }
  }
  res_sq = rs;
  in_sq = is;
}

template <typename T, int BITS, int FMT, bool SR>
void encode_mode(const T* src, const EncodeArgs& a, int64_t mode, uint8_t* bad, double& rs,
                 double& is, int threads) {
  switch (mode) {
    case kNoError: return encode_all<T, BITS, FMT, kNoError, SR>(src, a, bad, rs, is, threads);
    case kInt8: return encode_all<T, BITS, FMT, kInt8, SR>(src, a, bad, rs, is, threads);
    case kFp32: return encode_all<T, BITS, FMT, kFp32, SR>(src, a, bad, rs, is, threads);
    default: return encode_all<T, BITS, FMT, kBf16, SR>(src, a, bad, rs, is, threads);
  }
}

template <typename T, int BITS>
void encode_bits(const T* src, const EncodeArgs& a, int64_t mode, uint8_t* bad, double& rs,
                 double& is, int threads) {
  if (a.stochastic) return encode_mode<T, BITS, kInt, true>(src, a, mode, bad, rs, is, threads);
  return encode_mode<T, BITS, kInt, false>(src, a, mode, bad, rs, is, threads);
}

// encode_nv_all of the call's error storage.
template <typename T, int FMT>
void encode_nv_mode(const T* src, const EncodeArgs& a, double& rs, double& is, int threads) {
  switch (a.mode) {
    case kNoError: return encode_nv_all<T, FMT, kNoError>(src, a, a.nonfinite, rs, is, threads);
    case kInt8: return encode_nv_all<T, FMT, kInt8>(src, a, a.nonfinite, rs, is, threads);
    case kFp32: return encode_nv_all<T, FMT, kFp32>(src, a, a.nonfinite, rs, is, threads);
    default: return encode_nv_all<T, FMT, kBf16>(src, a, a.nonfinite, rs, is, threads);
  }
}

template <typename T>
void encode_typed(const EncodeArgs& a, int64_t bits, int threads) {
  const T* src = static_cast<const T*>(a.src);
  double rs = 0.0, is = 0.0;
  if (a.format == kNv) encode_nv_mode<T, kNv>(src, a, rs, is, threads);
  else if (a.format == kNvInt3) encode_nv_mode<T, kNvInt3>(src, a, rs, is, threads);
  else if (a.format == kNvFp3) encode_nv_mode<T, kNvFp3>(src, a, rs, is, threads);
  else if (a.format == kMx) encode_mode<T, 4, kMx, false>(src, a, a.mode, a.nonfinite, rs, is, threads);
  else if (bits == 2) encode_bits<T, 2>(src, a, a.mode, a.nonfinite, rs, is, threads);
  else if (bits == 4) encode_bits<T, 4>(src, a, a.mode, a.nonfinite, rs, is, threads);
  else encode_bits<T, 8>(src, a, a.mode, a.nonfinite, rs, is, threads);
  a.sums[0] += rs;
  a.sums[1] += is;
}

}  // namespace
}  // namespace lowbitcc_cpu
