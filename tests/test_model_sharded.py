"""Parameters sharded over a model axis inside each data replica (tensor parallel, FSDP inside a
node), through the one runner: the layout is kept in and out, exact training equals the
replicated run, every device sends only its shard's bytes, replicas along the data axis stay
bit-identical, and what cannot run on shards is a clear error."""

from __future__ import annotations

import re

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_qcomm as qcomm
from tests._launch import launch_workers
from tests.test_protocol import _COLLECTIVE, _shape_bytes

# Leaves whose unsharded dimensions neither data axis size (2, 4) divides; the sharded dimension
# (60, 28) splits over 2 and 4 model devices.
SHAPES = {"w1": (15, 60), "b1": (60,), "w2": (60, 7), "scale": (7,)}
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "scale": P()}


def _params(seed=0):
  keys = jax.random.split(jax.random.key(seed), len(SHAPES))
  return {k: jax.random.normal(key, s) * 0.2 for (k, s), key in zip(SHAPES.items(), keys)}


def _batch(n=24, seed=1):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (n, 15)), jax.random.normal(ky, (n, 7))


def loss_fn(p, batch):
  x, y = batch
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] * p["scale"] - y) ** 2)


def _mesh(shape):
  return Mesh(np.array(jax.devices()[:shape[0] * shape[1]]).reshape(shape), ("data", "model"))


def _place(params, mesh, specs=SPECS):
  return jax.device_put(params, {k: NamedSharding(mesh, specs[k]) for k in params})


def _train(mesh, tx, sharded, steps=5, batch=None):
  dp = qcomm.data_parallel(loss_fn, tx, mesh)
  params = _place(_params(), mesh) if sharded else _params()
  state = dp.init(params)
  losses = []
  for i in range(steps):
    params, state, loss, _ = dp.step(params, state, batch or _batch(seed=10 + i))
    losses.append(float(np.mean(loss)))  # diloco: one loss per replica
  return params, state, losses


def _specs_of(tree):
  """Each leaf's PartitionSpec, trailing Nones dropped (P("model", None) is P("model"))."""
  def norm(x):
    entries = list(x.sharding.spec)
    while entries and entries[-1] is None:
      entries.pop()
    return P(*entries)
  return {k: norm(v) for k, v in tree.items()}


WANT = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model"), "scale": P()}


def _assert_replicas_identical(tree):
  """Every shard of every leaf is bit-identical on the devices that hold the same index."""
  for leaf in jax.tree_util.tree_leaves(tree):
    by_index = {}
    for shard in leaf.addressable_shards:
      by_index.setdefault(str(shard.index), []).append(np.asarray(shard.data).tobytes())
    for index, copies in by_index.items():
      assert all(c == copies[0] for c in copies), f"replicas of shard {index} differ"


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("accum_steps", [1, 2])
@pytest.mark.parametrize("shard_state", [False, True])
def test_exact_training_equals_the_replicated_run_and_keeps_the_layout(shape, accum_steps,
                                                                      shard_state):
  mesh = _mesh(shape)
  tx = qcomm.sync(optax.adam(1e-2), axis_name="data", bits=32, accum_steps=accum_steps)
  want, _, want_losses = _train(mesh, tx, sharded=False)
  tx = qcomm.sync(optax.adam(1e-2), axis_name="data", bits=32, accum_steps=accum_steps,
                  shard_state=shard_state)
  got, state, got_losses = _train(mesh, tx, sharded=True)
  # The same math in another partitioning: float32 sums in another order (tolerance 1e-5).
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
  assert _specs_of(got) == WANT
  if shard_state:  # each device's flat part of a model-sharded leaf: 1 / (data x model) of it
    assert state.master["w1"].sharding.spec == P(("data", "model"))
    assert state.master["scale"].sharding.spec == P("data")
    d, m = shape  # the (15, 60 / m) shard's rows split over d devices, the last padded
    assert state.master["w1"].addressable_shards[0].data.size == -(-15 // d) * (60 // m)
  else:
    assert _specs_of(state.inner_opt_state[0].mu) == WANT
  _assert_replicas_identical((got, state))


@pytest.mark.parametrize("codec", [dict(bits=4, error_feedback=True, accum_steps=2),
                                   dict(codec=qcomm.Summable(4)), dict(codec=qcomm.TopK(0.25)),
                                   dict(bits=16)], ids=["qsgd4_ef_accum", "summable4", "topk",
                                                        "wire16"])
def test_compressed_sync_on_shards_trains_and_replicas_stay_identical(codec):
  mesh = _mesh((2, 4))
  tx = qcomm.sync(optax.adam(2e-2), axis_name="data", min_size=16, **codec)
  batch = _batch(seed=3)
  params, state, losses = _train(mesh, tx, sharded=True, steps=8, batch=batch)
  assert losses[-1] < losses[0], losses
  assert _specs_of(params) == WANT
  if codec.get("error_feedback"):
    residual = state.residual
    assert residual["w1"].sharding.spec == P("data", None, "model")
    assert residual["scale"].sharding.spec == P("data")
  _assert_replicas_identical((params, state.inner_opt_state))


def test_diloco_keeps_the_layout():
  mesh = _mesh((2, 4))
  tx = qcomm.diloco(optax.adam(1e-2), axis_name="data", every=2, codec=qcomm.QSGD(4))
  params, state, losses = _train(mesh, tx, sharded=True, steps=4)
  assert _specs_of(params) == WANT
  _assert_replicas_identical(params)


def test_explicit_axes_and_a_step_inside_the_callers_jit():
  mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes

  def explicit_loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P()) * p["scale"]
    return jnp.mean((out - y) ** 2)

  tx = qcomm.sync(optax.sgd(0.1), axis_name="data", bits=4, min_size=16)
  dp = qcomm.data_parallel(explicit_loss, tx, mesh)
  params = _place(_params(), mesh)
  state = dp.init(params)
  params, state, loss, _ = jax.jit(dp.step)(params, state, _batch())
  assert _specs_of(params) == WANT
  assert np.isfinite(float(loss))


