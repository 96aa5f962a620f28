"""The warm-up plan: every shape a server meets, a lone request's first; the shapes of a lone short
request, which serve.py compiles before it binds."""

from __future__ import annotations

from collections import Counter

import pytest

from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.runtime.warmup import Shape, first_request_shapes, warmup_plan
from dflash_jax.tiny import random_target, tiny_target_config


@pytest.fixture(scope="module")
def target():
    return random_target(tiny_target_config())


def test_plan_lists_every_shape_a_server_meets_a_lone_request_first(target):
    engine = Engine(target, None, EngineConfig(max_batch_size=2, max_length=100, steps_per_sync=4))
    plan = warmup_plan(engine)
    assert len(plan) == len(set(plan))
    counts = Counter(s.phase for s in plan)
    windows, buckets = len(engine.windows), len(engine.prompt_buckets())
    # decode per running state (1 and 2 rows) and window; prefills of 1 and 2 rows per bucket; a lone
    # prefill joins either state, a pair the 2-row one; resizes both ways; a release per state
    assert counts == {"decode": 2 * windows, "prefill": 2 * buckets, "admit": 3 * buckets, "resize": 2, "release": 2}
    lone = [s for s in plan if s.rows == 1 and s.phase in ("decode", "prefill") or s.into == 1 and s.phase == "admit"]
    assert plan[:len(lone)] == lone  # what a lone request runs comes first
    assert plan[0] == Shape("decode", 1, engine.windows[0])
    assert warmup_plan(engine, [1]) == [s for s in lone] + [Shape("release", 1)]


def test_first_request_shapes_cover_the_windows_the_host_picks(target):
    engine = Engine(target, None, EngineConfig(max_batch_size=8, max_length=2048, steps_per_sync=8))
    plan = warmup_plan(engine)
    first = first_request_shapes(engine, plan, 64, 256)
    # a 1..64-token prompt in buckets 16, 32, 64; its calls' windows cover start + 8 steps of one token
    # (>= 9: 64) up to the last token it can write (64 + 256 - 2 + 1: 512)
    assert [s for s in first if s.phase == "prefill"] == [Shape("prefill", 1, b) for b in (16, 32, 64)]
    assert [s for s in first if s.phase == "admit"] == [Shape("admit", 1, b, 1) for b in (16, 32, 64)]
    assert [s.size for s in first if s.phase == "decode"] == [64, 128, 256, 512]
    assert all(s in plan for s in first) and len(first) < len(plan) / 4
    assert str(first[0]) == "decode, 1 row, attention window 64"
