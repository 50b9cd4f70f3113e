"""Transfer-pattern benchmark: how fast the collectives' traffic patterns move uint8 rows.

What diagnosed the compressed allreduce's all-to-all on gloo (docs/benchmarks-log.md): the same bytes
moved by ``lax.all_to_all``, by ppermute rounds (``jax_qcomm.transport._exchange``), by one ppermute of a given
shift, and by ``lax.all_gather``, each against the link floor::

    python -m benchmarks cluster --nodes 4 --rate 1gbit -- patterns --row-bytes 3600000
    python -m jax_qcomm.tools.launch -n 4 -m benchmarks patterns --row-bytes 1M

Patterns (p = ``--row-bytes``, D devices):

* ``all_to_all``: ``lax.all_to_all`` of uint8[D, p] (each device sends D-1 rows of p bytes);
* ``rounds``: the same exchange as ppermute rounds (4 devices: six half-row rounds along the
  directed Hamiltonian cycles of K4; otherwise D-1 shift rounds);
* ``all_gather``: ``lax.all_gather`` of uint8[p] (each device sends p bytes to D-1 peers);
* ``psum``: ``lax.psum`` of uint8[p], XLA's all-reduce (a ring: each device sends 2 (D-1)/D p
  bytes; on CPU it runs at the same rate per byte as float32, see docs/benchmarks.md);
* ``psum_scatter``: ``lax.psum_scatter`` of uint8[D, p], XLA's reduce-scatter (a ring: each
  device sends (D-1) p bytes);
* ``exchange``, ``gather``, ``scatter_sum``: the library's all-to-all, all-gather and
  reduce-scatter (``jax_qcomm.transport._exchange``) as it sends them: rounds on CPU across processes, and
  rows in pieces where the transport bounds a message (two processes over gloo);
* ``shift<s>``: one ``lax.ppermute`` of uint8[p], device i to i+s (``shift2`` at D = 4 is made of
  swaps: 0<->2, 1<->3);
* ``cycle<t>`` (D = 4 only): one ppermute along the t-th Hamiltonian cycle of the rounds schedule.

Columns: ``sent MB`` (bytes each device sends), ``floor ms`` (those bytes / ``--link-gbps``) and
``time/floor``; times as in the allreduce benchmark (median; across processes the slowest process
per call).
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable, Sequence

import numpy as np

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_qcomm.transport import _exchange

from benchmarks import _common

DEFAULT_OUT = "bench-results/patterns.json"
DEFAULT_PATTERNS = ("all_to_all", "rounds", "all_gather", "shift1", "shift2")
_PATTERN = re.compile(r"all_to_all|rounds|all_gather|psum_scatter|psum|exchange|gather|scatter_sum|"
                      r"shift[1-9][0-9]*|cycle[0-5]")


def _pattern(text: str) -> str:
  if not _PATTERN.fullmatch(text):
    raise argparse.ArgumentTypeError(
        f"expected all_to_all, rounds, all_gather, psum, psum_scatter, exchange, gather, "
        f"scatter_sum, shift<s> or cycle<0-5>, "
        f"got {text!r}")
  return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the patterns benchmark's options to its subcommand parser."""
  parser.add_argument("--row-bytes", type=_common.parse_size, default=3_600_000, metavar="P",
                      help="bytes per row (default: 3.6M, one QSGD 4-bit chunk of 25.6M / 4)")
  parser.add_argument("--patterns", type=_pattern, nargs="+", default=list(DEFAULT_PATTERNS),
                      help=f"patterns to time (default: {' '.join(DEFAULT_PATTERNS)})")
  parser.add_argument("--devices", type=int, default=None,
                      help="host devices per process (default: 4 in a single process; under the "
                           "launcher QCOMM_LOCAL_DEVICES, else 1)")
  parser.add_argument("--link-gbps", type=float, default=None,
                      help="link rate in Gbit/s, for the floor columns")
  parser.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")


