"""The Mosaic GPU expert products (``kernels_pallas.experts``) on the CPU: lowered for CUDA (every
supported JAX), and run in Mosaic GPU's interpret mode (jax >= 0.11) against their references, alone
and as ``ops.experts.mosaic_routed_experts`` against ``routed_experts_reference``. What the GPU
compiles from them runs in tests/gpu/test_gpu_mosaic.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops import experts as experts_ops
from dflash_jax.ops.experts import ExpertWeights, mosaic_routed_experts, routed_experts_reference, uses_mosaic_kernel
from kernels_pallas._mosaic import mosaic_interpret_available
from kernels_pallas.experts import mosaic_gpu
from kernels_pallas.experts.mosaic_gpu import MosaicConfig, plan
from kernels_pallas.experts.reference import FP4_VALUES, expert_products_reference, mxfp4_expert_products_reference
from lowering import lower_for

interpreted = pytest.mark.skipif(not mosaic_interpret_available(),
                                 reason="Mosaic GPU's interpret mode needs jax >= 0.11")
sd = jax.ShapeDtypeStruct
bf16 = jnp.bfloat16


def mxfp4(key, experts: int, outputs: int, inputs: int):
    """Random MXFP4 ``(blocks [E, N, K / 32, 16], scales [E, N, K / 32])``: every code, scales near 1."""
    kb, ks = jax.random.split(key)
    blocks = jax.random.randint(kb, (experts, outputs, inputs // 32, 16), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.randint(ks, (experts, outputs, inputs // 32), 122, 130, jnp.int32).astype(jnp.uint8)
    return blocks, scales


def expert_weights(key, experts: int, hidden: int, inter: int, *, quantized: bool, biases: bool) -> ExpertWeights:
    ks = jax.random.split(key, 4)
    if quantized:
        gate_up, down = mxfp4(ks[0], experts, 2 * inter, hidden), mxfp4(ks[1], experts, hidden, inter)
    else:
        gate_up = (jax.random.normal(ks[0], (experts, hidden, 2 * inter)) / hidden**0.5).astype(bf16)
        down = (jax.random.normal(ks[1], (experts, inter, hidden)) / inter**0.5).astype(bf16)
    gate_up_bias = (0.1 * jax.random.normal(ks[2], (experts, 2 * inter))).astype(bf16) if biases else None
    down_bias = (0.1 * jax.random.normal(ks[3], (experts, hidden))).astype(bf16) if biases else None
    return ExpertWeights(gate_up, down, gate_up_bias, down_bias, interleaved=biases)


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# -- lowering for CUDA (any JAX) -------------------------------------------------------------------


@pytest.mark.parametrize("quantized,tokens", [(False, 1), (False, 16), (True, 1), (True, 16)],
                         ids=["qwen3-bf16-decode", "qwen3-bf16-verify", "gpt-oss-mxfp4-decode", "gpt-oss-mxfp4-verify"])
def test_routed_experts_lower_for_cuda(quantized, tokens):
    """Qwen3-30B-A3B (bf16, 128 experts, top-8, 2,048 / 768) and gpt-oss-20b (MXFP4, 32 experts, top-4,
    2,880 / 2,880) experts for a decode token and a verify block: the Pallas Mosaic GPU lowering takes
    every layout, TMA box and wgmma operand; the products are the two kernel calls alone (no matrix
    product left to XLA)."""
    num_experts, top_k, hidden, inter = (32, 4, 2880, 2880) if quantized else (128, 8, 2048, 768)
    w = jax.eval_shape(lambda: expert_weights(jax.random.key(0), num_experts, hidden, inter, quantized=quantized,
                                              biases=quantized))
    fn = jax.jit(lambda x, e, r, w: mosaic_routed_experts(x, e, r, w, "gpt_oss" if quantized else "silu",
                                                          interpret=False))
    args = (sd((tokens, hidden), bf16), sd((tokens, top_k), jnp.int32), sd((tokens, top_k), bf16), w)
    assert experts_ops.mosaic_kernel_fits(tokens, w, bf16)
    text = lower_for(fn, args, "cuda").as_text()
    assert text.count("custom_call @mosaic_gpu") == 2 and "dot_general" not in text


def test_plan_and_fits():
    """Splits fill one wave of an H200 (132 SMs, as many programs an SM as its shared memory holds)
    where the groups' tiles do not; shapes the kernel does not take fall back to XLA (float32, a width
    of no whole tiles, many tokens); the kernel runs only where asked for on a GPU."""
    cfg = MosaicConfig(num_sms=132)
    assert plan(8, 2048, 1536, 8, cfg) == 2  # a Qwen3-30B-A3B decode token's gate-up: 192 tiles, 3 an SM
    assert plan(8, 768, 2048, 8, cfg) == 1  # its down projection: 256 tiles
    assert plan(80, 2048, 1536, 16, cfg) == 1
    assert plan(1, 256, 64, 8, cfg) == 2  # capped by the input tiles
    assert plan(4, 2880, 2880, 8, cfg, mxfp4=True) == 4  # gpt-oss-20b's down projection: 180 tiles, 6 an SM
    assert mosaic_gpu.supports(2880, 5760, 1, bf16) and mosaic_gpu.block_k_for(2880) == 64
    assert not mosaic_gpu.supports(2048, 1536, 1, jnp.float32)
    assert not mosaic_gpu.supports(2048, 1000, 1, bf16) and not mosaic_gpu.supports(2048, 1536, 65, bf16)
    assert mosaic_gpu.mxfp4_supports(2880, 2880, 16, bf16) and not mosaic_gpu.mxfp4_supports(2880 + 32, 2880, 1, bf16)
    w = jax.eval_shape(lambda: expert_weights(jax.random.key(0), 128, 2048, 768, quantized=False, biases=False))
    assert not uses_mosaic_kernel("auto", (1, 8), w, bf16, kernels=True, mosaic=True)  # not a GPU
    with pytest.raises(ValueError, match="block_k"):
        MosaicConfig(block_k=96)


def test_every_mxfp4_byte_decodes_to_its_two_values():
    """The kernel's decoding arithmetic (plain jnp here): both nibbles of all 256 bytes, signs and
    negative zeros included, times powers of two from 2 ** -20 to 2 ** 20, equal the E2M1 table."""
    codes = jnp.arange(256, dtype=jnp.int32)
    for exponent in (-20, 0, 20):
        factor = jnp.float32(2.0**exponent)
        for shift, nibble in ((0, np.arange(256) & 15), (4, np.arange(256) >> 4)):
            got = np.asarray(mosaic_gpu._scaled_fp4(codes, shift, factor))
            want = FP4_VALUES[nibble] * np.float32(2.0**exponent)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_dispatch_on_a_gpu(monkeypatch):
    """On a Hopper GPU with the kernels on, whichever the lowering: "auto" steps of up to four pairs an
    expert run the kernel, but MXFP4 steps of fewer pairs than experts ("gemv" is faster there) and, with
    tokamax installed, 16-bit steps of at least as many pairs as experts (its grouped matmul is faster
    there; on a mesh, where it does not run, the kernel stays); "gemv" runs it under the Mosaic lowering
    only; grouped matmuls, larger steps, kernels off and older GPUs never."""
    from dflash_jax import sharding
    from kernels_pallas import _mosaic

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(_mosaic, "hopper_or_later", lambda: True)
    monkeypatch.setattr(experts_ops, "_tokamax_ragged_dot", lambda: None)  # not installed
    w = jax.eval_shape(lambda: expert_weights(jax.random.key(0), 128, 2048, 768, quantized=False, biases=False))
    for mosaic in (False, True):
        assert uses_mosaic_kernel("auto", (1, 8), w, bf16, kernels=True, mosaic=mosaic)
        assert uses_mosaic_kernel("auto", (64, 8), w, bf16, kernels=True, mosaic=mosaic)
        assert not uses_mosaic_kernel("auto", (65, 8), w, bf16, kernels=True, mosaic=mosaic)
        assert not uses_mosaic_kernel("ragged_dot", (1, 8), w, bf16, kernels=True, mosaic=mosaic)
    assert uses_mosaic_kernel("gemv", (64, 8), w, bf16, kernels=True, mosaic=True)
    assert not uses_mosaic_kernel("gemv", (64, 8), w, bf16, kernels=True, mosaic=False)
    assert not uses_mosaic_kernel("auto", (1, 8), w, bf16, kernels=False)  # the XLA ops
    q = jax.eval_shape(lambda: expert_weights(jax.random.key(0), 32, 2880, 2880, quantized=True, biases=True))
    assert uses_mosaic_kernel("auto", (32, 4), q, bf16, kernels=True)
    assert uses_mosaic_kernel("auto", (8, 4), q, bf16, kernels=True)  # as many pairs as experts
    assert not uses_mosaic_kernel("auto", (7, 4), q, bf16, kernels=True)  # fewer: "gemv"
    assert not uses_mosaic_kernel("auto", (1, 4), q, bf16, kernels=True, mosaic=True)
    assert uses_mosaic_kernel("gemv", (1, 4), q, bf16, kernels=True, mosaic=True)
    assert not uses_mosaic_kernel("auto", (33, 4), q, bf16, kernels=True)  # more than 4 pairs an expert
    monkeypatch.setattr(experts_ops, "_tokamax_ragged_dot", lambda: jax.lax.ragged_dot)  # installed
    for mosaic in (False, True):
        assert uses_mosaic_kernel("auto", (8, 8), w, bf16, kernels=True, mosaic=mosaic)  # 64 pairs of 128 experts
        assert not uses_mosaic_kernel("auto", (16, 8), w, bf16, kernels=True, mosaic=mosaic)  # 128: tokamax
        assert not uses_mosaic_kernel("auto", (64, 8), w, bf16, kernels=True, mosaic=mosaic)
    assert uses_mosaic_kernel("auto", (32, 4), q, bf16, kernels=True)  # MXFP4: the kernel, as without tokamax
    with sharding.kernel_mesh(sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=2), jax.devices()[:2])):
        assert uses_mosaic_kernel("auto", (16, 8), w, bf16, kernels=True)
    monkeypatch.setattr(_mosaic, "hopper_or_later", lambda: False)  # an A100: no wgmma
    assert not uses_mosaic_kernel("auto", (1, 8), w, bf16, kernels=True)


# -- interpret mode (jax >= 0.11) --------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("config", [MosaicConfig(), MosaicConfig(splits=2, block_k=64, stages=2)], ids=str)
def test_expert_products_interpreted_equal_reference(config):
    """bf16 experts (5, an odd count), three groups (one unused: zeros, its expert not read), 8 and 16
    row slots, inputs split over programs (a last split shorter than the others at 3 tiles over 2)."""
    ks = jax.random.split(jax.random.key(1), 2)
    for slots, inputs in ((8, 192), (16, 256)):
        weight = jax.random.normal(ks[0], (5, inputs, 128)).astype(bf16)
        rows = jax.random.normal(ks[1], (3, slots, inputs)).astype(bf16)
        experts, counts = jnp.array([4, 0, 2], jnp.int32), jnp.array([1, slots, 0], jnp.int32)
        got = mosaic_gpu.expert_products(rows, weight, experts, counts, config=config, interpret=True)
        want = expert_products_reference(rows, weight, experts, counts)
        assert relative_error(got, want) < 1e-5
        np.testing.assert_array_equal(np.asarray(got[2]), 0)


@interpreted
@pytest.mark.parametrize("splits", [None, 2])
def test_mxfp4_expert_products_interpreted_equal_reference(splits):
    """MXFP4 experts (every code, both signs and zeros, scales around 1) decoded in the kernel: the
    products of the dequantized weights to float32 rounding (the products are exact; only the order
    of the sums differs)."""
    blocks, scales = mxfp4(jax.random.key(2), 5, 128, 192)
    rows = jax.random.normal(jax.random.key(3), (3, 8, 192)).astype(bf16)
    experts, counts = jnp.array([1, 4, 3], jnp.int32), jnp.array([2, 1, 0], jnp.int32)
    got = mosaic_gpu.mxfp4_expert_products(rows, blocks, scales, experts, counts,
                                           config=MosaicConfig(splits=splits), interpret=True)
    want = mxfp4_expert_products_reference(rows, blocks, scales, experts, counts)
    assert relative_error(got, want) < 1e-6
    np.testing.assert_array_equal(np.asarray(got[2]), 0)


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_mosaic_routed_experts_interpreted_equal_reference(family):
    """The whole op through the kernel: Qwen3-MoE's SwiGLU on bf16 experts (7 experts, top-3) and
    gpt-oss's clamped interleaved SwiGLU with biases on MXFP4 experts (5 experts, top-2); a decode
    token, and three tokens sharing experts (one expert chosen by all three); then the same step as
    one device's share under expert parallelism (experts 2-4 held, the other pairs adding nothing)."""
    quantized = family == "gpt_oss"
    num_experts, top_k = (5, 2) if quantized else (7, 3)
    activation = "gpt_oss" if quantized else "silu"
    w = expert_weights(jax.random.key(4), num_experts, 128, 64, quantized=quantized, biases=quantized)
    x = jax.random.normal(jax.random.key(5), (3, 128)).astype(bf16)
    routing = jnp.array([[0, 3, 1], [3, 2, 0], [4, 3, 1]], jnp.int32)[:, :top_k]
    weights = jax.nn.softmax(jax.random.normal(jax.random.key(6), (3, top_k)), axis=-1).astype(bf16)
    for tokens in (1, 3):
        args = (x[:tokens], routing[:tokens], weights[:tokens], w)
        got = mosaic_routed_experts(*args, activation, interpret=True)
        want = routed_experts_reference(*args, activation=activation)
        assert relative_error(got, want) < 2e-2, tokens
    local = jax.tree.map(lambda a: a[2:5], w)
    for tokens in (1, 3):
        args = (x[:tokens], routing[:tokens], weights[:tokens])
        got = mosaic_routed_experts(*args, local, activation, 2, interpret=True)
        mine = jnp.where((args[1] >= 2) & (args[1] < 5), args[2], 0)
        want = routed_experts_reference(args[0], args[1], mine, w, activation=activation)
        assert relative_error(got, want) < 2e-2, tokens
