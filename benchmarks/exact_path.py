"""The exact path in one process: ``sync(codec=NoCompression())``'s update (its updates and its new
state) against a per-leaf ``lax.pmean`` of the same gradients, on 8 host devices; medians of 15
calls, three rounds in one process, ratios per round.

    python -m benchmarks.exact_path                  # every tree below
    python -m benchmarks.exact_path --trees small    # some of them

Trees: ``small`` (the 12-leaf CNN of examples/nnx_digits.py), ``many`` (161 leaves of 1.0M values
in all, 6k per leaf: ResNet-shaped but small), ``large`` (42 leaves, 3.7M values: a 2048 x 1000
dense kernel, six 1x1x256x1024 and two 3x3x64x64 convolutions, 33 biases of 64) and ``resnet50``
(its 161 real leaves, 25.6M values).
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


def median_ms(f, *args, n: int = 15) -> float:
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--trees", nargs="+", choices=TREES, default=list(TREES),
                  help="the gradient trees to time (default: all)")
  for tree in ap.parse_args(argv).trees:
    run(tree, _shapes(tree))


def run(name: str, shapes: list) -> None:
  mesh = Mesh(np.array(jax.devices()), (AX,))
  d = mesh.devices.size
  params = {f"l{i:03d}": jnp.zeros(s) for i, s in enumerate(shapes)}
  rng = np.random.default_rng(0)
  grads = {k: rng.standard_normal((d,) + v.shape).astype(np.float32) for k, v in params.items()}
  tx = qcomm.sync(optax.identity(), axis_name=AX, codec=qcomm.NoCompression())
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))(params)
  # The update and the new state, as a training step keeps it (the finite guard's count is part
  # of the state: returning only the updates would let XLA drop the guard).
  f_sync = jax.jit(jax.shard_map(lambda s, g: tx.update(jax.tree.map(lambda a: a[0], g), s),
                                 mesh=mesh, in_specs=(spec, P(AX)), out_specs=(P(), spec)))
  f_pmean = jax.jit(jax.shard_map(lambda g: jax.tree.map(lambda a: lax.pmean(a[0], AX), g),
                                  mesh=mesh, in_specs=P(AX), out_specs=P()))
  print(f"{name}: {len(shapes)} leaves, {sum(int(np.prod(s)) for s in shapes):,} elements, "
        f"{d} devices")
  ratios = []
  for _ in range(3):
    a, b = median_ms(f_sync, state, grads), median_ms(f_pmean, grads)
    ratios.append(a / b)
    print(f"sync(NoCompression) {a:7.2f} ms   per-leaf pmean {b:7.2f} ms   ratio {a / b:.2f}")
  print(f"median ratio {np.median(ratios):.2f}")


if __name__ == "__main__":
  main()
