// The CPU codec's decodes, framing and Python bindings (C++/OpenMP) built from loco_codec.cuh;
// bit-exact with reference.py. The encode kernels are in cpu_encode.h (see cpu_codec.h).
//
// encode: checks the Python EncodeArgs' buffers against the shapes they imply, then encodes
//   (cpu_encode.h: compensate, quantize, pack codes and scales, update the error).
// decode_sum: decode k messages of one shard and sum them in fp32 in row order (with AVX2, 3-,
//   4- and 8-bit codes 8 at a time, the sum held in a register; 2-bit codes group by group).
// decode_into: decode k messages (row r = elements r*m ...) and write them, cast, into `out`.
//
// Shapes: the source is a flat tensor of `numel` elements seen as `rows` rows of `m` elements
// (element r*m + j; indices >= numel read as 0). ng = ceil(m / G) groups per row, mp = ng * G.
// Messages are uint8 [rows, P]; the header (bytes 0..31) is written by Python. The error state
// is [rows * mp] elements (int8 codes with [rows * ng] fp32 scales, or fp32, or bf16). The
// arguments are loco::EncodeArgs (loco_codec.cuh), filled from Python's EncodeArgs by `encode`.
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <omp.h>
#include <vector>

#include "codec_api.h"
#include "cpu_codec.h"

using namespace lowbitcc_cpu;

namespace {

// A tensor attribute of the Python EncodeArgs (None -> undefined tensor).
at::Tensor tensor_attr(const py::object& args, const char* name) {
  py::object value = args.attr(name);
  return value.is_none() ? at::Tensor() : value.cast<at::Tensor>();
}

void check_buffer(const at::Tensor& t, at::ScalarType dtype, int64_t numel, const char* what) {
  TORCH_CHECK(t.defined(), what, " is missing");
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype,
              what, " must be a contiguous CPU ", c10::toString(dtype), " tensor");
  TORCH_CHECK(t.numel() == numel, what, " holds ", t.numel(), " elements, expected ", numel);
}

// Whether format `fmt` (any integer) is a loco::Format that carries `bits`-bit codes: int codes
// are 2, 4 or 8 bits wide, the other formats' are their grid's fields (lowbitcc/codec/formats.py).
bool takes_bits(int64_t fmt, int64_t bits) {
  if (fmt == kInt) return bits == 2 || bits == 4 || bits == 8;
  return fmt > kInt && fmt <= kNvFp3 && bits == loco::grid((int)fmt).bits;
}

// One encode of `a`, whose buffers are checked (codec_api.h's `encode`).
void encode_checked(const EncodeArgs& a, int64_t bits, int threads, at::ScalarType dtype) {
  for (int64_t r = 0; r < a.rows; ++r) loco::clear_scale_padding(a.msgs + r * a.P, a.ng, a.format);
  switch (dtype) {
    case at::kFloat: return encode_fp32(a, bits, threads);
    case at::kBFloat16: return encode_bf16(a, bits, threads);
    case at::kHalf: return encode_fp16(a, bits, threads);
    default: TORCH_CHECK(false, "source dtype must be float32, bfloat16 or float16");
  }
}

