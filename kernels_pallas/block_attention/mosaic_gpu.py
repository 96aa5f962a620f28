"""Block attention in Pallas's Mosaic GPU lowering: flash decoding with TMA and ``wgmma``.

``forward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, *, causal)`` computes
``reference.block_attention_reference`` (the contract of ``gpu.forward``: ``(out, lse)``): each block
of queries sees its row's context positions ``< ctx_lens`` plus the block's own ``blk_lens`` slots
(causally or not). One block per row is the drafter's block and the target's decode token or verify
block over a KV cache; several are the training pattern's anchor blocks.

Split-K ("flash decoding"): the context is what costs HBM bandwidth, so the kernel reads it once per
KV head, split over enough programs to fill the GPU:

- **Grid ``(splits, kv_heads * query tiles, batch * blocks)``**, one warpgroup per program. A program
  holds the ``block * groups`` query rows of its KV head (row ``t * groups + g``: slot ``t``, group
  member ``g``) in a 64-row tile (the M of one ``wgmma``); more rows run as several query tiles,
  each reading the context again.
- **One XLA kernel before:** the block's own K and V, padded to whole key tiles, and the folded
  queries, padded to whole 64-row tiles, go to the kernel as ONE array ``[batch * blocks, kv_heads,
  2 * slots + rows, head_dim]`` (one fusion of transposes, pads and a concatenation).
- **Balanced splits:** a block's context ``ctx_lens`` in whole ``block_k`` tiles, dealt to its
  ``splits`` programs (``ceil(tiles / splits)`` each), so a short context is not left to the first
  splits. The split count fills the SMs once (``plan``) from the static shapes.
- **TMA pipeline:** ``plgpu.emit_pipeline`` over the split's tiles (a dynamic trip count) copies each
  ``[block_k, head_dim]`` K and V tile of the strided cache view ``[ctx, head_dim]`` into a ring of
  ``stages`` shared-memory slots with the bulk tensor-copy engine, so ``stages`` tiles are in flight
  while the warpgroup computes on the oldest.
- **The block's own keys in the kernel:** the last split, which holds the fewest context tiles,
  runs one more pipeline of ``slots / block_k`` steps over them (zero steps on the other splits),
  masked to the first ``blk_lens`` slots and, causally, to ``slot * groups <= row``.
- **Tensor cores:** ``S = Q K^T`` and ``P V`` are ``wgmma`` (Q, P and the tiles in 128-byte-swizzled
  shared memory); the online softmax in float32 between them, in base 2 (``exp2`` of scores
  pre-scaled by ``scale * log2(e)``).
- **One XLA kernel after, or none:** with one split the kernel writes the normalised output in the
  query dtype; with several, each program its normalised float32 output, running max and sum, and
  one fusion merges them (``_flash.merge_splits``), unfolds the rows and casts.

**Paged contexts** (``paged_forward``): the context is a pool of pages ``[pages, page_size, kv_heads,
head_dim]`` and a page table per row; the pipeline's index map looks each tile up in the table (a
page of whole ``block_k`` tiles: ``page_size % block_k == 0``) and the TMA copies it from the pool
page the table names. Nothing else changes: the grid, the splits and the block's own keys are those of
a contiguous context of ``n_pages * page_size`` positions.

16-bit floats only: ``wgmma`` takes float32 operands as TF32, which would not match the float32
reference. The backward is ``mosaic_gpu_bwd.py`` (or the Triton kernels', or XLA's: ``block_attention``'s
``bwd`` and ``lowering``). Mosaic GPU compiles for Hopper and later (sm_90a); on the CPU the kernel runs in Mosaic
GPU's interpret mode (jax >= 0.11) and lowers for CUDA (``tests/kernels/test_mosaic_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas._common import NEG, check_shapes, default_scale, fold_q, round_up
from kernels_pallas._flash import merge_splits
from kernels_pallas._mosaic import interpret_params, mosaic_runs_here
from kernels_pallas.block_attention.gpu import GpuConfig, num_sms

ROWS = 64  # query rows of a program: the M of one warpgroup's wgmma
LOG2E = math.log2(math.e)
SWIZZLE = 128  # bytes: a tile row of 64 16-bit elements per swizzle atom
SMEM_PER_PROGRAM = 227 * 1024  # bytes of shared memory one program may claim on Hopper (and Blackwell)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiles and split planning of the Mosaic GPU block attention.

    ``block_k``: keys per TMA tile (64 or 128), of the context and of the block's own keys.
    ``stages``: context tiles in flight per program while one program fills an SM; ``wide_stages``
    where the grid has more programs than SMs (two programs then share an SM's shared memory).
    ``num_sms``: the GPU's SMs (None: read off the device, else 132, an H200's). ``splits``: a fixed
    split count (None: ``plan``)."""

    block_k: int = 64
    stages: int = 4
    wide_stages: int = 2
    num_sms: int | None = None
    splits: int | None = None

    def __post_init__(self):
        if self.block_k not in (64, 128):  # 256-key score tiles would hold 128 more registers a thread
            raise ValueError(f"MosaicConfig.block_k must be 64 or 128, got {self.block_k}")
        if self.stages < 2 or self.wide_stages < 2:
            raise ValueError(f"MosaicConfig stages must be >= 2, got {self.stages} / {self.wide_stages}")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"MosaicConfig.splits must be >= 1, got {self.splits}")


