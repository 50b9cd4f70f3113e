"""Property-based tests of the QSGD codec's numerics over the whole float32 range (hypothesis).

For every finite input, anywhere from the smallest normal float32 (2**-126) to the largest finite
one (3.4e38), mixed freely within a bucket, and any key:

* the decode is finite;
* every element is within the codec's stated bound (docs/wire-format.md, "Error bound"): one
  stored step for stochastic rounding, half a step for nearest, up to float32 rounding (2**-20 of
  the bucket's largest |x|) and the flush of results below 2**-126; and the stored step is at most
  (max - min) / L (maxmin) or min(||bucket||_2, float32 max) / L (norm), times 1 + 2**-14;
* the C++ kernels and the pure-JAX reference give the same payload bytes and the same decoded bits
  (under jit, where XLA may contract multiply-adds into FMAs);
* scaling the input by a power of two scales the decode by it and leaves the codes unchanged.

Inputs are drawn per bucket: a "kind" (log-uniform exponents over a drawn width, a narrow cluster
around one value, a constant bucket, one huge value among tiny ones, the extreme values of the
range), the bucket's top binade (-126..127), signs (all positive, all negative, mixed) and zeros;
the mantissas come from a numpy generator seeded by hypothesis. Each example runs ROWS rows (each of
three buckets) through one compiled function per codec configuration; compilation dominates, so the
configurations are a fixed list covering bits 1..8, both schemes, both roundings and bucket sizes
8..520, each a parametrized case (tests/test_codec.py compares all 30 bits x scheme x rounding
combinations on fixed extreme data).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jax
import jax.numpy as jnp

import jax_qcomm as qcomm

U32 = np.uint32
F32_MAX = float(np.finfo(np.float32).max)
TINY = 2.0**-126  # the smallest normal float32
ROWS = 8

# (bits, bucket_size, scheme, rounding): every bit width, both schemes and roundings; L = 1 for
# maxmin 1-bit (the step is the whole span) and norm 2-bit (the step is the norm, capped at the
# float32 max); bucket 520 takes the reference's scan over the sum of squares.
CONFIGS = [(1, 8, "maxmin", "stochastic"), (2, 24, "maxmin", "nearest"),
           (2, 128, "norm", "stochastic"), (3, 8, "norm", "nearest"),
           (4, 128, "maxmin", "stochastic"), (5, 24, "norm", "stochastic"),
           (6, 520, "norm", "nearest"), (7, 24, "maxmin", "nearest"),
           (8, 8, "maxmin", "stochastic"), (8, 128, "norm", "nearest")]

SETTINGS = settings(deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def levels(bits: int, scheme: str) -> int:
  return (1 << bits) - 1 if scheme == "maxmin" else (1 << (bits - 1)) - 1


def row_size(bucket: int) -> int:
  """Two whole buckets and a partial third (its padding takes part in the scales)."""
  return 2 * bucket + bucket // 2 + 3


@functools.cache
def compiled(config):
  """jit(vmap): xs[ROWS, n], keys[ROWS] -> (ffi payloads, jax payloads, ffi decodes, jax decodes)."""
  f = qcomm.QSGD(*config, impl="ffi")
  j = qcomm.QSGD(*config, impl="jax")

  def one(x, key):
    pf, pj = f.encode(x, key), j.encode(x, key)
    return pf, pj, f.decode(pf, x.shape), j.decode(pf, x.shape)

  return jax.jit(jax.vmap(one))


def run(config, xs, seed, pairs=False):
  """The compiled config on xs[ROWS], row r under key r of split(key(seed)); with pairs=True row
  r + ROWS/2 gets the key of row r."""
  keys = jax.random.split(jax.random.key(seed), ROWS)
  if pairs:
    keys = jnp.concatenate([keys[: ROWS // 2], keys[: ROWS // 2]])
  return [np.asarray(a) for a in jax.device_get(compiled(config)(jnp.asarray(xs), keys))]


# ---- inputs ------------------------------------------------------------------------------------

KINDS = ("spread", "narrow", "constant", "outlier", "extremes")


@st.composite
def bucket_params(draw, max_top=127, min_exp=-126):
  """What one bucket looks like; the values themselves come from make_bucket. Exponents stay in
  [min_exp, max_top] (the whole normal range by default)."""
  return dict(kind=draw(st.sampled_from(KINDS)),
              top=draw(st.integers(min_exp, max_top)),   # binade of the largest magnitude
              width=draw(st.integers(0, 253)),            # binades the magnitudes spread over
              signs=draw(st.sampled_from(("+", "-", "mixed"))),
              zeros=draw(st.booleans()),
              min_exp=min_exp, max_top=max_top)


def make_bucket(p: dict, size: int, rng: np.random.Generator) -> np.ndarray:
  """`size` finite float32 values, each 0 or normal with exponent in [min_exp, top]."""
  top, lo = p["top"], p["min_exp"]
  bottom = max(lo, top - p["width"])
  m = np.minimum(rng.uniform(1, 2, size), 2 - 2.0**-23).astype(np.float32)
  e = np.full(size, top)
  kind = p["kind"]
  if kind == "spread":  # log-uniform magnitudes over [2**bottom, 2**(top+1))
    e = rng.integers(bottom, top + 1, size)
  elif kind == "narrow":  # a cluster around one value, relative spread 2**-d (maxmin: tiny span)
    d = 1 + p["width"] % 23
    m = np.minimum(np.float32(1.5) + (rng.uniform(-0.25, 0.25, size) * 2.0**-d), 2 - 2.0**-23)
    m = m.astype(np.float32)
  elif kind == "constant":
    m[:] = m[0]
  elif kind == "outlier":  # one value 2**(top - bottom) times larger than all the others
    e = np.full(size, bottom)
    e[rng.integers(size)] = top
  elif kind == "extremes":  # the ends of the range (largest finite, smallest normal), the binade
    pick = rng.integers(0, 4, size)
    m = np.where(pick == 0, np.float32(2 - 2.0**-23), np.where(pick == 1, np.float32(1), m))
    e = np.where(pick == 0, p["max_top"], np.where(pick == 1, lo, e))
  x = np.ldexp(m.astype(np.float32), e.astype(np.int32)).astype(np.float32)
  if p["signs"] == "-":
    x = -x
  elif p["signs"] == "mixed":
    x = np.where(rng.random(size) < 0.5, -x, x)
  if p["zeros"]:
    x = np.where(rng.random(size) < 0.25, np.float32(0), x)
  return x


@st.composite
def rows_of(draw, bucket, **kw):
  """[ROWS, row_size(bucket)] float32 inputs, each bucket drawn on its own."""
  n = row_size(bucket)
  nb = math.ceil(n / bucket)
  params = draw(st.lists(bucket_params(**kw), min_size=ROWS * nb, max_size=ROWS * nb))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  flat = np.concatenate([make_bucket(p, bucket, rng) for p in params])
  xs = flat.reshape(ROWS, nb * bucket)[:, :n]
  assert np.all(np.isfinite(xs)) and np.all((xs == 0) | (np.abs(xs) >= TINY))
  return xs


# ---- reading payloads ---------------------------------------------------------------------------

def header_of(payload, n, bits, bucket, scheme):
  """(min per bucket or None, step s * 2**k per bucket in float64, k per bucket)."""
  nb = math.ceil(n / bucket)
  words = payload[: 4 * (2 if scheme == "maxmin" else 1) * nb].view(U32).reshape(nb, -1)
  word = words[:, -1]
  low = (word & U32(0xFF)).astype(np.int64)
  k = np.where(low >= 128, low - 256, low)
  s = (word & U32(0xFFFFFF00)).view(np.float32).astype(np.float64)
  mins = words[:, 0].view(np.float32) if scheme == "maxmin" else None
  return mins, s * np.exp2(k.astype(np.float64)), k


def per_bucket(v, bucket, n):
  return np.repeat(v, bucket)[:n]


def padded_buckets(x, bucket, scheme):
  """float64 [nb, bucket] with the format's padding (first value of the last bucket, or 0)."""
  n = x.size
  nb = math.ceil(n / bucket)
  fill = x[(nb - 1) * bucket] if scheme == "maxmin" else 0.0
  return np.concatenate([x, np.full(nb * bucket - n, fill)]).astype(np.float64).reshape(nb, bucket)


