"""qcomm.diloco: infrequent compressed outer synchronisation (the DiLoCo family).

What is proved here:
  - the oracles: one replica (or identical data on every replica) with the exact codec and
    ``outer=optax.sgd(1.0)`` is plain ``inner`` training; one replica with ``outer=optax.sgd(a)``
    is ``optax.lookahead(inner, H, a)``'s slow weights; the pseudo-gradient's sign;
  - no collective on the calls between synchronisations (the compiled step's collectives sit
    inside the conditional), and ``describe`` counts the compiled HLO's bytes, per call = per
    sync / H;
  - bit-identical anchors (and local parameters after a sync) on every replica at D = 3 and 6,
    4 and 2 bits with error feedback, leaves that do not divide among the devices;
  - ``every`` counts the inner sync's optimizer steps when it accumulates;
  - the 2-D composition: ``diloco(sync(adam, axis_name="gpu"), axis_name="node")`` on 2 x 4;
  - the one runner: ``qcomm.data_parallel`` takes and returns the anchor (replicated, shaped like
    the model); the replicas' own parameters live in the state;
  - an orbax checkpoint of the state resumes exactly;
  - the errors that name what to fix, and the removed names that name their replacement.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm import _compat
from jax_qcomm.collectives.packing import fragment_groups
from test_protocol import hlo_sent_bytes

AX = "node"


def _mesh(d: int, name: str = AX) -> Mesh:
  return Mesh(np.array(jax.devices("cpu")[:d]), (name,))


def _params(seed: int = 0) -> dict:
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  # Leaves that do not divide among 3 or 6 devices, nor into 128-element buckets.
  return {"w": jax.random.normal(k1, (37, 29), jnp.float32) * 0.3,
          "v": jax.random.normal(k2, (7, 5, 11), jnp.float32) * 0.3,
          "b": jax.random.normal(k3, (29,), jnp.float32) * 0.1}


def _loss(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w"] + params["b"])
  z = jnp.einsum("nj,abj->nab", h[:, :11], params["v"]).reshape(x.shape[0], -1)
  return jnp.mean((z[:, :3] - y) ** 2) + 1e-3 * jnp.sum(h ** 2) / x.shape[0]


def _batches(n: int, size: int, seed: int = 1):
  rng = np.random.default_rng(seed)
  return [(jnp.asarray(rng.normal(size=(size, 37)), jnp.float32),
           jnp.asarray(rng.normal(size=(size, 3)), jnp.float32)) for _ in range(n)]


def _single(inner, params, batches):
  """Plain inner training on one device."""
  state = inner.init(params)

  @jax.jit
  def step(p, s, b):
    g = jax.grad(_loss)(p, b)
    u, s = inner.update(g, s, p)
    return optax.apply_updates(p, u), s

  for b in batches:
    params, state = step(params, state, b)
  return params


def _run(tx, d, params, batches, replicate_batch=False):
  """qcomm.data_parallel over d devices; returns (anchor, state)."""
  dp = qcomm.data_parallel(_loss, tx, _mesh(d), axis_name=AX)
  state = dp.init(params)
  for b in batches:
    if replicate_batch:
      b = jax.tree.map(lambda a: jnp.concatenate([a] * d), b)
    params, state, loss, _ = dp.step(params, state, b)
  assert loss.shape == (d,)  # one per replica: no collective across replicas between syncs
  return params, state


def _explicit(tx, d, params):
  """The explicit form over d devices (no runner): ``(init, step)`` jitted, where
  ``step(anchor, state, batch) -> (anchor, state, copies)`` takes the gradient at the replica's
  own parameters and ``copies`` is every replica's copy of the new anchor, ``(d, ...)``."""
  mesh, axes = _mesh(d), frozenset({AX})
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params), AX)

  def step(anchor, s, batch):
    g = jax.grad(_loss)(qcomm.local_params(s, anchor), batch)
    u, s = tx.update(g, s, anchor)
    anchor = optax.apply_updates(anchor, u)
    every_copy = jax.tree.map(lambda a: _compat.make_varying(a, axes)[None], anchor)
    return anchor, s, every_copy

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))
  return init, jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P(AX)),
                                     out_specs=(P(), spec, P(AX))))


def _close(a, b, **kw):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


# ---- oracles --------------------------------------------------------------------------------------

