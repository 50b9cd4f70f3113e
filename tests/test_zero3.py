"""Sharded data parallelism (ZeRO-3) as a mode of the one runner: ``qcomm.sync(...,
shard_params=True)`` through ``qcomm.data_parallel``. Exact codecs equal replicated data
parallelism over several steps at D = 3, 6 and 8 with leaves no D divides (a Python loop of
layers and ``lax.scan`` over stacked layers, under remat, with accumulation); hpZ on a (node, gpu)
mesh equals it too and keeps backward's gathers inside the node; ``describe`` equals the compiled
HLO; checkpoints restore with orbax, also onto another device count; a non-finite step is
skipped; misuse is named."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm
from benchmarks import hlo
from tests._launch import launch_workers

W = 13  # 169-element kernels, 13-element biases: no D in (3, 6, 8) divides them
L = 3


def _mesh(shape, names=("data",)):
  return Mesh(np.array(jax.devices()[:math.prod(shape)]).reshape(shape), names)


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {"layers": {"w": jnp.asarray(rng.standard_normal((L, W, W)) / 4, jnp.float32),
                     "b": jnp.asarray(rng.standard_normal((L, W)) * 0.1, jnp.float32)},
          "out": jnp.asarray(rng.standard_normal((W, 2)), jnp.float32)}


def _batch(d, step=0):
  rng = np.random.default_rng(100 + step)
  return (jnp.asarray(rng.standard_normal((2 * d, W)), jnp.float32),
          jnp.asarray(rng.standard_normal((2 * d, 2)), jnp.float32))


def _full_loss(p, batch):
  def layer(h, l):
    return jnp.tanh(h @ l["w"] + l["b"]), None
  h, _ = jax.lax.scan(layer, batch[0], p["layers"])
  return jnp.mean((h @ p["out"] - batch[1]) ** 2)


def _scan_loss(s, batch, policy=None):
  out = qcomm.gather_params(s["out"])

  def layer(h, shard):  # one layer's full parameters exist only here
    full = qcomm.gather_params(shard)
    return jnp.tanh(h @ full["w"] + full["b"]), None
  h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), batch[0], s["layers"])
  return jnp.mean((h @ out - batch[1]) ** 2)


def _loop_loss(s, batch, policy=qcomm.hpz_remat_policy):
  h = batch[0]
  for i in range(L):
    def layer(shard, h):
      full = qcomm.gather_params(shard, after=h)
      return jnp.tanh(h @ full["w"] + full["b"])
    h = jax.checkpoint(layer, policy=policy)(s[f"l{i}"], h)
  return jnp.mean((h @ qcomm.gather_params(s["out"]) - batch[1]) ** 2)


def _loop_params(p):
  return {**{f"l{i}": jax.tree_util.tree_map(lambda a, i=i: a[i], p["layers"]) for i in range(L)},
          "out": p["out"]}


def _train(loss, tx, mesh, axis, params, steps, layers=None):
  dp = qcomm.data_parallel(loss, tx, mesh, axis_name=axis)
  d = dp.devices if layers is not None else math.prod(mesh.devices.shape)
  p = dp.shard(params, layers=layers) if layers is not None else params
  state = dp.init(p)
  losses = []
  for step in range(steps):
    p, state, l, _ = dp.step(p, state, _batch(d, step))
    losses.append(float(l))
  return dp, p, state, losses


def _replicated(mesh, axis, steps, accum=1):
  tx = qcomm.sync(optax.adam(1e-2), axis_name=axis, bits=32, accum_steps=accum)
  return _train(_full_loss, tx, mesh, axis, _params(), steps)[1]


def _exact(axis, **kw):
  return qcomm.sync(optax.adam(1e-2), axis_name=axis, bits=32, shard_params=True,
                    param_codec=qcomm.NoCompression(), **kw)


def _close(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [3, 6, 8])
def test_exact_sharded_parameters_equal_replicated_data_parallelism(d):
  mesh = _mesh((d,))
  want = _replicated(mesh, "data", 4)
  dp, shards, state, _ = _train(_scan_loss, _exact("data"), mesh, "data", _params(), 4,
                                layers={"layers": 1, "out": 0})
  # Every leaf and the optimizer's moments are 1/D per device: [L, D, m] over "data".
  w = shards["layers"]["w"]
  assert w.data.shape == (L, d, -(-W * W // d)) and w.shape == (W, W)
  assert w.data.sharding.spec == P(None, "data", None)
  mu = state.inner_opt_state[0].mu["layers"]["w"]
  assert mu.data.sharding.spec == P(None, "data", None)
  assert {s.data.shape for s in mu.data.addressable_shards} == {(L, 1, w.data.shape[-1])}
  _close(dp.unshard(shards), want)
  assert qcomm.unshard_params(shards)["layers"]["w"].shape == (L, W, W)


def test_python_loop_and_accumulation_equal_replicated():
  mesh = _mesh((6,))
  want = _replicated(mesh, "data", 4, accum=2)
  tx = _exact("data", accum_steps=2)
  dp, shards, state, _ = _train(_loop_loss, tx, mesh, "data", _loop_params(_params()), 4,
                                layers=0)
  assert int(state.gradient_step) == 2
  full = dp.unshard(shards)
  _close({"layers": jax.tree_util.tree_map(lambda *a: jnp.stack(a),
                                           *[full[f"l{i}"] for i in range(L)]),
          "out": full["out"]}, want)


@pytest.mark.parametrize("shape", [(2, 3), (2, 4)])
def test_hpz_equals_replicated_and_backward_gathers_stay_in_the_node(shape):
  axis = ("node", "gpu")
  mesh = _mesh(shape, axis)
  want = _replicated(mesh, axis, 3)
  dp, shards, _, _ = _train(functools.partial(_scan_loss, policy=qcomm.hpz_remat_policy),
                            _exact(axis, hpz=True), mesh, axis, _params(), 3,
                            layers={"layers": 1, "out": 0})
  _close(dp.unshard(shards), want)


@pytest.mark.parametrize("bits,hpz", [(32, False), (4, False), (32, True), (4, True)])
def test_describe_equals_the_compiled_hlo_and_hpz_crosses_nodes_once(bits, hpz):
  axis = ("node", "gpu")
  mesh = _mesh((2, 3), axis)
  codec = qcomm.NoCompression() if bits == 32 else qcomm.QSGD(8, rounding="nearest")
  tx = qcomm.sync(optax.sgd(0.1), axis_name=axis, bits=bits, shard_params=True,
                  param_codec=codec, hpz=hpz, min_size=16)
  dp = qcomm.data_parallel(_loop_loss, tx, mesh, axis_name=axis)
  shards = dp.shard(_loop_params(_params()))
  state = dp.init(shards)
  text = jax.jit(dp.step).lower(shards, state, _batch(6)).compile().as_text()
  total, cross = hlo.sent_bytes(text, "node")
  loss_pmean = 2 * 5 / 6 * 4
  with jax.set_mesh(mesh):
    described = qcomm.describe(tx, shards, regather={**{f"l{i}": True for i in range(L)},
                                                     "out": False})
  assert described.sent_bytes_per_sync == pytest.approx(total - loss_pmean, rel=1e-9)
  if hpz:  # across nodes: one gather (codec) and one reduce-scatter per leaf, plus two scalars
    n = 2
    exact = qcomm.NoCompression()
    want = 2 * loss_pmean  # the loss's pmean and the finite guard's psum, over all devices
    for s in jax.tree_util.tree_leaves(shards, is_leaf=lambda x: isinstance(x, qcomm.ParamShard)):
      m = s.data.shape[-1]
      lossy = s.size >= 16 and len(s.shape) > 1
      gather = codec if lossy else exact
      grad = qcomm.QSGD(4) if lossy and bits == 4 else exact
      want += gather.sent_bytes(m, n, "all_gather") + grad.sent_bytes(n * m, n, "reduce_scatter")
    assert cross == pytest.approx(want, rel=1e-9)
  else:
    assert cross == pytest.approx(total)  # every collective spans both axes


def test_compressed_gathers_are_bit_identical_on_every_device_and_train():
  axis = ("node", "gpu")
  mesh = _mesh((2, 4), axis)
  shards = qcomm.shard_params(_params(), 8, layers={"layers": 1, "out": 0})

  def gathered(s, key):  # layer 0, gathered in hpZ's two stages
    full = qcomm.gather_params(jax.tree_util.tree_map(lambda a: a[0], s["layers"]), axis,
                               qcomm.QSGD(8, rounding="nearest"), qcomm.QSGD(4), key, hpz=True)
    return jax.tree_util.tree_map(lambda a: a[None], full)

  spec = qcomm.shard_specs(shards, axis)
  out = jax.jit(jax.shard_map(gathered, mesh=mesh, in_specs=(spec, P()), out_specs=P(axis)))(
      shards, jax.random.key(0))
  for leaf in jax.tree_util.tree_leaves(out):
    rows = np.asarray(leaf)
    assert all(np.array_equal(rows[0], r) for r in rows[1:])  # bits, on all 8 devices
  for name in ("w", "b"):
    want = np.asarray(_params()["layers"][name][0])
    step = (want.max() - want.min()) / 255  # a bucket's range is at most the whole leaf's
    np.testing.assert_array_less(np.abs(np.asarray(out[name][0]) - want), step / 2 + 1e-6)

  tx = qcomm.sync(optax.adam(1e-2), axis_name=axis, bits=4, shard_params=True, hpz=True)
  _, _, state, losses = _train(functools.partial(_scan_loss, policy=qcomm.hpz_remat_policy), tx,
                               mesh, axis, _params(), 8, layers={"layers": 1, "out": 0})
  assert losses[-1] < 0.8 * losses[0]
  assert int(state.total_notfinite) == 0


def test_a_non_finite_step_is_skipped_and_does_not_poison_later_ones():
  mesh = _mesh((3,))
  dp = qcomm.data_parallel(_scan_loss, qcomm.sync(optax.adam(1e-2), bits=4, shard_params=True),
                           mesh)
  shards = dp.shard(_params(), layers={"layers": 1, "out": 0})
  state = dp.init(shards)
  before = dp.unshard(shards)
  x, y = _batch(3)
  shards, state, loss, _ = dp.step(shards, state, (x.at[0, 0].set(jnp.nan), y))
  assert not np.isfinite(float(loss)) and int(state.total_notfinite) == 1
  _close(dp.unshard(shards), before)  # skipped: nothing moved, nothing made finite
  shards, state, loss, _ = dp.step(shards, state, (x, y))
  assert np.isfinite(float(loss)) and int(state.total_notfinite) == 1
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree_util.tree_leaves(
      dp.unshard(shards)))


def test_checkpoints_restore_with_orbax_also_onto_another_device_count(tmp_path):
  tx = _exact("data")
  mesh6, mesh4 = _mesh((6,)), _mesh((4,))
  dp6, shards, state, _ = _train(_scan_loss, tx, mesh6, "data", _params(), 2,
                                 layers={"layers": 1, "out": 0})
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "six", {"params": shards, "opt_state": state})
  ckpt.wait_until_finished()
  target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct,
                                  {"params": shards, "opt_state": state})
  restored = ckpt.restore(tmp_path / "six", target)
  _close(dp6.unshard(restored["params"]), dp6.unshard(shards))
  # Onto 4 devices: the shards and the moments moved to D = 4, then training goes on there.
  dp4 = qcomm.data_parallel(_scan_loss, tx, mesh4)
  moved = qcomm.reshard_params(jax.device_get(restored), 4)
  p4, s4 = moved["params"], moved["opt_state"]
  assert p4["layers"]["w"].data.shape == (L, 4, -(-W * W // 4))
  p6, st6 = shards, state
  for step in range(2):
    p4, s4, _, _ = dp4.step(p4, s4, _batch(12, step))
    p6, st6, _, _ = dp6.step(p6, st6, _batch(12, step))
  _close(dp4.unshard(p4), dp6.unshard(p6))


def test_misuse_is_named():
  mesh = _mesh((3,))
  with pytest.raises(ValueError, match="shard_params=True and shard_state=True cannot"):
    qcomm.sync(optax.sgd(0.1), shard_params=True, shard_state=True)
  with pytest.raises(ValueError, match="param_codec PowerSGD.*all-gather"):
    qcomm.sync(optax.sgd(0.1), shard_params=True, param_codec=qcomm.PowerSGD(1))
  with pytest.raises(ValueError, match="codec TopK.*reduce-scatter"):
    qcomm.sync(optax.sgd(0.1), shard_params=True, codec=qcomm.TopK())
  with pytest.raises(ValueError, match="error_feedback is not available with shard_params"):
    qcomm.sync(optax.sgd(0.1), shard_params=True, bits=4, error_feedback=True)
  with pytest.raises(ValueError, match="param_codec and hpz apply to shard_params=True only"):
    qcomm.sync(optax.sgd(0.1), param_codec=qcomm.NoCompression())
  with pytest.raises(ValueError, match="hpz=True needs axis_name=\\(node, gpu\\)"):
    qcomm.sync(optax.sgd(0.1), shard_params=True, hpz=True)
  with pytest.raises(ValueError, match="exclude and overrides"):
    qcomm.sync(optax.sgd(0.1), shard_params=True, exclude="out")
  tx = qcomm.sync(optax.sgd(0.1), shard_params=True, bits=32)
  dp = qcomm.data_parallel(_scan_loss, tx, mesh)
  state = dp.init(_params())  # full parameters: sharded by init
  with pytest.raises(ValueError, match="params must be the shards"):
    dp.step(_params(), state, _batch(3))

  def twice(s, batch):  # the same layer gathered twice in one forward
    a, b = qcomm.gather_params(s["out"]), qcomm.gather_params(s["out"])
    return jnp.mean((batch[0] @ a - batch[1]) ** 2) + jnp.mean(b)
  dp2 = qcomm.data_parallel(twice, tx, mesh)
  shards = dp2.shard(_params())
  with pytest.raises(ValueError, match="gathered twice in one step"):
    dp2.step(shards, dp2.init(shards), _batch(3))
  with pytest.raises(ValueError, match="axis_name is required outside"):
    jax.shard_map(lambda s: qcomm.gather_params(s), mesh=mesh,
                  in_specs=(qcomm.shard_specs(shards["out"], "data"),), out_specs=P())(shards["out"])
  with pytest.raises(ValueError, match="layers must be an int from 0"):
    qcomm.shard_params({"w": jnp.ones(3)}, 2, layers=2)
  with pytest.raises(ValueError, match="shards of another device count"):
    qcomm.describe(tx, qcomm.shard_params(_params(), 4), devices=3)


@pytest.mark.multiprocess
def test_two_processes(tmp_path):
  launch_workers("zero3_mp_worker.py", str(tmp_path), local_devices=3)
  runs = [dict(np.load(tmp_path / f"proc{p}.npz")) for p in range(2)]
  assert runs[0].keys() == runs[1].keys() and runs[0]
  for key in runs[0]:  # every process ends with the same full parameters, bit for bit
    np.testing.assert_array_equal(runs[0][key], runs[1][key])
  for key in [k for k in runs[0] if k.startswith("replicated/")]:
    for mode in ("sharded", "hpz"):
      np.testing.assert_allclose(runs[0][key.replace("replicated", mode)], runs[0][key],
                                 rtol=1e-5, atol=1e-6)


def test_nnx_runner_names_the_runner_to_use():
  from flax import nnx  # noqa: PLC0415
  mesh = _mesh((2,))
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, qcomm.sync(optax.sgd(0.1), shard_params=True), wrt=nnx.Param)
  dp = qcomm.nnx_data_parallel(lambda m, b: jnp.mean(m(b) ** 2), mesh)
  with pytest.raises(ValueError, match="nnx_data_parallel does not run .*shard_params"):
    dp.step(model, optimizer, jnp.ones((4, 4)))


def test_flax_linen_one_line_per_block_equals_replicated():
  import flax.linen as nn  # noqa: PLC0415

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jnp.tanh(nn.Dense(W)(x))

  class Net(nn.Module):
    block: Any = Block

    @nn.compact
    def __call__(self, x):
      for i in range(L):
        x = self.block(name=f"block{i}")(x)
      return nn.Dense(2, name="head")(x)

  sharded_block = nn.remat(nn.map_variables(Block, "params", trans_in_fn=qcomm.gather_params))
  mesh = _mesh((3,))
  params = Net().init(jax.random.key(0), jnp.ones((1, W)))["params"]

  def plain(p, batch):
    return jnp.mean((Net().apply({"params": p}, batch[0]) - batch[1]) ** 2)

  def sharded(shards, batch):
    head = qcomm.gather_params(shards["head"])  # the blocks' shards are gathered by the blocks
    net = Net(block=sharded_block)
    return jnp.mean((net.apply({"params": {**shards, "head": head}}, batch[0]) - batch[1]) ** 2)

  want = _train(plain, qcomm.sync(optax.adam(1e-2), bits=32), mesh, "data", params, 3)[1]
  dp, shards, _, _ = _train(sharded, _exact("data"), mesh, "data", params, 3, layers=0)
  _close(dp.unshard(shards), want)


def test_a_loss_that_never_gathers_and_two_branches_are_told_apart():
  mesh = _mesh((3,))
  tx = qcomm.sync(optax.sgd(0.1), shard_params=True, bits=32)

  def forgot(s, batch):  # the shards used as they are: each device's own gradient, no mean
    return jnp.mean(s["out"].data) + 0 * jnp.mean(batch[0])
  dp = qcomm.data_parallel(forgot, tx, mesh)
  shards = dp.shard(_params())
  with pytest.raises(ValueError, match="loss_fn never called qcomm.gather_params"):
    dp.step(shards, dp.init(shards), _batch(3))

  def branches(s, batch):  # one layer gathered in either branch of a cond: one gather runs
    out = jax.lax.cond(batch[0][0, 0] > 0, lambda: qcomm.gather_params(s["out"]),
                       lambda: qcomm.gather_params(s["out"]) * 2)
    return jnp.mean((batch[0] @ out - batch[1]) ** 2)
  dp = qcomm.data_parallel(branches, tx, mesh)
  _, _, loss, _ = dp.step(shards, dp.init(shards), _batch(3))
  assert np.isfinite(float(loss))


def test_clipping_before_the_sharded_sync_is_refused_and_inside_it_sees_the_whole_model():
  mesh = _mesh((3,))
  with pytest.raises(ValueError, match="clips by global norm before the qcomm synchronisation"):
    qcomm.data_parallel(_scan_loss, optax.chain(optax.clip_by_global_norm(1.0), _exact("data")),
                        mesh)
  # qcomm's clip inside: the whole model's norm over the shards, as replicated clipping computes
  tiny = 1e-3
  tx = qcomm.sync(optax.chain(qcomm.clip_by_global_norm(tiny), optax.sgd(1.0)), bits=32,
                  shard_params=True, param_codec=qcomm.NoCompression())
  ref = qcomm.sync(optax.chain(optax.clip_by_global_norm(tiny), optax.sgd(1.0)), bits=32)
  want = _train(_full_loss, ref, mesh, "data", _params(), 2)[1]
  dp, shards, _, _ = _train(_scan_loss, tx, mesh, "data", _params(), 2,
                            layers={"layers": 1, "out": 0})
  _close(dp.unshard(shards), want)
