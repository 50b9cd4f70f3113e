#!/bin/bash
# The message in the pieces it travels in (8aab4b3) against the commit before it (afff243): QSGD 4
# and 2 of sync_update_2n_1gbit_20261128/run.sh, the two builds alternating, rebuilt before each
# run (the working tree's kernels, xla_ffi and jax_qcomm checked out from the commit). Run from
# the repository root with a clean tree: ab.sh 1 2 3 (pairs). The runs go to
# notebooks/data/sync_update_2n_1gbit_20261128_pieces (8aab4b3) and its before/ (afff243).
set -e
A=notebooks/data/sync_update_2n_1gbit_20261128_pieces
B=$A/before
RUN=benchmarks/series/sync_update_2n_1gbit_20261128/run.sh
P="kernels xla_ffi jax_qcomm"
build() { .venv/bin/python -m pip install -q --no-build-isolation --no-deps -e . > /dev/null 2>&1; }
mkdir -p $B
for i in "$@"; do
  git checkout -q afff243 -- $P && build && echo afff243 > $B/commit_$i.txt
  D=$B CODECS="auto4 auto2" bash $RUN $i
  git checkout -q 8aab4b3 -- $P && build && echo 8aab4b3 > $A/commit_$i.txt
  D=$A CODECS="auto4 auto2" bash $RUN $i
done
git checkout -q HEAD -- $P && build
