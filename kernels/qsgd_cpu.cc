// Run-time choice of the instruction set (the widest this CPU has, or a narrower one forced by
// force_isa), and the FTZ/DAZ mode XLA uses.
#include "qsgd_cpu.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace qcomm::cpu {

#define QCOMM_DECLARE_ISA(ISA)                                                                    \
  namespace ISA {                                                                                 \
  void encode(const float* x, int64_t n, const uint32_t seed[2], const Params& p, uint8_t* out);  \
  void decode_sum(const Pieces& m, int64_t first, int64_t k, int64_t n, const Params& p,          \
                  float* out);                                                                    \
  void decode_sum_reencode(const uint8_t* payloads, int64_t k, int64_t stride, int64_t n,         \
                           float scale, const uint32_t seed[2], const Params& p, uint8_t* out);   \
  void encode_leaves(const Leaves<const float>& x, int64_t n, int64_t skip,                      \
                     const uint32_t* seeds, const Params& p, const Pieces& payloads);             \
  void decode_sum_reencode_own(const Pieces& payloads, int64_t slot,                              \
                               const Leaves<const float>& own, int64_t row, int64_t n,            \
                               float scale, const uint32_t seed[2], const Params& p,              \
                               const Pieces& payload);                                            \
  void encode_chunks(const Chunks& x, int64_t skip, const uint32_t* seeds, const Params& p,       \
                     const Pieces& message);                                                      \
  void decode_sum_chunks(const Pieces& received, int64_t slot, const Chunks& own, float scale,    \
                         const Params& p, float* const* out, float* mark);                        \
  void decode_chunks(const Pieces& message, const Chunks& x, const Params& p, float* const* out);  \
  void encode_chunk_differences(const Chunks& x, const Chunks& minus, int64_t shard,              \
                                const uint32_t* seeds, const Params& p, const Pieces& message);   \
  void summable_encode(const Leaves<const float>& x, const int32_t* shared,                       \
                       const uint32_t seed[2], const SummableParams& p, uint32_t* words);         \
  void summable_decode(const uint32_t* words, const int32_t* shared, const Leaves<float>& out,    \
                       int32_t count, float scale, const SummableParams& p);                      \
  void summable_scale(const Leaves<const float>& x, int32_t bucket, int32_t* out);                \
  }
QCOMM_DECLARE_ISA(generic)
#if defined(QCOMM_HAVE_X86_VARIANTS)
QCOMM_DECLARE_ISA(avx2)
QCOMM_DECLARE_ISA(avx512)
#endif
#undef QCOMM_DECLARE_ISA

namespace {

enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };  // ordered: wider is larger

constexpr const char* kIsaNames[] = {"generic", "avx2", "avx512"};

Isa detect() {
#if defined(QCOMM_HAVE_X86_VARIANTS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

const Isa kDetected = detect();
// What the dispatcher runs: the detected ISA unless force_isa() chose a narrower one (at import,
// before any kernel runs; atomic all the same, relaxed loads cost nothing).
std::atomic<int> g_isa{static_cast<int>(kDetected)};

Isa current() { return static_cast<Isa>(g_isa.load(std::memory_order_relaxed)); }

// XLA's CPU runtime flushes denormals (FTZ + DAZ); the kernels run the same way so that they
// produce the same bytes as the pure-JAX reference.
class FlushDenormals {
 public:
#if defined(__x86_64__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

}  // namespace

const char* isa() { return kIsaNames[static_cast<int>(current())]; }
const char* detected_isa() { return kIsaNames[static_cast<int>(kDetected)]; }

std::string force_isa(const std::string& name) {
  for (int i = 0; i < 3; ++i) {
    if (name != kIsaNames[i]) continue;
    if (i > static_cast<int>(kDetected))
      return "this CPU does not support '" + name + "' (it supports up to '" + detected_isa() +
             "')";
    g_isa.store(i, std::memory_order_relaxed);
    return "";
  }
  return "unknown instruction set '" + name + "' (expected one of 'avx512', 'avx2', 'generic')";
}

void encode(const float* x, int64_t n, const uint32_t seed[2], const Params& p, uint8_t* payload) {
  FlushDenormals ftz;
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512) return avx512::encode(x, n, seed, p, payload);
  if (which == Isa::kAvx2) return avx2::encode(x, n, seed, p, payload);
#endif
  generic::encode(x, n, seed, p, payload);
}

void encode_leaves(const Leaves<const float>& x, int64_t n, int64_t skip, const uint32_t* seeds,
                   const Params& p, const Pieces& payloads) {
  FlushDenormals ftz;
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512) return avx512::encode_leaves(x, n, skip, seeds, p, payloads);
  if (which == Isa::kAvx2) return avx2::encode_leaves(x, n, skip, seeds, p, payloads);
#endif
  generic::encode_leaves(x, n, skip, seeds, p, payloads);
}

