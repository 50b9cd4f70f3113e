"""Per pair of ab.sh's runs, the new build's median less the old one's, in ms, for the bare
allreduce, the update alone and the update with apply; and the median of those differences.
The runs: notebooks/data/sync_update_2n_1gbit_20261128_pieces (new) and its before/ (old).

    python benchmarks/series/sync_update_2n_1gbit_20261128_pieces/paired.py 1 2 3 4 5 6
"""
import json
import pathlib
import statistics
import sys

# The data lie in notebooks/data/<this folder's name>/ of the repository.
DATA = (pathlib.Path(__file__).resolve().parents[3] / "notebooks" / "data"
        / pathlib.Path(__file__).parent.name)

HERE = DATA
pairs = sys.argv[1:] or ["1", "2", "3", "4", "5", "6"]


def rows(path):
  return {r["codec"]: r for r in json.load(open(path))["rows"]}


for codec in ("auto4", "auto2"):
  for key, what in (("median_s", "allreduce"), ("update_median_s", "update"),
                    ("sync_median_s", "update + apply")):
    diff = [1e3 * (rows(HERE / f"jax_{i}.json")[codec][key]
                   - rows(HERE / "before" / f"jax_{i}.json")[codec][key]) for i in pairs]
    print(f"{codec} {what}: " + " ".join(f"{x:+.1f}" for x in diff)
          + f"  median {statistics.median(diff):+.1f} ms, {sum(x < 0 for x in diff)} of "
          f"{len(diff)} faster")
