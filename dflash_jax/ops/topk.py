"""Top-k over a vocabulary-wide row, without XLA:GPU's whole-row sort.

``jax.lax.top_k`` over a row of 151,936 logits (Qwen3's vocabulary) runs as a sort on XLA:GPU:
milliseconds for the rows of a batched draft or verify block. The k largest of a row all lie in the
k slices of the row with the largest maxima, so a pass over the row for the slice maxima, a top-k of
those and a top-k of the k picked slices give the same result for a fraction of the cost.

The two small top-ks run one of two ways (``method``; None: ``default_method()``, by backend):

- ``"select"`` (the default on GPUs): no sort at all. The k-th largest value is found by a radix select on
  order-preserving integer keys of the values (a few bits a pass, each pass one fused reduction over
  the array counting the keys at or above each candidate digit), the k largest are compacted in id
  order (a prefix count, as masked sums over small blocks, and a scatter), and those k are ordered
  by a rank count over ``[k, k]`` pairs. Every step is a fused elementwise op or reduction over a small array: no CUB radix sort,
  no XLA sort kernel.
- ``"sort"`` (the default elsewhere): ``lax.top_k`` of the slice maxima, a sort of the picked slice
  indices, ``lax.top_k`` of the picked slices' elements. On XLA:GPU ``lax.top_k`` with k = 64 lowers to
  a CUB segmented radix sort; on the CPU it is the faster method: the select's dozens of small
  reductions took 0.87 ms for a DFlash2 selector's top-8 of ``[15, 4096]`` logits, this method 0.14 ms
  (16 rows, k = 64: 1.18 against 0.28 ms).

Both give ``lax.top_k``'s result exactly, ties included (the sort: but for slices whose maximum is a
signed zero, ``top_k_and_argmax``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

METHODS = ("select", "sort")
RADIX_BITS = 4  # bits of the key settled per pass of the radix select: 2**4 - 1 counts per pass


def default_method() -> str:
    """The method for the backend tracing: ``"select"`` on a GPU, ``"sort"`` on CPUs and TPUs."""
    return "select" if jax.default_backend() == "gpu" else "sort"


def top_k(x: jax.Array, k: int, *, chunk: int = 128, method: str | None = None) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` over the last axis of ``x [..., V]``: ``(values [..., k], ids [..., k]
    int32)``, values descending, equal values in ascending id order (as ``lax.top_k``)."""
    values, ids, _ = top_k_and_argmax(x, k, chunk=chunk, method=method)
    return values, ids


