"""The one runner: ``qcomm.data_parallel`` (Linen-style params) and ``qcomm.nnx_data_parallel``
run every transformation the library builds, with one calling convention.

What is proved here:
  - the matrix {sync, sync sharded, diloco(optax), diloco(sync), diloco(sync sharded)} x {params,
    NNX} x {accum 1, 2}, on a 1-D mesh of 3 devices and a 2-D (node x gpu) mesh of 2 x 3 (3
    divides none of the leaves): in every cell it trains, the params (for diloco: the anchor) are
    bit-identical on every device at every step, and the devices of a diloco replica hold the
    same replica parameters;
  - the exact oracles through the runner: exact diloco with outer ``sgd(1.0)`` on the same data on
    every replica equals exact data parallelism; exact sharded equals exact replicated;
  - the traps of the seams: a decay chained after an accumulating sync acts once per optimizer
    step; a batch the devices cannot split, a stateful transformation after an accumulating sync
    in an ``nnx.Optimizer``, a scalar aux concatenated are errors that name the fix; the NNX step
    runs inside ``nnx.jit``; a scalar aux under NNX's default comes back averaged.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

import jax_qcomm as qcomm

nnx = pytest.importorskip("flax.nnx")

ONE_D = ("data",)
TWO_D = ("node", "gpu")


def _mesh(names):
  if names == ONE_D:
    return Mesh(np.array(jax.devices("cpu")[:3]), ONE_D)
  return Mesh(np.array(jax.devices("cpu")[:6]).reshape(2, 3), TWO_D)


def _tx(kind: str, accum: int, names, exact: bool = False):
  """The transformation of a matrix row; its sync (if any) over the fast axis."""
  inner = optax.adam(2e-2)
  codec = qcomm.NoCompression() if exact else qcomm.QSGD(4)
  fast = names[-1]
  sync = lambda **kw: qcomm.sync(inner, axis_name=fast if kind.startswith("diloco") else  # noqa: E731
                                 (names[0] if len(names) == 1 else names), codec=codec,
                                 accum_steps=accum, policy=qcomm.LeafPolicy(min_size=0), **kw)
  if kind == "sync":
    return sync()
  if kind == "sharded":
    return sync(shard_state=True)
  outer = dict(axis_name=names[0], every=2, codec=codec, outer=optax.sgd(1.0))
  if kind == "diloco":
    return qcomm.diloco(optax.adam(2e-2), **outer)
  return qcomm.diloco(sync(shard_state=kind == "diloco_sharded"), **outer)


CELLS = ([("sync", ONE_D), ("sharded", ONE_D), ("diloco", ONE_D)]
         + [(k, TWO_D) for k in ("sync", "sharded", "diloco_sync", "diloco_sharded")])
IDS = [f"{k}-{len(n)}d" for k, n in CELLS]


def _data(n: int = 12, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 7)).astype(np.float32)
  w = rng.normal(size=(7, 2)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(np.tanh(x @ w))


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  # 7 x 5 and 5 x 2: 3 devices divide neither; a bias of 5.
  return {"w1": jax.random.normal(k1, (7, 5)) * 0.5, "b1": jnp.zeros((5,)),
          "w2": jax.random.normal(k2, (5, 2)) * 0.5}


def _loss(p, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)


def _copies_equal(tree) -> bool:
  """Every device's copy of every (replicated) leaf is the same, bit for bit."""
  for x in jax.tree.leaves(tree):
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    if not all(np.array_equal(shards[0], s) for s in shards[1:]):
      return False
  return True


