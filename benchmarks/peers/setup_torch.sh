#!/usr/bin/env bash
# Makes the PyTorch venv of the peers benchmark (python -m benchmarks peers): Python 3.11 + torch +
# numpy, in .venv-torch at the repository root (or $1). Only that benchmark uses it: the library,
# the trainer and the tests never need torch.
#
# Why a separate venv: this project needs Python >= 3.12 (jax >= 0.11), and the torch wheel on
# this machine is a CPU build for Python 3.11 (torch-2.13.0+cpu-cp311, found by pip through the
# machine's find-links /opt/wheels); the torch on the package index bundles CUDA and is far larger.
# Result here: ~970 MB (du -sh .venv-torch), ~1 minute.
#
#   bash benchmarks/peers/setup_torch.sh              # -> .venv-torch
#   PYTHON311=/path/to/python3.11 bash benchmarks/peers/setup_torch.sh /tmp/venv-torch
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-$root/.venv-torch}"
torch_version="${TORCH_VERSION:-2.13.0}"

find_python311() {
  if [[ -n "${PYTHON311:-}" ]]; then echo "$PYTHON311"; return; fi
  for candidate in python3.11 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11*/bin/python3.11; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
      command -v "$candidate"; return
    fi
  done
  echo "setup_torch.sh: no Python 3.11 found (set PYTHON311=/path/to/python3.11)" >&2
  exit 69
}

python311="$(find_python311)"
echo "making $venv with $python311 and torch==$torch_version" >&2
"$python311" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "torch==$torch_version" numpy
"$venv/bin/python" - <<'PY'
import numpy, torch, torch.distributed as dist
assert dist.is_available() and dist.is_gloo_available(), "this torch has no gloo backend"
print(f"torch {torch.__version__} (gloo), numpy {numpy.__version__}")
PY
du -sh "$venv" >&2
