// Fused CUDA codec kernels built from loco_codec.cuh; the same bytes as cpu_codec.cpp and
// reference.py. Compiled at run time by CuPy (NVRTC) for the GPU at hand, with name expressions
// for the template instances; `nvcc -DLOCO_INSTANTIATE_ALL` builds every instance (the compile
// test). Compile with --fmad=false: every operation is one correctly rounded fp32 operation.
//
// Layouts are those of cpu_codec.cpp: the source is `numel` elements seen as `rows` rows of `m`
// (indices >= numel read as 0), ng = ceil(m / G) groups per row, messages are uint8 [rows, P]
// (header, padding and trailer written by Kernels.frame), the error state holds rows * ng * G elements.
//
// encode: a group takes a *segment* of G/8 lanes where G/8 is a power of two (so a warp encodes
//   32/(G/8) groups at once and every lane works: 8 groups of MXFP4's 32), else a whole warp;
//   each warp takes its groups in a grid-stride loop (the launcher caps the grid). Lane l of a
//   segment owns elements 8l .. 8l+7 of its group (G <= 256, a multiple of 8), held in
//   registers from load to store: one read of the source and the error state, one write of the
//   codes and the error state. The source comes in 16-byte loads and the lane's codes go out as
//   one word of BITS bytes, where aligned (TensorSource::chunk, store_codes); else element by
//   element and byte by byte, the same values. Group maxima are shuffle reductions within the segment (every
//   lane of the warp takes part, so none may leave early); the residual sums stay in each
//   lane's registers across its warp's groups and reach `sums` with one atomic add per warp
//   (one per group serialised the kernel on those two addresses). NVFP4 and the other is_nv
//   formats (G = 16, 2 lanes a group): a warp takes one block of loco::kNvBlock groups of a
//   row, whose byte comes from a warp max of the finite groups' maxima. A lane's 8 codes are
//   BITS whole bytes at every width (3 bytes of 3-bit codes, stored and loaded byte by byte).
// decode_sum: kDecodeVec consecutive elements of the shard per thread (the scale read once per
//   row and the codes in one load where they lie in one group, 16-byte stores where aligned),
//   rows summed in row order.
// encode_sum: decode_sum and the encode of its sum in one launch (the all-gather stage of an
//   all-reduce of more than two ranks): the encode's warps read each element as the sum in row
//   order of the received messages' values (SummedSource), after every block checked the rows.
// decode_into: kDecodeVec consecutive elements of the output per thread, cast to its dtype.
// decode_rows: decode_sum of every row of gathered messages (the two-rank all-reduce) in one
//   launch, kDecodeVec elements of the output per thread, cast to its dtype.
// checksum: the wire checksum of each message row (wire.py), by a grid of (blocks, rows): each
//   thread sums its 64-bit words in a grid-stride loop, warps and then the block reduce, and
//   one atomic add per block and sum reaches the row's two accumulators; checksum_fold makes
//   the trailer. The sums are mod 2^64 and integer additions commute, so the result does not
//   depend on the order.
// frame_body, frame_fold: Kernels.frame after an encode, as checksum and checksum_fold with the
//   padding cleared in the same pass, the rows' non-finite flags OR-ed alongside, and the fold
//   writing each row's header (loco::header_word) and trailer in place; the C++ frame shares
//   loco::padded_word and loco::header_word.
// check_fold: Kernels.check after checksum: each received row's header words against the call's
//   (loco::header_word) and its trailer against its sums, OR-ed into a two-byte verdict.
#include "loco_codec.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace loco_cuda {

constexpr int kChunk = 8;  // consecutive elements per lane
constexpr unsigned kFull = 0xffffffffu;
constexpr int kNoError = loco::kErrorNone;
constexpr int kInt8 = loco::kErrorInt8;
constexpr int kFp32 = loco::kErrorFp32;
constexpr int kBf16 = loco::kErrorBf16;
constexpr int kMx = loco::kFormatMxfp4;
constexpr int kTrailerBytes = 8;

// The kinds of vector access the kernels make where aligned (16-byte loads of the source and
// stores of the output, a lane's codes as one word). The host harness counts them
// (tests/support/cuda_on_host/prelude.h defines LOCO_VECTOR_ACCESS), so that a test tells them
// from the element-by-element paths, which write the same bytes; a GPU build counts nothing.
constexpr int kSourceLoad = 0;
constexpr int kCodesLoad = 1;
constexpr int kCodesStore = 2;
constexpr int kOutputStore = 3;
#ifndef LOCO_VECTOR_ACCESS
#define LOCO_VECTOR_ACCESS(kind) ((void)(kind))
#endif

// The call's header (shard 0, flags 0) as eight little-endian words, passed by value.
struct Header {
  unsigned int w[8];
};

// A place's call counter on the device (uint32 word[2]: the call number its next replayed
// graph uses, and a count of finished blocks, zero between launches) and what a launch does
// with it. `read`: the call number in the headers written and expected is word[0], not the
// header's own (a replayed graph, whose arguments were fixed at its capture). `mode`
// (0: nothing; kCountSet, kCountAdd: the call's last launch only): kCountSet writes `value`
// (an eager run: the next call number where the place keeps its stride), kCountAdd adds
// `value` (the stride) once every block of the launch has read word[0]. `out_at` (a decode
// into the call's output; or null): where the output lies, read from this device word instead
// of the launch's argument (a graph replayed on an output elsewhere than its capture's).
struct CallCount {
  unsigned int* word;
  unsigned int value;
  int read;
  int mode;
  const unsigned long long* out_at;
};
constexpr int kCountSet = 1;
constexpr int kCountAdd = 2;

// The call's header words (shard 0, flags 0) with the call number `count` says.
__device__ __forceinline__ void call_words(const Header& h, const unsigned int* seq_at,
                                           unsigned int (&w)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) w[k] = h.w[k];
  if (seq_at != nullptr) w[loco::kSeqOffset / 4] = *reinterpret_cast<const volatile unsigned int*>(seq_at);
}

// `n.mode` done once for the launch (every thread calls it, its block's reads of word[0] done).
__device__ __forceinline__ void count_call(const CallCount& n) {
  if (threadIdx.x != 0) return;
  if (n.mode == kCountSet && blockIdx.x == 0) n.word[0] = n.value;
  if (n.mode != kCountAdd) return;
  __threadfence();
  if (atomicAdd(n.word + 1, 1u) == gridDim.x - 1) {
    __threadfence();  // every block's count before the add
    n.word[0] += n.value;
    n.word[1] = 0u;
  }
}

