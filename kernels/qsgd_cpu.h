// CPU entry points of the QSGD codec. Arrays are contiguous; `n` counts float32 elements.
// The payload layout is docs/wire-format.md; qsgd_math.h holds the per-element math.
#pragma once

#include <cstdint>
#include <string>

namespace qcomm::cpu {

struct Params {
  int32_t bits;      // 1..8 (norm: 2..8)
  int32_t bucket;    // positive multiple of 8
  int32_t scheme;    // Scheme
  int32_t rounding;  // Rounding
};

// x[n] -> payload[payload_bytes(n, ...)]; `seed` is two uint32 words derived from a JAX key.
void encode(const float* x, int64_t n, const uint32_t seed[2], const Params& p, uint8_t* payload);
// payload -> out[n].
void decode(const uint8_t* payload, int64_t n, const Params& p, float* out);
// out[n] = sum over j < k of decode(payloads + j * stride), summed in order j = 0, 1, ...
void decode_sum(const uint8_t* payloads, int64_t k, int64_t stride, int64_t n, const Params& p,
                float* out);

// payload = encode(decode_sum(payloads) * scale, seed): the middle of a compressed allreduce. The
// multiplication is skipped where scale == 1; the bytes equal those of the three steps done apart.
void decode_sum_reencode(const uint8_t* payloads, int64_t k, int64_t stride, int64_t n, float scale,
                         const uint32_t seed[2], const Params& p, uint8_t* payload);

// ---- the summable codec (kernels/summable_math.h, docs/wire-format.md "Summable") ----------------
struct SummableParams {
  int32_t bits;      // 2..8
  int32_t bucket;    // positive multiple of 8
  int32_t devices;   // payloads summed (sets the field width); >= 1, 2 L devices < 2^32
  int32_t rounding;  // Rounding
};
// x[n], shared[num_buckets(n)] (the bits of each bucket's largest |x| over all devices) ->
// words[ceil(n / fields)].
void summable_encode(const float* x, int64_t n, const int32_t* shared, const uint32_t seed[2],
                     const SummableParams& p, uint32_t* words);
// x[n] -> out[num_buckets(n)]: the bits of each bucket's largest |x| as int32 (NaN > Inf > finite).
void summable_scale(const float* x, int64_t n, int32_t bucket, int32_t* out);
// words (the sum of `count` payloads) -> out[n] = the sum of their decodes times `scale`.
void summable_decode(const uint32_t* words, const int32_t* shared, int64_t n, int32_t count,
                     float scale, const SummableParams& p, float* out);

// Name of the instruction set the kernels run ("avx512", "avx2" or "generic").
const char* isa();
// The widest instruction set this CPU supports (and this build has kernels for).
const char* detected_isa();
// Runs the kernels built for `name` ("avx512", "avx2" or "generic") from now on; it must be
// supported by this CPU (a narrower set than detected_isa() is fine). Returns "" on success, else
// why not (the ISA is unchanged). Call before any kernel runs (jax_qcomm does, at import).
std::string force_isa(const std::string& name);

}  // namespace qcomm::cpu
