"""bench/bench_load.py's rows: every measurement's state made again from the same seed (one state on the
device at a time), and a batch whose state cannot fit the device's free memory skipped with the reason."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_load  # noqa: E402
import timing  # noqa: E402
from dflash_jax.runtime.engine import Engine, EngineConfig  # noqa: E402
from dflash_jax.synthetic import repeat_target, synthetic_drafter  # noqa: E402
from dflash_jax.tiny import tiny_target_config  # noqa: E402


@pytest.fixture(scope="module")
def engines():
    target, drafter = timing.random_pair(tiny_target_config(num_layers=4))
    spec = Engine(repeat_target(target), synthetic_drafter(drafter, 0.0),
                  EngineConfig(max_batch_size=1, max_length=96, prompt_buckets=(16,)))
    return spec, spec.derive(spec.config, drafter=None)


def test_rows_give_the_same_state_every_time_and_the_plain_engine_no_drafter_cache(engines):
    spec, plain = engines
    rows = bench_load.Rows(spec, batch=2, context=32, seed=5)
    one, two = bench_load.state_for(spec, rows), bench_load.state_for(spec, rows)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert one.draft_cache is not None and bench_load.state_for(plain, rows).draft_cache is None
    assert np.asarray(one.tokens[:, 0]).tolist() == np.asarray(bench_load.row_tokens(spec, 2)).tolist()
    assert rows.nbytes() == sum(x.nbytes for x in jax.tree.leaves(one))


def test_a_state_past_the_free_memory_is_named_with_its_size(engines, monkeypatch):
    spec, _ = engines
    rows = bench_load.Rows(spec, batch=4, context=32, seed=0)
    need = rows.nbytes()
    assert bench_load.too_large(rows, None) is None  # a device that does not say: measured
    assert bench_load.too_large(rows, 2 * need) is None
    why = bench_load.too_large(rows, need)
    assert why and "GiB" in why and "free on the device" in why

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 1000, "bytes_in_use": 300}

    monkeypatch.setattr(bench_load.jax, "devices", lambda: [Device()])
    assert bench_load.free_device_bytes() == 700
