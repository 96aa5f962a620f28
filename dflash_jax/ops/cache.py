"""Preallocated KV caches: the target's and the drafter's context cache share one layout.

A cache is a registered dataclass of per-layer, zero-initialised arrays
``[batch, capacity, kv_heads, head_dim]``: one buffer per layer, so that a donated step updates each
in place (a stacked ``[layers, ...]`` array would be sliced and copied per layer). Lengths live with
the engine's per-row state: rollback is bookkeeping (a shorter length), and entries past a row's
length are never read, so the block written by a verify pass is simply overwritten by the next one.

A decode step may attend to a static prefix ``window`` of the buffers instead of their whole capacity
(``read_window`` / ``write_back``): the XLA attention computes over every context position it is given,
so reading only the positions a row can have filled makes its cost follow the live length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")
CACHE_ALIGNMENT = 128  # engine cache capacities are multiples of this many positions (whole kernel tiles)


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
    A paged cache layer (``ops.paged_cache.PagedKV``, not an array) writes through its page table.
    """
    if not isinstance(buffer, jax.Array):
        return buffer.write_rows(update, starts)

    def one(row, upd, start):
        idx = (start,) + (0,) * (row.ndim - 1)
        return jax.lax.dynamic_update_slice(row, upd.astype(row.dtype), idx)

    return jax.vmap(one)(buffer, update, starts)


def read_rows(buffer: jax.Array, starts: jax.Array, n: int) -> jax.Array:
    """Positions ``[starts, starts + n)`` of ``buffer [batch, capacity, ...]`` per row -> ``[batch, n, ...]``:
    the read that ``write_rows`` at the same ``starts`` writes back. A paged cache layer
    (``ops.paged_cache.PagedKV``) is read from its rows' pages, gathered."""
    if not isinstance(buffer, jax.Array):
        buffer = buffer.gather()
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, n, axis=0))(buffer, starts)


def write_all_layers(cache: KVCache, k: jax.Array, v: jax.Array, starts: jax.Array) -> KVCache:
    """Writes ``k, v [layers, batch, n, kv_heads, head_dim]`` for all layers at per-row ``starts``."""
    return KVCache(tuple(write_rows(c, u, starts) for c, u in zip(cache.k, k)),
                   tuple(write_rows(c, u, starts) for c, u in zip(cache.v, v)))


def read_window(cache: KVCache, window: int) -> KVCache:
    """The first ``window`` positions of every layer: ``[batch, window, kv_heads, head_dim]`` each."""
    return KVCache(tuple(x[:, :window] for x in cache.k), tuple(x[:, :window] for x in cache.v))


def write_back(cache: KVCache, window: KVCache, starts: jax.Array, n: int) -> KVCache:
    """Copies positions ``[starts, starts + n)`` of ``window`` (a ``read_window`` of ``cache`` that a
    step has written its block into) back into ``cache``, per row.

    Only the block moves: the rest of the window is unchanged. The write depends on the window read,
    so XLA updates ``cache`` in place after the read instead of copying it. Rows need
    ``starts + n <= window capacity``; others (done rows) get stale values past ``starts``, which are
    never read.
    """
    return KVCache(tuple(write_rows(c, read_rows(w, starts, n), starts) for c, w in zip(cache.k, window.k)),
                   tuple(write_rows(c, read_rows(w, starts, n), starts) for c, w in zip(cache.v, window.v)))
