"""The table of docs/benchmarks.md's sharded-state section from the runs in a folder (default:
notebooks/data/sharded_2n_1gbit_20261127): medians over the runs of each width.

    python benchmarks/series/sharded_2n_1gbit_20261127/summarise.py [FOLDER]
"""

import json
import pathlib
import statistics
import sys

# The data lie in notebooks/data/<this folder's name>/ of the repository.
DATA = (pathlib.Path(__file__).resolve().parents[3] / "notebooks" / "data"
        / pathlib.Path(__file__).parent.name)

HERE = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else DATA)
MODES = ("replicated", "same_codec", "sharded")


def main():
  for g in (4, 8):
    runs = [json.loads(p.read_text())["result"] for p in sorted(HERE.glob(f"g{g}_*.json"))]
    if not runs:  # a folder may hold one width only
      continue
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    print(f"{g}-bit differences, {len(runs)} runs; codecs: {runs[0]['codecs']}")
    for m in MODES:
      print(f"  {m:11s} update {1e3 * med(lambda r: r['update_s'][m]):6.1f} ms  optimizer "
            f"{1e3 * med(lambda r: r['optimizer_s'][m]):5.1f}  communication "
            f"{1e3 * med(lambda r: r['comm_s'][m]):6.1f}  sent "
            f"{runs[0]['sent_bytes_per_device'][m] / 1e6:.2f} MB  state "
            f"{runs[0]['state_bytes_per_device'][m] / 1e6:.1f} MB")
    for key in ("update_ratio", "comm_ratio", "update_ratio_same_codec", "comm_ratio_same_codec",
                "optimizer_ratio"):
      print(f"  {key:24s} {med(lambda r: r[key]):.3f}  (runs: "
            + ", ".join(f"{r[key]:.3f}" for r in runs) + ")")


if __name__ == "__main__":
  main()
