"""Worker of tests/test_model_sharded.py::test_two_processes_with_the_model_sharded_in_each,
started as

    python -m jax_qcomm.tools.launch -n 2 --local-devices 4 tests/model_sharded_mp_worker.py OUT

Two processes over gloo with 4 devices each: the mesh is (data = the 2 processes, model = each
process's 4 devices), so the model axis lies inside a process and only the data axis crosses
between them. Each process trains the MLP of tests/test_model_sharded.py through
``qcomm.data_parallel`` with its weights sharded over "model": exact (``bits=32``), and at 4 bits
with error feedback and accumulation; and the exact run with the same params replicated. It
writes, per run, the shards its devices hold (by shard index) to OUT/proc<i>.npz, and the layout it
saw to OUT/proc<i>.json. The test checks the layouts, that both processes hold the same bits of
every shard (the data replicas), and that the exact sharded run equals the replicated one.
"""

import json
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

pid = jax.process_index()
mesh = distributed.global_mesh(("data", "model"))
assert dict(mesh.shape) == {"data": 2, "model": 4}, mesh.shape
SHAPES = {"w1": (15, 60), "b1": (60,), "w2": (60, 7), "scale": (7,)}
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "scale": P()}


def loss_fn(p, batch):
  x, y = batch
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] * p["scale"] - y) ** 2)


def host_params():
  rng = np.random.default_rng(0)
  return {k: (rng.standard_normal(s) * 0.2).astype(np.float32) for k, s in SHAPES.items()}


def placed(tree, specs):
  return {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]),
                                          lambda idx, v=v: v[idx]) for k, v in tree.items()}


def batch(step):
  rng = np.random.default_rng(10 + step)
  x = rng.standard_normal((24, 15)).astype(np.float32)
  y = rng.standard_normal((24, 7)).astype(np.float32)
  return tuple(jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("data")),
                                            lambda idx, a=a: a[idx]) for a in (x, y))


def run(tx, specs):
  dp = qcomm.data_parallel(loss_fn, tx, mesh)
  params = placed(host_params(), specs)
  state = dp.init(params)
  for step in range(4):
    params, state, loss, _ = dp.step(params, state, batch(step))
  return params


RUNS = {
    "exact_sharded": (qcomm.sync(optax.adam(1e-2), axis_name="data", bits=32), SPECS),
    "q4_sharded": (qcomm.sync(optax.adam(1e-2), axis_name="data", bits=4, min_size=16,
                              error_feedback=True, accum_steps=2), SPECS),
    "exact_replicated": (qcomm.sync(optax.adam(1e-2), axis_name="data", bits=32),
                         {k: P() for k in SHAPES}),
}
out, layout = {}, {}
for name, (tx, specs) in RUNS.items():
  params = run(tx, specs)
  for leaf, a in params.items():
    layout[f"{name}/{leaf}"] = str(a.sharding.spec)
    for shard in a.addressable_shards:
      index = ",".join(f"{s.start}:{s.stop}" for s in shard.index)
      out[f"{name}/{leaf}/{index}/{shard.device.id % 2048}"] = np.asarray(shard.data)
folder = sys.argv[1]
np.savez(os.path.join(folder, f"proc{pid}.npz"), **out)
with open(os.path.join(folder, f"proc{pid}.json"), "w") as f:
  json.dump(layout, f)
print(f"process {pid}: {len(out)} shards written", flush=True)
