"""qcomm.PowerSGD: rank-r factors of every matrix-shaped leaf, warm-started, with error feedback.

What is proved here: the allreduce equals a float64 numpy simulation of PowerSGD's step (P = M Q,
sum, Gram-Schmidt, Q = Mᵀ P, mean, P Qᵀ; the residual M - P (Mᵀ P)ᵀ) on every device, bit-identical
across D = 3 devices, leaves that are not matrices or would not shrink sent exact; a rank-1 mean is
sent exactly; the warm start carried in SyncState.codec_state converges to the best rank-r
approximation (the SVD's); sync with accumulation and error feedback trains and keeps replicas
bit-identical over steps; a NaN step is reported and does not poison the warm start; what PowerSGD
cannot do is a clear error. (describe == the compiled HLO: tests/test_protocol.py.)
"""

from __future__ import annotations

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm import collectives
from jax_qcomm.codecs.powersgd import matrix_shape

AX = "data"
# Shapes no D divides; (5, 3) would not shrink twice at rank 1, (7,) is 1-D.
SHAPES = {"w": (40, 50), "c": (3, 3, 4, 24), "small": (5, 3), "b": (7,)}
ALL = qcomm.LeafPolicy(min_size=0, compress_1d=True)  # every leaf reaches the codec


def _mesh(d):
  return Mesh(np.array(jax.devices()[:d]), (AX,))


def _per_device(d, seed, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal((d,) + s).astype(np.float32) for k, s in shapes.items()}


def _oracle(xs, qs, rank, d):
  """float64 PowerSGD of one leaf: xs[d, ...] every device's values, qs its Q or None (exact).
  Returns (mean, residual[d], new q)."""
  if qs is None:
    return xs.astype(np.float64).mean(0), np.zeros_like(xs, np.float64), None
  ms = [x.astype(np.float64).reshape(matrix_shape(x.shape)) for x in xs]  # (rest, out)
  p = sum(m.T @ qs for m in ms)
  cols = []
  for j in range(rank):  # Gram-Schmidt
    c = p[:, j]
    for q in cols:
      c = c - (q @ c) * q
    cols.append(c / np.linalg.norm(c))
  p = np.stack(cols, 1)
  q_local = [m @ p for m in ms]
  q_mean = sum(q_local) / d
  out = (q_mean @ p.T).reshape(xs.shape[1:])
  res = np.stack([(m - q @ p.T).reshape(xs.shape[1:]) for m, q in zip(ms, q_local)])
  return out, res, q_mean


def _run_allreduce(codec, x, d, states):
  def body(v, st):
    out, res, new, _ = collectives.allreduce_tree(
        jax.tree_util.tree_map(lambda a: a[0], v), AX, codec, None, policy=ALL, codec_state=st)
    vary = lambda t: jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying")[None], t)
    return vary(out), jax.tree_util.tree_map(lambda a: a[None], res), vary(new)

  mesh = _mesh(d)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX), P()), out_specs=P(AX)))
  return f(jax.device_put(x, NamedSharding(mesh, P(AX))), states)


@pytest.mark.parametrize("rank", [1, 3])
def test_allreduce_matches_the_float64_simulation_on_every_device(rank):
  d, codec = 3, qcomm.PowerSGD(rank)
  x = _per_device(d, 0)
  assert [codec.compresses(s) for s in SHAPES.values()] == [True, True, False, False]
  states = collectives.init_codec_state(
      jax.tree_util.tree_map(lambda a: a[0], x), codec, ALL, jax.random.key(3))
  for step in range(2):  # the second call starts from the first one's averaged Q
    out, res, new = _run_allreduce(codec, x, d, states)
    for i, k in enumerate(sorted(SHAPES)):
      q = None if isinstance(states[i], tuple) else np.asarray(states[i], np.float64)
      want, want_res, want_q = _oracle(x[k], q, rank, d)
      got = np.asarray(out[k])
      for r in range(1, d):  # the same bits on every device
        np.testing.assert_array_equal(got[r].view(np.uint32), got[0].view(np.uint32))
      np.testing.assert_allclose(got[0], want, rtol=2e-4, atol=2e-5)
      np.testing.assert_allclose(np.asarray(res[k]), want_res, rtol=2e-4, atol=2e-5)
      if q is None:
        assert new[i] == () or isinstance(new[i], tuple)
      else:
        got_q = np.asarray(new[i])
        for r in range(1, d):
          np.testing.assert_array_equal(got_q[r], got_q[0])
        np.testing.assert_allclose(got_q[0], want_q, rtol=2e-4, atol=2e-5)
    states = tuple(s if isinstance(s, tuple) else jnp.asarray(np.asarray(n)[0])
                   for s, n in zip(states, new))
    x = _per_device(d, 1 + step)


