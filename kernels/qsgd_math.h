// The QSGD codec math, once, for every implementation.
//
// Everything that decides a payload byte lives here as small inline functions usable from host C++
// and from CUDA device code. The pure-JAX reference (jax_qcomm/_reference.py) mirrors these
// functions line by line; docs/wire-format.md is the normative description.
//
// Bit-exactness across implementations rules out a few innocent-looking formulas:
//  * XLA contracts `a * b + c` into an FMA, so no product is ever followed by an add on the encode
//    path (stochastic rounding compares `t >= floor(t) + u` instead of computing `floor(t + u)`),
//    and every product that is followed by an add on the decode path is exact (`code * s` with a
//    16-bit step s), so FMA or not gives the same value.
//  * XLA rewrites division by a constant as multiplication by its reciprocal, so the format itself
//    is defined with `recip_levels(L) = fl(1 / L)`.
//  * Summation order is fixed (8 lanes, sequential, then a tree), and the squares summed by the norm
//    scheme are exact (12-bit operands), so FMA or not gives the same sum.
//
// Range: every bucket is scaled by a power of two 2^-k that brings its largest magnitude to [1, 2)
// before any sum, square or step is formed, and the step is stored in units of 2^k. Scaling by a
// power of two is exact, so a finite bucket anywhere in the normal float32 range, from 2^-126 to
// the largest finite float, is quantised exactly as the same bucket near 1 (same codes, scales
// shifted by k): nothing overflows, and no step underflows. All implementations run with
// denormals flushed (FTZ/DAZ, as XLA CPU does): a subnormal input reads as 0, a result below 2^-126
// is flushed to 0.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define QCOMM_HD __host__ __device__ __forceinline__
#else
// static: every translation unit (compiled for its own ISA) gets its own copy; no ODR mixing.
#define QCOMM_HD static inline __attribute__((always_inline))
#endif

namespace qcomm {

enum Scheme : int32_t { kMaxMin = 0, kNorm = 1 };
enum Rounding : int32_t { kStochastic = 0, kNearest = 1 };

// ---- float32 arithmetic that no compiler may contract or approximate ---------------------------
//
// Host code is built with -ffp-contract=off and IEEE division/sqrt. In CUDA device code the
// intrinsics below are never fused into FMAs and are correctly rounded whatever -fmad, -prec-div
// or -prec-sqrt say; the CUDA build also uses -ftz=true, so that they flush denormal inputs and
// results to zero like the CPU kernels (which run with FTZ/DAZ, as XLA CPU does).
QCOMM_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
QCOMM_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
QCOMM_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
QCOMM_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return sqrtf(a);
#endif
}
QCOMM_HD float rcp_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

// ---- format sizes ------------------------------------------------------------------------------

// float32 scales stored per bucket: maxmin (min, step), norm (step).
QCOMM_HD int64_t scales_per_bucket(int32_t scheme) { return scheme == kMaxMin ? 2 : 1; }
QCOMM_HD int64_t num_buckets(int64_t n, int64_t bucket) { return (n + bucket - 1) / bucket; }
QCOMM_HD int64_t code_bytes_per_bucket(int64_t bucket, int32_t bits) { return bucket * bits / 8; }
QCOMM_HD int64_t payload_bytes(int64_t n, int64_t bucket, int32_t bits, int32_t scheme) {
  return num_buckets(n, bucket) * (4 * scales_per_bucket(scheme) + code_bytes_per_bucket(bucket, bits));
}

// Highest quantization level: maxmin uses all 2^b codes, norm spends one bit on the sign.
QCOMM_HD uint32_t num_levels(int32_t scheme, int32_t bits) {
  return scheme == kMaxMin ? (1u << bits) - 1u : (1u << (bits - 1)) - 1u;
}
QCOMM_HD float recip_levels(uint32_t levels) { return rcp_rn(static_cast<float>(levels)); }

// ---- randomness: a counter-based hash of (seed, element index) ---------------------------------

// Chris Wellons' "lowbias32" integer finaliser.
QCOMM_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
// random_bits(seed0, seed1, index) from h = index * kIndexMul + seed0 (uint32): a loop over
// consecutive indices adds kIndexMul to h instead of multiplying (the same bits, one vector
// multiply fewer per element: vpmulld is the bottleneck of the hash on AVX2 CPUs such as Zen 1).
constexpr uint32_t kIndexMul = 0x9e3779b1u;
QCOMM_HD uint32_t random_bits_at(uint32_t h, uint32_t seed1) { return mix32(mix32(h) ^ seed1); }
QCOMM_HD uint32_t random_bits(uint32_t seed0, uint32_t seed1, uint32_t index) {
  return random_bits_at(index * kIndexMul + seed0, seed1);
}
// Uniform in [0, 1) with 24 random bits; exact in float32.
QCOMM_HD float uniform01(uint32_t bits) { return static_cast<float>(bits >> 8) * 5.9604644775390625e-8f; }

