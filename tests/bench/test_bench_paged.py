"""``bench/bench_paged``'s comparison of a paged decode step's kernels with the contiguous step's."""

from __future__ import annotations

import argparse
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


def test_kernel_rows_time_the_same_attention_through_page_tables():
    """``--parts kernel`` on tiny shapes (interpret mode): the paged kernels, over the contiguous caches'
    pages shuffled or in order, give the contiguous kernel's output (checked inside) and their times."""
    args = argparse.Namespace(tiny=True, context=64, page_size=16, batch_list=[2], layers=36)
    (row,) = bench_paged.kernel_rows(args)
    assert row["batch"] == 2
    for variant in ("contiguous", "paged", "paged_in_order"):
        assert row[variant]["us_per_layer"] > 0 and "output" not in row[variant]
    assert row["paged_over_contiguous"] > 0 and row["paged_in_order_over_contiguous"] > 0