def test_a_rank_one_mean_is_sent_exactly_and_bytes_are_the_factors():
  d = 3
  rng = np.random.default_rng(0)
  u, v = rng.standard_normal(40), rng.standard_normal(50)
  x = {"w": np.stack([a * np.outer(u, v) for a in (0.5, -1.0, 2.0)]).astype(np.float32)}
  codec = qcomm.PowerSGD(1)
  states = collectives.init_codec_state({"w": x["w"][0]}, codec, ALL, jax.random.key(0))
  out, _, _ = _run_allreduce(codec, x, d, states)
  np.testing.assert_allclose(np.asarray(out["w"])[0], x["w"].mean(0), rtol=1e-4, atol=1e-5)
  # two all-reduces of float32 factors: (out + rest) * rank values
  assert codec.leaves_sent_bytes([(40, 50)], d) == pytest.approx(2 * 2 / 3 * 4 * (50 + 40))
  assert codec.leaf_payload_size((3, 3, 4, 24)) == 4 * (36 + 24)
  assert codec.leaf_payload_size((5, 3)) == 4 * 15


def _dp(tx, d, loss):
  return qcomm.data_parallel(loss, tx, _mesh(d), axis_name=AX)


def test_warm_start_converges_to_the_best_rank_r_approximation():
  """The same gradient every step, no error feedback: the Q carried in SyncState.codec_state makes
  the steps a power iteration, whose error falls to the SVD's best rank-2 error."""
  d, rank = 3, 2
  rng = np.random.default_rng(4)
  spectrum = np.diag([10.0, 6.0, 3.0, 1.0, 0.5])
  g = (np.linalg.qr(rng.standard_normal((60, 5)))[0] @ spectrum
       @ np.linalg.qr(rng.standard_normal((45, 5)))[0].T).astype(np.float32)
  s = np.linalg.svd(g.astype(np.float64), compute_uv=False)
  best = np.sqrt(np.sum(s[rank:] ** 2)) / np.linalg.norm(g)
  params = {"w": jnp.zeros((60, 45))}
  tx = qcomm.sync(optax.sgd(1.0), axis_name=AX, codec=qcomm.PowerSGD(rank), error_feedback=False)
  # loss = -sum(w * g): the gradient is -g on every device (as a per-device gradient)
  dp = _dp(tx, d, lambda p, b: -jnp.sum(p["w"] * b[0]))
  state = dp.init(params)
  batch = np.broadcast_to(g, (d, 1) + g.shape).reshape(d, *g.shape)
  errors = []
  for _ in range(8):
    new, state, _, _ = dp.step(params, state, batch)
    errors.append(float(np.linalg.norm(np.asarray(new["w"]) - g) / np.linalg.norm(g)))
  assert errors[-1] < errors[0], errors
  assert errors[-1] == pytest.approx(best, rel=1e-3), (errors, best)