// The frame an encode writes itself where the host asks it to (`enabled`; checksums off): each
// row's header (`header` with shard shard0 + r and flags `flags`, plus kFlagNonfinite where a
// group of the row is not finite), its padding from `used` and a zero trailer, and `answer`
// (the call's verdict's non-finite byte) set where a row is non-finite, as frame_body and
// frame_fold do. `words` (rows + 1, zero before and left zero after) counts the finished blocks
// (word 0) and ORs each row's non-finite groups (word 1 + r): the last block to finish writes
// the frames.
struct FrameArgs {
  Header header;
  long long shard0;
  long long used;
  unsigned long long* words;
  unsigned char* answer;
  unsigned int flags;
  int enabled;
  const unsigned int* seq_at;  // the call number's word on the device (CallCount.read), or null
  const unsigned long long* src_at;  // the source's address on the device (a graph's), or null
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

__device__ __forceinline__ unsigned short as_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ unsigned short as_bits(__half v) { return __half_as_ushort(v); }
template <typename T> __device__ __forceinline__ T from_bits(unsigned short b);
template <> __device__ __forceinline__ __nv_bfloat16 from_bits<__nv_bfloat16>(unsigned short b) {
  return __ushort_as_bfloat16(b);
}
template <> __device__ __forceinline__ __half from_bits<__half>(unsigned short b) {
  return __ushort_as_half(b);
}

// max of |v| over the warp's group as an unsigned max of sign-cleared bit patterns (exact in any
// order); patterns >= 0x7f800000 mean a NaN or Inf is present.
__device__ __forceinline__ unsigned warp_max_bits(unsigned bits) {
  for (int o = 16; o > 0; o >>= 1) bits = max(bits, __shfl_xor_sync(kFull, bits, o));
  return bits;
}

// the same over aligned segments of `width` lanes (a power of two <= 32); every lane calls it
__device__ __forceinline__ unsigned segment_max_bits(unsigned bits, int width) {
  for (int o = width >> 1; o > 0; o >>= 1) bits = max(bits, __shfl_xor_sync(kFull, bits, o));
  return bits;
}

// lanes per group (see encode above); cuda_build.py's `segment_lanes` is the same rule
__device__ __forceinline__ int segment_lanes(int G) {
  const int lanes = G / kChunk;
  return (G % kChunk == 0 && lanes <= 32 && (lanes & (lanes - 1)) == 0) ? lanes : 32;
}

__device__ __forceinline__ float bits_to_amax(unsigned top) {
  return top >= 0x7f800000u ? loco::quiet_nan() : __uint_as_float(top);
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// An encode's source read from a.src (T), times a.factor where a.scale_input says so: element
// `idx` of the flat tensor (column `col` of its row); `chunk`: kChunk of them at once.
template <typename T>
struct TensorSource {
  const loco::EncodeArgs& a;
  const T* src;  // a.src, or the address FrameArgs.src_at holds
  __device__ __forceinline__ float scaled(float v) const {
    return a.scale_input ? __fmul_rn(v, a.factor) : v;
  }
  __device__ __forceinline__ float operator()(long long idx, long long) const {
    return scaled(to_float(src[idx]));
  }
  // Elements idx .. idx + kChunk - 1 (columns col ..) into v, in 16-byte loads, where they all
  // lie in the row and the tensor and start 16-byte aligned; false (nothing read) elsewhere.
  __device__ __forceinline__ bool chunk(long long idx, long long col, float (&v)[kChunk]) const {
    if (col + kChunk > a.m || idx + kChunk > a.numel) return false;
    const T* p = src + idx;
    if (reinterpret_cast<unsigned long long>(p) % 16 != 0) return false;
    LOCO_VECTOR_ACCESS(kSourceLoad);
    if constexpr (sizeof(T) == 4) {
      const float4 lo = reinterpret_cast<const float4*>(p)[0];
      const float4 hi = reinterpret_cast<const float4*>(p)[1];
      const float w[kChunk] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int t = 0; t < kChunk; ++t) v[t] = scaled(w[t]);
    } else {  // eight 2-byte elements, element t in the low half of word t / 2 (little-endian)
      const uint4 q = *reinterpret_cast<const uint4*>(p);
      const unsigned w[kChunk / 2] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int t = 0; t < kChunk; ++t)
        v[t] = scaled(to_float(from_bits<T>((unsigned short)(w[t / 2] >> (16 * (t % 2))))));
    }
    return true;
  }
};

// The BITS-bit field of element j of a row's codes (at bit BITS * j of `codes` read as one
// little-endian number; a 3-bit field may span two bytes).
template <int BITS>
__device__ __forceinline__ unsigned field_at(const unsigned char* codes, long long j) {
  if constexpr (8 % BITS == 0) {  // 8 / BITS whole fields a byte
    constexpr int kPer = 8 / BITS;
    return ((unsigned)codes[j / kPer] >> (BITS * (int)(j % kPer))) & ((1u << BITS) - 1u);
  } else {
    const long long bit = (long long)BITS * j;
    const int shift = (int)(bit & 7);
    unsigned v = (unsigned)codes[bit >> 3] >> shift;
    if (shift + BITS > 8) v |= (unsigned)codes[(bit >> 3) + 1] << (8 - shift);
    return v & ((1u << BITS) - 1u);
  }
}

// The scale of group gcol of one message of ng groups: a byte scale (loco::fp4_wire_scale) or
// int codes' fp32.
template <int FMT>
__device__ __forceinline__ float wire_scale(const unsigned char* msg, long long ng,
                                            long long gcol) {
  if (loco::is_grid(FMT)) return loco::fp4_wire_scale(msg + loco::kHeaderBytes, ng, gcol, FMT);
  const unsigned char* sp = msg + loco::kHeaderBytes + 4 * gcol;
  return __uint_as_float((unsigned)sp[0] | ((unsigned)sp[1] << 8) | ((unsigned)sp[2] << 16) |
                         ((unsigned)sp[3] << 24));
}

// Element j of one message of m elements (ng groups of G): an is_grid format's field value
// (loco::field_value), or an int code (u - 2^(BITS-1), loco::dequantize_one), times its
// group's scale.
template <int BITS, int FMT>
__device__ __forceinline__ float decode_one(const unsigned char* msg, long long ng, int G,
                                            long long j) {
  const long long gcol = j / G;
  const unsigned char* codes = msg + loco::kHeaderBytes + loco::scale_field_bytes(ng, FMT);
  if constexpr (loco::is_grid(FMT)) {
    const float scale = wire_scale<FMT>(msg, ng, gcol);
    return loco::field_value(field_at<BITS>(codes, j), scale, FMT);
  } else {
    const float scale = wire_scale<FMT>(msg, ng, gcol);
    return loco::dequantize_one((int)field_at<BITS>(codes, j) - (1 << (BITS - 1)), scale);
  }
}

