"""The DiLoCo cells of docs/accuracy.md: ``python -m training.lm_diloco`` once per cell.

    python scripts/diloco_study.py run [--cells fp32_h10,q4_h50 | all]
    python scripts/diloco_study.py status
    python scripts/diloco_study.py table     # the results tables in docs/accuracy.md

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
# SGD with momentum 0.9 unless a cell says otherwise. ``"outer_lr": TUNED`` is the outer optimizer
# (lr and momentum) of the fp32 cell with the lowest loss at the same H (seed 0) among the lr sweep
# and plain averaging, read from the results when the cell runs.
TUNED = "tuned"
AVERAGING = {"outer_lr": 1.0, "outer_momentum": 0.0}
SPARSELOCO = {"bits": 2, "topk": 1 / 64, "error_feedback": True}
SPARSELOCO_OUTER = {"outer": "sparseloco", "outer_lr": 1.0, "outer_momentum": 0.95}
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
    # K = 8 replicas of 1 device (each an eighth of the batch), and TopK at K = 4 and 8.
    "fp32_h50_k8_tuned": ({"bits": 32}, {"every": 50, "outer_lr": TUNED, "replicas": 8}),
    "q4_h50_k8_tuned": ({"bits": 4}, {"every": 50, "outer_lr": TUNED, "replicas": 8}),
    **{f"topk2_ef_h50_k{k}_default": ({"bits": 2, "topk": 0.02, "error_feedback": True},
                                      {"every": 50, "outer_lr": 1.0, "outer_momentum": 0.5,
                                       "replicas": k}) for k in (4, 8)},
    # 4 bits with buckets of 1024 values at H = 100 (the bytes target).
    "q4_b1024_h100_tuned": ({"bits": 4, "bucket_size": 1024}, {"every": 100, "outer_lr": TUNED}),
    # 1.5x the inner steps (3000; the schedule stretched), for the time-to-loss runs.
    "fp32_h50_avg_3000": ({"bits": 32, "num_steps": 3000},
                          {"every": 50, "outer_lr": 1.0, "outer_momentum": 0.0}),
    # TopK(0.02, 2 bits) with error feedback (SparseLoCo's recipe) at the tuned outer optimizer.
    **{f"topk2_ef_h{h}_tuned": ({"bits": 2, "topk": 0.02, "error_feedback": True},
                               {"every": h, "outer_lr": TUNED}) for h in (50, 100)},
    # The same with every leaf through TopK (the sparse codec's default policy) and the default
    # outer optimizer for a sparse codec with error feedback (Nesterov lr 1.0, momentum 0.5).
    **{f"topk2_ef_h{h}_default": ({"bits": 2, "topk": 0.02, "error_feedback": True},
                                  {"every": h, "outer_lr": 1.0, "outer_momentum": 0.5})
       for h in (50, 100)},
    # Streaming fragments: a fifth of the model every 10 inner steps, each leaf every 50.
    "q4_h50_frag5_avg": ({"bits": 4, "fragments": 5},
                         {"every": 50, "outer_lr": 1.0, "outer_momentum": 0.0}),
    # A second seed at K = 4 and 8 (fp32 and 4 bits at the tuned outer optimizer, TopK with its
    # defaults).
    **{f"{name}_h50_k{k}_seed1": ({**cfg, "seed": 1}, {"every": 50, "replicas": k, **outer})
       for k in (4, 8) for name, cfg, outer in (
           ("fp32", {"bits": 32}, {"outer_lr": TUNED}), ("q4", {"bits": 4}, {"outer_lr": TUNED}),
           ("topk2_ef", {"bits": 2, "topk": 0.02, "error_feedback": True},
            {"outer_lr": 1.0, "outer_momentum": 0.5}))},
    # A second seed (parameters, data order, rounding).
    **{f"{name}_h{h}_tuned_seed1": ({**cfg, "seed": 1}, {"every": h, "outer_lr": TUNED})
       for h in (50, 100) for name, cfg in (("fp32", {"bits": 32}), ("q4", {"bits": 4}))},
    # SparseLoCo (outer="sparseloco": TopK 1/64 of each 4096 values, 2-bit values, error feedback
    # decayed by 0.95 in place of the outer momentum, plain SGD lr 1.0 on the mean sent) against
    # fp32 diloco with plain averaging, at K = 2, 4, 8 and H = 10, 30, 50.
    **{f"slc_h{h}_k{k}": (SPARSELOCO, {"every": h, "replicas": k, **SPARSELOCO_OUTER})
       for k in (2, 4, 8) for h in (10, 30, 50)},
    "slc_h30_k2_seed1": ({**SPARSELOCO, "seed": 1}, {"every": 30, **SPARSELOCO_OUTER}),
    **{f"fp32_h{h}_k{k}_avg": ({"bits": 32}, {"every": h, "replicas": k, **AVERAGING})
       for k, h in ((2, 30), (4, 10), (4, 30), (8, 10), (8, 30))},
    "fp32_h30_avg_seed1": ({"bits": 32, "seed": 1}, {"every": 30, **AVERAGING}),
    # Which part of SparseLoCo matters (K = 2, H = 30): the decay (1.0, 0.8, 0.5, 0), density
    # 1/32, 1/16 and 1/4, 8-bit values, small and 1-D leaves exact, outer lr 0.8, and TopK(0.02)
    # with the earlier default outer (Nesterov 1.0, 0.5).
    "slc_h30_k2_nodecay": (SPARSELOCO, {"every": 30, **SPARSELOCO_OUTER, "outer_momentum": 1.0}),
    **{f"slc_h30_k2_b{b}": (SPARSELOCO, {"every": 30, **SPARSELOCO_OUTER, "outer_momentum": b})
       for b in (0.8, 0.5, 0.0)},
    **{f"slc_h30_k2_d{d}": ({**SPARSELOCO, "topk": 1 / d}, {"every": 30, **SPARSELOCO_OUTER})
       for d in (32, 16, 4)},
    "slc_h30_k2_8bit": ({**SPARSELOCO, "bits": 8}, {"every": 30, **SPARSELOCO_OUTER}),
    "slc_h30_k2_exact_small": ({**SPARSELOCO, "min_size": 1024, "compress_1d": False},
                               {"every": 30, **SPARSELOCO_OUTER}),
    "slc_h30_k2_lr0.8": (SPARSELOCO, {"every": 30, **SPARSELOCO_OUTER, "outer_lr": 0.8}),
    "topk2_ef_h30_default": ({"bits": 2, "topk": 0.02, "error_feedback": True},
                             {"every": 30, "outer_lr": 1.0, "outer_momentum": 0.5}),
}


def tuned(every: int, finished: dict[str, dict]) -> dict[str, float]:
  """The outer optimizer with the lowest fp32 loss at H = ``every`` (seed 0) among the sweep's
  Nesterov lrs and plain averaging: ``{"outer_lr": ..., "outer_momentum": ...}``."""
  names = [f"fp32_h{every}_lr{lr}" for lr in SWEEP_LRS] + [f"fp32_h{every}_avg"]
  missing = [n for n in names if n not in finished]
  if missing:
    raise SystemExit(f"the tuned cells at H={every} need the sweep first: run {','.join(missing)}")
  best = min(names, key=lambda n: finished[n]["val_loss"])
  return {"outer_lr": finished[best]["outer_lr"], "outer_momentum": finished[best]["outer_momentum"]}


def command(name: str, finished: dict[str, dict]) -> list[str]:
  overrides, flags = CELLS[name]
  flags = {"replicas": 2, **({} if flags.get("outer") == "sparseloco" else {"outer_momentum": 0.9}),
           **flags}
  if flags["outer_lr"] == TUNED:
    flags.update(tuned(flags["every"], finished))
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


DDP_FP32 = {0: 1.5368, 1: 1.5173}  # the exact data-parallel runs of docs/accuracy.md, per seed
BEGIN, END = "<!-- diloco-table -->", "<!-- /diloco-table -->"


def _codec(r: dict) -> str:
  if r.get("outer") == "sparseloco":
    return f"SparseLoCo, TopK {r['topk']:g} x {r['bits']} bits"
  if r.get("topk"):
    return f"TopK {r['topk']:g} x {r['bits']} bits" + (" + EF" if r["error_feedback"] else "")
  name = {32: "fp32", 16: "16-bit"}.get(r["bits"], f"QSGD {r['bits']} bits")
  bucket = r.get("bucket_size", 128)
  fragments = r.get("fragments") or 1
  return name + (f" /{bucket}" if r["bits"] <= 8 and bucket != 128 else "") + (
      " + EF" if r["error_feedback"] else "") + (f", {fragments} fragments" if fragments > 1 else "")


def write_table(finished: dict[str, dict]) -> None:
  """The sweep grid and the table of every cell, between the markers of docs/accuracy.md, from
  the JSON lines alone."""
  grid = ["| H | " + " | ".join(f"Nesterov lr {lr}" for lr in SWEEP_LRS) + " | averaging |",
          "|--:|" + "--:|" * (len(SWEEP_LRS) + 1)]
  for h in HS:
    names = [f"fp32_h{h}_lr{lr}" for lr in SWEEP_LRS] + [f"fp32_h{h}_avg"]
    vals = [finished[n]["val_loss"] if n in finished else None for n in names]
    best = min((v for v in vals if v is not None), default=None)
    grid.append(f"| {h} | " + " | ".join(
        "—" if v is None else (f"**{v:.4f}**" if v == best else f"{v:.4f}") for v in vals) + " |")
  rows = ["| cell | seed | outer codec | H | K | outer lr / momentum | val loss (nats/byte) "
          "| vs exact DDP (same seed) | vs fp32, same H and outer | B / param / step | train s |",
          "|---|--:|---|--:|--:|---|--:|--:|--:|--:|--:|"]
  for name in CELLS:
    r = finished.get(name)
    if r is None or name.startswith("fp32_h") and "_lr" in name:
      continue
    ref = next((o for o in finished.values() if o["bits"] == 32 and o["every"] == r["every"]
                and o["outer_lr"] == r["outer_lr"] and o["outer_momentum"] == r["outer_momentum"]
                and o["seed"] == r["seed"] and o["replicas"] == r["replicas"]
                and o["steps"] == r["steps"]), None)
    vs_fp32 = ("" if ref is None or ref is r else
               f"{100 * (r['val_loss'] / ref['val_loss'] - 1):+.2f}%")
    rows.append(
        f"| `{name}` | {r['seed']} | {_codec(r)} | {r['every']} | {r['replicas']} "
        f"| {r['outer_lr']} / {r['outer_momentum']} | {r['val_loss']:.4f} "
        f"| {100 * (r['val_loss'] / DDP_FP32[r['seed']] - 1):+.2f}% | {vs_fp32} "
        f"| {r['bytes_per_param_step']:.5f} | {r['train_s']:.0f} |")
  path = os.path.join(REPO, "docs", "accuracy.md")
  with open(path) as f:
    text = f.read()
  head, rest = text.split(BEGIN)
  _, tail = rest.split(END)
  body = ("The outer-lr sweep at fp32 (val loss; K = 2, seed 0; bold: the tuned outer optimizer "
          "of that H, which the `_tuned` cells reuse):\n\n" + "\n".join(grid)
          + "\n\nEvery other cell:\n\n" + "\n".join(rows))
  with open(path, "w") as f:
    f.write(head + BEGIN + "\n" + body + "\n" + END + tail)


SLC_BEGIN, SLC_END = "<!-- sparseloco-table -->", "<!-- /sparseloco-table -->"
#: The ablation cells (K = 2, H = 30) and what each changes from SparseLoCo's defaults.
ABLATIONS = {
    "slc_h30_k2_nodecay": "no decay (beta 1.0)",
    "slc_h30_k2_b0.8": "beta 0.8",
    "slc_h30_k2_b0.5": "beta 0.5",
    "slc_h30_k2_b0.0": "beta 0 (what is not sent is dropped)",
    "slc_h30_k2_lr0.8": "outer lr 0.8",
    "slc_h30_k2_8bit": "8-bit values",
    "slc_h30_k2_exact_small": "small and 1-D leaves exact",
    "slc_h30_k2_d32": "density 1/32",
    "slc_h30_k2_d16": "density 1/16",
    "slc_h30_k2_d4": "density 1/4",
    "topk2_ef_h30_default": "TopK 0.02, Nesterov (1.0, 0.5) outer, residual not decayed",
}


def _gap(r: dict, ref: dict | None) -> str:
  """``r``'s val loss against ``ref``'s, in percent ('' without ``ref``)."""
  return "" if ref is None else f"{100 * (r['val_loss'] / ref['val_loss'] - 1):+.1f}%"


def _fp32_avg(finished: dict[str, dict], every: int, k: int, seed: int) -> dict | None:
  """The fp32 plain-averaging cell at (H, K, seed) over 2000 steps, whatever its name."""
  return next((r for r in finished.values() if r["bits"] == 32 and r["every"] == every
               and r["replicas"] == k and r["seed"] == seed and r["steps"] == 2000
               and r["outer_lr"] == 1.0 and r["outer_momentum"] == 0.0
               and r.get("outer", "nesterov") == "nesterov" and not r.get("fragments", 1) > 1
               and not r.get("delay")), None)


def _q4_bytes(finished: dict[str, dict], k: int) -> float | None:
  """QSGD 4's bytes per synchronisation at K replicas (every leaf counted; H does not matter)."""
  r = next((r for r in finished.values() if r["bits"] == 4 and not r.get("topk")
            and r["replicas"] == k and r.get("bucket_size", 128) == 128
            and not r["error_feedback"]), None)
  return None if r is None else r["sent_bytes_per_sync"]


