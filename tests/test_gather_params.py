"""ZeRO-3's primitive, ``qcomm.gather_params``: parameters kept as 1/D shards over the data axis,
gathered where they are used (a Python loop over layers, ``lax.scan`` over stacked layers, under
``jax.checkpoint``), their gradient reduce-scattered back to the shards. Exact codecs equal
replicated data parallelism; compressed gathers stay within their stated error; replicas of the
gathered weights are bit-identical; bad shards are named."""

from __future__ import annotations

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm

AX = "data"


def _mesh(d):
  return Mesh(np.array(jax.devices()[:d]), (AX,))


def _layers(n=3, width=13, seed=0):
  """n layers of (width x width) weights and width biases: sizes no D in (3, 6, 8) divides."""
  rng = np.random.default_rng(seed)
  return [{"w": jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width), jnp.float32),
           "b": jnp.asarray(rng.standard_normal(width) * 0.1, jnp.float32)} for _ in range(n)]


def _batch(d, seed=1, width=13):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((2 * d, width)), jnp.float32),
          jnp.asarray(rng.standard_normal((2 * d, width)), jnp.float32))


def _forward(layers, x):
  for layer in layers:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return x


def _loss(layers, batch):
  return jnp.mean((_forward(layers, batch[0]) - batch[1]) ** 2)


def _spec(shards):
  return jax.tree_util.tree_map(lambda _: P(AX), shards)


def _sharded_train(d, steps, per_layer, tx, codec=qcomm.NoCompression(),
                   grad_codec=qcomm.NoCompression(), remat=False, after=False):
  """``steps`` of ``tx`` on the shards: the loss gathers each layer where it runs (or all of them
  up front), autodiff reduce-scatters the gradient to the shards."""
  mesh = _mesh(d)
  shards = qcomm.shard_params(_layers(), d)
  spec = _spec(shards)

  def loss(shards, batch, key):
    if not per_layer:
      return _loss(qcomm.gather_params(shards, AX, codec, grad_codec, key), batch)
    x = batch[0]
    for i, shard in enumerate(shards):
      def layer(shard, x, i=i):
        full = qcomm.gather_params(shard, AX, codec, grad_codec, jax.random.fold_in(key, i),
                                   after=x if after else None)
        return jnp.tanh(x @ full["w"] + full["b"])
      x = (jax.checkpoint(layer) if remat else layer)(shard, x)
    return jnp.mean((x - batch[1]) ** 2)

  def step(shards, state, batch, key):
    grads = jax.grad(loss)(shards, batch, key)
    updates, state = tx.update(grads, state, shards)
    return optax.apply_updates(shards, updates), state

  state = tx.init(shards)  # the global [D, m] moments of the shards, a replicated count
  state_spec = jax.tree_util.tree_map(lambda a: P(AX) if jnp.ndim(a) else P(), state)
  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, state_spec, P(AX), P()),
                              out_specs=(spec, state_spec)))
  for i in range(steps):
    shards, state = run(shards, state, _batch(d, seed=10 + i), jax.random.key(i))
  return shards


def _replicated_train(d, steps, tx):
  """The same steps as plain data parallelism: the mean of the devices' gradients."""
  params = _layers()
  state = tx.init(params)
  for i in range(steps):
    x, y = _batch(d, seed=10 + i)
    # the devices' rows are contiguous: device j holds rows [2j, 2j + 2)
    grads = [jax.grad(_loss)(params, (x[2 * j:2 * j + 2], y[2 * j:2 * j + 2])) for j in range(d)]
    mean = jax.tree_util.tree_map(lambda *g: sum(g) / d, *grads)
    updates, state = tx.update(mean, state, params)
    params = optax.apply_updates(params, updates)
  return params


def test_shard_and_unshard_round_trip_and_the_layout():
  params = _layers()
  shards = qcomm.shard_params(params, 6)
  leaf = shards[0]["w"]
  assert isinstance(leaf, qcomm.ParamShard)
  assert leaf.data.shape == (6, 29) and leaf.shape == (13, 13)  # ceil(169 / 6) = 29, zero-padded
  np.testing.assert_array_equal(np.asarray(leaf.data).reshape(-1)[169:], 0)
  back = qcomm.unshard_params(shards)
  for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("d", [3, 6, 8])
@pytest.mark.parametrize("per_layer,remat,after", [(False, False, False), (True, False, False),
                                                   (True, True, False), (True, True, True)],
                         ids=["up_front", "per_layer", "per_layer_remat", "remat_after"])
