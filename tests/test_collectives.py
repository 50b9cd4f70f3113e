"""Tests of the compressed collectives (jax_qcomm.collectives) on 8 host CPU devices.

The devices come from tests/conftest.py. Every accuracy assertion is derived from the quantisation
step of the data (computed here in numpy, float64), never from a hand-picked constant:

* QSGD maxmin, b bits, bucket B: step = (max - min) / (2**b - 1) over the bucket;
  QSGD norm: step = ||bucket||_2 / (2**(b-1) - 1). Stochastic rounding errs by < 1 step, nearest
  rounding by <= 1/2 step.
* The scatter-reduce-allgather allreduce quantises every value twice: first each device's chunk
  (error of the mean <= max over devices of the bucket step, s1), then the reduced chunk, whose step
  s2 is bounded from the exact mean's bucket and the first-stage error
  (maxmin: (range(mean) + 2 s1) / levels; norm: (||mean|| + sqrt(B) s1) / levels).
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm

D = 8
N = 3000  # per-device elements: not a multiple of the bucket (128) nor of D * bucket
BF16_U = 2.0**-8   # unit roundoff of bfloat16 (8 significant bits)
F16_U = 2.0**-11   # unit roundoff of float16 (11 significant bits)


# ---- meshes and jitted collectives (cached: one compilation per configuration) -----------------

@functools.cache
def mesh1() -> Mesh:
  devs = jax.devices("cpu")
  assert len(devs) >= D, f"tests/conftest.py must provide {D} host devices, got {len(devs)}"
  return Mesh(np.array(devs[:D]), ("d",))


@functools.cache
def mesh2() -> Mesh:
  return Mesh(np.array(jax.devices("cpu")[:D]).reshape(2, 4), ("o", "i"))


def _axis_setup(mode: str):
  if mode == "flat":
    return mesh1(), P("d"), "d"
  if mode == "tuple":
    return mesh2(), P(("o", "i")), ("o", "i")
  if mode == "hier":
    return mesh2(), P(("o", "i")), qcomm.Hierarchical(inner="i", outer="o")
  raise AssertionError(mode)


def _local(tree):
  return jax.tree.map(lambda v: v[0], tree)


def _stack(tree):
  return jax.tree.map(lambda v: v[None], tree)


def _smap(body, mode="flat"):
  mesh, spec, _ = _axis_setup(mode)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec))


def allreduce_fn(codec, mode="flat", op="mean", policy=None, cbs=None):
  """jit(shard_map(allreduce)): (tree of [D, ...] arrays, key[1]) -> tree of [D, ...] outputs."""
  return _allreduce_fn(codec, mode, op, policy, cbs)  # one cache entry however it is called


@functools.cache
def _allreduce_fn(codec, mode, op, policy, cbs):
  _, _, axis = _axis_setup(mode)
  kw = {} if cbs is None else {"comm_bucket_size": cbs}

  def body(tree, k):
    return _stack(qcomm.allreduce(_local(tree), axis, codec, k[0], op=op, policy=policy, **kw))
  return _smap(body, mode)


def key1(seed: int):
  return jax.random.key(seed)[None]


def run_allreduce(x, codec, seed=0, **kw):
  return jax.tree.map(np.asarray, allreduce_fn(codec, **kw)(x, key1(seed)))


@functools.cache
def pmean_fn():
  return _smap(lambda x, k: lax.pmean(x[0], "d")[None])


@functools.cache
def pmap_allreduce_fn(codec):
  return jax.pmap(lambda v, k: qcomm.allreduce(v, "d", codec, k), axis_name="d",
                  in_axes=(0, None), devices=jax.devices("cpu")[:D])


@functools.cache
def reduce_scatter_fn(codec, op="mean"):
  return _smap(lambda x, k: qcomm.reduce_scatter(x[0], "d", codec, k[0], op=op)[None])


@functools.cache
def all_gather_fn(codec, tiled):
  def body(x, k):
    if codec is None:  # the default codec
      return qcomm.all_gather(x[0], "d", tiled=tiled)[None]
    return qcomm.all_gather(x[0], "d", codec, k[0], tiled=tiled)[None]
  return _smap(body)


# ---- numpy oracles -----------------------------------------------------------------------------

def _levels(codec) -> int:
  return 2**codec.bits - 1 if codec.scheme == "maxmin" else 2**(codec.bits - 1) - 1


def _buckets(a: np.ndarray, codec) -> np.ndarray:
  """[..., n] -> [..., nb, B]; padded with the last value (maxmin) or 0 (norm): scales unchanged."""
  b = codec.bucket_size
  a = np.asarray(a, np.float64)
  pad = -a.shape[-1] % b
  if pad:
    fill = a[..., -1:] if codec.scheme == "maxmin" else np.zeros_like(a[..., -1:])
    a = np.concatenate([a, np.repeat(fill, pad, axis=-1)], axis=-1)
  return a.reshape(a.shape[:-1] + (-1, b))


def bucket_steps(a: np.ndarray, codec) -> np.ndarray:
  """Quantisation step of every bucket of the last axis: [..., n] -> [..., nb]."""
  bk = _buckets(a, codec)
  if codec.scheme == "maxmin":
    return (bk.max(-1) - bk.min(-1)) / _levels(codec)
  return np.sqrt((bk * bk).sum(-1)) / _levels(codec)


def _expand(per_bucket: np.ndarray, codec, n: int) -> np.ndarray:
  return np.repeat(per_bucket, codec.bucket_size, axis=-1)[..., :n]


def _round_factor(codec) -> float:
  return 1.0 if codec.rounding == "stochastic" else 0.5


def first_stage_step(xs: np.ndarray, codec) -> np.ndarray:
  """s1: max over devices of the bucket step of each device's input. xs: [D, n] -> [nb]."""
  return bucket_steps(xs, codec).max(0)


