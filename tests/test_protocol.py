"""The reduction protocol (jax_qcomm.Codec): one interface for every way values cross the wire.

* ``TopK`` -- a codec of a kind the library does not have, written here with no change to the
  library: a sparsifier (the k largest magnitudes as int32 indices + float32 values) that reduces
  by an all-gather of the sparse payloads (each value quantised once, every device decodes the
  same rows in the same order). It overrides ``allreduce_flat`` and ``traffic`` and runs through
  ``qcomm.allreduce``, ``qcomm.sync(codec=...)`` and ``qcomm.describe``.
* ``describe`` equals the bytes read from the compiled HLO of a sync step, for every codec of the
  library and TopK, at D = 2, 3 and 8.
* ``sync`` in optax's shape: a codec object as the default, extra arguments reaching ``inner``,
  removed keyword arguments naming their replacement, chains that would silently change the maths
  refused.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.tools import efficiency

AX = "data"


@dataclasses.dataclass(frozen=True)
class TopK(qcomm.Codec):
  """The ``ceil(fraction * n)`` largest magnitudes: payload = k int32 indices, then k float32
  values. Reduced by one all-gather of every device's payload and an in-order sparse sum."""

  fraction: float = 0.1

  def _k(self, n: int) -> int:
    return max(1, math.ceil(self.fraction * n)) if n else 0

  def payload_size(self, n: int) -> int:
    return 8 * self._k(n)

  def wire_bits(self, devices: int = 1) -> float:
    return 64.0 * self.fraction

  def wire_encode(self, x, key):
    _, idx = lax.top_k(jnp.abs(x), self._k(x.shape[0]))
    idx = idx.astype(jnp.int32)
    return jnp.concatenate([lax.bitcast_convert_type(idx, jnp.uint8).reshape(-1),
                            lax.bitcast_convert_type(x[idx], jnp.uint8).reshape(-1)])

  def wire_decode_sum(self, wires, n):
    k = self._k(n)
    out = jnp.zeros((n,), jnp.float32)
    for j in range(wires.shape[0]):  # in order
      idx = lax.bitcast_convert_type(wires[j, :4 * k].reshape(k, 4), jnp.int32)
      val = lax.bitcast_convert_type(wires[j, 4 * k:].reshape(k, 4), jnp.float32)
      out = out.at[idx].add(val)
    return out

  # -- its own reduction: one all-gather of the sparse payloads ------------------------------------
  def buffer_length(self, n, devices):
    return n

  def allreduce_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    d = lax.axis_size(axis_name)
    payload = self.wire_encode(x, None)
    rows = lax.all_gather(payload, axis_name, to="invarying")
    out = self.wire_decode_sum(rows, x.shape[0])
    if op == "mean":
      out = out * jnp.float32(1.0 / d)
    return out, x - self.wire_decode_sum(payload[None], x.shape[0])

  def traffic(self, n, devices, collective="allreduce"):
    if collective != "allreduce":
      return super().traffic(n, devices, collective)
    return (("all-gather", (devices - 1) * self.payload_size(n)),)


def _mesh(d: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:d]), (AX,))


def _grads(d: int, seed: int, params) -> dict:
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal((d,) + v.shape).astype(np.float32) for k, v in params.items()}


# Leaf sizes that no D in (2, 3, 8) times a bucket divides.
PARAMS = {"w": jnp.zeros((40, 50)), "v": jnp.zeros((3, 7, 64)), "b": jnp.zeros((50,))}


def _sync_step(tx, mesh, params):
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))

  def step(p, s, g):
    u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
    return optax.apply_updates(p, u), s

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P(AX)),
                              out_specs=(P(), spec)))
  return init, run


# ---- the new kind of codec, end to end ----------------------------------------------------------

def test_topk_allreduce_matches_its_oracle_and_replicas_agree():
  d, n = 3, 1001
  codec = TopK(0.05)
  x = np.random.default_rng(0).standard_normal((d, n)).astype(np.float32)
  f = jax.jit(jax.shard_map(lambda v: qcomm.allreduce(v[0], AX, codec)[None], mesh=_mesh(d),
                            in_specs=P(AX), out_specs=P(AX)))
  out = np.asarray(f(x))
  for i in range(1, d):
    np.testing.assert_array_equal(out[i].view(np.uint32), out[0].view(np.uint32))
  want = np.zeros(n, np.float32)
  for i in range(d):  # the oracle: each device's top k, summed in order, times 1/D
    want = want + np.asarray(codec.roundtrip(jnp.asarray(x[i])))
  np.testing.assert_allclose(out[0], want * np.float32(1 / d), rtol=1e-6, atol=1e-7)
  assert np.count_nonzero(out[0]) <= d * codec._k(n)


