"""The cached attention's prologue in Pallas's Mosaic GPU lowering: from the raw fused QKV projection to
the Mosaic GPU block attention's packed input, in one kernel.

``prologue(qkv, rope, scales, q_norm, k_norm, *, eps, batch, block_k)`` computes what
``dflash_jax.ops.attention.cached_attention``'s jnp steps compute before the attention (its reference),
then ``block_attention.mosaic_gpu.pack_inputs`` of the result:

1. the projection ``qkv``: float32 split-K partials summed in order, times the row scale (an input
   norm folded into the projection), rounded to the caches' dtype;
2. the per-head RMSNorm of each query head and the key (where the model has one), and RoPE at the
   block's positions, with the models' rounding points (each product and sum of the rotation, the
   norm's cast and its weight, in the dtype);
3. out: ``packed [batch, kv_heads, 2 * slots + q_rows, head_dim]`` (per KV head the block's K and V
   padded to whole ``block_k`` tiles, then its ``block * groups`` query rows, row ``t * groups + g``,
   padded to whole 64-row tiles: the attention kernel's one input besides the caches), and the
   block's K and V ``[batch, block, kv_heads, head_dim]`` for the cache write.

**Grid ``(tiles, kv_heads, batch)``**, one warpgroup per program: tile ``i`` is the ``i``-th 64-row
tile of ``packed``'s rows for its KV head and row (the K tiles, the V tiles, the query tiles). Each
tile's code is static (``pl.when`` on the tile index): its slots, its rows and its TMA copies.

- **Rows in the WGMMA register layout, heads as their two RoPE halves** ``[64, head_dim / 2]``: the
  norm's sum of squares is a reduction along the rows (the layout's row vector), the rotation
  elementwise between the halves, so no shuffle crosses a register.
- **The projection by TMA**, one copy per slot of a query tile (its ``groups`` query heads are one
  contiguous ``[groups, head_dim]`` box) and one strided copy per part for K or V. A tile of ``n`` used
  rows takes ``parts`` partials at row offsets ``0, n, 2n, ...`` of one buffer of ``(parts - 1) * n + 64``
  rows: part ``p``'s tile is rows ``p * n ..`` (its rows past ``n`` hold the next parts' rows, padding
  that never reaches the output), so a decode token's 8 float32 partials take 47 KB, not 256.
- **From XLA: the RoPE table and the row scales**, ``[batch, slots + q_rows, ...]`` per packed row
  (one small fusion, the same values the reference computes: cos and sin rounded to the dtype), so
  the kernel needs no per-row gather and no transcendental functions.

Forward only (inference); head dims of 64 and 128; groups dividing 64; 16-bit caches where the
attention follows (its ``wgmma`` takes 16-bit operands; the prologue alone also runs in float32). Mosaic GPU compiles for Hopper and later (sm_90a); on the CPU the
kernel runs in Mosaic GPU's interpret mode (jax >= 0.11) and lowers for CUDA
(``tests/kernels/test_mosaic_gpu.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas._mosaic import interpret_params, load, mosaic_runs_here, store
from kernels_pallas.block_attention.mosaic_gpu import ROWS, packed_layout  # the attention's input layout

SMEM_BUDGET = 160 * 1024  # bytes of shared memory a program may take (two programs share an SM)
WGMMA = plgpu.Layout.WGMMA


def _load(ref, layout):
    """``ref`` in registers of ``layout``: the unswizzled tiles' rows are 128-byte multiples apart, so
    every pattern has bank conflicts (a few KB a program: cheap against its copies from HBM)."""
    return load(ref, layout, optimized=False)


def packed_slots(block: int, groups: int, block_k: int) -> np.ndarray:
    """The block slot of each row of a KV head's K tiles, then query tiles (``slots + q_rows`` int32,
    padding rows clipped to the last slot): the rows of the RoPE table and the row scales."""
    slots, q_rows = packed_layout(block, groups, block_k)
    own = np.minimum(np.arange(slots), block - 1)
    queries = np.minimum(np.arange(q_rows) // groups, block - 1)
    return np.concatenate([own, queries]).astype(np.int32)


def shared_memory_bytes(parts: int, block: int, groups: int, head_dim: int, qkv_dtype, dtype) -> int:
    """A program's shared memory: the projection buffer of its largest tile (``_buffer_rows``), the
    output tile, the RoPE tile, the row scales and the norm weights."""
    rows = _buffer_rows(parts, block, groups)
    item = jnp.dtype(dtype).itemsize
    return (rows * head_dim * jnp.dtype(qkv_dtype).itemsize + 2 * ROWS * head_dim * item + ROWS * 4
            + 2 * head_dim * item)


def _buffer_rows(parts: int, block: int, groups: int) -> int:
    """Rows of the projection buffer: the most rows a tile uses (``used``), each part's at ``p * used``,
    and a whole 64-row tile from the last part's offset (the WGMMA layout's load)."""
    used = min(ROWS, max(block, block * groups))
    return (parts - 1) * used + ROWS


def supports(qkv_shape: tuple[int, ...], qkv_dtype, dtype, head_dim: int) -> bool:
    """Whether the kernel takes a projection ``qkv_shape`` (``[rows, block, kv_heads, groups + 2,
    head_dim]`` or ``[parts, rows, ...]``) of ``qkv_dtype`` into caches of ``dtype``: 16- or 32-bit
    floats (the attention kernel after it takes 16-bit ones), head dims of 64 or 128, groups dividing
    64, a plain projection in the caches' dtype or float32 partials, and the buffers within
    ``SMEM_BUDGET``."""
    if len(qkv_shape) not in (5, 6) or qkv_shape[-1] != head_dim:
        return False
    parts = qkv_shape[0] if len(qkv_shape) == 6 else 1
    block, groups = qkv_shape[-4], qkv_shape[-2] - 2
    floats = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
    input_ok = jnp.dtype(qkv_dtype) == jnp.dtype(jnp.float32 if len(qkv_shape) == 6 else dtype)
    return (jnp.dtype(dtype) in floats and head_dim in (64, 128) and groups >= 1 and ROWS % groups == 0
            and block >= 1 and input_ok
            and shared_memory_bytes(parts, block, groups, head_dim, qkv_dtype, dtype) <= SMEM_BUDGET)


def runs_here(qkv_shape: tuple[int, ...], qkv_dtype, dtype, head_dim: int) -> bool:
    """``supports`` on a GPU, or on the CPU in Mosaic GPU's interpret mode (jax >= 0.11)."""
    return mosaic_runs_here() and supports(qkv_shape, qkv_dtype, dtype, head_dim)


