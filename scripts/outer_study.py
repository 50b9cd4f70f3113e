"""The outer-optimizer study of ``qcomm.diloco``: K replicas x H inner steps x outer optimizer.

    python scripts/outer_study.py run --task mlp [--cells k2_h10_avg,... | all]
    python scripts/outer_study.py run --task lm --cells k2_h50_avg,k8_h50_n0.7m0.9
    python scripts/outer_study.py table [--task mlp|lm]

Tasks:
  * ``mlp``: a 64-256-10 MLP on scikit-learn's 8x8 digits (1437 training / 360 held-out images),
    AdamW inner optimizer, 600 inner steps, a global batch of 128 images per step split over the
    K replicas (the same images whatever K), on 8 host CPU devices. Metric: held-out
    cross-entropy of the anchor at the end. Runs in this process, a few seconds a cell.
  * ``mlp-topk``: the same MLP with ``qcomm.TopK(0.02, bits=2)`` and error feedback as the outer
    codec (fp32 elsewhere): how a sparse codec's residual interacts with the outer momentum.
  * ``lm``: the byte-level LM of docs/accuracy.md (``python -m training.lm_diloco``, fp32 outer
    codec, 2000 inner steps), one process per cell.

Outer optimizers, named by learning rate and Nesterov momentum; the momentum-adjusted rate
``lr / (1 - momentum)`` is what the DiLoCo scaling studies find matters. Each finished cell is one
JSON line in ``notebooks/data/outer_study/<task>.jsonl``; ``run`` skips cells already there, so
the study runs in pieces (repeat the command).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO, "notebooks", "data", "outer_study")

KS = (2, 4, 8)
HS = (10, 50, 100)
#: name -> (lr, Nesterov momentum); 0 momentum is plain SGD (lr 1.0: the replicas' mean).
OUTERS = {
    "avg": (1.0, 0.0),
    "s1.5": (1.5, 0.0),
    "s2.0": (2.0, 0.0),
    "n0.5m0.5": (0.5, 0.5),
    "n1.0m0.5": (1.0, 0.5),
    "n0.3m0.9": (0.3, 0.9),
    "n0.7m0.9": (0.7, 0.9),
    "slc0.95": (1.0, 0.0),
}
#: Outers that decay the error-feedback residual (``qcomm.diloco(residual_decay=)``): SparseLoCo's
#: rule, plain SGD with the decayed residual in place of the momentum (the TopK task only).
DECAYS = {"slc0.95": 0.95}
CELLS = {f"k{k}_h{h}_{o}": (k, h, o) for k in KS for h in HS for o in OUTERS}


def adjusted(outer: str) -> float:
  lr, m = OUTERS[outer]
  return lr / (1 - m)


# ---- the MLP task ---------------------------------------------------------------------------------

def run_mlp(k: int, h: int, outer: str, seed: int = 0, steps: int = 600,
            topk: bool = False) -> dict:
  import numpy as np
  import jax
  if jax.config.jax_num_cpu_devices != 8:  # before the backend starts (the first cell)
    jax.config.update("jax_num_cpu_devices", 8)
  import jax.numpy as jnp
  import optax
  from jax.sharding import Mesh
  from sklearn.datasets import load_digits

  import jax_qcomm as qcomm

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  x, y = x[order], y[order]
  xtr, ytr, xte, yte = x[:1437], y[:1437], x[1437:], y[1437:]

  def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (64, 256)) * (1 / 8), "b1": jnp.zeros((256,)),
            "w2": jax.random.normal(k2, (256, 10)) * (1 / 16), "b2": jnp.zeros((10,))}

  def loss_fn(p, batch):
    xb, yb = batch
    logits = jnp.tanh(xb @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

  lr, m = OUTERS[outer]
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(k, 8 // k), ("node", "gpu"))
  inner = qcomm.sync(optax.adamw(3e-3, weight_decay=1e-4), axis_name="gpu",
                     codec=qcomm.NoCompression())
  codec = qcomm.TopK(0.02, bits=2) if topk else qcomm.NoCompression()
  decay = DECAYS.get(outer)
  if decay is not None and not topk:
    raise SystemExit(f"outer {outer} decays the error-feedback residual: --task mlp-topk only")
  tx = qcomm.diloco(inner, axis_name="node", every=h, codec=codec, error_feedback=topk,
                    outer=optax.sgd(lr, momentum=m or None, nesterov=bool(m)),
                    residual_decay=decay)
  dp = qcomm.data_parallel(loss_fn, tx, mesh, axis_name=("node", "gpu"))
  params = init(jax.random.key(seed))
  state = dp.init(params)
  rng = np.random.default_rng(seed)
  t0 = time.perf_counter()
  for _ in range(steps):
    idx = rng.integers(0, len(xtr), 128)
    params, state, _, _ = dp.step(params, state, (xtr[idx], ytr[idx]))
  val = float(loss_fn(params, (xte, yte)))
  return {"task": "mlp-topk" if topk else "mlp", "replicas": k, "every": h, "outer": outer, "outer_lr": lr,
          "outer_momentum": m, "adjusted_lr": adjusted(outer), "seed": seed, "steps": steps,
          "val_loss": val, "train_s": time.perf_counter() - t0}


# ---- the LM task ----------------------------------------------------------------------------------

def run_lm(k: int, h: int, outer: str) -> dict:
  lr, m = OUTERS[outer]
  cmd = [sys.executable, "-m", "training.lm_diloco", "--config=configs/lm_bytes.py",
         "--config.bits=32", f"--every={h}", f"--replicas={k}", f"--outer_lr={lr}",
         f"--outer_momentum={m}"]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
  row = json.loads(out.strip().splitlines()[-1])
  row.update(task="lm", outer=outer, adjusted_lr=adjusted(outer),
             command="python " + " ".join(cmd[1:]))
  return row


# ---- results ----------------------------------------------------------------------------------------

def results_path(task: str) -> str:
  return os.path.join(OUT_DIR, f"{task}.jsonl")


def done(task: str) -> dict[str, dict]:
  out = {}
  if os.path.exists(results_path(task)):
    with open(results_path(task)) as f:
      for line in f:
        row = json.loads(line)
        out[row["cell"]] = row
  return out


def table(task: str) -> str:
  """Per (K, H): every outer optimizer's loss as its gap to that cell's best, and the worst gap
  of each optimizer over the cells run."""
  rows = done(task)
  outers = [o for o in OUTERS if any(r.get("outer") == o for r in rows.values())]
  lines = ["| K | H | " + " | ".join(f"{o} ({adjusted(o):g})" for o in outers) + " |",
           "|--:|--:|" + "--:|" * len(outers)]
  worst = {o: None for o in outers}
  for k in KS:
    for h in HS:
      vals = {o: rows.get(f"k{k}_h{h}_{o}", {}).get("val_loss") for o in outers}
      if all(v is None for v in vals.values()):
        continue
      best = min(v for v in vals.values() if v is not None)
      cells = []
      for o in outers:
        v = vals[o]
        if v is None:
          cells.append("—")
          continue
        gap = 100 * (v / best - 1)
        if all(x is not None for x in vals.values()):
          worst[o] = gap if worst[o] is None else max(worst[o], gap)
        cells.append(f"**{v:.4f}**" if v == best else f"{v:.4f} (+{gap:.1f}%)")
      lines.append(f"| {k} | {h} | " + " | ".join(cells) + " |")
  lines.append("| worst gap | | " + " | ".join(
      "—" if worst[o] is None else f"+{worst[o]:.1f}%" for o in outers) + " |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("what", choices=("run", "table"))
  parser.add_argument("--task", choices=("mlp", "mlp-topk", "lm"), default="mlp")
  parser.add_argument("--cells", default="all")
  args = parser.parse_args()
  if args.what == "table":
    print(table(args.task))
    return
  names = list(CELLS) if args.cells == "all" else args.cells.split(",")
  unknown = [n for n in names if n not in CELLS]
  if unknown:
    parser.error(f"--cells: unknown cell(s) {unknown}; known: k<K>_h<H>_<outer>, K in {KS}, "
                 f"H in {HS}, outer in {list(OUTERS)}")
  os.makedirs(OUT_DIR, exist_ok=True)
  finished = done(args.task)
  for name in names:
    if name in finished:
      continue
    k, h, outer = CELLS[name]
    row = (run_lm(k, h, outer) if args.task == "lm" else
           run_mlp(k, h, outer, topk=args.task == "mlp-topk"))
    row["cell"] = name
    with open(results_path(args.task), "a") as f:
      f.write(json.dumps(row) + "\n")
    print(f"{name}: val_loss {row['val_loss']:.4f} ({row['train_s']:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