// One encode; `args` is a lowbitcc.codec.interface.EncodeArgs. Every buffer is checked against
// the shapes the arguments imply before anything is written.
void encode(const py::object& args) {
  const at::Tensor source = tensor_attr(args, "source");
  const at::Tensor messages = tensor_attr(args, "messages");
  const at::Tensor nonfinite = tensor_attr(args, "nonfinite");
  const at::Tensor sums = tensor_attr(args, "sums");
  EncodeArgs a{};
  a.rows = args.attr("rows").cast<int64_t>();
  a.m = args.attr("m").cast<int64_t>();
  a.G = args.attr("group_size").cast<int32_t>();
  const int64_t bits = args.attr("bits").cast<int64_t>();
  a.mode = args.attr("mode").cast<int32_t>();
  a.format = args.attr("format_code").cast<int32_t>();
  TORCH_CHECK(takes_bits(a.format, bits), "unknown code format ", a.format, " for ", bits,
              " bits");
  TORCH_CHECK(!is_nv(a.format) || a.G == loco::kNvGroup,
              "nvfp4, nvint3 and nvfp3 groups are 16 elements");
  TORCH_CHECK(a.G > 0 && a.G % 8 == 0, "group size must be a positive multiple of 8");
  TORCH_CHECK(a.rows >= 0 && a.m >= 0, "rows and m must be >= 0");
  TORCH_CHECK(a.mode >= kNoError && a.mode <= kBf16, "unknown error mode ", a.mode);
  TORCH_CHECK(source.defined() && source.dim() == 1 && source.is_contiguous() &&
                  source.device().is_cpu(), "source must be a flat contiguous CPU tensor");
  a.ng = (a.m + a.G - 1) / a.G;
  const int64_t groups = a.rows * a.ng, elements = groups * a.G;
  TORCH_CHECK(messages.defined() && messages.dim() == 2 && messages.size(0) == a.rows &&
                  messages.is_contiguous() && messages.scalar_type() == at::kByte &&
                  messages.device().is_cpu(), "messages must be a contiguous [rows, P] uint8 CPU tensor");
  TORCH_CHECK(messages.size(1) >= loco::kHeaderBytes + loco::scale_field_bytes(a.ng, a.format) +
                  a.ng * a.G * bits / 8, "message rows too short");
  check_buffer(nonfinite, at::kByte, groups, "nonfinite");
  check_buffer(sums, at::kDouble, 2, "sums");
  a.has_error = args.attr("has_error").cast<bool>();
  if (a.mode == kInt8) {
    const at::Tensor codes = tensor_attr(args, "error_codes");
    const at::Tensor scales = tensor_attr(args, "error_scales");
    check_buffer(codes, at::kChar, elements, "error codes");
    check_buffer(scales, at::kFloat, groups, "error scales");
    a.ecodes = codes.data_ptr<int8_t>();
    a.escales = scales.data_ptr<float>();
  } else if (a.mode == kFp32 || a.mode == kBf16) {
    const at::Tensor values = tensor_attr(args, "error_values");
    check_buffer(values, a.mode == kFp32 ? at::kFloat : at::kBFloat16, elements, "error values");
    if (a.mode == kFp32) a.ef32 = values.data_ptr<float>();
    else a.ebf16 = reinterpret_cast<uint16_t*>(values.data_ptr<at::BFloat16>());
  }
  a.src = source.data_ptr();
  a.msgs = messages.data_ptr<uint8_t>();
  a.nonfinite = nonfinite.data_ptr<uint8_t>();
  a.sums = sums.data_ptr<double>();
  a.numel = source.numel();
  a.P = messages.size(1);
  const double factor = args.attr("factor").cast<double>();
  const double beta = args.attr("beta").cast<double>();
  a.factor = (float)factor;
  a.scale_input = factor != 1.0;
  a.beta = (float)beta;
  a.omb = (float)(1.0 - beta);
  a.stochastic = args.attr("stochastic").cast<bool>();
  TORCH_CHECK(a.format == kInt || !a.stochastic, "only int codes round stochastically");
  a.k0 = args.attr("k0").cast<uint32_t>();
  a.k1 = args.attr("k1").cast<uint32_t>();
  const int threads = args.attr("threads").cast<int>();
  encode_checked(a, bits, threads, source.scalar_type());
}

// loco::e4m3_value of every byte, looked up by the decodes instead of computed per group.
struct E4m3Values {
  float v[256];
  E4m3Values() {
    for (int byte = 0; byte < 256; ++byte) v[byte] = loco::e4m3_value((uint32_t)byte);
  }
};
const E4m3Values kE4m3;

// loco::fp4_wire_scale (MXFP4's, and every is_nv format's), the E4M3 value from the table.
inline float fp4_scale(const uint8_t* scales, int64_t ng, int64_t gcol, int fmt) {
  if (fmt == kMx) return loco::e8m0_scale(scales[gcol]);
  return kE4m3.v[scales[gcol]] * loco::e8m0_scale(scales[ng + gcol / loco::kNvBlock]);
}

#if defined(__AVX2__)
// The 8 4-bit fields of the 4 bytes at p (field k in bits 4k .. 4k + 3 of the little-endian
// word), one per 32-bit lane, in order.
inline __m256i fields4x8(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)),
                                            _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                          _mm256_set1_epi32(15));
}

// The 8 3-bit fields of the 3 bytes at p (field k in bits 3k .. 3k + 2 of the little-endian
// word), one per 32-bit lane, in order.
inline __m256i fields3x8(const uint8_t* p) {
  const uint32_t word = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16;
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)),
                                            _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21)),
                          _mm256_set1_epi32(7));
}

