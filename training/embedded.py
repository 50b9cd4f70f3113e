"""The embedded default (the README's first command): trains the digits ResNet over 8 host CPU
devices at 32 bits and at 4 bits, and prints both held-out accuracies and the measured scaling
efficiency of each (step time without synchronisation / with it).

    python -m training.embedded [--bits 32,4] [--workdir runs/embedded] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Sequence

from configs import digits
from training import train


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m training.embedded", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--bits", default="32,4",
                      help="comma-separated bit widths to train with (default: 32,4)")
  parser.add_argument("--workdir", default="runs/embedded",
                      help="metrics, TensorBoard logs and checkpoints go to WORKDIR/bits<B> "
                           "(cleared first; default: runs/embedded)")
  parser.add_argument("--steps", type=int, default=-1,
                      help="optimizer steps per run (default: the config's epochs)")
  parser.add_argument("--json", help="also write the results to this JSON file")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  bits_list = [int(b) for b in args.bits.split(",") if b.strip()]
  base = digits.get_config()
  train.initialize_processes(base)
  results = []
  t0 = time.perf_counter()
  for bits in bits_list:
    config = digits.get_config()
    config.bits = bits
    config.num_train_steps = args.steps
    workdir = os.path.join(args.workdir, f"bits{bits}")
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, not a resume
    print(f"\n=== {config.model} on digits, bits={bits} ===", flush=True)
    t_run = time.perf_counter()
    result = train.train_and_evaluate(config, workdir)
    result["wall_seconds"] = time.perf_counter() - t_run  # compilation included
    results.append(result)
  wall = time.perf_counter() - t0

  print("\nbits  accum  opt. steps  held-out acc  wall s  step s (sync)  step s (no sync)  "
        "scaling eff.")
  for r in results:
    print(f"{r['bits']:>4}  {r['accum_steps']:>5}  {r['steps']:>10}  {r['eval_accuracy']:>12.4f}  "
          f"{r['wall_seconds']:>6.1f}  {r['step_time_sync']:>13.4f}  {r['step_time_nosync']:>16.4f}  "
          f"{r['scaling_efficiency']:>12.3f}")
  print(f"total wall time {wall:.0f} s (8 host CPU devices sharing this machine's cores: the "
        f"'communication' here is memory copies, so the efficiency shows codec overhead, not "
        f"network savings)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"results": results, "wall_seconds": wall}, f, indent=2)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
