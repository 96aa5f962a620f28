"""The frozen target: Qwen3 (q/k norms) and Llama-3 (llama3 RoPE scaling) decoders in Flax NNX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.attention import AttentionImpl
from dflash_jax.cache import KVCache, write_layer
from dflash_jax.layers import DecoderLayer, RMSNorm, _init, rope_inv_freq
from dflash_jax.model_config import TargetConfig


class Target(nnx.Module):
    """A decoder-only LM whose forward also returns the hidden states after chosen layers (taps).

    Taps follow HF ``output_hidden_states[lid + 1]``: the raw output of decoder layer ``lid``, except
    for the last layer, whose HF hidden state is the final-normed one.
    """

    def __init__(self, config: TargetConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        c = config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        self.embed_tokens = nnx.Param(_init(rngs, (c.vocab_size, c.hidden_size), dtype), axes=("vocab", "embed"))
        self.layers = nnx.List([
            DecoderLayer(
                c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                eps=c.rms_norm_eps, qk_norm=c.qk_norm, attention_bias=c.attention_bias,
                mlp_bias=c.mlp_bias, inv_freq=inv_freq, dtype=dtype, rngs=rngs,
            )
            for _ in range(c.num_layers)
        ])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        if c.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Param(_init(rngs, (c.hidden_size, c.vocab_size), dtype), axes=("embed", "vocab"))

    # -- embedding and head, shared with the drafter -------------------------------------------

    def embed(self, ids: jax.Array) -> jax.Array:
        """``ids [...]`` -> ``[..., hidden]``: the raw embedding-table lookup (no scaling)."""
        return jnp.take(self.embed_tokens[...], ids, axis=0)

    def head(self, hidden: jax.Array) -> jax.Array:
        """The LM head on already-normed ``hidden [..., hidden]`` -> ``[..., vocab]``."""
        if self.lm_head is None:
            return jnp.einsum("...h,vh->...v", hidden, self.embed_tokens[...])
        return hidden @ self.lm_head[...]

    # -- forward passes ------------------------------------------------------------------------

    def _run(self, h, positions, ctx_lens, blk_lens, cache, starts, tap_layers, attention_impl, fresh=False):
        """Shared layer loop over one causal block per row: ``h [batch, 1, seq, hidden]``.

        ``fresh``: the cache holds nothing yet (prefill), so only the block is attended to.
        """
        n = len(self.layers)
        taps = {}
        for i, layer in enumerate(self.layers):
            if cache is None or fresh:
                empty = jnp.zeros((h.shape[0], 0, self.config.num_kv_heads, self.config.head_dim), h.dtype)
                k_ctx = v_ctx = empty
            else:
                k_ctx, v_ctx = cache.k[i], cache.v[i]
            h, k_blk, v_blk = layer(
                h, positions, k_ctx, v_ctx, ctx_lens, blk_lens, causal=True, attention_impl=attention_impl
            )
            if cache is not None:
                cache = write_layer(cache, i, k_blk[:, 0], v_blk[:, 0], starts)
            if i in tap_layers and i != n - 1:
                taps[i] = h
        h = self.norm(h)
        if n - 1 in tap_layers:
            taps[n - 1] = h
        tapped = jnp.concatenate([taps[i] for i in tap_layers], axis=-1)[:, 0] if tap_layers else None
        return h[:, 0], tapped, cache

    def step(
        self,
        ids: jax.Array,
        starts: jax.Array,
        cache: KVCache,
        *,
        blk_lens: jax.Array | None = None,
        tap_layers: tuple[int, ...] = (),
        attention_impl: AttentionImpl = "xla",
        prefill: bool = False,
    ) -> tuple[jax.Array, jax.Array | None, KVCache]:
        """Extends every row by a block of tokens at its own position, through the KV cache.

        Args:
          ids: ``[batch, seq]`` tokens at positions ``starts + 0 .. seq - 1`` (prefill: ``starts = 0``).
          starts: ``[batch]`` int32, the number of tokens already in the cache for each row.
          cache: the target KV cache (``capacity >= starts + seq``); the block's K/V are written at
            ``starts``.
          blk_lens: ``[batch]`` valid tokens of the block (padding beyond is never attended to).
          tap_layers: decoder layers whose outputs are returned as taps.
          prefill: the cache is empty (``starts == 0``): attend within the block only.

        Returns:
          final-normed hidden ``[batch, seq, hidden]``, taps ``[batch, seq, len(tap_layers) * hidden]``
          (None without tap layers), and the updated cache.
        """
        batch, seq = ids.shape
        if blk_lens is None:
            blk_lens = jnp.full((batch,), seq, jnp.int32)
        positions = (starts[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :])[:, None, :]
        h = self.embed(ids)[:, None]
        return self._run(h, positions, starts[:, None], blk_lens[:, None], cache, starts, tuple(tap_layers),
                         attention_impl, fresh=prefill)

    def forward(
        self,
        ids: jax.Array,
        *,
        tap_layers: tuple[int, ...] = (),
        attention_impl: AttentionImpl = "xla",
    ) -> tuple[jax.Array, jax.Array | None]:
        """Cache-free causal forward: ``ids [batch, seq]`` -> ``(logits [batch, seq, vocab], taps)``."""
        batch, seq = ids.shape
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, 1, seq))
        zeros = jnp.zeros((batch, 1), jnp.int32)
        full = jnp.full((batch, 1), seq, jnp.int32)
        h = self.embed(ids)[:, None]
        hidden, taps, _ = self._run(h, positions, zeros, full, None, None, tuple(tap_layers), attention_impl)
        return self.head(hidden), taps
