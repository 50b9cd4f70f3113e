#!/bin/bash
# The PowerSGD rows again after the unrolled factor products: pairs of runs, torch then
# jax_qcomm (PowerSGD ranks 1 and 4 only), as run_pairs.sh.
D=notebooks/data/peers_torch_layout_2n_1gbit_20261127
for i in "$@"; do
  uptime > $D/load_psgd_$i.txt
  timeout 900 .venv/bin/python -m jax_qcomm.tools.cluster --nodes 2 --rate 1gbit --local-devices 1 \
      --malloc glibc --python /work/torchenv/bin/python --out $D/torch_psgd_$i.json -- \
      benchmarks/peers/torch_worker.py --rows ddp_fp32 ddp_powersgd1 ddp_powersgd4 \
      > $D/torch_psgd_$i.log 2>&1
  uptime >> $D/load_psgd_$i.txt
  QCOMM_MALLOC=reuse timeout 1500 .venv/bin/python -m benchmarks cluster --nodes 2 --rate 1gbit \
      --malloc glibc -- allreduce --tree resnet50 --codecs powersgd1 powersgd4 --sync --repeats 5 \
      --warmup 1 --raw-malloc > $D/jax_psgd_$i.log 2>&1
  cp bench-results/cluster.json $D/jax_psgd_$i.json
  uptime >> $D/load_psgd_$i.txt
done
