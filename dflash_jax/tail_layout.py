"""The target's decoder layers in the layer-tail serving layout, and the layer loop that runs them.

At batch 1 a decode step streams the weights, and the stretch of a layer between two attentions
(output projection, residual add, post-attention norm, gate-up, SwiGLU, down, residual add, the next
layer's input norm and QKV) was nine kernels in the fused layout (``layers.fuse_projections``). In
this layout it is one call of ``kernels_pallas.layer_tail`` per layer: on a GPU one persistent Mosaic
kernel for blocks of up to 16 rows (a decode token padded to 8 rows, a verify block), elsewhere and
for larger blocks its jnp reference, the same math in the same layout. A step is then, per layer,
the attention kernel (``Attention.attend_cached_qkv``, which reads the QKV the previous layer's tail
wrote) and the tail; the first layer's QKV and the final norm run around the loop.

The layout (``TailWeights``), held instead of the fused one (the weights exist once): every matmul
weight ``[N, K]`` (x is the kernel's WGMMA left operand), the RMSNorm weight before a matmul folded
into it (the norm's row scale comes after the dot, ``layer_tail_gpu.normed_matmul``), and gate-up
interleaved per 64-row tile, 32 gate rows then the same units' 32 up rows. Folding the norms moves
bf16 results by a rounding, as a change of GEMM does; float32 models stay within float32 rounding
(tests/test_tail_layout.py).

Single device, no biases (Qwen3, Llama-3); opt-in, ``EngineConfig(tail_layout="on")``: on the
H200 a batch-1 step is no faster than in the fused layout (docs/kernels.md, docs/benchmarks.md,
nineteenth session). Checkpoints and training keep the separate projections. ``ATTENTION_IN_TAIL``
(off) also moves a single decode token's attention into the layer tail before it: correct, and
slower on the H200 (twenty-fourth session).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import kernels_pallas
from dflash_jax.attention import AttentionImpl, block_attention
from dflash_jax.cache import KVCache, write_rows
from dflash_jax.layers import DecoderLayer, add_rms_norm
from dflash_jax.model_config import TargetConfig
from kernels_pallas._common import default_scale
from kernels_pallas.layer_tail_gpu import (GATE_UP_TILE, MAX_ROWS, ROW_MULTIPLE, WGMMA_M, fold_norm,
                                           interleave_gate_up, normed_matmul)
from kernels_pallas.tail_attention_gpu import META

# A single decode token (batch 1, Qwen3's q / k norms) runs each layer's attention in the layer tail
# before it (``kernels_pallas.layer_tail``'s attention phase): one kernel per layer instead of three,
# but 19-23 us per layer slower on the H200 (docs/kernels.md), so off; bench/bench_engine.py's
# ``--tail-layout attn`` switches it on for an A/B.
ATTENTION_IN_TAIL = False


class TailWeights(nnx.Module):
    """One decoder layer's matmul weights in the layer-tail layout (norm weights folded in):
    ``qkv [kv_heads, groups + 2, head_dim, hidden]`` (the fused QKV's heads, input norm folded),
    ``o [hidden, heads, head_dim]``, ``gate_up [intermediate / 32, 2, 32, hidden]`` (per tile 32
    gate then 32 up units; post-attention norm folded), ``down [hidden, intermediate]``."""

    def __init__(self, qkv: jax.Array, o: jax.Array, gate_up: jax.Array, down: jax.Array):
        self.qkv = nnx.Param(qkv, axes=("kv_heads", None, "head_dim", "embed"))
        self.o = nnx.Param(o, axes=("embed", "heads", "head_dim"))
        self.gate_up = nnx.Param(gate_up, axes=("mlp", None, None, "embed"))
        self.down = nnx.Param(down, axes=("embed", "mlp"))

    def qkv_matrix(self) -> jax.Array:
        """``[Q, hidden]``: the fused QKV's output columns as rows."""
        w = self.qkv[...]
        return w.reshape(-1, w.shape[-1])

    def matrices(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``o [hidden, heads * head_dim]``, ``gate_up [2 * intermediate, hidden]``, ``down``."""
        o, gate_up = self.o[...], self.gate_up[...]
        return o.reshape(o.shape[0], -1), gate_up.reshape(-1, gate_up.shape[-1]), self.down[...]


def unsupported_reason(config: TargetConfig) -> str | None:
    """Why a target of ``config`` cannot take the layout (None: it can)."""
    if config.attention_bias or config.mlp_bias:
        return "the layer-tail layout has no biases (attention_bias / mlp_bias)"
    if config.intermediate_size % (GATE_UP_TILE // 2):
        return f"intermediate_size {config.intermediate_size} is not a multiple of {GATE_UP_TILE // 2}"
    return None


def _tail_weights(layer: DecoderLayer) -> TailWeights:
    attn, mlp = layer.self_attn, layer.mlp
    attn.fuse()
    mlp.fuse()
    qkv = attn.qkv_proj[...]  # [hidden, kv_heads, groups + 2, head_dim]
    hidden = qkv.shape[0]
    folded_qkv = fold_norm(layer.input_layernorm.weight[...], qkv.reshape(hidden, -1)).reshape(qkv.shape)
    gate_up = mlp.gate_up_proj[...]  # [hidden, intermediate, 2]
    post = layer.post_attention_layernorm.weight[...]
    interleaved = interleave_gate_up(fold_norm(post, gate_up[..., 0]), fold_norm(post, gate_up[..., 1]))
    half = GATE_UP_TILE // 2
    return TailWeights(qkv=jnp.transpose(folded_qkv, (1, 2, 3, 0)),
                       o=jnp.transpose(attn.o_proj[...], (2, 0, 1)),
                       gate_up=interleaved.reshape(-1, 2, half, hidden),
                       down=mlp.down_proj[...].T)


def to_tail_layout(layers: nnx.List, config: TargetConfig) -> None:
    """Puts a target's decoder ``layers`` in the layer-tail layout, in place and layer by layer (the
    earlier layout of a layer is dropped once its tail weights exist); idempotent."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(reason)
    for layer in layers:
        if layer.tail is not None:
            continue
        layer.tail = nnx.data(_tail_weights(layer))
        layer.input_layernorm = layer.post_attention_layernorm = None
        layer.self_attn.qkv_proj = layer.self_attn.o_proj = None
        layer.mlp.gate_up_proj = layer.mlp.down_proj = None


def padded_rows(rows: int, block: int, attention_impl: AttentionImpl) -> int:
    """The rows a decode or verify pass of ``rows`` runs through the layer loop: padded to the
    kernel's multiple of 8 where that fits it (whole blocks of ``block``, at most 16 rows), else as
    they are. The attention kernel reads the padded QKV as is (its padding rows are never read), so
    only the attention's output is padded, in the same XLA fusion as its split merge."""
    padded = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
    if attention_impl != "pallas" or padded > MAX_ROWS or padded % block:
        return rows
    return padded


def _pad(x: jax.Array, rows: int) -> jax.Array:
    """``x [n, ...]`` padded to ``rows`` rows with copies of its last row (a single token's padded rows
    are then copies of it, which the layer tail's attention phase relies on)."""
    if x.shape[0] == rows:
        return x
    return jnp.concatenate([x, jnp.broadcast_to(x[-1:], (rows - x.shape[0],) + x.shape[1:])])


def _attention_tables(target, starts: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """The layer tail's attention inputs shared by every layer of a single-token step: ``meta`` (the
    token's position first) and the RoPE table ``[64, head_dim]`` (cos | sin at that position, every
    row the same; ``cached_attention_gpu``'s values)."""
    attn = target.layers[0].self_attn
    position = starts[0].astype(jnp.int32)
    freqs = position.astype(jnp.float32) * jnp.asarray(attn.inv_freq, jnp.float32)
    row = jnp.concatenate([jnp.cos(freqs), jnp.sin(freqs)]).astype(dtype)
    return jnp.zeros((META,), jnp.int32).at[0].set(position), jnp.broadcast_to(row, (WGMMA_M, row.shape[0]))


def _norm_tables(attn, dtype) -> jax.Array:
    """``[2, 64, head_dim]``: a layer's q and k RMSNorm weights, every row the same."""
    w = jnp.stack([attn.q_norm.weight[...], attn.k_norm.weight[...]]).astype(dtype)
    return jnp.broadcast_to(w[:, None], (2, WGMMA_M, w.shape[-1]))


def run_layers(target, h: jax.Array, positions: jax.Array, starts: jax.Array | None, cache: KVCache | None,
               blk_lens: jax.Array, tap_layers: tuple[int, ...], attention_impl: AttentionImpl,
               decoding: bool) -> tuple[jax.Array, dict[int, jax.Array], KVCache | None]:
    """``Target._run``'s layer loop in this layout: ``h [batch, 1, block, hidden]`` (one causal block
    per row at ``positions [batch, 1, block]``; ``blk_lens [batch, 1]`` valid slots).

    ``decoding``: the blocks extend the cache at ``starts`` (decode and verify passes); otherwise
    the block attends to itself only (prefill, with ``cache`` then written at ``starts``; or no
    cache). Returns the final-normed hidden ``[batch, 1, block, hidden]``, the raw outputs of the
    ``tap_layers`` (not the last layer) and the cache.
    """
    c = target.config
    layers = target.layers
    batch, _, block, hidden = h.shape
    rows = batch * block
    kv_shape = (c.num_kv_heads, c.num_heads // c.num_kv_heads + 2, c.head_dim)
    padded = padded_rows(rows, block, attention_impl) if decoding else rows
    eps = c.rms_norm_eps
    ks, vs = (list(cache.k), list(cache.v)) if cache is not None else (None, None)
    empty = jnp.zeros((batch, 0, c.num_kv_heads, c.head_dim), h.dtype)  # prefill: no context before the block
    x = _pad(h.reshape(rows, hidden), padded)
    qkv = normed_matmul(x, layers[0].tail.qkv_matrix(), eps=eps).astype(x.dtype)
    in_tail = (ATTENTION_IN_TAIL and decoding and rows == 1 and padded == ROW_MULTIPLE and attention_impl == "pallas"
               and layers[0].self_attn.q_norm is not None)
    if in_tail:
        meta, rope_table = _attention_tables(target, starts, x.dtype)
    taps = {}
    a = None  # the layer's attention output, when the layer tail before it ran the attention
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        qkv_blocks = qkv.reshape((padded // block, block) + kv_shape)
        if a is None:
            if decoding:
                out, ks[i], vs[i] = attn.attend_cached_qkv(qkv_blocks, starts, ks[i], vs[i], blk_lens[:, 0],
                                                           impl=attention_impl)
            else:
                q, k, v = attn.finish_qkv(qkv_blocks[:, None], positions)
                out = block_attention(q, empty, empty, jnp.zeros_like(blk_lens), k, v, blk_lens, causal=True,
                                      impl=attention_impl)
                if cache is not None:
                    ks[i], vs[i] = write_rows(ks[i], k[:, 0], starts), write_rows(vs[i], v[:, 0], starts)
            a = _pad(out.reshape(rows, -1), padded)
        w_next = layers[i + 1].tail.qkv_matrix() if i + 1 < len(layers) else None
        if in_tail and w_next is not None:
            nxt = layers[i + 1].self_attn
            outs = kernels_pallas.layer_tail(
                a, x, *layer.tail.matrices(), w_next, ks[i + 1][0], vs[i + 1][0], meta, _norm_tables(nxt, x.dtype),
                rope_table, eps=eps, groups=c.num_heads // c.num_kv_heads, scale=default_scale(c.head_dim, None))
            a, k_new, v_new = outs[4:7]
            new_kv = lambda t: t[:1].reshape(1, 1, c.num_kv_heads, c.head_dim)  # noqa: E731
            ks[i + 1] = write_rows(ks[i + 1], new_kv(k_new), starts)
            vs[i + 1] = write_rows(vs[i + 1], new_kv(v_new), starts)
        else:
            outs = kernels_pallas.layer_tail(a, x, *layer.tail.matrices(), w_next, eps=eps)
            a = None
        x = outs[2]
        if w_next is not None:
            qkv = outs[3]
        if i in tap_layers and i != len(layers) - 1:
            taps[i] = x[:rows].reshape(h.shape)
    _, final = add_rms_norm(x[:rows].reshape(h.shape), None, target.norm, fused=decoding and attention_impl == "pallas")
    return final, taps, (KVCache(tuple(ks), tuple(vs)) if cache is not None else None)
