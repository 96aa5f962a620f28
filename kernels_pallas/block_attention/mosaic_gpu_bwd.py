"""Block attention's backward in Pallas's Mosaic GPU lowering: two kernels with TMA and ``wgmma``.

``backward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, out, lse, dout, *, causal, scale)``
computes ``reference_bwd.block_attention_bwd`` (the contract of ``gpu_bwd.block_attention_bwd_pallas``:
``(dq, dk_ctx, dv_ctx, dk_blk, dv_blk)``) from the forward's per-row log-sum-exp, FlashAttention-2
style: the probabilities are recomputed tile by tile, ``p = exp(s * scale - lse)``, ``ds = p * (dp -
delta)`` with ``delta = rowsum(dout * out)``; the dense ``[queries x keys]`` mask never exists.

- **Rows as in the forward:** per (block, KV head) the ``block * groups`` folded query rows (row ``t *
  groups + g``) in 64-row tiles, the M of one warpgroup's ``wgmma``. One XLA fusion packs, per
  (block, KV head), the block's own K and V (padded to whole 64-key tiles), the folded queries and
  the folded output gradient (padded to whole row tiles) into one array, and the log-sum-exp (in
  base 2) and ``delta`` into another.
- **dq kernel, grid ``(kv_heads * query tiles, batch * blocks)``:** a program holds its tile's Q and
  dO in shared memory and walks the context tiles below its block's ``ctx_len`` (a TMA pipeline over
  the strided cache view, as the forward), then its block's own key tiles; per tile ``S = Q K^T``,
  ``dP = dO V^T``, ``dQ += dS K`` are ``wgmma``. The own tiles also give ``dK_blk = dS^T Q`` and
  ``dV_blk = P^T dO`` (the transposed operands read from shared memory as ``wgmma``'s transposed A):
  they belong to this block alone, so no other program adds to them. Blocks are the fastest grid
  axis (Mosaic GPU launches the last one fastest): programs running together are neighbouring blocks
  of one KV head, whose contexts (training's anchors, in order) overlap in L2.
- **dk/dv kernel, grid ``(batch, kv_heads, context tiles)``:** a program holds one 64-key tile of K
  and V and walks the (block, query tile)s that see it. The blocks are ordered by context length
  (longest first, one XLA sort), so those seeing tile ``j`` are the first ``counts[j]``: the pipeline
  has that dynamic trip count and fetches the next block's Q, dO and statistics by TMA through the
  order (no load and no step for a block that does not see the tile). Tiles are the fastest grid axis:
  the programs running together read one KV head's Q and dO (L2), the longest (tile 0) first. The
  products are transposed so
  that every ``wgmma`` takes its operands as stored: ``S^T = K Q^T``, ``dP^T = V dO^T``, ``dV += P^T
  dO``, ``dK += dS^T Q``.
- **Numerics of the Triton backward:** float32 scores, probabilities and accumulators, 16-bit
  operands (``P`` and ``dS`` cast, through shared memory, which is also what Mosaic GPU's
  interpreter runs), masked probabilities zeroed (a row that sees no key contributes nothing).

16-bit floats only (``wgmma`` takes float32 as TF32); float32 keeps the Triton backward. Mosaic GPU
compiles for Hopper and later (sm_90a); on the CPU the kernels run in Mosaic GPU's interpret mode (jax
>= 0.11) and lower for CUDA (``tests/kernels/test_mosaic_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas._common import check_shapes, round_up
from kernels_pallas._mosaic import interpret_params, load, mosaic_runs_here
from kernels_pallas.block_attention.mosaic_gpu import LOG2E, ROWS, SWIZZLE, fold_rows, supports as forward_supports

BLOCK_K = 64  # keys per tile: the M of the dk/dv kernel's one-warpgroup wgmma


@dataclasses.dataclass(frozen=True)
class MosaicBwdConfig:
    """Pipeline depths of the two backward kernels: context K/V tiles in flight per dq program
    (``dq_stages``), blocks' Q/dO tiles in flight per dk/dv program (``dkv_stages``). Two keep a
    program's shared memory near 100 KB, so that two programs share an SM."""

    dq_stages: int = 2
    dkv_stages: int = 2

    def __post_init__(self):
        if self.dq_stages < 1 or self.dkv_stages < 1:
            raise ValueError(f"MosaicBwdConfig stages must be >= 1, got {self.dq_stages} / {self.dkv_stages}")


