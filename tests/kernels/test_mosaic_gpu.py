"""The Mosaic GPU kernels on the CPU: lowered for CUDA (every supported JAX), and run in Mosaic GPU's
interpret mode against their references (jax >= 0.11: its interpreter runs TMA copies, barriers and
wgmma on shared-memory operands). What the GPU compiles from them runs in tests/gpu/test_gpu_mosaic.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import EngineConfig
from dflash_jax.ops import attention as attention_ops
from dflash_jax.ops.config import XLA, OpsConfig
from dflash_jax.ops.rope import rope_inv_freq
from kernels_pallas._mosaic import mosaic_interpret_available
from kernels_pallas.block_attention.reference import block_attention_reference
from kernels_pallas.block_attention import block_attention
from kernels_pallas.block_attention import mosaic_gpu as attention_mgpu
from kernels_pallas.block_attention import mosaic_gpu_bwd as attention_mgpu_bwd
from kernels_pallas.block_attention.gpu import forward as triton_forward
from kernels_pallas.block_attention.mosaic_gpu import MosaicConfig, plan
from lowering import lower_for

interpreted = pytest.mark.skipif(not mosaic_interpret_available(),
                                 reason="Mosaic GPU's interpret mode needs jax >= 0.11")
sd = jax.ShapeDtypeStruct


def normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def attention_args(batch, blocks, block, heads, kv_heads, head_dim, ctx, ctx_lens, blk_lens, *,
                   dtype=jnp.bfloat16, seed=0):
    """``block_attention``'s arguments: ``ctx_lens, blk_lens`` are ``[batch, blocks]`` lists."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q = normal(ks[0], (batch, blocks, block, heads, head_dim), dtype)
    k_blk, v_blk = (normal(k, (batch, blocks, block, kv_heads, head_dim), dtype) for k in ks[1:3])
    k_ctx, v_ctx = (normal(k, (batch, ctx, kv_heads, head_dim), dtype) for k in ks[3:5])
    return (q, k_ctx, v_ctx, jnp.asarray(ctx_lens, jnp.int32), k_blk, v_blk, jnp.asarray(blk_lens, jnp.int32))


def largest_error(got, want) -> float:
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))


# -- lowering for CUDA (any JAX) -------------------------------------------------------------------


@pytest.mark.parametrize("batch,blocks,block,ctx", [(1, 1, 1, 32768), (8, 1, 16, 4096), (32, 1, 1, 1024),
                                                   (1, 64, 16, 4096), (2, 1, 32, 2048)])
def test_block_attention_lowers_for_cuda(batch, blocks, block, ctx):
    """Qwen3-8B heads in bf16: a decode token over a 32k cache (16 splits), a verify block of 64 query
    rows, a wide batch (no split), training's anchor blocks, two query tiles: the Pallas Mosaic GPU
    lowering accepts every layout and copy. The attention is the kernel's alone: one kernel call and
    no matrix product in XLA (the block's own keys are inside the kernel)."""
    shapes = [sd(x.shape, x.dtype) for x in attention_args(batch, blocks, block, 32, 8, 128, 128,
                                                              [[0] * blocks] * batch, [[block] * blocks] * batch)]
    shapes[1] = shapes[2] = sd((batch, ctx, 8, 128), jnp.bfloat16)
    fn = jax.jit(lambda *a: attention_mgpu.forward(*a, causal=True, interpret=False)[0])
    text = lower_for(fn, shapes, "cuda").as_text()
    assert text.count("custom_call @mosaic_gpu") == 1 and "dot_general" not in text


def paged_args(args, page_size, pages, seed):
    """``attention_args``' contexts ``[B, C, Hkv, D]`` scattered into shuffled pages of a pool ``[pages,
    page_size, Hkv, D]`` (page 0 unused) -> the pools and the page table ``[B, C / page_size]``."""
    k_ctx, v_ctx = args[1], args[2]
    batch, ctx = k_ctx.shape[:2]
    n = ctx // page_size
    table = np.random.default_rng(seed).permutation(np.arange(1, pages))[:batch * n].reshape(batch, n)

    def pool(x):
        out = jnp.zeros((pages, page_size) + x.shape[2:], x.dtype)
        return out.at[table.ravel()].set(x.reshape((batch * n, page_size) + x.shape[2:]))

    return pool(k_ctx), pool(v_ctx), jnp.asarray(table, jnp.int32)


