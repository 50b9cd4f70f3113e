"""Tests of qcomm.sync (the optax wrapper) and qcomm.accumulate_gradients on 8 host CPU devices.

Gradients handed to ``sync`` must be per-device (varying over the "data" axis). Note that
``jax.grad`` inside ``jax.shard_map`` with respect to *replicated* (P()) parameters already returns
the psum over the axis (the transpose of the implicit pvary); the training loop below therefore
differentiates with respect to parameters marked varying (``lax.pcast``), so that each device holds
its own gradient, which is what ``sync`` is meant to average.

With ``accum_steps > 1`` or error feedback the state is genuinely per device (``acc``, ``residual``,
with a leading device axis), so it is passed with ``qcomm.state_partition_spec``; per-device outputs
come back with a leading device axis (out_specs P("data")).
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

try:  # tests/conftest.py is meant to provide the devices; harmless fallback if run alone
  jax.config.update("jax_num_cpu_devices", 8)
except Exception:  # backend already initialised
  pass

import jax_qcomm as qcomm

D = 8
AX = "data"


@functools.cache
def mesh() -> Mesh:
  devs = jax.devices()
  assert len(devs) >= D, f"need {D} host devices, got {len(devs)}"
  return Mesh(np.array(devs[:D]), (AX,))


def _params():
  k1, k2 = jax.random.split(jax.random.key(42))
  return {"w": 0.1 * jax.random.normal(k1, (64, 32)), "b": 0.1 * jax.random.normal(k2, (32,))}


def _device_grads(seed: int):
  """Per-device gradients, leading device axis (to be sharded P('data'))."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w": jax.random.normal(k1, (D, 64, 32)), "b": jax.random.normal(k2, (D, 32))}


def _vary(tree):
  """Mark every leaf varying over the data axis (no data movement)."""
  return jax.tree_util.tree_map(lambda x: qcomm._compat.make_varying(x, frozenset({AX})), tree)


def _first(tree):
  return jax.tree_util.tree_map(lambda x: x[0], tree)


def _stack(tree):
  return jax.tree_util.tree_map(lambda x: x[None], tree)


def _smap(f, in_specs, out_specs):
  return jax.jit(jax.shard_map(f, mesh=mesh(), in_specs=in_specs, out_specs=out_specs))


def _assert_tree_close(a, b, atol, rtol=0.0):
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol,
                               err_msg=jax.tree_util.keystr(path))


# ---- 1. bits=32 is exactly pmean + inner.update -------------------------------------------------

def test_bits32_equals_pmean_then_inner():
  inner = optax.adam(1e-2)
  tx = qcomm.sync(inner, axis_name=AX, bits=32)
  params = _params()

  def synced(p, s, g1, g2):
    u1, s = tx.update(_first(g1), s, p)
    u2, s = tx.update(_first(g2), s, optax.apply_updates(p, u1))
    return u1, u2

  def reference(p, s, g1, g2):
    u1, s = inner.update(lax.pmean(_first(g1), AX), s, p)
    u2, s = inner.update(lax.pmean(_first(g2), AX), s, optax.apply_updates(p, u1))
    return u1, u2

  specs = (P(), P(), P(AX), P(AX))
  g1, g2 = _device_grads(1), _device_grads(2)
  got = _smap(synced, specs, P())(params, tx.init(params), g1, g2)
  want = _smap(reference, specs, P())(params, inner.init(params), g1, g2)
  _assert_tree_close(got, want, atol=1e-6)
  # and the reference really is the mean of the devices' gradients (not, e.g., their sum)
  np.testing.assert_allclose(
      np.asarray(want[0]["w"]),
      np.asarray(inner.update(jax.tree_util.tree_map(lambda g: g.mean(0), g1),
                              inner.init(params), params)[0]["w"]), atol=1e-6)


# ---- 2. accum_steps=2 == one sync on the mean; collectives inside the conditional --------------

