"""One persistent kernel for layers of dependent decode matmuls (Pallas Mosaic GPU): the measurement
of whether the batch-1 step's per-kernel fixed costs can be hidden. NOT used by the engine.

Why: at batch 1 every layer matmul streams its weight at ~4.4-4.6 TB/s once running, but each also
pays ~2.5-3.8 us to fill and drain, and a split-K reduction kernel after it (docs/benchmarks.md,
tenth session). A persistent kernel has no boundaries: each program keeps a ring of weight tiles in
flight across matmuls, as weights depend on nothing, and waits only for the previous matmul's output
(at a grid-wide barrier, or group by group), before its tensor-core steps that read it.

The chain: ``L`` layers of matmuls ``y_j = x_j @ w_j[l]`` (bf16 out of a float32 accumulation), each
reading the first ``K_j`` columns of the previous one's output: one square matmul per layer, or the
Qwen3-8B layer's four (QKV, output, gate-up, down; no attention, norms or SiLU between them). ``rows``
rows (1: a decode token; 16: a verify block), padded to a multiple of 8. The resident programs (at
most one per SM) deal each matmul's output tiles round-robin; a program with no tile in a
matmul only passes its barrier. Each step is one WGMMA, in one of two shapes:
- by default the weight tile is the transposed left operand and the x tile the right one,
  ``acc[block_n, rows] += w^T @ x^T``, tiles 64 columns wide (the WGMMA's M). Mosaic stores a WGMMA
  fragment to a transposed view only from its transposed register layout, so the output tile is
  shuffled into that layout, written transposed into an unswizzled buffer, and leaves by TMA in
  its natural orientation;
- with ``x_lhs`` x is the left operand, rows padded to 64, and the weights are stored ``[N, K]``
  (``acc[64, n] += x @ w^T``): a tile may be any multiple of 8 columns wide (``tile_n``, per matmul),
  so a narrow matmul still has a tile for every program. A slot's 64 x rows overlap the next slots'
  (only its first ``rows`` are its own), which costs no shared memory: the rows beyond reach only
  accumulator rows that are never stored.

Synchronisation, one of two kinds:
- grid-wide barriers (default): after its output tiles' TMA stores complete, a program increments
  the global counter of that matmul (release, GPU scope); before the next matmul each program with a
  tile in it spins until the counter reaches the number of programs (acquire), then copies its x
  tiles by TMA;
- ready flags (``flag_cols``): one counter per group of ``flag_cols`` output columns of each matmul,
  counted over the layers. A program counts each tile into the groups it overlaps once its store is
  complete, and a reader waits, before the first x copy of each group, for that group's tiles of
  this layer only. Early groups are then consumed while late ones are still being written.
At the end the counters go back to zero (program 0, or with flags one counter per program between
two exit counts), so the kernel is correct whether or not ``pl.get_global`` semaphores persist
across calls.

The weight ring's slot holds the largest ``tile_n * tile_k`` of the layer (``tile_k``: K rows per
tile, per matmul; the rings are aliased views, one per K tile, ``plgpu.RefUnion``), so a 32-column
matmul given 256-row K tiles fills its slots as the 64-column gate-up does with 128 rows.

Measured on the Qwen3-8B layer's four matmuls, GPU kernel time per layer at one row, us
(docs/benchmarks.md, eleventh and twelfth sessions; the same variant moves by up to 2% between calls):
- XLA's four GEMMs and two split-K reductions: 96.1-98.3;
- 64-column tiles, barriers: 97.0-97.4 (the output, down and QKV projections stream on part of the
  SMs: 64, 64 and 96 tiles);
- narrow tiles, barriers: 96.2-98.5 with 256-row K tiles, 100.8-102.0 with 128 (each barrier waits
  for the slowest of the 128 programs);
- narrow tiles filling every slot, ready flags per 2048 columns: 93.9-95.9, 1.8-3.4 under XLA in
  the same call (16 rows: 96.1-97.7 against XLA's 101-102). Finer groups cost more, since every
  wait is a round trip that stalls the warpgroup issuing the copies: per 1024 columns 97.4, per 512
  (128-row tiles) 112.1;
- without any dependency (every matmul reads x0; the streaming ceiling): 86.0-88.8 (4.4-4.5 TB/s).
Neither a ninth ring stage nor counting a tile before its store completes (``early_signal``, a
diagnostic race) closes the remaining ~7 us per layer. The in-kernel profile (``profile_dir``: each
matmul and each wait as a named range per program) says why: programs given equal work finish a
matmul up to ~10 us apart, and not the same programs each time, so every full dependency waits for
a late one (~9 us per layer and program with flags). What that needs is dynamic balancing, small
work items from an atomic queue, not a finer dependency.

No CPU test: the grid-wide barrier and the flags have no interpret mode. ``bench_persistent_chain.py``
checks every variant on the device against float32 dots, matmul by matmul.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._mosaic_gpu import (SMEM_BUDGET, WGMMA_M, count_into_groups, fence_proxy_async,
                                        group_tiles, reset_ready_counters, swizzled)
from matvec_mgpu import padded_rows



@dataclasses.dataclass(frozen=True)
class ChainConfig:
    """``block_n`` output columns per tile (the WGMMA's M), ``block_k`` rows of K per weight tile,
    ``stages`` weight and x tiles in flight per program (the weights cross matmul boundaries; x cannot,
    it is not ready before the barrier), ``programs`` resident programs (0: the widest matmul's tile
    count, at most 132)."""

    block_n: int = 64
    block_k: int = 256
    stages: int = 5
    programs: int = 0
    # False: every matmul multiplies x0 (no barrier): the kernel's streaming ceiling.
    dependent: bool = True
    # x as the WGMMA's left operand (``acc[64, block_n] += x @ w``, rows padded to 64), the weights
    # stored ``[N, K]``: output tiles may then be any multiple of 8 columns wide, so narrow matmuls
    # get as many tiles as there are programs. A slot's 64 x rows overlap the next slots (only its
    # first ``rows`` are its own), so the padding costs no shared memory; the rows beyond reach only
    # accumulator rows that are never stored.
    x_lhs: bool = False
    # x_lhs only: per matmul of a layer, its tile width (None: block_n for all).
    tile_n: tuple[int, ...] | None = None
    # 0: a grid-wide barrier before each matmul (every program waits for all of the previous one).
    # > 0: ready counters, one per ``flag_cols`` output columns of each matmul: a program counts its
    # tile into the groups it overlaps once stored, and a reader waits only for the group its next x
    # tiles come from, once per group, so early tiles are consumed while late ones are still written.
    flag_cols: int = 0
    # x_lhs only: per matmul of a layer, its K tile (None: block_k for all). A ring slot holds the
    # largest ``tile_n * tile_k``; narrow matmuls given deeper K tiles fill their slots too, so as many
    # weight bytes stay in flight across a matmul boundary, whatever the next matmul's width.
    tile_k: tuple[int, ...] | None = None
    # Diagnostic, wrong by design (with ready flags): count a tile once its store has left shared
    # memory, not once it is in global memory. Sizes the store's share of the dependency latency.
    early_signal: bool = False

    def bn(self, j: int) -> int:
        """Matmul ``j``'s output columns per tile."""
        return self.tile_n[j] if self.tile_n else self.block_n

    def bk(self, j: int) -> int:
        """Matmul ``j``'s rows of K per weight tile."""
        return self.tile_k[j] if self.tile_k else self.block_k

    def tile_ks(self, phases: int) -> list[int]:
        """The distinct K tiles of a layer's matmuls: one aliased view of the rings each."""
        return sorted({self.bk(j) for j in range(phases)})

    def slot(self, phases: int) -> int:
        """Weight elements per ring slot (x_lhs)."""
        return max(self.bn(j) * self.bk(j) for j in range(phases))

    def smem_bytes(self, rows: int, phases: int = 1, itemsize: int = 2) -> int:
        """Shared memory for ``rows`` padded rows: the weight and x rings, the output tiles."""
        widths = [self.bn(j) for j in range(phases)]
        if self.x_lhs:
            x_ring = (self.stages * rows + WGMMA_M - rows) * max(self.tile_ks(phases))
            return (self.stages * self.slot(phases) + x_ring + WGMMA_M * max(widths)) * itemsize
        return (self.stages * self.block_k * (self.block_n + rows) + rows * self.block_n) * itemsize

    def resident(self, shapes: Sequence[tuple[int, int]]) -> int:
        """The number of programs for matmuls of ``shapes`` ``(K, N)``."""
        return self.programs or min(132, max(n // self.bn(j) for j, (_, n) in enumerate(shapes)))


def supports(layers: int, shapes: Sequence[tuple[int, int]], rows: int, config: ChainConfig) -> bool:
    """Whether the kernel takes ``layers`` repetitions of matmuls of ``shapes`` ``(K, N)``, each
    reading the first K columns of the previous one's output."""
    c = config
    ns = [n for _, n in shapes]
    widths = [c.bn(j) for j in range(len(shapes))]
    width_ok = all(8 <= b <= 256 and b % 8 == 0 for b in widths) if c.x_lhs else c.block_n % WGMMA_M == 0
    # Dependent chains need every program resident (one per SM) for the grid-wide barrier.
    return (width_ok and 1 <= rows <= (WGMMA_M if c.x_lhs else 256) and c.stages >= 2
            and (c.tile_n is None or (c.x_lhs and len(c.tile_n) == len(shapes)))
            and (c.tile_k is None or (c.x_lhs and len(c.tile_k) == len(shapes)))
            and all(c.bk(j) % 64 == 0 and c.slot(len(shapes)) % c.bk(j) == 0 for j in range(len(shapes)))
            and all(k % c.bk(j) == 0 and n % b == 0 for j, ((k, n), b) in enumerate(zip(shapes, widths)))
            and all(k <= n_prev for (k, _), n_prev in zip(shapes, ns[-1:] + ns[:-1]))
            and c.resident(shapes) <= max(n // b for n, b in zip(ns, widths))
            and (c.resident(shapes) <= 132 or not c.dependent)
            and c.smem_bytes(padded_rows(rows), len(shapes)) <= SMEM_BUDGET
            and (not c.flag_cols or _flags_fit(shapes, c)))


def _flags_fit(shapes: Sequence[tuple[int, int]], c: ChainConfig) -> bool:
    """Ready counters: whole groups per output and per read, whole K steps per group, a tile in at
    most two groups, and no more counters than programs (each resets one at the end)."""
    f = c.flag_cols
    return (c.dependent and all(f % c.bk(j) == 0 and c.bn(j) <= f for j in range(len(shapes)))
            and all(n % f == 0 and k % f == 0 for k, n in shapes)
            and sum(n // f for _, n in shapes) <= c.resident(shapes))


def persistent_chain(x0: jax.Array, weights: Sequence[jax.Array], config: ChainConfig = ChainConfig(), *,
                     profile_dir: str | None = None, profile_ranges: int = 0) -> list[jax.Array]:
    """Layers of dependent matmuls in one kernel. ``weights``: per matmul of a layer ``w_j [L, K_j,
    N_j]`` (``[L, N_j, K_j]`` with ``config.x_lhs``); ``x0 [R, K]`` (``R = padded_rows(rows)``, ``K``
    the largest ``K_j``). Matmul ``j`` of layer ``l`` reads the first ``K_j`` columns of the previous
    matmul's output (of ``x0`` for the first), or of ``x0`` throughout if not ``config.dependent``
    -> every output, ``y_j [L, R, N_j]``.

    ``profile_dir``: Mosaic GPU's in-kernel profile, up to ``profile_ranges`` timed ranges per program
    (each matmul ``m0``, ``m1``, ... and each ``wait`` for its input), one trace file per call."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    c = config
    layers = weights[0].shape[0]
    shapes = [(w.shape[2], w.shape[1]) if c.x_lhs else tuple(w.shape[1:]) for w in weights]
    rows = x0.shape[0]
    if (any(w.shape[0] != layers or w.dtype != x0.dtype for w in weights) or rows != padded_rows(rows)
            or x0.shape[1] < max(k for k, _ in shapes) or not supports(layers, shapes, rows, c)):
        raise ValueError(f"persistent_chain: x0 {x0.shape} {x0.dtype}, weights {[w.shape for w in weights]} "
                         f"not supported by {c}")
    programs = c.resident(shapes)
    phases = len(weights)
    tiles = [n // c.bn(j) for j, (_, n) in enumerate(shapes)]
    k_steps = [k // c.bk(j) for j, (k, _) in enumerate(shapes)]
    waves = [-(-t // programs) for t in tiles]  # tiles per program, at most
    itemsize = jnp.dtype(x0.dtype).itemsize

    def transforms(minor: int):
        return swizzled(minor, itemsize)

    def body(x_gmem, *refs):
        w_gmem, y_gmem = refs[:phases], refs[phases:2 * phases]
        w_smem, x_smem, out_smem, w_ready, x_ready = refs[2 * phases:]
        if c.x_lhs:  # the rings as seen by each K tile: aliased views with the same slot boundaries
            views = {bk: i for i, bk in enumerate(c.tile_ks(phases))}
            w_rings = [w_smem[views[c.bk(j)]] for j in range(phases)]
            x_rings = [x_smem[views[c.bk(j)]] for j in range(phases)]
            # One output tile at a time: a matmul's last store completes (or, with early_signal, has
            # left shared memory) before the next matmul writes its first tile.
            out_tiles = [out_smem[j] for j in range(phases)]
        p = lax.axis_index("p")
        flags = c.dependent and c.flag_cols > 0
        if flags:
            # Per matmul its groups of flag_cols output columns, counted over the layers (a reader of
            # layer l's group waits for (l + 1) times its tile count), so no counter is reused.
            groups = [n // c.flag_cols for _, n in shapes]
            base = [sum(groups[:j]) for j in range(phases)]
            ready = pl.get_global(plgpu.SemaphoreType.REGULAR((sum(groups),)))
            drained = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        else:
            done = pl.get_global(plgpu.SemaphoreType.REGULAR((layers * phases,)))
        exited = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        # This program's tiles per matmul, and where each matmul's steps start within a layer.
        mine = [jnp.maximum(0, (t - p + programs - 1) // programs) for t in tiles]
        start = [0]
        for j in range(phases):
            start.append(start[-1] + mine[j] * k_steps[j])
        per_layer = start[-1]
        steps = layers * per_layer

        def tile_columns(j: int, i):
            """The output columns of this program's ``i``-th tile of matmul ``j``."""
            return pl.ds((p + i * programs) * c.bn(j), c.bn(j))

        def fetch_weights(step):
            """The weight tile of ``step`` of this program (any matmul, any layer) into its slot."""
            slot, layer, r = step % c.stages, step // per_layer, step % per_layer
            for j in range(phases):
                @pl.when((start[j] <= r) & (r < start[j + 1]))
                def _():
                    i, kk = (r - start[j]) // k_steps[j], (r - start[j]) % k_steps[j]
                    rows_k, cols = pl.ds(kk * c.bk(j), c.bk(j)), tile_columns(j, i)
                    if c.x_lhs:
                        plgpu.copy_gmem_to_smem(w_gmem[j].at[layer, cols, rows_k],
                                                w_rings[j].at[slot, pl.ds(0, c.bn(j))], w_ready.at[slot])
                    else:
                        plgpu.copy_gmem_to_smem(w_gmem[j].at[layer, rows_k, cols], w_smem.at[slot], w_ready.at[slot])

        def tiles_in_group(j: int, g):
            return group_tiles(c.flag_cols, c.bn(j), g)

        def count_tile(j: int, t):
            count_into_groups(ready, base[j], c.flag_cols, c.bn(j), t)

        def await_x(layer, j, kk):
            """Waits until the group of the previous matmul's output that K step ``kk`` of matmul ``j``
            reads is written (nothing to wait for in layer 0's first matmul, which reads x0)."""
            src = j - 1 if j > 0 else phases - 1
            src_layer = layer if j > 0 else layer - 1
            g = (kk * c.bk(j)) // c.flag_cols
            with jax.named_scope("wait"):
                plgpu.semaphore_wait(ready.at[base[src] + g], (src_layer + 1) * tiles_in_group(src, g),
                                     decrement=False, memory_scope="gpu")
                fence_proxy_async()

        def with_x_source(layer, j, fn):
            """``fn(input of matmul j of this layer)``: x0, or the previous matmul's output."""
            if not c.dependent:
                fn(x_gmem)
            elif j > 0:
                fn(y_gmem[j - 1].at[layer])
            else:
                pl.when(layer == 0)(lambda: fn(x_gmem))
                pl.when(layer > 0)(lambda: fn(y_gmem[phases - 1].at[layer - 1]))

        def fetch_x(step, j, first, src, layer):
            """The x tile of ``step`` of matmul ``j`` (whose steps start at ``first``) into its slot;
            with ready flags, the first tile of each group of this program's first tile waits for it."""
            slot, kk = step % c.stages, (step - first) % k_steps[j]
            if flags:
                first_read = (step - first < k_steps[j]) & ((kk * c.bk(j)) % c.flag_cols == 0)
                pl.when(first_read & ((layer > 0) | (j > 0)))(lambda: await_x(layer, j, kk))
            dst = x_rings[j].at[pl.ds(slot * rows, rows)] if c.x_lhs else x_smem.at[slot]
            plgpu.copy_gmem_to_smem(src.at[:, pl.ds(kk * c.bk(j), c.bk(j))], dst, x_ready.at[slot])

        for step in range(c.stages - 1):
            pl.when(step < steps)(lambda step=step: fetch_weights(step))

        def run_matmul(layer, j: int):
            """Matmul ``j`` of ``layer``: this program's tiles of it, from its input's wait to its
            outputs' count."""
            first = layer * per_layer + start[j]
            end = first + mine[j] * k_steps[j]
            if c.dependent and not flags:
                @pl.when((mine[j] > 0) & ((layer > 0) | (j > 0)))
                def _():
                    with jax.named_scope("wait"):
                        plgpu.semaphore_wait(done.at[layer * phases + j - 1], programs, decrement=False,
                                             memory_scope="gpu")
                        fence_proxy_async()

            def fetch_first(src, j=j, first=first, end=end):
                for q in range(c.stages - 1):
                    pl.when(first + q < end)(lambda q=q: fetch_x(first + q, j, first, src, layer))

            with_x_source(layer, j, fetch_first)
            for i in range(waves[j]):
                @pl.when(i < mine[j])
                def _(i=i, j=j, first=first, end=end):
                    def accumulate(acc_ref):
                        def k_step(kk, carry):
                            step = first + i * k_steps[j] + kk
                            slot = step % c.stages
                            plgpu.barrier_wait(x_ready.at[slot])
                            plgpu.barrier_wait(w_ready.at[slot])
                            if c.x_lhs:
                                plgpu.wgmma(acc_ref, x_rings[j].at[pl.ds(slot * rows, WGMMA_M)],
                                            plgpu.transpose_ref(w_rings[j].at[slot, pl.ds(0, c.bn(j))], (1, 0)))
                            else:
                                plgpu.wgmma(acc_ref, plgpu.transpose_ref(w_smem.at[slot], (1, 0)),
                                            plgpu.transpose_ref(x_smem.at[slot], (1, 0)))
                            plgpu.wgmma_wait(1)  # the previous step's WGMMA is done: its slot is free
                            pl.when(step + c.stages - 1 < steps)(lambda: fetch_weights(step + c.stages - 1))

                            @pl.when(step + c.stages - 1 < end)
                            def _():
                                with_x_source(layer, j,
                                              lambda src: fetch_x(step + c.stages - 1, j, first, src, layer))

                            return carry

                        lax.fori_loop(0, k_steps[j], k_step, None)
                        plgpu.wgmma_wait(0)
                        return acc_ref[...]

                    cols = tile_columns(j, i)
                    if c.x_lhs:
                        acc = pl.run_scoped(accumulate, plgpu.ACC((WGMMA_M, c.bn(j))))
                        out_tiles[j][...] = acc.astype(out_tiles[j].dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_tiles[j].at[pl.ds(0, rows)], y_gmem[j].at[layer, :, cols])
                    else:
                        acc = pl.run_scoped(accumulate, plgpu.ACC((c.block_n, rows)))
                        y_tile = plgpu.layout_cast(acc.astype(out_smem.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
                        # .at: JAX 0.11.2's transpose_ref takes a view, not the bare scratch ref
                        plgpu.transpose_ref(out_smem.at[:, :], (1, 0))[...] = y_tile
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_smem, y_gmem[j].at[layer, :, cols])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=flags and c.early_signal)
                    if flags:
                        fence_proxy_async()
                        count_tile(j, p + i * programs)

            if c.dependent and not flags:
                fence_proxy_async()
                plgpu.semaphore_signal(done.at[layer * phases + j], 1, memory_scope="gpu")

        def layer_body(layer, carry):
            for j in range(phases):
                with jax.named_scope(f"m{j}"):  # a range of the in-kernel profile
                    run_matmul(layer, j)
            return carry

        lax.fori_loop(0, layers, layer_body, None)
        if flags:
            reset_ready_counters(ready, exited, drained, p, programs,
                                 [layers * tiles_in_group(j, g) for j in range(phases) for g in range(groups[j])])
        elif c.dependent:
            plgpu.semaphore_signal(exited, 1, memory_scope="gpu")

            @pl.when(p == 0)
            def _():
                plgpu.semaphore_wait(exited, programs, decrement=True, memory_scope="gpu")
                for counter in range(layers * phases):
                    plgpu.semaphore_signal(done.at[counter], -programs, memory_scope="gpu")

    if c.x_lhs:
        # One view of each ring per K tile, all from offset 0: slot s has the same bytes in all.
        ks = c.tile_ks(phases)
        ring = lambda shape, bk: plgpu.SMEM(shape, x0.dtype, transforms=transforms(bk))  # noqa: E731
        scratch = (plgpu.RefUnion(*(ring((c.stages, c.slot(phases) // bk, bk), bk) for bk in ks)),
                   plgpu.RefUnion(*(ring((c.stages * rows + WGMMA_M - rows, bk), bk) for bk in ks)),
                   plgpu.RefUnion(*(ring((WGMMA_M, c.bn(j)), c.bn(j)) for j in range(phases))))
    else:
        scratch = (plgpu.SMEM((c.stages, c.block_k, c.block_n), x0.dtype, transforms=transforms(c.block_n)),
                   plgpu.SMEM((c.stages, rows, c.block_k), x0.dtype, transforms=transforms(c.block_k)),
                   plgpu.SMEM((rows, c.block_n), x0.dtype))  # unswizzled: written through a transposed view
    scratch += (plgpu.Barrier(num_arrivals=1, num_barriers=c.stages), plgpu.Barrier(num_arrivals=1, num_barriers=c.stages))
    out_types = [jax.ShapeDtypeStruct((layers, rows, n), x0.dtype) for _, n in shapes]
    params = plgpu.CompilerParams(profile_space=profile_ranges, profile_dir=profile_dir) if profile_dir else None
    kernel = plgpu.kernel(body, out_type=out_types, scratch_types=scratch, grid=(programs,), grid_names=("p",),
                          compiler_params=params)
    return list(kernel(x0, *weights))
