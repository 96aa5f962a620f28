"""ops.topk.top_k (two stages over slices of the row) against jax.lax.top_k, ties included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops.topk import top_k


@pytest.mark.parametrize("k", [1, 5, 16, 20])
def test_equals_lax_top_k_ties_included(k):
    rs = np.random.RandomState(9)
    x = rs.randn(4, 5000).astype(np.float32)
    x[1, 4000:4010] = 9.0   # ties inside one slice
    x[2] = np.round(x[2])   # many ties, across slices, at the k-th value
    x[3, ::97] = 7.0        # equal maxima in many slices
    for chunk in (64, 128):
        values, ids = top_k(jnp.asarray(x), k, chunk=chunk)
        want_values, want_ids = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))  # equal values: lower ids first


def test_leading_axes_and_short_rows():
    x = jax.random.normal(jax.random.key(0), (2, 3, 151), jnp.float32)
    values, ids = top_k(x, 4)  # 2 slices of 128 <= 2k: one lax.top_k
    want_values, want_ids = jax.lax.top_k(x, 4)
    assert values.shape == (2, 3, 4) and ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    x = jax.random.normal(jax.random.key(1), (2, 3, 9000), jnp.bfloat16)
    values, ids = top_k(x, 16)
    want_values, want_ids = jax.lax.top_k(x, 16)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))


@pytest.mark.parametrize("vocab", [151, 5000, 5003])
def test_argmax_from_the_slice_maxima_equals_jnp_argmax(vocab):
    """The argmax beside the top-k is ``jnp.argmax``'s: the first maximum, ties across slices included."""
    from dflash_jax.ops.topk import top_k_and_argmax

    rs = np.random.RandomState(3)
    x = np.round(rs.randn(5, vocab) * 2).astype(np.float32)  # ties in and across slices
    x[1, 7] = x[1, vocab - 2] = 50.0
    x[2, vocab // 2:] = x[2].max()  # the maximum first in a later slice
    x[3, vocab - 1] = np.inf
    x[4, :] = -np.inf
    values, ids, argmax = top_k_and_argmax(jnp.asarray(x), 4)
    np.testing.assert_array_equal(np.asarray(argmax), np.argmax(x, axis=-1))
    np.testing.assert_array_equal(np.asarray(ids)[[0, 1]], np.asarray(jax.lax.top_k(jnp.asarray(x[[0, 1]]), 4)[1]))
