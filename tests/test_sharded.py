"""Sharded optimizer state: ``qcomm.sync(inner, shard_state=True, gather_codec=...)``.

Oracles: with exact codecs the sharded mode gives the replicated mode's parameters (Adam, weight
decay with a mask, ``qcomm.clip_by_global_norm``, accumulation) at world sizes that do not divide
the leaves; with 4-bit gradients and 8-bit weight differences every replica holds the same bits
after every step; ``describe`` equals the compiled HLO's bytes; the optimizer state per device
is counted from the arrays.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm
from test_protocol import hlo_sent_bytes

AX = "data"

# dim 0 of 7, 5, 2 and a 0-d leaf: no D in (2, 3, 6, 8) divides them all; "v" has fewer rows than D,
# so it is split along axis 0, 1 or 2 depending on D; "b" and, at D = 8, "w" need padding.
PARAMS = {"w": np.random.default_rng(0).standard_normal((7, 300)).astype(np.float32),
          "b": np.zeros((5,), np.float32), "s": np.float32(0.5),
          "v": np.ones((2, 3, 200), np.float32)}


@functools.cache
def _mesh(d: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:d]), (AX,))


def _grads(d: int, i: int, scale: float = 1.0) -> dict:
  rng = np.random.default_rng(100 + i)
  return {k: (scale * rng.standard_normal((d,) + np.shape(v))).astype(np.float32)
          for k, v in PARAMS.items()}


def _inner():
  decay_mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
  return optax.chain(qcomm.clip_by_global_norm(1.0),
                     optax.adamw(3e-2, weight_decay=0.1, mask=decay_mask))


def _runner(tx, d):
  mesh = _mesh(d)
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, PARAMS))
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))

  def step(p, s, g):
    u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
    p = optax.apply_updates(p, u)
    mine = jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying")[None], p)
    return p, s, mine

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P(AX)),
                              out_specs=(P(), spec, P(AX))))
  return init, run


def _train(tx, d, steps, scale=1.0, check_identical=False):
  init, run = _runner(tx, d)
  params, state = PARAMS, init(PARAMS)
  for i in range(steps):
    params, state, mine = run(params, state, _grads(d, i, scale))
    if check_identical:
      for leaf in jax.tree_util.tree_leaves(mine):
        leaf = np.asarray(leaf)
        for j in range(1, d):
          np.testing.assert_array_equal(leaf[j].view(np.uint32), leaf[0].view(np.uint32))
  return params, state


@pytest.mark.parametrize("d", [2, 3, 6])
@pytest.mark.parametrize("accum", [1, 2])
def test_exact_sharded_equals_replicated(d, accum):
  kw = dict(axis_name=AX, codec=qcomm.NoCompression(), accum_steps=accum)
  want, _ = _train(qcomm.sync(_inner(), **kw), d, 6)
  got, state = _train(qcomm.sync(_inner(), shard_state=True, gather_codec=qcomm.NoCompression(),
                                 **kw), d, 6, check_identical=True)
  for k in PARAMS:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=2e-6, atol=2e-7)
  assert isinstance(state, qcomm.ShardedSyncState)
  assert int(state.gradient_step) == 6 // accum
  # Each device holds its shard of every leaf, split along the first axis D divides, else the
  # least padded one: (D, *shard_shape) globally.
  assert state.master["w"].shape == (d, 7, 300 // d)
  assert state.master["v"].shape == {2: (d, 1, 3, 200), 3: (d, 2, 1, 200), 6: (d, 2, 3, 34)}[d]
  assert state.master["b"].shape == (d, -(-5 // d)) and state.master["s"].shape == (d,)


@pytest.mark.parametrize("shape,d,axis", [
    ((2048, 1000), 8, 0),     # flax Dense kernel (in, out): dim 0, as FSDP2
    ((1, 1, 64, 256), 8, 2),  # flax 1x1 conv (H, W, in, out): not the spatial dims
    ((3, 3, 64, 64), 2, 2),
    ((7, 7, 3, 64), 2, 3),
    ((7, 300), 8, 1),         # nothing divides: 4 padded columns (28 values), not 1 row (300)
    ((5,), 3, 0), ((), 4, 0)])
def test_shard_axis(shape, d, axis):
  from jax_qcomm.collectives.shard_layout import Layout, shard_axis
  assert shard_axis(shape, d) == axis
  layout = Layout.of([shape], d, [qcomm.NoCompression()], 1 << 20)
  x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
  rows = layout.rows(x, 0)
  np.testing.assert_array_equal(np.asarray(layout.unrows(rows, 0)), np.asarray(x))
  for j in range(d):  # device j's shard is a slice of the leaf along the axis (0-d: whole)
    shard = layout.shard_of(x, 0, jnp.int32(j))
    assert shard.shape == layout.leaves[0].shard_shape
    np.testing.assert_array_equal(np.asarray(layout.from_shard(shard, 0)), np.asarray(rows[j]))
    if shape:
      s = layout.leaves[0].rows_per_device
      want = np.take(np.asarray(x), range(j * s, min((j + 1) * s, shape[axis])), axis=axis)
      np.testing.assert_array_equal(np.asarray(shard).take(range(want.shape[axis]), axis=axis),
                                    want)


def test_global_norm_clipping_needs_the_sharding_aware_transformation():
  """optax.clip_by_global_norm inside a sharded sync would clip each shard by its own norm: it is
  refused (found in inner's trace), naming qcomm.clip_by_global_norm, whose result equals the
  replicated one."""
  d, kw = 3, dict(axis_name=AX, codec=qcomm.NoCompression())
  sharded = dict(shard_state=True, gather_codec=qcomm.NoCompression())
  ref, _ = _train(qcomm.sync(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), **kw),
                  d, 2, scale=5.0)
  ok, _ = _train(qcomm.sync(optax.chain(qcomm.clip_by_global_norm(1.0), optax.sgd(0.1)),
                            **kw, **sharded), d, 2, scale=5.0)
  np.testing.assert_allclose(np.asarray(ok["w"]), np.asarray(ref["w"]), rtol=1e-5, atol=1e-6)
  for blind in (optax.clip_by_global_norm(1.0), optax.scale_by_trust_ratio(),
                optax.adafactor(0.1)):
    with pytest.raises(ValueError, match=r"qcomm.clip_by_global_norm\(max_norm\)"):
      _train(qcomm.sync(optax.chain(blind, optax.sgd(0.1)), **kw, **sharded), d, 1, scale=5.0)


@pytest.mark.parametrize("d", [3, 8])
def test_compressed_replicas_stay_bit_identical(d):
  tx = qcomm.sync(_inner(), axis_name=AX, codec=qcomm.QSGD(4), shard_state=True,
                  gather_codec=qcomm.QSGD(8, rounding="nearest"), error_feedback=True,
                  min_size=16)
  params, state = _train(tx, d, 30, check_identical=True)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(params))


def test_compressed_sharded_training_tracks_replicated():
  """A least-squares problem: 4-bit gradients + 8-bit (and 4-bit) differences reach the exact
  run's loss within a few percent."""
  d = 4
  rng = np.random.default_rng(7)
  x = rng.standard_normal((d, 32, 64)).astype(np.float32)
  target = rng.standard_normal((64, 48)).astype(np.float32) / 8
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros((48,))}

  def losses(tx):
    mesh = _mesh(d)
    spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))(params)

    def step(p, s, xb):
      local = jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying"), p)
      f = lambda q: jnp.mean((xb[0] @ q["w"] + q["b"] - xb[0] @ target) ** 2)  # noqa: E731
      loss, g = jax.value_and_grad(f)(local)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, lax.pmean(loss, AX)

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P(AX)),
                                out_specs=(P(), spec, P())))
    p, out = params, []
    for _ in range(60):
      p, state, loss = run(p, state, x)
      out.append(float(loss))
    return out

  base = dict(axis_name=AX, min_size=16)
  exact = losses(qcomm.sync(optax.adam(3e-2), codec=qcomm.NoCompression(), **base))
  q48 = losses(qcomm.sync(optax.adam(3e-2), shard_state=True, **base))
  q44 = losses(qcomm.sync(optax.adam(3e-2), shard_state=True,
                          gather_codec=qcomm.QSGD(4, rounding="nearest"), **base))
  assert exact[-1] < 0.05 * exact[0]
  assert q48[-1] < 0.05 * q48[0] and q44[-1] < 0.05 * q44[0], (exact[-1], q48[-1], q44[-1])


