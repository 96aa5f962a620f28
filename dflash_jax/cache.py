"""Preallocated KV caches: the target's and the drafter's context cache share one layout.

A cache is a registered dataclass of two zero-initialised arrays
``[layers, batch, capacity, kv_heads, head_dim]``. Lengths live with the engine's per-row state:
rollback is bookkeeping (a shorter length), and entries past a row's length are never read, so the
block written by a verify pass can simply be overwritten by the next one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [layers, batch, capacity, kv_heads, head_dim]
    v: jax.Array  # [layers, batch, capacity, kv_heads, head_dim]

    @classmethod
    def zeros(cls, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
        shape = (layers, batch, capacity, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def write_rows(buffer: jax.Array, update: jax.Array, starts: jax.Array) -> jax.Array:
    """Writes ``update [batch, n, ...]`` into ``buffer [batch, capacity, ...]`` at per-row ``starts``.

    The caller guarantees ``starts + n <= capacity`` (dynamic_update_slice would clamp otherwise).
    """
    def one(row, upd, start):
        idx = (start,) + (0,) * (row.ndim - 1)
        return jax.lax.dynamic_update_slice(row, upd.astype(row.dtype), idx)

    return jax.vmap(one)(buffer, update, starts)


def write_layer(cache: KVCache, layer: int, k: jax.Array, v: jax.Array, starts: jax.Array) -> KVCache:
    """Writes one layer's ``k, v [batch, n, kv_heads, head_dim]`` at per-row ``starts``."""
    return KVCache(
        cache.k.at[layer].set(write_rows(cache.k[layer], k, starts)),
        cache.v.at[layer].set(write_rows(cache.v[layer], v, starts)),
    )


def write_all_layers(cache: KVCache, k: jax.Array, v: jax.Array, starts: jax.Array) -> KVCache:
    """Writes ``k, v [layers, batch, n, kv_heads, head_dim]`` for all layers at per-row ``starts``."""
    over_layers = jax.vmap(write_rows, in_axes=(0, 0, None))
    return KVCache(over_layers(cache.k, k, starts), over_layers(cache.v, v, starts))
