#!/bin/bash
# The sharded mode against the replicated sync on the 2-node 1 Gbit/s simulated cluster, as
# sync's defaults run (bits=4) with g-bit weight differences, jax_qcomm under QCOMM_MALLOC=reuse
# (what tools.distributed.initialize applies itself). Usage: [D=folder] run.sh i g
D=${D:-notebooks/data/sharded_2n_1gbit_20261127}
i=$1; g=$2
extra=(--gather-bits "$g"); tag=g$g
uptime > $D/load_${tag}_$i.txt
QCOMM_MALLOC=reuse timeout 1200 .venv/bin/python -m benchmarks cluster --nodes 2 --rate 1gbit \
    --malloc glibc --out $D/${tag}_$i.json -- sharded --repeats 7 --warmup 2 --raw-malloc \
    "${extra[@]}" > $D/${tag}_$i.log 2>&1
uptime >> $D/load_${tag}_$i.txt
