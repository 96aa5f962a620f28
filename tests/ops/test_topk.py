"""ops.topk.top_k (stages over slices of the row) against jax.lax.top_k, ties included; largest_threshold
against sorted rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops import topk

# Jitted: one compile per shape, not one dispatch per operation.
top_k = jax.jit(topk.top_k, static_argnames=("k", "chunks"))
top_k_and_argmax = jax.jit(topk.top_k_and_argmax, static_argnames=("k", "chunks"))
largest_threshold = jax.jit(topk.largest_threshold)


@pytest.mark.parametrize("k", [1, 5, 16, 20])
def test_equals_lax_top_k_ties_included(k):
    rs = np.random.RandomState(9)
    x = rs.randn(4, 5000).astype(np.float32)
    x[1, 4000:4010] = 9.0   # ties inside one slice
    x[2] = np.round(x[2])   # many ties, across slices, at the k-th value
    x[3, ::97] = 7.0        # equal maxima in many slices
    for chunks in ((64,), (128,), (128, 16), (64, 8, 8)):
        values, ids = top_k(jnp.asarray(x), k=k, chunks=chunks)
        want_values, want_ids = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))  # equal values: lower ids first


def test_leading_axes_and_short_rows():
    x = jax.random.normal(jax.random.key(0), (2, 3, 151), jnp.float32)
    values, ids = top_k(x, k=4)  # 2 slices of 128 <= 2k: one lax.top_k
    want_values, want_ids = jax.lax.top_k(x, 4)
    assert values.shape == (2, 3, 4) and ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    x = jax.random.normal(jax.random.key(1), (2, 3, 9000), jnp.bfloat16)
    values, ids = top_k(x, k=16)
    want_values, want_ids = jax.lax.top_k(x, 16)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_short_top_k_equals_lax_top_k_ties_included(dtype, monkeypatch):
    """Routers' rows (7, 32 and 128 experts): random, many ties at and around the k-th value, a row of
    equal values, infinities; by ranks, and by ``lax.top_k`` above the compared-pairs bound."""
    rs = np.random.RandomState(3)
    for n in (7, 32, 128):
        x = rs.randn(6, n).astype(np.float32)
        x[1] = np.round(x[1])
        x[2] = 0.5
        x[3, ::3] = -np.inf
        x[4, n // 2:] = np.inf
        x[5] = np.round(4 * x[5]) / 4
        x = jnp.asarray(x, dtype)
        for k in sorted({1, 3, 8, n} & set(range(1, n + 1))):
            want_values, want_ids = jax.lax.top_k(x, k)
            for bound in (topk.SHORT_TOP_K_PAIRS, 1):
                monkeypatch.setattr(topk, "SHORT_TOP_K_PAIRS", bound)
                values, ids = jax.jit(topk.short_top_k, static_argnums=1)(x, k)
                assert values.dtype == dtype and ids.dtype == jnp.int32
                np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids), err_msg=f"{n} {k} {bound}")
                np.testing.assert_array_equal(np.asarray(values, np.float32), np.asarray(want_values, np.float32))
    values, ids = topk.short_top_k(jnp.asarray(rs.randn(2, 3, 16), jnp.float32), 4)
    assert values.shape == ids.shape == (2, 3, 4)
    with pytest.raises(ValueError, match="k=17"):
        topk.short_top_k(jnp.zeros((2, 16)), 17)


def test_short_top_k_sorts_nothing():
    """A decode or verify step's routing (256 tokens over 128 experts) compiles without a sort."""
    jaxpr = jax.make_jaxpr(lambda x: topk.short_top_k(x, 8))(jnp.zeros((256, 128)))
    assert not {e.primitive.name for e in jaxpr.jaxpr.eqns} & {"sort", "top_k"}