def second_stage_step(xs: np.ndarray, codec) -> np.ndarray:
  """Upper bound of the reduced bucket's step (reduced = mean + first-stage error). -> [nb]."""
  s1 = first_stage_step(xs, codec)
  mb = _buckets(xs.mean(0), codec)
  if codec.scheme == "maxmin":
    return (mb.max(-1) - mb.min(-1) + 2 * s1) / _levels(codec)
  return (np.sqrt((mb * mb).sum(-1)) + math.sqrt(codec.bucket_size) * s1) / _levels(codec)


def allreduce_bound(xs: np.ndarray, codec) -> np.ndarray:
  """Per-element bound of |allreduce_mean(x) - mean(x)| for QSGD: 2 quantisations. xs: [D, n]."""
  xs = np.asarray(xs, np.float64).reshape(xs.shape[0], -1)
  n = xs.shape[1]
  f = _round_factor(codec)
  s1 = first_stage_step(xs, codec)
  s2 = second_stage_step(xs, codec)
  return _expand(f * (s1 + s2), codec, n) * (1 + 1e-4) + 1e-6 * np.abs(xs).max()


def exact_mean(x) -> np.ndarray:
  return np.asarray(x, np.float64).mean(0)


def rows_identical(out: np.ndarray) -> bool:
  out = np.asarray(out)
  return all(np.array_equal(out[0], out[i], equal_nan=True) for i in range(1, out.shape[0]))


def data(seed: int, shape=(D, N), scale=1.0, dtype=np.float32) -> np.ndarray:
  return (np.random.RandomState(seed).standard_normal(shape) * scale).astype(dtype)


Q4 = qcomm.QSGD(4)


# ---- 1. unbiasedness ---------------------------------------------------------------------------

K_CALLS = 256


@functools.cache
def mean_of_calls_fn(codec, k_calls):
  """Mean over k_calls allreduces of the same x with different keys (vmapped over the keys)."""
  def body(x, key):
    keys = jax.random.split(key[0], k_calls)
    outs = jax.vmap(lambda kk: qcomm.allreduce(x[0], "d", codec, kk))(keys)
    return jnp.mean(outs, axis=0)[None]
  return _smap(body)


@pytest.mark.parametrize("scheme", ["maxmin", "norm"])
def test_stochastic_allreduce_is_unbiased(scheme):
  codec = qcomm.QSGD(4, scheme=scheme)
  x = data(1)
  xs = x.astype(np.float64)
  avg = np.asarray(mean_of_calls_fn(codec, K_CALLS)(x, key1(7)), np.float64)
  assert rows_identical(avg)
  err = avg[0] - xs.mean(0)
  # Per-element standard deviation of one call: stochastic rounding of a value at fraction f of a
  # step has variance step^2 f (1 - f) <= step^2 / 4. Stage 1 averages D independent roundings.
  var1 = (bucket_steps(xs, codec) ** 2).sum(0) / (4 * D * D)  # [nb]
  if scheme == "maxmin":
    s2 = second_stage_step(xs, codec)  # rigorous and close: the range barely grows
  else:  # ||mean + e1|| <= ||mean|| + ||e1||, with ||e1|| taken as twice its rms sqrt(B var1)
    mb = _buckets(xs.mean(0), codec)
    s2 = (np.sqrt((mb * mb).sum(-1)) + 2 * np.sqrt(codec.bucket_size * var1)) / _levels(codec)
  sigma = np.sqrt(_expand(var1 + s2**2 / 4, codec, N)) / math.sqrt(K_CALLS)
  z = err / sigma
  # Sanity: the tolerance is far below a quantisation step, so a biased rounding (nearest/floor,
  # bias up to 1/2 step) would fail.
  step = _expand(first_stage_step(xs, codec), codec, N)
  assert np.median(6 * sigma / step) < 0.25
  assert np.abs(z).max() < 6.0, (np.abs(z).max(), np.abs(err).max())
  # The element errors are independent given the scales: their mean is ~N(0, <= 1/N).
  assert abs(z.mean()) < 5.0 / math.sqrt(N), z.mean()
  # And the average really is better than a single call (the randomness varies with the key).
  single = run_allreduce(x, codec, seed=3)[0].astype(np.float64)
  assert np.sqrt(np.mean(err**2)) < 0.25 * np.sqrt(np.mean((single - xs.mean(0)) ** 2))


# ---- 2. error bounded by two quantisation steps -----------------------------------------------

