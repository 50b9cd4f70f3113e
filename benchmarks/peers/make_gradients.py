"""Real ResNet50 gradients for the peers benchmark's error column, one per rank, saved once::

    python -m benchmarks.peers.make_gradients --ranks 2 --out bench-results/peers/resnet50_grads.npz

``training.models.ResNet50`` (1000 classes, ImageNet stem, BatchNorm in training mode), initialised
with seed 0 and moved by ``--steps`` SGD steps (the same weights on every rank), then the softmax
cross-entropy gradient of a batch of synthetic images (``--batch`` per rank, ``--image`` pixels
square, standard normal) with random labels; rank r's batch comes from its own seed, so the ranks'
gradients differ as data-parallel workers' do. Each leaf is stored as ``rank{r}/{name}`` in PyTorch's layout
(:mod:`benchmarks.peers.payloads`), float32, uncompressed: what both the JAX benchmark and the torch
worker read (:mod:`benchmarks.peers.data`). 25.6M values: ~102 MB per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

import numpy as np
import optax

import jax
import jax.numpy as jnp

from benchmarks.peers import data, payloads

DEFAULT_OUT = "bench-results/peers/resnet50_grads.npz"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m benchmarks.peers.make_gradients", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--ranks", type=int, default=2, help="gradients to make, one per rank (default: 2)")
  p.add_argument("--batch", type=int, default=8, help="images per rank (default: 8)")
  p.add_argument("--image", type=int, default=64, help="image side in pixels (default: 64)")
  p.add_argument("--steps", type=int, default=3,
                 help="SGD steps taken before the gradients (default: 3; see gradients())")
  p.add_argument("--out", default=DEFAULT_OUT, help=f"npz to write (default: {DEFAULT_OUT})")
  args = p.parse_args(argv)
  if args.ranks < 1 or args.batch < 1 or args.image < 32 or args.steps < 0:
    p.error("--ranks and --batch must be >= 1, --image >= 32, --steps >= 0")
  return args


def _batch(seed: int, batch: int, image: int) -> tuple[np.ndarray, np.ndarray]:
  """Synthetic images (standard normal) and random labels of one batch."""
  rng = np.random.default_rng([data.SEED, seed])
  return (rng.standard_normal((batch, image, image, 3), dtype=np.float32),
          rng.integers(0, 1000, batch))


def gradients(ranks: int, batch: int, image: int, steps: int) -> list[dict[str, np.ndarray]]:
  """Per rank, {leaf name: gradient in PyTorch's layout}, in :func:`payloads.resnet50` order.

  The weights first take ``steps`` SGD steps (lr 0.05, momentum 0.9) on other batches: at its
  initialisation the last BatchNorm of every block has scale 0, so the convolution before it has an
  exactly zero gradient, which no trained model has (and on which PowerSGD's orthogonalisation
  divides by zero).
  """
  model, _ = payloads.resnet50_flax_params()
  variables = jax.jit(lambda: model.init(jax.random.key(0), jnp.zeros((1, image, image, 3)),
                                         train=False))()

  @jax.jit
  def grad_fn(params, batch_stats, images, labels):
    def loss(p):
      logits, state = model.apply({"params": p, "batch_stats": batch_stats}, images, train=True,
                                  mutable=["batch_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state
    g, state = jax.grad(loss, has_aux=True)(params)
    return g, state["batch_stats"]

  params, stats = variables["params"], variables["batch_stats"]
  tx = optax.sgd(0.05, momentum=0.9)
  opt_state = tx.init(params)
  for step in range(steps):
    g, stats = grad_fn(params, stats, *_batch(10_000 + step, batch, image))
    updates, opt_state = tx.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
  order = [name for name, _ in payloads.resnet50()]
  out = []
  for r in range(ranks):
    g, _ = grad_fn(params, stats, *_batch(1000 + r, batch, image))
    flat = {payloads._path_name(path): np.asarray(payloads.flax_to_torch(np.asarray(leaf)),
                                                   np.float32)
            for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]}
    out.append({name: np.ascontiguousarray(flat[name]) for name in order})
  return out


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  start = time.monotonic()
  grads = gradients(args.ranks, args.batch, args.image, args.steps)
  arrays = {data.npz_key(r, name): a for r, g in enumerate(grads) for name, a in g.items()}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  np.savez(args.out, **arrays)
  norms = [float(np.sqrt(sum(float(np.vdot(a, a)) for a in g.values()))) for g in grads]
  print(f"wrote {args.out}: {args.ranks} ranks x {len(grads[0])} leaves, gradient norms "
        f"{', '.join(f'{n:.4g}' for n in norms)} ({time.monotonic() - start:.0f} s)",
        file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
