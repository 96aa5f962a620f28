"""The gated delta rule and its convolution against transformers' torch fallbacks, and the masking
that makes a verify block's rollback exact."""

import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the oracles; without torch (e.g. a jax-only venv) the module skips

import jax
import jax.numpy as jnp

from dflash_jax.ops import gated_delta

ATOL = 2e-5
_chunked = jax.jit(gated_delta.chunk_gated_delta_rule, static_argnames=("chunk", "normalize_qk"))
_recurrent = jax.jit(gated_delta.recurrent_gated_delta_rule, static_argnames=("normalize_qk",))


def _inputs(seed, batch=2, seq=37, heads=3, dk=8, dv=6):
    rng = np.random.RandomState(seed)
    q, k = rng.randn(batch, seq, heads, dk), rng.randn(batch, seq, heads, dk)
    v = rng.randn(batch, seq, heads, dv)
    g = -rng.uniform(0.01, 1.0, (batch, seq, heads))
    beta = rng.uniform(0, 1, (batch, seq, heads))
    state = 0.3 * rng.randn(batch, heads, dk, dv)
    return [x.astype(np.float32) for x in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("seq,chunk", [(37, 16), (5, 64), (64, 64), (70, 64)])
def test_chunked_and_recurrent_forms_match_transformers(seq, chunk):
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, state = _inputs(seq, seq=seq)
    t = [torch.tensor(x) for x in (q, k, v, g, beta, state)]
    want_o, want_s = torch_chunk_gated_delta_rule(*t[:5], chunk_size=chunk, initial_state=t[5],
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = _chunked(*map(jnp.asarray, (q, k, v, g, beta, state)), chunk=chunk)
    np.testing.assert_allclose(np.asarray(o), want_o.numpy(), atol=ATOL)
    np.testing.assert_allclose(np.asarray(s), want_s.numpy(), atol=ATOL)
    rec_o, rec_s = torch_recurrent_gated_delta_rule(*t[:5], initial_state=t[5], output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    o, s = _recurrent(*map(jnp.asarray, (q, k, v, g, beta, state)))
    np.testing.assert_allclose(np.asarray(o), rec_o.numpy(), atol=ATOL)
    np.testing.assert_allclose(np.asarray(s), rec_s.numpy(), atol=ATOL)


def test_masked_tail_leaves_the_state_after_the_prefix():
    """A block with its slots past n masked ends in the state after its first n tokens, per row,
    in both forms; the recurrent form over the prefix and one block's terms give the same."""
    q, k, v, g, beta, state = map(jnp.asarray, _inputs(3, seq=9))
    lens = jnp.asarray([0, 6])
    gm, bm = gated_delta.mask_tail(g, beta, lens)
    _, masked = _chunked(q, k, v, gm, bm, state, chunk=4)
    np.testing.assert_allclose(np.asarray(masked[0]), np.asarray(state[0]), atol=0)  # exactly unchanged
    _, prefix = _chunked(q[1:, :6], k[1:, :6], v[1:, :6], g[1:, :6], beta[1:, :6],
                                                   state[1:], chunk=4)
    np.testing.assert_allclose(np.asarray(masked[1]), np.asarray(prefix[0]), atol=ATOL)
    _, recurrent_prefix = _recurrent(q[1:, :6], k[1:, :6], v[1:, :6], g[1:, :6], beta[1:, :6], state[1:])
    np.testing.assert_allclose(np.asarray(recurrent_prefix[0]), np.asarray(prefix[0]), atol=ATOL)
    # One block's terms give the state after any prefix, and the block's outputs are the rule's.
    o_block, terms = jax.jit(gated_delta.gated_delta_block)(q, k, v, g, beta, state)
    o_full, _ = _chunked(q, k, v, g, beta, state, chunk=4)
    np.testing.assert_allclose(np.asarray(o_block), np.asarray(o_full), atol=ATOL)
    after = jax.jit(gated_delta.state_after)(state, *terms, lens)
    np.testing.assert_allclose(np.asarray(after[0]), np.asarray(state[0]), atol=0)
    np.testing.assert_allclose(np.asarray(after[1]), np.asarray(prefix[0]), atol=ATOL)


def test_causal_conv_and_its_state_match_torch_conv1d():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    rng = np.random.RandomState(0)
    x = rng.randn(2, 11, 5).astype(np.float32)
    w = rng.randn(4, 5).astype(np.float32)
    zeros = jnp.zeros((2, 3, 5))
    want = causal_conv1d_fn(torch.tensor(x).transpose(1, 2), torch.tensor(w.T), activation="silu").transpose(1, 2)
    conv = gated_delta.causal_conv1d(gated_delta.conv_window(jnp.asarray(x), zeros), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(conv), want.numpy(), atol=1e-5)
    # Split at 7: the state after 7 tokens carries the convolution on exactly.
    head = gated_delta.conv_window(jnp.asarray(x[:, :7]), zeros)
    state = gated_delta.conv_state_after(head, jnp.asarray([7, 7]), 3)
    tail = gated_delta.causal_conv1d(gated_delta.conv_window(jnp.asarray(x[:, 7:]), state), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(tail), want.numpy()[:, 7:], atol=1e-5)
    # A per-row count: row 0 keeps its first 2 tokens after 1 zero of the initial state.
    short = gated_delta.conv_state_after(head, jnp.asarray([2, 7]), 3)
    np.testing.assert_array_equal(np.asarray(short[0]), np.concatenate([np.zeros((1, 5)), x[0, :2]]))