// ---- float32 bits and powers of two ------------------------------------------------------------

QCOMM_HD uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
QCOMM_HD float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

constexpr float kMaxFinite = 3.40282346638528859811704183484516925e+38f;  // 0x7f7fffff
constexpr uint32_t kCanonicalNanBits = 0x7fc00000u;
constexpr int32_t kMaxShift = 126;  // |k| <= 126: 2^k and 2^-k are both normal float32

QCOMM_HD float canonical_nan() { return bits_float(kCanonicalNanBits); }
QCOMM_HD bool is_nan(float v) { return v != v; }

// 2^j as a float32, for j in [-126, 127].
QCOMM_HD float pow2(int32_t j) { return bits_float(static_cast<uint32_t>(j + 127) << 23); }

// |x| >= 2^128 (Inf or NaN), from the bits of |x| (sign cleared).
QCOMM_HD bool abs_bits_non_finite(uint32_t abs_bits) { return abs_bits >= 0x7f800000u; }

// The scale exponent k of a bucket, from the bits of its largest magnitude M (sign cleared):
// floor(log2 M) clamped to [-126, 126], so that the bucket scaled by 2^-k has its largest
// magnitude in [1, 2) ([2, 4) in the top binade), where no sum, square or step of the format can
// overflow or become subnormal. 0 where M is 0 (or subnormal: flushed) or not finite.
QCOMM_HD int32_t scale_exponent(uint32_t max_abs_bits) {
  if (max_abs_bits < 0x00800000u || abs_bits_non_finite(max_abs_bits)) return 0;
  const int32_t e = static_cast<int32_t>(max_abs_bits >> 23) - 127;
  return e < kMaxShift ? e : kMaxShift;
}

// v * 2^j for |j| <= 126, as the decoder computes it: exact, except that a result below the
// smallest normal is flushed to +-0 (FTZ) and one above the largest finite float32 (only reached
// by rounding, for buckets within 2^-15 of it) is saturated to +-kMaxFinite. NaN stays NaN.
QCOMM_HD float saturate(float v) { return v > kMaxFinite ? kMaxFinite : (v < -kMaxFinite ? -kMaxFinite : v); }

// ---- the step word: the bucket's step in units of 2^k (16 significant bits), and k --------------
//
// bits 8..31: a float32 step s with its 8 low mantissa bits zero (a positive normal number or 0);
// bits 0..7:  k as a two's complement int8. The step of the bucket is s * 2^k. A non-finite bucket
// stores the canonical NaN 0x7fc00000 (k = 0). With 16 significant bits, code * s is exact for
// codes of up to 8 bits, so no FMA contraction anywhere can change a decoded value.

// Rounds a step s >= 0 up to 16 significant bits (so that `levels` steps still span the bucket).
QCOMM_HD float round_up16(float s) { return bits_float((float_bits(s) + 0xffu) & 0xffffff00u); }
QCOMM_HD uint32_t step_word(float step16, int32_t k) {
  return float_bits(step16) | (static_cast<uint32_t>(k) & 0xffu);
}
QCOMM_HD float word_step(uint32_t word) { return bits_float(word & 0xffffff00u); }
QCOMM_HD int32_t word_shift(uint32_t word) {
  return static_cast<int32_t>(static_cast<int8_t>(static_cast<uint8_t>(word & 0xffu)));
}

// ---- per-bucket scales ------------------------------------------------------------------------

// What the encoder needs of a bucket: its header words and the constants of the per-element loop.
struct EncodeScales {
  float min;      // maxmin header word 0: the bucket's min (NaN if the bucket is not finite)
  uint32_t word;  // the step word (maxmin header word 1, norm header)
  float down;     // 2^-k
  float y_min;    // min * 2^-k (maxmin), 0 (norm)
  float inv;      // 1 / s, or 0 where s is 0 or NaN: the codes of such a bucket are then fixed
};

QCOMM_HD float inverse_step(float step) { return step > 0.0f ? rcp_rn(step) : 0.0f; }

QCOMM_HD EncodeScales non_finite_scales() {
  return EncodeScales{canonical_nan(), kCanonicalNanBits, 1.0f, canonical_nan(), 0.0f};
}

