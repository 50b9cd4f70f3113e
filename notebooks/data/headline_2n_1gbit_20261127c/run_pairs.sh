#!/bin/bash
# The headline's pairs of runs (../sync_guard_2n_1gbit_20261127/run_pairs.sh, the same commands),
# re-run after the exact path's changes: leaves of 2**18 values and more as their own all-reduce
# operands across gloo processes, and the finite mark read from the sums. The table:
#   python notebooks/data/sync_guard_2n_1gbit_20261127/summarise.py notebooks/data/headline_2n_1gbit_20261127c 1 2 3
D=notebooks/data/headline_2n_1gbit_20261127c
for i in "$@"; do
  uptime > $D/load_$i.txt
  timeout 900 .venv/bin/python -m jax_qcomm.tools.cluster --nodes 2 --rate 1gbit --local-devices 1 \
      --malloc glibc --python /work/torchenv/bin/python --out $D/torch_$i.json -- \
      benchmarks/peers/torch_worker.py > $D/torch_$i.log 2>&1
  uptime >> $D/load_$i.txt
  QCOMM_MALLOC=reuse timeout 1800 .venv/bin/python -m benchmarks cluster --nodes 2 --rate 1gbit \
      --malloc glibc -- allreduce --tree resnet50 --codecs fp32 wire16 auto4 auto2 powersgd1 \
      powersgd4 --sync --repeats 5 --warmup 1 --raw-malloc > $D/jax_$i.log 2>&1
  cp bench-results/cluster.json $D/jax_$i.json
  uptime >> $D/load_$i.txt
done
