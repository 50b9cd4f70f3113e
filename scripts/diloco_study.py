"""The DiLoCo cells of docs/accuracy.md: ``python -m training.lm_diloco`` once per cell.

    python scripts/diloco_study.py run [--cells fp32_h10,q4_h50 | all]
    python scripts/diloco_study.py status
    python scripts/diloco_study.py table     # the results table in docs/accuracy.md

Each cell is its own process; its result JSON line is appended to
``notebooks/data/lm/diloco.jsonl``. ``run`` skips cells already there, so the study can be run in
pieces (repeat the same command). A cell is not resumed mid-run: an interrupted cell starts over.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "notebooks", "data", "lm", "diloco.jsonl")

# name -> (config overrides, training.lm_diloco flags). K = 2 replicas of 4 devices, 2000 inner
# steps, training/lm.py's global batch (the tokens of the exact data-parallel run), outer Nesterov
# SGD with momentum 0.9 unless a cell says otherwise. ``"outer_lr": TUNED`` is the lr of the fp32
# sweep cell with the lowest loss at the same H (seed 0), read from the results when the cell runs.
TUNED = "tuned"
SWEEP_LRS = (0.4, 0.6, 0.8, 1.0)
HS = (10, 50, 100)
CELLS: dict[str, tuple[dict, dict]] = {
    # DiLoCo's published outer optimizer (Nesterov lr 0.7, momentum 0.9), not tuned.
    "fp32_h10": ({"bits": 32}, {"every": 10, "outer_lr": 0.7}),
    "fp32_h50": ({"bits": 32}, {"every": 50, "outer_lr": 0.7}),
    "q4_h10": ({"bits": 4}, {"every": 10, "outer_lr": 0.7}),
    "q4_h50": ({"bits": 4}, {"every": 50, "outer_lr": 0.7}),
    # Plain averaging (outer SGD lr 1.0, no momentum: the anchor is the replicas' mean).
    "fp32_h10_avg": ({"bits": 32}, {"every": 10, "outer_lr": 1.0, "outer_momentum": 0.0}),
    "fp32_h50_avg": ({"bits": 32}, {"every": 50, "outer_lr": 1.0, "outer_momentum": 0.0}),
    "fp32_h100_avg": ({"bits": 32}, {"every": 100, "outer_lr": 1.0, "outer_momentum": 0.0}),
    # The outer lr sweep at fp32, once per H.
    **{f"fp32_h{h}_lr{lr}": ({"bits": 32}, {"every": h, "outer_lr": lr})
       for h in HS for lr in SWEEP_LRS},
    # The codecs at the tuned lr of their H.
    **{f"{name}_h{h}_tuned": (cfg, {"every": h, "outer_lr": TUNED})
       for h in HS for name, cfg in (("q8", {"bits": 8}), ("q4", {"bits": 4}),
                                     ("q2_ef", {"bits": 2, "error_feedback": True}))},
    # K = 4 replicas of 2 devices (each a quarter of the batch).
    "fp32_h50_k4_tuned": ({"bits": 32}, {"every": 50, "outer_lr": TUNED, "replicas": 4}),
    "q4_h50_k4_tuned": ({"bits": 4}, {"every": 50, "outer_lr": TUNED, "replicas": 4}),
    # A second seed (parameters, data order, rounding).
    **{f"{name}_h{h}_tuned_seed1": ({**cfg, "seed": 1}, {"every": h, "outer_lr": TUNED})
       for h in (50, 100) for name, cfg in (("fp32", {"bits": 32}), ("q4", {"bits": 4}))},
}


def tuned_lr(every: int, finished: dict[str, dict]) -> float:
  """The sweep's best outer lr at H = ``every`` (all four sweep cells must be done)."""
  sweep = {lr: finished.get(f"fp32_h{every}_lr{lr}") for lr in SWEEP_LRS}
  missing = [f"fp32_h{every}_lr{lr}" for lr, row in sweep.items() if row is None]
  if missing:
    raise SystemExit(f"the tuned cells at H={every} need the sweep first: run {','.join(missing)}")
  return min(sweep, key=lambda lr: sweep[lr]["val_loss"])


def command(name: str, finished: dict[str, dict]) -> list[str]:
  overrides, flags = CELLS[name]
  flags = {"replicas": 2, "outer_momentum": 0.9, **flags}
  if flags["outer_lr"] == TUNED:
    flags["outer_lr"] = tuned_lr(flags["every"], finished)
  cmd = [sys.executable, "-m", "training.lm_diloco", "--config=configs/lm_bytes.py"]
  cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
  cmd += [f"--{k}={v}" for k, v in flags.items()]
  return cmd


def done() -> dict[str, dict]:
  out = {}
  if os.path.exists(RESULTS):
    with open(RESULTS) as f:
      for line in f:
        row = json.loads(line)
        out[row["cell"]] = row
  return out


DDP_FP32 = 1.537  # the exact data-parallel run of docs/accuracy.md (fp32, seed 0)
BEGIN, END = "<!-- diloco-table -->", "<!-- /diloco-table -->"


def write_table(finished: dict[str, dict]) -> None:
  """The results table between the markers of docs/accuracy.md, from the JSON lines alone."""
  rows = ["| cell | outer codec | H | outer lr / momentum | val loss (nats/byte) | vs exact DDP "
          "| outer steps | train s |", "|---|---|--:|---|--:|--:|--:|--:|"]
  for name in CELLS:
    r = finished.get(name)
    if r is None:
      continue
    codec = {32: "fp32", 16: "bf16"}.get(r["bits"], f"QSGD {r['bits']} bits") + (
        " + EF" if r["error_feedback"] else "")
    rows.append(f"| `{name}` | {codec} | {r['every']} | {r['outer_lr']} / {r['outer_momentum']} "
                f"| {r['val_loss']:.3f} | {100 * (r['val_loss'] / DDP_FP32 - 1):+.1f}% "
                f"| {r['outer_steps']} | {r['train_s']:.0f} |")
  path = os.path.join(REPO, "docs", "accuracy.md")
  with open(path) as f:
    text = f.read()
  head, rest = text.split(BEGIN)
  _, tail = rest.split(END)
  with open(path, "w") as f:
    f.write(head + BEGIN + "\n" + "\n".join(rows) + "\n" + END + tail)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("action", choices=("run", "status", "table"))
  parser.add_argument("--cells", default="fp32_h10,fp32_h50,q4_h10,q4_h50")
  args = parser.parse_args()
  names = list(CELLS) if args.cells == "all" else args.cells.split(",")
  unknown = [n for n in names if n not in CELLS]
  if unknown:
    parser.error(f"--cells: unknown cell(s) {unknown}; known: {', '.join(CELLS)}")
  finished = done()
  if args.action == "table":
    write_table(finished)
    return
  if args.action == "status":
    for name in CELLS:
      row = finished.get(name)
      print(f"{name:26s} " + (f"val_loss {row['val_loss']:.4f}  bytes/param/step "
                              f"{row['bytes_per_param_step']:.5f}  train {row['train_s']:.0f} s"
                              if row else "not run"))
    return
  os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
  for name in names:
    if name in finished:
      continue
    cmd = command(name, finished)
    print(" ".join(cmd[1:]), flush=True)
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row["cell"], row["command"] = name, "python " + " ".join(cmd[1:])
    with open(RESULTS, "a") as f:
      f.write(json.dumps(row) + "\n")
    print(f"{name}: val_loss {row['val_loss']:.4f} ({row['train_s']:.0f} s)", flush=True)
    finished = done()


if __name__ == "__main__":
  main()
