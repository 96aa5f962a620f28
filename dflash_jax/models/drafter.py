"""The DFlash drafter: fused target taps injected as K/V into every layer of a bidirectional block.

The drafter has no embedding and no LM head of its own: the block ``[anchor, MASK, ...]`` is
embedded with the target's table and the draft logits come from the target's head.

Training runs ``__call__`` (many blocks per row, the context given as K/V arrays). Decoding runs
``draft`` (one block per row over the drafter's context cache) in the engine's serving layout
(``runtime.serving_params``): one QKV and one gate-up matmul per layer, and one matmul for the
context K/V of every layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.ops.config import XLA, OpsConfig
from dflash_jax.ops.cache import KVCache
from dflash_jax.models.layers import DecoderLayer, RMSNorm, _init
from dflash_jax.ops.linear import dense
from dflash_jax.ops.rope import rope_attention_factor, rope_inv_freq
from dflash_jax.models.config import DrafterConfig


class Drafter(nnx.Module):
    def __init__(self, config: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        c = config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        self.fc = nnx.Param(
            _init(rngs, (len(c.target_layer_ids) * c.hidden_size, c.hidden_size), dtype), axes=("taps", "embed")
        )
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([self._make_layer(i, inv_freq, dtype, rngs) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        # The serving layout (``runtime.serving_params``): every layer's context K and V weights side by
        # side, ``[embed, kv_heads, layers, 2, head_dim]``, for one matmul in ``context_kv``.
        self.context_kv_proj = self.context_kv_bias = None

    @property
    def dtype(self):
        """The drafter's compute dtype (its context cache's, its activations'): its norms' weights', which every
        layout keeps as loaded (the serving layout may store a matmul weight in bfloat16 on a CPU)."""
        return self.hidden_norm.weight.dtype

    def _make_layer(self, i: int, inv_freq, dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Decoder layer ``i`` (a drafter generation with other layers overrides this)."""
        c = self.config
        extras = {}
        if (factor := rope_attention_factor(c.rope_scaling)) != 1.0:
            extras["rope_factor"] = factor  # YaRN (a gpt-oss drafter's RoPE)
        if c.layer_window(i) is not None:
            extras["window"] = c.layer_window(i)  # a sliding_attention layer
        return DecoderLayer(
            c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
            eps=c.rms_norm_eps, qk_norm=True, attention_bias=c.attention_bias, mlp_bias=c.mlp_bias,
            inv_freq=inv_freq, dtype=dtype, rngs=rngs, attention_extras=extras or None,
        )

    def fuse(self, taps: jax.Array) -> jax.Array:
        """``taps [..., n_taps * hidden]`` -> context features ``hidden_norm(fc(taps))`` ``[..., hidden]``."""
        return self.hidden_norm(dense(taps.astype(self.dtype), self.fc))

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
        k = jnp.stack([layer.self_attn.finish_k(kv[:, :, :, i, 0], positions) for i, layer in enumerate(self.layers)])
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
        ops: OpsConfig = XLA,
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
                causal=self.config.layer_causal(i), ops=ops,
            )
        return self.norm(h)

    def draft(
        self, block_embeds: jax.Array, starts: jax.Array, cache: KVCache, blk_lens: jax.Array,
        *, ops: OpsConfig = XLA,
    ) -> jax.Array:
        """``__call__`` for decoding: one block per row over the drafter's context cache.

        ``block_embeds [batch, 1, block, hidden]`` (raw target embeddings of ``[anchor, MASK, ...]``)
        at positions ``starts [batch] + slot``; it sees the cache positions ``< starts`` (K/V from
        ``context_kv``) and its own ``blk_lens [batch]`` valid slots. With the kernels on (``ops``)
        each layer's attention is one kernel and each residual add shares a kernel with its norm
        (``DecoderLayer.cached``). Returns final-normed hidden ``[batch, 1, block, hidden]``.
        """
        h, delta = self._scale_embeds(block_embeds), None
        for i, layer in enumerate(self.layers):
            h, delta, _, _ = layer.cached(h, delta, starts, cache.k[i], cache.v[i], blk_lens,
                                          ops=ops, causal=self.config.layer_causal(i), write=False)
        return self.norm.add_norm(h, delta)[1]

    def override_drafts(self, draft: jax.Array, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """The proposals a decode step verifies, given the drafter's own: a drafter proposes its own
        (returns ``draft`` unchanged, adding nothing to the compiled step); a drafter of known acceptance
        for benchmarks and tests (``dflash_jax.synthetic.SyntheticDrafter``) overrides this to replace them.

        Called by ``runtime.decoding.draft_block`` inside the compiled step, after the drafts are chosen
        (greedy, sampled or a DFlash2 selector's path): ``draft [batch, B-1]`` int32 (slots 1..B-1 of the
        block), ``tokens [batch, capacity + 1]`` int32 (each row's prompt and committed tokens) and
        ``positions [batch, B]`` int32 (the block's positions, the anchor's first). An override must be
        jittable and return ``[batch, B-1]`` token ids (cast to ``draft``'s dtype).
        """
        del tokens, positions
        return draft

    def _scale_embeds(self, block_embeds: jax.Array) -> jax.Array:
        h = block_embeds.astype(self.dtype)
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
