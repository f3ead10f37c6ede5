// The C++ CPU codec's entry points for lowbitcc's other C++ modules (the steady runner,
// lowbitcc/backend/csrc/steady_runner.h), which call them without Python. The codec's module
// (cpu_codec.cpp) hands a `CodecApi` it keeps for the process over as the capsule `codec_api`
// (named kCodecApiName); a module that takes it checks `version` against kCodecApiVersion.
// Every function is the one the codec's Python bindings call, with the same arguments and
// contracts (cpu_codec.cpp): what Python checks before calling them, the caller checks.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "loco_codec.cuh"

namespace lowbitcc_cpu {

constexpr int kCodecApiVersion = 2;
constexpr const char* kCodecApiName = "lowbitcc_cpu.codec_api";

struct CodecApi {
  int version;
  // One encode of `a` (loco::EncodeArgs, its buffers checked by the caller) of a source of
  // `dtype` (float32, bfloat16 or float16): `bits`-bit codes on `threads` OpenMP threads.
  void (*encode)(const loco::EncodeArgs& a, int64_t bits, int threads, at::ScalarType dtype);
  // Frames encoded messages (uint8 [rows, P], contiguous): each row's header is `header` with
  // its shard and flags, its padding zero and its checksum written; whether a row is non-finite.
  bool (*frame)(at::Tensor messages, const std::string& header, const std::vector<int64_t>& shards,
                const at::Tensor& nonfinite, int64_t used, int64_t flags, bool with_checksum,
                int64_t step, int64_t threads);
  // Whether received messages (rows contiguous) belong to the call: -1 no (the caller finds out
  // why), else 1 if a row is flagged non-finite, 0 if none.
  int64_t (*verify)(const at::Tensor& messages, const std::string& header,
                    const std::vector<int64_t>& shards, bool with_checksum, int64_t step,
                    int64_t threads);
  // The fp32 sum in row order of k messages of one shard, into `out` (fp32 [m]).
  at::Tensor (*decode_sum)(const at::Tensor& messages, int64_t m, int64_t bits, int64_t G,
                           int64_t fmt, int64_t threads, at::Tensor out);
  // Decodes k messages into flat `out` (fp32, bf16 or fp16, contiguous, at most k * m
  // elements): row r's values at r * m, cast, clipped to `out`'s length.
  void (*decode_into)(const at::Tensor& messages, int64_t m, int64_t bits, int64_t G,
                      int64_t fmt, at::Tensor out, int64_t threads);
};

}  // namespace lowbitcc_cpu
