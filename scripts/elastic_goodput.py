"""Goodput of elastic training on the simulated cluster: useful steps per second with node
processes killed every few minutes, against the same run with no failure.

    python scripts/elastic_goodput.py run --kind clean [--method ddp]  # resumable by run
    python scripts/elastic_goodput.py run --kind kill --every-s 120 --first-s 30 [--method ddp]
    python scripts/elastic_goodput.py run --kind kill2 --every-s 120 --first-s 30 [--method ddp]
    python scripts/elastic_goodput.py run ... --repeat 2     # NAME_2.json: one more of a run
    python scripts/elastic_goodput.py table                  # medians over the repeats
    python scripts/elastic_goodput.py table --only clean_4,kill_6   # those runs only

Each run is ``python -m jax_qcomm.tools.cluster --elastic`` (3 nodes sharing the machine's cores,
10 Mbit/s links) of ``training.lm_slow_link``: ``--method=diloco`` with 4-bit synchronisations
every 20 steps (4000 steps), or ``--method=ddp``, a 4-bit ``qcomm.sync`` every step (1500 steps).
``kill`` sends SIGKILL to node 1, then 2, then 0, ...: ``--first-s`` seconds (default:
``--every-s``) after the first evaluation, then every ``--every-s`` seconds; ``kill2`` kills two
nodes at once each time (1 and 2, then 2 and 0, ...); the launcher restarts each (from its
spare); none after the last evaluation (a process killed once its training is over would wait
to be admitted by a group that has finished). Useful steps: for every synchronisation (diloco) or optimizer step (ddp), the replicas
averaged times the calls it covers (the work that reached the parameters); per second of
the run's wall time (start-up included in every run). Every run starts with an empty compilation
cache of its own (``JAX_COMPILATION_CACHE_DIR``, a new directory, removed afterwards): the elastic
processes keep their programs there (docs/distributed.md), and a cache filled by an earlier run
would make a later one start faster.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

OUT = os.path.join(os.path.dirname(__file__), "..", "notebooks", "data", "elastic_goodput")
NODES, RATE, EVERY = 3, "10mbit", 20
STEPS = {"diloco": 4000, "ddp": 1500}
KINDS = ("clean", "kill", "kill2")
# A collective a lost process leaves some survivors inside (waiting on a survivor that has left
# it) ends at the collective timeout: 20 s instead of the default 60, still far above a step.
ENV = {"QCOMM_COLLECTIVE_TIMEOUT": "20"}


def _command(out_json: str, method: str) -> list[str]:
  return [sys.executable, "-m", "jax_qcomm.tools.cluster", "--nodes", str(NODES), "--rate", RATE,
          "--local-devices", "1", "--elastic", "--max-restarts", "10", "--timeout", "1800",
          "--out", out_json, "--", "-m", "training.lm_slow_link", "--config=configs/lm_bytes.py",
          f"--method={method}", "--config.bits=4", f"--config.num_devices={NODES}",
          "--config.batch_size=24", "--config.num_val_windows=192",
          f"--config.num_steps={STEPS[method]}", f"--every={EVERY}", "--eval_every=500"]


def _name(method: str, kind: str, repeat: int = 1) -> str:
  """A run's file name: ``kill``, ``ddp_kill``, ``ddp_kill_2`` (its second repeat), ..."""
  return ((kind if method == "diloco" else f"{method}_{kind}")
          + ("" if repeat == 1 else f"_{repeat}"))


def _node_pid(rank: int) -> int | None:
  """The live node process of ``rank`` (its environment holds QCOMM_PROCESS_ID): of those, the
  oldest; a younger one is the launcher's spare, waiting to replace it."""
  found = []
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
      if env.get(b"QCOMM_PROCESS_ID") != str(rank).encode() or b"-c" in cmd[:3]:
        continue
      with open(f"/proc/{pid}/stat") as f:  # field 22: the start time, after the ")" of comm
        found.append((int(f.read().rsplit(")", 1)[1].split()[19]), int(pid)))
    except OSError:
      continue
  return min(found)[1] if found else None