@pytest.mark.parametrize("d,replicate", [(1, False), (2, True)])
def test_exact_codec_and_outer_sgd_1_is_plain_inner_training(d, replicate):
  inner = optax.adam(3e-3)
  params, batches = _params(), _batches(12, 8)
  tx = qcomm.diloco(inner, axis_name=AX, every=4, codec=qcomm.NoCompression(),
                    outer=optax.sgd(1.0))
  anchor, state = _run(tx, d, params, batches, replicate_batch=replicate)
  want = _single(inner, params, batches)
  _close(anchor, want, rtol=2e-5, atol=2e-6)
  assert int(state.outer_step) == 3 and int(state.mini_step) == 0
  for row in range(d):  # after a sync every replica's parameters are the anchor, bit for bit
    for x, a in zip(jax.tree.leaves(state.params), jax.tree.leaves(anchor)):
      np.testing.assert_array_equal(np.asarray(x)[row], np.asarray(a))


def test_one_replica_outer_sgd_is_lookahead_slow_weights():
  inner, h, a = optax.sgd(0.05, momentum=0.9), 5, 0.5
  params, batches = _params(), _batches(15, 8)
  tx = qcomm.diloco(inner, axis_name=AX, every=h, codec=qcomm.NoCompression(),
                    outer=optax.sgd(a))
  anchor, _ = _run(tx, 1, params, batches)

  look = optax.lookahead(inner, sync_period=h, slow_step_size=a)
  lp = optax.LookaheadParams.init_synced(params)
  ls = look.init(lp)

  @jax.jit
  def step(lp, ls, b):
    g = jax.grad(_loss)(lp.fast, b)
    u, ls = look.update(g, ls, lp)
    return optax.apply_updates(lp, u), ls

  for b in batches:
    lp, ls = step(lp, ls, b)
  _close(anchor, lp.slow, rtol=1e-5, atol=1e-6)


def test_the_pseudo_gradient_is_anchor_minus_local():
  # Constant gradient g, plain SGD inner (lr 1): after H steps local = anchor - H g, so
  # delta = H g and outer sgd(a) moves the anchor by -a H g (towards the local parameters).
  h, a = 3, 0.25
  params = {"w": jnp.zeros((4, 4))}
  tx = qcomm.diloco(optax.sgd(1.0), axis_name=AX, every=h, codec=qcomm.NoCompression(),
                    outer=optax.sgd(a))
  dp = qcomm.data_parallel(lambda p, b: jnp.sum(p["w"] * b), tx, _mesh(2), axis_name=AX)
  state = dp.init(params)
  g = jnp.ones((2, 4, 4))
  for i in range(h):
    params, state, _, _ = dp.step(params, state, g)
    if i < h - 1:  # between syncs the anchor stays, the replicas move
      np.testing.assert_array_equal(np.asarray(params["w"]), 0.0)
      np.testing.assert_allclose(np.asarray(state.params["w"]), -(i + 1), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(params["w"]), -a * h, rtol=1e-6)


# ---- no collective between syncs; describe == HLO --------------------------------------------------

def _compiled(dp, params, state, batch):
  from jax_qcomm.transforms.specs import _SpecKey
  fn = dp._step_fn(_SpecKey(dp.state_spec(state)), (AX,), 0, False)
  return fn.lower(params, state, batch, ()).compile().as_text()


def _compiled_text(tx, d, params):
  dp = qcomm.data_parallel(_loss, tx, _mesh(d), axis_name=AX)
  return _compiled(dp, params, dp.init(params), _batches(1, 2 * d)[0])


@pytest.mark.parametrize("codec", [qcomm.NoCompression(), qcomm.QSGD(4), qcomm.Summable(4),
                                   qcomm.TopK(0.1, 2, chunk=64)],
                         ids=["exact", "qsgd4", "summable4", "topk"])
@pytest.mark.parametrize("d", [2, 3])
def test_describe_equals_the_compiled_hlo_and_collectives_are_conditional(codec, d):
  params = _params()
  tx = qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=50, codec=codec,
                    policy=qcomm.LeafPolicy(min_size=0))
  text = _compiled_text(tx, d, params)
  desc = qcomm.describe(tx, params, devices=d)
  assert desc.accum_steps == 50
  assert desc.sent_bytes_per_sync == pytest.approx(hlo_sent_bytes(text, d), rel=1e-9)
  assert desc.sent_bytes_per_call == pytest.approx(desc.sent_bytes_per_sync / 50)
  # Every collective is inside a conditional's branch computation, none in the entry.
  entry = text[text.index("ENTRY"):]
  entry = entry[:entry.index("\n}")]
  assert hlo_sent_bytes(entry, d) == 0, entry


# ---- bit-identical replicas -------------------------------------------------------------------------

@pytest.mark.parametrize("d", [3, 6])
@pytest.mark.parametrize("codec,ef", [(qcomm.QSGD(4), False),
                                      (qcomm.QSGD(2, rounding="nearest"), True),
                                      (qcomm.TopK(0.1, 2, chunk=64), True)],
                         ids=["qsgd4", "qsgd2_ef", "topk_ef"])
