#!/bin/bash
# Pairs of runs, torch fp32 DDP then sync(bits=32), on the 2-node 1 Gbit/s simulated cluster, after
# the exact path across processes sent leaves of 2**18 values and more as their own all-reduce
# operands (transport.GLOO_PAIR.own_operand). The same commands as the headline's pairs
# (../sync_guard_2n_1gbit_20261127/run_pairs.sh), with the fp32 rows only; the table:
#   python benchmarks/series/sync_guard_2n_1gbit_20261127/summarise.py notebooks/data/exact_2n_1gbit_20261127 1 2 3
D=notebooks/data/exact_2n_1gbit_20261127 CODECS=fp32 TORCH_ROWS=ddp_fp32 exec benchmarks/series/sync_guard_2n_1gbit_20261127/run_pairs.sh "$@"
