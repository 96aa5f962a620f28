"""A drafter's decode case for the serving-layout tests: three rows of different context lengths over a
context cache holding stale entries past each row's context, one row's block short."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops.cache import KVCache, write_all_layers


class DraftCase(NamedTuple):
    taps: jax.Array       # [batch, n, taps * hidden]
    positions: jax.Array  # [batch, n]
    starts: jax.Array     # [batch]
    valid: jax.Array      # [batch]
    embeds: jax.Array     # [batch, 1, block, hidden]
    cache: KVCache
    want: jax.Array       # the drafter's training forward over the case: [batch, 1, block, hidden]
    rows: np.ndarray      # [batch, block]: the slots that exist (the short block's padding is free)


def draft_case(drafter, target_hidden: int, seed: int = 0) -> DraftCase:
    cfg = drafter.config
    keys = jax.random.split(jax.random.key(seed), 4)
    batch, n, cap, block = 3, 20, 48, cfg.block_size
    taps = jax.random.normal(keys[0], (batch, n, len(cfg.target_layer_ids) * target_hidden))
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    starts = jnp.array([20, 5, 13], jnp.int32)
    valid = jnp.array([block, block, 3], jnp.int32)
    embeds = jax.random.normal(keys[1], (batch, 1, block, target_hidden))
    k, v = drafter.context_kv(taps, positions)
    junk = KVCache.zeros(cfg.num_layers, batch, cap, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    junk = KVCache(tuple(x + jax.random.normal(keys[2], x.shape) for x in junk.k),
                   tuple(x + jax.random.normal(keys[3], x.shape) for x in junk.v))
    cache = write_all_layers(junk, k, v, jnp.zeros((batch,), jnp.int32))
    block_pos = (starts[:, None] + jnp.arange(block, dtype=jnp.int32))[:, None]
    want = drafter(embeds, block_pos, jnp.stack(cache.k), jnp.stack(cache.v), starts[:, None], valid[:, None])
    rows = np.arange(block)[None, :] < np.asarray(valid)[:, None]
    return DraftCase(taps, positions, starts, valid, embeds, cache, want, rows)
