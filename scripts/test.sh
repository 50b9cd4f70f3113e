#!/usr/bin/env bash
# README command 2: install everything into .venv and run the whole test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q -ra "$@"
