"""The device phases of a paged engine (``EngineConfig.page_size > 0``): a running state whose caches are
page pools shared by all rows (``dflash_jax.ops.paged_cache``), with a page table per row.

- ``empty_state``: row slots as ``decoding.empty_state``'s, the pools, and page tables of null pages.
- ``prefill``: the new prompts. Without a cached prefix in the group it is ``decoding.prefill`` (a
  flash attention over the prompt), the rows' caches holding the prompt's positions. With one, each row
  runs only its uncached suffix as one causal block through its page table (``Target.step`` on the pools
  as ``PagedKV`` layers, as a decode step runs): the attention reads the cached prefix from its pages, the
  suffix's K/V and the drafter's projection of its taps are written into the row's own pages, and the
  pools are returned in place (donated). The first token and the rows' other arrays come from the same
  ``decoding.prompt_rows`` either way.
- ``admit``: the rows into free slots, their page tables beside them, the positions a prefill without a
  cached prefix computed scattered into their pages (never into a cached prefix's page: those are
  read-only).
- ``set_page_rows``: new page tables for running rows (pages a row got as it advanced).
- ``resize``: the rows (with their page tables) into a state of another row count; the pools move as
  they are.
- ``step``: a decode step of the unchanged contiguous code, its caches the pools as ``PagedKV`` layers:
  each attention reads the rows' pages through their tables (the fused Triton cached attention and the
  Mosaic GPU block attention load the pages the table names, the fused kernel also storing the verify
  block into them; the XLA reference and the other kernels gather the rows' pages of that one layer
  inside the op), and the other block K/V (the unfused paths' verify block, the drafter's context) are
  scattered into the rows' pages; done rows write into the null page. No step copies the state's
  caches as a whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target
from dflash_jax.ops.cache import KVCache, read_rows
from dflash_jax.ops.config import XLA, OpsConfig
from dflash_jax.ops.paged_cache import copy_positions, layer_pools, page_pools, paged_layers, scatter_positions
from dflash_jax.runtime import decoding
from dflash_jax.runtime.decoding import DecodeState


def new_pools(target: Target, drafter: Drafter | None, pages: int, page_size: int) -> tuple[KVCache, KVCache | None]:
    """Zeroed target and drafter-context page pools (no drafter: no context pool)."""
    tc = target.config
    target_pools = page_pools(tc.num_layers, pages, page_size, tc.num_kv_heads, tc.head_dim,
                              target.embed_tokens.dtype)
    if drafter is None:
        return target_pools, None
    dc = drafter.config
    return target_pools, page_pools(dc.num_layers, pages, page_size, dc.num_kv_heads, dc.head_dim, drafter.dtype)


def _without_caches(state: DecodeState) -> DecodeState:
    return dataclasses.replace(state, target_cache=None, draft_cache=None, page_table=None)


def empty_state(target: Target, drafter: Drafter | None, rows: int, *, pages: int, page_size: int,
                max_pages: int, capacity: int, max_steps: int, n_stop: int,
                max_logprobs: int | None = None) -> DecodeState:
    """``rows`` free slots over zeroed pools of ``pages`` pages; every table entry the null page."""
    # The per-row caches ``decoding.empty_state`` builds are dropped: unused under jit, never allocated.
    state = decoding.empty_state(target, drafter, rows, capacity=capacity, max_steps=max_steps, n_stop=n_stop,
                                 max_logprobs=max_logprobs)
    target_pools, draft_pools = new_pools(target, drafter, pages, page_size)
    return dataclasses.replace(state, target_cache=target_pools, draft_cache=draft_pools,
                               page_table=jnp.zeros((rows, max_pages), jnp.int32))


def prefill(
    target: Target, drafter: Drafter | None, state: DecodeState, page_rows: jax.Array, ids: jax.Array,
    lens: jax.Array, cached: jax.Array, max_lens: jax.Array, stop_ids: jax.Array, *, suffix: int,
    context_pages: int, capacity: int, max_steps: int, mask_token_id: int, ops: OpsConfig = XLA,
    sampling: dict[str, jax.Array] | None = None, max_logprobs: int = 0, source: jax.Array | None = None,
    row_cached: jax.Array | None = None, row_pages: jax.Array | None = None, prompt_logprobs: jax.Array | None = None,
) -> tuple[DecodeState, DecodeState, jax.Array]:
    """The prompts ``ids [rows, P]`` (lengths ``lens``), of which the first ``cached [rows]`` positions are
    in the pages ``page_rows [rows, max_pages]`` of ``state``'s pools (a multiple of the page size,
    ``< lens``). ``suffix``: a static length covering every ``lens - cached``; ``context_pages``: a static
    page count covering every ``cached`` (0: nothing cached, a plain ``decoding.prefill``).

    Returns ``(rows, state, last_logits)``, the rows with their greedy first token as ``decoding.prefill_pass``
    gives them (``decoding.draw_first`` redraws sampled rows'). With nothing cached, the rows are
    ``decoding.prefill_pass``'s, their caches
    holding all P prompt positions (``admit`` scatters them into their pages), and ``state`` is unchanged.
    Over a cached prefix, each prompt's suffix runs as one causal block through the page tables: it reads
    the prefix from the pages and writes its own K/V (and the drafter's context K/V) into the prompt's
    pages from ``cached`` on, in ``state``'s pools, which are returned; the rows carry no caches.

    ``source [out rows]``: rows sharing a prompt, as in ``decoding.prefill`` (``ids``, ``lens``, ``cached``
    and ``page_rows`` are the distinct prompts'); row r's caches then hold the positions from its own
    ``row_cached [out rows]`` on (``>= cached[source[r]]``: a row that shares its prompt's pages up to there
    has only the rest to hold). Over a cached prefix those positions are copied from the prompt's pages into
    the row's own, ``row_pages [out rows, max_pages]``. ``prompt_logprobs [out rows]``: as in
    ``decoding.prefill``, for the positions this pass computes (a row asking for them has nothing cached)."""
    common = dict(capacity=capacity, max_steps=max_steps, mask_token_id=mask_token_id, sampling=sampling,
                  max_logprobs=max_logprobs)
    if context_pages == 0:
        rows, last_logits = decoding.prefill_pass(target, drafter, ids, lens, max_lens, stop_ids, ops=ops,
                                                  source=source, prompt_logprobs=prompt_logprobs, **common)
        if source is None:
            return rows, state, last_logits
        plen = ids.shape[1]
        return dataclasses.replace(rows, target_cache=_positions_from(rows.target_cache, row_cached, plen),
                                   draft_cache=_positions_from(rows.draft_cache, row_cached, plen)), state, last_logits
    batch, plen = ids.shape
    page_size = state.target_cache.k[0].shape[1]
    offsets = jnp.arange(suffix, dtype=jnp.int32)[None, :]
    positions = cached[:, None] + offsets
    suffix_ids = jnp.take_along_axis(ids, jnp.clip(positions, 0, plen - 1), axis=1)
    suffix_lens = (lens - cached).astype(jnp.int32)
    computed = offsets < suffix_lens[:, None]

    # The suffix's positions are past the cached prefix's pages (read-only, shared): in the prompt's own.
    # Its slots past the prompt write into the prompt's later pages or the null page, where no read looks.
    read_pages = min(context_pages + -(-suffix // page_size), page_rows.shape[1])
    writable = jnp.ones((batch,), bool)
    tap_layers = drafter.config.target_layer_ids if drafter is not None else ()
    hidden, taps, target_cache = target.step(
        suffix_ids, cached, paged_layers(state.target_cache, page_rows, writable, read_pages),
        blk_lens=suffix_lens, tap_layers=tap_layers, ops=ops)
    target_pools, draft_pools = layer_pools(target_cache), state.draft_cache
    if drafter is not None:
        k, v = drafter.context_kv(taps, positions)
        put = lambda pools, xs: tuple(scatter_positions(p, page_rows, x, cached, computed)  # noqa: E731
                                      for p, x in zip(pools, xs))
        draft_pools = KVCache(put(draft_pools.k, k), put(draft_pools.v, v))
    last = jnp.take_along_axis(hidden, (suffix_lens - 1)[:, None, None], axis=1)[:, 0]
    entries = None
    if prompt_logprobs is not None:
        entries = decoding.prompt_entries(target, hidden, suffix_ids, jnp.any(prompt_logprobs), max_logprobs)
    first = cached
    if source is not None:
        # The distinct prompts' pass, for the rows sharing each: a row's positions from its own
        # ``row_cached`` on copied from its prompt's pages into its own.
        first = cached[source]
        last, ids, lens, entries = jax.tree.map(lambda x: x[source], (last, ids, lens, entries))
        keep = row_cached[:, None] + offsets < lens[:, None]

        def copy(pools: KVCache | None) -> KVCache | None:
            if pools is None:
                return None
            move = lambda p: copy_positions(p, page_rows[source], row_pages, row_cached, keep)  # noqa: E731
            return KVCache(tuple(move(p) for p in pools.k), tuple(move(p) for p in pools.v))

        target_pools, draft_pools = copy(target_pools), copy(draft_pools)
    last_logits = target.head(last)
    rows = decoding.prompt_rows(last_logits, ids, lens, max_lens, stop_ids, **common)
    rows = dataclasses.replace(rows, target_cache=None, draft_cache=None)
    if entries is not None:
        rows = decoding.record_prompt_logprobs(rows, entries, first, prompt_logprobs)
    return rows, dataclasses.replace(state, target_cache=target_pools, draft_cache=draft_pools), last_logits


def _positions_from(cache: KVCache | None, starts: jax.Array, n: int) -> KVCache | None:
    """Positions ``starts [rows] + j`` (j < n) of every layer of a per-row ``cache``; zeros past its end."""
    if cache is None:
        return None
    pad = ((0, 0), (0, n), (0, 0), (0, 0))
    return KVCache(tuple(read_rows(jnp.pad(x, pad), starts, n) for x in cache.k),
                   tuple(read_rows(jnp.pad(x, pad), starts, n) for x in cache.v))


def admit(state: DecodeState, rows: DecodeState, slots: jax.Array, page_rows: jax.Array,
          cache_from: jax.Array) -> DecodeState:
    """Writes prefilled ``rows`` into ``slots`` of the paged ``state`` (``decoding.scatter_rows``; slots out
    of range drop their row), with their page tables ``page_rows [rows, max_pages]``, and scatters
    each row's cache positions ``cache_from [rows] + j`` (prompt positions only) into its pages."""
    merged = decoding.scatter_rows(_without_caches(state), _without_caches(rows), slots)
    merged = dataclasses.replace(merged, target_cache=state.target_cache, draft_cache=state.draft_cache,
                                 page_table=state.page_table.at[slots].set(page_rows, mode="drop"))
    return write_pages(merged, rows, page_rows, cache_from, (slots >= 0) & (slots < state.starts.shape[0]))


def write_pages(state: DecodeState, rows: DecodeState, page_rows: jax.Array, cache_from: jax.Array,
                written: jax.Array) -> DecodeState:
    """Scatters the cache positions ``cache_from [rows] + j`` (prompt positions only) of prefilled ``rows``
    into their pages ``page_rows [rows, max_pages]`` of ``state``'s pools, for the rows where ``written
    [rows]``; the rest of ``state`` is unchanged (a chunk of a prompt: its row is admitted later). Rows
    without caches (a prefill over a cached prefix wrote its positions into the pages itself) write nothing."""
    if rows.target_cache is None:
        return state
    n = rows.target_cache.capacity
    keep = written[:, None] & (jnp.arange(n)[None, :] < (rows.starts - cache_from)[:, None])

    def put(pools: KVCache | None, cache: KVCache | None) -> KVCache | None:
        if pools is None:
            return None
        return KVCache(tuple(scatter_positions(p, page_rows, c, cache_from, keep) for p, c in zip(pools.k, cache.k)),
                       tuple(scatter_positions(p, page_rows, c, cache_from, keep) for p, c in zip(pools.v, cache.v)))

    return dataclasses.replace(state, target_cache=put(state.target_cache, rows.target_cache),
                               draft_cache=put(state.draft_cache, rows.draft_cache))


def set_page_rows(state: DecodeState, slots: jax.Array, page_rows: jax.Array) -> DecodeState:
    """The page tables of rows ``slots [n]`` set to ``page_rows [n, max_pages]`` (rows that got pages as
    they advanced; slots out of range are dropped)."""
    return dataclasses.replace(state, page_table=state.page_table.at[slots].set(page_rows, mode="drop"))


def resize(empty: DecodeState, state: DecodeState, slots: jax.Array) -> DecodeState:
    """Row ``i`` of ``state`` (its page table with it) into row ``slots[i]`` of ``empty``, a state of
    another row count without caches; the pools are ``state``'s."""
    moved = decoding.scatter_rows(empty, dataclasses.replace(state, target_cache=None, draft_cache=None), slots)
    return dataclasses.replace(moved, target_cache=state.target_cache, draft_cache=state.draft_cache)


def step(contiguous_step: Callable[[DecodeState], DecodeState | tuple[DecodeState, Any]], state: DecodeState, *,
         read_pages: int) -> DecodeState | tuple[DecodeState, Any]:
    """``contiguous_step`` (a decode step's code, written for per-row caches) on the pools themselves:
    every layer's cache is a ``PagedKV`` of its pool, the page tables and the rows' first ``read_pages``
    pages (covering every live row's positions and its block), so the attention reads through the
    tables and the block's K/V are scattered into the rows' pages; rows that were done write into the
    null page. A step returning ``(state, extra)`` returns ``(paged state, extra)``."""
    table, writable = state.page_table, ~state.done

    def paged(pools: KVCache | None) -> KVCache | None:
        return None if pools is None else paged_layers(pools, table, writable, read_pages)

    out = contiguous_step(dataclasses.replace(state, target_cache=paged(state.target_cache),
                                              draft_cache=paged(state.draft_cache), page_table=None))
    new, extra = out if isinstance(out, tuple) else (out, None)
    new = dataclasses.replace(new, target_cache=layer_pools(new.target_cache),
                              draft_cache=None if new.draft_cache is None else layer_pools(new.draft_cache),
                              page_table=table)
    return (new, extra) if isinstance(out, tuple) else new


def extend_context(drafter: Drafter, state: DecodeState, taps: jax.Array, starts: jax.Array, count: jax.Array
                   ) -> DecodeState:
    """``decoding.extend_context`` into the drafter's context pool: the deferred positions ``starts + j``
    (``j < count``) through each row's page table."""
    k, v, keep = decoding.deferred_context(drafter, taps, starts, count)
    pools, table = state.draft_cache, state.page_table
    return dataclasses.replace(state, draft_cache=KVCache(
        tuple(scatter_positions(p, table, x, starts, keep) for p, x in zip(pools.k, k)),
        tuple(scatter_positions(p, table, x, starts, keep) for p, x in zip(pools.v, v))))
