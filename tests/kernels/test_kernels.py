"""The Pallas block-attention kernels against ``block_attention_reference`` (CPU, interpret mode).

Random inputs, odd lengths, empty contexts, blk_len 0 / 1, GQA ratios 1 / 2 / 4, causal and not,
several blocks with different context lengths; forward of both kernels (the GPU kernel in Pallas
interpret mode, the TPU kernel in TPU interpret mode), split-K, and gradients of the training
pattern through the custom VJP (the blockwise jnp backward and the Pallas backward kernels). Plus:
the kernels lower to Triton IR (cuda) and Mosaic (tpu) on this CPU machine, so a change that
cannot be lowered for the accelerators fails here (Triton's and Mosaic's own compilers to machine
code only run on the accelerators).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dflash_jax.ops.attention import block_attention as dispatch
from dflash_jax.ops.config import OpsConfig
from dflash_jax.ops.attention import block_attention_reference as reference
from kernels_pallas.block_attention import block_attention, block_attention_fwd
from kernels_pallas.cached_attention import cached_block_attention
from kernels_pallas.block_attention.gpu import GpuConfig, plan
from kernels_pallas.block_attention.tpu import TpuConfig
from lowering import lower_for

F32_TOL = dict(rtol=1e-5, atol=2e-5)


def run_kernel(*args, causal, **kw):
    """The kernel under jit (eager op-by-op dispatch would dominate the test time)."""
    return jax.jit(lambda *a: block_attention(*a, causal=causal, **kw))(*args)


def run_reference(*args, causal):
    return jax.jit(lambda *a: reference(*a, causal=causal))(*args)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def make_inputs(seed, *, batch=2, blocks=3, block=5, q_heads=4, kv_heads=2, head_dim=16, ctx=37,
                dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = jax.random.normal(ks[0], (batch, blocks, block, q_heads, head_dim), jnp.float32)
    k_ctx = jax.random.normal(ks[1], (batch, ctx, kv_heads, head_dim), jnp.float32)
    v_ctx = jax.random.normal(ks[2], (batch, ctx, kv_heads, head_dim), jnp.float32)
    k_blk = jax.random.normal(ks[3], (batch, blocks, block, kv_heads, head_dim), jnp.float32)
    v_blk = jax.random.normal(ks[4], (batch, blocks, block, kv_heads, head_dim), jnp.float32)
    ctx_lens = np.array(jax.random.randint(ks[5], (batch, blocks), 0, ctx + 1), np.int32)
    blk_lens = np.array(jax.random.randint(ks[6], (batch, blocks), 0, block + 1), np.int32)
    # the edge cases, always present: empty context, blk_len 0 and 1, both empty, full lengths
    ctx_lens[0, 0] = 0
    blk_lens[0, 0] = 0  # this block's rows see nothing: zeros
    blk_lens[-1, -1] = 1
    ctx_lens[-1, 0] = ctx
    if blocks > 1:
        ctx_lens[0, 1] = 0
        blk_lens[0, 1] = block
    cast = lambda x: x.astype(dtype)  # noqa: E731
    return (cast(q), cast(k_ctx), cast(v_ctx), jnp.asarray(ctx_lens), cast(k_blk), cast(v_blk),
            jnp.asarray(blk_lens))


def assert_close(got, want, dtype):
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, **(F32_TOL if dtype == jnp.float32 else BF16_TOL))
    if dtype != jnp.float32:  # bf16: the error must also be small on average
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want) + 1e-6


# (seed, q_heads, kv_heads, block, head_dim, ctx, blocks, causal, dtype)
FWD_CASES = [
    (0, 2, 2, 5, 16, 37, 3, False, jnp.float32),  # GQA 1
    (1, 2, 2, 5, 16, 37, 3, True, jnp.float32),
    (2, 4, 2, 3, 32, 50, 2, False, jnp.float32),  # GQA 2
    (3, 8, 2, 5, 16, 33, 2, True, jnp.float32),  # GQA 4
    (4, 8, 2, 16, 32, 80, 2, True, jnp.bfloat16),
    (5, 4, 1, 5, 16, 45, 3, False, jnp.bfloat16),
]


@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: f"s{c[0]}-g{c[1] // c[2]}-c{int(c[7])}-{jnp.dtype(c[8]).name}")
def test_forward_gpu_kernel(case):
    seed, hq, hkv, block, d, ctx, blocks, causal, dtype = case
    args = make_inputs(seed, blocks=blocks, block=block, q_heads=hq, kv_heads=hkv, head_dim=d,
                       ctx=ctx, dtype=dtype)
    got = run_kernel(*args, causal=causal, backend="gpu", interpret=True)
    want = run_reference(*args, causal=causal)
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    # the block with no key at all gives exact zeros
    np.testing.assert_array_equal(np.asarray(got[0, 0], np.float32), 0.0)
    # negative control: the comparison can fail (the other mask is visibly different)
    other = np.asarray(run_reference(*args, causal=not causal), np.float32)
    assert np.max(np.abs(np.asarray(got, np.float32) - other)) > 5e-2


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "capacity-chunks"])
@pytest.mark.parametrize("splits,causal", [(3, False), (4, True)])
def test_forward_gpu_split_k(splits, causal, balanced):
    """Split-K: several programs per (row, block, head), merged by log-sum-exp; each row's context dealt
    to the splits in whole tiles of its own length (balanced) or in fixed chunks of the capacity."""
    args = make_inputs(10 + splits, blocks=2, block=5, q_heads=8, kv_heads=2, ctx=70)
    cfg = GpuConfig(block_k=16, num_splits=splits, balanced_splits=balanced)
    out, lse = jax.jit(lambda *a: block_attention_fwd(
        *a, causal=causal, backend="gpu", interpret=True, config=cfg))(*args)
    assert_close(out, run_reference(*args, causal=causal), jnp.float32)
    assert lse.shape == (2, 2, 2, 5 * 4)
    # the automatic plan splits a long context at small batch and not the training pattern
    assert plan(1, 1, 8, 32768, GpuConfig())[2] > 8
    assert plan(1, 512, 8, 4096, GpuConfig())[2] == 1


@pytest.fixture
def cudnn_via_xla(monkeypatch) -> list[str]:
    """Makes ``attention.prompt_attention`` take its cuDNN path on the CPU: the library's flash
    attention is asked for (recorded) and ``jax.nn.dot_product_attention``'s XLA implementation runs
    in its place, so that everything around the call (layout, GQA heads, lengths, zero rows,
    sharding) is checked against the reference. The cuDNN kernel itself runs on GPUs only
    (``bench/bench_prefill.py`` checks it there)."""
    from dflash_jax.ops import attention

    asked = []
    library = jax.nn.dot_product_attention

    def recorded(*args, implementation=None, **kw):
        asked.append(implementation)
        return library(*args, implementation="xla", **kw)

    monkeypatch.setattr(attention, "library_flash_attention", lambda dtype, head_dim: "cudnn")
    monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
    return asked


@pytest.mark.parametrize("library", ["cudnn", "tpu_flash"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prompt_attention_library_path_equals_reference(request, dtype, library):
    """ctx = 0 and one causal block (a prompt): with the kernels on it goes to a library flash
    attention (cuDNN's, XLA's implementation in its place; the Pallas TPU one, interpreted); rows of
    full, partial, one and zero valid slots, GQA 4, a prompt of 40 slots (the TPU kernel's tiles are
    128): equal to the reference at every slot, the padding's included."""
    calls = request.getfixturevalue("cudnn_via_xla" if library == "cudnn" else "tpu_flash_interpreted")
    args = make_inputs(20, batch=4, blocks=1, block=40, q_heads=8, kv_heads=2, ctx=1, dtype=dtype)
    q, _, _, _, kb, vb, _ = args
    empty = jnp.zeros((4, 0, 2, 16), dtype)
    cl = jnp.zeros((4, 1), jnp.int32)
    bl = jnp.array([[40], [23], [1], [0]], jnp.int32)
    got = jax.jit(lambda *a: dispatch(*a, causal=True, ops=OpsConfig(attention="pallas")))(q, empty, empty, cl, kb, vb, bl)
    assert len(calls) == 1 and (library == "tpu_flash" or calls == ["cudnn"])
    want = run_reference(q, empty, empty, cl, kb, vb, bl, causal=True)
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    np.testing.assert_array_equal(np.asarray(got[3], np.float32), 0.0)  # no key at all: zeros
    # negative control: without the causal mask the rows differ visibly
    other = run_reference(q, empty, empty, cl, kb, vb, bl, causal=False)
    assert np.max(np.abs(np.asarray(got, np.float32) - np.asarray(other, np.float32))) > 5e-2


