"""sync(bits=4) against torch's fp32 DDP per pair of run_pairs.sh: each run's medians (update
alone, update + apply, sync - local) over that run's torch fp32, then the median over the runs
with the lowest and highest.

    python benchmarks/series/sync4_2n_1gbit_20261128_series/summarise.py 1 2 3 4 5 6
    python benchmarks/series/sync4_2n_1gbit_20261128_series/summarise.py OTHER_FOLDER 1 2 3 4 5 6

(the first: notebooks/data/sync4_2n_1gbit_20261128_series; the second: a later series of the same
harness, in OTHER_FOLDER).
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
runs = args or ["1", "2", "3", "4", "5", "6"]
cols = (("update_median_s", "update"), ("sync_median_s", "update + apply"),
        ("sync_comm_median_s", "sync - local"))
ratios = {key: [] for key, _ in cols}
print("run  torch fp32 ms  " + "  ".join(f"{name} ms (x fp32)" for _, name in cols))
for i in runs:
  fp32 = json.load(open(HERE / f"torch_{i}.json"))["rows"]["ddp_fp32"]["median_s"]
  row = {r["codec"]: r for r in json.load(open(HERE / f"jax_{i}.json"))["rows"]}["auto4"]
  cells = []
  for key, _ in cols:
    ratios[key].append(row[key] / fp32)
    cells.append(f"{1e3 * row[key]:.1f} ({row[key] / fp32:.3f})")
  print(f"{i:>3}  {1e3 * fp32:13.1f}  " + "  ".join(cells))
for key, name in cols:
  r = ratios[key]
  print(f"{name}: median {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}), "
        f"{sum(x <= 0.20 for x in r)} of {len(r)} runs <= 0.20")