def _replicas_agree_inside(state, mesh) -> bool:
  """For diloco: the devices of one replica (a row of the mesh) hold the same replica params."""
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, qcomm.DiLoCoState))
           if isinstance(s, qcomm.DiLoCoState)]
  for s in found:
    for x in jax.tree.leaves(s.params):
      by_row = {}
      for shard in x.addressable_shards:
        row = int(np.argwhere(mesh.devices == shard.device)[0][0])
        by_row.setdefault(row, []).append(np.asarray(shard.data))
      if not all(np.array_equal(v[0], u) for v in by_row.values() for u in v[1:]):
        return False
  return True


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("kind,names", CELLS, ids=IDS)
def test_params_runner_trains_and_keeps_replicas_identical(kind, names, accum):
  mesh = _mesh(names)
  tx = _tx(kind, accum, names)
  dp = qcomm.data_parallel(_loss, tx, mesh, axis_name=names[0] if len(names) == 1 else names)
  params, batch = _params(), _data()
  state = dp.init(params)
  first = float(_loss(params, batch))
  for _ in range(8):
    params, state, loss, _ = dp.step(params, state, batch)
    assert _copies_equal(params) and _replicas_agree_inside(state, mesh)
    assert jax.tree.structure(params) == jax.tree.structure(_params())
  assert float(_loss(params, batch)) < 0.9 * first


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(7, 5, rngs=rngs)
    self.l2 = nnx.Linear(5, 2, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def _nnx_loss(model, batch):
  x, y = batch
  return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("kind,names", CELLS, ids=IDS)
def test_nnx_runner_trains_and_keeps_replicas_identical(kind, names, accum):
  mesh = _mesh(names)
  model = MLP(nnx.Rngs(0))
  with jax.set_mesh(mesh):
    opt = nnx.Optimizer(model, _tx(kind, accum, names), wrt=nnx.Param)
  dp = qcomm.nnx_data_parallel(_nnx_loss, mesh,
                               axis_name=names[0] if len(names) == 1 else names)
  batch = _data()
  first = float(_nnx_loss(model, batch))
  for _ in range(8):
    dp.step(model, opt, batch)
    assert _copies_equal(nnx.state(model, nnx.Param))
  assert int(opt.step.get_value()) == 8
  assert float(_nnx_loss(model, batch)) < 0.9 * first


def test_nnx_runner_donate_gives_the_same_training_and_frees_the_inputs():
  mesh = _mesh(ONE_D)
  models, opts = [], []
  for donate in (False, True):
    model = MLP(nnx.Rngs(0))
    with jax.set_mesh(mesh):
      opt = nnx.Optimizer(model, qcomm.sync(optax.adam(1e-2), bits=4, accum_steps=2),
                          wrt=nnx.Param)
    dp = qcomm.nnx_data_parallel(_nnx_loss, mesh, donate=donate)
    dp.step(model, opt, _data())  # compiled, and the inputs placed on the mesh
    before = jax.tree.leaves(nnx.state(model, nnx.Param))
    for _ in range(3):
      dp.step(model, opt, _data())
    assert all(x.is_deleted() for x in before) == donate
    models.append(model)
    opts.append(opt)
  for a, b in zip(jax.tree.leaves(nnx.state(models[0])), jax.tree.leaves(nnx.state(models[1]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="donate"):
    qcomm.nnx_data_parallel(_nnx_loss, mesh, donate="yes")


# ---- the exact oracles ---------------------------------------------------------------------------

def test_exact_diloco_with_outer_sgd_1_on_the_same_data_equals_data_parallelism():
  """Every replica sees the same batch: each replica's inner run is the same, so the mean of the
  replicas is that run, and plain averaging (outer sgd(1.0)) makes the anchor equal it."""
  names, mesh = ONE_D, _mesh(ONE_D)
  params, (x, y) = _params(), _data(4)
  same = (jnp.concatenate([x] * 3), jnp.concatenate([y] * 3))  # one copy per device
  ref = qcomm.data_parallel(_loss, qcomm.sync(optax.adam(2e-2), axis_name="data",
                                              codec=qcomm.NoCompression()), mesh)
  dl = qcomm.data_parallel(_loss, _tx("diloco", 1, names, exact=True), mesh)
  p_ref, s_ref = params, ref.init(params)
  p_dl, s_dl = params, dl.init(params)
  for i in range(6):
    p_ref, s_ref, _, _ = ref.step(p_ref, s_ref, same)
    p_dl, s_dl, loss, _ = dl.step(p_dl, s_dl, same)
    assert loss.shape == (3,)
    if i % 2 == 1:  # after each synchronisation
      for a, b in zip(jax.tree.leaves(p_dl), jax.tree.leaves(p_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
  assert int(s_dl.outer_step) == 3


@pytest.mark.parametrize("accum", [1, 2])
def test_exact_sharded_equals_replicated_through_the_runner(accum):
  names, mesh = TWO_D, _mesh(TWO_D)
  out = []
  for kind in ("sync", "sharded"):
    dp = qcomm.data_parallel(_loss, _tx(kind, accum, names, exact=True), mesh, axis_name=names)
    params = _params()
    state = dp.init(params)
    for seed in range(4):
      params, state, _, _ = dp.step(params, state, _data(12, seed))
    out.append(params)
  for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# ---- the traps of the seams ------------------------------------------------------------------------

def test_decay_after_an_accumulating_sync_acts_once_per_optimizer_step():
  """optax.chain(sync(scale_by_adam, accum 2), add_decayed_weights, scale(-lr)) through the runner
  equals the decay inside the sync: the calls that do not communicate change nothing."""
  mesh = _mesh(ONE_D)
  kw = dict(axis_name="data", codec=qcomm.NoCompression(), accum_steps=2)
  outside = optax.chain(qcomm.sync(optax.scale_by_adam(), **kw), optax.add_decayed_weights(0.1),
                        optax.scale(-0.05))
  inside = qcomm.sync(optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(0.1),
                                  optax.scale(-0.05)), **kw)
  out = []
  for tx in (outside, inside):
    dp = qcomm.data_parallel(_loss, tx, mesh)
    params = _params()
    state = dp.init(params)
    for seed in range(4):
      before = params
      params, state, _, _ = dp.step(params, state, _data(12, seed))
      if seed % 2 == 0:  # a call that only accumulates
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before)):
          np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out.append(params)
  for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("runner", ["params", "nnx"])
def test_a_batch_the_devices_cannot_split_names_its_size_and_the_device_count(runner):
  mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
  x, y = _data(250)
  tx = qcomm.sync(optax.sgd(0.1), axis_name="data")
  with pytest.raises(ValueError, match=r"250 examples, batch size not divisible by the device "
                                       r"count 8"):
    if runner == "params":
      dp = qcomm.data_parallel(_loss, tx, mesh)
      dp.step(_params(), dp.init(_params()), (x, y))
    else:
      model = MLP(nnx.Rngs(0))
      with jax.set_mesh(mesh):
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
      qcomm.nnx_data_parallel(_nnx_loss, mesh).step(model, opt, (x, y))


def test_nnx_stateful_transformation_after_an_accumulating_sync_is_refused():
  mesh = _mesh(ONE_D)
  model = MLP(nnx.Rngs(0))
  with jax.set_mesh(mesh):
    opt = nnx.Optimizer(model, optax.chain(qcomm.sync(optax.identity(), accum_steps=2),
                                           optax.adam(1e-3)), wrt=nnx.Param)
  with pytest.raises(ValueError, match="Move it inside"):
    qcomm.nnx_data_parallel(_nnx_loss, mesh).step(model, opt, _data())
  with pytest.raises(ValueError, match="Move it inside"):
    qcomm.state_partition_spec(nnx.as_pure(opt.opt_state))
  with pytest.raises(ValueError, match="Move it inside"):  # the mapping form of nnx.state
    qcomm.state_partition_spec(nnx.state(opt), "data")


def test_nnx_step_inside_nnx_jit_and_scalar_aux():
  mesh = _mesh(ONE_D)
  model = MLP(nnx.Rngs(0))
  with jax.set_mesh(mesh):
    opt = nnx.Optimizer(model, qcomm.sync(optax.adam(2e-2), accum_steps=2), wrt=nnx.Param)

  def loss_aux(m, batch):
    loss = _nnx_loss(m, batch)
    return loss, {"scalar": loss * 2}

  dp = qcomm.nnx_data_parallel(loss_aux, mesh, has_aux=True)

  @nnx.jit
  def train_step(m, o, batch):
    return dp.step(m, o, batch)

  losses = []
  for _ in range(6):
    loss, aux = train_step(model, opt, _data())
    np.testing.assert_allclose(float(aux["scalar"]), 2 * float(loss), rtol=1e-6)
    losses.append(float(loss))
  assert int(opt.step.get_value()) == 6 and losses[-1] < losses[0]
  concat = qcomm.nnx_data_parallel(loss_aux, mesh, has_aux=True, aux_reduce="concat")
  with pytest.raises(ValueError, match="aux_reduce='mean'"):
    concat.step(model, opt, _data())


# ---- mistakes a new user makes, each named with its fix ----------------------------------------

def _lin_loss(p, batch):
  return jnp.mean((batch[0] @ p["w"] - batch[1]) ** 2)


def test_clipping_before_the_sync_is_refused_and_inside_it_is_not():
  mesh = Mesh(np.array(jax.devices()), ("data",))
  sync = qcomm.sync(optax.sgd(0.1), axis_name="data", bits=4)
  with pytest.raises(ValueError, match="clips by global norm before the qcomm synchronisation"):
    qcomm.data_parallel(_lin_loss, optax.chain(optax.clip_by_global_norm(1.0), sync), mesh)
  with pytest.raises(ValueError, match="clips by global norm before"):
    qcomm.data_parallel(_lin_loss, optax.chain(qcomm.clip_by_global_norm(1.0), sync), mesh)
  # before a diloco nothing is averaged yet: the same as clipping inside it
  qcomm.data_parallel(_lin_loss, optax.chain(
      optax.clip_by_global_norm(1.0), qcomm.diloco(optax.sgd(0.1), axis_name="data", every=2)),
      mesh)
  inside = qcomm.sync(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
                      axis_name="data", bits=4)
  qcomm.data_parallel(_lin_loss, inside, mesh)
  qcomm.data_parallel(_lin_loss, optax.chain(sync, optax.clip_by_global_norm(1.0)), mesh)


def test_a_forgotten_has_aux_and_ragged_batch_leaves_are_named():
  mesh = Mesh(np.array(jax.devices()), ("data",))
  params = {"w": jnp.ones((4, 2))}
  batch = (jnp.ones((8, 4)), jnp.ones((8, 2)))
  tx = qcomm.sync(optax.sgd(0.1), axis_name="data", bits=32)
  dp = qcomm.data_parallel(lambda p, b: (_lin_loss(p, b), {"n": 1.0}), tx, mesh)
  with pytest.raises(ValueError, match="needs data_parallel\\(..., has_aux=True\\)"):
    dp.step(params, dp.init(params), batch)
  dp = qcomm.data_parallel(_lin_loss, tx, mesh, has_aux=True)
  with pytest.raises(ValueError, match="has_aux=True: loss_fn must return \\(loss, aux\\)"):
    dp.step(params, dp.init(params), batch)
  dp = qcomm.data_parallel(_lin_loss, tx, mesh)
  with pytest.raises(ValueError, match="different leading sizes \\('0': 8, '1': 16\\)"):
    dp.step(params, dp.init(params), (batch[0], jnp.ones((16, 2))))


def test_describe_total_agrees_with_its_summary_line():
  d = qcomm.describe(qcomm.sync(optax.sgd(0.1), bits=4),
                     {"w": jnp.ones((512, 64)), "b": jnp.ones(64)}, devices=8)
  lines = str(d).splitlines()
  total = [line for line in lines if line.startswith("total")][0].split()[-1]
  assert f"({total} more)" in lines[-1], (total, lines[-1])
