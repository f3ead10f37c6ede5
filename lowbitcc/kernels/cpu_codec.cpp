// Fused CPU codec kernels (C++/OpenMP) built from loco_codec.cuh; bit-exact with reference.py.
//
// encode: one pass per group of G elements: read the source (fp32/bf16/fp16, times `factor`),
//   add the stored error, group max, quantize, pack codes and the fp32 scale straight into the
//   message rows, LoCo-update the error and store it back (int8 + scale, fp32 or bf16) in place.
// decode_sum: decode k messages of one shard and sum them in fp32 in row order.
// decode_into: decode k messages (row r = elements r*m ...) and write them, cast, into `out`.
//
// Shapes: the source is a flat tensor of `numel` elements seen as `rows` rows of `m` elements
// (element r*m + j; indices >= numel read as 0). ng = ceil(m / G) groups per row, mp = ng * G.
// Messages are uint8 [rows, P]; the header (bytes 0..31) is written by Python. The error state
// is [rows * mp] elements (int8 codes with [rows * ng] fp32 scales, or fp32, or bf16).
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "loco_codec.cuh"

namespace {

enum ErrorMode : int64_t { kNoError = 0, kInt8 = 1, kFp32 = 2, kBf16 = 3 };

template <typename T>
struct Encoder {
  const T* src;
  int64_t numel, rows, m, ng, P;
  float factor;
  bool scale_input;
  uint8_t* msgs;
  int64_t mode;
  bool has_error;
  int8_t* ecodes;
  float* escales;
  float* ef32;
  at::BFloat16* ebf16;
  float beta, omb;
  int bits, G;

  // Encodes group gi; returns false if the group is non-finite.
  bool group(int64_t gi, float* y, float* e, int8_t* codes, double& res_sq, double& in_sq) const {
    const int64_t row = gi / ng, gcol = gi % ng;
    const int64_t col0 = gcol * G;
    const int q = loco::qmax(bits);
    const int64_t limit = std::min<int64_t>(G, std::max<int64_t>(0, m - col0));
    const int64_t base = row * m + col0;
    const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(limit, numel - base));
    for (int64_t j = 0; j < valid; ++j) {
      float x = static_cast<float>(src[base + j]);
      y[j] = scale_input ? x * factor : x;
    }
    for (int64_t j = valid; j < G; ++j) y[j] = 0.0f;
    if (has_error) {
      const int64_t off = gi * G;
      if (mode == kInt8) {
        const float s = escales[gi];
        for (int j = 0; j < G; ++j) e[j] = loco::dequantize_one(ecodes[off + j], s);
      } else if (mode == kFp32) {
        for (int j = 0; j < G; ++j) e[j] = ef32[off + j];
      } else {
        for (int j = 0; j < G; ++j) e[j] = static_cast<float>(ebf16[off + j]);
      }
      for (int j = 0; j < G; ++j) y[j] = y[j] + e[j];
    }
    float amax = 0.0f;
    for (int j = 0; j < G; ++j) amax = loco::amax_step(amax, y[j]);
    const loco::GroupScale s = loco::group_scale(amax, q);
    for (int j = 0; j < G; ++j) codes[j] = (int8_t)loco::quantize_one(y[j], s.inv, q, s.finite);

    uint8_t* row_msg = msgs + row * P;
    std::memcpy(row_msg + loco::kHeaderBytes + 4 * gcol, &s.scale, sizeof(float));
    uint8_t* packed = row_msg + loco::kHeaderBytes + 4 * ng + col0 * bits / 8;
    const int per_byte = 8 / bits;
    for (int b = 0; b < G / per_byte; ++b) {
      uint32_t byte = 0;
      for (int k = 0; k < per_byte; ++k)
        byte |= loco::code_to_field(codes[b * per_byte + k], bits) << (bits * k);
      packed[b] = (uint8_t)byte;
    }

    if (s.finite) {
      double rs = 0.0, is = 0.0;
      for (int j = 0; j < G; ++j) {
        const float r = y[j] - loco::dequantize_one(codes[j], s.scale);
        rs += (double)r * r;
        is += (double)y[j] * y[j];
      }
      res_sq += rs;
      in_sq += is;
    }
    if (mode == kNoError) return s.finite;

