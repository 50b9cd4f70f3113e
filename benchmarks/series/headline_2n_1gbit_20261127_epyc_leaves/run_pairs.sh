#!/bin/bash
# The headline's pairs after QSGD's first encode read the leaves in place (no packed copy): every
# row, torch then jax_qcomm, on the 2-node 1 Gbit/s simulated cluster (the VM given an AMD EPYC
# with AVX-512), 3 warmup steps on both sides, jax_qcomm 10 timed calls, torch 13 steps. The table:
#   python benchmarks/series/sync_guard_2n_1gbit_20261127/summarise.py notebooks/data/headline_2n_1gbit_20261127_epyc_leaves 1 2 3
D=notebooks/data/headline_2n_1gbit_20261127_epyc_leaves JAX_STEPS="--repeats 10 --warmup 3" \
    TORCH_STEPS="--repeats 13" exec benchmarks/series/sync_guard_2n_1gbit_20261127/run_pairs.sh "$@"
