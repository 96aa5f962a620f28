"""The batch-1 MLP (gate-up, SwiGLU, down) as one persistent kernel whose programs take work items
from an atomic queue (Pallas Mosaic GPU): the measurement of whether dynamic balancing recovers the
streaming ceiling that fixed assignments lose. NOT used by the engine.

Why: the twelfth session (docs/benchmarks.md) found that programs given equal shares of a matmul
finish up to ~10 us apart, and not the same programs each time, so every full dependency between two
matmuls waits for a late program. Here no program owns a fixed share: each claims its next item
(``atom.add`` on a global counter, inline PTX, since Mosaic GPU's ``atomic_add`` returns nothing) and
the late ones simply claim fewer. The gate-up -> down dependency is made local: a down item reads
only one K slice of the SwiGLU output, so it waits for that slice's gate-up items, not for all.

Work items, every step of each a weight tile ``[step_k, 64]`` (by default 256 rows, 32 KB, in two
TMA copies into one ring slot; 128 rows is one 16 KB copy):
- gate-up ``b``: 64 columns of the gate-up weight stored as blocks of 32 gate columns then the same
  32 up columns (``gate_up_layout``), over all of K (512 KB): one WGMMA accumulator whose
  first 32 columns are gate and last 32 up, so the SwiGLU of 32 output columns is the item's own
  epilogue (through shared memory). Its x tiles ``[8, step_k]`` of the input ``xn`` travel with its
  weights, in the same ring slot.
- down ``(s, t)``: 64 output columns ``t`` over K slice ``s`` (``x_cols`` rows of the SwiGLU output,
  ``x_cols / step_k`` steps): a float32 partial ``[8, 64]``; the caller sums the ``I / x_cols``
  partials (as the engine's next residual add would). Its x slice (it must wait for the slice's
  gate-up items) comes into one half of a double buffer, while the item before runs.
The queue holds every gate-up item, then every down item (slice-major), so the last gate-up items
are finished long before the down items of their slice come up.

What a program does not wait for in line: the weights (a ring of ``stages`` steps filled ahead
across item boundaries, since weights depend on nothing); a gate-up item's SwiGLU store (its
completion and its count into the slice's ready flag wait for the next epilogue or the program's
next flag wait, whichever is first, so a program never waits on a flag its own tile would
complete); the next down item's x (loaded while the current down item runs). A down item that
follows a gate-up item loads its x only once that item is finished and counted, which keeps the
kernel free of deadlock. The claim itself is one atomic round trip per item, in line.

With ``producer_warp`` each program is two warpgroups: a producer that only issues copies, refilling
a ring slot once the consumer has released it (a second barrier per slot) and loading a down item's
x once its slice is ready, and a consumer that only waits, multiplies and stores. Items are then
dealt round-robin.

Every counter goes back to zero before the kernel ends (the queue and the slice flags), so
consecutive calls need no reset. No CPU test: the atomics and TMA have no interpret mode.
``bench_persistent_mlp.py`` checks the kernel on the device against float32 XLA, twice in a row
(bit for bit), and times it against XLA's gate-up GEMM, SwiGLU, down GEMM and split-K reduction.

Measured on the H200 (docs/benchmarks.md, sixteenth session), GPU kernel time per layer at one row,
Qwen3-8B shapes (302 MB): correct (error 2.1e-3 / 1.6e-3 against float32, bf16 rounding) and the
same bit for bit on a second call, in every variant, but 77.0-77.8 us against 73.9-74.5 for XLA's
three kernels it replaces (~3.9 TB/s against ~4.1). The diagnostics say where the time is not:
round-robin items (``static``) 77.0 against 77.6 claimed, no dependency wait (``no_wait``) 77.6,
contiguous 32 KB tiles (``tiled``) 77.1 against 77.8. What costs is the streaming rate of one
warpgroup that waits for each step, multiplies and issues the next copies in turn; one more ring
stage gave 1.6 us (4 -> 5), and shared memory allows no sixth. An earlier version with gate-up
items split over K (partials summed by the item that completed a tile's last slice) took 82.5 us.

The seventeenth session tested that explanation, and it does not hold: a producer warpgroup
(76.9-77.6 us, its consumer waiting for weights 66-70% of its loop), 128 programs (76.3-77.3) and
16 KB steps nine deep (78.1-79.7) all run as slowly. ``persistent_chain``'s layer, streamed without
dependencies through the same kind of TMA ring, reached 4.32 TB/s on the same machine that day.
What costs is the items' epilogues: ~9 per program (gate-up 512 KB, down 128 KB), each an
accumulator through shared memory and a store, ~10% of a program's loop, while no new weight copy
is issued; without the stores (``no_store``) the kernel takes 72.7 us against 76.4, as long as XLA's
kernels (72.5), and down items twice as long (``x_cols=2048``) take 75.6. A second consumer
warpgroup whose epilogues overlap the other's steps would be the next thing to try; at the chain's
rate the MLP would still gain only ~2-3 us per layer over XLA.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._mosaic_gpu import SMEM_BUDGET, fence_proxy_async, swizzled

ROWS = 8  # the WGMMA's N: the rows of x, padded
TILE = 64  # weight columns per item (the WGMMA's M)
HALF = TILE // 2  # a gate-up item's gate (and up) columns: its SwiGLU output columns
COPY_K = 128  # K rows per TMA copy of a weight step: a [128, TILE] tile, 16 KB


@dataclasses.dataclass(frozen=True)
class MlpConfig:
    """``stages`` weight steps in flight per program (at most a down item's steps + 1: the ring looks
    ahead into the next item only); ``programs`` resident programs (one per SM); ``x_cols`` the K
    slice of a down item; ``step_k`` K rows per step (a ``[step_k, 64]`` weight tile: 256 is 32 KB in
    two TMA copies, 128 is 16 KB in one)."""

    stages: int = 5
    programs: int = 132
    x_cols: int = 1024
    step_k: int = 256
    # Diagnostics: ``static`` deals the items round-robin (program p takes p, p + programs, ...)
    # instead of claiming them, which prices the claims and the balancing; ``no_wait`` (wrong by
    # design) skips the down items' wait for their slice, which prices the dependency.
    static: bool = False
    no_wait: bool = False
    # Diagnostic, wrong by design: no epilogue stores (no SwiGLU tile, no partial; the flags are still
    # counted), which prices the items' epilogues.
    no_store: bool = False
    # The weights stored tile-major (``tile_major``): every step's weight tile one contiguous block
    # of HBM, instead of ``step_k`` rows of 128 bytes each.
    tiled: bool = False
    # Two warpgroups per program: a producer that only issues the copies (refilling a slot once the
    # consumer has released it) and a consumer that only waits, multiplies and stores; items dealt
    # round-robin (as ``static``).
    producer_warp: bool = False

    def smem_bytes(self, itemsize: int = 2) -> int:
        ring = self.stages * self.step_k * TILE * itemsize
        ring += self.stages * ROWS * self.step_k * itemsize  # a gate-up step's x tile beside its weights
        x = 2 * ROWS * self.x_cols * itemsize  # the down x double buffer
        return ring + x + ROWS * TILE * 4 + 128  # + the broadcast word and the barriers


def supports(hidden: int, inter: int, config: MlpConfig) -> bool:
    c = config
    return (c.step_k in (COPY_K, 2 * COPY_K) and c.x_cols % c.step_k == 0 and inter % c.x_cols == 0
            and hidden % c.step_k == 0 and hidden % TILE == 0 and 2 <= c.stages <= c.x_cols // c.step_k + 1
            and c.smem_bytes() <= SMEM_BUDGET and c.programs >= 1 and not (c.producer_warp and c.no_wait))


def gate_up_layout(w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
    """``w_gate, w_up [H, I]`` -> the kernel's gate-up weight ``[H, 2 I]``: blocks of 32 gate columns,
    then the same 32 up columns."""
    hidden, inter = w_gate.shape
    blocks = lambda w: w.reshape(hidden, inter // HALF, 1, HALF)  # noqa: E731
    return jnp.concatenate([blocks(w_gate), blocks(w_up)], axis=2).reshape(hidden, 2 * inter)


def _claim(counter, bcast):
    """``counter += 1`` by one thread (``atom.relaxed.gpu``) -> the old value, the same in every thread
    of the warpgroup (passed through the shared ``bcast [1]`` int32). ``counter``: a global semaphore."""
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    scalar = plgpu.Layout.WG_SPLAT(shape=())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((), jnp.int32, layout=scalar))
    def atom(_ctx, counter_ref, bcast_ref):
        i32 = ir.IntegerType.get_signless(32)
        ptr, slot = mgpu_utils.memref_ptr(counter_ref), mgpu_utils.memref_ptr(bcast_ref)
        pred = mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.WARPGROUP)
        mgpu_utils.warpgroup_barrier()  # every thread has read the last value passed on
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [ptr, slot, pred],
                        "{ .reg .u32 old; @$2 atom.relaxed.gpu.global.add.u32 old, [$0], 1; "
                        "@$2 st.shared.u32 [$1], old; }",
                        "l,l,b", has_side_effects=True)
        mgpu_utils.warpgroup_barrier()
        old = llvm.inline_asm(i32, [slot], "ld.shared.u32 $0, [$1];", "=r,l", has_side_effects=True)
        return mgpu.FragmentedArray.splat(old, (), is_signed=True)

    return atom(counter, bcast)


def tile_major(w: jax.Array, step_k: int = 256) -> jax.Array:
    """``w [K, N]`` -> ``[N / 64, K / step_k, step_k, 64]``: each step's weight tile contiguous."""
    k, n = w.shape
    return w.reshape(k // step_k, step_k, n // TILE, TILE).transpose(2, 0, 1, 3)


def persistent_mlp(xn: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, config: MlpConfig = MlpConfig(), *,
                   profile_dir: str | None = None, profile_ranges: int = 0) -> tuple[jax.Array, jax.Array]:
    """``xn [8, H]`` (the normed input, rows padded), ``w_gate_up [H, 2 I]`` (``gate_up_layout``),
    ``w_down [I, H]``, bf16 -> ``h [8, I]`` bf16 (``silu(xn @ w_gate) * (xn @ w_up)``) and the down
    projection's float32 partials ``[I / x_cols, 8, H]`` (their sum over the first axis: ``h @ w_down``).

    ``profile_dir``: Mosaic GPU's in-kernel profile, up to ``profile_ranges`` timed ranges per program:
    ``loop`` (all its items), and within it ``ring`` (waiting for a weight step), ``x`` (for a down
    item's x slice or its slice's flag), ``epilogue`` and ``claim``."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    c = config
    step_k, copies = c.step_k, c.step_k // COPY_K
    rows, hidden = xn.shape
    inter = w_down.shape[0] if w_down.ndim == 2 else w_down.shape[1] * step_k
    shapes = (((2 * inter // TILE, hidden // step_k, step_k, TILE), (hidden // TILE, inter // step_k, step_k, TILE))
              if c.tiled else ((hidden, 2 * inter), (inter, hidden)))
    if rows != ROWS or (w_gate_up.shape, w_down.shape) != shapes or not supports(hidden, inter, c):
        raise ValueError(f"persistent_mlp: xn {xn.shape}, w_gate_up {w_gate_up.shape}, w_down {w_down.shape} "
                         f"not supported by {c}")
    slices = inter // c.x_cols
    down_tiles = hidden // TILE
    n_gate, n_down = 2 * inter // TILE, down_tiles * slices
    total = n_gate + n_down
    gate_steps, down_steps = hidden // step_k, c.x_cols // step_k
    items_per_slice = c.x_cols // HALF  # gate-up items whose SwiGLU columns make one down K slice
    programs, stages = c.programs, c.stages
    dtype = xn.dtype

    def body(xn_gmem, wgu_gmem, wd_gmem, h_gmem, dpart_gmem, ring, ring_x, xd_smem, out_union,
             w_ready, x_ready, bcast, *released):
        out32, hout = out_union  # an accumulator's transpose; a SwiGLU tile, once that is read
        queue = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        slice_ready = pl.get_global(plgpu.SemaphoreType.REGULAR((slices,)))
        exited = pl.get_global(plgpu.SemaphoreType.REGULAR(()))

        def claim(k):
            """This program's ``k``-th item (from 0)."""
            if c.static:
                return lax.axis_index("p") + programs * k
            with jax.named_scope("claim"):
                return _claim(queue, bcast)

        def is_gate(item):
            return item < n_gate

        def n_steps(item):
            return jnp.where(is_gate(item), gate_steps, down_steps)

        def fetch_weights(item, kk, slot):
            """Weight step ``kk`` of ``item`` into ring slot ``slot`` (16 KB copies), and for a
            gate-up item its x tile (a down item's x is not ready this early: it arrives in place)."""
            is_down = jnp.logical_not(is_gate(item))
            d = item - n_gate
            row0 = jnp.where(is_down, (d // down_tiles) * c.x_cols, 0) + kk * step_k
            col0 = jnp.where(is_down, d % down_tiles, item) * TILE

            def copy(w_gmem):
                for half in range(copies):
                    if c.tiled:
                        src = w_gmem.at[col0 // TILE, row0 // step_k, pl.ds(half * COPY_K, COPY_K)]
                    else:
                        src = w_gmem.at[pl.ds(row0 + half * COPY_K, COPY_K), pl.ds(col0, TILE)]
                    plgpu.copy_gmem_to_smem(src, ring.at[slot, pl.ds(half * COPY_K, COPY_K)], w_ready.at[slot])

            @pl.when(is_gate(item))
            def _():
                copy(wgu_gmem)
                plgpu.copy_gmem_to_smem(xn_gmem.at[:, pl.ds(kk * step_k, step_k)], ring_x.at[slot], w_ready.at[slot])

            @pl.when(is_down & (item < total))
            def _():
                copy(wd_gmem)
                plgpu.barrier_arrive(w_ready.at[slot])  # in place of the x tile: every step arrives copies + 1 times

        def fetch_ahead(step, cur, cur_start, nxt):
            """The weights of this program's ``step`` (in ``cur``, else in ``nxt``), if it has one."""
            in_cur = step < cur_start + n_steps(cur)
            item = jnp.where(in_cur, cur, nxt)
            kk = jnp.where(in_cur, step - cur_start, step - cur_start - n_steps(cur))
            pl.when(item < total)(lambda: fetch_weights(item, kk, step % stages))

        def flush(pending):
            """The SwiGLU tile of gate-up item ``pending`` (if any, >= 0) is in global memory: count it."""
            @pl.when(pending >= 0)
            def _():
                plgpu.wait_smem_to_gmem(0)
                fence_proxy_async()
                plgpu.semaphore_signal(slice_ready.at[pending // items_per_slice], 1, memory_scope="gpu")

        def fetch_down_x(item, buf, pending):
            """The x slice of down ``item`` into ``xd_smem[buf]``, once its slice is ready (this program's
            own pending tile counted first: it may be one of them)."""
            flush(pending)
            s = (item - n_gate) // down_tiles
            if not c.no_wait:
                with jax.named_scope("x"):
                    plgpu.semaphore_wait(slice_ready.at[s], items_per_slice, decrement=False, memory_scope="gpu")
                    fence_proxy_async()
            plgpu.copy_gmem_to_smem(h_gmem.at[:, pl.ds(s * c.x_cols, c.x_cols)], xd_smem.at[buf], x_ready.at[buf])

        def transposed_to_out32(acc_ref):
            """A ``[64, 8]`` float32 accumulator into ``out32 [8, 64]``, visible to every thread."""
            tile = plgpu.layout_cast(acc_ref[...], plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.transpose_ref(out32.at[:, :], (1, 0))[...] = tile
            plgpu.commit_smem()

        def gate_epilogue(acc, item):
            """Gate-up ``item``'s SwiGLU tile, stored (its count into the slice's flag is left to a
            later ``flush``)."""
            if c.no_store:
                return
            with jax.named_scope("epilogue"):
                transposed_to_out32(acc)
                gate, up = out32[:, pl.ds(0, HALF)], out32[:, pl.ds(HALF, HALF)]
                swiglu = (gate * jax.nn.sigmoid(gate) * up).astype(dtype)
                plgpu.commit_smem()  # every thread has read out32, which hout overlaps
                hout[...] = swiglu
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(hout, h_gmem.at[:, pl.ds(item * HALF, HALF)])

        def down_epilogue(acc, item):
            """Down ``item``'s float32 partial, stored."""
            d = item - n_gate
            if c.no_store:
                return
            with jax.named_scope("epilogue"):
                transposed_to_out32(acc)
                plgpu.copy_smem_to_gmem(out32, dpart_gmem.at[d // down_tiles, :, pl.ds((d % down_tiles) * TILE, TILE)])

        def run_item(cur, cur_start, nxt, parity, pending):
            """Every step of ``cur``, then its epilogue; ``pending``: an earlier gate-up item whose
            SwiGLU store is not counted yet (or -1)."""
            def accumulate(acc, count, x_step):
                def k_step(kk, carry):
                    step = cur_start + kk
                    slot = step % stages
                    with jax.named_scope("ring"):
                        plgpu.barrier_wait(w_ready.at[slot])
                    plgpu.wgmma(acc, plgpu.transpose_ref(ring.at[slot], (1, 0)), plgpu.transpose_ref(x_step(kk), (1, 0)))
                    plgpu.wgmma_wait(1)  # the previous step's WGMMA is done: its slot is free
                    fetch_ahead(step + stages - 1, cur, cur_start, nxt)
                    return carry

                lax.fori_loop(0, count, k_step, None)
                with jax.named_scope("epilogue"):
                    plgpu.wgmma_wait(0)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # out32 and hout are free
                    flush(pending)

            @pl.when(is_gate(cur))
            def _():
                def gate_up(acc):
                    accumulate(acc, gate_steps, lambda kk: ring_x.at[(cur_start + kk) % stages])
                    gate_epilogue(acc, cur)

                pl.run_scoped(gate_up, plgpu.ACC((TILE, ROWS)))

            @pl.when(jnp.logical_not(is_gate(cur)))
            def _():
                def down(acc):
                    with jax.named_scope("x"):
                        plgpu.barrier_wait(x_ready.at[parity])
                    accumulate(acc, down_steps, lambda kk: xd_smem.at[parity, :, pl.ds(kk * step_k, step_k)])
                    down_epilogue(acc, cur)

                pl.run_scoped(down, plgpu.ACC((TILE, ROWS)))

        def item_loop(carry):
            cur, cur_start, nxt, parity, pending, claims = carry
            nxt_down = jnp.logical_not(is_gate(nxt)) & (nxt < total)
            # The next down item's x now, into the other buffer; after a gate-up item, only once that
            # item is done and counted (its own SwiGLU tile may be what the next item waits for).
            early = nxt_down & jnp.logical_not(is_gate(cur))
            pl.when(early)(lambda: fetch_down_x(nxt, 1 - parity, pending))
            run_item(cur, cur_start, nxt, parity, pending)  # -1 whenever cur is a down item
            pending = jnp.where(is_gate(cur), cur, -1)
            late = nxt_down & is_gate(cur)
            pl.when(late)(lambda: fetch_down_x(nxt, 1 - parity, pending))
            pending = jnp.where(late, -1, pending)
            # Every program claims once per item and twice before: the counter ends at total + 2 programs.
            return nxt, cur_start + n_steps(cur), claim(claims), 1 - parity, pending, claims + 1

        def one_warpgroup():
            first = claim(0)
            second = claim(1)
            for step in range(stages - 1):
                fetch_ahead(step, first, 0, second)
            pl.when(jnp.logical_not(is_gate(first)) & (first < total))(lambda: fetch_down_x(first, 0, -1))
            carry = (first, jnp.int32(0), second, jnp.int32(0), jnp.int32(-1), jnp.int32(2))
            with jax.named_scope("loop"):
                *_, pending, _ = lax.while_loop(lambda cr: cr[0] < total, item_loop, carry)
            return pending

        def round_robin_count():
            """How many items this program has with a producer warpgroup: p, p + programs, ..."""
            return jnp.maximum(0, (total - lax.axis_index("p") + programs - 1) // programs)

        def producer():
            """Only issues copies: each item's weight steps (a slot once the consumer released it), and
            before a down item its x slice (once the slice is ready and the buffer released)."""
            def item_body(k, carry):
                fill, downs = carry
                item = lax.axis_index("p") + programs * k
                is_down = jnp.logical_not(is_gate(item))

                @pl.when(is_down)
                def _():
                    buf, s = downs % 2, (item - n_gate) // down_tiles
                    plgpu.semaphore_wait(slice_ready.at[s], items_per_slice, decrement=False, memory_scope="gpu")
                    fence_proxy_async()
                    pl.when(downs >= 2)(lambda: plgpu.barrier_wait(x_released.at[buf]))
                    plgpu.copy_gmem_to_smem(h_gmem.at[:, pl.ds(s * c.x_cols, c.x_cols)], xd_smem.at[buf],
                                            x_ready.at[buf])

                def step_body(kk, fill):
                    slot = fill % stages
                    pl.when(fill >= stages)(lambda: plgpu.barrier_wait(slot_released.at[slot]))
                    fetch_weights(item, kk, slot)
                    return fill + 1

                return lax.fori_loop(0, n_steps(item), step_body, fill), downs + is_down.astype(jnp.int32)

            lax.fori_loop(0, round_robin_count(), item_body, (jnp.int32(0), jnp.int32(0)))

        def consumer():
            """Only waits, multiplies and stores; releases each slot once its WGMMA is done."""
            def consume(acc, used, count, x_step):
                def k_step(kk, carry):
                    step = used + kk
                    with jax.named_scope("ring"):
                        plgpu.barrier_wait(w_ready.at[step % stages])
                    plgpu.wgmma(acc, plgpu.transpose_ref(ring.at[step % stages], (1, 0)),
                                plgpu.transpose_ref(x_step(kk), (1, 0)))
                    plgpu.wgmma_wait(1)
                    pl.when(kk > 0)(lambda: plgpu.barrier_arrive(slot_released.at[(step - 1) % stages]))
                    return carry

                lax.fori_loop(0, count, k_step, None)
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(slot_released.at[(used + count - 1) % stages])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # out32 and hout are free

            def item_body(k, carry):
                used, downs, pending = carry
                item = lax.axis_index("p") + programs * k

                @pl.when(is_gate(item))
                def _():
                    def gate_up(acc):
                        consume(acc, used, gate_steps, lambda kk: ring_x.at[(used + kk) % stages])
                        flush(pending)
                        gate_epilogue(acc, item)

                    pl.run_scoped(gate_up, plgpu.ACC((TILE, ROWS)))

                @pl.when(jnp.logical_not(is_gate(item)))
                def _():
                    flush(pending)  # the producer may be waiting for this very tile's slice
                    buf = downs % 2

                    def down(acc):
                        with jax.named_scope("x"):
                            plgpu.barrier_wait(x_ready.at[buf])
                        consume(acc, used, down_steps, lambda kk: xd_smem.at[buf, :, pl.ds(kk * step_k, step_k)])
                        plgpu.barrier_arrive(x_released.at[buf])
                        down_epilogue(acc, item)

                    pl.run_scoped(down, plgpu.ACC((TILE, ROWS)))

                is_down = jnp.logical_not(is_gate(item))
                return used + n_steps(item), downs + is_down.astype(jnp.int32), jnp.where(is_down, -1, item)

            with jax.named_scope("loop"):
                *_, pending = lax.fori_loop(0, round_robin_count(), item_body, (jnp.int32(0), jnp.int32(0), jnp.int32(-1)))
            return pending

        def finish(pending):
            """The last SwiGLU tile counted; then program 0 zeroes the counters, once every program has
            made its last claim and read its last flag."""
            plgpu.wait_smem_to_gmem(0)
            flush(pending)
            plgpu.semaphore_signal(exited, 1, memory_scope="gpu")

            @pl.when(lax.axis_index("p") == 0)
            def _():
                plgpu.semaphore_wait(exited, programs, decrement=True, memory_scope="gpu")
                if not c.static and not c.producer_warp:
                    plgpu.semaphore_signal(queue, -(total + 2 * programs), memory_scope="gpu")
                for s in range(slices):
                    plgpu.semaphore_signal(slice_ready.at[s], -items_per_slice, memory_scope="gpu")

        if c.producer_warp:
            slot_released, x_released = released
            wg = lax.axis_index("wg")
            pl.when(wg == 0)(producer)
            pl.when(wg == 1)(lambda: finish(consumer()))
        else:
            finish(one_warpgroup())

    itemsize = jnp.dtype(dtype).itemsize
    scratch = (
        plgpu.SMEM((stages, step_k, TILE), dtype, transforms=swizzled(TILE, itemsize)),
        plgpu.SMEM((stages, ROWS, step_k), dtype, transforms=swizzled(step_k, itemsize)),
        plgpu.SMEM((2, ROWS, c.x_cols), dtype, transforms=swizzled(c.x_cols, itemsize)),
        plgpu.RefUnion(plgpu.SMEM((ROWS, TILE), jnp.float32),  # unswizzled: written through a transposed view
                       plgpu.SMEM((ROWS, HALF), dtype)),
        plgpu.Barrier(num_arrivals=copies + 1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        plgpu.SMEM((1,), jnp.int32),  # last but the producer's: allocations after it are aligned
    )
    if c.producer_warp:  # a slot released by the consumer, a down x buffer released
        scratch += (plgpu.Barrier(num_arrivals=1, num_barriers=stages), plgpu.Barrier(num_arrivals=1, num_barriers=2))
    out_types = (jax.ShapeDtypeStruct((ROWS, inter), dtype),
                 jax.ShapeDtypeStruct((slices, ROWS, hidden), jnp.float32))
    params = plgpu.CompilerParams(profile_space=profile_ranges, profile_dir=profile_dir) if profile_dir else None
    threads = dict(num_threads=2, thread_name="wg") if c.producer_warp else {}
    kernel = plgpu.kernel(body, out_type=out_types, scratch_types=scratch, grid=(programs,), grid_names=("p",),
                          compiler_params=params, **threads)
    return kernel(xn, w_gate_up, w_down)


def persistent_mlp_reference(xn: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array):
    """The same in float32 XLA -> ``h [8, I]``, ``h @ w_down [8, H]``."""
    x = xn.astype(jnp.float32)
    h = jax.nn.silu(x @ w_gate.astype(jnp.float32)) * (x @ w_up.astype(jnp.float32))
    return h, h @ w_down.astype(jnp.float32)
