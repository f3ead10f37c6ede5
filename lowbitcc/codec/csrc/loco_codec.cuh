// lowbitcc codec arithmetic shared by the C++ CPU kernels and the CUDA kernels.
//
// Every function here is the element-level form of lowbitcc/codec/reference.py, the executable
// specification; implementations built from this header must produce the same bytes. Compile
// without FMA contraction (-ffp-contract=off, nvcc --fmad=false) and without fast-math: each
// operation below is one correctly rounded IEEE fp32 operation, as in the reference.
#pragma once

#if defined(__CUDACC_RTC__)
typedef signed char int8_t;  // NVRTC has no <stdint.h>
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define LOCO_HD __host__ __device__ __forceinline__
#else
#include <math.h>
#define LOCO_HD static inline
#endif

// Unrolls the loop that follows (over a grid's magnitudes: a trip count known at compile time),
// so that a GPU keeps its values in registers and g++ vectorizes the loops that call it (an
// inner loop left rolled stops g++'s vectorizer).
#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(__clang__)
#define LOCO_UNROLL _Pragma("unroll")
#else
#define LOCO_UNROLL _Pragma("GCC unroll 8")
#endif

namespace loco {

constexpr int kHeaderBytes = 32;
// A message's codes start this aligned (the scale field is padded to it: scale_field_bytes), so
// the kernels' 16-byte loads and stores of codes apply wherever the message row is aligned
// (every row is: a message's size is a multiple of it too, lowbitcc/codec/wire.py).
constexpr int kCodesAlign = 16;
// Where a shard header (lowbitcc/codec/wire.py, ShardHeader) holds the fields that differ
// between the rows of one encode: the flags byte and the shard (uint16, little-endian);
// lowbitcc/codec/abi.py checks them against wire.py.
constexpr int kFlagsOffset = 7;
constexpr int kShardOffset = 24;
// ... and the call number (uint32, little-endian), which a replayed graph reads from a place's
// counter on the device (cuda_codec.cu, CallCount).
constexpr int kSeqOffset = 20;
constexpr uint8_t kFlagNonfinite = 1;

// Storage of the error state. lowbitcc/codec/abi.py reads the names and values from this
// enum (kError<Name> -> "<name>", kErrorNone -> feedback off): it is the only definition.
enum ErrorMode : int32_t {
  kErrorNone = 0,
  kErrorInt8 = 1,
  kErrorFp32 = 2,
  kErrorBf16 = 3,
};

// The codes and scales of a compressed message. lowbitcc/codec/abi.py reads the names and values
// from this enum (kFormat<Name> -> "<name>"): it is the only definition.
//   kFormatInt: symmetric b-bit integer codes (b = 2, 4, 8), one fp32 scale per group;
//   kFormatMxfp4: 4-bit FP4 (E2M1) codes, one power-of-two E8M0 scale byte per group (the OCP
//     microscaling MXFP4 element and scale types; see reference.py for the rounding rules);
//   kFormatNvfp4: 4-bit FP4 (E2M1) codes, one FP8 E4M3 scale byte per group of 16 (NVIDIA's
//     NVFP4 element and scale types) under one power-of-two E8M0 byte per kNvBlock groups of a
//     row (where NVFP4 has one fp32 scale per tensor);
//   kFormatNvint3: 3-bit codes, integer magnitudes {0, 1, 2, 3} and a sign, under NVFP4's
//     two-level scales;
//   kFormatNvfp3: 3-bit FP3 (E2M0) codes, magnitudes {0, 1, 2, 4} and a sign, under NVFP4's
//     two-level scales.
enum Format : int32_t {
  kFormatInt = 0,
  kFormatMxfp4 = 1,
  kFormatNvfp4 = 2,
  kFormatNvint3 = 3,
  kFormatNvfp3 = 4,
};

// NVFP4's scales (every is_nv format's): elements per group and groups per block (one E8M0
// byte each).
constexpr int kNvGroup = 16;
constexpr int kNvBlock = 16;

// Whether a format's codes are 4-bit E2M1 fields (reference.FP4_FORMATS).
LOCO_HD constexpr bool is_fp4(int format) {
  return format == kFormatMxfp4 || format == kFormatNvfp4;
}

// Whether a format has NVFP4's two-level scales (reference.TWO_LEVEL): an E4M3 byte per group
// of kNvGroup under an E8M0 byte per kNvBlock groups, codes on its grid (below). The three are
// consecutive, so that this is one comparison where the format is only known at run time (the
// decodes ask it per group).
static_assert(kFormatNvint3 == kFormatNvfp4 + 1 && kFormatNvfp3 == kFormatNvfp4 + 2,
              "is_nv's range");
LOCO_HD constexpr bool is_nv(int format) {
  return (uint32_t)(format - kFormatNvfp4) <= (uint32_t)(kFormatNvfp3 - kFormatNvfp4);
}

// Whether a format's codes are sign-and-magnitude fields of a grid (every format but "int",
// whose codes are offset integers: code_to_field).
LOCO_HD constexpr bool is_grid(int format) { return format != kFormatInt; }

// The element grid of a format whose codes are fields of one (is_grid): the magnitudes by index,
// 2^(bits - 1) of them from 0 up (the rest of `mag` 0), and for the is_nv formats the block
// rule: top * 448 = (1 + block_man * 2^-23) * 2^block_exp, top the largest magnitude
// (nv_block_byte). A field is the magnitude index in bits 0 .. bits - 2 and a sign bit
// bits - 1. The one table of the kernels (lowbitcc/codec/two_level.py's GRIDS is the
// reference's, and lowbitcc/codec/abi.py checks the two agree: keep one row per line).
struct Grid {
  int32_t bits;
  int32_t block_exp;
  uint32_t block_man;
  float mag[8];
};

LOCO_HD constexpr Grid grid(int format) {
  switch (format) {
    case kFormatNvint3: return Grid{3, 10, 0x280000u, {0.0f, 1.0f, 2.0f, 3.0f}};
    case kFormatNvfp3: return Grid{3, 10, 0x600000u, {0.0f, 1.0f, 2.0f, 4.0f}};
    default: return Grid{4, 11, 0x280000u, {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f}};
  }
}  // default: E2M1, the elements of kFormatNvfp4 and kFormatMxfp4

// A grid's magnitudes, its largest, its sign bit, and the midpoint between magnitudes k and
// k + 1 (exact: every magnitude has at most 3 significant bits).
LOCO_HD constexpr int grid_levels(const Grid& g) { return 1 << (g.bits - 1); }
LOCO_HD constexpr float grid_top(const Grid& g) { return g.mag[grid_levels(g) - 1]; }
LOCO_HD constexpr uint32_t grid_sign(const Grid& g) { return 1u << (g.bits - 1); }
LOCO_HD constexpr float grid_mid(const Grid& g, int k) {
  return 0.5f * (g.mag[k] + g.mag[k + 1]);
}

// Each is_nv grid's block rule is its top times E4M3's largest value, 448, checked here.
LOCO_HD constexpr bool block_rule_holds(int format) {
  return grid_top(grid(format)) * 448.0f ==
         (1.0f + (float)grid(format).block_man * 1.1920928955078125e-07f) *  // 2^-23
             (float)(1 << grid(format).block_exp);
}
static_assert(block_rule_holds(kFormatNvfp4) && block_rule_holds(kFormatNvint3) &&
                  block_rule_holds(kFormatNvfp3),
              "a grid's block rule is top * 448");

// The count of g's midpoints times S below a (a >= 0, S > 0): the index of the magnitude nearest
// to a / S in exact arithmetic, ties to the even index (> on the even midpoints, >= on the odd
// ones). No division rounds: a is compared with products that are exact (a midpoint has at most
// 3 significant bits, an NVFP4 scale S at most 4; MXFP4 passes S = 1 and a = |y * inv|).
LOCO_HD uint32_t grid_index(float a, float S, const Grid& g) {
  uint32_t index = 0;
  LOCO_UNROLL
  for (int k = 0; k + 1 < grid_levels(g); ++k)
    index += (uint32_t)(k % 2 ? a >= grid_mid(g, k) * S : a > grid_mid(g, k) * S);
  return index;
}

// g's magnitude at grid_index(a, S, g), as the sum of the steps between magnitudes whose
// midpoints lie below a (exact: every partial sum is a magnitude), branch-free so it vectorizes.
LOCO_HD float grid_round(float a, float S, const Grid& g) {
  float v = 0.0f;
  LOCO_UNROLL
  for (int k = 0; k + 1 < grid_levels(g); ++k)
    v += (float)(k % 2 ? a >= grid_mid(g, k) * S : a > grid_mid(g, k) * S) *
         (g.mag[k + 1] - g.mag[k]);
  return v;
}

// g's magnitude of index `index` (< grid_levels(g)), as the same sum of steps: no array is
// indexed at run time (a GPU would keep it in local memory).
LOCO_HD float grid_value(const Grid& g, uint32_t index) {
  float v = 0.0f;
  LOCO_UNROLL
  for (int k = 1; k < grid_levels(g); ++k)
    v += index >= (uint32_t)k ? g.mag[k] - g.mag[k - 1] : 0.0f;
  return v;
}

// The value of a field of format `format`'s grid (index in the low bits, the sign bit above
// them), times scale.
LOCO_HD float field_value(uint32_t field, float scale, int format) {
  const Grid g = grid(format);
  const float val = grid_value(g, field & (grid_sign(g) - 1u));
  return (field & grid_sign(g) ? -val : val) * scale;
}

// The arguments of one encode, shared by the C++ and the CUDA kernels (passed by value to the
// CUDA kernel). lowbitcc/codec/abi.py reads this struct to lay out the same bytes with NumPy,
// so keep one field per line, fixed-width types and pointers only; the CPU module exports
// every field's offset and the tests compare the two layouts.
//
// The source holds `numel` elements seen as `rows` rows of `m` (indices >= numel read as 0);
// ng = ceil(m / G) groups per row; messages are uint8 [rows, P] (header, padding and trailer
// are written after the encode: Kernels.frame); the error state holds rows * ng * G elements,
// used per `mode`.
struct EncodeArgs {
  const void* src;     // [numel] float, bfloat16 or half (the kernel's T)
  uint8_t* msgs;       // [rows, P]
  int8_t* ecodes;      // kErrorInt8: [rows * ng * G] codes, updated in place
  float* escales;      // kErrorInt8: [rows * ng] scales, updated in place
  float* ef32;         // kErrorFp32: [rows * ng * G], updated in place
  uint16_t* ebf16;     // kErrorBf16: [rows * ng * G] bfloat16 bits, updated in place
  uint8_t* nonfinite;  // [rows * ng] out: 1 where a group held NaN or Inf, else 0
  double* sums;        // [2] in/out: residual^2 and compensated input^2 over finite groups, added
  const uint64_t* invalid;  // nullptr, or a word whose non-zero value voids the error state
                            // (read as has_error 0): the verdict of the call that wrote it
  uint64_t* clear;     // nullptr, or the call's verdict word, which the encode sets to zero
                       // (the call's first encode: the verdict needs no fill of its own)
  int64_t numel;
  int64_t rows;
  int64_t m;
  int64_t ng;
  int64_t P;
  float factor;        // the source is multiplied by it first (PREMUL_SUM, 1/n for AVG)
  float beta;          // LoCo moving-average factor
  float omb;           // 1 - beta, rounded once by the host
  int32_t G;
  int32_t scale_input;  // factor != 1
  int32_t has_error;    // an error state is applied (y = g + e)
  int32_t mode;         // ErrorMode of the state written back
  int32_t stochastic;   // stochastic rounding with keys k0, k1 (uniform24)
  int32_t format;       // Format of the codes and scales
  uint32_t k0;
  uint32_t k1;
};

// Largest code magnitude of the symmetric b-bit quantizer: 1, 7 or 127.
LOCO_HD int qmax(int bits) { return (1 << (bits - 1)) - 1; }

LOCO_HD bool finite(float x) { return x - x == 0.0f; }  // false for NaN and +-Inf

// The quiet NaN torch writes (0x7fc00000), so NaN scales are the same bytes everywhere.
// __int_as_float exists in device code only: nvcc compiles this function for the host too.
LOCO_HD float quiet_nan() {
#if defined(__CUDA_ARCH__)
  return __int_as_float(0x7fc00000);
#else
  return __builtin_nanf("");
#endif
}

// Running max of |v| that propagates NaN, as torch.amax does (branch-free, so it vectorizes;
// the NaN's payload may differ, only its presence matters).
LOCO_HD float amax_step(float amax, float v) {
  float a = fabsf(v);
  return (a > amax || a != a) ? a : amax;
}

// Scale and reciprocal of one group: scale = amax / q, inv = q / amax (0 when amax == 0, and 0
// when q / amax overflows: a group that small encodes as all-zero codes, never as 0 * inf);
// a non-finite group gets scale NaN and inv 0 (all its codes are 0). The C++ codec also carries
// an FP4 group's scale, inv and finiteness (ByteScale below) in this struct.
struct GroupScale {
  float scale;
  float inv;
  bool finite;
};

LOCO_HD GroupScale group_scale(float amax, int q) {
  GroupScale s;
  s.finite = finite(amax);
  float qf = (float)q;
  s.scale = s.finite ? amax / qf : quiet_nan();
  const float inv = (s.finite && amax > 0.0f) ? qf / amax : 0.0f;
  s.inv = finite(inv) ? inv : 0.0f;
  return s;
}

// Clamped code as a float, for finite groups only (a non-finite group's codes are all 0):
// nearest, clamp(round_half_even(y * inv), -q, q) (rintf rounds half to even in the default
// mode), or stochastic, with t = y * inv rounded to fp32 first, then floor(t + u) with u
// uniform in [0, 1) from `uniform24`.
LOCO_HD float code_nearest(float y, float inv, float qf) {
  float t = rintf(y * inv);
  t = t > qf ? qf : t;
  return t < -qf ? -qf : t;
}

LOCO_HD float code_stochastic(float y, float inv, float u, float qf) {
  float t = y * inv;
  t = floorf(t + u);
  t = t > qf ? qf : t;
  return t < -qf ? -qf : t;
}

// Counter-based random bits for stochastic rounding: a 32-bit integer hash (two xor-shift-multiply
// rounds; multipliers below 2^31 so the pure-torch reference can evaluate it in int64 without
// overflow). Element i of a call draws mix32(mix32(i ^ k0) ^ k1); (k0, k1) come from the seed,
// the call's sequence number and the stream (see reference.stream_keys).
LOCO_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x1b873593u;
  x ^= x >> 16;
  return x;
}