def test_a_tile_config_beyond_shared_memory_is_refused_by_name():
    """128-key tiles at head_dim 128 hold 64 KB of K/V a stage: 4 stages (the batch-1 plan's) need
    more than a program's 227 KB, which the GPU reports only when it loads the kernel; the wrapper
    names the config before lowering. 3 stages fit and lower."""
    shapes = [sd(x.shape, x.dtype) for x in attention_args(1, 1, 16, 32, 8, 128, 128, [[0]], [[16]])]
    shapes[1] = shapes[2] = sd((1, 4096, 8, 128), jnp.bfloat16)

    def lower(config):
        fn = jax.jit(lambda *a: attention_mgpu.forward(*a, causal=True, interpret=False, config=config)[0])
        return lower_for(fn, shapes, "cuda")

    with pytest.raises(ValueError, match=r"block_k=128 with 4 stages needs 288 KB of shared memory"):
        lower(MosaicConfig(block_k=128))
    assert "custom_call @mosaic_gpu" in lower(MosaicConfig(block_k=128, stages=3)).as_text()


def test_paged_block_attention_lowers_for_cuda():
    """A decode token and a verify block of Qwen3-8B heads over 64-position pages: one Mosaic GPU
    kernel reading the pools through the table, no gather of the context in XLA."""
    for batch, block, page_size in ((1, 1, 64), (16, 16, 128)):
        args = attention_args(batch, 1, block, 32, 8, 128, 128, [[0]] * batch, [[block]] * batch)
        shapes = [sd(x.shape, x.dtype) for x in args]
        pool = sd((4096, page_size, 8, 128), jnp.bfloat16)
        table = sd((batch, 8192 // page_size), jnp.int32)
        fn = jax.jit(lambda q, kp, vp, t, cl, kb, vb, bl: attention_mgpu.paged_forward(
            q, kp, vp, t, cl, kb, vb, bl, causal=True, interpret=False)[0])
        text = lower_for(fn, [shapes[0], pool, pool, table] + shapes[3:], "cuda").as_text()
        assert text.count("custom_call @mosaic_gpu") == 1 and "dot_general" not in text and "gather" not in text


@interpreted
@pytest.mark.slow
def test_paged_block_attention_interpreted_equals_reference():
    """Rows of different lengths (a context ending inside a page, one over several splits, none) with
    their pages shuffled over the pool, 64-key tiles of 64- and 128-position pages: the paged kernel
    equals the reference over the contiguous contexts, and the contiguous kernel to the last bit."""
    for page_size, config in ((64, MosaicConfig(splits=2)), (128, MosaicConfig(splits=3))):
        args = attention_args(3, 1, 3, 4, 2, 64, 256, [[100], [256], [0]], [[3], [2], [3]], seed=page_size)
        k_pool, v_pool, table = paged_args(args, page_size, 3 * 256 // page_size + 2, seed=page_size)
        q, _, _, ctx_lens, k_blk, v_blk, blk_lens = args
        got = attention_mgpu.paged_forward(q, k_pool, v_pool, table, ctx_lens, k_blk, v_blk, blk_lens, causal=True,
                                           config=config, interpret=True)[0]
        assert largest_error(got, block_attention_reference(*args, causal=True)) < 2e-2, page_size
        contiguous = attention_mgpu.forward(*args, causal=True, config=config, interpret=True)[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(contiguous))


@interpreted
@pytest.mark.slow
def test_paged_attention_on_the_mosaic_lowering_equals_the_gathered_cache():
    """``ops.attention.attend_and_write`` over ``PagedKV`` caches with ``gpu_lowering="mosaic"``: the
    paged kernel, equal to the Mosaic kernel over the gathered view; the block written into the pages."""
    from dflash_jax.ops.paged_cache import PagedKV

    args = attention_args(2, 1, 2, 4, 2, 64, 128, [[70], [5]], [[2], [1]], seed=3)
    k_pool, v_pool, table = paged_args(args, 64, 6, seed=3)
    q, _, _, ctx_lens, k_blk, v_blk, blk_lens = args
    writable = jnp.ones((2,), bool)
    k_cache, v_cache = PagedKV(k_pool, table, writable, 2), PagedKV(v_pool, table, writable, 2)
    mosaic = OpsConfig(attention="pallas", gpu_lowering="mosaic")
    common = dict(causal=True, write=True, ops=mosaic)
    got, k_got, _ = attention_ops.attend_and_write(q, k_blk, v_blk, ctx_lens[:, 0], k_cache, v_cache, blk_lens[:, 0],
                                                   **common)
    want, k_want, _ = attention_ops.attend_and_write(q, k_blk, v_blk, ctx_lens[:, 0], k_cache.gather(),
                                                     v_cache.gather(), blk_lens[:, 0], **common)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(k_got.gather()), np.asarray(k_want))


@pytest.mark.parametrize("blocks,block,ctx", [(512, 16, 4096), (2, 32, 1024)])
def test_block_attention_backward_lowers_for_cuda(blocks, block, ctx):
    """The backward at Qwen3-8B heads in bf16: training's 512 anchor blocks of 16 over 4k tokens (one
    64-row query tile), and blocks of 32 (two query tiles): two Mosaic GPU kernels, every product in
    them (no matrix product in XLA)."""
    q = sd((1, blocks, block, 32, 128), jnp.bfloat16)
    kv_ctx, kv_blk, lens = sd((1, ctx, 8, 128), jnp.bfloat16), sd((1, blocks, block, 8, 128), jnp.bfloat16), \
        sd((1, blocks), jnp.int32)
    lse = sd((1, blocks, 8, block * 4), jnp.float32)
    fn = jax.jit(lambda *a: attention_mgpu_bwd.backward(*a, causal=False, scale=128 ** -0.5, interpret=False))
    text = lower_for(fn, (q, kv_ctx, kv_ctx, lens, kv_blk, kv_blk, lens, q, lse, q), "cuda").as_text()
    assert text.count("custom_call @mosaic_gpu") == 2 and "dot_general" not in text


def test_plan_fills_the_sms_once():
    """Batch 1 at Qwen3-8B's 8 KV heads: 16 splits (128 programs of one per SM, 4 stages); batch 32:
    no split and 2 stages, so that two programs share an SM; a short cache caps the splits."""
    cfg = MosaicConfig()
    assert plan(1, 8, 1, 32768, cfg) == (16, 4)
    assert plan(8, 8, 1, 32768, cfg) == (2, 4)
    assert plan(32, 8, 1, 32768, cfg) == (1, 2)
    assert plan(1, 8, 1, 256, cfg) == (4, 4)
    with pytest.raises(ValueError, match="block_k"):
        MosaicConfig(block_k=96)


@pytest.mark.parametrize("platform,capability,hopper", [
    ("gpu", "9.0", True), ("gpu", "10.0", True), ("gpu", "8.0", False), ("gpu", None, False), ("cpu", None, False)])
def test_mosaic_kernels_run_on_hopper_or_later_gpus_only(monkeypatch, platform, capability, hopper):
    """TMA and ``wgmma`` came with compute capability 9.0: an older GPU (or one reporting no capability)
    runs the Triton kernels whatever the lowering asked for."""
    from types import SimpleNamespace

    from kernels_pallas import _mosaic

    device = SimpleNamespace(platform=platform) if capability is None else SimpleNamespace(
        platform=platform, compute_capability=capability)
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    assert _mosaic.hopper_or_later() is hopper
    if platform == "gpu":
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        assert _mosaic.mosaic_runs_here() is hopper
        assert attention_mgpu.runs_here(128, 1024, jnp.bfloat16) is hopper


def test_gpu_lowering_is_validated():
    assert OpsConfig(attention="pallas", gpu_lowering="mosaic").mosaic
    assert not OpsConfig(attention="xla", gpu_lowering="mosaic").mosaic
    with pytest.raises(ValueError, match="gpu_lowering"):
        OpsConfig(gpu_lowering="cuda")
    with pytest.raises(ValueError, match="gpu_lowering"):
        EngineConfig(gpu_lowering="cuda").validate()


# -- interpret mode (jax >= 0.11) --------------------------------------------------------------------


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False], ids=["verify", "draft"])
def test_block_attention_interpreted_equals_reference(causal):
    """The drafter's block and the target's verify block over a context: two rows (a context of 100
    positions over two splits' balanced tiles, and none), GQA 4 / 2 heads of 64, a block of 3 with
    one row's block one short, the block's own keys in the last split; then a decode token of 4 / 1
    heads of 128 (one query tile of 4 real rows, stored without padding)."""
    for shape, ctx_lens, blk_lens in (((2, 1, 3, 4, 2, 64, 192), [[100], [0]], [[3], [2]]),
                                      ((1, 1, 1, 4, 1, 128, 128), [[77]], [[1]])):
        args = attention_args(*shape, ctx_lens, blk_lens, seed=len(ctx_lens))
        got = attention_mgpu.forward(*args, causal=causal, config=MosaicConfig(splits=2), interpret=True)[0]
        assert largest_error(got, block_attention_reference(*args, causal=causal)) < 2e-2, shape


