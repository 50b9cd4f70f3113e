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
# SGD lr 0.7 / momentum 0.9 (DiLoCo's; not tuned) unless a cell says otherwise.
CELLS = {
    "fp32_h10": ({"bits": 32}, {"every": 10}),
    "fp32_h50": ({"bits": 32}, {"every": 50}),
    "q4_h10": ({"bits": 4}, {"every": 10}),
    "q4_h50": ({"bits": 4}, {"every": 50}),
    "q4_h100": ({"bits": 4}, {"every": 100}),
    "fp32_h100": ({"bits": 32}, {"every": 100}),
    "q8_h50": ({"bits": 8}, {"every": 50}),
    "q2_ef_h50": ({"bits": 2, "error_feedback": True}, {"every": 50}),
    # Plain averaging (outer SGD lr 1.0, no momentum: the anchor is the replicas' mean).
    "fp32_h10_avg": ({"bits": 32}, {"every": 10, "outer_lr": 1.0, "outer_momentum": 0.0}),
    "fp32_h50_avg": ({"bits": 32}, {"every": 50, "outer_lr": 1.0, "outer_momentum": 0.0}),
    "q4_h50_avg": ({"bits": 4}, {"every": 50, "outer_lr": 1.0, "outer_momentum": 0.0}),
}


def command(name: str) -> list[str]:
  overrides, flags = CELLS[name]
  cmd = [sys.executable, "-m", "training.lm_diloco", "--config=configs/lm_bytes.py"]
  cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
  cmd += [f"--{k}={v}" for k, v in {"replicas": 2, "outer_lr": 0.7, "outer_momentum": 0.9,
                                    **flags}.items()]
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
  finished = done()
  if args.action == "table":
    write_table(finished)
    return
  if args.action == "status":
    for name in CELLS:
      row = finished.get(name)
      print(f"{name:12s} " + (f"val_loss {row['val_loss']:.4f}  bytes/param/step "
                              f"{row['bytes_per_param_step']:.5f}  train {row['train_s']:.0f} s"
                              if row else "not run"))
    return
  os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
  for name in names:
    if name in finished:
      continue
    cmd = command(name)
    print(" ".join(cmd[1:]), flush=True)
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row["cell"], row["command"] = name, "python " + " ".join(cmd[1:])
    with open(RESULTS, "a") as f:
      f.write(json.dumps(row) + "\n")
    print(f"{name}: val_loss {row['val_loss']:.4f} ({row['train_s']:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
