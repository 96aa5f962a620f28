"""The DFlash drafter: fused target taps injected as K/V into every layer of a bidirectional block.

The drafter has no embedding and no LM head of its own: the block ``[anchor, MASK, ...]`` is
embedded with the target's table and the draft logits come from the target's head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.attention import AttentionImpl
from dflash_jax.layers import DecoderLayer, RMSNorm, _init, rope_inv_freq
from dflash_jax.model_config import DrafterConfig


class Drafter(nnx.Module):
    def __init__(self, config: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        c = config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        self.fc = nnx.Param(
            _init(rngs, (len(c.target_layer_ids) * c.hidden_size, c.hidden_size), dtype), axes=("taps", "embed")
        )
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([
            DecoderLayer(
                c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                eps=c.rms_norm_eps, qk_norm=True, attention_bias=c.attention_bias, mlp_bias=c.mlp_bias,
                inv_freq=inv_freq, dtype=dtype, rngs=rngs,
            )
            for _ in range(c.num_layers)
        ])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)

    def fuse(self, taps: jax.Array) -> jax.Array:
        """``taps [..., n_taps * hidden]`` -> context features ``hidden_norm(fc(taps))`` ``[..., hidden]``."""
        return self.hidden_norm(taps.astype(self.fc.dtype) @ self.fc[...])

    def context_kv(self, taps: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Projects committed tokens' taps into every draft layer's context K/V at once.

        ``taps [batch, t, n_taps * hidden]``, ``positions [batch, t]`` ->
        ``k, v [layers, batch, t, kv_heads, head_dim]`` (K normed and RoPE'd; V raw). Computed once
        per committed token and cached; block K/V are never cached.
        """
        ctx = self.fuse(taps)
        kvs = [layer.self_attn.keys_values(ctx, positions) for layer in self.layers]
        return jnp.stack([k for k, _ in kvs]), jnp.stack([v for _, v in kvs])

    def __call__(
        self,
        block_embeds: jax.Array,
        positions: jax.Array,
        k_ctx: jax.Array,
        v_ctx: jax.Array,
        ctx_lens: jax.Array,
        blk_lens: jax.Array,
        *,
        attention_impl: AttentionImpl = "xla",
    ) -> jax.Array:
        """Drafts query blocks.

        Args:
          block_embeds: ``[batch, blocks, block, hidden]`` the target's raw embeddings of
            ``[anchor, MASK, ...]`` (``input_embedding_scale`` is applied here).
          positions: ``[batch, blocks, block]`` RoPE positions ``anchor + k``.
          k_ctx, v_ctx: ``[layers, batch, ctx, kv_heads, head_dim]`` from ``context_kv``.
          ctx_lens: ``[batch, blocks]`` a block sees context positions ``< ctx_lens``.
          blk_lens: ``[batch, blocks]`` valid slots of each block.

        Returns:
          final-normed hidden ``[batch, blocks, block, hidden]``.
        """
        h = block_embeds.astype(self.fc.dtype)
        if self.config.input_embedding_scale != 1.0:
            h = h * jnp.asarray(self.config.input_embedding_scale, h.dtype)
        for i, layer in enumerate(self.layers):
            h, _, _ = layer(
                h, positions, k_ctx[i], v_ctx[i], ctx_lens, blk_lens,
                causal=self.config.causal, attention_impl=attention_impl,
            )
        return self.norm(h)

    def logits(self, target, hidden: jax.Array) -> jax.Array:
        """Draft logits through the target's LM head (with the drafter's multiplier and softcap)."""
        logits = target.head(hidden.astype(target.embed_tokens.dtype))
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = jnp.tanh(logits / cap) * cap
        return logits