@interpreted
@pytest.mark.slow
def test_block_attention_interpreted_blocks_tiles_and_lse():
    """Several blocks per row (training's anchors: contexts 0, 50 and the whole 128, a row that sees
    no key at all gets zeros), two 64-row query tiles (32 slots of 8 / 2 heads), 128-key tiles; the
    log-sum-exp equals the Triton kernel's (the backward's input)."""
    cases = (((1, 3, 2, 4, 2, 64, 128), [[0, 50, 128]], [[0, 1, 2]], MosaicConfig()),
             ((1, 1, 32, 8, 2, 64, 256), [[200]], [[30]], MosaicConfig(splits=3)),
             ((2, 1, 16, 4, 1, 64, 256), [[0], [256]], [[0], [16]], MosaicConfig(block_k=128)))
    for shape, ctx_lens, blk_lens, config in cases:
        args = attention_args(*shape, ctx_lens, blk_lens, seed=shape[1])
        got, lse = attention_mgpu.forward(*args, causal=True, config=config, interpret=True)
        assert largest_error(got, block_attention_reference(*args, causal=True)) < 2e-2, shape
        want_lse = triton_forward(*args, causal=True, interpret=True)[1]
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    zero_row = attention_mgpu.forward(*attention_args(1, 1, 2, 2, 1, 64, 64, [[0]], [[0]]), causal=True,
                                      interpret=True)[0]
    np.testing.assert_array_equal(np.asarray(zero_row), 0)