// The values of elements j .. j + 7 of one group whose packed codes start at `packed`, times
// the group's scale s, as loco::dequantize_one (int codes: the integer code, converted exactly)
// or loco::field_value (MXFP4, NVFP4: the magnitude from the 8 E2M1 values held in a register,
// the field's sign bit moved onto it; negation commutes exactly with the product; the 3-bit
// formats: the field's signed magnitude, the grid's 4 and their negatives in a register)
// compute them. 4- and 8-bit int codes, 4-bit MXFP4 and NVFP4, 3-bit nvint3 and nvfp3.
template <int BITS, int FMT>
inline __m256 values8(const uint8_t* packed, int j, __m256 s) {
  const __m256i f =
      BITS == 4   ? fields4x8(packed + j / 2)
      : BITS == 3 ? fields3x8(packed + j * 3 / 8)
                  : _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + j)));
  if constexpr (is_grid(FMT) && BITS == 3) {
    constexpr loco::Grid g = loco::grid(FMT);
    static_assert(loco::grid_sign(g) == 4u, "fields of 2 index bits and a sign bit");
    const __m256 signed_values = _mm256_setr_ps(g.mag[0], g.mag[1], g.mag[2], g.mag[3],
                                                -g.mag[0], -g.mag[1], -g.mag[2], -g.mag[3]);
    return _mm256_mul_ps(_mm256_permutevar8x32_ps(signed_values, f), s);
  } else if constexpr (is_fp4(FMT)) {
    constexpr loco::Grid g = loco::grid(FMT);
    const __m256 e2m1 = _mm256_setr_ps(g.mag[0], g.mag[1], g.mag[2], g.mag[3], g.mag[4],
                                       g.mag[5], g.mag[6], g.mag[7]);
    const __m256 sign = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_and_si256(f, _mm256_set1_epi32(8)), 28));
    return _mm256_mul_ps(_mm256_xor_ps(_mm256_permutevar8x32_ps(e2m1, f), sign), s);
  } else {
    return _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_sub_epi32(f, _mm256_set1_epi32(1 << (BITS - 1)))), s);
  }
}

// decode_sum of the vector-decoded wires: for group gcol, the rows' values summed in row order
// 8 at a time in a register, the n <= G valid ones written to o. `scales` holds k floats of
// the calling thread.
template <int BITS, int FMT>
void decode_sum_group(const uint8_t* msgs, int64_t k, int64_t P, int64_t ng, int64_t gcol, int G,
                      int64_t n, float* scales, float* o) {
  const int64_t packed =
      loco::kHeaderBytes + loco::scale_field_bytes(ng, FMT) + gcol * G * BITS / 8;
  for (int64_t r = 0; r < k; ++r) {
    const uint8_t* msg = msgs + r * P;
    if constexpr (is_grid(FMT)) {
      scales[r] = fp4_scale(msg + loco::kHeaderBytes, ng, gcol, FMT);
    } else {
      std::memcpy(scales + r, msg + loco::kHeaderBytes + 4 * gcol, sizeof(float));
    }
  }
  for (int j = 0; j < n; j += 8) {
    __m256 acc = values8<BITS, FMT>(msgs + packed, j, _mm256_set1_ps(scales[0]));
    for (int64_t r = 1; r < k; ++r)
      acc = _mm256_add_ps(acc, values8<BITS, FMT>(msgs + r * P + packed, j,
                                                  _mm256_set1_ps(scales[r])));
    if (j + 8 <= n) {
      _mm256_storeu_ps(o + j, acc);
    } else {
      float tail[8];
      _mm256_storeu_ps(tail, acc);
      std::memcpy(o + j, tail, (n - j) * sizeof(float));
    }
  }
}
#endif

#if defined(__AVX2__)
// decode_sum_group for every group of the shard, on `threads` threads (the group inlined).
template <int BITS, int FMT>
void decode_sum_groups(const uint8_t* msgs, int64_t k, int64_t P, int64_t m, int64_t ng, int G,
                       float* o, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scales(k);
#pragma omp for schedule(static)
    for (int64_t gcol = 0; gcol < ng; ++gcol)
      decode_sum_group<BITS, FMT>(msgs, k, P, ng, gcol, G, std::min<int64_t>(G, m - gcol * G),
                                  scales.data(), o + gcol * G);
  }
}
#endif

