"""Decode / verify attention over a KV cache in Pallas's Mosaic GPU lowering: flash decoding with TMA.

``decode_attention(q, k_blk, v_blk, k_cache, v_cache, starts, blk_lens, *, causal)`` computes
``block_attention_reference`` for one block per row (``blocks == 1``): a row's ``block`` queries
see its cache's positions ``< starts`` plus the block's own ``blk_lens`` slots (causally or not).
The queries come normed and rotated, and the block's K/V are not read from the cache, so the caller
may write them there before or after (``dflash_jax.ops.attention.cached_attention`` does the q/k
norms, RoPE and the cache write in XLA around this kernel on this lowering).

Split-K ("flash decoding"): the context is what costs HBM bandwidth, so the kernel reads it once per
KV head, split over enough programs to fill the GPU:

- **Grid ``(splits, kv_heads * query tiles, batch)``**, one warpgroup per program. A program holds
  the ``block * groups`` query rows of its KV head (row ``t * groups + g``: slot ``t``, group member
  ``g``), padded in HBM by XLA to whole 64-row tiles (the M of one ``wgmma``); more than 64 rows run
  as several query tiles, each reading the context again.
- **Balanced splits:** a row's context ``starts[b]`` in whole ``block_k`` tiles, dealt to its
  ``splits`` programs (``ceil(tiles / splits)`` each), so a short context is not left to the first
  splits. The split count fills the SMs once (``plan``) from the static shapes.
- **TMA pipeline:** ``plgpu.emit_pipeline`` over the split's tiles (a dynamic trip count) copies each
  ``[block_k, head_dim]`` K and V tile of the strided cache view ``[capacity, head_dim]`` into a ring
  of ``stages`` shared-memory slots with the bulk tensor-copy engine, so ``stages`` tiles are in
  flight while the warpgroup computes on the oldest.
- **Tensor cores:** ``S = Q K^T`` and ``P V`` are ``wgmma`` (Q, P and the tiles in 128-byte-swizzled
  shared memory); the online softmax in float32 between them, in base 2 (``exp2``
  of scores pre-scaled by ``scale * log2(e)``). Keys ``>= starts`` of the last tile are masked.
- **Partials out, merge in XLA:** every program writes its normalised float32 output and its
  running max and sum; the block's own keys (``block`` of them: no bandwidth) are one more
  "split" computed by XLA, and ``_flash.merge_splits`` combines them all.

16-bit floats only: ``wgmma`` takes float32 operands as TF32, which would not match the float32
reference; float32 caches run the XLA reference on this lowering. Forward only (inference). Mosaic
GPU compiles for Hopper and later (sm_90a); on the CPU the kernel runs in Mosaic GPU's interpret mode
(jax >= 0.11) and lowers for CUDA (``tests/kernels/test_mosaic_gpu.py``).
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

from kernels_pallas._common import NEG, default_scale
from kernels_pallas._flash import merge_splits
from kernels_pallas._mosaic import interpret_params, mosaic_interpret_available
from kernels_pallas.block_attention.gpu import GpuConfig, num_sms

ROWS = 64  # query rows of a program: the M of one warpgroup's wgmma
LOG2E = math.log2(math.e)
SWIZZLE = 128  # bytes: a tile row of 64 16-bit elements per swizzle atom


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiles and split planning of the Mosaic GPU decode attention.

    ``block_k``: context keys per TMA tile (64 or 128). ``stages``: tiles in flight per program
    while one program fills an SM; ``wide_stages`` where the grid has more programs than SMs (two
    programs then share an SM's shared memory). ``num_sms``: the GPU's SMs (None: read off the device,
    else 132, an H200's).
    ``splits``: a fixed split count (None: ``plan``)."""

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


