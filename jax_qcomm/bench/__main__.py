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


#: The benchmarks that run JAX work (they take the common options): subcommand -> (module, help).
#: Each module has ``add_arguments(parser)`` and ``main(args, command)``, which :func:`main` calls
#: after :func:`check_shared_options`.
BENCHMARKS = {
    "codec": (codec, "QSGD encode / decode / decode-sum throughput, ffi vs jax"),
    "allreduce": (allreduce, "allreduce time of fp32 psum, cast_pmean, Cast(bf16), QSGD 8/4/2 "
                             "(devices or processes)"),
    "step": (step, "data-parallel training step with qcomm.sync: Ts, Tstep, Tc, eta, and the cost "
                   "model"),
    "partial": (partial, "fp32 psum of N/gamma elements: where time stops falling with gamma"),
    "patterns": (patterns, "uint8 rows moved by all_to_all, ppermute rounds, all_gather, single "
                           "shifts: vs floor"),
}


def build_parser() -> argparse.ArgumentParser:
  """The parser of all subcommands."""
  parser = argparse.ArgumentParser(prog="python -m jax_qcomm.bench",
                                   description="Benchmarks of jax_qcomm.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
  common = _common_options()
  for name, (module, help_text) in BENCHMARKS.items():
    module.add_arguments(sub.add_parser(
        name, parents=[common], help=help_text, description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter))
  cluster.add_arguments(sub.add_parser(
      "cluster", help="run a benchmark on a simulated cluster: network namespaces, tc-shaped links",
      usage="%(prog)s --nodes N --rate RATE [options] -- BENCHMARK [args ...]",
      description=cluster.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
  return parser


def check_shared_options(args: argparse.Namespace) -> None:
  """The checks of options several benchmarks take, once for all (SystemExit naming the option)."""
  if hasattr(args, "repeats") and (args.repeats < 1 or args.warmup < 1):
    raise SystemExit("--repeats and --warmup must be >= 1")
  link_gbps = getattr(args, "link_gbps", None)
  if link_gbps is not None and not link_gbps > 0:
    raise SystemExit(f"--link-gbps must be > 0, got {link_gbps}")


def main(argv: Sequence[str] | None = None, *, allow_reexec: bool = False) -> int:
  """Parses argv (default: sys.argv[1:]) and runs the subcommand; returns the exit status.

  With ``allow_reexec`` (set when run as a program) the process may first re-execute itself with
  the malloc tuning; called from Python, the malloc mode of the caller's process is recorded as is.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  check_shared_options(args)
  if allow_reexec:
    # cluster: no re-exec of its own; each node's benchmark process re-executes itself.
    _timing.ensure_malloc_env(raw=getattr(args, "raw_malloc", True))
  command = ["python", "-m", "jax_qcomm.bench", *argv]
  if args.command == "cluster":
    return cluster.main(args, command)
  return BENCHMARKS[args.command][0].main(args, command)


if __name__ == "__main__":
  sys.exit(main(allow_reexec=True))
