"""The mixture-of-experts MLP of Qwen3-MoE and gpt-oss targets (Flax NNX): router plus routed experts.

Parameters mirror the checkpoints' modules so their names map one to one (``io.moe_checkpoint``):

- Qwen3-MoE: ``gate.weight [E, hidden]`` (the router, no bias; softmax over all experts, top-k,
  optionally renormalised) and ``experts.gate_up_proj [E, hidden, 2 * inter]`` (gate columns, then
  up), ``experts.down_proj [E, inter, hidden]``; SwiGLU experts.
- gpt-oss: ``router.weight [E, hidden]`` and ``router.bias [E]`` (top-k logits, softmax over them),
  experts with biases and gate-up columns interleaved (gate, up, gate, ...), the clamped SwiGLU
  (``ops.experts``). Float experts hold ``gate_up_proj``/``down_proj`` inputs-first, as transformers
  does; MXFP4 experts hold the checkpoint's ``*_blocks`` / ``*_scales`` uint8 tensors (4-bit values,
  outputs first), expanded only inside the expert matmul.

Expert weights carry the logical axis ``experts`` first (``sharding.py``: expert parallelism).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.config import TargetConfig
from dflash_jax.ops.config import XLA, OpsConfig
from dflash_jax.ops.experts import MXFP4_BLOCK, ExpertWeights, route, routed_experts


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Router(nnx.Module):
    """``weight [E, hidden]`` (torch's layout: a router is tiny) and an optional ``bias [E]``."""

    def __init__(self, hidden: int, num_experts: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (num_experts, hidden), dtype), axes=(None, "embed"))
        self.bias = nnx.Param(jnp.zeros((num_experts,), dtype), axes=(None,)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        logits = jnp.einsum("th,eh->te", x, self.weight[...])
        return logits if self.bias is None else logits + self.bias[...]


class Experts(nnx.Module):
    """``E`` expert MLPs stacked on a leading axis; float or MXFP4 (see the module docstring)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, *, bias: bool, mxfp4: bool, dtype,
                 rngs: nnx.Rngs):
        e = num_experts
        if mxfp4:
            for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
                groups = cols // MXFP4_BLOCK
                blocks = jax.random.randint(rngs.params(), (e, rows, groups, MXFP4_BLOCK // 2), 0, 256, jnp.int32)
                # Scales 2**-9 .. 2**-6: values of the order of an initialised float weight.
                scales = jax.random.randint(rngs.params(), (e, rows, groups), 118, 122, jnp.int32)
                setattr(self, f"{name}_blocks", nnx.Param(blocks.astype(jnp.uint8), axes=("experts", None, None, None)))
                setattr(self, f"{name}_scales", nnx.Param(scales.astype(jnp.uint8), axes=("experts", None, None)))
            self.gate_up_proj = self.down_proj = None
        else:
            self.gate_up_proj = nnx.Param(_normal(rngs, (e, hidden, 2 * inter), dtype), axes=("experts", "embed", None))
            self.down_proj = nnx.Param(_normal(rngs, (e, inter, hidden), dtype), axes=("experts", None, "embed"))
            self.gate_up_proj_blocks = self.gate_up_proj_scales = self.down_proj_blocks = self.down_proj_scales = None
        if bias:
            self.gate_up_proj_bias = nnx.Param(jnp.zeros((e, 2 * inter), dtype), axes=("experts", None))
            self.down_proj_bias = nnx.Param(jnp.zeros((e, hidden), dtype), axes=("experts", None))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.interleaved = bias  # gpt-oss: gate and up columns alternate

    def weights(self) -> ExpertWeights:
        def value(p):
            return None if p is None else p[...]

        if self.gate_up_proj is not None:
            gate_up, down = self.gate_up_proj[...], self.down_proj[...]
        else:
            gate_up = (self.gate_up_proj_blocks[...], self.gate_up_proj_scales[...])
            down = (self.down_proj_blocks[...], self.down_proj_scales[...])
        return ExpertWeights(gate_up, down, value(self.gate_up_proj_bias), value(self.down_proj_bias),
                             self.interleaved)


class MoeMLP(nnx.Module):
    """Router plus routed experts: ``x [..., hidden]`` -> ``[..., hidden]`` (prefill, decode, verify and
    training all run it; ``ops.experts.routed_experts`` picks how)."""

    def __init__(self, config: TargetConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.gpt_oss = c.model_type == "gpt_oss"
        self.top_k = c.num_experts_per_tok
        self.normalize = c.norm_topk_prob
        router = Router(c.hidden_size, c.num_experts, bias=self.gpt_oss, dtype=dtype, rngs=rngs)
        if self.gpt_oss:
            self.router, self.gate = router, None
        else:
            self.gate, self.router = router, None
        self.experts = Experts(c.hidden_size, c.moe_intermediate_size, c.num_experts, bias=self.gpt_oss,
                               mxfp4=c.experts_quantization == "mxfp4", dtype=dtype, rngs=rngs)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [T, hidden]`` -> ``(weights [T, top_k], experts [T, top_k])``."""
        logits = (self.router or self.gate)(x)
        return route(logits, self.top_k, softmax_first=not self.gpt_oss, normalize=self.normalize)

    def __call__(self, x: jax.Array, *, ops: OpsConfig = XLA) -> jax.Array:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(flat)
        out = routed_experts(flat, experts, weights, self.experts.weights(),
                             activation="gpt_oss" if self.gpt_oss else "silu", implementation=ops.experts,
                             kernels=ops.kernels, mosaic=ops.mosaic)
        return out.reshape(x.shape)
