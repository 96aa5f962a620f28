"""bench/bench_topk.py on the CPU: every variant is checked (against lax.top_k; the thresholds against each
other) before it is timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_topk  # noqa: E402


def test_times_each_variant_after_checking_it(capsys):
    bench_topk.main(["--rows", "2,3", "--vocab", "3000", "--k", "8", "--repeats", "1",
                     "--variants", "lax;ops;chunks:64;chunks:64,8"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["lax", "ops", "chunks:64", "chunks:64,8"]


def test_an_unknown_variant_is_named():
    with pytest.raises(SystemExit, match="sorted"):
        bench_topk.main(["--variants", "sorted"])


def test_thresholds_times_the_sorted_and_the_searched_fallback(capsys):
    bench_topk.main(["--rows", "2", "--vocab", "3000", "--repeats", "1", "--thresholds"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["sort", "search"]
