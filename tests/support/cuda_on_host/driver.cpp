// The decode kernels of cuda_codec.cu run on the host, thread by thread (prelude.h), for
// tests/codec/test_cuda_decodes_on_host.py: each entry point runs one launch as the CUDA
// launcher would grid it (cuda_args.THREADS threads a block, kDecodeVec elements a thread),
// without the kernels' own row check (RowCheck zero), the call's verdict given or null.
#include "prelude.h"
#include "cuda_codec.cu"

namespace {
constexpr unsigned kThreads = 256;

template <typename Kernel>
void launch(long long elements, Kernel kernel) {
  const long long per_block = (long long)kThreads * loco_cuda::kDecodeVec;
  gridDim.x = (unsigned)((elements + per_block - 1) / per_block);
  blockDim.x = kThreads;
  for (unsigned b = 0; b < gridDim.x; ++b)
    for (unsigned t = 0; t < kThreads; ++t) {
      blockIdx.x = b;
      threadIdx.x = t;
      kernel();
    }
}

// (bits, format) as the kernels are instantiated: 2, 4 and 8 bits int, MXFP4, NVFP4
template <template <int, int> class Run, typename... A>
void by_wire(int bits, int fmt, A... a) {
  if (fmt == 1) Run<4, 1>::go(a...);
  else if (fmt == 2) Run<4, 2>::go(a...);
  else if (bits == 2) Run<2, 0>::go(a...);
  else if (bits == 4) Run<4, 0>::go(a...);
  else Run<8, 0>::go(a...);
}

const loco_cuda::RowCheck kNoCheck{};

template <int B, int F> struct Sum {
  static void go(const unsigned char* msgs, long long k, long long P, long long m, int G,
                 float* out, unsigned char* verdict) {
    launch(m, [&] { loco_cuda::decode_sum<B, F>(msgs, k, P, m, G, out, verdict, kNoCheck); });
  }
};

template <typename T> struct Into {
  template <int B, int F> struct W {
    static void go(const unsigned char* msgs, long long P, long long m, int G, long long numel,
                   void* out, unsigned char* verdict) {
      launch(numel, [&] {
        loco_cuda::decode_into<T, B, F>(msgs, P, m, G, numel, static_cast<T*>(out), verdict,
                                        kNoCheck);
      });
    }
  };
};

template <typename T> struct Rows {
  template <int B, int F> struct W {
    static void go(const unsigned char* msgs, long long k, long long n, long long P, long long m,
                   int G, long long numel, void* out, unsigned char* verdict) {
      launch(numel, [&] {
        loco_cuda::decode_rows<T, B, F>(msgs, k, n, P, m, G, numel, static_cast<T*>(out),
                                        verdict, kNoCheck);
      });
    }
  };
};
}  // namespace

// dtype: 0 float, 1 bfloat16, 2 half
extern "C" void host_decode_sum(int bits, int fmt, const unsigned char* msgs, long long k,
                                long long P, long long m, int G, float* out,
                                unsigned char* verdict) {
  by_wire<Sum>(bits, fmt, msgs, k, P, m, G, out, verdict);
}

extern "C" void host_decode_into(int dtype, int bits, int fmt, const unsigned char* msgs,
                                 long long P, long long m, int G, long long numel, void* out,
                                 unsigned char* verdict) {
  if (dtype == 0) by_wire<Into<float>::W>(bits, fmt, msgs, P, m, G, numel, out, verdict);
  else if (dtype == 1) by_wire<Into<__nv_bfloat16>::W>(bits, fmt, msgs, P, m, G, numel, out, verdict);
  else by_wire<Into<__half>::W>(bits, fmt, msgs, P, m, G, numel, out, verdict);
}

extern "C" void host_decode_rows(int dtype, int bits, int fmt, const unsigned char* msgs,
                                 long long k, long long n, long long P, long long m, int G,
                                 long long numel, void* out, unsigned char* verdict) {
  if (dtype == 0) by_wire<Rows<float>::W>(bits, fmt, msgs, k, n, P, m, G, numel, out, verdict);
  else if (dtype == 1) by_wire<Rows<__nv_bfloat16>::W>(bits, fmt, msgs, k, n, P, m, G, numel, out, verdict);
  else by_wire<Rows<__half>::W>(bits, fmt, msgs, k, n, P, m, G, numel, out, verdict);
}