def test_anchors_are_bit_identical_on_every_replica(d, codec, ef):
  params = _params()
  tx = qcomm.diloco(optax.adam(3e-3), axis_name=AX, every=2, codec=codec, error_feedback=ef,
                    policy=qcomm.LeafPolicy(min_size=0, compress_1d=True))
  init, step = _explicit(tx, d, params)  # the gradient at the replica's own parameters
  anchor, state = params, init(params)
  for i, b in enumerate(_batches(6, 2 * d)):
    anchor, state, copies = step(anchor, state, b)
    for c, lp in zip(jax.tree.leaves(copies), jax.tree.leaves(state.params)):
      c = np.asarray(c)
      for r in range(1, d):
        np.testing.assert_array_equal(c[r], c[0])
      if i % 2 == 1:  # a synchronising call: every replica's parameters are the anchor
        np.testing.assert_array_equal(np.asarray(lp), c)
  assert int(state.outer_step) == 3
  # The replicas trained on different data: between syncs they differ.
  anchor, state, _ = step(anchor, state, _batches(1, 2 * d, seed=9)[0])
  w = np.asarray(state.params["w"])
  assert not np.array_equal(w[0], w[1])
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.outer_opt_state))
  if ef:
    assert state.residual["w"].shape == (d, 37, 29)
    assert float(jnp.max(jnp.abs(state.residual["w"]))) > 0


# ---- composition with sync on a 2-D mesh -------------------------------------------------------------

def test_diloco_over_nodes_of_sync_over_gpus_on_a_2x4_mesh():
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("node", "gpu"))
  inner = qcomm.sync(optax.adam(3e-3), axis_name="gpu", codec=qcomm.NoCompression(),
                     accum_steps=2)
  tx = qcomm.diloco(inner, axis_name="node", every=3, codec=qcomm.QSGD(4), error_feedback=True,
                    policy=qcomm.LeafPolicy(min_size=0))
  dp = qcomm.data_parallel(_loss, tx, mesh, axis_name=("node", "gpu"))
  params = _params()
  state = dp.init(params)
  spec = dp.state_spec(state)
  sync_spec = spec.inner_opt_state
  assert sync_spec.acc_grads["w"] == P("node", "gpu")
  assert sync_spec.mini_step == P("node")
  assert spec.params["w"] == P("node")
  assert state.inner_opt_state.acc_grads["w"].shape == (2, 4, 37, 29)
  batches = _batches(12, 16)
  anchor = params
  for i, b in enumerate(batches):
    anchor, state, loss, _ = dp.step(anchor, state, b)
    assert loss.shape == (2,)  # one per node
    # every 2 calls the inner sync steps; every 3 inner steps (6 calls) the nodes synchronise
    assert int(state.outer_step) == (i + 1) // 6
  assert int(state.inner_opt_state.gradient_step[0]) == 6
  for x, a in zip(jax.tree.leaves(state.params), jax.tree.leaves(anchor)):
    np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(a))
    np.testing.assert_array_equal(np.asarray(x)[1], np.asarray(a))
  # It learns: the anchor's loss on the data is below the initial one.
  data = (jnp.concatenate([b[0] for b in batches]), jnp.concatenate([b[1] for b in batches]))
  assert float(_loss(anchor, data)) < float(_loss(params, data))
  desc = qcomm.describe(tx, params, devices=2)
  assert desc.accum_steps == 6


def test_every_counts_the_inner_syncs_optimizer_steps():
  inner = qcomm.sync(optax.sgd(0.1), axis_name="gpu", codec=qcomm.NoCompression(), accum_steps=3)
  tx = qcomm.diloco(inner, axis_name="node", every=2)
  assert qcomm.describe(tx, _params(), devices=2).accum_steps == 6


# ---- checkpoints --------------------------------------------------------------------------------