void decode_sum_reencode_own(const Pieces& payloads, int64_t slot, const Leaves<const float>& own,
                             int64_t row, int64_t n, float scale, const uint32_t seed[2],
                             const Params& p, const Pieces& payload) {
  FlushDenormals ftz;  // as XLA CPU adds and scales (DAZ: a subnormal own value adds as 0)
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512)
    return avx512::decode_sum_reencode_own(payloads, slot, own, row, n, scale, seed, p, payload);
  if (which == Isa::kAvx2)
    return avx2::decode_sum_reencode_own(payloads, slot, own, row, n, scale, seed, p, payload);
#endif
  generic::decode_sum_reencode_own(payloads, slot, own, row, n, scale, seed, p, payload);
}

void encode_chunks(const Chunks& x, int64_t skip, const uint32_t* seeds, const Params& p,
                   const Pieces& message) {
  FlushDenormals ftz;
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512) return avx512::encode_chunks(x, skip, seeds, p, message);
  if (which == Isa::kAvx2) return avx2::encode_chunks(x, skip, seeds, p, message);
#endif
  generic::encode_chunks(x, skip, seeds, p, message);
}

void encode_chunk_differences(const Chunks& x, const Chunks& minus, int64_t shard,
                              const uint32_t* seeds, const Params& p, const Pieces& message) {
  FlushDenormals ftz;  // as XLA CPU subtracts
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512)
    return avx512::encode_chunk_differences(x, minus, shard, seeds, p, message);
  if (which == Isa::kAvx2) return avx2::encode_chunk_differences(x, minus, shard, seeds, p, message);
#endif
  generic::encode_chunk_differences(x, minus, shard, seeds, p, message);
}

void decode_chunks(const Pieces& message, const Chunks& x, const Params& p, float* const* out) {
  FlushDenormals ftz;
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512) return avx512::decode_chunks(message, x, p, out);
  if (which == Isa::kAvx2) return avx2::decode_chunks(message, x, p, out);
#endif
  generic::decode_chunks(message, x, p, out);
}

void decode_sum_chunks(const Pieces& received, int64_t slot, const Chunks& own, float scale,
                       const Params& p, float* const* out, float* mark) {
  FlushDenormals ftz;  // as XLA CPU adds and scales
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512)
    return avx512::decode_sum_chunks(received, slot, own, scale, p, out, mark);
  if (which == Isa::kAvx2) return avx2::decode_sum_chunks(received, slot, own, scale, p, out, mark);
#endif
  generic::decode_sum_chunks(received, slot, own, scale, p, out, mark);
}

void decode_sum(const Pieces& m, int64_t first, int64_t k, int64_t n, const Params& p, float* out) {
  FlushDenormals ftz;
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512) return avx512::decode_sum(m, first, k, n, p, out);
  if (which == Isa::kAvx2) return avx2::decode_sum(m, first, k, n, p, out);
#endif
  generic::decode_sum(m, first, k, n, p, out);
}

void summable_encode(const Leaves<const float>& x, const int32_t* shared, const uint32_t seed[2],
                     const SummableParams& p, uint32_t* words) {
  FlushDenormals ftz;
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512) return avx512::summable_encode(x, shared, seed, p, words);
  if (which == Isa::kAvx2) return avx2::summable_encode(x, shared, seed, p, words);
#endif
  generic::summable_encode(x, shared, seed, p, words);
}

void summable_decode(const uint32_t* words, const int32_t* shared, const Leaves<float>& out,
                     int32_t count, float scale, const SummableParams& p) {
  FlushDenormals ftz;
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512) return avx512::summable_decode(words, shared, out, count, scale, p);
  if (which == Isa::kAvx2) return avx2::summable_decode(words, shared, out, count, scale, p);
#endif
  generic::summable_decode(words, shared, out, count, scale, p);
}

void summable_scale(const Leaves<const float>& x, int32_t bucket, int32_t* out) {
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512) return avx512::summable_scale(x, bucket, out);
  if (which == Isa::kAvx2) return avx2::summable_scale(x, bucket, out);
#endif
  generic::summable_scale(x, bucket, out);
}

void decode(const uint8_t* payload, int64_t n, const Params& p, float* out) {
  const int64_t bytes = payload_bytes(n, p.bucket, p.bits, p.scheme);
  decode_sum(whole_rows(payload, 1, bytes, bytes).pieces(), 0, 1, n, p, out);
}

void decode_sum_reencode(const uint8_t* payloads, int64_t k, int64_t stride, int64_t n, float scale,
                         const uint32_t seed[2], const Params& p, uint8_t* payload) {
  FlushDenormals ftz;  // as XLA CPU computes `reduced * scale`, and as the two kernels run
#if defined(QCOMM_HAVE_X86_VARIANTS)
  const Isa which = current();
  if (which == Isa::kAvx512)
    return avx512::decode_sum_reencode(payloads, k, stride, n, scale, seed, p, payload);
  if (which == Isa::kAvx2)
    return avx2::decode_sum_reencode(payloads, k, stride, n, scale, seed, p, payload);
#endif
  generic::decode_sum_reencode(payloads, k, stride, n, scale, seed, p, payload);
}

}  // namespace qcomm::cpu
