"""qcomm.Auto (what sync(bits=b) runs): the candidate it picks is the one whose traffic takes the
least time on the transport; it runs exactly that candidate (same bits), replicas stay identical,
and describe names it and counts what the compiled program sends."""

from __future__ import annotations

import types

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.transport import cost as T

from tests.test_protocol import AX, PARAMS, _grads, _mesh, _sync_step, hlo_sent_bytes

#: A transport on which the all-reduce is the cheap collective (gloo between two processes before
#: its messages were cut into pieces, made stronger), so that Summable wins at every D the tests
#: use.
CHEAP_PSUM = T.Transport(allreduce=1.0, all_to_all=4.0, all_gather=4.0, reduce_scatter=4.0)


def _use(monkeypatch, transport: T.Transport) -> None:
  monkeypatch.setattr(T, "current", lambda devices: transport)


def test_the_rule_on_the_measured_transports():
  for bits in range(3, 9):
    a = qcomm.Auto(bits)
    # gloo between two processes (the exchange and all-gather in pieces, near the link rate),
    # gloo from three processes and the ideal transport: QSGD's fewer bytes win
    assert a.resolve(2, transport=T.GLOO_PAIR) == qcomm.QSGD(bits)
    for d in (3, 4, 8, 64):
      assert a.resolve(d, transport=T.GLOO) == qcomm.QSGD(bits), (bits, d)
    for d in (2, 3, 8, 64):
      assert a.resolve(d, transport=T.IDEAL) == qcomm.QSGD(bits), (bits, d)
    assert a.resolve(2, "reduce_scatter", T.GLOO_PAIR) == qcomm.QSGD(bits)
    # where the all-reduce is much the cheapest collective, Summable's one all-reduce wins
    assert a.resolve(2, transport=CHEAP_PSUM) == qcomm.Summable(bits)
  # 1 and 2 bits have one candidate; one device sends nothing, and QSGD wins the tie
  assert qcomm.Auto(1).resolve(2, transport=CHEAP_PSUM) == qcomm.QSGD(1, 64)
  assert qcomm.Auto(2).candidates == (qcomm.QSGD(2, 64),)  # bucket 64 at 1 and 2 bits
  assert qcomm.Auto(3).bucket_size == 128 and qcomm.Auto(2, 256).bucket_size == 256
  assert qcomm.Auto(4).resolve(1, transport=CHEAP_PSUM) == qcomm.QSGD(4)
  # the candidates carry the bucket, rounding, scheme and impl
  a = qcomm.Auto(3, 64, scheme="norm", rounding="nearest", impl="jax")
  assert a.candidates == (qcomm.QSGD(3, 64, "norm", "nearest", "jax"),
                          qcomm.Summable(3, 64, "nearest", "jax"))


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(bits=st.integers(1, 8), d=st.integers(1, 300),
                  collective=st.sampled_from(["allreduce", "reduce_scatter", "all_gather"]),
                  factors=st.tuples(*[st.floats(0.25, 8.0)] * 4))
def test_it_picks_the_least_weighted_bytes(bits, d, collective, factors):
  t = T.Transport(*factors)
  a = qcomm.Auto(bits)
  picked = a.resolve(d, collective, t)
  assert picked in a.candidates
  n = 1 << 20
  cost = {c: t.weighted_bytes(c.traffic(n, d, collective)) for c in a.candidates}
  assert cost[picked] == min(cost.values())
  # its own byte count is that of the codec it picks on the running transport
  here = a.resolve(d, collective)
  assert a.traffic(12345, d, collective) == here.traffic(12345, d, collective)
  assert a.wire_bits(d) == a.resolve(d).wire_bits(d)


def test_the_transport_follows_the_processes(monkeypatch):
  assert T.current(2) is T.IDEAL  # this test process: one process, memory copies

  def fake(backend, processes, impl):
    return types.SimpleNamespace(default_backend=lambda: backend, process_count=lambda: processes,
                                 config=types.SimpleNamespace(jax_cpu_collectives_implementation=impl))

  monkeypatch.setattr(T, "jax", fake("cpu", 2, "gloo"))
  assert T.current(2) is T.GLOO_PAIR and T.current(3) is T.GLOO and T.current(8) is T.GLOO
  for backend, processes, impl in [("cpu", 1, "gloo"), ("cpu", 2, "mpi"), ("gpu", 2, "gloo")]:
    monkeypatch.setattr(T, "jax", fake(backend, processes, impl))
    assert T.current(2) is T.IDEAL, (backend, processes, impl)