def test_orbax_checkpoint_resumes_exactly(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  d = 2
  tx = qcomm.diloco(optax.adam(3e-3), axis_name=AX, every=3, codec=qcomm.QSGD(4),
                    error_feedback=True, policy=qcomm.LeafPolicy(min_size=0))
  dp = qcomm.data_parallel(_loss, tx, _mesh(d), axis_name=AX)
  local, batches = _params(), _batches(10, 2 * d)  # local: the anchor
  state = dp.init(local)
  for b in batches[:4]:  # mid-window: the replicas' parameters differ from the anchor
    local, state, _, _ = dp.step(local, state, b)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", {"local": local, "state": state})
  ckpt.wait_until_finished()
  for b in batches[4:]:
    local, state, _, _ = dp.step(local, state, b)

  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"local": local, "state": state})
  restored = ckpt.restore(tmp_path / "ckpt", target)
  local2, state2 = restored["local"], restored["state"]
  assert isinstance(state2, qcomm.DiLoCoState) and int(state2.mini_step) == 1
  for b in batches[4:]:
    local2, state2, _, _ = dp.step(local2, state2, b)
  for x, y in zip(jax.tree.leaves((local, state)), jax.tree.leaves((local2, state2))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---- bf16 models ----------------------------------------------------------------------------------

def test_bf16_params_keep_a_float32_outer_state_and_residual():
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _params())
  tx = qcomm.diloco(optax.sgd(0.05), axis_name=AX, every=2, codec=qcomm.QSGD(4),
                    error_feedback=True)
  loss = lambda p, b: _loss(jax.tree.map(lambda a: a.astype(jnp.float32), p), b)  # noqa: E731
  dp = qcomm.data_parallel(loss, tx, _mesh(2), axis_name=AX)
  state = dp.init(params)
  for b in _batches(4, 4):
    params, state, _, _ = dp.step(params, state, b)
  for tree in (state.outer_opt_state, state.residual):
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(tree))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves((params, state.params)))
  for x, a in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(x)[1], np.asarray(a))


# ---- errors ---------------------------------------------------------------------------------------

def test_removed_names_name_their_replacement():
  for name, fix in (("diloco_data_parallel", "qcomm.data_parallel"),
                    ("diloco_params", "params that qcomm.data_parallel"),
                    ("diloco_apply_updates", "optax.apply_updates"),
                    ("diloco_partition_spec", "qcomm.state_partition_spec")):
    with pytest.raises(AttributeError, match=re.escape(fix)):
      getattr(qcomm, name)


def test_varying_params_are_refused_naming_the_anchor():
  tx = qcomm.diloco(optax.sgd(0.1), axis_name=AX, every=2)
  params = _params()
  mesh = _mesh(2)
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))

  def step(lp, s, b):  # the replica's parameters passed where the anchor belongs
    p = jax.tree.map(lambda a: a[0], lp)
    return tx.update(jax.grad(_loss)(p, b), s, p)

  with jax.set_mesh(mesh):
    state = tx.init(params)
  local = jax.tree.map(lambda a: jnp.stack([a, a]), params)
  with pytest.raises(ValueError, match="must be the anchor"):
    jax.eval_shape(jax.shard_map(step, mesh=mesh, in_specs=(P(AX), spec, P(AX)),
                                 out_specs=(P(), spec)), local, state, _batches(1, 4)[0])


def test_a_data_axis_no_transformation_synchronises_is_refused():
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("node", "gpu"))
  tx = qcomm.diloco(optax.sgd(0.1), axis_name="node", every=2)
  dp = qcomm.data_parallel(_loss, tx, mesh, axis_name=("node", "gpu"))
  with pytest.raises(ValueError, match="no qcomm transformation in tx synchronises"):
    dp.init(_params())


def test_a_state_passed_replicated_is_refused():
  tx = qcomm.diloco(optax.adam(0.1), axis_name=AX, every=2)
  params = _params()
  mesh = _mesh(2)
  with jax.set_mesh(mesh):
    state = tx.init(params)

  def step(p, s, b):
    return tx.update(jax.grad(_loss)(qcomm.local_params(s, p), b), s, p)

  with pytest.raises(ValueError, match="state_partition_spec"):
    jax.eval_shape(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(AX)),
                                 out_specs=(P(), P())), params, state, _batches(1, 4)[0])


def test_same_axis_inside_and_outside_is_refused():
  tx = qcomm.diloco(qcomm.sync(optax.sgd(0.1), axis_name="node"), axis_name="node", every=2)
  with pytest.raises(ValueError, match="axis_name"):
    jax.eval_shape(tx.init, _params())


def test_specs_are_read_from_the_states_inside_any_container():
  """diloco(sync) inside optax.chain and inject_hyperparams: the spec function needs no axis
  names (each state carries its own); an axis_name that does not cover them is refused."""
  inner = qcomm.sync(optax.sgd(0.1), axis_name="gpu", accum_steps=2, shard_state=True)
  tx = optax.chain(optax.clip(1.0), qcomm.diloco(inner, axis_name="node", every=2))
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("node", "gpu"))
  with jax.set_mesh(mesh):
    shapes = jax.eval_shape(tx.init, _params())
  spec = qcomm.state_partition_spec(shapes)
  assert spec == qcomm.state_partition_spec(shapes, ("node", "gpu"))
  d = spec[1]
  assert d.params["w"] == P("node") and d.residual == () and d.outer_opt_state[0].trace == {
      "w": P(), "v": P(), "b": P()}
  assert d.inner_opt_state.master["w"] == P("node", "gpu")
  assert d.inner_opt_state.acc_grads["w"] == P("node", "gpu")
  assert d.inner_opt_state.mini_step == P("node")
  with pytest.raises(ValueError, match="must name the axes of every qcomm state"):
    qcomm.state_partition_spec(shapes, "node")