def rope_table(starts: jax.Array, inv_freq, slots_of_rows: np.ndarray, dtype) -> jax.Array:
    """``[batch, rows, head_dim]``: per packed row its cos then sin (half a head each) at position
    ``starts + slot``, rounded to ``dtype`` as ``ops.rope.apply_rope`` rounds them."""
    positions = starts[:, None] + jnp.asarray(slots_of_rows)[None]
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.concatenate([jnp.cos(freqs).astype(dtype), jnp.sin(freqs).astype(dtype)], axis=-1)


def _kernel(qkv_gmem, rope_gmem, scales_gmem, qn_gmem, kn_gmem, packed_gmem, k_gmem, v_gmem,
            buf, out_smem, rope_smem, scale_smem, qn_smem, kn_smem, *loaded, parts: int, rows_in: int,
            block: int, groups: int, block_k: int, eps: float, qk_norm: bool, scaled: bool):
    """One program: tile ``i`` of KV head ``h`` of row ``b``.

    GMEM: qkv [parts * rows_in * block, Hkv, G + 2, D] (part p, row b, slot t at ``(p * rows_in + b) *
    block + t``); rope [B, slots + q_rows, D] (cos | sin); scales [B, slots + q_rows] float32; the
    norm weights [D]; outputs packed [B, Hkv, 2 * slots + q_rows, D], k, v [B * block, Hkv, D].
    Scratch: the projection buffer, the output and RoPE tiles, the scales, the weights, a barrier per tile."""
    i = lax.axis_index("tiles")
    h = lax.axis_index("heads")
    b = lax.axis_index("rows")
    head_dim = out_smem.shape[-1]
    half = head_dim // 2
    slots, q_rows = packed_layout(block, groups, block_k)
    own_tiles = slots // ROWS
    dtype = out_smem.dtype
    f32 = jnp.float32

    def source(part, slot):  # the projection's first dimension: part, row, slot
        return (part * rows_in + b) * block + slot

    def tile_program(tile: int, barrier):
        kind = "k" if tile < own_tiles else "v" if tile < 2 * own_tiles else "q"
        if kind == "q":
            first_row = (tile - 2 * own_tiles) * ROWS
            used = min(ROWS, block * groups - first_row)
            table_row = slots + first_row
        else:
            first_row = (tile % own_tiles) * ROWS
            used = min(ROWS, block - first_row)
            table_row = first_row
        if used > 0:
            for p in range(parts):
                if kind == "q":  # a slot's query heads: one [groups, D] box
                    for s in range(used // groups):
                        slot = first_row // groups + s
                        plgpu.copy_gmem_to_smem(qkv_gmem.at[source(p, slot), h, pl.ds(0, groups)],
                                                buf.at[pl.ds(p * used + s * groups, groups)], barrier)
                else:  # the tile's slots of the key (or value) head: one strided box
                    head = groups if kind == "k" else groups + 1
                    plgpu.copy_gmem_to_smem(qkv_gmem.at[pl.ds(source(p, first_row), used), h, head],
                                            buf.at[pl.ds(p * used, used)], barrier)
            if kind != "v":
                plgpu.copy_gmem_to_smem(rope_gmem.at[b, pl.ds(table_row, ROWS)], rope_smem, barrier)
            if scaled:
                plgpu.copy_gmem_to_smem(scales_gmem.at[b, pl.ds(table_row, ROWS)], scale_smem, barrier)
            if qk_norm and kind != "v":
                norm_smem = qn_smem if kind == "q" else kn_smem
                plgpu.copy_gmem_to_smem(qn_gmem if kind == "q" else kn_gmem, norm_smem, barrier)
            plgpu.barrier_wait(barrier)

            def part_half(p, column):
                return _load(buf.at[pl.ds(p * used, ROWS), pl.ds(column, half)], WGMMA).astype(f32)

            def rounded_to(x):
                return x.astype(dtype).astype(f32)

            halves = []
            for column in (0, half):  # the sum of the partials in order, the row scale, one rounding
                x = part_half(0, column)
                for p in range(1, parts):
                    x = x + part_half(p, column)
                if scaled:
                    x = x * lax.broadcast_in_dim(_load(scale_smem, WGMMA.reduce(1)), x.shape, [0])
                halves.append(rounded_to(x))
            lo, hi = halves
            if kind != "v":
                if qk_norm:  # rms_norm: float32 normalised, cast, times the weight in the dtype
                    squares = (lo * lo).sum(axis=1) + (hi * hi).sum(axis=1)
                    scale = lax.broadcast_in_dim(lax.rsqrt(squares / head_dim + eps), lo.shape, [0])

                    def weighted(x, column):
                        w = _load(norm_smem.at[pl.ds(column, half)], WGMMA.reduce(0)).astype(f32)
                        return rounded_to(lax.broadcast_in_dim(w, x.shape, [1]) * rounded_to(x * scale))

                    lo, hi = weighted(lo, 0), weighted(hi, half)
                # RoPE (neox halves): x * cos + rotate_half(x) * sin, each product and the sum rounded
                cos = _load(rope_smem.at[:, pl.ds(0, half)], WGMMA).astype(f32)
                sin = _load(rope_smem.at[:, pl.ds(half, half)], WGMMA).astype(f32)
                lo, hi = (rounded_to(rounded_to(lo * cos) + rounded_to(-hi * sin)),
                          rounded_to(rounded_to(hi * cos) + rounded_to(lo * sin)))
            row = plgpu.broadcasted_iota(jnp.int32, lo.shape, 0, layout=WGMMA)
            for x, column in ((lo, 0), (hi, half)):  # padding rows are zeros, as pack_inputs pads
                store(out_smem.at[:, pl.ds(column, half)], jnp.where(row < used, x, 0.0).astype(dtype),
                      optimized=False)
        else:  # a tile past the block's own slots (block_k > 64): padding only
            store(out_smem, jnp.zeros(out_smem.shape, dtype), optimized=False)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, packed_gmem.at[b, h, pl.ds(tile * ROWS, ROWS)])
        if kind != "q" and used > 0:
            plain = k_gmem if kind == "k" else v_gmem
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, used)], plain.at[pl.ds(b * block + first_row, used), h])
        plgpu.wait_smem_to_gmem(0)

    for tile, barrier in enumerate(loaded):
        pl.when(i == tile)(functools.partial(tile_program, tile, barrier))


