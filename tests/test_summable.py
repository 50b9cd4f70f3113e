"""The summable codec (qcomm.Summable): one psum of uint32 words instead of the SRA.

* the C++ kernel (each ISA) and the pure-JAX reference give identical words and decoded bits, for
  several bits, bucket sizes, device counts and keys, over the whole float32 range (fixed extreme
  data and hypothesis), zero buckets, NaN / Inf buckets;
* the stated bound (Summable's docstring, docs/wire-format.md): per element and device
  |decoded - x| <= step (stochastic) or step / 2 (nearest), step <= max|x| / L * (1 + 2**-15),
  up to 2**-22 of the shared max; unbiased (a mean over many keys);
* qcomm.allreduce over 2 / 4 / 8 host devices equals the host model (encode per device with its
  key, add the words, decode once), bit for bit, and is identical on every device; op sum / mean;
  Hierarchical and reduce_scatter;
* sync(..., summable=True) trains, with and without error feedback;
* the cost model and describe count the summable bytes; bad arguments raise ValueError.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.native import _ffi, wire
from jax_qcomm.tools import efficiency

AX = "d"
F32_MAX = float(np.finfo(np.float32).max)
TINY = 2.0**-126
needs_kernels = pytest.mark.skipif(not _ffi.has_cpu_kernels(), reason="no CPU kernels built")


def levels(bits: int) -> int:
  return (1 << (bits - 1)) - 1


def extreme_input(bucket: int, seed: int = 0) -> np.ndarray:
  """Buckets across the float32 range: tiny, subnormal, huge (3e38), zeros, mixed, constant."""
  r = np.random.default_rng(seed)
  b = []
  for e in (-126, -100, -20, 0, 20, 100, 126, 127):
    b.append(r.standard_normal(bucket) * 2.0**e)
  b.append(np.full(bucket, F32_MAX) * np.sign(r.standard_normal(bucket)))  # +-3.4e38
  b.append(np.zeros(bucket))  # all zero
  b.append(r.standard_normal(bucket) * 1e-40)  # subnormals: read as 0
  b.append(np.where(r.random(bucket) < 0.5, 3e38, 1e-30) * np.sign(r.standard_normal(bucket)))
  b.append(np.full(bucket, -0.75))  # constant
  b.append(r.standard_normal(bucket) * np.exp(r.uniform(-40, 40, bucket)))
  x = np.concatenate(b)
  with np.errstate(over="ignore"):
    x = np.clip(x, -F32_MAX, F32_MAX).astype(np.float32)
  return np.concatenate([x, r.standard_normal(bucket // 2 + 3).astype(np.float32)])  # a part bucket


def _codec(bits, bucket, rounding, impl):
  return qcomm.Summable(bits=bits, bucket_size=bucket, rounding=rounding, impl=impl)


@functools.cache
def _encode_fn(bits, bucket, rounding, impl, devices):
  c = _codec(bits, bucket, rounding, impl)
  return jax.jit(lambda x, shared, key: c.wire_encode_summable(x, shared, key, devices))


@functools.cache
def _decode_fn(bits, bucket, impl, devices, count, n, scale):
  c = _codec(bits, bucket, "stochastic", impl)
  return jax.jit(lambda w, shared: c.decode_summed_words(w, shared, devices, count, n, scale))


def host_model(xs: np.ndarray, bits, bucket, rounding, impl, keys, scale=1.0, narrow=False):
  """Per-device inputs xs[D, n] -> (words[D, W], summed words, shared, decoded sum): what the
  summable allreduce computes, with the codec's own functions and numpy's uint32 sum. narrow: the
  shared maxima rounded up to bfloat16 bits, as a reduction shares them."""
  d, n = xs.shape
  c = _codec(bits, bucket, rounding, impl)
  shared = np.max(np.stack([np.asarray(jax.jit(c.bucket_scale)(x)) for x in xs]), axis=0)
  if narrow:
    up = (shared.view(np.uint32) >> 16) + ((shared.view(np.uint32) & 0xFFFF) != 0)
    shared = (up.astype(np.uint32) << 16).view(np.int32)  # finite, far below the float32 max
  enc = _encode_fn(bits, bucket, rounding, impl, d)
  words = np.stack([np.asarray(enc(x, shared, k)) for x, k in zip(xs, keys)])
  total = words.sum(axis=0, dtype=np.uint32)
  out = np.asarray(_decode_fn(bits, bucket, impl, d, d, n, scale)(total, shared))
  return words, total, shared, out


CONFIGS = [(2, 8, "stochastic", 2), (2, 128, "nearest", 8), (3, 24, "stochastic", 3),
           (4, 128, "stochastic", 2), (4, 128, "nearest", 4), (5, 40, "stochastic", 1),
           (8, 128, "stochastic", 8), (8, 8, "nearest", 2)]


@needs_kernels
@pytest.mark.parametrize("bits, bucket, rounding, d", CONFIGS)
def test_kernel_equals_reference(bits, bucket, rounding, d):
  """The C++ kernel's words and decodes (count 1 and D, scale 1 and 1/D) equal the reference's."""
  x0 = extreme_input(bucket, seed=bits)
  with np.errstate(over="ignore"):
    xs = np.stack([np.roll(x0, 7 * i) * np.float32(1 + i) for i in range(d)])
  xs = np.clip(xs, -F32_MAX, F32_MAX).astype(np.float32)
  keys = [jax.random.key(100 * bits + i) for i in range(d)]
  got = host_model(xs, bits, bucket, rounding, "ffi", keys, 1.0 / d)
  want = host_model(xs, bits, bucket, rounding, "jax", keys, 1.0 / d)
  for g, w, what in zip(got, want, ("words", "summed words", "shared", "decoded")):
    np.testing.assert_array_equal(g, w, err_msg=what)
  n = xs.shape[1]
  own = [np.asarray(_decode_fn(bits, bucket, impl, d, 1, n, 1.0)(got[0][0], got[2]))
         for impl in ("ffi", "jax")]  # one device's own decode (the residual's)
  np.testing.assert_array_equal(own[0], own[1], err_msg="own decode")
  assert np.all(np.isfinite(got[3])), "finite inputs decode finite"


def test_words_layout_and_sizes():
  """Element e is field e // nw of word e % nw; sizes and wire bits as documented."""
  c = qcomm.Summable(bits=4, bucket_size=8, rounding="nearest", impl="jax")
  n = 20
  x = jnp.asarray(np.linspace(-1, 1, n), jnp.float32)
  shared = c.bucket_scale(x)
  words = np.asarray(c.wire_encode_summable(x, shared, None, 2))
  w, f = 5, 6  # 2 L D = 28: 5 bits, 6 fields
  assert wire.summable_field_bits(4, 2) == w and wire.summable_fields(4, 2) == f
  nw = -(-n // f)
  assert words.shape == (nw,)
  fields = (words[None, :] >> (np.arange(f, dtype=np.uint32)[:, None] * w)) & ((1 << w) - 1)
  codes = fields.reshape(-1)
  assert np.all(codes[n:] == levels(4))  # padding: the code of 0
  assert codes[0] == 0 and codes[n - 1] == 2 * levels(4)  # -1 and +1: the bottom and top level
  # D = 2: a ring all-reduce sends its buffer once: the words and a 2-byte statistic per bucket
  assert c.sent_bytes(n, 2) == 4 * nw + 2 * 3
  assert c.traffic(n, 2) == (("all-reduce", 4 * nw), ("all-reduce", 2 * 3))
  assert abs(qcomm.Summable(4, 128).wire_bits(2) - (32 / 6 + 16 / 128)) < 1e-12


def test_wire_bits_table():
  """The documented table (docs/wire-format.md, "Summable"): bits per element vs D."""
  want = {(2, 2): 32 / 10, (2, 4): 32 / 8, (2, 8): 32 / 6, (3, 2): 32 / 8, (3, 4): 32 / 6,
          (3, 8): 32 / 5, (4, 2): 32 / 6, (4, 4): 32 / 5, (4, 8): 32 / 4, (8, 2): 32 / 3,
          (8, 4): 32 / 3, (8, 8): 32 / 2}
  for (bits, d), v in want.items():
    assert qcomm.Summable(bits, 128).wire_bits(d) == pytest.approx(v + 0.125), (bits, d)


# ---- numerics over the whole float32 range (hypothesis) ----------------------------------------

HSET = settings(deadline=None, derandomize=True, database=None, max_examples=25,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HB = 16  # bucket
HD = 3   # devices


@st.composite
def buckets(draw):
  """float32[HD, 4 * HB]: per bucket a top binade in -126..127, log-uniform magnitudes below it
  over a drawn width, signs, zeros; one device may hold much smaller values than another."""
  seed = draw(st.integers(0, 2**31 - 1))
  r = np.random.default_rng(seed)
  out = np.zeros((HD, 4 * HB))
  for b in range(4):
    top = draw(st.integers(-126, 127))
    width = draw(st.sampled_from([0, 1, 10, 60, 250]))
    kind = draw(st.sampled_from(["spread", "zeros", "constant", "extreme"]))
    for d in range(HD):
      lo = max(top - width, -149)
      e = r.uniform(lo, top + 1, HB)
      v = np.sign(r.standard_normal(HB)) * 2.0**e
      if kind == "zeros":
        v = np.where(r.random(HB) < 0.7, 0.0, v)
      elif kind == "constant":
        v = np.full(HB, v[0])
      elif kind == "extreme":
        v = np.where(r.random(HB) < 0.5, F32_MAX, TINY) * np.sign(r.standard_normal(HB))
      out[d, b * HB:(b + 1) * HB] = v
  with np.errstate(over="ignore"):
    return np.clip(out, -F32_MAX, F32_MAX).astype(np.float32)


def _steps(xs: np.ndarray, bits: int, bucket: int) -> np.ndarray:
  """The stated upper bound of each bucket's step: shared max / L * (1 + 2**-15), per element."""
  m = np.abs(xs.astype(np.float64)).max(axis=0)
  m = np.where(m < TINY, 0.0, m)  # flushed subnormals
  nb = -(-xs.shape[1] // bucket)
  mb = np.pad(m, (0, nb * bucket - m.size)).reshape(nb, bucket).max(axis=1)
  return np.repeat(mb / levels(bits) * (1 + 2.0**-15), bucket)[: xs.shape[1]], np.repeat(mb, bucket)[: xs.shape[1]]


@pytest.mark.parametrize("bits, rounding", [(2, "stochastic"), (4, "nearest"), (8, "stochastic")])
@HSET
@given(xs=buckets(), seed=st.integers(0, 2**31 - 1))
def test_bound_and_identical_over_the_float32_range(bits, rounding, xs, seed):
  keys = [jax.random.key(seed + i) for i in range(HD)]
  impls = ("ffi", "jax") if _ffi.has_cpu_kernels() else ("jax",)
  res = {impl: host_model(xs, bits, HB, rounding, impl, keys, 1.0) for impl in impls}
  if len(impls) == 2:
    for g, w in zip(res["ffi"], res["jax"]):
      np.testing.assert_array_equal(g, w)
  words, total, shared, out = res[impls[0]]
  assert np.all(np.isfinite(out)), "finite inputs decode finite (sums saturate at the float32 max)"
  step, mx = _steps(xs, bits, HB)
  xflush = np.where(np.abs(xs) < TINY, 0.0, xs.astype(np.float64))
  per = step if rounding == "stochastic" else step / 2
  slack = 2.0**-22 * mx + TINY
  dec = _decode_fn(bits, HB, impls[0], HD, 1, xs.shape[1], 1.0)
  for d in range(HD):  # each device's own decode is within the bound of its input
    own = np.asarray(dec(words[d], shared)).astype(np.float64)
    err = np.abs(own - xflush[d])
    assert np.all(err <= per + slack), (d, np.max(err / (per + slack)))
  exact = xflush.sum(axis=0)
  fin = np.abs(exact) < F32_MAX / 2  # the sum itself is a float32
  err = np.abs(out.astype(np.float64) - exact)
  assert np.all((err <= HD * (per + slack) + 2.0**-22 * np.abs(exact))[fin])
  zero = mx == 0
  assert np.all(out[zero] == 0), "an all-zero (or subnormal) bucket decodes to exact zeros"


@pytest.mark.parametrize("impl", ["ffi", "jax"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_bucket_decodes_to_nan(impl, bad):
  if impl == "ffi" and not _ffi.has_cpu_kernels():
    pytest.skip("no CPU kernels built")
  r = np.random.default_rng(3)
  xs = r.standard_normal((2, 64)).astype(np.float32)
  xs[1, 40] = bad  # bucket 1 (of 32) on device 1 only
  keys = [jax.random.key(i) for i in range(2)]
  _, _, _, out = host_model(xs, 4, 32, "stochastic", impl, keys, 0.5)
  assert np.all(np.isnan(out[32:])), "the bucket holding a non-finite value is NaN throughout"
  assert np.all(np.isfinite(out[:32]))


def test_unbiased():
  """Stochastic rounding: the mean decode over 2000 keys is within 5 standard errors of x."""
  c = qcomm.Summable(bits=2, bucket_size=32)
  x = jnp.asarray(np.random.default_rng(0).standard_normal(64), jnp.float32)
  keys = jax.random.split(jax.random.key(0), 2000)
  dec = jax.jit(jax.vmap(lambda k: c.roundtrip(x, k)))(keys)
  mean = np.asarray(dec).mean(axis=0)
  step = np.repeat(np.abs(np.asarray(x)).reshape(2, 32).max(axis=1), 32)  # L = 1
  se = step / 2 / np.sqrt(2000)
  assert np.all(np.abs(mean - np.asarray(x)) <= 5 * se + 1e-7)


def test_array_api_roundtrip():
  c = qcomm.Summable(bits=8, bucket_size=16)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 7)), jnp.float32)
  p = c.encode(x, jax.random.key(0))
  assert p.dtype == jnp.uint8 and p.shape == (c.payload_size(35),)
  y = c.decode(p, x.shape)
  assert np.max(np.abs(np.asarray(y) - np.asarray(x))) <= np.max(np.abs(np.asarray(x))) / 127 * 1.01
  s = c.decode_sum(jnp.stack([p, p]), x.shape)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(y) + np.asarray(y))


# ---- the allreduce ------------------------------------------------------------------------------

@functools.cache
def _mesh(d: int) -> Mesh:
  return Mesh(np.array(jax.devices("cpu")[:d]), (AX,))


@functools.cache
def _allreduce(codec, d, op):
  def body(x, key):
    return qcomm.allreduce(x[0], AX, codec=codec, key=key, op=op)[None]
  return jax.jit(jax.shard_map(body, mesh=_mesh(d), in_specs=(P(AX), P()), out_specs=P(AX)))


@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_allreduce_equals_host_model(d, op):
  codec = qcomm.Summable(bits=4, bucket_size=128)
  n = 1000  # not a multiple of the bucket nor of the fields per word
  r = np.random.default_rng(d)
  xs = (r.standard_normal((d, n)) * np.exp(r.uniform(-3, 3, (d, 1)))).astype(np.float32)
  key = jax.random.key(42)
  out = np.asarray(_allreduce(codec, d, op)(jnp.asarray(xs), key))
  for i in range(1, d):
    np.testing.assert_array_equal(out[i], out[0], err_msg="identical on every device")
  # the keys the allreduce uses: group 0, device i, salt 0 (collectives._device_key)
  keys = [jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, 0), i), 0) for i in range(d)]
  *_, want = host_model(xs, 4, 128, "stochastic", "auto", keys, 1.0 / d if op == "mean" else 1.0,
                        narrow=True)
  np.testing.assert_array_equal(out[0], want)
  exact = xs.astype(np.float64).sum(0) / (d if op == "mean" else 1)
  step, _ = _steps(xs, 4, 128)
  step = step * (1 + 2.0**-7)  # the shared maximum rounded up to a bfloat16
  bound = step * (d if op == "sum" else 1) + 1e-6
  assert np.all(np.abs(out[0] - exact) <= bound)


