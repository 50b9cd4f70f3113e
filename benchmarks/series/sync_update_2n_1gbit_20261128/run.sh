#!/bin/bash
# sync's update alone, its update and apply, and the bare allreduce of ResNet-50's tree, in the
# same rounds, on the 2-node 1 Gbit/s simulated cluster, under tools.distributed.initialize's own
# malloc setting (QCOMM_MALLOC=reuse restates its default). Usage: [D=<folder>] [CODECS=...]
# run.sh 1 2 3 (D: where the runs go, default this folder; CODECS: default all four).
D=${D:-notebooks/data/sync_update_2n_1gbit_20261128}
CODECS=${CODECS:-fp32 wire16 auto4 auto2}
for i in "$@"; do
  uptime > $D/load_$i.txt
  QCOMM_MALLOC=reuse timeout 1800 .venv/bin/python -m benchmarks cluster --nodes 2 --rate 1gbit \
      --malloc glibc -- allreduce --tree resnet50 --codecs $CODECS --sync \
      --repeats 10 --warmup 3 --raw-malloc > $D/jax_$i.log 2>&1
  cp bench-results/cluster.json $D/jax_$i.json
  uptime >> $D/load_$i.txt
done
