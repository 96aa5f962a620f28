"""The fused cached-attention kernel on paged caches (its ``page_table`` mode, interpret mode on the CPU)
equals the same kernel on the contiguous caches the pages stand for (to float32 rounding; the written
K/V bit for bit): random page tables
(pages shuffled over the pool), rows of different lengths, a block crossing a page boundary, a done row
(its block written into the null page), pages of 16 and 64 positions (a 64-key tile over four pages, or
a page over several tiles), a table wider than the pages a step reads. And the paged kernel lowers to
Triton IR for CUDA at Qwen3-8B shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops.cache import read_rows
from dflash_jax.ops.paged_cache import NULL_PAGE, PagedKV
from kernels_pallas.block_attention.gpu import GpuConfig
from kernels_pallas.cached_attention import cached_block_attention
from lowering import lower_for

KV, GROUPS, DIM = 2, 2, 32


def paged_case(page_size: int, read_pages: int, block: int, seed: int):
    """Pools with three rows' pages shuffled over them (page 0 the null page, a table two pages wider than
    the pages read), the rows' starts (one whose block crosses a page boundary, one with no context)
    and block lengths, the last row done, and the block's raw projection and norms."""
    rng = np.random.default_rng(seed)
    batch, max_pages = 3, read_pages + 2
    pages = 1 + batch * max_pages + 3  # a few pages no row owns
    table = rng.permutation(np.arange(1, pages))[:batch * max_pages].reshape(batch, max_pages)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((pages, page_size, KV, DIM)), jnp.float32) for _ in range(2))
    capacity = read_pages * page_size
    starts = jnp.asarray([page_size - block // 2 - 1 if block > 1 else capacity - 1, capacity - block, 0], jnp.int32)
    blk_lens = jnp.asarray([block, max(block - 1, 1), block], jnp.int32)
    writable = jnp.asarray([True, True, False])
    qkv = jnp.asarray(rng.standard_normal((batch, block, KV, GROUPS + 2, DIM)), jnp.float32)
    norms = tuple(jnp.asarray(1 + 0.2 * rng.standard_normal(DIM), jnp.float32) for _ in range(2))
    inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(0, DIM, 2) / DIM), jnp.float32)
    k_cache = PagedKV(k_pool, jnp.asarray(table, jnp.int32), writable, read_pages)
    v_cache = PagedKV(v_pool, k_cache.page_table, writable, read_pages)
    return qkv, k_cache, v_cache, starts, blk_lens, norms, inv_freq


@pytest.mark.parametrize("mode", ["verify", "draft"])
@pytest.mark.parametrize("page_size,read_pages,block,splits", [
    (16, 8, 1, None), (16, 8, 4, 3), (64, 3, 4, None), (64, 2, 1, 2), (16, 5, 16, None), (128, 2, 4, 2),
    (24, 4, 1, None)],
    ids=["p16-token", "p16-block-splits", "p64-block", "p64-token-splits", "p16-verify16", "p128-two-tiles-a-page",
         "p24-tiles-across-pages"])
def test_paged_kernel_equals_the_contiguous_kernel(page_size, read_pages, block, splits, mode):
    qkv, k_cache, v_cache, starts, blk_lens, (q_norm, k_norm), inv_freq = paged_case(
        page_size, read_pages, block, seed=page_size + block)
    causal = write = mode == "verify"
    config = GpuConfig(num_splits=splits)
    kw = dict(eps=1e-6, qk_norm=True, causal=causal, write=write, config=config)

    @jax.jit
    def paged(qkv, k_pool, v_pool, starts, blk_lens):
        k, v = (PagedKV(p, k_cache.page_table, k_cache.writable, read_pages) for p in (k_pool, v_pool))
        return cached_block_attention(qkv, k_pool, v_pool, starts, blk_lens, q_norm, k_norm, inv_freq, **kw,
                                      page_table=k.page_table, read_pages=read_pages,
                                      write_rows=k.pool_rows(starts, qkv.shape[1]) if write else None)

    @jax.jit
    def contiguous(qkv, k, v, starts, blk_lens):
        return cached_block_attention(qkv, k, v, starts, blk_lens, q_norm, k_norm, inv_freq, **kw)

    got, k_pool, v_pool = paged(qkv, k_cache.pool, v_cache.pool, starts, blk_lens)
    want, k_view, v_view = contiguous(qkv, k_cache.gather(), v_cache.gather(), starts, blk_lens)
    # to float32 rounding: interpreted on the CPU, XLA may fuse a gathered tile's dots differently
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # the pools: the contiguous kernel's block written through the table, every other page untouched
    # (the null page takes the done row's block: its contents are no row's)
    for pool, cache, view in ((k_pool, k_cache, k_view), (v_pool, v_cache, v_view)):
        expected = cache.write_rows(read_rows(view, starts, block), starts).pool if write else cache.pool
        owned = np.arange(pool.shape[0]) != NULL_PAGE
        np.testing.assert_array_equal(np.asarray(pool)[owned], np.asarray(expected)[owned])


def test_paged_kernel_refuses_a_write_without_its_rows():
    qkv, k_cache, v_cache, starts, blk_lens, (q_norm, k_norm), inv_freq = paged_case(16, 4, 1, seed=0)
    with pytest.raises(ValueError, match="write_rows"):
        cached_block_attention(qkv, k_cache.pool, v_cache.pool, starts, blk_lens, q_norm, k_norm, inv_freq, eps=1e-6,
                               qk_norm=True, page_table=k_cache.page_table, read_pages=4)


@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_paged_kernel_lowers_for_gpus(page_size):
    """Triton IR for cuda, built on this CPU: Qwen3-8B heads in bf16, a decode token and a verify block
    (stacked members), written through the table, over 1,152 positions of pages."""
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    read_pages = 1152 // page_size
    pool = sd((4096, page_size, 8, 128), bf)
    for batch, block in ((1, 1), (16, 16)):
        args = (sd((batch, block, 8, 6, 128), bf), pool, pool, sd((batch,), jnp.int32), sd((batch,), jnp.int32),
                sd((128,), bf), sd((128,), bf), sd((64,), jnp.float32), sd((batch, read_pages + 8), jnp.int32),
                sd((batch, block), jnp.int32))

        def fn(qkv, k, v, starts, blk_lens, q_norm, k_norm, inv_freq, table, rows):
            return cached_block_attention(qkv, k, v, starts, blk_lens, q_norm, k_norm, inv_freq, eps=1e-6,
                                          qk_norm=True, interpret=False, page_table=table, read_pages=read_pages,
                                          write_rows=rows)

        text = lower_for(jax.jit(fn), args, "cuda").as_text()
        assert "dflash_cached_attention" in text and "triton" in text
