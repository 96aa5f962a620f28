"""Paged KV caches: one pool of fixed-size pages per layer, read and written through per-row page tables.

A paged cache is a ``KVCache`` whose per-layer arrays are page pools ``[pages, page_size, kv_heads,
head_dim]`` instead of ``[batch, capacity, kv_heads, head_dim]``. Row ``b``'s position ``p`` lives at
offset ``p % page_size`` of page ``page_table[b, p // page_size]``; ``page_table [batch, max_pages]``
int32 has a fixed size, so nothing recompiles as rows grow. Page ``NULL_PAGE`` (0) is never handed to a
request: table entries a row has no page for point at it, and the writes a row must not make (a done
row's block, positions past its pages) land in it. Its contents are garbage that no read uses: a row
attends only to positions below its length, all of which are in its own pages.

A decode step reads and writes the pools in place: each layer's cache arrays are ``PagedKV`` values (a
pool, the page tables, the rows that may write, the static number of pages a step reads), which the
models pass where they pass a contiguous cache array. ``ops.attention`` reads through the table: the
Triton kernels (the fused cached attention, the block attention) and the Mosaic GPU block attention load
the pages the table names, and the fused kernel stores a block's K/V at the pool rows
``PagedKV.pool_rows`` resolves; every other path gathers the row's pages of that one layer inside the op
(``PagedKV.gather``). A block's K/V written outside the fused kernel are scattered into the row's pages
(``scatter_positions``). A prefill over a cached prefix is a step of the same kind: its suffix block is
read and written through the page tables, so no phase holds the prefix of every layer at once. Shapes
are static throughout: a step's page count is static.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax.ops.cache import KVCache

NULL_PAGE = 0  # the page that takes every write a row must not make; never allocated to a request

# Logical axes of a pool and of the page tables (``dflash_jax.sharding``): on a mesh a pool is split by KV
# head, as a contiguous cache is, and holds every row's pages, so rows are never split.
POOL_AXES = ("pages", "length", "kv_heads", "head_dim")
PAGE_TABLE_AXES = ("batch", None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
    """One layer's K or V cache of a paged state, standing where a contiguous cache array ``[batch,
    n_pages * page_size, kv_heads, head_dim]`` stands (``shape``, ``dtype``): row ``b``'s position ``p``
    is at ``pool[page_table[b, p // page_size], p % page_size]``. A step reads each row's first
    ``n_pages`` table entries (a static count covering every live row's positions); writes of rows
    where ``writable`` is False (done rows) land in ``NULL_PAGE``."""

    pool: jax.Array        # [pages, page_size, kv_heads, head_dim]
    page_table: jax.Array  # [batch, max_pages] int32
    writable: jax.Array    # [batch] bool
    n_pages: int = dataclasses.field(metadata=dict(static=True))

    @property
    def page_size(self) -> int:
        return self.pool.shape[1]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The contiguous cache this stands for: ``[batch, n_pages * page_size, kv_heads, head_dim]``."""
        return (self.page_table.shape[0], self.n_pages * self.page_size) + tuple(self.pool.shape[2:])

    @property
    def dtype(self):
        return self.pool.dtype

    @property
    def ndim(self) -> int:
        return 4

    def gather(self) -> jax.Array:
        """The contiguous cache itself, ``[batch, n_pages * page_size, kv_heads, head_dim]``: each row's
        first ``n_pages`` pages (a copy; the XLA reference of reading through the table)."""
        return gather_pages(self.pool, self.page_table, self.n_pages)

    def pool_rows(self, starts: jax.Array, n: int) -> jax.Array:
        """Where ``write_rows`` puts each row's positions ``starts [batch] + 0 .. n - 1``, as rows of the
        pool flattened to ``[pages * page_size, kv_heads, head_dim]``: ``[batch, n]`` int32 (the null
        page's for rows that may not write and positions past the table)."""
        positions = starts[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
        keep = jnp.broadcast_to(self.writable[:, None], positions.shape)
        page, offset = page_slots(self.page_table, positions, keep, self.page_size)
        return page * self.page_size + offset

    def write_rows(self, update: jax.Array, starts: jax.Array) -> "PagedKV":
        """``ops.cache.write_rows`` through the table: ``update [batch, n, kv_heads, head_dim]`` at each
        writable row's positions ``starts [batch] + j``."""
        keep = jnp.broadcast_to(self.writable[:, None], update.shape[:2])
        return dataclasses.replace(self, pool=scatter_positions(self.pool, self.page_table, update, starts, keep))


def paged_layers(pools: KVCache, page_table: jax.Array, writable: jax.Array, n_pages: int) -> KVCache:
    """The pools as a cache of ``PagedKV`` layers (what a decode step's models take), each reading the
    rows' first ``n_pages`` pages."""
    if not isinstance(n_pages, int) or not 0 < n_pages <= page_table.shape[-1]:
        raise ValueError(f"n_pages must be a static page count in 1..{page_table.shape[-1]} (the page table's "
                         f"width), got {n_pages!r}")
    return KVCache(tuple(PagedKV(x, page_table, writable, n_pages) for x in pools.k),
                   tuple(PagedKV(x, page_table, writable, n_pages) for x in pools.v))


def layer_pools(cache: KVCache) -> KVCache:
    """``paged_layers``' inverse: the pools of a cache of ``PagedKV`` layers."""
    return KVCache(tuple(x.pool for x in cache.k), tuple(x.pool for x in cache.v))


def gather_pages(pool: jax.Array, page_table: jax.Array, n_pages: int) -> jax.Array:
    """Each row's first ``n_pages`` pages of ``pool [pages, page_size, kv_heads, head_dim]`` through
    ``page_table [batch, >= n_pages]`` -> ``[batch, n_pages * page_size, kv_heads, head_dim]``."""
    pages = pool[page_table[:, :n_pages]]  # [batch, n_pages, page_size, kv_heads, head_dim]
    return pages.reshape((page_table.shape[0], n_pages * pool.shape[1]) + pool.shape[2:])


def page_pools(layers: int, pages: int, page_size: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    """Zeroed page pools of ``layers`` layers: ``[pages, page_size, kv_heads, head_dim]`` each (a ``KVCache``
    whose arrays are pools)."""
    return KVCache.zeros(layers, pages, page_size, kv_heads, head_dim, dtype)


def page_slots(page_table: jax.Array, positions: jax.Array, keep: jax.Array, page_size: int
               ) -> tuple[jax.Array, jax.Array]:
    """The (page, offset) of each of ``positions [batch, n]`` through ``page_table [batch, max_pages]``;
    positions where ``keep [batch, n]`` is False, or past the table, go to ``NULL_PAGE``."""
    index = positions // page_size
    inside = keep & (index < page_table.shape[1]) & (positions >= 0)
    page = jnp.take_along_axis(page_table, jnp.clip(index, 0, page_table.shape[1] - 1), axis=1)
    return jnp.where(inside, page, NULL_PAGE), positions % page_size


def gather_positions(pool: jax.Array, page_table: jax.Array, starts: jax.Array, n: int) -> jax.Array:
    """Each row's positions ``starts [batch] + 0 .. n - 1`` of ``pool [pages, page_size, kv_heads,
    head_dim]`` through ``page_table [batch, max_pages]`` -> ``[batch, n, kv_heads, head_dim]`` (positions
    past the table read the null page): ``scatter_positions``' inverse."""
    positions = starts[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    page, offset = page_slots(page_table, positions, jnp.ones(positions.shape, bool), pool.shape[1])
    return pool[page, offset]


def copy_positions(pool: jax.Array, source_table: jax.Array, target_table: jax.Array, starts: jax.Array,
                   keep: jax.Array) -> jax.Array:
    """Each row's positions ``starts [batch] + j`` (where ``keep [batch, n]``) copied from its pages in
    ``source_table [batch, max_pages]`` to its pages in ``target_table``; a position whose page is the
    same in both is left as it is."""
    n = keep.shape[1]
    positions = starts[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    page_size = pool.shape[1]
    source_page, _ = page_slots(source_table, positions, keep, page_size)
    target_page, _ = page_slots(target_table, positions, keep, page_size)
    values = gather_positions(pool, source_table, starts, n)
    return scatter_positions(pool, target_table, values, starts, keep & (source_page != target_page))


def scatter_positions(pool: jax.Array, page_table: jax.Array, values: jax.Array, starts: jax.Array,
                      keep: jax.Array) -> jax.Array:
    """Writes ``values [batch, n, kv_heads, head_dim]`` at each row's positions ``starts [batch] + 0 ..
    n - 1`` of ``pool [pages, page_size, kv_heads, head_dim]``, where ``keep [batch, n]``; the other
    slots write into ``NULL_PAGE``."""
    n = values.shape[1]
    positions = starts[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    page, offset = page_slots(page_table, positions, keep, pool.shape[1])
    return pool.at[page, offset].set(values.astype(pool.dtype))
