"""The benchmarks of a multi-GPU host on tiny shapes over fake CPU devices (a smoke test of their mesh
options, so that a lease of an 8-GPU machine runs them as they are): the engine step at several
tensor-parallel degrees in one process, the training step on (data, fsdp, tensor) meshes, and an MoE
target with its experts split over the mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], tmp_path: Path) -> str:
    # The suite's XLA flags (tests/conftest.py: its faster compiles) with 8 fake devices whatever they say.
    flags = ["--xla_force_host_platform_device_count=8",
             *(f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_engine_bench_times_each_tensor_degree_in_one_process(tmp_path):
    out = tmp_path / "engine.json"
    # a 32-token context (the script's default is a 512-token prompt): the degrees' programs and their
    # collectives are the same at any context, and each compiles and runs in a fraction of the time
    stdout = _run(["bench/bench_engine.py", "--tiny", "--batches", "1", "--steps", "2", "--repeats", "1",
                   "--context", "32", "--draft-batches", "", "--tensor", "1,2", "--collectives", "--no-host-overhead", "--out", str(out)],
                  tmp_path)
    report = json.loads(out.read_text())
    assert set(report["by_tensor"]) == {"1", "2"}
    one, two = (report["by_tensor"][t]["batches"]["1"] for t in ("1", "2"))
    assert one["collectives"]["dflash"] == {} and two["collectives"]["dflash"].get("all-reduce", 0) > 0
    assert two["hbm_roofline_step_s"] == pytest.approx(one["hbm_roofline_step_s"] / 2)
    assert "TP=2" in stdout


@pytest.mark.slow
def test_train_bench_runs_the_step_on_a_mesh(tmp_path):
    # one drafter layer (the script's default is five): each layer is sharded as the first is, and the
    # meshes' losses agree as well on one as on five
    stdout = _run(["bench/bench_train.py", "--tiny", "--batch", "4", "--attention-impl", "xla", "--mesh", "1,1,1",
                   "2,2,2", "--steps", "1", "--draft-layers", "1", "--out", str(tmp_path)], tmp_path)
    rows = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(rows) == {"b4_xla", "b4_xla_mesh2x2x2"}, stdout
    one, eight = rows["b4_xla"], rows["b4_xla_mesh2x2x2"]
    assert eight["devices"] == 8 and one["devices"] == 1
    assert eight["loss"] == pytest.approx(one["loss"], rel=1e-4)


@pytest.mark.slow
def test_moe_bench_splits_the_experts_over_the_mesh(tmp_path):
    out = tmp_path / "moe.json"
    _run(["bench/bench_moe.py", "--tiny", "--families", "qwen3_moe", "--tensor", "2", "--op-tokens", "",
          "--batches", "1", "--steps", "2", "--calls", "1", "--repeats", "1", "--json", str(out)], tmp_path)
    row = json.loads(out.read_text())["qwen3_moe"]["batches"]["1"]
    assert row["target_step_s"] > 0 and row["spec_step_s"] > 0