// Order-preserving map of float bits to int32 (for min/max), and back; -0 orders below +0.
QCOMM_HD int32_t order_key(float x) {
  const uint32_t u = float_bits(x);
  return static_cast<int32_t>(u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) >> 1));
}
QCOMM_HD float from_order_key(int32_t k) {
  return bits_float(static_cast<uint32_t>(k) ^ (static_cast<uint32_t>(k >> 31) >> 1));
}
// |x| as bits, for the norm scheme's max-abs reduction (an exact unsigned max).
QCOMM_HD uint32_t abs_bits(float x) { return float_bits(x) & 0x7fffffffu; }

// maxmin: scales from the order keys of the smallest and largest value. The reductions (min/max
// of keys) are exact, so any order of evaluation gives them. A NaN's key lies beyond the keys of
// both infinities (above +Inf's with the sign bit clear, below -Inf's with it set), so a bucket
// holding a NaN has one as an extreme, and its bits fail the finiteness test below.
QCOMM_HD EncodeScales maxmin_scales(int32_t lo_key, int32_t hi_key, uint32_t levels) {
  float mn = from_order_key(lo_key), mx = from_order_key(hi_key);
  // -0 and +0 compare equal; store +0 so the bytes do not depend on which came first. (Under
  // FTZ/DAZ a denormal compares equal to 0 as well and is stored as +0.)
  mn = mn == 0.0f ? 0.0f : mn;
  mx = mx == 0.0f ? 0.0f : mx;
  const uint32_t a = abs_bits(mn), b = abs_bits(mx);
  const uint32_t max_abs = a > b ? a : b;
  if (abs_bits_non_finite(max_abs)) return non_finite_scales();
  const int32_t k = scale_exponent(max_abs);
  const float down = pow2(-k);
  const float y_min = mul_rn(mn, down), y_max = mul_rn(mx, down);
  const float s = round_up16(mul_rn(sub_rn(y_max, y_min), recip_levels(levels)));
  return EncodeScales{mn, step_word(s, k), down, y_min, inverse_step(s)};
}

// The norm scheme sums squares of the scaled values truncated to 12 significant bits: such
// squares are exact in float32, so the sum is the same with or without FMA contraction.
QCOMM_HD float truncate12(float x) { return bits_float(float_bits(x) & 0xfffff000u); }

// norm: the square of one value y = x * 2^-k, as summed by the norm scheme.
QCOMM_HD float norm_square(float y) {
  const float h = truncate12(y);
  return mul_rn(h, h);
}
// The 8 lane sums (lane j: squares of elements j, j+8, j+16, ... added in order, from 0.0f) are
// combined as ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)): a butterfly with strides 4, 2, 1.
QCOMM_HD float norm_tree(const float lane[8]) {
  const float a0 = add_rn(lane[0], lane[4]), a1 = add_rn(lane[1], lane[5]);
  const float a2 = add_rn(lane[2], lane[6]), a3 = add_rn(lane[3], lane[7]);
  return add_rn(add_rn(a0, a2), add_rn(a1, a3));
}
// norm: scales from the bucket's largest |x| (as bits) and the sum of squares of its values
// scaled by 2^-k (k = scale_exponent(max_abs_bits)). The step is the scaled norm / L, capped so
// that L steps stay below the largest finite float32 (a bucket whose norm exceeds it: a smaller
// step keeps every |x| within L steps, so rounding stays unbiased and the error within one step).
QCOMM_HD EncodeScales norm_scales(uint32_t max_abs_bits, float total, uint32_t levels) {
  if (abs_bits_non_finite(max_abs_bits)) return non_finite_scales();
  const int32_t k = scale_exponent(max_abs_bits);
  const float recip = recip_levels(levels);
  const float step = mul_rn(sqrt_rn(total), recip);
  const float cap = mul_rn(mul_rn(kMaxFinite, pow2(-k)), recip);  // Inf where k < 0
  const float s = round_up16(step < cap ? step : cap);
  return EncodeScales{0.0f, step_word(s, k), pow2(-k), 0.0f, inverse_step(s)};
}

// ---- per-element quantisation -----------------------------------------------------------------

// floor(t) for t >= 0 or NaN. Baseline x86-64 (SSE2, the "generic" build) has no vector floor, so
// floorf would be a libm call per element there; below 2^23 the truncation to int32 is the same
// value (+0 for -0, which quantize() turns into the same code), at or above it t is an integer.
QCOMM_HD float floor_nonneg(float t) {
#if defined(__x86_64__) && !defined(__SSE4_1__) && !defined(__CUDA_ARCH__)
  return t < 8388608.0f ? static_cast<float>(static_cast<int32_t>(t)) : t;
#else
  return floorf(t);
#endif
}

