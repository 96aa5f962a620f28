"""The Mosaic GPU expert products (``kernels_pallas.experts``) compiled for the GPU (Hopper or later)
against their references, at Qwen3-30B-A3B (bf16) and gpt-oss-20b (MXFP4) expert shapes, alone and as
``ops.experts.routed_experts`` with ``mosaic=True`` (``OpsConfig.gpu_lowering = "mosaic"``) against its
XLA grouped matmuls; and tokamax's ragged dot in those grouped matmuls where it is installed.

    JAX_PLATFORMS=cuda python -m pytest -q -m gpu tests/gpu/test_gpu_experts_mosaic.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from dflash_jax.models.moe import MoeMLP
from dflash_jax.ops import OpsConfig
from dflash_jax.ops.experts import ExpertWeights, library_ragged_dot, route, routed_experts, uses_mosaic_kernel
from dflash_jax.tiny import tiny_target_config
from kernels_pallas.experts import mosaic_gpu
from kernels_pallas.experts.mosaic_gpu import MosaicConfig
from kernels_pallas.experts.reference import expert_products_reference, mxfp4_expert_products_reference

pytestmark = pytest.mark.gpu

bf16 = jnp.bfloat16


def relative(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def mxfp4(key, experts, outputs, inputs):
    kb, ks = jax.random.split(key)
    blocks = jax.random.randint(kb, (experts, outputs, inputs // 32, 16), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.randint(ks, (experts, outputs, inputs // 32), 118, 127, jnp.int32).astype(jnp.uint8)
    return blocks, scales


def groups(key, num_experts, tokens, top_k):
    """The groups a random routing of ``tokens`` tokens makes: distinct touched experts, padded."""
    ids = jax.random.randint(key, (tokens, top_k), 0, num_experts)
    g = min(tokens * top_k, num_experts)
    unique = jnp.unique(ids, size=g, fill_value=num_experts)
    return jnp.minimum(unique, num_experts - 1), jnp.where(unique < num_experts, tokens, 0).astype(jnp.int32)


@pytest.mark.parametrize("tokens", [1, 16, 64])
@pytest.mark.parametrize("config", [MosaicConfig(), MosaicConfig(block_k=64, stages=2), MosaicConfig(splits=3)],
                         ids=str)
def test_expert_products_bf16_equal_reference(tokens, config):
    """Qwen3-30B-A3B's gate-up (2,048 -> 1,536) and down (768 -> 2,048) over 128 experts."""
    ks = jax.random.split(jax.random.key(tokens), 4)
    ids, counts = groups(ks[0], 128, tokens, 8)
    slots = mosaic_gpu.slots_for(tokens)
    for inputs, outputs in ((2048, 1536), (768, 2048)):
        weight = (jax.random.normal(ks[1], (128, inputs, outputs)) * inputs**-0.5).astype(bf16)
        rows = jax.random.normal(ks[2], (ids.shape[0], slots, inputs)).astype(bf16)
        got = jax.jit(lambda r, w, e, c: mosaic_gpu.expert_products(r, w, e, c, config=config))(rows, weight, ids,
                                                                                                counts)
        want = expert_products_reference(rows, weight, ids, counts)
        assert relative(got, want) < 1e-5, (inputs, outputs)


@pytest.mark.parametrize("tokens", [1, 16, 32])
def test_expert_products_mxfp4_equal_reference(tokens):
    """gpt-oss-20b's MXFP4 gate-up (2,880 -> 5,760) and down (2,880 -> 2,880) over 32 experts: the codes
    and scales decoded in the kernel give the dequantized weights' products to float32 rounding."""
    ks = jax.random.split(jax.random.key(tokens), 3)
    ids, counts = groups(ks[0], 32, tokens, 4)
    slots = mosaic_gpu.slots_for(tokens)
    for outputs in (5760, 2880):
        blocks, scales = mxfp4(ks[1], 32, outputs, 2880)
        rows = jax.random.normal(ks[2], (ids.shape[0], slots, 2880)).astype(bf16)
        got = jax.jit(mosaic_gpu.mxfp4_expert_products)(rows, blocks, scales, ids, counts)
        want = mxfp4_expert_products_reference(rows, blocks, scales, ids, counts)
        assert relative(got, want) < 1e-5, outputs


