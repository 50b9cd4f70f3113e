"""Overlap benchmark: does XLA's runtime run codec work while a collective is on the wire?

Pipelining a compressed allreduce over chunks (encode chunk k+1 while chunk k travels) only pays
if the runtime executes independent operations concurrently. This times, in one process per node
(under the cluster harness or the launcher)::

    python -m benchmarks cluster --nodes 2 --rate 1gbit -- overlap --size 25600000
    python -m benchmarks overlap --devices 2 --size 1M        # one process, host devices

* ``comm``: ``lax.psum`` of uint32 words, as many bytes as the 4-bit QSGD payload of ``--size``;
* ``codec``: the QSGD 4-bit encode of float32[``--size``] (the C++ custom call);
* ``both``: the two in one jitted function, with no data dependence between them;
* ``pipelined``: ``--chunks`` independent (encode chunk k, psum of chunk k's words) pairs in one
  jitted function: what a chunk pipeline gives the scheduler.

``overlap = (comm + codec - both) / min(comm, codec)``: 1 when the shorter one hides entirely
behind the longer, 0 when they run one after the other (medians; across processes the slowest
process per call). ``--xla-flags`` is added to XLA_FLAGS before the backend starts (for example
``--xla_cpu_enable_concurrency_optimized_scheduler=false``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_qcomm as qcomm

from benchmarks import _common

DEFAULT_OUT = "bench-results/overlap.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the overlap benchmark's options to its subcommand parser."""
  parser.add_argument("--size", type=_common.parse_size, default=25_600_000, metavar="N",
                      help="float32 elements encoded per device (default: 25.6M)")
  parser.add_argument("--chunks", type=int, default=4, help="chunks of the pipelined row (default: 4)")
  parser.add_argument("--devices", type=int, default=None,
                      help="host devices per process (default: 4 in a single process; under the "
                           "launcher QCOMM_LOCAL_DEVICES, else 1)")
  parser.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS before the backend starts")
  parser.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")


def _functions(mesh, n: int, words: int, chunks: int) -> dict[str, Any]:
  codec = qcomm.QSGD(bits=4)
  key = jax.random.key(0)
  spec = P("data")

  def comm(x, w):
    return lax.psum(w[0], "data")[None]

  def codec_only(x, w):
    return codec.wire_encode(x[0], key)[None]

  def both(x, w):
    return comm(x, w), codec_only(x, w)

  def pipelined(x, w):
    xs, ws = jnp.split(x[0], chunks), jnp.split(w[0], chunks)
    outs = [(codec.wire_encode(xc, jax.random.fold_in(key, i)), lax.psum(wc, "data"))
            for i, (xc, wc) in enumerate(zip(xs, ws))]
    return [o[0][None] for o in outs], [o[1][None] for o in outs]

  def jit(f):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                                 check_vma=False))

  return {"comm": jit(comm), "codec": jit(codec_only), "both": jit(both),
          "pipelined": jit(pipelined)}


def run(args: argparse.Namespace, mesh) -> list[dict[str, Any]]:
  d, n = mesh.devices.size, args.size
  quantum = args.chunks * qcomm.QSGD(bits=4).pad_multiple
  n = -(-n // quantum) * quantum
  words = -(-qcomm.QSGD(bits=4).payload_size(n) // (4 * args.chunks)) * args.chunks
  sharding = NamedSharding(mesh, P("data"))
  x = _common.global_input(mesh, n)
  w = jax.make_array_from_callback(
      (d, words), sharding, lambda idx: np.full((len(range(*idx[0].indices(d))), words), 3, np.uint32))
  rows = []
  for name, fn in _functions(mesh, n, words, args.chunks).items():
    compiled = fn.lower(x, w).compile()
    t = _common.collective_timing(_common.median_time(compiled, x, w, repeats=args.repeats,
                                                      warmup=args.warmup))
    _common.log(f"  {name:<10} {1e3 * t.median:9.2f} ms")
    rows.append(dict(name=name, size=n, words=words, chunks=args.chunks, **t.as_dict()))
  return rows


def overlap(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
  """The overlap fraction of ``both`` and of ``pipelined`` (1: fully hidden, 0: serial)."""
  t = {r["name"]: r["median_s"] for r in rows}
  shorter = min(t["comm"], t["codec"])
  return {k: (t["comm"] + t["codec"] - t[k]) / shorter for k in ("both", "pipelined")}


def main(args: argparse.Namespace, command: Sequence[str]) -> int:
  """Runs the benchmark; process 0 prints the table and writes the JSON."""
  if args.size < 1 or args.chunks < 1:
    raise SystemExit(f"--size and --chunks must be >= 1, got {args.size}, {args.chunks}")
  if args.xla_flags:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
  _common.init_devices(args.devices)
  mesh, meta = _common.mesh_and_metadata("overlap", command)
  meta["config"] = dict(size=args.size, chunks=args.chunks, repeats=args.repeats,
                        warmup=args.warmup, xla_flags=os.environ.get("XLA_FLAGS", ""))
  rows = run(args, mesh)
  meta["overlap"] = overlap(rows)
  if jax.process_index() == 0:
    headers = ["function", "median ms", "min ms", "max ms"]
    table = [[r["name"], f"{1e3 * r['median_s']:.1f}", f"{1e3 * r['min_s']:.1f}",
              f"{1e3 * r['max_s']:.1f}"] for r in rows]
    print(f"overlap of the QSGD 4-bit encode of {rows[0]['size']:,} floats with a psum of "
          f"{rows[0]['words']:,} uint32 words over D={mesh.devices.size} devices in "
          f"{meta['num_processes']} process(es)  |  {_common.machine_line(meta)}")
    print(_common.format_table(headers, table, align="lrrr"))
    print("overlap (1 = the shorter fully hidden, 0 = serial): "
          + ", ".join(f"{k} {v:.2f}" for k, v in meta["overlap"].items()))
    path = _common.write_json(args.out, dict(metadata=meta, rows=rows))
    print(f"wrote {path}")
  return 0
