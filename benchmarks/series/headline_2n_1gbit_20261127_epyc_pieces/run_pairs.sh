#!/bin/bash
# The headline's pairs with the exchange, all-gather and reduce-scatter between two processes in
# pieces of at most 1 MiB (transport.GLOO_PAIR.message_bytes): every row, torch then jax_qcomm, on
# the 2-node 1 Gbit/s simulated cluster (the VM given an AMD EPYC with AVX-512), 3 warmup steps on
# both sides, jax_qcomm 10 timed calls, torch 13 steps. The table:
#   python benchmarks/series/sync_guard_2n_1gbit_20261127/summarise.py notebooks/data/headline_2n_1gbit_20261127_epyc_pieces 1 2 3
D=notebooks/data/headline_2n_1gbit_20261127_epyc_pieces JAX_STEPS="--repeats 10 --warmup 3" \
    TORCH_STEPS="--repeats 13" exec benchmarks/series/sync_guard_2n_1gbit_20261127/run_pairs.sh "$@"
