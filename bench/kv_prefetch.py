"""A layer's K/V cache pulled into L2 beside its QKV matmul, before its attention reads it (a
prototype for ``sweep_decode_options.py``'s ``kv_prefetch`` variant).

At batch 1 the cached-attention kernel takes ~7.3 us per layer in the engine against ~5.4 us alone
with its layer's K/V in L2 (docs/benchmarks.md, thirteenth and twenty-third sessions): in the
engine 386 MB of weights stream through the 50 MB L2 between two reads of a layer's cache, so its
K/V tiles come from HBM, on the kernel's latency-bound chain. Here a Pallas Triton kernel of its own
loads the context's tiles (positions before ``starts``) with L2 eviction priority "last" once the
input norm is done, so that in the decode loop's CUDA graph (ordered by data flow) it runs beside the
QKV matmul, whose 50 MB would otherwise push normal-priority lines out before the attention.

The kernel returns zeros made from what it read; the layer adds them to its MLP output, so XLA keeps
it, the attention does not wait for it, and every output is unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dflash_jax import layers
from kernels_pallas._flash import triton_params

BLOCK_K = 64  # keys per program (the attention kernel's tile)
LANES = 16  # a program's zeros: a Triton tile is at least this long


def _kernel(start_ref, after_ref, k_ref, v_ref, o_ref, *, block_k: int, interpret: bool):
    tile = pl.program_id(1)
    live = tile * block_k < start_ref[()]
    keys = pl.ds(pl.multiple_of(tile * block_k, block_k), block_k)
    zero = after_ref[...].astype(jnp.float32) * 0.0  # ordered after the input norm that wrote ``after``

    @pl.when(live)
    def _():
        if interpret:
            k, v = k_ref[keys, :], v_ref[keys, :]
        else:
            from jax.experimental.pallas import triton as plt

            k = plt.load(k_ref.at[keys, :], eviction_policy="evict_last")
            v = plt.load(v_ref.at[keys, :], eviction_policy="evict_last")
        o_ref[...] = zero + (jnp.max(k.astype(jnp.float32)) + jnp.max(v.astype(jnp.float32))) * 0.0

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = zero


def prefetch_zero(k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array, after: jax.Array) -> jax.Array:
    """``k_cache, v_cache [1, capacity, kv_heads, head_dim]``, ``starts [1]``, ``after`` (any array of at
    least 16 elements) -> a float32 scalar zero that reads the caches' positions ``< starts[0]`` into L2
    (priority "last") once ``after`` is ready."""
    batch, capacity, kv_heads, head_dim = k_cache.shape
    if batch != 1 or capacity % BLOCK_K:
        raise ValueError(f"prefetch_zero takes one row and whole tiles, got caches {k_cache.shape}")
    interpret = jax.default_backend() != "gpu"
    tiles = capacity // BLOCK_K
    cache_spec = pl.BlockSpec((None, capacity, None, head_dim), lambda h, i: (0, 0, h, 0))
    zeros = pl.pallas_call(
        functools.partial(_kernel, block_k=BLOCK_K, interpret=interpret),
        grid=(kv_heads, tiles),
        in_specs=[pl.BlockSpec((None,), lambda h, i: (0,)), pl.BlockSpec((LANES,), lambda h, i: (0,)),
                  cache_spec, cache_spec],
        out_specs=pl.BlockSpec((None, None, LANES), lambda h, i: (h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((kv_heads, tiles, LANES), jnp.float32),
        compiler_params=triton_params(4, 1),
        interpret=interpret,
        name="kv_l2_prefetch",
    )(starts.astype(jnp.int32), after.reshape(-1)[:LANES], k_cache, v_cache)
    return jnp.max(zeros) * 0.0


def kv_prefetching_cached(self, h, delta, starts, k_cache, v_cache, blk_lens, *, attention_impl="xla", causal=True,
                          write=True):
    """``DecoderLayer.cached`` with a single decode token's K/V cache pulled into L2 beside its QKV
    matmul (``prefetch_zero``); other passes as they are."""
    fused = attention_impl == "pallas"
    h, x = layers.add_rms_norm(h, delta, self.input_layernorm, fused=fused)
    zero = None
    if k_cache.shape[0] == 1 and x.shape[2] == 1 and write and k_cache.shape[1] % BLOCK_K == 0:
        zero = prefetch_zero(k_cache, v_cache, starts, x)
    attn, k_cache, v_cache = self.self_attn.attend_cached(x, starts, k_cache, v_cache, blk_lens, impl=attention_impl,
                                                          causal=causal, write=write)
    h, mlp_out = self._residual_mlp(h, attn, fused)
    if zero is not None:
        mlp_out = mlp_out + zero.astype(mlp_out.dtype)
    return h, mlp_out, k_cache, v_cache