// Decodes group gcol of one message into v[0..G) (G a multiple of 8); with AVX2, 4- and 8-bit
// codes 8 at a time (values8).
template <int BITS>
inline void decode_group_bits(const uint8_t* msg, int64_t ng, int64_t gcol, int G, float* v) {
  constexpr int kPer = 8 / BITS;
  float scale;
  std::memcpy(&scale, msg + loco::kHeaderBytes + 4 * gcol, sizeof(float));
  const uint8_t* packed =
      msg + loco::kHeaderBytes + loco::scale_field_bytes(ng, kInt) + gcol * G * BITS / 8;
#if defined(__AVX2__)
  if constexpr (BITS == 4 || BITS == 8) {
    for (int j = 0; j < G; j += 8)
      _mm256_storeu_ps(v + j, values8<BITS, kInt>(packed, j, _mm256_set1_ps(scale)));
    return;
  }
#endif
  for (int b = 0; b < G / kPer; ++b) {
    const uint32_t byte = packed[b];
    for (int k = 0; k < kPer; ++k)
      v[b * kPer + k] = loco::dequantize_one(loco::field_to_code(byte, k, BITS), scale);
  }
}

#if !defined(__AVX2__)
// The signed values of the 8 fields of a 3-bit format's grid (loco::field_value with scale 1).
struct SignedGrid {
  float v[8];
  explicit SignedGrid(int fmt) {
    for (int field = 0; field < 8; ++field) v[field] = loco::field_value((uint32_t)field, 1.0f, fmt);
  }
};
const SignedGrid kNvInt3Values(kNvInt3), kNvFp3Values(kNvFp3);
#endif

// Decodes group gcol of one message in a 3-bit is_nv format FMT (nvint3, nvfp3) into v[0..G)
// (G = kNvGroup): each 8 codes are the 3 bytes of one little-endian word, element k at bit 3k,
// each field's value times the scale, as loco::field_value computes it; with AVX2 8 at a time
// (values8), otherwise from a table of the signed values (x * 1 is exact: the same values).
template <int FMT>
inline void decode_group_3bit(const uint8_t* msg, int64_t ng, int64_t gcol, int G, float* v) {
  const float scale = fp4_scale(msg + loco::kHeaderBytes, ng, gcol, FMT);
  const uint8_t* packed =
      msg + loco::kHeaderBytes + loco::scale_field_bytes(ng, FMT) + gcol * G * 3 / 8;
#if defined(__AVX2__)
  for (int j = 0; j < G; j += 8)
    _mm256_storeu_ps(v + j, values8<3, FMT>(packed, j, _mm256_set1_ps(scale)));
#else
  const SignedGrid& values = FMT == kNvInt3 ? kNvInt3Values : kNvFp3Values;
  for (int c = 0; c < G / 8; ++c) {
    const uint32_t word = (uint32_t)packed[3 * c] | (uint32_t)packed[3 * c + 1] << 8 |
                          (uint32_t)packed[3 * c + 2] << 16;
    for (int k = 0; k < 8; ++k) v[8 * c + k] = values.v[(word >> (3 * k)) & 7u] * scale;
  }
#endif
}

#if !defined(__AVX2__)
// The signed E2M1 values of both fields of every byte (loco::fp4_dequantize with scale 1).
struct Fp4Pairs {
  float v[256][2];
  Fp4Pairs() {
    for (int byte = 0; byte < 256; ++byte)
      for (int k = 0; k < 2; ++k) v[byte][k] = loco::fp4_dequantize((uint32_t)byte, k, 1.0f);
  }
};
const Fp4Pairs kFp4Pairs;
#endif

// Decodes group gcol of one MXFP4 or NVFP4 (fmt) message into v[0..G) (G a multiple of 8):
// each field's value times the scale, as loco::fp4_dequantize computes it; with AVX2 8 at a time
// (values8), otherwise from a table of signed pairs per byte (x * 1 is exact, so it holds the
// same values).
inline void decode_group_fp4(const uint8_t* msg, int64_t ng, int64_t gcol, int G, int fmt,
                             float* v) {
  const float scale = fp4_scale(msg + loco::kHeaderBytes, ng, gcol, fmt);
  const uint8_t* packed = msg + loco::kHeaderBytes + loco::scale_field_bytes(ng, fmt) + gcol * G / 2;
#if defined(__AVX2__)
  for (int j = 0; j < G; j += 8)
    _mm256_storeu_ps(v + j, values8<4, kMx>(packed, j, _mm256_set1_ps(scale)));
#else
  for (int b = 0; b < G / 2; ++b) {
    const float* pair = kFp4Pairs.v[packed[b]];
    v[2 * b] = pair[0] * scale;
    v[2 * b + 1] = pair[1] * scale;
  }
#endif
}

