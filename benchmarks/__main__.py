"""Command line of the benchmarks: ``python -m benchmarks <subcommand> [options]``.

Unless ``--raw-malloc`` is given or the variables are already set, the process first re-executes
itself with glibc's malloc tuned (:func:`benchmarks._common.ensure_malloc_env`) so that large
XLA output buffers do not page-fault on every call.

``cluster`` runs a benchmark on the simulated cluster of :mod:`jax_qcomm.tools.cluster`, after
checking the benchmark's own options here (a typo fails before any namespace exists).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

from jax_qcomm.tools import cluster

from benchmarks import _cli, _common

CLUSTER_OUT = "bench-results/cluster.json"


def build_parser() -> argparse.ArgumentParser:
  """The parser of all subcommands: the JAX benchmarks and ``cluster``."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description="Benchmarks of jax_qcomm.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
  _cli.add_benchmarks(sub)
  cluster.add_arguments(sub.add_parser(
      "cluster", help="run a benchmark on a simulated cluster: network namespaces, tc-shaped links",
      usage="%(prog)s --nodes N --rate RATE [options] -- BENCHMARK [args ...]",
      description=cluster.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
  return parser


def cluster_program(args: argparse.Namespace) -> list[str]:
  """The node program of ``python -m benchmarks cluster ... -- BENCHMARK args``: ``-m benchmarks
  BENCHMARK args`` with ``--link-gbps`` set from ``--rate`` where the benchmark takes it. Raises
  ValueError naming the option when the cluster options or the benchmark's are wrong."""
  bench = cluster.validate(args)
  if args.cleanup:
    return []
  parser = _cli.benchmark_parser()
  try:
    parsed = _cli.parse_quietly(parser, bench)
  except (argparse.ArgumentError, SystemExit) as e:
    what = "cannot run inside the cluster" if bench[0] == "cluster" else f"rejected: {e}"
    raise ValueError(f"benchmark command {shlex.join(bench)!r} {what}") from None
  takes = {o for a in _cli.subparser(parser, parsed.command)._actions for o in a.option_strings}
  if "--link-gbps" in takes and not any(a.split("=")[0] == "--link-gbps" for a in bench):
    bench = [*bench, "--link-gbps", f"{args.rate / 1e9:g}"]
  return ["-m", "benchmarks", *bench]


def main(argv: Sequence[str] | None = None, *, allow_reexec: bool = False) -> int:
  """Parses argv (default: sys.argv[1:]) and runs the subcommand; returns the exit status.

  With ``allow_reexec`` (set when run as a program) the process may first re-execute itself with
  the malloc tuning; called from Python, the malloc mode of the caller's process is recorded as is.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  _cli.check_shared_options(args)
  command = ["python", "-m", "benchmarks", *argv]
  if args.command == "cluster":  # no re-exec of its own: each node's benchmark process does it
    try:
      program = cluster_program(args)
    except ValueError as e:
      print(f"python -m benchmarks cluster: error: {e}", file=sys.stderr)
      return cluster.EXIT_USAGE
    args.out = args.out or CLUSTER_OUT
    return cluster.execute(args, program, command, prog="python -m benchmarks cluster")
  if allow_reexec:
    _common.ensure_malloc_env(raw=getattr(args, "raw_malloc", True))
  return _cli.BENCHMARKS[args.command][0].main(args, command)


if __name__ == "__main__":
  sys.exit(main(allow_reexec=True))
