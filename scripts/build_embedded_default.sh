#!/usr/bin/env bash
# Rebuilds the embedded default pair under models/embedded/ from the running interpreter's stdlib:
# tokenizer -> target pretraining -> the target's own answers -> DFlash drafter training -> DFlash2
# drafter training (from the DFlash one) -> evaluation of both, all in one process. Sized for one
# accelerator (hours on a CPU; `--tiny` checks the whole pipeline there in a few minutes with a toy model).
# Stages whose outputs exist are skipped; --force STAGE (tokenizer|target|answers|drafter|drafter2|eval)
# redoes one and those after it; --until STAGE stops after one (a later run continues). Work files:
# runs/embedded_build/ (or --work DIR). --output DIR writes elsewhere;
# --pack DIR also writes the output as DIR/embedded.tar.partNN (<= 15 MiB each), restored by
#   python -m dflash_jax.training.embedded_build --unpack DIR --output models/embedded
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m dflash_jax.training.embedded_build --output models/embedded --work runs/embedded_build "$@"
