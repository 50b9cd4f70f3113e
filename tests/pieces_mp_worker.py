"""Worker of tests/test_pieces.py::test_pieces_across_two_processes, started as

    python -m jax_qcomm.tools.launch -n 2 --local-devices 1 tests/pieces_mp_worker.py

Two processes over gloo, one device each: the transport is ``GLOO_PAIR``, whose messages go in
pieces. Each process trains ``sync(adamw, bits=4, error_feedback=True)`` replicated, sharded, and
exact sharded for 3 steps twice: with ``GLOO_PAIR``'s message bound set to 256 bytes (every row in
pieces) and with none (whole rows), and checks: the same bits both ways, the same bits on both
processes after every step, and more collectives in the program with pieces. Exits 1 on a
mismatch.
"""

import dataclasses
import sys

import numpy as np

from jax_qcomm.tools import distributed

distributed.initialize()
import jax  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_qcomm as qcomm  # noqa: E402
from jax_qcomm.transport import cost as T  # noqa: E402

pid = jax.process_index()
mesh = distributed.global_mesh(("data",))
d = mesh.devices.size
assert d == 2 and T.current(d) is T.GLOO_PAIR, (d, T.current(d))
PARAMS = {"w": np.linspace(-1, 1, 37 * 53, dtype=np.float32).reshape(37, 53),
          "v": np.ones((3, 7, 64), np.float32), "b": np.zeros((5,), np.float32)}


def grads(step):
  def one(g):
    rng = np.random.default_rng(100 * step + g)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in PARAMS.items()}
  return {k: jax.make_array_from_callback(
      (d,) + v.shape, NamedSharding(mesh, P("data")),
      lambda idx, k=k: np.stack([one(g)[k] for g in range(*idx[0].indices(d))]))
      for k, v in PARAMS.items()}


def train(tx):
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, PARAMS))
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))

  def step(p, s, g):
    u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
    return optax.apply_updates(p, u), s

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P("data")),
                              out_specs=(P(), spec)))
  params, state, seen = PARAMS, init(PARAMS), []
  for i in range(3):
    g = grads(i)
    if i == 0:
      text = run.lower(params, state, g).compile().as_text()
      ops = sum(text.count(f" {op}(") for op in ("all-to-all", "all-gather", "reduce-scatter",
                                                   "collective-permute"))
    params, state = run(params, state, g)
    local = {k: np.asarray(v.addressable_shards[0].data) for k, v in params.items()}
    both = multihost_utils.process_allgather(local)  # [2, ...] per leaf: each process's copy
    for k, v in both.items():
      if not np.array_equal(v[0].view(np.uint8), v[1].view(np.uint8)):
        print(f"process {pid}: step {i} leaf {k}: the processes differ", flush=True)
        return None, ops
    seen.append(local)
  return seen, ops


ok = True
modes = {"replicated": dict(bits=4, error_feedback=True),
         "sharded": dict(bits=4, error_feedback=True, shard_state=True),
         "exact sharded": dict(bits=32, shard_state=True)}
pair = T.GLOO_PAIR
for name, kw in modes.items():
  results = {}
  for bound in (256, None):
    T.GLOO_PAIR = dataclasses.replace(pair, message_bytes=bound)
    results[bound] = train(qcomm.sync(optax.adamw(1e-2), axis_name="data", min_size=16, **kw))
  T.GLOO_PAIR = pair
  (pieces, n_pieces), (whole, n_whole) = results[256], results[None]
  same = pieces is not None and whole is not None and all(
      np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8))
      for a, b in zip(pieces, whole) for k in a)
  more = n_pieces > n_whole
  ok &= same and more
  print(f"process {pid}: {name}: pieces equal whole rows: {same}; collectives {n_pieces} "
        f"in pieces, {n_whole} whole", flush=True)
multihost_utils.sync_global_devices("done")
print(f"process {pid}: {'OK' if ok else 'MISMATCH'}", flush=True)
sys.exit(0 if ok else 1)
