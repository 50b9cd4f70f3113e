// XLA FFI handlers for the QSGD CPU kernels, exported to Python as capsules (module _qcomm_cpu).
//
// The handlers only check shapes and attributes and loop over leading (vmap) batch rows; the
// codec math is in kernels/. Attribute types must match exactly what jax_qcomm/_ffi.py passes.
#include <cstdint>
#include <string>

#include "kernels/qsgd_cpu.h"
#include "kernels/qsgd_math.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

ffi::Error CheckParams(const qcomm::cpu::Params& p) {
  if (p.scheme != qcomm::kMaxMin && p.scheme != qcomm::kNorm)
    return ffi::Error::InvalidArgument("scheme must be 0 (maxmin) or 1 (norm)");
  const int32_t min_bits = p.scheme == qcomm::kNorm ? 2 : 1;
  if (p.bits < min_bits || p.bits > 8)
    return ffi::Error::InvalidArgument("bits must be in 1..8 (2..8 for the norm scheme), got " +
                                       std::to_string(p.bits));
  if (p.bucket <= 0 || p.bucket % 8 != 0)
    return ffi::Error::InvalidArgument("bucket_size must be a positive multiple of 8, got " +
                                       std::to_string(p.bucket));
  if (p.rounding != qcomm::kStochastic && p.rounding != qcomm::kNearest)
    return ffi::Error::InvalidArgument("rounding must be 0 (stochastic) or 1 (nearest)");
  return ffi::Error::Success();
}

int64_t LastDim(ffi::Span<const int64_t> dims) { return dims.size() == 0 ? 1 : dims.back(); }

// x[rows, n] f32, seed[rows, 2] u32 -> payload[rows, P] u8.
ffi::Error EncodeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> seed,
                      ffi::ResultBuffer<ffi::U8> payload, int32_t bits, int32_t bucket_size,
                      int32_t scheme, int32_t rounding) {
  const qcomm::cpu::Params p{bits, bucket_size, scheme, rounding};
  if (ffi::Error e = CheckParams(p); e.failure()) return e;
  const int64_t n = LastDim(x.dimensions());
  const int64_t rows = n == 0 ? 0 : x.element_count() / n;
  const int64_t bytes = qcomm::payload_bytes(n, bucket_size, bits, scheme);
  if (LastDim(payload->dimensions()) != bytes || payload->element_count() != rows * bytes)
    return ffi::Error::InvalidArgument("payload shape does not match the input size");
  if (seed.element_count() != 2 * rows)
    return ffi::Error::InvalidArgument("seed must hold 2 uint32 words per row");
  for (int64_t r = 0; r < rows; ++r)
    qcomm::cpu::encode(x.typed_data() + r * n, n, seed.typed_data() + 2 * r, p,
                       payload->typed_data() + r * bytes);
  return ffi::Error::Success();
}

// payloads[rows, k, P] u8 -> out[rows, n] f32: the sum of the k decoded payloads.
ffi::Error DecodeSumImpl(ffi::Buffer<ffi::U8> payloads, ffi::ResultBuffer<ffi::F32> out,
                         int32_t bits, int32_t bucket_size, int32_t scheme) {
  const qcomm::cpu::Params p{bits, bucket_size, scheme, qcomm::kNearest};
  if (ffi::Error e = CheckParams(p); e.failure()) return e;
  const auto dims = payloads.dimensions();
  if (dims.size() < 2) return ffi::Error::InvalidArgument("payloads must be [..., k, bytes]");
  const int64_t k = dims[dims.size() - 2];
  const int64_t bytes = dims.back();
  const int64_t n = LastDim(out->dimensions());
  const int64_t rows = n == 0 ? 0 : out->element_count() / n;
  if (bytes != qcomm::payload_bytes(n, bucket_size, bits, scheme))
    return ffi::Error::InvalidArgument("payload size does not match the output size");
  if (k < 1 || payloads.element_count() != rows * k * bytes)
    return ffi::Error::InvalidArgument("payloads and output disagree on the batch size");
  for (int64_t r = 0; r < rows; ++r)
    qcomm::cpu::decode_sum(payloads.typed_data() + r * k * bytes, k, bytes, n, p,
                           out->typed_data() + r * n);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdEncode, EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("bucket_size")
                                  .Attr<int32_t>("scheme")
                                  .Attr<int32_t>("rounding"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdDecodeSum, DecodeSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("bucket_size")
                                  .Attr<int32_t>("scheme"));

NB_MODULE(_qcomm_cpu, m) {
  m.doc() = "QSGD codec CPU kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d["qcomm_qsgd_encode"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdEncode));
    d["qcomm_qsgd_decode_sum"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdDecodeSum));
    return d;
  });
  m.def("isa", []() { return std::string(qcomm::cpu::isa()); },
        "Instruction set the CPU kernels dispatch to on this machine.");
}
