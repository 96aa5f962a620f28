"""RMSNorm with transformers' numerics, the residual add fused with it, and a norm folded into a weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.ops.config import OpsConfig
from dflash_jax.sharding import shard_kernel
from kernels_pallas.rms_norm.reference import add_rms_norm_reference, rms_norm, row_scale

__all__ = ["add_rms_norm", "fold_norm", "rms_norm", "row_scale"]


def add_rms_norm(h: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float, *,
                 ops: OpsConfig) -> tuple[jax.Array, jax.Array]:
    """A residual add and the norm that reads it: ``s = h + delta`` (``delta`` None: ``s = h``) and
    ``rms_norm(s)``, both ``[..., hidden]``.

    With the kernels on: one Pallas kernel (``kernels_pallas.rms_norm``, forward only:
    inference; its Mosaic GPU version with ``ops.gpu_lowering == "mosaic"``) where the platform and
    width allow, instead of the three XLA kernels this is otherwise at batch 1.
    """
    if ops.kernels and weight.dtype == h.dtype:
        if ops.mosaic:
            from kernels_pallas.rms_norm import mosaic_gpu

            if mosaic_gpu.add_rms_norm_supported(h.shape[-1], h.dtype):
                return _sharded_add_rms_norm(mosaic_gpu.add_rms_norm, h, delta, weight, eps)
        from kernels_pallas.rms_norm import add_rms_norm as kernel_add_rms_norm, add_rms_norm_supported

        if add_rms_norm_supported(h.shape[-1]):
            return _sharded_add_rms_norm(kernel_add_rms_norm, h, delta, weight, eps)
    return add_rms_norm_reference(h, delta, weight, eps)


def _sharded_add_rms_norm(kernel_add_rms_norm, h, delta, weight, eps):
    """``kernel_add_rms_norm(h, delta, weight, eps=eps)`` per device under a kernel mesh."""
    rows = ("batch",) + (None,) * (h.ndim - 1)  # per device: its rows, the whole width
    if delta is None:
        kernel = lambda h, w: kernel_add_rms_norm(h, None, w, eps=eps)  # noqa: E731
        return shard_kernel(kernel, (rows, (None,)), (rows, rows))(h, weight)
    kernel = lambda h, d, w: kernel_add_rms_norm(h, d, w, eps=eps)  # noqa: E731
    return shard_kernel(kernel, (rows, rows, (None,)), (rows, rows))(h, delta, weight)


def fold_norm(norm_weight: jax.Array, w: jax.Array) -> jax.Array:
    """``w [K, ...]`` with the RMSNorm weight ``[K]`` before it folded in (same shape), in float32 and
    rounded to ``w``'s dtype."""
    scale = norm_weight.astype(jnp.float32).reshape((-1,) + (1,) * (w.ndim - 1))
    return (scale * w.astype(jnp.float32)).astype(w.dtype)