DEFAULT_CONFIG = MosaicBwdConfig()


def supports(head_dim: int, ctx: int, dtype) -> bool:
    """The forward's shapes with 64-key tiles: 16-bit floats, head_dim 64 or 128, whole 64-key
    context tiles."""
    return ctx % BLOCK_K == 0 and forward_supports(head_dim, ctx, dtype)


def runs_here(head_dim: int, ctx: int, dtype) -> bool:
    """A GPU, or the CPU in Mosaic GPU's interpret mode (jax >= 0.11), and ``supports``."""
    return mosaic_runs_here() and supports(head_dim, ctx, dtype)


_SWIZZLED = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
_ROW = plgpu.Layout.WGMMA.reduce(1)  # a value per score row
_COL = plgpu.Layout.WGMMA.reduce(0)  # a value per score column


def _matmul(shape, a, b):
    """``a @ b`` by ``wgmma`` into a fresh float32 accumulator of ``shape`` (shared-memory operands)."""
    return _matmuls(shape, (a, b))[0]


def _matmuls(shape, *products):
    """``[a @ b for a, b in products]``, each ``shape``: every ``wgmma`` issued before the first
    result is read, so the warpgroup waits for them once."""
    def run(*acc_refs):
        for acc_ref, (a, b) in zip(acc_refs, products):
            plgpu.wgmma(acc_ref, a, b)
        return [acc_ref[...] for acc_ref in acc_refs]
    return pl.run_scoped(run, *(plgpu.ACC(shape, jnp.float32) for _ in products))