inline void decode_group(const uint8_t* msg, int64_t ng, int64_t gcol, int bits, int fmt, int G,
                         float* v) {
  if (is_fp4(fmt)) decode_group_fp4(msg, ng, gcol, G, fmt, v);
  else if (fmt == kNvInt3) decode_group_3bit<kNvInt3>(msg, ng, gcol, G, v);
  else if (fmt == kNvFp3) decode_group_3bit<kNvFp3>(msg, ng, gcol, G, v);
  else if (bits == 4) decode_group_bits<4>(msg, ng, gcol, G, v);
  else if (bits == 8) decode_group_bits<8>(msg, ng, gcol, G, v);
  else decode_group_bits<2>(msg, ng, gcol, G, v);
}

// Messages may be rows of a larger buffer (a column of gathered messages): each row
// contiguous, rows `stride(0)` bytes apart.
bool rows_contiguous(const at::Tensor& messages) {
  return messages.dim() == 2 && messages.scalar_type() == at::kByte &&
         messages.device().is_cpu() && (messages.size(1) <= 1 || messages.stride(1) == 1) &&
         (messages.size(0) <= 1 || messages.stride(0) >= messages.size(1));
}

void check_messages(const at::Tensor& messages, int64_t m, int64_t bits, int64_t fmt,
                    int64_t G) {
  TORCH_CHECK(rows_contiguous(messages), "messages must be a 2-D uint8 CPU tensor of contiguous rows");
  TORCH_CHECK(takes_bits(fmt, bits), "unknown code format ", fmt, " for ", bits, " bits");
  TORCH_CHECK(G > 0 && G % 8 == 0, "group size must be a positive multiple of 8");
  TORCH_CHECK(!is_nv((int)fmt) || G == loco::kNvGroup,
              "nvfp4, nvint3 and nvfp3 groups are 16 elements");
  const int64_t ng = (m + G - 1) / G;
  TORCH_CHECK(messages.size(1) >= loco::kHeaderBytes + loco::scale_field_bytes(ng, (int)fmt) +
                  ng * G * bits / 8,
              "message rows too short for ", m, " elements");
}

// `out`: fp32 [m] to write, or an empty tensor to allocate one.
at::Tensor decode_sum(const at::Tensor& messages, int64_t m, int64_t bits, int64_t G,
                         int64_t fmt, int64_t threads, at::Tensor out) {
  check_messages(messages, m, bits, fmt, G);
  const int64_t k = messages.size(0), P = messages.stride(0), ng = (m + G - 1) / G;
  if (out.numel() == 0) out = at::empty({m}, at::kFloat);
  TORCH_CHECK(out.numel() == m && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.device().is_cpu(), "decode_sum: out must be a contiguous fp32 CPU tensor of ", m,
              " elements");
  float* o = out.data_ptr<float>();
  const uint8_t* msgs = messages.data_ptr<uint8_t>();
#if defined(__AVX2__)
  if (bits == 3 || bits == 4 || bits == 8) {
    const auto all = fmt == kMx ? decode_sum_groups<4, kMx>
                     : fmt == kNv ? decode_sum_groups<4, kNv>
                     : fmt == kNvInt3 ? decode_sum_groups<3, kNvInt3>
                     : fmt == kNvFp3 ? decode_sum_groups<3, kNvFp3>
                     : bits == 4 ? decode_sum_groups<4, kInt> : decode_sum_groups<8, kInt>;
    all(msgs, k, P, m, ng, (int)G, o, (int)threads);
    return out;
  }
#endif
#pragma omp parallel num_threads((int)threads)
  {
    std::vector<float> acc(G), v(G);
#pragma omp for schedule(static)
    for (int64_t gcol = 0; gcol < ng; ++gcol) {
      decode_group(msgs, ng, gcol, (int)bits, (int)fmt, (int)G, acc.data());
      for (int64_t r = 1; r < k; ++r) {
        decode_group(msgs + r * P, ng, gcol, (int)bits, (int)fmt, (int)G, v.data());
        for (int j = 0; j < G; ++j) acc[j] = acc[j] + v[j];
      }
      const int64_t n = std::min<int64_t>(G, m - gcol * G);
      std::memcpy(o + gcol * G, acc.data(), n * sizeof(float));
    }
  }
  return out;
}