@pytest.mark.slow
@pytest.mark.parametrize("bwd", ["xla", "pallas"])
def test_block_attention_mosaic_lowering_is_differentiable(bwd):
    """``block_attention(lowering="mosaic")``: the Mosaic GPU forward (interpreted; on a JAX without
    Mosaic GPU's interpreter the Triton kernel's) and, from its log-sum-exp, the XLA backward or the
    Mosaic GPU backward kernels (``bwd="pallas"``; the Triton ones where Mosaic GPU does not run);
    gradients equal the reference's."""
    args = attention_args(1, 2, 2, 4, 2, 64, 64, [[30, 64]], [[2, 1]], seed=2)
    q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens = args

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)

    def mosaic(q, k, v):
        return block_attention(q, k, v, ctx_lens, k_blk, v_blk, blk_lens, causal=False, lowering="mosaic",
                               bwd=bwd)

    def ref(q, k, v):
        return block_attention_reference(q, k, v, ctx_lens, k_blk, v_blk, blk_lens, causal=False)

    got = jax.grad(loss(mosaic), argnums=(0, 1, 2))(q, k_ctx, v_ctx)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k_ctx, v_ctx)
    for g, w in zip(got, want):
        assert largest_error(g, w) < 5e-2 * float(jnp.max(jnp.abs(w.astype(jnp.float32))))


def reference_grads(args, causal, cotangent):
    """jax.grad of the reference: (dq, dk_ctx, dv_ctx, dk_blk, dv_blk) for ``sum(out * cotangent)``."""
    q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens = args

    def loss(q, k_ctx, v_ctx, k_blk, v_blk):
        out = block_attention_reference(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal)
        return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*(args[i] for i in (0, 1, 2, 4, 5)))


