// The encodes of bf16 and fp16 sources (cpu_encode.h), a translation unit of their own so that
// ninja compiles it in parallel with the others.
#include "cpu_encode.h"

void lowbitcc_cpu::encode_bf16(const EncodeArgs& a, int64_t bits, int threads) {
  encode_typed<c10::BFloat16>(a, bits, threads);
}

void lowbitcc_cpu::encode_fp16(const EncodeArgs& a, int64_t bits, int threads) {
  encode_typed<c10::Half>(a, bits, threads);
}
