# Sourced by the scripts: find_python [3.N] prints a Python >= 3.12 (or exactly 3.N when given).
# Order: $PYTHON if set (and no version asked), python3.13 / python3.12 / python3 on PATH, then
# pyenv installs under $PYENV_ROOT (default ~/.pyenv) that no shim activates, newest first.

find_python() {
  local want="${1:-}" candidates=()
  if [ -n "${PYTHON:-}" ] && [ -z "$want" ]; then
    candidates=("$PYTHON")
  else
    if [ -n "$want" ]; then candidates=("python$want"); else candidates=(python3.13 python3.12 python3); fi
    local root="${PYENV_ROOT:-$HOME/.pyenv}"
    local pattern="${want:-3.1[2-9]}"
    candidates+=($(ls -d "$root"/versions/$pattern*/bin/python3 2>/dev/null | sort -rV))
  fi
  local py
  for py in "${candidates[@]}"; do
    command -v "$py" >/dev/null 2>&1 || [ -x "$py" ] || continue
    # A pyenv shim for a version that is not selected exits non-zero: skipped here.
    if "$py" -c "import sys; v = sys.version_info[:2]; sys.exit(0 if (v == tuple(map(int, '${want}'.split('.'))) if '${want}' else v >= (3, 12)) else 1)" >/dev/null 2>&1; then
      echo "$py"; return 0
    fi
  done
  echo "error: no Python ${want:->= 3.12} found${PYTHON:+ (PYTHON=$PYTHON is not one)}; set PYTHON=/path/to/python3.12" >&2
  return 1
}
