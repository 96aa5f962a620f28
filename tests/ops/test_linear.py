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


def test_bfloat16_terms_sum_to_the_float32_values_exactly():
    """Three bfloat16 terms per value whose float32 sum, smallest first, is the value: values over the
    exponent range down to 2^-103 (below it a term can be subnormal, which XLA:CPU flushes to zero, as it
    does in its float32 GEMMs), both signs, zeros, bfloat16 values themselves."""
    rng = np.random.RandomState(0)
    mantissas = rng.uniform(1, 2, 4096) * rng.choice([-1, 1], 4096)
    x = (mantissas * 2.0 ** rng.randint(-103, 127, 4096)).astype(np.float32)
    x[:2] = [0.0, -0.0]
    x[4:8] = np.asarray([1.5, -2.0, 3.0, 0.1], dtype=jnp.bfloat16).astype(np.float32)
    terms = jax.jit(linear.bfloat16_terms)(jnp.asarray(x.reshape(64, 64)))
    assert terms.dtype == jnp.bfloat16 and terms.shape == (3, 64, 64)
    t = np.asarray(terms.astype(jnp.float32), np.float32)
    np.testing.assert_array_equal((t[2] + t[1]) + t[0], x.reshape(64, 64))
    assert (np.abs(t[1]) <= np.abs(t[0])).all() and (np.abs(t[2]) <= np.abs(t[1])).all()


@pytest.mark.parametrize("rows", [(1,), (16,), (2, 3)])
@pytest.mark.parametrize("in_shape,out_shape", [((96,), (40,)), ((4, 24), (40,)), ((96,), (5, 8))])
def test_float32_rows_times_a_bfloat16_weight_give_the_float32_product(rows, in_shape, out_shape):
    """A weight of bfloat16 values stored in bfloat16 (``[*in, *out]``, ``serving_params``' bfloat16 weights)
    times float32 rows: float32 results equal to the product of the same values in float32 up to the
    summation order (1e-6 relative), one and two input dimensions, several output dimensions; the compiled
    program multiplies the rows' three terms (``3 * rows`` bfloat16 rows) on the left of the weight."""
    rng = np.random.RandomState(sum(rows) + len(in_shape))
    x = jnp.asarray(rng.randn(*rows, *in_shape).astype(np.float32))
    w = jnp.asarray(rng.randn(*in_shape, *out_shape).astype(np.float32)).astype(jnp.bfloat16)
    stored = nnx.Param(w)
    f = jax.jit(lambda x: linear.dense(x, stored, in_dims=len(in_shape)))
    got = np.asarray(f(x))
    assert got.dtype == np.float32 and got.shape == rows + out_shape
    want = np.tensordot(np.asarray(x, np.float64), np.asarray(w.astype(jnp.float32), np.float64), axes=len(in_shape))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    hlo = f.lower(x).compile().as_text()
    assert f"bf16[{3 * int(np.prod(rows))},{int(np.prod(in_shape))}]" in hlo


def test_exactly_bfloat16_tells_a_bfloat16_checkpoint_in_float32():
    values = jnp.asarray(np.random.RandomState(1).randn(8, 8).astype(np.float32))
    assert linear.exactly_bfloat16(values.astype(jnp.bfloat16).astype(jnp.float32))
    assert not linear.exactly_bfloat16(values)
    assert not linear.exactly_bfloat16(values.astype(jnp.bfloat16))  # already bfloat16: nothing to keep


def test_bfloat16_matrix_units_are_read_from_the_cpu_flags(tmp_path, monkeypatch):
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n\nprocessor\t: 1\n")
    zen = tmp_path / "zen"
    zen.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert "amx_bf16" in linear.cpu_flags(str(amx)) and "amx_bf16" not in linear.cpu_flags(str(zen))
    assert linear.cpu_flags(str(tmp_path / "missing")) == frozenset()
    read = linear.cpu_flags
    for path, want in ((amx, True), (zen, False)):
        monkeypatch.setattr(linear, "cpu_flags", lambda p=path: read(str(p)))
        assert linear.bfloat16_matrix_units() is want
