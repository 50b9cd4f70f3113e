"""Parameters sharded over a model axis inside each data replica, through ``qcomm.data_parallel``:
per-device memory (the compiled step's ``memory_analysis()``), bytes each device sends across the
data axis (``qcomm.describe``, checked against the compiled HLO) and compile time, against the
same model replicated on the same mesh, and the compile time of a plain ``jax.jit`` step.

    python -m benchmarks.model_sharded --data 2 --model 4 --d-model 256 --layers 4 \\
        --out notebooks/data/model_sharded_20261129/model_sharded.json

On the simulated cluster (one process per node, the model axis over each node's own devices, the
data axis across the nodes' links), ``--steps N`` times the runner's step instead (median of N
after 3 warm-up steps), exact against 4 bits across the nodes:

    python -m jax_qcomm.tools.cluster --nodes 2 --rate 1gbit --local-devices 4 \\
        --out notebooks/data/model_sharded_20261129/cluster_step.json -- \\
        -m benchmarks.model_sharded --d-model 512 --layers 4 --steps 10

The model is the byte LM of ``training/lm.py`` (Megatron-style tensor parallel weights,
``training.lm.param_partition``), its optimizer ``qcomm.sync(clip -> AdamW)``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time

from jax_qcomm.tools import distributed

if distributed.under_launcher():
  distributed.initialize()
import jax  # noqa: E402

if not distributed.under_launcher():
  jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from flax import nnx  # noqa: E402

import jax_qcomm as qcomm  # noqa: E402
from benchmarks._common import time_step_calls  # noqa: E402
from training import lm  # noqa: E402
from configs import lm_bytes  # noqa: E402

_ITEMSIZE = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "u16": 2, "s16": 2, "u8": 1,
             "s8": 1, "pred": 1, "f64": 8, "s64": 8, "u64": 8}
_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                         r"(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)\(")


def data_axis_bytes(text: str, d: int) -> float:
  """Bytes each device sends over the collectives of the data axis in a compiled HLO module
  (all-reduce 2 (D-1)/D x size, all-gather and all-to-all (D-1)/D x size, reduce-scatter (D-1) x
  output, collective-permute 1 x size)."""
  factor = {"all-reduce": 2 * (d - 1) / d, "all-gather": (d - 1) / d, "all-to-all": (d - 1) / d,
            "reduce-scatter": d - 1, "collective-permute": 1}
  total = 0.0
  for line in text.splitlines():
    if "{'data'}" in line:
      for shape, op in _COLLECTIVE.findall(line):
        total += factor[op] * sum(
            _ITEMSIZE[t] * int(np.prod([int(v) for v in dims.split(",") if v] or [1]))
            for t, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", shape))
  return total


def measure(config, mesh: Mesh, sharded: bool, bits: int) -> dict:
  config = config.copy_and_resolve_references()
  config.bits = bits
  tx = lm.create_optimizer(config)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: lm.create_model(config, nnx.Rngs(0))))
  params = jax.jit(lambda: nnx.state(lm.create_model(config, nnx.Rngs(0))).to_pure_dict())()
  specs = (lm.param_partition(params, mesh) if sharded
           else jax.tree_util.tree_map(lambda _: P(), params))
  params = jax.device_put(params, jax.tree_util.tree_map(
      lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)))
  dp = lm.create_data_parallel(graphdef, tx, mesh)
  state = dp.init(params)
  windows = jnp.zeros((config.batch_size, config.seq_len + 1), jnp.int32)
  windows = jax.device_put(windows, NamedSharding(mesh, P("data")))
  t0 = time.perf_counter()
  compiled = jax.jit(dp.step).lower(params, state, windows).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  d = mesh.shape["data"]
  hlo = data_axis_bytes(compiled.as_text(), d) - 2 * (d - 1) / d * 4  # less the loss's pmean
  described = qcomm.describe(tx, params, devices=d).sent_bytes_per_sync
  per_device = lambda tree: sum(  # noqa: E731
      s.data.nbytes for x in jax.tree_util.tree_leaves(tree) for s in x.addressable_shards
      if s.device == jax.devices()[0])
  return {"sharded": sharded, "bits": bits, "compile_s": compile_s,
          "argument_bytes": int(mem.argument_size_in_bytes),
          "output_bytes": int(mem.output_size_in_bytes),
          "temp_bytes": int(mem.temp_size_in_bytes),
          "params_bytes_device0": per_device(params), "state_bytes_device0": per_device(state),
          "sent_bytes_per_sync_described": described, "sent_bytes_per_sync_hlo": hlo}


def time_steps(config, mesh: Mesh, bits: int, steps: int) -> dict:
  """Median seconds of the runner's step, parameters sharded over "model" (3 warm-up steps)."""
  config = config.copy_and_resolve_references()
  config.bits = bits
  tx = lm.create_optimizer(config)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: lm.create_model(config, nnx.Rngs(0))))
  abstract = jax.eval_shape(lambda: nnx.state(lm.create_model(config, nnx.Rngs(0))).to_pure_dict())
  shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s),
                                     lm.param_partition(abstract, mesh),
                                     is_leaf=lambda s: isinstance(s, P))
  params = jax.jit(lambda: nnx.state(lm.create_model(config, nnx.Rngs(0))).to_pure_dict(),
                   out_shardings=shardings)()
  dp = lm.create_data_parallel(graphdef, tx, mesh)
  state = dp.init(params)
  rows = config.batch_size // jax.process_count()
  local = np.zeros((rows, config.seq_len + 1), np.int32)
  windows = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
  times, params, state, _ = time_step_calls(jax.jit(dp.step), params, state, windows, steps=steps)
  d = mesh.shape["data"]
  return {"bits": bits, "step_s_median": float(np.median(times)), "step_s": times,
          "sent_bytes_per_device": qcomm.describe(tx, params, devices=d).sent_bytes_per_sync}


