"""bench/bench_embedded.py's measurement on a tiny pair: the speedup and where it goes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_embedded  # noqa: E402
from copycat_fixtures import shallow_copycat_pair  # noqa: E402
from dflash_jax import load_drafter, load_target  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    target_dir, drafter_dir = shallow_copycat_pair(tmp_path_factory.mktemp("pair"), block_size=4, seed=2)
    target, drafter = load_target(target_dir), load_drafter(drafter_dir)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, 95, n).tolist() for n in (5, 11)]
    args = argparse.Namespace(max_new_tokens=12, repeats=2, attention_config="")
    return bench_embedded.measure(target, drafter, prompts, 4, args)


def test_speedup_and_its_parts(report):
    assert report["identical"] and report["block_size"] == 4 and report["prompts"] == 2
    assert report["tau"] >= 1 and report["speedup"] > 0 and report["decode_speedup"] > 0
    assert report["step_cost"] > 0
    outside = report["outside_ms_per_prompt"]
    assert outside["dflash"] > 0 and outside["target_only"] > 0
    # each side's time outside its decode steps is part of its whole time
    assert outside["dflash"] * report["prompts"] < 1e3 * report["dflash_s"]
    assert outside["target_only"] * report["prompts"] < 1e3 * report["target_only_s"]
