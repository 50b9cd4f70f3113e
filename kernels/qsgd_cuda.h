// CUDA entry points of the QSGD codec (kernels/qsgd_cuda.cu). Pointers are device memory; arrays
// are contiguous, `rows` independent rows of `n` float32 elements each (the leading, vmapped,
// dimensions of an FFI call). The payload layout is docs/wire-format.md and the per-element math
// is kernels/qsgd_math.h, shared with the CPU kernels: for the same input and seed the payload
// bytes and the decoded float32 values are the same as those of kernels/qsgd_cpu.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace qcomm::cuda {

struct Params {
  int32_t bits;      // 1..8 (norm: 2..8)
  int32_t bucket;    // positive multiple of 8
  int32_t scheme;    // Scheme
  int32_t rounding;  // Rounding
};

// x[rows, n] -> payload[rows, P]; seed[rows, 2] holds two uint32 words per row (device memory).
cudaError_t encode(cudaStream_t stream, const float* x, int64_t rows, int64_t n,
                   const uint32_t* seed, const Params& p, uint8_t* payload);
// payloads[rows, k, P] -> out[rows, n]: the k decodes of a row summed in order j = 0, 1, ...
cudaError_t decode_sum(cudaStream_t stream, const uint8_t* payloads, int64_t rows, int64_t k,
                       int64_t n, const Params& p, float* out);
// payloads[rows, k, P] -> payload[rows, P] = encode(decode_sum(payloads) * scale, seed), fused
// (the reduced values never leave registers); no multiplication where scale == 1.
cudaError_t decode_sum_reencode(cudaStream_t stream, const uint8_t* payloads, int64_t rows,
                                int64_t k, int64_t n, float scale, const uint32_t* seed,
                                const Params& p, uint8_t* payload);

}  // namespace qcomm::cuda