@needs_kernels
@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("cbs", [None, 1024], ids=["one-buffer", "a-buffer-per-leaf"])
def test_leaves_reduced_in_place_equal_the_packed_reference(d, rounding, cbs):
  """On CPU the kernels read and write a pytree's leaves in place of their packed buffer: results
  and residuals bit for bit those of the pure-JAX reference on the packed buffer, the same on
  every device, with no packed copy in the compiled program; in one communication buffer
  (Summable's own bound) and in one per leaf."""
  shapes = {"a": (7, 300), "b": (5000,), "c": (33, 129), "d": (128,), "e": (1,), "f": (0, 4),
            "g": (2, 3, 200)}
  r = np.random.default_rng(d)
  tree = {k: (r.standard_normal((d,) + s) * np.exp(r.uniform(-3, 3))).astype(np.float32)
          for k, s in shapes.items()}
  tree["b"][1, 17] = np.nan  # a NaN on one device: its bucket is NaN everywhere
  policy = qcomm.LeafPolicy(min_size=0, compress_1d=True)  # every leaf compressed
  got = {}
  for impl in ("ffi", "jax"):
    codec = qcomm.Summable(4, 128, rounding, impl)

    def body(t, codec=codec):
      out, res = qcomm.allreduce(jax.tree_util.tree_map(lambda a: a[0], t), AX, codec=codec,
                                 key=jax.random.key(9), policy=policy, return_residual=True,
                                 comm_bucket_size=cbs)
      return jax.tree_util.tree_map(lambda a: a[None], (out, res))

    f = jax.jit(jax.shard_map(body, mesh=_mesh(d), in_specs=P(AX), out_specs=P(AX)))
    got[impl] = jax.tree_util.tree_map(np.asarray, f(tree))
    hlo = f.lower(tree).compile().as_text()
    if impl == "ffi":
      assert "qcomm_summable_encode_leaves" in hlo and "qcomm_summable_decode_leaves" in hlo
      assert "concatenate" not in hlo  # no packed copy
  for a, b in zip(jax.tree_util.tree_leaves(got["ffi"]), jax.tree_util.tree_leaves(got["jax"])):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
  out, res = got["ffi"]
  for leaf in jax.tree_util.tree_leaves(out):
    for j in range(1, d):
      np.testing.assert_array_equal(leaf[j].view(np.uint32), leaf[0].view(np.uint32))
  assert np.all(np.isnan(out["b"][:, 0:128])) and np.all(np.isfinite(out["b"][:, 128:]))
  assert out["f"].shape == (d, 0, 4)
  # the residual is what each device's own quantisation lost: the devices' decoded contributions
  # (input minus residual) average to the result, and each is within a step of its input
  np.testing.assert_allclose((tree["a"] - res["a"]).mean(0), out["a"][0], rtol=1e-5, atol=1e-6)
  assert np.all(np.abs(res["a"]) <= np.abs(tree["a"]).max() / 7 * 1.01)


