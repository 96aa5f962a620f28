"""Attention over a paged cache (``ops.paged_cache.PagedKV``) equals the attention over the contiguous
cache it stands for (its rows' pages gathered), bitwise in float32 on the XLA path, and the block's
K/V land in the rows' pages."""

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops import attention as attention_ops
from dflash_jax.ops.cache import KVCache, read_rows, write_rows
from dflash_jax.ops.config import XLA
from dflash_jax.ops.paged_cache import NULL_PAGE, PagedKV, layer_pools, paged_layers

PAGE, MAX_PAGES, KV, HEADS, DIM = 4, 6, 2, 4, 8


def paged_cache(rng, batch, n_pages=MAX_PAGES, pages=None):
    """A K and V pool with each row's pages shuffled over it (page 0 the null page) and their table."""
    pages = pages or 1 + batch * MAX_PAGES
    table = rng.permutation(np.arange(1, pages))[:batch * MAX_PAGES].reshape(batch, MAX_PAGES)
    k, v = (jnp.asarray(rng.standard_normal((pages, PAGE, KV, DIM)), jnp.float32) for _ in range(2))
    writable = jnp.asarray([True] * (batch - 1) + [False])  # the last row is done
    table = jnp.asarray(table, jnp.int32)
    return PagedKV(k, table, writable, n_pages), PagedKV(v, table, writable, n_pages)


def kernel_case(seed: int, dim: int = 16):
    """A case the kernels take (head_dim 16, interpret mode): pools with three rows' pages shuffled over
    them, their tables, the last row done, a block of 2 slots' raw fused projection per row at starts 3, 9
    and 7, and ``cached_attention``'s other arguments with the kernels on. Returns the generator too."""
    from dflash_jax.ops.config import OpsConfig

    rng = np.random.default_rng(seed)
    batch, block = 3, 2
    pages = 1 + batch * MAX_PAGES
    table = jnp.asarray(rng.permutation(np.arange(1, pages)).reshape(batch, MAX_PAGES), jnp.int32)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((pages, PAGE, KV, dim)), jnp.float32) for _ in range(2))
    writable = jnp.asarray([True, True, False])
    qkv = jnp.asarray(rng.standard_normal((batch, block, KV, HEADS // KV + 2, dim)), jnp.float32)
    starts, blk_lens = jnp.asarray([3, 9, 7], jnp.int32), jnp.asarray([2, 2, 1], jnp.int32)
    norm = jnp.asarray(rng.standard_normal(dim), jnp.float32)
    common = dict(q_norm=norm, k_norm=norm, eps=1e-6, inv_freq=tuple(1.0 / 10000 ** (np.arange(0, dim, 2) / dim)),
                  num_heads=HEADS, ops=OpsConfig(attention="pallas"))
    return rng, table, k_pool, v_pool, writable, qkv, starts, blk_lens, common


@pytest.mark.parametrize("causal,write", [(True, True), (False, False)])
def test_attend_and_write_through_page_tables_equals_the_gathered_cache(causal, write):
    """Rows of different lengths, one whose block crosses a page boundary (start 6, block 3 over pages
    of 4), one done (its writes go to the null page): the attention and the written positions are
    those of the contiguous cache the pages hold."""
    rng = np.random.default_rng(0)
    batch, block = 3, 3
    k_cache, v_cache = paged_cache(rng, batch, n_pages=4)
    starts = jnp.asarray([6, 1, 9], jnp.int32)
    blk_lens = jnp.asarray([3, 2, 3], jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, 1, block, HEADS, DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, 1, block, KV, DIM)), jnp.float32) for _ in range(2))
    kw = dict(causal=causal, write=write, ops=XLA)
    attn, k_paged, v_paged = attention_ops.attend_and_write(q, k, v, starts, k_cache, v_cache, blk_lens, **kw)
    k_view, v_view = k_cache.gather(), v_cache.gather()
    want, k_want, v_want = attention_ops.attend_and_write(q, k, v, starts, k_view, v_view, blk_lens, **kw)
    np.testing.assert_array_equal(attn, want)
    assert isinstance(k_paged, PagedKV) and k_paged.page_table is k_cache.page_table
    np.testing.assert_array_equal(k_paged.gather()[:2], k_want[:2])
    np.testing.assert_array_equal(v_paged.gather()[:2], v_want[:2])
    np.testing.assert_array_equal(k_paged.gather()[2], k_view[2])  # the done row's pages unchanged
    untouched = np.ones(k_cache.pool.shape[0], bool)
    untouched[np.asarray(k_cache.page_table[:2, :4]).ravel()] = False
    untouched[NULL_PAGE] = False
    np.testing.assert_array_equal(k_paged.pool[untouched], k_cache.pool[untouched])