def test_sync_with_accumulation_trains_and_replicas_stay_identical():
  d = 3
  shapes = {"w": (40, 50), "c": (3, 3, 4, 24), "b": (24,)}
  target = {k: jnp.asarray(v[0]) for k, v in _per_device(1, 9, shapes).items()}
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  tx = qcomm.sync(optax.sgd(0.2), axis_name=AX, codec=qcomm.PowerSGD(1), accum_steps=2)
  assert qcomm.describe(tx, params, devices=d).leaves[0].codec == qcomm.NoCompression()
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
  mesh = _mesh(d)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))

  def step(p, s, noise):
    local = jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying"), p)
    g = jax.grad(lambda q: sum(jnp.sum((q[k] - target[k] + noise[k][0]) ** 2) for k in q))(local)
    u, s = tx.update(g, s, p)
    p = optax.apply_updates(p, u)
    mine = lambda t: jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying")[None], t)
    return p, s, mine(p), mine(s.codec_state)

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P(AX)),
                              out_specs=(P(), spec, P(AX), P(AX))))
  state = init(params)
  assert jax.tree_util.tree_leaves(state.residual)  # error feedback is on by default for PowerSGD
  loss = lambda p: sum(float(jnp.sum((p[k] - target[k]) ** 2)) for k in p)  # noqa: E731
  loss0 = loss(params)
  for i in range(12):
    noise = {k: 0.1 * v for k, v in _per_device(d, 20 + i, shapes).items()}
    params, state, mine, qs = run(params, state, noise)
    for leaf in jax.tree_util.tree_leaves((mine, qs)):
      leaf = np.asarray(leaf)
      for r in range(1, d):
        np.testing.assert_array_equal(leaf[r].view(np.uint32), leaf[0].view(np.uint32))
  assert int(state.gradient_step) == 6
  assert loss(params) < 0.7 * loss0, (loss0, loss(params))  # rank 1 of a full-rank target


def test_a_nan_step_is_reported_and_does_not_poison_the_warm_start():
  d = 3
  params = {"w": jnp.zeros((40, 50))}
  tx = qcomm.sync(optax.sgd(0.1), axis_name=AX, codec=qcomm.PowerSGD(1))
  dp = _dp(tx, d, lambda p, b: jnp.sum(p["w"] * b[0]))
  state = dp.init(params)
  good = _per_device(d, 5, {"w": (40, 50)})["w"]
  params, state, _, _ = dp.step(params, state, good)
  q_before = np.asarray(state.codec_state[0])
  residual_before = np.asarray(state.residual["w"])
  bad = good.copy()
  bad[1, 3, 4] = np.nan
  nan_params, state, _, _ = dp.step(params, state, bad)
  assert np.isnan(np.asarray(nan_params["w"])).any()  # never made finite
  assert int(state.total_notfinite) == 1
  np.testing.assert_array_equal(np.asarray(state.codec_state[0]), q_before)
  np.testing.assert_array_equal(np.asarray(state.residual["w"]), residual_before)
  params, state, _, _ = dp.step(params, state, good)
  assert np.all(np.isfinite(np.asarray(params["w"])))
  assert np.all(np.isfinite(np.asarray(state.codec_state[0])))


def test_what_powersgd_cannot_do_is_a_clear_error():
  codec = qcomm.PowerSGD(1)
  with pytest.raises(ValueError, match="shard_state=True"):
    qcomm.sync(optax.sgd(0.1), codec=codec, shard_state=True)
  with pytest.raises(ValueError, match="PowerSGD has no standalone payload"):
    codec.encode(jnp.ones((8, 8)))
  with pytest.raises(ValueError, match="leaves_traffic"):
    codec.sent_bytes(100, 2)
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("node", "gpu"))
  axis = qcomm.Hierarchical(inner="gpu", outer="node")
  f = jax.shard_map(lambda v: qcomm.allreduce(v[0], axis, codec)[None], mesh=mesh,
                    in_specs=P(("node", "gpu")), out_specs=P(("node", "gpu")))
  with pytest.raises(ValueError, match="flat buffer"):
    jax.jit(f)(np.ones((4, 40, 50), np.float32))
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="rank must be a positive integer"):
      qcomm.PowerSGD(bad)
  with pytest.raises(ValueError, match="min_compression_rate"):
    qcomm.PowerSGD(1, min_compression_rate=0.5)
