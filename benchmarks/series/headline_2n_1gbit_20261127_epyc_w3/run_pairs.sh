#!/bin/bash
# The headline's pairs (../sync_guard_2n_1gbit_20261127/run_pairs.sh, every row), torch then
# jax_qcomm, on the 2-node 1 Gbit/s simulated cluster (the VM given an AMD EPYC with AVX-512), with
# the same 3 warmup steps on both sides: jax_qcomm times 10 calls after 3, torch 13 steps after 3
# (so that its error at the compressed step where jax_qcomm reads its own, the 14th, is in its
# run). The table:
#   python benchmarks/series/sync_guard_2n_1gbit_20261127/summarise.py notebooks/data/headline_2n_1gbit_20261127_epyc_w3 1 2 3
D=notebooks/data/headline_2n_1gbit_20261127_epyc_w3 JAX_STEPS="--repeats 10 --warmup 3" \
    TORCH_STEPS="--repeats 13" exec benchmarks/series/sync_guard_2n_1gbit_20261127/run_pairs.sh "$@"
