"""Pallas kernels of dflash-jax.

``block_attention`` computes exactly ``dflash_jax.attention.block_attention_reference`` (blocks of
queries over a shared context prefix of per-block length plus the block's own K/V; GQA folded into
the query rows; float32 softmax; rows that see no key give zeros) with a Pallas forward kernel:

- ``jax.default_backend() == "gpu"``: ``block_attention_gpu`` (Pallas, Triton lowering, split-K);
- ``"tpu"``: ``block_attention_tpu`` (Mosaic TPU, scalar-prefetched lengths);
- ``"cpu"``: the GPU kernel in Pallas interpret mode (``backend="tpu"`` selects the TPU kernel in
  TPU interpret mode instead).

It is differentiable through ``jax.custom_vjp``: the forward kernel also returns the per-row
log-sum-exp, and the backward recomputes the probabilities from it without ever materialising the
dense ``[queries x keys]`` mask: on a GPU two Pallas kernels with the Triton lowering
(``block_attention_gpu_bwd``, FlashAttention-2 style; ``bwd="pallas"``), on TPU and in interpret
mode a blockwise jnp recomputation (``block_attention_bwd``; ``bwd="xla"``). The TPU backward is
therefore not a Pallas kernel.

``cached_block_attention`` (``cached_attention_gpu``) is the target's decode/verify attention fused
with what precedes it (q/k norms, RoPE, the cache write), a forward-only GPU kernel; its reference
is ``dflash_jax.layers.Attention.attend_unfused``.

``add_rms_norm`` (``rms_norm_gpu``) is a residual add and the RMSNorm that reads it in one kernel,
forward only (GPUs; interpret mode on the CPU); its reference is ``dflash_jax.layers.add_rms_norm``.

``layer_tail`` (``layer_tail_gpu``) is a decoder layer from the attention's output to the next
layer's QKV as one persistent Mosaic GPU kernel (Hopper), forward only, for blocks of up to 16 rows.
It has no interpret mode: off a GPU, and for shapes the kernel does not take, its jnp reference
``layer_tail_gpu.layer_tail_reference`` (same layout, same roundings) runs instead.
"""

from __future__ import annotations

import functools

import jax

from kernels_pallas._common import default_scale
from kernels_pallas.block_attention_bwd import block_attention_bwd, zero_cotangent
from kernels_pallas.cached_attention_gpu import cached_block_attention, cached_block_attention_supported
from kernels_pallas.rms_norm_gpu import add_rms_norm, add_rms_norm_supported

__all__ = ["add_rms_norm", "add_rms_norm_supported", "block_attention", "block_attention_fwd", "cached_block_attention",
           "cached_block_attention_supported", "layer_tail", "layer_tail_kernel_config"]


def layer_tail_kernel_config(rows: int, hidden: int, intermediate: int, qkv: int | None, *, attention: int,
                             dtype) -> object | None:
    """The ``layer_tail_gpu.LayerConfig`` the Mosaic kernel would run these shapes with on this
    platform (``rows`` already padded to a multiple of 8), or None where ``layer_tail`` runs its
    reference: off a GPU, for other dtypes than bfloat16, and for shapes the kernel does not take."""
    import jax.numpy as jnp

    from kernels_pallas import layer_tail_gpu

    if jax.default_backend() != "gpu" or jnp.dtype(dtype) != jnp.bfloat16:
        return None
    return layer_tail_gpu.config_for(rows, hidden, intermediate, qkv, attention=attention)


@functools.partial(jax.jit, static_argnames=("eps", "groups", "scale"))
def layer_tail(a, h, w_o, w_gu, w_d, w_qkv=None, k_cache=None, v_cache=None, meta=None, norm_tables=None,
               rope_table=None, *, eps: float, groups: int = 0, scale: float = 0.0):
    """A decoder layer from its attention output to the next layer's QKV: ``h1 = h + a @ w_o^T``,
    ``s = swiglu(norm(h1) @ w_gu^T)``, ``h2 = h1 + s @ w_d^T``, ``qkv = norm(h2) @ w_qkv^T`` with the
    norms' weights folded into ``w_gu`` and ``w_qkv`` (``layer_tail_gpu``: shapes, layout) -> ``[h1,
    s, h2]`` plus ``qkv`` if ``w_qkv`` is given; with ``k_cache`` (a decode token's rows, all copies
    of it) also the next layer's attention on that ``qkv``: ``attn, k_new, v_new``
    (``layer_tail_gpu.layer_tail``'s attention phase, ``tail_attention_gpu``). The Mosaic GPU
    kernel where ``layer_tail_kernel_config`` finds one (and, for the attention,
    ``layer_tail_gpu.attention_supported``), else the references.

    Jitted, so that the identical calls of a model's layers are traced and lowered once: a decode
    step of 36 layers otherwise lowers (and compiles) 36 copies of the kernel.
    """
    from kernels_pallas import layer_tail_gpu, tail_attention_gpu

    config = layer_tail_kernel_config(h.shape[0], h.shape[1], w_d.shape[1], None if w_qkv is None else w_qkv.shape[0],
                                      attention=w_o.shape[1], dtype=h.dtype)
    attention = (k_cache, v_cache, meta, norm_tables, rope_table)
    if k_cache is not None and config is not None and layer_tail_gpu.attention_supported(
            h.shape[0], w_qkv.shape[0], k_cache.shape[1], groups, k_cache.shape[2], k_cache.shape[0], config):
        outs = layer_tail_gpu.layer_tail(a, h, w_o, w_gu, w_d, w_qkv, *attention, eps=eps, groups=groups, scale=scale,
                                         config=config)
        return outs[:7]  # without the split merge's scratch
    if config is None:
        outs = layer_tail_gpu.layer_tail_reference(a, h, w_o, w_gu, w_d, w_qkv, eps=eps)
    else:
        outs = layer_tail_gpu.layer_tail(a, h, w_o, w_gu, w_d, w_qkv, eps=eps, config=config)
    if k_cache is None:
        return outs
    return outs + tail_attention_gpu.next_attention_reference(outs[3], *attention, groups=groups, scale=scale, eps=eps)