def _dq_kernel(ctx_lens_gmem, blk_lens_gmem, packed_gmem, stats_gmem, k_gmem, v_gmem,
               dq_gmem, dkb_gmem, dvb_gmem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, bars,
               *, blocks: int, groups: int, slots: int, q_rows: int, stages: int, query_tiles: int,
               causal: bool, scale: float):
    """Query tile ``qt`` of KV head ``h`` of block ``bn``: dQ over its context and own keys, and its
    share of dK_blk, dV_blk.

    GMEM: ctx_lens, blk_lens [B * N]; packed [B * N, Hkv, 2 * slots + 2 * q_rows, D] (own K, own V,
    folded Q, folded dO); stats [B * N, Hkv, 2, q_rows] float32 (lse * log2(e), delta); contexts [B,
    C, Hkv, D]. Outputs dq [B * N, Hkv, q_rows, D]; dkb, dvb [B * N, Hkv, query_tiles, slots, D]."""
    head_tile = lax.axis_index("heads")
    bn = lax.axis_index("blocks")
    b = lax.div(bn, jnp.int32(blocks))
    h = lax.div(head_tile, jnp.int32(query_tiles))
    qt = lax.rem(head_tile, jnp.int32(query_tiles))
    head_dim = q_smem.shape[-1]
    q_at = 2 * slots + qt * ROWS
    plgpu.copy_gmem_to_smem(packed_gmem.at[bn, h, pl.ds(q_at, ROWS)], q_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(packed_gmem.at[bn, h, pl.ds(q_at + q_rows, ROWS)], do_smem, bars.at[1])
    plgpu.copy_gmem_to_smem(stats_gmem.at[bn, h, 0, pl.ds(qt * ROWS, ROWS)], lse_smem, bars.at[2])
    plgpu.copy_gmem_to_smem(stats_gmem.at[bn, h, 1, pl.ds(qt * ROWS, ROWS)], delta_smem, bars.at[3])
    ctx_len = ctx_lens_gmem[bn]
    blk_len = blk_lens_gmem[bn]
    for i in range(4):
        plgpu.barrier_wait(bars.at[i])
    tile_shape = (ROWS, BLOCK_K)
    # Per-row vectors, broadcast in each step: [64, 64] tiles held across the loop would take 32
    # registers a thread each beside the 64 of the dQ accumulator.
    lse, delta = load(lse_smem, layout=_ROW), load(delta_smem, layout=_ROW)
    log2_scale = scale * LOG2E

    def key_index():
        return plgpu.broadcasted_iota(jnp.int32, tile_shape, 1, layout=plgpu.Layout.WGMMA)

    def grads(valid, k_smem, v_smem, dq):
        """One tile of keys: ``(dQ + dS K, P)``; ``dS`` is left in shared memory."""
        s, dp = _matmuls(tile_shape, (q_smem, k_smem.transpose((1, 0))), (do_smem, v_smem.transpose((1, 0))))
        p = jnp.where(valid, jnp.exp2(s * log2_scale - lax.broadcast_in_dim(lse, tile_shape, [0])), 0.0)
        ds = p * (dp - lax.broadcast_in_dim(delta, tile_shape, [0]))
        ds_smem[...] = ds.astype(ds_smem.dtype)
        plgpu.commit_smem()
        return dq + _matmul((ROWS, head_dim), ds_smem, k_smem), p

    def context_step(indices, k_smem, v_smem, dq):
        return grads(key_index() + indices[0] * BLOCK_K < ctx_len, k_smem, v_smem, dq)[0]

    ctx_spec = plgpu.BlockSpec((BLOCK_K, head_dim), lambda i: (i, 0), transforms=_SWIZZLED)
    dq = plgpu.emit_pipeline(context_step, grid=(lax.div(ctx_len + BLOCK_K - 1, jnp.int32(BLOCK_K)),),
                             in_specs=[ctx_spec, ctx_spec], max_concurrent_steps=stages,
                             init_carry=plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32),
                                                          plgpu.Layout.WGMMA))(
        k_gmem.at[b, :, h], v_gmem.at[b, :, h])

    # The block's own keys, tile by tile: dQ, and this query tile's dK_blk = dS^T Q, dV_blk = P^T dO.
    def own_tiles(kb_smem, vb_smem, p_smem, out_smem, own_bars, dq):
        for tile in range(slots // BLOCK_K):
            keys = pl.ds(tile * BLOCK_K, BLOCK_K)
            plgpu.copy_gmem_to_smem(packed_gmem.at[bn, h, pl.ds(tile * BLOCK_K, BLOCK_K)], kb_smem, own_bars.at[0])
            plgpu.copy_gmem_to_smem(packed_gmem.at[bn, h, pl.ds(slots + tile * BLOCK_K, BLOCK_K)], vb_smem,
                                    own_bars.at[1])
            plgpu.barrier_wait(own_bars.at[0])
            plgpu.barrier_wait(own_bars.at[1])
            slot = key_index() + tile * BLOCK_K
            valid = slot < blk_len
            if causal:
                row = plgpu.broadcasted_iota(jnp.int32, tile_shape, 0, layout=plgpu.Layout.WGMMA) + qt * ROWS
                valid = valid & (slot * groups <= row)
            dq, p = grads(valid, kb_smem, vb_smem, dq)
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            # dK_blk then dV_blk through one buffer: 16 KB less, so that two programs fit an SM
            for lhs, rhs, factor, gmem in ((ds_smem, q_smem, scale, dkb_gmem), (p_smem, do_smem, 1.0, dvb_gmem)):
                grad = _matmul((BLOCK_K, head_dim), lhs.transpose((1, 0)), rhs) * factor
                out_smem[...] = grad.astype(out_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem, gmem.at[bn, h, qt, keys])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the buffer is rewritten next
        plgpu.wait_smem_to_gmem(0)
        return dq

    out_dtype = dkb_gmem.dtype
    out_transforms = _SWIZZLED if jnp.dtype(out_dtype).itemsize == 2 else ()
    dq = pl.run_scoped(functools.partial(own_tiles, dq=dq),
                       plgpu.SMEM((BLOCK_K, head_dim), packed_gmem.dtype, transforms=_SWIZZLED),
                       plgpu.SMEM((BLOCK_K, head_dim), packed_gmem.dtype, transforms=_SWIZZLED),
                       plgpu.SMEM((ROWS, BLOCK_K), packed_gmem.dtype, transforms=_SWIZZLED),
                       plgpu.SMEM((BLOCK_K, head_dim), out_dtype, transforms=out_transforms),
                       plgpu.Barrier(num_barriers=2))
    q_smem[...] = (dq * scale).astype(q_smem.dtype)  # Q is no longer read: its buffer stores dQ
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_gmem.at[bn, h, pl.ds(qt * ROWS, ROWS)])
    plgpu.wait_smem_to_gmem(0)


