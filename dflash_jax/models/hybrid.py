"""Hybrid linear-attention targets (Qwen3.5 / Qwen3.6, dense and MoE) in Flax NNX: Gated DeltaNet
layers interleaved with gated full-attention layers, with the ``Target`` interface the runtime and
the trainer use (``embed``, ``head``, ``step``, ``forward``, taps). The MoE variant's MLP is
``SharedExpertMoeMLP``: routed experts (``models.moe``) plus a sigmoid-gated shared expert.

The decode state of such a target is a ``HybridCache``: a KV cache for each full-attention layer
and, for each linear layer, a convolution state (its last ``kernel - 1`` inputs) and a recurrent
state ``[value_heads, dk, dv]``. Unlike a KV cache, those states cannot be rolled back by
bookkeeping: a verify pass runs the block with ``defer=True``, which leaves the linear states as
they were and attaches the block's record to the cache; ``settle`` then advances each row's states
by exactly its accepted tokens (``runtime.recurrent_state``): the verify block runs as one chunk
(``ops.gated_delta.gated_delta_block``) and the record holds its per-token terms (keys, cumulative
decays, corrected values); the state after ``n`` tokens is recomputed from the state before the block
as one masked sum over them (``state_after``: a matmul per head, no second pass). Keeping every
slot's state instead (``[batch, block, heads, dk, dv]``, settling by selection) measured 1.7x slower
DFlash steps on the H200 (docs/performance.md).

Norms follow transformers: the decoder norms (and q/k norms) scale by ``1 + weight`` in the
checkpoint; ours hold ``1 + weight`` itself (``io.hybrid_checkpoint`` converts), so they are the
plain ``RMSNorm``. The gated output norm of the linear layers scales by its weight as stored.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.hybrid_config import LINEAR, HybridTargetConfig
from dflash_jax.models.layers import MLP, RMSNorm, _init
from dflash_jax.models.moe import MoeMLP
from dflash_jax.models.target import Target
from dflash_jax.ops import gated_delta
from dflash_jax.ops.attention import attend_and_write, block_attention
from dflash_jax.ops.cache import KVCache, write_rows
from dflash_jax.ops.config import XLA, OpsConfig
from dflash_jax.ops.norms import row_scale
from dflash_jax.ops.rope import apply_rope, rope_inv_freq

# ----------------------------------------------------------------------------------------------
# Decode state
# ----------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockRecord:
    """What a deferred verify pass keeps to settle each linear layer's state (per linear layer).

    ``window [batch, kernel - 1 + block, conv_dim]``: the convolution's inputs (``ops.gated_delta.
    conv_window``: the state carried in, then the block's), of which each prefix's state is a slice; the
    block's terms (``ops.gated_delta.gated_delta_block``) ``k [batch, heads, block, dk]``, ``gc [batch,
    heads, block]``, ``v_new [batch, heads, block, dv]``.
    """

    window: tuple[jax.Array, ...]
    k: tuple[jax.Array, ...] = ()
    gc: tuple[jax.Array, ...] = ()
    v_new: tuple[jax.Array, ...] = ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridCache:
    """A hybrid target's decode state; every array leads with ``batch``."""

    kv: KVCache                       # one per full-attention layer
    conv: tuple[jax.Array, ...]       # per linear layer: [batch, kernel - 1, conv_dim]
    recurrent: tuple[jax.Array, ...]  # per linear layer: [batch, value_heads, dk, dv] float32
    pending: BlockRecord | None = None  # a deferred verify pass's record, until ``settle``

    @property
    def capacity(self) -> int:
        return self.kv.capacity


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------