// Uniform in [0, 1) with 24 random bits: exact in fp32.
LOCO_HD float uniform24(uint32_t index, uint32_t k0, uint32_t k1) {
  const uint32_t h = mix32(mix32(index ^ k0) ^ k1);
  return (float)(h >> 8) * 5.9604644775390625e-08f;  // 2^-24
}

LOCO_HD float dequantize_one(int code, float scale) { return (float)code * scale; }

// dequantize_one for a code still held as an integral float t (from code_nearest or
// code_stochastic): t + 0.0f turns a -0 code into +0, as the integer code would be, so that
// the residual of a zero code keeps the sign the reference gives it.
LOCO_HD float dequantize_code(float t, float scale) { return (t + 0.0f) * scale; }

// r = y - deQ(q), for the code t of y.
LOCO_HD float residual(float y, float t, float scale) { return y - dequantize_code(t, scale); }

// Stored form of a code: u = code + 2^(b-1), b bits, element k of a byte at bits b*k.
LOCO_HD uint32_t code_to_field(int code, int bits) {
  return (uint32_t)(code + (1 << (bits - 1)));
}

LOCO_HD int field_to_code(uint32_t byte, int k, int bits) {
  uint32_t mask = (1u << bits) - 1u;
  return (int)((byte >> (bits * k)) & mask) - (1 << (bits - 1));
}