def _data_axis_bytes(text: str, d: int) -> float:
  """Bytes each device sends across the data axis, from the compiled HLO (the collectives whose
  replica groups are the data axis)."""
  factor = {"all-reduce": 2 * (d - 1) / d, "all-gather": (d - 1) / d, "all-to-all": (d - 1) / d,
            "reduce-scatter": d - 1, "collective-permute": 1}
  total = 0.0
  for line in text.splitlines():
    if "{'data'}" not in line:
      continue
    for shape, op in _COLLECTIVE.findall(line):
      total += factor[op] * sum(_shape_bytes(shape))
  return total


@pytest.mark.parametrize("bits", [32, 4])
def test_each_device_sends_its_shard_and_describe_equals_the_hlo(bits):
  d, m = 2, 4
  mesh = _mesh((d, m))
  big = {"w1": (64, 512), "w2": (512, 64)}
  specs = {"w1": P(None, "model"), "w2": P("model", None)}
  params = {k: jnp.ones(s) * 0.01 for k, s in big.items()}

  def loss(p, batch):
    return jnp.mean((jnp.tanh(batch[0] @ p["w1"]) @ p["w2"] - batch[1]) ** 2)

  tx = qcomm.sync(optax.sgd(0.1), axis_name="data", bits=bits)
  dp = qcomm.data_parallel(loss, tx, mesh)
  batch = (jnp.ones((8, 64)), jnp.ones((8, 64)))
  sent = {}
  for sharded in (False, True):
    p = _place(params, mesh, specs) if sharded else params
    state = dp.init(p)
    text = jax.jit(dp.step).lower(p, state, batch).compile().as_text()
    hlo = _data_axis_bytes(text, d) - 2 * (d - 1) / d * 4  # less the loss's pmean
    described = qcomm.describe(tx, p, devices=d).sent_bytes_per_sync
    assert described == pytest.approx(hlo, rel=1e-9), (sharded, described, hlo)
    sent[sharded] = hlo
    if sharded and bits < 32:  # each message is a shard's: no gather over "model" before it
      messages = re.findall(r"u8\[1,(\d+)\]\{1,0\}, u8\[1,\d+\]\{1,0\}\) all-to-all", text)
      whole = 2 * 64 * 512 * (bits / 8 + 8 / 128)  # both leaves' payloads, 4 bits + headers
      assert messages and all(d * int(n) <= 1.1 * whole / m for n in messages), messages
  assert sent[True] <= 1.1 * sent[False] / m, sent


