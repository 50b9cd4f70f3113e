"""qcomm.diloco(outer="sparseloco"): SparseLoCo's outer rule, against a numpy simulation.

The rule, per replica r at each synchronisation: ``e_r <- beta e_r + delta_r``; it sends
``s_r = Q(top-k(e_r))`` and keeps ``e_r - s_r``; the anchor moves by ``-alpha mean_r(s_r)``. The
simulation below runs it in numpy (TopK's chunked top-k and 2-bit levels written out again here)
over several rounds at K = 3 replicas, one round holding a NaN, and the runner must match it. Also:
the 12-bit positions of a 4096-value chunk, the argument errors, and bit-identical replicas of a
multi-leaf model whose sizes the replica count does not divide.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

import jax_qcomm as qcomm
from jax_qcomm.transforms import diloco as diloco_mod

AX = "node"


def _mesh(d):
  return Mesh(np.array(jax.devices("cpu")[:d]), (AX,))


# ---- the numpy simulation -------------------------------------------------------------------------

def _np_topk(x: np.ndarray, codec: qcomm.TopK) -> np.ndarray:
  """TopK's roundtrip of a float32 vector, in numpy: per chunk the k largest magnitudes, each the
  nearest of 2**bits levels evenly from -scale to scale (scale: their largest magnitude)."""
  n = x.shape[0]
  padded = np.zeros(-(-n // 8) * 8, np.float32)
  padded[:n] = x
  out = np.zeros_like(padded)
  top = (1 << codec.bits) - 1
  for start in range(0, padded.shape[0], codec.chunk):
    row = padded[start:start + codec.chunk]
    if not np.all(np.isfinite(row)):
      out[start:start + row.shape[0]] = np.nan
      continue
    k = codec.k_of(row.shape[0])
    idx = np.argsort(-np.abs(row), kind="stable")[:k]
    vals = row[idx]
    scale = np.max(np.abs(vals))
    safe = scale if scale > 0 else np.float32(1)
    codes = np.clip(np.round((vals / safe + np.float32(1)) * np.float32(top / 2)), 0, top)
    out[start + idx] = (codes.astype(np.float32) * np.float32(2 / top) - np.float32(1)) * scale
  return out[:n]


def _simulate(anchor, grads, *, every, lr, alpha, beta, codec):
  """The rule over ``grads[step][replica]`` (constant-gradient inner SGD at ``lr``): the anchors
  after every step and the final residuals."""
  k = grads.shape[1]
  anchor = anchor.astype(np.float32)
  local = np.stack([anchor] * k)
  e = np.zeros_like(local)
  anchors = []
  for step in range(grads.shape[0]):
    local = local + np.float32(-lr) * grads[step]
    if (step + 1) % every == 0:
      send = (anchor - local) + np.float32(beta) * e
      sent = np.stack([_np_topk(send[r], codec) for r in range(k)])
      total = sent[0]
      for r in range(1, k):
        total = total + sent[r]
      mean = total * np.float32(1 / k)
      if np.all(np.isfinite(mean)):
        anchor = anchor + np.float32(-alpha) * mean
        e = send - sent
      local = np.stack([anchor] * k)  # every replica restarts from the anchor, skipped or not
    anchors.append(anchor.copy())
  return anchors, e


def _run(tx, params, grads):
  """qcomm.data_parallel over len(grads[0]) replicas of ``loss = sum(w * g)`` (gradient g)."""
  k = grads.shape[1]
  dp = qcomm.data_parallel(lambda p, g: jnp.sum(p["w"] * g[0]), tx, _mesh(k), axis_name=AX)
  state = dp.init(params)
  anchors = []
  for g in grads:
    params, state, _, _ = dp.step(params, state, jnp.asarray(g))
    anchors.append(np.asarray(params["w"]))
  return anchors, state


@pytest.mark.parametrize("outer,beta,alpha", [("sparseloco", 0.95, 1.0),
                                              (optax.sgd(0.7), 0.8, 0.7)])
def test_the_update_is_the_published_rule_over_rounds_with_a_non_finite_one(outer, beta, alpha):
  k, n, every, lr, rounds = 3, 300, 2, 0.1, 6
  codec = qcomm.TopK(0.25, bits=2, chunk=64)  # 4 whole chunks and a tail of 44 (padded to 48)
  rng = np.random.default_rng(0)
  grads = rng.normal(size=(rounds * every, k, n)).astype(np.float32)
  grads[2 * every + 1, 1, 17] = np.nan  # round 3: replica 1's pseudo-gradient holds a NaN
  w0 = rng.normal(size=(n,)).astype(np.float32)
  extra = {} if isinstance(outer, str) else dict(residual_decay=beta, error_feedback=True)
  tx = qcomm.diloco(optax.sgd(lr), axis_name=AX, every=every, codec=codec, outer=outer, **extra)
  got, state = _run(tx, {"w": jnp.asarray(w0)}, grads)
  want, e = _simulate(w0, grads, every=every, lr=lr, alpha=alpha, beta=beta, codec=codec)
  for step, (g, w) in enumerate(zip(got, want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
  assert np.all(np.isfinite(got[-1]))
  np.testing.assert_array_equal(want[2 * every - 1], want[3 * every - 1])  # round 3 skipped
  np.testing.assert_array_equal(got[2 * every - 1], got[3 * every - 1])
  assert not np.array_equal(want[3 * every - 1], want[4 * every - 1])  # round 4 moved it again
  assert int(state.total_notfinite) == 1 and int(state.outer_step) == rounds
  np.testing.assert_allclose(np.asarray(state.residual["w"]), e, rtol=1e-5, atol=1e-6)


def test_sparseloco_is_one_argument_with_the_published_defaults():
  tx = qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=10, outer="sparseloco")
  state = jax.eval_shape(tx.init, {"w": jnp.zeros((64, 64))})
  cfg = state.config
  assert cfg.codec == qcomm.TopK(1 / 64, bits=2, chunk=4096) == diloco_mod.SPARSELOCO_CODEC
  assert cfg.error_feedback and cfg.residual_decay == 0.95
  # The outer step is plain SGD at lr 1: the anchor moves by minus the mean sent.
  outer = optax.sgd(diloco_mod.SPARSELOCO_LR)
  u, _ = outer.update(jnp.ones(3), outer.init(jnp.ones(3)))
  np.testing.assert_array_equal(u, -jnp.ones(3))
  with pytest.raises(ValueError, match="error_feedback must be True or None"):
    qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=10, outer="sparseloco",
                 error_feedback=False)
  with pytest.raises(ValueError, match="needs a lossy codec"):
    qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=10, outer="sparseloco",
                 codec=qcomm.NoCompression())
  with pytest.raises(ValueError, match="outer must be .*'sparseloco'"):
    qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=10, outer="demo")
  with pytest.raises(ValueError, match=r"residual_decay must be in \[0, 1\]"):
    qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=10, outer="sparseloco",
                 residual_decay=1.5)
  with pytest.raises(ValueError, match="residual_decay=0.9 .*must come with error_feedback"):
    qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=10, codec=qcomm.QSGD(4),
                 residual_decay=0.9)


def test_positions_take_12_bits_in_a_chunk_of_4096_and_land_where_they_were():
  codec = qcomm.TopK(1 / 64, bits=2)  # k = 64 of 4096
  assert codec.k == 64 and codec.chunk_bytes == 4 + 64 * 12 // 8 + 64 * 2 // 8 == 116
  x = np.random.default_rng(2).uniform(-0.01, 0.01, 2 * 4096).astype(np.float32)
  spots = np.array([0, 1, 2047, 4094, 4095, 4096, 4097 + 1234, 8191])
  x[spots] = np.linspace(1, 2, spots.size) * np.where(np.arange(spots.size) % 2, -1, 1)
  y = np.asarray(codec.roundtrip(jnp.asarray(x)))
  assert np.count_nonzero(y) == 2 * 64 and set(spots) <= set(np.flatnonzero(y))
  np.testing.assert_array_equal(np.sign(y[spots]), np.sign(x[spots]))
  np.testing.assert_allclose(y, _np_topk(x, codec), rtol=1e-6)
  # Every leaf counted, the small and 1-D ones too, and >= 10x fewer bytes than QSGD(4).
  params = {"w": jnp.zeros((256, 96)), "b": jnp.zeros((96,)), "s": jnp.zeros(())}
  sent = {}
  for name, kw in (("sparseloco", dict(outer="sparseloco")), ("q4", dict(codec=qcomm.QSGD(4)))):
    d = qcomm.describe(qcomm.diloco(optax.adam(1e-3), axis_name=AX, every=10, **kw), params,
                       devices=2)
    sent[name] = d.sent_bytes_per_sync
    if name == "sparseloco":
      assert "exact" not in str(d).split("-" * 20)[1], str(d)
  assert sent["q4"] / sent["sparseloco"] >= 10, sent


def test_replicas_stay_bit_identical_across_rounds_at_three_replicas():
  rng = np.random.default_rng(1)
  params = {"w1": jnp.asarray(rng.normal(size=(37, 11)), jnp.float32),
            "b1": jnp.zeros((11,)), "w2": jnp.asarray(rng.normal(size=(11, 5)), jnp.float32)}
  start = {k: np.asarray(v) for k, v in params.items()}
  x = rng.normal(size=(9, 3 * 16, 37)).astype(np.float32)
  y = rng.normal(size=(9, 3 * 16, 5)).astype(np.float32)

  def loss(p, b):
    h = jnp.tanh(b[0] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b[1]) ** 2)

  tx = qcomm.diloco(optax.adam(1e-2), axis_name=AX, every=3,
                    codec=qcomm.TopK(0.1, bits=2, chunk=128), outer="sparseloco")
  dp = qcomm.data_parallel(loss, tx, _mesh(3), axis_name=AX)
  state = dp.init(params)
  for i in range(9):
    params, state, _, _ = dp.step(params, state, (jnp.asarray(x[i]), jnp.asarray(y[i])))
    for name, leaf in params.items():  # the anchor: one value on every device
      copies = [np.asarray(s.data) for s in leaf.addressable_shards]
      assert all(np.array_equal(copies[0], c) for c in copies[1:]), (i, name)
    if (i + 1) % 3 == 0:  # after a synchronisation every replica is the anchor, bit for bit
      for name, rows in state.params.items():
        for r in range(3):
          np.testing.assert_array_equal(np.asarray(rows)[r], np.asarray(params[name]))
  assert int(state.outer_step) == 3
  assert all(np.any(np.asarray(params[k]) != start[k]) for k in params)
  res = np.asarray(state.residual["w1"])
  assert np.all(np.isfinite(res)) and not np.array_equal(res[0], res[1])
