"""The QSGD codec in pure JAX: the oracle for the kernels and the fallback where none is built.

It mirrors kernels/qsgd_math.h operation for operation, so that for the same seed it produces the
same payload bytes as the C++ and CUDA kernels (docs/wire-format.md says why each formula has the
shape it has: no product followed by a sum on the encode path, exact products on the decode path,
fixed summation order, reciprocal constants instead of divisions). Scaling by powers of two is done
on the float bits (`_ldexp`), with the kernels' FTZ semantics, so that XLA cannot contract it into
a neighbouring add. All arrays here are flat: x is float32[n], payloads uint8[P].
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm.native import wire

_U32 = jnp.uint32


def mix32(x: jax.Array) -> jax.Array:
  """Chris Wellons' lowbias32 finaliser on uint32 (wrapping arithmetic)."""
  x = x ^ (x >> 16)
  x = x * _U32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * _U32(0x846CA68B)
  return x ^ (x >> 16)


def random_bits(seed: jax.Array, index: jax.Array) -> jax.Array:
  """uint32 random bits of each element index, from the two seed words."""
  return mix32(mix32(index * _U32(0x9E3779B1) + seed[0]) ^ seed[1])


def summable_random_bits(seed: jax.Array, index: jax.Array) -> jax.Array:
  """The summable codec's random bits: one lowbias32 round (QSGD's :func:`random_bits` takes two;
  one round's bias is far below what stochastic rounding can show, and it halves the hash)."""
  return mix32((index * _U32(0x9E3779B1) + seed[0]) ^ seed[1])


def uniform01(bits: jax.Array) -> jax.Array:
  """Uniform in [0, 1) from the top 24 bits; exact in float32."""
  return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


# numpy scalars, not jnp: a jnp constant made at import would start a JAX backend (and freeze
# jax_num_cpu_devices) as a side effect of `import jax_qcomm` (tests/test_layers.py).
_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_EXP_ONE = 0x00800000           # bits of the smallest normal float32, 2**-126
_NON_FINITE = 0x7F800000        # bits of +Inf: |x| bits at or above are Inf or NaN
_MAX_FINITE_BITS = 0x7F7FFFFF
_CANONICAL_NAN_BITS = 0x7FC00000
_MAX_SHIFT = 126


def _bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x, _U32)