// Bytes of one group's scale on the wire.
LOCO_HD int scale_bytes(int format) { return format == kFormatInt ? 4 : 1; }

// Bytes of the scales of a row of ng groups, before the field's padding (is_nv formats: their
// E4M3 bytes, then one E8M0 byte per block of kNvBlock groups, the last block possibly shorter).
LOCO_HD int64_t scale_bytes_used(int64_t ng, int format) {
  return scale_bytes(format) * ng + (is_nv(format) ? (ng + kNvBlock - 1) / kNvBlock : 0);
}

// Bytes of the scale field of a row of ng groups: its scales, then zero bytes up to a multiple
// of kCodesAlign, so that the codes, which start after it (the header's kHeaderBytes being a
// multiple of kCodesAlign too), are kCodesAlign-byte aligned in a message that is.
LOCO_HD int64_t scale_field_bytes(int64_t ng, int format) {
  return (scale_bytes_used(ng, format) + kCodesAlign - 1) / kCodesAlign * kCodesAlign;
}

// Writes the zero padding of the scale field of message row `row_msg` of ng groups (what the
// encode of the row's last group does: the encodes write every byte from the header to `used`).
LOCO_HD void clear_scale_padding(unsigned char* row_msg, int64_t ng, int format) {
  const int64_t end = kHeaderBytes + scale_field_bytes(ng, format);
  for (int64_t b = kHeaderBytes + scale_bytes_used(ng, format); b < end; ++b) row_msg[b] = 0;
}

