"""A decode token's MLP as independent chains over slices of its intermediate units (a prototype for
``sweep_decode_options.py``'s ``mlp_chains:`` variants; not used by the engine).

At batch 1 a layer is one chain of kernels, and HBM idles at every link: a GEMM's fill and drain, the
SwiGLU between gate-up and down. The MLP splits into independent chains without changing its math:
``down(silu(x G) * (x U)) = sum_c down_c(silu(x G_c) * (x U_c))`` over slices ``c`` of the intermediate
units. With the decode loop's CUDA graph ordered by data flow (``CONCURRENT``, the engine's mode) the
chains are branches of the graph, so one chain's short kernels and its GEMMs' fill and drain can
overlap another chain's streaming. ``lag``: chain ``c``'s input passes an ``optimization_barrier``
with chain ``c - 1``'s gate-up, meant to stagger the chains; it orders XLA's schedule but adds no
edge to the graph (in the trace two chains' gate-ups still start together). Measured, not adopted:
docs/benchmarks.md, twenty-fifth session.

Each chain has weight arrays of its own (``attach_chains``: static slices inside the jitted step
would be copies, docs/benchmarks.md, twentieth session). The chains' down products are summed in
chain order, in float32 when written out as split-K partials (``parts``), so tokens may differ from
the one-chain MLP's in the last bits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax import layers


def attach_chains(target, chains: int) -> None:
    """Gives every layer's fused MLP (``gate_up_proj [hidden, intermediate, 2]``) ``chains`` weight
    slices of its own, ``chain_gu_c [hidden, intermediate / chains, 2]`` and ``chain_down_c
    [intermediate / chains, hidden]`` (copies: the originals stay for every other path)."""
    for layer in target.layers:
        mlp = layer.mlp
        gate_up, down = mlp.gate_up_proj[...], mlp.down_proj[...]
        width = gate_up.shape[1] // chains
        for c in range(chains):
            units = slice(c * width, (c + 1) * width)
            setattr(mlp, f"chain_gu_{c}", nnx.data(nnx.Param(gate_up[:, units])))
            setattr(mlp, f"chain_down_{c}", nnx.data(nnx.Param(down[units])))
        mlp.chains = chains


def detach_chains(target) -> None:
    """Undoes ``attach_chains`` (nothing where none are attached), leaving the modules as they were."""
    for layer in target.layers:
        mlp = layer.mlp
        if not hasattr(mlp, "chains"):
            continue
        for c in range(mlp.chains):
            delattr(mlp, f"chain_gu_{c}")
            delattr(mlp, f"chain_down_{c}")
        delattr(mlp, "chains")


def chained_call(default_call, *, parts: int, lag: bool):
    """``MLP.__call__`` that runs a single row through the layer's attached chains (``parts``: each
    chain's down written out as that many float32 split-K partials; 0: each chain's down as XLA's
    dot), every chain's products summed in float32 in one reduction."""

    def call(self, x: jax.Array) -> jax.Array:
        chains = getattr(self, "chains", 0)
        if not chains or math.prod(x.shape[:-1]) != 1 or self.gate_up_bias is not None:
            return default_call(self, x)
        products, previous = [], None
        for c in range(chains):
            xc = x if previous is None or not lag else jax.lax.optimization_barrier((x, previous))[0]
            gu = layers.dense(xc, getattr(self, f"chain_gu_{c}"))
            previous = gu
            h = jax.nn.silu(gu[..., 0]) * gu[..., 1]
            down = getattr(self, f"chain_down_{c}")
            partials = layers.single_row_partials(h, down, parts) if parts else None
            if partials is None:  # XLA's dot (off a GPU, the CPU smoke test: always)
                products.append(layers.dense(h, down).astype(jnp.float32).reshape(1, 1, -1))
            else:
                products.append(partials[:, :1].reshape(parts, 1, -1))
        return jnp.sum(jnp.concatenate(products), axis=0).astype(x.dtype).reshape(x.shape)

    return call
