"""Can a collective run while other work computes, on XLA:CPU? A minimal reproduction.

    python -m jax_qcomm.tools.cluster --nodes 2 --rate 10mbit --local-devices 2 \\
        --out notebooks/data/slow_link/overlap_probe.json -- scripts/overlap_probe.py

Each process (a node of the simulated cluster) has two host devices. ``comm`` is a ``psum`` of
``--mb`` MB per process across the processes; ``compute`` is a loop of 512 x 512 matmuls on one
device, sized to take about as long as ``comm``. Each row is the median of ``--reps`` timings of
both finishing:

* ``one_device_two_programs``: ``comm`` over the processes' first devices, then ``compute`` on
  the first device, dispatched back to back (asynchronous dispatch, no wait in between);
* ``one_device_one_program``: both in one ``shard_map`` program over the first devices;
* ``two_devices``: ``comm`` over the processes' second devices, ``compute`` on the first.

Overlap shows as a row near ``max(comm, compute)``; none as a row near their sum.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jax_qcomm.tools import distributed

distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


def timed(f) -> float:
  t = time.perf_counter()
  jax.block_until_ready(f())
  return time.perf_counter() - t


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--mb", type=float, default=1.0, help="MB per process in the psum")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  if jax.local_device_count() < 2:
    raise SystemExit("needs 2 host devices per process (--local-devices 2)")
  by_process = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                for p in range(jax.process_count())]
  first = Mesh([r[0] for r in by_process], ("x",))
  second = Mesh([r[1] for r in by_process], ("x",))
  n = int(args.mb * 2**20 / 4)

  def operand(mesh):
    return jax.make_array_from_callback((mesh.size * n,), NamedSharding(mesh, P("x")),
                                        lambda _: jnp.ones((n,), jnp.float32))

  def psum_on(mesh):
    return jax.jit(jax.shard_map(lambda x: lax.psum(x, "x"), mesh=mesh, in_specs=P("x"),
                                 out_specs=P("x")))

  here = by_process[jax.process_index()][0]
  w = jax.device_put(jnp.eye(512, dtype=jnp.float32) * 0.999, here)
  loop = lambda iters: lambda m: lax.fori_loop(0, iters, lambda i, a: jnp.tanh(a @ m), m)  # noqa: E731
  comm1, x1 = psum_on(first), operand(first)
  comm2, x2 = psum_on(second), operand(second)
  jax.block_until_ready((comm1(x1), comm2(x2)))
  one = jax.jit(loop(1))
  jax.block_until_ready(one(w))
  t_comm = statistics.median(timed(lambda: comm1(x1)) for _ in range(3))
  t_one = min(timed(lambda: one(w)) for _ in range(3))
  iters = max(1, round(t_comm / t_one))
  compute = jax.jit(loop(iters))
  w_mesh = jax.device_put(jnp.eye(512, dtype=jnp.float32) * 0.999, NamedSharding(first, P()))
  both = jax.jit(jax.shard_map(lambda x, m: (lax.psum(x, "x"), loop(iters)(m)), mesh=first,
                               in_specs=(P("x"), P()), out_specs=(P("x"), P())))
  jax.block_until_ready((compute(w), both(x1, w_mesh)))
  rows = {"comm": [], "compute": [], "one_device_two_programs": [],
          "one_device_one_program": [], "two_devices": []}
  for _ in range(args.reps):
    rows["comm"].append(timed(lambda: comm1(x1)))
    rows["compute"].append(timed(lambda: compute(w)))
    rows["one_device_two_programs"].append(timed(lambda: (comm1(x1), compute(w))))
    rows["one_device_one_program"].append(timed(lambda: both(x1, w_mesh)))
    rows["two_devices"].append(timed(lambda: (comm2(x2), compute(w))))
  result = {k: statistics.median(v) for k, v in rows.items()}
  result.update(overlap_would_be=max(result["comm"], result["compute"]),
                serial_would_be=result["comm"] + result["compute"], mb=args.mb, reps=args.reps,
                matmuls=iters, process=jax.process_index(), processes=jax.process_count(),
                jax=jax.__version__)
  print(json.dumps(result), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f)


if __name__ == "__main__":
  main()
