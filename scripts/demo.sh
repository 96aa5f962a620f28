#!/usr/bin/env bash
# Installs dflash-jax and runs the main job on the embedded default (CPU or accelerator).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e .
exec python serve.py demo "$@"