def test_nonfinite_window_is_skipped_everywhere_and_does_not_poison():
  d = 3
  tx = qcomm.sync(optax.adam(1e-2), axis_name=AX, codec=qcomm.QSGD(4), shard_state=True,
                  error_feedback=True, min_size=16)
  init, run = _runner(tx, d)
  params, state = PARAMS, init(PARAMS)
  params, state, _ = run(params, state, _grads(d, 0))
  bad = _grads(d, 1)
  bad["w"][2, 6, 5] = np.nan  # one value, on the device that does not own row 6 (D = 3: owner 2)
  before = params
  params, state, _ = run(params, state, bad)
  assert int(state.total_notfinite) == 1 and int(state.gradient_step) == 2
  for k in PARAMS:
    np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(before[k]))
  for leaf in jax.tree_util.tree_leaves((state.master, state.inner_opt_state, state.residual)):
    assert np.all(np.isfinite(np.asarray(leaf)))
  params, state, _ = run(params, state, _grads(d, 2))
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("impl", ["auto", "jax"])
@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("shapes", [((1, 256), (3, 128)), ((1, 300), (1, 1), (3, 129), (2, 384))])
def test_leaves_collectives_against_a_reference(shapes, d, impl):
  """QSGD's reduce_scatter_leaves (each shard as ``wire.chunk_runs`` payloads, read where the
  chunks lie): device j's block is the in-order sum over the devices of their shard j, decoded
  from its payloads, but device j's own shard exact, times 1/D, bit for bit (rounding to nearest:
  no key is involved); the residual is what each payload lost, 0 on the own shard; the mark is
  0. The all-gather of the blocks gives every device the packed buffer's rows. Leaves as P runs
  of D chunks (P = 3: a kernel split on an inner axis; chunks of 129 values: a shard's runs end
  to end, one payload). The all-gather of differences from the chunks, read where they lie,
  equals the all-gather of the differences. The C++ kernels and the pure-JAX reference (what GPUs
  run) alike."""
  from jax_qcomm.native import wire  # noqa: PLC0415
  from jax_qcomm.codecs.base import _chunks_of, _rows_of  # noqa: PLC0415
  codec = qcomm.QSGD(4, bucket_size=128, rounding="nearest", impl=impl)
  rng = np.random.default_rng(7)
  chunks = [rng.standard_normal((d, p, d, c)).astype(np.float32) for p, c in shapes]  # [device]

  def run(chunks):
    chunks = [x[0] for x in chunks]
    got, lost, mark = codec.reduce_scatter_leaves_marked(chunks, AX, None, "mean")
    g = codec.all_gather_leaves(got, AX, None)
    gw = qcomm.Codec.all_gather_leaves(codec, got, AX, None)
    # the differences' all-gather, read in place, against the differences gathered
    me = jax.lax.axis_index(AX)
    gd = codec.all_gather_differences(got, chunks, me, AX, None)
    gdw = codec.all_gather_leaves([b - x[:, me].reshape(-1) for b, x in zip(got, chunks)], AX, None)
    for a, w in zip(gd, gdw):
      mark = mark + jnp.sum(jnp.where(a == w, 0.0, jnp.nan))  # NaN where they differ
    return [x[None] for x in got + lost + g + gw] + [mark[None]]

  out = jax.jit(jax.shard_map(run, mesh=_mesh(d), in_specs=P(AX), out_specs=P(AX)))(chunks)
  k = len(shapes)
  got, lost, g, gw = (out[i * k:(i + 1) * k] for i in range(4))
  np.testing.assert_array_equal(np.asarray(out[-1]), np.zeros(d, np.float32))
  for i, (p, c) in enumerate(shapes):
    runs, n = wire.chunk_runs(p, c, 128)
    rows = np.stack([np.asarray(_rows_of(jnp.asarray(x))) for x in chunks[i]])  # [dev, D, P*c]
    dec = np.stack([[np.concatenate([np.asarray(codec.roundtrip(rows[s, j, r * n:(r + 1) * n]))
                                     for r in range(runs)]) for j in range(d)]
                    for s in range(d)])
    for j in range(d):
      terms = [rows[s, j] if s == j else dec[s, j] for s in range(d)]
      want = terms[0]
      for t in terms[1:]:
        want = want + t
      np.testing.assert_array_equal(np.asarray(got[i][j]), want * np.float32(1 / d))
      want_lost = np.where((np.arange(d) == j)[:, None], np.float32(0), rows[j] - dec[j])
      np.testing.assert_array_equal(np.asarray(lost[i][j]),
                                    np.asarray(_chunks_of(jnp.asarray(want_lost), (p, d, c))))
      np.testing.assert_array_equal(np.asarray(g[i][j]), np.asarray(g[i][0]))  # same everywhere
    if c % 128 == 0 or p == 1 and c * p % 128 == 0:
      np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(gw[i]))


