// The CPU loops of the summable codec (jax_qcomm.Summable), compiled once per instruction set.
//
// Included by qsgd_cpu_<isa>.cc inside its ISA namespace after qsgd_cpu_loops.h (same flags, same
// run-time dispatch in qsgd_cpu.cc). The words are built in blocks of kBlock words held in L1: for
// each field i the elements [i*nw + J0, i*nw + J1) are read in runs that share one bucket, and each
// run is a contiguous loop over (value, word) pairs with one set of scales: the auto-vectoriser
// turns it into SIMD code (the hash, floor, compares and shifts all have vector forms).
#include <math.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qsgd_cpu.h"
#include "summable_math.h"

namespace {

constexpr int64_t kSummableBlock = 1024;  // words per block: 4 KiB

// acc[j] |= code(x[j]) << shift for one run of `len` values of one bucket, indices base.. .
// (uint32 induction variables: the element index is a uint32 lane, no 64-bit lanes to narrow.)
inline void summable_codes_run(const float* __restrict x, int64_t len, float down, float inv,
                               bool stochastic, uint32_t seed0, uint32_t seed1, uint32_t base,
                               int32_t lv, uint32_t shift, uint32_t* __restrict acc) {
  const uint32_t m = static_cast<uint32_t>(len);  // <= kSummableBlock
  if (stochastic) {
    uint32_t h = base * qcomm::summable::kIndexMul + seed0;  // index * C + seed0, index = base + j
    for (uint32_t j = 0; j < m; ++j) {
      const float r = qcomm::uniform01(qcomm::summable::random_bits_at(h, seed1));
      acc[j] |= qcomm::summable::encode_value(x[j], down, inv, r, lv) << shift;
      h += qcomm::summable::kIndexMul;
    }
  } else {
    for (uint32_t j = 0; j < m; ++j)
      acc[j] |= qcomm::summable::encode_value(x[j], down, inv, 0.5f, lv) << shift;
  }
}

// out[b] = the bits of the largest |x| of bucket b (an exact integer max; NaN > Inf > finite).
void summable_scale_impl(const float* __restrict x, int64_t n, int64_t B, int32_t* out) {
  const int64_t nb = qcomm::num_buckets(n, B);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * B;
    const int64_t len = std::min<int64_t>(B, n - b * B);
    uint32_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
      for (int j = 0; j < 8; ++j) {
        const uint32_t a = qcomm::abs_bits(xb[i + j]);
        acc[j] = a > acc[j] ? a : acc[j];
      }
    uint32_t m = 0;
    for (; i < len; ++i) m = std::max(m, qcomm::abs_bits(xb[i]));
    for (int j = 0; j < 8; ++j) m = std::max(m, acc[j]);
    out[b] = static_cast<int32_t>(m);
  }
}

void summable_encode_impl(const float* x, int64_t n, const int32_t* shared, const uint32_t seed[2],
                          const qcomm::cpu::SummableParams& p, uint32_t* words) {
  const int32_t lv = qcomm::summable::levels(p.bits);
  const int32_t w = qcomm::summable::field_bits(p.bits, p.devices);
  const int32_t f = 32 / w;
  const int64_t nw = qcomm::summable::num_words(n, f);
  const int64_t B = p.bucket;
  const bool stochastic = p.rounding == qcomm::kStochastic;
  alignas(64) uint32_t acc[kSummableBlock];
  for (int64_t j0 = 0; j0 < nw; j0 += kSummableBlock) {
    const int64_t len = std::min<int64_t>(kSummableBlock, nw - j0);
    for (int32_t i = 0; i < f; ++i) {
      const uint32_t shift = static_cast<uint32_t>(i * w);
      const int64_t first = i * nw + j0, end = first + len;
      int64_t e = first;
      while (e < end) {
        if (e >= n) {  // padding: the code of 0 (q = 0)
          const uint32_t pad = static_cast<uint32_t>(lv) << shift;
          for (int64_t j = e - first; j < len; ++j) acc[j] = (i == 0 ? 0u : acc[j]) | pad;
          break;
        }
        const int64_t run_end = std::min<int64_t>({end, (e / B + 1) * B, n});
        const qcomm::summable::BucketScales s = qcomm::summable::bucket_scales(shared[e / B], p.bits);
        uint32_t* a = acc + (e - first);
        if (i == 0) std::fill(a, a + (run_end - e), 0u);
        summable_codes_run(x + e, run_end - e, s.down, s.inv, stochastic, seed[0], seed[1],
                           static_cast<uint32_t>(e), lv, shift, a);
        e = run_end;
      }
    }
    memcpy(words + j0, acc, 4 * len);  // rows of a vmapped call may start at any 4-byte offset
  }
}

void summable_decode_impl(const uint32_t* words, const int32_t* shared, int64_t n, int32_t count,
                          float scale, const qcomm::cpu::SummableParams& p, float* out) {
  const int32_t lv = qcomm::summable::levels(p.bits);
  const int32_t w = qcomm::summable::field_bits(p.bits, p.devices);
  const int32_t f = 32 / w;
  const int64_t nw = qcomm::summable::num_words(n, f);
  const int64_t B = p.bucket;
  const uint32_t mask = w >= 32 ? 0xffffffffu : (1u << w) - 1u;
  const uint32_t offset = static_cast<uint32_t>(count) * static_cast<uint32_t>(lv);
  for (int32_t i = 0; i < f; ++i) {
    const uint32_t shift = static_cast<uint32_t>(i * w);
    const int64_t first = i * nw, end = std::min<int64_t>(first + nw, n);
    for (int64_t e = first; e < end;) {
      const int64_t run_end = std::min<int64_t>(end, (e / B + 1) * B);
      const qcomm::summable::BucketScales s = qcomm::summable::bucket_scales(shared[e / B], p.bits);
      const uint32_t* __restrict wd = words + (e - first);
      float* __restrict o = out + e;
      for (int64_t j = 0; j < run_end - e; ++j)
        o[j] = qcomm::summable::decode_value((wd[j] >> shift) & mask, offset, s, scale);
      e = run_end;
    }
  }
}

}  // namespace

namespace qcomm::cpu::QCOMM_ISA {

void summable_encode(const float* x, int64_t n, const int32_t* shared, const uint32_t seed[2],
                     const SummableParams& p, uint32_t* words) {
  summable_encode_impl(x, n, shared, seed, p, words);
}

void summable_decode(const uint32_t* words, const int32_t* shared, int64_t n, int32_t count,
                     float scale, const SummableParams& p, float* out) {
  summable_decode_impl(words, shared, n, count, scale, p, out);
}

void summable_scale(const float* x, int64_t n, int32_t bucket, int32_t* out) {
  summable_scale_impl(x, n, bucket, out);
}

}  // namespace qcomm::cpu::QCOMM_ISA