LOCO_HD float bits_as_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

LOCO_HD uint32_t float_as_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  __builtin_memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

// MXFP4 scale of one group from the bits of its amax with the sign cleared (>= 0x7f800000: the
// group holds a NaN or an Inf). The scale is 2^k with k the least integer such that
// amax <= 6 * 2^k (so no code clips), as E8M0 byte k + 127, at least 1 (2^-126, normal): with
// amax = (1 + f) 2^(e - 127), k = e - 129 when f <= 1/2 (mantissa bits <= 0x400000), else
// e - 128. A non-finite group gets byte 0xFF (E8M0's NaN), scale NaN, inv 0. inv = 2^-k exactly.
// A scale sent as one byte (MXFP4's here, NVFP4's E4M3 in nv_scale): the byte, the scale it
// stands for, its reciprocal where the codes use one (MXFP4), and whether the group is finite.
struct ByteScale {
  uint32_t byte;
  float scale;
  float inv;
  bool finite;
};

LOCO_HD ByteScale mx_scale(uint32_t amax_bits) {
  ByteScale s;
  s.finite = amax_bits < 0x7f800000u;
  const int e = (int)(amax_bits >> 23);
  int k = e - ((amax_bits & 0x7fffffu) <= 0x400000u ? 2 : 1);
  k = k < 1 ? 1 : k;
  s.byte = s.finite ? (uint32_t)k : 0xffu;
  s.scale = s.finite ? bits_as_float(s.byte << 23) : quiet_nan();
  s.inv = s.finite ? bits_as_float((254u - s.byte) << 23) : 0.0f;
  return s;
}