constexpr int kDecodeVec = 8;  // consecutive output elements per thread of a decode
static_assert(kDecodeVec == kChunk, "an encode_sum lane decodes its chunk by decode_vec");

// The `BITS` bytes (kChunk codes of BITS bits) at p, little-endian first, as one load where
// p is BITS-aligned (BITS 2, 4 or 8), else byte by byte (3 bytes of 3-bit codes always).
template <int BITS>
__device__ __forceinline__ unsigned long long load_codes(const unsigned char* p) {
  static_assert(BITS * kChunk % 8 == 0, "a chunk's codes are whole bytes");
  const bool aligned = BITS % 2 == 0 && reinterpret_cast<unsigned long long>(p) % BITS == 0;
  if (aligned) LOCO_VECTOR_ACCESS(kCodesLoad);
  if constexpr (BITS == 8) {
    if (aligned) return *reinterpret_cast<const unsigned long long*>(p);
  } else if constexpr (BITS == 4) {
    if (aligned) return *reinterpret_cast<const unsigned*>(p);
  } else if constexpr (BITS == 2) {
    if (aligned) return *reinterpret_cast<const unsigned short*>(p);
  }
  unsigned long long word = 0;
#pragma unroll
  for (int b = 0; b < BITS; ++b) word |= (unsigned long long)p[b] << (8 * b);
  return word;
}

// load_codes' counterpart: `word`'s low BITS bytes stored at p.
template <int BITS>
__device__ __forceinline__ void store_codes(unsigned char* p, unsigned long long word) {
  const bool aligned = BITS % 2 == 0 && reinterpret_cast<unsigned long long>(p) % BITS == 0;
  if (aligned) LOCO_VECTOR_ACCESS(kCodesStore);
  if constexpr (BITS == 8) {
    if (aligned) return void(*reinterpret_cast<unsigned long long*>(p) = word);
  } else if constexpr (BITS == 4) {
    if (aligned) return void(*reinterpret_cast<unsigned*>(p) = (unsigned)word);
  } else if constexpr (BITS == 2) {
    if (aligned) return void(*reinterpret_cast<unsigned short*>(p) = (unsigned short)word);
  }
#pragma unroll
  for (int b = 0; b < BITS; ++b) p[b] = (word >> (8 * b)) & 0xff;
}

// decode_one of kDecodeVec consecutive elements j0 .. j0 + kDecodeVec - 1 of one message, all
// in one group (the caller checks G % kDecodeVec == 0, j0 % kDecodeVec == 0): the scale read
// once, the codes' BITS bytes in one load where aligned; the same values as decode_one.
template <int BITS, int FMT>
__device__ __forceinline__ void decode_vec(const unsigned char* msg, long long ng, int G,
                                           long long j0, float (&v)[kDecodeVec]) {
  const long long gcol = j0 / G;
  const unsigned char* fields = msg + loco::kHeaderBytes + loco::scale_field_bytes(ng, FMT);
  // j0 * BITS / 8 (j0 a multiple of 8), as j0 / (8 / BITS) where that is whole
  const unsigned long long codes =
      load_codes<BITS>(fields + (8 % BITS == 0 ? j0 / (8 / BITS) : j0 * BITS / 8));
  if constexpr (loco::is_grid(FMT)) {  // field t at bit BITS * t
    const float scale = wire_scale<FMT>(msg, ng, gcol);
#pragma unroll
    for (int t = 0; t < kDecodeVec; ++t)
      v[t] = loco::field_value((unsigned)(codes >> (BITS * t)) & ((1u << BITS) - 1u), scale, FMT);
  } else {  // 8 / BITS whole fields a byte
    constexpr int kPer = 8 / BITS;
    const float scale = wire_scale<FMT>(msg, ng, gcol);
#pragma unroll
    for (int t = 0; t < kDecodeVec; ++t)
      v[t] = loco::dequantize_one(
          loco::field_to_code((unsigned)(codes >> (8 * (t / kPer))) & 0xffu, t % kPer, BITS),
          scale);
  }
}

// An encode_sum's source, its one row: column `col` of the sum in row order of k received
// messages of m elements (rows `stride` bytes apart), as decode_sum writes it (NaN where
// `foreign`: a message of the call was not the call's).
template <int BITS, int FMT>
struct SummedSource {
  const unsigned char* __restrict__ msgs;
  long long k, stride, ng, m, numel;  // numel: the encode's a.numel
  int G;
  bool foreign;
  __device__ __forceinline__ float operator()(long long, long long col) const {
    float acc = decode_one<BITS, FMT>(msgs, ng, G, col);
    for (long long r = 1; r < k; ++r)
      acc = __fadd_rn(acc, decode_one<BITS, FMT>(msgs + r * stride, ng, G, col));
    return foreign ? loco::quiet_nan() : acc;
  }
  // Columns col .. col + kChunk - 1 into v by decode_vec, where they lie in one group of the
  // row (col % kChunk == 0, as an encode's lanes ask); false (nothing read) elsewhere.
  __device__ __forceinline__ bool chunk(long long idx, long long col, float (&v)[kChunk]) const {
    if (G % kDecodeVec != 0 || col + kChunk > m || idx + kChunk > numel) return false;
    float w[kDecodeVec];
    decode_vec<BITS, FMT>(msgs, ng, G, col, v);
    for (long long r = 1; r < k; ++r) {
      decode_vec<BITS, FMT>(msgs + r * stride, ng, G, col, w);
#pragma unroll
      for (int t = 0; t < kChunk; ++t) v[t] = __fadd_rn(v[t], w[t]);
    }
#pragma unroll
    for (int t = 0; t < kChunk; ++t) v[t] = foreign ? loco::quiet_nan() : v[t];
    return true;
  }
};