@functools.cache
def _accum_fns(bits: int):
  inner = optax.sgd(0.1, momentum=0.9)
  tx2 = qcomm.sync(inner, axis_name=AX, bits=bits, accum_steps=2)
  tx1 = qcomm.sync(inner, axis_name=AX, bits=bits, accum_steps=1)

  def two_calls(p, s, g1, g2):
    keys = [s.key]
    u1, s = tx2.update(_first(g1), s, p)
    keys.append(s.key)
    u2, s = tx2.update(_first(g2), s, p)
    keys.append(s.key)
    return _stack((u1, u2)), _stack(keys)

  def one_call(p, s, g1, g2):
    mean = jax.tree_util.tree_map(lambda a, b: (a + b) * jnp.float32(0.5), _first(g1), _first(g2))
    u, _ = tx1.update(mean, s, p)
    return _stack(u)

  params = _params()
  spec2 = qcomm.state_partition_spec(jax.eval_shape(tx2.init, params))
  return (tx2, tx1, _smap(two_calls, (P(), spec2, P(AX), P(AX)), P(AX)),
          _smap(one_call, (P(), P(), P(AX), P(AX)), P(AX)))


@pytest.mark.parametrize("bits", [32, 4])
def test_accum_steps_2_equals_one_sync_on_mean(bits):
  tx2, tx1, two, one = _accum_fns(bits)
  params = _params()
  g1, g2 = _device_grads(3), _device_grads(4)
  (u1, u2), _ = two(params, tx2.init(params), g1, g2)
  ref = one(params, tx1.init(params), g1, g2)
  for leaf in jax.tree_util.tree_leaves(u1):
    assert not np.any(np.asarray(leaf)), "the first (non-communicating) call must return zeros"
  _assert_tree_close(u2, ref, atol=1e-5)
  for leaf in jax.tree_util.tree_leaves(u2):  # every device got the same update
    leaf = np.asarray(leaf)
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))
    assert np.any(leaf)


def _hlo_computations(text: str):
  """{name: body} for every computation of an HLO module text, and the entry's name."""
  comps, entry, name, body = {}, None, None, []
  for line in text.splitlines():
    m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if name is None and m:
      name, body = m.group(2), []
      if m.group(1):
        entry = name
    elif name is not None and line.startswith("}"):
      comps[name] = "\n".join(body)
      name = None
    elif name is not None:
      body.append(line)
  return comps, entry


def test_accum_collectives_sit_inside_conditional():
  tx2, _, two, _ = _accum_fns(4)
  params = _params()
  g = _device_grads(5)
  text = two.lower(params, tx2.init(params), g, g).compile().as_text()
  assert "conditional(" in text
  comps, entry = _hlo_computations(text)
  assert entry in comps
  refs = {n: set(re.findall(r"%([\w.\-]+)", b)) & comps.keys() for n, b in comps.items()}
  branches = set()
  for b in comps.values():
    for m in re.finditer(r"branch_computations=\{([^}]*)\}", b):
      branches |= {s.strip().lstrip("%") for s in m.group(1).split(",")}
    for m in re.finditer(r"(?:true|false)_computation=%?([\w.\-]+)", b):
      branches.add(m.group(1))
  assert branches, "no conditional branches found"
  inside, todo = set(), list(branches)
  while todo:  # computations reachable from a branch
    n = todo.pop()
    if n not in inside:
      inside.add(n)
      todo.extend(refs.get(n, ()))
  coll = re.compile(r"\b(all-to-all|all-gather|all-gather-start|all-reduce|all-reduce-start)\(")
  with_coll = {n for n, b in comps.items() if coll.search(b)}
  assert any(re.search(r"\b(all-to-all|all-gather)", comps[n]) for n in with_coll), \
      "expected the QSGD all-to-all / all-gather in the HLO"
  assert entry not in with_coll
  assert with_coll <= inside, f"collectives outside the conditional: {sorted(with_coll - inside)}"


# ---- 3. accumulate_gradients --------------------------------------------------------------------

def _mse(p, batch):
  x, y = batch
  return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def test_accumulate_gradients_matches_full_batch():
  kx, ky = jax.random.split(jax.random.key(7))
  batch = (jax.random.normal(kx, (32, 64)), jax.random.normal(ky, (32, 32)))
  params = _params()
  vg = jax.value_and_grad(_mse)
  loss, grads = qcomm.accumulate_gradients(vg, params, batch, 4)
  loss_ref, grads_ref = vg(params, batch)
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5, atol=1e-5)
  _assert_tree_close(grads, grads_ref, atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="divisible"):
    qcomm.accumulate_gradients(vg, params, (batch[0][:30], batch[1][:30]), 4)
  with pytest.raises(ValueError, match="accum_steps"):
    qcomm.accumulate_gradients(vg, params, batch, 0)


# ---- 4. data-parallel training reaches the same loss --------------------------------------------

STEPS = 60
LR = 0.3


