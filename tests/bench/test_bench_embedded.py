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


def test_profile_steps_times_each_engine(tmp_path, capsys):
    """``--profile``: the decode step of target-only and of each block size, in target-only steps (the first
    1.00); off a GPU there is no kernel trace to list, and it says so."""
    target_dir, drafter_dir = shallow_copycat_pair(tmp_path / "pair", block_size=4, seed=2)
    bench_embedded.profile_steps(load_target(target_dir), load_drafter(drafter_dir), [4, 2], str(tmp_path / "p"),
                                 context=16, steps=2)
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("decode step, ")]
    assert [line.split(":")[0] for line in steps] == ["decode step, target-only", "decode step, block 4",
                                                      "decode step, block 2"]
    assert "(1.00 target-only steps)" in steps[0] and all(" ms (" in line for line in steps)
    assert sum("profile: no GPU trace" in line for line in lines) == 2