// One group `gi` by a segment of `width` lanes (`lane`: this one's index in it; `valid`: gi is
// a group, else the lane only takes part in the segment's shuffles), its elements read through
// `load` (TensorSource or SummedSource); adds this lane's share of the group's residual and
// input squares to rs_acc / is_acc (finite groups only). FMT: loco::Format (kMx: BITS 4, !SR;
// is_nv: BITS the grid's, !SR).
template <int BITS, int MODE, bool SR, int FMT, typename Load>
__device__ __forceinline__ void encode_group(const loco::EncodeArgs& a, const Load& load,
                                             long long gi, int lane, bool valid, int width,
                                             double& rs_acc, double& is_acc,
                                             unsigned long long* row_bad) {
  __nv_bfloat16* ebf16 = reinterpret_cast<__nv_bfloat16*>(a.ebf16);
  const int G = a.G;
  const long long row = gi / a.ng, gcol = gi % a.ng;
  const long long col0 = gcol * G;
  const int first = lane * kChunk;
  const bool active = valid && first < G;
  const long long off = gi * G;
  const bool with_error = MODE != kNoError && a.has_error && !(a.invalid && *a.invalid);

  float y[kChunk], e[kChunk];
  unsigned top = 0;
  const float escale = (MODE == kInt8 && with_error && valid) ? a.escales[gi] : 0.0f;
  const long long idx0 = row * a.m + col0 + first;
  if (!(active && load.chunk(idx0, col0 + first, y))) {
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      const long long col = col0 + first + t, idx = idx0 + t;
      y[t] = active && col < a.m && idx < a.numel ? load(idx, col) : 0.0f;
    }
  }
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    float v = y[t];
    e[t] = 0.0f;
    if (active && with_error) {
      if (MODE == kInt8) e[t] = loco::dequantize_one(a.ecodes[off + first + t], escale);
      if (MODE == kFp32) e[t] = a.ef32[off + first + t];
      if (MODE == kBf16) e[t] = __bfloat162float(ebf16[off + first + t]);
      v = __fadd_rn(v, e[t]);
    }
    y[t] = v;
    top = max(top, __float_as_uint(v) & 0x7fffffffu);
  }
  top = segment_max_bits(top, width);
  unsigned char* row_msg = a.msgs + row * a.P;
  const bool leader = valid && lane == 0;
  float scale, inv;
  bool finite;
  if (loco::is_nv(FMT)) {  // the warp is one block of the row: lane 0 holds its first group
    const unsigned block_top = warp_max_bits(valid && top < 0x7f800000u ? top : 0u);
    const unsigned block = loco::nv_block_byte(block_top, FMT);
    if (valid && (threadIdx.x & 31) == 0)
      row_msg[loco::kHeaderBytes + a.ng + gcol / loco::kNvBlock] = (unsigned char)block;
    const loco::ByteScale s = loco::nv_scale(bits_to_amax(top), block, FMT);
    if (leader) row_msg[loco::kHeaderBytes + gcol] = (unsigned char)s.byte;
    scale = s.scale, inv = 0.0f, finite = s.finite;
  } else if (FMT == kMx) {
    const loco::ByteScale s = loco::mx_scale(top);
    if (leader) row_msg[loco::kHeaderBytes + gcol] = (unsigned char)s.byte;
    scale = s.scale, inv = s.inv, finite = s.finite;
  } else {
    const loco::GroupScale s = loco::group_scale(bits_to_amax(top), loco::qmax(BITS));
    if (leader) {
      const unsigned sb = __float_as_uint(s.scale);
      for (int b = 0; b < 4; ++b) row_msg[loco::kHeaderBytes + 4 * gcol + b] = (sb >> (8 * b)) & 0xff;
    }
    scale = s.scale, inv = s.inv, finite = s.finite;
  }
  if (leader && gcol == a.ng - 1) loco::clear_scale_padding(row_msg, a.ng, FMT);
  unsigned char* packed =
      row_msg + loco::kHeaderBytes + loco::scale_field_bytes(a.ng, FMT) + col0 * BITS / 8;
  const float qf = (float)loco::qmax(BITS);

  // codes of this lane's chunk, packed little-end first: BITS bytes
  unsigned long long word = 0;
  double rs = 0.0, is = 0.0;
  unsigned etop = 0;
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    float code = 0.0f;
    unsigned field = loco::is_grid(FMT) ? 0u : loco::code_to_field(0, BITS);
    if (finite) {
      if (loco::is_nv(FMT)) {
        code = loco::nv_code(y[t], scale, FMT);
        field = loco::nv_field(y[t], scale, FMT);
      } else if (FMT == kMx) {
        code = loco::fp4_code(y[t], inv);
        field = loco::fp4_field(y[t], inv);
      } else {
        code = SR ? loco::code_stochastic(
                        y[t], inv, loco::uniform24((unsigned)(off + first + t), a.k0, a.k1), qf)
                  : loco::code_nearest(y[t], inv, qf);
        field = loco::code_to_field((int)code, BITS);
      }
      const float r = loco::residual(y[t], code, scale);
      if (active) {
        rs += (double)r * (double)r;
        is += (double)y[t] * (double)y[t];
      }
      if (MODE != kNoError) e[t] = loco::update_error(e[t], r, a.beta, a.omb, with_error);
      etop = max(etop, __float_as_uint(e[t]) & 0x7fffffffu);
    }
    word |= (unsigned long long)field << (BITS * t);
  }
  if (active) store_codes<BITS>(packed + first * BITS / 8, word);
  // every group writes its non-finite byte (the caller does not zero them); a non-finite group
  // writes no error state (the call's states are dropped, as on the CPU); its lanes still take
  // part in the segment's shuffle below
  if (leader) a.nonfinite[gi] = finite ? 0 : 1;
  if (leader && !finite && row_bad != nullptr) atomicOr(row_bad + row, 1ull);
  if (finite) {
    rs_acc += rs;
    is_acc += is;
  }
  if (MODE == kInt8) {
    etop = segment_max_bits(etop, width);
    const loco::GroupScale es = loco::group_scale(bits_to_amax(etop), 127);
    if (active && finite) {
#pragma unroll
      for (int t = 0; t < kChunk; ++t)
        a.ecodes[off + first + t] =
            es.finite ? (signed char)loco::code_nearest(e[t], es.inv, 127.0f) : 0;
    }
    if (leader && finite) a.escales[gi] = es.scale;
  } else if (MODE == kFp32 && active && finite) {
#pragma unroll
    for (int t = 0; t < kChunk; ++t) a.ef32[off + first + t] = e[t];
  } else if (MODE == kBf16 && active && finite) {
#pragma unroll
    for (int t = 0; t < kChunk; ++t) ebf16[off + first + t] = __float2bfloat16_rn(e[t]);
  }
}

// `a` is loco::EncodeArgs (loco_codec.cuh), passed by value: the launcher lays out its bytes with
// lowbitcc.codec.abi.encode_args_dtype(). a.src holds T; a.ebf16 holds __nv_bfloat16 bits.
// The frames of FrameArgs, by the last block of the encode to finish (every thread of every
// block calls it after its groups; it synchronises the block).
__device__ __forceinline__ void frame_after_encode(const loco::EncodeArgs& a, const FrameArgs& f) {
  __shared__ bool last;
  __threadfence();  // this block's codes, scales and flags before its count
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(f.words, 1ull) == (unsigned long long)gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  unsigned int hw[8];
  call_words(f.header, f.seq_at, hw);
  for (long long r = threadIdx.x; r < a.rows; r += blockDim.x) {
    const bool bad = atomicExch(f.words + 1 + r, 0ull) != 0ull;
    const unsigned int row_flags = f.flags | (bad ? loco::kFlagNonfinite : 0u);
    unsigned char* msg = a.msgs + r * a.P;
    unsigned int* h = reinterpret_cast<unsigned int*>(msg);
#pragma unroll
    for (int k = 0; k < loco::kHeaderBytes / 4; ++k)
      h[k] = loco::header_word(hw, k, (unsigned int)(f.shard0 + r), row_flags);
    for (long long b = f.used; b < a.P; ++b) msg[b] = 0;  // padding and the trailer
    if (bad) *f.answer = 1;
  }
  if (threadIdx.x == 0) f.words[0] = 0ull;
}