def plain_jit_compile_s(config, mesh: Mesh) -> float:
  """Compile time of the plain jax.jit step of the same model and optimizer (optax AdamW, XLA's
  own data parallelism over the batch's sharding): the baseline of the runner's compile time."""
  tx = lm.local_optimizer(config)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: lm.create_model(config, nnx.Rngs(0))))
  params = jax.jit(lambda: nnx.state(lm.create_model(config, nnx.Rngs(0))).to_pure_dict())()
  params = jax.device_put(params, jax.tree_util.tree_map(
      lambda s: NamedSharding(mesh, s), lm.param_partition(params, mesh),
      is_leaf=lambda s: isinstance(s, P)))
  state = tx.init(params)

  def step(params, state, windows):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean(lm.window_loss(graphdef, p, windows)))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  windows = jax.device_put(jnp.zeros((config.batch_size, config.seq_len + 1), jnp.int32),
                           NamedSharding(mesh, P("data")))
  t0 = time.perf_counter()
  jax.jit(step).lower(params, state, windows).compile()
  return time.perf_counter() - t0


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--data", type=int, default=2)
  ap.add_argument("--model", type=int, default=4)
  ap.add_argument("--d-model", type=int, default=256)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--bits", default="32,4")
  ap.add_argument("--steps", type=int, default=0,
                  help="time N steps of the sharded runner (on the cluster) instead")
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  config = lm_bytes.get_config()
  config.d_model, config.num_layers = args.d_model, args.layers
  if args.steps:
    mesh = (distributed.global_mesh(("data", "model")) if jax.process_count() > 1
            else lm.create_mesh(args.data * args.model, args.model))
    result = {"command": "python -m benchmarks.model_sharded " + " ".join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "cpu": platform.processor() or platform.machine(), "jax": jax.__version__,
              "mesh": dict(mesh.shape),
              "rows": [time_steps(config, mesh, int(b), args.steps)
                       for b in args.bits.split(",")]}
    if args.out and jax.process_index() == 0:
      with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if jax.process_index() == 0:
      print(json.dumps({**result, "rows": [{k: v for k, v in r.items() if k != "step_s"}
                                           for r in result["rows"]]}), flush=True)
    return result
  config.num_devices, config.model_devices = args.data * args.model, args.model
  mesh = lm.create_mesh(config.num_devices, config.model_devices)
  rows = []
  for bits in [int(b) for b in args.bits.split(",")]:
    for sharded in (False, True):
      row = measure(config, mesh, sharded, bits)
      rows.append(row)
      print(json.dumps(row), flush=True)
  # jit compiles cache per process: time the plain step after the runner's, both warm alike
  plain = plain_jit_compile_s(config, mesh)
  result = {"command": "python -m benchmarks.model_sharded " + " ".join(argv or sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": platform.processor() or platform.machine(), "jax": jax.__version__,
            "python": platform.python_version(), "mesh": dict(mesh.shape),
            "parameters": int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(
                jax.eval_shape(lambda: nnx.state(lm.create_model(config, nnx.Rngs(0)))
                               .to_pure_dict())))),
            "plain_jit_compile_s": plain, "rows": rows}
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
  return result


if __name__ == "__main__":
  main()
