"""Top-k over a vocabulary-wide row, without a whole-row sort.

``jax.lax.top_k`` over a row of 151,936 logits (Qwen3's vocabulary) runs as a sort on XLA:GPU:
milliseconds for the rows of a batched draft or verify block. The k largest of a row all lie in the
k slices of the row with the largest maxima, so a pass over the row for the slice maxima, a top-k of
those and a top-k of the k picked slices give the same result for a fraction of the cost. The picked
slices (k x 128 elements) are still a long row for a sort, so the same step runs on them again with
narrower slices before the last, short ``lax.top_k`` (on XLA:GPU with k = 64, a CUB segmented radix
sort of a short row): a radix select without any sort measured slower on Hopper (docs/performance.md,
rejected designs).

The result is ``lax.top_k``'s exactly, ties included, but where a slice's maximum is a zero of either
sign: its maximum by ``jnp.max`` may be -0.0 for a slice holding 0.0, which then ranks that slice below
``lax.top_k``'s order.

``short_top_k`` is the same contract for short rows (a router's logits over its experts): each element's
rank by comparisons against the whole row, then the k ranked first picked by rank, two fused reductions
instead of a sort and its copies (a decode token's router on XLA:GPU: a sort kernel, a copy and two small
fusions around it).

``largest_threshold`` finds a row's largest value with a given count or mass at or above it (the k-th
largest value; the top-p boundary) without any sort: a search over the float's ordered bits, a few
fused reductions a pass. It is slower than the two-stage top-k above, but a sort of a whole row is a
CUB radix sort on XLA:GPU, which cannot be recorded in a CUDA graph; a program holding one (even in a
branch never taken) keeps its loop out of the graph.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Slice widths of the stages: the maxima of 128-wide slices of the row, then of 16-wide slices of the k
# picked ones. A stage narrows its slices (to 8 at least) for a large k and runs only while its row is
# longer than 2k slices.
STAGE_WIDTHS = (128, 16)
# On a GPU the second stage pays from this many rows on: k = 64 over 151,936 on an H200, 256 rows (a batch
# of 16 blocks) take 146 us with one stage and 90 with two, 16 rows 60 and 75 (the stage's kernels cost
# more than the shorter sort saves). A CPU's sort is slow at any row count: two stages always.
GPU_SECOND_STAGE_ROWS = 64
# Bits of ``largest_threshold``'s key found per pass: 2**4 - 1 probes, summed in one pass over the row;
# a float32 key takes 8 passes.
SEARCH_BITS = 4


# ``short_top_k`` ranks by comparisons while a call compares at most this many pairs (rows x row length
# squared: a verify block of 256 tokens over 128 experts is 4.2M); longer calls (prefill, training) run
# ``lax.top_k``, which gives the same result.
SHORT_TOP_K_PAIRS = 1 << 23


def short_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` over the last axis of a short ``x [..., E]`` (rows without NaN):
    ``(values [..., k], ids [..., k] int32)``, values descending, equal values in ascending id order.

    An element's rank is the count of elements above it plus the equal ones before it, so the ranks of
    a row are a permutation and rank ``j`` is the ``j``-th of ``lax.top_k``'s order (but zeros of either
    sign, which tie here); the output ``j`` is the element of rank ``j``. Above ``SHORT_TOP_K_PAIRS``
    compared pairs it is ``lax.top_k``."""
    *lead, n = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"short_top_k: k={k} must be in [1, {n}] for rows of {n}")
    rows = x.reshape(-1, n)
    if rows.shape[0] * n * n > SHORT_TOP_K_PAIRS:
        values, ids = jax.lax.top_k(rows, k)
        return values.reshape(*lead, k), ids.astype(jnp.int32).reshape(*lead, k)
    ids_n = jnp.arange(n, dtype=jnp.int32)
    other, this = rows[:, None, :], rows[:, :, None]  # [R, n (this), n (other)]
    before = (other > this) | ((other == this) & (ids_n[None, None, :] < ids_n[None, :, None]))
    rank = jnp.sum(before, axis=-1, dtype=jnp.int32)  # [R, n]
    picked = rank[:, None, :] == jnp.arange(k, dtype=jnp.int32)[None, :, None]  # [R, k, n]
    ids = jnp.sum(jnp.where(picked, ids_n, 0), axis=-1, dtype=jnp.int32)
    values = jnp.max(jnp.where(picked, rows[:, None, :], -jnp.inf), axis=-1).astype(x.dtype)
    return values.reshape(*lead, k), ids.reshape(*lead, k)


def stage_widths(rows: int) -> tuple[int, ...]:
    """The slice widths ``top_k`` uses by default for ``rows`` rows on this platform."""
    if jax.default_backend() == "gpu" and rows < GPU_SECOND_STAGE_ROWS:
        return STAGE_WIDTHS[:1]
    return STAGE_WIDTHS