// The groups of an encode, their sums and its frame, its elements read through `load`
// (every thread of every block calls it).
template <int BITS, int MODE, bool SR, int FMT, typename Load>
__device__ __forceinline__ void encode_groups(const loco::EncodeArgs& a, const FrameArgs& f,
                                              const Load& load) {
  const long long groups = a.rows * a.ng;
  const int lane = threadIdx.x & 31;
  const int width = segment_lanes(a.G), per_warp = 32 / width;
  // is_nv: a task is a block of a row (per_warp = kNvBlock groups), else per_warp groups
  const long long blocks = (a.ng + loco::kNvBlock - 1) / loco::kNvBlock;
  const long long tasks =
      loco::is_nv(FMT) ? a.rows * blocks : (groups + per_warp - 1) / per_warp;
  const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
  double rs = 0.0, is = 0.0;
  // the call's verdict starts at zero; the call's later kernels set its bytes
  if (a.clear && blockIdx.x == 0 && threadIdx.x == 0) *a.clear = 0ull;
  // a task (per_warp consecutive groups) is the same on every lane, so whole warps run (and
  // leave) the loop together
  for (long long task = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; task < tasks;
       task += warps) {
    long long gi = task * per_warp + lane / width;
    bool valid = gi < groups;
    if (loco::is_nv(FMT)) {
      const long long gcol = (task % blocks) * loco::kNvBlock + lane / width;
      gi = task / blocks * a.ng + gcol;
      valid = gcol < a.ng;
    }
    encode_group<BITS, MODE, SR, FMT>(a, load, gi, lane % width, valid, width, rs, is,
                                      f.enabled ? f.words + 1 : nullptr);
  }
  rs = warp_sum(rs);
  is = warp_sum(is);
  if (lane == 0 && (rs != 0.0 || is != 0.0)) {
    atomicAdd(a.sums, rs);
    atomicAdd(a.sums + 1, is);
  }
  if (f.enabled) frame_after_encode(a, f);
}

template <typename T, int BITS, int MODE, bool SR, int FMT>
__global__ void encode(const loco::EncodeArgs a, const FrameArgs f) {
  const T* src = f.src_at != nullptr ? reinterpret_cast<const T*>(*f.src_at)
                                     : static_cast<const T*>(a.src);
  encode_groups<BITS, MODE, SR, FMT>(a, f, TensorSource<T>{a, src});
}

// What a decode checks itself where the host asks it to (`check`): the k rows' headers against
// the call's `header` with shard shard0 + r * shard_step (modulo shard_mod where it is not 0)
// and the row's own non-finite flag, as check_fold does without checksums.
struct RowCheck {
  Header header;
  long long shard0;
  long long shard_step;
  long long rows;  // the rows to check: every row of the messages, read or not
  long long shard_mod;
  int check;
  CallCount count;  // the call number expected where count.read, and the launch's count_call
};

// Every block checks the c.rows headers (one thread a row, 32 bytes each) and answers whether any row
// is foreign, or the call's verdict says an earlier check found one; block 0 sets the verdict's
// bytes (foreign, non-finite), which nothing of this launch reads back as its answer. Without
// `c.check` the answer is the verdict's foreign byte alone (Kernels.check ran first). Then
// `c.count`'s count_call. Every thread of the block must call it (it synchronises the block).
__device__ __forceinline__ bool checked_foreign(const unsigned char* __restrict__ msgs,
                                                long long P, const RowCheck& c,
                                                unsigned char* __restrict__ verdict) {
  if (!c.check) {
    count_call(c.count);
    return verdict != nullptr && verdict[0];
  }
  unsigned int hw[8];
  call_words(c.header, c.count.read ? c.count.word : nullptr, hw);
  int foreign = 0, nonfinite = 0;
  for (long long r = threadIdx.x; r < c.rows; r += blockDim.x) {
    const unsigned char* row = msgs + r * P;
    const unsigned int flags = row[loco::kFlagsOffset] & loco::kFlagNonfinite;
    const unsigned int* h = reinterpret_cast<const unsigned int*>(row);
    const long long s = c.shard0 + r * c.shard_step;
    const unsigned int shard = (unsigned int)(c.shard_mod ? s % c.shard_mod : s);
#pragma unroll
    for (int w = 0; w < loco::kHeaderBytes / 4; ++w)
      foreign |= h[w] != loco::header_word(hw, w, shard, flags);
    nonfinite |= flags != 0;
  }
  foreign = __syncthreads_or(foreign);
  nonfinite = __syncthreads_or(nonfinite);
  count_call(c.count);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (foreign) verdict[0] = 1;
    if (nonfinite) verdict[1] = 1;
  }
  return foreign || verdict[0];
}

// out[0 .. kDecodeVec) = v cast to T (NaN everywhere where `foreign`): 16-byte stores where
// `out` is 16-byte aligned, else one store per element.
template <typename T>
__device__ __forceinline__ void store_vec(T* out, const float (&v)[kDecodeVec], bool foreign) {
  float w[kDecodeVec];
#pragma unroll
  for (int t = 0; t < kDecodeVec; ++t) w[t] = foreign ? loco::quiet_nan() : v[t];
  if (reinterpret_cast<unsigned long long>(out) % 16 != 0) {
#pragma unroll
    for (int t = 0; t < kDecodeVec; ++t) out[t] = from_float<T>(w[t]);
    return;
  }
  LOCO_VECTOR_ACCESS(kOutputStore);
  if constexpr (sizeof(T) == 4) {
    float4* dst = reinterpret_cast<float4*>(out);
    dst[0] = make_float4(w[0], w[1], w[2], w[3]);
    dst[1] = make_float4(w[4], w[5], w[6], w[7]);
  } else {  // element t in the low half of word t / 2 (little-endian, as out[t] would be)
    unsigned q[kDecodeVec / 2];
#pragma unroll
    for (int h = 0; h < kDecodeVec / 2; ++h)
      q[h] = (unsigned)as_bits(from_float<T>(w[2 * h])) |
             ((unsigned)as_bits(from_float<T>(w[2 * h + 1])) << 16);
    *reinterpret_cast<uint4*>(out) = make_uint4(q[0], q[1], q[2], q[3]);
  }
}

