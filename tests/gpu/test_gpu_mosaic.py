"""The Mosaic GPU kernels compiled for the GPU (Hopper or later) against their references, at Qwen3-8B
head shapes: the block attention (one block per row over a KV cache: decode tokens, verify and draft
blocks, split-K over long contexts, the tile configs; several blocks per row: the training pattern,
its gradients through the Mosaic GPU backward kernels; through ``ops.attention.cached_attention`` with
``gpu_lowering="mosaic"`` in test_gpu_kernels.py beside the Triton kernel; over paged contexts, the
pages of a pool named by page tables, and a paged engine on it).
Tolerances are those of tests/gpu/test_gpu_kernels.py for the Triton kernels.

    JAX_PLATFORMS=cuda python -m pytest -q -m gpu tests/gpu/test_gpu_mosaic.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops import OpsConfig
from dflash_jax.ops import attention as attention_ops
from dflash_jax.ops.config import XLA
from kernels_pallas.block_attention import block_attention, block_attention_fwd
from kernels_pallas.block_attention import mosaic_gpu as attention_mgpu
from kernels_pallas.block_attention import mosaic_gpu_bwd as attention_mgpu_bwd
from kernels_pallas.block_attention.mosaic_gpu import MosaicConfig, plan
from kernels_pallas.block_attention.reference import block_attention_reference
from kernels_pallas.block_attention.reference_bwd import block_attention_bwd
from test_gpu_kernels import (BLOCK, D, HKV, HQ, assert_cached_matches, assert_training_pattern_gradients, block_args,
                              cached, cached_args, errors, normal)

pytestmark = pytest.mark.gpu

MOSAIC = OpsConfig(attention="pallas", gpu_lowering="mosaic")


def attention_args(batch, block, capacity, *, dtype=jnp.bfloat16, seed=0, starts=None, blk_lens=None):
    """One block per row over a cache (``block_attention``'s arguments, ``blocks == 1``): by default
    rows' contexts spread over the cache (the first full, the last empty) and random block lengths."""
    rng = np.random.default_rng(seed)
    if starts is None:
        starts = rng.integers(0, capacity + 1, batch)
        starts[0] = capacity
        if batch > 1:
            starts[-1] = 0
    if blk_lens is None:
        blk_lens = rng.integers(1, block + 1, batch)
    return block_args(batch, 1, capacity, dtype=dtype, seed=seed, block=block,
                      ctx_lens=jnp.asarray(starts, jnp.int32)[:, None],
                      blk_lens=jnp.asarray(blk_lens, jnp.int32)[:, None])


def check(args, *, causal, config=None):
    got = jax.jit(lambda *a: attention_mgpu.forward(*a, causal=causal, config=config)[0])(*args)
    want = jax.jit(lambda *a: block_attention_reference(*a, causal=causal))(*args)
    largest, rel = errors(got, want)
    batch, blocks, block = args[0].shape[:3]
    splits = plan(batch * blocks, HKV, -(-block * HQ // HKV // 64), args[1].shape[1], config or MosaicConfig())[0]
    assert rel < 1e-2 and largest < 6e-2, (largest, rel, splits)


@pytest.mark.parametrize("causal", [False, True], ids=["draft", "causal"])
@pytest.mark.parametrize("batch,block,capacity", [(1, 1, 32768), (1, 16, 16384), (8, 1, 4096), (4, 16, 2048),
                                                  (32, 16, 1024), (2, 32, 4096)])
def test_block_attention_over_a_cache_bf16_equals_reference(batch, block, capacity, causal):
    """A decode token and verify / draft blocks (16 slots: one 64-row query tile; 32: two), random
    context and block lengths (one row's context the whole cache, one none), split-K as ``plan``
    fills the SMs, the block's own keys in the last split."""
    check(attention_args(batch, block, capacity, seed=batch * 7 + block), causal=causal)


@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("batch,block,capacity", [(1, 1, 16384), (16, 16, 2048), (32, 1, 1024)])
def test_paged_block_attention_equals_the_contiguous_kernel(batch, block, capacity, page_size):
    """The paged kernel over the rows' contexts scattered into shuffled pages of a pool equals the
    contiguous kernel over the same contexts bit for bit (the same tiles in the same order), and the
    reference to bf16 rounding."""
    args = attention_args(batch, block, capacity, seed=batch + page_size)
    n = capacity // page_size
    table = np.random.default_rng(page_size).permutation(np.arange(1, batch * n + 3))[:batch * n].reshape(batch, n)

    def pool(x):
        out = jnp.zeros((batch * n + 3, page_size) + x.shape[2:], x.dtype)
        return out.at[table.ravel()].set(x.reshape((batch * n, page_size) + x.shape[2:]))

    q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens = args
    got = jax.jit(lambda *a: attention_mgpu.paged_forward(*a, causal=True)[0])(
        q, pool(k_ctx), pool(v_ctx), jnp.asarray(table, jnp.int32), ctx_lens, k_blk, v_blk, blk_lens)
    contiguous = jax.jit(lambda *a: attention_mgpu.forward(*a, causal=True)[0])(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(contiguous))
    check(args, causal=True)


def test_block_attention_float16_and_odd_contexts():
    """float16; contexts ending inside a tile, a context of one position, a block of no valid slot."""
    args = attention_args(4, 16, 4096, dtype=jnp.float16, seed=11, starts=[4095, 1, 1000, 64],
                          blk_lens=[16, 3, 1, 0])
    check(args, causal=True)


@pytest.mark.parametrize("config", [MosaicConfig(block_k=128, stages=3), MosaicConfig(block_k=128, stages=2),
                                    MosaicConfig(stages=2), MosaicConfig(stages=6), MosaicConfig(splits=1),
                                    MosaicConfig(splits=7)], ids=str)
def test_block_attention_tile_configs_equal_reference(config):
    for batch, block in ((1, 1), (4, 16)):
        check(attention_args(batch, block, 8192, seed=block), causal=True, config=config)


@pytest.mark.parametrize("causal", [False, True], ids=["draft", "causal"])
@pytest.mark.parametrize("batch,blocks,ctx", [(1, 64, 1024), (4, 3, 2048), (1, 512, 4096)])
def test_block_attention_several_blocks_equals_reference(batch, blocks, ctx, causal):
    """Several blocks per row (the training pattern: anchor blocks over the context before them, and
    random lengths with one block of no context), on the Mosaic GPU lowering through
    ``block_attention``; the log-sum-exp (the backward's input) equals the Triton kernel's."""
    rng = np.random.default_rng(ctx + blocks)
    ctx_lens = jnp.asarray(np.sort(rng.integers(0, ctx - BLOCK + 1, (batch, blocks))), jnp.int32).at[0, 0].set(0)
    blk_lens = jnp.asarray(rng.integers(1, BLOCK + 1, (batch, blocks)), jnp.int32)
    args = block_args(batch, blocks, ctx, seed=blocks, ctx_lens=ctx_lens, blk_lens=blk_lens)
    got = jax.jit(lambda *a: block_attention(*a, causal=causal, lowering="mosaic"))(*args)
    want = jax.jit(lambda *a: block_attention_reference(*a, causal=causal))(*args)
    largest, rel = errors(got, want)
    assert rel < 1e-2 and largest < 6e-2, (largest, rel)
    lse = [jax.jit(lambda *a, lo=lo: block_attention_fwd(*a, causal=causal, lowering=lo)[1])(*args)
           for lo in ("mosaic", "triton")]
    np.testing.assert_allclose(np.asarray(lse[0]), np.asarray(lse[1]), rtol=1e-3, atol=1e-3)


def test_block_attention_mosaic_gradients_of_the_training_pattern():
    """64 anchor blocks over 1024 tokens: the Mosaic GPU forward and, from its log-sum-exp, the Mosaic
    GPU backward kernels (a GPU's default ``bwd="pallas"``), against the reference's autodiff, every
    input's gradient."""
    assert_training_pattern_gradients(lowering="mosaic")


@pytest.mark.parametrize("causal", [False, True], ids=["draft", "causal"])
@pytest.mark.parametrize("batch,blocks,block,ctx,dtype", [
    (1, 512, 16, 4096, jnp.bfloat16), (2, 8, 32, 2048, jnp.bfloat16), (4, 1, 16, 8192, jnp.float16)])
def test_block_attention_mosaic_backward_equals_reference(batch, blocks, block, ctx, dtype, causal):
    """The backward kernels alone against the blockwise jnp backward (``reference_bwd``) from the same
    forward output and log-sum-exp: training's 512 anchors over 4k tokens, blocks of 32 slots (two
    query tiles), long contexts in float16; unsorted contexts (the dk/dv kernel's order) with one of
    none and one of the whole sequence, random block lengths with one empty block."""
    rng = np.random.default_rng(blocks + block)
    ctx_lens = rng.integers(0, ctx + 1, (batch, blocks))
    ctx_lens.flat[0], ctx_lens.flat[-1] = 0, ctx
    blk_lens = rng.integers(1, block + 1, (batch, blocks))
    blk_lens.flat[min(1, blk_lens.size - 1)] = 0
    args = block_args(batch, blocks, ctx, dtype=dtype, seed=blocks, block=block,
                      ctx_lens=jnp.asarray(ctx_lens, jnp.int32), blk_lens=jnp.asarray(blk_lens, jnp.int32))
    out, lse = jax.jit(lambda *a: attention_mgpu.forward(*a, causal=causal))(*args)
    cotangent = normal(jax.random.key(blocks), out.shape, dtype)
    scale = args[0].shape[-1] ** -0.5
    got = jax.jit(lambda *a: attention_mgpu_bwd.backward(*a, causal=causal, scale=scale))(*args, out, lse, cotangent)
    want = jax.jit(lambda *a: block_attention_bwd(*a, causal=causal, scale=scale))(*args, out, lse, cotangent)
    for name, g, w in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), got, want):
        assert g.dtype == w.dtype and errors(g, w)[1] < 2e-2, (name, errors(g, w))


@pytest.mark.parametrize("config", [attention_mgpu_bwd.MosaicBwdConfig(dq_stages=1, dkv_stages=1),
                                    attention_mgpu_bwd.MosaicBwdConfig(dq_stages=3, dkv_stages=4)], ids=str)
def test_block_attention_mosaic_backward_pipeline_depths(config):
    """Other pipeline depths of the two backward kernels give the same gradients."""
    anchors = jnp.asarray(np.sort(np.random.default_rng(4).integers(0, 1024 - BLOCK + 1, (2, 32))), jnp.int32)
    args = block_args(2, 32, 1024, seed=8, ctx_lens=anchors)
    out, lse = attention_mgpu.forward(*args, causal=False)
    cotangent = normal(jax.random.key(4), out.shape, jnp.bfloat16)
    got = jax.jit(lambda *a: attention_mgpu_bwd.backward(*a, causal=False, scale=D ** -0.5, config=config))(
        *args, out, lse, cotangent)
    want = jax.jit(lambda *a: block_attention_bwd(*a, causal=False, scale=D ** -0.5))(*args, out, lse, cotangent)
    for name, g, w in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), got, want):
        assert errors(g, w)[1] < 2e-2, name