@pytest.mark.parametrize("impl", ["auto", "jax"])
def test_reduce_scatter_mark_and_residual_of_a_non_finite_shard(impl):
  """An infinity in one device's gradient: the mark (the codec's, from its kernel on CPU) is NaN
  on the device whose block holds it and 0 elsewhere, whether the value lies in the owner's own,
  exact shard or in a quantised one; the kernels and the reference agree."""
  d, codec = 3, qcomm.QSGD(4, bucket_size=128, impl=impl)
  chunks = [np.ones((d, 2, d, 128), np.float32), np.ones((d, 3, d, 100), np.float32)]
  chunks[0][0, 1, 0, 5] = np.inf  # device 0's own shard
  chunks[1][2, 0, 1, 7] = -np.inf  # device 2's value in device 1's shard

  def run(chunks, key):
    return codec.reduce_scatter_leaves_marked([x[0] for x in chunks], AX, key, "mean")[2][None]

  marks = jax.jit(jax.shard_map(run, mesh=_mesh(d), in_specs=(P(AX), P()), out_specs=P(AX)))(
      chunks, jax.random.key(0))
  assert np.isnan(marks[0]) and np.isnan(marks[1]) and marks[2] == 0


def test_the_step_updates_its_donated_state_in_place():
  """The sharded step writes the inner state and the master into their donated buffers: no copy
  of a state array in the compiled step (a copy is a full pass over the optimizer state)."""
  d = 2
  tx = qcomm.sync(optax.adam(1e-3), axis_name=AX, codec=qcomm.QSGD(4), shard_state=True,
                  min_size=16)
  mesh = _mesh(d)
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, PARAMS))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))(PARAMS)

  def step(p, s, g):
    u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
    return optax.apply_updates(p, u), s

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P(AX)),
                              out_specs=(P(), spec)), donate_argnums=(0, 1))
  text = run.lower(PARAMS, state, _grads(d, 0)).compile().as_text()
  names = dict(re.findall(r"(%param[.0-9]*) = [^\n]*?op_name=\"([^\"]*)\"", text))
  copied = [names.get(p, p)
            for p in re.findall(r"= f32\[[^\]]*\][^ ]* copy\((%param[.0-9]*)\)", text)]
  assert not [c for c in copied if "master" in c or "inner_opt_state" in c], copied


