"""Tests of the codecs (jax_qcomm.codecs): QSGD, Cast, NoCompression.

Three implementations of the QSGD wire format are compared byte for byte:

* ``impl="ffi"``: the C++ kernels (kernels/qsgd_math.h, kernels/qsgd_cpu_loops.h);
* ``impl="jax"``: the pure-JAX reference (jax_qcomm/native/_reference.py);
* ``_np_encode`` / ``_np_decode`` below: an independent numpy transcription of the format (float32
  arithmetic, no FMA, with the kernels' flush of denormals modelled by ``_ftz``; the scaling by
  powers of two done in float64, not on the bits as the reference does; the bit packing follows
  ``pack8`` of qsgd_math.h, not the reference's ``packbits``).

Decoded values are compared bit for bit too, also for the pure-JAX decode under jit: the only product
followed by an add, ``code * s``, is exact (16-bit steps), so XLA's FMA contraction changes nothing.

Accuracy assertions are derived from the quantisation step of the data, computed here in float64
from its definition: maxmin step = (max - min) / (2**b - 1), norm step = ||bucket||_2 / (2**(b-1) - 1)
(the kernels sum squares of values truncated to 12 significant bits, so the stored norm step may be
up to 2**-11 smaller; the stored steps are rounded up to 16 significant bits, at most 2**-14
larger; every bound below holds with the stored step). tests/test_numerics.py holds the bounds
property-based over the whole float32 range.

Compilation dominates the runtime, so the jitted functions are cached per codec configuration and
each test uses a handful of shapes.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.native import _ffi

D = 8
BUCKETS = (8, 16, 24, 64, 128, 512)
SCHEMES = ("maxmin", "norm")
ROUNDINGS = ("stochastic", "nearest")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
U32 = np.uint32


def levels(bits: int, scheme: str) -> int:
  return (1 << bits) - 1 if scheme == "maxmin" else (1 << (bits - 1)) - 1


def scales_per_bucket(scheme: str) -> int:
  return 2 if scheme == "maxmin" else 1


def expected_payload_bytes(n: int, bits: int, bucket: int, scheme: str) -> int:
  return math.ceil(n / bucket) * (4 * scales_per_bucket(scheme) + bucket * bits // 8)


def codec_id(c) -> str:
  return "b{}-B{}-{}-{}".format(*c)


def as_np(a) -> np.ndarray:
  return np.asarray(jax.device_get(a))


# ---- an independent numpy model of the wire format ---------------------------------------------

def _mix32(x: np.ndarray) -> np.ndarray:
  x = x ^ (x >> U32(16))
  x = x * U32(0x7FEB352D)
  x = x ^ (x >> U32(15))
  x = x * U32(0x846CA68B)
  return x ^ (x >> U32(16))


def _seed(key) -> np.ndarray:
  """The codec's two rounding seed words: jax.random.bits(key, (2,), uint32)."""
  return as_np(jax.random.bits(key, (2,), jnp.uint32))


