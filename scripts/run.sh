#!/usr/bin/env bash
# README command 1: install everything into .venv and run the main job on its embedded default.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m jax_qcomm.demo "$@"
