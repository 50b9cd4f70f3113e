"""The accuracy study of docs/accuracy.md: the byte-level LM (training/lm.py) trained at fp32, bf16
wire, 8, 4, 2 bits, 2 and 1 bits with error feedback, plus fp32 and 4 bits with a second seed.

    python scripts/lm_study.py run [--runs fp32,q4 | all] [--max-minutes 50]
    python scripts/lm_study.py status
    python scripts/lm_study.py plot          # docs/img/lm_val_loss.png + the table in docs/accuracy.md
    python scripts/lm_study.py calibrate [--steps 200] [--runs fp32,q4]

``run`` trains each named run as its own ``python -m training.lm`` process with a workdir
(``runs/lm_study/<name>``): a run whose result JSON exists (``notebooks/data/lm/<name>.json``) is
skipped, a partial one resumes from its latest orbax checkpoint (bit-identically), and with
``--max-minutes`` the driver starts no run it cannot begin and stops the current one cleanly
(checkpointed) when the time is up, so the study can be run in pieces: repeat the same command.
``--config``/``--set`` change the base config (for trying the driver on a tiny model; the study
itself uses neither). ``plot`` regenerates the plot and the results table from the JSON files alone.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/lm_bytes.py"

# name -> config overrides (on top of configs/lm_bytes.py: 8 devices, accum_steps=2, 2000 steps,
# maxmin, bucket 128, stochastic rounding, the default leaf policy).
RUNS: dict[str, dict[str, Any]] = {
    "fp32": {"bits": 32},
    "bf16": {"bits": 16},
    "q8": {"bits": 8},
    "q4": {"bits": 4},
    "q2": {"bits": 2},
    "q2_ef": {"bits": 2, "error_feedback": True},
    "q1_ef": {"bits": 1, "error_feedback": True},
    "fp32_seed1": {"bits": 32, "seed": 1},
    "q4_seed1": {"bits": 4, "seed": 1},
    "sh_q4_g8": {"bits": 4, "shard_state": True, "gather_bits": 8},
    "sh_q4_g4": {"bits": 4, "shard_state": True, "gather_bits": 4},
    "sh_q2_g8_ef": {"bits": 2, "error_feedback": True, "shard_state": True, "gather_bits": 8},
    "sh_q4_g8_seed1": {"bits": 4, "shard_state": True, "gather_bits": 8, "seed": 1},
    "sh_q4_g4_seed1": {"bits": 4, "shard_state": True, "gather_bits": 4, "seed": 1},
    "sh_q2_g8_ef_seed1": {"bits": 2, "error_feedback": True, "shard_state": True,
                          "gather_bits": 8, "seed": 1},
}
LABELS = {"fp32": "fp32 (exact)", "bf16": "bf16 wire", "q8": "QSGD 8 bits", "q4": "QSGD 4 bits",
          "q2": "QSGD 2 bits", "q2_ef": "QSGD 2 bits + EF", "q1_ef": "QSGD 1 bit + EF",
          "fp32_seed1": "fp32, seed 1", "q4_seed1": "QSGD 4 bits, seed 1",
          "sh_q4_g8": "sharded state: 4-bit gradients, 8-bit differences",
          "sh_q4_g4": "sharded state: 4-bit gradients, 4-bit differences",
          "sh_q2_g8_ef": "sharded state: 2-bit gradients + EF, 8-bit differences",
          "sh_q4_g8_seed1": "sharded state: 4-bit gradients, 8-bit differences, seed 1",
          "sh_q4_g4_seed1": "sharded state: 4-bit gradients, 4-bit differences, seed 1",
          "sh_q2_g8_ef_seed1": "sharded state: 2-bit gradients + EF, 8-bit differences, seed 1"}
TABLE_BEGIN, TABLE_END = "<!-- lm-table -->", "<!-- /lm-table -->"
# Seconds a run needs before its training loop starts (imports, corpus, compilation): the driver
# does not start a run with less time left, and gives the loop the rest.
STARTUP_S = 60.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python scripts/lm_study.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--out", default=os.path.join(REPO, "notebooks", "data", "lm"),
                      help="per-run result JSON files (default: notebooks/data/lm)")
  run = sub.add_parser("run", parents=[common], help="train the runs (skips done, resumes partial)")
  calibrate = sub.add_parser("calibrate", help="time a few hundred steps, project the study")
  for p in (run, calibrate):
    p.add_argument("--runs", default="all" if p is run else "fp32,q4",
                   help=f"comma-separated names from {', '.join(RUNS)}, or 'all'")
    p.add_argument("--config", default=CONFIG, help=f"base config (default: {CONFIG})")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="extra --config.FIELD=VALUE for every run (not for the study itself)")
  status = sub.add_parser("status", parents=[common], help="which runs are done or partial")
  for p in (run, status):
    p.add_argument("--workdir", default=os.path.join(REPO, "runs", "lm_study"),
                   help="checkpoints and TensorBoard logs, one folder per run")
  run.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop cleanly (checkpointed) after about this long; 0: no limit")
  calibrate.add_argument("--steps", type=int, default=200, help="optimizer steps per timed run")
  plot = sub.add_parser("plot", parents=[common], help="plot + results table from the JSON")
  plot.add_argument("--img", default=os.path.join(REPO, "docs", "img"), help="where the PNG goes")
  plot.add_argument("--doc", default=os.path.join(REPO, "docs", "accuracy.md"),
                    help=f"markdown file whose {TABLE_BEGIN} ... {TABLE_END} block is rewritten")
  args = parser.parse_args(argv)
  if getattr(args, "runs", None) is not None:
    names = list(RUNS) if args.runs == "all" else [n.strip() for n in args.runs.split(",")
                                                  if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
      parser.error(f"--runs: unknown run(s) {unknown or args.runs!r}; known: {', '.join(RUNS)}")
    args.runs = names
  for item in getattr(args, "set", []):
    if not re.fullmatch(r"[a-z_0-9]+=.+", item):
      parser.error(f"--set takes FIELD=VALUE (e.g. num_steps=100), got {item!r}")
  if getattr(args, "max_minutes", 0.0) < 0:
    parser.error("--max-minutes must be >= 0")
  if getattr(args, "steps", 2) < 2:
    parser.error("--steps must be >= 2")
  return args


# ---- provenance ----------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
  """CPU model, the vector ISA extensions XLA and the codec kernels can use, core count."""
  info: dict[str, str] = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
  except OSError:
    pass
  flags = set(info.get("flags", "").split())
  isa = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni",
                     "avx512_bf16", "amx_tile") if f in flags]
  return {"cpu": info.get("model name") or platform.processor() or "unknown", "isa": isa,
          "cores": os.cpu_count(), "os": platform.platform(), "machine": platform.machine()}


def versions() -> dict[str, str]:
  out = {"python": platform.python_version()}
  for dist in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "jax_qcomm"):
    try:
      out[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      out[dist] = "not installed"
  try:
    out["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                capture_output=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    pass
  return out


# ---- running -------------------------------------------------------------------------------------

def trainer_command(name: str, config: str, sets: Sequence[str], workdir: str | None,
                    time_limit_minutes: float = 0.0) -> list[str]:
  cmd = ["-m", "training.lm", f"--config={config}"]
  cmd += [f"--config.{k}={v}" for k, v in RUNS[name].items()]
  cmd += [f"--config.{s}" for s in sets]
  if time_limit_minutes:
    cmd.append(f"--config.time_limit_minutes={time_limit_minutes:.3f}")
  if workdir:
    cmd.append(f"--workdir={workdir}")
  return cmd


def num_devices(config: str, sets: Sequence[str]) -> int:
  """config.num_devices of ``path[:mode]`` after the ``--set`` overrides."""
  for item in reversed(sets):
    if item.startswith("num_devices="):
      return int(item.split("=", 1)[1])
  path, _, mode = config.partition(":")
  spec = importlib.util.spec_from_file_location("_lm_config", os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return int((module.get_config(mode) if mode else module.get_config()).num_devices)


def _die_with_parent() -> None:
  """In the trainer's process (Linux): SIGKILL when the driver dies, even by SIGKILL."""
  try:
    import ctypes  # noqa: PLC0415
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass  # not Linux: the finally clause of run_trainer still covers Ctrl-C and SIGTERM