@pytest.mark.parametrize("codec", [
    qcomm.QSGD(4),
    qcomm.QSGD(4, impl="jax"),
    qcomm.QSGD(4, rounding="nearest"),
    qcomm.QSGD(2, bucket_size=64),
    qcomm.QSGD(8, scheme="norm"),
], ids=str)
def test_allreduce_error_within_two_steps(codec):
  x = data(2)
  out = run_allreduce(x, codec, seed=11)
  bound = allreduce_bound(x, codec)
  err = np.abs(out.astype(np.float64) - exact_mean(x))
  assert np.all(err <= bound), (err - bound).max()
  assert err.max() > 0.05 * bound.max()  # it really is quantised (not an exact psum)


def test_allreduce_2d_array_and_offset_data():
  """A 2-D array (flattened into buckets) whose values sit far from 0: the maxmin scales adapt."""
  x = data(3, shape=(D, 37, 90)) + np.float32(50.0)
  out = run_allreduce(x, Q4, seed=2)
  assert out.shape == x.shape and out.dtype == np.float32
  err = np.abs(out.astype(np.float64) - exact_mean(x))
  bound = allreduce_bound(x.reshape(D, -1), Q4).reshape(x.shape[1:])
  assert np.all(err <= bound)


# ---- 3. bit-identical replicas -----------------------------------------------------------------

@pytest.mark.parametrize("codec,mode", [
    (qcomm.QSGD(4), "flat"),
    (qcomm.QSGD(4, impl="jax"), "flat"),
    (qcomm.QSGD(4, scheme="norm"), "flat"),
    (qcomm.Cast(jnp.bfloat16), "flat"),
    (qcomm.Cast(jnp.float16), "flat"),
    (qcomm.NoCompression(), "flat"),
    (qcomm.QSGD(4), "tuple"),
    (qcomm.QSGD(4), "hier"),
    (qcomm.Cast(jnp.bfloat16), "hier"),
], ids=lambda v: str(v))
def test_replicas_bit_identical(codec, mode):
  out = run_allreduce(data(4), codec, seed=5, mode=mode)
  assert np.all(np.isfinite(out))
  assert rows_identical(out)


def test_replicas_bit_identical_pmap():
  x = data(4)
  out = np.asarray(pmap_allreduce_fn(Q4)(x, jax.random.key(5)))
  assert out.shape == x.shape
  assert rows_identical(out)
  err = np.abs(out.astype(np.float64) - exact_mean(x))
  assert np.all(err <= allreduce_bound(x, Q4))


def test_ffi_and_jax_impls_agree():
  """One wire format: with the same key the FFI kernels and the pure-JAX reference make the same
  codes. Decoded values may differ by one rounding of `code * step` (XLA may contract the pure-JAX
  `min + code * step` into an FMA, docs/wire-format.md), never by a quantisation level."""
  x = data(6)
  a = run_allreduce(x, qcomm.QSGD(4, impl="ffi"), seed=9)
  b = run_allreduce(x, qcomm.QSGD(4, impl="jax"), seed=9)
  assert rows_identical(a) and rows_identical(b)
  bound = allreduce_bound(x, Q4)
  diff = np.abs(a[0].astype(np.float64) - b[0])
  assert np.all(diff <= 1e-3 * bound), diff.max()  # a different code would differ by ~ a step
  for out in (a, b):
    assert np.all(np.abs(out[0] - exact_mean(x)) <= bound)


# ---- 4. codecs ---------------------------------------------------------------------------------