def write_sparseloco_table(finished: dict[str, dict]) -> None:
  """The SparseLoCo grid (K x H against fp32 averaging), its bytes and the ablation, between the
  markers of docs/accuracy.md."""
  hs, ks = (10, 30, 50), (2, 4, 8)
  grid = ["| K | " + " | ".join(f"H = {h}: fp32 avg / SparseLoCo (gap)" for h in hs)
          + " | SparseLoCo B / sync | QSGD 4 B / sync | fewer bytes |",
          "|--:|" + "--:|" * (len(hs) + 3)]
  for k in ks:
    cells = []
    for h in hs:
      slc, ref = finished.get(f"slc_h{h}_k{k}"), _fp32_avg(finished, h, k, 0)
      if slc is None or ref is None:
        cells.append("—")
        continue
      cells.append(f"{ref['val_loss']:.4f} / {slc['val_loss']:.4f} ({_gap(slc, ref)})")
    slc = next((finished[f"slc_h{h}_k{k}"] for h in hs if f"slc_h{h}_k{k}" in finished), None)
    q4 = _q4_bytes(finished, k)
    sent = "—" if slc is None else f"{slc['sent_bytes_per_sync']:,.0f}"
    ratio = "—" if slc is None or q4 is None else f"{q4 / slc['sent_bytes_per_sync']:.1f}x"
    grid.append(f"| {k} | " + " | ".join(cells) + f" | {sent} | "
                + ("—" if q4 is None else f"{q4:,.0f}") + f" | {ratio} |")
  base = finished.get("slc_h30_k2")
  rows = ["| cell | what changes | val loss | vs SparseLoCo | vs fp32 averaging | B / sync "
          "| B / param / step |", "|---|---|--:|--:|--:|--:|--:|"]
  ref = _fp32_avg(finished, 30, 2, 0)
  for name, what in (("slc_h30_k2", "SparseLoCo's defaults"), *ABLATIONS.items()):
    r = finished.get(name)
    if r is None:
      continue
    rows.append(
        f"| `{name}` | {what} | {r['val_loss']:.4f} "
        f"| {'' if r is base else _gap(r, base)} | {_gap(r, ref)} "
        f"| {r['sent_bytes_per_sync']:,.0f} | {r['bytes_per_param_step']:.5f} |")
  seeds = []
  for seed, name in ((0, "slc_h30_k2"), (1, "slc_h30_k2_seed1")):
    r, ref = finished.get(name), _fp32_avg(finished, 30, 2, seed)
    if r is not None and ref is not None:
      seeds.append(f"seed {seed}: {ref['val_loss']:.4f} / {r['val_loss']:.4f} ({_gap(r, ref)})")
  body = ("Val loss (nats/byte) after 2000 inner steps, fp32 diloco with plain averaging against "
          "SparseLoCo (`--outer=sparseloco`, TopK 1/64 x 2 bits, beta 0.95, alpha 1.0), seed 0; "
          "bytes per synchronisation each replica sends, every leaf counted:\n\n"
          + "\n".join(grid) + "\n\nK = 2, H = 30, fp32 averaging / SparseLoCo: "
          + "; ".join(seeds) + ".\n\nWhat each part does (K = 2, H = 30, seed 0):\n\n"
          + "\n".join(rows))
  path = os.path.join(REPO, "docs", "accuracy.md")
  with open(path) as f:
    text = f.read()
  if SLC_BEGIN not in text:
    raise SystemExit(f"docs/accuracy.md has no {SLC_BEGIN} marker")
  head, rest = text.split(SLC_BEGIN)
  _, tail = rest.split(SLC_END)
  with open(path, "w") as f:
    f.write(head + SLC_BEGIN + "\n" + body + "\n" + SLC_END + tail)


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
    write_sparseloco_table(finished)
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