DEFAULT_CONFIG = MosaicConfig()


def supports(head_dim: int, ctx: int, dtype, cfg: MosaicConfig = DEFAULT_CONFIG) -> bool:
    """Whether the kernel takes these shapes: 16-bit floats (``wgmma`` runs float32 as TF32), a
    head_dim of 64 or 128 (whole 64-element swizzle rows; the float32 accumulator and a tile's P V
    product of 256 would hold 256 registers a thread), and a context of whole ``block_k`` tiles
    (engine caches are multiples of 128)."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim in (64, 128) and ctx % cfg.block_k == 0 and ctx > 0)


def runs_here(head_dim: int, ctx: int, dtype, cfg: MosaicConfig = DEFAULT_CONFIG) -> bool:
    """Whether ``forward`` runs on this platform and shapes: a GPU, or the CPU in Mosaic GPU's
    interpret mode (jax >= 0.11), and ``supports``."""
    return mosaic_runs_here() and supports(head_dim, ctx, dtype, cfg)


def plan(rows: int, kv_heads: int, query_tiles: int, ctx: int, cfg: MosaicConfig) -> tuple[int, int]:
    """``(splits, stages)`` for ``rows`` query blocks (batch * blocks): the most splits (at most the
    context's tiles) with which every program runs in one wave of one program per SM, and the
    pipeline depth that wave allows. Grids wider than the SMs take no split and ``wide_stages``, so
    that two programs fit an SM."""
    programs, sms = rows * kv_heads * query_tiles, num_sms(GpuConfig(num_sms=cfg.num_sms))
    if cfg.splits is not None:
        splits = min(cfg.splits, ctx // cfg.block_k)
    else:
        splits = max(1, min(sms // programs, ctx // cfg.block_k))
    stages = cfg.stages if programs * splits <= sms else cfg.wide_stages
    return splits, stages


def shared_memory_bytes(head_dim: int, dtype, block_k: int, stages: int) -> int:
    """A program's shared memory before barriers: the query tile and the probabilities tile, and the
    K/V ring of ``stages`` tiles of each (the outputs reuse the ring's space after the pipelines)."""
    itemsize = jnp.dtype(dtype).itemsize
    return itemsize * (ROWS * head_dim + ROWS * block_k + stages * 2 * block_k * head_dim)


def check_shared_memory(head_dim: int, dtype, block_k: int, stages: int) -> None:
    """A clear error for a tile config whose ring does not fit one program's shared memory (Mosaic GPU
    would reject it only when it compiles for a device)."""
    need = shared_memory_bytes(head_dim, dtype, block_k, stages)
    if need > SMEM_PER_PROGRAM:
        raise ValueError(f"MosaicConfig block_k={block_k} with {stages} stages needs {need // 1024} KB of shared "
                         f"memory a program at head_dim {head_dim}, more than the {SMEM_PER_PROGRAM // 1024} KB a "
                         f"GPU gives one; use fewer stages (at most 3 with 128-key tiles at head_dim 128)")


def _paged_kernel(ctx_lens_gmem, blk_lens_gmem, table_gmem, *refs, page_tiles: int, **static):
    """``_kernel`` over a paged context: ``table [B, n_pages]`` int32 names each row's pages of the pools
    ``k, v [pages * page_size, Hkv, D]``, each page ``page_tiles`` key tiles."""
    _kernel(ctx_lens_gmem, blk_lens_gmem, *refs, table_gmem=table_gmem, page_tiles=page_tiles, **static)


def _kernel(ctx_lens_gmem, blk_lens_gmem, packed_gmem, k_gmem, v_gmem, o_gmem, m_gmem, l_gmem,
            q_smem, p_smem, q_loaded, *, blocks: int, groups: int, q_rows: int, slots: int, out_rows: int,
            block_k: int, stages: int, query_tiles: int, causal: bool, scale: float, table_gmem=None,
            page_tiles: int = 0):
    """One program: query tile ``qt`` of KV head ``h`` of block ``bn`` (row ``bn // blocks``), split
    ``j`` of its context.

    GMEM: ctx_lens, blk_lens [B * N] int32; packed [B * N, Hkv, 2 * slots + q_rows, D] (the block's
    K, its V, the folded queries); k, v contexts [B, C, Hkv, D]; outputs o [B * N, Hkv, S, out_rows,
    D] (normalised per split), m, l [B * N, Hkv, S, q_rows] float32 (running max in natural-log
    units, sum of exponentials)."""
    j = lax.axis_index("splits")
    head_tile = lax.axis_index("heads")
    bn = lax.axis_index("blocks")
    b = lax.div(bn, jnp.int32(blocks))
    h = lax.div(head_tile, jnp.int32(query_tiles))
    qt = lax.rem(head_tile, jnp.int32(query_tiles))
    splits = lax.axis_size("splits")
    head_dim = q_smem.shape[-1]

    plgpu.copy_gmem_to_smem(packed_gmem.at[bn, h, pl.ds(2 * slots + qt * ROWS, ROWS)], q_smem, q_loaded)

    ctx_len = ctx_lens_gmem[bn]
    blk_len = blk_lens_gmem[bn]
    tiles = lax.div(ctx_len + block_k - 1, jnp.int32(block_k))
    per_split = lax.div(tiles + splits - 1, splits)
    first = j * per_split
    n_tiles = jnp.clip(tiles - first, 0, per_split)

    plgpu.barrier_wait(q_loaded)
    log2_scale = scale * LOG2E
    row = (plgpu.broadcasted_iota(jnp.int32, (ROWS, block_k), 0, layout=plgpu.Layout.WGMMA) + qt * ROWS)

    def attend(valid_of_key, k_smem, v_smem, carry):
        """One flash step over a tile of keys: ``valid_of_key(key index within the tile)`` the mask."""
        acc, m, l = carry

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
            return acc_ref[...]

        key = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_k), 1, layout=plgpu.Layout.WGMMA)
        valid = valid_of_key(key)
        s = jnp.where(valid, pl.run_scoped(qk, plgpu.ACC((ROWS, block_k), jnp.float32)) * log2_scale, NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        # Masked keys count zero even where the row has seen no key yet (m_new still NEG).
        p = jnp.where(valid, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        l = l * alpha + p.sum(axis=1)

        # P through shared memory and into a fresh accumulator, added to the rescaled one: Mosaic
        # GPU's interpreter runs wgmma on shared-memory operands and scoped accumulators only, and
        # the 8 KB round trip is small against a tile's 32 KB from HBM
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem)
            return acc_ref[...]

        pv_tile = pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim), jnp.float32))
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv_tile, m_new, l

    def context_step(indices, k_smem, v_smem, carry):
        tile_start = (first + indices[0]) * block_k
        return attend(lambda key: key + tile_start < ctx_len, k_smem, v_smem, carry)

    def own_step(indices, k_smem, v_smem, carry):
        tile_start = indices[0] * block_k

        def valid_of_key(key):
            slot = key + tile_start
            valid = slot < blk_len
            return (valid & (slot * groups <= row)) if causal else valid

        return attend(valid_of_key, k_smem, v_smem, carry)

    transforms = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    if table_gmem is None:
        ctx_spec = plgpu.BlockSpec((block_k, head_dim), lambda i: (first + i, 0), transforms=transforms)
        k_ctx, v_ctx = k_gmem.at[b, :, h], v_gmem.at[b, :, h]
    else:  # the row's tile t is tile t % page_tiles of its page t // page_tiles
        def pool_tile(i):
            t = first + i
            page = table_gmem[b, lax.div(t, jnp.int32(page_tiles))]
            return (page * page_tiles + lax.rem(t, jnp.int32(page_tiles)), 0)

        ctx_spec = plgpu.BlockSpec((block_k, head_dim), pool_tile, transforms=transforms)
        k_ctx, v_ctx = k_gmem.at[:, h], v_gmem.at[:, h]
    init = (
        plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((ROWS,), NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    carry = plgpu.emit_pipeline(context_step, grid=(n_tiles,), in_specs=[ctx_spec, ctx_spec],
                                max_concurrent_steps=stages, init_carry=init)(k_ctx, v_ctx)

    # The block's own K and V open the packed array, in whole key tiles.
    own_tiles = slots // block_k
    k_spec = plgpu.BlockSpec((block_k, head_dim), lambda i: (i, 0), transforms=transforms)
    v_spec = plgpu.BlockSpec((block_k, head_dim), lambda i: (own_tiles + i, 0), transforms=transforms)
    own_steps = jnp.where(j == splits - 1, jnp.int32(own_tiles), jnp.int32(0))
    acc, m, l = plgpu.emit_pipeline(own_step, grid=(own_steps,), in_specs=[k_spec, v_spec],
                                    max_concurrent_steps=min(2, own_tiles), init_carry=carry)(
        packed_gmem.at[bn, h], packed_gmem.at[bn, h])

    # The outputs' shared memory is scoped after the pipelines', in the space their rings held: two
    # programs of 2 stages then fit an SM (q 16 KB, p 8 KB, ring 64 KB) where a 32 KB float32 output
    # beside the ring would not.
    def store(o_smem, m_smem, l_smem):
        o_smem[...] = (acc / lax.broadcast_in_dim(jnp.where(l == 0.0, 1.0, l), acc.shape, [0])).astype(o_smem.dtype)
        m_smem[...] = m * (1.0 / LOG2E)
        l_smem[...] = l
        plgpu.commit_smem()
        if query_tiles == 1:  # only the real rows (a decode token's groups): no slice after the kernel
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, out_rows)], o_gmem.at[bn, h, j])
        else:
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[bn, h, j, pl.ds(qt * ROWS, ROWS)])
        rows = pl.ds(qt * ROWS, ROWS)
        plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[bn, h, j, rows])
        plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[bn, h, j, rows])
        plgpu.wait_smem_to_gmem(0)

    f32 = jnp.float32
    pl.run_scoped(store, plgpu.SMEM((ROWS, head_dim), o_gmem.dtype), plgpu.SMEM((ROWS,), f32),
                  plgpu.SMEM((ROWS,), f32))