def test_state_partition_spec_combines_the_parameters_specs():
  mesh = _mesh((2, 4))
  tx = qcomm.sync(optax.adam(1e-2), axis_name="data", bits=4, error_feedback=True, min_size=16)
  params = _place(_params(), mesh)
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params), "data", params=params)
  assert spec.inner_opt_state[0].mu == {**SPECS, "w2": P("model")}
  assert spec.residual["w1"] == P("data", None, "model")
  assert spec.residual["b1"] == P("data", "model")
  assert spec.key == P()


def test_errors_name_the_fix():
  mesh = _mesh((2, 4))
  tx = qcomm.sync(optax.sgd(0.1), axis_name="data", bits=4)
  dp = qcomm.data_parallel(loss_fn, tx, mesh)
  with pytest.raises(ValueError, match="param_spec entries must name only the mesh axes \\['model'\\]"):
    qcomm.data_parallel(loss_fn, tx, mesh, param_spec={**SPECS, "w1": P("model", "data")})
  over_data = jax.device_put({"w": jnp.ones((16, 60))}, NamedSharding(mesh, P("data", "model")))
  with pytest.raises(ValueError, match="shards it over the data axis.*shard_state=True"):
    dp.init(over_data)
  uneven = qcomm.data_parallel(loss_fn, tx, mesh, param_spec={**SPECS, "scale": P("model")})
  with pytest.raises(ValueError, match="dimension 0 \\(7\\).*do not divide"):
    uneven.init(_params())
  with pytest.raises(ValueError, match="PowerSGD"):
    _train(mesh, qcomm.sync(optax.sgd(0.1), axis_name="data", codec=qcomm.PowerSGD(1),
                            min_size=16), sharded=True, steps=1)
  with pytest.raises(ValueError, match="param_spec is not supported with elastic=True"):
    qcomm.data_parallel(loss_fn, qcomm.diloco(optax.sgd(0.1), axis_name="data", every=2), mesh,
                        elastic=True, param_spec=SPECS)


# ---- the collectives in your own partial-manual shard_map ----------------------------------------

def _explicit_gradient():
  mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes
  g = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32)
  return mesh, g, jax.device_put(g, NamedSharding(mesh, P("data", "model")))


def test_collectives_on_explicit_model_shards_encode_each_shard():
  mesh, g, placed = _explicit_gradient()

  def step(x, key):
    total = qcomm.allreduce(x, "data", codec=qcomm.QSGD(4), key=key)
    block = qcomm.reduce_scatter(x, "data", codec=qcomm.NoCompression())
    return total, block, qcomm.all_gather(block, "data", codec=qcomm.NoCompression(), tiled=True)

  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P()),
                             out_specs=(P(), P("data"), P()), axis_names={"data"}))
  total, block, gathered = fn(placed, jax.random.key(0))
  want = (g[:64] + g[64:]) / 2
  assert total.sharding.spec == P(None, "model") and gathered.sharding.spec == P(None, "model")
  np.testing.assert_allclose(np.asarray(gathered), want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(block), want, rtol=1e-6, atol=1e-6)
  err = np.linalg.norm(np.asarray(total) - want) / np.linalg.norm(want)
  assert err < 0.3, err  # 4 bits: about 0.2 on normal values, as for a whole leaf
  text = fn.lower(placed, jax.random.key(0)).compile().as_text()
  # QSGD 4 of one (64, 64) shard: 4096 values, 2048 B + 256 B of headers, in 2 rows
  rows = re.findall(r"u8\[1,(\d+)\]\{1,0\}, u8\[1,\d+\]\{1,0\}\) all-to-all", text)
  assert rows == ["1152"], rows


def test_auto_model_axes_in_your_own_shard_map_warn_of_the_whole_payload():
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))  # Auto axes
  g = jax.device_put(jnp.ones((128, 256)), NamedSharding(mesh, P("data", "model")))
  step = jax.shard_map(lambda x, k: qcomm.allreduce(x, "data", key=k), mesh=mesh,
                       in_specs=(P("data"), P()), out_specs=P(), axis_names={"data"})
  with pytest.warns(UserWarning, match="leaves the Auto axes \\['model'\\] to XLA"):
    jax.jit(step).lower(g, jax.random.key(0))


