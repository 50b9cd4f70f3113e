// Attribute and shape checks shared by the CPU and CUDA FFI handlers (xla_ffi/*_module.cc), so
// that both platforms accept and reject exactly the same calls.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "kernels/qsgd_math.h"
#include "xla/ffi/api/ffi.h"

namespace qcomm::ffi_common {

namespace ffi = xla::ffi;

struct Params {
  int32_t bits;      // 1..8 (norm: 2..8)
  int32_t bucket;    // positive multiple of 8
  int32_t scheme;    // Scheme
  int32_t rounding;  // Rounding
};

inline ffi::Error CheckParams(const Params& p) {
  if (p.scheme != kMaxMin && p.scheme != kNorm)
    return ffi::Error::InvalidArgument("scheme must be 0 (maxmin) or 1 (norm)");
  const int32_t min_bits = p.scheme == kNorm ? 2 : 1;
  if (p.bits < min_bits || p.bits > 8)
    return ffi::Error::InvalidArgument("bits must be in 1..8 (2..8 for the norm scheme), got " +
                                       std::to_string(p.bits));
  if (p.bucket <= 0 || p.bucket % 8 != 0)
    return ffi::Error::InvalidArgument("bucket_size must be a positive multiple of 8, got " +
                                       std::to_string(p.bucket));
  if (p.rounding != kStochastic && p.rounding != kNearest)
    return ffi::Error::InvalidArgument("rounding must be 0 (stochastic) or 1 (nearest)");
  return ffi::Error::Success();
}

inline int64_t LastDim(ffi::Span<const int64_t> dims) { return dims.size() == 0 ? 1 : dims.back(); }

// Sizes of one call: `rows` independent (vmap) rows of n elements, k payloads of `bytes` each.
struct Sizes {
  int64_t rows = 0, n = 0, k = 1, bytes = 0;
};

// x[rows, n] f32, seed[rows, 2] u32 -> payload[rows, P] u8.
inline ffi::Error EncodeSizes(const Params& p, ffi::Span<const int64_t> x_dims, int64_t x_count,
                              int64_t seed_count, ffi::Span<const int64_t> out_dims,
                              int64_t out_count, Sizes* s) {
  if (ffi::Error e = CheckParams(p); e.failure()) return e;
  s->n = LastDim(x_dims);
  s->rows = s->n == 0 ? 0 : x_count / s->n;
  s->bytes = payload_bytes(s->n, p.bucket, p.bits, p.scheme);
  if (LastDim(out_dims) != s->bytes || out_count != s->rows * s->bytes)
    return ffi::Error::InvalidArgument("payload shape does not match the input size");
  if (seed_count != 2 * s->rows)
    return ffi::Error::InvalidArgument("seed must hold 2 uint32 words per row");
  return ffi::Error::Success();
}

// payloads[rows, k, P] u8 -> [rows, n] elements (decode_sum: the output; reencode: n is given).
inline ffi::Error DecodeSumSizes(const Params& p, ffi::Span<const int64_t> in_dims, int64_t in_count,
                                 int64_t n, int64_t rows, Sizes* s) {
  if (ffi::Error e = CheckParams(p); e.failure()) return e;
  if (in_dims.size() < 2) return ffi::Error::InvalidArgument("payloads must be [..., k, bytes]");
  s->k = in_dims[in_dims.size() - 2];
  s->bytes = in_dims.back();
  s->n = n;
  s->rows = rows;
  if (s->bytes != payload_bytes(n, p.bucket, p.bits, p.scheme))
    return ffi::Error::InvalidArgument("payload size does not match the output size");
  if (s->k < 1 || in_count != s->rows * s->k * s->bytes)
    return ffi::Error::InvalidArgument("payloads and output disagree on the batch size");
  return ffi::Error::Success();
}

// payloads[rows, k, P] u8, seed[rows, 2] u32 -> payload[rows, P] u8; n (an attribute) elements:
// the payload size alone does not tell n, and the last bucket's padding depends on it.
inline ffi::Error ReencodeSizes(const Params& p, ffi::Span<const int64_t> in_dims, int64_t in_count,
                                int64_t seed_count, int64_t n, ffi::Span<const int64_t> out_dims,
                                int64_t out_count, Sizes* s) {
  if (ffi::Error e = CheckParams(p); e.failure()) return e;
  if (n < 0) return ffi::Error::InvalidArgument("n must be >= 0");
  const int64_t bytes = payload_bytes(n, p.bucket, p.bits, p.scheme);
  if (LastDim(out_dims) != bytes)
    return ffi::Error::InvalidArgument("output payload size does not match n");
  const int64_t rows = bytes == 0 ? 0 : out_count / bytes;
  if (ffi::Error e = DecodeSumSizes(p, in_dims, in_count, n, rows, s); e.failure()) return e;
  if (seed_count != 2 * rows)
    return ffi::Error::InvalidArgument("seed must hold 2 uint32 words per row");
  return ffi::Error::Success();
}

// The operands, results and attributes of the three targets, appended to a platform's binding (the
// CUDA module first adds its stream context): one declaration for both modules, with the attribute
// names jax_qcomm/_ffi.py passes.
template <typename B>
auto BindEncode(B binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::U32>>()
      .template Ret<ffi::Buffer<ffi::U8>>()
      .template Attr<int32_t>("bits")
      .template Attr<int32_t>("bucket_size")
      .template Attr<int32_t>("scheme")
      .template Attr<int32_t>("rounding");
}

template <typename B>
auto BindDecodeSum(B binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::U8>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int32_t>("bits")
      .template Attr<int32_t>("bucket_size")
      .template Attr<int32_t>("scheme");
}

template <typename B>
auto BindDecodeSumReencode(B binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::U8>>()
      .template Arg<ffi::Buffer<ffi::U32>>()
      .template Ret<ffi::Buffer<ffi::U8>>()
      .template Attr<int32_t>("bits")
      .template Attr<int32_t>("bucket_size")
      .template Attr<int32_t>("scheme")
      .template Attr<int32_t>("rounding")
      .template Attr<int64_t>("n")
      .template Attr<float>("scale");
}

}  // namespace qcomm::ffi_common
