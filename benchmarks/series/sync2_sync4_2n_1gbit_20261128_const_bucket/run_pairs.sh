#!/bin/bash
# sync(bits=4) and sync(bits=2) beside torch's fp32 DDP and PowerSGD rank 1 hook after the CPU
# encode compiled buckets of 64 and 128 with a constant length, on the VM of
# headline_2n_1gbit_20261128_second_vm (the same harness: 3 warmup steps on both sides, jax_qcomm
# 10 timed calls, torch 13 steps). The table:
#   python benchmarks/series/sync_guard_2n_1gbit_20261127/summarise.py notebooks/data/sync2_sync4_2n_1gbit_20261128_const_bucket 1 2 3
D=notebooks/data/sync2_sync4_2n_1gbit_20261128_const_bucket CODECS="auto4 auto2" \
    TORCH_ROWS="ddp_fp32 ddp_powersgd1" JAX_STEPS="--repeats 10 --warmup 3" \
    TORCH_STEPS="--repeats 13" exec benchmarks/series/sync_guard_2n_1gbit_20261127/run_pairs.sh "$@"
