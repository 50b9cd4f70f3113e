"""Per-layer liveness of ZeRO-3's gathers: the compiled train step's ``memory_analysis()`` for an
L-layer model whose parameters live as 1/D shards (``qcomm.gather_params``), gathered all up
front against one layer at a time (a Python loop, or a ``lax.scan`` over the stacked layers, each
layer under ``jax.checkpoint`` so that backward gathers it again), and against replicated
parameters.

    python -m benchmarks.zero3_memory --devices 8 --layers 8 --width 1024 \\
        --out notebooks/data/zero3_memory_20261129/zero3_memory.json

Each layer is ``x -> tanh(x @ W + b)`` with W ``[width, width]``; the batch is small, so the
parameters, not the activations, set the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_qcomm as qcomm  # noqa: E402

AX = "data"


def _layers(n, width):
  return [{"w": jnp.zeros((width, width), jnp.float32), "b": jnp.zeros((width,), jnp.float32)}
          for _ in range(n)]


def _layer(full, x):
  return jnp.tanh(x @ full["w"] + full["b"])


def compiled_memory(mode: str, devices: int, layers: int, width: int, batch: int) -> dict:
  mesh = Mesh(np.array(jax.devices()[:devices]), (AX,))
  x = jnp.ones((devices * batch, width), jnp.float32)
  params = _layers(layers, width)
  if mode == "replicated":
    def step(p, x):  # plain data parallelism: every device holds every layer
      local = jax.tree_util.tree_map(lambda a: lax.pcast(a, AX, to="varying"), p)
      return lax.pmean(jax.grad(lambda p: jnp.mean(_chain(p, x) ** 2))(local), AX)
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AX)), out_specs=P()))
    args = (params, x)
  else:
    shards = [qcomm.shard_params(layer, devices) for layer in params]
    if mode == "per_layer":  # stacked [D, L, m] for the scan
      shards = jax.tree_util.tree_map(lambda *s: jnp.stack(s, 1), *shards)
    spec = jax.tree_util.tree_map(lambda _: P(AX), shards)

    def loss(sh, x):
      if mode == "up_front":
        return jnp.mean(_chain(qcomm.gather_params(sh, AX), x) ** 2)
      if mode == "loop_remat":  # a Python loop over the layers, each under jax.checkpoint
        for shard in sh:
          x = jax.checkpoint(lambda shard, h: _layer(qcomm.gather_params(shard, AX, after=h), h))(
              shard, x)
        return jnp.mean(x ** 2)

      def body(h, shard):
        return _layer(qcomm.gather_params(shard, AX), h), None
      h, _ = lax.scan(jax.checkpoint(body), x,
                      jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), sh))
      return jnp.mean(h ** 2)

    fn = jax.jit(jax.shard_map(lambda sh, x: jax.grad(loss)(sh, x), mesh=mesh,
                               in_specs=(spec, P(AX)), out_specs=spec))
    args = (shards, x)
  mem = fn.lower(*args).compile().memory_analysis()
  return {"mode": mode, "argument_bytes": int(mem.argument_size_in_bytes),
          "output_bytes": int(mem.output_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes)}


def _chain(params, x):
  for layer in params:
    x = _layer(layer, x)
  return x


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--width", type=int, default=1024)
  ap.add_argument("--batch", type=int, default=2, help="rows per device")
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  layer_bytes = 4 * (args.width * args.width + args.width)
  rows = []
  for mode in ("replicated", "up_front", "loop_remat", "per_layer"):
    row = compiled_memory(mode, args.devices, args.layers, args.width, args.batch)
    row["temp_in_layers"] = row["temp_bytes"] / layer_bytes
    row["peak_in_layers"] = (row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"]) \
        / layer_bytes
    rows.append(row)
    print(json.dumps(row), flush=True)
  result = {"command": "python -m benchmarks.zero3_memory " + " ".join(argv or sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": platform.machine(), "jax": jax.__version__,
            "python": platform.python_version(), "layer_bytes": layer_bytes,
            "devices": args.devices, "layers": args.layers, "width": args.width, "rows": rows}
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
