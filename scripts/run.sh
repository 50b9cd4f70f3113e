#!/usr/bin/env bash
# README command 1: install everything into .venv and run the main job on its embedded default:
# the ResNet trainer on scikit-learn's digits over 8 host CPU devices, at 32 and at 4 bits.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"  # TF is only the input pipeline here
exec .venv/bin/python -m training.embedded "$@"
