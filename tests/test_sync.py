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


# ---- 8. gradients already summed by autodiff (the forgotten pcast) -------------------------------

def _summed_grads_step(tx):
  def step(p, s, x, y):
    g = jax.grad(_mse)(p, (x, y))  # p replicated: autodiff psums the gradient over the axis
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return step


@pytest.mark.parametrize("accum", [1, 2])
def test_forgotten_pcast_raises_with_the_fix(accum):
  tx = qcomm.sync(optax.sgd(LR), axis_name=AX, bits=4, accum_steps=accum)
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
  state = tx.init(params)
  spec = qcomm.state_partition_spec(state)
  f = _smap(_summed_grads_step(tx), (P(), spec, P(AX), P(AX)), (P(), spec))
  with pytest.raises(ValueError, match=r"already summed(.|\n)*lax.pcast\(p, 'data', to='varying'\)"):
    f(params, state, *_problem())


def test_collectives_reject_replicated_values_unless_told():
  x = jnp.arange(256, dtype=jnp.float32)
  key = jax.random.key(0)
  calls = {
      "qcomm.allreduce": lambda v, **kw: qcomm.allreduce(v, AX, qcomm.QSGD(8), key, **kw),
      "qcomm.reduce_scatter": lambda v, **kw: qcomm.reduce_scatter(v, AX, qcomm.NoCompression(),
                                                                   **kw),
      "qcomm.cast_pmean": lambda v, **kw: qcomm.cast_pmean(v, AX, **kw),
  }
  for name, call in calls.items():
    with pytest.raises(ValueError, match=re.escape(name) + r"(.|\n)*check_varying=False"):
      _smap(lambda v, call=call: call(v), P(), P())(x)
  # a value that is meant to be replicated: allowed with check_varying=False
  out = _smap(lambda v: qcomm.allreduce(v, AX, qcomm.NoCompression(), check_varying=False),
              P(), P())(x)
  np.testing.assert_allclose(np.asarray(out), np.asarray(x))
  out = _smap(lambda v: qcomm.cast_pmean(v, AX, jnp.float32, check_varying=False), P(), P())(x)
  np.testing.assert_allclose(np.asarray(out), np.asarray(x))


def test_sync_check_varying_false_accepts_identical_gradients():
  tx = qcomm.sync(optax.sgd(1.0), axis_name=AX, bits=32, check_varying=False)
  params = _params()

  def step(p, s):
    g = jax.tree_util.tree_map(jnp.ones_like, p)  # the same on every device, by construction
    u, _ = tx.update(g, s, p)
    return u

  u = _smap(step, (P(), P()), P())(params, tx.init(params))
  np.testing.assert_allclose(np.asarray(u["w"]), -1.0)


def test_pmap_skips_the_varying_check_and_accumulates():
  """Under pmap JAX records no variation: nothing to check; the state is made inside pmap."""
  tx = qcomm.sync(optax.sgd(0.1), axis_name=AX, bits=32, accum_steps=2)
  params = _params()
  devs = jax.devices()[:D]
  init = jax.pmap(tx.init, axis_name=AX, devices=devs)
  step = jax.pmap(lambda p, s, g: tx.update(g, s, p), axis_name=AX, devices=devs)
  rep = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (D,) + a.shape), params)
  state = init(rep)
  assert state.acc_grads["w"].shape == (D, 1, 64, 32)
  g1, g2 = _device_grads(1), _device_grads(2)
  u1, state = step(rep, state, g1)
  u2, state = step(rep, state, g2)
  assert not np.any(np.asarray(u1["w"]))
  want = -0.1 * (np.asarray(g1["w"]) + np.asarray(g2["w"])).mean(0) / 2
  np.testing.assert_allclose(np.asarray(u2["w"][3]), want, atol=1e-6)
  with pytest.raises(ValueError, match="jax.pmap\\(tx.init"):  # a replicated global state
    step(rep, jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (D,) + a.shape),
                                     tx.init(params)), g1)


def test_state_passed_replicated_raises_naming_state_partition_spec():
  tx = qcomm.sync(optax.sgd(LR), axis_name=AX, bits=4, accum_steps=2)
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
  state = tx.init(params)

  def step(p, s, x, y):
    local = jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying"), p)
    u, s = tx.update(jax.grad(_mse)(local, (x, y)), s, p)
    return optax.apply_updates(p, u), s

  f = _smap(step, (P(), P(), P(AX), P(AX)), (P(), P()))  # P() for the whole state: wrong
  with pytest.raises(ValueError, match=r"qcomm.state_partition_spec\(opt_state, 'data'\)"):
    f(params, state, *_problem())


