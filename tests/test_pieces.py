"""Messages in pieces (``Transport.message_bytes``, ``jax_qcomm.transport._exchange``): the exchange, the
all-gather and the reduce-scatter of summed words run one collective per piece where the transport
bounds a message. Oracles: the same bits as whole messages (XLA's own collectives), more
collectives in the compiled program, the same bytes; ``sync`` trains to the same bits with every
replica identical, replicated and sharded, at world sizes that do not divide the leaves.

The tests run in one process, where :func:`jax_qcomm.transport.current` is the ideal transport;
they put a transport with tiny messages in its place.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import optax
import pytest

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.transport import _exchange
from jax_qcomm.native import _ffi
from jax_qcomm.transport import cost as T

from test_protocol import _COLLECTIVE, AX, PARAMS, _grads, _mesh, _sync_step, hlo_sent_bytes
import test_sharded

#: Every collective's rows cut into pieces of at most 40 bytes.
SMALL = T.Transport(message_bytes=40)


def _use(monkeypatch, transport):
  monkeypatch.setattr(T, "current", lambda devices: transport)


def _collectives(fn, *args) -> list[str]:
  text = fn.lower(*args).compile().as_text()
  return [op for _, op in _COLLECTIVE.findall(text)]


def test_message_bytes_is_checked():
  for bad in (0, -3, 2.5, True, "1"):
    with pytest.raises(ValueError, match="message_bytes must be None or an integer >= 1"):
      T.Transport(message_bytes=bad)
  assert T.IDEAL.message_bytes is None and T.GLOO.message_bytes is None
  assert T.GLOO_PAIR.message_bytes == 1 << 20


@pytest.mark.parametrize("d", [2, 3, 4])
def test_pieces_give_the_bits_of_whole_messages(monkeypatch, d):
  """exchange (uint8 rows of 103 bytes: 3 pieces), gather (uint32[37]: 4 pieces) and scatter_sum
  (float32 and uint32 blocks of 29: 3 pieces) against lax.all_to_all / all_gather / psum_scatter,
  bit for bit, under a transport of 40-byte messages."""
  rng = np.random.default_rng(d)
  rows = rng.integers(0, 256, (d, d, 103), dtype=np.uint8)
  words = rng.integers(0, 1 << 20, (d, 37), dtype=np.uint32)
  floats = rng.standard_normal((d, d * 29)).astype(np.float32)
  ints = rng.integers(0, 1 << 20, (d, d * 29), dtype=np.uint32)

  def ours(r, w, f, i):
    return (_exchange.exchange(r[0], AX, "rounds")[None], _exchange.gather(w[0], AX)[None],
            _exchange.scatter_sum(f[0], AX)[None], _exchange.scatter_sum(i[0], AX)[None])

  def xla(r, w, f, i):
    return (lax.all_to_all(r[0], AX, 0, 0, tiled=True)[None],
            lax.all_gather(w[0], AX, to="invarying")[None],
            lax.psum_scatter(f[0], AX, scatter_dimension=0, tiled=True)[None],
            lax.psum_scatter(i[0], AX, scatter_dimension=0, tiled=True)[None])

  mesh = _mesh(d)
  wrap = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))  # noqa: E731
  args = (rows, words, floats, ints)
  _use(monkeypatch, SMALL)
  got = wrap(ours)(*args)
  pieces = _collectives(wrap(ours), *args)
  _use(monkeypatch, T.IDEAL)
  whole = _collectives(wrap(ours), *args)
  want = wrap(xla)(*args)
  for g, w in zip(got, want):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
  assert pieces.count("all-gather") == 4 * whole.count("all-gather")
  assert pieces.count("reduce-scatter") == 3 * whole.count("reduce-scatter") == 6
  moved = lambda ops: len(ops) - ops.count("all-gather") - ops.count("reduce-scatter")  # noqa: E731
  assert moved(pieces) == 3 * moved(whole)  # the exchange: all-to-alls (2) or permutes (3, 4)


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("shard_state", [False, True])
def test_sync_in_pieces_trains_to_the_same_bits(monkeypatch, d, shard_state):
  """sync(bits=4) with error feedback, 4 steps, replicated and sharded: every replica holds the
  same bits after every step, and the parameters are those of whole messages."""
  def train():
    tx = qcomm.sync(test_sharded._inner(), axis_name=AX, bits=4, error_feedback=True, min_size=16,
                    shard_state=shard_state)
    params, _ = test_sharded._train(tx, d, 4, check_identical=True)
    return jax.tree_util.tree_map(np.asarray, params)

  _use(monkeypatch, SMALL)
  got = train()
  _use(monkeypatch, T.IDEAL)
  want = train()
  for k in got:
    np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint32),
                                  np.asarray(want[k]).view(np.uint32))


@pytest.mark.parametrize("d", [2, 3])
def test_describe_counts_the_bytes_sent_in_pieces(monkeypatch, d):
  _use(monkeypatch, SMALL)
  tx = qcomm.sync(optax.sgd(0.1), axis_name=AX, codec=qcomm.QSGD(4))
  init, run = _sync_step(tx, _mesh(d), PARAMS)
  text = run.lower(PARAMS, init(PARAMS), _grads(d, 0, PARAMS)).compile().as_text()
  assert len(_COLLECTIVE.findall(text)) > 10  # the rows went in pieces
  desc = qcomm.describe(tx, PARAMS, devices=d)
  assert desc.sent_bytes_per_sync == pytest.approx(hlo_sent_bytes(text, d), rel=1e-9)


@pytest.mark.multiprocess
def test_pieces_across_two_processes():
  """2 processes x 1 device over gloo (GLOO_PAIR): replicated, sharded and exact sharded sync with
  every row in pieces give the bits of whole rows, the same on both processes after every step
  (tests/pieces_mp_worker.py)."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pieces_mp_worker.py")
  proc = subprocess.run([sys.executable, "-m", "jax_qcomm.tools.launch", "-n", "2",
                         "--local-devices", "1", "--timeout", "240", worker], env=env,
                        capture_output=True, text=True, timeout=270,
                        cwd=os.path.dirname(os.path.dirname(worker)))
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  assert proc.stdout.count(": OK") == 2, proc.stdout[-4000:]