def run_trainer(cmd: list[str], devices: int) -> dict[str, Any]:
  """Runs ``python <cmd>`` in the repository, echoing its output; returns its last line's JSON.
  stderr (the tqdm bar) goes straight to ours. The CPU device count also goes in the environment,
  so that it holds even if an import starts a JAX backend before the trainer's main runs."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_NUM_CPU_DEVICES"] = str(devices)
  env["PYTHONUNBUFFERED"] = "1"  # its log lines as they happen, not when a pipe buffer fills
  proc = subprocess.Popen([sys.executable, *cmd], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          text=True, bufsize=1, preexec_fn=_die_with_parent)
  last = ""
  try:
    assert proc.stdout is not None
    for line in proc.stdout:
      if line.strip():
        last = line
      if not line.startswith("{"):
        print(line, end="", flush=True)
    if proc.wait() != 0:
      raise RuntimeError(f"the trainer failed (exit {proc.returncode}): python {' '.join(cmd)}")
  finally:
    # Ctrl-C / SIGTERM of the driver: no orphan trainer may keep writing to the run's workdir
    # while a restarted driver resumes it. (Its checkpoints are written atomically by orbax.)
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return json.loads(last)


def cmd_run(args: argparse.Namespace) -> int:
  os.makedirs(args.out, exist_ok=True)
  t0 = time.monotonic()
  for name in args.runs:
    out = os.path.join(args.out, f"{name}.json")
    if os.path.exists(out):
      print(f"skipping {name}: {os.path.relpath(out, REPO)} exists", flush=True)
      continue
    limit = 0.0
    if args.max_minutes:
      left = args.max_minutes * 60 - (time.monotonic() - t0)
      if left < 2 * STARTUP_S:
        print(f"--max-minutes reached: {name} and later runs not started; rerun the same "
              "command to continue", flush=True)
        return 0
      limit = (left - STARTUP_S) / 60
    workdir = os.path.join(args.workdir, name)
    cmd = trainer_command(name, args.config, args.set, workdir, limit)
    print(f"\n=== {name}: python {' '.join(cmd)}", flush=True)
    result = run_trainer(cmd, num_devices(args.config, args.set))
    if result.get("stopped"):
      print(f"{name} stopped cleanly at optimizer step {result['steps']}/{result['num_steps']} "
            f"(checkpoint in {workdir}); rerun the same command to continue", flush=True)
      return 0
    # The command as the study runs it, without this piece's time limit nor its machine paths.
    public = trainer_command(name, args.config, args.set, f"runs/lm_study/{name}")
    record = {"name": name, **result, "command": "python " + " ".join(public),
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "versions": versions()}
    with open(out + ".tmp", "w") as f:
      json.dump(record, f, indent=1)
      f.write("\n")
    os.replace(out + ".tmp", out)
    print(f"{name}: val_loss {result['val_loss']:.4f} nats/byte after {result['steps']} steps, "
          f"{result['wall_s'] / 60:.1f} min -> {os.path.relpath(out, REPO)}", flush=True)
  return 0


def cmd_status(args: argparse.Namespace) -> int:
  for name in RUNS:
    out = os.path.join(args.out, f"{name}.json")
    ckpt = os.path.join(args.workdir, name, "checkpoints")
    if os.path.exists(out):
      r = load(out)
      state = f"done: val_loss {r['val_loss']:.4f} after {r['steps']} steps"
    elif os.path.isdir(ckpt) and any(d.isdigit() for d in os.listdir(ckpt)):
      state = f"partial: checkpoint at step {max(int(d) for d in os.listdir(ckpt) if d.isdigit())}"
    else:
      state = "not started"
    print(f"{name:<11} {state}")
  return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
  """Times ``--steps`` optimizer steps of each named run (no checkpoints) and projects the study."""
  sys.path.insert(0, REPO)
  from configs import lm_bytes  # noqa: PLC0415
  study_steps = lm_bytes.get_config().num_steps
  rates, startup = {}, []
  for name in args.runs:
    sets = [f"num_steps={args.steps}", f"warmup_steps={min(100, args.steps // 4)}",
            "progress_bar=False", *args.set]
    cmd = trainer_command(name, args.config, sets, None)
    print(f"\n=== {name}: python {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    r = run_trainer(cmd, num_devices(args.config, args.set))
    wall = time.monotonic() - t0
    rates[name] = (r["steps_per_s"], r["cpu_s_per_step"])
    startup.append(wall - args.steps / r["steps_per_s"])
  cores = os.cpu_count() or 1
  print(f"\n{'run':<11} {'opt. steps/s':>12} {'CPU s/step':>10} {'min/run now':>11} "
        f"{'min/run idle':>12}")
  total = idle_lo = idle_hi = 0.0
  for name, settings in RUNS.items():
    rate, cpu = rates.get(name) or _closest(settings["bits"], rates)
    minutes = (study_steps / rate + max(startup)) / 60
    lo, hi = study_steps * cpu / cores / 60, study_steps * cpu / 60
    total, idle_lo, idle_hi = total + minutes, idle_lo + lo, idle_hi + hi
    mark = "" if name in rates else "  (rates of a similar run)"
    print(f"{name:<11} {rate:>12.2f} {cpu:>10.3f} {minutes:>11.1f} {lo:>5.1f} - {hi:<5.1f}{mark}")
  print(f"whole study ({len(RUNS)} runs x {study_steps} optimizer steps): about {total:.0f} min on "
        f"this machine at its current load ({cores} cores, load average {os.getloadavg()[0]:.1f}); "
        f"on the same machine idle, {idle_lo:.0f} - {idle_hi:.0f} min of training (CPU time / "
        f"cores .. CPU time; compilation not included)")
  return 0


def _closest(bits: int, rates: dict[str, tuple[float, float]]) -> tuple[float, float]:
  """Calibrated rates for an uncalibrated run: QSGD runs take a QSGD run's, others fp32's (the
  slowest such, to stay pessimistic)."""
  quantised = [r for n, r in rates.items() if RUNS[n]["bits"] <= 8]
  exact = [r for n, r in rates.items() if RUNS[n]["bits"] > 8]
  pool = (quantised or exact) if bits <= 8 else (exact or quantised)
  return min(pool)


# ---- plot and table ------------------------------------------------------------------------------

def load(path: str) -> dict[str, Any]:
  with open(path) as f:
    return json.load(f)


def load_results(folder: str) -> dict[str, dict[str, Any]]:
  """Per-run records in the study's order (unknown names after, sorted)."""
  found = {os.path.basename(p)[:-5]: load(p) for p in glob.glob(os.path.join(folder, "*.json"))}
  order = [n for n in RUNS if n in found] + sorted(n for n in found if n not in RUNS)
  return {n: found[n] for n in order}


