"""The part of a decoder layer between two attentions as one persistent kernel (Pallas Mosaic GPU):
the output projection and its residual add, the post-attention RMSNorm, gate-up with the SwiGLU, the
down projection and its residual add, the next layer's input RMSNorm and its QKV projection. With
``EngineConfig(tail_layout="on")`` the engine's decode and verify steps run it on a GPU for blocks of
up to 16 rows (``dflash_jax/tail_layout.py``: the target's weights held once in its layout);
``layer_tail_reference`` is its math in jnp, the same layout, which runs for every other shape and
platform. In the engine it is not faster than the fused layout's kernels (docs/kernels.md).

Why: at batch 1 this stretch of a layer is nine kernels in the engine (four GEMMs, three split-K
reductions, two ``add_rms_norm``, the SwiGLU: ~107 us, docs/benchmarks.md). The persistent chain
(``bench/persistent_chain.py``) streams the same four matmuls with ready flags in 94-96 us, but without
the norms, the SwiGLU and the residual adds between them. Here they ride along:
- a residual add is the epilogue of the output and down projections' tiles (the residual tile is
  copied in while the tile's weights stream);
- an RMSNorm is folded: its weight into the next matmul's weight (``fold_norm``, at load), its
  ``rsqrt(mean(h^2) + eps)`` per row applied to the accumulator in the epilogue. The mean square
  comes from one more small WGMMA per step, ``x @ x^T`` over the x tiles the matmul streams anyway,
  whose diagonal is each row's sum of squares: no reduction of its own, no extra pass;
- the SwiGLU is the epilogue of a gate-up tile: its 32 gate and 32 up weight rows side by side
  (``interleave_gate_up``), two accumulators.
So every phase streams its x straight from the previous phase's output, as the chain does.

Numerics: the norm weight is rounded into the bf16 weight, and the row scale is applied after the
dot rather than before it; both move the result by bf16 rounding, like a change of GEMM
(``bench/bench_persistent_layer.py`` checks the kernel against a float32 reference of the layer).

The phases, with ``R`` rows (a decode token padded to 8): 0 ``h1 = h + a @ w_o``; 1 ``s =
swiglu(norm(h1) @ w_gu)``; 2 ``h2 = h1 + s @ w_d``; 3 ``qkv = norm(h2) @ w_qkv`` (left out for a
model's last layer). Weights are stored ``[N, K]`` (x is the WGMMA's left operand, rows padded to 64,
so tiles may be any multiple of 8 columns wide: 128 tiles for every phase but gate-up's 384). Program
``p`` takes tiles ``p, p + P, ...`` of each phase. A phase waits for the previous one through ready
counters per 2048 output columns (the chain's best): a program counts each tile it stores, a reader
waits before its first x copy of each group.

Measured on the H200 (docs/benchmarks.md, eighteenth session), GPU kernel time per layer: 100.7-101.0
us at one row against ~104.6-104.9 for the engine's nine kernels, 103.3 (6 stages) against ~108.6 at
16 rows; 6 to 9 stages within ~1.5 us of each other, flags per 1024 columns 2 us slower. No interpret
mode (it has neither global semaphores nor transposed WGMMA operands): off a GPU the reference stands
in (``kernels_pallas.layer_tail``), and ``bench/bench_persistent_layer.py`` checks the kernel against
a float32 reference of the model's math on the device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._mosaic_gpu import (SMEM_BUDGET, WGMMA_M, count_into_groups, fence_proxy_async, group_tiles,
                                        reset_ready_counters, swizzled)

O, GU, D, QKV = range(4)  # the phases
GATE_UP_TILE = 64  # weight rows of a gate-up tile: half gate, half the same units' up
ROW_MULTIPLE = 8  # the kernel takes rows in multiples of this (a decode token is padded to it)
MAX_ROWS = 16  # and at most this many (a verify block of 16)


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """Per phase (output, gate-up, down, QKV): ``tile_n`` weight rows per tile (gate-up: 32 gate and
    32 up) and ``tile_k`` K rows per weight tile (the ring's slot holds the largest product);
    ``stages`` tiles in flight; ``programs`` resident programs (one per SM); ``flag_cols`` output
    columns per ready counter."""

    tile_n: tuple[int, ...] = (32, 64, 32, 48)
    tile_k: tuple[int, ...] = (256, 128, 256, 128)
    stages: int = 8
    programs: int = 128
    flag_cols: int = 2048

    def out_cols(self, j: int) -> int:
        """Output columns per tile of phase ``j``."""
        return self.tile_n[j] // 2 if j == GU else self.tile_n[j]

    def slot(self) -> int:
        return max(n * k for n, k in zip(self.tile_n, self.tile_k))

    def smem_bytes(self, rows: int, phases: int) -> int:
        x_ring = (self.stages * rows + WGMMA_M - rows) * max(self.tile_k)
        out = WGMMA_M * max(self.out_cols(j) for j in range(phases))
        return (self.stages * self.slot() + x_ring + out + WGMMA_M * self.out_cols(O)) * 2


def interleave_gate_up(w_gate: jax.Array, w_up: jax.Array, tile: int = GATE_UP_TILE) -> jax.Array:
    """``w_gate, w_up [K, I]`` -> ``[2 I, K]``: per gate-up tile of ``tile`` rows, its ``tile / 2``
    gate rows then the same units' up rows."""
    k, i = w_gate.shape
    half = tile // 2
    pairs = jnp.stack([w_gate.T.reshape(i // half, half, k), w_up.T.reshape(i // half, half, k)], axis=1)
    return pairs.reshape(2 * i, k)


def fold_norm(norm_weight: jax.Array, w: jax.Array) -> jax.Array:
    """``w [K, N]`` with the RMSNorm weight ``[K]`` before it folded in (still ``[K, N]``)."""
    return (norm_weight.astype(jnp.float32)[:, None] * w.astype(jnp.float32)).astype(w.dtype)


def supports(rows: int, hidden: int, intermediate: int, qkv: int | None, config: LayerConfig, *,
             attention: int | None = None) -> bool:
    """Whether the kernel takes ``rows`` rows and these widths: ``attention`` the output projection's
    input (heads x head_dim; None: ``hidden``), ``qkv`` the next QKV's output (None: no next layer)."""
    c = config
    phases = 3 if qkv is None else 4
    outs = [hidden, intermediate, hidden, qkv or 0][:phases]
    ks = [attention or hidden, hidden, intermediate, hidden][:phases]
    return (rows % ROW_MULTIPLE == 0 and rows <= MAX_ROWS and c.out_cols(O) == c.out_cols(D) and c.tile_n[GU] == GATE_UP_TILE
            and all(n % c.out_cols(j) == 0 and n // c.out_cols(j) >= c.programs for j, n in enumerate(outs))
            and all(k % c.tile_k[j] == 0 and c.flag_cols % c.tile_k[j] == 0 and c.slot() % c.tile_k[j] == 0
                    for j, k in enumerate(ks))
            and all(n % c.flag_cols == 0 for n in outs[:phases - 1])
            and sum(n // c.flag_cols for n in outs[:phases - 1]) <= c.programs <= 132
            and c.smem_bytes(rows, phases) <= SMEM_BUDGET)


# The ring depths measured fastest (docs/benchmarks.md, eighteenth session): 8 stages at one row
# (padded to 8), 6 for a verify block of 16 rows, where 8 do not fit in shared memory.
MEASURED_STAGES = (8, 6)


def config_for(rows: int, hidden: int, intermediate: int, qkv: int | None, *,
               attention: int | None = None) -> LayerConfig | None:
    """The fastest measured configuration that takes these shapes (None: none does)."""
    for stages in MEASURED_STAGES:
        config = LayerConfig(stages=stages)
        if supports(rows, hidden, intermediate, qkv, config, attention=attention):
            return config
    return None


def layer_tail(a: jax.Array, h: jax.Array, w_o: jax.Array, w_gu: jax.Array, w_d: jax.Array,
               w_qkv: jax.Array | None, *, eps: float, config: LayerConfig = LayerConfig()) -> list[jax.Array]:
    """``a [R, >= A]`` (the attention's output in its first ``A`` columns), ``h [R, H]`` (the
    residual), weights ``[N, K]``: ``w_o [H, A]``, ``w_gu [2 I, H]`` (``interleave_gate_up`` of the
    norm-folded gate and up), ``w_d [H, I]``, ``w_qkv [Q, H]`` (norm-folded; None: no next layer)
    -> ``h1 [R, H]``, ``s [R, I]``, ``h2 [R, H]`` and ``qkv [R, Q]`` (if ``w_qkv``)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    c = config
    weights = [w_o, w_gu, w_d] + ([] if w_qkv is None else [w_qkv])
    phases = len(weights)
    rows, hidden = h.shape
    intermediate = w_d.shape[1]
    if not supports(rows, hidden, intermediate, None if w_qkv is None else w_qkv.shape[0], c,
                    attention=w_o.shape[1]):
        raise ValueError(f"layer_tail: rows {rows}, weights {[w.shape for w in weights]} not supported by {c}")
    outs = [w.shape[0] // (2 if j == GU else 1) for j, w in enumerate(weights)]
    ks = [w.shape[1] for w in weights]
    programs = c.programs
    tiles = [n // c.out_cols(j) for j, n in enumerate(outs)]
    k_steps = [k // c.tile_k[j] for j, k in enumerate(ks)]
    waves = [-(-t // programs) for t in tiles]
    groups = [n // c.flag_cols for n in outs[:phases - 1]]  # the last phase has no reader here
    base = [sum(groups[:j]) for j in range(phases - 1)]
    bks = sorted(set(c.tile_k))
    views = {bk: i for i, bk in enumerate(bks)}

    def body(a_gmem, h_gmem, *refs):
        w_gmem, y_gmem = refs[:phases], refs[phases:2 * phases]
        w_smem, x_smem, out_smem, res_smem, w_ready, x_ready, res_ready = refs[2 * phases:]
        w_rings = [w_smem[views[c.tile_k[j]]] for j in range(phases)]
        x_rings = [x_smem[views[c.tile_k[j]]] for j in range(phases)]
        out_tiles = [out_smem[j] for j in range(phases)]
        x_src = [a_gmem] + list(y_gmem[:phases - 1])
        p = lax.axis_index("p")
        ready = pl.get_global(plgpu.SemaphoreType.REGULAR((sum(groups),)))
        exited = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        drained = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        mine = [jnp.maximum(0, (t - p + programs - 1) // programs) for t in tiles]
        start = [0]
        for j in range(phases):
            start.append(start[-1] + mine[j] * k_steps[j])
        steps = start[-1]

        def fetch_weights(step):
            slot = step % c.stages
            for j in range(phases):
                @pl.when((start[j] <= step) & (step < start[j + 1]))
                def _(j=j):
                    i, kk = (step - start[j]) // k_steps[j], (step - start[j]) % k_steps[j]
                    cols = pl.ds((p + i * programs) * c.tile_n[j], c.tile_n[j])
                    plgpu.copy_gmem_to_smem(w_gmem[j].at[cols, pl.ds(kk * c.tile_k[j], c.tile_k[j])],
                                            w_rings[j].at[slot, pl.ds(0, c.tile_n[j])], w_ready.at[slot])

        def tiles_in_group(j: int, g):
            return group_tiles(c.flag_cols, c.out_cols(j), g)

        def await_group(j: int, kk):
            """Waits until the previous phase has stored the group that step ``kk`` of phase ``j`` reads."""
            g = (kk * c.tile_k[j]) // c.flag_cols
            with jax.named_scope("wait"):
                plgpu.semaphore_wait(ready.at[base[j - 1] + g], tiles_in_group(j - 1, g), decrement=False,
                                     memory_scope="gpu")
                fence_proxy_async()

        def fetch_x(step, j: int):
            first = start[j]
            slot, kk = step % c.stages, (step - first) % k_steps[j]
            if j > 0:
                first_read = (step - first < k_steps[j]) & ((kk * c.tile_k[j]) % c.flag_cols == 0)
                pl.when(first_read)(lambda: await_group(j, kk))
            plgpu.copy_gmem_to_smem(x_src[j].at[:, pl.ds(kk * c.tile_k[j], c.tile_k[j])],
                                    x_rings[j].at[pl.ds(slot * rows, rows)], x_ready.at[slot])

        for step in range(c.stages - 1):
            pl.when(step < steps)(lambda step=step: fetch_weights(step))
        # Nothing above reads what the kernel before wrote: launched early (programmatic dependent
        # launch, which JAX asks for when a kernel waits), the weight ring fills while that kernel
        # finishes, and the wait holds every read of the attention output and the residual.
        plgpu.griddepcontrol_wait()

        def run_phase(j: int):
            first, end = start[j], start[j + 1]
            for q in range(c.stages - 1):
                pl.when(first + q < end)(lambda q=q: fetch_x(first + q, j))
            normed = j in (GU, QKV)
            accs = ([plgpu.ACC((WGMMA_M, c.out_cols(j)))] * (2 if j == GU else 1)
                    + ([plgpu.ACC((WGMMA_M, rows))] if normed else []))
            for i in range(waves[j]):
                @pl.when(i < mine[j])
                def _(i=i):
                    t = p + i * programs
                    out_cols = pl.ds(t * c.out_cols(j), c.out_cols(j))
                    if j in (O, D):  # the residual tile, copied in while the weights stream
                        residual = h_gmem if j == O else y_gmem[O]
                        plgpu.copy_gmem_to_smem(residual.at[:, out_cols], res_smem.at[pl.ds(0, rows)],
                                                res_ready.at[0])

                    def accumulate(*acc_refs):
                        def k_step(kk, carry):
                            step = first + i * k_steps[j] + kk
                            slot = step % c.stages
                            plgpu.barrier_wait(x_ready.at[slot])
                            plgpu.barrier_wait(w_ready.at[slot])
                            x_tile = x_rings[j].at[pl.ds(slot * rows, WGMMA_M)]
                            w_slot = w_rings[j].at[slot]
                            if j == GU:
                                half = c.out_cols(GU)
                                plgpu.wgmma(acc_refs[0], x_tile, plgpu.transpose_ref(w_slot.at[pl.ds(0, half)], (1, 0)))
                                plgpu.wgmma(acc_refs[1], x_tile, plgpu.transpose_ref(w_slot.at[pl.ds(half, half)], (1, 0)))
                            else:
                                plgpu.wgmma(acc_refs[0], x_tile,
                                            plgpu.transpose_ref(w_slot.at[pl.ds(0, c.tile_n[j])], (1, 0)))
                            if normed:  # the diagonal of x x^T: each row's sum of squares
                                plgpu.wgmma(acc_refs[-1], x_tile,
                                            plgpu.transpose_ref(x_rings[j].at[pl.ds(slot * rows, rows)], (1, 0)))
                            plgpu.wgmma_wait(len(acc_refs))  # the previous step's are done: its slot is free
                            pl.when(step + c.stages - 1 < steps)(lambda: fetch_weights(step + c.stages - 1))
                            pl.when(step + c.stages - 1 < end)(lambda: fetch_x(step + c.stages - 1, j))
                            return carry

                        lax.fori_loop(0, k_steps[j], k_step, None)
                        plgpu.wgmma_wait(0)
                        return tuple(ref[...] for ref in acc_refs)

                    accs_out = pl.run_scoped(accumulate, *accs)
                    if normed:
                        sq = accs_out[-1]
                        diag = (plgpu.broadcasted_iota(jnp.int32, sq.shape, 0, layout=plgpu.Layout.WGMMA)
                                == plgpu.broadcasted_iota(jnp.int32, sq.shape, 1, layout=plgpu.Layout.WGMMA))
                        mean_sq = jnp.sum(jnp.where(diag, sq, 0.0), axis=1) * (1.0 / ks[j])
                        # (a [64] row vector broadcasts by broadcast_in_dim, not by a new axis, in Mosaic GPU)
                        scale = lax.broadcast_in_dim(lax.rsqrt(mean_sq + eps), accs_out[0].shape, (0,))
                    if j in (O, D):
                        plgpu.barrier_wait(res_ready.at[0])
                        res = plgpu.load(res_smem, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                        y = res + accs_out[0].astype(h.dtype).astype(jnp.float32)
                    elif j == GU:
                        gate = (accs_out[0] * scale).astype(h.dtype).astype(jnp.float32)
                        up = (accs_out[1] * scale).astype(h.dtype).astype(jnp.float32)
                        silu = (gate / (1.0 + jnp.exp(-gate))).astype(h.dtype).astype(jnp.float32)
                        y = silu * up
                    else:
                        y = accs_out[0] * scale
                    out_tiles[j][...] = y.astype(h.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_tiles[j].at[pl.ds(0, rows)], y_gmem[j].at[:, out_cols])
                    plgpu.wait_smem_to_gmem(0)
                    if j < phases - 1:
                        fence_proxy_async()
                        count_into_groups(ready, base[j], c.flag_cols, c.out_cols(j), t)

        for j in range(phases):
            with jax.named_scope(f"m{j}"):
                run_phase(j)
        reset_ready_counters(ready, exited, drained, p, programs,
                             [tiles_in_group(j, g) for j in range(phases - 1) for g in range(groups[j])])

    ring = lambda shape, minor: plgpu.SMEM(shape, h.dtype, transforms=swizzled(minor, 2))  # noqa: E731
    scratch = (plgpu.RefUnion(*(ring((c.stages, c.slot() // bk, bk), bk) for bk in bks)),
               plgpu.RefUnion(*(ring((c.stages * rows + WGMMA_M - rows, bk), bk) for bk in bks)),
               plgpu.RefUnion(*(ring((WGMMA_M, c.out_cols(j)), c.out_cols(j)) for j in range(phases))),
               ring((WGMMA_M, c.out_cols(O)), c.out_cols(O)),
               plgpu.Barrier(num_arrivals=1, num_barriers=c.stages),
               plgpu.Barrier(num_arrivals=1, num_barriers=c.stages),
               plgpu.Barrier(num_arrivals=1, num_barriers=1))
    out_types = [jax.ShapeDtypeStruct((rows, n), h.dtype) for n in outs]
    kernel = plgpu.kernel(body, out_type=out_types, scratch_types=scratch, grid=(programs,), grid_names=("p",))
    return list(kernel(a, h, *weights))


def _dot_nk(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [R, K] @ w [N, K]^T`` with a float32 result."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def normed_matmul(x: jax.Array, w: jax.Array, *, eps: float) -> jax.Array:
    """``rms_norm(x) @ w^T`` as the kernel computes it for a norm folded into ``w [N, K]``: the dot
    of the raw rows ``x [R, K]``, scaled per row by ``rsqrt(mean(x^2) + eps)`` -> float32 ``[R, N]``."""
    xf = x.astype(jnp.float32)
    return lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * _dot_nk(x, w)


def layer_tail_reference(a: jax.Array, h: jax.Array, w_o: jax.Array, w_gu: jax.Array, w_d: jax.Array,
                         w_qkv: jax.Array | None, *, eps: float) -> list[jax.Array]:
    """``layer_tail``'s math in jnp, the same arguments, layout and roundings (the products rounded
    to ``h``'s dtype where the kernel stores or rounds them), for any number of rows.

    Each dot's float32 result is rounded (or scaled, then rounded) at once, before any reshape: an
    order meant to let XLA round in its GEMM's epilogue rather than write and read the float32
    gate-up product (25 MB per layer at 256 rows). On the H200 it did not change a 256-row verify
    pass's time (docs/benchmarks.md, nineteenth session)."""
    rows = h.shape[0]
    f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
    h1 = (f32(h) + f32(_dot_nk(a[:, :w_o.shape[1]], w_o).astype(h.dtype))).astype(h.dtype)
    half = GATE_UP_TILE // 2
    gate_up = normed_matmul(h1, w_gu, eps=eps).astype(h.dtype).reshape(rows, -1, 2, half)
    gate, up = f32(gate_up[:, :, 0].reshape(rows, -1)), f32(gate_up[:, :, 1].reshape(rows, -1))
    s = (f32((gate / (1.0 + jnp.exp(-gate))).astype(h.dtype)) * up).astype(h.dtype)
    h2 = (f32(h1) + f32(_dot_nk(s, w_d).astype(h.dtype))).astype(h.dtype)
    if w_qkv is None:
        return [h1, s, h2]
    return [h1, s, h2, normed_matmul(h2, w_qkv, eps=eps).astype(h.dtype)]
