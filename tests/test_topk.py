"""qcomm.TopK: the largest values of every chunk, quantised, with their positions.

What is proved here: the payload's size (>= 10x fewer bytes than QSGD(4) per synchronisation at
fraction 0.02, 2 bits, by describe), that the positions kept are those of the largest magnitudes
and the codes decode to the documented levels, that a non-finite chunk decodes non-finite, that
the all-gather reduction is the in-order sum of every device's decode (the same bits on every
device, at D = 3), and that diloco with TopK and error feedback trains close to fp32 diloco.
(describe == compiled HLO and bit-identical anchors: tests/test_diloco.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.transforms.diloco import default_outer


def test_ten_times_fewer_bytes_than_qsgd4_per_synchronisation():
  params = {"w": jnp.zeros((512, 512)), "v": jnp.zeros((4096, 96)), "b": jnp.zeros((512,))}
  sent = {}
  for name, codec in (("topk", qcomm.TopK(0.02, 2)), ("q4", qcomm.QSGD(4))):
    tx = qcomm.diloco(optax.sgd(0.1), axis_name="node", every=50, codec=codec,
                      error_feedback=True)
    sent[name] = qcomm.describe(tx, params, devices=2).sent_bytes_per_sync
  assert sent["q4"] / sent["topk"] >= 10, sent


def test_positions_are_the_largest_and_codes_the_levels():
  codec = qcomm.TopK(0.25, 2, chunk=32)  # k = 8 of 32
  x = jax.random.normal(jax.random.key(0), (96,))
  y = np.asarray(codec.roundtrip(x))
  xs = np.asarray(x).reshape(3, 32)
  for row, out in zip(xs, y.reshape(3, 32)):
    top = np.argsort(-np.abs(row))[:8]
    assert set(np.flatnonzero(out)) <= set(top)
    scale = np.max(np.abs(row))
    levels = scale * np.array([-1, -1 / 3, 1 / 3, 1], np.float32)
    for i in top:  # each sent value decodes to the level nearest to it
      assert np.isclose(out[i], levels[np.argmin(np.abs(levels - row[i]))], rtol=1e-6) or (
          out[i] == 0 and np.isclose(min(np.abs(levels - row[i])), np.abs(row[i]), rtol=1e-6))
  assert codec.payload_size(96) == 3 * (4 + 8 * 5 // 8 + 8 * 2 // 8)  # 5-bit positions


def test_a_non_finite_chunk_decodes_non_finite():
  codec = qcomm.TopK(0.1, 4, chunk=64)
  x = jnp.ones((192,)).at[70].set(jnp.inf)
  y = np.asarray(codec.roundtrip(x))
  assert np.all(np.isnan(y[64:128])) and np.all(np.isfinite(y[:64])) and np.all(
      np.isfinite(y[128:]))


def test_allreduce_is_the_in_order_sum_of_the_decodes_on_every_device():
  d, codec = 3, qcomm.TopK(0.1, 2, chunk=64)
  mesh = Mesh(np.array(jax.devices("cpu")[:d]), ("node",))
  x = jax.random.normal(jax.random.key(1), (d, 200))

  def body(v):
    out = qcomm.allreduce(v[0], "node", codec, jax.random.key(0), op="sum",
                          policy=qcomm.LeafPolicy(min_size=0, compress_1d=True))
    return jax.lax.pcast(out, "node", to="varying")[None]

  out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("node"), out_specs=P("node")))(x)
  out = np.asarray(out)
  want = np.asarray(codec.roundtrip(x[0]))
  for j in range(1, d):
    want = want + np.asarray(codec.roundtrip(x[j]))
  for r in range(d):
    np.testing.assert_array_equal(out[r], out[0])
  np.testing.assert_allclose(out[0], want, rtol=1e-6, atol=1e-6)


def test_diloco_with_topk_and_error_feedback_tracks_fp32_diloco():
  rng = np.random.default_rng(0)
  w_true = rng.normal(size=(32, 16)).astype(np.float32)
  x = rng.normal(size=(8, 64, 32)).astype(np.float32)
  batches = [(jnp.asarray(b), jnp.asarray(np.tanh(b @ w_true))) for b in x]

  def loss(p, batch):
    return jnp.mean((jnp.tanh(batch[0] @ p["w"]) - batch[1]) ** 2)

  mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("node",))
  final = {}
  for name, codec, ef in (("fp32", qcomm.NoCompression(), False),
                          ("topk", qcomm.TopK(0.1, 2, chunk=64), True)):
    tx = qcomm.diloco(optax.adam(1e-2), axis_name="node", every=4, codec=codec,
                      error_feedback=ef, outer=optax.sgd(1.0),
                      policy=qcomm.LeafPolicy(min_size=0))
    dp = qcomm.data_parallel(loss, tx, mesh, axis_name="node")
    params = {"w": jnp.zeros((32, 16))}
    state = dp.init(params)
    for i in range(48):
      params, state, _, _ = dp.step(params, state, batches[i % 8])
    final[name] = np.mean([float(loss(params, b)) for b in batches])
  start = np.mean([float(loss({"w": jnp.zeros((32, 16))}, b)) for b in batches])
  assert final["topk"] < 0.5 * start
  assert final["topk"] < 1.5 * final["fp32"], final
  with pytest.raises(ValueError, match="no reduce-scatter"):
    qcomm.TopK().traffic(64, 2, "reduce_scatter")


def test_a_short_last_chunk_has_its_own_k():
  codec = qcomm.TopK(0.02, 2)  # whole chunks: k = 88 of 4096
  # padded to 16 values, 8 sent at 4-bit positions
  assert codec.payload_size(10) == 4 + 8 * 4 // 8 + 8 * 2 // 8
  # a whole chunk: 88 12-bit positions; the tail (304 values): 8 9-bit positions
  assert codec.payload_size(4096 + 300) == (4 + 132 + 22) + (4 + 9 + 2)
  x = jax.random.normal(jax.random.key(2), (4096 + 300,))
  y = np.asarray(codec.roundtrip(x))
  tail, out = np.asarray(x)[4096:], y[4096:]
  assert set(np.flatnonzero(out)) <= set(np.argsort(-np.abs(tail))[:8])
  assert np.count_nonzero(y[:4096]) <= 88 and np.count_nonzero(out) >= 1


def test_sparse_codecs_send_every_leaf_and_lighter_outer_momentum_with_error_feedback():
  """A sparse codec's defaults: small and 1-D leaves go through it (error feedback loses nothing
  of them), and diloco with error feedback uses Nesterov (1.0, 0.5) outside; an explicit policy
  still wins."""
  params = {"w1": jnp.zeros((64, 256)), "b1": jnp.zeros((256,)), "w2": jnp.zeros((256, 10)),
            "b2": jnp.zeros((10,))}
  sent = {}
  for name, codec in (("topk", qcomm.TopK(0.02, 2)), ("q4", qcomm.QSGD(4))):
    tx = qcomm.diloco(optax.adam(1e-3), axis_name="node", every=50, codec=codec,
                      error_feedback=True)
    d = qcomm.describe(tx, params, devices=2)
    sent[name] = d.sent_bytes_per_sync
    if name == "topk":
      assert "exact" not in str(d).split("-" * 20)[1], str(d)  # no leaf row is exact
  assert sent["q4"] / sent["topk"] >= 10, sent
  explicit = qcomm.LeafPolicy(min_size=1024, compress_1d=False)
  assert isinstance(explicit.codec_for("b1", params["b1"], qcomm.TopK()), qcomm.NoCompression)
  assert explicit.codec_for("w1", params["w1"], qcomm.TopK()) == qcomm.TopK()

  def first_step(codec, ef):  # the default outer's first update of a pseudo-gradient of ones
    outer = default_outer(codec, ef)
    g = jnp.ones((3,))
    return float(outer.update(g, outer.init(g))[0][0])

  assert first_step(qcomm.TopK(), True) == pytest.approx(-1.0 * 1.5)  # lr 1.0, (1 + 0.5)
  assert first_step(qcomm.TopK(), False) == pytest.approx(-0.3 * 1.9)  # the dense default
  assert first_step(qcomm.QSGD(4), True) == pytest.approx(-0.3 * 1.9)