template <typename T>
void decode_into_typed(const at::Tensor& messages, int64_t m, int64_t bits, int64_t G,
                       int64_t fmt, at::Tensor& out, int threads) {
  const int64_t k = messages.size(0), P = messages.stride(0), ng = (m + G - 1) / G;
  const int64_t numel = out.numel();
  T* o = out.data_ptr<T>();
  const uint8_t* msgs = messages.data_ptr<uint8_t>();
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> v(G);
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < k * ng; ++gi) {
      const int64_t r = gi / ng, gcol = gi % ng;
      decode_group(msgs + r * P, ng, gcol, (int)bits, (int)fmt, (int)G, v.data());
      const int64_t base = r * m + gcol * G;
      const int64_t n = std::min<int64_t>(std::min<int64_t>(G, m - gcol * G), numel - base);
      for (int64_t j = 0; j < n; ++j) o[base + j] = static_cast<T>(v[j]);
    }
  }
}

void decode_into(const at::Tensor& messages, int64_t m, int64_t bits, int64_t G,
                 int64_t fmt, at::Tensor out, int64_t threads) {
  check_messages(messages, m, bits, fmt, G);
  TORCH_CHECK(out.is_contiguous() && out.numel() <= messages.size(0) * m,
              "out must be contiguous and hold at most rows * m elements");
  switch (out.scalar_type()) {
    case at::kFloat: return decode_into_typed<float>(messages, m, bits, G, fmt, out, (int)threads);
    case at::kBFloat16: return decode_into_typed<at::BFloat16>(messages, m, bits, G, fmt, out, (int)threads);
    case at::kHalf: return decode_into_typed<at::Half>(messages, m, bits, G, fmt, out, (int)threads);
    default: TORCH_CHECK(false, "out dtype must be float32, bfloat16 or float16");
  }
}

// Partial checksum of words [first, last) of one message body `w` (lowbitcc.codec.wire): the
// keyed product sum N and the sum S of the 32-bit halves, each modulo its width; partial sums of
// disjoint ranges add up to the whole body's.
struct ChecksumSums {
  uint64_t n = 0;
  uint32_t s = 0;
};

ChecksumSums checksum_words(const uint8_t* w, int64_t first, int64_t last, uint64_t k) {
  ChecksumSums out;
  int64_t i = first;
  uint64_t key = (uint64_t)(first + 1) * k;
#if defined(__AVX2__)
  if (last - i >= 4) {
    __m256i keys = _mm256_add_epi64(_mm256_set1_epi64x((long long)key),
                                    _mm256_set_epi64x((long long)(3 * k), (long long)(2 * k),
                                                      (long long)k, 0));
    const __m256i step = _mm256_set1_epi64x((long long)(4 * k));
    __m256i n = _mm256_setzero_si256(), s = _mm256_setzero_si256();
    for (; i + 4 <= last; i += 4) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * i));
      const __m256i y = _mm256_add_epi64(x, keys);
      n = _mm256_add_epi64(n, _mm256_mul_epu32(y, _mm256_srli_epi64(y, 32)));
      s = _mm256_add_epi32(s, x);
      keys = _mm256_add_epi64(keys, step);
    }
    alignas(32) uint64_t nl[4];
    alignas(32) uint32_t sl[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(nl), n);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sl), s);
    for (uint64_t v : nl) out.n += v;
    for (uint32_t v : sl) out.s += v;
    key = (uint64_t)(i + 1) * k;
  }
#endif
  for (; i < last; ++i, key += k) {
    uint64_t x;
    std::memcpy(&x, w + 8 * i, 8);
    const uint64_t y = x + key;
    out.n += (y & 0xffffffffu) * (y >> 32);
    out.s += (uint32_t)x + (uint32_t)(x >> 32);
  }
  return out;
}

// The checksum of each of `rows` messages of P bytes, `stride` bytes apart, over bytes
// kHeaderBytes .. P - 8, as lowbitcc.codec.wire defines it, into out[rows]; `k` is its key
// step K. One parallel loop over every row's chunks of kChunk words; small messages stay on
// the calling thread, where waking OpenMP's team would cost more than the hashing.
void checksum_rows(const uint8_t* msgs, int64_t rows, int64_t P, int64_t stride, uint64_t k,
                   int threads, uint64_t* out) {
  const int64_t words = (P - loco::kHeaderBytes - 8) / 8;
  constexpr int64_t kChunk = 1 << 15;
  const int64_t chunks = std::max<int64_t>(1, (words + kChunk - 1) / kChunk);
  std::vector<ChecksumSums> partial(rows * chunks);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * words > 4 * kChunk)
  for (int64_t job = 0; job < rows * chunks; ++job) {
    const int64_t r = job / chunks, first = (job % chunks) * kChunk;
    partial[job] = checksum_words(msgs + r * stride + loco::kHeaderBytes, first,
                                  std::min(words, first + kChunk), k);
  }
  for (int64_t r = 0; r < rows; ++r) {
    ChecksumSums sum;
    for (int64_t c = 0; c < chunks; ++c) {
      sum.n += partial[r * chunks + c].n;
      sum.s += partial[r * chunks + c].s;
    }
    out[r] = loco::checksum_trailer(sum.n, sum.s);
  }
}

