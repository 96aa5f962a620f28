"""RMSNorm with transformers' numerics, the residual add that precedes it, and a norm folded into a weight.

No kernel: XLA fuses the residual add, the sum of squares and the scale with the split-K sums and
elementwise ops around them, which measured as fast as a one-program-per-row Pallas kernel of the
add and the norm, on Triton and on Mosaic GPU, in whole decode steps (docs/performance.md, designs
tried and rejected).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["add_rms_norm", "fold_norm", "rms_norm", "row_scale"]


def row_scale(x: jax.Array, eps: float) -> jax.Array:
    """``x [..., dim]`` -> ``rsqrt(mean(x^2) + eps)`` float32 ``[..., 1]``: the factor ``rms_norm``
    normalises a row by."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """transformers' RMSNorm numerics: normalise in float32, cast back, then scale by the weight."""
    return weight * (x.astype(jnp.float32) * row_scale(x, eps)).astype(x.dtype)


def add_rms_norm(h: jax.Array, delta: jax.Array | None, weight: jax.Array,
                 eps: float) -> tuple[jax.Array, jax.Array]:
    """A residual add and the norm that reads it: ``(s, rms_norm(s))`` with ``s = h + delta``
    (``delta`` None: ``s = h``), ``[..., hidden]`` each. The decoder layers defer each residual add
    to the norm that reads it (a layer returns ``(h, delta)``), so that XLA fuses the add with the
    norm and with the sum of the matmul partials before it."""
    s = h if delta is None else h + delta
    return s, rms_norm(s, weight, eps)


def fold_norm(norm_weight: jax.Array, w: jax.Array) -> jax.Array:
    """``w [K, ...]`` with the RMSNorm weight ``[K]`` before it folded in (same shape), in float32 and
    rounded to ``w``'s dtype."""
    scale = norm_weight.astype(jnp.float32).reshape((-1,) + (1,) * (w.ndim - 1))
    return (scale * w.astype(jnp.float32)).astype(w.dtype)