F32_MAX = np.float32(np.finfo(np.float32).max)
F32_TINY = np.float32(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal


def _ftz(a) -> np.ndarray:
  """float32 with subnormals flushed to signed zero: what an FTZ/DAZ float32 operation gives."""
  a = np.asarray(a, np.float32)
  with np.errstate(invalid="ignore"):
    return np.where(np.abs(a) < F32_TINY, np.copysign(np.float32(0), a), a).astype(np.float32)


def _np_ldexp(v, j) -> np.ndarray:
  """float32 v * 2**j (|j| <= 126) under FTZ/DAZ, saturated to +-max where a finite v would pass it
  (computed in float64: independent of the reference's bit arithmetic)."""
  v = _ftz(v)
  with np.errstate(over="ignore", invalid="ignore"):
    r = v.astype(np.float64) * np.exp2(np.asarray(j, np.float64))
    r = np.where(np.isfinite(v) & (np.abs(r) > F32_MAX), np.copysign(np.float64(F32_MAX), r), r)
  return _ftz(r.astype(np.float32))


def _np_scale_exponent(m) -> np.ndarray:
  """k of each bucket from its largest |x| (float32, flushed): floor(log2 m) clamped to 126."""
  m = np.asarray(m, np.float32)
  normal = np.isfinite(m) & (m >= F32_TINY)
  _, e = np.frexp(np.where(normal, m, np.float32(1)).astype(np.float64))
  return np.where(normal, np.minimum(e - 1, 126), 0).astype(np.int64)


def _np_round_up16(s) -> np.ndarray:
  u = np.asarray(s, np.float32).view(U32)
  return ((u + U32(0xFF)) & U32(0xFFFFFF00)).view(np.float32)


def _np_word(s, k) -> np.ndarray:
  return np.asarray(s, np.float32).view(U32) | (np.asarray(k).astype(np.int64) & 0xFF).astype(U32)


def _np_unword(word):
  """(s, k) of step words."""
  word = np.asarray(word, U32)
  low = (word & U32(0xFF)).astype(np.int64)
  return (word & U32(0xFFFFFF00)).view(np.float32), np.where(low >= 128, low - 256, low)


def _np_encode(x, seed, bits, bucket, scheme, rounding) -> np.ndarray:
  x = np.asarray(x, np.float32).reshape(-1)
  n = x.size
  if n == 0:
    return np.zeros((0,), np.uint8)
  nb = -(-n // bucket)
  L = levels(bits, scheme)
  recip = np.float32(1) / np.float32(L)
  fill = x[(nb - 1) * bucket] if scheme == "maxmin" else np.float32(0)
  xb = np.concatenate([x, np.full(nb * bucket - n, fill, np.float32)]).reshape(nb, bucket)
  xb = _ftz(xb)  # DAZ: subnormal inputs read as zeros
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    finite = np.isfinite(xb).all(axis=1)
    if scheme == "maxmin":
      mn = xb.min(axis=1)
      mx = xb.max(axis=1)
      mn = np.where(mn == 0, np.float32(0), mn).astype(np.float32)
      mx = np.where(mx == 0, np.float32(0), mx).astype(np.float32)
      k = _np_scale_exponent(np.maximum(np.abs(mn), np.abs(mx)))
      y_min = _np_ldexp(mn, -k)
      s = _np_round_up16(_ftz(_ftz(_np_ldexp(mx, -k) - y_min) * recip))
    else:
      k = _np_scale_exponent(np.abs(xb).max(axis=1))
      y = _np_ldexp(xb, -k[:, None])
      h = (y.view(U32) & U32(0xFFFFF000)).view(np.float32)
      sq = _ftz(h * h).reshape(nb, bucket // 8, 8)
      acc = sq[:, 0].copy()
      for g in range(1, bucket // 8):
        acc = acc + sq[:, g]
      a = acc[:, :4] + acc[:, 4:]
      total = (a[:, 0] + a[:, 2]) + (a[:, 1] + a[:, 3])
      step = _ftz(np.sqrt(total) * recip)
      cap = (F32_MAX * np.exp2(-k).astype(np.float32)) * recip  # inf for k < 0
      s = _np_round_up16(np.minimum(step, cap).astype(np.float32))
    k = np.where(finite, k, 0)
    word = np.where(finite, _np_word(s, k), U32(0x7FC00000)).astype(U32)
    inv = np.where(finite & (s > 0), np.float32(1) / s, np.float32(0)).astype(np.float32)
    y = _np_ldexp(xb, -k[:, None])
    if scheme == "maxmin":
      mn = np.where(finite, mn, np.float32(np.nan)).astype(np.float32)
      header = np.stack([mn.view(U32), word], axis=1)
      v = _ftz(y - np.where(finite, y_min, np.float32(np.nan))[:, None])
    else:
      header = word[:, None]
      v = np.abs(y)
    index = np.arange(nb * bucket, dtype=U32).reshape(nb, bucket)
    if rounding == "stochastic":
      rbits = _mix32(_mix32(index * U32(0x9E3779B1) + U32(seed[0])) ^ U32(seed[1]))
      r = (rbits >> U32(8)).astype(np.float32) * np.float32(2.0**-24)
    else:
      r = np.float32(0.5)
    t = _ftz(v * inv[:, None])
    fl = np.floor(t)
    q = fl + np.where(t >= fl + r, np.float32(1), np.float32(0))
    codes = np.where(q <= L, q, np.float32(L)).astype(U32)
  if scheme == "norm":
    codes = codes | ((xb < 0).astype(U32) << U32(bits - 1))
  codes = np.where(index < n, codes, U32(0)).astype(np.uint64)
  # pack8: 8 codes -> one little-endian word of `bits` bytes, code j at bit j*bits.
  words = np.zeros(codes.shape[:1] + (bucket // 8,), np.uint64)
  grouped = codes.reshape(nb, bucket // 8, 8)
  for j in range(8):
    words |= grouped[..., j] << np.uint64(j * bits)
  packed = ((words[..., None] >> (np.uint64(8) * np.arange(bits, dtype=np.uint64))) & np.uint64(255))
  return np.concatenate([header.astype(U32).reshape(-1).view(np.uint8),
                         packed.astype(np.uint8).reshape(-1)])


def _np_fields(payload, n, bits, bucket, scheme):
  """(header[nb, S] uint32, codes[nb, bucket]) of a payload, codes unpacked as pack8 in
  qsgd_math.h defines."""
  payload = np.asarray(payload)
  nb = -(-n // bucket)
  s = scales_per_bucket(scheme)
  header = payload[: 4 * s * nb].view(U32).reshape(nb, s)
  packed = payload[4 * s * nb:].reshape(nb, bucket // 8, bits).astype(np.uint64)
  words = np.zeros((nb, bucket // 8), np.uint64)
  for byte in range(bits):
    words |= packed[..., byte] << np.uint64(8 * byte)
  mask = np.uint64((1 << bits) - 1)
  codes = np.stack([(words >> np.uint64(j * bits)) & mask for j in range(8)], axis=-1)
  return header, codes.reshape(nb, bucket).astype(U32)


def _np_scales(payload, n, bits, bucket, scheme):
  """(min or None, step) per bucket in float64: the stored min and the step s * 2**k."""
  header, _ = _np_fields(payload, n, bits, bucket, scheme)
  s, k = _np_unword(header[:, -1])
  step = s.astype(np.float64) * np.exp2(k.astype(np.float64))
  return (header[:, 0].view(np.float32) if scheme == "maxmin" else None), step


def _np_decode(payload, n, bits, bucket, scheme) -> np.ndarray:
  if n == 0:
    return np.zeros((0,), np.float32)
  header, codes = _np_fields(payload, n, bits, bucket, scheme)
  s, k = _np_unword(header[:, -1])
  with np.errstate(invalid="ignore", over="ignore"):
    if scheme == "maxmin":
      y_min = _np_ldexp(header[:, 0].view(np.float32), -k)
      w = _ftz(y_min[:, None] + codes.astype(np.float32) * s[:, None])  # the product is exact
      out = _np_ldexp(w, k[:, None])
    else:
      level = (codes & U32((1 << (bits - 1)) - 1)).astype(np.float32)
      v = _np_ldexp(level * s[:, None], k[:, None])
      out = np.where((codes >> U32(bits - 1)) != 0, -v, v)
  return out.astype(np.float32).reshape(-1)[:n]


def _steps(x, bits, bucket, scheme) -> np.ndarray:
  """float64 step of each element's bucket, from the definition."""
  x = np.asarray(x, np.float64).reshape(-1)
  n = x.size
  out = np.empty(n)
  for s in range(0, n, bucket):
    b = x[s:s + bucket]
    span = b.max() - b.min() if scheme == "maxmin" else np.sqrt(np.sum(b * b))
    out[s:s + bucket] = span / levels(bits, scheme)
  return out


def _bucket_min(x, bucket) -> np.ndarray:
  x = np.asarray(x, np.float64).reshape(-1)
  out = np.empty_like(x)
  for s in range(0, x.size, bucket):
    out[s:s + bucket] = x[s:s + bucket].min()
  return out


def _bucket_max_abs(x, bucket) -> np.ndarray:
  x = np.abs(np.asarray(x, np.float64).reshape(-1))
  out = np.empty_like(x)
  for s in range(0, x.size, bucket):
    out[s:s + bucket] = x[s:s + bucket].max()
  return out


def assert_jax_decode(d, payload, shape, bits, bucket, scheme, dtype=np.float32):
  """The pure-JAX decode (eager or under jit) equals the format's value bit for bit: the only
  product followed by an add, code * s, is exact, so XLA's FMA contraction cannot change it."""
  want = _np_decode(payload, math.prod(shape), bits, bucket, scheme).astype(dtype).reshape(shape)
  np.testing.assert_array_equal(np.asarray(d), want)


# ---- test data and cached compiled functions ---------------------------------------------------

def _sweep_input(bucket: int) -> np.ndarray:
  """7 * bucket + 3 values: a normal bucket with an outlier, a constant bucket (maxmin step 0), a
  wide-range offset bucket, a zero bucket holding -0.0, three buckets at the ends of the float32
  range (mixed signs near the largest finite float: max - min and the norm overflow float32; an
  offset bucket near 1e-37: its step is below the smallest normal; one value of 1e30 among values
  near 2**-120), and a partial last bucket."""
  r = np.random.default_rng(1000 + bucket)
  huge = np.clip(r.standard_normal(bucket), -1, 1) * 3.4e38
  huge[0] = np.finfo(np.float32).max
  among_tiny = r.standard_normal(bucket) * 2.0**-120
  among_tiny[bucket // 3] = 1e30
  x = np.concatenate([
      r.standard_normal(bucket),
      np.full(bucket, 1.5),
      r.standard_normal(bucket) * 1e3 - 500.0,
      np.where(np.arange(bucket) % 3 == 0, -0.0, 0.0),
      huge,
      (2.0 + r.standard_normal(bucket) * 0.1) * 1e-37,
      among_tiny,
      r.standard_normal(3) * 1e-2,
  ])
  x[bucket // 2] = 40.0
  return x.astype(np.float32)


@functools.cache
def _pair_fn(bits, bucket, scheme, rounding):
  """jit: xs, key -> per x: (ffi payload, jax payload, ffi decode, jax decode of the ffi payload)."""
  f = qcomm.QSGD(bits, bucket, scheme, rounding, impl="ffi")
  j = qcomm.QSGD(bits, bucket, scheme, rounding, impl="jax")

  def fn(xs, key):
    out = []
    for x in xs:
      pf, pj = f.encode(x, key), j.encode(x, key)
      out.append((pf, pj, f.decode(pf, x.shape, x.dtype), j.decode(pf, x.shape, x.dtype)))
    return out

  return jax.jit(fn)


@functools.cache
def _sweep_result(config):
  """(x, seed words, (ffi payload, jax payload, ffi decode, jax decode)), computed once."""
  x = _sweep_input(config[1])
  key = jax.random.key(7)
  (out,) = jax.device_get(_pair_fn(*config)([jnp.asarray(x)], key))
  return x, _seed(key), tuple(np.asarray(a) for a in out)


def _sweep_configs():
  """Every bits x scheme x rounding, the bucket size rotating through BUCKETS (so every bucket
  meets every scheme, rounding and most bit widths), plus buckets on the other code paths: > 512
  (the reference's scan over the sum of squares), > 4096 (the kernels' heap buffers), and every
  bit width at 64 and 128 (the sizes the CPU encode compiles as constants) in both schemes."""
  out = []
  for bits in range(1, 9):
    combos = [(s, r) for s in SCHEMES for r in ROUNDINGS if not (s == "norm" and bits < 2)]
    for i, (s, r) in enumerate(combos):
      out.append((bits, BUCKETS[(bits + i) % len(BUCKETS)], s, r))
  out += [(4, 1024, "norm", "stochastic"), (8, 4104, "norm", "nearest"),
          (5, 4104, "maxmin", "stochastic")]
  out += [(bits, b, s, "stochastic") for bits in range(1, 9) for b in (64, 128) for s in SCHEMES
          if not (s == "norm" and bits < 2) and (bits, b, s, "stochastic") not in out]
  return out


SWEEP = _sweep_configs()


# ---- 1. the implementations agree bit for bit ---------------------------------------------------

@pytest.mark.parametrize("config", SWEEP, ids=codec_id)
def test_ffi_jax_numpy_payloads_and_decodes_agree(config):
  bits, bucket, scheme, rounding = config
  x, seed, (pf, pj, df, dj) = _sweep_result(config)
  n = x.size
  assert pf.dtype == np.uint8 and pf.shape == (expected_payload_bytes(n, bits, bucket, scheme),)
  np.testing.assert_array_equal(pf, pj, err_msg="ffi vs jax payload")
  np.testing.assert_array_equal(pf, _np_encode(x, seed, bits, bucket, scheme, rounding),
                                err_msg="ffi vs numpy model payload")
  np.testing.assert_array_equal(df, _np_decode(pf, n, bits, bucket, scheme),
                                err_msg="ffi vs numpy model decode")
  assert_jax_decode(dj, pf, (n,), bits, bucket, scheme)


def test_jax_decode_under_jit_bit_identical_to_ffi():
  """Every decoded value of the sweep: the jitted pure-JAX decode equals the kernels' bit for bit
  (was a strict xfail while `min + code * step` had a 24-bit step: XLA contracted it into an FMA)."""
  mismatches = 0
  for config in SWEEP:
    _, _, (_, _, df, dj) = _sweep_result(config)
    mismatches += int(np.sum(df.view(U32) != dj.view(U32)))
  assert mismatches == 0, f"{mismatches} decoded values differ"


SHAPES = [(), (0,), (2, 0), (1,), (7,), (3, 50), (2, 3, 37)]
SHAPE_INPUTS = ([(s, "float32") for s in SHAPES]
                + [(s, "bfloat16") for s in ((), (3, 50))]
                + [(s, "float16") for s in ((7,), (2, 3, 37))])
SHAPE_CONFIGS = [(4, 16, "maxmin", "stochastic"), (3, 24, "norm", "nearest"),
                 (8, 8, "norm", "stochastic"), (1, 128, "maxmin", "nearest")]


@pytest.mark.parametrize("config", SHAPE_CONFIGS, ids=codec_id)
def test_shapes_and_dtypes_agree(config):
  """Scalars, empty arrays, sizes below one bucket, 2-D/3-D, bf16/f16 inputs (decoded to their own
  dtype): ffi, jax and the numpy model agree; the payload is that of the flattened float32 array."""
  bits, bucket, scheme, rounding = config
  r = np.random.default_rng(zlib.crc32(repr(config).encode()))
  xs = [jnp.asarray((r.standard_normal(s) * 3).astype(np.float32)).astype(DTYPES[dt])
        for s, dt in SHAPE_INPUTS]
  key = jax.random.key(3)
  out = jax.device_get(_pair_fn(*config)(xs, key))
  seed = _seed(key)
  for x, (pf, pj, df, dj) in zip(xs, out):
    where = f"{x.shape} {x.dtype}"
    n = x.size
    assert pf.shape == (expected_payload_bytes(n, bits, bucket, scheme),), where
    np.testing.assert_array_equal(pf, pj, err_msg=where)
    x32 = as_np(x.astype(jnp.float32))
    np.testing.assert_array_equal(pf, _np_encode(x32, seed, bits, bucket, scheme, rounding),
                                  err_msg=where)
    assert df.shape == x.shape and df.dtype == x.dtype, where
    assert dj.shape == x.shape and dj.dtype == x.dtype, where
    want = _np_decode(pf, n, bits, bucket, scheme).astype(x.dtype).reshape(x.shape)
    np.testing.assert_array_equal(df, want, err_msg=where)
    assert_jax_decode(dj, pf, x.shape, bits, bucket, scheme, x.dtype)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_denormal_and_tiny_inputs_agree(scheme):
  """Denormal inputs and underflowing intermediates: ffi and jax both flush denormals (XLA CPU)."""
  tiny = np.float32(np.finfo(np.float32).tiny)
  x = np.concatenate([
      np.arange(16) * tiny / 64,                          # denormals
      np.linspace(-3, 5, 16) * tiny,                      # around the smallest normal
      np.linspace(-1, 1, 16) * 1e-30,                     # squares underflow (norm)
      np.linspace(1, 2, 16) * 1e-20 + 1.0,                # span below the step resolution
  ]).astype(np.float32)
  for bits, rounding in ((2, "stochastic"), (8, "nearest")):
    (out,) = jax.device_get(_pair_fn(bits, 16, scheme, rounding)([jnp.asarray(x)],
                                                                 jax.random.key(1)))
    pf, pj, df, dj = out
    np.testing.assert_array_equal(pf, pj)
    assert np.all(np.isfinite(df)) and np.all(np.isfinite(dj))


def test_auto_impl_matches_ffi_on_cpu():
  x = jnp.asarray(np.random.default_rng(0).standard_normal(300).astype(np.float32))
  key = jax.random.key(0)
  a = qcomm.QSGD(impl="auto").encode(x, key)
  f = qcomm.QSGD(impl="ffi").encode(x, key)
  np.testing.assert_array_equal(as_np(a), as_np(f))


# ---- 2. stochastic rounding is unbiased --------------------------------------------------------

def _unbias_input():
  r = np.random.default_rng(11)
  scale = np.repeat([1.0, 0.01, 30.0, 1.0], 16)[:60]
  offset = np.repeat([0.0, 5.0, -20.0, 0.0], 16)[:60]
  return (r.standard_normal(60) * scale + offset).astype(np.float32)  # 3 buckets of 16 + 12


@pytest.mark.parametrize("scheme,bits", [("maxmin", 1), ("maxmin", 2), ("maxmin", 4),
                                         ("norm", 2), ("norm", 4)])
def test_stochastic_rounding_is_unbiased(scheme, bits):
  """The mean of K roundtrips is within 5 standard errors of x, element by element, both impls;
  the pooled z-score of all elements off the grid is within 5 too.

  One stochastic rounding of t (in steps) is floor(t) or floor(t)+1, a variance of
  frac(t)(1-frac(t)) step^2 <= step^2/4; the mean of K independent ones has a standard error
  <= step / (2 sqrt(K)).
  """
  K = 2000
  x = _unbias_input()
  keys = jax.random.split(jax.random.key(2024), K)
  cs = [qcomm.QSGD(bits, 16, scheme, "stochastic", impl=i) for i in ("ffi", "jax")]
  f = jax.jit(lambda x, keys: [jax.vmap(c.roundtrip, in_axes=(None, 0))(x, keys) for c in cs])
  step = _steps(x, bits, 16, scheme)
  slack = 2.0**-20 * _bucket_max_abs(x, 16)
  tol = 5 * step / math.sqrt(4 * K) + slack
  # Pooled z-score of the signed errors (toward larger codes), which sees a small systematic bias
  # that the per-element bound cannot: under unbiasedness it is ~N(0, 1).
  sign = np.ones_like(x, np.float64) if scheme == "maxmin" else np.sign(x)
  t = (x - _bucket_min(x, 16)) / step if scheme == "maxmin" else np.abs(x) / step
  p = t - np.floor(t)
  use = p * (1 - p) > 0.01
  sigma = np.sqrt(p * (1 - p)) * step / math.sqrt(K)
  for impl, dec in zip(("ffi", "jax"), f(jnp.asarray(x), keys)):
    dec = as_np(dec).astype(np.float64)
    err = np.abs(dec.mean(axis=0) - x)
    assert np.all(err <= tol), (impl, np.max(err / step), np.argmax(err - tol))
    z = ((dec.mean(axis=0) - x) * sign)[use] / sigma[use]
    pooled = z.sum() / math.sqrt(z.size)
    assert z.size > 20 and abs(pooled) <= 5, (impl, pooled)
    # Every roundtrip is one of the two grid points around x.
    assert np.all(np.abs(dec - x) <= step * (1 + 1e-4) + slack), impl
    # The randomness is real: values off the grid are rounded both ways across the keys.
    assert np.mean(dec.std(axis=0) > 0) > 0.5, impl
  # The bound has power: nearest rounding (biased) breaks it.
  near = as_np(qcomm.QSGD(bits, 16, scheme, "nearest", impl="ffi").roundtrip(jnp.asarray(x)))
  assert np.any(np.abs(near - x) > tol)


# ---- 3. per-element error bound ----------------------------------------------------------------

@pytest.mark.parametrize("config", SWEEP, ids=codec_id)
def test_error_within_one_step(config):
  """|decode - x| <= step (stochastic) or step/2 (nearest), float32 rounding aside, for the stored
  step; the stored min is the bucket's min, the stored step is (max - min) * fl(1/L) (maxmin) or
  about norm / L (norm), rounded up to 16 significant bits."""
  bits, bucket, scheme, rounding = config
  x, _, (pf, _, df, dj) = _sweep_result(config)
  L = levels(bits, scheme)
  mins, stored = _np_scales(pf, x.size, bits, bucket, scheme)
  step = np.repeat(stored, bucket)[: x.size]
  slack = 2.0**-20 * _bucket_max_abs(x, bucket)
  bound = step * (1.0 if rounding == "stochastic" else 0.5) + slack
  for d in (df, dj):
    err = np.abs(d.astype(np.float64) - x)
    assert np.all(err <= bound), (np.argmax(err - bound), np.max(err - bound))
  nb = stored.shape[0]
  xb = np.concatenate([x, np.full(nb * bucket - x.size, np.nan, np.float32)]).reshape(nb, bucket)
  xb64 = xb.astype(np.float64)
  if scheme == "maxmin":
    np.testing.assert_array_equal(mins, np.nanmin(xb, axis=1) + np.float32(0))
    want = (np.nanmax(xb64, axis=1) - np.nanmin(xb64, axis=1)) / L
  else:
    # capped where the norm exceeds the largest float32: L steps must stay finite
    want = np.minimum(np.sqrt(np.nansum(xb64**2, axis=1)), np.float64(F32_MAX)) / L
  assert np.all(stored <= want * (1 + 2.0**-14)), np.max(stored / want)
  assert np.all(stored >= want * (1 - (2.0**-10 if scheme == "norm" else 2.0**-22))), (
      np.min(stored / want))


@pytest.mark.parametrize("scale", [1e20, 1e-25, 3e37, 1.5e-38])  # 3e37: the norm exceeds 3.4e38
def test_norm_error_bound_at_extreme_magnitudes(scale):
  """Was a strict xfail: float32 squares overflowed above ~1.8e19 (NaN for finite x) and underflowed
  below ~1e-19 (all zeros). The bucket is now scaled by a power of two first."""
  x = np.array([1, -2, 3, -4, 5, -6, 7, 0], np.float32) * np.float32(scale)
  step = _steps(x, 4, 8, "norm")
  (out,) = _pair_fn(4, 8, "norm", "nearest")([jnp.asarray(x)], None)
  np.testing.assert_array_equal(as_np(out[0]), as_np(out[1]))
  for d in (as_np(out[2]), as_np(out[3])):
    assert np.all(np.isfinite(d))
    assert np.all(np.abs(d - x) <= step * 0.5 * (1 + 2.0**-14) + 2.0**-20 * np.abs(x).max())


# ---- 4. nearest rounding reproduces values on the grid exactly ---------------------------------

@functools.cache
def _roundtrip_both(bits, bucket, scheme, rounding="nearest"):
  cs = [qcomm.QSGD(bits, bucket, scheme, rounding, impl=i) for i in ("ffi", "jax")]
  return jax.jit(lambda x: [c.roundtrip(x) for c in cs])


@pytest.mark.parametrize("bits", range(1, 9))
def test_nearest_maxmin_exact_on_grid(bits):
  """Buckets of min + k * 2**e with every k in 0..L: step = L * 2**e * fl(1/L) = 2**e exactly, so
  nearest rounding gives code k and the decode is exact (both impls)."""
  L = levels(bits, "maxmin")
  bucket = 8 * math.ceil((L + 1) / 8)
  r = np.random.default_rng(bits)
  buckets = []
  for mn, e in ((-3.0, -4), (0.0, 0), (1024.0, -2), (-0.5, -9)):
    k = r.permutation(np.arange(bucket) % (L + 1))
    buckets.append(mn + k * 2.0**e)
  buckets.append(7.0 + np.array([L, 0, 1, L, 0]) * 2.0**-3)  # a partial bucket, also 0..L
  exact = np.concatenate(buckets)
  x = exact.astype(np.float32)
  assert np.array_equal(x.astype(np.float64), exact)
  for d in _roundtrip_both(bits, bucket, "maxmin")(jnp.asarray(x)):
    np.testing.assert_array_equal(as_np(d), x)


# k with sum(k^2) == L^2 for L = 2**(b-1) - 1: a bucket of +-k * 2**e has norm L * 2**e, step 2**e.
_PYTHAGOREAN = {1: (1,), 3: (2, 2, 1), 7: (6, 3, 2), 15: (14, 5, 2), 31: (30, 6, 5),
                63: (62, 10, 5), 127: (126, 13, 8, 4, 2)}


@pytest.mark.parametrize("bits", range(2, 9))
def test_nearest_norm_exact_on_grid(bits):
  L = levels(bits, "norm")
  ks = _PYTHAGOREAN[L]
  assert sum(k * k for k in ks) == L * L
  r = np.random.default_rng(bits)
  rows = []
  for e in (-6, 0, 5):
    b = np.zeros(16)  # grid values with random signs at random places, zeros elsewhere
    b[r.permutation(16)[: len(ks)]] = np.array(ks) * r.choice([-1.0, 1.0], len(ks)) * 2.0**e
    rows.append(b)
  # One nonzero value v (it is the norm itself): code L, decoded L * s with s = fl(|v| * fl(1/L))
  # rounded up to 16 significant bits, which need not be v (the step is stored, not the norm), but
  # is within 2**-14 of it (also for a power of two: fl(1/L) has 24 significant bits).
  general = []
  for v in (-(2.0**-3), -1.375 * 2.0**-3, 2.75):
    g = np.zeros(16)
    g[r.integers(16)] = v
    general.append(g)
  tail = np.array([0.0, 0.0, 4.0])  # a partial last bucket with one nonzero value
  x = np.concatenate(rows + general + [tail]).astype(np.float32)
  grid = np.ones(x.size, bool)
  grid[16 * len(rows):] = False
  for d in _roundtrip_both(bits, 16, "norm")(jnp.asarray(x)):
    d = as_np(d)
    np.testing.assert_array_equal(d[grid], x[grid])
    assert np.all(np.abs(d[~grid] - x[~grid]) <= 2.0**-14 * np.abs(x[~grid])), d[~grid]


# ---- 5. payload sizes -------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["ffi", "jax"])
def test_payload_size_formula(impl):
  for bits in range(1, 9):
    for bucket in BUCKETS + (1024,):
      for scheme in SCHEMES:
        if scheme == "norm" and bits < 2:
          continue
        c = qcomm.QSGD(bits, bucket, scheme, impl=impl)
        S = scales_per_bucket(scheme)
        assert c.wire_bits() == pytest.approx(8 * (4 * S + bucket * bits / 8) / bucket, rel=1e-12)
        for n in (0, 1, 7, bucket - 1, bucket, bucket + 1, 1000, 4097):
          want = math.ceil(n / bucket) * (4 * S + bucket * bits // 8)
          assert c.payload_size(n) == want
          if bucket in (8, 512) and n in (1, bucket + 1, 4097):  # traced, not compiled
            out = jax.eval_shape(c.encode, jax.ShapeDtypeStruct((n,), jnp.float32),
                                 jax.random.key(0))
            assert (out.shape, out.dtype) == ((want,), jnp.uint8)
  for codec, per, bits_ in ((qcomm.Cast(jnp.bfloat16), 2, 16), (qcomm.Cast(jnp.float16), 2, 16),
                            (qcomm.NoCompression(), 4, 32)):
    assert codec.wire_bits() == bits_
    for n in (0, 1, 7, 1000):
      assert codec.payload_size(n) == per * n
      out = jax.eval_shape(codec.encode, jax.ShapeDtypeStruct((n,), jnp.float32))
      assert (out.shape, out.dtype) == ((per * n,), jnp.uint8)


def test_payload_sizes_of_real_encodes():
  x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 70)).astype(np.float32))
  key = jax.random.key(0)
  for codec, want in ((qcomm.QSGD(4, 128), 2 * (8 + 64)), (qcomm.QSGD(3, 24, "norm"), 9 * (4 + 9)),
                      (qcomm.QSGD(1, 8), 27 * (8 + 1)), (qcomm.Cast(jnp.bfloat16), 420),
                      (qcomm.NoCompression(), 840)):
    p = codec.encode(x, key)
    assert p.shape == (want,) and p.dtype == jnp.uint8 and codec.payload_size(210) == want


# ---- 6. non-finite inputs ----------------------------------------------------------------------

NF_BUCKET = 16
NF_N = 3 * NF_BUCKET + 5  # three whole buckets and a partial one


def _nonfinite_rows():
  """(rows, per row the buckets that hold a non-finite value)."""
  base = np.random.default_rng(9).standard_normal(NF_N).astype(np.float32)
  # NaNs with the sign bit set and with other payloads: the kernels find a NaN from the order
  # keys of a bucket's extremes, which must catch every NaN bit pattern, not only the canonical one
  neg_nan, neg_low_nan, low_nan = np.array([0xFFC00000, 0xFF800001, 0x7F800001],
                                           np.uint32).view(np.float32)
  cases = [({20: np.nan}, {1}), ({20: np.inf}, {1}), ({20: -np.inf}, {1}),
           ({21: neg_nan}, {1}), ({2: neg_low_nan}, {0}), ({40: low_nan, 41: -np.inf}, {2}),
           ({17: np.inf, 30: -np.inf}, {1}), ({0: -np.inf}, {0}), ({47: np.inf}, {2}),
           ({48: np.nan}, {3}), ({48: -np.inf}, {3}), ({52: np.inf}, {3}),
           ({5: np.nan, 50: np.inf}, {0, 3}), ({33: np.inf, 34: np.nan}, {2})]
  rows, bad = [], []
  for sets, b in cases:
    row = base.copy()
    for i, v in sets.items():
      row[i] = v
    rows.append(row)
    bad.append(b)
  return np.stack(rows), bad


NF_CONFIGS = [(1, "maxmin", "stochastic"), (4, "maxmin", "nearest"), (8, "maxmin", "stochastic"),
              (2, "norm", "nearest"), (5, "norm", "stochastic"), (8, "norm", "nearest")]


@pytest.mark.parametrize("bits,scheme,rounding", NF_CONFIGS)
def test_non_finite_inputs_poison_exactly_their_bucket(bits, scheme, rounding):
  """A bucket holding NaN/+-Inf decodes to non-finite values only (through decode and decode_sum
  with a finite payload), the other buckets stay finite; ffi and jax give the same bytes."""
  cs = [qcomm.QSGD(bits, NF_BUCKET, scheme, rounding, impl=i) for i in ("ffi", "jax")]
  rows, bad = _nonfinite_rows()
  key = jax.random.key(4)

  @jax.jit
  def run(xs):
    out = []
    for c in cs:
      p = jax.vmap(c.encode, in_axes=(0, None))(xs, key)
      d = jax.vmap(lambda q: c.decode(q, (NF_N,)))(p)
      finite = c.encode(jnp.ones((NF_N,), jnp.float32), key)
      s = jax.vmap(lambda q: c.decode_sum(jnp.stack([finite, q]), (NF_N,)))(p)
      out.append((p, d, s))
    return out

  (pf, df, sf), (pj, dj, sj) = jax.device_get(run(jnp.asarray(rows)))
  np.testing.assert_array_equal(pf, pj)  # the NaN bytes too
  bucket_of = np.arange(NF_N) // NF_BUCKET
  for i, b in enumerate(bad):
    in_bad = np.isin(bucket_of, list(b))
    for name, d in (("ffi decode", df), ("ffi decode_sum", sf), ("jax decode", dj),
                    ("jax decode_sum", sj)):
      assert not np.any(np.isfinite(d[i][in_bad])), (name, i, d[i][in_bad])
      assert np.all(np.isfinite(d[i][~in_bad])), (name, i)


@pytest.mark.parametrize("codec", [qcomm.Cast(jnp.bfloat16), qcomm.Cast(jnp.float16),
                                   qcomm.NoCompression()], ids=["bf16", "f16", "f32"])
def test_cast_and_nocompression_keep_non_finite(codec):
  x = np.array([1.0, np.nan, np.inf, -np.inf, -2.5, 0.0], np.float32)
  d = as_np(codec.roundtrip(jnp.asarray(x)))
  np.testing.assert_array_equal(np.isnan(d), np.isnan(x))
  np.testing.assert_array_equal(d[2:4], x[2:4])
  np.testing.assert_array_equal(d[[0, 4, 5]], x[[0, 4, 5]])
  s = as_np(codec.decode_sum(jnp.stack([codec.encode(jnp.asarray(x)),
                                        codec.encode(jnp.ones(6, jnp.float32))]), (6,)))
  np.testing.assert_array_equal(np.isfinite(s), np.isfinite(x))


# ---- 7. bad parameters -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,name", [
    (dict(bits=0), "bits"), (dict(bits=9), "bits"), (dict(bits=2.5), "bits"),
    (dict(bits=True), "bits"), (dict(bits="4"), "bits"), (dict(bits=-1), "bits"),
    (dict(bucket_size=0), "bucket_size"), (dict(bucket_size=-8), "bucket_size"),
    (dict(bucket_size=12), "bucket_size"), (dict(bucket_size=7), "bucket_size"),
    (dict(bucket_size=16.0), "bucket_size"), (dict(bucket_size=False), "bucket_size"),
    (dict(scheme="foo"), "scheme"), (dict(scheme="norm", bits=1), "bits"),
    (dict(rounding="up"), "rounding"), (dict(impl="cuda"), "impl"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_bad_qsgd_parameters_raise(kwargs, name):
  with pytest.raises(ValueError, match=name):
    qcomm.QSGD(**kwargs)


def test_numpy_integer_parameters_are_accepted():
  c = qcomm.QSGD(bits=np.int32(3), bucket_size=np.int64(24))
  assert c.bits == 3 and type(c.bits) is int and c.bucket_size == 24 and type(c.bucket_size) is int
  assert c == qcomm.QSGD(bits=3, bucket_size=24)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8, jnp.float64, "float8_e4m3fn"])
def test_bad_cast_dtype_raises(dtype):
  with pytest.raises(ValueError, match="dtype"):
    qcomm.Cast(dtype)


@pytest.mark.parametrize("codec", [qcomm.QSGD(impl="ffi"), qcomm.QSGD(impl="jax"),
                                   qcomm.Cast(jnp.bfloat16), qcomm.NoCompression()],
                         ids=["qsgd-ffi", "qsgd-jax", "cast", "none"])
def test_bad_call_arguments_raise(codec):
  key = jax.random.key(0)
  for bad in (jnp.ones(4, jnp.int32), jnp.ones(4, jnp.uint8), jnp.ones(4, bool)):
    with pytest.raises(ValueError, match="x must be"):
      codec.encode(bad, key)
  p = jnp.zeros((codec.payload_size(40),), jnp.uint8)  # a payload of a (5, 8) array
  codec.decode(p, (5, 8))  # valid
  with pytest.raises(ValueError, match="payload"):
    codec.decode(p[:-1], (5, 8))
  with pytest.raises(ValueError, match="payload"):
    codec.decode(jnp.zeros((codec.payload_size(40) + 1,), jnp.uint8), (5, 8))
  with pytest.raises(ValueError, match="payload"):  # a shape of another payload size
    codec.decode(p, (17, 8) if isinstance(codec, qcomm.QSGD) else (5, 7))
  with pytest.raises(ValueError, match="payload"):
    codec.decode(p.astype(jnp.int8), (5, 8))
  with pytest.raises(ValueError, match="payload"):
    codec.decode(p[None], (5, 8))
  with pytest.raises(ValueError, match="dtype"):
    codec.decode(p, (5, 8), jnp.int32)
  with pytest.raises(ValueError, match="payloads"):
    codec.decode_sum(p, (5, 8))
  with pytest.raises(ValueError, match="payloads?"):
    codec.decode_sum(p[None, :-1], (5, 8))
  with pytest.raises(ValueError, match="payloads"):
    codec.decode_sum(jnp.zeros((0, p.shape[0]), jnp.uint8), (5, 8))
  with pytest.raises(ValueError, match="dtype"):
    codec.decode_sum(p[None], (5, 8), jnp.int32)


@pytest.mark.parametrize("impl", ["ffi", "jax"])
def test_bad_keys_raise(impl):
  x = jnp.ones(20, jnp.float32)
  with pytest.raises(ValueError, match="key"):
    qcomm.QSGD(impl=impl).encode(x)  # stochastic needs a key
  with pytest.raises(ValueError, match="key"):
    qcomm.QSGD(impl=impl).encode(x, None)
  for rounding in ROUNDINGS:
    c = qcomm.QSGD(rounding=rounding, impl=impl)
    with pytest.raises(ValueError, match="key"):
      c.encode(x, jax.random.split(jax.random.key(0), 2))  # an array of keys
    with pytest.raises(ValueError, match="key"):
      c.encode(x, jnp.arange(2, dtype=jnp.int32))  # not a key
    with pytest.raises(ValueError, match="key"):
      c.encode(x, jnp.zeros((2, 2), jnp.uint32))  # raw keys, batched


# ---- 8. transformations ------------------------------------------------------------------------

TRANSFORM_CODECS = [(4, 128, "maxmin", "stochastic"), (3, 24, "norm", "nearest")]
ROW = 200  # per-device / per-row elements: not a multiple of either bucket
ROW_SHAPE = (8, 25)  # 2-D rows where a test wants them


def _rows():
  return np.random.default_rng(0).standard_normal((D, ROW)).astype(np.float32)


def _row_keys():
  return jax.random.split(jax.random.key(99), D)


@functools.cache
def _per_row_reference(config):
  """Payload of each row with its own key (the numpy model, which test 1 ties to the eager codec)."""
  seeds = as_np(jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(_row_keys()))
  return np.stack([_np_encode(x, s, *config) for x, s in zip(_rows(), seeds)])


def _check_rows(config, impl, payloads, decodes):
  enc = _per_row_reference(config)
  payloads = np.asarray(payloads).reshape(enc.shape)
  np.testing.assert_array_equal(payloads, enc)
  decodes = np.asarray(decodes).reshape(D, ROW)
  for i in range(D):
    if impl == "ffi":
      np.testing.assert_array_equal(decodes[i], _np_decode(enc[i], ROW, *config[:3]))
    else:
      assert_jax_decode(decodes[i], enc[i], (ROW,), *config[:3])


@pytest.mark.parametrize("impl", ["ffi", "jax"])
@pytest.mark.parametrize("config", TRANSFORM_CODECS, ids=codec_id)
def test_jit_matches_eager(config, impl):
  """jit gives the eager bytes; eager decodes (also pure JAX: one op at a time, no FMA) are the
  format's exact values."""
  c = qcomm.QSGD(*config, impl=impl)
  xs, keys = _rows(), _row_keys()
  x2 = jnp.asarray(xs[2].reshape(ROW_SHAPE))
  eager_p = as_np(c.encode(x2, keys[2]))
  eager_d = as_np(c.decode(jnp.asarray(eager_p), ROW_SHAPE))
  np.testing.assert_array_equal(eager_p, _per_row_reference(config)[2])
  np.testing.assert_array_equal(eager_d.reshape(-1), _np_decode(eager_p, ROW, *config[:3]))
  p, d = jax.jit(lambda x, k: (c.encode(x, k), c.roundtrip(x, k)))(x2, keys[2])
  np.testing.assert_array_equal(as_np(p), eager_p)
  assert d.shape == ROW_SHAPE
  if impl == "ffi":
    np.testing.assert_array_equal(as_np(d), eager_d)
  else:
    assert_jax_decode(as_np(d), eager_p, ROW_SHAPE, *config[:3])


@pytest.mark.parametrize("impl", ["ffi", "jax"])
@pytest.mark.parametrize("config", TRANSFORM_CODECS, ids=codec_id)
def test_vmap_matches_per_row(config, impl):
  c = qcomm.QSGD(*config, impl=impl)
  xs, keys = jnp.asarray(_rows()), _row_keys()

  @jax.jit
  def f(xs, keys):
    p = jax.vmap(c.encode)(xs, keys)
    shared = jax.vmap(c.encode, in_axes=(0, None))(xs, keys[3])
    d = jax.vmap(lambda q: c.decode(q, (ROW,)))(p)
    pairs = jnp.stack([p, p[::-1]], axis=1)
    s = jax.vmap(lambda q: c.decode_sum(q, (ROW,)))(pairs)
    return p, shared, d, s

  p, shared, d, s = (as_np(a) for a in f(xs, keys))
  _check_rows(config, impl, p, d)
  np.testing.assert_array_equal(s, d + d[::-1])
  seed3 = _seed(keys[3])
  for i in (0, 3, 7):
    np.testing.assert_array_equal(shared[i], _np_encode(_rows()[i], seed3, *config))


@pytest.mark.parametrize("impl", ["ffi", "jax"])
@pytest.mark.parametrize("config", TRANSFORM_CODECS, ids=codec_id)
def test_shard_map_matches_per_shard(config, impl, cpu_devices):
  c = qcomm.QSGD(*config, impl=impl)
  mesh = Mesh(np.array(cpu_devices), ("d",))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"))
  def f(x, k):
    p = c.encode(x, k[0])
    return p, c.decode(p, x.shape)

  x = jax.device_put(jnp.asarray(_rows().reshape(-1)), NamedSharding(mesh, P("d")))
  p, d = f(x, _row_keys())
  assert len(p.sharding.device_set) == D
  _check_rows(config, impl, as_np(p), as_np(d))


@pytest.mark.parametrize("impl", ["ffi", "jax"])
@pytest.mark.parametrize("config", TRANSFORM_CODECS, ids=codec_id)
def test_pmap_matches_per_row(config, impl, cpu_devices):
  c = qcomm.QSGD(*config, impl=impl)
  f = jax.pmap(lambda x, k: (c.encode(x, k), c.roundtrip(x, k)), devices=cpu_devices)
  p, d = f(jnp.asarray(_rows()), _row_keys())
  _check_rows(config, impl, as_np(p), as_np(d))


# ---- 9. keys -----------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["ffi", "jax"])
def test_keys(impl):
  x = jnp.asarray(np.random.default_rng(2).standard_normal(300).astype(np.float32))
  c = qcomm.QSGD(4, 16, impl=impl)
  enc = jax.jit(c.encode)
  typed = as_np(enc(x, jax.random.key(5)))
  raw = as_np(enc(x, jax.random.PRNGKey(5)))
  np.testing.assert_array_equal(typed, raw)  # the same threefry key data: the same bits
  np.testing.assert_array_equal(typed, as_np(enc(x, jax.random.key(5))))  # deterministic
  scale_bytes = 19 * 8  # 19 buckets of 16, (min, step) each
  for k in (jax.random.key(6), jax.random.key(7), jax.random.fold_in(jax.random.key(5), 1)):
    o = as_np(enc(x, k))
    np.testing.assert_array_equal(o[:scale_bytes], typed[:scale_bytes])  # the scales agree
    assert not np.array_equal(o[scale_bytes:], typed[scale_bytes:])  # the rounding does not
  near = qcomm.QSGD(4, 16, rounding="nearest", impl=impl)
  enc_near = jax.jit(near.encode)
  ref = as_np(enc_near(x))  # no key at all
  for k in (jax.random.key(0), jax.random.key(1)):
    np.testing.assert_array_equal(as_np(enc_near(x, k)), ref)


def test_other_prng_impls_and_eager_keys():
  x = jnp.asarray(np.random.default_rng(2).standard_normal(300).astype(np.float32))
  c = qcomm.QSGD(4, 16, impl="ffi")
  for key in (jax.random.key(5, impl="rbg"), jax.random.key(5, impl="unsafe_rbg")):
    p = as_np(c.encode(x, key))
    np.testing.assert_array_equal(p, _np_encode(as_np(x), _seed(key), 4, 16, "maxmin",
                                                "stochastic"))
  np.testing.assert_array_equal(as_np(c.encode(x, jax.random.PRNGKey(5))),
                                as_np(c.encode(x, jax.random.key(5))))
  near = qcomm.QSGD(4, 16, rounding="nearest", impl="ffi")
  np.testing.assert_array_equal(as_np(near.encode(x, jax.random.PRNGKey(3))), as_np(near.encode(x)))


# ---- 10. Cast and NoCompression ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_cast_roundtrip_and_decode_sum(dtype):
  r = np.random.default_rng(3)
  x = (r.standard_normal((4, 37)) * np.logspace(-8, 6, 37)).astype(np.float32)  # f16 over/underflow
  c = qcomm.Cast(dtype)
  npdt = np.dtype(dtype)
  xj = jnp.asarray(x)
  want = x.astype(npdt).astype(np.float32)
  np.testing.assert_array_equal(as_np(c.roundtrip(xj)), want)
  p = c.encode(xj)
  assert p.dtype == jnp.uint8 and p.shape == (2 * x.size,)
  np.testing.assert_array_equal(as_np(p).view(npdt).reshape(x.shape), x.astype(npdt))
  # narrow inputs decode to their own dtype, unchanged
  xn = xj.astype(dtype)
  rn = c.roundtrip(xn)
  assert rn.dtype == dtype
  np.testing.assert_array_equal(as_np(rn), as_np(xn))
  # decode_sum: the float32 sum of the casts, in order
  parts = [x * (i + 1) - i for i in range(3)]
  ps = jnp.stack([c.encode(jnp.asarray(a)) for a in parts])
  acc = parts[0].astype(npdt).astype(np.float32)
  for a in parts[1:]:
    acc = acc + a.astype(npdt).astype(np.float32)
  np.testing.assert_array_equal(as_np(c.decode_sum(ps, x.shape)), acc)
  np.testing.assert_array_equal(as_np(jax.jit(lambda q: c.decode_sum(q, x.shape))(ps)), acc)
  np.testing.assert_array_equal(as_np(c.decode_sum(ps, x.shape, dtype)), acc.astype(npdt))


def test_nocompression_is_exact():
  x = np.random.default_rng(4).standard_normal((3, 11)).astype(np.float32)
  c = qcomm.NoCompression()
  assert not c.lossy and qcomm.QSGD().lossy and qcomm.Cast().lossy
  p = c.encode(jnp.asarray(x))
  np.testing.assert_array_equal(as_np(p), x.reshape(-1).view(np.uint8))
  np.testing.assert_array_equal(as_np(c.roundtrip(jnp.asarray(x))), x)
  parts = [x, 2 * x + 1, x - 3]
  got = as_np(c.decode_sum(jnp.stack([c.encode(jnp.asarray(a)) for a in parts]), x.shape))
  np.testing.assert_array_equal(got, (parts[0] + parts[1]) + parts[2])


# ---- 11. decode_sum ----------------------------------------------------------------------------

DS_SHAPE = (8, 25)  # = ROW_SHAPE: the eager pure-JAX decode ops compiled for test 8 are reused


@pytest.mark.parametrize("config", [(4, 128, "maxmin", "stochastic"), (5, 24, "norm", "stochastic"),
                                    (8, 128, "maxmin", "nearest"), (2, 8, "norm", "nearest")],
                         ids=codec_id)
def test_decode_sum_is_in_order_float32_sum(config):
  """decode_sum(payloads[:k]) == ((d0 + d1) + ...) + d_{k-1} in float32, exactly: eager and under
  jit for the kernels; for the jax impl eagerly, and under jit equal to the sum of its own jitted
  decodes."""
  bits, bucket, scheme, _ = config
  f = qcomm.QSGD(*config, impl="ffi")
  j = qcomm.QSGD(*config, impl="jax")
  r = np.random.default_rng(bits)
  xs = [(r.standard_normal(DS_SHAPE) * 10.0**i).astype(np.float32) for i in (0, 2, -1, 1)]
  ps = jnp.stack([f.encode(jnp.asarray(a), jax.random.key(i)) for i, a in enumerate(xs)])
  n = math.prod(DS_SHAPE)
  decs = [_np_decode(as_np(p), n, bits, bucket, scheme).reshape(DS_SHAPE) for p in ps]
  for k in (1, 2, 4):
    want = decs[0]
    for d in decs[1:k]:
      want = want + d  # float32, in order
    np.testing.assert_array_equal(as_np(f.decode_sum(ps[:k], DS_SHAPE)), want, err_msg=f"k={k}")
  np.testing.assert_array_equal(as_np(jax.jit(lambda q: f.decode_sum(q, DS_SHAPE))(ps)), want)
  np.testing.assert_array_equal(as_np(f.decode_sum(ps, DS_SHAPE, jnp.bfloat16)),
                                want.astype(ml_dtypes.bfloat16))
  # jax impl, eager: exactly the format's sum
  if config == TRANSFORM_CODECS[0]:
    np.testing.assert_array_equal(as_np(j.decode_sum(ps[:2], DS_SHAPE)), decs[0] + decs[1])

  @jax.jit
  def jax_sum_and_parts(q):
    return j.decode_sum(q, DS_SHAPE), [j.decode(q[i], DS_SHAPE) for i in range(q.shape[0])]

  s, parts = jax.device_get(jax_sum_and_parts(ps))
  for i, d in enumerate(parts):
    assert_jax_decode(d, as_np(ps[i]), DS_SHAPE, bits, bucket, scheme)
  np.testing.assert_array_equal(s, ((parts[0] + parts[1]) + parts[2]) + parts[3])


# ---- fused decode-sum-reencode (the middle of the allreduce) --------------------------------------

REENCODE_CONFIGS = [(4, 128, "maxmin", "stochastic"), (3, 24, "norm", "stochastic"),
                    (1, 8, "maxmin", "nearest"), (8, 512, "norm", "nearest"),
                    (5, 4104, "maxmin", "stochastic"), (2, 16, "norm", "stochastic")]


def _reencode_payloads(codec, n, k, seed):
  """k ffi payloads of n values: normal data, one bucket with a NaN, one with tiny values whose
  sums and scaled sums underflow (denormals are flushed by both paths)."""
  r = np.random.default_rng(seed)
  xs = (r.standard_normal((k, n)) * 3.0).astype(np.float32)
  b = codec.bucket_size
  if n > 2 * b:
    xs[0, b + 1] = np.nan
    xs[:, 2 * b:3 * b] = (r.standard_normal((k, min(b, n - 2 * b))) * 1e-37).astype(np.float32)
  keys = jax.random.split(jax.random.key(seed), k)
  enc = jax.jit(jax.vmap(qcomm.QSGD(codec.bits, b, codec.scheme, codec.rounding, impl="ffi").encode))
  return enc(jnp.asarray(xs), keys)


@pytest.mark.parametrize("config", REENCODE_CONFIGS, ids=codec_id)
@pytest.mark.parametrize("k,scale", [(1, 1.0), (3, 1.0 / 3.0), (4, 0.25), (2, 1e-30)])
def test_decode_sum_reencode_bytes_equal_unfused(config, k, scale):
  """decode_sum_reencode gives the bytes of decode_sum -> * float32(scale) -> encode, for the FFI
  kernel (fused) and the pure-JAX reference (composed), under jit and vmap."""
  bits, bucket, scheme, rounding = config
  n = 3 * bucket + 5
  key = jax.random.key(11)
  for impl in ("ffi", "jax"):
    c = qcomm.QSGD(bits, bucket, scheme, rounding, impl=impl)
    payloads = _reencode_payloads(c, n, k, seed=bits * 100 + k)

    @jax.jit
    def both(p, key):
      fused = c.decode_sum_reencode(p, (n,), key, scale)
      reduced = c.decode_sum(p, (n,))
      if scale != 1.0:
        reduced = reduced * jnp.float32(scale)
      return fused, c.encode(reduced, key)

    fused, unfused = both(payloads, key)
    assert fused.dtype == np.uint8 and fused.shape == (c.payload_size(n),)
    np.testing.assert_array_equal(as_np(fused), as_np(unfused), err_msg=f"impl={impl}")
    # vmapped over rows (as inside collectives), each row with its own key.
    rows = jnp.stack([payloads, payloads[::-1]])
    keys = jax.random.split(key, 2)
    batched = jax.jit(jax.vmap(lambda p, kk: c.decode_sum_reencode(p, (n,), kk, scale)))(rows, keys)
    for i in range(2):
      np.testing.assert_array_equal(as_np(batched[i]), as_np(both(rows[i], keys[i])[1]),
                                    err_msg=f"impl={impl} vmap row {i}")


def test_decode_sum_reencode_checks_arguments():
  c = qcomm.QSGD(4, 16)
  p = jnp.zeros((2, c.payload_size(40)), jnp.uint8)
  with pytest.raises(ValueError, match="key is required"):
    c.decode_sum_reencode(p, (40,), None)
  with pytest.raises(ValueError, match="payload"):
    c.decode_sum_reencode(p, (41 + 16,), jax.random.key(0))
  with pytest.raises(ValueError, match="payloads must have shape"):
    c.decode_sum_reencode(p[0], (40,), jax.random.key(0))
  assert c.decode_sum_reencode(jnp.zeros((2, 0), jnp.uint8), (0,), jax.random.key(0)).shape == (0,)


class _UnfusedQSGD(qcomm.QSGD):
  """QSGD with the interface's default middle step (decode_sum -> scale -> encode, composed)
  instead of its fused kernel."""

  def wire_decode_sum_reencode(self, wires, n, key, scale=1.0):
    return qcomm.Codec.wire_decode_sum_reencode(self, wires, n, key, scale)


@pytest.mark.parametrize("config", [(4, 128, "maxmin", "stochastic"), (3, 24, "norm", "nearest")],
                         ids=codec_id)
def test_allreduce_fused_reencode_matches_unfused(config, cpu_devices):
  """The allreduce (which uses the fused kernel) gives the same bits as the unfused path."""
  mesh = Mesh(np.array(cpu_devices), ("d",))
  n = 8 * config[1] * 3 + 7
  x = jnp.asarray(np.random.default_rng(5).standard_normal((D, n)).astype(np.float32))
  key = jax.random.key(3)
  outs = []
  for cls in (qcomm.QSGD, _UnfusedQSGD):
    codec = cls(*config, impl="ffi")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    def f(xs, key):
      return qcomm.allreduce(xs[0], "d", codec=codec, key=key)[None]

    outs.append(np.asarray(f(x, key)))
  np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


# ---- 12. the CPU kernels of every instruction set give the same bytes ---------------------------

ISA_ORDER = ("generic", "avx2", "avx512")
ISA_CONFIGS = [(1, 8, "maxmin", "stochastic"), (2, 16, "norm", "nearest"),
               (3, 24, "maxmin", "nearest"), (4, 128, "norm", "stochastic"),
               (5, 40, "maxmin", "stochastic"), (6, 512, "norm", "nearest"),
               (7, 128, "maxmin", "nearest"), (8, 8, "norm", "stochastic")]

# Run with QCOMM_CPU_ISA set: the FFI encode, decode and fused reencode of each ISA_CONFIGS entry.
_ISA_SCRIPT = r"""
import sys
import numpy as np
import jax, jax.numpy as jnp
import jax_qcomm as qcomm
from jax_qcomm import _ffi
x = jnp.asarray(np.load(sys.argv[1]))
configs = eval(sys.argv[2])
out = {"isa": np.array(_ffi.cpu_isa())}
for i, config in enumerate(configs):
  c = qcomm.QSGD(*config, impl="ffi")
  key = jax.random.key(i)
  p = c.encode(x, key)
  out[f"p{i}"] = np.asarray(p)
  out[f"d{i}"] = np.asarray(c.decode(p, x.shape))
  out[f"r{i}"] = np.asarray(c.decode_sum_reencode(jnp.stack([p, p]), x.shape, key, 0.5))
np.savez(sys.argv[3], **out)
"""


def _isa_input() -> np.ndarray:
  """The sweep's buckets (extreme magnitudes included) and 1000 values of spread magnitudes."""
  r = np.random.default_rng(19)
  spread = r.standard_normal(1000) * np.exp(r.uniform(-20, 20, 1000))
  return np.concatenate([_sweep_input(128), spread]).astype(np.float32)


@functools.cache
def _isa_reference():
  """Per ISA_CONFIGS entry: the pure-JAX reference payload of _isa_input() under key i."""
  x = jnp.asarray(_isa_input())
  cs = [qcomm.QSGD(*config, impl="jax") for config in ISA_CONFIGS]
  return jax.device_get(jax.jit(lambda x: [c.encode(x, jax.random.key(i))
                                           for i, c in enumerate(cs)])(x))


def _subprocess_env(**extra) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
  env.pop("XLA_FLAGS", None)
  return env


@pytest.mark.parametrize("isa", ISA_ORDER)
def test_forced_isa_gives_the_same_bytes(isa, tmp_path):
  """QCOMM_CPU_ISA=<isa> (read at import) runs that ISA's kernels: cpu_isa() reports it, and its
  payloads equal the pure-JAX reference's; its decodes and fused reencodes equal the numpy model's.
  Skipped only for ISAs this CPU lacks."""

  detected = _ffi.cpu_isa_detected()
  if detected is None:
    pytest.skip("no CPU kernels built")
  if ISA_ORDER.index(isa) > ISA_ORDER.index(detected):
    pytest.skip(f"this CPU lacks {isa} (it supports up to {detected})")
  x = _isa_input()
  np.save(tmp_path / "x.npy", x)
  proc = subprocess.run(
      [sys.executable, "-c", _ISA_SCRIPT, str(tmp_path / "x.npy"), repr(ISA_CONFIGS),
       str(tmp_path / "out.npz")],
      env=_subprocess_env(QCOMM_CPU_ISA=isa), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = np.load(tmp_path / "out.npz")
  assert str(got["isa"]) == isa
  n = x.size
  for i, (config, want) in enumerate(zip(ISA_CONFIGS, _isa_reference())):
    bits, bucket, scheme, rounding = config
    p = got[f"p{i}"]
    np.testing.assert_array_equal(p, np.asarray(want), err_msg=f"{isa} payload {config}")
    np.testing.assert_array_equal(got[f"d{i}"], _np_decode(p, n, bits, bucket, scheme),
                                  err_msg=f"{isa} decode {config}")
    with np.errstate(over="ignore"):  # d + d overflows near the float32 max, in the kernel too
      reduced = _ftz(_np_decode(p, n, bits, bucket, scheme) * np.float32(2)) * np.float32(0.5)
    np.testing.assert_array_equal(
        got[f"r{i}"], _np_encode(_ftz(reduced), _seed(jax.random.key(i)), *config),
        err_msg=f"{isa} reencode {config}")


def test_bad_isa_override_raises_at_import():
  """An unknown name, or an ISA this CPU lacks, is a ValueError naming QCOMM_CPU_ISA at import."""

  detected = _ffi.cpu_isa_detected()
  if detected is None:
    pytest.skip("no CPU kernels built")
  cases = [("avx9", "unknown instruction set 'avx9'")]
  if detected != "avx512":
    cases.append(("avx512", "does not support 'avx512'"))
  for name, message in cases:
    proc = subprocess.run([sys.executable, "-c", "import jax_qcomm"], capture_output=True,
                          text=True, env=_subprocess_env(QCOMM_CPU_ISA=name), timeout=300)
    assert proc.returncode != 0
    assert "ValueError: QCOMM_CPU_ISA=" in proc.stderr and message in proc.stderr, proc.stderr[-2000:]


def test_cpu_module_is_the_requested_build():
  """The kernels under test are the build asked for: with QCOMM_CPU_MODULE (scripts/sanitize.sh),
  that file, built with exactly the sanitizers QCOMM_REQUIRE_SANITIZERS names; otherwise the
  installed module, built without any."""
  module = _ffi._qcomm_cpu
  if module is None:
    pytest.skip("no CPU kernels built")
  path = os.environ.get(_ffi.CPU_MODULE_ENV)
  if path:
    assert os.path.samefile(module.__file__, path), (module.__file__, path)
  assert module.sanitizers == os.environ.get("QCOMM_REQUIRE_SANITIZERS", "")
  assert sys.modules["jax_qcomm._qcomm_cpu"] is module


def test_ffi_impl_on_a_backend_without_kernels_names_the_fix(monkeypatch):
  """impl="ffi" where the default backend has no compiled kernel (Summable on a GPU) is a clear
  ValueError naming impl='auto', not a lowering error."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  codec = qcomm.Summable(4, 128, impl="ffi")
  with pytest.raises(ValueError, match=r"Summable\(impl='ffi'\) has compiled kernels for \['cpu'\] only.*impl='auto'"):
    codec.bucket_scale(jnp.ones((256,), jnp.float32))
