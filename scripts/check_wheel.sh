#!/usr/bin/env bash
# Builds the wheel as a user would (`pip wheel .`, build isolation), installs it into a clean venv
# OUTSIDE the checkout and runs a 4-bit compressed allreduce inside shard_map over 8 host CPU
# devices there, asserting that the C++ FFI kernels ran (not the pure-JAX fallback).
#
#   bash scripts/check_wheel.sh            # PYTHON=... chooses the interpreter (as bootstrap)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_python.sh
PY=$(find_python)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "[wheel] building with $PY ($("$PY" --version 2>&1)) into $work/dist"
"$PY" -m pip wheel -q --no-deps . -w "$work/dist"  # --no-deps: only our wheel, not jax's
wheel=$(ls "$work"/dist/jax_qcomm-*.whl)
echo "[wheel] $(basename "$wheel"): $(du -h "$wheel" | cut -f1); compiled modules:"
# The listing is read once into a variable: `zipfile -l | grep -q` under pipefail fails whenever
# grep exits before zipfile has written everything (a broken pipe in the lister).
listing=$("$PY" -m zipfile -l "$wheel")
awk '/\.so/ {print "  " $1}' <<<"$listing"
grep -q '_qcomm_cpu.*\.so' <<<"$listing" || { echo "error: no CPU module in the wheel" >&2; exit 1; }
for tool in efficiency distributed launch cluster; do  # the tooling subpackage ships too
  grep -q "jax_qcomm/tools/$tool.py" <<<"$listing" \
    || { echo "error: jax_qcomm/tools/$tool.py is not in the wheel" >&2; exit 1; }
done
"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel"
cp scripts/wheel_smoke.py "$work/"
cd "$work"  # nothing of the checkout is importable from here
"$work/venv/bin/python" wheel_smoke.py