def assert_gradients_close(got, want):
    """The Triton backward's bf16 tolerance: each gradient within 2% (relative L2) of the reference's."""
    for name, g, w in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.linalg.norm(g - w) <= 2e-2 * np.linalg.norm(w), name


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["draft", "causal"])
def test_block_attention_backward_interpreted_equals_reference(causal):
    """The Mosaic GPU backward kernels from the Mosaic GPU forward's log-sum-exp, against the
    reference's autodiff: two rows of blocks with unsorted contexts (the dk/dv kernel's order), a
    block of no context and one of the whole context, blocks one short; then two 64-row query tiles
    (32 slots of 8 / 2 heads: dK_blk, dV_blk summed over them); then 80 slots of one head (two own
    key tiles) in float16."""
    cases = (((2, 3, 3, 4, 2, 64, 192), [[100, 7, 192], [0, 150, 64]], [[3, 2, 3], [1, 3, 0]], jnp.bfloat16),
             ((1, 2, 32, 8, 2, 64, 128), [[128, 37]], [[32, 20]], jnp.bfloat16),
             ((1, 1, 80, 1, 1, 64, 64), [[64]], [[75]], jnp.float16))
    for shape, ctx_lens, blk_lens, dtype in cases:
        args = attention_args(*shape, ctx_lens, blk_lens, dtype=dtype, seed=shape[1])
        out, lse = attention_mgpu.forward(*args, causal=causal, interpret=True)
        cotangent = normal(jax.random.key(7), out.shape, dtype)
        got = attention_mgpu_bwd.backward(*args, out, lse, cotangent, causal=causal, scale=64 ** -0.5,
                                          interpret=True)
        assert_gradients_close(got, reference_grads(args, causal, cotangent))


@interpreted
@pytest.mark.slow
def test_block_attention_backward_through_the_custom_vjp():
    """``jax.grad`` of ``block_attention(lowering="mosaic", bwd="pallas")`` runs the Mosaic GPU
    backward (its kernels in the jaxpr) in bf16 and equals the reference; float32, which ``wgmma``
    would take as TF32, keeps the Triton backward, to float32 tolerances."""
    for dtype in (jnp.bfloat16, jnp.float32):
        args = attention_args(1, 3, 4, 4, 2, 64, 128, [[0, 60, 128]], [[4, 4, 2]], dtype=dtype, seed=4)
        cotangent = normal(jax.random.key(8), args[0].shape, dtype)

        def loss(q, k_ctx, v_ctx, k_blk, v_blk):
            out = block_attention(q, k_ctx, v_ctx, args[3], k_blk, v_blk, args[6], causal=True,
                                  lowering="mosaic", bwd="pallas")
            return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

        grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
        inputs = [args[i] for i in (0, 1, 2, 4, 5)]
        assert ("dflash_block_attention_bwd_dq_mgpu" in str(jax.make_jaxpr(grad)(*inputs))) == (dtype == jnp.bfloat16)
        got, want = grad(*inputs), reference_grads(args, True, cotangent)
        if dtype == jnp.float32:
            for g, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=5e-5)
        else:
            assert_gradients_close(got, want)


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("case", ["verify", "partials", "plain"])
def test_cached_attention_on_the_mosaic_lowering_equals_reference(case):
    """``ops.attention.cached_attention`` with ``gpu_lowering="mosaic"``: the jnp prologue (the raw
    fused projection's q/k norms and RoPE; float32 partials of a padded batch with a row scale; a block
    of 3 without q/k norms), the Mosaic GPU attention kernel and the cache write, interpreted, against
    the XLA reference: the attention within bf16 rounding, both caches bit for bit; the causal verify
    block and the drafter's block (not causal, not written)."""
    batch, block, kv_heads, groups, head_dim, capacity = 2, 3 if case == "plain" else 2, 1, 2, 64, 128
    ks = jax.random.split(jax.random.key(1), 6)
    heads = (block, kv_heads, groups + 2, head_dim)
    qkv = (normal(ks[0], (3, batch + 1) + heads, jnp.float32) if case == "partials"
           else normal(ks[0], (batch,) + heads, jnp.bfloat16))
    k_cache, v_cache = (normal(k, (batch, capacity, kv_heads, head_dim), jnp.bfloat16) for k in ks[1:3])
    starts, blk_lens = jnp.array([70, 5], jnp.int32), jnp.array([2, 1], jnp.int32)
    norms = ([None] * 2 if case == "plain" else
             [(1 + 0.2 * normal(k, (head_dim,), jnp.float32)).astype(jnp.bfloat16) for k in ks[3:5]])
    row_scale = 0.5 + jax.random.uniform(ks[5], (batch, block), jnp.float32) if case == "partials" else None
    inv_freq = tuple(float(f) for f in rope_inv_freq(head_dim, 1e6, None))
    mosaic = OpsConfig(attention="pallas", gpu_lowering="mosaic")

    def run(ops, causal=True, write=True):
        return attention_ops.cached_attention(qkv, starts, k_cache, v_cache, blk_lens, q_norm=norms[0],
                                              k_norm=norms[1], eps=1e-6, inv_freq=inv_freq, row_scale=row_scale,
                                              num_heads=kv_heads * groups, ops=ops, causal=causal, write=write)

    assert "dflash_block_attention_mgpu" in str(jax.make_jaxpr(lambda: run(mosaic))())
    for causal, write in ((True, True), (False, False)):
        got, want = run(mosaic, causal, write), run(XLA, causal, write)
        assert largest_error(got[0], want[0]) < 2e-2, (case, causal)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))


