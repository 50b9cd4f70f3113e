"""Command line of the benchmarks: ``python -m benchmarks <subcommand> [options]``.

Unless ``--raw-malloc`` is given or the variables are already set, the process first re-executes
itself with glibc's malloc tuned (:func:`benchmarks._common.ensure_malloc_env`) so that large
XLA output buffers do not page-fault on every call.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from benchmarks import _cli, _common, cluster
from benchmarks.peers import run as peers


def build_parser() -> argparse.ArgumentParser:
  """The parser of all subcommands: the JAX benchmarks and ``cluster``."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description="Benchmarks of jax_qcomm.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
  _cli.add_benchmarks(sub)
  cluster.add_arguments(sub.add_parser(
      "cluster", help="run a benchmark on a simulated cluster: network namespaces, tc-shaped links",
      usage="%(prog)s --nodes N --rate RATE [options] -- BENCHMARK [args ...]",
      description=cluster.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
  peers.add_arguments(sub.add_parser(
      "peers", help="PyTorch gloo/DDP hooks and jax_qcomm on the same simulated links (torch venv)",
      description=peers.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
  return parser


def main(argv: Sequence[str] | None = None, *, allow_reexec: bool = False) -> int:
  """Parses argv (default: sys.argv[1:]) and runs the subcommand; returns the exit status.

  With ``allow_reexec`` (set when run as a program) the process may first re-execute itself with
  the malloc tuning; called from Python, the malloc mode of the caller's process is recorded as is.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  _cli.check_shared_options(args)
  if allow_reexec:
    # cluster: no re-exec of its own; each node's benchmark process re-executes itself.
    _common.ensure_malloc_env(raw=getattr(args, "raw_malloc", True))
  command = ["python", "-m", "benchmarks", *argv]
  if args.command == "cluster":
    return cluster.main(args, command)
  if args.command == "peers":
    return peers.main(args, command)
  return _cli.BENCHMARKS[args.command][0].main(args, command)


if __name__ == "__main__":
  sys.exit(main(allow_reexec=True))