# ---- Flax NNX: nnx.with_partitioning ----------------------------------------------------------

def test_nnx_model_with_partitioning_keeps_its_layout_and_equals_the_replicated_run():
  from flax import nnx  # noqa: PLC0415

  mesh = _mesh((2, 4))
  init = nnx.initializers.lecun_normal()

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(15, 60, kernel_init=nnx.with_partitioning(init, (None, "model")),
                           bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(),
                                                           ("model",)), rngs=rngs)
      self.l2 = nnx.Linear(60, 7, kernel_init=nnx.with_partitioning(init, ("model", None)),
                           rngs=rngs)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.l1(x)))

  def make(sharded):
    with jax.set_mesh(mesh):
      model = MLP(nnx.Rngs(0))
    if not sharded:  # the same values, replicated
      nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    with jax.set_mesh(mesh):
      # accum_steps=1 and no error feedback: flax gives every optimizer-state leaf its
      # parameter's sharding annotation, which a per-device part (a leading device axis more)
      # cannot take (docs/usage.md, "Models sharded inside a node").
      tx = qcomm.sync(optax.adam(1e-2), axis_name="data", bits=32)
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  dp = qcomm.nnx_data_parallel(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), mesh)
  out = {}
  for sharded in (False, True):
    model, optimizer = make(sharded)
    for i in range(4):
      dp.step(model, optimizer, _batch(seed=20 + i))
    out[sharded] = (nnx.state(model, nnx.Param), nnx.as_pure(optimizer.opt_state))
  kernel = out[True][0]["l1"]["kernel"]
  assert kernel.sharding.spec == P(None, "model")
  assert out[True][1].inner_opt_state[0].mu["l2"]["kernel"].sharding.spec in (P("model"), P("model", None))
  for a, b in zip(jax.tree_util.tree_leaves(out[True][0]), jax.tree_util.tree_leaves(out[False][0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  _assert_replicas_identical(out[True])


# ---- across processes: the model axis inside each, the data axis between them --------------------

@pytest.mark.multiprocess
def test_two_processes_with_the_model_sharded_in_each(tmp_path):
  import json  # noqa: PLC0415

  launch_workers("model_sharded_mp_worker.py", str(tmp_path), local_devices=4)
  shards = [dict(np.load(tmp_path / f"proc{p}.npz")) for p in range(2)]
  layouts = [json.loads((tmp_path / f"proc{p}.json").read_text()) for p in range(2)]
  assert layouts[0] == layouts[1]
  assert layouts[0]["exact_sharded/w1"] == str(P(None, "model"))
  assert layouts[0]["q4_sharded/w2"] in (str(P("model")), str(P("model", None)))
  # Each process holds all 4 model shards of every leaf once (its 4 devices); the other process
  # (the other data replica) holds the same bits.
  by_shard = [{} for _ in range(2)]
  for p in range(2):
    for key, value in shards[p].items():
      run, leaf, index, _ = key.split("/")
      by_shard[p][(run, leaf, index)] = value
  assert by_shard[0].keys() == by_shard[1].keys()
  for key in by_shard[0]:
    assert by_shard[0][key].tobytes() == by_shard[1][key].tobytes(), key
  # The exact sharded run equals the replicated one (float32 sums in another order).
  for (run, leaf, index), value in by_shard[0].items():
    if run == "exact_sharded":
      whole = next(v for (r, l, _), v in by_shard[0].items() if r == "exact_replicated" and l == leaf)
      sl = tuple(slice(*map(int, part.split(":"))) if part != "None:None" else slice(None)
                 for part in index.split(","))
      np.testing.assert_allclose(value, whole[sl], rtol=1e-5, atol=1e-6)


def test_a_step_written_by_hand_manual_over_every_axis():
  """Fully manual tensor parallelism: shard_map over (data, model) with the parameters' own specs
  and qcomm.state_partition_spec(..., params=) for the state. sync runs per shard (its finite
  guard adds the shards' marks over "model" by itself: the state's counters stay replicated),
  trains, and the data replicas of every shard stay bit-identical."""
  from jax import lax  # noqa: PLC0415

  mesh = _mesh((2, 4))
  specs = {k: SPECS[k] for k in ("w1", "b1", "w2")}  # every leaf sharded over "model"
  start = {k: v for k, v in _params().items() if k in specs}
  tx = qcomm.sync(optax.adam(1e-2), axis_name="data", bits=4, min_size=16)
  params = _place(start, mesh, specs)
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params), "data", params=params)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=spec))

  def step(p, s, batch, key):
    def local_loss(p):  # the model axis by hand: the first layer's columns, the second's rows
      x, y = batch
      out = lax.psum(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"], "model")
      return jnp.mean((out - y) ** 2)
    grads = jax.grad(local_loss)(jax.tree_util.tree_map(
        lambda a: lax.pcast(a, "data", to="varying"), p))
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, spec, P("data"), P()),
                              out_specs=(specs, spec)))
  state = init(params)
  for i in range(3):
    params, state = run(params, state, _batch(seed=10 + i), jax.random.key(i))
  assert int(state.total_notfinite) == 0
  x, y = _batch(seed=50)
  loss = lambda p: float(jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2))  # noqa: E731
  assert loss(params) < loss(start)
  _assert_replicas_identical(params)