@interpreted
@pytest.mark.slow
def test_cached_attention_over_paged_caches_on_the_mosaic_lowering():
    """``cached_attention`` over ``PagedKV`` caches with ``gpu_lowering="mosaic"``: the paged attention
    kernel, equal to the same op over the gathered caches bit for bit, the
    block written into the rows' pages."""
    from dflash_jax.ops.paged_cache import PagedKV

    args = attention_args(2, 1, 2, 4, 2, 64, 128, [[70], [5]], [[2], [1]], seed=3)
    k_pool, v_pool, table = paged_args(args, 64, 6, seed=3)
    writable = jnp.ones((2,), bool)
    k_cache, v_cache = PagedKV(k_pool, table, writable, 2), PagedKV(v_pool, table, writable, 2)
    qkv = normal(jax.random.key(4), (2, 2, 2, 4, 64), jnp.bfloat16)
    starts, blk_lens = jnp.array([70, 5], jnp.int32), jnp.array([2, 1], jnp.int32)
    inv_freq = tuple(float(f) for f in rope_inv_freq(64, 1e6, None))
    mosaic = OpsConfig(attention="pallas", gpu_lowering="mosaic")

    def run(k, v):
        return attention_ops.cached_attention(qkv, starts, k, v, blk_lens, q_norm=None, k_norm=None, eps=1e-6,
                                              inv_freq=inv_freq, num_heads=4, ops=mosaic)

    jaxpr = str(jax.make_jaxpr(lambda: run(k_cache, v_cache))())
    assert "dflash_paged_block_attention_mgpu" in jaxpr
    got, want = run(k_cache, v_cache), run(k_cache.gather(), v_cache.gather())
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1].gather()), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[2].gather()), np.asarray(want[2]))


@interpreted
def test_cached_attention_on_the_mosaic_lowering_per_device():
    """Under a kernel mesh (rows on ``data``, KV heads on ``tensor``) the attention kernel traces per
    device on its rows and KV heads (one shard_map; Mosaic GPU's interpreter runs one device's kernels only, so the values are the GPU tests' and the single-device tests')."""
    from dflash_jax import sharding
    from dflash_jax.sharding import MeshConfig, make_mesh

    batch, block, kv_heads, groups, head_dim = 2, 3, 2, 2, 64
    qkv = jnp.zeros((batch, block, kv_heads, groups + 2, head_dim), jnp.bfloat16)
    cache = jnp.zeros((batch, 128, kv_heads, head_dim), jnp.bfloat16)
    norm = jnp.ones((head_dim,), jnp.bfloat16)
    lens = jnp.array([3, 2], jnp.int32)
    inv_freq = tuple(float(f) for f in rope_inv_freq(head_dim, 1e6, None))
    mosaic = OpsConfig(attention="pallas", gpu_lowering="mosaic")

    def run(qkv, k, v, starts):
        return attention_ops.cached_attention(qkv, starts, k, v, lens, q_norm=norm, k_norm=norm, eps=1e-6,
                                              inv_freq=inv_freq, num_heads=kv_heads * groups, ops=mosaic)

    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4])
    with sharding.kernel_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(run)(qkv, cache, cache, jnp.array([90, 4], jnp.int32)))
    assert "shard_map" in jaxpr and "dflash_block_attention_mgpu" in jaxpr
