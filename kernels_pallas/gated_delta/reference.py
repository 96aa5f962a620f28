"""The kernel's reference: the chunked gated delta rule in jnp, the kernel's own arithmetic (the
unit lower-triangular inverse by repeated squaring, as a Triton program computes it) over inputs
already L2-normalised, heads-major, in float32. ``dflash_jax.ops.gated_delta`` is the model's
(sequence-major, any length, held to transformers); both compute the same function."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + a)^-1`` for strictly lower-triangular ``a [..., c, c]``: ``a`` is nilpotent, so the
    inverse is ``(I - a)(I + a^2)(I + a^4)...`` up to ``a^c`` (log2(c) squarings, matmuls only)."""
    c = a.shape[-1]
    eye = jnp.eye(c, dtype=a.dtype)
    inv = eye - a
    power = a @ a
    n = 2
    while n < c:
        inv = inv @ (eye + power)
        power = power @ power
        n *= 2
    return inv


def chunk_gated_delta_reference(q, k, v, g, beta, state, *, chunk: int):
    """``q, k [batch, heads, seq, dk]`` (normalised), ``v [batch, heads, seq, dv]``, ``g, beta
    [batch, heads, seq]``, ``state [batch, heads, dk, dv]``, all float32, ``seq`` a multiple of
    ``chunk`` -> ``(o [batch, heads, seq, dv], final state)``."""
    b, h, seq, dk = k.shape
    n = seq // chunk
    scale = dk ** -0.5
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)

    def body(s, i):
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=2)  # noqa: E731
        qi, ki, vi, gi, bi = sl(q) * scale, sl(k), sl(v), sl(g), sl(beta)
        gc = jnp.cumsum(gi, axis=-1)
        decay = jnp.where(lower, jnp.exp(jnp.where(lower, gc[..., :, None] - gc[..., None, :], 0.0)), 0.0)
        kb = ki * bi[..., None]
        t = unit_lower_inverse(jnp.where(strict, (kb @ jnp.swapaxes(ki, -1, -2)) * decay, 0.0))
        u = t @ (vi * bi[..., None])
        w = t @ (kb * jnp.exp(gc)[..., None])
        v_new = u - w @ s
        scores = jnp.where(lower, (qi @ jnp.swapaxes(ki, -1, -2)) * decay, 0.0)
        o = (qi * jnp.exp(gc)[..., None]) @ s + scores @ v_new
        last = jnp.sum(gi, axis=-1, keepdims=True)
        s = s * jnp.exp(last)[..., None] + jnp.swapaxes(ki * jnp.exp(last - gc)[..., None], -1, -2) @ v_new
        return s, o

    state, o = jax.lax.scan(body, state, jnp.arange(n))
    return jnp.moveaxis(o, 0, 2).reshape(b, h, seq, -1), state
