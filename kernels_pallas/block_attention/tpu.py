"""Block attention on TPUs: Pallas / Mosaic TPU with scalar-prefetched lengths.

Grid ``(batch, blocks, kv_heads, ctx_tiles + 1)``; the last axis is the reduction ("arbitrary")
axis that Mosaic pipelines: steps ``0 .. ctx_tiles - 1`` stream context tiles of ``block_k`` keys,
the final step takes the block's own keys and writes the output. The per-(row, block) lengths are
scalar-prefetched into SMEM (``PrefetchScalarGridSpec``) and used twice:

- in the K/V ``index_map``: the tile index is clamped to the last tile that holds a visible key,
  so the tiles past ``ctx_len`` repeat the previous block index and Mosaic issues no DMA for them
  (a short row in a long cache costs no HBM traffic);
- in the kernel: ``pl.when`` skips the compute of those tiles, and the last tile is masked.

Layouts (all lane-dense for Mosaic's (8, 128) tiling):

- queries are folded to ``[batch, blocks, kv_heads, block * groups, head_dim]`` (rows = slots x
  group members, see ``_common``); outputs come back the same way, and so do the block's K/V;
- the context K/V stay in the cache layout, seen as ``[batch, ctx, kv_heads * head_dim]`` (a free
  reshape); a ``(block_k, head_dim)`` block at column-block ``h`` is KV head ``h``. On real
  hardware this needs ``head_dim % 128 == 0`` (or one KV head) and ``block_k % 8 == 0``.

Paged contexts (``paged_forward``): the context is a pool ``[pages, page_size, kv_heads, head_dim]``
and a page table per row, scalar-prefetched beside the lengths; a context tile is one page, and the
K/V ``index_map`` names the page the row's table holds for that tile (clamped as above), so Mosaic
DMAs each tile straight from its page. Tiles of one page (at most 128 positions in an engine) take
more grid steps than the contiguous kernel's 512-key tiles.

Online softmax in float32 scratch (m, l as ``[rows, 1]``, acc ``[rows, head_dim]``); the
log-sum-exp per row is written for the backward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._common import (
    NEG,
    check_shapes,
    default_scale,
    fold_blk,
    fold_q,
    round_up,
    unfold_rows,
)


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    block_k: int = 512  # context keys per tile (multiple of 8; 128+ keeps the MXU busy)


def _update(m_sc, l_sc, acc_sc, s, valid, v, scale):
    s = jnp.where(valid, s * scale, NEG)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    acc_sc[...] = acc_sc[...] * alpha + pv
    m_sc[...] = m_new


def _nt_dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(
    cl_ref,  # SMEM [B * N] int32 (scalar prefetch)
    bl_ref,  # SMEM [B * N] int32 (scalar prefetch)
    q_ref,  # [R, D]
    k_ref,  # [bk, D]
    v_ref,  # [bk, D]
    kb_ref,  # [S, D]
    vb_ref,  # [S, D]
    o_ref,  # [R, D]
    lse_ref,  # [R, 1]
    m_sc,
    l_sc,
    acc_sc,
    *,
    scale: float,
    causal: bool,
    groups: int,
    block_k: int,
    blocks: int,
):
    b = pl.program_id(0)
    n = pl.program_id(1)
    kk = pl.program_id(3)
    n_tiles = pl.num_programs(3) - 1
    idx = b * blocks + n
    ctx_len = cl_ref[idx]
    blk_len = bl_ref[idx]

    @pl.when(kk == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when((kk < n_tiles) & (kk * block_k < ctx_len))
    def _ctx_tile():
        q = q_ref[...]
        s = _nt_dot(q, k_ref[...])
        pos = kk * block_k + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        _update(m_sc, l_sc, acc_sc, s, pos < ctx_len, v_ref[...], scale)

    @pl.when(kk == n_tiles)
    def _block_and_finish():
        q = q_ref[...]
        s = _nt_dot(q, kb_ref[...])
        col = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        valid = col < blk_len
        if causal:
            row = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
            valid = valid & (col * groups <= row)
        _update(m_sc, l_sc, acc_sc, s, valid, vb_ref[...], scale)
        l = l_sc[...]
        l_safe = jnp.where(l == 0.0, 1.0, l)
        o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(l > 0.0, m_sc[...] + jnp.log(l_safe), NEG)


def _paged_kernel(cl_ref, bl_ref, table_ref, *refs, **static):
    """``_kernel`` with the page table (SMEM ``[B * n_pages]`` int32, scalar prefetch) read by the index maps only."""
    del table_ref
    _kernel(cl_ref, bl_ref, *refs, **static)


# Jitted, their static settings as static arguments: the layers' identical calls in a program share one
# trace and one lowering of the kernel (a call of one function, which XLA inlines: the same kernels run).
@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret"))
def paged_forward(q, k_pool, v_pool, page_table, ctx_lens, k_blk, v_blk, blk_lens, *, causal: bool,
                  scale: float | None = None, interpret: bool = False):
    """``forward`` over paged contexts: ``k_pool, v_pool [pages, page_size, Hkv, D]``, ``page_table [B,
    n_pages]`` int32 (row b's position p at ``pool[page_table[b, p // page_size], p % page_size]``), one
    block per row (``N == 1``), a tile per page (``page_size % 8 == 0``) -> ``(out, lse)`` as ``forward``."""
    b, n, s_len, hq, d = q.shape
    pages, page_size, hkv, _ = k_pool.shape
    if n != 1 or page_table.shape[0] != b or k_pool.shape != v_pool.shape or page_size % 8:
        raise ValueError(f"paged block attention takes q [batch, 1, block, heads, head_dim], pools [pages, "
                         f"page_size (a multiple of 8), kv_heads, head_dim] and page_table [batch, n_pages]; got q "
                         f"{q.shape}, pools {k_pool.shape} / {v_pool.shape}, page_table {page_table.shape}")
    n_pages = page_table.shape[1]

    def kv_map(i, nn, h, kk, cl_ref, bl_ref, table_ref):
        last = jnp.maximum(jax.lax.div(cl_ref[i] + (page_size - 1), page_size) - 1, 0)
        return (table_ref[i * n_pages + jnp.minimum(kk, last)], 0, h)

    pools = tuple(x.reshape(pages, page_size, hkv * d) for x in (k_pool, v_pool))
    return _call(q, pools, ctx_lens, k_blk, v_blk, blk_lens, n_pages * page_size, page_size, n_pages, kv_map,
                 (page_table.astype(jnp.int32).reshape(-1),), causal=causal, scale=scale, interpret=interpret,
                 kernel=_paged_kernel, name="dflash_paged_block_attention_tpu")


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config"))
def forward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, *, causal: bool, scale: float | None = None,
    interpret: bool = False, config: TpuConfig | None = None):
    """Returns (out [B, N, S, Hq, D] in q.dtype, lse [B, N, Hkv, S * G] float32, NEG if no key)."""
    cfg = config or TpuConfig()
    b, n, s_len, hq, hkv, d = check_shapes(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens)
    ctx = k_ctx.shape[1]

    bk = min(cfg.block_k, round_up(max(ctx, 1), 8))
    while bk > 8 and ctx % bk:
        bk //= 2
    bk = max(8, bk - bk % 8)
    ctx_p = max(round_up(ctx, bk), bk)
    if ctx_p != ctx:  # a copy of the context: only for odd shapes
        pad = ((0, 0), (0, ctx_p - ctx), (0, 0), (0, 0))
        k_ctx = jnp.pad(k_ctx, pad)
        v_ctx = jnp.pad(v_ctx, pad)

    def kv_map(i, nn, h, kk, cl_ref, bl_ref):
        length = cl_ref[i * n + nn]
        last = jnp.maximum(jax.lax.div(length + (bk - 1), bk) - 1, 0)  # lengths >= 0: no floor
        return (i, jnp.minimum(kk, last), h)

    contexts = (k_ctx.reshape(b, ctx_p, hkv * d), v_ctx.reshape(b, ctx_p, hkv * d))
    return _call(q, contexts, ctx_lens, k_blk, v_blk, blk_lens, ctx, bk, ctx_p // bk, kv_map, (), causal=causal,
                 scale=scale,
                 interpret=interpret, kernel=_kernel, name="dflash_block_attention_tpu")


def _call(q, contexts, ctx_lens, k_blk, v_blk, blk_lens, ctx, bk, n_tiles, kv_map, prefetch, *, causal, scale,
          interpret, kernel, name):
    """The pallas_call of ``forward`` and ``paged_forward``: contexts of ``ctx`` positions a row in
    ``n_tiles`` tiles of ``bk`` keys, at the blocks ``kv_map`` names in ``contexts`` (``[.., tiles of bk, Hkv * D]``), with
    ``prefetch`` scalar-prefetched after the lengths."""
    b, n, s_len, hq, d = q.shape
    hkv = k_blk.shape[3]
    g = hq // hkv
    rows = s_len * g
    scale = default_scale(d, scale)
    qf = fold_q(q, hkv)
    kb = fold_blk(k_blk)
    vb = fold_blk(v_blk)
    cl = jnp.clip(ctx_lens.astype(jnp.int32), 0, ctx).reshape(-1)
    bl = jnp.clip(blk_lens.astype(jnp.int32), 0, s_len).reshape(-1)

    def row_map(i, nn, h, kk, *prefetched):
        return (i, nn, h, 0, 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2 + len(prefetch),
        grid=(b, n, hkv, n_tiles + 1),
        in_specs=[
            pl.BlockSpec((None, None, None, rows, d), row_map),
            pl.BlockSpec((None, bk, d), kv_map),
            pl.BlockSpec((None, bk, d), kv_map),
            pl.BlockSpec((None, None, None, s_len, d), row_map),
            pl.BlockSpec((None, None, None, s_len, d), row_map),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), row_map),
            pl.BlockSpec((None, None, None, rows, 1), row_map),
        ],
        scratch_shapes=[
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, d), jnp.float32),
        ],
    )
    o, lse = pl.pallas_call(
        functools.partial(kernel, scale=scale, causal=causal, groups=g, block_k=bk, blocks=n),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((b, n, hkv, rows, d), q.dtype),
            jax.ShapeDtypeStruct((b, n, hkv, rows, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=name,
    )(cl, bl, *prefetch, qf, *contexts, kb, vb)
    return unfold_rows(o, s_len, g, d), lse[..., 0]
