#!/usr/bin/env bash
# README command 2: install everything into .venv (the "test" extra: test tools, the trainer's and
# the notebooks' libraries) and run the whole test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
QCOMM_EXTRAS=test bash scripts/bootstrap.sh
# Two pytest-xdist workers, a file per worker at a time (module fixtures run once), handed out in
# the order tests/conftest.py gives them (HEAVY_FIRST; xdist would otherwise put the files with
# the most tests first); a later -n overrides (-n 0: one process, e.g. with -x or pdb).
exec .venv/bin/python -m pytest -q -ra -n 2 --dist loadfile --no-loadscope-reorder "$@"