class GatedDeltaNet(nnx.Module):
    """The linear-attention token mixer: projections, the causal convolution over q/k/v, the gated
    delta rule with value heads grouped over key heads, the gated RMSNorm, the output projection."""

    def __init__(self, c: HybridTargetConfig, *, dtype, rngs: nnx.Rngs):
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.key_heads, self.value_heads = hk, hv
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.eps = c.rms_norm_eps
        self.in_proj_qkv = nnx.Param(_init(rngs, (c.hidden_size, c.conv_dim), dtype), axes=("embed", None))
        self.in_proj_z = nnx.Param(_init(rngs, (c.hidden_size, hv * self.dv), dtype), axes=("embed", None))
        self.in_proj_b = nnx.Param(_init(rngs, (c.hidden_size, hv), dtype), axes=("embed", None))
        self.in_proj_a = nnx.Param(_init(rngs, (c.hidden_size, hv), dtype), axes=("embed", None))
        self.conv1d = nnx.Param(_init(rngs, (c.linear_conv_kernel_dim, c.conv_dim), dtype), axes=(None, None))
        self.A_log = nnx.Param(jnp.zeros((hv,), dtype), axes=("norm",))
        self.dt_bias = nnx.Param(jnp.ones((hv,), dtype), axes=("norm",))
        self.norm = RMSNorm(self.dv, c.rms_norm_eps, dtype=dtype)
        self.out_proj = nnx.Param(_init(rngs, (hv * self.dv, c.hidden_size), dtype), axes=(None, "embed"))

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``x [batch, seq, hidden]`` (normed) -> the convolution's input ``mixed [batch, seq,
        conv_dim]``, the output gate ``z [batch, seq, heads, dv]``, the decay ``g`` and the write
        strength ``beta``, ``[batch, seq, heads]`` float32."""
        mixed = x @ self.in_proj_qkv[...]
        z = (x @ self.in_proj_z[...]).reshape(x.shape[:2] + (self.value_heads, self.dv))
        beta = jax.nn.sigmoid((x @ self.in_proj_b[...]).astype(jnp.float32))
        a = (x @ self.in_proj_a[...]).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
        return mixed, z, g, beta

    def qkv(self, window: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The convolution over a ``conv_window`` -> q, k ``[batch, seq, value_heads, dk]`` (each key
        head repeated for its group of value heads) and v ``[batch, seq, value_heads, dv]``."""
        conv = gated_delta.causal_conv1d(window, self.conv1d[...])
        batch, seq = conv.shape[:2]
        key_dim = self.key_heads * self.dk
        q = conv[..., :key_dim].reshape(batch, seq, self.key_heads, self.dk)
        k = conv[..., key_dim:2 * key_dim].reshape(batch, seq, self.key_heads, self.dk)
        v = conv[..., 2 * key_dim:].reshape(batch, seq, self.value_heads, self.dv)
        group = self.value_heads // self.key_heads
        if group > 1:  # value head h reads key head h // group (transformers' repeat_interleave)
            q, k = jnp.repeat(q, group, axis=2), jnp.repeat(k, group, axis=2)
        return q, k, v

    def output(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """The gated RMSNorm of ``o [batch, seq, heads, dv]`` by ``z``, then the output projection."""
        dtype = o.dtype
        normed = self.norm.weight[...] * (o.astype(jnp.float32) * row_scale(o, self.eps)).astype(dtype)
        gated = (normed.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)
        return gated.reshape(o.shape[:2] + (-1,)) @ self.out_proj[...]

    def __call__(self, x: jax.Array, conv_state: jax.Array, state: jax.Array, lens: jax.Array, *,
                 chunk: int, ops: OpsConfig = XLA) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [batch, seq, hidden]`` (normed) after the states, of which the first ``lens [batch]``
        tokens are real -> the mixer's output and both states after those tokens."""
        mixed, z, g, beta = self.project(x)
        window = gated_delta.conv_window(mixed, conv_state)
        q, k, v = self.qkv(window)
        g, beta = gated_delta.mask_tail(g, beta, lens)
        rule = gated_delta.recurrent_gated_delta_rule if x.shape[1] == 1 else (
            lambda *a: gated_delta.chunk_gated_delta_rule(*a, chunk=chunk, ops=ops))
        o, state = rule(q, k, v, g, beta, state)
        return self.output(o, z), gated_delta.conv_state_after(window, lens, conv_state.shape[1]), state

    def deferred(self, x: jax.Array, conv_state: jax.Array, state: jax.Array, lens: jax.Array, *,
                 chunk: int) -> tuple[jax.Array, dict]:
        """``__call__`` without advancing the states: the output and the block's record entries."""
        mixed, z, g, beta = self.project(x)
        window = gated_delta.conv_window(mixed, conv_state)
        q, k, v = self.qkv(window)
        g, beta = gated_delta.mask_tail(g, beta, lens)
        o, (k, gc, v_new) = gated_delta.gated_delta_block(q, k, v, g, beta, state)
        return self.output(o, z), dict(window=window, k=k, gc=gc, v_new=v_new)


class GatedAttention(nnx.Module):
    """Full attention with an output gate (a sigmoid of a second query half) and partial RoPE.

    ``q_proj`` is ``[hidden, heads, 2 * head_dim]``: per head its query, then its gate (the torch
    layout's per-head order). RoPE rotates the first ``rotary_dim`` dims of q and k (neox
    half-split within them); text positions make Qwen3.5's M-RoPE the 1D rotation.
    """

    def __init__(self, c: HybridTargetConfig, *, dtype, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.rotary_dim = c.rotary_dim
        self.eps = c.rms_norm_eps
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling))
        hd = c.head_dim
        self.q_proj = nnx.Param(_init(rngs, (c.hidden_size, c.num_heads, 2 * hd), dtype),
                                axes=("embed", "heads", "head_dim"))
        self.k_proj = nnx.Param(_init(rngs, (c.hidden_size, c.num_kv_heads, hd), dtype),
                                axes=("embed", "kv_heads", "head_dim"))
        self.v_proj = nnx.Param(_init(rngs, (c.hidden_size, c.num_kv_heads, hd), dtype),
                                axes=("embed", "kv_heads", "head_dim"))
        self.o_proj = nnx.Param(_init(rngs, (c.num_heads, hd, c.hidden_size), dtype),
                                axes=("heads", "head_dim", "embed"))
        self.q_norm = RMSNorm(hd, c.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps, dtype=dtype)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        rot = self.rotary_dim
        if rot == x.shape[-1]:
            return apply_rope(x, positions, self.inv_freq)
        return jnp.concatenate([apply_rope(x[..., :rot], positions, self.inv_freq), x[..., rot:]], axis=-1)

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``x [batch, seq, hidden]`` at ``positions [batch, seq]`` -> q, gate ``[batch, seq, heads,
        head_dim]`` and k, v ``[batch, seq, kv_heads, head_dim]`` (q, k normed and rotated)."""
        qg = jnp.einsum("...h,hnd->...nd", x, self.q_proj[...])
        q, gate = qg[..., :self.head_dim], qg[..., self.head_dim:]
        k = jnp.einsum("...h,hnd->...nd", x, self.k_proj[...])
        v = jnp.einsum("...h,hnd->...nd", x, self.v_proj[...])
        q = self._rope(self.q_norm(q), positions)
        k = self._rope(self.k_norm(k), positions)
        return q, gate, k, v

    def output(self, attn: jax.Array, gate: jax.Array) -> jax.Array:
        """``attn, gate [batch, seq, heads, head_dim]`` -> ``[batch, seq, hidden]``."""
        gated = (attn * jax.nn.sigmoid(gate)).astype(attn.dtype)
        return jnp.einsum("...nd,ndh->...h", gated, self.o_proj[...])


class SharedExpertMoeMLP(MoeMLP):
    """Qwen3.5-MoE's MLP: the routed experts of ``MoeMLP`` (softmax over all experts, top-k,
    renormalised) plus ``sigmoid(x @ shared_expert_gate) * shared_expert(x)``, a dense SwiGLU of
    ``config.intermediate_size`` gated per token by one logit."""

    def __init__(self, config: HybridTargetConfig, *, dtype, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, rngs=rngs)
        self.shared_expert = MLP(config.hidden_size, config.intermediate_size, bias=False, dtype=dtype, rngs=rngs)
        self.shared_expert_gate = nnx.Param(_init(rngs, (config.hidden_size, 1), dtype), axes=("embed", None))

    def __call__(self, x: jax.Array, *, ops: OpsConfig = XLA) -> jax.Array:
        gate = jax.nn.sigmoid(x @ self.shared_expert_gate[...])
        return super().__call__(x, ops=ops) + gate * self.shared_expert(x)


class HybridLayer(nnx.Module):
    """A pre-norm decoder layer whose token mixer is a ``GatedDeltaNet`` or a ``GatedAttention``,
    its MLP dense or (MoE variant) a ``SharedExpertMoeMLP``."""

    def __init__(self, c: HybridTargetConfig, kind: str, *, dtype, rngs: nnx.Rngs):
        self.kind = kind
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        if kind == LINEAR:
            self.linear_attn, self.self_attn = GatedDeltaNet(c, dtype=dtype, rngs=rngs), None
        else:
            self.linear_attn, self.self_attn = None, GatedAttention(c, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        if c.num_experts:
            self.mlp = SharedExpertMoeMLP(c, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, bias=False, dtype=dtype, rngs=rngs)

    def finish(self, h: jax.Array, mixed: jax.Array, ops: OpsConfig = XLA) -> jax.Array:
        """The residual add of the mixer's output and the MLP half of the layer."""
        h = h + mixed
        x = self.post_attention_layernorm(h)
        return h + (self.mlp(x, ops=ops) if isinstance(self.mlp, MoeMLP) else self.mlp(x))