def test_shared_statistic_is_the_bfloat16_ceiling_and_stays_finite():
  narrow = qcomm.Summable._narrow
  bits = np.array([0x3F800000, 0x3F800001, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F0000, 0x7F800000,
                   0x7FC00000, 0x00000001, 0], np.uint32).view(np.int32)
  got = np.asarray(narrow(jnp.asarray(bits)))
  # 1.0 exact; just above 1.0 -> the next bfloat16; the largest finite float32 -> the largest
  # finite bfloat16 (rounded down, not up to Inf); Inf and NaN keep their class; subnormal -> tiny
  np.testing.assert_array_equal(got, [0x3F80, 0x3F81, 0x3F81, 0x7F7F, 0x7F7F, 0x7F80, 0x7FC0, 1, 0])
  assert np.all(np.asarray(qcomm.Summable._widen(jnp.asarray(got))).view(np.uint32)
                == got.astype(np.uint32) << 16)
  # in an allreduce, a bucket at the float32 maximum decodes finite and close; Inf decodes NaN
  codec = qcomm.Summable(bits=4, bucket_size=128)
  xs = np.random.default_rng(5).standard_normal((2, 384)).astype(np.float32)
  xs[0, 10] = np.finfo(np.float32).max
  xs[1, 300] = np.inf
  out = np.asarray(_allreduce(codec, 2, "mean")(jnp.asarray(xs), jax.random.key(1)))
  assert np.all(np.isfinite(out[:, :256])) and np.all(np.isnan(out[:, 256:]))
  assert abs(out[0, 10] / (np.finfo(np.float32).max / 2) - 1) < 2.0**-6


