"""Transformer building blocks shared by the targets and the drafter (Flax NNX): pure model math.

Every parameter carries its logical axis names in the ``axes`` metadata; ``dflash_jax.sharding``
maps them to a mesh. Linear kernels are stored ``[in, out]`` (torch's ``[out, in]`` transposed on
load), with attention projections split per head so that head counts, not flattened widths, decide
sharding. Which implementation runs each op (XLA or a kernel) is decided in ``dflash_jax.ops`` from
the ``OpsConfig`` passed down; these modules never import a kernel.

Two weight layouts: the checkpoint layout (``q/k/v_proj``, ``gate/up_proj``: loading, saving,
training) and the serving layout that ``dflash_jax.runtime.serving_params`` builds on a copy
(``qkv_proj``, ``gate_up_proj``, norms folded into them). The modules run either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.ops import attention as attention_ops
from dflash_jax.ops.config import XLA, OpsConfig
from dflash_jax.ops.linear import dense, one_gpu_row, single_row_dot, single_row_partials
from dflash_jax.ops.norms import add_rms_norm, rms_norm, row_scale


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, axis_name: str = "norm"):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)

    def row_scale(self, x: jax.Array) -> jax.Array:
        """``row_scale`` of ``x [..., dim]`` (float32 ``[..., 1]``), for a norm whose weight is folded
        into the matmul after it."""
        return row_scale(x, self.eps)

    def add_norm(self, h: jax.Array, delta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """``(h + delta, self(h + delta))`` (``delta`` None: ``h``)."""
        return add_rms_norm(h, delta, self.weight[...], self.eps)


class Attention(nnx.Module):
    """Q/K/V/O projections (optional biases and per-head q/k RMSNorm) around the block attention."""

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
        sinks: bool = False,
        window: int | None = None,
        rope_factor: float = 1.0,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps = eps
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: a tuple, not array state
        # gpt-oss: a learned sink logit per query head, a sliding window (static), YaRN's cos/sin scale.
        self.sinks = nnx.Param(jnp.zeros((num_heads,), dtype), axes=("heads",)) if sinks else None
        self.window = window
        self.rope_factor = rope_factor
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
        # The serving layout (``runtime.serving_params``): one QKV weight ``[embed, kv_heads,
        # groups + 2, head_dim]`` (per KV head its query heads, its key, its value) in place of the three.
        self.qkv_proj = self.qkv_bias = None

    @staticmethod
    def _project(x, w, b):
        y = jnp.einsum("...h,hkd->...kd", x, w[...])
        return y if b is None else y + b[...]

    def _qkv(self, x: jax.Array) -> jax.Array:
        """``x [..., hidden]`` -> the raw fused projection ``[..., kv_heads, groups + 2, head_dim]``."""
        y = dense(x, self.qkv_proj)
        return y if self.qkv_bias is None else y + self.qkv_bias[...]

    def _qkv_partials(self, x: jax.Array, ops: OpsConfig) -> jax.Array | None:
        """``x [1, 1, hidden]``, a decode token, on one GPU -> the fused projection as
        ``ops.qkv_partials`` float32 split-K partials ``[S, 2, 1, kv_heads, groups + 2, head_dim]``,
        which the cached attention sums; else None (``_qkv``)."""
        if self.qkv_bias is not None:
            return None
        partials = single_row_partials(x, self.qkv_proj, ops.qkv_partials)
        return None if partials is None else partials.reshape(partials.shape[:2] + x.shape[1:-1] + partials.shape[2:])

    def _norm_weight(self, norm: RMSNorm | None) -> jax.Array | None:
        return None if norm is None else norm.weight[...]

    def finish_k(self, k: jax.Array, positions: jax.Array) -> jax.Array:
        """Raw keys ``[..., seq, kv_heads, head_dim]`` -> normed and RoPE'd."""
        return attention_ops.finish_qk(k, positions, self._norm_weight(self.k_norm), self.eps, self.inv_freq,
                                       self.rope_factor)

    def extras(self) -> dict:
        """The attention's gpt-oss keywords (sinks, window) for ``ops.attention``."""
        return dict(sinks=None if self.sinks is None else self.sinks[...], window=self.window)

    def finish_qkv(self, qkv: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The raw fused projection ``qkv [..., seq, kv_heads, groups + 2, head_dim]`` at ``positions
        [..., seq]`` -> q ``[..., seq, heads, head_dim]`` and k, v ``[..., seq, kv_heads, head_dim]``
        (q and k normed and RoPE'd)."""
        q, k, v = attention_ops.split_qkv(qkv, self.num_heads)
        q = attention_ops.finish_qk(q, positions, self._norm_weight(self.q_norm), self.eps, self.inv_freq,
                                    self.rope_factor)
        return q, self.finish_k(k, positions), v

    def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [..., seq, hidden]`` -> K (normed, RoPE'd) and V, each ``[..., seq, kv_heads, head_dim]``."""
        if self.qkv_proj is not None:
            _, k, v = self.finish_qkv(self._qkv(x), positions)
            return k, v
        k = self._project(x, self.k_proj, self.k_bias)
        return self.finish_k(k, positions), self._project(x, self.v_proj, self.v_bias)

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [..., seq, hidden]`` -> q ``[..., seq, heads, head_dim]`` and k, v
        ``[..., seq, kv_heads, head_dim]`` (q and k normed and RoPE'd)."""
        if self.qkv_proj is not None:
            return self.finish_qkv(self._qkv(x), positions)
        q = attention_ops.finish_qk(self._project(x, self.q_proj, self.q_bias), positions,
                                    self._norm_weight(self.q_norm), self.eps, self.inv_freq, self.rope_factor)
        return (q,) + self.keys_values(x, positions)

    def attend_cached(
        self, x: jax.Array, starts: jax.Array, k_cache: jax.Array, v_cache: jax.Array, blk_lens: jax.Array,
        *, ops: OpsConfig, causal: bool = True, write: bool = True, row_scale: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """A block per row over its KV cache (the target's: causal, the block's K/V written into it;
        the drafter's: ``causal=False, write=False``).

        ``x [batch, 1, block, hidden]`` (normed) at positions ``starts [batch] + slot``; caches
        ``[batch, capacity, kv_heads, head_dim]``; ``blk_lens [batch]`` valid slots. Returns
        ``attn [batch, 1, block, heads, head_dim]`` and the caches, with ``write`` the block written
        at ``starts``. In the serving layout ``x`` may also be the raw residual stream, with
        ``row_scale [batch, 1, block, 1]`` float32 the input norm's row scale (its weight folded into
        the projection).
        """
        if self.qkv_proj is not None:
            qkv = self._qkv_partials(x[:, 0], ops) if ops.kernels else None
            return attention_ops.cached_attention(
                self._qkv(x[:, 0]) if qkv is None else qkv, starts, k_cache, v_cache, blk_lens,
                q_norm=self._norm_weight(self.q_norm), k_norm=self._norm_weight(self.k_norm), eps=self.eps,
                inv_freq=self.inv_freq, num_heads=self.num_heads, causal=causal, write=write,
                row_scale=None if row_scale is None else row_scale[:, 0, :, 0], ops=ops,
                rope_factor=self.rope_factor, **self.extras())
        if row_scale is not None:
            raise ValueError("row_scale needs the serving layout (runtime.serving_params)")
        positions = starts[:, None, None] + jnp.arange(x.shape[2], dtype=jnp.int32)
        return attention_ops.attend_and_write(*self.project(x, positions), starts, k_cache, v_cache, blk_lens,
                                              causal=causal, write=write, ops=ops, **self.extras())

    def output(self, attn: jax.Array, ops: OpsConfig = XLA) -> jax.Array:
        """``[..., seq, heads, head_dim]`` -> ``[..., seq, hidden]`` (a decode token's on one GPU:
        ``ops.output_partials`` split-K partials, summed)."""
        y = single_row_dot(attn, self.o_proj, ops.output_partials, in_dims=2)
        if y is None:
            y = dense(attn, self.o_proj, in_dims=2)
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
        # The serving layout: one gate-up weight ``[embed, mlp, 2]`` (gate, up per unit).
        self.gate_up_proj = self.gate_up_bias = None

    def __call__(self, x: jax.Array, row_scale: jax.Array | None = None) -> jax.Array:
        """``x [..., hidden]`` -> ``[..., hidden]``. ``row_scale [..., 1]`` float32 (the serving layout
        only): gate and up times it (in float32, rounded again) before the SwiGLU, for a norm folded
        into gate-up."""
        def affine(v, w, b):
            y = dense(v, w)
            return y if b is None else y + b[...]

        if row_scale is not None and self.gate_up_proj is None:
            raise ValueError("row_scale needs the serving layout (runtime.serving_params)")
        if self.gate_up_proj is not None:
            gu = affine(x, self.gate_up_proj, self.gate_up_bias)
            gate, up = gu[..., 0], gu[..., 1]
            if row_scale is not None:
                # On the halves, in the SwiGLU's fusion: on the product itself, XLA fuses the scale
                # into gate-up's GEMM, which then waits for the scale's reduction and streams 10% slower.
                gate, up = ((v.astype(jnp.float32) * row_scale).astype(v.dtype) for v in (gate, up))
            h = jax.nn.silu(gate) * up
        else:
            h = jax.nn.silu(affine(x, self.gate_proj, self.gate_bias)) * affine(x, self.up_proj, self.up_bias)
        return affine(h, self.down_proj, self.down_bias)


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
        mlp: nnx.Module | None = None,
        attention_extras: dict | None = None,
    ):
        """``mlp``: a module in place of the dense SwiGLU (a mixture of experts, ``models.moe``);
        ``attention_extras``: ``Attention``'s gpt-oss keywords (sinks, window, rope_factor)."""
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype)
        self.self_attn = Attention(
            hidden, num_heads, num_kv_heads, head_dim, eps=eps, qk_norm=qk_norm, bias=attention_bias,
            inv_freq=inv_freq, dtype=dtype, rngs=rngs, **(attention_extras or {}),
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype)
        self.mlp = mlp if mlp is not None else MLP(hidden, intermediate, bias=mlp_bias, dtype=dtype, rngs=rngs)
        # Static: the norms' weights are folded into the QKV and gate-up weights (the serving layout
        # of ``runtime.serving_params``; the norm weights are then ones).
        self.norms_folded = False

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
        ops: OpsConfig = XLA,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``h [batch, blocks, block, hidden]``, ``positions [batch, blocks, block]``; context
        ``[batch, ctx, kv_heads, head_dim]``; lengths ``[batch, blocks]``.

        Returns the new ``h`` and the block's ``k, v [batch, blocks, block, kv_heads, head_dim]``.
        """
        q, k_blk, v_blk = self.self_attn.project(self.input_layernorm(h), positions)
        attn = attention_ops.block_attention(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal,
                                             ops=ops, **self.self_attn.extras())
        h, mlp_out = self._residual_mlp(h, attn, XLA)
        return h + mlp_out, k_blk, v_blk

    def cached(
        self, h: jax.Array, delta: jax.Array | None, starts: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
        blk_lens: jax.Array, *, ops: OpsConfig = XLA, causal: bool = True, write: bool = True,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The layer over a KV cache, for decoding: the residual stream entering it is ``h + delta``
        (``delta`` None: ``h``), ``[batch, 1, block, hidden]``, at positions ``starts [batch] + slot``,
        ``blk_lens [batch]`` valid slots; caches ``[batch, capacity, kv_heads, head_dim]``. The
        target's layers run causal blocks and write them into their caches; the drafter's layers
        attend bidirectionally to their context caches without writing.

        Returns ``(h, delta)`` whose sum is the layer's output (the add is left to the next norm, so
        that each add and its norm are one fusion) and the caches.

        With the norms folded, a decode token on one GPU runs no norm before a matmul: the QKV and
        gate-up matmuls take the residual stream itself and their products are scaled per row after
        the dot (in the attention kernel, and in the SwiGLU's fusion), so the row scale's reduction
        runs beside the matmul instead of before it. Blocks of several rows keep their norms before
        the matmuls (the weights ones): beside a matmul of 16 rows the reductions slowed it by more
        than the norm costs.
        """
        if self.norms_folded and one_gpu_row(h, self.self_attn.qkv_proj):
            s = h if delta is None else h + delta
            attn, k_cache, v_cache = self.self_attn.attend_cached(
                s, starts, k_cache, v_cache, blk_lens, ops=ops, causal=causal, write=write,
                row_scale=self.input_layernorm.row_scale(s))
            s = s + self.self_attn.output(attn, ops)
            return s, self.mlp(s, row_scale=self.post_attention_layernorm.row_scale(s)), k_cache, v_cache
        h, x = self.input_layernorm.add_norm(h, delta)
        attn, k_cache, v_cache = self.self_attn.attend_cached(x, starts, k_cache, v_cache, blk_lens, ops=ops,
                                                              causal=causal, write=write)
        h, mlp_out = self._residual_mlp(h, attn, ops)
        return h, mlp_out, k_cache, v_cache

    def _residual_mlp(self, h: jax.Array, attn: jax.Array, ops: OpsConfig) -> tuple[jax.Array, jax.Array]:
        """``(h + output(attn), mlp(post_attention_layernorm(h + output(attn))))``: the MLP's residual
        add is the caller's."""
        h, x = self.post_attention_layernorm.add_norm(h, self.self_attn.output(attn, ops))
        return h, (self.mlp(x) if isinstance(self.mlp, MLP) else self.mlp(x, ops=ops))