@functools.cache
def _problem():
  kx, kw, kn = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (D * 32, 64))
  w_true = jax.random.normal(kw, (64, 32)) / 8.0
  y = x @ w_true + 1.0 + 0.01 * jax.random.normal(kn, (D * 32, 32))
  return x, y


def _train(bits: int, error_feedback: bool = False, seed: int = 0) -> float:
  tx = qcomm.sync(optax.sgd(LR), axis_name=AX, bits=bits, error_feedback=error_feedback,
                  seed=seed)
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}

  def run(p, s, x, y):
    def body(_, carry):
      p, s = carry
      g = jax.grad(_mse)(p, (x, y))  # p varying: this device's gradient
      u, s = tx.update(g, s, p)
      return _vary((optax.apply_updates(p, u), s))

    p, _ = lax.fori_loop(0, STEPS, body, _vary((p, s)))
    return lax.pmean(_mse(p, (x, y)), AX)

  state = tx.init(params)
  f = _smap(run, (P(), qcomm.state_partition_spec(state), P(AX), P(AX)), P())
  return float(f(params, state, *_problem()))


@functools.cache
def _losses():
  out = {b: _train(b) for b in (32, 16, 8, 4, 2, 1)}
  out["2ef"] = _train(2, error_feedback=True)
  return out


def test_training_loss_vs_bits():
  losses = _losses()
  base = losses[32]
  print("final losses:", losses)
  # exact run: from ~2.0 (zero init) to ~0.22 after STEPS steps
  assert np.isfinite(base) and base < 0.5, losses
  for b in (16, 8, 4):  # indistinguishable from exact: within 2% of the bits=32 loss
    assert abs(losses[b] - base) <= 0.02 * base, (b, losses)
  assert losses[2] >= base * 0.99, losses  # 2 bits: no better than exact (1% noise allowance)
  assert losses[1] >= base * 1.05, losses  # 1 bit: visibly worse (observed ~+25%)
  assert np.isfinite(losses["2ef"]) and losses["2ef"] <= losses[2] * 1.02, losses


@pytest.mark.xfail(strict=True, reason="error_feedback at bits=1 (maxmin, nearest rounding) trains "
                   "but worse than plain stochastic 1-bit (loss 0.96 vs 0.27 here); with stochastic "
                   "rounding it diverged (1e25). Known limitation, see the sync docstring.")
def test_error_feedback_1bit_no_worse():
  ef, plain = _train(1, error_feedback=True), _losses()[1]
  assert np.isfinite(ef) and ef <= plain * 1.05, (ef, plain)


# ---- 5. rounding keys advance only on communication ---------------------------------------------

def test_key_advances_only_when_communicating():
  tx2, _, two, _ = _accum_fns(4)
  params = _params()
  g = _device_grads(6)
  _, keys = two(params, tx2.init(params), g, g)
  keys = np.stack([np.asarray(k) for k in keys], 1)  # (D, 3, 2): before, after skip, after sync
  np.testing.assert_array_equal(keys, np.broadcast_to(keys[:1], keys.shape))
  k0, k1, k2 = keys[0]
  np.testing.assert_array_equal(k0, k1)
  assert not np.array_equal(k1, k2)


# ---- 6. argument errors -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(bits=9), "bits"),
    (dict(bits=0), "bits"),
    (dict(bucket_size=12), "bucket_size"),
    (dict(accum_steps=0), "accum_steps"),
    (dict(error_feedback="yes"), "error_feedback"),
    (dict(inner=None), "inner"),
    (dict(exclude=["("]), "exclude"),
])
def test_bad_arguments(kwargs, name):
  kwargs = dict(kwargs)
  inner = kwargs.pop("inner", optax.sgd(0.1))
  with pytest.raises(ValueError, match=name):
    qcomm.sync(inner, **kwargs)


def test_update_outside_shard_map_names_axis():
  tx = qcomm.sync(optax.sgd(0.1), axis_name="data", bits=4)
  params = _params()
  with pytest.raises(ValueError, match="'data'"):
    tx.update(params, tx.init(params), params)


# ---- 7. orbax round trip ------------------------------------------------------------------------

def test_state_orbax_roundtrip(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = qcomm.sync(optax.adam(1e-3), bits=4, accum_steps=2, error_feedback=True)
  state = tx.init(_params())
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state)
    ckptr.wait_until_finished()
    restored = ckptr.restore(path, state)
  restored = type(state)(*restored) if not isinstance(restored, type(state)) else restored
  _assert_tree_close(restored, state, atol=0)
