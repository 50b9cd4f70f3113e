#!/bin/bash
# The headline's pairs after QSGD's scatter-reduce-allgather kept each device's own chunk exact
# (and read the leaves in place): every row, torch then jax_qcomm, on the 2-node 1 Gbit/s simulated
# cluster (the VM given an AMD EPYC with AVX-512), 3 warmup steps on both sides, jax_qcomm 10
# timed calls, torch 13 steps. The table:
#   python benchmarks/series/sync_guard_2n_1gbit_20261127/summarise.py notebooks/data/headline_2n_1gbit_20261128_epyc_own 1 2 3
D=notebooks/data/headline_2n_1gbit_20261128_epyc_own JAX_STEPS="--repeats 10 --warmup 3" \
    TORCH_STEPS="--repeats 13" exec benchmarks/series/sync_guard_2n_1gbit_20261127/run_pairs.sh "$@"
