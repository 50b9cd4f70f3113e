// The CPU loops of the summable codec (jax_qcomm.Summable), compiled once per instruction set.
//
// Included by qsgd_cpu_<isa>.cc inside its ISA namespace after qsgd_cpu_loops.h (same flags, same
// run-time dispatch in qsgd_cpu.cc). The words are built in blocks of kBlock words held in L2: for
// each field i the elements [i*nw + J0, i*nw + J1) are read in runs that share one bucket, and each
// run is a contiguous loop over (value, word) pairs with one set of scales: the auto-vectoriser
// turns it into SIMD code (the hash, floor, compares and shifts all have vector forms). The block is
// long so that each field's run of input is long: a 4 KiB run per field (1024 words) restarted the
// hardware prefetcher at every page, and 25.6M-value encodes took 18 ms against 12.5 ms (AVX-512).
// Reads and writes go through `Leaves`, so one kernel serves a flat buffer and a list of leaves.
#include <math.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qsgd_cpu.h"
#include "summable_math.h"

namespace {

constexpr int64_t kSummableBlock = 16384;  // words per block: 64 KiB

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

// Where the elements [e, end) of a leaf buffer come from (or go to): *ptr = the leaf's memory at
// e, returned = how many of them are the leaf's (the rest, up to end, are padding). [e, end) lies
// in one bucket, hence in one leaf's span; *hint is the leaf of the previous run.
template <typename T>
inline int64_t leaf_run(const qcomm::cpu::Leaves<T>& v, int64_t e, int64_t end, int64_t* hint,
                        T** ptr) {
  const int64_t i = v.find(e, *hint);
  *hint = i;
  const int64_t local = e - v.start[i];
  const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(end - e, v.size[i] - local));
  *ptr = valid > 0 ? v.data[i] + local : v.data[i];  // no pointer past the leaf's end
  return valid;
}

inline uint32_t max_abs_bits(const float* xb, int64_t len) {
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
  return m;
}

// out[b] = the bits of the largest |x| of bucket b (an exact integer max; NaN > Inf > finite;
// padding is zeros, which never raise it).
void summable_scale_impl(const qcomm::cpu::Leaves<const float>& x, int64_t B, int32_t* out) {
  const int64_t n = x.length();
  const int64_t nb = qcomm::num_buckets(n, B);
  int64_t hint = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb;
    const int64_t len = leaf_run(x, b * B, std::min<int64_t>((b + 1) * B, n), &hint, &xb);
    out[b] = static_cast<int32_t>(max_abs_bits(xb, len));
  }
}

void summable_encode_impl(const qcomm::cpu::Leaves<const float>& x, const int32_t* shared,
                          const uint32_t seed[2], const qcomm::cpu::SummableParams& p,
                          uint32_t* words) {
  const int64_t n = x.length();
  const int32_t lv = qcomm::summable::levels(p.bits);
  const int32_t w = qcomm::summable::field_bits(p.bits, p.devices);
  const int32_t f = 32 / w;
  const int64_t nw = qcomm::summable::num_words(n, f);
  const int64_t B = p.bucket;
  const bool stochastic = p.rounding == qcomm::kStochastic;
  alignas(64) uint32_t acc[kSummableBlock];
  int64_t hint = 0;
  for (int64_t j0 = 0; j0 < nw; j0 += kSummableBlock) {
    const int64_t len = std::min<int64_t>(kSummableBlock, nw - j0);
    for (int32_t i = 0; i < f; ++i) {
      const uint32_t shift = static_cast<uint32_t>(i * w);
      const uint32_t pad = static_cast<uint32_t>(lv) << shift;  // the code of 0 (q = 0)
      const int64_t first = i * nw + j0, end = first + len;
      int64_t e = first;
      while (e < end) {
        if (e >= n) {  // past the buffer: padding
          for (int64_t j = e - first; j < len; ++j) acc[j] = (i == 0 ? 0u : acc[j]) | pad;
          break;
        }
        const int64_t run_end = std::min<int64_t>({end, (e / B + 1) * B, n});
        const float* src;
        const int64_t valid = leaf_run(x, e, run_end, &hint, &src);
        const qcomm::summable::BucketScales s = qcomm::summable::bucket_scales(shared[e / B], p.bits);
        uint32_t* a = acc + (e - first);
        if (i == 0) std::fill(a, a + (run_end - e), 0u);
        summable_codes_run(src, valid, s.down, s.inv, stochastic, seed[0], seed[1],
                           static_cast<uint32_t>(e), lv, shift, a);
        for (int64_t j = valid; j < run_end - e; ++j) a[j] |= pad;  // a leaf's padding
        e = run_end;
      }
    }
    memcpy(words + j0, acc, 4 * len);  // rows of a vmapped call may start at any 4-byte offset
  }
}

void summable_decode_impl(const uint32_t* words, const int32_t* shared,
                          const qcomm::cpu::Leaves<float>& out, int32_t count, float scale,
                          const qcomm::cpu::SummableParams& p) {
  const int64_t n = out.length();
  const int32_t lv = qcomm::summable::levels(p.bits);
  const int32_t w = qcomm::summable::field_bits(p.bits, p.devices);
  const int32_t f = 32 / w;
  const int64_t nw = qcomm::summable::num_words(n, f);
  const int64_t B = p.bucket;
  const uint32_t mask = w >= 32 ? 0xffffffffu : (1u << w) - 1u;
  const uint32_t offset = static_cast<uint32_t>(count) * static_cast<uint32_t>(lv);
  int64_t hint = 0;
  for (int32_t i = 0; i < f; ++i) {
    const uint32_t shift = static_cast<uint32_t>(i * w);
    const int64_t first = i * nw, end = std::min<int64_t>(first + nw, n);
    for (int64_t e = first; e < end;) {
      const int64_t run_end = std::min<int64_t>(end, (e / B + 1) * B);
      float* o;
      const int64_t valid = leaf_run(out, e, run_end, &hint, &o);
      const qcomm::summable::BucketScales s = qcomm::summable::bucket_scales(shared[e / B], p.bits);
      const uint32_t* __restrict wd = words + (e - first);
      float* __restrict od = o;
      for (int64_t j = 0; j < valid; ++j)
        od[j] = qcomm::summable::decode_value((wd[j] >> shift) & mask, offset, s, scale);
      e = run_end;
    }
  }
}

}  // namespace

namespace qcomm::cpu::QCOMM_ISA {

void summable_encode(const Leaves<const float>& x, const int32_t* shared, const uint32_t seed[2],
                     const SummableParams& p, uint32_t* words) {
  summable_encode_impl(x, shared, seed, p, words);
}

void summable_decode(const uint32_t* words, const int32_t* shared, const Leaves<float>& out,
                     int32_t count, float scale, const SummableParams& p) {
  summable_decode_impl(words, shared, out, count, scale, p);
}

void summable_scale(const Leaves<const float>& x, int32_t bucket, int32_t* out) {
  summable_scale_impl(x, bucket, out);
}

}  // namespace qcomm::cpu::QCOMM_ISA
