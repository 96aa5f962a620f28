"""``bench/timing``'s reading of a profiler trace into calls."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import timing  # noqa: E402


def test_call_spans_split_a_trace_at_its_longest_gaps():
    # Three calls of three kernels each; within a call the gaps are short, between calls long (and one
    # kernel of the second call overlaps the next kernel: its end, not its start, bounds the gap).
    starts = [0, 10, 25, 1000, 1004, 1020, 3000, 3003, 3050]
    durs = [5, 5, 5, 30, 2, 5, 1, 1, 7]
    events = [{"name": "k", "ts": t, "dur": d} for t, d in zip(starts, durs)]
    assert timing.call_spans(events, 3) == [(0, 30), (1000, 1030), (3000, 3057)]
    assert timing.call_spans(events, 1) == [(0, 3057)]
    assert timing.call_spans([], 3) == []
