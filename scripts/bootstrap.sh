#!/usr/bin/env bash
# Makes .venv with a Python >= 3.12 and installs jax_qcomm (building its C++ / CUDA extension).
# Idempotent: re-running rebuilds the extension only if sources changed. Source it or run it.
#
#   PYTHON=python3.13 bash scripts/bootstrap.sh   # choose the interpreter (default: the newest
#                                                  # python3.1x >= 3.12 on PATH or under pyenv)
#   QCOMM_EXTRAS=test                              # which extras to install (default: test)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

find_python() {
  local candidates=("${PYTHON:-}")
  if [ -z "${PYTHON:-}" ]; then
    candidates+=(python3.13 python3.12 python3)
    # pyenv installs that are not on PATH (no shim activated); newest first.
    local root="${PYENV_ROOT:-$HOME/.pyenv}"
    candidates+=($(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV))
  fi
  for py in "${candidates[@]}"; do
    [ -n "$py" ] || continue
    command -v "$py" >/dev/null 2>&1 || [ -x "$py" ] || continue
    if "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
      echo "$py"; return 0
    fi
  done
  echo "error: no Python >= 3.12 found${PYTHON:+ (PYTHON=$PYTHON is not one)}; set PYTHON=/path/to/python3.12" >&2
  return 1
}

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
"$VPY" scripts/requirements.py "${QCOMM_EXTRAS:-test}" > .venv/qcomm-requirements.txt
"$VPY" -m pip install -q -r .venv/qcomm-requirements.txt
# 2. The project itself WITHOUT build isolation, so that its build compiles against the jaxlib
#    installed in step 1 (the XLA FFI headers must match the jaxlib that loads the module).
"$VPY" -m pip install -q --no-build-isolation --no-deps -e .
"$VPY" -c 'import jax, sys, jax_qcomm._ffi as f; print(f"[bootstrap] Python {sys.version.split()[0]}, jax {jax.__version__}, CPU kernels: {f.cpu_isa()}, CUDA kernels: {f.has_cuda_kernels()}")'