def _arrivals(tile: int, *, parts: int, block: int, groups: int, block_k: int, qk_norm: bool,
              scaled: bool) -> int:
    """The TMA copies ``_kernel`` issues into tile ``tile``'s barrier (at least 1: a barrier takes one)."""
    slots, _ = packed_layout(block, groups, block_k)
    own_tiles = slots // ROWS
    if tile >= 2 * own_tiles:
        used = min(ROWS, block * groups - (tile - 2 * own_tiles) * ROWS)
        per_part, kind = used // groups, "q"
    else:
        used = min(ROWS, block - (tile % own_tiles) * ROWS)
        per_part, kind = 1, "k" if tile < own_tiles else "v"
    if used <= 0:
        return 1
    return parts * per_part + (kind != "v") + scaled + (qk_norm and kind != "v")


def prologue(qkv: jax.Array, rope: jax.Array, scales: jax.Array | None, q_norm: jax.Array | None,
             k_norm: jax.Array | None, *, eps: float, batch: int, block_k: int, dtype,
             interpret: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``qkv [rows, block, kv_heads, groups + 2, head_dim]`` (rows >= batch; in ``dtype`` or float32)
    or float32 partials ``[parts, rows, ...]``; ``rope [batch, slots + q_rows, head_dim]``
    (``rope_table`` at ``packed_slots``); ``scales [batch, slots + q_rows]`` float32 (the row scale
    per packed row, or None); ``q_norm, k_norm [head_dim]`` (both None: no q/k norm) ->
    ``(packed [batch, kv_heads, 2 * slots + q_rows, head_dim], k, v [batch, block, kv_heads,
    head_dim])`` in ``dtype``."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    parts = qkv.shape[0] if qkv.ndim == 6 else 1
    rows_in, block, kv_heads, heads, head_dim = qkv.shape[-5:]
    groups = heads - 2
    if not supports(qkv.shape, qkv.dtype, dtype, head_dim):
        raise ValueError(f"the Mosaic GPU cached-attention prologue does not take qkv {qkv.shape} {qkv.dtype} "
                         f"into {jnp.dtype(dtype)} caches (see cached_attention.mosaic_gpu.supports)")
    slots, q_rows = packed_layout(block, groups, block_k)
    table_rows = slots + q_rows
    if rows_in < batch or rope.shape != (batch, table_rows, head_dim) or (
            scales is not None and scales.shape != (batch, table_rows)):
        raise ValueError(f"rope {rope.shape} / scales {None if scales is None else scales.shape} must be "
                         f"[{batch}, {table_rows}(, {head_dim})] for qkv {qkv.shape} of {batch} rows")
    qk_norm = q_norm is not None
    if qk_norm != (k_norm is not None) or (qk_norm and (q_norm.shape, k_norm.shape) != ((head_dim,),) * 2):
        raise ValueError(f"q_norm and k_norm must both be [{head_dim}] or both None, got "
                         f"{None if q_norm is None else q_norm.shape} / {None if k_norm is None else k_norm.shape}")
    scaled = scales is not None
    static = dict(parts=parts, block=block, groups=groups, block_k=block_k, qk_norm=qk_norm, scaled=scaled)
    tiles = (2 * slots + q_rows) // ROWS
    weights = (q_norm, k_norm) if qk_norm else (jnp.zeros((head_dim,), dtype),) * 2
    out = jax.ShapeDtypeStruct((batch * block, kv_heads, head_dim), dtype)
    packed, k, v = plgpu.kernel(
        functools.partial(_kernel, rows_in=rows_in, eps=float(eps), **static),
        out_type=[jax.ShapeDtypeStruct((batch, kv_heads, 2 * slots + q_rows, head_dim), dtype), out, out],
        scratch_types=[
            plgpu.SMEM((_buffer_rows(parts, block, groups), head_dim), qkv.dtype),
            plgpu.SMEM((ROWS, head_dim), dtype),
            plgpu.SMEM((ROWS, head_dim), dtype),
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.SMEM((head_dim,), dtype),
            plgpu.SMEM((head_dim,), dtype),
            *[plgpu.Barrier(num_arrivals=_arrivals(t, **static)) for t in range(tiles)],
        ],
        grid=(tiles, kv_heads, batch),
        grid_names=("tiles", "heads", "rows"),
        # The explicit register layouts of every load, and no inferred tiling of the shared-memory
        # buffers (which a TMA box of a few query heads, within a dimension of groups + 2, cannot take).
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_params(interpret),
        kernel_name="dflash_cached_attention_prologue_mgpu",
    )(qkv.reshape((parts * rows_in * block,) + qkv.shape[-3:]), rope.astype(dtype),
      scales if scaled else jnp.zeros((batch, table_rows), jnp.float32),
      *(w.astype(dtype) for w in weights))
    shape = (batch, block, kv_heads, head_dim)
    return packed, k.reshape(shape), v.reshape(shape)
