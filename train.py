#!/usr/bin/env python
"""Train a DFlash drafter, export a checkpoint to the z-lab format, or pretrain a small target:
``python train.py --help``. The logic is ``dflash_jax.training.cli`` (also installed as ``dflash-train``)."""

import sys

from dflash_jax.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
