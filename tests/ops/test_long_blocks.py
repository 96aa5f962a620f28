"""A long causal block over a cache (a prefill suffix or chunk over a cached prefix) attended as
sub-blocks over the caches it was first written into (``attention.written_block_attention``, what a GPU
runs where the block-attention kernel cannot hold the block in one program) equals the block attended at
once, to float32 rounding: rows of different contexts and valid lengths (one ending inside a sub-block,
one with no context), a block that is not a whole number of sub-blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops import attention as attention_ops
from dflash_jax.ops.cache import write_rows
from dflash_jax.ops.config import XLA, OpsConfig

KV, HEADS, DIM, CAPACITY = 2, 4, 16, 96


@pytest.mark.parametrize("ops", [XLA, OpsConfig(attention="pallas")], ids=["xla", "kernel"])
def test_written_sub_blocks_equal_one_block(ops):
    rng = np.random.default_rng(0)
    batch, block = 3, 40
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((batch, CAPACITY, KV, DIM)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch, 1, block, HEADS, DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, 1, block, KV, DIM)), jnp.float32) for _ in range(2))
    starts = jnp.asarray([50, 7, 0], jnp.int32)
    blk_lens = jnp.asarray([40, 21, 33], jnp.int32)
    want, k_want, v_want = attention_ops.attend_and_write(q, k, v, starts, k_cache, v_cache, blk_lens, causal=True,
                                                          write=True, ops=XLA)
    k_written, v_written = write_rows(k_cache, k[:, 0], starts), write_rows(v_cache, v[:, 0], starts)
    got = jax.jit(lambda *a: attention_ops.written_block_attention(*a, sub_block=16, ops=ops))(
        q, k, v, starts, k_written, v_written, blk_lens)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(k_written, k_want)
    np.testing.assert_array_equal(v_written, v_want)


def test_attend_and_write_takes_sub_blocks_where_the_kernel_cannot_hold_the_block(monkeypatch):
    """With the kernels on, a written causal block longer than a sub-block that the Triton kernel does not
    hold (``triton_block_kernel_fits`` False, as for 128 slots and up on a GPU) runs as written sub-blocks;
    the result is the block's attention and the caches hold its K/V."""
    rng = np.random.default_rng(1)
    batch, block = 2, 32
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((batch, CAPACITY, KV, DIM)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch, 1, block, HEADS, DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, 1, block, KV, DIM)), jnp.float32) for _ in range(2))
    starts, blk_lens = jnp.asarray([60, 3], jnp.int32), jnp.asarray([32, 17], jnp.int32)
    calls = []
    sub_blocks = attention_ops.written_block_attention
    monkeypatch.setattr(attention_ops, "triton_block_kernel_fits", lambda *a: False)
    monkeypatch.setattr(attention_ops, "written_block_attention",
                        lambda *a, **kw: calls.append(1) or sub_blocks(*a, **kw))
    got = attention_ops.attend_and_write(q, k, v, starts, k_cache, v_cache, blk_lens, causal=True, write=True,
                                         ops=OpsConfig(attention="pallas"))
    want = attention_ops.attend_and_write(q, k, v, starts, k_cache, v_cache, blk_lens, causal=True, write=True, ops=XLA)
    assert calls
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-5)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("ops", [XLA, OpsConfig(attention="pallas")], ids=["xla", "kernel"])
def test_a_long_block_through_page_tables_equals_the_contiguous_cache(monkeypatch, ops):
    """A prefill suffix over a cached prefix on paged caches (``runtime.paged.prefill``): the block is written
    into the rows' pages (shuffled over the pool) and, where the kernel cannot hold it, attended as 16-slot
    sub-blocks through the tables (``triton_block_kernel_fits`` as on a GPU: sub-blocks fit, the block does
    not), each sub-block a row of the kernel over its row's table: the kernel reads the pages, nothing is
    gathered. The same attention as the contiguous cache's, and the pool holds the block's K/V."""
    from dflash_jax.ops.paged_cache import PagedKV, gather_pages, scatter_positions

    monkeypatch.setattr(attention_ops, "triton_block_kernel_fits", lambda q_shape, *a: q_shape[2] <= 16)
    if ops.kernels:
        monkeypatch.setattr(PagedKV, "gather", lambda self: pytest.fail("the kernel path gathered the pages"))
    rng = np.random.default_rng(2)
    batch, block, page = 2, 40, 8
    pages = CAPACITY // page
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((batch, CAPACITY, KV, DIM)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch, 1, block, HEADS, DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, 1, block, KV, DIM)), jnp.float32) for _ in range(2))
    starts, blk_lens = jnp.asarray([48, 8], jnp.int32), jnp.asarray([40, 29], jnp.int32)
    table = jnp.asarray(1 + rng.permutation(batch * pages).reshape(batch, pages), jnp.int32)  # page 0: the null page
    everything = jnp.ones((batch, CAPACITY), bool)

    def pooled(cache):
        pool = jnp.zeros((1 + batch * pages, page, KV, DIM), jnp.float32)
        return PagedKV(scatter_positions(pool, table, cache, jnp.zeros((batch,), jnp.int32), everything), table,
                       jnp.ones((batch,), bool), pages)

    want, k_want, v_want = attention_ops.attend_and_write(q, k, v, starts, k_cache, v_cache, blk_lens, causal=True,
                                                          write=True, ops=XLA)
    got, k_got, v_got = jax.jit(lambda *a: attention_ops.attend_and_write(*a, causal=True, write=True, ops=ops))(
        q, k, v, starts, pooled(k_cache), pooled(v_cache), blk_lens)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(gather_pages(k_got.pool, table, pages), k_want)
    np.testing.assert_array_equal(gather_pages(v_got.pool, table, pages), v_want)
