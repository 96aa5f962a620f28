"""Transformer building blocks shared by the targets and the drafter (Flax NNX).

Every parameter carries its logical axis names in the ``axes`` metadata; ``sharding.py`` maps them
to a mesh. Linear kernels are stored ``[in, out]`` (torch's ``[out, in]`` transposed on load), with
attention projections split per head so that head counts, not flattened widths, decide sharding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.attention import AttentionImpl, block_attention


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF's RMSNorm numerics: normalise in float32, cast back, then scale by the weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, axis_name: str = "norm"):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


# ----------------------------------------------------------------------------------------------
# RoPE (neox half-split), with the rope types found in Qwen3 and Llama-3 checkpoints.
# ----------------------------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | tuple | None) -> np.ndarray:
    """``[head_dim // 2]`` float32 inverse frequencies, computed as transformers computes them."""
    scaling = dict(scaling) if scaling is not None else None
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        factor = np.float32(scaling["factor"])
        low = np.float32(scaling["low_freq_factor"])
        high = np.float32(scaling["high_freq_factor"])
        old_len = np.float32(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """Rotates ``x [..., seq, heads, head_dim]`` by ``positions [..., seq]`` (neox half-split)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., seq, d/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., seq, 1, d]
    cos = jnp.cos(emb).astype(x.dtype)
    sin = jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------------------------
# Attention projections, MLP, decoder layer.
# ----------------------------------------------------------------------------------------------


class Attention(nnx.Module):
    """Q/K/V/O projections (optional biases and per-head q/k RMSNorm) around ``block_attention``."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        eps: float,
        qk_norm: bool,
        bias: bool,
        inv_freq: np.ndarray,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: a tuple, not array state
        self.q_proj = nnx.Param(_init(rngs, (hidden, num_heads, head_dim), dtype), axes=("embed", "heads", "head_dim"))
        self.k_proj = nnx.Param(_init(rngs, (hidden, num_kv_heads, head_dim), dtype), axes=("embed", "kv_heads", "head_dim"))
        self.v_proj = nnx.Param(_init(rngs, (hidden, num_kv_heads, head_dim), dtype), axes=("embed", "kv_heads", "head_dim"))
        self.o_proj = nnx.Param(_init(rngs, (num_heads, head_dim, hidden), dtype), axes=("heads", "head_dim", "embed"))
        if bias:
            self.q_bias = nnx.Param(jnp.zeros((num_heads, head_dim), dtype), axes=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((num_kv_heads, head_dim), dtype), axes=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((num_kv_heads, head_dim), dtype), axes=("kv_heads", "head_dim"))
            self.o_bias = nnx.Param(jnp.zeros((hidden,), dtype), axes=("embed",))
        else:
            self.q_bias = self.k_bias = self.v_bias = self.o_bias = None
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    @staticmethod
    def _project(x, w, b):
        y = jnp.einsum("...h,hkd->...kd", x, w[...])
        return y if b is None else y + b[...]

    def queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x [..., seq, hidden]``, ``positions [..., seq]`` -> ``[..., seq, heads, head_dim]``."""
        q = self._project(x, self.q_proj, self.q_bias)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, positions, self.inv_freq)

    def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [..., seq, hidden]`` -> K (normed, RoPE'd) and V, each ``[..., seq, kv_heads, head_dim]``."""
        k = self._project(x, self.k_proj, self.k_bias)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self._project(x, self.v_proj, self.v_bias)
        return apply_rope(k, positions, self.inv_freq), v

    def output(self, attn: jax.Array) -> jax.Array:
        """``[..., seq, heads, head_dim]`` -> ``[..., seq, hidden]``."""
        y = jnp.einsum("...kd,kdh->...h", attn, self.o_proj[...])
        return y if self.o_bias is None else y + self.o_bias[...]


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.gate_proj = nnx.Param(_init(rngs, (hidden, intermediate), dtype), axes=("embed", "mlp"))
        self.up_proj = nnx.Param(_init(rngs, (hidden, intermediate), dtype), axes=("embed", "mlp"))
        self.down_proj = nnx.Param(_init(rngs, (intermediate, hidden), dtype), axes=("mlp", "embed"))
        if bias:
            self.gate_bias = nnx.Param(jnp.zeros((intermediate,), dtype), axes=("mlp",))
            self.up_bias = nnx.Param(jnp.zeros((intermediate,), dtype), axes=("mlp",))
            self.down_bias = nnx.Param(jnp.zeros((hidden,), dtype), axes=("embed",))
        else:
            self.gate_bias = self.up_bias = self.down_bias = None

    def __call__(self, x: jax.Array) -> jax.Array:
        def dense(v, w, b):
            y = v @ w[...]
            return y if b is None else y + b[...]

        h = jax.nn.silu(dense(x, self.gate_proj, self.gate_bias)) * dense(x, self.up_proj, self.up_bias)
        return dense(h, self.down_proj, self.down_bias)


class DecoderLayer(nnx.Module):
    """One pre-norm decoder layer over query blocks; serves the target and the drafter alike.

    The target passes its KV cache as the context and its own token embeddings as the block
    (``causal=True``); the drafter passes the projected target context and the noise block
    (``causal=False``). The block's K/V are returned so the target can write them to its cache.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        eps: float,
        qk_norm: bool,
        attention_bias: bool,
        mlp_bias: bool,
        inv_freq: np.ndarray,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype)
        self.self_attn = Attention(
            hidden, num_heads, num_kv_heads, head_dim, eps=eps, qk_norm=qk_norm, bias=attention_bias,
            inv_freq=inv_freq, dtype=dtype, rngs=rngs,
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype)
        self.mlp = MLP(hidden, intermediate, bias=mlp_bias, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        h: jax.Array,
        positions: jax.Array,
        k_ctx: jax.Array,
        v_ctx: jax.Array,
        ctx_lens: jax.Array,
        blk_lens: jax.Array,
        *,
        causal: bool,
        attention_impl: AttentionImpl = "xla",
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``h [batch, blocks, block, hidden]``, ``positions [batch, blocks, block]``; context
        ``[batch, ctx, kv_heads, head_dim]``; lengths ``[batch, blocks]``.

        Returns the new ``h`` and the block's ``k, v [batch, blocks, block, kv_heads, head_dim]``.
        """
        x = self.input_layernorm(h)
        q = self.self_attn.queries(x, positions)
        k_blk, v_blk = self.self_attn.keys_values(x, positions)
        attn = block_attention(
            q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal, impl=attention_impl
        )
        h = h + self.self_attn.output(attn)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k_blk, v_blk