// out[j] = sum over rows r (in order) of message r's element j, for j < m (P: the distance
// between rows, at least their length: a column of gathered messages too); NaN where the call's
// verdict (when given) says a message was foreign (Kernels.check ran first), or, with
// `c.check`, where this launch's own check of the rows finds one (checked_foreign). Each thread
// writes kDecodeVec consecutive elements (decode_vec where they lie in one group, else one by one).
template <int BITS, int FMT>
__global__ void decode_sum(const unsigned char* __restrict__ msgs, long long k, long long P,
                           long long m, int G, float* __restrict__ out,
                           unsigned char* __restrict__ verdict, const RowCheck c) {
  if (c.count.out_at != nullptr) out = reinterpret_cast<float*>(*c.count.out_at);
  const long long j0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * kDecodeVec;
  const bool foreign = checked_foreign(msgs, P, c, verdict);
  if (j0 >= m) return;
  const long long ng = (m + G - 1) / G;
  if (G % kDecodeVec == 0 && j0 + kDecodeVec <= m) {
    float acc[kDecodeVec], v[kDecodeVec];
    decode_vec<BITS, FMT>(msgs, ng, G, j0, acc);
    for (long long r = 1; r < k; ++r) {
      decode_vec<BITS, FMT>(msgs + r * P, ng, G, j0, v);
#pragma unroll
      for (int t = 0; t < kDecodeVec; ++t) acc[t] = __fadd_rn(acc[t], v[t]);
    }
    store_vec(out + j0, acc, foreign);
    return;
  }
  for (long long j = j0; j < j0 + kDecodeVec && j < m; ++j) {
    float acc = decode_one<BITS, FMT>(msgs, ng, G, j);
    for (long long r = 1; r < k; ++r)
      acc = __fadd_rn(acc, decode_one<BITS, FMT>(msgs + r * P, ng, G, j));
    out[j] = foreign ? loco::quiet_nan() : acc;
  }
}

// out[r * m + j] = message r's element j, cast, for r * m + j < numel (NaN as decode_sum; with
// `c.check` every row of the messages is checked, also those past numel). Each thread writes
// kDecodeVec consecutive elements (decode_vec where m and G are multiples of it).
template <typename T, int BITS, int FMT>
__global__ void decode_into(const unsigned char* __restrict__ msgs, long long P, long long m,
                            int G, long long numel, T* __restrict__ out,
                            unsigned char* __restrict__ verdict, const RowCheck c) {
  if (c.count.out_at != nullptr) out = reinterpret_cast<T*>(*c.count.out_at);
  const long long i0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * kDecodeVec;
  const bool foreign = checked_foreign(msgs, P, c, verdict);
  if (i0 >= numel) return;
  const long long ng = (m + G - 1) / G;
  if (G % kDecodeVec == 0 && m % kDecodeVec == 0 && i0 + kDecodeVec <= numel) {
    float v[kDecodeVec];
    decode_vec<BITS, FMT>(msgs + i0 / m * P, ng, G, i0 % m, v);
    store_vec(out + i0, v, foreign);
    return;
  }
  for (long long i = i0; i < i0 + kDecodeVec && i < numel; ++i) {
    const long long r = i / m, j = i % m;
    const float v = foreign ? loco::quiet_nan() : decode_one<BITS, FMT>(msgs + r * P, ng, G, j);
    out[i] = from_float<T>(v);
  }
}

// decode_rows: decode_sum of every row of gathered messages at once (the two-rank all-reduce):
// out[r * m + j] = the sum over senders s, in order, of element j of sender s's message of row
// r, cast, for r * m + j < numel (a partial last row, any dtype: what decode_sum then a cast
// write). The messages are k senders' n rows of P bytes, contiguous ([k, n, P]); with `c.check`
// every one of the k * n rows is checked (c.shard_mod n: row q holds shard q % n), NaN as
// decode_sum writes it. Each thread writes kDecodeVec consecutive elements, as decode_into.
template <typename T, int BITS, int FMT>
__global__ void decode_rows(const unsigned char* __restrict__ msgs, long long k, long long n,
                            long long P, long long m, int G, long long numel,
                            T* __restrict__ out, unsigned char* __restrict__ verdict,
                            const RowCheck c) {
  if (c.count.out_at != nullptr) out = reinterpret_cast<T*>(*c.count.out_at);
  const long long i0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * kDecodeVec;
  const bool foreign = checked_foreign(msgs, P, c, verdict);
  if (i0 >= numel) return;
  const long long ng = (m + G - 1) / G;
  if (G % kDecodeVec == 0 && m % kDecodeVec == 0 && i0 + kDecodeVec <= numel) {
    const unsigned char* row = msgs + i0 / m * P;
    const long long j0 = i0 % m;
    float acc[kDecodeVec], v[kDecodeVec];
    decode_vec<BITS, FMT>(row, ng, G, j0, acc);
    for (long long s = 1; s < k; ++s) {
      decode_vec<BITS, FMT>(row + s * n * P, ng, G, j0, v);
#pragma unroll
      for (int t = 0; t < kDecodeVec; ++t) acc[t] = __fadd_rn(acc[t], v[t]);
    }
    store_vec(out + i0, acc, foreign);
    return;
  }
  for (long long i = i0; i < i0 + kDecodeVec && i < numel; ++i) {
    const long long r = i / m, j = i % m;
    const unsigned char* row = msgs + r * P;
    float acc = decode_one<BITS, FMT>(row, ng, G, j);
    for (long long s = 1; s < k; ++s)
      acc = __fadd_rn(acc, decode_one<BITS, FMT>(row + s * n * P, ng, G, j));
    out[i] = from_float<T>(foreign ? loco::quiet_nan() : acc);
  }
}

// The source of an encode_sum: k received messages of the one row encoded (its shard from
// every rank, rows `stride` bytes apart) and the call's verdict, which their check sets.
struct SumSource {
  const unsigned char* msgs;
  long long k;
  long long stride;
  unsigned char* verdict;
};

// decode_sum and the encode of its sum in one launch (an all-reduce of more than two ranks: the
// own row's messages summed in rank order and encoded for the all-gather), the same bytes as
// the two: `a` encodes one row of a.m elements (a.src, a.factor unused) read as
// SummedSource<BITS, FMT> of `s`, whose rows are checked first as `c` says (checked_foreign).
template <int BITS, int MODE, bool SR, int FMT>
__global__ void encode_sum(const loco::EncodeArgs a, const FrameArgs f, const SumSource s,
                           const RowCheck c) {
  const bool foreign = checked_foreign(s.msgs, s.stride, c, s.verdict);
  encode_groups<BITS, MODE, SR, FMT>(
      a, f, SummedSource<BITS, FMT>{s.msgs, s.k, s.stride, a.ng, a.m, a.numel, a.G, foreign});
}

