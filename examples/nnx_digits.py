"""A Flax NNX CNN (Conv, BatchNorm, Dropout) trained data-parallel with ``qcomm.sync``.

flax's NNX MNIST tutorial (``nnx.Optimizer``, ``nnx.MultiMetric``) on scikit-learn's 8x8 digits,
split over 8 devices (host CPU devices here; the GPUs on a GPU machine), once with exact gradient
averaging (``bits=32``) and once with 4-bit QSGD, both accumulating 2 micro-batches per optimizer
step:

    python examples/nnx_digits.py                     # bits 32 and 4, accum_steps 2
    python examples/nnx_digits.py --bits 4 --epochs 5

The last line printed is a JSON object with each run's test accuracy.

What differs from single-device NNX code: the five lines marked ``# qcomm (n)``. A mesh; the
optimizer wrapped in ``qcomm.sync`` and created under the mesh; ``qcomm.nnx_data_parallel`` built
from the loss; and ``dp.step(model, optimizer, batch, key=key)`` in place of
``nnx.value_and_grad`` + ``optimizer.update``. The step splits the batch over the devices, takes
each device's own gradient (of a copy whose parameters vary per device), averages it with
``qcomm.sync``, gives dropout a key of its own per device, averages the BatchNorm statistics
across devices and returns the logits of the global batch for the metrics.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np
from sklearn.datasets import load_digits as sk_load_digits
from sklearn.model_selection import train_test_split

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from flax import nnx
import optax

import jax_qcomm as qcomm


def load_digits(seed: int = 0):
  """Train/test split of scikit-learn's digits (float32 [N, 8, 8, 1], normalised; int32 labels)."""
  digits = sk_load_digits()
  x = digits.images.astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
  mean, std = x_tr.mean(), x_tr.std()
  return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te


def train(bits: int, accum_steps: int, epochs: int, batch_size: int, lr: float, seed: int = 0,
          verbose: bool = True) -> dict:
  class CNN(nnx.Module):
    """flax's MNIST tutorial CNN, sized for 8x8 images."""

    def __init__(self, *, rngs: nnx.Rngs):
      self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
      self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
      self.dropout1 = nnx.Dropout(rate=0.025)
      self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
      self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
      self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
      self.linear1 = nnx.Linear(2 * 2 * 64, 128, rngs=rngs)
      self.dropout2 = nnx.Dropout(rate=0.025)
      self.linear2 = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
      x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
      x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
      x = x.reshape(x.shape[0], -1)
      x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
      return self.linear2(x)

  x_tr, y_tr, x_te, y_te = load_digits(seed)
  mesh = Mesh(np.array(jax.devices()), ("data",))                                     # qcomm (1)
  d = mesh.devices.size
  if batch_size % d:
    raise ValueError(f"batch_size must be a multiple of the {d} devices, got {batch_size}")

  model = CNN(rngs=nnx.Rngs(seed))  # in training mode (dropout on, batch statistics)
  tx = qcomm.sync(optax.adamw(lr, 0.9), axis_name="data", bits=bits,                   # qcomm (2)
                  accum_steps=accum_steps)
  with jax.set_mesh(mesh):                                                             # qcomm (3)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))

  def loss_fn(model, batch, rngs):
    logits = model(batch["image"], rngs=rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits

  dp = qcomm.nnx_data_parallel(loss_fn, mesh, has_aux=True, aux_reduce="concat")   # qcomm (4)

  def train_step(model, optimizer, metrics, batch, key):
    loss, logits = dp.step(model, optimizer, batch, key=key)                          # qcomm (5)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # on the global batch

  @nnx.jit
  def evaluate(model, images, labels):
    model.eval()
    acc = jnp.mean(jnp.argmax(model(images), -1) == labels)
    model.train()
    return acc

  order = np.random.default_rng(seed)
  steps_per_epoch = len(x_tr) // batch_size
  history, call, t0 = [], 0, time.perf_counter()
  for epoch in range(epochs):
    idx = order.permutation(len(x_tr))
    for i in range(steps_per_epoch):
      take = idx[i * batch_size:(i + 1) * batch_size]
      batch = {"image": x_tr[take], "label": y_tr[take]}
      train_step(model, optimizer, metrics, batch, jax.random.fold_in(jax.random.key(seed), call))
      call += 1
    train_metrics = {k: float(v) for k, v in metrics.compute().items()}
    metrics.reset()
    test_acc = float(evaluate(model, x_te, y_te))
    history.append({"epoch": epoch + 1, **train_metrics, "test_accuracy": test_acc})
    if verbose:
      print(f"bits {bits:2d}  epoch {epoch + 1:3d}  train loss {train_metrics['loss']:.4f}  "
            f"train acc {train_metrics['accuracy']:.4f}  test acc {test_acc:.4f}", flush=True)
  return {"bits": bits, "accum_steps": accum_steps, "calls": call,
          "optimizer_steps": int(optimizer.opt_state.gradient_step[...]),
          "nnx_optimizer_step": int(optimizer.step[...]), "test_accuracy": history[-1]["test_accuracy"],
          "seconds": round(time.perf_counter() - t0, 1), "history": history}


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--bits", type=int, nargs="+", default=[32, 4])
  ap.add_argument("--accum-steps", type=int, default=2)
  ap.add_argument("--epochs", type=int, default=12)
  ap.add_argument("--batch-size", type=int, default=64, help="global micro-batch (all devices)")
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--quiet", action="store_true")
  args = ap.parse_args(argv)
  runs = {b: train(b, args.accum_steps, args.epochs, args.batch_size, args.lr, args.seed,
                   verbose=not args.quiet) for b in args.bits}
  summary = {f"bits{b}": {k: r[k] for k in ("test_accuracy", "calls", "optimizer_steps",
                                             "nnx_optimizer_step", "seconds")}
             for b, r in runs.items()}
  print(json.dumps(summary))
  return runs


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # CPU: split the host into 8 devices
  main()
