"""``qcomm.diloco(..., delay=1)`` and the overlapped runner (``data_parallel(..., overlap=True)``).

What is proved here:
  - delay=1 computes the one-round-delayed outer step: against a numpy simulation of the rule
    (the pending mean moves the anchor, each replica moves onto it keeping its round's progress,
    the progress is what it sends), with a non-trivial outer learning rate;
  - the overlapped runner (the collective on devices the mesh leaves out) ends with every state
    field and the anchor bit-identical to the ordinary runner of the same ``tx``, at 3 replicas,
    4 bits with error feedback, a leaf that does not divide among them, across 4 synchronisations,
    and with a checkpoint-style restart from ``flush``; the anchor is the same on every device;
  - ``describe``'s bytes (the same as delay=0's) are those of the compiled HLO of both the
    ordinary runner's step and the overlapped runner's communication program;
  - a non-finite round is skipped by every replica (counted in ``total_notfinite``), the replica
    that produced it starts again from the anchor, and the next rounds are finite;
  - across processes (2 processes x 2 host devices, one of them each process's communication
    device): tests/overlap_worker.py, the same equality with the ordinary runner;
  - the errors that name what to fix.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jax_qcomm as qcomm
from jax.sharding import NamedSharding, PartitionSpec as P
from jax_qcomm.transforms.specs import _SpecKey
from test_protocol import hlo_sent_bytes

ROOT = pathlib.Path(__file__).resolve().parent.parent
AX = "node"


def _mesh(d: int):
  return jax.make_mesh((d,), (AX,), devices=jax.devices("cpu")[:d])


def _loss(p, b):
  return jnp.mean((jnp.tanh(b @ p["w"]) @ p["v"] + p["b"] - 1.0) ** 2)


def _params(n_hidden: int = 41):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, (40, n_hidden)) * 0.1,
          "v": jax.random.normal(k2, (n_hidden, 3)) * 0.1, "b": jnp.zeros((3,))}


def _batches(n: int, rows: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((rows, 40)), jnp.float32) for _ in range(n)]


def _train(dp, params, batches, flush=False):
  state = dp.init(params)
  for b in batches:
    params, state, _, _ = dp.step(params, state, b)
  if flush:
    state = dp.flush(state)
  return params, state


def test_delay_one_is_the_delayed_outer_step():
  """Two replicas, plain SGD inside, exact codec, outer SGD(0.5): numpy follows the rule."""
  d, h, lr_in, lr_out = 2, 2, 0.1, 0.5
  params = {"w": jnp.asarray(np.linspace(-1, 1, 12).reshape(4, 3), jnp.float32)}
  loss = lambda p, b: jnp.mean((b @ p["w"] - 1.0) ** 2)  # noqa: E731
  tx = qcomm.diloco(optax.sgd(lr_in), axis_name=AX, every=h, codec=qcomm.NoCompression(),
                    outer=optax.sgd(lr_out), delay=1)
  dp = qcomm.data_parallel(loss, tx, _mesh(d), axis_name=AX)
  batches = [jnp.asarray(np.random.default_rng(i).standard_normal((2 * d, 4)), jnp.float32)
             for i in range(7)]
  anchor, state = _train(dp, params, batches)

  grad = jax.grad(lambda w, b: jnp.mean((b @ w - 1.0) ** 2))
  a = np.asarray(params["w"], np.float64)
  local = [a.copy() for _ in range(d)]
  start = [a.copy() for _ in range(d)]
  pending = None
  for i, b in enumerate(batches):
    for r in range(d):
      local[r] = local[r] - lr_in * np.asarray(grad(jnp.asarray(local[r], jnp.float32),
                                                    b[2 * r:2 * r + 2]), np.float64)
    if (i + 1) % h == 0:
      progress = [start[r] - local[r] for r in range(d)]
      if pending is not None:
        a = a - lr_out * pending
      local = [a - p for p in progress]
      start = [x.copy() for x in local]
      pending = sum(progress) / d
  np.testing.assert_allclose(np.asarray(anchor["w"]), a, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(np.asarray(state.pending["w"]), pending, rtol=2e-5, atol=2e-6)
  for r in range(d):
    np.testing.assert_allclose(np.asarray(state.params["w"])[r], local[r], rtol=2e-5, atol=2e-6)
  assert int(state.outer_step) == 3 and int(state.pending_valid) == 1


def _pair(codec, error_feedback, d=3, inner=None):
  def make(overlap):
    tx = qcomm.diloco(inner or optax.adam(0.03), axis_name=AX, every=2, codec=codec,
                      error_feedback=error_feedback, delay=1, seed=3)
    return qcomm.data_parallel(_loss, tx, _mesh(d), axis_name=AX, overlap=overlap)
  return make(False), make(True)


@pytest.mark.parametrize("codec,ef", [(qcomm.NoCompression(), False), (qcomm.QSGD(4), True)],
                         ids=["exact", "qsgd4-ef"])
def test_overlapped_runner_equals_the_ordinary_one(codec, ef):
  plain, overlapped = _pair(codec, ef)
  batches = _batches(9, 6)
  want = _train(plain, _params(), batches)
  got = _train(overlapped, _params(), batches, flush=True)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0],
                          jax.tree_util.tree_leaves(got)):
    assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
  anchor = got[0]
  for leaf in jax.tree_util.tree_leaves(anchor):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards[1:])
  assert int(got[1].outer_step) == 4
  if ef:  # the codec path was taken: 4 bits lost something, and the residual holds it
    assert float(jnp.abs(got[1].residual["w"]).max()) > 0


def test_overlapped_runner_resumes_from_a_flushed_state():
  plain, overlapped = _pair(qcomm.QSGD(4), True)
  batches = _batches(10, 6, seed=1)
  want = _train(plain, _params(), batches)
  params, state = _train(overlapped, _params(), batches[:5], flush=True)
  state = jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), state)  # a "restore"
  _, fresh = _pair(qcomm.QSGD(4), True)
  fresh.init(_params())
  for b in batches[5:]:
    params, state, _, _ = fresh.step(params, state, b)
  state = fresh.flush(state)
  for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves((params, state))):
    assert np.array_equal(np.asarray(a), np.asarray(b))


class _NNXModel(nnx.Module):
  def __init__(self, n_hidden: int = 41):
    params = _params(n_hidden)
    self.w, self.v, self.b = (nnx.Param(params[k]) for k in ("w", "v", "b"))

  def __call__(self, x):
    return jnp.tanh(x @ self.w) @ self.v + self.b


class _WithBatchStats(_NNXModel):
  def __init__(self):
    super().__init__()
    self.seen = nnx.BatchStat(jnp.zeros(()))

  def __call__(self, x):
    self.seen[...] = self.seen[...] + 1.0
    return super().__call__(x)


def test_nnx_overlapped_runner_equals_the_ordinary_one():
  """nnx_data_parallel(overlap=True): the same anchors, step by step, and (flushed) the same
  optimizer state as the ordinary NNX runner, at 3 replicas with 4 bits and error feedback."""
  d = 3
  loss = lambda m, b: jnp.mean((m(b) - 1.0) ** 2)  # noqa: E731
  runs = []
  for overlap in (False, True):
    model = _NNXModel()
    tx = qcomm.diloco(optax.adam(1e-2), axis_name=AX, every=2, codec=qcomm.QSGD(4),
                      error_feedback=True, delay=1, seed=3)
    with jax.set_mesh(_mesh(d)):
      opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    dp = qcomm.nnx_data_parallel(loss, _mesh(d), axis_name=AX, overlap=overlap)
    anchors = []
    for b in _batches(9, 6):
      dp.step(model, opt, b)
      anchors.append([np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(model,
                                                                                  nnx.Param))])
    if overlap:
      dp.flush(opt)
    runs.append((anchors, nnx.as_pure(opt.opt_state), int(opt.step.get_value())))
    assert (dp.runner is None) != overlap
  (want, want_state, n), (got, got_state, m) = runs
  assert n == m == 9
  for step, (a, b) in enumerate(zip(want, got)):
    assert all(np.array_equal(x, y) for x, y in zip(a, b)), step
  for a, b in zip(jax.tree_util.tree_leaves(want_state), jax.tree_util.tree_leaves(got_state)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  assert int(got_state.outer_step) == 4
  # A forward pass that changes other model state: the overlapped runner does not carry it.
  model = _WithBatchStats()
  with jax.set_mesh(_mesh(d)):
    opt = nnx.Optimizer(model, qcomm.diloco(optax.adam(1e-2), axis_name=AX, every=2, delay=1),
                        wrt=nnx.Param)
  with pytest.raises(ValueError, match="forward pass changed model state"):
    qcomm.nnx_data_parallel(loss, _mesh(d), axis_name=AX, overlap=True).step(
        model, opt, _batches(1, 6)[0])
  with pytest.raises(ValueError, match="donate=True is not supported with overlap"):
    qcomm.nnx_data_parallel(loss, _mesh(d), axis_name=AX, overlap=True, donate=True)
  with pytest.raises(ValueError, match="elastic must be"):
    qcomm.nnx_data_parallel(loss, _mesh(d), axis_name=AX, elastic="yes")


def test_a_nonfinite_round_is_skipped_and_does_not_poison_the_next():
  # Plain SGD inside: a NaN gradient poisons no inner optimizer state of the replica (Adam's
  # moments would keep it: the inner state is the replica's own, never reset).
  _, overlapped = _pair(qcomm.NoCompression(), False, d=2, inner=optax.sgd(0.1))
  params, state = _params(), None
  batches = _batches(10, 4, seed=2)
  bad = batches[2].at[0, 0].set(jnp.nan)  # replica 0's third step: its round 2 goes NaN
  batches = batches[:2] + [bad] + batches[3:]
  state = overlapped.init(params)
  anchors = []
  for b in batches:
    params, state, loss, _ = overlapped.step(params, state, b)
    anchors.append(params)
  state = overlapped.flush(state)
  # Round 2's mean (sent at call 4) is NaN; it arrives at call 6 and is skipped there.
  assert int(state.total_notfinite) == 1
  for leaf in jax.tree_util.tree_leaves((params, state.params, state.pending)):
    assert bool(jnp.all(jnp.isfinite(leaf)))
  # The anchor did not move at the skipped arrival (call 6), and moved again afterwards.
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(anchors[3]),
                                                  jax.tree_util.tree_leaves(anchors[5])))
  assert not np.array_equal(np.asarray(anchors[5]["w"]), np.asarray(anchors[9]["w"]))
  assert bool(jnp.all(jnp.isfinite(loss)))


@pytest.mark.parametrize("codec", [qcomm.NoCompression(), qcomm.QSGD(4)], ids=["exact", "qsgd4"])
def test_describe_equals_the_hlo_of_both_runners(codec):
  """delay=1 sends what delay=0 sends but for the scalars of delay=0's finite guard (the codecs'
  mark; a delayed mean is checked by a pass over it): describe's bytes are those of the ordinary
  runner's step and of the overlapped runner's communication program (3 replicas)."""
  d, params = 3, _params()
  tx = qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=2, codec=codec, delay=1)
  delayed = qcomm.describe(tx, params, devices=d)
  want = delayed.sent_bytes_per_sync
  plain_desc = qcomm.describe(qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=2, codec=codec),
                              params, devices=d)
  assert delayed.scalar_bytes == 0
  assert want == plain_desc.sent_bytes_per_sync - plain_desc.scalar_bytes
  plain = qcomm.data_parallel(_loss, tx, _mesh(d), axis_name=AX)
  state = plain.init(params)
  step = plain._step_fn(_SpecKey(plain.state_spec(state)), (AX,), 0, False)
  batch = jax.device_put(_batches(1, 2 * d)[0], NamedSharding(_mesh(d), P(AX)))
  text = step.lower(params, state, batch, ()).compile().as_text()
  assert hlo_sent_bytes(text, d) == pytest.approx(want, rel=1e-9)
  over = qcomm.data_parallel(_loss, tx, _mesh(d), axis_name=AX, overlap=True)
  state = over.init(params)
  mesh = over._comm_mesh
  rows = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct((d,) + x.shape, jnp.float32,
                                     sharding=NamedSharding(mesh, P(AX))), params)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P()))
  text = over._comm_fn(state.config).lower(rows, key).compile().as_text()
  assert hlo_sent_bytes(text, d) == pytest.approx(want, rel=1e-9)


def test_overlap_errors():
  tx1 = qcomm.diloco(optax.sgd(0.1), axis_name=AX, every=2, delay=1)
  tx0 = qcomm.diloco(optax.sgd(0.1), axis_name=AX, every=2)
  mesh = _mesh(2)
  with pytest.raises(ValueError, match="delay=1"):
    qcomm.data_parallel(_loss, tx0, mesh, axis_name=AX, overlap=True).init(_params())
  full = jax.make_mesh((len(jax.devices()),), (AX,))
  with pytest.raises(ValueError, match="communication device"):
    qcomm.data_parallel(_loss, tx1, full, axis_name=AX, overlap=True).init(_params())
  with pytest.raises(ValueError, match="elastic"):
    qcomm.data_parallel(_loss, tx1, mesh, axis_name=AX, overlap=True, elastic=True)
  with pytest.raises(ValueError, match="donate"):
    qcomm.data_parallel(_loss, tx1, mesh, axis_name=AX, overlap=True, donate=True)
  with pytest.raises(ValueError, match="overlap"):
    qcomm.data_parallel(_loss, tx1, mesh, axis_name=AX, overlap="yes")
  with pytest.raises(ValueError, match="delay"):
    qcomm.diloco(optax.sgd(0.1), axis_name=AX, every=2, delay=2)
  with pytest.raises(ValueError, match="fragments"):
    qcomm.diloco(optax.sgd(0.1), axis_name=AX, every=4, delay=1, fragments=2)
  dp = qcomm.data_parallel(_loss, tx1, mesh, axis_name=AX, overlap=True)
  with pytest.raises(ValueError, match="init"):
    dp.step(_params(), None, _batches(1, 4)[0])


@pytest.mark.multiprocess
def test_overlapped_runner_across_processes(tmp_path):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "jax_qcomm.tools.launch", "-n", "2", "--local-devices", "2",
       "--timeout", "150", str(ROOT / "tests" / "overlap_worker.py"), str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = [json.loads((tmp_path / f"{p}.json").read_text()) for p in range(2)]
  for row in rows:
    assert row["equal"], row
    assert row["outer_step"] == 4 and row["total_notfinite"] == 0
  assert rows[0]["anchor_sha"] == rows[1]["anchor_sha"]
  assert rows[0]["comm_device"] != rows[1]["comm_device"]
