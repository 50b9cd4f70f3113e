#!/usr/bin/env bash
# Makes .venv with a Python >= 3.12 and installs jax_qcomm (building its C++ / CUDA extension).
# Idempotent: re-running rebuilds the extension only if sources changed. Source it or run it.
#
#   PYTHON=python3.13 bash scripts/bootstrap.sh   # choose the interpreter (default: the newest
#                                                  # python3.1x >= 3.12 on PATH or under pyenv)
#   QCOMM_EXTRAS=test                              # which extras of pyproject.toml to install,
#                                                  # comma-separated (default: test, everything;
#                                                  # scripts/run.sh: train; "" : the library only)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/_python.sh  # find_python

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python)
  echo "[bootstrap] creating .venv with $PY ($("$PY" --version 2>&1))"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null
# 1. Every dependency (runtime + extras), read from pyproject.toml, WITH build isolation: a
#    dependency that ships only an sdist (tensorflow-datasets' `promise`) builds with its own
#    declared build requirements, whatever this venv or the pip cache holds.
"$VPY" scripts/requirements.py "${QCOMM_EXTRAS-test}" > .venv/qcomm-requirements.txt
"$VPY" -m pip install -q -r .venv/qcomm-requirements.txt
# 2. The project itself WITHOUT build isolation, so that its build compiles against the jaxlib
#    installed in step 1 (the XLA FFI headers must match the jaxlib that loads the module).
"$VPY" -m pip install -q --no-build-isolation --no-deps -e .
"$VPY" -c 'import jax, sys, jax_qcomm.native._ffi as f; print(f"[bootstrap] Python {sys.version.split()[0]}, jax {jax.__version__}, CPU kernels: {f.cpu_isa()}, CUDA kernels: {f.has_cuda_kernels()}")'
