"""bench/bench_experts.py off the GPU: its tiny mode checks every implementation against the reference
and writes the per-layer times (the Mosaic GPU kernel in interpret mode where jax >= 0.11 has it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_experts  # noqa: E402
from kernels_pallas._mosaic import mosaic_interpret_available  # noqa: E402


def test_tiny_mode_checks_outputs_and_writes_json(tmp_path):
    out = tmp_path / "experts.json"
    bench_experts.main(["--tiny", "--families", "gpt_oss", "--tokens", "3", "--layers", "1", "--repeats", "1",
                        "--json", str(out)])
    row = json.loads(out.read_text())["gpt_oss"]["tokens"]["3"]
    assert set(bench_experts.XLA_IMPLEMENTATIONS) <= set(row["seconds"])
    assert not row["failed"] and all(err < 2e-2 for err in row["errors"].values())
    if mosaic_interpret_available():
        assert {"mosaic", "mosaic kernels"} <= set(row["seconds"])
    else:
        assert "jax < 0.11" in row["mosaic_skipped"]