    // New error, written over the old one of this group.
    float eamax = 0.0f;
    for (int j = 0; j < G; ++j) {
      const float r = y[j] - loco::dequantize_one(codes[j], s.scale);
      const float ne = loco::update_error(has_error ? e[j] : 0.0f, r, beta, omb, has_error);
      e[j] = ne;
      eamax = loco::amax_step(eamax, ne);
    }
    const int64_t off = gi * G;
    if (mode == kInt8) {
      const loco::GroupScale es = loco::group_scale(eamax, 127);
      for (int j = 0; j < G; ++j)
        ecodes[off + j] = (int8_t)loco::quantize_one(e[j], es.inv, 127, es.finite);
      escales[gi] = es.scale;
    } else if (mode == kFp32) {
      for (int j = 0; j < G; ++j) ef32[off + j] = e[j];
    } else {
      for (int j = 0; j < G; ++j) ebf16[off + j] = at::BFloat16(e[j]);
    }
    return s.finite;
  }
};

template <typename T>
std::vector<double> encode_typed(const torch::Tensor& source, int64_t rows, int64_t m,
                                 double factor, torch::Tensor& messages, torch::Tensor& nonfinite,
                                 int64_t mode, bool has_error, torch::Tensor& ecodes,
                                 torch::Tensor& escales, torch::Tensor& eflt, double beta,
                                 int64_t bits, int64_t G, int threads) {
  Encoder<T> enc;
  enc.src = source.data_ptr<T>();
  enc.numel = source.numel();
  enc.rows = rows;
  enc.m = m;
  enc.ng = (m + G - 1) / G;
  enc.P = messages.size(1);
  enc.factor = (float)factor;
  enc.scale_input = factor != 1.0;
  enc.msgs = messages.data_ptr<uint8_t>();
  enc.mode = mode;
  enc.has_error = has_error;
  enc.ecodes = mode == kInt8 ? ecodes.data_ptr<int8_t>() : nullptr;
  enc.escales = mode == kInt8 ? escales.data_ptr<float>() : nullptr;
  enc.ef32 = mode == kFp32 ? eflt.data_ptr<float>() : nullptr;
  enc.ebf16 = mode == kBf16 ? eflt.data_ptr<at::BFloat16>() : nullptr;
  enc.beta = (float)beta;
  enc.omb = (float)(1.0 - beta);
  enc.bits = (int)bits;
  enc.G = (int)G;
  const int64_t groups = rows * enc.ng;
  std::vector<uint8_t> bad(groups, 0);
  double res_sq = 0.0, in_sq = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : res_sq, in_sq)
  {
    std::vector<float> y(G), e(G);
    std::vector<int8_t> codes(G);
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < groups; ++gi)
      bad[gi] = !enc.group(gi, y.data(), e.data(), codes.data(), res_sq, in_sq);
  }
  uint8_t* nf = nonfinite.data_ptr<uint8_t>();
  for (int64_t r = 0; r < rows; ++r)
    nf[r] = std::any_of(bad.begin() + r * enc.ng, bad.begin() + (r + 1) * enc.ng,
                        [](uint8_t b) { return b != 0; });
  return {res_sq, in_sq};
}

std::vector<double> encode(const torch::Tensor& source, int64_t rows, int64_t m, double factor,
                           torch::Tensor messages, torch::Tensor nonfinite, int64_t mode,
                           bool has_error, torch::Tensor ecodes, torch::Tensor escales,
                           torch::Tensor eflt, double beta, int64_t bits, int64_t G,
                           int64_t threads) {
  TORCH_CHECK(source.is_contiguous() && source.device().is_cpu(), "source must be contiguous CPU");
  TORCH_CHECK(messages.dim() == 2 && messages.size(0) == rows && messages.is_contiguous(),
              "messages must be a contiguous [rows, P] uint8 tensor");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
  TORCH_CHECK(G > 0 && G % 8 == 0, "group size must be a positive multiple of 8");
  const int64_t ng = (m + G - 1) / G;
  TORCH_CHECK(messages.size(1) >= loco::kHeaderBytes + 4 * ng + ng * G * bits / 8,
              "message rows too short");
  switch (source.scalar_type()) {
    case at::kFloat:
      return encode_typed<float>(source, rows, m, factor, messages, nonfinite, mode, has_error,
                                 ecodes, escales, eflt, beta, bits, G, (int)threads);
    case at::kBFloat16:
      return encode_typed<at::BFloat16>(source, rows, m, factor, messages, nonfinite, mode,
                                        has_error, ecodes, escales, eflt, beta, bits, G, (int)threads);
    case at::kHalf:
      return encode_typed<at::Half>(source, rows, m, factor, messages, nonfinite, mode, has_error,
                                    ecodes, escales, eflt, beta, bits, G, (int)threads);
    default:
      TORCH_CHECK(false, "source dtype must be float32, bfloat16 or float16");
  }
}