def test_block_attention_mosaic_backward_is_deterministic():
    """Every gradient has one writer (no atomics): 5 calls give the same bits."""
    anchors = jnp.asarray(np.sort(np.random.default_rng(2).integers(0, 2048, (1, 128))), jnp.int32)
    args = block_args(1, 128, 2048, seed=6, ctx_lens=anchors)
    out, lse = attention_mgpu.forward(*args, causal=False)
    fn = jax.jit(lambda *a: attention_mgpu_bwd.backward(*a, causal=False, scale=D ** -0.5))
    first = [np.asarray(g) for g in fn(*args, out, lse, normal(jax.random.key(3), out.shape, jnp.bfloat16))]
    for _ in range(4):
        again = fn(*args, out, lse, normal(jax.random.key(3), out.shape, jnp.bfloat16))
        for g, f in zip(again, first):
            np.testing.assert_array_equal(np.asarray(g), f)


def test_block_attention_is_deterministic():
    """20 calls give the same bits: the split partials merge in a fixed order, nothing races."""
    args = attention_args(1, 16, 16384, seed=3)
    fn = jax.jit(lambda *a: attention_mgpu.forward(*a, causal=True)[0])
    first = np.asarray(fn(*args))
    for _ in range(19):
        np.testing.assert_array_equal(np.asarray(fn(*args)), first)


