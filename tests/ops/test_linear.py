"""``ops.linear``: the projections' dots, weights in either layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.ops import linear


@pytest.mark.parametrize("weight_major", [True, False])
@pytest.mark.parametrize("rows", [(1,), (3,), (2, 1, 5)])
@pytest.mark.parametrize("in_shape,out_shape", [((12,), (7,)), ((3, 4), (10,)), ((12,), (2, 3, 4))])
def test_dense_of_an_input_last_weight_equals_the_plain_dot(weight_major, rows, in_shape, out_shape, monkeypatch):
    """A weight stored input-last (``INPUT_LAST``: ``[*out, *in]``) gives ``dense`` the product of the
    same weight stored ``[*in, *out]``, for one row and several, one and two input dimensions, several
    output dimensions, with the weight the GEMM's left operand (a CPU's choice) or the right one."""
    monkeypatch.setattr(linear, "weight_major_gemms", lambda: weight_major)
    rng = np.random.RandomState(len(rows) + len(in_shape))
    x = jnp.asarray(rng.randn(*rows, *in_shape).astype(np.float32))
    w = rng.randn(*in_shape, *out_shape).astype(np.float32)
    n_in = len(in_shape)
    perm = tuple(range(n_in, w.ndim)) + tuple(range(n_in))
    plain = linear.dense(x, nnx.Param(jnp.asarray(w)), in_dims=n_in)
    stored = nnx.Param(jnp.asarray(np.transpose(w, perm)), **{linear.INPUT_LAST: True})
    got = jax.jit(lambda x: linear.dense(x, stored, in_dims=n_in))(x)
    assert got.shape == rows + out_shape == plain.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), rtol=1e-5, atol=1e-5)
    want = np.tensordot(np.asarray(x, np.float64), w.astype(np.float64), axes=n_in)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_several_rows_multiply_with_the_weight_on_the_left(monkeypatch):
    """On a CPU (``weight_major_gemms``) the compiled dot of a block has the weight as its left operand,
    the transpose back kept out of it (XLA's simplifier would otherwise turn ``(w x^T)^T`` back into
    ``x w^T``); elsewhere the dot is ``x``'s."""
    w = nnx.Param(jnp.ones((6, 5), jnp.float32), **{linear.INPUT_LAST: True})  # [out 6, in 5]
    x = jnp.ones((4, 5), jnp.float32)
    for weight_major, dot_shape in ((True, "f32[6,4]"), (False, "f32[4,6]")):
        monkeypatch.setattr(linear, "weight_major_gemms", lambda v=weight_major: v)
        hlo = jax.jit(lambda x: linear.dense(x, w)).lower(x).compile().as_text()
        dots = [line for line in hlo.splitlines() if " dot(" in line or "__ynn" in line and "dot" in line]
        assert dots and all(dot_shape in line for line in dots), dots