def supports(head_dim: int, capacity: int, dtype, cfg: MosaicConfig = DEFAULT_CONFIG) -> bool:
    """Whether the kernel takes these shapes: 16-bit floats (``wgmma`` runs float32 as TF32), a
    head_dim of 64 or 128 (whole 64-element swizzle rows; the float32 accumulator and a tile's P V
    product of 256 would hold 256 registers a thread), and a capacity of whole ``block_k`` tiles
    (engine caches are multiples of 128)."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim in (64, 128) and capacity % cfg.block_k == 0 and capacity > 0)


def decode_attention_supported(head_dim: int, capacity: int, dtype) -> bool:
    """Whether ``decode_attention`` runs on this platform: a GPU, or the CPU in Mosaic GPU's
    interpret mode (jax >= 0.11)."""
    platform = jax.default_backend()
    if platform == "tpu" or (platform != "gpu" and not mosaic_interpret_available()):
        return False
    return supports(head_dim, capacity, dtype)


def plan(batch: int, kv_heads: int, query_tiles: int, capacity: int, cfg: MosaicConfig) -> tuple[int, int]:
    """``(splits, stages)``: the most splits (at most the capacity's tiles) with which every program
    runs in one wave of one program per SM, and the pipeline depth that wave allows. Grids wider
    than the SMs take no split and ``wide_stages``, so that two programs fit an SM."""
    programs, sms = batch * kv_heads * query_tiles, num_sms(GpuConfig(num_sms=cfg.num_sms))
    if cfg.splits is not None:
        splits = min(cfg.splits, capacity // cfg.block_k)
    else:
        splits = max(1, min(sms // programs, capacity // cfg.block_k))
    stages = cfg.stages if programs * splits <= sms else cfg.wide_stages
    return splits, stages


def _kernel(starts_gmem, q_gmem, k_gmem, v_gmem, o_gmem, m_gmem, l_gmem, q_smem, p_smem, q_loaded, *,
            block_k: int, stages: int, query_tiles: int, scale: float):
    """One program: query tile ``qt`` of KV head ``h`` of row ``b``, split ``j`` of its context.

    GMEM: starts [B] int32; q [B, Hkv, R, D]; k, v caches [B, C, Hkv, D]; outputs o [B, Hkv, S, R, D]
    float32 (normalised per split), m, l [B, Hkv, S, R] float32 (running max in natural-log units,
    sum of exponentials)."""
    j = lax.axis_index("splits")
    head_tile = lax.axis_index("heads")
    b = lax.axis_index("rows")
    h = lax.div(head_tile, jnp.int32(query_tiles))
    qt = lax.rem(head_tile, jnp.int32(query_tiles))
    splits = lax.axis_size("splits")
    head_dim = q_smem.shape[-1]

    rows = pl.ds(qt * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(q_gmem.at[b, h, rows], q_smem, q_loaded)

    start = starts_gmem[b]
    tiles = lax.div(start + block_k - 1, jnp.int32(block_k))
    per_split = lax.div(tiles + splits - 1, splits)
    first = j * per_split
    n_tiles = jnp.clip(tiles - first, 0, per_split)

    plgpu.barrier_wait(q_loaded)
    log2_scale = scale * LOG2E

    def step(indices, k_smem, v_smem, carry):
        acc, m, l = carry
        tile = first + indices[0]

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, block_k), jnp.float32)) * log2_scale
        key = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_k), 1, layout=plgpu.Layout.WGMMA) + tile * block_k
        s = jnp.where(key < start, s, NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
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

    transforms = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    tile_spec = plgpu.BlockSpec((block_k, head_dim), lambda i: (first + i, 0), transforms=transforms)
    init = (
        plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((ROWS,), NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    acc, m, l = plgpu.emit_pipeline(step, grid=(n_tiles,), in_specs=[tile_spec, tile_spec],
                                    max_concurrent_steps=stages, init_carry=init)(
        k_gmem.at[b, :, h], v_gmem.at[b, :, h])

    # The outputs' shared memory is scoped after the pipeline's, in the space its K/V ring held: two
    # programs of 2 stages then fit an SM (q 16 KB, p 8 KB, ring 64 KB) where a 32 KB float32 output
    # beside the ring would not.
    def store(o_smem, m_smem, l_smem):
        o_smem[...] = acc / lax.broadcast_in_dim(jnp.where(l == 0.0, 1.0, l), acc.shape, [0])
        m_smem[...] = m * (1.0 / LOG2E)
        l_smem[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, j, rows])
        plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[b, h, j, rows])
        plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[b, h, j, rows])
        plgpu.wait_smem_to_gmem(0)

    f32 = jnp.float32
    pl.run_scoped(store, plgpu.SMEM((ROWS, head_dim), f32), plgpu.SMEM((ROWS,), f32), plgpu.SMEM((ROWS,), f32))


def context_partials(q_rows: jax.Array, k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array, *,
                     scale: float, config: MosaicConfig | None = None, interpret: bool | None = None):
    """The kernel: ``q_rows [B, Hkv, R, D]`` (R a multiple of 64) over the caches ``[B, C, Hkv, D]``'
    positions ``< starts [B]`` -> per split ``(o [B, Hkv, S, R, D], m, l [B, Hkv, S, R])`` float32,
    ``o`` normalised by ``l`` (zeros where a split holds no key)."""
    cfg = config or DEFAULT_CONFIG
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    batch, kv_heads, rows, head_dim = q_rows.shape
    capacity = k_cache.shape[1]
    if rows % ROWS:
        raise ValueError(f"q_rows must hold whole {ROWS}-row tiles, got {q_rows.shape}")
    if k_cache.shape != (batch, capacity, kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must be {(batch, capacity, kv_heads, head_dim)}: "
                         f"{k_cache.shape} {v_cache.shape}")
    if not supports(head_dim, capacity, k_cache.dtype, cfg) or q_rows.dtype != k_cache.dtype:
        raise ValueError(f"the Mosaic GPU decode attention does not take head_dim {head_dim}, capacity {capacity}, "
                         f"{q_rows.dtype} queries over {k_cache.dtype} caches (see mosaic_gpu.supports)")
    query_tiles = rows // ROWS
    splits, stages = plan(batch, kv_heads, query_tiles, capacity, cfg)
    f32 = jnp.float32
    swizzled = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    kernel = plgpu.kernel(
        functools.partial(_kernel, block_k=cfg.block_k, stages=stages, query_tiles=query_tiles, scale=scale),
        out_type=[jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, head_dim), f32),
                  jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), f32),
                  jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), f32)],
        scratch_types=[
            plgpu.SMEM((ROWS, head_dim), q_rows.dtype, transforms=swizzled),
            plgpu.SMEM((ROWS, cfg.block_k), q_rows.dtype, transforms=swizzled),
            plgpu.Barrier(),
        ],
        grid=(splits, kv_heads * query_tiles, batch),
        grid_names=("splits", "heads", "rows"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
        kernel_name="dflash_decode_attention_mgpu",
    )
    return kernel(starts.astype(jnp.int32), q_rows, k_cache, v_cache)


def block_partials(q: jax.Array, k_blk: jax.Array, v_blk: jax.Array, blk_lens: jax.Array, *, causal: bool,
                   scale: float):
    """The block's own keys as one more split, in XLA: ``q [B, T, Hq, D]``, ``k_blk, v_blk [B, T, Hkv,
    D]`` -> ``(o [B, Hkv, 1, T * G, D], m, l [B, Hkv, 1, T * G])`` float32 in the kernel's row order."""
    batch, block, heads, head_dim = q.shape
    kv_heads = k_blk.shape[2]
    groups = heads // kv_heads
    qg = q.reshape(batch, block, kv_heads, groups, head_dim)
    s = jnp.einsum("btkgd,bukd->bktgu", qg, k_blk, preferred_element_type=jnp.float32) * scale
    slot = jnp.arange(block)
    visible = slot[None, None, None, None, :] < blk_lens[:, None, None, None, None]
    if causal:
        visible = visible & (slot[None, None, None, None, :] <= slot[None, None, :, None, None])
    s = jnp.where(visible, s, NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.where(visible, jnp.exp(s - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bktgu,bukd->bktgd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    o = o / jnp.where(l == 0.0, 1.0, l)[..., None]
    rows = block * groups
    return (o.reshape(batch, kv_heads, 1, rows, head_dim), m.reshape(batch, kv_heads, 1, rows),
            l.reshape(batch, kv_heads, 1, rows))


def decode_attention(q: jax.Array, k_blk: jax.Array, v_blk: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     starts: jax.Array, blk_lens: jax.Array, *, causal: bool, scale: float | None = None,
                     config: MosaicConfig | None = None, interpret: bool | None = None) -> jax.Array:
    """``q [B, T, Hq, D]`` (normed and rotated), the block's own ``k_blk, v_blk [B, T, Hkv, D]``, the
    caches ``[B, C, Hkv, D]`` (positions ``< starts [B]`` are the context), ``blk_lens [B]`` valid
    slots -> ``[B, T, Hq, D]`` in ``q.dtype``: ``block_attention_reference`` with one block per row."""
    batch, block, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads or k_blk.shape != (batch, block, kv_heads, head_dim) or v_blk.shape != k_blk.shape:
        raise ValueError(f"q {q.shape} / k_blk {k_blk.shape} / v_blk {v_blk.shape} do not match the caches "
                         f"{k_cache.shape}")
    if starts.shape != (batch,) or blk_lens.shape != (batch,):
        raise ValueError(f"starts / blk_lens must be [{batch}], got {starts.shape} / {blk_lens.shape}")
    groups = heads // kv_heads
    scale = default_scale(head_dim, scale)
    rows = block * groups
    padded = -(-rows // ROWS) * ROWS
    # [B, T, Hkv, G, D] -> [B, Hkv, T * G, D] (row t * G + g), zero rows up to whole 64-row tiles
    q_rows = q.reshape(batch, block, kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = jnp.pad(q_rows.reshape(batch, kv_heads, rows, head_dim), ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    o_ctx, m_ctx, l_ctx = context_partials(q_rows.astype(k_cache.dtype), k_cache, v_cache, starts, scale=scale,
                                           config=config, interpret=interpret)
    o_blk, m_blk, l_blk = block_partials(q, k_blk, v_blk, jnp.clip(blk_lens, 0, block), causal=causal, scale=scale)
    o, _, _ = merge_splits(jnp.concatenate([o_ctx[..., :rows, :], o_blk], axis=2),
                           jnp.concatenate([m_ctx[..., :rows], m_blk], axis=2),
                           jnp.concatenate([l_ctx[..., :rows], l_blk], axis=2), axis=2)
    # [B, Hkv, T * G, D] -> [B, T, Hq, D]
    o = o.reshape(batch, kv_heads, block, groups, head_dim).transpose(0, 2, 1, 3, 4)
    return o.reshape(batch, block, heads, head_dim).astype(q.dtype)
