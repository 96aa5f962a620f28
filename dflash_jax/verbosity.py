"""What the command-line tools (``serve.py``, ``train.py``) print at their default verbosity.

Their own progress lines (the ``dflash_jax`` loggers, at INFO) and every error; of the frameworks
below them (JAX, XLA's C++ runtime, absl, Orbax, grain, Flax) only errors. At the default, JAX's
backend probing ("Unable to initialize backend 'tpu'"), XLA's C++ INFO and WARNING lines and Orbax's
absl warnings are routine chatter that buries what the tool says. ``--verbose`` shows everything at
INFO and above, as the frameworks print it.
"""

from __future__ import annotations

import logging
import os
import warnings

# Python loggers of the frameworks: quiet below ERROR at the default verbosity.
FRAMEWORK_LOGGERS = ("jax", "jaxlib", "absl", "orbax", "grain", "flax", "tensorstore", "etils", "tensorboardX")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"


def configure_logging(verbose: bool = False) -> None:
    """Sets up the process's logging for a command-line tool (call it before JAX initializes a
    backend: XLA reads ``TF_CPP_MIN_LOG_LEVEL`` once, when it first logs).

    Default: ``dflash_jax`` at INFO, other Python loggers at WARNING, the frameworks' at ERROR, XLA's
    C++ logging at ERROR (unless ``TF_CPP_MIN_LOG_LEVEL`` is set already), and the frameworks'
    Python warnings (deprecations, experimental features) hidden. ``verbose``: everything at INFO.
    """
    root = logging.getLogger()
    if not root.handlers:  # else the host process (a test runner, a notebook) keeps its own handlers and level
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        root.addHandler(handler)
        root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("dflash_jax").setLevel(logging.INFO)
    if verbose:
        for name in FRAMEWORK_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA / TSL C++: errors only
    for name in FRAMEWORK_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    pattern = "|".join(FRAMEWORK_LOGGERS)
    warnings.filterwarnings("ignore", module=rf"({pattern})(\.|$)")


__all__ = ["FRAMEWORK_LOGGERS", "configure_logging"]
