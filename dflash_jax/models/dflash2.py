"""The DFlash2 drafter: DFlash plus in-block dynamic convolutions and a candidate selector.

Each drafter layer wraps its attention and its MLP in a ``GroupedDynamicCausalConv``: the sublayer's
input is convolved causally along the block (``conv_kernel_size`` taps, one coefficient per group of
``conv_group_size`` channels: a base kernel plus a per-token delta projected from the normed input),
and its output is convolved with a second kernel from the same projection. The taps run along the
block axis only, so they never reach across a block start. Identity kernels (base tap 0 = 1, the
rest and the projection 0) make the layer a DFlash layer.

The ``CandidateSelector`` re-ranks the top-``selector_top_k`` unary candidates at each draft slot
with a rank-``selector_rank`` bilinear term of the previous token and the slot's hidden state:
``score(c) = unary(c) + <pred_codebook[prev] * (h @ W), succ_codebook[c]>``. Drafting walks the
block greedily, slot after slot, each slot's ``prev`` the token chosen at the slot before (the
anchor for slot 1): the block is drafted as a path. The walk runs over the ``K x K`` candidate
edges, so its shapes are static and it costs ``(B - 1) * K * K * rank`` multiply-adds per row.

Sliding-window layers (``layer_types``) see the context positions ``[anchor - sliding_window,
anchor)`` plus their block (bidirectional with ``sliding_window_non_causal``, else causal), as the
reference trainer masks them; they run the XLA attention (the kernels serve full-attention layers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.config import DrafterConfig, ModelConfigError
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.layers import MLP, Attention, RMSNorm, _init
from dflash_jax.ops import attention as attention_ops
from dflash_jax.ops.cache import KVCache
from dflash_jax.ops.config import XLA, OpsConfig
from dflash_jax.ops.linear import dense
from dflash_jax.ops.topk import top_k


@dataclasses.dataclass(frozen=True)
class DFlash2Config(DrafterConfig):
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    sample_from_anchor: bool = False
    sliding_window_non_causal: bool = True  # sliding layers' blocks bidirectional (else causal)
    sliding_needs_window: ClassVar[bool] = True  # speculators' sliding layers always have a window

    def validate(self, source: str = "config") -> None:
        super().validate(source)
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{source}: dflash_config.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.conv_group_size:
            raise ModelConfigError(f"{source}: hidden_size={self.hidden_size} is not a multiple of "
                                   f"dflash_config.conv_group_size={self.conv_group_size}")
        if self.conv_kernel_size > self.block_size:
            raise ModelConfigError(f"{source}: dflash_config.conv_kernel_size={self.conv_kernel_size} exceeds "
                                   f"block_size={self.block_size}")
        if self.selector_top_k > self.vocab_size:
            raise ModelConfigError(f"{source}: dflash_config.selector_top_k={self.selector_top_k} exceeds "
                                   f"vocab_size={self.vocab_size}")
        if self.sample_from_anchor:
            raise ModelConfigError(f"{source}: dflash_config.sample_from_anchor=true (slot 0 drafting) is not "
                                   "supported: the anchor is the committed bonus token here")

    @property
    def sliding(self) -> bool:
        return "sliding_attention" in self.layer_types


def grouped_dynamic_conv(x: jax.Array, delta: jax.Array, base: jax.Array, group_size: int) -> jax.Array:
    """A token-conditioned grouped causal convolution along the block axis.

    ``x [..., block, hidden]``, ``delta [..., block, taps, groups]`` (per token, per group),
    ``base [taps, hidden]`` -> ``[..., block, hidden]``:
    ``out[s, c] = sum_{t <= s} (base[t, c] + delta[s, t, c // group_size]) * x[s - t, c]``.
    Taps past the block's first slot read zeros: a block never sees the block before it.
    """
    *lead, block, hidden = x.shape
    taps = base.shape[0]
    groups = hidden // group_size
    xg = x.reshape(*lead, block, groups, group_size)
    out = jnp.zeros(xg.shape, jnp.result_type(x.dtype, delta.dtype))
    for t in range(min(taps, block)):
        shifted = xg if t == 0 else jnp.pad(xg, [(0, 0)] * len(lead) + [(t, 0), (0, 0), (0, 0)])[..., :block, :, :]
        coef = base[t].astype(delta.dtype).reshape(groups, group_size) + delta[..., t, :, None]
        out = out + shifted * coef
    return out.reshape(x.shape).astype(x.dtype)


class GroupedDynamicCausalConv(nnx.Module):
    """The input- and output-side convolutions of one sublayer, both driven by one projection of the
    sublayer's (normed) input."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int, *, dtype, rngs: nnx.Rngs):
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden // group_size
        # Identity: base tap 0 = 1, every other tap and the delta projection 0 (a DFlash layer).
        base = jnp.zeros((2, kernel_size, hidden), dtype).at[:, 0].set(1)
        self.base_kernel = nnx.Param(base, axes=(None, None, "embed"))
        self.kernel_projection = nnx.Param(jnp.zeros((hidden, 2 * kernel_size * self.groups), dtype),
                                           axes=("embed", None))

    def prepare(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [..., block, hidden]`` -> (the convolved input, the output side's delta kernel
        ``[..., block, taps, groups]``)."""
        kernels = dense(x, self.kernel_projection).reshape(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return (grouped_dynamic_conv(x, kernels[..., 0, :, :], self.base_kernel[0], self.group_size),
                kernels[..., 1, :, :])

    def finish(self, y: jax.Array, delta: jax.Array) -> jax.Array:
        """The sublayer's output ``y [..., block, hidden]`` convolved with ``prepare``'s delta kernel."""
        return grouped_dynamic_conv(y, delta, self.base_kernel[1], self.group_size)


class DFlash2Layer(nnx.Module):
    """A pre-norm decoder layer with a dynamic convolution around its attention and its MLP."""

    def __init__(self, c: DFlash2Config, inv_freq, *, window: int | None, block_causal: bool, dtype,
                 rngs: nnx.Rngs):
        self.window, self.block_causal = window, block_causal  # static
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, eps=c.rms_norm_eps, qk_norm=True,
            bias=c.attention_bias, inv_freq=inv_freq, dtype=dtype, rngs=rngs,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, dtype=dtype, rngs=rngs)
        self.attention_conv = GroupedDynamicCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size,
                                                       dtype=dtype, rngs=rngs)
        self.mlp_conv = GroupedDynamicCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size,
                                                 dtype=dtype, rngs=rngs)

    def reset_convolutions(self) -> None:
        """Both convolutions back to the identity (the DFlash-equivalent initialisation)."""
        for conv in (self.attention_conv, self.mlp_conv):
            conv.base_kernel[...] = jnp.zeros_like(conv.base_kernel[...]).at[:, 0].set(1)
            conv.kernel_projection[...] = jnp.zeros_like(conv.kernel_projection[...])

    def _forward(self, h: jax.Array, delta: jax.Array | None, attend, ops: OpsConfig) -> tuple[jax.Array, jax.Array]:
        """The residual stream entering the layer is ``h + delta`` (``delta`` None: ``h``),
        ``[batch, blocks, block, hidden]``; ``attend(x)`` -> the attention's ``[..., heads, head_dim]``.
        Returns ``(h, delta)`` whose sum is the layer's output: each residual add is left to the norm
        that reads it (``DecoderLayer.cached``)."""
        h, x = self.input_layernorm.add_norm(h, delta)
        x, out_delta = self.attention_conv.prepare(x)
        h, x = self.post_attention_layernorm.add_norm(
            h, self.attention_conv.finish(self.self_attn.output(attend(x), ops), out_delta))
        x, out_delta = self.mlp_conv.prepare(x)
        return h, self.mlp_conv.finish(self.mlp(x), out_delta)

    def __call__(self, h, positions, k_ctx, v_ctx, ctx_lens, blk_lens, *, ops: OpsConfig = XLA) -> jax.Array:
        """Training: ``h [batch, blocks, block, hidden]`` over context ``[batch, ctx, kv_heads, head_dim]``
        (``DecoderLayer.__call__``'s arguments)."""
        def attend(x):
            q, k_blk, v_blk = self.self_attn.project(x, positions)
            if self.window is not None:
                return windowed_block_attention(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens,
                                                window=self.window, causal=self.block_causal)
            return attention_ops.block_attention(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens,
                                                 causal=self.block_causal, ops=ops)
        h, delta = self._forward(h, None, attend, XLA)
        return h + delta

    def cached(self, h, delta, starts, k_cache, v_cache, blk_lens, *,
               ops: OpsConfig = XLA) -> tuple[jax.Array, jax.Array]:
        """Decoding: one block per row, the residual stream ``h + delta`` (``delta`` None: ``h``),
        ``[batch, 1, block, hidden]``, at ``starts [batch] + slot`` over the context cache ``[batch,
        capacity, kv_heads, head_dim]`` (not written) -> ``(h, delta)`` as ``_forward``."""
        def attend(x):
            if self.window is None:
                return self.self_attn.attend_cached(x, starts, k_cache, v_cache, blk_lens, ops=ops,
                                                    causal=self.block_causal, write=False)[0]
            positions = starts[:, None, None] + jnp.arange(x.shape[2], dtype=jnp.int32)
            q, k_blk, v_blk = self.self_attn.project(x, positions)
            return windowed_block_attention(q, k_cache, v_cache, starts[:, None], k_blk, v_blk, blk_lens[:, None],
                                            window=self.window, causal=self.block_causal)
        return self._forward(h, delta, attend, ops)


def windowed_block_attention(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, *, window: int,
                             causal: bool) -> jax.Array:
    """``block_attention`` with each block seeing only the context positions
    ``[ctx_lens - window, ctx_lens)`` (shapes as there). Scores and softmax in float32."""
    batch, blocks, block, heads, head_dim = q.shape
    kv_heads = k_ctx.shape[2]
    qg = q.reshape(batch, blocks, block, kv_heads, heads // kv_heads, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    s_ctx = jnp.einsum("bnskgd,btkd->bnkgst", qg, k_ctx, preferred_element_type=jnp.float32) * scale
    s_blk = jnp.einsum("bnskgd,bntkd->bnkgst", qg, k_blk, preferred_element_type=jnp.float32) * scale
    pos = jnp.arange(k_ctx.shape[1])
    ctx_ok = (pos[None, None] < ctx_lens[..., None]) & (pos[None, None] >= ctx_lens[..., None] - window)
    slot = jnp.arange(block)
    blk_ok = jnp.broadcast_to(slot[None, None, None, :] < blk_lens[..., None, None], (batch, blocks, block, block))
    if causal:
        blk_ok = blk_ok & (slot[None, None, None, :] <= slot[None, None, :, None])
    ok = jnp.concatenate([jnp.broadcast_to(ctx_ok[:, :, None, :], (batch, blocks, block, k_ctx.shape[1])), blk_ok],
                         axis=-1)[:, :, None, None]
    scores = jnp.where(ok, jnp.concatenate([s_ctx, s_blk], axis=-1), -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(ok, jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    probs = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)
    n = k_ctx.shape[1]
    out = jnp.einsum("bnkgst,btkd->bnskgd", probs[..., :n].astype(v_ctx.dtype), v_ctx,
                     preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bnkgst,bntkd->bnskgd", probs[..., n:].astype(v_blk.dtype), v_blk,
                           preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


class CandidateSelector(nnx.Module):
    """Predecessor/successor codebooks ``[vocab, rank]`` and a hidden projection ``[hidden, rank]``."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int, *, dtype, rngs: nnx.Rngs):
        self.top_k = top_k
        self.predecessor_codebook = nnx.Param(_init(rngs, (vocab, rank), dtype), axes=("vocab", None))
        self.successor_codebook = nnx.Param(_init(rngs, (vocab, rank), dtype), axes=("vocab", None))
        self.hidden_projection = nnx.Param(_init(rngs, (hidden, rank), dtype), axes=("embed", None))

    def context(self, hidden: jax.Array, predecessor_ids: jax.Array) -> jax.Array:
        """``hidden [..., hidden]``, ``predecessor_ids [...]`` -> ``pred_codebook[prev] * (hidden @ W)``
        ``[..., rank]``."""
        pred = jnp.take(self.predecessor_codebook[...], predecessor_ids, axis=0)
        return pred * dense(hidden, self.hidden_projection).astype(pred.dtype)

    def score_candidates(self, unary_logits: jax.Array, hidden: jax.Array, predecessor_ids: jax.Array,
                         candidate_ids: jax.Array) -> jax.Array:
        """``unary_logits [..., vocab]``, ``hidden [..., hidden]``, ``predecessor_ids [...]``,
        ``candidate_ids [..., K]`` -> the candidates' scores ``[..., K]``: unary plus transition."""
        unary = jnp.take_along_axis(unary_logits, candidate_ids, axis=-1)
        succ = jnp.take(self.successor_codebook[...], candidate_ids, axis=0)  # [..., K, rank]
        return unary + transition_scores(self.context(hidden, predecessor_ids), succ).astype(unary.dtype)

    def select_path(self, unary_logits: jax.Array, hidden: jax.Array, anchor_ids: jax.Array,
                    candidates: tuple[jax.Array, jax.Array] | None = None,
                    noise: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """The greedy path through the block's candidates.

        ``unary_logits [batch, n, vocab]`` and ``hidden [batch, n, hidden]`` of the draft slots
        1..n, ``anchor_ids [batch]`` -> ``[batch, n]`` int32: at each slot the top-K unary candidate
        (``ops.topk.top_k``: by logit, ties to the lower token id) of highest score given the token chosen
        at the slot before (the anchor for the first); score ties go to the higher-ranked candidate.

        Every edge at once: slot j's scores ``[K, K]`` for each predecessor (the previous slot's K
        candidates; K copies of the anchor at the first slot) in one multiply-reduce with the codebook
        rows gathered inside it, then the walk (``greedy_walk``) as elementwise selects over those
        scores: after the top-K and the hidden projection, two kernels whatever the block size.
        ``candidates``: ``(unary [b, n, K], ids [b, n, K])`` chosen by the caller instead of the top-K
        of ``unary_logits`` (sampled rows: the candidates the target's own noise favours).
        ``noise``: ``(gumbel [b, n, K] at the candidates, temperature [b])``: a row with a temperature
        walks ``score / temperature + gumbel`` instead, the draw of each slot's token from the
        selector's scores given its predecessor, with the noise the caller chose (float32).
        """
        unary, cand = top_k(unary_logits, self.top_k) if candidates is None else candidates  # [b, n, K]
        batch, _, k = cand.shape
        proj = dense(hidden, self.hidden_projection)  # [b, n, rank]
        pred_book, succ_book = self.predecessor_codebook[...], self.successor_codebook[...]
        predecessors = jnp.concatenate([jnp.broadcast_to(anchor_ids[:, None, None], (batch, 1, k)), cand[:, :-1]],
                                       axis=1)  # [b, n, K]
        ctx = jnp.take(pred_book, predecessors, axis=0) * proj[:, :, None].astype(pred_book.dtype)  # [b, n, K, rank]
        succ = jnp.take(succ_book, cand, axis=0)[:, :, None]  # [b, n, 1, K, rank]
        edges = unary[:, :, None, :] + transition_scores(ctx, succ).astype(unary.dtype)  # [b, n, K, K]
        if noise is not None:
            gumbel, temperature = noise
            t = temperature.astype(jnp.float32)[:, None, None, None]
            edges = jnp.where(t > 0, edges.astype(jnp.float32) / jnp.where(t > 0, t, 1.0) + gumbel[:, :, None, :],
                              edges.astype(jnp.float32))
        return greedy_walk(edges, cand)


def transition_scores(context: jax.Array, successors: jax.Array) -> jax.Array:
    """``<context, successor>`` per candidate: ``context [..., rank]``, ``successors [..., K, rank]``
    (broadcast against each other) -> ``[..., K]`` in the codebooks' dtype.

    As the reference computes it: the products in that dtype, summed in float32, rounded once. A
    multiply-reduce rather than a batched matmul, so that the gathers of codebook rows feeding it
    fuse into the one reduction instead of materialising both operands of a dot."""
    products = context[..., None, :] * successors
    return jnp.sum(products, axis=-1, dtype=jnp.float32).astype(products.dtype)


def greedy_walk(edges: jax.Array, candidates: jax.Array) -> jax.Array:
    """The greedy path through per-slot edge scores.

    ``edges [batch, n, K, K]`` (slot j's score of candidate k after the previous slot's candidate p;
    at slot 0 every row p is the anchor's), ``candidates [batch, n, K]`` -> the chosen tokens
    ``[batch, n]`` int32: slot j takes the first maximum of ``edges[j, p]`` with p the index chosen
    at slot j - 1 (NaN counts as the maximum, as in ``jnp.argmax``).

    Elementwise compares and selects over static slices only (``first_argmax``, ``pick``), which XLA
    can fuse into one kernel (the argmaxes, the walk and the token pick) where a reduction and a chain
    of dependent gathers are a kernel launch each; the walk is ``n * log2(K)`` selects per row."""
    best = first_argmax(edges)  # [b, n, K]: the successor index after each predecessor index
    index = best[:, 0, 0]  # slot 0: every predecessor is the anchor
    indices = [index]
    for j in range(1, candidates.shape[1]):
        index = pick(best[:, j], index)
        indices.append(index)
    return pick(candidates, jnp.stack(indices, axis=1)).astype(jnp.int32)


def _pad_to_power_of_two(x: jax.Array, fill) -> jax.Array:
    """``x [..., K]`` padded with ``fill`` at the end of its last axis to the next power of two."""
    k = x.shape[-1]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << (k - 1).bit_length()) - k)], constant_values=fill)


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as int32 (the first maximum; the first NaN where there is one) by a
    tournament of halves: ``log2(K)`` rounds of elementwise compares and selects, no reduction."""
    values = _pad_to_power_of_two(x, -jnp.inf)  # the pads lie after every real entry: they never win a tie
    index = jnp.broadcast_to(jnp.arange(values.shape[-1], dtype=jnp.int32), values.shape)
    while values.shape[-1] > 1:
        left, right = values[..., 0::2], values[..., 1::2]
        # The left entry holds the lower indices: it keeps ties and NaNs of its own.
        take = (right > left) | (jnp.isnan(right) & ~jnp.isnan(left))
        values, index = jnp.where(take, right, left), jnp.where(take, index[..., 1::2], index[..., 0::2])
    return index[..., 0]


def pick(table: jax.Array, index: jax.Array) -> jax.Array:
    """``table [..., K]`` at ``index [...]`` (``take_along_axis``) by ``log2(K)`` selects on the
    index's bits: elementwise, so it fuses with what computes the index."""
    values, bit = _pad_to_power_of_two(table, 0), 0
    while values.shape[-1] > 1:
        odd = ((index >> bit) & 1).astype(bool)[..., None]
        values, bit = jnp.where(odd, values[..., 1::2], values[..., 0::2]), bit + 1
    return values[..., 0]


class DFlash2Drafter(Drafter):
    """The DFlash drafter (context projection, target embedding and head shared) with DFlash2 layers
    and a candidate selector; ``draft`` returns hidden states as DFlash's does and ``select`` turns
    the block's logits into draft tokens."""

    config: DFlash2Config
    # Drafts come from the selector's path, not from sampling the drafter's distribution.
    selects_drafts = True

    def __init__(self, config: DFlash2Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, rngs=rngs)
        c = config
        self.candidate_selector = CandidateSelector(c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k,
                                                    dtype=dtype, rngs=rngs)

    def _make_layer(self, i: int, inv_freq, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        window = c.layer_window(i)
        block_causal = c.causal if window is None else not c.sliding_window_non_causal
        return DFlash2Layer(c, inv_freq, window=window, block_causal=block_causal, dtype=dtype, rngs=rngs)

    def __call__(self, block_embeds, positions, k_ctx, v_ctx, ctx_lens, blk_lens, *, ops: OpsConfig = XLA):
        """As ``Drafter.__call__``: final-normed hidden ``[batch, blocks, block, hidden]``."""
        h = self._scale_embeds(block_embeds)
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, k_ctx[i], v_ctx[i], ctx_lens, blk_lens, ops=ops)
        return self.norm(h)

    def draft(self, block_embeds, starts, cache: KVCache, blk_lens, *, ops: OpsConfig = XLA) -> jax.Array:
        """As ``Drafter.draft``: final-normed hidden ``[batch, 1, block, hidden]``."""
        h, delta = self._scale_embeds(block_embeds), None
        for i, layer in enumerate(self.layers):
            h, delta = layer.cached(h, delta, starts, cache.k[i], cache.v[i], blk_lens, ops=ops)
        return self.norm.add_norm(h, delta)[1]

    def select(self, logits: jax.Array, hidden: jax.Array, anchor_ids: jax.Array,
               candidates: tuple[jax.Array, jax.Array] | None = None,
               noise: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """Draft tokens ``[batch, B - 1]`` from the block's ``logits [batch, B - 1, vocab]`` and
        ``hidden [batch, B - 1, hidden]`` (slots 1..B-1) and ``anchor_ids [batch]``; ``candidates``
        and ``noise`` as in ``CandidateSelector.select_path``."""
        return self.candidate_selector.select_path(logits, hidden, anchor_ids, candidates, noise)

    def reset_convolutions(self) -> None:
        for layer in self.layers:
            layer.reset_convolutions()


# ----------------------------------------------------------------------------------------------
# config.json: the authors' DFlash2 layout (the DFlash one plus the fields below in dflash_config)
# ----------------------------------------------------------------------------------------------

ARCHITECTURE = "DFlash2DraftModel"
_DFLASH2_FIELDS = {"conv_kernel_size": int, "conv_group_size": int, "selector_rank": int, "selector_top_k": int,
                   "sample_from_anchor": bool, "sliding_window_non_causal": bool}
# Every dflash_config key a DFlash2 config may hold; anything else is refused by name.
KNOWN_DFLASH_CONFIG = frozenset({
    "mask_token_id", "target_layer_ids", "block_size", "input_embedding_scale", "output_multiplier",
    "final_logit_softcapping", "causal", *_DFLASH2_FIELDS,
})
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DFlash2Config)}


def is_dflash2_config(data: dict) -> bool:
    """Whether a config.json object describes a DFlash2 drafter (by architecture, or by its fields)."""
    archs = data.get("architectures") or []
    dflash = data.get("dflash_config") if isinstance(data.get("dflash_config"), dict) else {}
    return ARCHITECTURE in archs or "selector_rank" in dflash or "conv_kernel_size" in dflash


def dflash2_config_from_dict(data: dict, source: str = "config.json") -> DFlash2Config:
    """A DFlash2 drafter config from the authors' config.json; errors name the file and field."""
    from dflash_jax.models.config import _check, drafter_config_from_dict

    dflash = data.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ModelConfigError(f"{source}: field 'dflash_config' must be an object")
    unknown = sorted(set(dflash) - KNOWN_DFLASH_CONFIG)
    if unknown:
        raise ModelConfigError(f"{source}: unknown field(s) dflash_config.{', dflash_config.'.join(unknown)} "
                               f"(known: {', '.join(sorted(KNOWN_DFLASH_CONFIG))})")
    # The DFlash reader refuses sliding layers; they are read here.
    base = {k: v for k, v in data.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")}
    base["dflash_config"] = {k: v for k, v in dflash.items() if k not in _DFLASH2_FIELDS and k != "causal"}
    common = drafter_config_from_dict(base, source)
    fields = {}
    for name, kind in _DFLASH2_FIELDS.items():
        label = f"dflash_config.{name}"
        fields[name] = _check(dflash[name], label, source, kind) if name in dflash else _DEFAULTS[name]
    layer_types = data.get("layer_types") or ()
    if not isinstance(layer_types, (list, tuple)):
        raise ModelConfigError(f"{source}: field 'layer_types' must be a list")
    window = data.get("sliding_window")
    if window is not None:
        window = _check(window, "sliding_window", source, int)
    causal = bool(common.causal)  # missing or null: the trainer's default, bidirectional blocks
    if "causal" in dflash and dflash["causal"] != causal:
        raise ModelConfigError(f"{source}: dflash_config.causal={dflash['causal']!r} contradicts "
                               f"is_causal={common.causal!r}")
    own = ("causal", "layer_types", "sliding_window")
    cfg = DFlash2Config(
        **{f.name: getattr(common, f.name) for f in dataclasses.fields(DrafterConfig) if f.name not in own},
        **fields, causal=causal,
        layer_types=tuple(str(t) for t in layer_types) if any(t != "full_attention" for t in layer_types) else (),
        sliding_window=window if "sliding_attention" in layer_types else None,
    )
    cfg.validate(source)
    return cfg


def dflash2_config_to_dict(cfg: DFlash2Config) -> dict:
    """The authors' config.json of a DFlash2 drafter."""
    from dflash_jax.models.config import drafter_config_to_dict

    out = drafter_config_to_dict(cfg)
    out["architectures"] = [ARCHITECTURE]
    out["dflash_config"]["block_size"] = cfg.block_size
    for name in _DFLASH2_FIELDS:
        out["dflash_config"][name] = getattr(cfg, name)
    out["layer_types"] = list(cfg.layer_types) or ["full_attention"] * cfg.num_layers
    out["sliding_window"] = cfg.sliding_window
    return out
