"""The pure-jnp reference of the block attention: the function every block-attention kernel computes.

``dflash_jax.ops.attention.block_attention`` runs it where the kernels are off (the CPU, float32
exactness) and the tests hold the kernels to it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so that fully masked rows give zeros rather than NaN


def block_attention_reference(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, ctx_lens: jax.Array,
    k_blk: jax.Array, v_blk: jax.Array, blk_lens: jax.Array, *, causal: bool, scale: float | None = None,
    sinks: jax.Array | None = None, window: int | None = None) -> jax.Array:
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
      sinks: ``[q_heads]`` learned sink logits (gpt-oss): each head's softmax denominator also
        holds ``exp(sink)``, a key of no value.
      window: a sliding window: the query at position ``p`` (block slot ``i`` is at ``ctx_len + i``,
        context slot ``t`` at ``t``) sees keys at positions ``> p - window`` only, and in a
        non-causal block also ``< p + window`` (a drafter's sliding layer, as the reference masks it).

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
    if window is not None:
        q_pos = ctx_lens[:, :, None] + slot[None, None, :]  # [b, n, query]
        ctx_visible = ctx_visible[:, :, None, :] & (q_pos[..., None] - ctx_pos[None, None, None, :] < window)
        blk_visible = blk_visible & (slot[None, None, :, None] - slot[None, None, None, :] < window)
        if not causal:
            blk_visible = blk_visible & (slot[None, None, None, :] - slot[None, None, :, None] < window)
    else:
        ctx_visible = ctx_visible[:, :, None, :]  # [b, n, 1, ctx]
    ctx_visible = ctx_visible[:, :, None, None]  # [b, n, 1, 1, query or 1, ctx]
    s_ctx = jnp.where(ctx_visible, s_ctx * scale, _MASKED)
    s_blk = jnp.where(blk_visible[:, :, None, None, :, :], s_blk * scale, _MASKED)

    scores = jnp.concatenate([s_ctx, s_blk], axis=-1)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(kv_heads, groups)[None, None, :, :, None, None]
        peak = jnp.maximum(peak, sink)
    weights = jnp.exp(scores - peak)
    visible = jnp.concatenate(
        [
            jnp.broadcast_to(ctx_visible, s_ctx.shape),
            jnp.broadcast_to(blk_visible[:, :, None, None, :, :], s_blk.shape),
        ],
        axis=-1,
    )
    weights = jnp.where(visible, weights, 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - peak)
    probs = weights / jnp.where(denom == 0.0, 1.0, denom)

    n_ctx = k_ctx.shape[1]
    p_ctx = probs[..., :n_ctx].astype(v_ctx.dtype)
    p_blk = probs[..., n_ctx:].astype(v_blk.dtype)
    out = jnp.einsum("bnkgst,btkd->bnskgd", p_ctx, v_ctx, preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bnkgst,bntkd->bnskgd", p_blk, v_blk, preferred_element_type=jnp.float32)
    return out.reshape(batch, blocks, block, q_heads, head_dim).astype(q.dtype)