// Scale of an E8M0 byte read off the wire: 2^(byte - 127); 0xFF is NaN (byte 0, which no encode
// writes, reads as 0).
LOCO_HD float e8m0_scale(uint32_t byte) {
  return byte == 0xffu ? quiet_nan() : bits_as_float(byte << 23);
}

// The E2M1 value {0, .5, 1, 1.5, 2, 3, 4, 6} nearest to a in [0, 6], ties to the even index
// (IEEE round-half-even on E2M1's mantissa bit): grid_round on E2M1 with S = 1, a sum of exact
// steps (branch-free, so it vectorizes).
LOCO_HD float e2m1_round(float a) { return grid_round(a, 1.0f, grid(kFormatMxfp4)); }

// The E2M1 value of magnitude index 0..7.
LOCO_HD float e2m1_value(int index) { return grid_value(grid(kFormatMxfp4), (uint32_t)index); }

// The signed E2M1 code of y in a finite group whose scale gave inv (|y * inv| <= 6, exact up to
// subnormal rounding since inv is a power of two): e2m1_round with v's sign (a zero code may be
// -0: dequantize_code turns it into +0, and its field has no sign bit).
LOCO_HD float fp4_code(float y, float inv) {
  const float v = y * inv;
  return copysignf(e2m1_round(fabsf(v)), v);
}

