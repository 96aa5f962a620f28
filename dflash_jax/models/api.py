"""The small, stable Python API for notebooks, tests and users (re-exported by ``dflash_jax``)."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target


def target_forward(
    target: Target, input_ids, layer_ids: Sequence[int] | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """Full-sequence forward without a cache.

    ``input_ids [batch, seq]`` -> ``(logits [batch, seq, vocab], taps)`` where taps are the hidden
    states after ``layer_ids`` (HF ``hidden_states[i + 1]``) concatenated on the feature axis,
    ``[batch, seq, len(layer_ids) * hidden]`` (None when ``layer_ids`` is None).
    """
    ids = jnp.asarray(input_ids, jnp.int32)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {ids.shape}")
    return _forward(target, ids, tap_layers=tuple(layer_ids or ()))


@functools.partial(jax.jit, static_argnames=("tap_layers",))
def _forward(target: Target, ids: jax.Array, *, tap_layers: tuple[int, ...]):
    return target.forward(ids, tap_layers=tap_layers)


def draft_logits(drafter: Drafter, target: Target, context_ids: Sequence[int], anchor_id: int,
                 block_size: int | None = None) -> jax.Array:
    """The drafter's logits ``[B - 1, vocab]`` for block slots 1..B-1 of the first drafting step.

    The context is ``context_ids`` at positions 0..n-1 (its taps from the target's forward); the block
    ``[anchor_id, MASK, ...]`` sits at positions n..n+B-1.
    """
    ctx = jnp.asarray([list(context_ids)], jnp.int32)
    return _draft_logits(drafter, target, ctx, jnp.int32(anchor_id), block=block_size or drafter.config.block_size)


@functools.partial(jax.jit, static_argnames=("block",))
def _draft_logits(drafter: Drafter, target: Target, ctx: jax.Array, anchor_id: jax.Array, *, block: int):
    cfg = drafter.config
    n = ctx.shape[1]
    _, taps = target.forward(ctx, tap_layers=cfg.target_layer_ids)
    k_ctx, v_ctx = drafter.context_kv(taps, jnp.arange(n, dtype=jnp.int32)[None])
    block_ids = jnp.concatenate([anchor_id[None], jnp.full((block - 1,), cfg.mask_token_id, jnp.int32)])[None]
    positions = (n + jnp.arange(block, dtype=jnp.int32))[None, None]
    lens = jnp.asarray([[n]], jnp.int32)
    hidden = drafter(target.embed(block_ids)[:, None], positions, k_ctx, v_ctx, lens,
                     jnp.asarray([[block]], jnp.int32))
    return drafter.logits(target, hidden[0, 0, 1:])