def top_k_and_argmax(x: jax.Array, k: int, *, chunk: int = 128, method: str | None = None,
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``top_k`` plus ``jnp.argmax(x, axis=-1)`` as int32 ``[...]`` (the first maximum; rows without
    NaN), read from the same slice maxima: no second pass over the row.

    In two stages when the row is long: the maximum of each ``chunk``-wide slice, the ``k`` slices with
    the largest maxima (equal maxima: the lower slice), those slices in id order, the top ``k`` of their
    elements. Exact, ties included: the slices holding a value above the k-th are all picked (fewer than
    k of them), and among slices whose maximum equals it, a lower slice holds lower ids. ``method``:
    ``"select"`` or ``"sort"`` (the module docstring; None: ``default_method()``); the same result, but
    where a slice's maximum is a zero of either sign: ``"sort"`` takes the slice maxima by ``jnp.max``,
    which may give -0.0 for a slice holding 0.0, and then ranks that slice below ``lax.top_k``'s order."""
    method = default_method() if method is None else method
    if method not in METHODS:
        raise ValueError(f"top_k method must be one of {METHODS}, got {method!r}")
    *lead, vocab = x.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"top_k: k={k} must be in [1, {vocab}] for rows of {vocab}")
    rows = x.reshape(-1, vocab)
    while chunk > 8 and -(-vocab // chunk) <= 2 * k:  # narrower slices for a larger k
        chunk //= 2
    slices = -(-vocab // chunk)
    if slices <= 2 * k:
        if method == "sort":
            values, ids = jax.lax.top_k(rows, k)
        else:
            ids = _top_positions(rows, k)
            values, ids = _descending(jnp.take_along_axis(rows, ids, axis=1), ids)
        argmax = jnp.argmax(rows, axis=-1)
    else:
        padded = jnp.pad(rows, ((0, 0), (0, slices * chunk - vocab)), constant_values=-jnp.inf)
        parts = padded.reshape(rows.shape[0], slices, chunk)
        if method == "sort":
            maxima = jnp.max(parts, axis=-1)                                  # [R, slices]
        else:
            # The maxima in the total order (a slice holding 0.0 and -0.0 has the maximum 0.0, as the
            # top-k ranks them), through the keys: one pass over the row, in the same kernel.
            maxima = from_order_keys(jnp.max(order_keys(parts), axis=-1), x.dtype)
        # The argmax: the first slice holding the maximum, its first maximum.
        part = jnp.argmax(maxima, axis=-1)
        inside = jnp.take_along_axis(parts, part[:, None, None], axis=1)[:, 0]
        argmax = part * chunk + jnp.argmax(inside, axis=-1)
        if method == "sort":
            _, best = jax.lax.top_k(maxima, k)                               # [R, k] slice indices
            best = jnp.sort(best, axis=-1)                                   # id order: ties to the lower id
        else:
            best = _top_positions(maxima, k)                                 # [R, k], ascending
        picked = jnp.take_along_axis(parts, best[..., None], axis=1).reshape(rows.shape[0], k * chunk)
        if method == "sort":
            values, at = jax.lax.top_k(picked, k)
        else:
            # ``picked`` is in id order, so ascending positions are ascending ids.
            at = _top_positions(picked, k)
            values, at = _descending(jnp.take_along_axis(picked, at, axis=1), at)
        ids = jnp.take_along_axis(best, at // chunk, axis=1) * chunk + at % chunk
    return (values.reshape(*lead, k), ids.astype(jnp.int32).reshape(*lead, k),
            argmax.astype(jnp.int32).reshape(lead))


def order_keys(x: jax.Array) -> jax.Array:
    """Unsigned integer keys ``[...]`` (uint32) of float ``x [...]`` in the total order ``lax.top_k``
    ranks floats by: ``x < y`` iff ``key(x) < key(y)``, and ``-0.0`` below ``0.0``, a NaN above
    ``+inf`` (a negative NaN below ``-inf``). The key of a ``b``-bit float fits its low ``b`` bits."""
    bits = jnp.finfo(x.dtype).bits
    unsigned = {16: jnp.uint16, 32: jnp.uint32}.get(bits)
    if unsigned is None:
        raise ValueError(f"order_keys: {x.dtype} is not a 16- or 32-bit float")
    u = jax.lax.bitcast_convert_type(x, unsigned)
    sign = unsigned(1 << (bits - 1))
    # Negative floats: all bits flipped (a larger magnitude, a smaller key); the others: the sign bit set.
    return jnp.where(u >= sign, ~u, u | sign).astype(jnp.uint32)


def from_order_keys(keys: jax.Array, dtype) -> jax.Array:
    """The floats of ``dtype`` whose ``order_keys`` are ``keys`` (uint32): its inverse."""
    bits = jnp.finfo(dtype).bits
    unsigned = {16: jnp.uint16, 32: jnp.uint32}[bits]
    keys = keys.astype(unsigned)
    sign = unsigned(1 << (bits - 1))
    return jax.lax.bitcast_convert_type(jnp.where(keys >= sign, keys ^ sign, ~keys), dtype)


def _kth_largest_key(keys: jax.Array, k: int, bits: int) -> jax.Array:
    """The ``k``-th largest of ``keys [R, N]`` (uint32 below ``2**bits``; ``k <= N``) -> ``[R]``.

    A radix select from the top bit down: ``prefix`` holds the settled high bits, with
    ``count(keys >= prefix) >= k`` throughout; each pass counts the keys at or above ``prefix`` plus
    each nonzero digit of the next ``RADIX_BITS`` bits and settles the largest digit keeping ``k``.
    At the end ``prefix`` is the largest key with ``k`` keys at or above it: the k-th largest."""
    prefix = jnp.zeros(keys.shape[:1], jnp.uint32)
    top = -(-bits // RADIX_BITS) * RADIX_BITS
    for shift in range(top - RADIX_BITS, -1, -RADIX_BITS):
        digits = jnp.arange(1, 1 << RADIX_BITS, dtype=jnp.uint32) << shift                 # [D]
        candidate = prefix[:, None] | digits[None, :]                                       # [R, D]
        # Summed over the middle axis, the digit minor: the lanes of a warp share each key (one read),
        # where a reduction over the last axis would read every key once per digit.
        at_least = jnp.sum(keys[:, :, None] >= candidate[:, None, :], axis=1, dtype=jnp.int32)  # [R, D]
        digit = jnp.sum(at_least >= k, axis=-1).astype(jnp.uint32)  # counts fall with the digit
        prefix = prefix | (digit << shift)
    return prefix


def _top_positions(x: jax.Array, k: int) -> jax.Array:
    """The positions ``[R, k]`` int32 of the ``k`` largest of ``x [R, N]`` (floats; ``k <= N``), in
    ascending order; equal values: the lower positions. Exactly ``lax.top_k``'s set of positions."""
    rows, n = x.shape
    keys = order_keys(x)
    kth = _kth_largest_key(keys, k, jnp.finfo(x.dtype).bits)
    above, tied = keys > kth[:, None], keys == kth[:, None]
    need = k - jnp.sum(above, axis=-1, dtype=jnp.int32)                 # >= 1 ties taken
    if n < 1 << 15:
        # One prefix count for both: the keys above (fewer than k) in the low half, the ties in the high half.
        counts = _prefix_sums(above.astype(jnp.int32) | (tied.astype(jnp.int32) << 16))
        above_before, tied_before = counts & 0xFFFF, counts >> 16       # inclusive counts
    else:
        above_before, tied_before = _prefix_sums(above.astype(jnp.int32)), _prefix_sums(tied.astype(jnp.int32))
    take = above | (tied & (tied_before <= need[:, None]))
    slot = above_before + jnp.minimum(tied_before, need[:, None]) - 1  # the count taken up to here, less one
    row = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], keys.shape)
    position = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], keys.shape)
    return jnp.zeros((rows, k), jnp.int32).at[row, jnp.where(take, slot, k)].set(position, mode="drop")