// The 4-bit field of the code fp4_code(y, inv): the magnitude index (the same seven steps as
// e2m1_round, counted) in bits 0..2 and the sign in bit 3, set for a negative non-zero code
// (v below minus the first midpoint, 0.25, since the index is 0 up to it).
LOCO_HD uint32_t fp4_field(float y, float inv) {
  const Grid g = grid(kFormatMxfp4);
  const float v = y * inv;
  return grid_index(fabsf(v), 1.0f, g) + grid_sign(g) * (uint32_t)(v < -grid_mid(g, 0));
}

// The value of the 4-bit field at element k of a byte, times scale.
LOCO_HD float fp4_dequantize(uint32_t byte, int k, float scale) {
  return field_value((byte >> (4 * k)) & 0xfu, scale, kFormatMxfp4);
}

// The block byte of an is_nv format: the E8M0 byte k + 127 with k the least integer such that
// amax <= top * 448 * 2^k (no group scale of the block exceeds E4M3's 448 after division by
// 2^k), at least 1, from the bits of the block's largest finite group amax (0 if none). With
// amax = (1 + f) 2^(e - 127) and top * 448 = (1 + f0) 2^p (the grid's block rule: NVFP4's
// 2688 = 1.3125 * 2^11, f0's mantissa bits 0x280000): byte e - p when f <= f0, else e - p + 1.
LOCO_HD uint32_t nv_block_byte(uint32_t amax_bits, int format) {
  const Grid g = grid(format);
  const int e = (int)(amax_bits >> 23);
  const int k = e - ((amax_bits & 0x7fffffu) <= g.block_man ? g.block_exp : g.block_exp - 1);
  return k < 1 ? 1u : (uint32_t)k;
}

// The FP8 E4M3 value of a byte below 0x7F (bias 7, 3 mantissa bits, subnormals m * 2^-9), exact;
// 0x7F (and above) is NaN.
LOCO_HD float e4m3_value(uint32_t byte) {
  if (byte >= 0x7fu) return quiet_nan();
  const uint32_t exp = byte >> 3, man = byte & 7u;
  if (exp == 0) return (float)man * 0.001953125f;  // 2^-9
  return bits_as_float((exp + 120u) << 23 | man << 20);
}

// A group's scale in an is_nv format, S = E4M3 * 2^(block byte - 127), and its E4M3 byte:
// t = (amax / top) * 2^(127 - block byte) (a correctly rounded division by the grid's largest
// magnitude, then a product by a power of two) rounded up to the next E4M3 value, at least 2^-9
// (so S > 0 and a zero group encodes as zeros; t <= 448 by the block byte's rule). A non-finite
// group gets byte 0x7F (E4M3's NaN) and S NaN. S is exact in fp32 (4 significant bits, at least
// 2^-135). inv is 0: the codes compare |y| with the midpoints times S (grid_index).
LOCO_HD ByteScale nv_scale(float amax, uint32_t block_byte, int format) {
  ByteScale s;
  s.inv = 0.0f;
  s.finite = finite(amax);
  const float t = (amax / grid_top(grid(format))) * bits_as_float((254u - block_byte) << 23);
  uint32_t byte;
  if (t < 0.015625f) {  // below 2^-6: E4M3 subnormals m * 2^-9, m = 1..8 (8 is 2^-6's byte)
    const float m = ceilf(t * 512.0f);
    byte = m < 1.0f ? 1u : (uint32_t)m;
  } else {
    const uint32_t up = (float_as_bits(t) + 0xfffffu) & ~0xfffffu;
    byte = ((up >> 23) - 120u) << 3 | ((up >> 20) & 7u);
  }
  s.byte = s.finite ? byte : 0x7fu;
  s.scale = s.finite ? e4m3_value(byte) * bits_as_float(block_byte << 23) : quiet_nan();
  return s;
}