def _fn(pattern: str, mesh) -> tuple[Callable, int]:
  """The jitted pattern over uint8[D, D, p] (device i holds [D, p]) and the rows each device sends."""
  d = mesh.devices.size
  if pattern == "all_to_all":
    body, rows = (lambda a: lax.all_to_all(a, "data", 0, 0, tiled=True)), d - 1
  elif pattern == "rounds":
    body, rows = (lambda a: _exchange.exchange_rounds(a, "data")), d - 1
  elif pattern == "all_gather":
    body, rows = (lambda a: lax.all_gather(a[0], "data")), d - 1
  elif pattern == "psum":  # XLA's all-reduce (a ring sends 2 (D-1)/D of the row); uint8 wraps
    body, rows = (lambda a: lax.psum(a[0], "data")), 2 * (d - 1) / d
  elif pattern == "psum_scatter":  # XLA's reduce-scatter of [D, p]: a ring sends D-1 rows of p
    body, rows = (lambda a: lax.psum_scatter(a, "data", scatter_dimension=0, tiled=True)[0]), d - 1
  elif pattern == "exchange":  # the library's all-to-all: rounds on CPU, in the transport's pieces
    body, rows = (lambda a: _exchange.exchange(a, "data")), d - 1
  elif pattern == "gather":
    body, rows = (lambda a: _exchange.gather(a[0], "data")), d - 1
  elif pattern == "scatter_sum":
    body, rows = (lambda a: _exchange.scatter_sum(a.reshape(-1), "data")), d - 1
  else:
    if pattern.startswith("cycle"):
      if d != 4:
        raise SystemExit(f"{pattern}: the cycles are those of 4 devices, not {d}")
      succ = _exchange.hamiltonian_schedule_4()[int(pattern[5:])][0]
      pairs = list(enumerate(succ))
    else:
      s = int(pattern[5:])
      if s % d == 0:
        raise SystemExit(f"{pattern}: a shift of {s} on {d} devices sends nothing")
      pairs = [(i, (i + s) % d) for i in range(d)]
    body, rows = (lambda a: lax.ppermute(a[0], "data", pairs)), 1
  fn = jax.jit(jax.shard_map(lambda a: body(a[0])[None], mesh=mesh, in_specs=P("data"),
                             out_specs=P("data")))
  return fn, rows


def run(args: argparse.Namespace, mesh) -> list[dict[str, Any]]:
  d, p = mesh.devices.size, args.row_bytes
  buf = jax.make_array_from_callback(
      (d, d, p), NamedSharding(mesh, P("data")),
      lambda idx: np.full((len(range(*idx[0].indices(d))), d, p), 7, np.uint8))
  out = []
  for pattern in args.patterns:
    fn, rows = _fn(pattern, mesh)
    compiled = fn.lower(buf).compile()
    t = _common.collective_timing(_common.median_time(compiled, buf, repeats=args.repeats,
                                               warmup=args.warmup))
    sent = rows * p
    floor = None if args.link_gbps is None else sent * 8 / (args.link_gbps * 1e9)
    _common.log(f"  {pattern:<12} {1e3 * t.median:9.2f} ms")
    out.append(dict(pattern=pattern, devices=d, row_bytes=p, sent_bytes_per_device=sent,
                    **t.as_dict(), link_floor_s=floor,
                    time_vs_floor=None if floor is None else t.median / floor))
  return out


def format_results(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
  cfg = meta["config"]
  headers = ["pattern", "sent MB", "median ms", "min ms", "max ms", "floor ms", "time/floor"]
  table = [[r["pattern"], f"{r['sent_bytes_per_device'] / 1e6:.2f}", f"{1e3 * r['median_s']:.1f}",
            f"{1e3 * r['min_s']:.1f}", f"{1e3 * r['max_s']:.1f}",
            "" if r["link_floor_s"] is None else f"{1e3 * r['link_floor_s']:.1f}",
            "" if r["time_vs_floor"] is None else f"{r['time_vs_floor']:.2f}x"] for r in rows]
  return "\n".join([
      f"transfer patterns of uint8 rows of {cfg['row_bytes']:,} bytes over D={meta['num_devices']} "
      f"devices in {meta['num_processes']} process(es)  |  {_common.machine_line(meta)}",
      "",
      _common.format_table(headers, table, align="l" + "r" * (len(headers) - 1)),
      "",
      f"median (min, max) of {cfg['repeats']} runs after {cfg['warmup']} warmup runs; sent = bytes "
      "each device sends; floor = sent / link rate.",
      _common.malloc_note(meta["malloc"]),
  ])


def main(args: argparse.Namespace, command: Sequence[str]) -> int:
  """Runs the benchmark; process 0 prints the table and writes the JSON."""
  if args.row_bytes < 2:
    raise SystemExit(f"--row-bytes must be >= 2, got {args.row_bytes}")

  _common.init_devices(args.devices)

  mesh, meta = _common.mesh_and_metadata("patterns", command)
  meta["config"] = dict(row_bytes=args.row_bytes, patterns=args.patterns, repeats=args.repeats,
                        warmup=args.warmup, link_gbps=args.link_gbps)
  _common.log(_common.malloc_note(meta["malloc"]))
  if mesh.devices.size < 2:
    raise SystemExit("the patterns benchmark needs at least 2 devices")
  rows = run(args, mesh)
  if jax.process_index() == 0:
    print(format_results(rows, meta))
    path = _common.write_json(args.out, dict(metadata=meta, rows=rows))
    print(f"wrote {path}")
  return 0
