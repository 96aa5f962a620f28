"""The one attention primitive of dflash-jax: blocks of queries over a shared context plus their own block.

Every attention in the project is this shape:

- drafting: one block of B queries per row, the row's committed context (its drafter cache) plus
  the block's own K/V, no mask inside the block (the drafter is bidirectional);
- verifying: the same block in the target, causal inside the block;
- prefill: the padded prompt is one causal block with an empty context;
- training: every anchor block of a sequence sees the context strictly before its anchor
  (``ctx_len = anchor``) plus its own block.

``block_attention`` dispatches between this pure-jnp reference and the Pallas kernels in
``kernels_pallas`` (``OpsConfig.attention``); both compute exactly the function documented here. The
Pallas kernels hold a block's query rows in one program, tiled for draft and verify blocks of up to
16 slots; a prompt (one causal block per row with no context: prefill, the frozen target's forward
in training) takes ``prompt_attention`` instead, a library's flash attention (cuDNN's on GPUs, JAX's
Pallas one on TPUs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

from dflash_jax.ops.cache import CACHE_AXES, write_rows
from dflash_jax.ops.config import XLA, OpsConfig
from dflash_jax.ops.norms import rms_norm
from dflash_jax.ops.paged_cache import PAGE_TABLE_AXES, POOL_AXES, PagedKV
from dflash_jax.ops.rope import apply_rope
from dflash_jax.sharding import shard_kernel
from kernels_pallas.block_attention.reference import block_attention_reference


def block_attention(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, ctx_lens: jax.Array, k_blk: jax.Array,
                    v_blk: jax.Array, blk_lens: jax.Array, *, causal: bool, scale: float | None = None,
                    ops: OpsConfig = XLA, sinks: jax.Array | None = None, window: int | None = None) -> jax.Array:
    """``block_attention_reference`` computed as ``ops`` says (the reference, or with the kernels on
    a Pallas kernel, or for a prompt, one causal block per row with no context, ``prompt_attention``).
    Attention sinks and sliding windows (gpt-oss layers) run the reference: no kernel takes them.

    ``k_ctx, v_ctx`` may be paged (``PagedKV``, the context read through the rows' page tables): the
    Triton, Mosaic GPU and TPU kernels load the pages the table names (``paged_block_attention``);
    every other path runs on the rows' pages of this layer gathered into a contiguous context
    (``PagedKV.gather``, the XLA reference of the read)."""
    if isinstance(k_ctx, PagedKV):
        out = paged_block_attention(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal, scale=scale,
                                    ops=ops, sinks=sinks, window=window)
        if out is not None:
            return out
        k_ctx, v_ctx = k_ctx.gather(), v_ctx.gather()
    if sinks is not None or window is not None:
        if causal and q.shape[1] == 1 and k_ctx.shape[1] == 0 and q.shape[2] > SINK_PROMPT_CHUNK:
            return chunked_prompt_attention(q, k_blk, v_blk, blk_lens, chunk=SINK_PROMPT_CHUNK, scale=scale,
                                            sinks=sinks, window=window)
        return block_attention_reference(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal,
                                         scale=scale, sinks=sinks, window=window)
    if ops.kernels and causal and q.shape[1] == 1 and k_ctx.shape[1] == 0:
        return prompt_attention(q[:, 0], k_blk[:, 0], v_blk[:, 0], blk_lens[:, 0], scale=scale)[:, None]
    if not ops.kernels or not (ops.mosaic or triton_block_kernel_fits(q.shape, k_ctx.shape[2], k_ctx.dtype)):
        return block_attention_reference(
            q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal, scale=scale
        )
    from kernels_pallas.block_attention import block_attention as pallas_block_attention

    # Per device under a kernel mesh: rows on ``batch``, heads by their KV head (the query
    # heads as [kv_heads, groups], so a device's query heads are those of its KV heads).
    batch, blocks, block, heads, head_dim = q.shape
    kv_heads = k_ctx.shape[2]

    def kernel(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens):
        b, n, s, kv, g, d = q.shape
        out = pallas_block_attention(q.reshape(b, n, s, kv * g, d), k_ctx, v_ctx, ctx_lens, k_blk, v_blk,
                                     blk_lens, causal=causal, scale=scale, lowering=ops.gpu_lowering)
        return (out.reshape(q.shape),)

    rows, kv_rows = ("batch", None, None, "kv_heads", None, None), ("batch", None, None, "kv_heads", None)
    lens = ("batch", None)
    (out,) = shard_kernel(kernel, (rows, CACHE_AXES, CACHE_AXES, lens, kv_rows, kv_rows, lens), (rows,))(
        q.reshape(batch, blocks, block, kv_heads, heads // kv_heads, head_dim), k_ctx, v_ctx, ctx_lens,
        k_blk, v_blk, blk_lens)
    return out.reshape(q.shape)


def triton_block_kernel_fits(q_shape: tuple[int, ...], kv_heads: int, dtype) -> bool:
    """Whether the Triton block-attention kernel takes a block of ``q_shape [batch, blocks, block,
    heads, head_dim]`` (off a GPU, interpreted, any): compiled, it holds a block's ``block * groups``
    query rows in one program, which for a long block (a prefill suffix over a cached prefix) exceeds
    an SM's shared memory (``block_attention.gpu.forward_fits``). ``attend_and_write`` runs such a block,
    when written and causal, as sub-blocks (``written_block_attention``); any other, the reference."""
    if jax.default_backend() != "gpu":
        return True
    from kernels_pallas.block_attention.gpu import forward_fits

    return forward_fits(tuple(q_shape), kv_heads, jnp.dtype(dtype).itemsize)


def paged_block_attention(q: jax.Array, k_ctx: PagedKV, v_ctx: PagedKV, ctx_lens: jax.Array, k_blk: jax.Array,
                          v_blk: jax.Array, blk_lens: jax.Array, *, causal: bool, scale: float | None, ops: OpsConfig,
                          sinks: jax.Array | None, window: int | None) -> jax.Array | None:
    """``block_attention`` over a paged context by a kernel that reads through the page table, or None
    where none takes it: no sinks or window, and the Triton block attention (a power-of-two head_dim, a
    block it holds in one program: each tile's keys loaded by their pool rows), the Mosaic GPU block
    attention (``ops.mosaic``, pages of whole key tiles) or on a TPU its block attention (a tile per
    page). The kernels take one block per row: several (a long block's sub-blocks,
    ``written_block_attention``) are each a row of their own over their row's page table, so nothing is
    gathered. Forward only (inference)."""
    if not (ops.kernels and sinks is None and window is None):
        return None
    if q.shape[1] > 1:
        batch, blocks = q.shape[:2]
        fold = lambda x: x.reshape((batch * blocks, 1) + x.shape[2:])  # noqa: E731
        per_block = lambda c: dataclasses.replace(  # noqa: E731
            c, page_table=jnp.repeat(c.page_table, blocks, axis=0), writable=jnp.repeat(c.writable, blocks))
        out = paged_block_attention(fold(q), per_block(k_ctx), per_block(v_ctx), ctx_lens.reshape(-1, 1),
                                    fold(k_blk), fold(v_blk), blk_lens.reshape(-1, 1), causal=causal, scale=scale,
                                    ops=ops, sinks=sinks, window=window)
        return None if out is None else out.reshape(q.shape)
    if jax.default_backend() == "tpu":
        from kernels_pallas.block_attention import tpu

        if k_ctx.page_size % 8:
            return None
        forward = functools.partial(tpu.paged_forward, causal=causal, scale=scale)
    elif not ops.mosaic:
        from kernels_pallas._common import next_pow2
        from kernels_pallas.block_attention import gpu

        head_dim = q.shape[-1]
        if head_dim != max(16, next_pow2(head_dim)) or not triton_block_kernel_fits(q.shape, k_blk.shape[3],
                                                                                     k_ctx.dtype):
            return None
        forward = functools.partial(gpu.paged_forward, causal=causal, scale=scale,
                                    interpret=jax.default_backend() != "gpu")
    else:
        from kernels_pallas.block_attention import mosaic_gpu

        if not mosaic_gpu.paged_supported(q.shape, k_ctx.pool.shape, k_ctx.n_pages, k_ctx.dtype):
            return None
        forward = functools.partial(mosaic_gpu.paged_forward, causal=causal, scale=scale)

    # Per device under a kernel mesh: its KV heads of every page (and their query heads), the page tables
    # of its rows.
    batch, _, block, heads, head_dim = q.shape
    kv_heads = k_ctx.pool.shape[2]

    def kernel(q, k_pool, v_pool, table, ctx_lens, k_blk, v_blk, blk_lens):
        b, n, s, kv, g, d = q.shape
        out = forward(q.reshape(b, n, s, kv * g, d), k_pool, v_pool, table, ctx_lens, k_blk, v_blk, blk_lens)[0]
        return (out.reshape(q.shape),)

    rows, kv_rows = ("batch", None, None, "kv_heads", None, None), ("batch", None, None, "kv_heads", None)
    (out,) = shard_kernel(kernel, (rows, POOL_AXES, POOL_AXES, PAGE_TABLE_AXES, ("batch",), kv_rows, kv_rows,
                                   ("batch",)), (rows,))(
        q.reshape(batch, 1, block, kv_heads, heads // kv_heads, head_dim), k_ctx.pool, v_ctx.pool,
        k_ctx.page_table[:, :k_ctx.n_pages], ctx_lens[:, 0], k_blk, v_blk, blk_lens[:, 0])
    return out.reshape(q.shape)


SINK_PROMPT_CHUNK = 512  # query slots a step of ``chunked_prompt_attention``


def chunked_prompt_attention(q: jax.Array, k: jax.Array, v: jax.Array, lens: jax.Array, *, chunk: int,
                             scale: float | None = None, sinks: jax.Array | None = None,
                             window: int | None = None) -> jax.Array:
    """``block_attention_reference`` of a prompt (one causal block per row, no context: ``q [batch, 1,
    seq, heads, head_dim]``, ``k, v [batch, 1, seq, kv_heads, head_dim]``, ``lens [batch, 1]``) in steps
    of ``chunk`` query slots (``lax.map``), each over the prompt's earlier slots as its context: float32
    scores of ``chunk * seq`` a head at a time, not ``seq ** 2``. For the layers no flash attention takes
    (attention sinks, sliding windows: gpt-oss)."""
    b, _, seq, heads, d = q.shape
    padded = -(-seq // chunk) * chunk
    pad = ((0, 0), (0, 0), (0, padded - seq), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))

    def step(start):
        def piece(x):
            return jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=2)

        # Context slots before ``start`` are the prompt's own (a query slot < lens sees only valid keys).
        return block_attention_reference(piece(q), k[:, 0], v[:, 0], jnp.full((b, 1), start, jnp.int32), piece(k),
                                         piece(v), jnp.clip(lens - start, 0, chunk), causal=True, scale=scale,
                                         sinks=sinks, window=window)

    out = jax.lax.map(step, jnp.arange(0, padded, chunk, dtype=jnp.int32))  # [chunks, b, 1, chunk, heads, d]
    return jnp.moveaxis(out, 0, 2).reshape(b, 1, padded, heads, d)[:, :, :seq]


TPU_FLASH_BLOCK = 128  # the Pallas TPU flash attention's default tiles; a prompt is padded to a multiple


def library_flash_attention(dtype, head_dim: int) -> Literal["cudnn", "tpu_flash"] | None:
    """The library flash attention ``prompt_attention`` runs here for 16-bit inputs, or None (the
    reference): cuDNN's fused attention on GPUs (it takes no float32), JAX's Pallas TPU flash
    attention on TPUs for head dims of whole 128-lane tiles (every Qwen3 and Llama-3 size; others
    were never run on a TPU). Float32 keeps the reference everywhere, for the exactness tests."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None
    backend = jax.default_backend()
    if backend == "gpu":
        return "cudnn"
    if backend == "tpu" and head_dim % 128 == 0:
        return "tpu_flash"
    return None


def prompt_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lens: jax.Array,
    *,
    scale: float | None = None,
    implementation: Literal["cudnn", "tpu_flash", "xla"] | None = None,
) -> jax.Array:
    """``block_attention_reference`` of one causal block per row with no context (a prompt):
    ``q [batch, seq, q_heads, head_dim]``, ``k, v [batch, seq, kv_heads, head_dim]``, ``lens [batch]``
    valid slots -> ``[batch, seq, q_heads, head_dim]``.

    A flash attention (O(seq) memory, the causal half of the score tiles skipped) in
    ``implementation``, by default ``library_flash_attention``'s: "cudnn" or "xla" through
    ``jax.nn.dot_product_attention``, "tpu_flash" through ``tpu_flash_attention``; where there is
    none, the reference itself, whose dense float32 scores take ``batch * q_heads * seq**2 * 4``
    bytes (34 GB per layer at 16,384 tokens). Slot ``i`` sees the valid slots ``j <= i``, as in the
    reference; a row of ``lens == 0`` gets zeros.
    """
    batch, seq, heads, head_dim = q.shape
    if implementation is None:
        implementation = library_flash_attention(q.dtype, head_dim)
        if implementation is None:
            empty = jnp.zeros((k.shape[0], 0) + k.shape[2:], k.dtype)
            zeros = jnp.zeros((q.shape[0], 1), jnp.int32)
            return block_attention_reference(q[:, None], empty, empty, zeros, k[:, None], v[:, None], lens[:, None],
                                             causal=True, scale=scale)[:, 0]
    kv_heads = k.shape[2]

    def attend(q, k, v, lens):
        b, s, kv, g, d = q.shape
        if implementation == "tpu_flash":
            out = tpu_flash_attention(q, k, v, lens, scale=scale)
        else:  # a row of no valid key: the library is handed one, and the row is zeroed after
            out = jax.nn.dot_product_attention(q.reshape(b, s, kv * g, d), k, v, scale=scale, is_causal=True,
                                               key_value_seq_lengths=jnp.maximum(lens, 1),
                                               implementation=implementation)
        return (jnp.where((lens > 0)[:, None, None, None], out, 0).astype(q.dtype).reshape(q.shape),)

    # Per device under a kernel mesh, as the Pallas kernels: rows on ``batch``, query heads by KV head.
    rows, kv_rows = ("batch", None, "kv_heads", None, None), ("batch", None, "kv_heads", None)
    (out,) = shard_kernel(attend, (rows, kv_rows, kv_rows, ("batch",)), (rows,))(
        q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim), k, v, lens)
    return out.reshape(q.shape)


