"""Anchor blocks of the published DFlash training recipe (all jit-able, static shapes).

For a sequence of length S and block size B:

- ``num_anchors`` anchors per sequence are drawn without replacement, uniformly among the
  supervised positions ``p`` in ``[0, S - B]`` (``loss_mask[p] > 0``), re-drawn every step. When a
  row has fewer valid positions, the rest of its anchors are invalid: anchor 0, block of MASK
  tokens, no context, zero loss weight.
- The block of an anchor ``p`` is ``[ids[p], MASK, ..., MASK]`` at positions ``p .. p + B - 1``.
- Attention: a block sees context positions STRICTLY before its anchor (``ctx_len = p``) plus its
  own B slots (bidirectional), never another block. ``block_attention`` implements exactly this
  with ``ctx_lens = anchors`` and ``blk_lens = B``; ``dense_training_mask`` writes the same rule as
  one dense ``[blocks * B, S + blocks * B]`` mask (context first, then all blocks) for checking.
- Labels: slot ``k >= 1`` is labelled ``ids[p + k]``; slot 0 is never in the loss; a label is
  dropped when ``loss_mask[p + k] == 0`` or it lies in another packed segment than the anchor.
- Distillation reads the target's logits at ``p + k - 1`` (its prediction of ``ids[p + k]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_anchors(
    key: jax.Array, loss_mask: jax.Array, block_size: int, num_anchors: int
) -> tuple[jax.Array, jax.Array]:
    """``(anchors, valid)``: int32 ``[batch, num_anchors]`` sorted ascending (invalid ones are 0
    and come last) and bool ``[batch, num_anchors]``."""
    batch, seq = loss_mask.shape
    span = seq - block_size + 1  # candidate anchors 0 .. S - B
    if span < 1:
        raise ValueError(f"seq_len={seq} is shorter than block_size={block_size}")
    ok = loss_mask[:, :span] > 0
    u = jax.random.uniform(key, (batch, span))
    score = jnp.where(ok, u, -1.0)
    k = min(num_anchors, span)
    top, idx = jax.lax.top_k(score, k)  # a uniform random subset of the valid positions
    valid = top >= 0.0
    # Sort the chosen anchors ascending, invalid ones last.
    order_key = jnp.where(valid, idx, seq + 1)
    order_key = jnp.sort(order_key, axis=-1)
    valid = order_key <= seq
    anchors = jnp.where(valid, order_key, 0).astype(jnp.int32)
    if k < num_anchors:
        pad = num_anchors - k
        anchors = jnp.pad(anchors, ((0, 0), (0, pad)))
        valid = jnp.pad(valid, ((0, 0), (0, pad)))
    return anchors, valid


def block_token_ids(
    input_ids: jax.Array, anchors: jax.Array, valid: jax.Array, block_size: int, mask_token_id: int
) -> jax.Array:
    """``[batch, blocks, B]`` ids: the anchor's token then MASK (all MASK for an invalid anchor)."""
    anchor_tok = jnp.take_along_axis(input_ids, anchors, axis=1)
    anchor_tok = jnp.where(valid, anchor_tok, mask_token_id)
    rest = jnp.full(anchors.shape + (block_size - 1,), mask_token_id, input_ids.dtype)
    return jnp.concatenate([anchor_tok[..., None].astype(input_ids.dtype), rest], axis=-1)


def block_positions(anchors: jax.Array, block_size: int) -> jax.Array:
    """``[batch, blocks, B]`` RoPE positions ``anchor + k``."""
    return anchors[..., None] + jnp.arange(block_size, dtype=anchors.dtype)


def attention_lengths(anchors: jax.Array, valid: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """``(ctx_lens, blk_lens)`` for ``block_attention``: context strictly before the anchor, whole block."""
    ctx_lens = jnp.where(valid, anchors, 0).astype(jnp.int32)
    blk_lens = jnp.full(anchors.shape, block_size, jnp.int32)
    return ctx_lens, blk_lens


def block_labels(
    input_ids: jax.Array,
    loss_mask: jax.Array,
    segment_ids: jax.Array | None,
    anchors: jax.Array,
    valid: jax.Array,
    block_size: int,
) -> tuple[jax.Array, jax.Array]:
    """``(labels, label_mask)``: int32 ``[batch, blocks, B]`` (``ids[anchor + k]``) and float32 0/1."""
    seq = input_ids.shape[1]
    pos = block_positions(anchors, block_size)
    in_range = pos < seq
    safe = jnp.minimum(pos, seq - 1)
    b, n, B = pos.shape
    flat = safe.reshape(b, n * B)
    labels = jnp.take_along_axis(input_ids, flat, axis=1).reshape(b, n, B)
    sup = jnp.take_along_axis(loss_mask, flat, axis=1).reshape(b, n, B) > 0
    mask = sup & in_range & valid[..., None] & (jnp.arange(B) >= 1)
    if segment_ids is not None:
        seg = jnp.take_along_axis(segment_ids, flat, axis=1).reshape(b, n, B)
        anchor_seg = jnp.take_along_axis(segment_ids, anchors, axis=1)
        mask = mask & (seg == anchor_seg[..., None])
    return labels.astype(jnp.int32), mask.astype(jnp.float32)


def teacher_positions(anchors: jax.Array, block_size: int) -> jax.Array:
    """``[batch, blocks, B]`` the target position whose logits predict slot k: ``anchor + k - 1``
    (clamped to 0 for slot 0 of an anchor at 0, which is never in the loss)."""
    return jnp.maximum(block_positions(anchors, block_size) - 1, 0)


def dense_training_mask(ctx_lens: jax.Array, blk_lens: jax.Array, seq_len: int, block_size: int) -> jax.Array:
    """The attention pattern of a training step as one dense boolean mask.

    ``[batch, blocks * B, seq_len + blocks * B]``: queries are all block slots in order; keys are
    the ``seq_len`` context positions followed by all block slots. A query slot of block ``n`` sees
    context ``j < ctx_lens[n]`` and the first ``blk_lens[n]`` slots of block ``n`` only.
    """
    n = ctx_lens.shape[1]
    q_block = jnp.arange(n * block_size) // block_size  # [Q]
    ctx = jnp.arange(seq_len)[None, None, :] < jnp.repeat(ctx_lens, block_size, axis=1)[:, :, None]
    kv_block = jnp.arange(n * block_size) // block_size
    kv_slot = jnp.arange(n * block_size) % block_size
    same = (q_block[:, None] == kv_block[None, :])[None]  # [1, Q, K]
    slot_ok = (kv_slot[None, :] < jnp.repeat(blk_lens, block_size, axis=1))[:, None, :]  # [b, 1, K]
    return jnp.concatenate([ctx, same & slot_ok], axis=-1)