def test_state_partition_spec_scalars_and_tuple_axes():
  tx = qcomm.sync(optax.adam(1e-3), axis_name=("a", "b"), bits=4, accum_steps=2,
                  error_feedback=True)
  params = {"s": jnp.float32(1.0), "v": jnp.zeros((3,))}
  state = jax.eval_shape(tx.init, params)
  spec = qcomm.state_partition_spec(state, ("a", "b"))
  assert spec.acc_grads == {"s": P(("a", "b")), "v": P(("a", "b"))}
  assert spec.residual["s"] == P(("a", "b")) and spec.mini_step == P() and spec.key == P()
  assert all(s == P() for s in jax.tree_util.tree_leaves(spec.inner_opt_state))
  assert state.acc_grads["s"].shape == (jax.device_count(),)  # no mesh set: all devices
  with jax.set_mesh(Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))):
    assert jax.eval_shape(tx.init, params).acc_grads["v"].shape == (4, 3)  # the current mesh's axes


# ---- 9. non-finite steps: error feedback and accumulation are not poisoned -----------------------

NAN_CALLS = 12
NAN_AT = 4  # the call at which device 3 sees a NaN in its data


@functools.cache
def _nan_run_fn(wrap: str, accum: int):
  inner = optax.sgd(LR, momentum=0.9)
  if wrap == "apply_if_finite":
    tx = qcomm.sync(optax.apply_if_finite(inner, 5), axis_name=AX, bits=2, accum_steps=accum,
                    error_feedback=True)
  else:
    tx = qcomm.sync(inner, axis_name=AX, bits=2, accum_steps=accum, error_feedback=True)
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))

  def step(p, s, x, y, poison):
    local = jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying"), p)
    g = jax.grad(_mse)(local, (x * poison[0], y))
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, u

  f = _smap(step, (P(), spec, P(AX), P(AX), P(AX)), (P(), spec, P()))
  return tx, params, f


def _nan_run(wrap: str, accum: int, poison_at: int | None):
  tx, params, f = _nan_run_fn(wrap, accum)
  state = tx.init(params)
  x, y = _problem()
  history = []
  for i in range(NAN_CALLS):
    poison = np.ones(D, np.float32)
    if i == poison_at:
      poison[3] = np.nan
    params, state, u = f(params, state, x, y, jnp.asarray(poison))
    history.append((params, state, u))
  return history


@pytest.mark.parametrize("accum", [1, 2])
def test_training_recovers_from_one_nan_with_error_feedback(accum):
  """sync(apply_if_finite(inner), error_feedback=True): one NaN on one device costs one step."""
  clean = _nan_run("apply_if_finite", accum, None)
  hist = _nan_run("apply_if_finite", accum, NAN_AT)
  x, y = _problem()
  loss = lambda h: float(_mse(h[0], (x, y)))  # noqa: E731
  sync_call = NAN_AT + (accum - 1 - NAN_AT % accum)  # the call that communicates the bad window
  _, state, u = hist[sync_call]
  for leaf in jax.tree_util.tree_leaves(u):  # that step is skipped (zeros) by apply_if_finite
    assert not np.any(np.asarray(leaf))
  assert int(state.total_notfinite) == 1 and int(state.inner_opt_state.total_notfinite) == 1
  for leaf in jax.tree_util.tree_leaves((state.residual, state.acc_grads)):  # nothing poisoned
    assert np.all(np.isfinite(np.asarray(leaf)))
  np.testing.assert_array_equal(  # the residual of before the bad window
      np.asarray(state.residual["w"]), np.asarray(hist[sync_call - accum][1].residual["w"]))
  # training goes on: every later step is taken, so the run ends one optimizer step behind the
  # clean run (a residual poisoned for ever would skip them all and leave the loss where it was)
  assert loss(hist[-1]) < 0.75 * loss(hist[sync_call]), [loss(h) for h in hist]
  np.testing.assert_allclose(loss(hist[-1]), loss(clean[-1 - accum]), rtol=0.05)


