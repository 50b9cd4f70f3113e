// XLA FFI handlers for the QSGD CUDA kernels, exported to Python as capsules (module _qcomm_cuda).
//
// Same targets, operands and attributes as xla_ffi/cpu_module.cc (the checks are shared in
// xla_ffi/qsgd_ffi_common.h); the kernels (kernels/qsgd_cuda.cu) run on the stream XLA gives.
// jax_qcomm/_ffi.py registers registrations() for platform "CUDA".
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/qsgd_cuda.h"
#include "kernels/qsgd_math.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/qsgd_ffi_common.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
namespace common = qcomm::ffi_common;

namespace {

qcomm::cuda::Params CudaParams(const common::Params& p) {
  return qcomm::cuda::Params{p.bits, p.bucket, p.scheme, p.rounding};
}

ffi::Error CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

// x[rows, n] f32, seed[rows, 2] u32 -> payload[rows, P] u8.
ffi::Error EncodeImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> seed,
                      ffi::ResultBuffer<ffi::U8> payload, int32_t bits, int32_t bucket_size,
                      int32_t scheme, int32_t rounding) {
  const common::Params p{bits, bucket_size, scheme, rounding};
  common::Sizes s;
  if (ffi::Error e = common::EncodeSizes(p, x.dimensions(), x.element_count(), seed.element_count(),
                                         payload->dimensions(), payload->element_count(), &s);
      e.failure())
    return e;
  return CudaStatus(qcomm::cuda::encode(stream, x.typed_data(), s.rows, s.n, seed.typed_data(),
                                        CudaParams(p), payload->typed_data()),
                    "qcomm_qsgd_encode");
}

// payloads[rows, k, P] u8 -> out[rows, n] f32: the sum of the k decoded payloads.
ffi::Error DecodeSumImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> payloads,
                         ffi::ResultBuffer<ffi::F32> out, int32_t bits, int32_t bucket_size,
                         int32_t scheme) {
  const common::Params p{bits, bucket_size, scheme, qcomm::kNearest};
  const int64_t n = common::LastDim(out->dimensions());
  common::Sizes s;
  if (ffi::Error e = common::DecodeSumSizes(p, payloads.dimensions(), payloads.element_count(), n,
                                            n == 0 ? 0 : out->element_count() / n, &s);
      e.failure())
    return e;
  return CudaStatus(qcomm::cuda::decode_sum(stream, payloads.typed_data(), s.rows, s.k, s.n,
                                            CudaParams(p), out->typed_data()),
                    "qcomm_qsgd_decode_sum");
}

// payloads[rows, k, P] u8, seed[rows, 2] u32 -> payload[rows, P] u8:
// encode(decode_sum(payloads) * scale, seed), the multiplication skipped where scale == 1.
ffi::Error DecodeSumReencodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> payloads,
                                 ffi::Buffer<ffi::U32> seed, ffi::ResultBuffer<ffi::U8> payload,
                                 int32_t bits, int32_t bucket_size, int32_t scheme,
                                 int32_t rounding, int64_t n, float scale) {
  const common::Params p{bits, bucket_size, scheme, rounding};
  common::Sizes s;
  if (ffi::Error e = common::ReencodeSizes(p, payloads.dimensions(), payloads.element_count(),
                                           seed.element_count(), n, payload->dimensions(),
                                           payload->element_count(), &s);
      e.failure())
    return e;
  return CudaStatus(
      qcomm::cuda::decode_sum_reencode(stream, payloads.typed_data(), s.rows, s.k, s.n, scale,
                                       seed.typed_data(), CudaParams(p), payload->typed_data()),
      "qcomm_qsgd_decode_sum_reencode");
}

// Every handler runs on the stream XLA gives it.
auto StreamBinding() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdEncodeCuda, EncodeImpl,
                              common::BindEncode(StreamBinding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdDecodeSumCuda, DecodeSumImpl,
                              common::BindDecodeSum(StreamBinding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdDecodeSumReencodeCuda, DecodeSumReencodeImpl,
                              common::BindDecodeSumReencode(StreamBinding()));

NB_MODULE(_qcomm_cuda, m) {
  m.doc() = "QSGD codec CUDA kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d["qcomm_qsgd_encode"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdEncodeCuda));
    d["qcomm_qsgd_decode_sum"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdDecodeSumCuda));
    d["qcomm_qsgd_decode_sum_reencode"] =
        nb::capsule(reinterpret_cast<void*>(QcommQsgdDecodeSumReencodeCuda));
    return d;
  });
  m.def("cuda_runtime_version", []() {
    int v = 0;
    cudaRuntimeGetVersion(&v);
    return v;
  }, "CUDA runtime version the module was linked with (statically), e.g. 13000.");
  m.def("architectures", []() { return std::string(QCOMM_CUDA_ARCHITECTURES); },
        "CUDA architectures the kernels were compiled for (CMake CUDA_ARCHITECTURES).");
}