def test_topk_through_sync_trains_with_error_feedback_and_stays_identical():
  """sync(codec=TopK) with error feedback over 3 devices and 6 steps: replicas bit-identical, the
  loss falls (the residual carries what the sparsifier dropped)."""
  d = 3
  tx = qcomm.sync(optax.sgd(0.1), axis_name=AX, codec=TopK(0.1), error_feedback=True, min_size=1)
  by_path = {leaf.path: leaf for leaf in qcomm.describe(tx, PARAMS, devices=d).leaves}
  assert by_path["w"].codec == TopK(0.1) and by_path["b"].codec == qcomm.NoCompression()
  target = {k: jnp.asarray(np.random.default_rng(1).standard_normal(v.shape), jnp.float32)
            for k, v in PARAMS.items()}
  mesh = _mesh(d)
  init, _ = _sync_step(tx, mesh, PARAMS)
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, PARAMS))

  def step(p, s, noise):
    local = jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying"), p)
    g = jax.grad(lambda q: sum(jnp.sum((q[k] - target[k] + noise[k][0]) ** 2) for k in q))(local)
    u, s = tx.update(g, s, p)
    p = optax.apply_updates(p, u)
    return p, s, lax.pcast(p["w"], AX, to="varying")[None]  # every replica's own w

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P(AX)),
                              out_specs=(P(), spec, P(AX))))
  params, state = PARAMS, init(PARAMS)
  loss0 = sum(float(jnp.sum((params[k] - target[k]) ** 2)) for k in params)
  for i in range(6):
    params, state, ws = run(params, state, _grads(d, 10 + i, PARAMS))
    ws = np.asarray(ws)
    for j in range(1, d):
      np.testing.assert_array_equal(ws[j].view(np.uint32), ws[0].view(np.uint32))
  loss = sum(float(jnp.sum((params[k] - target[k]) ** 2)) for k in params)
  assert loss < 0.8 * loss0, (loss0, loss)


# ---- describe == the compiled HLO's bytes ------------------------------------------------------

_ITEMSIZE = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "u16": 2, "s16": 2, "u8": 1,
             "s8": 1, "pred": 1, "f64": 8, "s64": 8, "u64": 8}
_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                         r"(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)\(")


def _shape_bytes(shape: str) -> list[int]:
  return [_ITEMSIZE[t] * math.prod(int(v) for v in dims.split(",") if v)
          for t, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", shape)]


def hlo_sent_bytes(text: str, d: int) -> float:
  """Bytes each device sends, read from a compiled HLO module: all-reduce 2 (D-1)/D x size,
  all-gather and all-to-all (D-1)/D x size (the output), reduce-scatter (D-1) x output,
  collective-permute 1 x size."""
  factor = {"all-reduce": 2 * (d - 1) / d, "all-gather": (d - 1) / d, "all-to-all": (d - 1) / d,
            "reduce-scatter": d - 1, "collective-permute": 1}
  total = 0.0
  for shape, op in _COLLECTIVE.findall(text):
    total += factor[op] * sum(_shape_bytes(shape))
  return total


CASES = {
    "exact": dict(codec=qcomm.NoCompression()),
    "bf16": dict(codec=qcomm.Cast(jnp.bfloat16)),
    "qsgd4": dict(codec=qcomm.QSGD(4)),
    "qsgd2_ef": dict(bits=2, error_feedback=True),
    "summable4": dict(codec=qcomm.Summable(4)),
    "wire16": dict(bits=16),
    "wire16_ef": dict(codec=qcomm.Wire16(128), error_feedback=True),
    "topk": dict(codec=TopK(0.1)),
    "powersgd1": dict(codec=qcomm.PowerSGD(1)),
    "powersgd2_accum": dict(codec=qcomm.PowerSGD(2), accum_steps=2),
}


@pytest.mark.parametrize("d", [2, 3, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_describe_equals_the_compiled_hlo(case, d):
  tx = qcomm.sync(optax.sgd(0.1), axis_name=AX, **CASES[case])
  init, run = _sync_step(tx, _mesh(d), PARAMS)
  state = init(PARAMS)
  text = run.lower(PARAMS, state, _grads(d, 0, PARAMS)).compile().as_text()
  want = hlo_sent_bytes(text, d)
  got = qcomm.describe(tx, PARAMS, devices=d).sent_bytes_per_sync
  assert want > 0
  assert got == pytest.approx(want, rel=1e-9), (case, d, got, want)


def test_cost_model_reads_the_codecs_traffic():
  codec = TopK(0.1)
  assert efficiency.allreduce_bytes(1000, 4, codec) == 3 * 8 * 100
  t = efficiency.comm_time(1000, 4, codec, 1.0, transport=efficiency.Transport(all_gather=2.0))
  assert t == pytest.approx(2 * 3 * 8 * 100 * 8 / 1e9)


# ---- sync in optax's shape -----------------------------------------------------------------------

def test_sync_adam_with_summable_codec_trains():
  d = 4
  tx = qcomm.sync(optax.adam(5e-2), axis_name=AX, codec=qcomm.Summable(4), min_size=1)
  target = jnp.asarray(np.random.default_rng(2).standard_normal((64, 32)), jnp.float32)
  mesh = _mesh(d)
  params = {"w": jnp.zeros((64, 32))}
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))(params)

  def step(p, s, x):
    local = jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying"), p)
    loss, g = jax.value_and_grad(lambda q: jnp.mean((x[0] @ q["w"] - x[0] @ target) ** 2))(local)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, lax.pmean(loss, AX)

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P(AX)),
                              out_specs=(P(), spec, P())))
  xs = np.random.default_rng(3).standard_normal((d, 16, 64)).astype(np.float32)
  losses = []
  for _ in range(80):
    params, state, loss = run(params, state, xs)
    losses.append(float(loss))
  assert losses[-1] < 0.2 * losses[0], losses[::10]


