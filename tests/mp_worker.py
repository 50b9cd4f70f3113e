"""Worker of tests/test_multiprocess.py: one of several JAX processes started by jax_qcomm.tools.launch.

    python -m jax_qcomm.tools.launch -n 2 --local-devices 2 tests/mp_worker.py OUT_DIR

Every process initialises jax.distributed (gloo), builds the global mesh, runs the collectives of
CASES under ``jax.shard_map`` on inputs made by :func:`inputs` from the global device index, and
writes the rows its own devices hold to OUT_DIR/proc<i>.npz (key ``case/leaf/g`` for global device
g). The test recomputes the inputs in numpy and checks the rows. Importing this module (as the test
does, for :func:`inputs` and the case table) starts nothing.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import ml_dtypes
import numpy as np

# name -> (kind, shape of each device's input, extra).  kind picks the collective (see _build).
N = 3000          # allreduce length: not a multiple of D * bucket, so padding is exercised
RS_BLOCK = 700    # reduce_scatter: each device's input is [D * RS_BLOCK], its output [RS_BLOCK]
AG_LEN = 900      # all_gather: each device's input is [AG_LEN]
TREE_SHAPES = {"w": ((48, 40), "float32"),   # quantised (2-D, >= 1024 elements)
               "h": ((32, 64), "bfloat16"),  # quantised, returned as bfloat16
               "b": ((40,), "float32"),      # 1-D: exact under the default LeafPolicy
               "s": ((16, 16), "float32")}   # < 1024 elements: exact
# The exact tree across processes: "big" is at least the gloo transports' own_operand (2**18) and
# travels as its own all-reduce operand, the other two packed together (300 * 7 + 40 values).
OWN_TREE_SHAPES = {"big": ((517, 509), "float32"), "mid": ((300, 7), "float32"),
                   "b": ((40,), "float32")}

# case -> (collective, codec description, axis, op). Axis "flat" is the 1-D mesh "data";
# "tuple" is ("proc", "local") of the 2-D mesh; "hier" is Hierarchical(inner="local", outer="proc").
CASES = {
    "qsgd4_maxmin": ("allreduce", ("qsgd", 4, "maxmin"), "flat", "mean"),
    "qsgd4_norm": ("allreduce", ("qsgd", 4, "norm"), "flat", "mean"),
    "qsgd4_maxmin_sum": ("allreduce", ("qsgd", 4, "maxmin"), "flat", "sum"),
    "cast_bf16": ("allreduce", ("cast",), "flat", "mean"),
    "fp32": ("allreduce", ("none",), "flat", "mean"),
    "tree_qsgd4": ("allreduce_tree", ("qsgd", 4, "maxmin"), "flat", "mean"),
    "tree_powersgd2": ("allreduce_tree", ("powersgd", 2), "flat", "mean"),
    "tree_fp32_own": ("allreduce_tree", ("none",), "flat", "mean"),
    "tuple_qsgd4": ("allreduce", ("qsgd", 4, "maxmin"), "tuple", "mean"),
    "hier_qsgd4": ("allreduce", ("qsgd", 4, "maxmin"), "hier", "mean"),
    "hier_fp32": ("allreduce", ("none",), "hier", "mean"),
    "rs_qsgd4": ("reduce_scatter", ("qsgd", 4, "maxmin"), "flat", "mean"),
    "rs_fp32": ("reduce_scatter", ("none",), "flat", "mean"),
    "ag_default": ("all_gather", ("default",), "flat", None),
    "ag_qsgd4": ("all_gather", ("qsgd", 4, "maxmin"), "flat", None),
}


def inputs(case: str, g: int, num_devices: int) -> dict[str, np.ndarray]:
  """The input of global device g for a case, as {leaf: array} (one leaf "x" unless a tree).

  Deterministic in (case, g): the test recomputes them. Each device gets a different scale and
  offset so that quantisation steps differ between devices."""
  kind = CASES[case][0]
  rng = np.random.default_rng([sum(map(ord, case)), g])
  scale, offset = 1.0 + 0.5 * g, 0.25 * g - 0.5

  def draw(shape):
    return (rng.standard_normal(shape) * scale + offset).astype(np.float32)

  if kind == "allreduce":
    return {"x": draw((N,))}
  if kind == "reduce_scatter":
    return {"x": draw((num_devices * RS_BLOCK,))}
  if kind == "all_gather":
    return {"x": draw((AG_LEN,))}
  if kind == "allreduce_tree":
    out = {}
    for leaf, (shape, dtype) in (OWN_TREE_SHAPES if case == "tree_fp32_own" else TREE_SHAPES).items():
      v = draw(shape)
      out[leaf] = v if dtype == "float32" else v.astype(getattr(ml_dtypes, dtype))
    return out
  raise AssertionError(kind)


def make_codec(desc):
  import jax.numpy as jnp

  import jax_qcomm as qcomm

  if desc[0] == "qsgd":
    return qcomm.QSGD(bits=desc[1], scheme=desc[2])
  if desc[0] == "cast":
    return qcomm.Cast(jnp.bfloat16)
  if desc[0] == "none":
    return qcomm.NoCompression()
  if desc[0] == "powersgd":
    return qcomm.PowerSGD(desc[1])
  return None  # the collective's default codec


def _build(case, mesh1, mesh2):
  """(jitted fn, mesh, spec axes) computing the case on [D, ...] global arrays."""
  import jax
  from jax.sharding import PartitionSpec as P

  import jax_qcomm as qcomm

  kind, desc, axis, op = CASES[case]
  codec = make_codec(desc)
  key = jax.random.key(1234)
  if axis == "flat":
    mesh, axes, name = mesh1, "data", "data"
  elif axis == "tuple":
    mesh, axes, name = mesh2, ("proc", "local"), ("proc", "local")
  else:
    mesh, axes, name = mesh2, ("proc", "local"), qcomm.Hierarchical(inner="local", outer="proc")
  kw = {} if codec is None else {"codec": codec}

  def per_device(tree):
    tree = jax.tree.map(lambda v: v[0], tree)  # drop the device axis of this device's [1, ...]
    if kind in ("allreduce", "allreduce_tree"):
      out = qcomm.allreduce(tree if kind == "allreduce_tree" else tree["x"], name, key=key, op=op, **kw)
      out = out if kind == "allreduce_tree" else {"x": out}
    elif kind == "reduce_scatter":
      out = {"x": qcomm.reduce_scatter(tree["x"], name, key=key, op=op, **kw)}
    else:
      out = {"x": qcomm.all_gather(tree["x"], name, key=key, **kw)}
    return jax.tree.map(lambda v: v[None], out)

  fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
  return fn, mesh, axes


def main(out_dir: str) -> None:
  t0 = time.perf_counter()
  from jax_qcomm.tools import distributed

  distributed.initialize()
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  pid, nproc = jax.process_index(), jax.process_count()
  mesh1 = distributed.global_mesh(("data",))
  mesh2 = distributed.global_mesh(("proc", "local"))
  devices = distributed.global_devices()
  d = len(devices)
  assert list(mesh1.devices.flat) == devices == list(mesh2.devices.flat)
  assert [dev.process_index for dev in devices] == sorted(dev.process_index for dev in devices)
  print(f"process {pid}/{nproc}: {d} devices, ids {[dev.id for dev in devices]}", flush=True)

  results: dict[str, np.ndarray] = {}
  for case in CASES:
    fn, mesh, axes = _build(case, mesh1, mesh2)
    sharding = NamedSharding(mesh, P(axes))
    leaves = inputs(case, 0, d)
    tree = {}
    for leaf, first in leaves.items():
      shape = (d,) + first.shape
      tree[leaf] = jax.make_array_from_callback(
          shape, sharding,
          lambda idx, leaf=leaf: np.stack([inputs(case, g, d)[leaf]
                                           for g in range(*idx[0].indices(d))]))
    out = fn(tree)
    if case == "qsgd4_maxmin":  # which exchange "auto" chose across processes (test_multiprocess)
      text = fn.lower(tree).as_text()  # StableHLO: the platform's branch only, no 2nd compile
      counts = {op: text.count(f"stablehlo.{op}") for op in ("collective_permute", "all_to_all")}
      with open(os.path.join(out_dir, f"proc{pid}_hlo.json"), "w") as f:
        json.dump(counts, f)
    if case == "tree_fp32_own":  # the operands of the compiled all-reduces (test_multiprocess)
      text = fn.lower(tree).compile().as_text()
      with open(os.path.join(out_dir, f"proc{pid}_own.json"), "w") as f:
        json.dump(re.findall(r"= \(?([^=]*?)\)? all-reduce\(", text), f)
    for leaf, arr in out.items():
      for shard in arr.addressable_shards:
        for row, g in enumerate(range(*shard.index[0].indices(d))):
          data = np.asarray(shard.data)[row]
          if data.dtype.name == "bfloat16":  # np.savez cannot store it: keep the bits
            data = data.view(np.uint16)
          results[f"{case}/{leaf}/{g}"] = data
    print(f"process {pid}: {case} done ({time.perf_counter() - t0:.1f} s)", flush=True)
  tmp = os.path.join(out_dir, f".proc{pid}.npz")
  np.savez(tmp, **results)
  os.replace(tmp, os.path.join(out_dir, f"proc{pid}.npz"))
  from jax.experimental import multihost_utils

  multihost_utils.sync_global_devices("mp_worker done")  # nobody exits while others still talk
  print(f"process {pid}: wrote {len(results)} rows in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit("usage: mp_worker.py OUT_DIR")
  main(sys.argv[1])
