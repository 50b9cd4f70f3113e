// The QSGD codec math, once, for every implementation.
//
// Everything that decides a payload byte lives here as small inline functions usable from host C++
// and from CUDA device code. The pure-JAX reference (jax_qcomm/_reference.py) mirrors these
// functions line by line; docs/wire-format.md is the normative description.
//
// Bit-exactness across implementations rules out a few innocent-looking formulas:
//  * XLA contracts `a * b + c` into an FMA, so no product is ever followed by an add on the encode
//    path (stochastic rounding compares `t >= floor(t) + u` instead of computing `floor(t + u)`).
//  * XLA rewrites division by a constant as multiplication by its reciprocal, so the format itself
//    is defined with `recip_levels(L) = fl(1 / L)`.
//  * Summation order is fixed (8 lanes, sequential, then a tree), and the squares summed by the norm
//    scheme are exact (12-bit operands), so FMA or not gives the same sum.
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
QCOMM_HD uint32_t random_bits(uint32_t seed0, uint32_t seed1, uint32_t index) {
  return mix32(mix32(index * 0x9e3779b1u + seed0) ^ seed1);
}
// Uniform in [0, 1) with 24 random bits; exact in float32.
QCOMM_HD float uniform01(uint32_t bits) { return static_cast<float>(bits >> 8) * 5.9604644775390625e-8f; }

// ---- per-bucket scales ------------------------------------------------------------------------

QCOMM_HD float canonical_nan() { return __builtin_nanf(""); }  // 0x7fc00000
QCOMM_HD bool is_nan(float v) { return v != v; }

// Step from the bucket's range (maxmin) or norm (norm); canonical NaN if the bucket held a NaN.
QCOMM_HD float step_from(float span, uint32_t levels) {
  const float s = mul_rn(span, recip_levels(levels));
  return is_nan(s) ? canonical_nan() : s;
}
// 1/step, or 0 where the step is 0 or not a number: all codes of such a bucket are then fixed.
QCOMM_HD float inverse_step(float step) {
  return step > 0.0f ? rcp_rn(step) : 0.0f;
}

// Order-preserving map of float bits to int32 (for min/max), and back; -0 orders below +0.
QCOMM_HD int32_t order_key(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return static_cast<int32_t>(u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) >> 1));
}
QCOMM_HD float from_order_key(int32_t k) {
  const uint32_t u = static_cast<uint32_t>(k) ^ (static_cast<uint32_t>(k >> 31) >> 1);
  float x;
  memcpy(&x, &u, 4);
  return x;
}
QCOMM_HD uint32_t nan_flag(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return (u & 0x7fffffffu) > 0x7f800000u;
}

// The norm scheme sums squares of x truncated to 12 significant bits: such squares are exact in
// float32, so the sum is the same with or without FMA contraction.
QCOMM_HD float truncate12(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  u &= 0xfffff000u;
  float r;
  memcpy(&r, &u, 4);
  return r;
}

// ---- per-bucket scales from the bucket's reductions --------------------------------------------

// maxmin: (min, step) from the order keys of the smallest and largest value and the NaN flag.
// The reductions (min/max of keys, OR of flags) are exact, so any order of evaluation gives them.
QCOMM_HD void maxmin_scales(int32_t lo_key, int32_t hi_key, uint32_t any_nan, uint32_t levels,
                            float* min, float* step) {
  float mn = from_order_key(lo_key), mx = from_order_key(hi_key);
  // -0 and +0 compare equal; store +0 so the bytes do not depend on which came first. (Under
  // FTZ/DAZ a denormal compares equal to 0 as well and is stored as +0.)
  mn = mn == 0.0f ? 0.0f : mn;
  mx = mx == 0.0f ? 0.0f : mx;
  if (any_nan) {
    *min = *step = canonical_nan();
  } else {
    *min = mn;
    *step = step_from(sub_rn(mx, mn), levels);
  }
}

// norm: the square of one value, as summed by the norm scheme (exact: 12-bit operand).
QCOMM_HD float norm_square(float x) {
  const float h = truncate12(x);
  return mul_rn(h, h);
}
// The 8 lane sums (lane j: squares of elements j, j+8, j+16, ... added in order, from 0.0f) are
// combined as ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)): a butterfly with strides 4, 2, 1.
QCOMM_HD float norm_tree(const float lane[8]) {
  const float a0 = add_rn(lane[0], lane[4]), a1 = add_rn(lane[1], lane[5]);
  const float a2 = add_rn(lane[2], lane[6]), a3 = add_rn(lane[3], lane[7]);
  return add_rn(add_rn(a0, a2), add_rn(a1, a3));
}
QCOMM_HD float norm_step(float total, uint32_t levels) { return step_from(sqrt_rn(total), levels); }

// ---- per-element quantisation -----------------------------------------------------------------

// t >= 0 is the value in units of the step. Rounds up with probability frac(t) (stochastic, r = u)
// or at frac(t) >= 1/2 (nearest, r = 0.5); clamps to `levels` (also where t is NaN).
QCOMM_HD uint32_t quantize(float t, float r, uint32_t levels) {
  const float fl = floorf(t);
  const float q = add_rn(fl, t >= add_rn(fl, r) ? 1.0f : 0.0f);
  const float top = static_cast<float>(levels);
  return q <= top ? static_cast<uint32_t>(q) : levels;
}

// The random threshold of element `index`: uniform in [0, 1) (stochastic) or 1/2 (nearest).
QCOMM_HD float rounding_threshold(bool stochastic, uint32_t seed0, uint32_t seed1, uint32_t index) {
  return stochastic ? uniform01(random_bits(seed0, seed1, index)) : 0.5f;
}

// The code of value x of a bucket with scales (min, inv = inverse_step(step)) and threshold r.
template <int BITS, int SCHEME>
QCOMM_HD uint32_t encode_value(float x, float min, float inv, float r) {
  constexpr uint32_t levels = SCHEME == kMaxMin ? (1u << BITS) - 1u : (1u << (BITS - 1)) - 1u;
  const float v = SCHEME == kMaxMin ? sub_rn(x, min) : fabsf(x);
  uint32_t q = quantize(mul_rn(v, inv), r, levels);
  if (SCHEME == kNorm) q |= static_cast<uint32_t>(x < 0.0f) << (BITS - 1);
  return q;
}

// Product and sum rounded separately (no FMA), as XLA computes it where it does not contract;
// decoded values may therefore differ from the pure-JAX reference by one rounding of the product.
QCOMM_HD float dequantize_maxmin(uint32_t code, float min, float step) {
  return add_rn(min, mul_rn(static_cast<float>(code), step));
}
QCOMM_HD float dequantize_norm(uint32_t code, int32_t bits, float step) {
  const uint32_t level = code & ((1u << (bits - 1)) - 1u);
  const float v = mul_rn(static_cast<float>(level), step);
  return (code >> (bits - 1)) ? -v : v;
}
template <int BITS, int SCHEME>
QCOMM_HD float decode_value(uint32_t code, float min, float step) {
  return SCHEME == kMaxMin ? dequantize_maxmin(code, min, step) : dequantize_norm(code, BITS, step);
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