@pytest.mark.parametrize("library", ["cudnn", "tpu_flash"])
def test_prompt_attention_library_path_sharded(request, library):
    """The library call per device on a data x tensor mesh (rows on ``data``, KV heads with their
    query heads on ``tensor``) equals the reference on one device."""
    from dflash_jax import sharding
    from dflash_jax.ops import attention
    from dflash_jax.sharding import MeshConfig, make_mesh

    calls = request.getfixturevalue("cudnn_via_xla" if library == "cudnn" else "tpu_flash_interpreted")
    q, _, _, _, kb, vb, _ = make_inputs(21, batch=2, blocks=1, block=24, q_heads=8, kv_heads=4, ctx=1)
    lens = jnp.array([24, 9], jnp.int32)
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4), jax.devices()[:8])
    with sharding.kernel_mesh(mesh):
        got = jax.jit(lambda *a: attention.prompt_attention(*a))(q[:, 0], kb[:, 0], vb[:, 0], lens)
        text = jax.jit(lambda *a: attention.prompt_attention(*a)).lower(q[:, 0], kb[:, 0], vb[:, 0], lens).as_text()
    assert calls and (library == "tpu_flash" or set(calls) == {"cudnn"})
    assert "shard_map" in text or "sdy.manual_computation" in text  # run per device, not gathered
    if library == "tpu_flash":
        assert (1,) in [x.shape for x in calls]  # traced per device on one row (and once whole, for its shapes)
    empty = jnp.zeros((2, 0, 4, 16), jnp.float32)
    assert_close(got, run_reference(q, empty, empty, jnp.zeros((2, 1), jnp.int32), kb, vb, lens[:, None],
                                    causal=True)[:, 0], jnp.float32)


def test_library_flash_attention_rule(monkeypatch):
    """Which flash attention a prompt gets: cuDNN's on GPUs and the Pallas TPU one on TPUs (head dims
    of whole 128-lane tiles), for 16-bit inputs; the reference for float32 and on the CPU."""
    from dflash_jax.ops import attention

    for backend, dtype, head_dim, want in [("gpu", jnp.bfloat16, 64, "cudnn"), ("gpu", jnp.float16, 128, "cudnn"),
                                           ("gpu", jnp.float32, 128, None), ("tpu", jnp.bfloat16, 128, "tpu_flash"),
                                           ("tpu", jnp.bfloat16, 256, "tpu_flash"), ("tpu", jnp.bfloat16, 64, None),
                                           ("tpu", jnp.float32, 128, None), ("cpu", jnp.bfloat16, 128, None)]:
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert attention.library_flash_attention(dtype, head_dim) == want, (backend, dtype, head_dim)


