"""Command line of the benchmarks: ``python -m jax_qcomm.bench <subcommand> [options]``.

Unless ``--raw-malloc`` is given or the variables are already set, the process first re-executes
itself with glibc's malloc tuned (:func:`jax_qcomm.bench._timing.ensure_malloc_env`) so that large
XLA output buffers do not page-fault on every call.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from jax_qcomm.bench import _timing, allreduce, cluster, codec, partial, patterns, step


def _common_options() -> argparse.ArgumentParser:
  """Options every subcommand takes."""
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--repeats", type=int, default=7, help="timed runs per point (default: 7)")
  common.add_argument("--warmup", type=int, default=2,
                      help="untimed runs before timing, compilation included (default: 2)")
  common.add_argument("--raw-malloc", action="store_true",
                      help=f"keep glibc's malloc defaults (no re-exec with "
                           f"{' '.join(_timing.MALLOC_ENV)} set)")
  return common


def build_parser() -> argparse.ArgumentParser:
  """The parser of all subcommands."""
  parser = argparse.ArgumentParser(prog="python -m jax_qcomm.bench",
                                   description="Benchmarks of jax_qcomm.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
  common = _common_options()
  codec.add_arguments(sub.add_parser(
      "codec", parents=[common], help="QSGD encode / decode / decode-sum throughput, ffi vs jax",
      description=codec.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
  allreduce.add_arguments(sub.add_parser(
      "allreduce", parents=[common],
      help="allreduce time of fp32 psum, cast_pmean, Cast(bf16), QSGD 8/4/2 (devices or processes)",
      description=allreduce.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
  step.add_arguments(sub.add_parser(
      "step", parents=[common],
      help="data-parallel training step with qcomm.sync: Ts, Tstep, Tc, eta, and the cost model",
      description=step.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
  partial.add_arguments(sub.add_parser(
      "partial", parents=[common],
      help="fp32 psum of N/gamma elements: where time stops falling with gamma",
      description=partial.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
  patterns.add_arguments(sub.add_parser(
      "patterns", parents=[common],
      help="uint8 rows moved by all_to_all, ppermute rounds, all_gather, single shifts: vs floor",
      description=patterns.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
  cluster.add_arguments(sub.add_parser(
      "cluster", help="run a benchmark on a simulated cluster: network namespaces, tc-shaped links",
      usage="%(prog)s --nodes N --rate RATE [options] -- BENCHMARK [args ...]",
      description=cluster.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
  return parser


def main(argv: Sequence[str] | None = None, *, allow_reexec: bool = False) -> int:
  """Parses argv (default: sys.argv[1:]) and runs the subcommand; returns the exit status.

  With ``allow_reexec`` (set when run as a program) the process may first re-execute itself with
  the malloc tuning; called from Python, the malloc mode of the caller's process is recorded as is.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  if allow_reexec:
    # cluster: no re-exec of its own; each node's benchmark process re-executes itself.
    _timing.ensure_malloc_env(raw=getattr(args, "raw_malloc", True))
  command = ["python", "-m", "jax_qcomm.bench", *argv]
  if args.command == "codec":
    return codec.main(args, command)
  if args.command == "allreduce":
    return allreduce.main(args, command)
  if args.command == "step":
    return step.main(args, command)
  if args.command == "partial":
    return partial.main(args, command)
  if args.command == "patterns":
    return patterns.main(args, command)
  if args.command == "cluster":
    return cluster.main(args, command)
  raise AssertionError(args.command)  # pragma: no cover - argparse rejects unknown subcommands


if __name__ == "__main__":
  sys.exit(main(allow_reexec=True))
