"""The finite guard as the codecs report it (``Codec.allreduce_leaves_marked``).

``collectives.allreduce_tree`` returns, with the result, a mark that ``sync`` turns into its
finite guard. Codecs with shared scales (Summable, Wire16, PowerSGD) answer from a bound on their
results and read the results only where the bound is not finite; the others read the results.
QSGD reads the headers of the payloads it gathers; the exact codec, in one process, has each
device mark its own 1/D of the results. Either way the mark must say "not finite" exactly where a result holds a NaN or an infinity, the
same on every device: checked here against the results themselves, for finite data, NaN, +-Inf on
one device, +Inf and -Inf on two (a NaN sum), and values near the largest float32 (where a bound
cannot answer, and a sum may overflow), at D = 3 on leaves D does not divide.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm import collectives

AX = "data"
D = 3
SHAPES = {"w": (40, 50), "c": (3, 3, 4, 24), "b": (7,)}
ALL = qcomm.LeafPolicy(min_size=0, compress_1d=True)  # every leaf reaches the codec

CODECS = {
    "summable4": qcomm.Summable(4),
    "summable2_nearest": qcomm.Summable(2, rounding="nearest"),
    "wire16": qcomm.Wire16(),
    "wire16_two_fields": qcomm.Wire16(fields=2),
    "powersgd1": qcomm.PowerSGD(1),
    "powersgd2": qcomm.PowerSGD(2),
    "qsgd4": qcomm.QSGD(4),
    "qsgd2_norm": qcomm.QSGD(2, scheme="norm"),
    "qsgd8_nearest": qcomm.QSGD(8, rounding="nearest"),
    "exact": qcomm.NoCompression(),
    "cast_bf16": qcomm.Cast(jnp.bfloat16),
}


def _inputs(case: str) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(3)
  x = {k: rng.standard_normal((D,) + s).astype(np.float32) for k, s in SHAPES.items()}
  if case == "nan":
    x["w"][1, 7, 9] = np.nan
  elif case == "inf":
    x["c"][2, 1, 2, 3, 5] = np.inf
  elif case == "opposite_infs":
    x["b"][0, 4], x["b"][1, 4] = np.inf, -np.inf
  elif case == "huge":  # a bound cannot answer; finite or not, as the codec's arithmetic goes
    x = {k: np.sign(v) * np.float32(3.0e38) for k, v in x.items()}
  elif case == "huge_same_sign":  # the sum of D such values overflows float32
    x = {k: np.full_like(v, 2.0e38) for k, v in x.items()}
  return x


def _reduce(codec, x, op):
  mesh = Mesh(np.array(jax.devices()[:D]), (AX,))

  def body(t):
    out, _, _, mark = collectives.allreduce_tree(
        jax.tree_util.tree_map(lambda a: a[0], t), AX, codec, jax.random.key(5), op,
        policy=ALL)
    vary = lambda a: jax.lax.pcast(a, AX, to="varying")[None]  # noqa: E731
    return jax.tree_util.tree_map(vary, out), vary(mark)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))
  return f(jax.device_put(x, NamedSharding(mesh, P(AX))))


@pytest.mark.parametrize("op", ["mean", "sum"])
@pytest.mark.parametrize("case", ["finite", "nan", "inf", "opposite_infs", "huge",
                                  "huge_same_sign"])
@pytest.mark.parametrize("name", list(CODECS))
def test_mark_says_not_finite_exactly_where_the_result_is_not(name, case, op):
  out, mark = _reduce(CODECS[name], _inputs(case), op)
  mark = np.asarray(mark)
  assert mark.shape == (D,)
  assert np.all((mark == 0) | np.isnan(mark)), mark  # 0 or NaN, nothing else
  for g in range(D):
    finite = all(bool(np.all(np.isfinite(np.asarray(v)[g]))) for v in out.values())
    assert bool(np.isfinite(mark[g])) == finite, (name, case, op, g, mark)
  assert np.array_equal(np.isnan(mark), np.isnan(mark[:1]).repeat(D))  # the same everywhere
  if case in ("nan", "inf", "opposite_infs"):
    assert np.isnan(mark).all()  # a non-finite input never reads as finite


def test_sync_counts_a_huge_but_finite_step_as_finite():
  """Summable saturates a sum beyond float32 (its documented range), so a step of values near the
  largest float32 is finite: the guard must see that through the fallback, not refuse the step."""
  import optax  # noqa: PLC0415

  mesh = Mesh(np.array(jax.devices()[:D]), (AX,))
  tx = qcomm.sync(optax.sgd(1.0), codec=qcomm.Summable(4), policy=ALL)
  params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))(params)

  def step(g, s):
    u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, params)
    return u, s

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(AX), spec), out_specs=(P(), spec)))
  x = jax.device_put(_inputs("huge_same_sign"), NamedSharding(mesh, P(AX)))
  u, state = run(x, state)
  assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree_util.tree_leaves(u))
  assert int(state.total_notfinite) == 0
  u, state = run(jax.device_put(_inputs("nan"), NamedSharding(mesh, P(AX))), state)
  assert int(state.total_notfinite) == 1


def _full_sums_outside_conds(jaxpr, size: int) -> int:
  """Reductions to a scalar of an operand of at least ``size`` elements in ``jaxpr`` and its
  sub-jaxprs, except inside a ``cond``'s branches (what runs only where a bound cannot answer)."""
  found = 0
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name == "reduce_sum" and eqn.outvars[0].aval.shape == ()
        and np.prod(eqn.invars[0].aval.shape) >= size):
      found += 1
    if eqn.primitive.name == "cond":
      continue
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (tuple, list)) else (value,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found += _full_sums_outside_conds(inner, size)
  return found


@pytest.mark.parametrize("name,reads_results", [
    ("summable4", False), ("wire16", False), ("qsgd4", False), ("powersgd1", False),
    ("exact", False), ("cast_bf16", True)])
def test_the_guard_of_a_codec_with_a_bound_does_not_read_the_results(name, reads_results):
  """sync's step: a codec that knows its results' scale sums no full-size array to a scalar
  outside the fallback branch (the guard costs a scalar); the exact codec in one process marks
  only its 1/D of each result; Cast keeps the default, a pass over the results, which shows that
  the count sees one."""
  import optax  # noqa: PLC0415

  mesh = Mesh(np.array(jax.devices()[:D]), (AX,))
  tx = qcomm.sync(optax.sgd(1.0), codec=CODECS[name], policy=ALL)
  params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))(params)

  def step(g, s):
    return tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, params)

  run = jax.shard_map(step, mesh=mesh, in_specs=(P(AX), spec), out_specs=(P(), spec))
  grads = {k: jnp.ones((D,) + s, jnp.float32) for k, s in SHAPES.items()}
  closed = jax.make_jaxpr(run)(grads, state)
  found = _full_sums_outside_conds(closed.jaxpr, 800)  # the leaves' sizes: 2000, 864 (and 7)
  assert (found > 0) == reads_results, found
