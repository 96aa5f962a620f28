"""The DFlash drafter: fused target taps injected as K/V into every layer of a bidirectional block.

The drafter has no embedding and no LM head of its own: the block ``[anchor, MASK, ...]`` is
embedded with the target's table and the draft logits come from the target's head.

Training runs ``__call__`` (many blocks per row, the context given as K/V arrays). Decoding runs
``draft`` (one block per row over the drafter's context cache) in the engine's serving layout
(``serving_layout``): one QKV and one gate-up matmul per layer, and one matmul for the context K/V
of every layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.attention import AttentionImpl
from dflash_jax.cache import KVCache
from dflash_jax.layers import DecoderLayer, RMSNorm, _init, add_rms_norm, dense, fuse_projections, rope_inv_freq
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
        self.context_kv_proj = self.context_kv_bias = None  # the serving layout (``serving_layout``)

    def serving_layout(self) -> None:
        """Switches (in place; idempotent) to the engine's layout: every layer's projections fused
        (``layers.fuse_projections``) for the block, plus ``context_kv_proj [hidden, kv_heads,
        layers, 2, head_dim]``, every layer's K and V weights side by side for ``context_kv``.

        The context K/V are projected apart from the block's queries, so they keep their own copy
        of the K/V weights (one matmul reads all layers' at once). Left to XLA, the separate
        per-layer K/V matmuls were merged into one by concatenating their weights at every step, a
        copy costing as much as the matmul (docs/benchmarks.md). KV heads come first after the input:
        the matmul runs on the weight flattened to 2-D, and a tensor-parallel shard of the flattened
        columns is then a shard of the KV heads (with them inside, XLA gathered the whole weight on
        every step). Checkpoints keep the separate layout.
        """
        if self.context_kv_proj is not None:
            return
        attns = [layer.self_attn for layer in self.layers]
        w = jnp.stack([jnp.stack([a.k_proj[...], a.v_proj[...]], axis=2) for a in attns], axis=2)
        self.context_kv_proj = nnx.data(nnx.Param(w, axes=("embed", "kv_heads", None, None, "head_dim")))
        if attns[0].k_bias is not None:
            b = jnp.stack([jnp.stack([a.k_bias[...], a.v_bias[...]], axis=1) for a in attns], axis=1)
            self.context_kv_bias = nnx.data(nnx.Param(b, axes=("kv_heads", None, None, "head_dim")))
        fuse_projections(self)

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
        if self.context_kv_proj is None:
            kvs = [layer.self_attn.keys_values(ctx, positions) for layer in self.layers]
            return jnp.stack([k for k, _ in kvs]), jnp.stack([v for _, v in kvs])
        kv = dense(ctx, self.context_kv_proj)  # [b, t, kv, layers, 2, d]
        if self.context_kv_bias is not None:
            kv = kv + self.context_kv_bias[...]
        k = jnp.stack([layer.self_attn._finish_k(kv[:, :, :, i, 0], positions) for i, layer in enumerate(self.layers)])
        return k, jnp.moveaxis(kv[:, :, :, :, 1], 3, 0)

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
        h = self._scale_embeds(block_embeds)
        for i, layer in enumerate(self.layers):
            h, _, _ = layer(
                h, positions, k_ctx[i], v_ctx[i], ctx_lens, blk_lens,
                causal=self.config.causal, attention_impl=attention_impl,
            )
        return self.norm(h)

    def draft(
        self, block_embeds: jax.Array, starts: jax.Array, cache: KVCache, blk_lens: jax.Array,
        *, attention_impl: AttentionImpl = "xla",
    ) -> jax.Array:
        """``__call__`` for decoding: one block per row over the drafter's context cache.

        ``block_embeds [batch, 1, block, hidden]`` (raw target embeddings of ``[anchor, MASK, ...]``)
        at positions ``starts [batch] + slot``; it sees the cache positions ``< starts`` (K/V from
        ``context_kv``) and its own ``blk_lens [batch]`` valid slots. With ``attention_impl="pallas"``
        each layer's attention is one kernel and each residual add shares a kernel with its norm
        (``DecoderLayer.cached``). Returns final-normed hidden ``[batch, 1, block, hidden]``.
        """
        h, delta = self._scale_embeds(block_embeds), None
        for i, layer in enumerate(self.layers):
            h, delta, _, _ = layer.cached(h, delta, starts, cache.k[i], cache.v[i], blk_lens,
                                          attention_impl=attention_impl, causal=self.config.causal, write=False)
        return add_rms_norm(h, delta, self.norm, fused=attention_impl == "pallas")[1]

    def _scale_embeds(self, block_embeds: jax.Array) -> jax.Array:
        h = block_embeds.astype(self.fc.dtype)
        if self.config.input_embedding_scale != 1.0:
            h = h * jnp.asarray(self.config.input_embedding_scale, h.dtype)
        return h

    def logits(self, target, hidden: jax.Array) -> jax.Array:
        """Draft logits through the target's LM head (with the drafter's multiplier and softcap)."""
        logits = target.head(hidden.astype(target.embed_tokens.dtype))
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = jnp.tanh(logits / cap) * cap
        return logits
