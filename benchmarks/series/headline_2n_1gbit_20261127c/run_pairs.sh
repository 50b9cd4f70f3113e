#!/bin/bash
# The headline's pairs of runs (../sync_guard_2n_1gbit_20261127/run_pairs.sh, the same commands),
# re-run after the exact path's changes: leaves of 2**18 values and more as their own all-reduce
# operands across gloo processes, and the finite mark read from the sums. The table:
#   python benchmarks/series/sync_guard_2n_1gbit_20261127/summarise.py notebooks/data/headline_2n_1gbit_20261127c 1 2 3
D=notebooks/data/headline_2n_1gbit_20261127c exec benchmarks/series/sync_guard_2n_1gbit_20261127/run_pairs.sh "$@"
