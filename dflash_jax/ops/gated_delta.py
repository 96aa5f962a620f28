"""Gated DeltaNet's token mixing (Qwen3.5 / Qwen3-Next linear attention): the causal depthwise
convolution with its carried state, and the gated delta rule in its chunked form (prompts, training,
verify blocks) and its recurrent form (one token).

The gated delta rule keeps one state ``S [dk, dv]`` per value head. For each token, with ``q, k``
L2-normalised, decay ``alpha = exp(g)`` and write strength ``beta``:

    S <- alpha * S
    S <- S + k (beta * (v - S^T k))^T        (the delta rule: replace what S recalls for k by v)
    o  = S^T (q / sqrt(dk))

A token with ``g = 0`` and ``beta = 0`` leaves the state exactly unchanged (a decay of 1, nothing
written) in either form: the padding of a prompt, the slots of a block past a row's length, and
the rejected drafts of a verify block are masked that way, so the state after exactly ``n`` tokens
of a block is the same computation as the state after the whole block with the rest masked.

Everything here is pure jnp in float32, written against transformers' torch fallbacks
(``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn``). The
chunk's triangular inverse is taken by repeated squaring (``unit_lower_inverse``: a handful of
batched matmuls) where transformers substitutes row by row (a chunk's worth of sequential steps,
each several GPU kernels): the same matrix, rounded differently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.ops.config import XLA, OpsConfig
from kernels_pallas.gated_delta.reference import unit_lower_inverse

DEFAULT_CHUNK = 64  # the chunk length of transformers' and fla's chunked kernels


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis (fla's and transformers' l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def conv_window(x: jax.Array, state: jax.Array) -> jax.Array:
    """The convolution's inputs: the carried ``state [batch, kernel - 1, channels]`` (the inputs
    before ``x``; zeros at the start), then ``x [batch, seq, channels]`` -> ``[batch, kernel - 1 +
    seq, channels]``. A verify block keeps it: its prefixes' states are slices of it."""
    return jnp.concatenate([state.astype(x.dtype), x], axis=1)


def causal_conv1d(window: jax.Array, weight: jax.Array) -> jax.Array:
    """The depthwise causal convolution, then SiLU, over a ``conv_window`` ``[batch, kernel - 1 +
    seq, channels]`` with ``weight [kernel, channels]`` -> ``[batch, seq, channels]``.

    Output ``t`` is ``sum_j weight[j] * window[t + j]``: torch's ``conv1d`` with ``kernel - 1``
    zeros of left padding, as transformers runs it.
    """
    kernel = weight.shape[0]
    seq = window.shape[1] - (kernel - 1)
    out = sum(window[:, j:j + seq].astype(jnp.float32) * weight[j].astype(jnp.float32) for j in range(kernel))
    return jax.nn.silu(out).astype(window.dtype)


def conv_state_after(window: jax.Array, lens: jax.Array, width: int) -> jax.Array:
    """The convolution state after the first ``lens [batch]`` tokens of a ``conv_window`` (``width =
    kernel - 1`` carried inputs, then the tokens'): its ``width`` inputs before slot ``width + lens``,
    per row -> ``[batch, width, channels]``."""
    return jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, width, axis=0))(window, lens)


def mask_tail(g: jax.Array, beta: jax.Array, lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``g, beta [batch, seq, heads]`` with the slots at or past ``lens [batch]`` set to 0: those
    tokens then leave the state unchanged."""
    keep = (jnp.arange(g.shape[1])[None, :] < lens[:, None])[..., None]
    return jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)


def chunk_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
    *, chunk: int = DEFAULT_CHUNK, normalize_qk: bool = True, ops: OpsConfig = XLA,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a sequence, a chunk at a time (the WY form: one triangular inverse
    and a few matmuls per chunk, the state carried between chunks).

    ``q, k [batch, seq, heads, dk]`` (heads already repeated to the value heads), ``v [batch, seq,
    heads, dv]``, ``g, beta [batch, seq, heads]``, ``state [batch, heads, dk, dv]`` float32 ->
    ``(o [batch, seq, heads, dv]`` in ``v``'s dtype, the final state float32). ``normalize_qk``:
    L2-normalise q and k first (Qwen3.5 always does). With the kernels on (``ops``) and dims it
    takes, the Pallas kernel (``kernels_pallas.gated_delta``); else this function's jnp.
    """
    out_dtype = v.dtype
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    batch, seq, heads, dk = k.shape
    dv = v.shape[-1]
    if ops.kernels:
        from kernels_pallas.gated_delta import chunk_gated_delta, chunk_gated_delta_supported

        if chunk_gated_delta_supported(dk, dv, chunk):
            return _by_kernel(chunk_gated_delta, q, k, v, g, beta, state, chunk, out_dtype)
    chunk = min(chunk, seq)
    pad = -seq % chunk
    if pad:  # padded slots: g = beta = 0, q = k = v = 0 (no effect on the state or the outputs)
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    n = (seq + pad) // chunk

    def chunks(x):  # [batch, seq, heads, ...] -> [n, batch, heads, chunk, ...]
        x = x.reshape((batch, n, chunk, heads) + x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

    terms = _chunk_terms(*(chunks(x) for x in (q, k, v, g, beta)))

    def body(s, xs):
        s, o, _ = _chunk_step(s, *xs)
        return s, o

    state, o = jax.lax.scan(body, state.astype(jnp.float32), terms)
    o = jnp.moveaxis(o, 2, 3)  # [n, batch, chunk, heads, dv]
    o = jnp.moveaxis(o, 0, 1).reshape(batch, n * chunk, heads, dv)[:, :seq]
    return o.astype(out_dtype), state


def _chunk_terms(q, k, v, g, beta):
    """What a chunk's step needs that does not depend on the state carried in, for chunks
    ``q, k [..., c, dk]``, ``v [..., c, dv]``, ``g, beta [..., c]`` float32 (q, k normalised):
    ``(q scaled, k, u, w, gc, scores)`` with ``gc`` the cumulative log decay, ``u`` the chunk's
    values corrected for the writes within it, ``w`` what the carried state contributes to them.
    Products sharing an operand run as one matmul each (fewer, larger products: a verify block's
    are tiny and launch-bound)."""
    c, dk = k.shape[-2:]
    q = q * (dk ** -0.5)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    gc = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, gc[..., :, None] - gc[..., None, :], 0.0)), 0.0)
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    # [k * beta; q] @ k^T: the writes' overlaps and the read scores together.
    overlaps = jnp.einsum("...id,...jd->...ij", jnp.concatenate([k_beta, q], axis=-2), k) * jnp.tile(decay, (2, 1))
    t = unit_lower_inverse(jnp.where(strict, overlaps[..., :c, :], 0.0))
    scores = jnp.where(lower, overlaps[..., c:, :], 0.0)
    uw = t @ jnp.concatenate([v_beta, k_beta * jnp.exp(gc)[..., None]], axis=-1)  # [u | w]
    dv = v.shape[-1]
    return q, k, uw[..., :dv], uw[..., dv:], gc, scores


