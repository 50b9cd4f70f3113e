"""The byte LM's train step with sharded parameters (``qcomm.sync(..., shard_params=True)``) on the
simulated cluster: exact against compressed gathers and gradients, with and without hpZ, beside
replicated exact data parallelism. One process per node, each node's devices on the "gpu" axis,
the parameters sharded over ("node", "gpu"):

    python -m jax_qcomm.tools.cluster --nodes 2 --rate 1gbit --local-devices 4 \\
        --out notebooks/data/zero3_cluster_20261129/zero3_step.json -- \\
        -m benchmarks.zero3_step --d-model 512 --layers 4 --batch 8 --seq-len 32 --steps 8

Each row times ``dp.step`` (the runner's step, jitted as users call it; median of ``--steps`` after
3 warm-up steps) and gives the bytes each device sends per step (``qcomm.describe``), and of them
across the nodes. The model is ``training/lm.py``'s transformer (blocks stacked and gathered one
at a time inside ``lax.scan`` under remat: ``lm.sharded_window_loss``), its optimizer
``qcomm.sync(clip -> AdamW)``. ``--rows`` picks rows by name (default all).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from jax_qcomm.tools import distributed

if distributed.under_launcher():
  distributed.initialize()
import jax  # noqa: E402

if not distributed.under_launcher():
  jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from flax import nnx  # noqa: E402

import jax_qcomm as qcomm  # noqa: E402
from benchmarks._common import time_step_calls, write_json  # noqa: E402
from benchmarks._lm_step import add_shape_args  # noqa: E402
from training import lm  # noqa: E402
from configs import lm_bytes  # noqa: E402

AX = ("node", "gpu")
Q8 = qcomm.QSGD(8, rounding="nearest")
#: name -> (shard_params, param_codec, gradient bits, hpz)
ROWS = {
    "dp_exact": (False, None, 32, False),
    "zero3_exact": (True, qcomm.NoCompression(), 32, False),
    "zero3_q8_q4": (True, Q8, 4, False),
    "zero3_exact_hpz": (True, qcomm.NoCompression(), 32, True),
    "zero3_q8_q4_hpz": (True, Q8, 4, True),
}


def _mesh() -> Mesh:
  if jax.process_count() > 1:
    return distributed.global_mesh(AX)
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), AX)


def cross_node_bytes(tx, shards, mesh: Mesh) -> float:
  """With hpZ, the bytes each device sends over the "node" axis per step: per leaf and layer one
  gather of its shard with the parameters' codec and one reduce-scatter of its secondary shard's
  gradient with the gradients' codec (the leaf policy's exact leaves exact), plus the step's two
  scalar all-reduces (the loss's mean and the finite guard); the same formula as
  tests/test_zero3.py checks against the compiled HLO."""
  cfg = qcomm.transforms.sync.config_of(tx)
  n = mesh.shape["node"]
  total = 2 * qcomm.NoCompression().sent_bytes(1, mesh.size)
  leaves = jax.tree_util.tree_leaves(shards, is_leaf=lambda x: isinstance(x, qcomm.ParamShard))
  gathers, grads = qcomm.collectives.sharded_params.leaf_codecs(shards, cfg.param_codec, cfg.codec,
                                                                cfg.policy)
  for s, gather, grad in zip(leaves, gathers, grads):
    m, layers = s.data.shape[-1], int(np.prod(s.data.shape[:-2]))
    total += layers * (gather.sent_bytes(m, n, "all_gather")
                       + grad.sent_bytes(n * m, n, "reduce_scatter"))
  return total


def time_row(config, mesh: Mesh, name: str, steps: int) -> dict:
  sharded, param_codec, bits, hpz = ROWS[name]
  inner = lm.local_optimizer(config)
  extra = dict(shard_params=True, param_codec=param_codec, hpz=hpz) if sharded else {}
  tx = qcomm.sync(inner, axis_name=AX, bits=bits, accum_steps=1, seed=config.seed, **extra)
  model = nnx.eval_shape(lambda: lm.create_model(config, nnx.Rngs(0)))
  graphdef, _ = nnx.split(model)
  make = lambda: nnx.state(lm.create_model(config, nnx.Rngs(0))).to_pure_dict()  # noqa: E731
  if sharded:
    parts = lm.model_parts(model)
    dp = qcomm.data_parallel(
        lambda s, w: jnp.mean(lm.sharded_window_loss(parts, s, w)), tx, mesh, axis_name=AX)
    d = mesh.size

    def make_shards():
      stacked = lm.stack_blocks(make(), config.num_layers)
      return qcomm.shard_params(stacked, d, layers=lm.shard_layers(stacked))
    specs = qcomm.shard_specs(jax.eval_shape(make_shards), AX)
    params = jax.jit(make_shards, out_shardings=jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)))()
    regather = {k: k == "blocks" for k in params}
  else:
    dp = qcomm.data_parallel(lambda p, w: jnp.mean(lm.window_loss(graphdef, p, w)), tx, mesh,
                             axis_name=AX)
    params = jax.jit(make, out_shardings=NamedSharding(mesh, P()))()
    regather = True
  state = dp.init(params)
  rows = config.batch_size // jax.process_count()
  local = np.random.default_rng(jax.process_index()).integers(
      0, 256, (rows, config.seq_len + 1)).astype(np.int32)
  windows = jax.make_array_from_process_local_data(NamedSharding(mesh, P(AX)), local)
  step = jax.jit(dp.step)
  compiled = step.lower(params, state, windows).compile()
  mem = compiled.memory_analysis()
  times, params, state, (loss, _) = time_step_calls(step, params, state, windows, steps=steps)
  # Slowest process's time per step (the step ends for all when the last one does).
  times = np.asarray(jax.experimental.multihost_utils.process_allgather(
      np.asarray(times))).reshape(-1, len(times)).max(axis=0) if jax.process_count() > 1 else \
      np.asarray(times)
  with jax.set_mesh(mesh):
    described = qcomm.describe(tx, params, regather=regather)
  return {"row": name, "shard_params": sharded, "param_codec": getattr(param_codec, "name", None),
          "bits": bits, "hpz": hpz, "step_s_median": float(np.median(times)),
          "step_s": [float(t) for t in times], "loss": float(loss),
          "sent_bytes_per_device": described.sent_bytes_per_sync,
          "cross_node_bytes_per_device": (cross_node_bytes(tx, params, mesh) if hpz
                                          else described.sent_bytes_per_sync),
          "peak_bytes_per_device": int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                       + mem.temp_size_in_bytes - mem.alias_size_in_bytes)}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_shape_args(ap)
  ap.add_argument("--rows", default=",".join(ROWS))
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  config = lm_bytes.get_config()
  config.d_model, config.num_layers = args.d_model, args.layers
  config.batch_size, config.seq_len = args.batch, args.seq_len
  mesh = _mesh()
  result = {"command": "python -m benchmarks.zero3_step " + " ".join(argv or sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": platform.processor() or platform.machine(), "jax": jax.__version__,
            "python": platform.python_version(), "mesh": dict(mesh.shape),
            "processes": jax.process_count(), "rows": []}
  for name in args.rows.split(","):
    row = time_row(config, mesh, name, args.steps)
    result["rows"].append(row)
    if jax.process_index() == 0:
      print(json.dumps({k: v for k, v in row.items() if k != "step_s"}), flush=True)
  if args.out and jax.process_index() == 0:
    write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
