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
import threading
import time
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


class Heartbeat(logging.Handler):
    """While a long phase runs, repeats its last log line every ``interval`` seconds that pass without
    another (a single compile can outlast a person's patience; a silent program looks hung).

    A context manager: it watches the records of ``logger`` and its children (``dflash_jax``: every
    progress line of the package), and each reminder, ``"<last line> (still running after N s)"``,
    goes out through the logger of that line."""

    def __init__(self, logger: logging.Logger, interval: float = 5.0):
        super().__init__(logging.INFO)
        self.logger, self.interval = logger, interval
        self._last: logging.LogRecord | None = None
        self._since = self._heard = time.perf_counter()
        self._lock_ = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self.logger.addHandler(self)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Ends the reminders (the long phases are over); idempotent."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        self.logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "heartbeat", False):
            return
        with self._lock_:
            self._last, self._since = record, time.perf_counter()
            self._heard = self._since

    def _beat(self) -> None:
        while not self._done.wait(min(1.0, self.interval)):
            with self._lock_:
                now = time.perf_counter()
                if self._last is None or now - self._heard < self.interval:
                    continue
                self._heard = now
                record, since = self._last, self._since
            logging.getLogger(record.name).info("%s (still running after %.0f s)", record.getMessage(), now - since,
                                                extra={"heartbeat": True})


__all__ = ["FRAMEWORK_LOGGERS", "Heartbeat", "configure_logging"]
