"""The all-to-all schedules of jax_qcomm.transport._exchange: the same bytes as lax.all_to_all, every size.

Runs on the host CPU devices of tests/conftest.py; the rounds are forced with method="rounds" where
"auto" would pick them anyway (CPU), and compared with lax.all_to_all on the same rows.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jax_qcomm.transport import _exchange


def _run(mesh: Mesh, axis, spec, rows: np.ndarray, method: str) -> np.ndarray:
  fn = jax.jit(jax.shard_map(lambda r: _exchange.exchange(r[0], axis, method)[None], mesh=mesh,
                             in_specs=spec, out_specs=spec))
  return np.asarray(fn(rows))


def _rows(d: int, w: int, dtype, seed: int = 0) -> np.ndarray:
  info = np.iinfo(dtype)
  return np.random.default_rng(seed).integers(info.min, info.max, (d, d, w), dtype=dtype, endpoint=True)


@pytest.mark.parametrize("d", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("w,dtype", [(64, np.uint8), (33, np.uint8), (7, np.uint16)])
def test_rounds_equal_all_to_all(d, w, dtype):
  """Row j of device i arrives as row i of device j, for every size (4: Hamiltonian halves, odd
  widths padded; others: shift rounds) and both wire word types."""
  mesh = Mesh(np.array(jax.devices("cpu")[:d]), ("x",))
  rows = _rows(d, w, dtype, seed=d * 100 + w)
  want = _run(mesh, "x", P("x"), rows, "all_to_all")
  got = _run(mesh, "x", P("x"), rows, "rounds")
  auto = _run(mesh, "x", P("x"), rows, "auto")
  np.testing.assert_array_equal(want, rows.transpose(1, 0, 2))  # the definition, checked too
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(auto, want)


@pytest.mark.parametrize("shape", [(2, 2), (2, 4)])
def test_rounds_over_a_tuple_of_axes(shape):
  mesh = Mesh(np.array(jax.devices("cpu")[:shape[0] * shape[1]]).reshape(shape), ("o", "i"))
  d = shape[0] * shape[1]
  rows = _rows(d, 40, np.uint8, seed=d)
  spec = P(("o", "i"))
  np.testing.assert_array_equal(_run(mesh, ("o", "i"), spec, rows, "rounds"),
                                _run(mesh, ("o", "i"), spec, rows, "all_to_all"))


def test_hamiltonian_schedule_sends_every_half_once_without_swaps():
  rounds = _exchange.hamiltonian_schedule_4()
  assert len(rounds) == 6
  sent = []
  for succ, half in rounds:
    assert sorted(succ) == [0, 1, 2, 3]                       # a permutation: one send, one receive
    assert all(succ[i] != i for i in range(4))                # nobody sends to itself
    assert all(succ[succ[i]] != i for i in range(4))          # no swap (i <-> j) in a round
    sent += [(i, succ[i], half[i]) for i in range(4)]
  want = [(i, j, p) for i, j in itertools.permutations(range(4), 2) for p in (0, 1)]
  assert sorted(sent) == sorted(want)


def test_rounds_lower_to_ppermutes_and_auto_keeps_all_to_all_in_one_process():
  """4 devices: "rounds" is six collective-permutes and no all-to-all; "auto" in a single process
  (in-process collectives) is the all-to-all. Across processes "auto" is the rounds:
  tests/test_multiprocess.py checks that."""
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("x",))

  def compiled(method):
    fn = jax.jit(jax.shard_map(lambda r: _exchange.exchange(r[0], "x", method)[None], mesh=mesh,
                               in_specs=P("x"), out_specs=P("x")))
    return fn.lower(_rows(4, 16, np.uint8)).compile().as_text()

  rounds = compiled("rounds")
  assert rounds.count("collective-permute(") == 6, rounds
  assert "all-to-all" not in rounds
  auto = compiled("auto")
  assert "all-to-all" in auto and "collective-permute" not in auto


def test_bad_method_raises():
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("x",))
  with pytest.raises(ValueError, match="method must be one of"):
    _run(mesh, "x", P("x"), _rows(4, 8, np.uint8), "ring")
  import jax_qcomm as qcomm

  x = np.random.default_rng(0).standard_normal((4, 1024)).astype(np.float32)
  for fn in (qcomm.allreduce, qcomm.reduce_scatter):
    with pytest.raises(ValueError, match="exchange must be one of"):
      jax.shard_map(lambda v, fn=fn: fn(v[0], "x", qcomm.Cast(), exchange="ring")[None], mesh=mesh,
                    in_specs=P("x"), out_specs=P("x"))(x)


def test_the_exchange_argument_picks_the_schedule():
  """The schedule is an argument of the collectives (no global switch): the traced program has
  the schedule its caller passed, and a jitted function without it keeps "auto"."""
  import jax_qcomm as qcomm

  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("x",))
  x = np.random.default_rng(0).standard_normal((4, 4 * 128)).astype(np.float32)

  def hlo(**kw):
    fn = jax.jit(jax.shard_map(lambda v: qcomm.allreduce(v[0], "x", qcomm.Cast(), **kw)[None],
                               mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return fn.lower(x).as_text()

  assert "all_to_all" not in hlo(exchange="rounds") and "collective_permute" in hlo(exchange="rounds")
  assert "all_to_all" in hlo()  # "auto": all-to-all within one process
  assert "all_to_all" in hlo(exchange="all_to_all")


@pytest.mark.parametrize("d", [4, 8])
def test_allreduce_and_reduce_scatter_bytes_do_not_depend_on_the_schedule(d):
  """qcomm.allreduce / reduce_scatter (QSGD 4 stochastic, Cast bf16) give bit-identical results with
  the rounds and with lax.all_to_all."""
  import jax_qcomm as qcomm

  mesh = Mesh(np.array(jax.devices("cpu")[:d]), ("x",))
  x = np.random.default_rng(d).standard_normal((d, 8 * d * 128 + 5)).astype(np.float32)
  key = jax.random.key(7)
  codecs = (qcomm.QSGD(bits=4), qcomm.Cast(jnp.bfloat16))

  def per_device(v, method):
    v = v[0]
    outs = [qcomm.allreduce(v, "x", codec=c, key=key, exchange=method) for c in codecs]
    outs += [qcomm.reduce_scatter(v[: 8 * d * 128], "x", codec=c, key=key, exchange=method)
             for c in codecs]
    return tuple(o[None] for o in outs)

  def run(method):
    fn = jax.jit(jax.shard_map(functools.partial(per_device, method=method), mesh=mesh,
                               in_specs=P("x"), out_specs=(P("x"),) * 4))
    hlo = fn.lower(x).as_text()
    out = [np.asarray(o) for o in fn(x)]
    return out, hlo

  (got, hlo_rounds), (want, hlo_a2a) = run("rounds"), run("all_to_all")
  assert "collective_permute" in hlo_rounds and "all_to_all" not in hlo_rounds  # really different
  assert "all_to_all" in hlo_a2a and "collective_permute" not in hlo_a2a
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