def top_k(x: jax.Array, k: int, *, chunks: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` over the last axis of ``x [..., V]``: ``(values [..., k], ids [..., k]
    int32)``, values descending, equal values in ascending id order (as ``lax.top_k``). ``chunks``: the
    stages' slice widths (None: ``stage_widths``)."""
    values, ids, _ = top_k_and_argmax(x, k, chunks=chunks)
    return values, ids


def top_k_and_argmax(x: jax.Array, k: int, *, chunks: tuple[int, ...] | None = None,
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``top_k`` plus ``jnp.argmax(x, axis=-1)`` as int32 ``[...]`` (the first maximum; rows without
    NaN), read from the first stage's slice maxima: no second pass over the row.

    Each stage of ``chunks`` (slice widths) keeps the ``k`` slices with the largest maxima (equal maxima:
    the lower slice) in id order; the last ``lax.top_k`` runs over what the stages kept. Exact, ties
    included (but signed zeros: the module docstring): the slices holding a value above the k-th are all
    picked (fewer than k of them), among slices whose maximum equals it a lower slice holds lower ids,
    and the picked slices stay in id order, so a later stage's ties resolve as the row's would."""
    *lead, vocab = x.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"top_k: k={k} must be in [1, {vocab}] for rows of {vocab}")
    rows = x.reshape(-1, vocab)
    chunks = stage_widths(rows.shape[0]) if chunks is None else tuple(chunks)
    if not chunks or any(c < 1 for c in chunks):
        raise ValueError(f"top_k: chunks must be positive slice widths, got {chunks!r}")
    argmax = None
    # (slice ids [R, k], width) of each stage that ran: an element's id is read back through them
    stages: list[tuple[jax.Array, int]] = []
    for chunk in chunks:
        while chunk > 8 and -(-rows.shape[-1] // chunk) <= 2 * k:  # narrower slices for a larger k
            chunk //= 2
        slices = -(-rows.shape[-1] // chunk)
        if slices <= 2 * k:
            break
        parts = jnp.pad(rows, ((0, 0), (0, slices * chunk - rows.shape[-1])),
                        constant_values=-jnp.inf).reshape(rows.shape[0], slices, chunk)
        maxima = jnp.max(parts, axis=-1)                                      # [R, slices]
        if argmax is None:  # the first slice holding the maximum, its first maximum
            part = jnp.argmax(maxima, axis=-1)
            inside = jnp.take_along_axis(parts, part[:, None, None], axis=1)[:, 0]
            argmax = part * chunk + jnp.argmax(inside, axis=-1)
        best = _best_slices_in_order(maxima, k)
        rows = jnp.take_along_axis(parts, best[..., None], axis=1).reshape(rows.shape[0], k * chunk)
        stages.append((best, chunk))
    if argmax is None:
        argmax = jnp.argmax(rows, axis=-1)
    values, ids = jax.lax.top_k(rows, k)
    for best, chunk in reversed(stages):
        ids = jnp.take_along_axis(best, ids // chunk, axis=1) * chunk + ids % chunk
    return (values.reshape(*lead, k), ids.astype(jnp.int32).reshape(*lead, k),
            argmax.astype(jnp.int32).reshape(lead))


def _best_slices_in_order(maxima: jax.Array, k: int) -> jax.Array:
    """The ``k`` slices with the largest ``maxima [R, S]`` (equal maxima: the lower slices), in ascending
    slice order -> ``[R, k]`` int32. Ordered by a sort of the k ids: a compaction by a cumulative count and
    a scatter measured slower on Hopper (docs/performance.md, rejected designs)."""
    return jnp.sort(jax.lax.top_k(maxima, k)[1], axis=-1).astype(jnp.int32)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """float32 ``x`` -> uint32 keys in the same order (-0.0 as +0.0; rows without NaN)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = jnp.where(bits == jnp.uint32(0x80000000), jnp.uint32(0), bits)  # on the bits: XLA may flush subnormals
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _value_of_key(keys: jax.Array) -> jax.Array:
    """The inverse of ``_ordered_keys``."""
    top = (keys >> 31) == 1
    return jax.lax.bitcast_convert_type(jnp.where(top, keys & jnp.uint32(0x7FFFFFFF), ~keys), jnp.float32)


def largest_threshold(x: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Each row's largest value ``t`` of ``x [R, V]`` (float32, no NaN) with
    ``sum(weights[x >= t]) >= target``: ``weights [R, V]`` non-negative (int32 counts or float32
    masses), ``target [R]`` -> float32 ``[R]``, one of the row's values (-0.0 read as +0.0); -inf where
    the whole row weighs less than ``target``.

    With unit weights and ``target = k`` it is the k-th largest value (ties counted); with
    probabilities and ``target = p``, the least likely value of the smallest set of most likely
    tokens whose mass reaches p. No sort: the answer's order-preserving key is found ``SEARCH_BITS``
    bits a pass from the top, each pass one sum per probe over the row (the mass at or above a key
    does not grow with the key, so the largest qualifying digit is the number of qualifying probes).
    Masses are summed in the reduction's order, not a sorted prefix's: a boundary within float32
    rounding of ``target`` may land one value over.
    """
    keys = _ordered_keys(x.astype(jnp.float32))
    target = target.astype(weights.dtype)
    zero = jnp.zeros((), weights.dtype)
    prefix = jnp.zeros(x.shape[:1], jnp.uint32)
    digits = jnp.arange(1, 2 ** SEARCH_BITS, dtype=jnp.uint32)
    for shift in range(32 - SEARCH_BITS, -1, -SEARCH_BITS):
        probes = prefix[:, None] | (digits[None, :] << shift)                              # [R, P]
        # One variadic reduction: a single pass over the row for every probe. Separate sums (stacked)
        # took 2.71 ms for 256 rows of 151,936 on an H100 against 2.23, and a [R, P, V] or [R, V, P]
        # sum 4.90 and 7.16.
        sums = jax.lax.reduce(tuple(jnp.where(keys >= probes[:, j:j + 1], weights, zero) for j in range(len(digits))),
                              (zero,) * len(digits), lambda a, b: tuple(x + y for x, y in zip(a, b)), (1,))
        above = jnp.stack(sums, axis=-1)                                                   # [R, P]
        prefix = prefix | (jnp.sum(above >= target[:, None], axis=-1).astype(jnp.uint32) << shift)
    return jnp.where(jnp.sum(weights, axis=-1) >= target, _value_of_key(prefix), -jnp.inf)
