"""The registry of the JAX benchmarks and their shared options (``python -m benchmarks SUBCOMMAND``).

Kept apart from :mod:`benchmarks.__main__`, which also registers ``cluster``: the benchmark command
a cluster runs on its nodes is checked against :func:`benchmark_parser`, which has no ``cluster``.
"""

from __future__ import annotations

import argparse

from benchmarks import _common, allreduce, codec, partial, patterns, sharded, step


def common_options() -> argparse.ArgumentParser:
  """Options every JAX benchmark takes (a parent parser)."""
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--repeats", type=int, default=7, help="timed runs per point (default: 7)")
  common.add_argument("--warmup", type=int, default=2,
                      help="untimed runs before timing, compilation included (default: 2)")
  common.add_argument("--raw-malloc", action="store_true",
                      help=f"keep glibc's malloc defaults (no re-exec with "
                           f"{' '.join(_common.MALLOC_ENV)} set)")
  return common


#: The benchmarks that run JAX work (they take the common options): subcommand -> (module, help).
#: Each module has ``add_arguments(parser)`` and ``main(args, command)``, which the command line
#: calls after :func:`check_shared_options`.
BENCHMARKS = {
    "codec": (codec, "QSGD encode / decode / decode-sum throughput, ffi vs jax"),
    "allreduce": (allreduce, "allreduce time of fp32 psum, cast_pmean, Cast(bf16), QSGD 8/4/2 "
                             "(devices or processes)"),
    "step": (step, "data-parallel training step with qcomm.sync: Ts, Tstep, Tc, eta, and the cost "
                   "model"),
    "partial": (partial, "fp32 psum of N/gamma elements: where time stops falling with gamma"),
    "sharded": (sharded, "sync(shard_state=True) vs the replicated sync: update, communication "
                         "and the optimizer's own time, bytes and state per device"),
    "patterns": (patterns, "uint8 rows moved by all_to_all, ppermute rounds, all_gather, single "
                           "shifts: vs floor"),
}


def add_benchmarks(sub: argparse._SubParsersAction) -> None:
  """Registers every JAX benchmark as a subcommand of ``sub``."""
  common = common_options()
  for name, (module, help_text) in BENCHMARKS.items():
    module.add_arguments(sub.add_parser(
        name, parents=[common], help=help_text, description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter))


def benchmark_parser() -> argparse.ArgumentParser:
  """The parser of the JAX benchmarks alone (what may run on a node of the cluster)."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description="Benchmarks of jax_qcomm.")
  add_benchmarks(parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND"))
  return parser


def parse_quietly(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
  """parse_args that raises instead of printing usage and exiting (subparsers exit regardless)."""

  def error(message):
    raise argparse.ArgumentError(None, message)

  parser.exit_on_error = False
  parser.error = error  # type: ignore[method-assign]
  for action in parser._actions:  # the subparsers report errors through their own .error
    if isinstance(action, argparse._SubParsersAction):
      for sub in action.choices.values():
        sub.error = error  # type: ignore[method-assign]
  return parser.parse_args(argv)


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
  """The parser of subcommand ``name``."""
  return next(a.choices[name] for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def check_shared_options(args: argparse.Namespace) -> None:
  """The checks of options several benchmarks take, once for all (SystemExit naming the option)."""
  if hasattr(args, "repeats") and (args.repeats < 1 or args.warmup < 1):
    raise SystemExit("--repeats and --warmup must be >= 1")
  link_gbps = getattr(args, "link_gbps", None)
  if link_gbps is not None and not link_gbps > 0:
    raise SystemExit(f"--link-gbps must be > 0, got {link_gbps}")