void check_body(const at::Tensor& messages, const char* what) {
  TORCH_CHECK(rows_contiguous(messages), what,
              ": messages must be a 2-D uint8 CPU tensor of contiguous rows");
  const int64_t body = messages.size(1) - loco::kHeaderBytes - 8;
  TORCH_CHECK(body >= 0 && body % 8 == 0, what, ": message bodies of ", body,
              " bytes, not whole words");
}

// The checksum of each row of `messages` (uint8 [rows, P], rows contiguous), as int64 [rows]
// holding the checksums' bits; `step` is the key step K (the bits of a uint64).
at::Tensor checksum(const at::Tensor& messages, int64_t step, int64_t threads) {
  check_body(messages, "checksum");
  at::Tensor out = at::empty({messages.size(0)}, at::kLong);
  checksum_rows(messages.data_ptr<uint8_t>(), messages.size(0), messages.size(1),
                messages.stride(0), (uint64_t)step, (int)threads,
                reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>()));
  return out;
}

// The header of a row: `header` (kHeaderBytes, shard 0, flags 0) with shard `shard` and flags
// `flags` (loco::header_word, as the CUDA frame writes it).
void write_header(uint8_t* row, const std::string& header, int64_t shard, uint32_t flags) {
  uint32_t words[loco::kHeaderBytes / 4];
  std::memcpy(words, header.data(), loco::kHeaderBytes);
  for (int k = 0; k < loco::kHeaderBytes / 4; ++k) {
    const uint32_t w = loco::header_word(words, k, (uint32_t)shard, flags);
    std::memcpy(row + 4 * k, &w, 4);
  }
}

// Completes the messages an encode wrote (uint8 [rows, P], contiguous; the kernel wrote bytes
// kHeaderBytes .. used): row r's header is `header` with shard shards[r] and flags `flags`,
// plus kFlagNonfinite where any of its ng groups' `nonfinite` bytes is set; bytes used .. P - 8
// become zeros, and the last 8 the checksum (zeros without `with_checksum`). Returns whether
// any row is flagged non-finite.
bool frame(at::Tensor messages, const std::string& header, const std::vector<int64_t>& shards,
           const at::Tensor& nonfinite, int64_t used, int64_t flags, bool with_checksum,
           int64_t step, int64_t threads) {
  check_body(messages, "frame");
  const int64_t rows = messages.size(0), P = messages.size(1);
  TORCH_CHECK(messages.is_contiguous() && (int64_t)header.size() == loco::kHeaderBytes &&
                  (int64_t)shards.size() == rows && used >= loco::kHeaderBytes &&
                  used <= P - 8 && nonfinite.is_contiguous() &&
                  nonfinite.scalar_type() == at::kByte && nonfinite.numel() % std::max<int64_t>(rows, 1) == 0,
              "frame: inconsistent arguments");
  const int64_t ng = rows ? nonfinite.numel() / rows : 0;
  uint8_t* msgs = messages.data_ptr<uint8_t>();
  const uint8_t* bad = nonfinite.data_ptr<uint8_t>();
  bool any = false;
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row = msgs + r * P;
    bool row_bad = false;
    for (int64_t g = 0; g < ng; ++g) row_bad |= bad[r * ng + g] != 0;
    any |= row_bad;
    write_header(row, header, shards[r], (uint32_t)flags | (row_bad ? loco::kFlagNonfinite : 0u));
    for (int64_t at = used / 8 * 8; at < P - 8; at += 8) {  // the padding (loco::padded_word)
      uint64_t x;
      std::memcpy(&x, row + at, 8);
      x = loco::padded_word(x, at, used);
      std::memcpy(row + at, &x, 8);
    }
    std::memset(row + P - 8, 0, 8);  // the trailer, until its checksum is written
  }
  if (with_checksum && rows) {
    std::vector<uint64_t> sums(rows);
    checksum_rows(msgs, rows, P, P, (uint64_t)step, (int)threads, sums.data());
    for (int64_t r = 0; r < rows; ++r) std::memcpy(msgs + r * P + P - 8, &sums[r], 8);
  }
  return any;
}