def test_cached_attention_through_page_tables_equals_the_gathered_cache():
    """The target's path from the raw fused projection (q/k norms, RoPE, write, attention), and a
    gpt-oss layer's (attention sinks, a sliding window: the reference), paged == contiguous bitwise."""
    rng = np.random.default_rng(1)
    batch, block = 3, 2
    k_cache, v_cache = paged_cache(rng, batch, n_pages=5)
    starts = jnp.asarray([3, 11, 7], jnp.int32)
    blk_lens = jnp.asarray([2, 2, 1], jnp.int32)
    qkv = jnp.asarray(rng.standard_normal((batch, block, KV, HEADS // KV + 2, DIM)), jnp.float32)
    norm = jnp.asarray(rng.standard_normal(DIM), jnp.float32)
    inv_freq = tuple(1.0 / 10000 ** (np.arange(0, DIM, 2) / DIM))
    common = dict(q_norm=norm, k_norm=norm, eps=1e-6, inv_freq=inv_freq, num_heads=HEADS, ops=XLA)
    for extra in ({}, dict(sinks=jnp.asarray(rng.standard_normal(HEADS), jnp.float32), window=6)):
        got, k_got, _ = attention_ops.cached_attention(qkv, starts, k_cache, v_cache, blk_lens, **common, **extra)
        want, k_want, _ = attention_ops.cached_attention(qkv, starts, k_cache.gather(), v_cache.gather(), blk_lens,
                                                         **common, **extra)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(k_got.gather()[:2], k_want[:2])


def test_fused_cached_attention_kernel_reads_through_the_page_tables(monkeypatch):
    """With the kernels on (the fused cached-attention kernel, interpret mode on the CPU), a paged layer
    gives the contiguous cache's attention and written K/V: the kernel reads the pools through the
    rows' page tables (pages of 4 positions: each 16-key tile spans four) and writes the block into
    the rows' pages; the done row writes nothing of its own."""
    from kernels_pallas.cached_attention.gpu import cached_block_attention_supported

    _, table, k_pool, v_pool, writable, qkv, starts, blk_lens, common = kernel_case(3)
    k_cache, v_cache = PagedKV(k_pool, table, writable, 4), PagedKV(v_pool, table, writable, 4)
    assert cached_block_attention_supported(qkv.shape, k_cache.shape[1], k_cache.dtype)
    with monkeypatch.context() as patch:  # no copy of the pages: the kernel reads the pools
        patch.setattr(PagedKV, "gather", lambda self: pytest.fail("the paged kernel gathered the pages"))
        got, k_got, v_got = attention_ops.cached_attention(qkv, starts, k_cache, v_cache, blk_lens, **common)
    want, k_want, v_want = attention_ops.cached_attention(qkv, starts, k_cache.gather(), v_cache.gather(), blk_lens,
                                                          **common)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(k_got.gather()[:2], k_want[:2])
    np.testing.assert_array_equal(v_got.gather()[:2], v_want[:2])
    np.testing.assert_array_equal(k_got.gather()[2], k_cache.gather()[2])  # the done row wrote nothing


def test_write_rows_past_the_read_pages_lands_in_the_rows_later_pages():
    """A step reads ``n_pages`` pages but writes through the whole table: a block past them is kept."""
    rng = np.random.default_rng(2)
    k_cache, _ = paged_cache(rng, 2, n_pages=2)
    block = jnp.asarray(rng.standard_normal((2, 3, KV, DIM)), jnp.float32)
    starts = jnp.asarray([8, 0], jnp.int32)
    written = write_rows(k_cache, block, starts)
    whole = PagedKV(written.pool, written.page_table, written.writable, MAX_PAGES).gather()
    np.testing.assert_array_equal(whole[0, 8:11], block[0])
    # and reads go through the table too (the drafter's context window reads positions of a row)
    whole_cache = PagedKV(written.pool, written.page_table, written.writable, MAX_PAGES)
    np.testing.assert_array_equal(read_rows(whole_cache, starts, 3), read_rows(whole, starts, 3))


def test_paged_layers_refuse_a_page_count_past_the_table():
    pools = KVCache((jnp.zeros((2, 4, 1, 8)),), (jnp.zeros((2, 4, 1, 8)),))
    table = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="n_pages"):
        paged_layers(pools, table, jnp.ones((1,), bool), 4)
    assert layer_pools(paged_layers(pools, table, jnp.ones((1,), bool), 3)) == pools


def test_paged_kernels_on_a_tensor_mesh_run_per_device_and_equal_one_device():
    """Under a 1 x 2 (data x tensor) kernel mesh, the pools split by KV head: the fused cached attention
    (writing the block into the rows' pages) and the block attention over a paged context (interpret mode)
    run on each device's heads of every page and give the one-device kernels' results."""
    import jax

    from dflash_jax import sharding
    from dflash_jax.ops.paged_cache import PAGE_TABLE_AXES, POOL_AXES

    rng, table, k_pool, v_pool, writable, qkv, starts, blk_lens, common = kernel_case(4)
    batch, block, _, _, dim = qkv.shape
    ops = common["ops"]
    q = jnp.asarray(rng.standard_normal((batch, 1, block, HEADS, dim)), jnp.float32)
    k_blk, v_blk = (jnp.asarray(rng.standard_normal((batch, 1, block, KV, dim)), jnp.float32) for _ in range(2))

    def run(k_pool, v_pool, table):
        k_cache, v_cache = PagedKV(k_pool, table, writable, 4), PagedKV(v_pool, table, writable, 4)
        attn, k_new, v_new = attention_ops.cached_attention(qkv, starts, k_cache, v_cache, blk_lens, **common)
        drafted = attention_ops.block_attention(q, k_cache, v_cache, starts[:, None], k_blk, v_blk, blk_lens[:, None],
                                                causal=False, ops=ops)
        return attn, k_new.pool, v_new.pool, drafted

    want = jax.jit(run)(k_pool, v_pool, table)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=2), jax.devices()[:2])
    placed = [jax.device_put(x, sharding.named_sharding(POOL_AXES, x.shape, mesh)) for x in (k_pool, v_pool)]
    placed.append(jax.device_put(table, sharding.named_sharding(PAGE_TABLE_AXES, table.shape, mesh)))
    assert {s.data.shape[2] for s in placed[0].addressable_shards} == {KV // 2}
    with sharding.kernel_mesh(mesh):
        lowered = jax.jit(run).lower(*placed)
        got = lowered.compile()(*placed)
    assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    assert {s.data.shape[2] for s in got[1].addressable_shards} == {KV // 2}  # the written pool stays split
