"""The serving layout: a pure function from a model in the checkpoint layout to the one the engine runs.

``serving_target(target)`` and ``serving_drafter(drafter)`` return new modules (``nnx.clone``: the
unchanged arrays are shared, never copied) and leave the caller's modules as they were, so that one
loaded target can back several engines of different settings, and a checkpoint is always saved
from the layout it was loaded in.

- Fused projections: one QKV weight ``[embed, kv_heads, groups + 2, head_dim]`` (per KV head its
  ``groups`` query heads, its key, its value) and one gate-up weight ``[embed, mlp, 2]``. At batch 1
  a decode step is weight streaming, and XLA's GEMV code reaches more of the bandwidth on one wide
  matrix than on three narrow ones. Grouping by KV head keeps a tensor-parallel shard's Q, K and V
  together; ``mlp`` first keeps a shard's gate and up together.
- Folded norms (the target only, layers without biases): each layer's input-norm weight multiplies
  the QKV weight's input rows and its post-attention-norm weight gate-up's (in float32, rounded to
  the weight's dtype), and the norm weights become ones, so every path computes the same function.
  The decode path then scales the products per row instead of the inputs (``DecoderLayer.cached``),
  so at batch 1 no norm kernel sits on the step's critical path before a matmul. Folding moves bf16
  products by a rounding, as a change of GEMM does; float32 models stay within float32 rounding.
- Weights stored input-last (``input_last=True``, where ``ops.linear.weight_major_gemms``: XLA:CPU): every
  weight ``ops.linear.dense`` multiplies transposed to ``[*out, *in]`` (torch's order), so that a block of
  rows multiplies as ``w @ x^T`` with the weight the GEMM's streamed operand (``ops.linear.dot_input_last``).
- With ``bfloat16_weights`` as well (CPUs with bfloat16 matrix units, ``ops.linear.bfloat16_matrix_units``):
  those of them whose float32 values are all bfloat16 values (a bfloat16 checkpoint served in float32) kept in
  their ``[*in, *out]`` order in bfloat16 instead, the norms before them unfolded, and a tied LM head gets a
  bfloat16 ``[hidden, vocab]`` copy of the embedding table (the lookup keeps reading the float32 table).
  ``ops.linear.dense`` multiplies float32 rows by them exactly, as three bfloat16 terms on the left of the
  weight: half the bytes, and the CPU's bfloat16 GEMMs. Weights with other values stay float32, input-last.
- The drafter's context K/V projection: every layer's K and V weights side by side, ``[embed,
  kv_heads, layers, 2, head_dim]``, one matmul per committed token for all layers (left to XLA,
  the per-layer matmuls were merged by copying their weights into one at every step). KV heads come
  first after the input, so a tensor-parallel shard of the flattened columns is a shard of KV heads.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.hybrid import HybridTarget
from dflash_jax.models.layers import MLP, Attention, DecoderLayer
from dflash_jax.models.target import Target
from dflash_jax.ops.attention import fused_query_groups
from dflash_jax.ops.linear import INPUT_LAST, exactly_bfloat16
from dflash_jax.ops.norms import fold_norm

# (module class, weight, the weight's input dimensions): the serving layout's weights that only
# ``ops.linear.dense`` multiplies, which ``store_input_last`` transposes.
DENSE_WEIGHTS = (
    (Attention, "qkv_proj", 1), (Attention, "o_proj", 2), (MLP, "gate_up_proj", 1), (MLP, "down_proj", 1),
    (Target, "lm_head", 1), (Drafter, "fc", 1), (Drafter, "context_kv_proj", 1),
    (GroupedDynamicCausalConv, "kernel_projection", 1), (CandidateSelector, "hidden_projection", 1),
)


def serving_target(target: Target, *, fold_norms: bool = True, input_last: bool = False,
                   bfloat16_weights: bool = False, attention_impl: str = "xla") -> Target:
    """A copy of ``target`` in the serving layout: projections fused, with ``fold_norms`` the norms
    folded into the matmuls after them, query heads padded for ``attention_impl``'s kernel
    (``pad_query_groups``), with ``input_last`` the weights stored input-last (``store_input_last``; with
    ``bfloat16_weights`` too, those of bfloat16 values in bfloat16, and a layer whose matmuls hold bfloat16
    values keeps its norms: folded, they would not). ``target`` is not changed. A hybrid target
    (``models.hybrid``) has no serving layout: it is served as a plain copy."""
    served = nnx.clone(target)
    if isinstance(served, HybridTarget):
        return served
    for layer in served.layers:
        fuse_attention(layer.self_attn)
        if isinstance(layer.mlp, MLP):  # a mixture of experts keeps its layout
            fuse_mlp(layer.mlp)
            keeps_bfloat16 = bfloat16_weights and input_last and exactly_bfloat16(layer.mlp.gate_up_proj[...])
            if fold_norms and not keeps_bfloat16:
                _fold_layer_norms(layer)
        pad_query_groups(layer.self_attn, attention_impl)
    if input_last:
        store_input_last(served, bfloat16_weights=bfloat16_weights)
        if bfloat16_weights and served.lm_head is None and exactly_bfloat16(served.embed_tokens[...]):
            served.lm_head = nnx.data(nnx.Param(served.embed_tokens[...].T.astype(jnp.bfloat16),
                                                axes=("embed", "vocab")))
    return served


def serving_drafter(drafter: Drafter, *, input_last: bool = False, bfloat16_weights: bool = False,
                    attention_impl: str = "xla") -> Drafter:
    """A copy of ``drafter`` in the serving layout: every layer's projections fused for the block,
    plus ``context_kv_proj`` for the context K/V of all layers at once, query heads padded for
    ``attention_impl``'s kernel (``pad_query_groups``), with ``input_last`` the weights stored
    input-last (``store_input_last``, ``bfloat16_weights`` as there). ``drafter`` is not changed."""
    served = nnx.clone(drafter)
    attns = [layer.self_attn for layer in served.layers]
    w = jnp.stack([jnp.stack([a.k_proj[...], a.v_proj[...]], axis=2) for a in attns], axis=2)
    served.context_kv_proj = nnx.data(nnx.Param(w, axes=("embed", "kv_heads", None, None, "head_dim")))
    if attns[0].k_bias is not None:
        b = jnp.stack([jnp.stack([a.k_bias[...], a.v_bias[...]], axis=1) for a in attns], axis=1)
        served.context_kv_bias = nnx.data(nnx.Param(b, axes=("kv_heads", None, None, "head_dim")))
    for layer in served.layers:
        fuse_attention(layer.self_attn)
        fuse_mlp(layer.mlp)
        pad_query_groups(layer.self_attn, attention_impl)
    if input_last:
        store_input_last(served, bfloat16_weights=bfloat16_weights)
    return served


def store_input_last(module: nnx.Module, *, bfloat16_weights: bool = False) -> None:
    """On a serving copy: each of ``DENSE_WEIGHTS`` replaced by its transpose ``[*out, *in]`` (its
    logical axes permuted alike), marked ``ops.linear.INPUT_LAST`` for ``dense``; with ``bfloat16_weights``, one
    whose float32 values all are bfloat16 values (``ops.linear.exactly_bfloat16``) is kept in its order in bfloat16
    instead. New arrays: the checkpoint-layout module keeps its own."""
    found = [(node, name, in_dims) for _, node in nnx.iter_graph(module) for cls, name, in_dims in DENSE_WEIGHTS
             if isinstance(node, cls) and isinstance(getattr(node, name, None), nnx.Param)]
    for node, name, in_dims in found:
        w = getattr(node, name)
        if bfloat16_weights and exactly_bfloat16(w[...]):  # ``ops.linear`` multiplies it rows on the left
            setattr(node, name, nnx.Param(w[...].astype(jnp.bfloat16), **w.get_metadata()))
            continue
        perm = tuple(range(in_dims, w.ndim)) + tuple(range(in_dims))
        axes = w.get_metadata().get("axes")
        metadata = {INPUT_LAST: True} if axes is None else {"axes": tuple(axes[i] for i in perm), INPUT_LAST: True}
        setattr(node, name, nnx.Param(jnp.transpose(w[...], perm), **metadata))


def in_serving_layout(module: nnx.Module) -> bool:
    """Whether any layer of ``module`` is already in the serving layout (such a module cannot be
    saved as a checkpoint, nor converted again)."""
    return any(isinstance(n, Attention) and n.qkv_proj is not None for _, n in nnx.iter_graph(module))


def fuse_attention(attn: Attention) -> None:
    """On a module of the copy: one QKV weight (and bias) in place of the three."""
    groups = attn.num_heads // attn.num_kv_heads
    hidden = attn.q_proj.shape[0]
    q = attn.q_proj[...].reshape(hidden, attn.num_kv_heads, groups, attn.head_dim)
    w = jnp.concatenate([q, attn.k_proj[...][:, :, None], attn.v_proj[...][:, :, None]], axis=2)
    attn.qkv_proj = nnx.data(nnx.Param(w, axes=("embed", "kv_heads", None, "head_dim")))
    if attn.q_bias is not None:
        qb = attn.q_bias[...].reshape(attn.num_kv_heads, groups, attn.head_dim)
        b = jnp.concatenate([qb, attn.k_bias[...][:, None], attn.v_bias[...][:, None]], axis=1)
        attn.qkv_bias = nnx.data(nnx.Param(b, axes=("kv_heads", None, "head_dim")))
    attn.q_proj = attn.k_proj = attn.v_proj = None
    attn.q_bias = attn.k_bias = attn.v_bias = None


def pad_query_groups(attn: Attention, attention_impl: str) -> None:
    """On a fused attention of the copy: each KV head's query heads padded with zero queries to
    ``ops.attention.fused_query_groups`` (a power of two, for the fused cached-attention kernel on a GPU),
    the output projection with zero rows for them, so the padded heads add exact zeros; the layer's
    function is unchanged. An attention with sinks or a sliding window is left alone: no kernel takes it."""
    kv, groups = attn.num_kv_heads, attn.num_heads // attn.num_kv_heads
    padded = fused_query_groups(groups, attention_impl)
    if padded == groups or attn.sinks is not None or attn.window is not None:
        return
    w = attn.qkv_proj[...]  # [embed, kv_heads, groups + 2, head_dim]: queries, key, value
    zeros = jnp.zeros(w.shape[:2] + (padded - groups,) + w.shape[3:], w.dtype)
    attn.qkv_proj = nnx.data(nnx.Param(jnp.concatenate([w[:, :, :groups], zeros, w[:, :, groups:]], axis=2),
                                       axes=attn.qkv_proj.get_metadata()["axes"]))
    if attn.qkv_bias is not None:
        b = attn.qkv_bias[...]  # [kv_heads, groups + 2, head_dim]
        pad = jnp.zeros((kv, padded - groups) + b.shape[2:], b.dtype)
        attn.qkv_bias = nnx.data(nnx.Param(jnp.concatenate([b[:, :groups], pad, b[:, groups:]], axis=1),
                                           axes=attn.qkv_bias.get_metadata()["axes"]))
    o = attn.o_proj[...]  # [heads, head_dim, hidden], heads grouped by KV head
    o = o.reshape((kv, groups) + o.shape[1:])
    o = jnp.concatenate([o, jnp.zeros((kv, padded - groups) + o.shape[2:], o.dtype)], axis=1)
    attn.o_proj = nnx.Param(o.reshape((kv * padded,) + o.shape[2:]), axes=attn.o_proj.get_metadata()["axes"])
    attn.num_heads = kv * padded


def fuse_mlp(mlp: MLP) -> None:
    """On a module of the copy: one gate-up weight ``[embed, mlp, 2]`` (and bias) in place of two."""
    w = jnp.stack([mlp.gate_proj[...], mlp.up_proj[...]], axis=-1)
    mlp.gate_up_proj = nnx.data(nnx.Param(w, axes=("embed", "mlp", None)))
    if mlp.gate_bias is not None:
        b = jnp.stack([mlp.gate_bias[...], mlp.up_bias[...]], axis=-1)
        mlp.gate_up_bias = nnx.data(nnx.Param(b, axes=("mlp", None)))
    mlp.gate_proj = mlp.up_proj = mlp.gate_bias = mlp.up_bias = None


def _fold_layer_norms(layer: DecoderLayer) -> None:
    """On a fused layer of the copy: the input norm's weight into the QKV weight's input rows and the
    post-attention norm's into gate-up's, the norm weights set to ones (new arrays: the original
    module's are untouched). A layer with biases is left as it is (the scale would have to precede
    the bias)."""
    attn, mlp = layer.self_attn, layer.mlp
    if attn.qkv_bias is not None or mlp.gate_up_bias is not None:
        return
    for norm, w in ((layer.input_layernorm, attn.qkv_proj), (layer.post_attention_layernorm, mlp.gate_up_proj)):
        w[...] = fold_norm(norm.weight[...], w[...])
        norm.weight[...] = jnp.ones_like(norm.weight[...])
    layer.norms_folded = True
