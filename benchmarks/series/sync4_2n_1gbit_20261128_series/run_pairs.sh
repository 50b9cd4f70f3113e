#!/bin/bash
# sync(bits=4) beside torch's fp32 DDP, more pairs than the headline's three: the headline's harness
# (sync_guard_2n_1gbit_20261127/run_pairs.sh) with only those two rows, on the 2-node 1 Gbit/s
# simulated cluster, 3 warmup steps on both sides, jax_qcomm 10 timed calls, torch 13 steps.
# Usage: run_pairs.sh 1 2 3 4 5 6. The table:
#   python benchmarks/series/sync4_2n_1gbit_20261128_series/summarise.py 1 2 3 4 5 6
D=notebooks/data/sync4_2n_1gbit_20261128_series CODECS=auto4 TORCH_ROWS=ddp_fp32 \
    JAX_STEPS="--repeats 10 --warmup 3" TORCH_STEPS="--repeats 13" \
    exec benchmarks/series/sync_guard_2n_1gbit_20261127/run_pairs.sh "$@"