@pytest.mark.parametrize("d", [2, 3, 8])
@pytest.mark.parametrize("case", ["exact", "q4_g8", "q4_g4_ef", "summable4_g8", "wire16"])
def test_describe_equals_the_compiled_hlo(case, d):
  kw = {"exact": dict(codec=qcomm.NoCompression(), gather_codec=qcomm.NoCompression()),
        "q4_g8": dict(codec=qcomm.QSGD(4)),
        "q4_g4_ef": dict(bits=4, error_feedback=True,
                         gather_codec=qcomm.QSGD(4, rounding="nearest")),
        "summable4_g8": dict(codec=qcomm.Summable(4)),
        "wire16": dict(bits=16, gather_codec=qcomm.Wire16())}[case]
  tx = qcomm.sync(optax.adam(1e-3), axis_name=AX, shard_state=True, min_size=16, **kw)
  init, run = _runner(tx, d)
  text = run.lower(PARAMS, init(PARAMS), _grads(d, 0)).compile().as_text()
  want = hlo_sent_bytes(text, d)  # every replica's params leave as P(AX) outputs: no collective
  got = qcomm.describe(tx, PARAMS, devices=d).sent_bytes_per_sync
  assert want > 0 and got == pytest.approx(want, rel=1e-9), (case, d, got, want)


