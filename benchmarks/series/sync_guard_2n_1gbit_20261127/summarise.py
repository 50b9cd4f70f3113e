"""The headline table of docs/benchmarks.md from the pairs in a data folder (median over the runs
of each run's median, with the lowest and highest; ratios to torch's fp32 DDP of the same runs).

    python benchmarks/series/sync_guard_2n_1gbit_20261127/summarise.py 1 2 3
    python benchmarks/series/sync_guard_2n_1gbit_20261127/summarise.py OTHER_FOLDER 1 2 3

(the first: notebooks/data/sync_guard_2n_1gbit_20261127; the second: the pairs of another folder,
made the same way; the torch rows it lacks are left out). PowerSGD's error grows by the step on a
fixed gradient (error feedback, warm start), so beside each of ours (read at the call after its
timed ones) torch's is given at the same compressed step, where its run had that many.
"""
import json
import pathlib
import statistics
import sys

# The data lie in notebooks/data/<this folder's name>/ of the repository.
DATA = (pathlib.Path(__file__).resolve().parents[3] / "notebooks" / "data"
        / pathlib.Path(__file__).parent.name)

args = sys.argv[1:]
HERE = pathlib.Path(args.pop(0)) if args and pathlib.Path(args[0]).is_dir() else \
    DATA
runs = args or ["1", "2", "3"]
torch = [json.load(open(HERE / f"torch_{i}.json"))["rows"] for i in runs]
jax = [{r["codec"]: r for r in json.load(open(HERE / f"jax_{i}.json"))["rows"]} for i in runs]


def cell(values):
  values = [1e3 * v for v in values]
  return statistics.median(values), min(values), max(values)


fp32 = statistics.median(1e3 * t["ddp_fp32"]["median_s"] for t in torch)
print(f"torch fp32 (median of the runs): {fp32:.1f} ms")
for name in ("ddp_fp32", "ddp_fp16", "ddp_powersgd1", "ddp_powersgd4"):
  if name not in torch[0]:
    continue
  m, lo, hi = cell([t[name]["median_s"] for t in torch])
  print(f"{name:14s} {m:7.1f} ({lo:.1f}-{hi:.1f})  {m / fp32:.3f}x  err {torch[0][name]['rel_error']:.3g}")


def torch_error_at(name, call):
  """torch's error at its ``call``-th compressed step (None where its run stopped earlier)."""
  row = torch[0].get(name, {})
  steps, start = row.get("rel_error_steps", []), row.get("start_powerSGD_iter")
  k = None if start is None else start + call - 1
  return steps[k] if k is not None and k < len(steps) else None


for codec in jax[0]:
  s = cell([j[codec]["sync_median_s"] for j in jax])
  c = cell([j[codec]["sync_comm_median_s"] for j in jax])
  a = cell([j[codec]["median_s"] for j in jax])
  loc = cell([j[codec]["local_step_median_s"] for j in jax])
  ratio = statistics.median(j[codec]["sync_over_allreduce"] for j in jax)
  print(f"{codec:10s} sync {s[0]:7.1f} ({s[1]:.1f}-{s[2]:.1f}) {s[0] / fp32:.3f}x | sync-local "
        f"{c[0]:7.1f} ({c[1]:.1f}-{c[2]:.1f}) {c[0] / fp32:.3f}x | allreduce {a[0]:7.1f} "
        f"{a[0] / fp32:.3f}x | local {loc[0]:5.1f} | sync/allreduce {ratio:.3f} | "
        f"err {jax[0][codec]['sync_rel_error']:.3g} | {jax[0][codec]['runs']}")
  if codec.startswith("powersgd"):
    call = jax[0][codec]["sync_calls_before_error"] + 1
    err = torch_error_at("ddp_" + codec, call)
    print(f"{'':10s} torch's error at its compressed step {call}: "
          + ("not in its run" if err is None else f"{err:.3g}"))
