"""``bench/bench_paged``'s comparison of a paged decode step's kernels with the contiguous step's."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_paged  # noqa: E402


def test_kernel_delta_ranks_kernels_by_their_difference(capsys):
    base = {"attention": 10.0, "gemm": 50.0, "copy": 3.0}
    paged = {"attention": 14.5, "gemm": 50.5, "page_write": 2.0}
    delta = bench_paged.kernel_delta(base, paged, "target paged", top=3)
    assert list(delta) == ["attention", "copy", "page_write"]
    assert delta == {"attention": 4.5, "copy": -3.0, "page_write": 2.0}
    out = capsys.readouterr().out
    assert "67.0 us of kernels a step against contiguous 63.0" in out
