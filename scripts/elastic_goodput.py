"""Goodput of elastic DiLoCo on the simulated cluster: useful inner steps per second with a node
process killed every few minutes, against the same run with no failure.

    python scripts/elastic_goodput.py run --kind clean     # one run each; resumable by kind
    python scripts/elastic_goodput.py run --kind kill --every-s 120
    python scripts/elastic_goodput.py table

Each run is ``python -m jax_qcomm.tools.cluster --elastic`` (3 nodes sharing the machine's cores,
10 Mbit/s links) of ``training.lm_slow_link --method=diloco`` with 4-bit synchronisations every
20 steps. The kill run sends SIGKILL to node 1, then 2, then 0, ... every ``--every-s`` seconds
after the first evaluation; the launcher restarts each. Useful inner steps: for every
synchronisation, the replicas averaged times the calls between synchronisations (the work that
reached the anchor); per second of the run's wall time (start-up included in both runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time

OUT = os.path.join(os.path.dirname(__file__), "..", "notebooks", "data", "elastic_goodput")
NODES, RATE, EVERY, STEPS = 3, "10mbit", 20, 4000


def _command(out_json: str) -> list[str]:
  return [sys.executable, "-m", "jax_qcomm.tools.cluster", "--nodes", str(NODES), "--rate", RATE,
          "--local-devices", "1", "--elastic", "--max-restarts", "10", "--timeout", "1800",
          "--out", out_json, "--", "-m", "training.lm_slow_link", "--config=configs/lm_bytes.py",
          "--method=diloco", "--config.bits=4", f"--config.num_devices={NODES}",
          "--config.batch_size=24", "--config.num_val_windows=192",
          f"--config.num_steps={STEPS}", f"--every={EVERY}", "--eval_every=500"]


def _node_pid(rank: int) -> int | None:
  """The live node process of ``rank`` (its environment holds QCOMM_PROCESS_ID)."""
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().split(b"\0")
      if b"training.lm_slow_link" not in cmd or cmd[0].endswith(b"ip"):
        continue
      with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
      continue
    if env.get(b"QCOMM_PROCESS_ID") == str(rank).encode() and b"-c" not in cmd[:3]:
      return int(pid)
  return None


def run(kind: str, every_s: float) -> None:
  os.makedirs(OUT, exist_ok=True)
  path = os.path.join(OUT, f"{kind}.json")
  if os.path.exists(path):
    print(f"{path} exists; skipping")
    return
  result_json = os.path.join(OUT, f"{kind}.result.json")
  log_path = os.path.join(OUT, f"{kind}.log")
  kills: list[dict] = []
  load_before = os.getloadavg()
  t0 = time.monotonic()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(_command(result_json), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    evaluated = threading.Event()

    def pump():
      for line in proc.stdout:
        log.write(line)
        log.flush()
        if "[eval] step" in line:
          evaluated.set()

    threading.Thread(target=pump, daemon=True).start()
    if kind == "kill":
      evaluated.wait()
      rank = 1
      while proc.poll() is None:
        deadline = time.monotonic() + every_s
        while proc.poll() is None and time.monotonic() < deadline:
          time.sleep(0.5)
        pid = _node_pid(rank) if proc.poll() is None else None
        if pid is not None:
          os.kill(pid, signal.SIGKILL)
          kills.append({"rank": rank, "pid": pid, "t_s": time.monotonic() - t0})
          rank = (rank + 1) % NODES
    proc.wait()
  wall = time.monotonic() - t0
  with open(result_json) as f:
    result = json.load(f)
  record = {
      "kind": kind, "wall_s": wall, "exit": proc.returncode, "kills": kills,
      "every_s": every_s if kind == "kill" else None,
      "replicas_per_sync": result["replicas_per_sync"], "val_loss": result["val_loss"],
      "calls_per_sync": EVERY * result["accum_steps"], "train_s": result["train_s"],
      "command": " ".join(_command("OUT.json")), "load_before": load_before,
      "load_after": os.getloadavg(), "cpu": platform.processor() or _cpu(),
      "python": platform.python_version(), "date": datetime.date.today().isoformat(),
  }
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  print(json.dumps({k: record[k] for k in ("kind", "wall_s", "exit", "val_loss")}))


def _cpu() -> str:
  with open("/proc/cpuinfo") as f:
    for line in f:
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  return "unknown"


def table() -> None:
  rows = {}
  for kind in ("clean", "kill"):
    path = os.path.join(OUT, f"{kind}.json")
    if os.path.exists(path):
      with open(path) as f:
        rows[kind] = json.load(f)
  base = None
  print("| run | kills | exit | syncs with fewer replicas | useful inner steps / s | goodput | "
        "final val loss | wall s |")
  print("|---|--:|--:|--:|--:|--:|--:|--:|")
  for kind, r in rows.items():
    useful = sum(r["replicas_per_sync"]) * r["calls_per_sync"] / r["wall_s"]
    base = useful if kind == "clean" else base
    short = sum(1 for x in r["replicas_per_sync"] if x < NODES)
    good = f"{useful / base:.1%}" if base else "-"
    print(f"| {kind} | {len(r['kills'])} | {r['exit']} | {short} | {useful:.1f} | {good} | "
          f"{r['val_loss']:.4f} | {r['wall_s']:.0f} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run")
  r.add_argument("--kind", choices=("clean", "kill"), required=True)
  r.add_argument("--every-s", type=float, default=120.0)
  sub.add_parser("table")
  args = parser.parse_args()
  if args.cmd == "run":
    run(args.kind, args.every_s)
  else:
    table()


if __name__ == "__main__":
  main()