def test_prompt_attention_without_library_is_the_reference():
    """Off a GPU or TPU (and for float32 anywhere) a prompt runs the reference itself."""
    from dflash_jax.ops import attention

    assert attention.library_flash_attention(jnp.bfloat16, 128) is None  # the suite runs on the CPU
    q, _, _, _, kb, vb, _ = make_inputs(22, batch=2, blocks=1, block=20, q_heads=4, kv_heads=2, ctx=1)
    lens = jnp.array([20, 7], jnp.int32)
    empty = jnp.zeros((2, 0, 2, 16), jnp.float32)
    want = run_reference(q, empty, empty, jnp.zeros((2, 1), jnp.int32), kb, vb, lens[:, None], causal=True)
    np.testing.assert_array_equal(np.asarray(attention.prompt_attention(q[:, 0], kb[:, 0], vb[:, 0], lens)),
                                  np.asarray(want[:, 0]))


@pytest.mark.parametrize("case", [FWD_CASES[1], FWD_CASES[2], FWD_CASES[5]],
                         ids=["g1-causal", "g2", "g4-bf16"])
def test_forward_tpu_kernel(case):
    seed, hq, hkv, block, d, ctx, blocks, causal, dtype = case
    args = make_inputs(seed, blocks=blocks, block=block, q_heads=hq, kv_heads=hkv, head_dim=d,
                       ctx=ctx, dtype=dtype)
    got = run_kernel(*args, causal=causal, backend="tpu", interpret=True,
                     config=TpuConfig(block_k=16))
    assert_close(got, run_reference(*args, causal=causal), dtype)
    np.testing.assert_array_equal(np.asarray(got[0, 0], np.float32), 0.0)


def test_paged_forward_tpu_kernel_equals_the_contiguous_kernel():
    """The TPU block attention over a paged context (interpret mode): rows of different lengths (one
    ending inside a page, one empty) with their 16-position pages shuffled over a pool, a tile per page:
    the contiguous kernel's output with 16-key tiles, bit for bit."""
    from kernels_pallas.block_attention.tpu import forward as tpu_forward
    from kernels_pallas.block_attention.tpu import paged_forward as tpu_paged_forward

    q, k_ctx, v_ctx, _, k_blk, v_blk, _ = make_inputs(31, batch=3, blocks=1, block=3, q_heads=4, kv_heads=2,
                                                      head_dim=16, ctx=64)
    ctx_lens, blk_lens = jnp.array([[37], [64], [0]], jnp.int32), jnp.array([[3], [2], [3]], jnp.int32)
    page, n = 16, 4
    table = np.random.default_rng(0).permutation(np.arange(1, 15))[:3 * n].reshape(3, n)

    def pool(x):
        return jnp.zeros((15, page) + x.shape[2:], x.dtype).at[table.ravel()].set(x.reshape((3 * n, page) + x.shape[2:]))

    got = tpu_paged_forward(q, pool(k_ctx), pool(v_ctx), jnp.asarray(table, jnp.int32), ctx_lens, k_blk, v_blk,
                            blk_lens, causal=True, interpret=True)
    want = tpu_forward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=True, interpret=True,
                       config=TpuConfig(block_k=page))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("page", [16, 64])
def test_paged_forward_gpu_kernel_equals_the_contiguous_kernel(page):
    """The Triton block attention over a paged context (interpret mode): rows of different lengths (one
    ending inside a page, one empty) with their pages shuffled over a pool (pages of 16 under 64-key
    tiles, or of 64): the contiguous kernel's output and log-sum-exp, to float32 rounding."""
    from kernels_pallas.block_attention.gpu import forward as gpu_forward
    from kernels_pallas.block_attention.gpu import paged_forward as gpu_paged_forward

    ctx, batch = 128, 3
    n = ctx // page
    q, k_ctx, v_ctx, _, k_blk, v_blk, _ = make_inputs(37, batch=batch, blocks=1, block=3, q_heads=4, kv_heads=2,
                                                      head_dim=16, ctx=ctx)
    ctx_lens, blk_lens = jnp.array([[37], [ctx], [0]], jnp.int32), jnp.array([[3], [2], [3]], jnp.int32)
    pages = 1 + batch * n + 2
    table = np.random.default_rng(page).permutation(np.arange(1, pages))[:batch * n].reshape(batch, n)

    def pool(x):
        return jnp.zeros((pages, page) + x.shape[2:], x.dtype).at[table.ravel()].set(
            x.reshape((batch * n, page) + x.shape[2:]))

    for config in (GpuConfig(), GpuConfig(num_splits=3)):
        got = jax.jit(lambda *a: gpu_paged_forward(*a, causal=True, interpret=True, config=config))(
            q, pool(k_ctx), pool(v_ctx), jnp.asarray(table, jnp.int32), ctx_lens[:, 0], k_blk, v_blk, blk_lens[:, 0])
        want = jax.jit(lambda *a: gpu_forward(*a, causal=True, interpret=True, config=config))(
            q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6, atol=1e-6)


def test_paged_forward_gpu_kernel_lowers_for_gpus():
    """Triton IR for cuda, built on this CPU: the paged Triton block attention at Qwen3-8B heads (a draft
    block of 16 over 1,152 positions in pages of 64)."""
    from kernels_pallas.block_attention.gpu import paged_forward as gpu_paged_forward

    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    pool, blk = sd((512, 64, 8, 128), bf), sd((2, 1, 16, 8, 128), bf)
    args = (sd((2, 1, 16, 32, 128), bf), pool, pool, sd((2, 18), jnp.int32), sd((2,), jnp.int32), blk, blk,
            sd((2,), jnp.int32))
    fn = jax.jit(lambda *a: gpu_paged_forward(*a, causal=False, interpret=False))
    text = lower_for(fn, args, "cuda").as_text()
    assert "dflash_block_attention" in text and "triton" in text