def test_ops_block_attention_takes_the_mosaic_kernel():
    """``ops.attention.block_attention`` with ``gpu_lowering="mosaic"`` runs the Mosaic GPU kernel
    (its name in the compiled program) and equals the reference."""
    args = block_args(2, 4, 2048, seed=4)
    fn = jax.jit(lambda *a: attention_ops.block_attention(*a, causal=False, ops=MOSAIC))
    assert "dflash_block_attention_mgpu" in fn.lower(*args).as_text()
    largest, rel = errors(fn(*args), block_attention_reference(*args, causal=False))
    assert rel < 1e-2 and largest < 6e-2


def test_ops_block_attention_gradient_takes_the_mosaic_backward():
    """A training step's gradient through ``ops.attention.block_attention`` with ``gpu_lowering="mosaic"``
    runs both Mosaic GPU backward kernels (their names in the compiled program) and equals the
    reference's."""
    anchors = jnp.asarray(np.sort(np.random.default_rng(5).integers(0, 2048 - BLOCK + 1, (2, 16))), jnp.int32)
    args = block_args(2, 16, 2048, seed=5, ctx_lens=anchors)
    cotangent = normal(jax.random.key(5), args[0].shape, jnp.float32)

    def grad(fn):
        def loss(q, k_ctx, v_ctx):
            return jnp.sum(fn(q, k_ctx, v_ctx, *args[3:]).astype(jnp.float32) * cotangent)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    mosaic = grad(lambda *a: attention_ops.block_attention(*a, causal=False, ops=MOSAIC))
    text = mosaic.lower(*args[:3]).as_text()
    assert "dflash_block_attention_bwd_dq_mgpu" in text and "dflash_block_attention_bwd_dkv_mgpu" in text
    want = grad(lambda *a: block_attention_reference(*a, causal=False))(*args[:3])
    for g, w in zip(mosaic(*args[:3]), want):
        assert errors(g, w)[1] < 2e-2