def test_the_elastic_and_overlapped_runners_refuse_sharded_parameters():
  mesh = _mesh((2, 4))
  tx = qcomm.diloco(optax.sgd(0.1), axis_name="data", every=2, delay=1)
  dp = qcomm.data_parallel(loss_fn, tx, mesh, overlap=True)
  with pytest.raises(ValueError, match="data_parallel\\(..., overlap=True\\) keeps the parameters"):
    dp.init(_place(_params(), mesh))


def test_a_non_finite_gradient_in_one_shard_skips_the_step_on_every_device():
  """An infinity in one element of one model shard's gradient (the slope of sqrt at 0): every
  device takes the same decision. With shard_state=True the sync skips the step itself: every
  shard unchanged, total_notfinite 1 everywhere; a later finite step trains."""
  mesh = _mesh((2, 4))

  def loss(p, batch):  # d sqrt(w1[0, 0]) / d w1[0, 0] = inf at 0: only model shard 0 sees it
    return loss_fn(p, batch) + jnp.sqrt(jnp.abs(p["w1"][0, 0]))

  tx = qcomm.sync(optax.sgd(0.1), axis_name="data", bits=4, min_size=16, shard_state=True)
  dp = qcomm.data_parallel(loss, tx, mesh)
  params = _place({**_params(), "w1": _params()["w1"].at[0, 0].set(0.0)}, mesh)
  state = dp.init(params)
  new, state, _, _ = dp.step(params, state, _batch())
  assert int(state.total_notfinite) == 1
  for k in params:
    np.testing.assert_array_equal(np.asarray(new[k]), np.asarray(params[k]))
  _assert_replicas_identical((new, state))
  with pytest.raises(ValueError, match="optax.apply_if_finite, but the parameters are sharded"):
    dp2 = qcomm.data_parallel(loss_fn, qcomm.sync(optax.apply_if_finite(optax.sgd(0.1), 3),
                                                  axis_name="data"), mesh)
    dp2.step(params, dp2.init(params), _batch())
  with pytest.raises(ValueError, match="optax.clip_by_global_norm, but the parameters are sharded"):
    dp3 = qcomm.data_parallel(loss_fn, qcomm.sync(optax.chain(optax.clip_by_global_norm(1.0),
                                                              optax.sgd(0.1)), axis_name="data"),
                              mesh)
    dp3.step(params, dp3.init(params), _batch())


def test_moments_follow_the_longest_matching_parameter_path():
  """A top-level "w" sharded over model and "block/w" replicated: block/w's moments belong to
  block/w (replicated), not to the top-level w whose path is a tail of theirs."""
  from jax_qcomm.transforms import layout  # noqa: PLC0415

  params = {"w": jnp.ones((8, 8)), "block": {"w": jnp.ones((8, 8))}}
  pspecs = {"w": P(None, "model"), "block": {"w": P()}}
  state = optax.adam(0.1).init(params)
  specs = layout.state_model_specs(state, params, pspecs)
  assert specs[0].mu["w"] == P(None, "model") and specs[0].mu["block"]["w"] == P()
