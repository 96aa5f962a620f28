"""The pure-jnp functions of the Mosaic GPU expert-products kernels (``mosaic_gpu.expert_products``),
and the MXFP4 format they decode.

``dflash_jax.ops.experts`` groups a step's (token, expert) pairs by expert into ``G`` groups of ``S``
row slots and runs each group's rows through its expert's matrix; this is that product, for tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The 16 values of a 4-bit E2M1 code, as the MXFP4 format (and transformers) decode them.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
MXFP4_BLOCK = 32  # values sharing one scale
MXFP4_SCALE_BIAS = 127  # a scale byte s means 2 ** (s - 127)


def mxfp4_dequantize(blocks: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """MXFP4 ``blocks [..., rows, groups, 16]`` uint8 (two 4-bit codes a byte, low nibble first) and
    ``scales [..., rows, groups]`` uint8 -> ``[..., rows, groups * 32]`` in ``dtype``.

    Each value is ``FP4_VALUES[code] * 2 ** (scale - 127)``, computed in float32 (exact: a power of two
    times a 3-bit mantissa) and rounded to ``dtype``, as transformers' ``convert_moe_packed_tensors``.
    """
    lut = jnp.asarray(FP4_VALUES)
    low, high = lut[(blocks & 0x0F).astype(jnp.int32)], lut[(blocks >> 4).astype(jnp.int32)]
    values = jnp.stack([low, high], axis=-1).reshape(blocks.shape[:-1] + (blocks.shape[-1] * 2,))
    exponent = scales.astype(jnp.int32) - MXFP4_SCALE_BIAS
    values = jnp.ldexp(values, exponent[..., None])
    return values.reshape(values.shape[:-2] + (-1,)).astype(dtype)


def expert_products_reference(rows: jax.Array, weight: jax.Array, experts: jax.Array,
                              counts: jax.Array) -> jax.Array:
    """``rows [G, S, K]`` times expert ``experts[g]``'s ``weight [E, K, N]`` -> float32 ``[G, S, N]``,
    zeros for a group of ``counts[g] == 0`` (an unused group: its expert's bytes are not read)."""
    products = jnp.einsum("gsk,gkn->gsn", rows, jnp.take(weight, experts, axis=0),
                          preferred_element_type=jnp.float32)
    return jnp.where((counts > 0)[:, None, None], products, 0.0)


def mxfp4_expert_products_reference(rows: jax.Array, blocks: jax.Array, scales: jax.Array, experts: jax.Array,
                                    counts: jax.Array) -> jax.Array:
    """``expert_products_reference`` of MXFP4 experts ``blocks [E, N, K / 32, 16]``, ``scales [E, N, K /
    32]`` (outputs first, as the checkpoints store them), dequantized to ``rows.dtype``."""
    weight = jnp.swapaxes(mxfp4_dequantize(jnp.take(blocks, experts, axis=0), jnp.take(scales, experts, axis=0),
                                           rows.dtype), 1, 2)
    return expert_products_reference(rows, weight, jnp.arange(experts.shape[0]), counts)
