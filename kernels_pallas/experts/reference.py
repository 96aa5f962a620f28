"""The pure-jnp function of the Mosaic GPU expert-products kernel (``mosaic_gpu.expert_products``).

``dflash_jax.ops.experts`` groups a step's (token, expert) pairs by expert into ``G`` groups of ``S``
row slots and runs each group's rows through its expert's matrix; this is that product, for tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expert_products_reference(rows: jax.Array, weight: jax.Array, experts: jax.Array,
                              counts: jax.Array) -> jax.Array:
    """``rows [G, S, K]`` times expert ``experts[g]``'s ``weight [E, K, N]`` -> float32 ``[G, S, N]``,
    zeros for a group of ``counts[g] == 0`` (an unused group: its expert's bytes are not read)."""
    products = jnp.einsum("gsk,gkn->gsn", rows, jnp.take(weight, experts, axis=0),
                          preferred_element_type=jnp.float32)
    return jnp.where((counts > 0)[:, None, None], products, 0.0)
