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
def test_allreduce_within_the_step_the_same_bits_everywhere(d, rounding):
  codec = qcomm.Wire16(128, rounding)
  x = np.random.default_rng(d).standard_normal((d, N)).astype(np.float32)
  x[:, 1024:1152] = 0  # a whole bucket of zeros
  x[0, 2000:2128] *= 1e-30  # tiny on one device only
  out, res = _allreduce(codec, d, x)
  for j in range(1, d):
    np.testing.assert_array_equal(out[j].view(np.uint32), out[0].view(np.uint32))
  xp = np.pad(x, ((0, 0), (0, -N % 128)))
  shared = np.abs(xp).reshape(d, -1, 128).max(axis=(0, 2))
  step = np.repeat(shared / qcomm.Wire16.levels(d), 128)[:N]
  bound = (0.5 if rounding == "nearest" else 1.0) * step * (1 + 1e-5) + 1e-37
  assert np.all(np.abs(out[0] - x.mean(0)) <= bound)
  assert np.all(out[0][1024:1152] == 0)
  # residual: what each device's own quantisation lost; the decoded contributions sum to the mean
  np.testing.assert_allclose((x - res).mean(0), out[0], rtol=1e-6, atol=float(step.max()) * 1e-3)
  assert np.all(np.abs(res) <= bound * d)


def test_more_accurate_than_the_bf16_cast_and_summed_is_sum():
  d = 2
  x = np.random.default_rng(0).standard_normal((d, N)).astype(np.float32)
  want = x.mean(0)
  out, _ = _allreduce(qcomm.Wire16(), d, x)
  cast = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)).mean(0)
  err = np.linalg.norm(out[0] - want) / np.linalg.norm(want)
  assert err < 0.1 * np.linalg.norm(cast - want) / np.linalg.norm(want)
  total, _ = _allreduce(qcomm.Wire16(), d, x, op="sum")
  np.testing.assert_allclose(total[0], 2 * out[0], rtol=1e-6)


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
  assert qcomm.Wire16.levels(2) == 16383 and qcomm.Wire16.levels(8) == 4095
  # a ring all-reduce of 2 bytes per value and 4 per bucket: half of fp32's, plus the scales
  assert codec.sent_bytes(1 << 20, 4) == pytest.approx(1.5 * (2 * (1 << 20) + 4 * 1024))


@pytest.mark.parametrize("kwargs,name", [(dict(bucket_size=12), "bucket_size"),
                                         (dict(bucket_size=True), "bucket_size"),
                                         (dict(rounding="up"), "rounding")])
def test_bad_arguments_name_the_parameter(kwargs, name):
  with pytest.raises(ValueError, match=name):
    qcomm.Wire16(**kwargs)
  with pytest.raises(ValueError, match="devices"):
    qcomm.Wire16().check_devices(1 << 15)


def test_sync_bits_16_keeps_replicas_identical_replicated_and_sharded():
  d = 3
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
