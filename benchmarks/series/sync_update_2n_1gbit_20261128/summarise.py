"""The table of `sync`'s update against the bare allreduce in docs/benchmarks.md, from the runs in
a data folder: per codec the median over the runs of each run's median, with the lowest and highest,
and the median over the runs of each run's median per-round ratio.

    python benchmarks/series/sync_update_2n_1gbit_20261128/summarise.py [FOLDER] 1 2 3

FOLDER (default: notebooks/data/sync_update_2n_1gbit_20261128) holds the runs of run.sh (D=FOLDER
run.sh writes them elsewhere).
"""
import json
import pathlib
import statistics
import sys

# The data lie in notebooks/data/<this folder's name>/ of the repository.
DATA = (pathlib.Path(__file__).resolve().parents[3] / "notebooks" / "data"
        / pathlib.Path(__file__).parent.name)

args = sys.argv[1:]
HERE = pathlib.Path(args.pop(0)) if args and pathlib.Path(args[0]).is_dir() \
    else DATA
runs = args or ["1", "2", "3"]
jax = [{r["codec"]: r for r in json.load(open(HERE / f"jax_{i}.json"))["rows"]} for i in runs]


def cell(key, codec):
  values = [1e3 * j[codec][key] for j in jax]
  return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def ratio(key, codec):
  values = [j[codec][key] for j in jax]
  return f"{statistics.median(values):.3f}x ({min(values):.3f}-{max(values):.3f})"


print("| codec | allreduce ms | update ms | update / allreduce | update + apply ms "
      "| (update + apply) / allreduce |")
print("|---|--:|--:|--:|--:|--:|")
for codec in jax[0]:
  print(f"| {codec} ({jax[0][codec]['runs']}) | {cell('median_s', codec)} | "
        f"{cell('update_median_s', codec)} | {ratio('update_over_allreduce', codec)} | "
        f"{cell('sync_median_s', codec)} | {ratio('sync_over_allreduce', codec)} |")