# ---- the LM trainer's DiLoCo mode ------------------------------------------------------------------

def test_lm_trainer_runs_diloco_on_a_node_by_data_mesh():
  pytest.importorskip("flax")
  from configs import lm_bytes
  from training import lm_diloco

  config = lm_bytes.get_config("quick")
  config.num_steps, config.warmup_steps, config.eval_every_steps = 20, 2, 10
  config.bits, config.fragments = 4, 5  # a fifth of the model every inner step, in turn
  result = lm_diloco.run(config, every=5, replicas=2, outer_lr=0.7, outer_momentum=0.9,
                         quiet=True)
  assert result["outer_steps"] == 20 and result["total_notfinite"] == 0
  assert result["fragments"] == 5
  assert result["curve"][-1][1] < result["curve"][0][1]  # the anchor learned
  # 4-bit outer codec: bytes per parameter per inner step = bytes per sync / H / parameters.
  assert result["bytes_per_param_step"] == pytest.approx(
      result["sent_bytes_per_sync"] / 5 / result["params"])


def test_time_to_loss_driver_stops_at_the_target_and_counts_bytes_per_step():
  """training/lm_slow_link in one process (two "nodes" of 4 host devices): DDP with a codec
  across nodes, and diloco; the clock starts after the first step and stops at the target."""
  pytest.importorskip("flax")
  from configs import lm_bytes
  from training import lm_slow_link

  config = lm_bytes.get_config("quick")
  config.num_steps, config.warmup_steps = 20, 2
  ddp = lm_slow_link.run(config, method="ddp", every=1, outer_lr=0.0, outer_momentum=0.0,
                         target=None, eval_every=10)
  assert ddp["steps_run"] == 20 and ddp["target_s"] is None
  assert [p[0] for p in ddp["curve"]] == [0, 10, 20] and ddp["curve"][-1][1] < ddp["curve"][0][1]
  assert ddp["sent_bytes_per_step"] == ddp["sent_bytes_per_sync"]  # every step, across 2 nodes
  config.bits = 4
  dl = lm_slow_link.run(config, method="diloco", every=5, outer_lr=1.0, outer_momentum=0.0,
                        target=ddp["curve"][0][1], eval_every=10)  # reached at the first eval
  assert dl["steps_run"] == 10 and dl["target_s"] == dl["curve"][-1][2] > 0
  assert dl["sent_bytes_per_step"] == pytest.approx(dl["sent_bytes_per_sync"] / 5)
  with pytest.raises(ValueError, match="method"):
    lm_slow_link.run(config, method="ring", every=5, outer_lr=1.0, outer_momentum=0.0,
                     target=None, eval_every=10)


def test_with_a_sync_inside_each_device_sends_its_share_across_nodes():
  """The pseudo-gradient is the same on the 4 devices of a node: the outer allreduce carries a
  quarter of it per device (slices, then an all-gather inside the node), and the nodes' anchors
  equal the flat allreduce's (exact outer codec: the mean of two copies either way)."""
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("node", "gpu"))
  params = _params()
  n = sum(x.size for x in jax.tree.leaves(params))
  inner = qcomm.sync(optax.adam(3e-3), axis_name="gpu", codec=qcomm.NoCompression())
  tx = qcomm.diloco(inner, axis_name="node", every=2, codec=qcomm.NoCompression(),
                    policy=qcomm.LeafPolicy(min_size=0))
  dp = qcomm.data_parallel(_loss, tx, mesh, axis_name=("node", "gpu"))
  state = dp.init(params)
  text = _compiled(dp, params, state, _batches(1, 16)[0])
  across = []  # elements of the all-reduces over the node axis (replica_groups=mesh[..] {'node'})
  for line in text.splitlines():
    m = re.search(r"= f32\[([0-9,]*)\][^=]*? all-reduce\(.*replica_groups=mesh\[[^]]*\] \{'node'\}",
                  line)
    if m:
      across.append(int(np.prod([int(v) for v in m.group(1).split(",") if v])))
  assert across and sum(across) <= -(-n // 4), (across, n)  # a share, not the whole
  for b in _batches(4, 16):
    params, state, _, _ = dp.step(params, state, b)
  assert int(state.outer_step) == 2
  for x, a in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(a))
    np.testing.assert_array_equal(np.asarray(x)[1], np.asarray(a))


