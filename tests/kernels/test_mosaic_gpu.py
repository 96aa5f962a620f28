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
from kernels_pallas.cached_attention.mosaic_gpu import MosaicConfig, decode_attention, plan
from kernels_pallas.rms_norm import mosaic_gpu as norm_mgpu
from kernels_pallas.rms_norm.reference import add_rms_norm_reference
from lowering import lower_for

interpreted = pytest.mark.skipif(not mosaic_interpret_available(),
                                 reason="Mosaic GPU's interpret mode needs jax >= 0.11")
sd = jax.ShapeDtypeStruct


def normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def attention_args(batch, block, heads, kv_heads, head_dim, capacity, starts, blk_lens, *, dtype=jnp.bfloat16,
                   seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = normal(ks[0], (batch, block, heads, head_dim), dtype)
    k_blk, v_blk = (normal(k, (batch, block, kv_heads, head_dim), dtype) for k in ks[1:3])
    k_cache, v_cache = (normal(k, (batch, capacity, kv_heads, head_dim), dtype) for k in ks[3:5])
    return (q, k_blk, v_blk, k_cache, v_cache, jnp.asarray(starts, jnp.int32), jnp.asarray(blk_lens, jnp.int32))


def reference(q, k_blk, v_blk, k_cache, v_cache, starts, blk_lens, *, causal):
    return block_attention_reference(q[:, None], k_cache, v_cache, starts[:, None], k_blk[:, None], v_blk[:, None],
                                     blk_lens[:, None], causal=causal)[:, 0]


# -- lowering for CUDA (any JAX) -------------------------------------------------------------------


@pytest.mark.parametrize("batch,block,capacity", [(1, 1, 32768), (8, 16, 4096), (32, 1, 1024)])
def test_decode_attention_lowers_for_cuda(batch, block, capacity):
    """Qwen3-8B heads in bf16: a decode token over a 32k cache (16 splits), a verify block of 64 query
    rows, a wide batch (no split): the Pallas Mosaic GPU lowering accepts every layout and copy."""
    shapes = [sd(x.shape, x.dtype) for x in attention_args(batch, block, 32, 8, 128, 128, [0] * batch,
                                                              [block] * batch)]
    shapes[3] = shapes[4] = sd((batch, capacity, 8, 128), jnp.bfloat16)
    fn = jax.jit(lambda *a: decode_attention(*a, causal=True, interpret=False))
    assert "mosaic_gpu" in lower_for(fn, shapes, "cuda").as_text()


@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_lowers_for_cuda(with_delta):
    fn = jax.jit(lambda h, d, w: norm_mgpu.add_rms_norm(h, d, w, eps=1e-6, interpret=False))
    delta = sd((16, 4096), jnp.bfloat16) if with_delta else None
    assert "mosaic_gpu" in lower_for(fn, (sd((16, 4096), jnp.bfloat16), delta, sd((4096,), jnp.bfloat16)),
                                     "cuda").as_text()


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
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_rms_norm_interpreted_equals_reference(dtype):
    """Three rows with a delta, two without: the sum bit for bit, the norm within a rounding of the
    dtype (the kernel sums the squares in its own order)."""
    ks = jax.random.split(jax.random.key(0), 3)
    weight = (1 + 0.2 * normal(ks[2], (384,), jnp.float32)).astype(dtype)
    for h, delta in ((normal(ks[0], (3, 384), dtype), normal(ks[1], (3, 384), dtype)),
                     (normal(ks[0], (2, 384), dtype), None)):
        s, y = norm_mgpu.add_rms_norm(h, delta, weight, eps=1e-6, interpret=True)
        s_want, y_want = add_rms_norm_reference(h, delta, weight, 1e-6)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s_want))
        ulp = 2**-7 if dtype == jnp.bfloat16 else 2**-21
        largest = float(jnp.max(jnp.abs(y_want.astype(jnp.float32))))
        assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_want.astype(jnp.float32)))) <= largest * ulp


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False], ids=["verify", "draft"])
def test_decode_attention_interpreted_equals_reference(causal):
    """Two rows (a context of 100 positions over two splits' balanced tiles, and none), GQA 4 / 2
    heads of 64, a block of 3 with one row's block one short; then a decode token of 4 / 1 heads of
    128 (one query tile of 4 real rows)."""
    for shape, starts, blk_lens in (((2, 3, 4, 2, 64, 192), [100, 0], [3, 2]),
                                    ((1, 1, 4, 1, 128, 128), [77], [1])):
        args = attention_args(*shape, starts, blk_lens, seed=len(starts))
        got = decode_attention(*args, causal=causal, config=MosaicConfig(splits=2), interpret=True)
        want = reference(*args, causal=causal)
        assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))) < 2e-2, shape


@interpreted
@pytest.mark.slow
def test_cached_attention_on_the_mosaic_lowering_equals_reference():
    """``ops.attention.cached_attention`` with ``gpu_lowering="mosaic"``: the raw fused projection
    through XLA's q/k norms, RoPE and cache write around the Mosaic GPU kernel (interpreted), against
    the XLA reference: the attention and both caches."""
    batch, block, kv_heads, groups, head_dim, capacity = 2, 2, 1, 2, 64, 128
    ks = jax.random.split(jax.random.key(1), 5)
    qkv = normal(ks[0], (batch, block, kv_heads, groups + 2, head_dim), jnp.bfloat16)
    k_cache, v_cache = (normal(k, (batch, capacity, kv_heads, head_dim), jnp.bfloat16) for k in ks[1:3])
    starts, blk_lens = jnp.array([70, 5], jnp.int32), jnp.array([2, 1], jnp.int32)
    norms = [(1 + 0.2 * normal(k, (head_dim,), jnp.float32)).astype(jnp.bfloat16) for k in ks[3:5]]
    inv_freq = tuple(float(f) for f in rope_inv_freq(head_dim, 1e6, None))

    def run(ops):
        return attention_ops.cached_attention(qkv, starts, k_cache, v_cache, blk_lens, q_norm=norms[0],
                                              k_norm=norms[1], eps=1e-6, inv_freq=inv_freq,
                                              num_heads=kv_heads * groups, ops=ops)

    got, want = run(OpsConfig(attention="pallas", gpu_lowering="mosaic")), run(XLA)
    assert float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - want[0].astype(jnp.float32)))) < 2e-2
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