@pytest.mark.parametrize("vocab", [151, 5000, 5003])
def test_argmax_from_the_slice_maxima_equals_jnp_argmax(vocab):
    """The argmax beside the top-k is ``jnp.argmax``'s: the first maximum, ties across slices included."""
    rs = np.random.RandomState(3)
    x = np.round(rs.randn(5, vocab) * 2).astype(np.float32)  # ties in and across slices
    x[1, 7] = x[1, vocab - 2] = 50.0
    x[2, vocab // 2:] = x[2].max()  # the maximum first in a later slice
    x[3, vocab - 1] = np.inf
    x[4, :] = -np.inf
    values, ids, argmax = top_k_and_argmax(jnp.asarray(x), k=4)
    np.testing.assert_array_equal(np.asarray(argmax), np.argmax(x, axis=-1))
    np.testing.assert_array_equal(np.asarray(ids)[[0, 1]], np.asarray(jax.lax.top_k(jnp.asarray(x[[0, 1]]), 4)[1]))


def _assert_lax(x, k, **kw):
    values, ids, argmax = top_k_and_argmax(x, k=k, **kw)
    want_values, want_ids = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), np.asarray(want_values.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(argmax), np.asarray(jnp.argmax(x, axis=-1)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("vocab,k", [(151, 64), (5003, 64), (20000, 64), (3000, 1), (3000, 7)])
def test_candidate_counts_equal_lax_top_k_ties_infinities_and_short_rows(dtype, vocab, k):
    """The candidate count the sampler uses (64), both dtypes: ties inside and across slices at the k-th
    value, rows of -inf, rows mostly -inf, rows shorter than 2k slices."""
    rs = np.random.RandomState(vocab + k)
    x = rs.randn(7, vocab).astype(np.float32)
    x[1, 10:30] = 9.0
    x[2] = np.round(x[2] * 2)                 # a few distinct values: ties everywhere
    x[3, ::97] = 7.0                          # equal maxima in many slices
    x[4, :] = -np.inf
    x[5, : vocab - k // 2] = -np.inf          # fewer than k finite values
    x[6] = 1.0                                # one value
    _assert_lax(jnp.asarray(x).astype(dtype), k)


def test_rejects_a_bad_k_and_bad_slice_widths():
    x = jnp.zeros((2, 300), jnp.float32)
    with pytest.raises(ValueError, match="k=301"):
        topk.top_k_and_argmax(x, 301)
    with pytest.raises(ValueError, match="chunks"):
        topk.top_k_and_argmax(x, 3, chunks=(128, 0))


def test_the_largest_candidate_count_on_a_whole_vocabulary():
    """k = 1024 (``MAX_TOP_K_CANDIDATES``) over Qwen3's 151,936: 65,536 picked elements; ties across the
    picked slices."""
    rs = np.random.RandomState(4)
    x = np.round(rs.randn(2, 151936) * 3).astype(np.float32)
    _assert_lax(jnp.asarray(x).astype(jnp.bfloat16), 1024)


def test_default_stages_by_platform_and_rows(monkeypatch):
    """Two stages on a CPU at any row count; on a GPU from ``GPU_SECOND_STAGE_ROWS`` rows on."""
    assert topk.stage_widths(1) == topk.stage_widths(4096) == topk.STAGE_WIDTHS
    monkeypatch.setattr(topk.jax, "default_backend", lambda: "gpu")
    assert topk.stage_widths(topk.GPU_SECOND_STAGE_ROWS - 1) == topk.STAGE_WIDTHS[:1]
    assert topk.stage_widths(topk.GPU_SECOND_STAGE_ROWS) == topk.STAGE_WIDTHS


def test_largest_threshold_with_counts_is_the_kth_largest_value():
    """Unit weights, target k: the k-th value of the sorted row, ties counted, signed zeros, infinities,
    negative and subnormal values; -inf where the row is shorter than k."""
    rs = np.random.RandomState(5)
    x = rs.randn(6, 777).astype(np.float32) * 10
    x[1] = np.round(x[1] / 5)                         # a few values, many ties
    x[2, :300], x[2, 300:400] = 0.0, -0.0
    x[3, :700] = -np.inf
    x[4, ::3] = np.inf
    x[5] = rs.choice([1e-42, -1e-42, 3e-39, -2.0, 5.0], 777)  # subnormals beside normal values
    desc = -np.sort(-x, axis=-1)
    for k in (1, 2, 77, 300, 401, 776, 777, 778):
        got = np.asarray(largest_threshold(jnp.asarray(x), jnp.ones(x.shape, jnp.int32), jnp.full((6,), k)))
        want = desc[:, k - 1] if k <= 777 else np.full(6, -np.inf, np.float32)
        np.testing.assert_array_equal(got, want + 0.0, err_msg=f"k={k}")  # -0.0 reads as +0.0


def test_largest_threshold_with_masses_is_the_top_p_boundary():
    """Probabilities, target p: the value at which the sorted row's mass (inclusive) first reaches p,
    per row, against the sorted cumulative sum (targets away from a boundary by more than rounding)."""
    rs = np.random.RandomState(6)
    logits = (rs.randn(8, 5000) * rs.choice([0.5, 2.0, 8.0], (8, 1))).astype(np.float32)
    logits[3] = np.round(logits[3])                   # ties at the boundary
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-logits, axis=-1, kind="stable")
    for p in (0.05, 0.5, 0.9, 0.99):
        cum = np.cumsum(np.take_along_axis(probs, order, -1).astype(np.float64), axis=-1)
        first = np.argmax(cum >= p, axis=-1)
        want = np.take_along_axis(logits, order, -1)[np.arange(8), first]
        got = np.asarray(largest_threshold(jnp.asarray(logits), jnp.asarray(probs), jnp.full((8,), p, jnp.float32)))
        np.testing.assert_array_equal(got, want, err_msg=f"p={p}")
    too_much = largest_threshold(jnp.asarray(logits), jnp.asarray(probs), jnp.full((8,), 1.5, jnp.float32))
    assert np.all(np.asarray(too_much) == -np.inf)


def test_largest_threshold_sorts_nothing():
    """No sort in its program: a whole-row sort is a CUB radix sort on XLA:GPU, which keeps a loop holding
    it out of the CUDA graph."""
    text = largest_threshold.lower(jnp.zeros((2, 5000)), jnp.zeros((2, 5000)), jnp.zeros((2,))).as_text()
    assert "sort" not in text
