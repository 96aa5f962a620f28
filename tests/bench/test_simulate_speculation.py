"""bench/simulate_speculation.py: the adaptive policy replayed on H200 step costs (Qwen3-8B shapes, context
1024 and 32k) with geometric acceptance drawn per row, against fixed block 16 and target-only."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import simulate_speculation as sim  # noqa: E402
from dflash_jax.runtime.speculation import rate_for_tau  # noqa: E402

# (context, batch): target-only step, then seconds per step of blocks 16, 8, 4, 1 (one H200, bench_load.py).
MEASURED = {
    (1024, 2): (0.004605, (0.005340, 0.004956, 0.004739, 0.004610)),
    (1024, 4): (0.004794, (0.006134, 0.005336, 0.005048, 0.004741)),
    (1024, 8): (0.004920, (0.006373, 0.005914, 0.005592, 0.004915)),
    (1024, 64): (0.007441, (0.027476, 0.016374, 0.009781, 0.007577)),
    (32768, 1): (0.006056, (0.006800, 0.006112, 0.005963, 0.005693)),
}


@pytest.mark.parametrize("context,batch", list(MEASURED))
@pytest.mark.parametrize("tau16", [1.5, 6.0])
def test_adaptive_is_never_slower_than_target_only_nor_fixed_where_fixed_pays(context, batch, tau16):
    target_step, seconds = MEASURED[(context, batch)]
    costs = {(batch, b): s for b, s in zip((16, 8, 4, 1), seconds)}
    rate = rate_for_tau(tau16, 16)
    rs = np.random.RandomState(0)
    fixed, adaptive = [], []
    for _ in range(8):
        paths = [rs.rand(context + 1200) < rate for _ in range(min(batch, 16))]
        bits = [paths[r % len(paths)] for r in range(batch)]
        fixed.append(sim.run("fixed", bits, context, costs, batch, steps=8, calls=6)["tok_s"])
        adaptive.append(sim.run("adaptive", bits, context, costs, batch, steps=8, calls=6)["tok_s"])
    target = batch / target_step
    assert np.mean(adaptive) >= 0.98 * target
    if np.mean(fixed) > target:
        assert np.mean(adaptive) >= 0.98 * np.mean(fixed)


def test_a_step_commits_the_bonus_and_the_drafts_right_in_a_row():
    bits = np.array([0, 1, 1, 0, 1, 1, 1, 1, 1], bool)
    assert sim.step(bits, 0, 16) == 3 and sim.step(bits, 3, 4) == 4 and sim.step(bits, 2, 1) == 1


@pytest.mark.parametrize("context,batch", [(1024, 2), (1024, 4), (1024, 8), (32768, 1)])
def test_a_fresh_batch_takes_the_large_block_when_it_pays_on_the_measured_acceptance_path(context, batch):
    """The draws the synthetic drafter keyed by position alone made for every row at tau 6 (the load report
    the costs come from): from the first timed call on, adaptive keeps up with fixed block 16."""
    target_step, seconds = MEASURED[(context, batch)]
    costs = {(batch, b): s for b, s in zip((16, 8, 4, 1), seconds)}
    bits = [sim.synthetic_bits(rate_for_tau(6.0, 16), context, 1200)] * batch
    fixed = sim.run("fixed", bits, context, costs, batch, steps=8, calls=6)
    adaptive = sim.run("adaptive", bits, context, costs, batch, steps=8, calls=6)
    assert adaptive["tok_s"] >= 0.98 * fixed["tok_s"]
    assert adaptive["blocks"][0] == 16 or batch == 4  # at batch 4 block 8 is near the break-even on this path


@pytest.mark.slow
def test_the_replayed_draws_are_the_synthetic_drafters():
    """``synthetic_bits`` and ``step`` give the acceptance lengths an engine with the synthetic drafter
    commits, row by row (each keyed by its first token), batched."""
    from dflash_jax.runtime.engine import Engine, EngineConfig
    from dflash_jax.synthetic import repeat_target, synthetic_drafter
    from dflash_jax.tiny import random_drafter, random_target, tiny_drafter_config, tiny_target_config

    tcfg = tiny_target_config(num_layers=2)
    target = repeat_target(random_target(tcfg, seed=3))
    drafter = synthetic_drafter(random_drafter(tiny_drafter_config(tcfg, block_size=8),
                                               seed=4), 0.6, seed=2)
    prompts = [[5, 9, 11], [7, 3, 3, 3, 3]]
    engine = Engine(target, drafter, EngineConfig(max_batch_size=2, max_length=120, prompt_buckets=(16,)))
    for prompt, result in zip(prompts, engine.generate(prompts, 100)):
        bits = sim.synthetic_bits(0.6, len(prompt), 200, seed=2, first_token=prompt[0])
        pos, want = len(prompt), []
        for _ in result.acceptance_lengths[:-1]:  # the last step is cut at max_length
            want.append(sim.step(bits, pos, 8))
            pos += want[-1]
        assert result.acceptance_lengths[:-1] == want


@pytest.mark.slow
def test_bench_load_tiny_runs_nothing_compiles_in_timed_calls_and_the_replay_chooses_its_blocks(tmp_path):
    import json

    import bench_load

    out = tmp_path / "load.json"
    bench_load.main(["--tiny", "--sweep", "64:2", "--taus", "3,6", "--json", str(out), "--png", str(tmp_path / "x.png")])
    report = json.loads(out.read_text())
    (entry,) = report["results"]
    assert entry["compiled_while_timing"] == [] and len(set(entry["first_tokens"])) == 2
    for replayed in sim.simulate(report, steps=report["config"]["steps"], calls=report["config"]["calls"], paths=0,
                                 rows=2, settings=sim.SpeculationSettings(), shared=False):
        assert replayed["adaptive"]["blocks"] == replayed["measured"]["adaptive"]["blocks"]
