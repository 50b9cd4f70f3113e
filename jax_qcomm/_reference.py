"""The QSGD codec in pure JAX: the oracle for the kernels and the fallback where none is built.

It mirrors kernels/qsgd_math.h operation for operation, so that for the same seed it produces the
same payload bytes as the C++ and CUDA kernels (docs/wire-format.md says why each formula has the
shape it has: no product followed by a sum on the encode path, fixed summation order, reciprocal
constants instead of divisions). All arrays here are flat: x is float32[n], payloads uint8[P].
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import wire

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


def uniform01(bits: jax.Array) -> jax.Array:
  """Uniform in [0, 1) from the top 24 bits; exact in float32."""
  return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def _canonical_nan(v: jax.Array) -> jax.Array:
  return jnp.where(jnp.isnan(v), jnp.float32(jnp.nan), v)


def _plus_zero(v: jax.Array) -> jax.Array:
  return jnp.where(v == 0, jnp.float32(0), v)


def _truncate12(x: jax.Array) -> jax.Array:
  u = lax.bitcast_convert_type(x, _U32) & _U32(0xFFFFF000)
  return lax.bitcast_convert_type(u, jnp.float32)


def _sum_squares_fixed_order(xb: jax.Array) -> jax.Array:
  """[nb, B] -> [nb]: 8 lanes summed sequentially over the bucket, then a fixed tree."""
  nb, bucket = xb.shape
  h = _truncate12(xb)
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
    has_nan = jnp.any(jnp.isnan(xb), axis=1)
    mn = _plus_zero(jnp.min(xb, axis=1))
    mx = _plus_zero(jnp.max(xb, axis=1))
    step = _canonical_nan((mx - mn) * recip)
    mn = jnp.where(has_nan, jnp.float32(jnp.nan), mn)
    step = jnp.where(has_nan, jnp.float32(jnp.nan), step)
    scales = jnp.stack([mn, step], axis=1)
    v = xb - mn[:, None]
  else:
    step = _canonical_nan(jnp.sqrt(_sum_squares_fixed_order(xb)) * recip)
    scales = step[:, None]
    v = jnp.abs(xb)

  inv = jnp.where(step > 0, jnp.float32(1) / step, jnp.float32(0))
  index = jnp.arange(nb * bucket_size, dtype=_U32).reshape(nb, bucket_size)
  if rounding == "stochastic":
    r = uniform01(random_bits(seed, index))
  else:
    r = jnp.float32(0.5)
  codes = _quantize(v * inv[:, None], r, levels)
  if scheme == "norm":
    codes = codes | ((xb < 0).astype(_U32) << (bits - 1))
  codes = jnp.where(index < n, codes, _U32(0))

  scale_bytes = lax.bitcast_convert_type(scales, jnp.uint8).reshape(-1)
  return jnp.concatenate([scale_bytes, _pack(codes, bits).reshape(-1)])


def decode(payload: jax.Array, n: int, *, bits: int, bucket_size: int, scheme: str) -> jax.Array:
  """uint8[payload_bytes] -> float32[n]."""
  nb = wire.num_buckets(n, bucket_size)
  s = wire.scales_per_bucket(scheme)
  scales = lax.bitcast_convert_type(payload[: 4 * s * nb].reshape(nb, s, 4), jnp.float32)
  codes = _unpack(payload[4 * s * nb:].reshape(nb, bucket_size * bits // 8), bits, bucket_size)
  if scheme == "maxmin":
    out = scales[:, :1] + codes.astype(jnp.float32) * scales[:, 1:]
  else:
    level = codes & _U32((1 << (bits - 1)) - 1)
    v = level.astype(jnp.float32) * scales
    out = jnp.where((codes >> (bits - 1)) != 0, -v, v)
  return out.reshape(-1)[:n]


def decode_sum(payloads: jax.Array, n: int, *, bits: int, bucket_size: int,
               scheme: str) -> jax.Array:
  """uint8[k, payload_bytes] -> float32[n], decodes summed in order 0, 1, ..., k-1."""
  out = decode(payloads[0], n, bits=bits, bucket_size=bucket_size, scheme=scheme)
  for j in range(1, payloads.shape[0]):
    out = out + decode(payloads[j], n, bits=bits, bucket_size=bucket_size, scheme=scheme)
  return out
