"""The Pallas kernels compiled for the GPU against their references, at Qwen3-8B head shapes.

The CPU suite (tests/kernels) runs the same kernels in interpret mode on small shapes; these run
what Triton compiles: split-K plans over long contexts, the tiles a config selects, the fused cached
attention with its in-place cache write, the cuDNN prompt attention the engine's prefill takes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops import OpsConfig
from dflash_jax.ops import attention as attention_ops
from dflash_jax.ops.config import XLA, parse_tiles
from dflash_jax.ops.rope import rope_inv_freq
from kernels_pallas.block_attention import block_attention
from kernels_pallas.block_attention.gpu import GpuConfig, plan
from kernels_pallas.block_attention.reference import block_attention_reference

pytestmark = pytest.mark.gpu

HQ, HKV, D, BLOCK = 32, 8, 128, 16  # Qwen3-8B's heads, the published block size


def normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def errors(got, want) -> tuple[float, float]:
    """(largest absolute difference, relative L2 difference); both infinite if ``got`` is not finite."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.all(np.isfinite(got)):
        return float("inf"), float("inf")
    return (float(np.max(np.abs(got - want))),
            float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)))


def block_args(batch, blocks, ctx, *, dtype=jnp.bfloat16, seed=0, hq=HQ, hkv=HKV, d=D, block=BLOCK,
               ctx_lens=None, blk_lens=None):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = normal(ks[0], (batch, blocks, block, hq, d), dtype)
    k_ctx, v_ctx = (normal(k, (batch, ctx, hkv, d), dtype) for k in ks[1:3])
    k_blk, v_blk = (normal(k, (batch, blocks, block, hkv, d), dtype) for k in ks[3:5])
    ctx_lens = jnp.full((batch, blocks), ctx, jnp.int32) if ctx_lens is None else ctx_lens
    blk_lens = jnp.full((batch, blocks), block, jnp.int32) if blk_lens is None else blk_lens
    return q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens


# -- block attention ---------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["draft", "causal"])
@pytest.mark.parametrize("batch,blocks,ctx", [(2, 1, 4096), (1, 1, 32768), (4, 3, 2048)])
def test_block_attention_bf16_equals_reference(batch, blocks, ctx, causal):
    """Random context and block lengths (one row full, one with no context), split-K over the long
    contexts as the wave model plans it."""
    rng = np.random.default_rng(ctx + batch)
    ctx_lens = jnp.asarray(rng.integers(0, ctx + 1, (batch, blocks)), jnp.int32).at[0, 0].set(ctx)
    if batch * blocks > 1:
        ctx_lens = ctx_lens.at[-1, -1].set(0)
    blk_lens = jnp.asarray(rng.integers(0, BLOCK + 1, (batch, blocks)), jnp.int32)
    args = block_args(batch, blocks, ctx, seed=batch + ctx, ctx_lens=ctx_lens, blk_lens=blk_lens)
    got = jax.jit(lambda *a: block_attention(*a, causal=causal))(*args)
    want = jax.jit(lambda *a: block_attention_reference(*a, causal=causal))(*args)
    largest, rel = errors(got, want)
    assert rel < 1e-2 and largest < 6e-2, (largest, rel, plan(batch, blocks, HKV, ctx, GpuConfig())[2])


@pytest.mark.parametrize("causal", [False, True], ids=["draft", "causal"])
def test_block_attention_float32_odd_shapes(causal):
    """Float32 at ``highest`` precision, 12 / 4 heads of 64, blocks of 7, lengths 0 to full."""
    args = block_args(2, 3, 1000, dtype=jnp.float32, seed=7, hq=12, hkv=4, d=64, block=7,
                      ctx_lens=jnp.array([[0, 999, 500], [1, 77, 640]], jnp.int32),
                      blk_lens=jnp.array([[0, 1, 7], [3, 7, 0]], jnp.int32))
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda *a: block_attention(*a, causal=causal))(*args)
        want = jax.jit(lambda *a: block_attention_reference(*a, causal=causal))(*args)
    assert errors(got, want)[0] < 1e-4


def assert_training_pattern_gradients(**kw):
    """64 anchor blocks over a 1024-token sequence, each seeing the context before its anchor:
    ``block_attention(**kw)``'s custom VJP against the reference's autodiff, every input's gradient."""
    anchors = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 1024 - BLOCK + 1, (1, 64))), jnp.int32)
    args = block_args(1, 64, 1024, seed=3, ctx_lens=anchors)
    ct = jax.random.normal(jax.random.PRNGKey(5), args[0].shape, jnp.float32)

    def grads(fn, **kw):
        def loss(q, kc, vc, kb, vb, cl, bl, ct):
            return jnp.sum(fn(q, kc, vc, cl, kb, vb, bl, causal=False, **kw).astype(jnp.float32) * ct)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*[args[i] for i in (0, 1, 2, 4, 5, 3, 6)], ct)

    for name, got, want in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"),
                               grads(block_attention, **kw), grads(block_attention_reference)):
        assert errors(got, want)[1] < 2e-2, name


