"""The command-line tools' logging: the frameworks hushed at the default verbosity, and a heartbeat
that repeats a long phase's last line (stderr as a whole: tests/serving/test_startup_and_chat.py)."""

from __future__ import annotations

import logging
import time

from dflash_jax.verbosity import Heartbeat


def test_heartbeat_repeats_the_last_line_of_a_long_phase_and_stays_quiet_otherwise():
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    parent = logging.getLogger("dflash_jax.test_heartbeat")
    child = logging.getLogger("dflash_jax.test_heartbeat.phase")
    parent.setLevel(logging.INFO)
    parent.addHandler(Collect())
    parent.propagate = False
    with Heartbeat(parent, interval=0.2) as heartbeat:
        child.info("compiling %s", "decode")  # a child's line: watched too
        time.sleep(1.3)
        child.info("done")
        heartbeat.stop()
        time.sleep(0.5)  # stopped: nothing more
    assert records[0] == "compiling decode" and records[-1] == "done"
    reminders = records[1:-1]
    assert 3 <= len(reminders) <= 7, records
    assert all(r.startswith("compiling decode (still running after ") for r in reminders), records