def _scale_by_value() -> optax.GradientTransformationExtraArgs:
  """An inner transformation that needs an extra argument: updates = grads * value."""
  def update(updates, state, params=None, *, value, **extra):
    del params, extra
    return jax.tree_util.tree_map(lambda g: g * value, updates), state
  return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


def test_extra_args_reach_inner():
  """value= (as optax.contrib.reduce_on_plateau takes it) passes through sync to inner, also
  through an accumulation window and inside a chain."""
  d = 2
  params = {"w": jnp.ones((4,))}
  for tx in (qcomm.sync(_scale_by_value(), axis_name=AX, codec=qcomm.NoCompression()),
             qcomm.sync(optax.chain(optax.contrib.reduce_on_plateau(), _scale_by_value()),
                        axis_name=AX, codec=qcomm.NoCompression(), accum_steps=2)):
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
    state = jax.jit(jax.shard_map(tx.init, mesh=_mesh(d), in_specs=P(), out_specs=spec))(params)

    def step(s, g, value):
      return tx.update({"w": g[0]}, s, params, value=value)

    run = jax.jit(jax.shard_map(step, mesh=_mesh(d), in_specs=(spec, P(AX), P()),
                                out_specs=(P(), spec)))
    g = np.stack([np.full(4, 1.0, np.float32), np.full(4, 3.0, np.float32)])
    while True:
      u, state = run(state, g, jnp.float32(3.0))
      if np.any(np.asarray(u["w"])):
        break
    np.testing.assert_allclose(np.asarray(u["w"]), 6.0)  # mean 2, times value 3


@pytest.mark.parametrize("name,value,replacement", [
    ("summable", True, "codec=qcomm.Summable"), ("scheme", "norm", "codec=qcomm.QSGD"),
    ("compress_1d", True, "policy=qcomm.LeafPolicy"), ("overrides", {}, "policy=qcomm.LeafPolicy")])
def test_removed_keywords_name_their_replacement(name, value, replacement):
  with pytest.raises(ValueError, match=re.escape(replacement)):
    qcomm.sync(optax.sgd(0.1), **{name: value})


def test_codec_and_shorthands_are_exclusive_and_checked():
  with pytest.raises(ValueError, match="either codec= or the bits="):
    qcomm.sync(optax.sgd(0.1), codec=qcomm.QSGD(4), bits=4)
  with pytest.raises(ValueError, match="either policy= or the min_size="):
    qcomm.sync(optax.sgd(0.1), policy=qcomm.LeafPolicy(), min_size=4)
  with pytest.raises(ValueError, match="codec must be a jax_qcomm codec"):
    qcomm.sync(optax.sgd(0.1), codec="qsgd")
  with pytest.raises(TypeError, match="unexpected keyword argument 'bitz'"):
    qcomm.sync(optax.sgd(0.1), bitz=4)
  from jax_qcomm.transforms.sync import config_of
  assert config_of(qcomm.sync(optax.sgd(0.1), bits=np.int64(2))).codec == qcomm.Auto(2)
  assert config_of(qcomm.sync(optax.sgd(0.1))).codec == qcomm.Auto(4)


