"""The page allocator and prefix cache (``runtime.pages``) and the paged cache ops (``ops.paged_cache``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops.cache import read_rows, write_rows
from dflash_jax.ops.paged_cache import (NULL_PAGE, PagedKV, copy_positions, gather_pages, gather_positions, page_pools,
                                        scatter_positions)
from dflash_jax.runtime.pages import PageAllocator


def test_pages_are_taken_and_given_back_with_reference_counts():
    pages = PageAllocator(num_pages=9, page_size=4, prefix_cache=False)
    assert pages.total == 8 and pages.all_free()
    a = pages.allocate(list(range(6)), positions=10)  # 3 pages
    b = pages.allocate(list(range(6)), positions=16)  # 4 pages: no prefix cache, nothing shared
    assert len(a.pages) == 3 and len(b.pages) == 4 and a.cached_tokens == b.cached_tokens == 0
    assert NULL_PAGE not in a.pages + b.pages and not set(a.pages) & set(b.pages)
    assert pages.allocate([1, 2], positions=8) is None  # 2 pages, 1 left: nothing is taken
    assert pages.available == 1
    pages.release(a.pages)
    pages.release(b.pages)
    assert pages.all_free()
    with pytest.raises(ValueError, match="released more often"):
        pages.release(a.pages[:1])


def test_prefix_hits_share_full_pages_and_leave_a_token_to_compute():
    pages = PageAllocator(num_pages=32, page_size=4)
    prompt = list(range(100, 111))  # 11 tokens: 2 full pages
    first = pages.allocate(prompt, positions=16)
    pages.register(prompt, first.pages)
    # the same prompt: both full pages, 3 tokens left to compute
    again = pages.allocate(prompt, positions=20)
    assert again.cached_tokens == 8 and again.pages[:2] == first.pages[:2]
    assert again.pages[2:] and not set(again.pages[2:]) & set(first.pages)
    # a prefix ending inside a page: only the full pages before it
    inside = pages.allocate(prompt[:6] + [1, 2, 3], positions=12)
    assert inside.cached_tokens == 4 and inside.pages[0] == first.pages[0]
    # a prompt that is exactly the cached pages: its last page is computed again
    exact = pages.allocate(prompt[:8], positions=12)
    assert exact.cached_tokens == 4
    # another first page: no hit (the chain keys a page by every token before it)
    assert pages.allocate([0] + prompt[1:], positions=12).cached_tokens == 0
    for grant in (first, again, inside, exact):
        pages.release(grant.pages)
    assert pages.stats().prefix_hits == 8 + 4 + 4


def test_unreferenced_cached_pages_are_evicted_least_recently_used_first():
    pages = PageAllocator(num_pages=5, page_size=2)  # 4 pages
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    a = pages.allocate(old + [0], positions=6)  # 3 pages
    pages.register(old, a.pages)
    pages.release(a.pages)
    b = pages.allocate(new + [0], positions=6)  # 3 pages: the two free ones, then the LRU cached one
    pages.register(new, b.pages)
    # ``old``'s second page went (a prefix's later pages are evicted before the ones they extend)
    assert a.pages[1] in b.pages and a.pages[0] not in b.pages
    hit = pages.cached_prefix(old + [9])
    assert len(hit) == 1 and hit[0] == a.pages[0]
    pages.release(b.pages)
    assert pages.all_free()


def test_requests_grow_their_pages_and_admissions_leave_room_for_growth():
    pages = PageAllocator(num_pages=7, page_size=4, prefix_cache=False)  # 6 pages
    a = pages.allocate([1, 2, 3, 4, 5], positions=8)  # 2 pages: the prompt and a first stretch
    assert pages.allocate([9], positions=4, keep=4) is None  # 1 page, but the running rows need 4 more
    assert pages.grow(a.pages, 20) and len(a.pages) == 5 and pages.available == 1
    assert pages.grow(a.pages, 18) and len(a.pages) == 5  # covered already
    assert not pages.grow(a.pages, 28) and len(a.pages) == 5  # 2 more needed, 1 left: nothing is taken
    assert len(set(a.pages)) == 5 and 0 not in a.pages
    pages.release(a.pages)
    assert pages.all_free()


def test_a_cached_page_held_by_a_request_is_never_evicted():
    pages = PageAllocator(num_pages=4, page_size=2)  # 3 pages
    a = pages.allocate([1, 2, 3], positions=4)
    pages.register([1, 2, 3], a.pages)
    assert pages.allocate([7, 7, 7], positions=4) is None  # 1 free page, 2 needed; a's are held
    pages.release(a.pages)
    b = pages.allocate([7, 7, 7], positions=6)  # now the cached ones may go
    assert b is not None and len(b.pages) == 3
    assert pages.cached_prefix([1, 2, 3]) == []


def _contiguous(rng, batch, length, kv, dim):
    return jnp.asarray(rng.standard_normal((batch, length, kv, dim)), jnp.float32)


def test_paged_view_and_scatter_equal_the_contiguous_cache():
    rng = np.random.default_rng(0)
    batch, page_size, max_pages, kv, dim = 3, 4, 5, 2, 8
    cache = _contiguous(rng, batch, page_size * max_pages, kv, dim)
    # rows' pages scattered over the pool, out of order; page 0 is the null page
    order = rng.permutation(np.arange(1, 1 + batch * max_pages))
    table = jnp.asarray(order.reshape(batch, max_pages), jnp.int32)
    pools = page_pools(1, 1 + batch * max_pages, page_size, kv, dim, jnp.float32)
    everything = jnp.ones((batch, page_size * max_pages), bool)
    pool = scatter_positions(pools.k[0], table, cache, jnp.zeros((batch,), jnp.int32), everything)
    np.testing.assert_array_equal(gather_pages(pool, table, max_pages), cache)
    np.testing.assert_array_equal(gather_pages(pool, table, 2), cache[:, :8])
    # positions read back through the table at per-row starts, across page boundaries
    reads = jnp.asarray([0, 6, 13], jnp.int32)
    np.testing.assert_array_equal(gather_positions(pool, table, reads, 5),
                                  np.stack([cache[b, s:s + 5] for b, s in enumerate([0, 6, 13])]))

    # a block written through the table at per-row starts lands in the pages; a done row writes nothing
    starts = jnp.asarray([3, 9, 14], jnp.int32)
    block = _contiguous(rng, batch, 5, kv, dim)
    paged = PagedKV(pool, table, jnp.asarray([True, True, False]), max_pages)
    assert paged.shape == cache.shape and paged.dtype == cache.dtype
    np.testing.assert_array_equal(paged.gather(), cache)
    after = write_rows(paged, block, starts).gather()
    want = write_rows(cache, block, starts)
    np.testing.assert_array_equal(after[:2], want[:2])
    np.testing.assert_array_equal(after[2], cache[2])
    np.testing.assert_array_equal(read_rows(after, starts, 5)[:2], block[:2])


def test_positions_past_a_rows_pages_write_into_the_null_page():
    pool = jnp.zeros((4, 2, 1, 1), jnp.float32)
    table = jnp.asarray([[1, 2, NULL_PAGE]], jnp.int32)  # two pages, then none
    values = jnp.arange(1.0, 9.0).reshape(1, 8, 1, 1)
    out = scatter_positions(pool, table, values, jnp.asarray([0], jnp.int32), jnp.ones((1, 8), bool))
    np.testing.assert_array_equal(out[1:3].reshape(-1), [1, 2, 3, 4])
    np.testing.assert_array_equal(out[3].reshape(-1), [0, 0])  # a page of no row is untouched
    assert jax.tree.leaves(out)[0].shape == pool.shape


def test_positions_are_copied_between_page_tables_and_shared_pages_are_left_alone():
    # Row 0 (a prompt's pass) holds positions 0-7 in pages 1, 2; row 1 shares page 1 and owns page 3.
    pool = jnp.zeros((5, 4, 1, 1), jnp.float32)
    source = jnp.asarray([[1, 2], [1, 2]], jnp.int32)
    values = jnp.arange(1.0, 9.0).reshape(1, 8, 1, 1)
    pool = scatter_positions(pool, source[:1], values, jnp.asarray([0], jnp.int32), jnp.ones((1, 8), bool))
    target = jnp.asarray([[1, 2], [1, 3]], jnp.int32)
    starts = jnp.asarray([4, 4], jnp.int32)
    keep = jnp.asarray([[True] * 4, [True, True, True, False]])  # row 1's last position is past its prompt
    shared = pool.at[1].set(-1.0)  # a write into a page both tables name would show here
    out = copy_positions(shared, source, target, starts, keep)
    np.testing.assert_array_equal(out[1].reshape(-1), [-1] * 4)
    np.testing.assert_array_equal(out[2].reshape(-1), [5, 6, 7, 8])  # row 0: the same page, unchanged
    np.testing.assert_array_equal(out[3].reshape(-1), [5, 6, 7, 0])  # row 1: its own page, 3 positions
    np.testing.assert_array_equal(out[4].reshape(-1), [0] * 4)