def run(kind: str, every_s: float, method: str = "diloco", first_s: float | None = None,
        repeat: int = 1) -> None:
  os.makedirs(OUT, exist_ok=True)
  name = _name(method, kind, repeat)
  path = os.path.join(OUT, f"{name}.json")
  if os.path.exists(path):
    print(f"{path} exists; skipping")
    return
  result_json = os.path.join(OUT, f"{name}.result.json")
  log_path = os.path.join(OUT, f"{name}.log")
  kills: list[dict] = []
  load_before = os.getloadavg()
  t0 = time.monotonic()
  cache = tempfile.mkdtemp(prefix="qcomm-goodput-cache-")
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, **ENV)
  with open(log_path, "w") as log:
    proc = subprocess.Popen(_command(result_json, method), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    evaluated, trained = threading.Event(), threading.Event()

    def pump():
      for line in proc.stdout:
        log.write(line)
        log.flush()
        if "[eval] step" in line:
          evaluated.set()
        if f"[eval] step {STEPS[method]}:" in line:  # the last: no kill after the training
          trained.set()

    threading.Thread(target=pump, daemon=True).start()
    if kind != "clean":
      evaluated.wait()
      rank = 1
      while proc.poll() is None:
        deadline = time.monotonic() + (every_s if kills or first_s is None else first_s)
        while proc.poll() is None and time.monotonic() < deadline:
          time.sleep(0.5)
        ranks = [rank, (rank + 1) % NODES] if kind == "kill2" else [rank]
        pids = ({r: _node_pid(r) for r in ranks} if proc.poll() is None and not trained.is_set()
                else {})
        for r, pid in pids.items():
          if pid is not None:
            os.kill(pid, signal.SIGKILL)
            kills.append({"rank": r, "pid": pid, "t_s": time.monotonic() - t0})
        rank = (rank + 1) % NODES
    proc.wait()
  wall = time.monotonic() - t0
  shutil.rmtree(cache, ignore_errors=True)
  with open(result_json) as f:
    result = json.load(f)
  record = {
      "kind": kind, "method": method, "wall_s": wall, "exit": proc.returncode, "kills": kills,
      "every_s": every_s if kind != "clean" else None,
      "first_s": (every_s if first_s is None else first_s) if kind != "clean" else None,
      # the replicas averaged at each synchronisation (diloco) or optimizer step (ddp)
      "replicas_per_sync": result["replicas_per_sync"] or result["replicas_per_step"],
      "val_loss": result["val_loss"], "stall_s": result.get("stall_s"),
      # process 0's rounds that ran short or admitted a process, with their seconds
      "short_syncs": result.get("short_syncs"), "compilation_cache": "empty at the start",
      "calls_per_sync": (EVERY if method == "diloco" else 1) * result["accum_steps"],
      "train_s": result["train_s"],
      "command": " ".join([f"{k}={v}" for k, v in ENV.items()] + _command("OUT.json", method)),
      "load_before": load_before,
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


def _runs(method: str, kind: str, only: set[str] | None = None) -> list[dict]:
  """Every repeat of one run that exists (``NAME.json``, ``NAME_2.json``, ...); those named in
  ``only``, if given."""
  runs, k = [], 1
  while True:
    name = _name(method, kind, k)
    path = os.path.join(OUT, f"{name}.json")
    if not os.path.exists(path):
      return runs
    if only is None or name in only:
      with open(path) as f:
        runs.append(json.load(f))
    k += 1


def _events(r: dict) -> int:
  """A run's kill events (a ``kill2`` event kills two processes)."""
  return len(r["kills"]) // (2 if r["kind"] == "kill2" else 1)


def _extra_s_per_loss(r: dict) -> float | None:
  """Process 0's seconds beyond a normal round in the rounds that ran short or admitted, per kill
  event: the rounds a loss broke, the admitting ones (a normal round: the median of the short
  rounds that neither broke nor admitted)."""
  rounds = r.get("short_syncs") or []
  plain = [x["seconds"] for x in rounds if not x["stall_s"] and not x["admitted"]]
  events = _events(r)
  if not events or not plain:
    return None
  typical = statistics.median(plain)
  return sum(max(0.0, x["seconds"] - typical) for x in rounds) / events


def table(only: set[str] | None = None) -> None:
  """The table over every run, or over the runs named in ``only`` (runs of one machine and
  day: each goodput is against the clean runs among them)."""
  print("| method | run | runs | kill events | rounds with fewer replicas | useful steps / s "
        "(median) | goodput | survivors' extra s per loss (process 0) | final val loss | wall s |")
  print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|")
  for method in STEPS:
    base = None
    for kind in KINDS:
      runs = _runs(method, kind, only)
      if not runs:
        continue
      useful = [sum(r["replicas_per_sync"]) * r["calls_per_sync"] / r["wall_s"] for r in runs]
      median = statistics.median(useful)
      base = median if kind == "clean" else base
      good = f"{median / base:.1%}" if base else "-"
      events = sum(map(_events, runs))
      short = sum(1 for r in runs for x in r["replicas_per_sync"] if x < NODES)
      total = sum(len(r["replicas_per_sync"]) for r in runs)
      extra = [e for e in map(_extra_s_per_loss, runs) if e is not None]
      extra = "-" if not extra else f"{statistics.median(extra):.2f}"
      print(f"| {method} | {kind} | {len(runs)} | {events} | {short} of {total} | "
            f"{median:.1f} ({min(useful):.1f}-{max(useful):.1f}) | {good} | {extra} | "
            + ", ".join(f"{r['val_loss']:.4f}" for r in runs) + " | "
            + ", ".join(f"{r['wall_s']:.0f}" for r in runs) + " |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run")
  r.add_argument("--kind", choices=KINDS, required=True)
  r.add_argument("--every-s", type=float, default=120.0)
  r.add_argument("--first-s", type=float, default=None,
                 help="seconds from the first evaluation to the first kill (default: --every-s)")
  r.add_argument("--method", choices=tuple(STEPS), default="diloco")
  r.add_argument("--repeat", type=int, default=1,
                 help="the repeat's number: 2, 3, ... write NAME_2.json, ... (the table takes "
                      "the median)")
  t = sub.add_parser("table")
  t.add_argument("--only", default=None,
                 help="comma-separated run names (clean_4,kill_6,...): only those")
  args = parser.parse_args()
  if args.cmd == "run":
    if args.repeat < 1:
      parser.error(f"--repeat must be >= 1, got {args.repeat}")
    run(args.kind, args.every_s, args.method, args.first_s, args.repeat)
  else:
    table(None if args.only is None else set(args.only.split(",")))


if __name__ == "__main__":
  main()
