#!/bin/bash
# sync(bits=4) beside torch's fp32 DDP on another VM instance of the same kind (AMD EPYC, AVX-512),
# later the same day: the harness of sync4_2n_1gbit_20261128_series, the same code.
# Usage: run_pairs.sh 1 2 3 4 5 6. The table:
#   python benchmarks/series/sync4_2n_1gbit_20261128_series/summarise.py \
#       notebooks/data/sync4_2n_1gbit_20261128_second_vm 1 2 3 4 5 6
D=notebooks/data/sync4_2n_1gbit_20261128_second_vm CODECS=auto4 TORCH_ROWS=ddp_fp32 \
    JAX_STEPS="--repeats 10 --warmup 3" TORCH_STEPS="--repeats 13" \
    exec benchmarks/series/sync_guard_2n_1gbit_20261127/run_pairs.sh "$@"
