"""Worker of tests/test_zero3.py::test_two_processes, started as

    python -m jax_qcomm.tools.launch -n 2 --local-devices 3 tests/zero3_mp_worker.py OUT

Two processes over gloo with 3 devices each, a ("node", "gpu") = (2, 3) mesh: the parameters are
sharded over all 6 devices (ZeRO-3), so every gather and reduce-scatter crosses the processes.
Each process trains the scanned MLP of tests/test_zero3.py replicated (exact), with sharded
parameters (exact), with hpZ (exact) and with compressed gathers and gradients, and writes the
full parameters each run ends with to OUT/proc<i>.npz.
"""

import functools
import os
import sys

import numpy as np

from jax_qcomm.tools import distributed

distributed.initialize()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_qcomm as qcomm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.test_zero3 import _batch, _full_loss, _params, _scan_loss  # noqa: E402

AX = ("node", "gpu")
mesh = distributed.global_mesh(AX)
assert dict(mesh.shape) == {"node": 2, "gpu": 3}, mesh.shape


def global_batch(step):
  return tuple(jax.make_array_from_callback(a.shape, NamedSharding(mesh, P(AX)),
                                            lambda idx, a=np.asarray(a): a[idx])
               for a in _batch(6, step))


def run(loss, tx, sharded):
  dp = qcomm.data_parallel(loss, tx, mesh, axis_name=AX)
  params = jax.tree_util.tree_map(np.asarray, _params())
  p = dp.shard(params, layers={"layers": 1, "out": 0}) if sharded else params
  state = dp.init(p)
  for step in range(3):
    p, state, _, _ = dp.step(p, state, global_batch(step))
  full = dp.unshard(p) if sharded else p
  return {k: np.asarray(jax.experimental.multihost_utils.process_allgather(v, tiled=True))
          for k, v in jax.tree_util.tree_flatten_with_path(full)[0]
          for k in [jax.tree_util.keystr(k)]}


exact = dict(bits=32, param_codec=qcomm.NoCompression())
hpz_loss = functools.partial(_scan_loss, policy=qcomm.hpz_remat_policy)
RUNS = {
    "replicated": (_full_loss, qcomm.sync(optax.adam(1e-2), axis_name=AX, bits=32), False),
    "sharded": (_scan_loss, qcomm.sync(optax.adam(1e-2), axis_name=AX, shard_params=True,
                                       **exact), True),
    "hpz": (hpz_loss, qcomm.sync(optax.adam(1e-2), axis_name=AX, shard_params=True, hpz=True,
                                 **exact), True),
    "q8q4": (hpz_loss, qcomm.sync(optax.adam(1e-2), axis_name=AX, shard_params=True, hpz=True,
                                  bits=4), True),
}
out = {}
for name, (loss, tx, sharded) in RUNS.items():
  for key, value in run(loss, tx, sharded).items():
    out[f"{name}/{key}"] = value
np.savez(os.path.join(sys.argv[1], f"proc{jax.process_index()}.npz"), **out)
print(f"process {jax.process_index()}: {len(out)} arrays written", flush=True)
