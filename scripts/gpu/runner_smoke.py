"""The runner on the first local device (a GPU where there is one): ``qcomm.sync`` (QSGD 4, Auto 4,
sharded, accumulating, the exact path, Wire16, PowerSGD) and ``qcomm.diloco`` (QSGD 4, TopK with
error feedback, two fragments, a one-round delay, the default outer optimizer) train
a linear regression for 30 steps; each line says OK when every loss is finite and the last is
under half the first. docs/cuda.md records a run.
"""

import numpy as np

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

import jax_qcomm as qcomm


def loss_fn(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def main() -> int:
  print(jax.devices(), qcomm.implementation())
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (512, 300))
  batch = (x, x @ jax.random.normal(k2, (300, 7)))
  params = {"w": jnp.zeros((300, 7)), "b": jnp.zeros((7,))}
  cases = {
      "sync QSGD4": qcomm.sync(optax.adam(3e-2), codec=qcomm.QSGD(4)),
      "sync auto4": qcomm.sync(optax.adam(3e-2), bits=4),
      "sync auto4 sharded": qcomm.sync(optax.adam(3e-2), bits=4, shard_state=True),
      "sync QSGD4 accum2": qcomm.sync(optax.adam(3e-2), codec=qcomm.QSGD(4), accum_steps=2),
      "sync bits=32": qcomm.sync(optax.adam(3e-2), bits=32),
      "sync bits=16": qcomm.sync(optax.adam(3e-2), bits=16),
      "sync PowerSGD1": qcomm.sync(optax.adam(3e-2), codec=qcomm.PowerSGD(1)),
      "diloco QSGD4": qcomm.diloco(optax.adam(3e-2), axis_name="data", every=5,
                                   codec=qcomm.QSGD(4)),
      "diloco TopK EF": qcomm.diloco(optax.adam(3e-2), axis_name="data", every=5,
                                     codec=qcomm.TopK(0.1, bits=2), error_feedback=True),
      "diloco 2 fragments": qcomm.diloco(optax.adam(3e-2), axis_name="data", every=6,
                                         fragments=2, codec=qcomm.QSGD(4)),
      "diloco delay=1": qcomm.diloco(optax.adam(3e-2), axis_name="data", every=5,
                                     codec=qcomm.QSGD(4), delay=1),
      "diloco default outer": qcomm.diloco(optax.adam(3e-2), axis_name="data", every=5),
  }
  failures = 0
  for name, tx in cases.items():
    dp = qcomm.data_parallel(loss_fn, tx, mesh)
    p, state = params, dp.init(params)
    losses = []
    for _ in range(30):
      p, state, loss, _ = dp.step(p, state, batch)
      losses.append(float(np.mean(loss)))
    ok = bool(np.isfinite(losses).all()) and losses[-1] < 0.5 * losses[0]
    failures += not ok
    print(f"{name:22s} {'OK' if ok else 'BAD'} loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  return int(failures > 0)


if __name__ == "__main__":
  raise SystemExit(main())
