"""Preallocated KV caches: the target's and the drafter's context cache share one layout.

A cache is a registered dataclass of per-layer, zero-initialised arrays
``[batch, capacity, kv_heads, head_dim]``: one buffer per layer, so that a donated step updates each
in place (a stacked ``[layers, ...]`` array would be sliced and copied per layer). Lengths live with
the engine's per-row state: rollback is bookkeeping (a shorter length), and entries past a row's
length are never read, so the block written by a verify pass is simply overwritten by the next one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer: [batch, capacity, kv_heads, head_dim]
    v: tuple[jax.Array, ...]  # per layer: [batch, capacity, kv_heads, head_dim]

    @classmethod
    def zeros(cls, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
        shape = (batch, capacity, kv_heads, head_dim)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(layers)))

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.k)


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
    ks, vs = list(cache.k), list(cache.v)
    ks[layer] = write_rows(ks[layer], k, starts)
    vs[layer] = write_rows(vs[layer], v, starts)
    return KVCache(tuple(ks), tuple(vs))


def write_all_layers(cache: KVCache, k: jax.Array, v: jax.Array, starts: jax.Array) -> KVCache:
    """Writes ``k, v [layers, batch, n, kv_heads, head_dim]`` for all layers at per-row ``starts``."""
    return KVCache(tuple(write_rows(c, u, starts) for c, u in zip(cache.k, k)),
                   tuple(write_rows(c, u, starts) for c, u in zip(cache.v, v)))