constexpr int kMaxWarps = 32;  // warps in the largest block CUDA allows (1024 threads)

// Word i of a message body (x) into a thread's checksum sums N and S (wire.py).
__device__ __forceinline__ void checksum_add(unsigned long long x, long long i,
                                             unsigned long long step, unsigned long long& n,
                                             unsigned long long& s) {
  const unsigned long long y = x + (unsigned long long)(i + 1) * step;
  n += (y & 0xffffffffull) * (y >> 32);
  s += (x & 0xffffffffull) + (x >> 32);
}

// The block's sums N and S, added atomically into dst[0] and dst[1] by thread 0 (warp shuffles,
// then shared memory: every thread of the block calls it, none having left).
__device__ __forceinline__ void block_add_sums(unsigned long long n, unsigned long long s,
                                               unsigned long long* dst) {
  for (int offset = 16; offset > 0; offset /= 2) {
    n += __shfl_down_sync(kFull, n, offset);
    s += __shfl_down_sync(kFull, s, offset);
  }
  __shared__ unsigned long long warp_n[kMaxWarps], warp_s[kMaxWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_n[warp] = n;
    warp_s[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 1; k < (int)(blockDim.x / 32); ++k) {
      n += warp_n[k];
      s += warp_s[k];
    }
    atomicAdd(dst, n);
    atomicAdd(dst + 1, s);
  }
}

// sums[2 * r] += N and sums[2 * r + 1] += S of row r's body (bytes kHeaderBytes ..
// P - kTrailerBytes, as 64-bit words w_i, i from 0): N = sum of lo32(y_i) * hi32(y_i) with
// y_i = w_i + (i + 1) * step, S = sum of the 32-bit halves of every w_i (both mod 2^64). Row r
// is blockIdx.y, `stride` bytes after row r - 1; rows start 8-byte aligned (the launcher
// checks). `sums` starts at zero.
__global__ void checksum(const unsigned char* __restrict__ msgs, long long P, long long stride,
                         unsigned long long step, unsigned long long* __restrict__ sums) {
  const long long row = blockIdx.y;
  const long long words = (P - loco::kHeaderBytes - kTrailerBytes) / 8;
  const unsigned long long* w =
      reinterpret_cast<const unsigned long long*>(msgs + row * stride + loco::kHeaderBytes);
  unsigned long long n = 0, s = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words;
       i += (long long)gridDim.x * blockDim.x)
    checksum_add(w[i], i, step, n, s);
  block_add_sums(n, s, sums + 2 * row);
}

// out[r] = the trailer of row r from its sums: S mod 2^32 in the low half, lo32(N) ^ hi32(N) in
// the high half (as the int64 bits of a uint64).
__global__ void checksum_fold(const unsigned long long* __restrict__ sums, long long rows,
                              long long* __restrict__ out) {
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  out[r] = (long long)loco::checksum_trailer(sums[2 * r], sums[2 * r + 1]);
}

// frame_body: the body pass of Kernels.frame (grid (blocks, rows), as checksum): every body word
// of row blockIdx.y is read with its padding bytes (from `used` on) cleared, written back where
// it holds padding, and summed into acc[3 * row] and acc[3 * row + 1] as checksum does; the row's
// `ng` non-finite bytes are OR-ed into acc[3 * row + 2]. `acc` [rows, 3] starts at zero. Without
// `with_checksum` only the words that hold padding are read (the sums are then not used).
__global__ void frame_body(unsigned char* __restrict__ msgs, long long P, long long used,
                           const unsigned char* __restrict__ nonfinite, long long ng,
                           unsigned long long step, int with_checksum,
                           unsigned long long* __restrict__ acc) {
  const long long row = blockIdx.y;
  const long long words = (P - loco::kHeaderBytes - kTrailerBytes) / 8;
  unsigned long long* w = reinterpret_cast<unsigned long long*>(msgs + row * P + loco::kHeaderBytes);
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long start = with_checksum ? 0 : (used - loco::kHeaderBytes) / 8;
  unsigned long long n = 0, s = 0;
  for (long long i = start + first; i < words; i += stride) {
    const long long at = loco::kHeaderBytes + 8 * i;
    const unsigned long long x = loco::padded_word(w[i], at, used);
    if (at + 8 > used) w[i] = x;
    checksum_add(x, i, step, n, s);
  }
  int bad = 0;
  for (long long j = first; j < ng; j += stride) bad |= nonfinite[row * ng + j] != 0;
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0 && bad) atomicOr(acc + 3 * row + 2, 1ull);
  block_add_sums(n, s, acc + 3 * row);
}

// frame_fold: one thread per row after frame_body: the row's header (`header` with shard
// shard0 + r and flags `flags`, plus kFlagNonfinite where acc[3 * r + 2] is set) and its
// trailer (the checksum from acc, or zeros without `with_checksum`); any_bad (one byte, zero
// before) becomes 1 where a row is non-finite. The row's three acc words are zero again after
// (the launcher keeps acc between calls on one stream instead of zero-filling it). Rows start
// 8-byte aligned (the launcher checks).
__global__ void frame_fold(unsigned char* __restrict__ msgs, long long P, long long rows,
                           unsigned long long* __restrict__ acc, const Header header,
                           long long shard0, unsigned int flags, int with_checksum,
                           unsigned char* __restrict__ any_bad) {
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const unsigned long long n = acc[3 * r], s = acc[3 * r + 1];
  const bool bad = acc[3 * r + 2] != 0;
  acc[3 * r] = acc[3 * r + 1] = acc[3 * r + 2] = 0ull;
  const unsigned int row_flags = flags | (bad ? loco::kFlagNonfinite : 0u);
  unsigned int* h = reinterpret_cast<unsigned int*>(msgs + r * P);
  for (int k = 0; k < loco::kHeaderBytes / 4; ++k)
    h[k] = loco::header_word(header.w, k, (unsigned int)(shard0 + r), row_flags);
  *reinterpret_cast<unsigned long long*>(msgs + r * P + P - kTrailerBytes) =
      with_checksum ? loco::checksum_trailer(n, s) : 0ull;
  if (bad) *any_bad = 1;
}

