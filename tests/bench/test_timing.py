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


def test_decode_timings_refuse_steps_that_did_not_run():
    """Rows that reach max_length stop, and a call's later steps would be timed without having run: both
    decode timings refuse such a count, naming themselves, and time one that fits."""
    import pytest
    from dflash_jax.runtime.engine import Engine, EngineConfig
    from dflash_jax.tiny import random_target, tiny_target_config

    engine = Engine(random_target(tiny_target_config(num_layers=1)), None,
                    EngineConfig(max_batch_size=1, max_length=40, steps_per_sync=4))
    seconds, tau = timing.time_decode(engine, 1, 8, 4, 2)  # 8 + (2 + 2) x 4 tokens: within 40
    assert seconds > 0 and tau == 1.0
    with pytest.raises(ValueError, match="time_decode: 4 steps from context 8 ran past"):
        timing.time_decode(engine, 1, 8, 4, 8)
    with pytest.raises(ValueError, match="time_decode_pipelined: 32 steps from context 8 ran past"):
        timing.time_decode_pipelined(engine, 1, 8, 4, 8)
