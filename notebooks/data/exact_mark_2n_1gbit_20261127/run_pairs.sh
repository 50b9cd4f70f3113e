#!/bin/bash
# Pairs of runs, torch fp32 DDP then sync(bits=32), on the 2-node 1 Gbit/s simulated cluster, after
# the exact path's finite mark moved from the means to the sums (the division fuses into the
# optimizer's pass instead of being written out). The same commands as the headline's pairs
# (../sync_guard_2n_1gbit_20261127/run_pairs.sh), with the fp32 rows only; the table:
#   python notebooks/data/sync_guard_2n_1gbit_20261127/summarise.py notebooks/data/exact_mark_2n_1gbit_20261127 1 2 3
D=notebooks/data/exact_mark_2n_1gbit_20261127
for i in "$@"; do
  uptime > $D/load_$i.txt
  timeout 900 .venv/bin/python -m jax_qcomm.tools.cluster --nodes 2 --rate 1gbit --local-devices 1 \
      --malloc glibc --python /work/torchenv/bin/python --out $D/torch_$i.json -- \
      benchmarks/peers/torch_worker.py --rows ddp_fp32 > $D/torch_$i.log 2>&1
  uptime >> $D/load_$i.txt
  QCOMM_MALLOC=reuse timeout 1800 .venv/bin/python -m benchmarks cluster --nodes 2 --rate 1gbit \
      --malloc glibc -- allreduce --tree resnet50 --codecs fp32 --sync --repeats 5 --warmup 1 \
      --raw-malloc > $D/jax_$i.log 2>&1
  cp bench-results/cluster.json $D/jax_$i.json
  uptime >> $D/load_$i.txt
done