#: The kernels of each mode's step that take or write the message's pieces.
_PIECE_KERNELS = {
    False: ("qcomm_qsgd_encode_leaves", "qcomm_qsgd_decode_sum_reencode_own",
            "qcomm_qsgd_decode_pieces"),
    True: ("qcomm_qsgd_encode_chunks", "qcomm_qsgd_decode_sum_chunks",
           "qcomm_qsgd_encode_differences", "qcomm_qsgd_decode_chunks"),
}


@pytest.mark.skipif(not _ffi.has_cpu_kernels(), reason="no CPU kernels built")
@pytest.mark.parametrize("shard_state", [False, True], ids=["replicated", "sharded"])
def test_kernels_read_and_write_the_pieces_where_they_lie(monkeypatch, shard_state):
  """sync(bits=4)'s step in pieces on CPU, replicated and sharded: the encodes write the pieces
  that travel, the reductions read the received ones (and the replicated one writes the pieces it
  sends on), the last decodes read the gathered ones, all where they lie: the compiled program
  never copies a message (no uint8 concatenate, slice or copy), and the kernels take the pieces
  as operands or results."""
  _use(monkeypatch, SMALL)
  tx = qcomm.sync(optax.sgd(0.1), axis_name=AX, codec=qcomm.QSGD(4), shard_state=shard_state)
  init, run = _sync_step(tx, _mesh(2), PARAMS)
  text = run.lower(PARAMS, init(PARAMS), _grads(2, 0, PARAMS)).compile().as_text()
  entry = text[text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  copies = re.findall(r"= u8\[[^\]]*\]\S* (concatenate|fusion|slice|copy|dynamic-slice)\(", entry)
  assert not copies, copies
  for target in _PIECE_KERNELS[shard_state]:
    calls = [line for line in text.splitlines() if f'custom_call_target="{target}"' in line]
    assert calls, target
    assert all(line.count("u8[") > 10 for line in calls), target  # pieces in or out
