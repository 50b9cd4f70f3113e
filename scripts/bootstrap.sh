#!/usr/bin/env bash
# Makes .venv with a Python >= 3.12 and installs jax_qcomm (building its C++ / CUDA extension).
# Idempotent: re-running rebuilds the extension only if sources changed. Source it or run it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

find_python() {
  local candidates=("${PYTHON:-}" python3.13 python3.12 python3
                    /root/.pyenv/versions/3.13*/bin/python3.13 /root/.pyenv/versions/3.12*/bin/python3.12
                    "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3)
  for py in "${candidates[@]}"; do
    [ -n "$py" ] || continue
    command -v "$py" >/dev/null 2>&1 || [ -x "$py" ] || continue
    if "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
      echo "$py"; return 0
    fi
  done
  echo "error: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2
  return 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python)
  echo "[bootstrap] creating .venv with $PY ($("$PY" --version))"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# Build requirements first, then the package without build isolation: the build reuses the
# jaxlib of the venv for the XLA FFI headers instead of downloading a second copy.
"$VPY" -m pip install -q --upgrade pip >/dev/null
"$VPY" -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" "jax>=0.11" "jaxlib>=0.11" cmake ninja
"$VPY" -m pip install -q --no-build-isolation -e ".[test]"
"$VPY" -c 'import jax, jax_qcomm._ffi as f; print(f"[bootstrap] jax {jax.__version__}, CPU kernels: {f.cpu_isa()}, CUDA kernels: {f.has_cuda_kernels()}")'