# ---- properties --------------------------------------------------------------------------------

def check_row(config, x, pf, pj, df, dj):
  bits, bucket, scheme, rounding = config
  n = x.size
  np.testing.assert_array_equal(pf, pj, err_msg="payload bytes: C++ vs pure JAX")
  np.testing.assert_array_equal(df.view(U32), dj.view(U32), err_msg="decoded bits: C++ vs pure JAX")
  assert np.all(np.isfinite(df)), np.flatnonzero(~np.isfinite(df))[:8]

  L = levels(bits, scheme)
  _, stored, _ = header_of(pf, n, bits, bucket, scheme)
  xb = padded_buckets(x, bucket, scheme)
  if scheme == "maxmin":
    ideal = (xb.max(axis=1) - xb.min(axis=1)) / L
  else:  # capped where the norm exceeds the float32 max: L steps must stay finite
    ideal = np.minimum(np.sqrt(np.sum(xb**2, axis=1)), F32_MAX) / L  # float64: no overflow
  assert np.all(stored <= ideal * (1 + 2.0**-14)), (stored / ideal)

  x64 = x.astype(np.float64)
  step = per_bucket(stored, bucket, n)
  max_abs = per_bucket(np.abs(xb).max(axis=1), bucket, n)
  bound = step * (1.0 if rounding == "stochastic" else 0.5) + 2.0**-20 * max_abs + TINY
  err = np.abs(df.astype(np.float64) - x64)
  bad = err > bound
  assert not np.any(bad), (np.flatnonzero(bad)[:5], x[bad][:5], df[bad][:5], step[bad][:5])