def _prefix_sums(x: jax.Array, width: int = 64) -> jax.Array:
    """``jnp.cumsum(x, axis=-1)`` of ``x [R, N]`` int32 as fused reductions over small blocks: the
    inclusive sums inside each ``width``-wide block (a masked sum over its ``[width, width]`` pairs), plus
    the prefix sums of the blocks' totals before it (the same, one level up). XLA:GPU runs a cumsum as a
    reduce-window rewritten into a tree of several kernels; this is one reduction a level (two levels
    up to ``width**2`` entries)."""
    rows, n = x.shape
    if n <= width:
        return _masked_prefix(x)
    blocks = -(-n // width)
    inner = _masked_prefix(jnp.pad(x, ((0, 0), (0, blocks * width - n))).reshape(rows * blocks, width))
    inner = inner.reshape(rows, blocks, width)
    totals = inner[:, :, -1]
    before = _prefix_sums(totals, width) - totals                               # [R, blocks], exclusive
    return (inner + before[:, :, None]).reshape(rows, blocks * width)[:, :n]


def _masked_prefix(x: jax.Array) -> jax.Array:
    """Inclusive sums along the last axis of ``x [R, n]`` (n small): output i sums inputs j <= i."""
    n = x.shape[-1]
    upto = jnp.arange(n)[:, None] <= jnp.arange(n)[None, :]                       # [j, i]: j <= i
    return jnp.sum(jnp.where(upto[None], x[:, :, None], 0), axis=1, dtype=x.dtype)  # over j, i minor


def _descending(values: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``values [R, k]`` (ids ``[R, k]`` ascending) reordered as ``lax.top_k`` gives them: descending,
    equal values in ascending id order. A rank count over the ``[k, k]`` pairs: no sort."""
    keys = order_keys(values)
    k = values.shape[-1]
    index = jnp.arange(k)
    # Sums over the middle axis, the output's index minor (as in ``_kth_largest_key``).
    earlier = (index[:, None] < index[None, :])[None]                             # [1, j, i]: j before i
    other, own = keys[:, :, None], keys[:, None, :]
    rank = jnp.sum((other > own) | ((other == own) & earlier), axis=1, dtype=jnp.int32)  # [R, k]: i's place
    # The inverse permutation: the entry ranked r.
    order = jnp.sum(jnp.where(rank[:, :, None] == index[None, None, :], index[None, :, None], 0),
                    axis=1, dtype=jnp.int32)
    return jnp.take_along_axis(values, order, axis=1), jnp.take_along_axis(ids, order, axis=1)