def test_memory_and_bytes_at_8_devices():
  """Adam at D = 8: the state per device (counted from the arrays) <= 0.25 of the replicated
  sync's; the bytes on the wire <= 0.25 (8-bit differences) and <= 0.18 (4-bit) of an exact sync."""
  params = {"w": jnp.zeros((4096, 1024)), "b": jnp.zeros((1024,))}
  rep = qcomm.describe(qcomm.sync(optax.adam(1e-3), axis_name=AX, bits=4), params, devices=8)
  g8 = qcomm.describe(qcomm.sync(optax.adam(1e-3), axis_name=AX, bits=4, shard_state=True,
                                 gather_codec=qcomm.QSGD(8, rounding="nearest")), params, devices=8)
  g4 = qcomm.describe(qcomm.sync(optax.adam(1e-3), axis_name=AX, bits=4, shard_state=True),
                      params, devices=8)
  assert g8.state_bytes_per_device / rep.state_bytes_per_device <= 0.25
  assert g8.sent_bytes_per_sync / rep.fp32_sent_bytes_per_sync <= 0.25
  assert g4.sent_bytes_per_sync / rep.fp32_sent_bytes_per_sync <= 0.18


def test_sharded_state_in_data_parallel_and_nnx():
  from flax import nnx
  d = 3
  mesh = _mesh(d)
  tx = qcomm.sync(optax.adam(1e-2), axis_name=AX, shard_state=True, min_size=16)
  dp = qcomm.data_parallel(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx, mesh)
  params = {"w": jnp.ones((10, 7))}
  state = dp.init(params)
  assert state.master["w"].sharding.spec == P(AX)
  for _ in range(3):
    params, state, loss, _ = dp.step(params, state, np.ones((6, 10), np.float32))
  assert np.isfinite(float(loss)) and int(state.gradient_step) == 3

  model = nnx.Linear(10, 7, rngs=nnx.Rngs(0))
  with jax.set_mesh(mesh):
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  step = qcomm.nnx_data_parallel(lambda m, b: jnp.mean(m(b) ** 2), mesh)
  first = float(step.step(model, opt, np.ones((6, 10), np.float32)))
  for _ in range(10):
    last = float(step.step(model, opt, np.ones((6, 10), np.float32)))
  assert last < first


def test_bad_combinations_raise():
  with pytest.raises(ValueError, match="gather_codec applies to shard_state=True only"):
    qcomm.sync(optax.sgd(0.1), gather_codec=qcomm.QSGD(8))
  with pytest.raises(ValueError, match="gather_codec must be a jax_qcomm codec"):
    qcomm.sync(optax.sgd(0.1), shard_state=True, gather_codec=8)
  with pytest.raises(ValueError, match="shard_state must be True or False"):
    qcomm.sync(optax.sgd(0.1), shard_state="yes")
  with pytest.raises(ValueError, match="qcomm.Hierarchical is not sharded"):
    qcomm.sync(optax.sgd(0.1), shard_state=True, axis_name=qcomm.Hierarchical("i", "o"))
  tx = qcomm.sync(optax.apply_if_finite(optax.sgd(0.1), 3), shard_state=True)
  with pytest.raises(ValueError, match="apply_if_finite inside a sync with shard_state=True"):
    jax.eval_shape(tx.init, PARAMS)
  tx = qcomm.sync(optax.sgd(0.1), axis_name=AX, shard_state=True)
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, PARAMS))
  f = jax.shard_map(lambda s, g: tx.update(jax.tree.map(lambda a: a[0], g), s)[0],
                    mesh=_mesh(2), in_specs=(spec, P(AX)), out_specs=P())
  state = jax.jit(jax.shard_map(tx.init, mesh=_mesh(2), in_specs=P(), out_specs=spec))(PARAMS)
  with pytest.raises(ValueError, match="params must be given to update with shard_state=True"):
    jax.jit(f)(state, _grads(2, 0))
  with pytest.raises(ValueError, match="max_norm must be a positive number"):
    qcomm.clip_by_global_norm(0.0)
