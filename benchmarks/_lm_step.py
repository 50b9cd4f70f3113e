"""The command-line shape of the byte LM's step benchmarks, with the standard library only: the
sharded-parameter step (benchmarks/zero3_step.py) and its PyTorch FSDP2 peer
(benchmarks/peers/fsdp2_worker.py, in a venv without jax) take the same model and batch, so that
one command line runs both on the same shapes."""

from __future__ import annotations

import argparse


def add_shape_args(ap: argparse.ArgumentParser) -> None:
  """``--d-model``, ``--layers``, ``--batch`` (windows per step, all processes), ``--seq-len``
  and ``--steps`` (timed steps, after 3 warm-up steps)."""
  ap.add_argument("--d-model", type=int, default=512)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq-len", type=int, default=32)
  ap.add_argument("--steps", type=int, default=8)
