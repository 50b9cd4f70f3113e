"""Bandwidth-bottleneck benchmark: an fp32 psum of only the first N/gamma elements.

The synthetic "send only 1/gamma of the gradient" experiment: if the allreduce is bandwidth-bound,
its time falls like 1/gamma; where it stops falling, bytes are no longer the bottleneck (latency,
per-call overheads, compute) and compressing further buys nothing::

    python -m benchmarks partial --devices 4 --size 25600000 --gammas 1,2,4,8,16,32
    python -m jax_qcomm.tools.launch -n 4 -m benchmarks partial --link-gbps 1

For each gamma, ``lax.psum`` (op mean) of a float32[N // gamma] buffer per device under
``jax.shard_map`` over all devices (all processes under the launcher), timed as in the allreduce
benchmark (median; across processes the slowest process per call).

Columns: ``wire MB`` (ring allreduce: 2 (D-1)/D x 4 N/gamma bytes per device), ``vs gamma=1`` (time
of gamma=1 / time), ``ideal`` (= gamma, a purely bandwidth-bound collective), ``efficiency`` (speedup
/ gamma: 1 while bandwidth-bound), ``marginal`` (time at the previous gamma / time: 2 when doubling
gamma halves the time), ``busbw GB/s`` (wire bytes / time) and, with ``--link-gbps``, the link floor.
The knee is the smallest gamma from which on no larger gamma is more than ``--knee`` (default 1.25)
times faster: the compression ratio beyond which the link stops being the bottleneck here.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_qcomm.tools import efficiency

from benchmarks import _common

DEFAULT_OUT = "bench-results/partial.json"
DEFAULT_SIZE = 25_600_000
DEFAULT_GAMMAS = (1, 2, 4, 8, 16, 32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the partial benchmark's options to its subcommand parser."""
  parser.add_argument("--size", type=_common.parse_size, default=DEFAULT_SIZE, metavar="N",
                      help="full gradient size in float32 elements (default: 25.6M)")
  parser.add_argument("--gammas", type=_common.int_list, default=list(DEFAULT_GAMMAS),
                      help="comma-separated reduction factors (default: 1,2,4,8,16,32)")
  parser.add_argument("--devices", type=int, default=None,
                      help="host devices per process (default: 4 in a single process; under the "
                           "launcher QCOMM_LOCAL_DEVICES, else 1)")
  parser.add_argument("--link-gbps", type=float, default=None,
                      help="link rate in Gbit/s, for a 'floor' column (wire bytes / rate)")
  parser.add_argument("--knee", type=float, default=1.25,
                      help="total further gain (time ratio) under which the collective counts as "
                           "no longer bandwidth-bound (default: 1.25)")
  parser.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")


def _psum_fn(mesh):
  def per_device(x):
    return lax.pmean(x[0], "data")[None]

  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data")))


def find_knee(rows: Sequence[dict[str, Any]], threshold: float) -> int | None:
  """The smallest gamma (not the last) from which on the time never falls below its time divided
  by ``threshold``: beyond it, sending fewer bytes buys less than ``threshold`` x in total. Robust
  to one noisy point. None if the time keeps falling over the whole range."""
  for i, r in enumerate(rows[:-1]):
    best_after = min(q["median_s"] for q in rows[i + 1:])
    if r["median_s"] / best_after < threshold:
      return r["gamma"]
  return None