def test_allreduce_nan_on_one_device_is_nan_everywhere():
  codec = qcomm.Summable(bits=4, bucket_size=128)
  xs = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
  xs[2, 300] = np.nan
  out = np.asarray(_allreduce(codec, 4, "mean")(jnp.asarray(xs), jax.random.key(0)))
  assert np.all(np.isnan(out[:, 256:384])) and np.all(np.isfinite(out[:, :256]))
  assert np.all(np.isfinite(out[:, 384:]))


def test_hierarchical_and_reduce_scatter():
  codec = qcomm.Summable(bits=8, bucket_size=32)
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("o", "i"))
  xs = np.random.default_rng(5).standard_normal((8, 300)).astype(np.float32)
  exact = xs.astype(np.float64).mean(0)

  def hier(x, key):
    return qcomm.allreduce(x[0], qcomm.Hierarchical(inner="i", outer="o"), codec=codec, key=key)[None]
  f = jax.jit(jax.shard_map(hier, mesh=mesh, in_specs=(P(("o", "i")), P()), out_specs=P(("o", "i"))))
  out = np.asarray(f(jnp.asarray(xs), jax.random.key(1)))
  for i in range(8):
    np.testing.assert_array_equal(out[i], out[0])
  # the shard sums over 4 devices are quantised: step <= 4 max|x| / 127 per summed shard, / 8
  assert np.max(np.abs(out[0] - exact)) <= 2 * 4 * np.abs(xs).max() / 127 / 8 * 2

  def rs(x, key):
    return qcomm.reduce_scatter(x[0], AX, codec=codec, key=key)[None]
  g = jax.jit(jax.shard_map(rs, mesh=_mesh(4), in_specs=(P(AX), P()), out_specs=P(AX)))
  xr = xs[:4, :296]
  got = np.asarray(g(jnp.asarray(xr), jax.random.key(2)))  # [4, 74]
  want = xr.astype(np.float64).mean(0).reshape(4, 74)
  assert np.max(np.abs(got - want)) <= np.abs(xr).max() / 127 * 1.01


