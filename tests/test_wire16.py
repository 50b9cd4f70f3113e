"""Wire16 (``sync(bits=16)``): 16-bit fixed-point fields that XLA's all-reduce sums as integers."""

from __future__ import annotations

import functools

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm

AX = "x"
N = 5000  # no bucket size divides it


@functools.cache
def _mesh(d: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:d]), (AX,))


def _allreduce(codec, d, x, op="mean"):
  def body(v):
    out, res = codec.allreduce_flat(v[0], AX, jax.random.key(3), op)
    return out[None], res[None]

  f = jax.jit(jax.shard_map(body, mesh=_mesh(d), in_specs=P(AX), out_specs=(P(AX), P(AX))))
  out, res = f(x)
  return np.asarray(out), np.asarray(res)


@pytest.mark.parametrize("d", [2, 3, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bucket,fields", [(128, None), (192, None), (96, 3)])
def test_allreduce_within_the_step_the_same_bits_everywhere(d, rounding, bucket, fields):
  codec = qcomm.Wire16(bucket, rounding, fields)
  x = np.random.default_rng(d).standard_normal((d, N)).astype(np.float32)
  x[:, 1152:1152 + bucket] = 0  # a whole bucket of zeros (1152 is a multiple of each bucket)
  x[0, 2000:2128] *= 1e-30  # tiny on one device only
  out, res = _allreduce(codec, d, x)
  for j in range(1, d):
    np.testing.assert_array_equal(out[j].view(np.uint32), out[0].view(np.uint32))
  xp = np.pad(x, ((0, 0), (0, -N % bucket)))
  shared = np.abs(xp).reshape(d, -1, bucket).max(axis=(0, 2))
  step = np.repeat(shared / codec.levels(d), bucket)[:N]
  bound = (0.5 if rounding == "nearest" else 1.0) * step * (1 + 1e-5) + 1e-37
  assert np.all(np.abs(out[0] - x.mean(0)) <= bound)
  assert np.all(out[0][1152:1152 + bucket] == 0)
  # residual: what each device's own quantisation lost; the decoded contributions sum to the mean
  np.testing.assert_allclose((x - res).mean(0), out[0], rtol=1e-6, atol=float(step.max()) * 1e-3)
  assert np.all(np.abs(res) <= bound * d)


def _rel(a, b):
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_as_accurate_as_the_bf16_cast_on_normal_values_and_summed_is_sum():
  d = 2
  x = np.random.default_rng(0).standard_normal((d, 1 << 16)).astype(np.float32)
  want = x.mean(0)
  cast_err = _rel(_allreduce(qcomm.Cast(jnp.bfloat16), d, x)[0][0], want)
  # the default packs three fields at D = 2 (406 levels): within the cast's all-reduce error
  assert qcomm.Wire16().resolve(d) == qcomm.Wire16(fields=3)
  out, _ = _allreduce(qcomm.Wire16(), d, x)
  assert 0.5 * cast_err < _rel(out[0], want) <= cast_err
  # two fields (16 bits): over ten times more exact than the cast
  out2, _ = _allreduce(qcomm.Wire16(fields=2), d, x)
  assert _rel(out2[0], want) < 0.1 * cast_err
  total, _ = _allreduce(qcomm.Wire16(), d, x, op="sum")
  np.testing.assert_allclose(total[0], 2 * out[0], rtol=1e-6)


def test_three_fields_are_base_1625_digits_that_sum_without_carries():
  codec = qcomm.Wire16(24, fields=3)
  d = 2
  lv = codec.levels(d)
  assert lv == 406 and 2 * lv * d < 1625 and 1625 ** 3 <= 2 ** 32
  x = jnp.asarray(np.linspace(-1, 1, 24, dtype=np.float32))
  shared = codec.bucket_max(x)
  words = np.asarray(codec.encode_fields(x, shared, None, d))
  assert words.shape == (8,)
  fields = np.stack([words % 1625, words // 1625 % 1625, words // 1625 ** 2], axis=0)
  # word i holds values i, i + 8 and i + 16 (a third of the bucket apart)
  want = np.round(np.asarray(x).reshape(3, 8) * lv) + lv
  np.testing.assert_array_equal(fields, want)
  # the sum of D = 2 devices' words decodes to the sum of their values, within the step
  total = codec.decode_fields(jnp.asarray(2 * words.astype(np.uint64)).astype(jnp.uint32),
                              shared, d, 2)
  np.testing.assert_allclose(np.asarray(total), 2 * np.asarray(x), atol=1.0 / lv)


def test_fields_follow_the_levels_and_the_bucket():
  assert [qcomm.Wire16().fields_for(d) for d in (1, 2, 3, 8)] == [3, 3, 2, 2]
  assert [qcomm.Wire16(1024).fields_for(d) for d in (1, 2)] == [2, 2]  # 1024 % 3 != 0
  assert qcomm.Wire16().levels(2) == 406 and qcomm.Wire16().levels(3) == 10922
  assert qcomm.Wire16(fields=3).levels(3) == 270
  assert qcomm.Wire16().resolve(3) == qcomm.Wire16(fields=2)
  assert qcomm.Wire16().wire_bits(2) == pytest.approx(32 / 3 + 32 / 192)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_bucket_is_nan_on_every_device(bad):
  d = 3
  x = np.random.default_rng(1).standard_normal((d, N)).astype(np.float32)
  x[2, 1030] = bad  # bucket 8 of 128
  out, _ = _allreduce(qcomm.Wire16(128), d, x)
  assert np.all(np.isnan(out[:, 1024:1152]))
  mask = np.ones(N, bool)
  mask[1024:1152] = False
  assert np.all(np.isfinite(out[:, mask]))


def test_bits_16_is_wire16_and_its_bytes():
  assert qcomm.codec_for_bits(16) == qcomm.Wire16()
  codec = qcomm.Wire16(1024)
  assert codec.wire_bits(8) == 16 + 32 / 1024
  assert codec.levels(2) == 16383 and codec.levels(8) == 4095
  # a ring all-reduce of 2 bytes per value and 4 per bucket: half of fp32's, plus the scales
  assert codec.sent_bytes(1 << 20, 4) == pytest.approx(1.5 * (2 * (1 << 20) + 4 * 1024))


@pytest.mark.parametrize("kwargs,name", [(dict(bucket_size=12), "bucket_size"),
                                         (dict(bucket_size=True), "bucket_size"),
                                         (dict(rounding="up"), "rounding"),
                                         (dict(fields=4), "fields"),
                                         (dict(fields=3, bucket_size=128), "bucket_size")])
def test_bad_arguments_name_the_parameter(kwargs, name):
  with pytest.raises(ValueError, match=name):
    qcomm.Wire16(**kwargs)
  with pytest.raises(ValueError, match="devices"):
    qcomm.Wire16().check_devices(1 << 15)


@pytest.mark.parametrize("d", [2, 3])  # three fields per word at D = 2, two at D = 3
def test_sync_bits_16_keeps_replicas_identical_replicated_and_sharded(d):
  params = {"w": jnp.zeros((7, 300)), "b": jnp.zeros((5,)), "v": jnp.zeros((2, 3, 200))}
  for kw in (dict(bits=16), dict(bits=16, error_feedback=True),
             dict(codec=qcomm.Wire16(), shard_state=True, gather_codec=qcomm.Wire16())):
    tx = qcomm.sync(optax.adam(1e-2), axis_name=AX, min_size=16, **kw)
    spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params), AX)
    state = jax.jit(jax.shard_map(tx.init, mesh=_mesh(d), in_specs=P(), out_specs=spec))(params)

    def step(p, s, g):
      u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
      p = optax.apply_updates(p, u)
      return p, s, jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying")[None], p)

    run = jax.jit(jax.shard_map(step, mesh=_mesh(d), in_specs=(P(), spec, P(AX)),
                                out_specs=(P(), spec, P(AX))))
    p = params
    for i in range(3):
      g = {k: np.random.default_rng(i).standard_normal((d,) + v.shape).astype(np.float32)
           for k, v in params.items()}
      p, state, mine = run(p, state, g)
      for leaf in jax.tree_util.tree_leaves(mine):
        leaf = np.asarray(leaf)
        assert np.all(np.isfinite(leaf))
        for j in range(1, d):
          np.testing.assert_array_equal(leaf[j].view(np.uint32), leaf[0].view(np.uint32))
    assert float(jnp.abs(p["w"]).max()) > 0  # it moved
