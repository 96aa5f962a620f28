"""The online-softmax (flash) pieces shared by the GPU kernels, and their split-K merge."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._common import NEG, next_pow2

MMA_MIN = 16  # Triton's dot takes operands of >= 16 rows, columns and contraction length


def nt_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [M, D] @ b [N, D].T`` with float32 accumulation (IEEE float32 for float32 inputs).

    ``N == 1`` (a single key) is a broadcast product summed in float32, not a ``tl.dot``.
    """
    if b.shape[0] == 1:
        return jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32), axis=1, keepdims=True)
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def nn_dot(p: jax.Array, v: jax.Array) -> jax.Array:
    """``p [M, K] @ v [K, D]`` with float32 accumulation; ``K == 1`` is a broadcast product."""
    if p.shape[1] == 1:
        return p.astype(jnp.float32) * v.astype(jnp.float32)
    return lax.dot_general(p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def online_update(carry, s: jax.Array, valid: jax.Array, v: jax.Array, scale: float):
    """One flash step: unscaled scores ``s [R, K]`` f32, ``valid`` broadcastable to ``[R, K]``,
    values ``v [K, D]``; ``carry = (acc [R, D] f32, m [R], l [R])``."""
    acc, m, l = carry
    s = jnp.where(valid, s * scale, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + nn_dot(p.astype(v.dtype), v)
    return acc, m_new, l_new


def merge_splits(o: jax.Array, m: jax.Array, l: jax.Array, axis: int):
    """Merges split-K partials: ``o [..., S, ..., D]`` float32 outputs normalised per split, their
    running max ``m`` and sum ``l`` (``o`` without its last axis), split axis ``axis``.

    Returns ``(o, m, l)`` of the whole context, the split axis removed: the log-sum-exp weighted
    mean of the partial outputs (``exp(m_j - max m) * l_j``), in float32.

    Written as elementwise ops over the (few, static) splits rather than reductions over their
    axis: XLA then fuses the whole merge into one kernel, where reductions made it two or three
    (each ~1.3 us per layer at batch 1, docs/performance.md). The normalisation is the last op
    (``sum_j o_j w_j / l``, not ``sum_j o_j (w_j / l)``): with the division inside, XLA split a
    verify block's merge in two kernels (a division, then the sum).
    """
    parts = lambda x: [lax.index_in_dim(x, j, axis, keepdims=False) for j in range(x.shape[axis])]  # noqa: E731
    os, ms, ls = parts(o), parts(m), parts(l)
    m_max = functools.reduce(jnp.maximum, ms)
    ws = [l_j * jnp.exp(m_j - m_max) for m_j, l_j in zip(ms, ls)]
    l_tot = functools.reduce(jnp.add, ws)
    weighted = functools.reduce(jnp.add, [o_j.astype(jnp.float32) * w_j[..., None] for o_j, w_j in zip(os, ws)])
    return weighted / jnp.where(l_tot == 0.0, 1.0, l_tot)[..., None], m_max, l_tot


def split_span(j, splits, context, chunk: int, block_k: int, balanced: bool):
    """Split ``j`` of ``splits`` (program axis 3) of a row's ``context`` keys (dynamic): ``(first, tiles)``,
    its first key and its count of ``block_k``-key tiles. Fixed: the split holds keys ``[j * chunk, (j +
    1) * chunk)`` of the capacity (``chunk``, planned statically), so a context much shorter than the
    capacity falls to the first splits alone. Balanced: the row's own context in whole tiles over the
    splits, so the longest split holds ``ceil(tiles / splits)`` tiles whatever the capacity."""
    if balanced:
        chunk = (context + block_k - 1) // block_k
        chunk = (chunk + splits - 1) // splits * block_k
    first = j * chunk
    keys = jnp.maximum(jnp.minimum(first + chunk, context) - first, 0)
    return first, (keys + block_k - 1) // block_k


MAX_SPLIT_PAGES = 1024  # table entries a split holds in registers (``split_pages``); more: read per tile


def split_pages(table_ref, first, max_keys: int, block_k: int, page_size: int):
    """Before a split's loop over its context tiles: the pool row of the first position of each page
    its keys ``[first, first + max_keys)`` may touch (``first`` a multiple of ``block_k``; ``max_keys``
    the plan's static bound on a split's keys), ``[n]`` int32 from the row's page table ``table_ref
    [max_pages]`` (entries past the table repeat its last page: masked by the caller). None for a
    contiguous cache, or where ``tile_keys`` reads the table per tile.

    Read once here, the table is not loaded inside the loop: a tile's rows then depend on the loop
    index alone, so Triton's pipeliner prefetches the K/V tiles as it does a contiguous cache's. Read
    per tile, each tile's loads waited on its table entries: the paged decode attention took 1.27-1.48x
    the contiguous kernel's time at batch 16-32 (docs/performance.md)."""
    if not page_size:
        return None
    n = next_pow2(-(-max_keys // page_size) + 1)
    if n > MAX_SPLIT_PAGES or (block_k % page_size and page_size % block_k):
        return None
    last = table_ref.shape[0] - 1
    entries = lax.div(first, page_size) + jnp.arange(n, dtype=jnp.int32)
    return table_ref[jnp.minimum(entries, last)] * page_size


def tile_keys(table_ref, pages, first, start, block_k: int, page_size: int):
    """The index of a context tile's ``block_k`` keys from position ``start`` (a multiple of
    ``block_k``) of a split whose keys begin at ``first``: ``pl.ds(start, block_k)`` of a contiguous
    cache, or (``page_size``: the caches are page pools flattened to ``[pages * page_size]`` rows) the
    pool rows ``table[p // page_size] * page_size + p % page_size`` of each position ``p``.

    With the split's ``pages`` (``split_pages``) a tile's page entries are picked from those
    registers: a tile within one page is then one slice of the pool, a tile of whole pages one slice
    per page. Without, each position's entry is read from the row's page table ``table_ref
    [max_pages]`` (positions past the table read its last page: masked by the caller)."""
    if not page_size:
        return pl.ds(start, block_k)
    if pages is not None:
        local = lax.div(start, page_size) - lax.div(first, page_size)  # the tile's first page in the split's
        ids = jnp.arange(pages.shape[0], dtype=jnp.int32)
        entry = lambda i: jnp.sum(jnp.where(ids == local + i, pages, 0))  # noqa: E731
        if page_size % block_k == 0:
            return pl.ds(pl.multiple_of(entry(0) + lax.rem(start, page_size), block_k), block_k)
        offset = jnp.arange(block_k, dtype=jnp.int32)
        rows = entry(0)
        for i in range(1, block_k // page_size):
            rows = jnp.where(offset >= i * page_size, entry(i), rows)
        return rows + lax.rem(offset, page_size)
    position = start + jnp.arange(block_k, dtype=jnp.int32)
    page = table_ref[jnp.minimum(lax.div(position, page_size), table_ref.shape[0] - 1)]
    return page * page_size + lax.rem(position, page_size)


def triton_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as plgpu_triton

    return plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