def test_composed_on_a_2x3_mesh_keeps_every_device_identical():
  """node x gpu = 2 x 3 (3 divides no leaf, nor 3 buckets): 4-bit inner sync with error feedback,
  4-bit outer sync with error feedback. After every outer sync all 6 devices hold the anchor, bit
  for bit; between syncs the 3 devices of a node agree with each other."""
  mesh = Mesh(np.array(jax.devices("cpu")[:6]).reshape(2, 3), ("node", "gpu"))
  inner = qcomm.sync(optax.adam(3e-3), axis_name="gpu", codec=qcomm.QSGD(4, rounding="nearest"),
                     error_feedback=True, policy=qcomm.LeafPolicy(min_size=0))
  tx = qcomm.diloco(inner, axis_name="node", every=2, codec=qcomm.QSGD(4), error_feedback=True,
                    policy=qcomm.LeafPolicy(min_size=0))
  dp = qcomm.data_parallel(_loss, tx, mesh, axis_name=("node", "gpu"))
  anchor = _params()
  state = dp.init(anchor)

  def copies(tree):  # every device's copy of every leaf, as numpy
    out = [[np.asarray(s.data) for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]
           for x in jax.tree.leaves(tree)]
    assert all(len(c) == 6 and c[0].shape[0] == 1 for c in out)  # one node's copy per device
    return out

  for i, b in enumerate(_batches(6, 12)):
    anchor, state, _, _ = dp.step(anchor, state, b)
    for leaf in copies(state.params):
      by_node = {}
      for shard, dev in zip(leaf, sorted(mesh.devices.flat, key=lambda d: d.id)):
        node = int(np.argwhere(mesh.devices == dev)[0][0])
        by_node.setdefault(node, []).append(shard)
      for shards in by_node.values():
        assert all(np.array_equal(shards[0], s) for s in shards[1:]), i
    if (i + 1) % 2 == 0:  # an outer sync: every device holds the anchor
      for x, a in zip(jax.tree.leaves(state.params), jax.tree.leaves(anchor)):
        for r in range(2):
          np.testing.assert_array_equal(np.asarray(x)[r], np.asarray(a))
  assert int(state.outer_step) == 3


# ---- streaming fragments --------------------------------------------------------------------------

