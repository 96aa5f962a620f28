"""The chunked gated delta rule kernel (interpret mode on the CPU) against its reference and the
model's (transformers-matched) reference, forward and gradient; and its lowering to Triton for CUDA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops import gated_delta
from kernels_pallas.gated_delta import chunk_gated_delta
from kernels_pallas.gated_delta.reference import chunk_gated_delta_reference
from lowering import lower_for


def _inputs(seed, b=1, h=2, seq=48, dk=16, dv=16):
    rng = np.random.RandomState(seed)
    q = gated_delta.l2_normalize(jnp.asarray(rng.randn(b, h, seq, dk), jnp.float32))
    k = gated_delta.l2_normalize(jnp.asarray(rng.randn(b, h, seq, dk), jnp.float32))
    v = jnp.asarray(rng.randn(b, h, seq, dv), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.01, 0.5, (b, h, seq)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (b, h, seq)), jnp.float32)
    state = jnp.asarray(0.3 * rng.randn(b, h, dk, dv), jnp.float32)
    return q, k, v, g, beta, state


def _model_reference(q, k, v, g, beta, state, chunk):
    """The model's rule (sequence-major, forward substitution), heads-major in and out."""
    seq_major = lambda x: jnp.moveaxis(x, 2, 1)  # noqa: E731
    o, s = gated_delta.chunk_gated_delta_rule(*(seq_major(x) for x in (q, k, v, g, beta)), state, chunk=chunk,
                                              normalize_qk=False)
    return jnp.moveaxis(o, 1, 2), s


def test_kernel_forward_matches_both_references():
    args = _inputs(0)
    kernel = jax.jit(functools.partial(chunk_gated_delta, chunk=16, interpret=True))
    o, s = kernel(*args)
    for want_o, want_s in (jax.jit(functools.partial(chunk_gated_delta_reference, chunk=16))(*args),
                           jax.jit(functools.partial(_model_reference, chunk=16))(*args)):
        np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=2e-5)
        np.testing.assert_allclose(np.asarray(s), np.asarray(want_s), atol=2e-5)


def test_kernel_gradient_matches_the_model_reference():
    args = _inputs(1, seq=32)
    rng = np.random.RandomState(2)
    wo = jnp.asarray(rng.randn(1, 2, 32, 16), jnp.float32)
    ws = jnp.asarray(rng.randn(1, 2, 16, 16), jnp.float32)

    def loss(fn, *a):
        o, s = fn(*a)
        return jnp.sum(o * wo) + jnp.sum(s * ws)

    kernel = functools.partial(chunk_gated_delta, chunk=16, interpret=True)
    got = jax.jit(jax.grad(functools.partial(loss, kernel), argnums=tuple(range(6))))(*args)
    want = jax.jit(jax.grad(functools.partial(loss, functools.partial(_model_reference, chunk=16)),
                            argnums=tuple(range(6))))(*args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def test_gated_delta_kernel_lowers_for_gpus():
    sd = jax.ShapeDtypeStruct
    shapes = [sd((1, 32, 128, 128), jnp.float32)] * 3 + [sd((1, 32, 128), jnp.float32)] * 2 + [
        sd((1, 32, 128, 128), jnp.float32)]
    fn = jax.jit(functools.partial(chunk_gated_delta, chunk=64, interpret=False))
    text = lower_for(fn, shapes, "cuda").as_text()
    assert "dflash_chunk_gated_delta" in text and "triton" in text