def run(args: argparse.Namespace, mesh) -> list[dict[str, Any]]:
  d = mesh.devices.size
  fn = _psum_fn(mesh)
  rows = []
  for gamma in sorted(set(args.gammas)):
    n = max(1, args.size // gamma)
    x = _common.global_input(mesh, n)
    jax.block_until_ready(x)
    t = _common.collective_timing(_common.median_time(fn, x, repeats=args.repeats, warmup=args.warmup))
    sent = efficiency.ring_allreduce_bytes(n, d, 4)
    _common.log(f"  gamma {gamma:>4} n {n:>12,} {1e3 * t.median:10.2f} ms")
    rows.append(dict(
        gamma=gamma, elements=n, size=args.size, devices=d, processes=jax.process_count(),
        wire_bytes_per_device=sent, **t.as_dict(),
        busbw_gb_per_s=sent / t.median / 1e9,
        link_floor_s=None if args.link_gbps is None else efficiency.transfer_time(sent, args.link_gbps)))
    del x
  t1 = rows[0]["median_s"]
  for prev, r in zip([None] + rows[:-1], rows):
    r["speedup_vs_first"] = t1 / r["median_s"]
    r["ideal_speedup"] = r["gamma"] / rows[0]["gamma"]
    r["efficiency"] = r["speedup_vs_first"] / r["ideal_speedup"]
    r["marginal_gain"] = None if prev is None else prev["median_s"] / r["median_s"]
  return rows


def format_results(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
  cfg = meta["config"]
  has_floor = cfg["link_gbps"] is not None
  headers = ["gamma", "elements", "wire MB", "median ms", "min ms", "max ms", "vs gamma=1", "ideal",
             "efficiency", "marginal", "busbw GB/s"] + (["floor ms"] if has_floor else [])
  table = []
  for r in rows:
    line = [r["gamma"], f"{r['elements']:,}", f"{r['wire_bytes_per_device'] / 1e6:.2f}",
            f"{1e3 * r['median_s']:.2f}", f"{1e3 * r['min_s']:.2f}", f"{1e3 * r['max_s']:.2f}",
            f"{r['speedup_vs_first']:.2f}x", f"{r['ideal_speedup']:.0f}x", f"{r['efficiency']:.2f}",
            "" if r["marginal_gain"] is None else f"{r['marginal_gain']:.2f}",
            f"{r['busbw_gb_per_s']:.3f}"]
    if has_floor:
      line.append(f"{1e3 * r['link_floor_s']:.2f}")
    table.append(line)
  knee = meta["knee_gamma"]
  return "\n".join([
      f"fp32 psum of N/gamma elements (N={cfg['size']:,}) over D={meta['num_devices']} devices in "
      f"{meta['num_processes']} process(es)  |  {_common.machine_line(meta)}",
      "",
      _common.format_table(headers, table),
      "",
      f"median of {cfg['repeats']} runs after {cfg['warmup']} warmup runs. efficiency = speedup / "
      "gamma (1 while bandwidth-bound); marginal = previous time / time.",
      ("knee: none (bandwidth-bound over the whole range)" if knee is None else
       f"knee: gamma = {knee} (no larger gamma is {cfg['knee']}x faster: beyond {knee}x fewer "
       "bytes the link is no longer the bottleneck)"),
      _common.malloc_note(meta["malloc"]),
  ])


def main(args: argparse.Namespace, command: Sequence[str]) -> int:
  """Runs the benchmark; process 0 prints the table and writes the JSON."""
  if args.size < 1:
    raise SystemExit(f"--size must be >= 1, got {args.size}")
  if not args.knee > 1:
    raise SystemExit(f"--knee must be > 1, got {args.knee}")

  _common.init_devices(args.devices)

  mesh, meta = _common.mesh_and_metadata("partial", command)
  meta["config"] = dict(size=args.size, gammas=sorted(set(args.gammas)), repeats=args.repeats,
                        warmup=args.warmup, link_gbps=args.link_gbps, knee=args.knee, op="mean")
  _common.log(_common.malloc_note(meta["malloc"]))
  if mesh.devices.size == 1:
    _common.log("warning: one device only: nothing is communicated")
  rows = run(args, mesh)
  meta["knee_gamma"] = find_knee(rows, args.knee)
  if jax.process_index() == 0:
    print(format_results(rows, meta))
    path = _common.write_json(args.out, dict(metadata=meta, rows=rows))
    print(f"wrote {path}")
  return 0
