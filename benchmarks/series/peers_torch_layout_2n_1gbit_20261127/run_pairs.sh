#!/bin/bash
# Pairs of runs, torch then jax_qcomm, on the 2-node 1 Gbit/s simulated cluster.
# torch as under torchrun (glibc's malloc); jax_qcomm as under any launcher of the user's own
# (QCOMM_MALLOC=reuse: what tools.distributed.initialize applies itself).
D=notebooks/data/peers_torch_layout_2n_1gbit_20261127
for i in "$@"; do
  uptime > $D/load_$i.txt
  timeout 900 .venv/bin/python -m jax_qcomm.tools.cluster --nodes 2 --rate 1gbit --local-devices 1 \
      --malloc glibc --python /work/torchenv/bin/python --out $D/torch_$i.json -- \
      benchmarks/peers/torch_worker.py > $D/torch_$i.log 2>&1
  uptime >> $D/load_$i.txt
  QCOMM_MALLOC=reuse timeout 1500 .venv/bin/python -m benchmarks cluster --nodes 2 --rate 1gbit \
      --malloc glibc -- allreduce --tree resnet50 --codecs fp32 wire16 auto4 auto2 powersgd1 \
      powersgd4 --sync --repeats 5 --warmup 1 --raw-malloc > $D/jax_$i.log 2>&1
  cp bench-results/cluster.json $D/jax_$i.json
  uptime >> $D/load_$i.txt
done
