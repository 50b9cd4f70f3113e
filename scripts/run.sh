#!/usr/bin/env bash
# README command 1: install what the main job needs into .venv (the library and the example
# trainer's extra, "train"; not the test tools) and run it on its embedded default: the ResNet
# trainer on scikit-learn's digits over 8 host CPU devices, at 32 and at 4 bits.
# QCOMM_EXTRAS=train,notebooks (for example) installs more.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
QCOMM_EXTRAS="${QCOMM_EXTRAS:-train}" bash scripts/bootstrap.sh
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"  # TF is only the input pipeline here
exec .venv/bin/python -m training.embedded "$@"