def _float(u: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(u, jnp.float32)


def _plus_zero(v: jax.Array) -> jax.Array:
  return jnp.where(v == 0, jnp.float32(0), v)


def _pow2(j: jax.Array) -> jax.Array:
  """2**j as float32, for int32 j in [-126, 127]."""
  return _float(lax.bitcast_convert_type((j + 127) << 23, _U32))


def _ldexp(x: jax.Array, j: jax.Array) -> jax.Array:
  """x * 2**j for int32 j in [-126, 126], as the kernels compute it under FTZ/DAZ.

  Exact where the result is a normal float32; below 2**-126 it is +-0 (so are subnormal x), above
  the largest finite float32 it saturates to +-max (only reached by a decoded value rounding past
  it); Inf and NaN pass unchanged. Done on the bits: no float product that XLA could fuse with a
  following add into an FMA (which would neither flush nor saturate).
  """
  u = _bits(x)
  e = ((u >> 23) & _U32(0xFF)).astype(jnp.int32)
  ne = e + j
  sign = u & _SIGN
  moved = u + lax.bitcast_convert_type(j << 23, _U32)  # wrapping: j may be negative
  out = jnp.where(ne <= 0, sign, jnp.where(ne >= 255, sign | _U32(_MAX_FINITE_BITS), moved))
  out = jnp.where(e == 0, sign, out)  # zero, or subnormal (read as zero)
  return _float(jnp.where(e == 255, u, out))


def _scale_exponent(max_abs_bits: jax.Array) -> jax.Array:
  """int32 k of each bucket from the bits of its largest |x|: floor(log2), clamped to 126; 0 for
  a zero (or subnormal) or non-finite maximum."""
  e = (max_abs_bits >> 23).astype(jnp.int32) - 127
  normal = (max_abs_bits >= _EXP_ONE) & (max_abs_bits < _NON_FINITE)
  return jnp.where(normal, jnp.minimum(e, _MAX_SHIFT), 0)


def _round_up16(s: jax.Array) -> jax.Array:
  """A step s >= 0 rounded up to 16 significant bits."""
  return _float((_bits(s) + _U32(0xFF)) & _U32(0xFFFFFF00))


def _step_word(s: jax.Array, k: jax.Array) -> jax.Array:
  """uint32 step word: the 16-bit step s in the top 24 bits, k as int8 in the low byte."""
  return _bits(s) | (lax.bitcast_convert_type(k, _U32) & _U32(0xFF))


def _word_step(word: jax.Array) -> jax.Array:
  return _float(word & _U32(0xFFFFFF00))


def _word_shift(word: jax.Array) -> jax.Array:
  low = (word & _U32(0xFF)).astype(jnp.int32)
  return jnp.where(low >= 128, low - 256, low)


def _truncate12(x: jax.Array) -> jax.Array:
  u = lax.bitcast_convert_type(x, _U32) & _U32(0xFFFFF000)
  return lax.bitcast_convert_type(u, jnp.float32)


def _sum_squares_fixed_order(yb: jax.Array) -> jax.Array:
  """[nb, B] scaled values -> [nb]: 8 lanes summed sequentially over the bucket, then a fixed
  tree. The squares are exact (12-bit operands), so an FMA contraction changes nothing."""
  nb, bucket = yb.shape
  h = _truncate12(yb)
  sq = (h * h).reshape(nb, bucket // 8, 8)
  if bucket // 8 <= 64:
    acc = sq[:, 0]
    for g in range(1, bucket // 8):
      acc = acc + sq[:, g]
  else:
    acc, _ = lax.scan(lambda a, s: (a + s, None), sq[:, 0], jnp.moveaxis(sq[:, 1:], 1, 0))
  a = acc[:, :4] + acc[:, 4:]
  return (a[:, 0] + a[:, 2]) + (a[:, 1] + a[:, 3])


def _bucketed(x: jax.Array, bucket_size: int, scheme: str) -> jax.Array:
  """float32[n] -> [nb, B], padded so that the scales are unchanged (first value, or 0)."""
  n = x.shape[0]
  nb = wire.num_buckets(n, bucket_size)
  pad = nb * bucket_size - n
  if pad:
    fill = x[(nb - 1) * bucket_size] if scheme == "maxmin" else jnp.float32(0)
    x = jnp.concatenate([x, jnp.broadcast_to(fill, (pad,)).astype(jnp.float32)])
  return x.reshape(nb, bucket_size)


def _quantize(t: jax.Array, r: jax.Array, levels: int) -> jax.Array:
  fl = jnp.floor(t)
  q = fl + jnp.where(t >= fl + r, jnp.float32(1), jnp.float32(0))
  return jnp.where(q <= levels, q, jnp.float32(levels)).astype(_U32)


def _pack(codes: jax.Array, bits: int) -> jax.Array:
  """uint32[nb, B] codes -> uint8[nb, B*bits/8]: code j at bits j*bits.. of a little-endian stream."""
  nb, bucket = codes.shape
  planes = (codes[..., None] >> jnp.arange(bits, dtype=_U32)) & _U32(1)
  return jnp.packbits(planes.reshape(nb, bucket * bits).astype(jnp.uint8), axis=-1,
                      bitorder="little")


def _unpack(packed: jax.Array, bits: int, bucket_size: int) -> jax.Array:
  nb = packed.shape[0]
  planes = jnp.unpackbits(packed, axis=-1, bitorder="little").reshape(nb, bucket_size, bits)
  return jnp.sum(planes.astype(_U32) << jnp.arange(bits, dtype=_U32), axis=-1, dtype=_U32)


def encode(x: jax.Array, seed: jax.Array, *, bits: int, bucket_size: int, scheme: str,
           rounding: str) -> jax.Array:
  """float32[n], uint32[2] -> uint8[payload_bytes]."""
  n = x.shape[0]
  levels = wire.num_levels(bits, scheme)
  recip = wire.recip_levels(bits, scheme)
  xb = _bucketed(x, bucket_size, scheme)
  nb = xb.shape[0]

  if scheme == "maxmin":
    finite = jnp.all(jnp.isfinite(xb), axis=1)
    mn = _plus_zero(jnp.min(xb, axis=1))
    mx = _plus_zero(jnp.max(xb, axis=1))
    k = _scale_exponent(jnp.maximum(_bits(mn) & _ABS, _bits(mx) & _ABS))
    y_min = _ldexp(mn, -k)
    s = _round_up16((_ldexp(mx, -k) - y_min) * recip)
  else:
    max_abs = jnp.max(_bits(xb) & _ABS, axis=1)
    finite = max_abs < _NON_FINITE
    k = _scale_exponent(max_abs)
    step = jnp.sqrt(_sum_squares_fixed_order(_ldexp(xb, -k[:, None]))) * recip
    cap = (jnp.float32(np.finfo(np.float32).max) * _pow2(-k)) * recip  # Inf where k < 0
    s = _round_up16(jnp.minimum(step, cap))
  # A bucket holding a NaN or Inf: the canonical NaN as its scales, codes from inv = 0.
  nan = jnp.float32(jnp.nan)
  k = jnp.where(finite, k, 0)
  word = jnp.where(finite, _step_word(s, k), _U32(_CANONICAL_NAN_BITS))
  inv = jnp.where(finite & (s > 0), jnp.float32(1) / s, jnp.float32(0))

  y = _ldexp(xb, -k[:, None])
  if scheme == "maxmin":
    mn = jnp.where(finite, mn, nan)
    header = jnp.stack([_bits(mn), word], axis=1)
    v = y - jnp.where(finite, y_min, nan)[:, None]
  else:
    header = word[:, None]
    v = jnp.abs(y)

  index = jnp.arange(nb * bucket_size, dtype=_U32).reshape(nb, bucket_size)
  if rounding == "stochastic":
    r = uniform01(random_bits(seed, index))
  else:
    r = jnp.float32(0.5)
  codes = _quantize(v * inv[:, None], r, levels)
  if scheme == "norm":
    codes = codes | ((xb < 0).astype(_U32) << (bits - 1))
  codes = jnp.where(index < n, codes, _U32(0))

  header_bytes = lax.bitcast_convert_type(header, jnp.uint8).reshape(-1)
  return jnp.concatenate([header_bytes, _pack(codes, bits).reshape(-1)])


def decode(payload: jax.Array, n: int, *, bits: int, bucket_size: int, scheme: str) -> jax.Array:
  """uint8[payload_bytes] -> float32[n]."""
  nb = wire.num_buckets(n, bucket_size)
  s = wire.scales_per_bucket(scheme)
  header = lax.bitcast_convert_type(payload[: 4 * s * nb].reshape(nb, s, 4), _U32)
  codes = _unpack(payload[4 * s * nb:].reshape(nb, bucket_size * bits // 8), bits, bucket_size)
  word = header[:, s - 1]
  step = _word_step(word)[:, None]
  k = _word_shift(word)[:, None]
  # code * step is exact (<= 24 significant bits): contracted into an FMA or not, the same value.
  if scheme == "maxmin":
    y_min = _ldexp(_float(header[:, :1]), -k)
    out = _ldexp(y_min + codes.astype(jnp.float32) * step, k)
  else:
    level = codes & _U32((1 << (bits - 1)) - 1)
    v = _ldexp(level.astype(jnp.float32) * step, k)
    out = jnp.where((codes >> (bits - 1)) != 0, -v, v)
  return out.reshape(-1)[:n]


def decode_sum(payloads: jax.Array, n: int, *, bits: int, bucket_size: int,
               scheme: str) -> jax.Array:
  """uint8[k, payload_bytes] -> float32[n], decodes summed in order 0, 1, ..., k-1."""
  out = decode(payloads[0], n, bits=bits, bucket_size=bucket_size, scheme=scheme)
  for j in range(1, payloads.shape[0]):
    out = out + decode(payloads[j], n, bits=bits, bucket_size=bucket_size, scheme=scheme)
  return out


# ---- the summable codec (kernels/summable_math.h) ------------------------------------------------

def summable_bucket_scale(x: jax.Array, bucket_size: int) -> jax.Array:
  """float32[n] -> int32[num_buckets]: the bits of each bucket's largest |x| (NaN > Inf > finite,
  as integers: what lax.pmax shares exactly). A partial last bucket takes its valid values."""
  n = x.shape[0]
  nb = wire.num_buckets(n, bucket_size)
  a = lax.bitcast_convert_type(_bits(x) & _ABS, jnp.int32)
  pad = nb * bucket_size - n
  if pad:
    a = jnp.concatenate([a, jnp.zeros((pad,), jnp.int32)])
  return jnp.max(a.reshape(nb, bucket_size), axis=1)


def _summable_scales(shared: jax.Array, bits: int):
  """int32[nb] -> (k, step, inv, finite) per bucket, as summable::bucket_scales."""
  m = lax.bitcast_convert_type(shared, _U32)
  finite = m < _NON_FINITE
  k = _scale_exponent(m)
  m_y = jnp.where(m < _EXP_ONE, jnp.float32(0), _ldexp(_float(m), -k))
  recip = np.float32(1) / np.float32(wire.summable_levels(bits))  # fl(1/L), as recip_levels
  s = _round_up16(m_y * recip)
  inv = jnp.where(finite & (s > 0), jnp.float32(1) / s, jnp.float32(0))
  return k, s, inv, finite


def summable_encode(x: jax.Array, shared: jax.Array, seed: jax.Array, *, bits: int,
                    bucket_size: int, devices: int, rounding: str) -> jax.Array:
  """float32[n], int32[num_buckets], uint32[2] -> uint32[num_words]: element e is field e // nw
  of word e % nw; elements past n are 0."""
  n = x.shape[0]
  lv = wire.summable_levels(bits)
  w = wire.summable_field_bits(bits, devices)
  f = 32 // w
  nw = wire.summable_words(n, bits, devices)
  k, _, inv, _ = _summable_scales(shared, bits)
  nb = shared.shape[0]
  xb = jnp.pad(x, (0, nb * bucket_size - n)).reshape(nb, bucket_size)
  t = (_ldexp(xb, -k[:, None]) * inv[:, None]).reshape(-1)[:n]
  if rounding == "stochastic":
    r = uniform01(summable_random_bits(seed, jnp.arange(n, dtype=_U32)))
  else:
    r = jnp.float32(0.5)
  fl = jnp.floor(t)
  q = fl + jnp.where(t > fl + r, jnp.float32(1), jnp.float32(0))
  q = jnp.where(q >= -lv, q, jnp.float32(-lv))
  q = jnp.where(q <= lv, q, jnp.float32(lv))
  codes = (q.astype(jnp.int32) + lv).astype(_U32)
  codes = jnp.concatenate([codes, jnp.full((f * nw - n,), lv, _U32)]).reshape(f, nw)
  shifts = (jnp.arange(f, dtype=_U32) * _U32(w))[:, None]
  out = codes[0] << shifts[0]
  for i in range(1, f):  # disjoint fields: OR == sum
    out = out | (codes[i] << shifts[i])
  return out


def summable_decode(words: jax.Array, shared: jax.Array, n: int, *, bits: int, bucket_size: int,
                    devices: int, count: int, scale: float) -> jax.Array:
  """uint32[num_words] (the sum of `count` payloads), int32[num_buckets] -> float32[n]: per element
  ldexp(((field - count L) * s) * scale, k); NaN in a non-finite bucket."""
  lv = wire.summable_levels(bits)
  w = wire.summable_field_bits(bits, devices)
  f = 32 // w
  mask = _U32(0xFFFFFFFF if w >= 32 else (1 << w) - 1)
  shifts = (jnp.arange(f, dtype=_U32) * _U32(w))[:, None]
  fields = ((words[None, :] >> shifts) & mask).reshape(-1)[:n]
  q = lax.bitcast_convert_type(fields - _U32(count * lv), jnp.int32).astype(jnp.float32)
  k, s, _, finite = _summable_scales(shared, bits)
  nb = shared.shape[0]
  qb = jnp.pad(q, (0, nb * bucket_size - n)).reshape(nb, bucket_size)
  v = _ldexp((qb * s[:, None]) * jnp.float32(scale), k[:, None])
  return jnp.where(finite[:, None], v, jnp.float32(jnp.nan)).reshape(-1)[:n]
