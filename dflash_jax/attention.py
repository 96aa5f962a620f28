"""The one attention primitive of dflash-jax: blocks of queries over a shared context plus their own block.

Every attention in the project is this shape:

- drafting: one block of B queries per row, the row's committed context (its drafter cache) plus
  the block's own K/V, no mask inside the block (the drafter is bidirectional);
- verifying: the same block in the target, causal inside the block;
- prefill: the padded prompt is one causal block with an empty context;
- training: every anchor block of a sequence sees the context strictly before its anchor
  (``ctx_len = anchor``) plus its own block.

``block_attention`` dispatches between this pure-jnp reference (``impl="xla"``) and the Pallas kernels
in ``kernels_pallas`` (``impl="pallas"``); both compute exactly the function documented here. The
Pallas kernels hold a block's query rows in one program, tiled for draft and verify blocks of up to
16 slots; a prompt (one causal block per row with no context: prefill, the frozen target's forward
in training) takes ``prompt_attention`` instead, a library's flash attention (cuDNN's on GPUs, JAX's
Pallas one on TPUs).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from dflash_jax.cache import CACHE_AXES
from dflash_jax.sharding import shard_kernel

AttentionImpl = Literal["xla", "pallas"]


def resolve_attention_impl(impl: str) -> AttentionImpl:
    """A configured ``attention_impl`` ("xla", "pallas" or "auto") for this platform: "auto" is the
    kernels on GPUs and TPUs, the reference elsewhere."""
    if impl == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
    return impl


_MASKED = -1e30  # finite, so that fully masked rows give zeros rather than NaN


def block_attention_reference(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    ctx_lens: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    blk_lens: jax.Array,
    *,
    causal: bool,
    scale: float | None = None,
) -> jax.Array:
    """Attention of query blocks over a shared context prefix plus their own block.

    Args:
      q: ``[batch, blocks, block, q_heads, head_dim]`` queries (already normed and RoPE'd).
      k_ctx, v_ctx: ``[batch, ctx, kv_heads, head_dim]`` the shared context K/V of each row.
      ctx_lens: ``[batch, blocks]`` int32; block ``n`` of row ``b`` sees context positions
        ``[0, ctx_lens[b, n])``.
      k_blk, v_blk: ``[batch, blocks, block, kv_heads, head_dim]`` each block's own K/V.
      blk_lens: ``[batch, blocks]`` int32; only the first ``blk_lens`` slots of a block are keys
        (the reference's shorter last block; padding of a prompt).
      causal: slot ``i`` sees block slots ``j <= i`` only (verify, prefill); else all valid slots.
      scale: softmax scale, ``1 / sqrt(head_dim)`` by default.

    Returns:
      ``[batch, blocks, block, q_heads, head_dim]`` in ``q.dtype``. A query that sees no key at
      all gets zeros.

    GQA: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``. Scores and softmax are in
    float32; the matmuls take the inputs' dtype and accumulate in float32.
    """
    batch, blocks, block, q_heads, head_dim = q.shape
    kv_heads = k_ctx.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    groups = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qg = q.reshape(batch, blocks, block, kv_heads, groups, head_dim)

    s_ctx = jnp.einsum("bnskgd,btkd->bnkgst", qg, k_ctx, preferred_element_type=jnp.float32)
    s_blk = jnp.einsum("bnskgd,bntkd->bnkgst", qg, k_blk, preferred_element_type=jnp.float32)
    ctx_pos = jnp.arange(k_ctx.shape[1])
    ctx_visible = ctx_pos[None, None, :] < ctx_lens[:, :, None]  # [batch, blocks, ctx]
    slot = jnp.arange(block)
    blk_visible = slot[None, None, None, :] < blk_lens[:, :, None, None]  # [b, n, 1, key]
    if causal:
        blk_visible = blk_visible & (slot[None, None, None, :] <= slot[None, None, :, None])
    s_ctx = jnp.where(ctx_visible[:, :, None, None, None, :], s_ctx * scale, _MASKED)
    s_blk = jnp.where(blk_visible[:, :, None, None, :, :], s_blk * scale, _MASKED)

    scores = jnp.concatenate([s_ctx, s_blk], axis=-1)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - peak)
    visible = jnp.concatenate(
        [
            jnp.broadcast_to(ctx_visible[:, :, None, None, None, :], s_ctx.shape),
            jnp.broadcast_to(blk_visible[:, :, None, None, :, :], s_blk.shape),
        ],
        axis=-1,
    )
    weights = jnp.where(visible, weights, 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom == 0.0, 1.0, denom)

    n_ctx = k_ctx.shape[1]
    p_ctx = probs[..., :n_ctx].astype(v_ctx.dtype)
    p_blk = probs[..., n_ctx:].astype(v_blk.dtype)
    out = jnp.einsum("bnkgst,btkd->bnskgd", p_ctx, v_ctx, preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bnkgst,bntkd->bnskgd", p_blk, v_blk, preferred_element_type=jnp.float32)
    return out.reshape(batch, blocks, block, q_heads, head_dim).astype(q.dtype)


def block_attention(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    ctx_lens: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    blk_lens: jax.Array,
    *,
    causal: bool,
    scale: float | None = None,
    impl: AttentionImpl = "xla",
) -> jax.Array:
    """``block_attention_reference`` computed by ``impl`` ("xla": the reference; "pallas": a kernel,
    or for a prompt, one causal block per row with no context, ``prompt_attention``)."""
    if impl == "pallas" and causal and q.shape[1] == 1 and k_ctx.shape[1] == 0:
        return prompt_attention(q[:, 0], k_blk[:, 0], v_blk[:, 0], blk_lens[:, 0], scale=scale)[:, None]
    if impl == "xla":
        return block_attention_reference(
            q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal, scale=scale
        )
    if impl == "pallas":
        from kernels_pallas import block_attention as pallas_block_attention

        # Per device under a kernel mesh: rows on ``batch``, heads by their KV head (the query
        # heads as [kv_heads, groups], so a device's query heads are those of its KV heads).
        batch, blocks, block, heads, head_dim = q.shape
        kv_heads = k_ctx.shape[2]

        def kernel(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens):
            b, n, s, kv, g, d = q.shape
            out = pallas_block_attention(q.reshape(b, n, s, kv * g, d), k_ctx, v_ctx, ctx_lens, k_blk, v_blk,
                                         blk_lens, causal=causal, scale=scale)
            return (out.reshape(q.shape),)

        rows, kv_rows = ("batch", None, None, "kv_heads", None, None), ("batch", None, None, "kv_heads", None)
        lens = ("batch", None)
        (out,) = shard_kernel(kernel, (rows, CACHE_AXES, CACHE_AXES, lens, kv_rows, kv_rows, lens), (rows,))(
            q.reshape(batch, blocks, block, kv_heads, heads // kv_heads, head_dim), k_ctx, v_ctx, ctx_lens,
            k_blk, v_blk, blk_lens)
        return out.reshape(q.shape)
    raise ValueError(f"attention impl must be 'xla' or 'pallas', got {impl!r}")


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