CONFIG_IDS = ["b{}-B{}-{}-{}".format(*c) for c in CONFIGS]


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@settings(SETTINGS, max_examples=10)
@given(data=st.data())
def test_finite_within_bound_and_identical_across_implementations(config, data):
  xs = data.draw(rows_of(config[1]), label="xs")
  seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
  pf, pj, df, dj = run(config, xs, seed)
  for r in range(ROWS):
    check_row(config, xs[r], pf[r], pj[r], df[r], dj[r])


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@settings(SETTINGS, max_examples=5)
@given(data=st.data())
def test_power_of_two_scaling_changes_only_k(config, data):
  """encode(x * 2**j) has the codes of encode(x) under the same key; its header has min * 2**j
  and the step word's k + j (same s); decoded values scale by 2**j (exactly, where neither is
  flushed to 0). Inputs stay in [2**-120, 2**121): no input is flushed, no k clamped."""
  bits, bucket, scheme, _ = config
  xs = data.draw(rows_of(bucket, max_top=90, min_exp=-90), label="xs")
  seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
  j = data.draw(st.integers(-30, 30), label="j")
  n = xs.shape[1]
  half = ROWS // 2
  scaled = np.ldexp(xs[:half], j).astype(np.float32)
  assert np.array_equal(np.ldexp(scaled, -j).astype(np.float32), xs[:half])
  pf, pj, df, _ = run(config, np.concatenate([xs[:half], scaled]), seed, pairs=True)
  np.testing.assert_array_equal(pf, pj)
  nb = math.ceil(n / bucket)
  hdr = 4 * (2 if scheme == "maxmin" else 1) * nb
  for r in range(half):
    a, b = pf[r], pf[r + half]  # x and x * 2**j under the same key
    np.testing.assert_array_equal(a[hdr:], b[hdr:], err_msg="codes")
    mins_a, _, k_a = header_of(a, n, bits, bucket, scheme)
    mins_b, _, k_b = header_of(b, n, bits, bucket, scheme)
    wa = a[:hdr].view(U32).reshape(nb, -1)[:, -1]
    wb = b[:hdr].view(U32).reshape(nb, -1)[:, -1]
    np.testing.assert_array_equal(wa & U32(0xFFFFFF00), wb & U32(0xFFFFFF00), err_msg="s")
    nonzero = np.abs(padded_buckets(xs[r], bucket, scheme)).max(axis=1) > 0
    np.testing.assert_array_equal(k_b[nonzero], k_a[nonzero] + j, err_msg="k")
    if scheme == "maxmin":
      np.testing.assert_array_equal(mins_b, np.ldexp(mins_a, j).astype(np.float32))
    da, db = df[r].astype(np.float64), df[r + half].astype(np.float64)
    both = (da != 0) & (db != 0)
    np.testing.assert_array_equal(db[both], da[both] * 2.0**j)
    assert np.all(np.abs(np.where(both, 0, da + db)) < TINY * 2.0 ** abs(j))