// Whether received messages (uint8 [rows, P], rows contiguous, sizes already checked) belong
// to the call whose header is `header`, row r to shard shards[r]: -1 where a row's header
// differs from it outside the flags, carries a flag other than kFlagNonfinite, or (with
// `with_checksum`) fails its checksum (the caller then finds out which, and why); else 1 if a
// row is flagged non-finite, 0 if none.
int64_t verify(const at::Tensor& messages, const std::string& header,
               const std::vector<int64_t>& shards, bool with_checksum, int64_t step,
               int64_t threads) {
  check_body(messages, "verify");
  const int64_t rows = messages.size(0), P = messages.size(1), stride = messages.stride(0);
  TORCH_CHECK((int64_t)header.size() == loco::kHeaderBytes && (int64_t)shards.size() == rows,
              "verify: inconsistent arguments");
  const uint8_t* msgs = messages.data_ptr<uint8_t>();
  int64_t nonfinite = 0;
  uint8_t want[loco::kHeaderBytes];
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = msgs + r * stride;
    const uint8_t flags = row[loco::kFlagsOffset];
    if (flags & ~loco::kFlagNonfinite) return -1;
    nonfinite |= flags & loco::kFlagNonfinite;
    write_header(want, header, shards[r], flags);
    if (std::memcmp(want, row, loco::kHeaderBytes) != 0) return -1;
  }
  if (with_checksum && rows) {
    std::vector<uint64_t> sums(rows);
    checksum_rows(msgs, rows, P, stride, (uint64_t)step, (int)threads, sums.data());
    for (int64_t r = 0; r < rows; ++r)
      if (std::memcmp(msgs + r * stride + P - 8, &sums[r], 8) != 0) return -1;
  }
  return nonfinite;
}

}  // namespace

// Offset of every field of loco::EncodeArgs, and its size, as this compiler laid it out
// (tests/codec/test_abi.py compares them with lowbitcc.codec.abi.encode_args_dtype()).
py::dict encode_args_layout() {
  py::dict d;
#define LOCO_FIELD(f) d[#f] = offsetof(EncodeArgs, f);
  LOCO_FIELD(src) LOCO_FIELD(msgs) LOCO_FIELD(ecodes) LOCO_FIELD(escales) LOCO_FIELD(ef32)
  LOCO_FIELD(ebf16) LOCO_FIELD(nonfinite) LOCO_FIELD(sums) LOCO_FIELD(invalid) LOCO_FIELD(clear)
  LOCO_FIELD(numel) LOCO_FIELD(rows)
  LOCO_FIELD(m) LOCO_FIELD(ng) LOCO_FIELD(P) LOCO_FIELD(factor) LOCO_FIELD(beta) LOCO_FIELD(omb)
  LOCO_FIELD(G) LOCO_FIELD(scale_input) LOCO_FIELD(has_error) LOCO_FIELD(mode)
  LOCO_FIELD(stochastic) LOCO_FIELD(format) LOCO_FIELD(k0) LOCO_FIELD(k1)
#undef LOCO_FIELD
  d["sizeof"] = sizeof(EncodeArgs);
  return d;
}

// What the other C++ modules of lowbitcc call (codec_api.h), kept for the process.
const lowbitcc_cpu::CodecApi kApi{lowbitcc_cpu::kCodecApiVersion, &encode_checked, &frame, &verify,
                                  &decode_sum, &decode_into};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("encode", &encode, "fused compensate + quantize + pack + error update",
             py::arg("args"));
  module.def("encode_args_layout", &encode_args_layout);
  module.def("decode_sum", &decode_sum, "decode k messages of one shard, sum in row order");
  module.def("decode_into", &decode_into, "decode k messages into a flat output, cast");
  module.def("checksum", &checksum, "checksum of each message's body (lowbitcc.codec.wire)");
  module.def("frame", &frame, "header, flags, padding and checksum of encoded messages");
  module.def("verify", &verify, "whether received messages belong to the call (-1: no)");
  module.attr("vector_path") = kVectorPath;
  module.attr("codec_api") = py::capsule(&kApi, lowbitcc_cpu::kCodecApiName);
}
