"""One persistent kernel for a chain of dependent decode matmuls (Pallas Mosaic GPU): the measurement
of whether the batch-1 step's per-kernel fixed costs can be hidden. NOT used by the engine.

Why: at batch 1 every layer matmul streams its weight at ~4.4-4.6 TB/s once running, but each also
pays ~2.5-3.8 us to fill and drain, and a split-K reduction kernel after it (docs/benchmarks.md,
tenth session). A persistent kernel has no boundaries: each program keeps a ring of weight tiles in
flight across matmuls, as weights depend on nothing, and waits only for the previous matmul's output
at a grid-wide barrier, before its first tensor-core step.

The chain: ``y[l] = x[l] @ w[l]`` (bf16 out of a float32 accumulation), ``x[l + 1] = y[l]``, with
``w [L, D, D]`` and ``rows`` rows (1: a decode token; 16: a verify block), padded to a multiple of 8.
Program ``p`` owns output columns ``[p * block_n, (p + 1) * block_n)`` of every matmul (``D / block_n``
programs, all resident: one per SM). Each step is one WGMMA with the weight tile as the transposed
left operand and the x tile as the right one, ``acc[block_n, rows] += w^T @ x^T``. Mosaic stores a
WGMMA fragment to a transposed view only from its transposed register layout, so the output tile is
shuffled into that layout, written transposed into an unswizzled buffer, and leaves by TMA in its
natural orientation, ``y[l, :, columns]``. (The other shape, x as the left operand padded to the
WGMMA's 64 rows, was measured slower: its 64-row x slots leave less shared memory for weight tiles.)

Synchronisation: after its output tile's TMA store completes, a program increments the global
counter of matmul ``l`` (release, GPU scope); before matmul ``l + 1`` each program spins until that
counter reaches the number of programs (acquire), then copies its x tiles by TMA. At the end program
0 waits for every program's exit signal and returns the counters to zero, so the kernel is correct
whether or not ``pl.get_global`` semaphores persist across calls.

No CPU test: the grid-wide barrier has no interpret mode. ``bench_persistent_chain.py`` checks every
variant on the device against float32 dots, link by link.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class ChainConfig:
    """``block_n`` output columns per program (the WGMMA's M), ``block_k`` rows of K per weight
    tile, ``stages`` weight and x tiles in flight per program (the weights cross matmul boundaries;
    x cannot, it is not ready before the barrier)."""

    block_n: int = 64
    block_k: int = 256
    stages: int = 5
    # False: every matmul multiplies x[0] (no barrier): the kernel's streaming ceiling.
    dependent: bool = True

    def smem_bytes(self, rows: int, itemsize: int = 2) -> int:
        """Shared memory for ``rows`` padded rows: the weight and x rings, the output tile."""
        return (self.stages * self.block_k * (self.block_n + rows) + rows * self.block_n) * itemsize


def padded_rows(rows: int) -> int:
    """The rows the activations carry: a multiple of 8, the WGMMA's least N."""
    return -(-rows // 8) * 8


def supports(layers: int, d: int, rows: int, config: ChainConfig) -> bool:
    c = config
    # Dependent chains need every program resident (one per SM) for the grid-wide barrier.
    return (c.block_n % 64 == 0 and d % c.block_n == 0 and d % c.block_k == 0 and c.block_k % 64 == 0
            and (d // c.block_n <= 132 or not c.dependent) and 1 <= rows <= 256
            and 2 <= c.stages <= layers * (d // c.block_k) and c.smem_bytes(padded_rows(rows)) <= 220 * 1024)


def _fence_proxy_async():
    """Orders this thread's generic-proxy accesses with TMA (async-proxy) ones, both ways: the
    counters are generic atomics, the outputs and inputs move by TMA."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    @plgpu.inline_mgpu()
    def fence(_ctx):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global;", "", has_side_effects=True)

    fence()


def persistent_chain(x0: jax.Array, w: jax.Array, config: ChainConfig = ChainConfig()) -> jax.Array:
    """``x0 [R, D]`` (``R = padded_rows(rows)``), ``w [L, D, D]`` -> every matmul's output
    ``y [L, R, D]``: ``y[l] = x[l] @ w[l]``, ``x[l + 1] = y[l]``."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    layers, d, d_out = w.shape
    c = config
    rows = x0.shape[0]
    if (d != d_out or x0.shape[1] != d or rows != padded_rows(rows) or x0.dtype != w.dtype
            or not supports(layers, d, rows, c)):
        raise ValueError(f"persistent_chain: x0 {x0.shape} {x0.dtype}, w {w.shape} {w.dtype} not supported by {c}")
    programs, k_tiles = d // c.block_n, d // c.block_k
    steps = layers * k_tiles
    itemsize = jnp.dtype(w.dtype).itemsize

    def transforms(minor: int):
        swizzle = plgpu.find_swizzle(minor * itemsize * 8)
        return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)

    def body(x_gmem, w_gmem, y_gmem, w_smem, x_smem, out_smem, w_ready, x_ready):
        p = lax.axis_index("p")
        done = pl.get_global(plgpu.SemaphoreType.REGULAR((layers,)))
        exited = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        cols = pl.ds(p * c.block_n, c.block_n)

        def fetch_weights(step):
            slot = step % c.stages
            layer, kk = step // k_tiles, step % k_tiles
            plgpu.copy_gmem_to_smem(w_gmem.at[layer, pl.ds(kk * c.block_k, c.block_k), cols],
                                    w_smem.at[slot], w_ready.at[slot])

        def fetch_x(step, src):
            slot, kk = step % c.stages, step % k_tiles
            plgpu.copy_gmem_to_smem(src.at[:, pl.ds(kk * c.block_k, c.block_k)], x_smem.at[slot], x_ready.at[slot])

        def with_x_source(layer, fn):
            """``fn(x[layer])``: the input, or the previous matmul's output in GMEM."""
            if not c.dependent:
                fn(x_gmem)
                return
            pl.when(layer == 0)(lambda: fn(x_gmem))
            pl.when(layer > 0)(lambda: fn(y_gmem.at[layer - 1]))

        for step in range(c.stages - 1):
            fetch_weights(step)

        def matmul(layer, carry):
            if c.dependent:
                @pl.when(layer > 0)
                def _():
                    plgpu.semaphore_wait(done.at[layer - 1], programs, decrement=False, memory_scope="gpu")
                    _fence_proxy_async()

            def fetch_first(src):
                for j in range(min(c.stages - 1, k_tiles)):
                    fetch_x(layer * k_tiles + j, src)

            with_x_source(layer, fetch_first)

            def accumulate(acc_ref):
                def k_step(kk, carry):
                    step = layer * k_tiles + kk
                    slot = step % c.stages
                    plgpu.barrier_wait(x_ready.at[slot])
                    plgpu.barrier_wait(w_ready.at[slot])
                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(w_smem.at[slot], (1, 0)),
                                plgpu.transpose_ref(x_smem.at[slot], (1, 0)))
                    plgpu.wgmma_wait(1)  # the previous step's WGMMA is done: its slot is free

                    @pl.when(step + c.stages - 1 < steps)
                    def _():
                        fetch_weights(step + c.stages - 1)

                    @pl.when(kk + c.stages - 1 < k_tiles)
                    def _():
                        with_x_source(layer, lambda src: fetch_x(step + c.stages - 1, src))

                    return carry

                lax.fori_loop(0, k_tiles, k_step, None)
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((c.block_n, rows)))
            y_tile = plgpu.layout_cast(acc.astype(out_smem.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
            # .at: JAX 0.11.2's transpose_ref takes a view, not the bare scratch ref
            plgpu.transpose_ref(out_smem.at[:, :], (1, 0))[...] = y_tile
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, y_gmem.at[layer, :, cols])
            plgpu.wait_smem_to_gmem(0)
            if c.dependent:
                _fence_proxy_async()
                plgpu.semaphore_signal(done.at[layer], 1, memory_scope="gpu")
            return carry

        lax.fori_loop(0, layers, matmul, None)
        if c.dependent:
            plgpu.semaphore_signal(exited, 1, memory_scope="gpu")

            @pl.when(p == 0)
            def _():
                plgpu.semaphore_wait(exited, programs, decrement=True, memory_scope="gpu")
                for layer in range(layers):
                    plgpu.semaphore_signal(done.at[layer], -programs, memory_scope="gpu")

    scratch = (plgpu.SMEM((c.stages, c.block_k, c.block_n), w.dtype, transforms=transforms(c.block_n)),
               plgpu.SMEM((c.stages, rows, c.block_k), w.dtype, transforms=transforms(c.block_k)),
               plgpu.SMEM((rows, c.block_n), w.dtype),  # unswizzled: written through a transposed view
               plgpu.Barrier(num_arrivals=1, num_barriers=c.stages),
               plgpu.Barrier(num_arrivals=1, num_barriers=c.stages))
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((layers, rows, d), w.dtype),
                          scratch_types=scratch, grid=(programs,), grid_names=("p",))
    return kernel(x0, w)