def _dkv_kernel(counts_gmem, order_gmem, ctx_lens_gmem, packed_gmem, stats_gmem, k_gmem, v_gmem,
                dk_gmem, dv_gmem, k_smem, v_smem, pt_smem, bars, *, blocks: int, kv_heads: int, slots: int,
                q_rows: int, stages: int, query_tiles: int, scale: float):
    """Context tile ``j`` of KV head ``h`` of row ``b``: dK, dV over the (block, query tile)s that see it.

    GMEM: counts [B, tiles] (blocks with ``ctx_len > j * 64``); order [B * N] (each row's blocks,
    longest context first); ctx_lens [B * N]; packed [B * N * Hkv * (2 * slots + 2 * q_rows), D] (the
    dq kernel's, flat); stats [B * N * Hkv * 2 * q_rows] float32 (flat); contexts [B, C, Hkv, D].
    Outputs dk, dv [B, C, Hkv, D]."""
    j = lax.axis_index("tiles")
    h = lax.axis_index("heads")
    b = lax.axis_index("batch")
    head_dim = k_smem.shape[-1]
    keys = pl.ds(j * BLOCK_K, BLOCK_K)
    plgpu.copy_gmem_to_smem(k_gmem.at[b, keys, h], k_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(v_gmem.at[b, keys, h], v_smem, bars.at[1])
    steps = counts_gmem[b, j] * query_tiles
    packed_tiles = (2 * slots + 2 * q_rows) // ROWS  # row tiles of one (block, KV head) in packed
    stat_tiles = 2 * q_rows // ROWS

    def block_of(i):
        """Step ``i``'s block (its row of ``packed``'s first axis) and query tile."""
        qt = lax.rem(i, jnp.int32(query_tiles))
        return b * blocks + order_gmem[b * blocks + lax.div(i, jnp.int32(query_tiles))], qt

    def q_tile(i):
        bn, qt = block_of(i)
        return ((bn * kv_heads + h) * packed_tiles + 2 * slots // ROWS + qt, 0)

    def do_tile(i):
        bn, qt = block_of(i)
        return ((bn * kv_heads + h) * packed_tiles + (2 * slots + q_rows) // ROWS + qt, 0)

    def lse_tile(i):
        bn, qt = block_of(i)
        return ((bn * kv_heads + h) * stat_tiles + qt,)

    def delta_tile(i):
        bn, qt = block_of(i)
        return ((bn * kv_heads + h) * stat_tiles + q_rows // ROWS + qt,)

    tile_shape = (BLOCK_K, ROWS)
    log2_scale = scale * LOG2E

    def step(indices, q_smem, do_smem, lse_smem, delta_smem, carry):
        dk, dv = carry
        ctx_len = ctx_lens_gmem[block_of(indices[0])[0]]
        st, dpt = _matmuls(tile_shape, (k_smem, q_smem.transpose((1, 0))), (v_smem, do_smem.transpose((1, 0))))
        lse = lax.broadcast_in_dim(load(lse_smem, layout=_COL), tile_shape, [1])
        key = plgpu.broadcasted_iota(jnp.int32, tile_shape, 0, layout=plgpu.Layout.WGMMA) + j * BLOCK_K
        pt = jnp.where(key < ctx_len, jnp.exp2(st * log2_scale - lse), 0.0)
        pt_smem[...] = pt.astype(pt_smem.dtype)
        plgpu.commit_smem()
        dv = dv + _matmul((BLOCK_K, head_dim), pt_smem, do_smem)
        delta = lax.broadcast_in_dim(load(delta_smem, layout=_COL), tile_shape, [1])
        pt_smem[...] = (pt * (dpt - delta)).astype(pt_smem.dtype)  # dS^T, in P^T's buffer
        plgpu.commit_smem()
        return dk + _matmul((BLOCK_K, head_dim), pt_smem, q_smem), dv

    row_spec = lambda index: plgpu.BlockSpec((ROWS, head_dim), index, transforms=_SWIZZLED)  # noqa: E731
    zeros = plgpu.layout_cast(jnp.zeros((BLOCK_K, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    plgpu.barrier_wait(bars.at[0])
    plgpu.barrier_wait(bars.at[1])
    dk, dv = plgpu.emit_pipeline(
        step, grid=(steps,), max_concurrent_steps=stages, init_carry=(zeros, zeros),
        in_specs=[row_spec(q_tile), row_spec(do_tile), plgpu.BlockSpec((ROWS,), lse_tile),
                  plgpu.BlockSpec((ROWS,), delta_tile)])(packed_gmem, packed_gmem, stats_gmem, stats_gmem)
    k_smem[...] = (dk * scale).astype(k_smem.dtype)  # K and V are no longer read: they store dK, dV
    v_smem[...] = dv.astype(v_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_gmem.at[b, keys, h])
    plgpu.copy_smem_to_gmem(v_smem, dv_gmem.at[b, keys, h])
    plgpu.wait_smem_to_gmem(0)


def backward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, out, lse, dout, *, causal: bool, scale: float,
             interpret: bool | None = None, config: MosaicBwdConfig | None = None):
    """``gpu_bwd.block_attention_bwd_pallas``'s contract: ``(dq, dk_ctx, dv_ctx, dk_blk, dv_blk)`` in
    their inputs' shapes and dtypes; ``lse [B, N, Hkv, T * G]`` the forward's (natural log, NEG where
    a row sees no key)."""
    cfg = config or DEFAULT_CONFIG
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    b, n, t, hq, hkv, d = check_shapes(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens)
    ctx, dtype = k_ctx.shape[1], k_ctx.dtype
    if not supports(d, ctx, dtype) or q.dtype != dtype:
        raise ValueError(f"the Mosaic GPU block attention backward does not take head_dim {d}, context {ctx}, "
                         f"{q.dtype} queries over {dtype} K/V (see mosaic_gpu_bwd.supports)")
    g = hq // hkv
    rows = t * g
    q_rows, slots = round_up(rows, ROWS), round_up(t, BLOCK_K)
    query_tiles, tiles, bn = q_rows // ROWS, ctx // BLOCK_K, b * n

    def own(x):  # [B, N, T, Hkv, D] -> [B * N, Hkv, slots, D]
        x = x.reshape(bn, t, hkv, d).transpose(0, 2, 1, 3)
        return jnp.pad(x.astype(dtype), ((0, 0), (0, 0), (0, slots - t), (0, 0)))

    # One fusion: own K, own V, folded Q, folded dO; and the row statistics, padded rows all zero
    # (their probabilities then meet zero dO and zero delta: no contribution).
    packed = jnp.concatenate([own(k_blk), own(v_blk), fold_rows(q.astype(dtype), hkv, q_rows),
                              fold_rows(dout.astype(dtype), hkv, q_rows)], axis=2)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)[..., None]  # [B, N, T, Hq, 1]
    stats = jnp.stack([lse.reshape(bn, hkv, rows) * LOG2E, fold_rows(delta, hkv, rows)[..., 0]], axis=2)
    stats = jnp.pad(stats, ((0, 0), (0, 0), (0, 0), (0, q_rows - rows)))
    ctx_lens = jnp.clip(ctx_lens.astype(jnp.int32), 0, ctx)
    blk_lens = jnp.clip(blk_lens.astype(jnp.int32), 0, t)
    params = dict(compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret_params(interpret))

    partial_dtype = dtype if query_tiles == 1 else jnp.float32  # several query tiles' shares are summed
    dq, dkb, dvb = plgpu.kernel(
        functools.partial(_dq_kernel, blocks=n, groups=g, slots=slots, q_rows=q_rows, stages=cfg.dq_stages,
                          query_tiles=query_tiles, causal=causal, scale=scale),
        out_type=[jax.ShapeDtypeStruct((bn, hkv, q_rows, d), dtype),
                  jax.ShapeDtypeStruct((bn, hkv, query_tiles, slots, d), partial_dtype),
                  jax.ShapeDtypeStruct((bn, hkv, query_tiles, slots, d), partial_dtype)],
        scratch_types=[plgpu.SMEM((ROWS, d), dtype, transforms=_SWIZZLED),
                       plgpu.SMEM((ROWS, d), dtype, transforms=_SWIZZLED),
                       plgpu.SMEM((ROWS,), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32),
                       plgpu.SMEM((ROWS, BLOCK_K), dtype, transforms=_SWIZZLED),
                       plgpu.Barrier(num_barriers=4)],
        grid=(hkv * query_tiles, bn), grid_names=("heads", "blocks"),
        kernel_name="dflash_block_attention_bwd_dq_mgpu", **params,
    )(ctx_lens.reshape(bn), blk_lens.reshape(bn), packed, stats, k_ctx, v_ctx)

    # Each row's blocks, longest context first: those that see tile j are the first counts[j].
    order = jnp.argsort(-ctx_lens, axis=1, stable=True).astype(jnp.int32)
    counts = jnp.sum(ctx_lens[:, None, :] > (jnp.arange(tiles, dtype=jnp.int32) * BLOCK_K)[None, :, None],
                     axis=2, dtype=jnp.int32)
    dk, dv = plgpu.kernel(
        functools.partial(_dkv_kernel, blocks=n, kv_heads=hkv, slots=slots, q_rows=q_rows, stages=cfg.dkv_stages,
                          query_tiles=query_tiles, scale=scale),
        out_type=[jax.ShapeDtypeStruct(k_ctx.shape, dtype), jax.ShapeDtypeStruct(v_ctx.shape, dtype)],
        scratch_types=[plgpu.SMEM((BLOCK_K, d), dtype, transforms=_SWIZZLED),
                       plgpu.SMEM((BLOCK_K, d), dtype, transforms=_SWIZZLED),
                       plgpu.SMEM((BLOCK_K, ROWS), dtype, transforms=_SWIZZLED),
                       plgpu.Barrier(num_barriers=2)],
        grid=(b, hkv, tiles), grid_names=("batch", "heads", "tiles"),
        kernel_name="dflash_block_attention_bwd_dkv_mgpu", **params,
    )(counts, order.reshape(bn), ctx_lens.reshape(bn), packed.reshape(-1, d), stats.reshape(-1), k_ctx, v_ctx)

    def unfold_own(x):  # [B * N, Hkv, query_tiles, slots, D] -> [B, N, T, Hkv, D]
        x = x.sum(axis=2) if query_tiles > 1 else x[:, :, 0]
        return x[:, :, :t].reshape(b, n, hkv, t, d).transpose(0, 1, 3, 2, 4).astype(k_blk.dtype)

    dq = dq[:, :, :rows].reshape(b, n, hkv, t, g, d).transpose(0, 1, 3, 2, 4, 5).reshape(b, n, t, hq, d)
    return dq.astype(q.dtype), dk, dv, unfold_own(dkb), unfold_own(dvb)