def test_paged_block_attention_dispatch_reads_through_the_table(monkeypatch):
    """With the kernels on (Triton lowering), ``ops.attention.block_attention`` over a ``PagedKV``
    context runs the paged Triton kernel (no gather of the pages) and equals the reference."""
    from dflash_jax.ops.paged_cache import PagedKV

    q, k_ctx, v_ctx, _, k_blk, v_blk, _ = make_inputs(41, batch=2, blocks=1, block=4, q_heads=4, kv_heads=2,
                                                      head_dim=16, ctx=64)
    ctx_lens, blk_lens = jnp.array([[50], [9]], jnp.int32), jnp.array([[4], [3]], jnp.int32)
    table = jnp.asarray([[3, 1, 6, 2], [5, 8, 4, 7]], jnp.int32)

    def paged(x):
        pool = jnp.zeros((9, 16) + x.shape[2:], x.dtype).at[table.ravel()].set(x.reshape((8, 16) + x.shape[2:]))
        return PagedKV(pool, table, jnp.ones((2,), bool), 4)

    want = reference(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=True)
    monkeypatch.setattr(PagedKV, "gather", lambda self: pytest.fail("the paged kernel gathered the pages"))
    got = dispatch(q, paged(k_ctx), paged(v_ctx), ctx_lens, k_blk, v_blk, blk_lens, causal=True,
                   ops=OpsConfig(attention="pallas"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)


def _grads(fn, args, causal, cotangent, **kw):
    q, kc, vc, cl, kb, vb, bl = args

    def loss(q, kc, vc, kb, vb):
        out = fn(q, kc, vc, cl, kb, vb, bl, causal=causal, **kw)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, kc, vc, kb, vb)


def _training_inputs(seed, dtype, *, blocks=6, block=4, seq=40):
    """The training pattern: ctx = the whole sequence, ctx_len = each block's anchor."""
    args = make_inputs(seed, batch=2, blocks=blocks, block=block, q_heads=8, kv_heads=2,
                       head_dim=16, ctx=seq, dtype=dtype)
    anchors = jax.random.randint(jax.random.PRNGKey(seed + 100), (2, blocks), 0, seq - block + 1)
    anchors = anchors.at[0, 0].set(0)  # a block with an empty context (but a full block)
    bl = jnp.full((2, blocks), block, jnp.int32).at[1, 2].set(1)
    return args[:3] + (anchors.astype(jnp.int32),) + args[4:6] + (bl,)


@pytest.mark.parametrize(
    "backend,causal,dtype",
    [("gpu", False, jnp.float32), ("gpu", True, jnp.bfloat16), ("tpu", True, jnp.float32),
     ("gpu-pallas-bwd", True, jnp.float32)],
)
@pytest.mark.slow
def test_gradients_training_pattern(backend, causal, dtype):
    args = _training_inputs(30, dtype)
    cot = jax.random.normal(jax.random.PRNGKey(31), args[0].shape, jnp.float32)
    kw = dict(backend=backend, interpret=True)
    if backend == "gpu-pallas-bwd":  # the Pallas backward kernels (Triton lowering; a GPU's default)
        kw = dict(backend="gpu", interpret=True, bwd="pallas")
    if backend == "tpu":
        kw["config"] = TpuConfig(block_k=8)
    got_out = run_kernel(*args, causal=causal, **kw)
    assert_close(got_out, run_reference(*args, causal=causal), dtype)
    got = _grads(block_attention, args, causal, cot, **kw)
    want = _grads(reference, args, causal, cot)
    for name, g, w in zip(["dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"], got, want):
        assert g.dtype == w.dtype, name
        if dtype == jnp.float32:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=5e-5,
                                       err_msg=name)
        else:
            g = np.asarray(g, np.float32)
            w = np.asarray(w, np.float32)
            assert np.linalg.norm(g - w) <= 2e-2 * np.linalg.norm(w), name


def test_gradients_small_backward_chunks():
    """The backward's scan over block chunks (a tiny memory budget forces one block per step)."""
    from kernels_pallas.block_attention.reference_bwd import block_attention_bwd

    args = _training_inputs(40, jnp.float32)
    out, lse = jax.jit(lambda *a: block_attention_fwd(*a, causal=False, interpret=True))(*args)
    dout = jax.random.normal(jax.random.PRNGKey(41), out.shape)
    bwd = jax.jit(block_attention_bwd, static_argnames=("causal", "scale", "budget_bytes"))
    one = bwd(*args, out, lse, dout, causal=False, scale=0.25, budget_bytes=1)
    many = bwd(*args, out, lse, dout, causal=False, scale=0.25)
    for a, b in zip(one, many):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def _qwen3_shapes(batch, blocks, ctx):
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    return (sd((batch, blocks, 16, 32, 128), bf), sd((batch, ctx, 8, 128), bf),
            sd((batch, ctx, 8, 128), bf), sd((batch, blocks), jnp.int32),
            sd((batch, blocks, 16, 8, 128), bf), sd((batch, blocks, 16, 8, 128), bf),
            sd((batch, blocks), jnp.int32))


@pytest.mark.parametrize("batch,blocks,ctx", [(1, 1, 32768), (1, 512, 4096)])
def test_lowers_for_accelerators(batch, blocks, ctx):
    """Triton IR for cuda and Mosaic for tpu, built on this CPU (Qwen3-8B heads, bf16)."""
    shapes = _qwen3_shapes(batch, blocks, ctx)
    for backend, platform, marker in (("gpu", "cuda", "triton"), ("tpu", "tpu", "tpu_custom_call")):
        fn = jax.jit(lambda *a, backend=backend: block_attention_fwd(
            *a, causal=True, interpret=False, backend=backend))
        text = lower_for(fn, shapes, platform).as_text()
        assert marker in text, (backend, platform)
    if blocks > 1:  # the training pattern's gradient with the Pallas backward kernels
        def loss(q, kc, vc, cl, kb, vb, bl):
            out = block_attention(q, kc, vc, cl, kb, vb, bl, causal=False, interpret=False,
                                  backend="gpu", bwd="pallas")
            return jnp.sum(out.astype(jnp.float32))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4, 5)))
        text = lower_for(grad, shapes, "cuda").as_text()
        assert text.count("triton") >= 3  # forward, dq, dk/dv