def _resolve(backend: str | None, interpret: bool | None):
    platform = jax.default_backend()
    if backend is None:
        backend = "tpu" if platform == "tpu" else "gpu"
    if backend not in ("gpu", "tpu"):
        raise ValueError(f"backend must be 'gpu' or 'tpu', got {backend!r}")
    if interpret is None:
        interpret = platform != backend
    return backend, bool(interpret)


def block_attention_fwd(
    q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, *, causal, scale=None,
    interpret=None, backend=None, config=None,
):
    """Forward only: ``(out, lse)``; ``lse`` is ``[batch, blocks, kv_heads, block * groups]``."""
    backend, interpret = _resolve(backend, interpret)
    if backend == "gpu":
        from kernels_pallas import block_attention_gpu as impl
    else:
        from kernels_pallas import block_attention_tpu as impl
    return impl.forward(
        q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens,
        causal=causal, scale=scale, interpret=interpret, config=config,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _attention(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal, scale, interpret,
               backend, config, bwd):
    out, _ = block_attention_fwd(
        q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal, scale=scale,
        interpret=interpret, backend=backend, config=config,
    )
    return out


def _attention_fwd(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal, scale, interpret,
                   backend, config, bwd):
    out, lse = block_attention_fwd(
        q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal, scale=scale,
        interpret=interpret, backend=backend, config=config,
    )
    return out, (q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, out, lse)


def _attention_bwd(causal, scale, interpret, backend, config, bwd, res, dout):
    q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, out, lse = res
    if bwd == "pallas":
        from kernels_pallas.block_attention_gpu_bwd import block_attention_bwd_pallas

        _, interpret = _resolve("gpu", interpret)
        grads = block_attention_bwd_pallas(
            q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, out, lse, dout,
            causal=causal, scale=scale, interpret=interpret, config=config,
        )
    elif bwd == "xla":
        grads = block_attention_bwd(
            q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, out, lse, dout,
            causal=causal, scale=scale,
        )
    else:
        raise ValueError(f"bwd must be 'xla' or 'pallas', got {bwd!r}")
    dq, dk_ctx, dv_ctx, dk_blk, dv_blk = grads
    return (dq, dk_ctx, dv_ctx, zero_cotangent(ctx_lens), dk_blk, dv_blk,
            zero_cotangent(blk_lens))


_attention.defvjp(_attention_fwd, _attention_bwd)


def block_attention(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    ctx_lens: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    blk_lens: jax.Array,
    *,
    causal: bool,
    scale: float | None = None,
    interpret: bool | None = None,
    backend: str | None = None,
    config=None,
    bwd: str | None = None,
) -> jax.Array:
    """``dflash_jax.attention.block_attention_reference`` as a Pallas kernel (differentiable).

    Args: as the reference (q ``[batch, blocks, block, q_heads, head_dim]``, k_ctx/v_ctx
    ``[batch, ctx, kv_heads, head_dim]``, ctx_lens/blk_lens ``[batch, blocks]`` int32, k_blk/v_blk
    ``[batch, blocks, block, kv_heads, head_dim]``), plus:
      interpret: run the kernel in Pallas interpret mode; default: when the kernel's backend is not
        the platform (so on the CPU).
      backend: "gpu" or "tpu" kernel; default from ``jax.default_backend()`` ("gpu" on CPU).
      config: a ``GpuConfig`` / ``TpuConfig`` of tile sizes (None: defaults).
      bwd: the backward: "pallas" (two Pallas kernels with the Triton lowering; the default when
        the GPU kernel runs compiled, i.e. on a GPU) or "xla" (blockwise jnp recomputation; the
        default on TPU and in interpret mode). Either may be asked for explicitly.
    """
    if bwd is None:
        resolved_backend, resolved_interpret = _resolve(backend, interpret)
        bwd = "pallas" if resolved_backend == "gpu" and not resolved_interpret else "xla"
    scale = default_scale(q.shape[-1], scale)
    return _attention(
        q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, bool(causal), scale, interpret,
        backend, config, bwd,
    )

