// The summable codec math (jax_qcomm.Summable), once, for every implementation.
//
// A summable payload is a uint32 word array that XLA's own all-reduce (lax.psum) sums: each word
// holds f fields of w bits, one per element, each an offset code c = q + L in [0, 2L] of a signed
// level q in [-L, L]; the sum over D devices of a field lies in [0, 2 L D] < 2^w, so no field carries
// into its neighbour. All devices quantise a bucket with the same scale, the bucket's largest |x|
// over all devices (a lax.pmax of bucket_scale), so that the sum of the levels times the shared step
// is the sum of the decoded values. docs/wire-format.md ("Summable") is the normative description;
// jax_qcomm/_reference.py mirrors these functions line by line.
//
// Layout: n elements, nw = ceil(n / f) words; element e is field e / nw (bits [w*(e/nw), ...)) of
// word e % nw ("planar": field i of all words holds the contiguous elements [i*nw, (i+1)*nw), so
// that packing is a vectorisable loop over words). Elements e >= n (the padding of the last field)
// are encoded as 0.
//
// Same rules as qsgd_math.h for bit-exactness: no product followed by an add on the encode path
// (stochastic rounding compares t > floor(t) + u), powers of two on the bits or by exact products,
// reciprocal constants, FTZ/DAZ.
#pragma once

#include <cstdint>

#include "qsgd_math.h"

namespace qcomm {
namespace summable {

// Highest level of `bits` bits: codes are signed levels in [-L, L] (2^bits - 1 values).
QCOMM_HD int32_t levels(int32_t bits) { return (1 << (bits - 1)) - 1; }

// Bits of one field for `devices` summed payloads: bit_length(2 L D). > 32 means no room.
QCOMM_HD int32_t field_bits(int32_t bits, int64_t devices) {
  uint64_t top = 2ull * static_cast<uint64_t>(levels(bits)) * static_cast<uint64_t>(devices);
  int32_t w = 0;
  while (top) {
    ++w;
    top >>= 1;
  }
  return w;
}
QCOMM_HD int32_t fields_per_word(int32_t bits, int64_t devices) { return 32 / field_bits(bits, devices); }
QCOMM_HD int64_t num_words(int64_t n, int32_t fields) { return (n + fields - 1) / fields; }

// The random bits of element `index` from h = index * kIndexMul + seed0 (see qsgd_math.h): one
// lowbias32 round of h ^ seed1 (QSGD's random_bits takes two; one round's bias is far below what
// stochastic rounding can show, and the hash's multiplies bound the encode: 18.1 -> 14.1 ms per
// 25M values on AVX2).
using qcomm::kIndexMul;
QCOMM_HD uint32_t random_bits_at(uint32_t h, uint32_t seed1) { return mix32(h ^ seed1); }

// What the encoder and the decoder need of a bucket, from the shared statistic: the bits of the
// largest |x| of the bucket over all devices (an int32 >= 0; >= 0x7f800000 for Inf or NaN).
struct BucketScales {
  float down;   // 2^-k: y = x * 2^-k has its largest magnitude in [1, 2) ([2, 4) in the top binade)
  float up;     // 2^k
  float step;   // s, the step in units of 2^k, 16 significant bits (0 for a zero bucket)
  float inv;    // 1 / s, or 0 where s is 0 or the bucket is not finite
  bool finite;  // false: the bucket decodes to NaN
};

QCOMM_HD BucketScales bucket_scales(int32_t shared_bits, int32_t bits) {
  const uint32_t m = static_cast<uint32_t>(shared_bits);
  if (abs_bits_non_finite(m)) return BucketScales{1.0f, 1.0f, 0.0f, 0.0f, false};
  const int32_t k = scale_exponent(m);  // 0 for a zero (or subnormal: flushed) maximum
  const float down = pow2(-k);
  const float m_y = m < 0x00800000u ? 0.0f : mul_rn(bits_float(m), down);
  const float s = round_up16(mul_rn(m_y, recip_levels(static_cast<uint32_t>(levels(bits)))));
  return BucketScales{down, pow2(k), s, inverse_step(s), true};
}

// The offset code c = q + L of value x: y = x * 2^-k (exact, or flushed), t = y / s, q = floor(t)
// + 1 if t > floor(t) + r (r = u in [0, 1): unbiased; r = 1/2: nearest, ties down), clamped to
// [-L, L] (a NaN t, only in a non-finite bucket, gives -L).
QCOMM_HD uint32_t encode_value(float x, float down, float inv, float r, int32_t lv) {
  const float t = mul_rn(mul_rn(x, down), inv);
  const float fl = floorf(t);
  float q = add_rn(fl, t > add_rn(fl, r) ? 1.0f : 0.0f);
  const float top = static_cast<float>(lv);
  q = q >= -top ? q : -top;
  q = q <= top ? q : top;
  return static_cast<uint32_t>(static_cast<int32_t>(q) + lv);
}

// The decoded value of a summed field: the sum of `count` offset codes, minus count * L, is the
// sum of the levels Q; value = ldexp((Q * s) * scale, k) (products only: no FMA can change it;
// the power of two flushes below 2^-126 and saturates above the largest float32). NaN for a
// non-finite bucket.
// (The difference is taken modulo 2^32 and read as int32: exact for any field width up to 32.)
QCOMM_HD float decode_value(uint32_t field, uint32_t offset, const BucketScales& b, float scale) {
  const float q = static_cast<float>(static_cast<int32_t>(field - offset));
  const float v = saturate(mul_rn(mul_rn(mul_rn(q, b.step), scale), b.up));
  return b.finite ? v : canonical_nan();
}

}  // namespace summable
}  // namespace qcomm