def fold_rows(x: jax.Array, kv_heads: int, rows: int) -> jax.Array:
    """``x [B, N, T, Hq, D]`` -> ``[B * N, Hkv, rows, D]``: per KV head its ``T * G`` query rows (row
    ``t * G + g``), zero-padded to ``rows``."""
    b, n, t, hq, d = x.shape
    x = fold_q(x, kv_heads).reshape(b * n, kv_heads, t * hq // kv_heads, d)
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows - x.shape[2]), (0, 0)))


def packed_layout(block: int, groups: int, block_k: int) -> tuple[int, int]:
    """``(slots, q_rows)`` of ``pack_inputs``' layout for a block of ``block`` positions and ``groups``
    query heads a KV head: the block's K (and V) rows padded to whole ``block_k`` tiles, its query rows
    to whole 64-row tiles."""
    return round_up(block, block_k), round_up(block * groups, ROWS)


def pack_inputs(q: jax.Array, k_blk: jax.Array, v_blk: jax.Array, block_k: int) -> jax.Array:
    """The kernel's one small input: ``q [B, N, T, Hq, D]``, ``k_blk, v_blk [B, N, T, Hkv, D]`` ->
    ``[B * N, Hkv, 2 * slots + q_rows, D]``: per KV head the block's K and V, each padded to whole
    ``block_k`` tiles (``slots``), then its ``T * G`` query rows (row ``t * G + g``) padded to whole
    64-row tiles (``q_rows``). One XLA fusion."""
    b, n, t, hq, d = q.shape
    hkv = k_blk.shape[3]
    slots, q_rows = packed_layout(t, hq // hkv, block_k)
    q = fold_rows(q, hkv, q_rows)

    def own(x):
        x = x.reshape(b * n, t, hkv, d).transpose(0, 2, 1, 3)
        return jnp.pad(x.astype(q.dtype), ((0, 0), (0, 0), (0, slots - t), (0, 0)))

    return jnp.concatenate([own(k_blk), own(v_blk), q], axis=2)


def attention_partials(packed: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, ctx_lens: jax.Array,
                       blk_lens: jax.Array, *, block: int, groups: int, causal: bool, scale: float,
                       config: MosaicConfig | None = None, interpret: bool | None = None,
                       page_table: jax.Array | None = None):
    """The kernel: ``packed`` (``pack_inputs``) over the contexts ``[B, C, Hkv, D]``' positions ``<
    ctx_lens [B * N]`` and the block's ``blk_lens [B * N]`` slots -> per split ``(o [B * N, Hkv, S,
    out_rows, D], m, l [B * N, Hkv, S, q_rows] float32)``: ``o`` normalised by ``l`` (zeros where a
    split holds no key), in ``packed.dtype`` with one split and float32 with several; ``out_rows``
    is ``block * groups`` within one query tile, else the padded ``q_rows``.

    ``page_table [B, n_pages]`` int32: the contexts are page pools ``k_ctx, v_ctx [pages, page_size,
    Hkv, D]`` (``page_size`` a multiple of ``block_k``), row b's of ``C = n_pages * page_size``
    positions in the pages its table row names."""
    cfg = config or DEFAULT_CONFIG
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if page_table is None:
        batch, ctx, kv_heads, head_dim = k_ctx.shape
    else:
        _, page_size, kv_heads, head_dim = k_ctx.shape
        if page_size % cfg.block_k or page_table.ndim != 2:
            raise ValueError(f"a paged context needs pages of whole {cfg.block_k}-key tiles and a page table "
                             f"[batch, n_pages], got page_size {page_size} and page_table {page_table.shape}")
        batch, ctx = page_table.shape[0], page_table.shape[1] * page_size
    rows_n = packed.shape[0]
    if rows_n % batch:
        raise ValueError(f"packed {packed.shape} does not hold whole blocks of the {batch} rows of k_ctx")
    slots, q_rows = packed_layout(block, groups, cfg.block_k)
    if packed.shape != (rows_n, kv_heads, 2 * slots + q_rows, head_dim):
        raise ValueError(f"packed must be {(rows_n, kv_heads, 2 * slots + q_rows, head_dim)} "
                         f"(pack_inputs), got {packed.shape}")
    if v_ctx.shape != k_ctx.shape or ctx_lens.shape != (rows_n,) or blk_lens.shape != (rows_n,):
        raise ValueError(f"v_ctx {v_ctx.shape} / ctx_lens {ctx_lens.shape} / blk_lens {blk_lens.shape} do not "
                         f"match k_ctx {k_ctx.shape} and {rows_n} blocks")
    if not supports(head_dim, ctx, k_ctx.dtype, cfg) or packed.dtype != k_ctx.dtype:
        raise ValueError(f"the Mosaic GPU block attention does not take head_dim {head_dim}, context {ctx}, "
                         f"{packed.dtype} queries over {k_ctx.dtype} K/V (see mosaic_gpu.supports)")
    query_tiles = q_rows // ROWS
    out_rows = block * groups if query_tiles == 1 else q_rows
    splits, stages = plan(rows_n, kv_heads, query_tiles, ctx, cfg)
    check_shared_memory(head_dim, packed.dtype, cfg.block_k, stages)
    f32 = jnp.float32
    swizzled = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    static = dict(blocks=rows_n // batch, groups=groups, q_rows=q_rows, slots=slots, out_rows=out_rows,
                  block_k=cfg.block_k, stages=stages, query_tiles=query_tiles, causal=causal, scale=scale)
    if page_table is None:
        body, table = functools.partial(_kernel, **static), ()
    else:  # the pools as [pages * page_size, Hkv, D]: a bitcast
        body, table = functools.partial(_paged_kernel, page_tiles=k_ctx.shape[1] // cfg.block_k, **static), (
            page_table.astype(jnp.int32),)
        k_ctx, v_ctx = (x.reshape((-1,) + x.shape[2:]) for x in (k_ctx, v_ctx))
    kernel = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((rows_n, kv_heads, splits, out_rows, head_dim),
                                       packed.dtype if splits == 1 else f32),
                  jax.ShapeDtypeStruct((rows_n, kv_heads, splits, q_rows), f32),
                  jax.ShapeDtypeStruct((rows_n, kv_heads, splits, q_rows), f32)],
        scratch_types=[
            plgpu.SMEM((ROWS, head_dim), packed.dtype, transforms=swizzled),
            plgpu.SMEM((ROWS, cfg.block_k), packed.dtype, transforms=swizzled),
            plgpu.Barrier(),
        ],
        grid=(splits, kv_heads * query_tiles, rows_n),
        grid_names=("splits", "heads", "blocks"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
        kernel_name="dflash_block_attention_mgpu" if page_table is None else "dflash_paged_block_attention_mgpu",
    )
    return kernel(ctx_lens.astype(jnp.int32), blk_lens.astype(jnp.int32), *table, packed, k_ctx, v_ctx)