@pytest.mark.parametrize("bwd", ["xla", "pallas"])
def test_block_attention_gradients_of_the_training_pattern(bwd):
    """The training pattern's gradients: Pallas backward kernels, or the blockwise jnp backward."""
    assert_training_pattern_gradients(bwd=bwd)


# -- the fused cached attention ------------------------------------------------------------------------

CAPACITY, CONTEXT = 1152, 512  # the engine's capacity for max_length 1024


def cached_args(batch: int, block: int, seed: int = 0, capacity: int = CAPACITY):
    """The raw fused projection ``qkv [batch, block, 8, 6, 128]`` and bf16 caches; rows' contexts
    spread over the cache (full, a third, none), the last row's block one short where it can be."""
    ks = jax.random.split(jax.random.key(seed), 5)
    qkv = normal(ks[0], (batch, block, HKV, HQ // HKV + 2, D), jnp.bfloat16)
    k_cache, v_cache = (normal(k, (batch, capacity, HKV, D), jnp.bfloat16) for k in ks[1:3])
    starts = jnp.array([(CONTEXT, CONTEXT // 3, 0)[i % 3] for i in range(batch)], jnp.int32)
    blk_lens = jnp.full((batch,), block, jnp.int32)
    if batch > 1 and block > 1:
        blk_lens = blk_lens.at[-1].set(block - 1)
    norms = dict(q_norm=(1 + 0.2 * normal(ks[3], (D,), jnp.float32)).astype(jnp.bfloat16),
                 k_norm=(1 + 0.2 * normal(ks[4], (D,), jnp.float32)).astype(jnp.bfloat16))
    return qkv, k_cache, v_cache, starts, blk_lens, norms


def cached(ops: OpsConfig, *, causal: bool = True, write: bool = True):
    """``ops.attention.cached_attention`` jitted, taking ``(qkv, k_cache, v_cache, starts, blk_lens,
    norms[, row_scale])``: with the kernels on (``ops``) the fused kernel, else its reference (norms,
    RoPE, block attention and cache writes in jnp)."""
    inv_freq = tuple(float(f) for f in rope_inv_freq(D, 1e6, None))

    @jax.jit
    def run(qkv, k, v, starts, blk_lens, norms, row_scale=None):
        return attention_ops.cached_attention(qkv, starts, k, v, blk_lens, q_norm=norms["q_norm"],
                                              k_norm=norms["k_norm"], eps=1e-6, inv_freq=inv_freq, num_heads=HQ,
                                              causal=causal, write=write, row_scale=row_scale, ops=ops)

    return run


def assert_cached_matches(got, want, k_cache, v_cache, tol: float = 1e-2):
    """The attention, and what each path wrote into the caches (the difference from the caches it was
    given, so that the written rows are compared, not the 1152 untouched ones)."""
    assert errors(got[0], want[0])[1] < tol, "attention"
    for name, g, w, before in (("k_cache", got[1], want[1], k_cache), ("v_cache", got[2], want[2], v_cache)):
        before = np.asarray(before, np.float32)
        assert errors(np.asarray(g, np.float32) - before, np.asarray(w, np.float32) - before)[1] < tol, name


KERNEL = OpsConfig(attention="pallas")


@pytest.mark.parametrize("lowering", ["triton", "mosaic"])
@pytest.mark.parametrize("mode", ["verify", "draft"])
@pytest.mark.parametrize("batch,block", [(1, 1), (1, 16), (16, 1), (16, 16)])
def test_cached_attention_kernel_equals_reference(batch, block, mode, lowering):
    """The target's decode token and verify block (causal, the block written into the caches) and the
    drafter's block (bidirectional, the caches only read), one row and sixteen; the fused Triton
    kernel, or on the Mosaic GPU lowering its prologue kernel (q/k norms, RoPE, packing) and the Mosaic
    GPU attention, the cache write in XLA (tests/gpu/test_gpu_mosaic.py)."""
    args = cached_args(batch, block, seed=batch * 100 + block)
    kw = dict(causal=mode == "verify", write=mode == "verify")
    ops = dataclasses.replace(KERNEL, gpu_lowering=lowering)
    got, want = cached(ops, **kw)(*args), cached(XLA, **kw)(*args)
    if mode == "verify":
        assert_cached_matches(got, want, args[1], args[2])
    else:
        assert errors(got[0], want[0])[1] < 1e-2


@pytest.mark.parametrize("tiles", ["block_k=32", "block_k=128", "num_warps=8", "num_stages=2",
                                   "min_chunk=64,num_stages=2", "num_splits=8", "members_per_program=2",
                                   "stacked_members=1,members_per_program=4"])
def test_cached_attention_tile_configs_equal_reference(tiles):
    """``OpsConfig.cached_attention_tiles`` (``EngineConfig.cached_attention_tiles``) reach the kernel,
    and every such config computes the reference's attention, for a decode token and a verify block."""
    kernel = cached(OpsConfig(attention="pallas", cached_attention_tiles=parse_tiles(tiles)))
    for batch, block in ((1, 1), (4, 16)):
        args = cached_args(batch, block, seed=block)
        assert_cached_matches(kernel(*args), cached(XLA)(*args), args[1], args[2])


@pytest.mark.parametrize("block", [1, 16])
def test_cached_attention_kernel_is_deterministic(block):
    """20 calls give the same bits: the split-K partials merge in a fixed order, nothing races."""
    args, kernel = cached_args(1, block, seed=3), cached(KERNEL)
    first = [np.asarray(x) for x in kernel(*args)]
    for _ in range(19):
        for a, b in zip(first, kernel(*args)):
            np.testing.assert_array_equal(a, np.asarray(b))


def test_cached_attention_sums_split_k_partials_with_a_row_scale():
    """A decode token's QKV as 8 float32 split-K partials (``OpsConfig.qkv_partials``; rows past the
    batch are padding) times the input norm's row scale (its weight folded into the projection),
    summed in the kernel, against the reference of the same sum."""
    qkv, k, v, starts, blk_lens, norms = cached_args(1, 1, seed=5)
    parts = 0.35 * normal(jax.random.key(6), (8, 2) + qkv.shape[1:], jnp.float32)
    row_scale = jnp.array([[0.7]], jnp.float32)
    args = (parts, k, v, starts, blk_lens, norms, row_scale)
    assert_cached_matches(cached(KERNEL)(*args), cached(XLA)(*args), k, v)


@pytest.mark.parametrize("block", [32, 64, 128, 512])
def test_cached_attention_long_blocks_over_a_long_cache(block):
    """A prefill suffix or chunk over a cached prefix of 4,096 tokens (and a row of 1,000) through
    ``cached_attention`` with the kernels on: the fused kernel where its program fits an SM's shared
    memory (``cached_attention.gpu.supports``), else the unfused path, where a block the Triton block
    attention cannot hold is written first and attended as 16-slot sub-blocks. Compiles and runs, and
    equals the reference."""
    qkv, k, v, _, blk_lens, norms = cached_args(2, block, seed=block, capacity=4096 + 512)
    starts = jnp.array([4096, 1000], jnp.int32)
    got, want = cached(KERNEL)(qkv, k, v, starts, blk_lens, norms), cached(XLA)(qkv, k, v, starts, blk_lens, norms)
    assert_cached_matches(got, want, k, v)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("batch,block", [(1, 1), (1, 16), (16, 16)])
def test_cached_attention_kernel_through_page_tables(batch, block, page_size):
    """The fused kernel on paged caches (pages shuffled over the pool, one row done) computes what it
    computes on the contiguous caches the pages stand for, and writes the block into the rows' pages."""
    from dflash_jax.ops.cache import read_rows
    from dflash_jax.ops.paged_cache import NULL_PAGE, PagedKV

    qkv, _, _, starts, blk_lens, norms = cached_args(batch, block, seed=page_size + block)
    read_pages = CAPACITY // page_size
    rng = np.random.default_rng(page_size)
    pages = 1 + batch * read_pages + 5
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[:batch * read_pages].reshape(batch, read_pages),
                        jnp.int32)
    writable = jnp.arange(batch) != batch - 1 if batch > 1 else jnp.ones((1,), bool)
    k_pool, v_pool = (normal(jax.random.key(i), (pages, page_size, HKV, D), jnp.bfloat16) for i in (7, 8))
    k_cache, v_cache = PagedKV(k_pool, table, writable, read_pages), PagedKV(v_pool, table, writable, read_pages)
    got, k_got, v_got = cached(KERNEL)(qkv, k_cache, v_cache, starts, blk_lens, norms)
    want, k_view, v_view = cached(KERNEL)(qkv, k_cache.gather(), v_cache.gather(), starts, blk_lens, norms)
    assert errors(got, want)[1] < 1e-3, "attention"
    owned = np.arange(pages) != NULL_PAGE
    for written, cache, view in ((k_got, k_cache, k_view), (v_got, v_cache, v_view)):
        expected = cache.write_rows(read_rows(view, starts, block), starts).pool
        np.testing.assert_array_equal(np.asarray(written.pool, np.float32)[owned],
                                      np.asarray(expected, np.float32)[owned])


@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("splits", [None, 3])
def test_block_attention_through_page_tables_equals_the_contiguous_kernel(page_size, splits):
    """The Triton block attention over paged contexts (the prefill of a prompt's rest over its cached
    prefix), compiled: rows of 4,096, 1,000 (inside a page) and 0 context positions, their pages shuffled
    over a pool; the output and log-sum-exp are the contiguous kernel's on the same context (the same
    tiles and splits)."""
    from kernels_pallas.block_attention.gpu import forward, paged_forward

    ctx, batch = 4096, 3
    n = ctx // page_size
    q, k_ctx, v_ctx, _, k_blk, v_blk, _ = block_args(batch, 1, ctx, seed=page_size)
    ctx_lens = jnp.array([ctx, 1000, 0], jnp.int32)
    blk_lens = jnp.array([BLOCK, 7, BLOCK], jnp.int32)
    pages = 1 + batch * n + 5
    table = np.random.default_rng(page_size).permutation(np.arange(1, pages))[:batch * n].reshape(batch, n)

    def pool(x):
        return jnp.zeros((pages, page_size) + x.shape[2:], x.dtype).at[table.ravel()].set(
            x.reshape((batch * n, page_size) + x.shape[2:]))

    config = GpuConfig(num_splits=splits)
    got = jax.jit(lambda *a: paged_forward(*a, causal=True, config=config))(
        q, pool(k_ctx), pool(v_ctx), jnp.asarray(table, jnp.int32), ctx_lens, k_blk, v_blk, blk_lens)
    want = jax.jit(lambda *a: forward(*a, causal=True, config=config))(
        q, k_ctx, v_ctx, ctx_lens[:, None], k_blk, v_blk, blk_lens[:, None])
    assert errors(got[0], want[0])[1] < 1e-3, "attention"
    assert errors(got[1], want[1])[0] < 1e-3, "log-sum-exp"


# -- the prompt attention (cuDNN) ------------------------------------------------------------------------


def prompt_args(rows: int, length: int, seed: int):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (normal(ks[0], (rows, length, HQ, D), jnp.bfloat16),
            *(normal(k, (rows, length, HKV, D), jnp.bfloat16) for k in ks[1:]))


def reference_prompt_attention(q, k, v, lens):
    empty = jnp.zeros((k.shape[0], 0) + k.shape[2:], k.dtype)
    return block_attention_reference(q[:, None], empty, empty, jnp.zeros((q.shape[0], 1), jnp.int32), k[:, None],
                                     v[:, None], lens[:, None], causal=True)[:, 0]


def test_prompt_attention_takes_cudnn_and_equals_reference():
    """A prompt's attention (``ops.attention.prompt_attention``, what prefill runs with the kernels
    on) is cuDNN's flash attention here, and the reference's on the valid slots of rows of a full, a
    partial and a single valid slot."""
    assert attention_ops.library_flash_attention(jnp.bfloat16, D) == "cudnn"
    q, k, v = prompt_args(3, 2048, seed=0)
    lens = jnp.array([2048, 682, 1], jnp.int32)
    got = jax.jit(attention_ops.prompt_attention)(q, k, v, lens)
    want = jax.jit(reference_prompt_attention)(q, k, v, lens)
    for row, n in enumerate((2048, 682, 1)):
        assert errors(got[row, :n], want[row, :n])[1] < 2e-2, row


@pytest.mark.parametrize("axis", ["tensor", "data"])
def test_prompt_attention_on_a_mesh_is_bit_equal_to_one_device(axis):
    """Under a kernel mesh of every GPU (rows on ``data``, KV heads on ``tensor``) each device runs the
    same per-head cuDNN call on its share: the result equals one device's bit for bit."""
    from dflash_jax import sharding

    n = jax.device_count()
    if n < 2:
        pytest.skip("needs 2 or more GPUs")
    q, k, v = prompt_args(2, 2048, seed=1)
    lens = jnp.array([2048, 1024], jnp.int32)
    want = np.asarray(jax.jit(lambda *a: attention_ops.prompt_attention(*a))(q, k, v, lens))
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1 if axis == "tensor" else n, fsdp=1,
                                                  tensor=n if axis == "tensor" else 1))
    with sharding.kernel_mesh(mesh):  # a fresh function: traced under the mesh, not taken from jit's cache
        got = np.asarray(jax.jit(lambda *a: attention_ops.prompt_attention(*a))(q, k, v, lens))
    np.testing.assert_array_equal(got, want)
