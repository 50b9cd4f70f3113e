"""The traps a new user met, each now an error that names the cause and the fix, or impossible:

* NNX through the short path: ``qcomm.nnx_data_parallel`` (the optimizer is updated with the model
  itself, so the update of a varying copy, which trained nothing, cannot be written);
* ``data_parallel`` with a plain optax transformation (no sync in its state);
* an optimizer state made for more devices than the step's mesh;
* an axis name that is not the mesh's: the error names the mesh's axes;
* numpy integers wherever a Python int is accepted.
"""

from __future__ import annotations

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from flax import nnx

import jax_qcomm as qcomm

AX = "data"


def _mesh(d: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:d]), (AX,))


class MLP(nnx.Module):
  def __init__(self, rngs, batch_norm=False):
    self.l1 = nnx.Linear(12, 32, rngs=rngs)
    self.bn = nnx.BatchNorm(32, rngs=rngs) if batch_norm else None
    self.dropout = nnx.Dropout(0.2 if batch_norm else 0.0)
    self.l2 = nnx.Linear(32, 3, rngs=rngs)

  def __call__(self, x, rngs=None):
    h = self.l1(x)
    if self.bn is not None:
      h = self.bn(h)
    return self.l2(self.dropout(nnx.relu(h), rngs=rngs))


def _data(n=48, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, 12)).astype(np.float32)
  return {"x": x, "y": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)}


def _loss(model, batch, rngs=None):
  logits = model(batch["x"], rngs=rngs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits


def test_nnx_short_path_equals_single_device_exact_training():
  """Exact sync over 3 devices (48 examples: 16 each) gives the single-device updates of the
  global batch (mean of equal shards' mean losses = the global mean loss)."""
  ref_model = MLP(nnx.Rngs(0))
  ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)
  model = MLP(nnx.Rngs(0))
  mesh = _mesh(3)
  with jax.set_mesh(mesh):
    opt = nnx.Optimizer(model, qcomm.sync(optax.adam(1e-2), codec=qcomm.NoCompression()),
                        wrt=nnx.Param)
  dp = qcomm.nnx_data_parallel(_loss, mesh, has_aux=True, aux_reduce="concat")
  for i in range(4):
    batch = _data(seed=i)
    (ref_loss, _), grads = nnx.value_and_grad(_loss, has_aux=True)(ref_model, batch)
    ref_opt.update(ref_model, grads)
    loss, logits = dp.step(model, opt, batch)
    assert logits.shape == (48, 3)  # the global batch's logits, for metrics
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(ref_model, nnx.Param))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
  assert int(opt.opt_state.gradient_step[...]) == 4


def test_nnx_short_path_batchnorm_dropout_and_4_bits_train():
  mesh = _mesh(4)
  model = MLP(nnx.Rngs(1), batch_norm=True)
  with jax.set_mesh(mesh):
    opt = nnx.Optimizer(model, qcomm.sync(optax.adam(3e-2), accum_steps=2), wrt=nnx.Param)
  dp = qcomm.nnx_data_parallel(_loss, mesh, has_aux=True)
  batch = _data(64, seed=5)
  first = None
  for i in range(40):
    loss, _ = dp.step(model, opt, batch, key=jax.random.key(i))
    first = float(loss) if first is None else first
  assert float(loss) < 0.6 * first, (first, float(loss))
  stats = np.asarray(model.bn.mean[...])
  assert np.any(stats != 0)  # the running statistics moved (averaged across the devices)
  assert int(opt.opt_state.gradient_step[...]) == 20 and int(opt.step[...]) == 40


def test_nnx_short_path_refuses_what_would_not_train():
  mesh = _mesh(2)
  model = MLP(nnx.Rngs(0))
  dp = qcomm.nnx_data_parallel(_loss, mesh, has_aux=True)
  plain = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  with pytest.raises(ValueError, match=r"tx must contain a qcomm transformation over 'data'"):
    dp.step(model, plain, _data())
  with pytest.raises(ValueError, match="optimizer must be an nnx.Optimizer"):
    dp.step(model, optax.adam(1e-2), _data())
  with pytest.raises(ValueError, match="model must be an nnx.Module"):
    dp.step(nnx.state(model), plain, _data())
  with pytest.raises(ValueError, match="axis_name 'batch' must name axes of the mesh"):
    qcomm.nnx_data_parallel(_loss, mesh, axis_name="batch")


def test_data_parallel_with_a_plain_optax_transformation_says_what_to_pass():
  mesh = _mesh(2)
  dp = qcomm.data_parallel(lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.sgd(0.1), mesh)
  with pytest.raises(ValueError, match=r"codec=qcomm.NoCompression\(\)\) for exact data"):
    dp.init({"w": jnp.zeros((4, 2))})


def test_state_made_for_more_devices_than_the_mesh_says_so():
  """tx.init outside the mesh counts all 8 devices; a step on 4 of them names the cause."""
  tx = qcomm.sync(optax.sgd(0.1), axis_name=AX, accum_steps=2, min_size=1)
  params = {"w": jnp.zeros((2, 32))}
  state = tx.init(params)  # no mesh set: 8 devices
  mesh = _mesh(4)
  spec = qcomm.state_partition_spec(state)

  def step(p, s, g):
    return tx.update({"w": g[0]}, s, p)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P(AX)), out_specs=(P(), spec)))
  with pytest.raises(ValueError, match=r"made for 8 devices along 'data', but the step runs on 4"
                                       r".*jax.set_mesh\(mesh\)"):
    f(params, state, np.zeros((4, 2, 32), np.float32))


def test_unbound_axis_names_the_mesh_axes():
  mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
  f = jax.shard_map(lambda x: qcomm.allreduce(x, "data", qcomm.NoCompression()), mesh=mesh,
                    in_specs=P("batch"), out_specs=P("batch"))
  with pytest.raises(ValueError, match=r"'data', which is not bound \(the mesh here has axes "
                                       r"\('batch',\)\)"):
    jax.jit(f)(jnp.ones((2, 4)))


def test_numpy_integers_are_accepted_as_ints():
  tx = qcomm.sync(optax.sgd(0.1), bits=np.int64(4), bucket_size=np.int32(64),
                  accum_steps=np.int64(2), min_size=np.int64(16), seed=np.int64(3))
  from jax_qcomm.transforms.sync import config_of
  cfg = config_of(tx)
  assert cfg.codec == qcomm.Auto(4, 64) and cfg.accum_steps == 2 and cfg.seed == 3
  assert type(cfg.accum_steps) is int and type(cfg.codec.bits) is int
  assert qcomm.QSGD(np.int8(2), np.int64(16)).payload_size(np.int64(32)) == 2 * (8 + 4)
  assert qcomm.Summable(np.int32(4)).sent_bytes(np.int64(128), np.int64(2)) > 0
  assert qcomm.LeafPolicy(min_size=np.uint16(3)).min_size == 3
