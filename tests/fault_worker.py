"""Worker of tests/test_faults.py: one of several JAX processes that run cross-process psums forever.

    python -m jax_qcomm.tools.launch -n 2 tests/fault_worker.py [--stall-rank R] [--raise-rank R]
                                                               [--steps N] [--mtls-dir D]

Every process joins with :func:`jax_qcomm.tools.distributed.initialize` (timeouts from the environment,
``QCOMM_*_TIMEOUT``), then runs a jitted ``psum`` over all processes' devices in a loop, printing
``ready pid=<pid>`` once the first one has completed everywhere and ``step <i>`` every 20 steps.
The test then kills or stops one process and measures how the others end. Options make one process
misbehave on its own after step 20:

* ``--stall-rank R``: process R sleeps instead of entering the next psum (alive, heartbeating);
* ``--raise-rank R``: process R raises a RuntimeError (a bug on one process).

Without ``--steps`` it never ends by itself: the test (or the launcher's timeout) ends it. With
``--steps N`` (the healthy case) it runs N psums of changing inputs, prints ``result <sum>`` and
``done <seconds>`` and returns, leaving the exit to jax's shutdown barrier; ``--linger-rank R``
makes process R return 5 s after the others. ``--mtls-dir D`` passes
``D/cert.pem``, ``D/key.pem`` and ``D/ca.pem`` to :func:`~jax_qcomm.tools.distributed.initialize`
(mutual TLS for the coordination service).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jax_qcomm.tools import distributed

MISBEHAVE_AT = 20
LINGER = 5  # seconds --linger-rank stays after its last collective


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--stall-rank", type=int, default=None)
  parser.add_argument("--raise-rank", type=int, default=None)
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--mtls-dir", default=None)
  parser.add_argument("--linger-rank", type=int, default=None)
  args = parser.parse_args(argv)
  mtls = {}
  if args.mtls_dir:
    mtls = {f"mtls_{kind}_file": os.path.join(args.mtls_dir, f"{kind}.pem")
            for kind in ("cert", "key", "ca")}
  timeouts = distributed.initialize(**mtls)

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = distributed.global_mesh(("d",))
  total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"),
                                out_specs=P()))
  x = jax.make_array_from_callback((mesh.size, 4), NamedSharding(mesh, P("d")),
                                   lambda index: jnp.ones((1, 4), jnp.float32))
  rank = jax.process_index()
  if args.steps is not None:
    start = time.monotonic()
    acc = 0.0
    for step in range(args.steps):
      y = total(x * (step + 1) / 7.0)
      acc += float(y[0].sum())
    print(f"result {acc!r} process {rank} of {jax.process_count()} "
          f"recoverable={jax.config.jax_enable_recoverability}", flush=True)
    print(f"done {time.monotonic() - start:.2f}", flush=True)
    if rank == args.linger_rank:
      time.sleep(LINGER)  # e.g. writing a file after the last collective, while the others exit
      print(f"lingered {LINGER} s", flush=True)
    return
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