def test_fragments_are_consecutive_leaves_of_about_equal_size():
  from jax_qcomm.collectives.packing import fragment_groups
  assert fragment_groups([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
  assert fragment_groups([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
  assert fragment_groups([1, 2, 3], 3) == [[0], [1], [2]]
  assert fragment_groups([5] * 7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
  with pytest.raises(ValueError, match="fragments must be at most the number of parameter leaves"):
    fragment_groups([5, 5], 3)
  with pytest.raises(ValueError, match="fragments must divide every"):
    qcomm.diloco(optax.sgd(0.1), axis_name=AX, every=6, fragments=4)
  with pytest.raises(ValueError, match="fragments must be"):
    qcomm.diloco(optax.sgd(0.1), axis_name=AX, every=6, fragments=0)


@pytest.mark.parametrize("d,ef", [(3, True), (2, False)])
def test_fragments_synchronise_in_turn_and_keep_replicas_identical(d, ef):
  """fragments=3, every=6: every 2 calls one fragment (in turn) is averaged and becomes the
  anchor on every replica, bit for bit; the other leaves keep each replica's own values; after a
  whole round every leaf has been synchronised once, and each fragment's outer state moved only
  at its own synchronisations."""
  params = _params()
  tx = qcomm.diloco(optax.adam(3e-3), axis_name=AX, every=6, fragments=3,
                    codec=qcomm.QSGD(2, rounding="nearest") if ef else qcomm.QSGD(4),
                    error_feedback=ef, policy=qcomm.LeafPolicy(min_size=0, compress_1d=True))
  groups = fragment_groups([x.size for x in jax.tree.leaves(params)], 3)
  assert groups == [[0], [1], [2]]  # b, v, w (the tree's order)
  init, step = _explicit(tx, d, params)
  anchor, state = params, init(params)
  assert isinstance(state.outer_opt_state, tuple) and len(state.outer_opt_state) == 3
  names = ["b", "v", "w"]
  for i, b in enumerate(_batches(12, 2 * d)):
    before = anchor
    anchor, state, copies = step(anchor, state, b)
    synced = (i // 2) % 3 if i % 2 == 1 else None
    for j, name in enumerate(names):
      c, lp = np.asarray(copies[name]), np.asarray(state.params[name])
      for r in range(1, d):
        np.testing.assert_array_equal(c[r], c[0])  # the anchor: the same on every replica
      if j == synced:  # the fragment just synchronised: every replica holds the anchor
        np.testing.assert_array_equal(lp, c)
        assert not np.array_equal(c[0], np.asarray(before[name]))
      else:  # the anchor did not move; the replicas trained apart on their own data
        np.testing.assert_array_equal(c[0], np.asarray(before[name]))
        assert not np.array_equal(lp[0], lp[1])
  assert int(state.outer_step) == 6  # two whole rounds
  for o in state.outer_opt_state:  # each fragment's Nesterov trace moved
    assert all(float(jnp.max(jnp.abs(t))) > 0 for t in jax.tree.leaves(o)
               if jnp.issubdtype(t.dtype, jnp.floating))


def test_fragments_send_a_share_per_synchronisation_and_describe_equals_the_hlo():
  params = _params()
  full = qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=6, codec=qcomm.QSGD(4),
                      policy=qcomm.LeafPolicy(min_size=0))
  frag = qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=6, codec=qcomm.QSGD(4),
                      policy=qcomm.LeafPolicy(min_size=0), fragments=3)
  d = 3
  a, b = qcomm.describe(full, params, devices=d), qcomm.describe(frag, params, devices=d)
  # The same round: each leaf once per 6 calls (packing apart changes only the padding).
  assert b.sent_bytes_per_call == pytest.approx(a.sent_bytes_per_call, rel=0.05)
  text = _compiled_text(frag, d, params)
  # One allreduce per fragment, each in its own branch; together they are the round's bytes.
  assert hlo_sent_bytes(text, d) == pytest.approx(b.sent_bytes_per_sync, rel=1e-9)
  per_leaf = {leaf.path: leaf.sent_bytes for leaf in b.leaves}
  assert max(per_leaf.values()) < 0.8 * b.sent_bytes_per_sync  # the peak: the largest fragment
  # Small communication buffers split a fragment into several allreduces: still the HLO's bytes.
  split = qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=6, codec=qcomm.QSGD(4),
                       policy=qcomm.LeafPolicy(min_size=0), fragments=2, comm_bucket_size=256)
  assert hlo_sent_bytes(_compiled_text(split, d, params), d) == pytest.approx(
      qcomm.describe(split, params, devices=d).sent_bytes_per_sync, rel=1e-9)


def test_the_runner_runs_fragments_and_matches_the_explicit_form():
  params, batches, d = _params(), _batches(8, 6), 3
  tx = qcomm.diloco(optax.adam(3e-3), axis_name=AX, every=6, fragments=3, codec=qcomm.QSGD(4),
                    policy=qcomm.LeafPolicy(min_size=0, compress_1d=True))
  anchor, state = _run(tx, d, params, batches)
  assert int(state.outer_step) == 4
  init, step = _explicit(tx, d, params)
  a, s = params, init(params)
  for b in batches:
    a, s, _ = step(a, s, b)
  for x, y in zip(jax.tree.leaves(anchor), jax.tree.leaves(a)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fragments_over_nodes_of_a_sharded_sync_over_gpus():
  """fragments=3 with a sharded, accumulating sync inside on a 2 x 4 mesh: a fragment every
  2 calls (one inner step of 2 micro-steps), every device of both nodes holding the same anchor,
  and after a whole round (12 calls) the last fragment's leaves are the anchor on both nodes."""
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("node", "gpu"))
  inner = qcomm.sync(optax.adam(3e-3), axis_name="gpu", codec=qcomm.NoCompression(),
                     accum_steps=2, shard_state=True)
  tx = qcomm.diloco(inner, axis_name="node", every=3, fragments=3, codec=qcomm.QSGD(4),
                    policy=qcomm.LeafPolicy(min_size=0))
  dp = qcomm.data_parallel(_loss, tx, mesh, axis_name=("node", "gpu"))
  params = _params()
  anchor, state = params, dp.init(params)
  for i, b in enumerate(_batches(12, 16)):
    anchor, state, loss, _ = dp.step(anchor, state, b)
    assert int(state.outer_step) == (i + 1) // 2
  w = np.asarray(state.params["w"])  # w is the last fragment, synchronised on the last call
  np.testing.assert_array_equal(w[0], np.asarray(anchor["w"]))
  np.testing.assert_array_equal(w[1], np.asarray(anchor["w"]))
  b0 = np.asarray(state.params["b"])  # b was synchronised 4 calls ago: the nodes drifted apart
  assert not np.array_equal(b0[0], b0[1])
  assert qcomm.describe(tx, params, devices=2).accum_steps == 6


# ---- a replica left out of the mean (the elastic runner's newly admitted process) -----------------

def _outer_program(tx, nodes, data, absent=None):
  """The outer phase alone over a ``nodes x data`` mesh (axes "node", "data"):
  ``(anchor, state) -> (anchor, state, copies)``; the node ``absent`` (if any) is left out of
  the mean, the flag varying over "node" only, as the elastic runner passes it."""
  from jax_qcomm.transforms.diloco import PHASE_ARG, PRESENT_ARG
  mesh = Mesh(np.array(jax.devices("cpu")[:nodes * data]).reshape(nodes, data), ("node", "data"))
  axes = frozenset({"node", "data"})
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, _params()), ("node", "data"))

  def outer(anchor, s):
    extra = {PHASE_ARG: "outer"}
    if absent is not None:
      extra[PRESENT_ARG] = jax.lax.axis_index("node") != absent
    u, s = tx.update(None, s, anchor, **extra)
    anchor = optax.apply_updates(anchor, u)
    return anchor, s, jax.tree.map(lambda a: _compat.make_varying(a, axes)[None, None], anchor)

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))
  return init, jax.jit(jax.shard_map(outer, mesh=mesh, in_specs=(P(), spec),
                                     out_specs=(P(), spec, P("node", "data"))))


