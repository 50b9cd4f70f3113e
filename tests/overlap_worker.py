"""One process of tests/test_overlap.py's multi-process case (run by ``jax_qcomm.tools.launch -n 2
--local-devices 2``): diloco with delay=1 over the processes' first devices, once by the ordinary
runner and once overlapped (each process's second device sends); writes ``<out>/<process>.json``
with whether the two ended bit-identical and a hash of the anchor."""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

from jax_qcomm.tools import distributed

distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_qcomm as qcomm  # noqa: E402


def loss_fn(p, b):
  return jnp.mean((jnp.tanh(b @ p["w"]) @ p["v"] - 1.0) ** 2)


def main(out: str) -> None:
  first = [d for d in jax.devices() if d.id % 2048 == 0]  # each process's first device
  mesh = Mesh(np.array(first), ("node",))
  params = {"w": jnp.full((40, 41), 0.02), "v": jnp.full((41, 3), 0.05)}
  rng = np.random.default_rng(0)
  batches = [rng.standard_normal((4, 40)).astype(np.float32) for _ in range(9)]
  ends = {}
  for overlap in (False, True):
    tx = qcomm.diloco(optax.adam(0.03), axis_name="node", every=2, codec=qcomm.QSGD(4),
                      error_feedback=True, delay=1)
    dp = qcomm.data_parallel(loss_fn, tx, mesh, axis_name="node", overlap=overlap)
    p, state = params, dp.init(params)
    for b in batches:
      batch = multihost_utils.host_local_array_to_global_array(
          b[2 * jax.process_index():2 * jax.process_index() + 2], mesh, jax.P("node"))
      p, state, _, _ = dp.step(p, state, batch)
    if overlap:
      state = dp.flush(state)
      comm = dp._comm_mesh.devices.flat[jax.process_index()].id
    local = [np.asarray(s.data) for leaf in jax.tree_util.tree_leaves((p, state))
             for s in sorted(leaf.addressable_shards, key=lambda s: s.device.id)]
    ends[overlap] = (local, state)
  equal = all(np.array_equal(a, b) for a, b in zip(ends[False][0], ends[True][0]))
  anchor = b"".join(np.asarray(leaf.addressable_shards[0].data).tobytes()
                    for leaf in jax.tree_util.tree_leaves(p))
  state = ends[True][1]
  row = {"equal": bool(equal), "anchor_sha": hashlib.sha256(anchor).hexdigest(),
         "outer_step": int(state.outer_step), "total_notfinite": int(state.total_notfinite),
         "comm_device": int(comm)}
  pathlib.Path(out, f"{jax.process_index()}.json").write_text(json.dumps(row))


if __name__ == "__main__":
  main(sys.argv[1])
