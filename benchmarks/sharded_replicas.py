"""Replica identity of the sharded mode over many steps: ``sync(adam, codec=QSGD(4),
shard_state=True, gather_codec=QSGD(8, nearest), error_feedback=True)`` on a tree whose leaves D
does not divide (rows 7, 5, 2; a 0-d leaf), random gradients every step; after every step each
device's parameters are compared bit for bit with every other device's on the device (``pmax ==
pmin`` of the bits), and the steps that differ are counted.

    python -m benchmarks.sharded_replicas --devices 3 --steps 1000
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_qcomm as qcomm  # noqa: E402

AX = "data"


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--devices", type=int, default=3)
  ap.add_argument("--steps", type=int, default=1000)
  args = ap.parse_args(argv)
  d = args.devices
  mesh = Mesh(np.array(jax.devices()[:d]), (AX,))
  params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((7, 3000)), jnp.float32),
            "b": jnp.zeros((5,)), "s": jnp.float32(0.5), "v": jnp.ones((2, 3, 500))}
  tx = qcomm.sync(optax.adamw(1e-3, weight_decay=1e-4), axis_name=AX, codec=qcomm.QSGD(4),
                  shard_state=True, gather_codec=qcomm.QSGD(8, rounding="nearest"),
                  error_feedback=True, min_size=16)
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))(params)

  def step(p, s, key):
    g = jax.tree_util.tree_map(  # this device's own random gradient
        lambda x: jax.random.normal(jax.random.fold_in(key, lax.axis_index(AX)), jnp.shape(x)),
        p)
    u, s = tx.update(g, s, p)
    p = optax.apply_updates(p, u)
    bits = [lax.bitcast_convert_type(lax.pcast(x, AX, to="varying"), jnp.uint32).reshape(-1)
            for x in jax.tree_util.tree_leaves(p)]
    same = jnp.all(jnp.stack([jnp.all(lax.pmax(b, AX) == lax.pmin(b, AX)) for b in bits]))
    return p, s, same

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P()),
                              out_specs=(P(), spec, P())))
  differing, t0 = 0, time.perf_counter()
  for i in range(args.steps):
    params, state, same = run(params, state, jax.random.key(i))
    differing += int(not bool(same))
  out = dict(devices=d, steps=args.steps, steps_with_differing_replicas=differing,
             finite=bool(all(np.all(np.isfinite(np.asarray(x)))
                             for x in jax.tree_util.tree_leaves(params))),
             seconds=round(time.perf_counter() - t0, 1))
  print(out)
  return out


if __name__ == "__main__":
  main()
