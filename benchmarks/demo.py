"""A tour of jax_qcomm over 8 host CPU devices (tooling: not part of the library).

Over 8 host CPU devices: (1) the QSGD codec's size and error, FFI vs pure JAX; (2) a compressed
allreduce of a gradient pytree with every codec, its error against the exact mean, the bytes each
device sends, and its time; (3) a small model trained data-parallel with ``qcomm.sync`` at 32, 16, 4
and 2 bits, with and without accumulation, reporting the final loss of each.

    python -m benchmarks.demo [--elements 2000000] [--steps 200]
"""

from __future__ import annotations

import argparse

import numpy as np

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.native import _ffi
from benchmarks._common import median_time

#: Host CPU devices of the tour (set in main, before the backend starts: never at import time).
NUM_DEVICES = 8


def codec_section(n: int) -> None:
  print(f"\n== QSGD codec on {n:,} float32 (CPU kernels: {_ffi.cpu_isa()}) ==")
  x = jax.random.normal(jax.random.key(0), (n,))
  print(f"{'codec':34s} {'bytes':>11s} {'ratio':>6s} {'rms err':>9s} {'same bytes ffi/jax':>19s}")
  for bits in (8, 4, 2):
    ffi, ref = qcomm.QSGD(bits, impl="ffi"), qcomm.QSGD(bits, impl="jax")
    key = jax.random.key(bits)
    p_ffi, p_ref = jax.jit(ffi.encode)(x, key), jax.jit(ref.encode)(x, key)
    err = float(jnp.sqrt(jnp.mean((ffi.decode(p_ffi, x.shape) - x) ** 2)))
    print(f"{str(ffi)[:34]:34s} {p_ffi.size:11,d} {4 * n / p_ffi.size:6.2f} {err:9.4f} "
          f"{str(bool(jnp.array_equal(p_ffi, p_ref))):>19s}")


def allreduce_section(mesh: Mesh, n: int) -> None:
  d = mesh.devices.size
  print(f"\n== allreduce of a {n:,}-element gradient pytree over {d} devices ==")
  shapes = {"conv": (n // 2 // 576, 576), "dense": (n // 2 // 1000, 1000), "bias": (1000,)}
  keys = jax.random.split(jax.random.key(1), len(shapes))
  grads = {k: jax.random.normal(kk, (d,) + s) for (k, s), kk in zip(shapes.items(), keys)}
  exact = jax.tree.map(lambda g: g.mean(0), grads)
  print(f"{'codec':34s} {'sent/device MB':>14s} {'max |err|':>10s} {'time ms':>8s} {'replicas equal':>15s}")
  for name, codec in [("fp32 psum", qcomm.NoCompression()), ("Cast(bf16)", qcomm.Cast(jnp.bfloat16)),
                      ("QSGD 8 bits", qcomm.QSGD(8)), ("QSGD 4 bits", qcomm.QSGD(4)),
                      ("QSGD 2 bits", qcomm.QSGD(2))]:
    fn = jax.jit(jax.shard_map(
        lambda g, k, c=codec: jax.tree.map(lambda a: a[None], qcomm.allreduce(
            jax.tree.map(lambda a: a[0], g), "data", c, k[0])),
        mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))
    key = jax.random.key(2)[None]
    out = fn(grads, key)
    err = max(float(jnp.abs(out[k][0] - exact[k]).max()) for k in grads)
    same = all(bool((out[k] == out[k][0]).all()) for k in grads)
    per_leaf = sum(codec.payload_size(int(np.prod(s))) if len(s) > 1 else 4 * int(np.prod(s))
                   for s in shapes.values())
    sent = 2 * (d - 1) / d * per_leaf / 1e6
    print(f"{name:34s} {sent:14.2f} {err:10.4f} {1e3 * median_time(fn, grads, key, repeats=5).median:8.1f} {str(same):>15s}")


def training_section(mesh: Mesh, steps: int) -> None:
  d = mesh.devices.size
  print(f"\n== a 2-layer MLP trained data-parallel over {d} devices for {steps} steps ==")
  k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(k1, (d * 64, 32))
  teacher = jax.random.normal(k2, (32, 8))
  y = jnp.tanh(x @ teacher)
  params = {"w1": 0.1 * jax.random.normal(k3, (32, 256)), "b1": jnp.zeros(256),
            "w2": jnp.zeros((256, 8)), "b2": jnp.zeros(8)}

  def loss_fn(p, xb, yb):
    h = jax.nn.relu(xb @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - yb) ** 2)

  print(f"{'bits':>4s} {'accum':>5s} {'error feedback':>14s} {'final loss':>11s}")
  for bits, accum, ef in [(32, 1, False), (16, 1, False), (8, 1, False), (4, 1, False),
                          (4, 2, False), (2, 1, False), (2, 1, True)]:
    tx = qcomm.sync(optax.sgd(0.2, momentum=0.9), bits=bits, accum_steps=accum, min_size=256,
                    error_feedback=ef)

    def step(p, s, xb, yb, tx=tx):
      # Differentiate a varying copy of p: the gradient of a replicated value would be summed
      # across devices by autodiff itself, uncompressed, before sync ever saw it.
      local = jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), p)
      loss, g = jax.value_and_grad(loss_fn)(local, xb, yb)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, jax.lax.pmean(loss, "data")

    spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P("data"), P("data")),
                              out_specs=(P(), spec, P())))
    p, s = params, init(params)
    for _ in range(steps * accum):
      p, s, loss = f(p, s, x, y)
    print(f"{bits:4d} {accum:5d} {str(ef):>14s} {float(loss):11.5f}")


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--elements", type=int, default=1_000_000, help="gradient size for sections 1-2")
  ap.add_argument("--steps", type=int, default=200, help="optimizer steps in section 3")
  args = ap.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  print(f"jax {jax.__version__}, {len(jax.devices())} {jax.default_backend()} devices")
  codec_section(args.elements)
  allreduce_section(mesh, args.elements)
  training_section(mesh, args.steps)


if __name__ == "__main__":
  main()
