"""Top-k over a vocabulary-wide row, without a whole-row sort.

``jax.lax.top_k`` over a row of 151,936 logits (Qwen3's vocabulary) runs as a sort on XLA:GPU:
milliseconds for the rows of a batched draft or verify block. The k largest of a row all lie in the
k slices of the row with the largest maxima, so a pass over the row for the slice maxima, a top-k of
those and a top-k of the k picked slices give the same result for a fraction of the cost. The two small
top-ks are ``lax.top_k`` (on XLA:GPU with k = 64, a CUB segmented radix sort of a short row): a radix
select without any sort measured slower on Hopper (docs/performance.md, rejected designs).

The result is ``lax.top_k``'s exactly, ties included, but where a slice's maximum is a zero of either
sign: its maximum by ``jnp.max`` may be -0.0 for a slice holding 0.0, which then ranks that slice below
``lax.top_k``'s order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k(x: jax.Array, k: int, *, chunk: int = 128) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` over the last axis of ``x [..., V]``: ``(values [..., k], ids [..., k]
    int32)``, values descending, equal values in ascending id order (as ``lax.top_k``)."""
    values, ids, _ = top_k_and_argmax(x, k, chunk=chunk)
    return values, ids


def top_k_and_argmax(x: jax.Array, k: int, *, chunk: int = 128) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``top_k`` plus ``jnp.argmax(x, axis=-1)`` as int32 ``[...]`` (the first maximum; rows without
    NaN), read from the same slice maxima: no second pass over the row.

    In two stages when the row is long: the maximum of each ``chunk``-wide slice, the ``k`` slices with
    the largest maxima (equal maxima: the lower slice), those slices in id order, the top ``k`` of their
    elements. Exact, ties included (but signed zeros: the module docstring): the slices holding a value
    above the k-th are all picked (fewer than k of them), and among slices whose maximum equals it, a
    lower slice holds lower ids."""
    *lead, vocab = x.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"top_k: k={k} must be in [1, {vocab}] for rows of {vocab}")
    rows = x.reshape(-1, vocab)
    while chunk > 8 and -(-vocab // chunk) <= 2 * k:  # narrower slices for a larger k
        chunk //= 2
    slices = -(-vocab // chunk)
    if slices <= 2 * k:
        values, ids = jax.lax.top_k(rows, k)
        argmax = jnp.argmax(rows, axis=-1)
    else:
        padded = jnp.pad(rows, ((0, 0), (0, slices * chunk - vocab)), constant_values=-jnp.inf)
        parts = padded.reshape(rows.shape[0], slices, chunk)
        maxima = jnp.max(parts, axis=-1)                                      # [R, slices]
        # The argmax: the first slice holding the maximum, its first maximum.
        part = jnp.argmax(maxima, axis=-1)
        inside = jnp.take_along_axis(parts, part[:, None, None], axis=1)[:, 0]
        argmax = part * chunk + jnp.argmax(inside, axis=-1)
        _, best = jax.lax.top_k(maxima, k)                                   # [R, k] slice indices
        best = jnp.sort(best, axis=-1)                                       # id order: ties to the lower id
        picked = jnp.take_along_axis(parts, best[..., None], axis=1).reshape(rows.shape[0], k * chunk)
        values, at = jax.lax.top_k(picked, k)
        ids = jnp.take_along_axis(best, at // chunk, axis=1) * chunk + at % chunk
    return (values.reshape(*lead, k), ids.astype(jnp.int32).reshape(*lead, k),
            argmax.astype(jnp.int32).reshape(lead))
