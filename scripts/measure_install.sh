#!/usr/bin/env bash
# Measures what each install of jax_qcomm weighs (README "Install"): the library alone
# (`pip install .`), with the `train` extra (what scripts/run.sh installs) and with the `test` extra
# (scripts/test.sh). Each goes into a fresh venv with an empty pip cache; prints one line per
# install: seconds, venv size in MiB, number of packages. Takes several minutes and ~6 GiB of disk.
#
#   bash scripts/measure_install.sh [WORKDIR]     # default WORKDIR: a new temporary directory
#
# The sources are the committed tree (git archive HEAD), copied into WORKDIR, so that the
# checkout's own build directory and .venv are not touched.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_python.sh
PY=$(find_python)
work="${1:-$(mktemp -d -t qcomm-install.XXXXXX)}"
mkdir -p "$work/src"
git archive HEAD | tar -x -C "$work/src"
echo "# $(date -u +%FT%TZ), $("$PY" --version 2>&1), $(nproc) CPUs: $(lscpu | sed -n 's/^Model name: *//p')"
for kind in lib train test; do
  venv="$work/venv-$kind"
  rm -rf "$venv"
  cache=$(mktemp -d -t qcomm-pip-cache.XXXXXX)
  spec="$work/src"
  [ "$kind" != lib ] && spec="$work/src[$kind]"
  start=$(date +%s.%N)
  "$PY" -m venv "$venv"
  PIP_CACHE_DIR="$cache" "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  PIP_CACHE_DIR="$cache" "$venv/bin/python" -m pip install -q "$spec" >"$work/log-$kind.txt" 2>&1
  end=$(date +%s.%N)
  packages=$("$venv/bin/python" -m pip list 2>/dev/null | tail -n +3 | wc -l)
  printf '%-5s %6.0f s  %5d MiB  %3d packages\n' "$kind" "$(echo "$end - $start" | bc)" \
    "$(du -sm "$venv" | cut -f1)" "$packages"
  rm -rf "$cache"
done
