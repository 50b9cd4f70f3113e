#!/bin/bash
# Pairs of runs, torch then jax_qcomm, on the 2-node 1 Gbit/s simulated cluster, after the finite
# guard moved into the codecs (Codec.allreduce_leaves_marked) and with the step without
# communication timed in the same rounds (the "sync-local" column).
# torch as under torchrun (glibc's malloc); jax_qcomm as under any launcher of the user's own
# (QCOMM_MALLOC=reuse: what tools.distributed.initialize applies itself).
# Later series run it with D (their folder), CODECS / TORCH_ROWS for fewer rows, and JAX_STEPS /
# TORCH_STEPS for other warmup and timed step counts (this series: jax_qcomm 1 + 5, torch 3 + 7).
D=${D:-notebooks/data/sync_guard_2n_1gbit_20261127}
CODECS=${CODECS:-fp32 wire16 auto4 auto2 powersgd1 powersgd4}
for i in "$@"; do
  uptime > $D/load_$i.txt
  timeout 900 .venv/bin/python -m jax_qcomm.tools.cluster --nodes 2 --rate 1gbit --local-devices 1 \
      --malloc glibc --python /work/torchenv/bin/python --out $D/torch_$i.json -- \
      benchmarks/peers/torch_worker.py ${TORCH_ROWS:+--rows $TORCH_ROWS} ${TORCH_STEPS:-} > $D/torch_$i.log 2>&1
  uptime >> $D/load_$i.txt
  QCOMM_MALLOC=reuse timeout 1800 .venv/bin/python -m benchmarks cluster --nodes 2 --rate 1gbit \
      --malloc glibc -- allreduce --tree resnet50 --codecs $CODECS --sync ${JAX_STEPS:---repeats 5 --warmup 1} \
      --raw-malloc > $D/jax_$i.log 2>&1
  cp bench-results/cluster.json $D/jax_$i.json
  uptime >> $D/load_$i.txt
done
