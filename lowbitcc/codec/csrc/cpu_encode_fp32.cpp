// The encode of fp32 sources (cpu_encode.h), a translation unit of its own so that ninja
// compiles it in parallel with the others.
#include "cpu_encode.h"

void lowbitcc_cpu::encode_fp32(const EncodeArgs& a, int64_t bits, int threads) {
  encode_typed<float>(a, bits, threads);
}
