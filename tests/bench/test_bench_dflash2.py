"""bench/bench_dflash2.py's kernel table: a draft loop's kernels from a trace, each named with its origin."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_dflash2  # noqa: E402


def _events() -> list[dict]:
    """A trace of two draft loops: GPU kernels (pid 1) inside each loop's host annotation (pid 0)."""
    meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
            dict(ph="M", name="process_name", pid=0, args=dict(name="/host:CPU"))]
    loops = [dict(ph="X", name="draft_loop_dflash", pid=0, ts=0, dur=100),
             dict(ph="X", name="draft_loop_dflash2", pid=0, ts=200, dur=100)]
    kernel = lambda name, ts, dur, hlo=None: dict(ph="X", name=name, pid=1, ts=ts, dur=dur,  # noqa: E731
                                                  args=dict(hlo_op=hlo) if hlo else {})
    gpu = [kernel("dflash_cached_attention", 10, 5), kernel("dflash_cached_attention", 20, 5),
           kernel("gemm_fusion_dot_1", 30, 40, "gemm_fusion_dot.1"),
           kernel("dflash_cached_attention", 210, 5), kernel("dflash_cached_attention", 220, 5),
           # one kernel name launched for two instructions (XLA reuses the kernel of identical fusions)
           kernel("loop_slice_fusion_2", 230, 3, "loop_slice_fusion.2"),
           kernel("loop_slice_fusion_2", 240, 3, "loop_slice_fusion.7"),
           kernel("gemm_fusion_dot_1", 250, 40, "gemm_fusion_dot.1"),
           kernel("unknown_kernel", 295, 1)]
    return meta + loops + gpu


def test_kernel_table_counts_passes_and_names_each_kernels_origins():
    sources = {"dflash2": {"loop_slice_fusion_2": "slice @ dflash2.py:109 (prepare)",
                           "loop_slice_fusion_7": "slice @ dflash2.py:110 (prepare)",
                           "gemm_fusion_dot_1": "dot_general @ linear.py:40 (dense)"}}
    table = bench_dflash2.kernel_table(_events(), steps=4, drafter_layers=2, sources=sources)
    assert set(table) == {"dflash", "dflash2"}
    one, two = table["dflash"], table["dflash2"]
    # one pass traced in each loop: as many attention kernels as the drafter has layers
    assert one["passes_traced"] == two["passes_traced"] == 1
    assert (one["per_pass"], two["per_pass"]) == (3, 6)
    assert (one["busy_us_per_pass"], two["busy_us_per_pass"]) == (50, 57)
    largest = {k["name"]: k for k in two["largest"]}
    assert [k["name"] for k in two["largest"]][0] == "gemm_fusion_dot_1"
    assert largest["loop_slice_fusion_2"]["launches_per_pass"] == 2
    assert largest["loop_slice_fusion_2"]["sources"] == ["slice @ dflash2.py:109 (prepare)",
                                                         "slice @ dflash2.py:110 (prepare)"]
    assert largest["gemm_fusion_dot_1"]["sources"] == ["dot_general @ linear.py:40 (dense)"]
    assert largest["unknown_kernel"]["sources"] == []
    # the DFlash loop's program has no sources given: its kernels are still counted, unnamed
    assert all(k["sources"] == [] for k in one["largest"])


def test_kernel_table_without_a_gpu_trace_is_empty():
    assert bench_dflash2.kernel_table([], steps=4, drafter_layers=2, sources={}) == {}
