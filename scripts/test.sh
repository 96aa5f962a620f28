#!/usr/bin/env bash
# Installs dflash-jax with its test extra (the oracles: torch 2.13.0 CPU, transformers, dflash, speculators) and
# runs the whole suite on the CPU. The README's test command; .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]"
# The authors' package pins datasets/tqdm in its base requirements: install it without them.
python -m pip install -q --no-deps "dflash==0.1.0"
# vLLM's trainer (the DFlash2 modules and objective, the authors' code vendored): without its GPU stack.
python -m pip install -q --no-deps "speculators==0.9.0"
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
export JAX_PLATFORMS=cpu
# Two worker processes (pytest-xdist; PYTEST_WORKERS to change, 0 for one process): the suite is mostly
# single-threaded XLA compilation, so on CI's 2 cores two processes take about half the time. Whole modules
# go to one worker (--dist loadfile), so a module's shared engines and models are built and compiled once;
# they go in the order tests/conftest.py gives them (--no-loadscope-reorder): the modules of most slow tests
# first, so that the last ones are short and both workers finish together.
exec python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