def test_too_many_devices_raise():
  with pytest.raises(ValueError, match="devices must be an integer in 1.."):
    qcomm.Summable(bits=8).check_devices(wire.summable_max_devices(8) + 1)
  assert qcomm.Summable(bits=8).check_devices(wire.summable_max_devices(8)) > 0
  assert wire.summable_field_bits(8, wire.summable_max_devices(8)) == 32


# ---- sync ----------------------------------------------------------------------------------------

def _train(summable: bool, ef: bool, bits: int = 4, steps: int = 60) -> tuple[float, float]:
  d = 8  # tx.init outside shard_map sizes the per-device state with jax.device_count()
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (d * 32, 64))
  y = x @ (jax.random.normal(kw, (64, 32)) / 8.0) + 1.0
  codec = qcomm.Summable(bits, rounding="nearest" if ef else "stochastic") if summable else None
  tx = qcomm.sync(optax.sgd(0.3), axis_name=AX, codec=codec, bits=None if summable else bits,
                  error_feedback=ef, min_size=1)
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}

  def mse(p, xb, yb):
    return jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)

  def run(p, s, xb, yb):
    l0 = lax.pmean(mse(p, xb, yb), AX)

    def vary(tree):
      return jax.tree_util.tree_map(lambda a: qcomm._compat.make_varying(a, frozenset({AX})), tree)

    def body(_, carry):
      p, s = carry
      g = jax.grad(mse)(p, xb, yb)  # p varying: this device's gradient
      u, s = tx.update(g, s, p)
      return vary((optax.apply_updates(p, u), s))

    p, _ = lax.fori_loop(0, steps, body, vary((p, s)))
    return l0, lax.pmean(mse(p, xb, yb), AX)

  state = tx.init(params)
  f = jax.jit(jax.shard_map(run, mesh=_mesh(d), out_specs=(P(), P()),
                            in_specs=(P(), qcomm.state_partition_spec(state, AX), P(AX), P(AX))))
  l0, l1 = f(params, state, x, y)
  return float(l0), float(l1)