@pytest.mark.parametrize("data,inner_sync", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("codec", [qcomm.NoCompression(), qcomm.QSGD(4), qcomm.Summable(4)],
                         ids=["exact", "qsgd4", "summable4"])
def test_an_absent_replica_counts_for_nothing_in_the_mean(codec, data, inner_sync):
  # Three nodes (of `data` replicas each, or of a sync over `data` inside), the third absent
  # with non-finite parameters of its own: the new anchor is the one the two other nodes alone
  # make (exactly so with the exact codec), bit-identical on every device, and the absent
  # ones' residual stays zero.
  params = _params()
  inner = (qcomm.sync(optax.sgd(0.1), axis_name="data", codec=qcomm.NoCompression())
           if inner_sync else optax.sgd(0.1))
  tx = qcomm.diloco(inner, axis_name="node" if inner_sync else ("node", "data"), every=2,
                    codec=codec, policy=qcomm.LeafPolicy(min_size=0, compress_1d=True))
  rng = np.random.default_rng(3)
  per_node = 1 if inner_sync else data  # replicas per node
  local = [jax.tree.map(lambda p: p + 0.05 * rng.normal(size=p.shape).astype(np.float32),
                        params) for _ in range(2 * per_node)]
  local += [jax.tree.map(lambda p: jnp.full(p.shape, jnp.nan), params)] * per_node

  def run(nodes, absent=None):
    init, outer = _outer_program(tx, nodes, data, absent)
    s = init(params)
    rows = jax.tree.map(lambda *x: jnp.stack(x), *local[:nodes * per_node])
    s = s._replace(params=rows, mini_step=jnp.full_like(s.mini_step, 2))
    return outer(params, s)

  anchor3, state3, copies = run(3, absent=2)
  anchor2, _, _ = run(2)
  for c in jax.tree.leaves(copies):
    c = np.asarray(c).reshape(3 * data, *c.shape[2:])
    assert np.isfinite(c).all()
    for r in range(1, 3 * data):
      np.testing.assert_array_equal(c[r], c[0])
  moved = [np.max(np.abs(np.asarray(a) - np.asarray(p)))
           for a, p in zip(jax.tree.leaves(anchor3), jax.tree.leaves(params))]
  assert min(moved) > 0  # the present replicas moved it
  if isinstance(codec, qcomm.NoCompression):
    _close(anchor3, anchor2, rtol=1e-6, atol=1e-7)
  else:
    _close(anchor3, anchor2, rtol=0, atol=0.02)  # the rounding draws differ
  for r in jax.tree.leaves(state3.residual):  # rows by node first
    np.testing.assert_array_equal(np.asarray(r)[2 * r.shape[0] // 3:], 0)


def test_present_is_refused_outside_the_plain_outer_phase():
  from jax_qcomm.transforms.diloco import PHASE_ARG, PRESENT_ARG
  tx = qcomm.diloco(optax.sgd(0.1), axis_name=AX, every=2, fragments=2)
  params = _params()
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params), AX)

  def outer(anchor, s):
    return tx.update(None, s, anchor, **{PHASE_ARG: "outer", PRESENT_ARG: True})

  state = jax.jit(jax.shard_map(tx.init, mesh=_mesh(2), in_specs=P(), out_specs=spec))(params)
  with pytest.raises(ValueError, match=f"{PRESENT_ARG} needs .*fragments=1"):
    jax.jit(jax.shard_map(outer, mesh=_mesh(2), in_specs=(P(), spec),
                          out_specs=(P(), spec)))(params, state)