// t >= 0 is the value in units of the step. Rounds up with probability frac(t) (stochastic, r = u)
// or at frac(t) >= 1/2 (nearest, r = 0.5); clamps to `levels` (also where t is NaN).
QCOMM_HD uint32_t quantize(float t, float r, uint32_t levels) {
  const float fl = floor_nonneg(t);
  const float q = add_rn(fl, t >= add_rn(fl, r) ? 1.0f : 0.0f);
  const float top = static_cast<float>(levels);
  // q is in [0, top] where it is converted (t >= 0), so through int32 gives the same code: AVX2
  // has a float -> int32 conversion, but none to uint32 (the compiler would emulate it).
  return q <= top ? static_cast<uint32_t>(static_cast<int32_t>(q)) : levels;
}

// The random threshold of element `index`: uniform in [0, 1) (stochastic) or 1/2 (nearest).
QCOMM_HD float rounding_threshold(bool stochastic, uint32_t seed0, uint32_t seed1, uint32_t index) {
  return stochastic ? uniform01(random_bits(seed0, seed1, index)) : 0.5f;
}

// The code of value x of a bucket with scales (down, y_min, inv) of EncodeScales and threshold r:
// y = x * 2^-k (exact, or flushed to 0 for values 2^126 times smaller than the bucket's largest),
// t = (y - y_min) / s (maxmin) or |y| / s (norm). No product is ever followed by an add.
template <int BITS, int SCHEME>
QCOMM_HD uint32_t encode_value(float x, float down, float y_min, float inv, float r) {
  constexpr uint32_t levels = SCHEME == kMaxMin ? (1u << BITS) - 1u : (1u << (BITS - 1)) - 1u;
  const float y = mul_rn(x, down);
  const float v = SCHEME == kMaxMin ? sub_rn(y, y_min) : fabsf(y);
  uint32_t q = quantize(mul_rn(v, inv), r, levels);
  if (SCHEME == kNorm) q |= static_cast<uint32_t>(x < 0.0f) << (BITS - 1);
  return q;
}

// ---- decoding ---------------------------------------------------------------------------------

// What the decoder needs of a bucket, from its header words.
struct DecodeScales {
  float y_min;  // min * 2^-k (maxmin), 0 (norm)
  float step;   // s, the step in units of 2^k
  float up;     // 2^k
};
QCOMM_HD DecodeScales maxmin_decode_scales(float min, uint32_t word) {
  const int32_t k = word_shift(word);
  return DecodeScales{mul_rn(min, pow2(-k)), word_step(word), pow2(k)};
}
QCOMM_HD DecodeScales norm_decode_scales(uint32_t word) {
  return DecodeScales{0.0f, word_step(word), pow2(word_shift(word))};
}
template <int SCHEME>
QCOMM_HD DecodeScales decode_scales(const uint32_t* header) {
  return SCHEME == kMaxMin ? maxmin_decode_scales(bits_float(header[0]), header[1])
                           : norm_decode_scales(header[0]);
}

// code * s is exact (at most 8 + 16 significant bits), so the value is the same whether a
// compiler contracts `y_min + code * s` into an FMA or not; the final * 2^k is exact but for FTZ
// and the saturation.
QCOMM_HD float dequantize_maxmin(uint32_t code, const DecodeScales& s) {
  return saturate(mul_rn(add_rn(s.y_min, mul_rn(static_cast<float>(code), s.step)), s.up));
}
QCOMM_HD float dequantize_norm(uint32_t code, int32_t bits, const DecodeScales& s) {
  const uint32_t level = code & ((1u << (bits - 1)) - 1u);
  const float v = saturate(mul_rn(mul_rn(static_cast<float>(level), s.step), s.up));
  return (code >> (bits - 1)) ? -v : v;
}
template <int BITS, int SCHEME>
QCOMM_HD float decode_value(uint32_t code, const DecodeScales& s) {
  return SCHEME == kMaxMin ? dequantize_maxmin(code, s) : dequantize_norm(code, BITS, s);
}

// ---- bit packing: 8 codes of `bits` bits -> `bits` bytes, little-endian, code j at bit j*bits --

template <int BITS>
QCOMM_HD uint64_t pack8(const uint8_t* codes) {
  uint64_t w = 0;
  for (int j = 0; j < 8; ++j) w |= static_cast<uint64_t>(codes[j]) << (j * BITS);
  return w;
}
template <int BITS>
QCOMM_HD uint32_t unpack1(uint64_t w, int j) {
  return static_cast<uint32_t>(w >> (j * BITS)) & ((1u << BITS) - 1u);
}

}  // namespace qcomm