// Decodes group gcol of message row r into v[0..G).
inline void decode_group(const uint8_t* msg, int64_t ng, int64_t gcol, int bits, int G, float* v) {
  float scale;
  std::memcpy(&scale, msg + loco::kHeaderBytes + 4 * gcol, sizeof(float));
  const uint8_t* packed = msg + loco::kHeaderBytes + 4 * ng + gcol * G * bits / 8;
  const int per_byte = 8 / bits;
  for (int j = 0; j < G; ++j)
    v[j] = loco::dequantize_one(loco::field_to_code(packed[j / per_byte], j % per_byte, bits), scale);
}

void check_messages(const torch::Tensor& messages, int64_t m, int64_t bits, int64_t G) {
  TORCH_CHECK(messages.dim() == 2 && messages.scalar_type() == at::kByte &&
                  messages.is_contiguous(), "messages must be a contiguous 2-D uint8 tensor");
  const int64_t ng = (m + G - 1) / G;
  TORCH_CHECK(messages.size(1) >= loco::kHeaderBytes + 4 * ng + ng * G * bits / 8,
              "message rows too short for ", m, " elements");
}

torch::Tensor decode_sum(const torch::Tensor& messages, int64_t m, int64_t bits, int64_t G,
                         int64_t threads) {
  check_messages(messages, m, bits, G);
  const int64_t k = messages.size(0), P = messages.size(1), ng = (m + G - 1) / G;
  torch::Tensor out = torch::empty({m}, torch::kFloat);
  float* o = out.data_ptr<float>();
  const uint8_t* msgs = messages.data_ptr<uint8_t>();
#pragma omp parallel num_threads((int)threads)
  {
    std::vector<float> acc(G), v(G);
#pragma omp for schedule(static)
    for (int64_t gcol = 0; gcol < ng; ++gcol) {
      decode_group(msgs, ng, gcol, (int)bits, (int)G, acc.data());
      for (int64_t r = 1; r < k; ++r) {
        decode_group(msgs + r * P, ng, gcol, (int)bits, (int)G, v.data());
        for (int j = 0; j < G; ++j) acc[j] = acc[j] + v[j];
      }
      const int64_t n = std::min<int64_t>(G, m - gcol * G);
      std::memcpy(o + gcol * G, acc.data(), n * sizeof(float));
    }
  }
  return out;
}

template <typename T>
void decode_into_typed(const torch::Tensor& messages, int64_t m, int64_t bits, int64_t G,
                       torch::Tensor& out, int threads) {
  const int64_t k = messages.size(0), P = messages.size(1), ng = (m + G - 1) / G;
  const int64_t numel = out.numel();
  T* o = out.data_ptr<T>();
  const uint8_t* msgs = messages.data_ptr<uint8_t>();
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> v(G);
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < k * ng; ++gi) {
      const int64_t r = gi / ng, gcol = gi % ng;
      decode_group(msgs + r * P, ng, gcol, (int)bits, (int)G, v.data());
      const int64_t base = r * m + gcol * G;
      const int64_t n = std::min<int64_t>(std::min<int64_t>(G, m - gcol * G), numel - base);
      for (int64_t j = 0; j < n; ++j) o[base + j] = static_cast<T>(v[j]);
    }
  }
}

void decode_into(const torch::Tensor& messages, int64_t m, int64_t bits, int64_t G,
                 torch::Tensor out, int64_t threads) {
  check_messages(messages, m, bits, G);
  TORCH_CHECK(out.is_contiguous() && out.numel() <= messages.size(0) * m,
              "out must be contiguous and hold at most rows * m elements");
  switch (out.scalar_type()) {
    case at::kFloat: return decode_into_typed<float>(messages, m, bits, G, out, (int)threads);
    case at::kBFloat16: return decode_into_typed<at::BFloat16>(messages, m, bits, G, out, (int)threads);
    case at::kHalf: return decode_into_typed<at::Half>(messages, m, bits, G, out, (int)threads);
    default: TORCH_CHECK(false, "out dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("encode", &encode, "fused compensate + quantize + pack + error update");
  module.def("decode_sum", &decode_sum, "decode k messages of one shard, sum in row order");
  module.def("decode_into", &decode_into, "decode k messages into a flat output, cast");
}
