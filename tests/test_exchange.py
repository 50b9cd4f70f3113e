"""The all-to-all schedules of jax_qcomm._exchange: the same bytes as lax.all_to_all, every size.

Runs on the host CPU devices of tests/conftest.py; the rounds are forced with method="rounds" where
"auto" would pick them anyway (CPU), and compared with lax.all_to_all on the same rows.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jax_qcomm import _exchange


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


def test_cpu_auto_lowers_to_ppermutes():
  """On CPU "auto" is the rounds (collective-permutes, no all-to-all) for 4 devices."""
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("x",))
  fn = jax.jit(jax.shard_map(lambda r: _exchange.exchange(r[0], "x")[None], mesh=mesh,
                             in_specs=P("x"), out_specs=P("x")))
  text = fn.lower(_rows(4, 16, np.uint8)).compile().as_text()
  assert text.count("collective-permute(") == 6, text
  assert "all-to-all" not in text


def test_bad_method_raises():
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("x",))
  with pytest.raises(ValueError, match="method must be one of"):
    _run(mesh, "x", P("x"), _rows(4, 8, np.uint8), "ring")
  with pytest.raises(ValueError, match="method must be one of"):
    with _exchange.using("ring"):
      pass


def test_using_sets_the_method_at_trace_time():
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("x",))

  def hlo():
    fn = jax.jit(jax.shard_map(lambda r: _exchange.exchange(r[0], "x")[None], mesh=mesh,
                               in_specs=P("x"), out_specs=P("x")))
    return fn.lower(_rows(4, 16, np.uint8)).as_text()

  with _exchange.using("all_to_all"):
    assert "all_to_all" in hlo()
  assert "all_to_all" not in hlo()  # back to "auto": rounds on CPU