def test_cached_attention_float32_on_the_mosaic_lowering_equals_reference():
    """float32 caches: wgmma would take them as TF32, so on the Mosaic lowering they take the unfused
    path's block attention (the Triton kernel, as every op without a Mosaic GPU port): float32
    tolerances at ``highest`` precision."""
    qkv, k, v, starts, blk_lens, norms = cached_args(2, 16, seed=9)
    args = (qkv.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), starts, blk_lens,
            {n: w.astype(jnp.float32) for n, w in norms.items()})
    with jax.default_matmul_precision("highest"):
        got, want = cached(MOSAIC)(*args), cached(XLA)(*args)
    assert errors(got[0], want[0])[0] < 1e-4
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("mode", ["verify", "draft"])
@pytest.mark.parametrize("batch,block,parts", [(1, 1, 8), (1, 16, 0), (16, 16, 0), (4, 5, 0)])
def test_cached_attention_on_the_mosaic_lowering_takes_the_attention_kernel(batch, block, parts, mode):
    """``cached_attention`` on ``gpu_lowering="mosaic"`` compiles to the Mosaic GPU attention kernel
    (its name in the HLO) and equals the XLA reference: a decode token's partials
    with a row scale, verify and draft blocks, an odd block; the written cache rows too."""
    qkv, k_cache, v_cache, starts, blk_lens, norms = cached_args(batch, block, seed=batch * 10 + block)
    row_scale = None
    if parts:
        qkv = 0.35 * normal(jax.random.key(6), (parts, batch + 1) + qkv.shape[1:], jnp.float32)
        row_scale = jnp.full((batch, block), 0.7, jnp.float32)
    kw = dict(causal=mode == "verify", write=mode == "verify")
    args = (qkv, k_cache, v_cache, starts, blk_lens, norms, row_scale)
    text = cached(MOSAIC, **kw).lower(*args).as_text()
    assert "dflash_block_attention_mgpu" in text
    got, want = cached(MOSAIC, **kw)(*args), cached(XLA, **kw)(*args)
    assert errors(got[0], want[0])[1] < 1e-2
    if mode == "verify":
        assert_cached_matches(got, want, k_cache, v_cache)


def test_paged_engine_on_the_mosaic_lowering_generates_the_contiguous_tokens():
    """A bf16 DFlash engine with head_dim 128 and 64-position pages: its decode steps read the pages
    through the Mosaic GPU paged attention, equal to the contiguous Mosaic kernel bit for bit, so the
    paged engine generates the contiguous engine's tokens."""
    from flax import nnx

    from dflash_jax import Engine, EngineConfig
    from dflash_jax.models.drafter import Drafter
    from dflash_jax.models.target import Target
    from dflash_jax.tiny import tiny_drafter_config, tiny_target_config

    tcfg = tiny_target_config(vocab_size=512, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=128)
    dcfg = tiny_drafter_config(tcfg, block_size=16, mask_token_id=511)
    target = Target(tcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    drafter = Drafter(dcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    config = dict(max_batch_size=4, max_length=512, prompt_buckets=(256,), attention_impl="pallas",
                  gpu_lowering="mosaic")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, n).tolist() for n in (200, 70, 5)]
    want = Engine(target, drafter, EngineConfig(**config)).generate(prompts, 64)
    got = Engine(target, drafter, EngineConfig(page_size=64, **config)).generate(prompts, 64)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