def test_nocompression_equals_pmean():
  x = data(7)
  out = run_allreduce(x, qcomm.NoCompression())
  ref = np.asarray(pmean_fn()(x, key1(0)))
  np.testing.assert_array_equal(out, ref)
  np.testing.assert_allclose(out[0], exact_mean(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype,u", [(jnp.bfloat16, BF16_U), (jnp.float16, F16_U)],
                         ids=["bf16", "f16"])
def test_cast_codec_within_narrow_rounding(dtype, u):
  x = data(8)
  xs = x.astype(np.float64)
  out = run_allreduce(x, qcomm.Cast(dtype))
  assert out.dtype == np.float32
  mean = xs.mean(0)
  a = np.abs(xs).mean(0)
  # Stage 1: each device's value rounded (<= u |x_s|), averaged; stage 2: the reduced value rounded
  # once more (<= u |reduced|, |reduced| <= |mean| + u a).
  bound = u * (a + np.abs(mean) + u * a) * 1.01 + 1e-7 * (a + 1)
  err = np.abs(out.astype(np.float64) - mean)
  assert np.all(err <= bound), (err - bound).max()
  assert err.max() > 0.1 * u * np.abs(mean).max()  # the wire really is narrow


@pytest.mark.parametrize("codec", [qcomm.NoCompression(), qcomm.Cast(jnp.bfloat16), Q4], ids=str)
def test_op_sum_is_d_times_mean(codec):
  x = data(9)
  xs = x.astype(np.float64)
  out_sum = run_allreduce(x, codec, seed=4, op="sum").astype(np.float64)
  out_mean = run_allreduce(x, codec, seed=4, op="mean").astype(np.float64)
  assert rows_identical(out_sum)
  exact_sum = xs.sum(0)
  if isinstance(codec, qcomm.NoCompression):
    np.testing.assert_allclose(out_sum[0], exact_sum, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out_sum[0], D * out_mean[0], rtol=0, atol=1e-5)
    return
  if isinstance(codec, qcomm.Cast):
    bound = 2.02 * BF16_U * np.abs(xs).sum(0) + 1e-6
  else:  # the same two-quantisation argument, every term D times larger
    bound = D * allreduce_bound(x, codec)
  assert np.all(np.abs(out_sum[0] - exact_sum) <= bound)
  assert np.all(np.abs(out_sum[0] - D * out_mean[0]) <= 2 * bound)
  assert np.abs(out_sum[0]).mean() > 0.5 * D * np.abs(out_mean[0]).mean()  # not a mean


# ---- 5. pytrees --------------------------------------------------------------------------------

def make_tree(seed=10):
  rs = np.random.RandomState(seed)

  def g(shape, dtype=np.float32, scale=1.0):
    return (rs.standard_normal((D,) + shape) * scale).astype(dtype)
  return {
      "dense": {"kernel": g((64, 48)), "bias": g((48,))},        # 3072 quantised; 48 exact (1-D)
      "emb": g((40, 50), jnp.bfloat16),                         # 2000 bf16 quantised
      "w1": g((32, 64)),                                         # 2048 quantised
      "norm": [g((1500,), jnp.float16), g((30, 40), jnp.float16)],  # 1-D exact; 1200 quantised
      "scalar": g(()),                                           # exact
      "small": g((10, 10)),                                      # 100 < min_size: exact
      "empty": g((0, 5)),
      "big": g((128, 300)),                                      # 38400 quantised
  }


COMPRESSED = ("dense/kernel", "emb", "w1", "norm/1", "big")
EXACT = ("dense/bias", "norm/0", "scalar", "small", "empty")


def _leaves(tree) -> dict:
  from jax_qcomm.collectives.packing import path_str
  return {path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _narrow_u(dtype) -> float:
  dtype = np.dtype(dtype)
  return {np.dtype(jnp.bfloat16): BF16_U, np.dtype(jnp.float16): F16_U}.get(dtype, 2.0**-24)


def _leaf_err(out_leaf, in_leaf):
  return np.abs(np.asarray(out_leaf, np.float64) - exact_mean(np.asarray(in_leaf, np.float64)))


def _assert_exact_leaf(name, o, x):
  mean = exact_mean(np.asarray(x, np.float64))
  u = _narrow_u(x.dtype)
  tol = 1.01 * u * np.abs(mean) + 1e-6  # pmean in float32, one cast back to the leaf's dtype
  assert np.all(_leaf_err(o[0], x) <= tol), name
  assert rows_identical(o), name


def _assert_quantised_leaf(name, o, x, codec):
  xs = np.asarray(x, np.float64).reshape(D, -1)
  bound = allreduce_bound(xs, codec)
  u = _narrow_u(x.dtype)
  bound = bound + 1.01 * u * (np.abs(xs.mean(0)) + bound)  # the final cast to the leaf's dtype
  err = _leaf_err(np.asarray(o[0], np.float64).reshape(-1), xs)
  assert np.all(err <= bound), (name, (err - bound).max())
  assert err.max() > 0.05 * bound.max(), name  # really quantised
  assert rows_identical(o), name


def test_pytree_structure_dtypes_and_default_policy():
  tree = make_tree()
  out = allreduce_fn(Q4)(tree, key1(3))
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  for (name, o), x in zip(_leaves(out).items(), _leaves(tree).values()):
    assert o.shape == x.shape and o.dtype == x.dtype, name
  lo, lx = _leaves(out), _leaves(tree)
  for name in EXACT:
    _assert_exact_leaf(name, lo[name], lx[name])
  for name in COMPRESSED:
    _assert_quantised_leaf(name, lo[name], lx[name], Q4)


def _count_compressed_buffers(fn, *args) -> int:
  """Compressed allreduces in fn: each ends with one all-gather (exact leaves use psum; the
  all-to-all may be ppermute rounds on CPU, see jax_qcomm.transport._exchange)."""
  text = fn.lower(*args).as_text()
  return len(re.findall(r"all_gather|all-gather", text))


def test_pytree_policy_and_small_comm_buckets():
  """exclude / overrides of LeafPolicy, with small communication buffers (one leaf each)."""
  tree = make_tree()
  lx = _leaves(tree)
  q8 = qcomm.QSGD(8)
  policy = qcomm.LeafPolicy(exclude=("kernel",), overrides={"w1": q8})
  small = allreduce_fn(Q4, policy=policy, cbs=1024)
  lo = _leaves(small(tree, key1(3)))
  assert jax.tree.structure(lo) == jax.tree.structure(_leaves(tree))
  _assert_exact_leaf("dense/kernel", lo["dense/kernel"], lx["dense/kernel"])  # excluded
  for name in EXACT:
    _assert_exact_leaf(name, lo[name], lx[name])
  _assert_quantised_leaf("w1", lo["w1"], lx["w1"], q8)  # overridden: 8 bits
  for name in ("emb", "norm/1", "big"):
    _assert_quantised_leaf(name, lo[name], lx[name], Q4)
  base = _leaves(allreduce_fn(Q4)(tree, key1(3)))  # default policy: w1 at 4 bits
  err8 = _leaf_err(lo["w1"][0], lx["w1"]).max()
  err4 = _leaf_err(base["w1"][0], lx["w1"]).max()
  assert err8 < err4 / 4, (err8, err4)  # 255 vs 15 levels

  # Buffer count: with the default (large) comm_bucket_size the quantised leaves are merged into
  # one buffer, with 1024 each leaf (all > 1024 elements once padded) gets its own collective.
  n_large = _count_compressed_buffers(allreduce_fn(Q4), tree, key1(3))
  n_small = _count_compressed_buffers(small, tree, key1(3))
  compressed_small = 4  # emb, w1 (8 bits), norm/1, big (dense/kernel is excluded)
  assert n_large >= 1
  assert n_large < len(COMPRESSED), n_large
  assert n_small >= compressed_small, n_small


def test_the_codec_bounds_its_communication_buffers(monkeypatch):
  """comm_bucket_size=None (the default) packs each codec's leaves up to its own
  comm_buffer_size: 2**24 elements by default, 2**26 for Summable's allreduce (one pmax and one
  psum per buffer, leaves read in place; the rows of sharded state keep 2**24), what Auto's
  resolved codec says, and what a subclass says; an explicit comm_bucket_size wins. The
  allreduce, the sharded layout and the cost model follow the same plan."""
  from jax_qcomm.collectives import packing  # noqa: PLC0415
  from jax_qcomm.transport import cost as transport  # noqa: PLC0415
  from jax_qcomm.collectives.shard_layout import Layout  # noqa: PLC0415
  from jax_qcomm.tools import efficiency  # noqa: PLC0415
  import dataclasses  # noqa: PLC0415

  shapes = [jax.ShapeDtypeStruct((3000, 4000), jnp.float32) for _ in range(2)]  # 12M each
  big = 1 << 24
  assert qcomm.QSGD(4).comm_buffer_size(2) == big
  assert qcomm.Summable(4).comm_buffer_size(2) == 4 * big
  assert qcomm.Summable(4).comm_buffer_size(2, "reduce_scatter") == big
  cheap_psum = transport.Transport(all_to_all=4.0, all_gather=4.0, reduce_scatter=4.0)
  for t, want in ((cheap_psum, 4 * big), (transport.IDEAL, big)):  # Summable, QSGD
    monkeypatch.setattr(transport, "current", lambda devices, t=t: t)
    assert qcomm.Auto(4).comm_buffer_size(2) == want, t
  monkeypatch.undo()
  for codec, buffers in ((qcomm.QSGD(4), 2), (qcomm.Summable(4), 1)):
    assert len(packing.plan(shapes, [codec] * 2, None, 2)) == buffers, codec
    assert len(packing.plan(shapes, [codec] * 2, 1 << 25, 2)) == 1, codec  # explicit: wins
    assert len(efficiency.tree_allreduce_bytes(shapes, 2, codec)["buffers"]) == buffers
    # rows of sharded state: 12M + 12M per row of two 24M leaves, over 2**24 for every codec
    assert len(Layout.of([(3000, 8000)] * 2, 2, [codec] * 2, None).groups) == 2, codec

  @dataclasses.dataclass(frozen=True)
  class SmallBuffers(qcomm.Summable):
    def comm_buffer_size(self, devices, collective="allreduce"):
      return 2048

  codec = SmallBuffers(4, 128, impl="jax")
  tree = {"a": data(20, shape=(D, 30, 100)), "b": data(21, shape=(D, 40, 50))}
  # the traced program (XLA may later combine independent all-reduces into one op)
  psums = lambda cbs: len(re.findall(r"stablehlo.all_reduce", allreduce_fn(  # noqa: E731
      codec, cbs=cbs).lower(tree, key1(1)).as_text()))
  assert psums(None) == 2 * psums(1 << 20) == 4  # a pmax and a psum per buffer: two buffers

  @dataclasses.dataclass(frozen=True)
  class NoBound(qcomm.Summable):
    def comm_buffer_size(self, devices, collective="allreduce"):
      return 0

  with pytest.raises(ValueError, match="NoBound.comm_buffer_size"):
    packing.plan(shapes, [NoBound()] * 2, None, 2)


# ---- 6. quantisation buckets never straddle leaves ---------------------------------------------

@pytest.mark.parametrize("names", [("a", "b"), ("b", "a")], ids=["tiny-first", "huge-first"])
def test_buckets_do_not_straddle_leaves(names):
  tiny_name, huge_name = names
  tiny = data(12, shape=(D, 33, 40), scale=1e-3)   # 1320 = 10 * 128 + 40
  huge = data(13, shape=(D, 37, 41), scale=1e3)    # 1517 = 11 * 128 + 109
  tree = {tiny_name: tiny, huge_name: huge}
  out = run_allreduce(tree, Q4, seed=1)
  err = _leaf_err(out[tiny_name][0].reshape(-1), tiny.reshape(D, -1))
  bound = allreduce_bound(tiny.reshape(D, -1), Q4)
  assert np.all(err <= bound), err.max()
  assert err.max() < 1e-2  # a straddling bucket would carry a step of ~1e3 * 5 / 15
  _assert_quantised_leaf(huge_name, out[huge_name], huge, Q4)


# ---- 7. non-finite values stay non-finite ------------------------------------------------------

POISON = ((3, 500, np.nan), (5, 1700, np.inf), (1, 2990, -np.inf))  # (device, index, value)


@pytest.mark.parametrize("codec,mode", [
    (qcomm.QSGD(4), "flat"),
    (qcomm.QSGD(4, impl="jax"), "flat"),
    (qcomm.QSGD(4, scheme="norm"), "flat"),
    (qcomm.QSGD(4), "hier"),
    (qcomm.NoCompression(), "flat"),
    (qcomm.Cast(jnp.bfloat16), "flat"),
    (qcomm.Cast(jnp.float16), "flat"),
], ids=lambda v: str(v))
def test_non_finite_inputs_stay_non_finite(codec, mode):
  x = data(14)
  for dev, idx, val in POISON:
    x[dev, idx] = val
  out = run_allreduce(x, codec, seed=2, mode=mode)
  idxs = [idx for _, idx, _ in POISON]
  assert not np.any(np.isfinite(out[:, idxs])), out[:, idxs]
  poisoned_buckets = {idx // 128 for idx in idxs}
  far = np.array([i // 128 not in poisoned_buckets for i in range(N)])
  assert np.all(np.isfinite(out[:, far]))
  assert rows_identical(out)


def test_nan_does_not_leak_into_neighbouring_leaf():
  a = data(15, shape=(D, 40, 50))  # 2000 = 15 * 128 + 80: the NaN sits in a's partial last bucket
  b = data(16, shape=(D, 40, 50))
  a[2, -1, -1] = np.nan
  out = run_allreduce({"a": a, "b": b}, Q4, seed=3)
  assert np.all(np.isnan(out["a"][:, -1, -1]))
  assert np.all(np.isfinite(out["b"]))
  assert np.all(np.isfinite(out["a"].reshape(D, -1)[:, :15 * 128]))


# ---- 8. hierarchical and tuple axes ------------------------------------------------------------

@pytest.mark.parametrize("codec", [qcomm.QSGD(4), qcomm.QSGD(4, scheme="norm")], ids=str)
def test_hierarchical_and_tuple_axes_match_flat(codec):
  x = data(17)
  mean = exact_mean(x)
  bound = allreduce_bound(x, codec)
  outs = {mode: run_allreduce(x, codec, seed=8, mode=mode).astype(np.float64)
          for mode in ("flat", "tuple", "hier")}
  for mode, out in outs.items():
    assert rows_identical(out), mode
    err = np.abs(out[0] - mean)
    assert np.all(err <= bound), (mode, (err - bound).max())
    assert err.max() > 0.05 * bound.max(), mode
  assert np.all(np.abs(outs["hier"][0] - outs["flat"][0]) <= 2 * bound)


def test_hierarchical_op_sum_and_nocompression():
  x = data(18)
  out = run_allreduce(x, qcomm.NoCompression(), mode="hier")
  np.testing.assert_allclose(out[0], exact_mean(x), rtol=0, atol=1e-6)
  out = run_allreduce(x, qcomm.NoCompression(), mode="tuple", op="sum")
  np.testing.assert_allclose(out[0], x.astype(np.float64).sum(0), rtol=0, atol=1e-5)
  out = run_allreduce(x, Q4, mode="hier", op="sum", seed=1).astype(np.float64)
  assert rows_identical(out)
  assert np.all(np.abs(out[0] - x.astype(np.float64).sum(0)) <= D * allreduce_bound(x, Q4))


# ---- 9. reduce_scatter and all_gather ----------------------------------------------------------

RS_M, RS_C = 24, 50  # block [24, 50] = 1200 elements = 9 * 128 + 48


@pytest.mark.parametrize("codec", [qcomm.QSGD(8), qcomm.QSGD(4, rounding="nearest")], ids=str)
def test_reduce_scatter_quantised(codec):
  x = data(19, shape=(D, D * RS_M, RS_C))
  out = np.asarray(reduce_scatter_fn(codec)(x, key1(4)), np.float64)
  assert out.shape == (D, RS_M, RS_C)
  mean = exact_mean(x).reshape(D, RS_M * RS_C)  # block i is device i's result
  # Each value is quantised once; each device's block is encoded with buckets from its start.
  blocks = x.astype(np.float64).reshape(D, D, RS_M * RS_C)  # [src, block, m]
  step = bucket_steps(blocks, codec).max(0)  # [block, nb]
  bound = _round_factor(codec) * _expand(step, codec, RS_M * RS_C) * (1 + 1e-4) + 1e-6
  err = np.abs(out.reshape(D, -1) - mean)
  assert np.all(err <= bound), (err - bound).max()
  assert err.max() > 0.05 * bound.max()


def test_reduce_scatter_nocompression_and_sum():
  x = data(20, shape=(D, D * RS_M, RS_C))
  xs = x.astype(np.float64)
  out = np.asarray(reduce_scatter_fn(qcomm.NoCompression())(x, key1(0)), np.float64)
  np.testing.assert_allclose(out.reshape(D * RS_M, RS_C), xs.mean(0), rtol=0, atol=1e-6)
  out = np.asarray(reduce_scatter_fn(qcomm.NoCompression(), "sum")(x, key1(0)), np.float64)
  np.testing.assert_allclose(out.reshape(D * RS_M, RS_C), xs.sum(0), rtol=0, atol=1e-5)
  q8 = qcomm.QSGD(8)
  out = np.asarray(reduce_scatter_fn(q8, "sum")(x, key1(0)), np.float64)
  step = bucket_steps(xs.reshape(D, D, -1), q8).sum(0)  # sum of D single-quantisation errors
  bound = _expand(step, q8, RS_M * RS_C) * (1 + 1e-4) + 1e-5
  assert np.all(np.abs(out.reshape(D, -1) - xs.sum(0).reshape(D, -1)) <= bound)


def test_reduce_scatter_shape_errors():
  x = jnp.zeros((D, 12, 5), jnp.float32)  # 12 rows per device, not divisible by 8
  with pytest.raises(ValueError, match="divisible"):
    reduce_scatter_fn(qcomm.NoCompression())(x, key1(0))
  f = _smap(lambda v, k: qcomm.reduce_scatter(v[0, 0, 0], "d", qcomm.NoCompression())[None])
  with pytest.raises(ValueError, match="divisible"):  # a scalar has no axis 0
    f(x, key1(0))


AG_SHAPE = (30, 45)  # 1350 elements = 10 * 128 + 70


@pytest.mark.parametrize("tiled", [False, True], ids=["stacked", "tiled"])
def test_all_gather_default_codec(tiled):
  x = data(21, shape=(D,) + AG_SHAPE)
  out = np.asarray(all_gather_fn(None, tiled)(x, key1(0)))
  expect_shape = (D * AG_SHAPE[0], AG_SHAPE[1]) if tiled else (D,) + AG_SHAPE
  assert out.shape == (D,) + expect_shape and out.dtype == np.float32
  assert rows_identical(out)
  got = out[0].reshape(D, -1).astype(np.float64)
  codec = qcomm.QSGD(8, rounding="nearest")
  # Nearest rounding, each device's array encoded on its own: <= 1/2 step.
  xs = x.reshape(D, -1)
  bound = 0.5 * _expand(bucket_steps(xs, codec), codec, xs.shape[1]) * (1 + 1e-4) + 1e-6
  err = np.abs(got - xs)
  assert np.all(err <= bound), (err - bound).max()
  assert err.max() > 0.05 * bound.max()


@pytest.mark.parametrize("tiled", [False, True], ids=["stacked", "tiled"])
def test_all_gather_nocompression_exact(tiled):
  x = data(22, shape=(D,) + AG_SHAPE)
  out = np.asarray(all_gather_fn(qcomm.NoCompression(), tiled)(x, key1(0)))
  assert rows_identical(out)
  np.testing.assert_array_equal(out[0].reshape(x.shape), x)


def test_all_gather_bf16_input_keeps_dtype():
  x = data(23, shape=(D,) + AG_SHAPE, dtype=jnp.bfloat16)
  out = np.asarray(all_gather_fn(qcomm.QSGD(8, rounding="nearest"), True)(x, key1(0)))
  assert out.dtype == x.dtype and out.shape == (D, D * AG_SHAPE[0], AG_SHAPE[1])
  assert rows_identical(out)


# ---- 10. errors ---------------------------------------------------------------------------------

def _trace(body, x=None):
  """Traces `body(local x, key)` inside shard_map over 'd' (errors surface at trace time)."""
  x = jnp.zeros((D, 256), jnp.float32) if x is None else x
  return _smap(lambda v, k: body(_local(v), k[0]))(x, key1(0))


def test_unbound_axis_name_raises():
  with pytest.raises(ValueError, match="'nope'"):
    _trace(lambda v, k: qcomm.allreduce(v, "nope", Q4, k)[None])
  with pytest.raises(ValueError, match="'nope'"):
    _trace(lambda v, k: qcomm.allreduce(v, ("d", "nope"), Q4, k)[None])
  with pytest.raises(ValueError, match="'nope'"):
    _trace(lambda v, k: qcomm.allreduce(v, qcomm.Hierarchical(inner="d", outer="nope"), Q4, k)[None])
  with pytest.raises(ValueError, match="'nope'"):
    _trace(lambda v, k: qcomm.reduce_scatter(v, "nope", Q4, k)[None])
  with pytest.raises(ValueError, match="'nope'"):
    _trace(lambda v, k: qcomm.all_gather(v, "nope")[None])
  with pytest.raises(ValueError, match="'nope'"):
    _trace(lambda v, k: qcomm.cast_pmean(v, "nope")[None])
  with pytest.raises(ValueError, match="'d'"):  # outside any shard_map / pmap
    qcomm.allreduce(jnp.ones(256), "d", qcomm.NoCompression())


def test_non_float_leaf_raises_naming_the_leaf():
  tree = {"a": jnp.zeros((D, 256), jnp.float32), "b": {"c": jnp.zeros((D, 256), jnp.int32)}}
  with pytest.raises(ValueError, match="b/c"):
    _trace(lambda v, k: _stack(qcomm.allreduce(v, "d", Q4, k)), tree)
  with pytest.raises(ValueError, match="int32"):
    _trace(lambda v, k: qcomm.allreduce(v, "d", Q4, k)[None], jnp.zeros((D, 256), jnp.int32))
  with pytest.raises(ValueError, match="int32"):
    _trace(lambda v, k: qcomm.reduce_scatter(v, "d", Q4, k)[None], jnp.zeros((D, 256), jnp.int32))


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="key"):
    _trace(lambda v, k: qcomm.allreduce(v, "d", Q4)[None])
  with pytest.raises(ValueError, match="key"):  # a stochastic override needs a key too
    pol = qcomm.LeafPolicy(overrides={"w": qcomm.QSGD(8)})
    _trace(lambda v, k: _stack(qcomm.allreduce(v, "d", qcomm.NoCompression(), policy=pol)),
           {"w": jnp.zeros((D, 64, 64))})
  with pytest.raises(ValueError, match="key"):
    _trace(lambda v, k: qcomm.reduce_scatter(v, "d", Q4)[None])
  with pytest.raises(ValueError, match="op"):
    _trace(lambda v, k: qcomm.allreduce(v, "d", Q4, k, op="max")[None])
  with pytest.raises(ValueError, match="codec"):
    _trace(lambda v, k: qcomm.allreduce(v, "d", "qsgd", k)[None])
  with pytest.raises(ValueError, match="comm_bucket_size"):
    _trace(lambda v, k: qcomm.allreduce(v, "d", Q4, k, comm_bucket_size=0)[None])
  with pytest.raises(ValueError, match="min_size"):
    qcomm.LeafPolicy(min_size=-1)
  with pytest.raises(ValueError, match="exclude"):
    qcomm.LeafPolicy(exclude=["("])
  with pytest.raises(ValueError, match="overrides"):
    qcomm.LeafPolicy(overrides={"w": "qsgd"})
  with pytest.raises(ValueError, match="bits"):
    qcomm.QSGD(bits=9)
  with pytest.raises(ValueError, match="bucket_size"):
    qcomm.QSGD(bucket_size=100)
  with pytest.raises(ValueError, match="bits"):
    qcomm.QSGD(bits=1, scheme="norm")


# ---- 11. cast_pmean ------------------------------------------------------------------------------

@functools.cache
def cast_pmean_fn(dtype):
  return _smap(lambda x, k: _stack(qcomm.cast_pmean(_local(x), "d", dtype)))


def test_cast_pmean():
  x = data(24)
  out = cast_pmean_fn(jnp.bfloat16)(x, key1(0))
  assert out.dtype == jnp.float32 and out.shape == x.shape
  out = np.asarray(out, np.float64)
  xs = x.astype(np.float64)
  mean = xs.mean(0)
  # Each input rounded to bf16, summed (in bf16 or promoted), mean rounded to bf16.
  tol = 4 * BF16_U * (np.abs(xs).sum(0) / D + np.abs(mean)) + 1e-6
  assert np.all(np.abs(out[0] - mean) <= tol)
  assert rows_identical(out)
  tree = {"a": x, "h": data(25, dtype=jnp.float16)}
  out = cast_pmean_fn(jnp.bfloat16)(tree, key1(0))
  assert out["a"].dtype == jnp.float32 and out["h"].dtype == jnp.float16


# ---- 12. randomness differs per call and per device --------------------------------------------

def test_randomness_differs_per_key_and_is_deterministic_per_key():
  x = data(26)
  a = run_allreduce(x, Q4, seed=1)
  b = run_allreduce(x, Q4, seed=2)
  c = run_allreduce(x, Q4, seed=1)
  np.testing.assert_array_equal(a, c)
  assert np.mean(a != b) > 0.3


def test_randomness_differs_per_device():
  """All devices hold the same x. With per-device randomness the reduce-scatter mean of D
  independent roundings errs ~sqrt(D) times less than one rounding; with shared randomness every
  device would round identically and the mean would err exactly as much as one roundtrip."""
  codec = qcomm.QSGD(4)
  same = np.broadcast_to(data(27, shape=(1, D * RS_M, RS_C)), (D, D * RS_M, RS_C)).copy()
  out = np.asarray(reduce_scatter_fn(codec)(same, key1(5)), np.float64).reshape(D * RS_M, RS_C)
  ref = same[0].astype(np.float64)
  rs_rms = np.sqrt(np.mean((out - ref) ** 2))
  blocks = jnp.asarray(same[0].reshape(D, -1))  # one device's blocks, each rounded once
  one = np.asarray(jax.jit(jax.vmap(codec.roundtrip))(blocks, jax.random.split(jax.random.key(1), D)))
  one_rms = np.sqrt(np.mean((one.reshape(ref.shape).astype(np.float64) - ref) ** 2))
  assert rs_rms < 0.6 * one_rms, (rs_rms, one_rms)