def _reference(name: str, results: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
  """The fp32 run of the same seed."""
  seed = results[name].get("seed", 0)
  return next((r for r in results.values() if r["bits"] == 32 and r.get("seed", 0) == seed), None)


def table(results: dict[str, dict[str, Any]]) -> str:
  """The markdown results table plus the seed-to-seed lines."""
  rows = ["| run | bits | error feedback | seed | final val loss (nats/byte) | gap to fp32 "
          "| wire bytes / optimizer step | vs fp32 | steps | wall min |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  for name, r in results.items():
    ref = _reference(name, results)
    gap = (f"{100 * (r['val_loss'] / ref['val_loss'] - 1):+.2f}%" if ref and ref is not r
           else ("0 (reference)" if ref is r else "n/a"))
    rows.append(
        f"| {name} | {r['bits']} | {'yes' if r['error_feedback'] else 'no'} | {r.get('seed', 0)} "
        f"| {r['val_loss']:.4f} | {gap} | {r['wire_bytes']:,} | {r['wire_bytes'] / r['fp32_bytes']:.3f} "
        f"| {r['steps']} | {r['wall_s'] / 60:.1f} |")
  lines = ["\n".join(rows), "",
           "Wall minutes are those of the machine as it was during each run (summed over the "
           "pieces), not a speed comparison of the settings."]
  for a, b in (("fp32", "fp32_seed1"), ("q4", "q4_seed1")):
    if a in results and b in results:
      x, y = results[a]["val_loss"], results[b]["val_loss"]
      lines.append(f"Seed-to-seed ({a} vs {b}): {x:.4f} vs {y:.4f}, "
                   f"{100 * abs(x - y) / min(x, y):.2f}% apart.")
  first = next(iter(results.values()), None)
  if first:
    lines.append(f"Unigram entropy of the validation split: {first['unigram_entropy_val']:.3f} "
                 f"nats/byte (uniform: 5.545). Corpus sha256 {first['corpus_sha256'][:16]}..., "
                 f"Python {first['python']}; {first['params']:,} parameters; machine: "
                 f"{first['machine']['cpu']} ({', '.join(first['machine']['isa'])}), "
                 f"{first['machine']['cores']} cores; {first['date_utc'][:10]}; "
                 f"jax {first['versions']['jax']}, flax {first['versions']['flax']}.")
  return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
  for i, (name, r) in enumerate(results.items()):
    steps, losses = zip(*r["curve"])
    style = "--" if r.get("seed", 0) else "-"
    for ax in axes:
      ax.plot(steps, losses, style, color=f"C{i % 10}", label=LABELS.get(name, name))
  axes[0].set_title("validation loss (held-out stdlib files)")
  axes[0].axhline(next(iter(results.values()))["unigram_entropy_val"], color="grey", lw=0.8,
                  ls=":", label="unigram entropy")
  last = max(r["curve"][-1][0] for r in results.values())
  axes[1].set_xlim(last / 2, last * 1.01)
  late = [v for r in results.values() for s, v in r["curve"] if s >= last / 2]
  margin = 0.05 * (max(late) - min(late)) + 0.002
  axes[1].set_ylim(min(late) - margin, max(late) + margin)
  axes[1].set_title("second half of training (zoom)")
  for ax in axes:
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("nats per byte")
    ax.grid(True, alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def cmd_plot(args: argparse.Namespace) -> int:
  results = load_results(args.out)
  if not results:
    print(f"no results in {args.out}: run `python scripts/lm_study.py run` first", file=sys.stderr)
    return 1
  os.makedirs(args.img, exist_ok=True)
  png = os.path.join(args.img, "lm_val_loss.png")
  plot(results, png)
  text = table(results)
  with open(args.doc) as f:
    doc = f.read()
  if TABLE_BEGIN not in doc or TABLE_END not in doc:
    print(f"{args.doc} has no {TABLE_BEGIN} ... {TABLE_END} block", file=sys.stderr)
    return 1
  head, rest = doc.split(TABLE_BEGIN, 1)
  with open(args.doc, "w") as f:
    f.write(f"{head}{TABLE_BEGIN}\n{text}\n{TABLE_END}{rest.split(TABLE_END, 1)[1]}")
  print(text)
  print(f"\nwrote {png} and the table in {args.doc}")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  # SIGTERM ends the driver through SystemExit, so run_trainer's cleanup runs.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
  return {"run": cmd_run, "status": cmd_status, "plot": cmd_plot,
          "calibrate": cmd_calibrate}[args.command](args)


if __name__ == "__main__":
  raise SystemExit(main())
