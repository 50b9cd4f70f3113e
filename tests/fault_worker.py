"""Worker of tests/test_faults.py: one of several JAX processes that run cross-process psums forever.

    python -m jax_qcomm.tools.launch -n 2 tests/fault_worker.py [--stall-rank R] [--raise-rank R]

Every process joins with :func:`jax_qcomm.tools.distributed.initialize` (timeouts from the environment,
``QCOMM_*_TIMEOUT``), then runs a jitted ``psum`` over all processes' devices in a loop, printing
``ready pid=<pid>`` once the first one has completed everywhere and ``step <i>`` every 20 steps.
The test then kills or stops one process and measures how the others end. Options make one process
misbehave on its own after step 20:

* ``--stall-rank R``: process R sleeps instead of entering the next psum (alive, heartbeating);
* ``--raise-rank R``: process R raises a RuntimeError (a bug on one process).

It never ends by itself: the test (or the launcher's timeout) ends it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jax_qcomm.tools import distributed

MISBEHAVE_AT = 20


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--stall-rank", type=int, default=None)
  parser.add_argument("--raise-rank", type=int, default=None)
  args = parser.parse_args(argv)
  timeouts = distributed.initialize()

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = distributed.global_mesh(("d",))
  total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"),
                                out_specs=P()))
  x = jax.make_array_from_callback((mesh.size, 4), NamedSharding(mesh, P("d")),
                                   lambda index: jnp.ones((1, 4), jnp.float32))
  rank = jax.process_index()
  for step in range(10**9):
    if step == MISBEHAVE_AT and rank == args.stall_rank:
      print(f"stalling at step {step}", flush=True)
      time.sleep(10**6)
    if step == MISBEHAVE_AT and rank == args.raise_rank:
      raise RuntimeError(f"a bug on process {rank} at step {step}")
    out = total(x).block_until_ready()
    if step == 0:
      assert float(out[0, 0]) == mesh.size, out
      print(f"ready pid={os.getpid()} {timeouts}", flush=True)
    if step % 20 == 0:
      print(f"step {step}", flush=True)
    time.sleep(0.01)


if __name__ == "__main__":
  main(sys.argv[1:])