# -- the fused cached attention (q/k norm + RoPE + cache write + attention) ------------------------

# (seed, block, groups, qk_norm, dtype, forced splits, drafter: bidirectional and not written)
CACHED_CASES = [
    (0, 1, 4, True, jnp.float32, None, False),  # one decode token: 4 query rows, broadcast products
    (1, 16, 4, True, jnp.float32, None, False),  # a verify block: 64 rows, tl.dot
    (2, 4, 2, False, jnp.float32, 3, False),  # Llama-style (no q/k norm), a short block, split-K
    (3, 16, 4, True, jnp.bfloat16, 2, False),
    (4, 1, 4, True, jnp.bfloat16, None, False),
    (5, 16, 4, True, jnp.float32, 2, True),  # a draft block: every valid slot sees every other
    (6, 8, 2, True, jnp.bfloat16, None, True),
]


@pytest.mark.parametrize("case", CACHED_CASES, ids=lambda c: f"seed{c[0]}-block{c[1]}-g{c[2]}{'-draft' * c[6]}")
@pytest.mark.slow
def test_cached_attention_kernel_equals_layer_reference(case):
    """``kernels_pallas.cached_block_attention`` (interpret mode) against the unfused layer path:
    ``project`` (norms, RoPE) + ``block_attention_reference`` + cache writes, rows at the start, the
    middle and the end of the cache, one with a short block. Drafter cases: not causal, and the caches
    come back untouched."""
    from kernels_pallas.block_attention.gpu import GpuConfig

    seed, block, groups, qk_norm, dtype, splits, drafter = case
    _check_cached_attention(seed, block, groups, qk_norm, dtype, drafter, GpuConfig(num_splits=splits))


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "capacity-chunks"])
@pytest.mark.parametrize("block", [1, 16])
def test_cached_attention_kernel_splits_of_the_context(block, balanced):
    """16-key tiles in 3 splits over a 128-key cache: rows with 0, 37 (3 tiles) and 127 or 112 keys
    (8 or 7 tiles) of context, dealt to the splits by the row's context (balanced: 1+1+1, 3+3+2 or
    3+3+1 tiles) or in fixed chunks of the capacity (3+0+0, 3+3+2, 3+3+1); both must be the
    reference's attention and its cache writes (the last split writes the block)."""
    from kernels_pallas.block_attention.gpu import GpuConfig

    _check_cached_attention(7, block, 4, True, jnp.float32, False,
                            GpuConfig(block_k=16, num_splits=3, balanced_splits=balanced))


@pytest.mark.parametrize("drafter", [False, True], ids=["verify", "draft"])
@pytest.mark.parametrize("members,stacked,block", [(2, False, 16), (4, False, 16), (4, True, 16), (2, True, 4)],
                         ids=["2", "4", "4-stacked", "2-stacked-short-block"])