def forward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, *, causal: bool, scale: float | None = None,
            interpret: bool | None = None, config: MosaicConfig | None = None):
    """``gpu.forward``'s contract: ``(out [B, N, T, Hq, D] in q.dtype, lse [B, N, Hkv, T * G]
    float32, NEG where a row sees no key)``."""
    check_shapes(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens)
    return _forward(q, k_ctx, v_ctx, k_ctx.shape[1], ctx_lens, k_blk, v_blk, blk_lens, causal=causal, scale=scale,
                    interpret=interpret, config=config)


def paged_supported(q_shape: tuple[int, ...], pool_shape: tuple[int, ...], n_pages: int, dtype,
                    cfg: MosaicConfig = DEFAULT_CONFIG) -> bool:
    """Whether ``paged_forward`` runs here on these shapes: one block per row, pages of whole
    ``block_k`` tiles, and what ``runs_here`` asks of a contiguous context of ``n_pages`` pages."""
    _, page_size, _, head_dim = pool_shape
    return (len(q_shape) == 5 and q_shape[1] == 1 and page_size % cfg.block_k == 0
            and runs_here(head_dim, n_pages * page_size, dtype, cfg))


def paged_forward(q, k_pool, v_pool, page_table, ctx_lens, k_blk, v_blk, blk_lens, *, causal: bool,
                  scale: float | None = None, interpret: bool | None = None, config: MosaicConfig | None = None):
    """``forward`` over paged contexts: ``k_pool, v_pool [pages, page_size, Hkv, D]``, ``page_table [B,
    n_pages]`` int32 (row b's position p at ``pool[page_table[b, p // page_size], p % page_size]``), the
    rest as ``forward``'s with one block per row (``N == 1``) -> ``(out, lse)``."""
    b, n, t, hq, d = q.shape
    if n != 1 or page_table.shape[0] != b or k_pool.shape != v_pool.shape or k_pool.shape[-1] != d:
        raise ValueError(f"paged block attention takes q [batch, 1, block, heads, head_dim], pools [pages, "
                         f"page_size, kv_heads, {d}] and page_table [batch, n_pages]; got q {q.shape}, pools "
                         f"{k_pool.shape} / {v_pool.shape}, page_table {page_table.shape}")
    return _forward(q, k_pool, v_pool, page_table.shape[1] * k_pool.shape[1], ctx_lens, k_blk, v_blk, blk_lens,
                    causal=causal, scale=scale, interpret=interpret, config=config, page_table=page_table)