@pytest.mark.parametrize("ef", [False, True])
def test_sync_summable_trains(ef):
  l0, l1 = _train(summable=True, ef=ef, bits=4)
  _, exact = _train(summable=False, ef=False, bits=32)
  assert np.isfinite(l1) and l1 < 0.2 * l0, (l0, l1)  # exact: ~2.07 -> ~0.2 in 60 steps
  assert l1 <= exact * 1.05 + 1e-3, (l1, exact)


def test_sync_takes_summable_as_its_codec():
  tx = qcomm.sync(optax.sgd(0.1), codec=qcomm.Summable(3, rounding="nearest"), error_feedback=True)
  from jax_qcomm.transforms.sync import config_of
  assert config_of(tx).codec == qcomm.Summable(3, 128, rounding="nearest")
  assert config_of(tx).error_feedback
  with pytest.raises(ValueError, match=r"summable= was replaced: pass codec=qcomm.Summable"):
    qcomm.sync(optax.sgd(0.1), bits=4, summable=True)


def test_cost_model_and_describe():
  c = qcomm.Summable(4, 128)
  n = 128 * 600
  words = -(-n // 6)  # D = 2: 6 fields per word
  assert c.sent_bytes(n, 2) == 4 * words + 2 * 600
  assert efficiency.allreduce_bytes(n, 2, c) == pytest.approx(4 * words + 2 * 600)
  assert efficiency.allreduce_bytes(n, 8, c) == pytest.approx(2 * 7 / 8 * (n + 2 * 600))
  tx = qcomm.sync(optax.sgd(0.1), axis_name=AX, codec=c)
  desc = qcomm.describe(tx, {"w": jnp.zeros((300, 256))}, devices=4)
  leaf = desc.leaves[0]
  assert leaf.payload_bytes == c.payload_size(300 * 256)  # the standalone payload (D = 1)
  assert leaf.sent_bytes == c.sent_bytes(300 * 256, 4) == 1.5 * (4 * 300 * 256 // 5 + 2 * 600)


# ---- ISA override and bad arguments --------------------------------------------------------------

_ISA_SCRIPT = r"""
import sys
import numpy as np
import jax, jax.numpy as jnp
import jax_qcomm as qcomm
from jax_qcomm import _ffi
x = jnp.asarray(np.load(sys.argv[1]))
out = {"isa": np.array(_ffi.cpu_isa())}
for i, (bits, bucket, rounding, d) in enumerate(eval(sys.argv[2])):
  c = qcomm.Summable(bits, bucket, rounding, impl="ffi")
  shared = c.bucket_scale(x)
  w = c.wire_encode_summable(x, shared, jax.random.key(i), d)
  out[f"w{i}"] = np.asarray(w)
  out[f"d{i}"] = np.asarray(c.decode_summed_words(w * jnp.uint32(d), shared, d, d, x.shape[0], 0.5))
np.savez(sys.argv[3], **out)
"""


@needs_kernels
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_forced_isa_gives_the_same_words(isa, tmp_path):
  order = ("generic", "avx2", "avx512")
  if order.index(isa) > order.index(_ffi.cpu_isa_detected()):
    pytest.skip(f"this CPU lacks {isa}")
  x = extreme_input(128, seed=9)
  np.save(tmp_path / "x.npy", x)
  env = dict(os.environ, JAX_PLATFORMS="cpu", QCOMM_CPU_ISA=isa)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(tmp_path / "x.npy"),
                         repr(CONFIGS), str(tmp_path / "out.npz")],
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = np.load(tmp_path / "out.npz")
  assert str(got["isa"]) == isa
  for i, (bits, bucket, rounding, d) in enumerate(CONFIGS):
    c = qcomm.Summable(bits, bucket, rounding, impl="jax")
    shared = c.bucket_scale(jnp.asarray(x))
    w = c.wire_encode_summable(jnp.asarray(x), shared, jax.random.key(i), d)
    np.testing.assert_array_equal(got[f"w{i}"], np.asarray(w), err_msg=f"{isa} words {i}")
    dec = c.decode_summed_words(w * jnp.uint32(d), shared, d, d, x.shape[0], 0.5)
    np.testing.assert_array_equal(got[f"d{i}"], np.asarray(dec), err_msg=f"{isa} decode {i}")


@pytest.mark.parametrize("kwargs, match", [
    (dict(bits=1), "bits must be an integer in 2..8"),
    (dict(bits=9), "bits must be an integer in 2..8"),
    (dict(bits=4.0), "bits must be an integer in 2..8"),
    (dict(bits=True), "bits must be an integer in 2..8"),
    (dict(bucket_size=0), "bucket_size must be a positive multiple of 8"),
    (dict(bucket_size=12), "bucket_size must be a positive multiple of 8"),
    (dict(rounding="up"), "rounding must be one of"),
    (dict(impl="cuda"), "impl must be one of"),
])
def test_bad_codec_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    qcomm.Summable(**kwargs)


def test_bad_summable_arguments_elsewhere():
  c = qcomm.Summable()
  with pytest.raises(ValueError, match="count must be an integer in 1..devices"):
    c.decode_summed_words(jnp.zeros((22,), jnp.uint32), jnp.zeros((1,), jnp.int32), 2, 3, 128)
  with pytest.raises(ValueError, match="key is required"):
    c.encode(jnp.ones(8))
  with pytest.raises(ValueError, match="devices must be an integer in 1..306783378"):
    c.sent_bytes(128, 306783379)
  assert not hasattr(qcomm.QSGD(), "bucket_scale")  # Summable's own wire API, not the base's


def test_all_gather_uses_the_standalone_payload():
  """all_gather has nothing to sum: it gathers each device's standalone payload (devices=1)."""
  codec = qcomm.Summable(bits=8, bucket_size=16)
  xs = np.random.default_rng(8).standard_normal((2, 48)).astype(np.float32)

  def body(x, key):
    return qcomm.all_gather(x[0], AX, codec=codec, key=key)[None]
  f = jax.jit(jax.shard_map(body, mesh=_mesh(2), in_specs=(P(AX), P()), out_specs=P(AX)))
  out = np.asarray(f(jnp.asarray(xs), jax.random.key(3)))  # [2 devices, 2 rows, 48]
  np.testing.assert_array_equal(out[0], out[1])
  assert np.max(np.abs(out[0] - xs)) <= np.abs(xs).max() / 127 * 1.01


@pytest.mark.multiprocess
def test_summable_allreduce_across_processes():
  """2 processes x 2 host devices over gloo: the pmax of int32 and psum of uint32 cross processes,
  and every device's result equals the host model bit for bit (tests/summable_mp_worker.py)."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "summable_mp_worker.py")
  proc = subprocess.run([sys.executable, "-m", "jax_qcomm.tools.launch", "-n", "2", "--local-devices",
                         "2", "--timeout", "150", worker], env=env, capture_output=True, text=True,
                        timeout=180, cwd=os.path.dirname(os.path.dirname(worker)))
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  assert proc.stdout.count(": OK") == 2, proc.stdout[-4000:]


def test_benchmark_codec_table():
  """python -m benchmarks allreduce --codecs sum8 sum4 sum3 sum2: the codecs and their bytes."""
  from benchmarks import allreduce as ar
  for bits in (8, 4, 3, 2):
    c = ar.make_codec(f"sum{bits}", 64)
    assert c == qcomm.Summable(bits, 64)
    payload, sent = ar.wire_bytes(f"sum{bits}", c, 1000, 4)
    assert sent == round(c.sent_bytes(1000, 4)) and payload == round(c.sent_bytes(1000, 4) * 4 / 6)