@pytest.mark.slow
def test_cached_attention_kernel_members_per_program(members, stacked, block, drafter):
    """A program of several group members (one context-tile load for all of them; one online
    softmax each, or with ``stacked_members`` one over their stacked rows, a short block's rows
    repeated to 16) against the reference, and against one member per program: the caches bit for
    bit, the attention to an ulp (interpret mode on the CPU may fuse the members' ops otherwise)."""
    config = GpuConfig(block_k=16, num_splits=3, members_per_program=members, stacked_members=stacked)
    got = _check_cached_attention(9, block, 4, True, jnp.float32, drafter, config)
    single = _one_member_per_program(block, drafter)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(single[0]), rtol=1e-6, atol=1e-7)
    for a, b in zip(got[1:], single[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@functools.cache
def _one_member_per_program(block: int, drafter: bool):
    """``test_cached_attention_kernel_members_per_program``'s baseline, checked against the reference
    and computed once for the cases that share it."""
    config = GpuConfig(block_k=16, num_splits=3, members_per_program=1, stacked_members=False)
    return _check_cached_attention(9, block, 4, True, jnp.float32, drafter, config)


@pytest.mark.slow
def test_cached_attention_kernel_stacked_members_scaled_partials():
    """Stacked members reading float32 split-K partials times a row scale per slot (each slot's
    scale broadcast over its stacked rows) against the reference fed the scaled sum."""
    config = GpuConfig(block_k=16, num_splits=2, members_per_program=4, stacked_members=True)
    _check_cached_attention(10, 16, 4, True, jnp.bfloat16, False, config, parts=2, scaled=True)


def test_cached_attention_members_per_program_fill_one_wave():
    """The fewest members per program that fit a verify block's grid in one wave of resident
    programs (132 SMs x 2): Qwen3-8B heads (8 KV heads, groups of 4)."""
    from kernels_pallas.cached_attention.gpu import members_per_program

    cfg = GpuConfig(num_sms=132)
    assert members_per_program(1, 8, 4, 4, cfg) == 1  # context 512: 4 splits, 128 programs
    assert members_per_program(1, 8, 4, 18, cfg) == 4  # context 4096: 18 splits, 576 -> 144
    assert members_per_program(16, 8, 4, 2, cfg) == 4  # batch 16 at 512: 1024 -> 256
    assert members_per_program(4, 8, 4, 2, cfg) == 1  # 256 fit
    assert members_per_program(64, 8, 4, 2, cfg) == 4  # never more than the group
    assert members_per_program(64, 8, 4, 2, dataclasses.replace(cfg, members_per_program=2)) == 2
    with pytest.raises(ValueError, match="members_per_program"):
        members_per_program(1, 8, 4, 4, dataclasses.replace(cfg, members_per_program=3))


def _qwen3_8b_attention_args(batch: int, block: int, capacity: int = 1152, qkv=None) -> tuple:
    """``cached_block_attention``'s positional arguments as abstract bf16 shapes at Qwen3-8B's heads
    (8 KV heads, groups of 4, head_dim 128): qkv (or ``qkv`` given), the caches, starts, block
    lengths, the q / k norm weights and RoPE's inverse frequencies."""
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    cache = sd((batch, capacity, 8, 128), bf)
    return (sd((batch, block, 8, 6, 128), bf) if qkv is None else qkv, cache, cache, sd((batch,), jnp.int32),
            sd((batch,), jnp.int32), sd((128,), bf), sd((128,), bf), sd((64,), jnp.float32))


def test_cached_attention_stages_fit_two_programs_per_sm():
    """Pipelining stages: the most (<= 3) with which two programs fit an H200 SM's 228 KiB of shared
    memory, Qwen3-8B heads in bf16 (64-key tiles: 32 KiB of K/V per stage), where the grid needs two
    per SM; and the verify block of 4,096 tokens at batch 1 (144 programs of 4 stacked members, 64
    query rows) compiled with 2, a decode token with 3."""
    from kernels_pallas.cached_attention.gpu import fitted_stages

    cfg = GpuConfig(num_sms=132)
    fit = lambda held, dot, itemsize=2, cfg=cfg, programs=256: fitted_stages(  # noqa: E731
        cfg, programs=programs, block_k=64, head_dim=128, held_rows=held, dot_rows=dot, itemsize=itemsize)
    assert fit(16, 16) == 3  # a decode token (its 4 rows repeated to 16), or one member of a block
    assert fit(32, 32) == 3  # 2 stacked members: 2 x 108 KiB fit
    assert fit(64, 64) == 2  # 4 stacked members: 2 x 120 KiB do not
    assert fit(64, 16) == 3  # 4 members one after the other: the probabilities of one 16-row dot
    assert fit(16, 16, itemsize=4) == 1  # float32: 64 KiB per stage
    assert fit(16, 16, itemsize=4, programs=132) == 3  # one program per SM: nothing to fit
    assert fit(64, 64, cfg=dataclasses.replace(cfg, fit_stages=False)) == 3
    assert fit(64, 64, cfg=dataclasses.replace(cfg, ctas_per_sm=1)) == 3

    for block, config, stages in ((16, cfg, 2), (1, cfg, 3), (16, dataclasses.replace(cfg, fit_stages=False), 3)):
        fn = jax.jit(lambda *a, config=config: cached_block_attention(*a, eps=1e-6, qk_norm=True, interpret=False,
                                                                      config=config))
        text = lower_for(fn, _qwen3_8b_attention_args(1, block, 4608), "cuda").as_text()
        assert set(re.findall(r"num_stages = (\d+)", text)) == {str(stages)}


def test_long_blocks_take_the_unfused_path():
    """Compiled for a GPU, the fused kernel takes what fits one SM's shared memory by its estimate: a
    decode token and the draft / verify blocks of 16 at batch 1-32 (Qwen3-8B heads, bf16), not a
    prefill suffix or chunk of 128 or 512 slots over a cached prefix, which the unfused path (the
    prologue and ``block_attention``) then runs; and the Triton block attention takes a block of 16
    but not of 128 (the reference runs it). Interpreted, any block runs."""
    from kernels_pallas.block_attention.gpu import forward_fits
    from kernels_pallas.cached_attention.gpu import supports

    for batch in (1, 4, 16, 32):
        for capacity in (1152, 4224, 16384):
            for block in (1, 16):
                assert supports((batch, block, 8, 6, 128), capacity), (batch, block, capacity)
            for block in (128, 512):
                assert not supports((batch, block, 8, 6, 128), capacity), (batch, block, capacity)
                assert supports((batch, block, 8, 6, 128), capacity, compiled=False)
    assert forward_fits((1, 1, 16, 32, 128), 8, 2) and forward_fits((8, 3, 16, 32, 128), 8, 2)
    assert not forward_fits((1, 1, 128, 32, 128), 8, 2)


def test_cached_attention_tiles_by_batch(monkeypatch):
    """Context tiles chosen by the batch alone: 32 keys where the rows' KV heads (a decode token's
    programs before any split) reach a quarter of the SMs (8 KV heads on 132 SMs: batch >= 5), 64
    below, and the same for a decode token and a verify block of one batch, as the kernel plans
    them; with ``wide_batch_block_k=None`` always ``block_k``."""
    from kernels_pallas.cached_attention import gpu as cached_attention_gpu
    from kernels_pallas.cached_attention.gpu import batch_tiles

    cfg = GpuConfig(num_sms=132)
    tiles = lambda batch, cfg=cfg: batch_tiles(cfg, batch=batch, kv_heads=8).block_k  # noqa: E731
    assert [tiles(b) for b in (1, 2, 4, 5, 8, 16, 32)] == [64, 64, 64, 32, 32, 32, 32]
    assert tiles(16, dataclasses.replace(cfg, wide_batch_block_k=None)) == 64
    assert batch_tiles(cfg, batch=1, kv_heads=8) is cfg

    planned, plan = [], cached_attention_gpu.plan
    monkeypatch.setattr(cached_attention_gpu, "plan", lambda *a: planned.append(a[-1].block_k) or plan(*a))
    for batch, block in ((16, 1), (16, 16), (1, 1), (1, 16)):
        fn = jax.jit(lambda *a: cached_block_attention(*a, eps=1e-6, qk_norm=True, interpret=False, config=cfg))
        fn.trace(*_qwen3_8b_attention_args(batch, block))
    assert planned == [32, 32, 64, 64]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block", [1, 16])
@pytest.mark.slow
def test_cached_attention_kernel_sums_projection_partials(block, dtype):
    """The projection given as float32 split-K partials ``[parts, rows, ...]`` (a GEMM without its
    reduction kernel): the kernel sums them in order and rounds to the caches' dtype, so it must
    match the reference fed the same sum (a decode token, 3 partials and a padded row; a verify
    block, 2); bf16 partials are refused."""
    from kernels_pallas.block_attention.gpu import GpuConfig

    _check_cached_attention(3, block, 4, True, dtype, False, GpuConfig(num_splits=2), parts=3 if block == 1 else 2)


@pytest.mark.parametrize("parts", [0, 3], ids=["value", "partials"])
@pytest.mark.parametrize("block", [1, 16])
@pytest.mark.slow
def test_cached_attention_kernel_scales_rows(block, parts):
    """A row scale per slot (a folded input norm's ``rsqrt(mean(x^2) + eps)``): the kernel multiplies
    each slot's projection (or its partials' float32 sum) by it before rounding, as the reference
    fed the scaled projection; without it, the same call is off."""
    from kernels_pallas.block_attention.gpu import GpuConfig

    _check_cached_attention(8, block, 4, True, jnp.bfloat16, False, GpuConfig(num_splits=2), parts=parts,
                            scaled=True)


def _check_cached_attention(seed, block, groups, qk_norm, dtype, drafter, config, parts=0, scaled=False):
    from flax import nnx

    from dflash_jax.models.layers import Attention
    from dflash_jax.ops import attention as attention_ops
    from dflash_jax.ops.config import XLA
    from dflash_jax.ops.rope import rope_inv_freq
    from dflash_jax.runtime.serving_params import fuse_attention

    causal = write = not drafter
    head_dim, kv_heads, hidden, batch, capacity = 32, 2, 64, 3, 128
    attn = Attention(hidden, kv_heads * groups, kv_heads, head_dim, eps=1e-6, qk_norm=qk_norm, bias=False,
                     inv_freq=rope_inv_freq(head_dim, 1e4, None), dtype=dtype, rngs=nnx.Rngs(seed))
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    if qk_norm:  # weights away from 1, so a skipped or misplaced norm weight shows
        attn.q_norm.weight[...] = (1 + 0.3 * jax.random.normal(keys[3], (head_dim,))).astype(dtype)
        attn.k_norm.weight[...] = (1 + 0.3 * jax.random.normal(keys[4], (head_dim,))).astype(dtype)
    fuse_attention(attn)

    def reference(qkv, *args, **kw):  # the cached attention with the kernels off
        return attention_ops.cached_attention(
            qkv, *args, q_norm=attn.q_norm.weight[...] if qk_norm else None,
            k_norm=attn.k_norm.weight[...] if qk_norm else None, eps=1e-6, inv_freq=attn.inv_freq,
            num_heads=attn.num_heads, ops=XLA, **kw)
    x = jax.random.normal(keys[0], (batch, 1, block, hidden), dtype)
    k_cache = jax.random.normal(keys[1], (batch, capacity, kv_heads, head_dim), dtype)
    v_cache = jax.random.normal(keys[2], (batch, capacity, kv_heads, head_dim), dtype)
    starts = jnp.array([0, 37, capacity - block], jnp.int32)
    blk_lens = jnp.array([block, max(1, block - 3), block], jnp.int32)

    want = jax.jit(lambda *a: attn.attend_cached(*a, ops=XLA, causal=causal, write=write))(
        x, starts, k_cache, v_cache, blk_lens)
    qkv = attn._qkv(x[:, 0])
    row_scale = None
    if scaled:  # the reference fed the scaled sum, rounded once
        row_scale = jax.random.uniform(jax.random.PRNGKey(seed + 100), (batch, block), jnp.float32, 0.3, 3.0)
        want = jax.jit(lambda *a: reference(*a, row_scale=row_scale))(
            qkv, starts, k_cache, v_cache, blk_lens)
    if parts:  # x @ w as float32 partial products over slices of K, plus a padding row never read
        w = attn.qkv_proj[...]
        cut = np.linspace(0, hidden, parts + 1).astype(int)
        rows = jnp.concatenate([x[:, 0], jnp.ones_like(x[:1, 0])])
        qkv = jnp.stack([jnp.einsum("rtk,k...->rt...", rows[..., a:b], w[a:b], preferred_element_type=jnp.float32)
                         for a, b in zip(cut[:-1], cut[1:])])
        want = jax.jit(lambda *a: reference(functools.reduce(jnp.add, list(qkv))[:batch].astype(dtype), *a))(starts, k_cache, v_cache, blk_lens)
        if scaled:
            total = functools.reduce(jnp.add, list(qkv))[:batch] * row_scale[:, :, None, None, None]
            want = jax.jit(lambda *a: reference(total.astype(dtype), *a))(
                starts, k_cache, v_cache, blk_lens)
        with pytest.raises(ValueError, match="float32"):
            cached_block_attention(qkv.astype(jnp.bfloat16), k_cache, v_cache, starts, blk_lens, attn.q_norm.weight[...],
                                   attn.k_norm.weight[...], jnp.asarray(attn.inv_freq), eps=1e-6, qk_norm=qk_norm)
    ones = jnp.ones((head_dim,), dtype)
    got = jax.jit(lambda q, kc, vc: cached_block_attention(
        q, kc, vc, starts, blk_lens, attn.q_norm.weight[...] if qk_norm else ones,
        attn.k_norm.weight[...] if qk_norm else ones, jnp.asarray(attn.inv_freq), eps=1e-6,
        qk_norm=qk_norm, causal=causal, write=write, config=config, row_scale=row_scale))(qkv, k_cache, v_cache)
    assert_close(got[0][:, None], want[0], dtype)
    if scaled:
        unscaled = jax.jit(lambda q, kc, vc: cached_block_attention(
            q, kc, vc, starts, blk_lens, attn.q_norm.weight[...], attn.k_norm.weight[...], jnp.asarray(attn.inv_freq),
            eps=1e-6, qk_norm=qk_norm, config=config))(qkv, k_cache, v_cache)
        assert not np.allclose(np.asarray(unscaled[2], np.float32), np.asarray(got[2], np.float32), atol=0.1)
        with pytest.raises(ValueError, match="row_scale"):
            cached_block_attention(qkv, k_cache, v_cache, starts, blk_lens, attn.q_norm.weight[...],
                                   attn.k_norm.weight[...], jnp.asarray(attn.inv_freq), eps=1e-6, qk_norm=qk_norm,
                                   row_scale=row_scale[:, :1].astype(jnp.bfloat16))
    if drafter:  # and the bidirectional reference differs from the causal one
        causal_out = jax.jit(lambda *a: attn.attend_cached(*a, ops=XLA))(x, starts, k_cache, v_cache, blk_lens)[0]
        assert not np.allclose(np.asarray(causal_out, np.float32), np.asarray(want[0], np.float32), atol=1e-3)
        for got_cache, before in zip(got[1:], (k_cache, v_cache)):
            np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(before))
        return got
    for got_cache, want_cache, before in zip(got[1:], want[1:], (k_cache, v_cache)):
        assert_close(got_cache, want_cache, dtype)  # the block written at each row's start
        # and nothing else touched (row 1's context before its start, bit for bit)
        np.testing.assert_array_equal(np.asarray(got_cache)[1, :37], np.asarray(before)[1, :37])
    return got


@pytest.mark.slow
def test_cached_attention_kernel_lowers_for_gpus():
    """Triton IR for cuda, built on this CPU: Qwen3-8B heads, a decode token and verify blocks, and a
    decode token's projection as 8 float32 split-K partials (``ops.linear.single_row_partials``)."""
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    for qkv in (sd((1, 1, 8, 6, 128), bf), sd((1, 8, 8, 6, 128), bf), sd((1, 16, 8, 6, 128), bf),
                sd((8, 2, 1, 8, 6, 128), jnp.float32)):
        shapes = _qwen3_8b_attention_args(1, 1, qkv=qkv)
        # a block: also 4 members per program, one online softmax each or stacked
        for members, stacked in ((None, False), (4, False), (4, True)) if qkv.shape[-4] > 1 else ((None, False),):
            config = GpuConfig(members_per_program=members, stacked_members=stacked)
            fn = jax.jit(lambda *a: cached_block_attention(*a, eps=1e-6, qk_norm=True, interpret=False,
                                                           config=config))
            text = lower_for(fn, shapes, "cuda").as_text()
            assert "dflash_cached_attention" in text and "triton" in text


def test_identical_kernel_calls_share_one_lowering():
    """A model's layers call each kernel with the same shapes and settings: each kernel is traced and
    lowered (Triton IR for cuda, on this CPU) once, in a function every layer calls (XLA inlines the
    calls: the same kernels run), not once per layer. A call of other static settings (another eps)
    gets its own lowering."""
    qkv, k_cache, v_cache, *rest = _qwen3_8b_attention_args(1, 16)

    def layers(qkv, k_cache, v_cache, *rest, last_eps=1e-6):
        # inputs computed in the program, as a model's layers get them (a call on the program's own
        # arguments is lowered apart by JAX)
        outputs = []
        for layer in range(4):
            eps = last_eps if layer == 3 else 1e-6
            attn, k_cache, v_cache = cached_block_attention(qkv * (layer + 2), k_cache, v_cache, *rest, eps=eps,
                                                            qk_norm=True, interpret=False)
            outputs.append(attn)
        return outputs, k_cache, v_cache

    def triton_calls(**kw):
        text = lower_for(jax.jit(functools.partial(layers, **kw)), (qkv, k_cache, v_cache, *rest), "cuda").as_text()
        return text.count("custom_call @__gpu$xla.gpu.triton"), len(re.findall(r"\bcall @_cached_block_attention", text))

    assert triton_calls() == (1, 4)  # one lowering of the kernel, called by the 4 layers
    assert triton_calls(last_eps=1e-5) == (2, 4)


@pytest.mark.parametrize("hopper", [False, True])
def test_gpu_kernels_signal_dependents_on_hopper(monkeypatch, hopper):
    """On Hopper and later GPUs the cached-attention kernel issues
    ``griddepcontrol.launch_dependents`` (once per program, after its last read; Triton IR for
    cuda built on this CPU, the device check patched); elsewhere, and in interpret mode, it does
    not, and its results are unchanged (the other tests here run it in interpret mode)."""
    from kernels_pallas import _pdl

    monkeypatch.setattr(_pdl, "hopper_or_later", lambda: hopper)
    bf = jnp.bfloat16
    attention = jax.jit(lambda *a: cached_block_attention(*a, eps=1e-6, qk_norm=True, interpret=False))
    text = lower_for(attention, _qwen3_8b_attention_args(1, 1), "cuda").as_text()
    assert text.count("griddepcontrol.launch_dependents") == (1 if hopper else 0)
    h = jax.random.normal(jax.random.key(0), (1, 4096), bf)
    assert not _pdl.signals(interpret=True) and _pdl.signals(interpret=False) == hopper
    assert _pdl.signal_after(h, signal=False) is h  # no signal: the value itself
    with pytest.raises(ValueError, match="16- or 32-bit"):
        _pdl.signal_after(jnp.zeros((4,), jnp.int8), signal=True)