def _forward(q, k_ctx, v_ctx, ctx, ctx_lens, k_blk, v_blk, blk_lens, *, causal, scale, interpret, config,
             page_table=None):
    """``forward`` and ``paged_forward``: a context of ``ctx`` positions a row."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _jitted_forward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, page_table, ctx=ctx, causal=bool(causal),
                           scale=scale, interpret=bool(interpret), config=config or DEFAULT_CONFIG)


@functools.partial(jax.jit, static_argnames=("ctx", "causal", "scale", "interpret", "config"))
def _jitted_forward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, page_table, *, ctx: int, causal: bool,
                    scale: float | None, interpret: bool, config: MosaicConfig):
    """``_forward``, jitted: the layers' identical calls in a program share one trace and one lowering
    of the kernel (a call of one function, which XLA inlines: the same kernels run)."""
    cfg = config
    b, n, t, hq, d = q.shape
    hkv = k_blk.shape[3]
    g = hq // hkv
    o, m, l = attention_partials(
        pack_inputs(q.astype(k_ctx.dtype), k_blk, v_blk, cfg.block_k), k_ctx, v_ctx,
        jnp.clip(ctx_lens, 0, ctx).reshape(b * n), jnp.clip(blk_lens, 0, t).reshape(b * n),
        block=t, groups=g, causal=causal, scale=default_scale(d, scale), config=cfg, interpret=interpret,
        page_table=page_table)
    out, lse = unpack_outputs(o, m, l, q.shape, hkv)
    return out.astype(q.dtype), lse


def unpack_outputs(o: jax.Array, m: jax.Array, l: jax.Array, q_shape: tuple[int, ...],
                   kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """``attention_partials``' outputs for queries ``q_shape [B, N, T, Hq, D]`` -> ``(out [B, N, T, Hq,
    D], lse [B, N, Hkv, T * G] float32)``: the splits merged (one fusion with the unfold) or, with one
    split, the rows unfolded."""
    b, n, t, hq, d = q_shape
    g = hq // kv_heads
    rows = t * g
    o, m, l = o[..., :rows, :], m[..., :rows], l[..., :rows]
    if o.shape[2] == 1:
        o, m, l = o[:, :, 0], m[:, :, 0], l[:, :, 0]
    else:  # one fusion: the merge, the unfold below and the cast
        o, m, l = merge_splits(o, m, l, axis=2)
    lse = jnp.where(l > 0.0, m + jnp.log(jnp.where(l > 0.0, l, 1.0)), NEG).reshape(b, n, kv_heads, rows)
    # [B * N, Hkv, T * G, D] -> [B, N, T, Hq, D]: a bitcast for a decode token (T == 1)
    return o.reshape(b, n, kv_heads, t, g, d).transpose(0, 1, 3, 2, 4, 5).reshape(b, n, t, hq, d), lse