def routed_case(family: str, tokens: int):
    """A layer's experts at the family's published shapes (gpt-oss: MXFP4 with biases), ``tokens``
    random rows and their routing: ``(x, ids, weights, w, activation)``."""
    quantized = family == "gpt_oss"
    e, k, hidden, inter = (32, 4, 2880, 2880) if quantized else (128, 8, 2048, 768)
    ks = jax.random.split(jax.random.key(tokens), 6)
    if quantized:
        w = ExpertWeights(mxfp4(ks[0], e, 2 * inter, hidden), mxfp4(ks[1], e, hidden, inter),
                          (0.1 * jax.random.normal(ks[2], (e, 2 * inter))).astype(bf16),
                          (0.1 * jax.random.normal(ks[3], (e, hidden))).astype(bf16), interleaved=True)
    else:
        w = ExpertWeights((jax.random.normal(ks[0], (e, hidden, 2 * inter)) * hidden**-0.5).astype(bf16),
                          (jax.random.normal(ks[1], (e, inter, hidden)) * inter**-0.5).astype(bf16))
    x = jax.random.normal(ks[4], (tokens, hidden)).astype(bf16)
    weights, ids = route(jax.random.normal(ks[5], (tokens, e)), k, softmax_first=not quantized, normalize=True)
    return x, ids, weights.astype(bf16), w, "gpt_oss" if quantized else "silu"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_routed_experts_on_the_mosaic_kernel_equal_grouped_matmuls(family, tokens):
    """``routed_experts`` under the Mosaic lowering ("gemv") runs the kernel and equals the XLA grouped matmuls to bf16
    rounding, twice the same (deterministic: no atomics)."""
    x, ids, weights, w, activation = routed_case(family, tokens)
    assert uses_mosaic_kernel("gemv", ids.shape, w, bf16, kernels=True, mosaic=True)
    run = jax.jit(lambda x, ids, weights, w: routed_experts(x, ids, weights, w, activation=activation,
                                                            implementation="gemv", kernels=True, mosaic=True))
    got = run(x, ids, weights, w)
    want = routed_experts(x, ids, weights, w, activation=activation, implementation="ragged_dot")
    assert relative(got, want) < 1e-2
    np.testing.assert_array_equal(np.asarray(run(x, ids, weights, w)), np.asarray(got))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("tokens", [64, 256])
def test_grouped_matmuls_on_tokamax_equal_xla(family, tokens):
    """With tokamax installed, "ragged_dot" with the kernels on runs tokamax's Mosaic GPU ragged dot
    (a batch-4 and a batch-16 verify block's tokens) and equals XLA's ``ragged_dot`` to bf16 rounding."""
    if not library_ragged_dot(bf16, kernels=True):
        pytest.skip("tokamax is not installed here (the `tokamax` extra)")
    x, ids, weights, w, activation = routed_case(family, tokens)
    run = jax.jit(lambda x, ids, weights, w, kernels: routed_experts(
        x, ids, weights, w, activation=activation, implementation="ragged_dot", kernels=kernels),
        static_argnames="kernels")
    assert "mosaic_gpu" in run.lower(x, ids, weights, w, kernels=True).as_text()
    assert relative(run(x, ids, weights, w, kernels=True), run(x, ids, weights, w, kernels=False)) < 1e-2


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_mlp_on_the_mosaic_lowering_equals_xla(family):
    """A model's MoE MLP (router and experts, 7 experts of 128 / 64, MXFP4 for gpt-oss) with
    ``OpsConfig(attention="pallas", gpu_lowering="mosaic")`` against the XLA ops, for a decode token and
    a block of 8 (24 pairs: within the kernel's four an expert; Qwen3-MoE's on tokamax where installed)."""
    overrides = dict(hidden_size=128, moe_intermediate_size=64, num_experts=7, num_experts_per_tok=3)
    if family == "gpt_oss":
        overrides["experts_quantization"] = "mxfp4"
    mlp = MoeMLP(tiny_target_config(family, **overrides), dtype=bf16, rngs=nnx.Rngs(0))
    mosaic = OpsConfig(attention="pallas", gpu_lowering="mosaic")
    for tokens in (1, 8):
        # MXFP4 experts take the kernel from as many pairs as experts (7) on; float experts below that, and
        # above it too where tokamax is not installed.
        many = tokens * 3 >= 7
        tokamax = family == "qwen3_moe" and many and library_ragged_dot(bf16, kernels=True)
        assert uses_mosaic_kernel("auto", (tokens, 3), mlp.experts.weights(), bf16, kernels=mosaic.kernels,
                                  mosaic=mosaic.mosaic) == ((family == "qwen3_moe" or many) and not tokamax)
        x = jax.random.normal(jax.random.key(tokens), (tokens, 128)).astype(bf16)
        got = nnx.jit(lambda m, x: m(x, ops=mosaic))(mlp, x)
        want = nnx.jit(lambda m, x: m(x))(mlp, x)
        assert relative(got, want) < 1e-2, tokens
