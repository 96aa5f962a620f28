"""Hybrid targets on the GPU: the chunked gated delta kernel compiled by Triton at Qwen3.5's linear
head dims against the model's reference, and a hybrid target's forward with the kernels on against
the XLA ops."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.hybrid import HybridTarget
from dflash_jax.models.hybrid_config import FULL, LINEAR, HybridTargetConfig
from dflash_jax.ops import gated_delta
from dflash_jax.ops.config import XLA, OpsConfig
from kernels_pallas.gated_delta import chunk_gated_delta

pytestmark = pytest.mark.gpu


def test_chunk_kernel_matches_reference_at_qwen35_dims():
    key = jax.random.key(0)
    ks = jax.random.split(key, 6)
    b, h, seq, d = 2, 32, 200, 128  # 200: a padded last chunk
    q = gated_delta.l2_normalize(jax.random.normal(ks[0], (b, seq, h, d)))
    k = gated_delta.l2_normalize(jax.random.normal(ks[1], (b, seq, h, d)))
    v = jax.random.normal(ks[2], (b, seq, h, d))
    g = -jax.random.uniform(ks[3], (b, seq, h), minval=0.01, maxval=1.0)
    beta = jax.random.uniform(ks[4], (b, seq, h))
    state = 0.3 * jax.random.normal(ks[5], (b, h, d, d))
    run = lambda ops: jax.jit(functools.partial(gated_delta.chunk_gated_delta_rule, normalize_qk=False,  # noqa: E731
                                                ops=ops))(q, k, v, g, beta, state)
    (o, s), (want_o, want_s) = run(OpsConfig(attention="pallas")), run(XLA)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=1e-3, rtol=1e-3)
    np.testing.assert_allclose(np.asarray(s), np.asarray(want_s), atol=1e-3, rtol=1e-3)
    direct = jax.jit(functools.partial(chunk_gated_delta, chunk=64))  # the kernel is what ran
    assert "dflash_chunk_gated_delta" in direct.lower(
        *(jnp.moveaxis(jnp.pad(x, ((0, 0), (0, 56)) + ((0, 0),) * (x.ndim - 2)), 1, 2) for x in (q, k, v, g, beta)),
        state).as_text()


def test_hybrid_forward_with_kernels_matches_xla():
    layers = 4
    cfg = HybridTargetConfig(
        model_type="qwen3_5_text", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=layers,
        num_heads=4, num_kv_heads=2, head_dim=64, layer_types=tuple(FULL if i == 2 else LINEAR for i in range(layers)),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
    target = HybridTarget(cfg, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(1), (2, 150), 0, 1024)
    run = lambda ops: jax.jit(lambda i: target.forward(i, tap_layers=(1, 3), ops=ops))(ids)  # noqa: E731
    # float32 at full precision on both paths (the kernel's dots are HIGHEST; XLA's default on a GPU is
    # TF32, whose rounding alone moves these logits by ~1e-3 over four layers), as the engine runs
    # float32 models (EngineConfig.matmul_precision).
    with jax.default_matmul_precision("highest"):
        (logits, taps), (want_logits, want_taps) = run(OpsConfig(attention="pallas")), run(XLA)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-3)
    np.testing.assert_allclose(np.asarray(taps), np.asarray(want_taps), atol=1e-3)
