"""``serve.py demo``'s comparison: both drafter generations side by side on one target, and its print."""

import re
import types

import numpy as np
import pytest

from dflash_jax.serving.demo import compare, fastest_runs, print_demo, speculative_report
from dflash_jax.tiny import random_drafter, random_target, tiny_dflash2_config, tiny_drafter_config, tiny_target_config


@pytest.fixture(scope="module")
def models():
    """A target of two layers (every program ``compare`` compiles holds each layer), each tapped by both drafters."""
    tcfg = tiny_target_config(num_layers=2)
    target = random_target(tcfg)
    drafter = random_drafter(tiny_drafter_config(tcfg, block_size=8))
    drafter2 = random_drafter(tiny_dflash2_config(tcfg, block_size=4), seed=2, std=0.05)
    return target, drafter, drafter2


@pytest.mark.slow
def test_compare_reports_both_generations_side_by_side(models, capsys):
    target, drafter, drafter2 = models
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, 95, n).tolist() for n in (5, 11)]
    report = compare(target, drafter, prompts, 12, block_sizes=(8,), repeats=1, drafter2=drafter2)
    assert report["block_size"] == 8
    second = report["dflash2"]
    assert second["block_size"] == 4  # the first generation's block size, cut to the drafter's own
    for row in (report, second):  # the speculative output is the target's, whatever the drafter
        assert row["identical"] and row["identical_prompts"] == 2
        assert row["output_tokens"] == 24 and row["tau"] >= 1.0
        assert sum(k * v for k, v in row["histogram"].items()) + 2 == row["output_tokens"]  # + the prefills' tokens
        assert row["speedup"] == pytest.approx(row["target_only_s"] / row["dflash_s"])
    assert second["target_only_s"] == report["target_only_s"]  # one target-only run for both

    report.update(pair="a tiny random pair", what="random prompts")
    print_demo(report)
    out = capsys.readouterr().out
    assert "DFlash vs DFlash2, block size 4/8, the same prompts and target-only run:" in out
    for name, row in (("DFlash", report), ("DFlash2", second)):
        line = re.search(rf"^    {name} +([0-9.]+) +([0-9.]+)x +\d+  yes \(2 of 2\)$", out, re.M)
        assert line, out
        assert float(line.group(1)) == pytest.approx(row["tau"], abs=0.005)
        assert float(line.group(2)) == pytest.approx(row["speedup"], abs=0.005)


def _row(tau: float, speedup: float, identical: int) -> dict:
    return dict(tau=tau, speedup=speedup, identical=identical == 4, identical_prompts=identical, output_tokens=400,
                dflash_s=0.5, target_only_s=0.5 * speedup, histogram={1: 3, 16: 2}, step_cost=1.5,
                decode_speedup=3.0, outside_decode_s=0.3)


def _report(**extra) -> dict:
    return dict(device="cpu (2 cores)", pair="a pair", what="prompts", prompts=4, max_new_tokens=96, block_size=8,
                block_rates={8: 800.0}, sampled=[], **_row(4.5, 0.8, 4), **extra)


def test_print_shows_the_generations_side_by_side(capsys):
    print_demo(_report(dflash2=dict(block_size=8, **_row(5.25, 0.75, 3))))
    out = capsys.readouterr().out
    table = out[out.index("DFlash vs DFlash2"):].splitlines()
    assert table[:4] == [
        "DFlash vs DFlash2, block size 8, the same prompts and target-only run:",
        "    drafter    tau  speedup  tok/s  identical greedy output",
        "    DFlash    4.50    0.80x    800  yes (4 of 4)",
        "    DFlash2   5.25    0.75x    800  NO (3 of 4)",
    ]


def test_the_report_splits_the_speedup_into_decoding_and_the_rest():
    def rows(tpot, steps):  # two prompts of 11 tokens: the prefill's first token and 10 decoded
        return [types.SimpleNamespace(acceptance_lengths=[5] * steps, num_output_tokens=11, output_ids=[1] * 11,
                                      time_per_output_token=tpot, num_steps=steps) for _ in range(2)]

    report = speculative_report(rows(0.01, 2), rows(0.03, 10), t_fast=0.5, t_slow=0.9)
    assert report["speedup"] == pytest.approx(1.8)
    assert report["decode_speedup"] == pytest.approx(3.0)       # 0.6 s of target-only decoding against 0.2 s
    assert report["outside_decode_s"] == pytest.approx(0.3)     # the DFlash run's 0.5 s less its 0.2 s decoding
    assert report["step_cost"] == pytest.approx((0.2 / 4) / (0.6 / 20))


def test_print_explains_a_speedup_below_tau_by_the_step_cost_and_the_prefills(capsys):
    print_demo(_report())
    out = capsys.readouterr().out
    assert ("costs 1.5 target-only steps, so tau 4.50 gives 3.00x while decoding; the prefills, the same work with "
            "and without the drafter, take 0.30 s of the 0.50 s, so 0.80x in all") in out


@pytest.mark.parametrize("platform,reason", [("cpu", "at the CPU's arithmetic rate"), ("gpu", "launch-bound")])
def test_print_gives_the_platforms_reason_for_the_step_cost(capsys, platform, reason):
    print_demo(_report(platform=platform))
    line = next(x for x in capsys.readouterr().out.splitlines() if "why not" in x)
    assert reason in line
    assert ("launch-bound" in line) == (platform == "gpu")


def test_print_without_a_second_generation_has_no_table(capsys):
    print_demo(_report())
    out = capsys.readouterr().out
    assert "greedy output identical with and without the drafter: yes (4 of 4 prompts)" in out
    assert "tau (tokens committed per DFlash step): 4.50" in out
    assert "DFlash2" not in out


@pytest.mark.slow
def test_compare_without_a_second_generation_reports_one(models):
    target, drafter, _ = models
    report = compare(target, drafter, [[3, 4, 5]], 6, block_sizes=(8,), repeats=1)
    assert "dflash2" not in report and report["identical"]


def test_compare_keeps_within_the_target_positions(caplog):
    tcfg = tiny_target_config(max_position_embeddings=24, num_layers=2)
    target = random_target(tcfg)
    drafter = random_drafter(tiny_drafter_config(tcfg, block_size=4))
    with caplog.at_level("WARNING", logger="dflash_jax.demo"):
        report = compare(target, drafter, [[3, 4, 5, 6]], 100, block_sizes=(4,), repeats=1)
    assert report["max_new_tokens"] == 20 and report["output_tokens"] <= 20
    assert "max_new_tokens 100: the target has 24 positions and the longest prompt 4 tokens; generating up to 20" \
        in caplog.text


def test_fastest_runs_keep_each_sides_fastest_call_and_its_own_result(monkeypatch):
    """The wall time and the results read for the report (per-row decode times) come from the same call."""
    from dflash_jax.serving import demo

    clock = iter(range(1000))
    monkeypatch.setattr(demo.time, "perf_counter", lambda: float(next(clock)))
    durations = {"spec": [5, 2, 7], "plain": [3, 4, 1]}  # clock ticks each call takes
    calls = {name: 0 for name in durations}

    def run(name):
        i = calls[name]
        calls[name] += 1
        for _ in range(durations[name][i] - 1):  # one tick is the call's own end reading
            next(clock)
        return f"{name} call {i}"

    best = fastest_runs({name: (lambda name=name: run(name)) for name in durations}, repeats=3)
    assert calls == {"spec": 3, "plain": 3}
    assert best == {"spec": (2.0, "spec call 1"), "plain": (1.0, "plain call 2")}
