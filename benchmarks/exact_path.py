"""The exact path: ``sync(codec=NoCompression())``'s update (its updates and its new state) against
a per-leaf ``lax.pmean`` of the same gradients. In one process on 8 host devices: three rounds of
15 pairs of calls (the update, then the pmean), each round's ratio the median of its pairs'.

    python -m benchmarks.exact_path                  # every tree below
    python -m benchmarks.exact_path --trees small    # some of them

Across processes (``--processes``: one device per process, under a launcher such as the simulated
cluster) it also times the update with other thresholds of the leaves that travel as their own
all-reduce operands (:attr:`jax_qcomm.transport.Transport.own_operand`; ``packed``: every leaf in
the packed buffer), in interleaved rounds, and process 0 prints the medians:

    python -m jax_qcomm.tools.cluster --nodes 2 --rate 1gbit --local-devices 1 --malloc glibc \
        -- -m benchmarks.exact_path --processes --trees resnet50

Trees: ``small`` (the 12-leaf CNN of examples/nnx_digits.py), ``many`` (161 leaves of 1.0M values
in all, 6k per leaf: ResNet-shaped but small), ``large`` (42 leaves, 3.7M values: a 2048 x 1000
dense kernel, six 1x1x256x1024 and two 3x3x64x64 convolutions, 33 biases of 64) and ``resnet50``
(its 161 real leaves, 25.6M values).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import jax
import numpy as np
import optax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm

AX = "data"
SMALL = [(3, 3, 1, 32), (32,), (32,), (32,), (3, 3, 32, 64), (64,), (64,), (64,), (256, 128),
         (128,), (128, 10), (10,)]
RESNET_LIKE = [s for i in range(53) for s in ((3, 3, 32, 64) if i % 3 else (64, 128), (128,),
                                               (128,))] + [(2048, 100), (100,)]
LARGE = [(2048, 1000)] + [(1, 1, 256, 1024)] * 6 + [(3, 3, 64, 64)] * 2 + [(64,)] * 33
TREES = ("small", "many", "large", "resnet50")


def _shapes(tree: str) -> list:
  if tree == "resnet50":
    from benchmarks import sharded  # noqa: PLC0415  (flax: only this tree needs it)
    return [tuple(s.shape) for s in jax.tree_util.tree_leaves(sharded.payload("resnet50"))]
  return {"small": SMALL, "many": RESNET_LIKE, "large": LARGE}[tree]


def _call_ms(f, *args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  return 1e3 * (time.perf_counter() - t0)


def median_ms(f, *args, n: int = 15) -> float:
  jax.block_until_ready(f(*args))
  return float(np.median([_call_ms(f, *args) for _ in range(n)]))


#: The thresholds ``--processes`` times besides the transport's own (``packed``: none travels alone).
OWN_OPERANDS = ("packed", 1 << 15, 1 << 16, 1 << 18, 1 << 20, 1 << 22)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--trees", nargs="+", choices=TREES, default=list(TREES),
                  help="the gradient trees to time (default: all)")
  ap.add_argument("--processes", action="store_true",
                  help="one device per process across the processes of a launcher (the simulated "
                       "cluster): time the update with each threshold of OWN_OPERANDS as well")
  ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
  args = ap.parse_args(argv)
  if args.processes:
    from jax_qcomm.tools import distributed  # noqa: PLC0415  (tooling: only this mode launches)
    distributed.initialize()
  else:
    jax.config.update("jax_num_cpu_devices", 8)
  for tree in args.trees:
    (run_processes if args.processes else run)(tree, _shapes(tree), args.rounds)


@contextlib.contextmanager
def _own_operand(value):
  """The current transport with ``own_operand`` replaced (``packed``: larger than any leaf)."""
  current = qcomm.transport.current
  own = 1 << 62 if value == "packed" else value
  qcomm.transport.current = lambda devices: dataclasses.replace(current(devices), own_operand=own)
  try:
    yield
  finally:
    qcomm.transport.current = current


def _functions(shapes: list, mesh: Mesh):
  """The gradients (device g's on row g), the sync's state, and the builders of the sync's update
  (with its new state, as a training step keeps it: the finite guard's count is part of the state;
  returning only the updates would let XLA drop the guard) and of the per-leaf pmean."""
  d = mesh.devices.size
  params = {f"l{i:03d}": jnp.zeros(s) for i, s in enumerate(shapes)}
  grads = {k: jax.make_array_from_callback(
      (d,) + v.shape, jax.sharding.NamedSharding(mesh, P(AX)),
      lambda idx, k=k, v=v: np.stack([np.random.default_rng([g, int(k[1:])]).standard_normal(
          v.shape, dtype=np.float32) for g in range(*idx[0].indices(d))]))
      for k, v in params.items()}
  tx = qcomm.sync(optax.identity(), axis_name=AX, codec=qcomm.NoCompression())
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))(params)
  f_sync = lambda: jax.jit(jax.shard_map(  # noqa: E731
      lambda s, g: tx.update(jax.tree.map(lambda a: a[0], g), s),
      mesh=mesh, in_specs=(spec, P(AX)), out_specs=(P(), spec))).lower(state, grads).compile()
  f_pmean = jax.jit(jax.shard_map(lambda g: jax.tree.map(lambda a: lax.pmean(a[0], AX), g),
                                  mesh=mesh, in_specs=P(AX), out_specs=P()))
  return grads, state, f_sync, f_pmean


def run_processes(name: str, shapes: list, rounds: int) -> None:
  mesh = Mesh(np.array(jax.devices()), (AX,))
  grads, state, f_sync, f_pmean = _functions(shapes, mesh)
  steps = {"transport's": f_sync()}
  for value in OWN_OPERANDS:
    with _own_operand(value):
      steps[str(value)] = f_sync()
  exact = jax.tree.map(np.asarray, f_pmean(grads))
  for label, f in steps.items():  # every variant is the per-leaf pmean, bit for bit
    got = jax.tree.map(np.asarray, f(state, grads)[0])
    assert all(np.array_equal(got[k], exact[k]) for k in exact), label
  times = {label: [] for label in [*steps, "per-leaf pmean"]}
  for _ in range(rounds):
    for label, f in steps.items():
      times[label].append(median_ms(f, state, grads, n=5))
    times["per-leaf pmean"].append(median_ms(f_pmean, grads, n=5))
  if jax.process_index() == 0:
    own = qcomm.transport.current(mesh.devices.size).own_operand
    print(f"{name}: {len(shapes)} leaves, {sum(int(np.prod(s)) for s in shapes):,} elements, "
          f"{jax.process_count()} processes; the transport's own_operand: {own}")
    for label, ts in times.items():
      row = label if label in ("transport's", "per-leaf pmean") else f"own_operand {label}"
      print(f"{row:<22} median {np.median(ts):8.2f} ms   rounds "
            + " ".join(f"{t:.1f}" for t in ts))


def run(name: str, shapes: list, rounds: int = 3, calls: int = 15) -> None:
  """Each round: ``calls`` pairs of calls, the update then the pmean, back to back, so that both
  see the same load; the round's ratio is the median of the pairs' ratios."""
  mesh = Mesh(np.array(jax.devices()), (AX,))
  d = mesh.devices.size
  grads, state, f_sync, f_pmean = _functions(shapes, mesh)
  f_sync = f_sync()
  jax.block_until_ready((f_sync(state, grads), f_pmean(grads)))
  print(f"{name}: {len(shapes)} leaves, {sum(int(np.prod(s)) for s in shapes):,} elements, "
        f"{d} devices")
  ratios = []
  for _ in range(rounds):
    pairs = np.array([(_call_ms(f_sync, state, grads), _call_ms(f_pmean, grads))
                      for _ in range(calls)])
    a, b = np.median(pairs, axis=0)
    ratios.append(float(np.median(pairs[:, 0] / pairs[:, 1])))
    print(f"sync(NoCompression) {a:7.2f} ms   per-leaf pmean {b:7.2f} ms   ratio {ratios[-1]:.2f}")
  print(f"median ratio {np.median(ratios):.2f}")


if __name__ == "__main__":
  main()