// check_fold: one thread per received row after checksum (sums [rows, 2]): the row is foreign
// where a header word differs from `header` with shard shard0 + r * shard_step and the row's
// own non-finite flag (any other flag differs), or, with `with_checksum`, where its trailer
// differs from its sums' fold; verdict[0] (foreign) and verdict[1] (non-finite), bytes zero
// before, become 1 where any row is. Rows of P bytes lie `stride` bytes apart and start 8-byte
// aligned (the launcher checks).
__global__ void check_fold(const unsigned char* __restrict__ msgs, long long P, long long stride,
                           long long rows,
                           const unsigned long long* __restrict__ sums, const Header header,
                           long long shard0, long long shard_step, int with_checksum,
                           unsigned char* __restrict__ verdict) {
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const unsigned char* row = msgs + r * stride;
  const unsigned int* h = reinterpret_cast<const unsigned int*>(row);
  const unsigned int flags = row[loco::kFlagsOffset];
  const unsigned int nonfinite = flags & loco::kFlagNonfinite;
  bool foreign = false;
  for (int k = 0; k < loco::kHeaderBytes / 4; ++k)
    foreign |= h[k] != loco::header_word(header.w, k, (unsigned int)(shard0 + r * shard_step),
                                         nonfinite);
  if (with_checksum)
    foreign |= *reinterpret_cast<const unsigned long long*>(row + P - kTrailerBytes) !=
               loco::checksum_trailer(sums[2 * r], sums[2 * r + 1]);
  if (foreign) verdict[0] = 1;
  if (nonfinite) verdict[1] = 1;
}

}  // namespace loco_cuda

#if defined(LOCO_INSTANTIATE_ALL)
#define LOCO_ENC_ARGS(T) const loco::EncodeArgs, const FrameArgs
#define LOCO_ENC_MODE(T, B, M)                                              \
  template __global__ void encode<T, B, M, false, 0>(LOCO_ENC_ARGS(T));     \
  template __global__ void encode<T, B, M, true, 0>(LOCO_ENC_ARGS(T));
#define LOCO_ENC(T, B) LOCO_ENC_MODE(T, B, 0) LOCO_ENC_MODE(T, B, 1) LOCO_ENC_MODE(T, B, 2) \
  LOCO_ENC_MODE(T, B, 3)
#define LOCO_ENC_MX(T)                                                      \
  template __global__ void encode<T, 4, 0, false, 1>(LOCO_ENC_ARGS(T));     \
  template __global__ void encode<T, 4, 1, false, 1>(LOCO_ENC_ARGS(T));     \
  template __global__ void encode<T, 4, 2, false, 1>(LOCO_ENC_ARGS(T));     \
  template __global__ void encode<T, 4, 3, false, 1>(LOCO_ENC_ARGS(T));
#define LOCO_ENC_GRID(T, B, F)                                              \
  template __global__ void encode<T, B, 0, false, F>(LOCO_ENC_ARGS(T));     \
  template __global__ void encode<T, B, 1, false, F>(LOCO_ENC_ARGS(T));     \
  template __global__ void encode<T, B, 2, false, F>(LOCO_ENC_ARGS(T));     \
  template __global__ void encode<T, B, 3, false, F>(LOCO_ENC_ARGS(T));
#define LOCO_ENC_NV(T) LOCO_ENC_GRID(T, 4, 2) LOCO_ENC_GRID(T, 3, 3) LOCO_ENC_GRID(T, 3, 4)
namespace loco_cuda {
LOCO_ENC(float, 2) LOCO_ENC(float, 4) LOCO_ENC(float, 8) LOCO_ENC_MX(float) LOCO_ENC_NV(float)
LOCO_ENC(__nv_bfloat16, 2) LOCO_ENC(__nv_bfloat16, 4) LOCO_ENC(__nv_bfloat16, 8)
LOCO_ENC_MX(__nv_bfloat16) LOCO_ENC_NV(__nv_bfloat16)
LOCO_ENC(__half, 2) LOCO_ENC(__half, 4) LOCO_ENC(__half, 8) LOCO_ENC_MX(__half)
LOCO_ENC_NV(__half)
#define LOCO_ESUM_ARGS const loco::EncodeArgs, const FrameArgs, const SumSource, const RowCheck
#define LOCO_ESUM(B, F, SR)                                                   \
  template __global__ void encode_sum<B, 0, SR, F>(LOCO_ESUM_ARGS);             \
  template __global__ void encode_sum<B, 1, SR, F>(LOCO_ESUM_ARGS);             \
  template __global__ void encode_sum<B, 2, SR, F>(LOCO_ESUM_ARGS);             \
  template __global__ void encode_sum<B, 3, SR, F>(LOCO_ESUM_ARGS);
LOCO_ESUM(2, 0, false) LOCO_ESUM(4, 0, false) LOCO_ESUM(8, 0, false)
LOCO_ESUM(2, 0, true) LOCO_ESUM(4, 0, true) LOCO_ESUM(8, 0, true)
LOCO_ESUM(4, 1, false) LOCO_ESUM(4, 2, false) LOCO_ESUM(3, 3, false) LOCO_ESUM(3, 4, false)
#define LOCO_DSUM(B, F) \
  template __global__ void decode_sum<B, F>(const unsigned char*, long long, long long, long long, int, float*, unsigned char*, const RowCheck);
LOCO_DSUM(2, 0) LOCO_DSUM(4, 0) LOCO_DSUM(8, 0) LOCO_DSUM(4, 1) LOCO_DSUM(4, 2) LOCO_DSUM(3, 3)
LOCO_DSUM(3, 4)
#define LOCO_DEC1(T, B, F) \
  template __global__ void decode_into<T, B, F>(const unsigned char*, long long, long long, int, long long, T*, unsigned char*, const RowCheck);
#define LOCO_ROWS1(T, B, F) \
  template __global__ void decode_rows<T, B, F>(const unsigned char*, long long, long long, long long, long long, int, long long, T*, unsigned char*, const RowCheck);
#define LOCO_ROWS(T) LOCO_ROWS1(T, 2, 0) LOCO_ROWS1(T, 4, 0) LOCO_ROWS1(T, 8, 0) \
  LOCO_ROWS1(T, 4, 1) LOCO_ROWS1(T, 4, 2) LOCO_ROWS1(T, 3, 3) LOCO_ROWS1(T, 3, 4)
LOCO_ROWS(float) LOCO_ROWS(__nv_bfloat16) LOCO_ROWS(__half)
#define LOCO_DEC(T) LOCO_DEC1(T, 2, 0) LOCO_DEC1(T, 4, 0) LOCO_DEC1(T, 8, 0) LOCO_DEC1(T, 4, 1) \
  LOCO_DEC1(T, 4, 2) LOCO_DEC1(T, 3, 3) LOCO_DEC1(T, 3, 4)
LOCO_DEC(float) LOCO_DEC(__nv_bfloat16) LOCO_DEC(__half)
}  // namespace loco_cuda
#endif
