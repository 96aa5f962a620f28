#!/usr/bin/env bash
# Rebuilds the embedded default pair under models/embedded/ from the running interpreter's stdlib:
# tokenizer -> target pretraining -> self-generated answers -> DFlash drafter training -> DFlash2 drafter
# training (from the DFlash one) -> evaluation of both. About an hour on 2 shared CPU cores. Stages whose
# outputs exist are skipped; pass --force STAGE (tokenizer|target|answers|drafter|drafter2|eval) to redo one
# and those after it. Work files: runs/embedded_build/.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m dflash_jax.training.embedded_build --output models/embedded --work runs/embedded_build "$@"