def tpu_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, lens: jax.Array, *,
                        scale: float | None = None) -> jax.Array:
    """A prompt's causal attention by JAX's Pallas TPU flash attention: ``q [batch, seq, kv_heads,
    groups, head_dim]``, ``k, v [batch, seq, kv_heads, head_dim]``, ``lens [batch]`` -> ``[batch,
    seq, kv_heads * groups, head_dim]``, slot ``i`` over the valid slots ``j <= i`` (a row of
    ``lens == 0`` unspecified).

    The kernel takes heads-major ``[batch, heads, seq, head_dim]`` with as many K/V heads as query
    heads, in tiles of ``TPU_FLASH_BLOCK`` slots: the prompt is padded to whole tiles and each KV
    head repeated for its group. Its segment ids carry the lengths: every query slot is in segment
    1, a key slot only while valid (0 past ``lens`` and in the tiles' padding). Runs on TPUs, and
    elsewhere only under ``pltpu.force_tpu_interpret_mode`` (the tests)."""
    from jax.experimental.pallas.ops.tpu.flash_attention import SegmentIds, flash_attention

    from kernels_pallas._common import default_scale

    b, s, kv, g, d = q.shape
    padded = -(-s // TPU_FLASH_BLOCK) * TPU_FLASH_BLOCK

    def heads_major(x: jax.Array) -> jax.Array:  # [b, s, heads, d] -> [b, heads, padded, d]
        return jnp.pad(x, ((0, 0), (0, padded - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    valid_keys = (jnp.arange(padded)[None] < lens[:, None]).astype(jnp.int32)
    segments = SegmentIds(q=jnp.ones_like(valid_keys), kv=valid_keys)
    out = flash_attention(heads_major(q.reshape(b, s, kv * g, d)), jnp.repeat(heads_major(k), g, axis=1),
                          jnp.repeat(heads_major(v), g, axis=1), segment_ids=segments, causal=True,
                          sm_scale=default_scale(d, scale))
    return out.transpose(0, 2, 1, 3)[:, :s]


# ----------------------------------------------------------------------------------------------
# A block per row over its KV cache (decode, verify, draft), from the raw fused QKV projection.
# ----------------------------------------------------------------------------------------------


def split_qkv(qkv: jax.Array, num_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The raw fused projection ``[..., kv_heads, groups + 2, head_dim]`` (per KV head its query
    heads, its key, its value) -> raw q ``[..., heads, head_dim]``, k and v ``[..., kv_heads, head_dim]``."""
    groups = qkv.shape[-2] - 2
    q = qkv[..., :groups, :].reshape(qkv.shape[:-3] + (num_heads, qkv.shape[-1]))
    return q, qkv[..., groups, :], qkv[..., groups + 1, :]


def finish_qk(x: jax.Array, positions: jax.Array, norm_weight: jax.Array | None, eps: float,
              inv_freq, rope_factor: float = 1.0) -> jax.Array:
    """Raw q or k ``[..., seq, heads, head_dim]`` -> its per-head RMSNorm (where the model has one)
    and RoPE at ``positions [..., seq]`` (``rope_factor``: YaRN's scale of cos and sin)."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    return apply_rope(x, positions, inv_freq, rope_factor)


def cached_attention(
    qkv: jax.Array, starts: jax.Array, k_cache: jax.Array, v_cache: jax.Array, blk_lens: jax.Array, *,
    q_norm: jax.Array | None, k_norm: jax.Array | None, eps: float, inv_freq: tuple[float, ...],
    num_heads: int, causal: bool = True, write: bool = True, row_scale: jax.Array | None = None,
    ops: OpsConfig, sinks: jax.Array | None = None, window: int | None = None, rope_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A block per row over its KV cache, from the raw fused projection (the target's decode and
    verify: causal, the block's K/V written into the caches; the drafter: ``causal=False,
    write=False``).

    ``qkv [batch, block, kv_heads, groups + 2, head_dim]``, or float32 split-K partials ``[parts,
    rows, ...]`` (``ops.linear.single_row_partials``; rows past ``batch`` are padding), at positions
    ``starts [batch] + slot``; caches ``[batch, capacity, kv_heads, head_dim]``; ``blk_lens [batch]``
    valid slots; ``q_norm, k_norm [head_dim]`` the per-head norms' weights (None: no q/k norm);
    ``row_scale [batch, block]`` float32: each slot's projection (its partials' float32 sum) times it,
    then rounded to the caches' dtype (an input norm folded into the projection).

    Returns ``attn [batch, 1, block, heads, head_dim]`` and the caches. With the kernels on, one
    kernel (``kernels_pallas.cached_attention``) where it takes the shapes: the q/k norms, RoPE,
    the cache write and the attention, instead of ~12 XLA kernels. Its reference is the rest of this
    function: the same steps in jnp, which also serve the layers the kernel does not take (attention
    sinks, a sliding window, YaRN's ``rope_factor``: gpt-oss). With ``ops.gpu_lowering == "mosaic"``
    the jnp steps (``cached_attention_prologue``) and ``attend_and_write``, whose block attention is
    the Mosaic GPU kernel where it takes the shapes: a Mosaic GPU kernel for the steps before the
    attention measured slower than XLA's fusions of them (docs/performance.md).
    """
    batch, block, head_dim = k_cache.shape[0], qkv.shape[-4], k_cache.shape[-1]
    fused = ops.kernels and not ops.mosaic and sinks is None and window is None and rope_factor == 1.0
    if fused and isinstance(k_cache, PagedKV):
        out = paged_fused_cached_attention(qkv, starts, k_cache, v_cache, blk_lens, q_norm=q_norm, k_norm=k_norm,
                                           eps=eps, inv_freq=inv_freq, num_heads=num_heads, causal=causal,
                                           write=write, row_scale=row_scale, ops=ops)
        if out is not None:
            return out
        fused = False  # a block the kernel does not take: the unfused path, which gathers the pages
    if fused:
        from kernels_pallas.cached_attention import cached_block_attention, cached_block_attention_supported

        config = cached_attention_config(ops)
        if cached_block_attention_supported(qkv.shape[-5:], k_cache.shape[1], k_cache.dtype, config):
            ones = jnp.ones((head_dim,), k_cache.dtype)

            def kernel(qkv, k_cache, v_cache, starts, blk_lens, q_norm, k_norm, inv_freq, *scale):
                attn, k_cache, v_cache = cached_block_attention(
                    qkv, k_cache, v_cache, starts, blk_lens, q_norm, k_norm, inv_freq, eps=eps,
                    qk_norm=has_qk_norm, causal=causal, write=write, row_scale=scale[0] if scale else None,
                    config=config)
                # [b, block, kv, groups, d] by this shard's KV heads (whole where replicated)
                attn = attn.reshape(attn.shape[:2] + (qkv.shape[-3], -1, head_dim))
                return (attn, k_cache, v_cache) if write else (attn,)

            has_qk_norm = q_norm is not None
            # Per device under a kernel mesh: its rows and its KV heads (with their query heads).
            per_head = (None,) * (qkv.ndim - 5) + ("batch", None, "kv_heads", None, None)
            rows, vec = ("batch",), (None,)
            scale = () if row_scale is None else (row_scale,)
            outs = shard_kernel(kernel, (per_head, CACHE_AXES, CACHE_AXES, rows, rows, vec, vec, vec)
                                + (("batch", None),) * len(scale),
                                (per_head[-5:],) + ((CACHE_AXES, CACHE_AXES) if write else ()))(
                qkv, k_cache, v_cache, starts, blk_lens,
                q_norm if q_norm is not None else ones, k_norm if k_norm is not None else ones,
                jnp.asarray(inv_freq, jnp.float32), *scale)
            if write:
                k_cache, v_cache = outs[1:]
            return outs[0].reshape(batch, 1, block, num_heads, head_dim), k_cache, v_cache
    q, k, v = cached_attention_prologue(qkv, starts, batch, k_cache.dtype, q_norm=q_norm, k_norm=k_norm, eps=eps,
                                        inv_freq=inv_freq, num_heads=num_heads, row_scale=row_scale,
                                        rope_factor=rope_factor)
    return attend_and_write(q[:, None], k[:, None], v[:, None], starts, k_cache, v_cache, blk_lens,
                            causal=causal, write=write, ops=ops, sinks=sinks, window=window)


def fused_query_groups(groups: int, attention_impl: str) -> int:
    """The query heads per KV head the serving layout gives an attention of ``groups`` so that the fused
    cached-attention kernel takes it (``runtime.serving_params.pad_query_groups``): Triton's tiles hold a
    power of two of them (``kernels_pallas.cached_attention.gpu.tiles_supported``), so on a GPU with
    the kernels on, ``groups`` rounded up to one (zero queries, whose outputs the output projection
    drops); ``groups`` itself elsewhere. Off that kernel a decode token and a verify block each take
    the unfused path, its block attention a program per KV head: the embedded pair's float32 verify
    attention ran 55 us a layer there (docs/performance.md, "The embedded pair")."""
    from kernels_pallas._common import next_pow2
    from kernels_pallas._flash import MMA_MIN

    padded = next_pow2(groups)
    if attention_impl != "pallas" or jax.default_backend() != "gpu" or padded > MMA_MIN:
        return groups
    return padded


def cached_attention_config(ops: OpsConfig):
    """The fused cached-attention kernel's tiles with ``ops.cached_attention_tiles`` applied (None: its
    defaults)."""
    if not ops.cached_attention_tiles:
        return None
    from kernels_pallas.cached_attention.gpu import DEFAULT_CONFIG

    return dataclasses.replace(DEFAULT_CONFIG, **dict(ops.cached_attention_tiles))


def paged_fused_cached_attention(qkv: jax.Array, starts: jax.Array, k_cache: PagedKV, v_cache: PagedKV,
                                 blk_lens: jax.Array, *, q_norm: jax.Array | None, k_norm: jax.Array | None,
                                 eps: float, inv_freq: tuple[float, ...], num_heads: int, causal: bool, write: bool,
                                 row_scale: jax.Array | None,
                                 ops: OpsConfig) -> tuple[jax.Array, PagedKV, PagedKV] | None:
    """``cached_attention`` of the fused Triton kernel on paged caches, or None where it does not take the
    shapes: the kernel reads each row's context through its page table (``read_pages`` entries, the capacity
    it plans its splits over) and writes the block's K/V into the pool rows ``PagedKV.pool_rows`` resolves
    (the rows' pages; the null page for done rows), in place. Under a kernel mesh each device runs it on its
    KV heads of every page (``shard_kernel``), as the contiguous kernel on its KV heads of the rows' caches."""
    from kernels_pallas.cached_attention import cached_block_attention, cached_block_attention_supported

    batch, block, head_dim = k_cache.shape[0], qkv.shape[-4], k_cache.shape[-1]
    config = cached_attention_config(ops)
    if not cached_block_attention_supported(qkv.shape[-5:], k_cache.shape[1], k_cache.dtype, config):
        return None
    ones = jnp.ones((head_dim,), k_cache.dtype)

    def kernel(qkv, k_pool, v_pool, starts, blk_lens, q_norm, k_norm, inv_freq, table, *rest):
        pool_rows = rest[0] if write else None
        scale = rest[-1] if row_scale is not None else None
        attn, k_pool, v_pool = cached_block_attention(
            qkv, k_pool, v_pool, starts, blk_lens, q_norm, k_norm, inv_freq, eps=eps, qk_norm=has_qk_norm,
            causal=causal, write=write, row_scale=scale, config=config, page_table=table,
            read_pages=k_cache.n_pages, write_rows=pool_rows)
        # [b, block, kv, groups, d] by this shard's KV heads (whole where replicated)
        attn = attn.reshape(attn.shape[:2] + (qkv.shape[-3], -1, head_dim))
        return (attn, k_pool, v_pool) if write else (attn,)

    has_qk_norm = q_norm is not None
    per_head = (None,) * (qkv.ndim - 5) + ("batch", None, "kv_heads", None, None)
    rows, vec = ("batch",), (None,)
    extra = ((k_cache.pool_rows(starts, block),) if write else ()) + (() if row_scale is None else (row_scale,))
    extra_axes = (("batch", None),) * len(extra)
    outs = shard_kernel(kernel, (per_head, POOL_AXES, POOL_AXES, rows, rows, vec, vec, vec, PAGE_TABLE_AXES)
                        + extra_axes, (per_head[-5:],) + ((POOL_AXES, POOL_AXES) if write else ()))(
        qkv, k_cache.pool, v_cache.pool, starts, blk_lens, q_norm if q_norm is not None else ones,
        k_norm if k_norm is not None else ones, jnp.asarray(inv_freq, jnp.float32), k_cache.page_table, *extra)
    attn = outs[0].reshape(batch, 1, block, num_heads, head_dim)
    if not write:
        return attn, k_cache, v_cache
    return attn, dataclasses.replace(k_cache, pool=outs[1]), dataclasses.replace(v_cache, pool=outs[2])


def cached_attention_prologue(qkv: jax.Array, starts: jax.Array, batch: int, dtype, *, q_norm: jax.Array | None,
                              k_norm: jax.Array | None, eps: float, inv_freq, num_heads: int,
                              row_scale: jax.Array | None = None,
                              rope_factor: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``cached_attention``'s steps before the attention, in jnp (the kernels' reference): the
    projection ``qkv`` (or its float32 partials summed in order) times ``row_scale`` and rounded to
    ``dtype``, split, q and k normed and rotated at ``starts + slot`` -> q ``[batch, block, heads,
    head_dim]``, k, v ``[batch, block, kv_heads, head_dim]``."""
    if qkv.ndim == 6 or row_scale is not None:  # the kernel's sum (in order) and row scale, in float32
        x = qkv.astype(jnp.float32)
        x = (functools.reduce(jnp.add, list(x)) if qkv.ndim == 6 else x)[:batch]
        qkv = (x if row_scale is None else x * row_scale[:, :, None, None, None]).astype(dtype)
    positions = starts[:, None] + jnp.arange(qkv.shape[-4], dtype=jnp.int32)
    q, k, v = split_qkv(qkv[:batch], num_heads)
    return (finish_qk(q, positions, q_norm, eps, inv_freq, rope_factor),
            finish_qk(k, positions, k_norm, eps, inv_freq, rope_factor), v)


def attend_and_write(q, k, v, starts, k_cache, v_cache, blk_lens, *, causal: bool, write: bool,
                     ops: OpsConfig, sinks: jax.Array | None = None,
                     window: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Block attention of ``q [batch, 1, block, heads, head_dim]`` over the caches plus the block's
    own ``k, v [batch, 1, block, kv_heads, head_dim]``, which ``write`` then writes at ``starts``.
    With ``ops.gpu_lowering == "mosaic"``: the Mosaic GPU block attention where it takes the shapes. A
    long causal block the Triton block attention cannot hold in one program (a prefill suffix or chunk
    over a cached prefix, on a GPU) is written first and attended in sub-blocks
    (``written_block_attention``)."""
    if (write and causal and ops.kernels and not ops.mosaic and sinks is None and window is None
            and q.shape[2] > SUB_BLOCK and not triton_block_kernel_fits(q.shape, k.shape[3], k_cache.dtype)):
        k_cache, v_cache = write_rows(k_cache, k[:, 0], starts), write_rows(v_cache, v[:, 0], starts)
        attn = written_block_attention(q, k, v, starts, k_cache, v_cache, blk_lens, sub_block=SUB_BLOCK, ops=ops)
        return attn, k_cache, v_cache
    attn = block_attention(q, k_cache, v_cache, starts[:, None], k, v, blk_lens[:, None], causal=causal,
                           ops=ops, sinks=sinks, window=window)
    if not write:
        return attn, k_cache, v_cache
    return attn, write_rows(k_cache, k[:, 0], starts), write_rows(v_cache, v[:, 0], starts)


SUB_BLOCK = 16  # query slots per block of ``written_block_attention``: a verify block's, which the kernel holds


def written_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array, k_cache, v_cache,
                            blk_lens: jax.Array, *, sub_block: int, ops: OpsConfig) -> jax.Array:
    """A causal block ``q [batch, 1, block, heads, head_dim]`` (its own ``k, v [batch, 1, block, kv_heads,
    head_dim]``, ``blk_lens [batch]`` valid slots) at ``starts``, over caches that already hold its K/V
    at ``starts``: as ``sub_block``-slot blocks, block ``i`` over the cache positions before its first
    slot (the context and the block's earlier valid slots, ``starts + min(i * sub_block, blk_lens)``)
    plus its own slots. The same keys for each valid query as one causal block; each program of the
    block-attention kernel holds ``sub_block`` query slots, whatever the block's length."""
    batch, _, block, heads, head_dim = q.shape
    n = -(-block // sub_block)
    pad = ((0, 0), (0, 0), (0, n * sub_block - block), (0, 0), (0, 0))

    def blocks(x):  # [batch, 1, block, h, d] -> [batch, n, sub_block, h, d]
        return jnp.pad(x, pad).reshape((batch, n, sub_block) + x.shape[3:])

    first = jnp.arange(n, dtype=jnp.int32)[None, :] * sub_block
    ctx_lens = starts[:, None] + jnp.minimum(first, blk_lens[:, None])
    own = jnp.clip(blk_lens[:, None] - first, 0, sub_block)
    out = block_attention(blocks(q), k_cache, v_cache, ctx_lens, blocks(k), blocks(v), own, causal=True, ops=ops)
    return out.reshape(batch, 1, n * sub_block, heads, head_dim)[:, :, :block]

