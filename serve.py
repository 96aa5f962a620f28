#!/usr/bin/env python
"""Serve a target with its DFlash drafter over an OpenAI-compatible API, run batch generation over a
JSONL file, or run the demo: ``python serve.py --help``. The logic is ``dflash_jax.serving.cli``
(also installed as ``dflash-serve``)."""

import sys

from dflash_jax.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