def test_sync_bits_is_auto_and_forcing_stays_possible():
  from jax_qcomm.transforms.sync import config_of
  assert config_of(qcomm.sync(optax.sgd(0.1), bits=4)).codec == qcomm.Auto(4)
  assert config_of(qcomm.sync(optax.sgd(0.1), bits=2, error_feedback=True)).codec == qcomm.Auto(
      2, rounding="nearest")
  assert config_of(qcomm.sync(optax.sgd(0.1), codec=qcomm.QSGD(4))).codec == qcomm.QSGD(4)


def _run(tx, d, steps=3):
  init, run = _sync_step(tx, _mesh(d), PARAMS)
  params, state, out = PARAMS, init(PARAMS), []
  for i in range(steps):
    params, state = run(params, state, _grads(d, i, PARAMS))
    out.append(jax.tree_util.tree_map(np.asarray, params))
  return out


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("transport,want", [(CHEAP_PSUM, qcomm.Summable(4, rounding="nearest")),
                                           (T.IDEAL, qcomm.QSGD(4, rounding="nearest"))])
def test_auto_runs_its_candidate_bit_for_bit(monkeypatch, d, transport, want):
  """Error feedback over three steps, at device counts that do not divide the leaves: the same
  bits as the candidate forced, and describe names it and counts the compiled program's bytes."""
  _use(monkeypatch, transport)
  auto = qcomm.sync(optax.sgd(0.1), axis_name=AX, bits=4, error_feedback=True)
  forced = qcomm.sync(optax.sgd(0.1), axis_name=AX, codec=want, error_feedback=True)
  got, ref = _run(auto, d), _run(forced, d)
  for a, b in zip(got, ref):
    for k in PARAMS:
      np.testing.assert_array_equal(a[k], b[k])
  desc = qcomm.describe(auto, PARAMS, devices=d)
  by = {leaf.path: leaf for leaf in desc.leaves}
  assert by["w"].codec == want and by["b"].codec == qcomm.NoCompression()
  assert f"(here: {want.name})" in desc.table()
  init, run = _sync_step(auto, _mesh(d), PARAMS)
  text = run.lower(PARAMS, init(PARAMS), _grads(d, 0, PARAMS)).compile().as_text()
  assert desc.sent_bytes_per_sync == pytest.approx(hlo_sent_bytes(text, d), rel=1e-9)


def test_replicas_agree_under_auto(monkeypatch):
  """Per-device results of the auto allreduce (Summable picked) are bit-identical at D = 3."""
  _use(monkeypatch, CHEAP_PSUM)
  mesh = _mesh(3)
  x = jax.random.normal(jax.random.key(0), (3, 1000), jnp.float32)

  def body(v):
    return qcomm.allreduce(v[0], AX, qcomm.Auto(4), jax.random.key(1))[None]

  out = np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX),
                                         out_specs=P(AX)))(x))
  assert all(np.array_equal(out[0], out[i]) for i in range(3))
  ref = np.asarray(jax.jit(jax.shard_map(
      lambda v: qcomm.allreduce(v[0], AX, qcomm.Summable(4), jax.random.key(1))[None],
      mesh=mesh, in_specs=P(AX), out_specs=P(AX)))(x))
  np.testing.assert_array_equal(out, ref)


def test_sharded_mode_resolves_for_the_reduce_scatter(monkeypatch):
  """shard_state=True: the gradients' reduce-scatter resolves for a reduce-scatter (here Summable's
  psum_scatter, on a transport where it is cheap), the same bits as Summable forced, and the state
  made at init fits the update."""
  cheap = T.Transport(allreduce=1.0, reduce_scatter=1.0, all_to_all=4.0, all_gather=4.0)
  _use(monkeypatch, cheap)
  assert qcomm.Auto(4).resolve(3, "reduce_scatter") == qcomm.Summable(4)
  assert qcomm.Auto(4).resolve(3, "reduce_scatter", T.IDEAL) == qcomm.QSGD(4)
  tx = qcomm.sync(optax.adam(1e-2), axis_name=AX, bits=4, shard_state=True)
  forced = qcomm.sync(optax.adam(1e-2), axis_name=AX, codec=qcomm.Summable(4), shard_state=True)
  for a, b in zip(_run(tx, 3, steps=2), _run(forced, 3, steps=2)):
    for k in PARAMS:
      np.testing.assert_array_equal(a[k], b[k])
  by = {leaf.path: leaf for leaf in qcomm.describe(tx, PARAMS, devices=3).leaves}
  assert by["w"].codec == qcomm.Summable(4)


def test_the_rule_table_runs(capsys):
  from benchmarks import auto_rule
  assert auto_rule.main(["--bits", "4", "--devices", "2", "3"]) == 0
  out = capsys.readouterr().out
  assert "| 4 | 2 | gloo |" in out and out.count("| QSGD |") == 4  # every D, both transports
  assert "| 4 | 8 x 8 |" in out
