#!/bin/bash
# The headline's pairs (../sync_guard_2n_1gbit_20261127/run_pairs.sh, every row), torch then
# jax_qcomm, on the 2-node 1 Gbit/s simulated cluster, with the VM given an AMD EPYC (AVX-512)
# instead of the Intel Xeon of the headline; the table:
#   python benchmarks/series/sync_guard_2n_1gbit_20261127/summarise.py notebooks/data/headline_2n_1gbit_20261127_epyc 1 2 3
D=notebooks/data/headline_2n_1gbit_20261127_epyc exec benchmarks/series/sync_guard_2n_1gbit_20261127/run_pairs.sh "$@"