def test_stateful_transformation_after_accumulating_sync_is_refused():
  params = {"w": jnp.zeros((8, 8))}
  bad = optax.chain(qcomm.sync(optax.identity(), accum_steps=2), optax.adam(1e-3))
  with pytest.raises(ValueError, match="Move it inside"):
    qcomm.state_partition_spec(jax.eval_shape(bad.init, params))
  # Fine: stateless after it, stateful before it, or no accumulation.
  for ok in (optax.chain(qcomm.sync(optax.adam(1e-3), accum_steps=2), optax.scale(1.0)),
             optax.chain(optax.clip_by_global_norm(1.0), qcomm.sync(optax.adam(1e-3), accum_steps=2)),
             optax.chain(qcomm.sync(optax.identity()), optax.adam(1e-3))):
    qcomm.state_partition_spec(jax.eval_shape(ok.init, params))


@pytest.mark.parametrize("transport", ["IDEAL", "GLOO_PAIR"])
def test_exact_path_leaves_the_transports_large_leaves_unpacked(monkeypatch, transport):
  """NoCompression reduces leaves of at least the transport's ``own_operand`` values as their own
  operands of one psum and packs the smaller ones: the result is a per-leaf pmean's, bit for bit,
  on every device, no large leaf is copied into a buffer, and a leaf below the threshold is."""
  from jax_qcomm.transport import cost as T
  t = getattr(T, transport)
  monkeypatch.setattr(T, "current", lambda devices: t)
  own = t.own_operand
  d = 3
  params = {"big": jnp.zeros((own // 128 + 3, 128)), "mid": jnp.zeros((own // 2 // 128, 128)),
            "b": jnp.zeros((7,))}
  grads = _grads(d, 5, params)
  f = lambda fn: jax.jit(jax.shard_map(  # noqa: E731
      lambda g: jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying")[None],
                                       fn(jax.tree_util.tree_map(lambda a: a[0], g))),
      mesh=_mesh(d), in_specs=P(AX), out_specs=P(AX)))
  ours = f(lambda g: qcomm.allreduce(g, AX, qcomm.NoCompression()))
  want = jax.tree_util.tree_map(np.asarray, f(
      lambda g: jax.tree_util.tree_map(lambda a: lax.pmean(a, AX), g))(grads))
  got = jax.tree_util.tree_map(np.asarray, ours(grads))
  for k in params:
    for r in range(d):
      np.testing.assert_array_equal(got[k][r].view(np.uint32), want[k][0].view(np.uint32))
  text = ours.lower(grads).compile().as_text()
  shapes = " ".join(re.findall(r"= \(?([^=]*?)\)? all-reduce\(", text))
  # the big leaf is an operand as it is; the mid one travels packed with the bias
  assert f"f32[{params['big'].size}]" in shapes or f"f32[{own // 128 + 3},128]" in shapes, shapes
  assert f"f32[{params['mid'].size + 7}]" in shapes, shapes


@pytest.mark.parametrize("transport", ["IDEAL", "GLOO_PAIR"])
def test_exact_reduce_scatter_divides_as_pmean(monkeypatch, transport):
  """NoCompression's reduce-scatter (a list of operands without latency, the packed buffer with
  it) gives each device its block of the sums divided by D as ``lax.pmean`` divides: the same bits
  as the replicated exact path's mean, at a D that is not a power of two."""
  from jax_qcomm.transport import cost as T
  t = getattr(T, transport)
  monkeypatch.setattr(T, "current", lambda devices: t)
  d = 3
  shapes = [(2, d, t.own_operand // 2 + 5), (1, d, 11), (3, d, 4)]
  rng = np.random.default_rng(0)
  chunks = [rng.standard_normal((d,) + s).astype(np.float32) for s in shapes]

  def run(*xs):
    xs = [x[0] for x in xs]
    blocks, _ = qcomm.NoCompression().reduce_scatter_leaves(xs, AX, None, "mean")
    j = lax.axis_index(AX)
    want = [lax.dynamic_index_in_dim(lax.pmean(x, AX), j, 1, keepdims=False).reshape(-1)
            for x in xs]
    return [b[None] for b in blocks], [w[None] for w in want]

  got, want = jax.jit(jax.shard_map(run, mesh=_mesh(d), in_specs=P(AX),
                                    out_specs=P(AX)))(*chunks)
  for g, w in zip(got, want):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape
    np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


def test_transport_own_operand_is_checked():
  from jax_qcomm.transport import cost as T
  for bad in (0, -1, 2.5, True, "1"):
    with pytest.raises(ValueError, match="own_operand must be an int >= 1"):
      T.Transport(own_operand=bad)
  assert T.GLOO_PAIR.own_operand > T.IDEAL.own_operand
