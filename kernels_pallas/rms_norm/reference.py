"""The pure-jnp reference of the add + RMSNorm kernel: transformers' RMSNorm numerics.

``dflash_jax.ops.norms`` runs it where the kernel is off, and every RMSNorm of the models is it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_scale(x: jax.Array, eps: float) -> jax.Array:
    """``x [..., dim]`` -> ``rsqrt(mean(x^2) + eps)`` float32 ``[..., 1]``: the factor ``rms_norm``
    normalises a row by."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF's RMSNorm numerics: normalise in float32, cast back, then scale by the weight."""
    return weight * (x.astype(jnp.float32) * row_scale(x, eps)).astype(x.dtype)


def add_rms_norm_reference(h: jax.Array, delta: jax.Array | None, weight: jax.Array,
                           eps: float) -> tuple[jax.Array, jax.Array]:
    """``(s, rms_norm(s))`` with ``s = h + delta`` (``delta`` None: ``s = h``), ``[..., hidden]`` each."""
    s = h if delta is None else h + delta
    return s, rms_norm(s, weight, eps)