def _chunk_step(s, q, k, u, w, gc, scores):
    """One chunk over the state ``s [..., dk, dv]`` -> the state after it, the chunk's outputs and
    its corrected values ``v_new [..., c, dv]`` (what it writes). The state is read once for what
    the writes and the reads need of it (``[w; q * exp(gc)] @ s``)."""
    c = w.shape[-2]
    from_state = jnp.concatenate([w, q * jnp.exp(gc)[..., None]], axis=-2) @ s
    v_new = u - from_state[..., :c, :]
    o = from_state[..., c:, :] + scores @ v_new
    last = gc[..., -1:]
    s = s * jnp.exp(last)[..., None] + jnp.einsum("...cd,...ce->...de", k * jnp.exp(last - gc)[..., None], v_new)
    return s, o, v_new


def gated_delta_block(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
    *, normalize_qk: bool = True,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """A verify block (shapes as ``chunk_gated_delta_rule``'s) as one chunk, the state left as it
    was: ``o`` and the block's terms ``(k, gc, v_new)`` from which ``state_after`` gives the state
    after any prefix of it. Token ``j``'s write ``v_new[j]`` depends only on tokens ``<= j``, so
    the prefix's state is the same sum cut at its length: no second pass over the block."""
    out_dtype = v.dtype
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    heads_major = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 2)  # noqa: E731
    terms = _chunk_terms(*(heads_major(x) for x in (q, k, v, g, beta)))
    _, o, v_new = _chunk_step(state.astype(jnp.float32), *terms)
    return jnp.moveaxis(o, 2, 1).astype(out_dtype), (terms[1], terms[4], v_new)


def state_after(state: jax.Array, k: jax.Array, gc: jax.Array, v_new: jax.Array, lens: jax.Array) -> jax.Array:
    """The state after the first ``lens [batch]`` tokens of a ``gated_delta_block`` (its terms
    ``k [batch, heads, block, dk]``, ``gc [batch, heads, block]``, ``v_new [batch, heads, block,
    dv]``) from the ``state`` before it: ``state * exp(gc[n-1]) + sum_{j<n} exp(gc[n-1] - gc[j]) k_j v_new_j^T``."""
    block = k.shape[-2]
    last = jnp.take_along_axis(gc, jnp.clip(lens - 1, 0, block - 1)[:, None, None], axis=-1)  # [batch, heads, 1]
    last = jnp.where((lens > 0)[:, None, None], last, 0.0)
    keep = jnp.arange(block)[None, None, :] < lens[:, None, None]
    weight = jnp.where(keep, jnp.exp(jnp.where(keep, last - gc, 0.0)), 0.0)
    return state * jnp.exp(last)[..., None] + jnp.einsum("bhcd,bhce->bhde", k * weight[..., None], v_new)


def _by_kernel(kernel, q, k, v, g, beta, state, chunk, out_dtype):
    """The chunked rule by ``kernel`` (heads-major inputs, the sequence padded to whole chunks with
    tokens that change nothing)."""
    seq = k.shape[1]
    pad = -seq % chunk
    heads_major = lambda x: jnp.moveaxis(jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)), 1, 2)  # noqa: E731
    o, state = kernel(*(heads_major(x) for x in (q, k, v, g, beta)), state, chunk=chunk)
    return jnp.moveaxis(o, 2, 1)[:, :seq].astype(out_dtype), state


def recurrent_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
    *, normalize_qk: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule a token at a time (decode; shapes as ``chunk_gated_delta_rule``).

    Returns ``o`` and the final state.
    """
    out_dtype = v.dtype
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q, k, v, g, beta = (jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta))
    q = q * (q.shape[-1] ** -0.5)

    def body(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [batch, heads, d]
        s = s * jnp.exp(g_t)[..., None, None]
        recalled = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        s = s + k_t[..., :, None] * ((v_t - recalled) * b_t[..., None])[..., None, :]
        o = jnp.einsum("bhkv,bhk->bhv", s, q_t)
        return s, o

    if q.shape[0] == 1:  # a decode token: the body itself, no one-iteration loop around it
        final, o = body(state.astype(jnp.float32), tuple(x[0] for x in (q, k, v, g, beta)))
        o = o[None]
    else:
        final, o = jax.lax.scan(body, state.astype(jnp.float32), (q, k, v, g, beta))
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), final
