// XLA FFI handlers for the QSGD CPU kernels, exported to Python as capsules (module _qcomm_cpu).
//
// The handlers only check shapes and attributes and loop over leading (vmap) batch rows; the
// codec math is in kernels/. Attribute types must match exactly what jax_qcomm/_ffi.py passes.
// xla_ffi/cuda_module.cc registers the same targets, with the same operands and attributes, for
// CUDA; the checks shared by both are in xla_ffi/qsgd_ffi_common.h.
#include <cstdint>
#include <string>

#include "kernels/qsgd_cpu.h"
#include "kernels/qsgd_math.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/qsgd_ffi_common.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
namespace common = qcomm::ffi_common;

namespace {

qcomm::cpu::Params CpuParams(const common::Params& p) {
  return qcomm::cpu::Params{p.bits, p.bucket, p.scheme, p.rounding};
}

// x[rows, n] f32, seed[rows, 2] u32 -> payload[rows, P] u8.
ffi::Error EncodeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> seed,
                      ffi::ResultBuffer<ffi::U8> payload, int32_t bits, int32_t bucket_size,
                      int32_t scheme, int32_t rounding) {
  const common::Params p{bits, bucket_size, scheme, rounding};
  common::Sizes s;
  if (ffi::Error e = common::EncodeSizes(p, x.dimensions(), x.element_count(), seed.element_count(),
                                         payload->dimensions(), payload->element_count(), &s);
      e.failure())
    return e;
  for (int64_t r = 0; r < s.rows; ++r)
    qcomm::cpu::encode(x.typed_data() + r * s.n, s.n, seed.typed_data() + 2 * r, CpuParams(p),
                       payload->typed_data() + r * s.bytes);
  return ffi::Error::Success();
}

// payloads[rows, k, P] u8 -> out[rows, n] f32: the sum of the k decoded payloads.
ffi::Error DecodeSumImpl(ffi::Buffer<ffi::U8> payloads, ffi::ResultBuffer<ffi::F32> out,
                         int32_t bits, int32_t bucket_size, int32_t scheme) {
  const common::Params p{bits, bucket_size, scheme, qcomm::kNearest};
  const int64_t n = common::LastDim(out->dimensions());
  common::Sizes s;
  if (ffi::Error e = common::DecodeSumSizes(p, payloads.dimensions(), payloads.element_count(), n,
                                            n == 0 ? 0 : out->element_count() / n, &s);
      e.failure())
    return e;
  for (int64_t r = 0; r < s.rows; ++r)
    qcomm::cpu::decode_sum(payloads.typed_data() + r * s.k * s.bytes, s.k, s.bytes, s.n,
                           CpuParams(p), out->typed_data() + r * s.n);
  return ffi::Error::Success();
}

// payloads[rows, k, P] u8, seed[rows, 2] u32 -> payload[rows, P] u8:
// encode(decode_sum(payloads) * scale, seed), the multiplication skipped where scale == 1.
ffi::Error DecodeSumReencodeImpl(ffi::Buffer<ffi::U8> payloads, ffi::Buffer<ffi::U32> seed,
                                 ffi::ResultBuffer<ffi::U8> payload, int32_t bits,
                                 int32_t bucket_size, int32_t scheme, int32_t rounding, int64_t n,
                                 float scale) {
  const common::Params p{bits, bucket_size, scheme, rounding};
  common::Sizes s;
  if (ffi::Error e = common::ReencodeSizes(p, payloads.dimensions(), payloads.element_count(),
                                           seed.element_count(), n, payload->dimensions(),
                                           payload->element_count(), &s);
      e.failure())
    return e;
  for (int64_t r = 0; r < s.rows; ++r)
    qcomm::cpu::decode_sum_reencode(payloads.typed_data() + r * s.k * s.bytes, s.k, s.bytes, s.n,
                                    scale, seed.typed_data() + 2 * r, CpuParams(p),
                                    payload->typed_data() + r * s.bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdEncode, EncodeImpl,
                              common::BindEncode(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdDecodeSum, DecodeSumImpl,
                              common::BindDecodeSum(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdDecodeSumReencode, DecodeSumReencodeImpl,
                              common::BindDecodeSumReencode(ffi::Ffi::Bind()));

NB_MODULE(_qcomm_cpu, m) {
  m.doc() = "QSGD codec CPU kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d["qcomm_qsgd_encode"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdEncode));
    d["qcomm_qsgd_decode_sum"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdDecodeSum));
    d["qcomm_qsgd_decode_sum_reencode"] =
        nb::capsule(reinterpret_cast<void*>(QcommQsgdDecodeSumReencode));
    return d;
  });
  m.def("isa", []() { return std::string(qcomm::cpu::isa()); },
        "Instruction set the CPU kernels run (the widest this CPU has, unless force_isa chose one).");
  m.def("detected_isa", []() { return std::string(qcomm::cpu::detected_isa()); },
        "The widest instruction set this CPU supports (and this build has kernels for).");
  m.def(
      "force_isa",
      [](const std::string& name) {
        const std::string error = qcomm::cpu::force_isa(name);
        if (!error.empty()) throw nb::value_error(error.c_str());
      },
      nb::arg("name"),
      "Runs the kernels built for `name` ('avx512', 'avx2', 'generic') from now on; ValueError if "
      "the name is unknown or this CPU lacks that instruction set.");
  // Sanitizers this module was built with (CMake option QCOMM_SANITIZE): "" in a normal build.
#if defined(QCOMM_SANITIZERS)
  m.attr("sanitizers") = QCOMM_SANITIZERS;
#else
  m.attr("sanitizers") = "";
#endif
}