def test_exact_gathers_equal_replicated_data_parallelism(d, per_layer, remat, after):
  tx = optax.adam(1e-2)
  got = qcomm.unshard_params(_sharded_train(d, 4, per_layer, tx, remat=remat, after=after))
  want = _replicated_train(d, 4, tx)
  # float32: the mean of D gradients summed in another order (tolerance 1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_scan_over_stacked_layers_with_remat_equals_the_loop():
  d = 3
  mesh = _mesh(d)
  layers = _layers(4)
  # one ParamShard per layer and leaf, stacked along a layer axis after the device axis for the
  # scan: data [D, L, m]
  shards = [qcomm.shard_params(layer, d) for layer in layers]
  stacked_shards = jax.tree_util.tree_map(lambda *s: jnp.stack(s, 1), *shards)

  def loss(stacked_shards, batch, key):
    def body(x, shard):
      full = qcomm.gather_params(shard, AX, key=key)
      return jnp.tanh(x @ full["w"] + full["b"]), None
    x, _ = lax.scan(jax.checkpoint(body), batch[0],
                    jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), stacked_shards))
    return jnp.mean((x - batch[1]) ** 2)

  spec = jax.tree_util.tree_map(lambda _: P(AX), stacked_shards)
  grad = jax.jit(jax.shard_map(lambda s, b, k: jax.grad(loss)(s, b, k), mesh=mesh,
                               in_specs=(spec, P(AX), P()), out_specs=spec))
  g = grad(stacked_shards, _batch(d), jax.random.key(0))
  x, y = _batch(d)
  want = [jax.grad(_loss)(layers, (x[2 * j:2 * j + 2], y[2 * j:2 * j + 2])) for j in range(d)]
  want = jax.tree_util.tree_map(lambda *a: sum(a) / d, *want)
  for i in range(4):
    got = qcomm.unshard_params(jax.tree_util.tree_map(lambda a: a[:, i], g))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want[i])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_compressed_gather_is_within_its_stated_error_and_bit_identical_on_every_device():
  d = 3
  mesh = _mesh(d)
  params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((37, 53)), jnp.float32)}
  shards = qcomm.shard_params(params, d)
  codec = qcomm.QSGD(8, rounding="nearest")
  gather = jax.jit(jax.shard_map(
      lambda s: qcomm.gather_params(s, AX, codec=codec)["w"][None], mesh=mesh,
      in_specs=(_spec(shards),), out_specs=P(AX)))
  copies = np.asarray(gather(shards))
  for c in copies[1:]:
    assert c.tobytes() == copies[0].tobytes()
  # 8-bit nearest rounding in buckets of 128 of each device's flat shard: within half a step of
  # 1/255 of the bucket's range
  flat = np.asarray(shards["w"].data)
  err = np.abs(copies[0] - np.asarray(params["w"])).reshape(-1)
  bound = []
  for row in flat:
    for start in range(0, row.size, 128):
      bucket = row[start:start + 128]
      bound += [(bucket.max() - bucket.min()) / 255 / 2 * (1 + 1e-5)] * bucket.size
  bound = np.asarray(bound)[:err.size]
  assert np.all(err <= bound + 1e-7), np.max(err - bound)


def test_a_compressed_gather_hands_back_the_mean_gradient():
  """The shards' gradient through a compressed forward gather is the devices' mean, as through an
  exact one (within the 8-bit weights' effect on the gradient), not their sum; with plain SGD a
  sum would be a D times larger step."""
  d = 3
  mesh = _mesh(d)
  shards = qcomm.shard_params(_layers(), d)
  spec = _spec(shards)
  grads = {}
  for name, codec in (("exact", qcomm.NoCompression()),
                      ("q8", qcomm.QSGD(8, rounding="nearest"))):
    fn = jax.jit(jax.shard_map(
        lambda s, b, c=codec: jax.grad(lambda s: _loss(qcomm.gather_params(s, AX, c), b))(s),
        mesh=mesh, in_specs=(spec, P(AX)), out_specs=spec))
    grads[name] = qcomm.unshard_params(fn(shards, _batch(d)))
  for a, b in zip(jax.tree_util.tree_leaves(grads["q8"]), jax.tree_util.tree_leaves(grads["exact"])):
    rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert rel < 0.05, rel


def test_compressed_gradients_train():
  d = 3
  tx = optax.sgd(0.3)
  start = _layers()
  got = qcomm.unshard_params(_sharded_train(d, 8, True, tx, codec=qcomm.QSGD(8, rounding="nearest"),
                                            grad_codec=qcomm.QSGD(4)))
  x, y = _batch(d, seed=99)
  assert float(_loss(got, (x, y))) < float(_loss(start, (x, y)))


def test_bad_shards_are_named():
  mesh = _mesh(3)
  shards = qcomm.shard_params(_layers(1), 6)  # made for 6 devices, run on 3
  with pytest.raises(ValueError, match="has a shard of shape \\(2, 3\\).*must be \\(1, 5\\)"
                                       ".*qcomm.shard_params\\(params, 3\\)"):
    jax.shard_map(lambda s: qcomm.gather_params(s, AX), mesh=mesh, in_specs=(_spec(shards),),
                  out_specs=P())(shards)
  with pytest.raises(ValueError, match="shards must be a pytree of qcomm ParamShard"):
    jax.shard_map(lambda s: qcomm.gather_params(s, AX), mesh=mesh, in_specs=(P(),),
                  out_specs=P())({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match="key is required"):
    jax.shard_map(lambda s: qcomm.gather_params(s, AX, grad_codec=qcomm.QSGD(4)), mesh=mesh,
                  in_specs=(_spec(qcomm.shard_params(_layers(1), 3)),), out_specs=P())(
                      qcomm.shard_params(_layers(1), 3))


def test_one_layer_at_a_time_in_the_compiled_step():
  """memory_analysis of an 8-layer step: gathered up front, every layer's full parameters are
  live at once; one layer at a time (a loop with ``after=``, or a scan, under remat), about one
  layer's."""
  from benchmarks.zero3_memory import compiled_memory  # noqa: PLC0415

  width, layers = 256, 8
  layer = 4 * (width * width + width)
  temp = {mode: compiled_memory(mode, 8, layers, width, 2)["temp_bytes"] / layer
          for mode in ("up_front", "loop_remat", "per_layer")}
  assert temp["up_front"] > layers - 1, temp
  # One layer's gathered buffer and its leaves split from it: about two layers, not all eight.
  assert temp["loop_remat"] < 2.5 and temp["per_layer"] < 2.5, temp
