"""Pieces shared by the Pallas Mosaic GPU (Hopper: TMA, WGMMA) kernels: the shared-memory budget,
swizzled operand layouts, the async-proxy fence, and the ready counters of persistent kernels
(``layer_tail_gpu``; the measured kernels of ``bench/`` import them too).

A persistent kernel's phases wait on each other through ready counters (``pl.get_global``
semaphores), one per ``flag_cols`` output columns of a phase: a program counts each output tile it
has stored into the (one or two) groups the tile overlaps, and a reader waits, before its first x
copy from a group, until that group has all its tiles."""

from __future__ import annotations

from collections.abc import Sequence

# Shared memory a kernel may claim of the H200's 227 KB per block (the rest: barriers, Mosaic's own).
SMEM_BUDGET = 220 * 1024
WGMMA_M = 64  # the rows of a WGMMA's left operand and accumulator


def swizzled(minor: int, itemsize: int) -> tuple:
    """The shared-memory transforms of a TMA / WGMMA operand whose rows hold ``minor`` elements of
    ``itemsize`` bytes: 8-row tiles, swizzled by the widest pattern that divides a row."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def fence_proxy_async():
    """Orders this thread's generic-proxy accesses with TMA (async-proxy) ones, both ways: the
    counters are generic atomics, the outputs and inputs move by TMA."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    @plgpu.inline_mgpu()
    def fence(_ctx):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global;", "", has_side_effects=True)

    fence()


def group_tiles(flag_cols: int, width: int, g):
    """How many output tiles ``width`` columns wide overlap column group ``g`` (``flag_cols`` wide)."""
    return ((g + 1) * flag_cols - 1) // width - (g * flag_cols) // width + 1


def count_into_groups(ready, first: int, flag_cols: int, width: int, t):
    """Counts stored output tile ``t`` (``width`` columns) into the ready counters of the (one or
    two) column groups it overlaps; ``ready.at[first]`` is its phase's first group."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    g0, g1 = (t * width) // flag_cols, (t * width + width - 1) // flag_cols
    plgpu.semaphore_signal(ready.at[first + g0], 1, memory_scope="gpu")
    pl.when(g1 != g0)(lambda: plgpu.semaphore_signal(ready.at[first + g1], 1, memory_scope="gpu"))


def reset_ready_counters(ready, exited, drained, p, programs: int, totals: Sequence[int]) -> None:
    """At a kernel's end, returns its ready counters (``ready.at[i]`` reached ``totals[i]``, static)
    and its two exit counters to zero, so the next call starts from zeros whether or not
    ``pl.get_global`` semaphores persist. Once every program has passed its last wait, program ``i``
    resets counter ``i`` (there are no more counters than programs), then program 0 the exit counters."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    plgpu.semaphore_signal(exited, 1, memory_scope="gpu")
    plgpu.semaphore_wait(exited, programs, decrement=False, memory_scope="gpu")
    for i, total in enumerate(totals):  # (a signal's value must be static)
        pl.when(p == i)(lambda i=i, total=total: plgpu.semaphore_signal(ready.at[i], -total, memory_scope="gpu"))
    plgpu.semaphore_signal(drained, 1, memory_scope="gpu")

    @pl.when(p == 0)
    def _():
        plgpu.semaphore_wait(drained, programs, decrement=True, memory_scope="gpu")
        plgpu.semaphore_signal(exited, -programs, memory_scope="gpu")
