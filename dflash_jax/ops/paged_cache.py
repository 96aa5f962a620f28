"""Paged KV caches: one pool of fixed-size pages per layer, read and written through per-row page tables.

A paged cache is a ``KVCache`` whose per-layer arrays are page pools ``[pages, page_size, kv_heads,
head_dim]`` instead of ``[batch, capacity, kv_heads, head_dim]``. Row ``b``'s position ``p`` lives at
offset ``p % page_size`` of page ``page_table[b, p // page_size]``; ``page_table [batch, max_pages]``
int32 has a fixed size, so nothing recompiles as rows grow. Page ``NULL_PAGE`` (0) is never handed to a
request: table entries a row has no page for point at it, and the writes a row must not make (a done
row's block, positions past its pages) land in it. Its contents are garbage that no read uses: a row
attends only to positions below its length, all of which are in its own pages.

The XLA reference path reads a row's pages as a contiguous view (``gather_view``: the first ``n_pages``
entries of each row's table, ``[batch, n_pages * page_size, kv_heads, head_dim]`` per layer), runs the
contiguous step on it, and scatters the positions the step wrote back into the pools
(``scatter_positions``). Shapes are static throughout: a view's length is a static page count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.ops.cache import KVCache, read_rows

NULL_PAGE = 0  # the page that takes every write a row must not make; never allocated to a request


def page_pools(layers: int, pages: int, page_size: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    """Zeroed page pools of ``layers`` layers: ``[pages, page_size, kv_heads, head_dim]`` each (a ``KVCache``
    whose arrays are pools)."""
    return KVCache.zeros(layers, pages, page_size, kv_heads, head_dim, dtype)


def gather_view(pools: KVCache, page_table: jax.Array, n_pages: int) -> KVCache:
    """Each row's first ``n_pages`` pages as a contiguous cache ``[batch, n_pages * page_size, kv_heads,
    head_dim]`` per layer; ``page_table [batch, >= n_pages]``."""
    table = page_table[:, :n_pages]

    def one(pool: jax.Array) -> jax.Array:
        pages = pool[table]  # [batch, n_pages, page_size, kv_heads, head_dim]
        return pages.reshape((table.shape[0], n_pages * pool.shape[1]) + pool.shape[2:])

    return KVCache(tuple(one(x) for x in pools.k), tuple(one(x) for x in pools.v))


def page_slots(page_table: jax.Array, positions: jax.Array, keep: jax.Array, page_size: int
               ) -> tuple[jax.Array, jax.Array]:
    """The (page, offset) of each of ``positions [batch, n]`` through ``page_table [batch, max_pages]``;
    positions where ``keep [batch, n]`` is False, or past the table, go to ``NULL_PAGE``."""
    index = positions // page_size
    inside = keep & (index < page_table.shape[1]) & (positions >= 0)
    page = jnp.take_along_axis(page_table, jnp.clip(index, 0, page_table.shape[1] - 1), axis=1)
    return jnp.where(inside, page, NULL_PAGE), positions % page_size


def scatter_positions(pool: jax.Array, page_table: jax.Array, values: jax.Array, starts: jax.Array,
                      keep: jax.Array) -> jax.Array:
    """Writes ``values [batch, n, kv_heads, head_dim]`` at each row's positions ``starts [batch] + 0 ..
    n - 1`` of ``pool [pages, page_size, kv_heads, head_dim]``, where ``keep [batch, n]``; the other
    slots write into ``NULL_PAGE``."""
    n = values.shape[1]
    positions = starts[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    page, offset = page_slots(page_table, positions, keep, pool.shape[1])
    return pool.at[page, offset].set(values.astype(pool.dtype))


def scatter_block(pools: KVCache, page_table: jax.Array, view: KVCache, starts: jax.Array, n: int,
                  keep: jax.Array) -> KVCache:
    """Copies positions ``[starts, starts + n)`` of a contiguous ``view`` (which a step wrote its block
    into) into the pools, per row, where ``keep [batch, n]``."""
    def one(pool, v):
        return scatter_positions(pool, page_table, read_rows(v, starts, n), starts, keep)

    return KVCache(tuple(one(p, v) for p, v in zip(pools.k, view.k)),
                   tuple(one(p, v) for p, v in zip(pools.v, view.v)))