def test_nonfinite_synced_gradient_is_not_made_finite():
  hist = _nan_run("none", 2, NAN_AT)
  _, state, u = hist[NAN_AT + 1]  # the communicating call of the bad window
  assert all(not np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree_util.tree_leaves(u))
  assert int(state.total_notfinite) == 1 and int(state.gradient_step) == (NAN_AT + 2) // 2
  for leaf in jax.tree_util.tree_leaves((state.residual, state.acc_grads)):
    assert np.all(np.isfinite(np.asarray(leaf)))


# ---- 10. describe ---------------------------------------------------------------------------------

def test_describe_counts_bytes_from_the_codecs():
  tx = qcomm.sync(optax.sgd(0.1), axis_name=AX, bits=4, accum_steps=2, exclude=("head",))
  params = {"conv": jnp.zeros((3, 3, 16, 32)), "bias": jnp.zeros((32,)),
            "head": jnp.zeros((64, 64)), "small": jnp.zeros((8, 8))}
  d = qcomm.describe(tx, params, devices=4)
  by = {leaf.path: leaf for leaf in d.leaves}
  q4 = qcomm.QSGD(4)
  assert by["conv"].codec == q4 and not by["conv"].exact
  assert by["conv"].payload_bytes == q4.payload_size(3 * 3 * 16 * 32)
  assert by["conv"].sent_bytes == pytest.approx(2 * 3 / 4 * q4.payload_size(4608))
  for name in ("bias", "head", "small"):  # 1-D, excluded, under min_size
    assert by[name].exact and by[name].payload_bytes == 4 * by[name].elements
  assert d.payload_bytes == sum(leaf.payload_bytes for leaf in d.leaves)
  assert d.sent_bytes_per_call == pytest.approx(d.sent_bytes_per_sync / 2)
  assert d.fp32_sent_bytes_per_sync == pytest.approx(1.5 * 4 * d.elements)
  text = str(d)
  assert "QSGD 4b/128 maxmin" in text and "exact fp32" in text and "conv" in text
  assert f"{d.payload_bytes:,}" in text
  # Found inside a combinator, through the state it makes.
  chained = qcomm.describe(optax.chain(optax.clip(1.0), tx, optax.scale(1.0)), params, devices=4)
  assert chained.sent_bytes_per_sync == d.sent_bytes_per_sync
  with pytest.raises(ValueError, match="exactly one qcomm.sync or qcomm.diloco"):
    qcomm.describe(optax.sgd(0.1), params)


def test_hierarchical_axis_state_from_tx_init():
  """Per-device parts over a Hierarchical axis: one row per device of both axes."""
  m = Mesh(np.array(jax.devices()[:D]).reshape(2, 4), ("o", "i"))
  axis = qcomm.Hierarchical(inner="i", outer="o")
  tx = qcomm.sync(optax.sgd(0.1), axis_name=axis, bits=32, accum_steps=2)
  params = _params()
  state = tx.init(params)
  spec = qcomm.state_partition_spec(state, axis)
  assert state.acc_grads["w"].shape == (D, 64, 32) and spec.acc_grads["w"] == P(("i", "o"))

  def two_calls(p, s, g1, g2):
    _, s = tx.update(_first(g1), s, p)
    u, s = tx.update(_first(g2), s, p)
    return u, s

  f = jax.jit(jax.shard_map(two_calls, mesh=m, in_specs=(P(), spec, P(("o", "i")), P(("o", "i"))),
                            out_specs=(P(), spec)))
  g1, g2 = _device_grads(1), _device_grads(2)
  u, state = f(params, state, g1, g2)
  want = -0.1 * (np.asarray(g1["w"]) + np.asarray(g2["w"])).mean(0) / 2
  np.testing.assert_allclose(np.asarray(u["w"]), want, atol=1e-6)
  assert int(state.gradient_step) == 1


def test_the_finite_test_sees_every_nan_and_infinity_and_no_overflow():
  """_parts.all_finite (sync's and diloco's finite guard): the float sum of x * 0 is NaN exactly
  when some element is a NaN or an infinity, in any dtype, and finite values as large as float32
  allows do not overflow it."""
  from jax_qcomm.transforms import _parts
  big = jnp.full((1000,), 3.0e38, jnp.float32)
  assert bool(_parts.all_finite({"a": big, "b": -big}))
  assert bool(_parts.all_finite({}))
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    x = jnp.ones((4099,), dtype)
    assert bool(_parts.all_finite([x, x[:3]]))
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
      assert not bool(jax.jit(_parts.all_finite)([x, x.at[4098].set(bad)])), (dtype, bad)
