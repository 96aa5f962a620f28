"""The block-attention kernel (README.md beside this file): dispatch by backend, and its backward.

``block_attention`` computes exactly ``reference.block_attention_reference`` (blocks
of queries over a shared context prefix of per-block length plus the block's own K/V; GQA folded
into the query rows; float32 softmax; rows that see no key give zeros) with a Pallas forward kernel:

- ``jax.default_backend() == "gpu"``: ``gpu.py`` (Pallas, Triton lowering, split-K), or with
  ``lowering="mosaic"`` ``mosaic_gpu.py`` (Pallas, Mosaic GPU lowering: TMA and ``wgmma``, split-K)
  where it takes the shapes (16-bit, head_dim 64 or 128, whole context tiles);
- ``"tpu"``: ``tpu.py`` (Mosaic TPU, scalar-prefetched lengths);
- ``"cpu"``: the GPU kernel in Pallas interpret mode (``backend="tpu"`` selects the TPU kernel in
  TPU interpret mode instead; ``lowering="mosaic"`` the Mosaic GPU kernel in its interpret mode,
  jax >= 0.11).

It is differentiable through ``jax.custom_vjp``: the forward kernel also returns the per-row
log-sum-exp, and the backward recomputes the probabilities from it without ever materialising the
dense ``[queries x keys]`` mask: on a GPU two Pallas kernels, FlashAttention-2 style (``bwd="pallas"``),
with the Triton lowering (``gpu_bwd.py``) or with ``lowering="mosaic"`` the Mosaic GPU lowering
(``mosaic_gpu_bwd.py``: TMA and ``wgmma``, where it takes the shapes), on TPU and in interpret mode a blockwise jnp
recomputation (``reference_bwd.py``; ``bwd="xla"``).
"""

from __future__ import annotations

import functools

import jax

from kernels_pallas._common import default_scale
from kernels_pallas.block_attention.reference_bwd import block_attention_bwd, zero_cotangent

__all__ = ["block_attention", "block_attention_fwd"]


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
    interpret=None, backend=None, config=None, lowering="triton",
):
    """Forward only: ``(out, lse)``; ``lse`` is ``[batch, blocks, kv_heads, block * groups]``."""
    if lowering not in ("triton", "mosaic"):
        raise ValueError(f"lowering must be 'triton' or 'mosaic', got {lowering!r}")
    backend, interpret = _resolve(backend, interpret)
    if lowering == "mosaic" and config is not None:
        from kernels_pallas.block_attention.mosaic_gpu_bwd import MosaicBwdConfig

        config = None if isinstance(config, MosaicBwdConfig) else config  # the backward's, not the forward's
    if backend == "gpu" and lowering == "mosaic":
        from kernels_pallas.block_attention import mosaic_gpu

        mosaic_config = config if isinstance(config, mosaic_gpu.MosaicConfig) else None
        if mosaic_gpu.runs_here(q.shape[-1], k_ctx.shape[1], k_ctx.dtype, mosaic_config or mosaic_gpu.DEFAULT_CONFIG) \
                and q.dtype == k_ctx.dtype:
            return mosaic_gpu.forward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal, scale=scale,
                                      interpret=interpret, config=mosaic_config)
        config = None if mosaic_config is not None else config  # the Triton kernel's defaults
    if backend == "gpu":
        from kernels_pallas.block_attention import gpu as impl
    else:
        from kernels_pallas.block_attention import tpu as impl
    return impl.forward(
        q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens,
        causal=causal, scale=scale, interpret=interpret, config=config,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12, 13))
def _attention(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal, scale, interpret,
               backend, config, bwd, lowering):
    out, _ = block_attention_fwd(
        q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal, scale=scale,
        interpret=interpret, backend=backend, config=config, lowering=lowering,
    )
    return out


def _attention_fwd(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal, scale, interpret,
                   backend, config, bwd, lowering):
    out, lse = block_attention_fwd(
        q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal, scale=scale,
        interpret=interpret, backend=backend, config=config, lowering=lowering,
    )
    return out, (q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, out, lse)


def _attention_bwd(causal, scale, interpret, backend, config, bwd, lowering, res, dout):
    q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, out, lse = res
    mosaic_bwd = None
    if bwd == "pallas" and lowering == "mosaic" and _resolve(backend, interpret)[0] == "gpu":
        from kernels_pallas.block_attention import mosaic_gpu_bwd

        if mosaic_gpu_bwd.runs_here(q.shape[-1], k_ctx.shape[1], k_ctx.dtype) and q.dtype == k_ctx.dtype:
            mosaic_bwd = mosaic_gpu_bwd
    if mosaic_bwd is not None:
        _, interpret = _resolve("gpu", interpret)
        grads = mosaic_bwd.backward(
            q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, out, lse, dout, causal=causal, scale=scale,
            interpret=interpret, config=config if isinstance(config, mosaic_bwd.MosaicBwdConfig) else None,
        )
    elif bwd == "pallas":
        from kernels_pallas.block_attention.gpu import GpuConfig

        config = config if isinstance(config, GpuConfig) else None  # a Mosaic GPU config is not the Triton kernels'
        from kernels_pallas.block_attention.gpu_bwd import block_attention_bwd_pallas

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


def block_attention(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, ctx_lens: jax.Array, k_blk: jax.Array,
    v_blk: jax.Array, blk_lens: jax.Array, *, causal: bool, scale: float | None = None,
    interpret: bool | None = None, backend: str | None = None, config=None, bwd: str | None = None,
    lowering: str = "triton") -> jax.Array:
    """``reference.block_attention_reference`` as a Pallas kernel (differentiable).

    Args: as the reference (q ``[batch, blocks, block, q_heads, head_dim]``, k_ctx/v_ctx
    ``[batch, ctx, kv_heads, head_dim]``, ctx_lens/blk_lens ``[batch, blocks]`` int32, k_blk/v_blk
    ``[batch, blocks, block, kv_heads, head_dim]``), plus:
      interpret: run the kernel in Pallas interpret mode; default: when the kernel's backend is not
        the platform (so on the CPU).
      backend: "gpu" or "tpu" kernel; default from ``jax.default_backend()`` ("gpu" on CPU).
      config: a ``GpuConfig`` / ``TpuConfig`` / ``mosaic_gpu.MosaicConfig`` of tile sizes (None:
        defaults).
      lowering: the GPU kernels' Pallas lowering: "triton" (``gpu.py``) or "mosaic"
        (``mosaic_gpu.py`` where it takes the shapes and the platform runs it, else ``gpu.py``).
      bwd: the backward: "pallas" (two Pallas kernels in ``lowering``'s lowering: Triton's
        ``gpu_bwd.py``, or Mosaic GPU's ``mosaic_gpu_bwd.py`` where it takes the shapes, whose
        ``MosaicBwdConfig`` ``config`` may also be; the default when the GPU kernel runs compiled, i.e.
        on a GPU) or "xla" (blockwise jnp recomputation; the default on TPU and in interpret mode).
        Either may be asked for explicitly.
    """
    if bwd is None:
        resolved_backend, resolved_interpret = _resolve(backend, interpret)
        bwd = "pallas" if resolved_backend == "gpu" and not resolved_interpret else "xla"
    scale = default_scale(q.shape[-1], scale)
    return _attention(
        q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, bool(causal), scale, interpret,
        backend, config, bwd, lowering,
    )