// The field of y in a finite group of scale S of an is_nv format (the magnitude index of
// grid_index in the low bits, the sign bit above them set for a negative non-zero code: NVFP4's
// index in bits 0..2 and sign in bit 3, the 3-bit formats' in bits 0..1 and 2) and its signed
// magnitude (dequantize_code(value, S) decodes it).
LOCO_HD uint32_t nv_field(float y, float S, int format) {
  const Grid g = grid(format);
  const uint32_t index = grid_index(fabsf(y), S, g);
  return index + grid_sign(g) * (uint32_t)(y < 0.0f && index > 0u);
}

LOCO_HD float nv_code(float y, float S, int format) {
  return copysignf(grid_round(fabsf(y), S, grid(format)), y);
}

// The scale of group gcol of a message in a format with byte scales (`scales`: the message's
// scale field after its header, ng groups a row): MXFP4's E8M0 byte, or an is_nv format's E4M3
// byte times its block's E8M0 byte (an exact product); NaN for a NaN byte.
LOCO_HD float fp4_wire_scale(const uint8_t* scales, int64_t ng, int64_t gcol, int format) {
  if (format == kFormatMxfp4) return e8m0_scale(scales[gcol]);
  return e4m3_value(scales[gcol]) * e8m0_scale(scales[ng + gcol / kNvBlock]);
}

// LoCo error update. has_error: an error state was applied (y = g + e).
// Matches reference.compensate_quantize: beta == 0 -> r; no state -> r * (1 - beta);
// else e * beta + r * (1 - beta), each product and the sum rounded separately.
LOCO_HD float update_error(float e, float r, float beta, float one_minus_beta, bool has_error) {
  if (beta == 0.0f) return r;
  if (!has_error) return r * one_minus_beta;
  float a = e * beta;
  float b = r * one_minus_beta;
  return a + b;
}

// The checksum trailer from a message body's sums (lowbitcc/codec/wire.py): S mod 2^32 in the
// low half, lo32(N) ^ hi32(N) in the high half.
LOCO_HD uint64_t checksum_trailer(uint64_t n, uint64_t s) {
  return (s & 0xffffffffull) | (((n ^ (n >> 32)) & 0xffffffffull) << 32);
}

// A body word of a message with its bytes from `used` on cleared (the padding before the
// trailer): `x` is the little-endian 64-bit word at byte offset `at` of its row.
LOCO_HD uint64_t padded_word(uint64_t x, int64_t at, int64_t used) {
  if (at + 8 <= used) return x;
  if (at >= used) return 0;
  return x & ((1ull << (8 * (used - at))) - 1ull);
}

// Word k (bytes 4k .. 4k+3, little-endian) of a row's header: the call's header `header`
// (shard 0, flags 0) with the row's shard and flags (kFlagsOffset and kShardOffset are the
// high byte of word 1 and the low half of word 6).
static_assert(kFlagsOffset % 4 == 3 && kShardOffset % 4 == 0 && kSeqOffset % 4 == 0,
              "header_word's layout");
LOCO_HD uint32_t header_word(const uint32_t* header, int k, uint32_t shard, uint32_t flags) {
  uint32_t w = header[k];
  if (k == kFlagsOffset / 4) w = (w & 0x00ffffffu) | (flags & 0xffu) << 24;
  if (k == kShardOffset / 4) w = (w & 0xffff0000u) | (shard & 0xffffu);
  return w;
}

}  // namespace loco