# ----------------------------------------------------------------------------------------------
# The target
# ----------------------------------------------------------------------------------------------


class HybridTarget(nnx.Module):
    """A hybrid decoder-only LM with ``Target``'s interface (taps as ``Target``'s: HF
    ``output_hidden_states[lid + 1]``, the last layer's final-normed).

    ``chunk``: the chunk length of the chunked gated delta rule (prompts, training, the verify
    rollback).
    """

    def __init__(self, config: HybridTargetConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 chunk: int = gated_delta.DEFAULT_CHUNK):
        self.config = config
        c = config
        self.chunk = chunk
        self.embed_tokens = nnx.Param(_init(rngs, (c.vocab_size, c.hidden_size), dtype), axes=("vocab", "embed"))
        self.layers = nnx.List([HybridLayer(c, kind, dtype=dtype, rngs=rngs) for kind in c.layer_types])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        if c.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Param(_init(rngs, (c.hidden_size, c.vocab_size), dtype), axes=("embed", "vocab"))

    embed = Target.embed
    head = Target.head

    # -- decode state --------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> HybridCache:
        """Zeroed decode state for ``batch`` rows of ``capacity`` positions."""
        c = self.config
        dtype = self.embed_tokens.dtype
        kv = KVCache.zeros(len(c.full_layers), batch, capacity, c.num_kv_heads, c.head_dim, dtype)
        n = len(c.linear_layers)
        conv = tuple(jnp.zeros((batch, c.linear_conv_kernel_dim - 1, c.conv_dim), dtype) for _ in range(n))
        shape = (batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        return HybridCache(kv, conv, tuple(jnp.zeros(shape, jnp.float32) for _ in range(n)))

    def settle(self, cache: HybridCache, lens: jax.Array) -> HybridCache:
        """A deferred verify pass's cache with each row's linear states advanced by its first
        ``lens [batch]`` block tokens (0: unchanged), the record dropped."""
        record = cache.pending
        if record is None:
            raise ValueError("settle needs the cache of a step run with defer=True")
        conv = tuple(gated_delta.conv_state_after(w, lens, s.shape[1]) for w, s in zip(record.window, cache.conv))
        recurrent = tuple(gated_delta.state_after(before, k, gc, v_new, lens)
                          for before, k, gc, v_new in zip(cache.recurrent, record.k, record.gc, record.v_new))
        return HybridCache(cache.kv, conv, recurrent)

    # -- forward passes ------------------------------------------------------------------------

    def _run(self, h, positions, lens, cache: HybridCache, starts, tap_layers, ops, *, prefill: bool,
             defer: bool):
        """The layer loop over one causal block per row: ``h [batch, seq, hidden]`` -> the final-normed
        ``h``, the taps and the cache (None: a cache-free forward)."""
        n = len(self.layers)
        batch, seq = h.shape[:2]
        if cache is None:
            cache = self.new_cache(batch, 0)
        ks, vs = list(cache.kv.k), list(cache.kv.v)
        conv, rec = list(cache.conv), list(cache.recurrent)
        record: dict[str, list] = {}
        linear_i = full_i = 0
        taps = {}
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            if layer.linear_attn is not None:
                j, linear_i = linear_i, linear_i + 1
                if defer:
                    out, entries = layer.linear_attn.deferred(x, conv[j], rec[j], lens, chunk=self.chunk)
                    for key, value in entries.items():
                        record.setdefault(key, []).append(value)
                else:
                    out, conv[j], rec[j] = layer.linear_attn(x, conv[j], rec[j], lens, chunk=self.chunk, ops=ops)
            else:
                j, full_i = full_i, full_i + 1
                attn_mod = layer.self_attn
                q, gate, k, v = attn_mod.project(x, positions)
                if prefill or ks[j].shape[1] == 0:
                    empty = jnp.zeros((batch, 0) + k.shape[2:], k.dtype)
                    zeros = jnp.zeros((batch, 1), jnp.int32)
                    attn = block_attention(q[:, None], empty, empty, zeros, k[:, None], v[:, None], lens[:, None],
                                           causal=True, ops=ops)
                    if ks[j].shape[1]:
                        ks[j], vs[j] = write_rows(ks[j], k, starts), write_rows(vs[j], v, starts)
                else:
                    attn, ks[j], vs[j] = attend_and_write(q[:, None], k[:, None], v[:, None], starts, ks[j], vs[j],
                                                          lens, causal=True, write=True, ops=ops)
                out = attn_mod.output(attn[:, 0], gate)
            h = layer.finish(h, out, ops)
            if i in tap_layers and i != n - 1:
                taps[i] = h
        h = self.norm(h)
        if n - 1 in tap_layers:
            taps[n - 1] = h
        tapped = jnp.concatenate([taps[i] for i in tap_layers], axis=-1) if tap_layers else None
        pending = BlockRecord(**{key: tuple(value) for key, value in record.items()}) if defer else None
        new = HybridCache(KVCache(tuple(ks), tuple(vs)), tuple(conv), tuple(rec), pending)
        return h, tapped, new

    def step(
        self,
        ids: jax.Array,
        starts: jax.Array,
        cache: HybridCache,
        *,
        blk_lens: jax.Array | None = None,
        tap_layers: tuple[int, ...] = (),
        ops: OpsConfig = XLA,
        prefill: bool = False,
        defer: bool = False,
    ) -> tuple[jax.Array, jax.Array | None, HybridCache]:
        """``Target.step``: extends every row by a block of ``ids [batch, seq]`` at ``starts``;
        ``blk_lens [batch]`` valid tokens, which advance the linear states (``prefill``: the cache
        is empty). ``defer``: leave the linear states as they were and attach the block's record
        for ``settle`` (the verify pass)."""
        batch, seq = ids.shape
        if blk_lens is None:
            blk_lens = jnp.full((batch,), seq, jnp.int32)
        if cache.pending is not None:
            raise ValueError("the cache holds an unsettled verify block: settle it first")
        positions = starts[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :]
        return self._run(self.embed(ids), positions, blk_lens.astype(jnp.int32), cache, starts,
                         tuple(tap_layers), ops, prefill=prefill, defer=defer)

    def forward(
        self,
        ids: jax.Array,
        *,
        tap_layers: tuple[int, ...] = (),
        ops: OpsConfig = XLA,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Cache-free causal forward: ``ids [batch, seq]`` -> ``(logits [batch, seq, vocab], taps)``."""
        batch, seq = ids.shape
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        lens = jnp.full((batch,), seq, jnp.int32)
        hidden, taps, _ = self._run(self.embed(ids), positions, lens, None, jnp.zeros((batch,), jnp.int32),
                                    tuple(tap_layers), ops, prefill=True, defer=False)
        return self.head(hidden), taps
