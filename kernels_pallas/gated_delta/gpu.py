"""The chunked gated delta rule as one Pallas program per (row, value head) (Triton lowering on GPUs,
interpret mode elsewhere): the state ``[dk, dv]`` stays in registers while the program walks the
sequence a chunk at a time, each chunk a few ``[chunk, chunk]`` and ``[chunk, d]`` matmuls (the WY
form; the triangular inverse by repeated squaring, matmuls only). XLA runs the same rule as a
``lax.scan`` whose every chunk is a dozen kernels and a round trip of the state through memory.

Forward here; the backward is the reference's (``jax.vjp`` of ``reference.py`` under
``jax.custom_vjp``): prompts and verify blocks need no gradient, training through a hybrid target
takes none either (the target is frozen).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._flash import triton_params
from kernels_pallas.gated_delta.reference import chunk_gated_delta_reference

NUM_WARPS = 8
CHUNK = 64


def chunk_gated_delta_supported(dk: int, dv: int, chunk: int = CHUNK) -> bool:
    """Whether the compiled kernel takes these dims (Triton tiles: powers of two, >= 16)."""
    ok = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return jax.default_backend() == "gpu" and ok(dk) and ok(dv) and ok(chunk)


def _dot(a, b, *, ta: bool = False, tb: bool = False):
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    # IEEE float32 (not TF32): the state carries every chunk's rounding into the next.
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, s_ref, *, chunk: int, n_chunks: int, scale: float):
    rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    lower, strict = rows >= cols, rows > cols
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)

    def body(i, s):
        at = pl.ds(i * chunk, chunk)
        qi = q_ref[at, :] * scale
        ki, vi = k_ref[at, :], v_ref[at, :]
        gi, bi = g_ref[at], b_ref[at]
        gc = jnp.sum(jnp.where(lower, gi[None, :], 0.0), axis=1)  # the cumulative sum within the chunk
        decay = jnp.where(lower, jnp.exp(jnp.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)
        kb = ki * bi[:, None]
        a = jnp.where(strict, _dot(kb, ki, tb=True) * decay, 0.0)
        t, power, n = eye - a, _dot(a, a), 2
        while n < chunk:  # static: log2(chunk) squarings
            t = _dot(t, eye + power)
            power = _dot(power, power)
            n *= 2
        u = _dot(t, vi * bi[:, None])
        w = _dot(t, kb * jnp.exp(gc)[:, None])
        v_new = u - _dot(w, s)
        scores = jnp.where(lower, _dot(qi, ki, tb=True) * decay, 0.0)
        o_ref[at, :] = (_dot(qi * jnp.exp(gc)[:, None], s) + _dot(scores, v_new)).astype(o_ref.dtype)
        last = jnp.sum(gi)
        return s * jnp.exp(last) + _dot(ki * jnp.exp(last - gc)[:, None], v_new, ta=True)

    s_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(jnp.float32))


def _forward(q, k, v, g, beta, state, *, chunk: int, interpret: bool):
    b, h, seq, dk = k.shape
    dv = v.shape[-1]
    seq_block = lambda d: pl.BlockSpec((None, None, seq, d), lambda i, j: (i, j, 0, 0))  # noqa: E731
    vec = pl.BlockSpec((None, None, seq), lambda i, j: (i, j, 0))
    mat = pl.BlockSpec((None, None, dk, dv), lambda i, j: (i, j, 0, 0))
    return pl.pallas_call(
        functools.partial(_kernel, chunk=chunk, n_chunks=seq // chunk, scale=dk ** -0.5),
        grid=(b, h),
        in_specs=[seq_block(dk), seq_block(dk), seq_block(dv), vec, vec, mat],
        out_specs=[seq_block(dv), mat],
        out_shape=[jax.ShapeDtypeStruct((b, h, seq, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)],
        compiler_params=triton_params(NUM_WARPS, 1),
        interpret=interpret,
        name="dflash_chunk_gated_delta",
    )(q, k, v, g, beta, state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _chunked(q, k, v, g, beta, state, chunk, interpret):
    return _forward(q, k, v, g, beta, state, chunk=chunk, interpret=interpret)


def _chunked_fwd(q, k, v, g, beta, state, chunk, interpret):
    return _forward(q, k, v, g, beta, state, chunk=chunk, interpret=interpret), (q, k, v, g, beta, state)


def _chunked_bwd(chunk, interpret, residuals, cotangents):
    _, vjp = jax.vjp(functools.partial(chunk_gated_delta_reference, chunk=chunk), *residuals)
    return vjp(cotangents)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunk_gated_delta(q, k, v, g, beta, state, *, chunk: int = CHUNK, interpret: bool | None = None):
    """``chunk_gated_delta_reference`` by the kernel: ``q, k [batch, heads, seq, dk]`` (normalised),
    ``v [batch, heads, seq, dv]``, ``g, beta [batch, heads, seq]``, ``state [batch, heads, dk, dv]``
    (float32; ``seq`` a multiple of ``chunk``) -> ``(o, final state)`` float32."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if k.shape[2] % chunk:
        raise ValueError(f"seq {k.shape[2]} is not a multiple of the chunk {chunk}")
    args = [x.astype(jnp.float32) for x in (q, k, v, g, beta, state)]
    return _chunked(*args, chunk, interpret)
