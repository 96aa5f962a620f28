"""The frozen target: Qwen3 (q/k norms), Llama-3 (llama3 RoPE scaling), Qwen3-MoE and gpt-oss (experts,
models/moe.py; gpt-oss's sinks, sliding windows and YaRN in the attention) decoders in Flax NNX."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax import sharding
from dflash_jax.ops.config import XLA, OpsConfig
from dflash_jax.ops.cache import KVCache, write_rows
from dflash_jax.ops.linear import dense, dot_input_last
from dflash_jax.models.layers import DecoderLayer, RMSNorm, _init
from dflash_jax.models.moe import MoeMLP
from dflash_jax.ops.rope import rope_attention_factor, rope_inv_freq
from dflash_jax.models.config import TargetConfig


def _embed_slice(table: jax.Array, ids: jax.Array, *, vocab_axes: tuple[str, ...]) -> tuple[jax.Array]:
    """One device's share of an embedding lookup: its ``table [vocab / n, hidden]`` slice's rows of
    ``ids`` (zeros for ids outside it), summed over ``vocab_axes``."""
    local = ids - jax.lax.axis_index(vocab_axes) * table.shape[0]
    inside = (local >= 0) & (local < table.shape[0])
    rows = jnp.take(table, jnp.where(inside, local, 0), axis=0)
    return (jax.lax.psum(jnp.where(inside[..., None], rows, jnp.zeros_like(rows)), vocab_axes),)


def _attention_extras(config: TargetConfig, layer: int) -> dict | None:
    """Layer ``layer``'s gpt-oss attention keywords (sinks, sliding window, YaRN's scale), or None."""
    factor = rope_attention_factor(config.rope_scaling)
    if not config.attention_sinks and config.layer_window(layer) is None and factor == 1.0:
        return None
    return dict(sinks=config.attention_sinks, window=config.layer_window(layer), rope_factor=factor)


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
                mlp=MoeMLP(c, dtype=dtype, rngs=rngs) if c.is_moe_layer(i) else None,
                attention_extras=_attention_extras(c, i),
            )
            for i in range(c.num_layers)
        ])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        if c.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Param(_init(rngs, (c.hidden_size, c.vocab_size), dtype), axes=("embed", "vocab"))

    # -- embedding and head, shared with the drafter -------------------------------------------

    def embed(self, ids: jax.Array) -> jax.Array:
        """``ids [batch, ...]`` -> ``[batch, ..., hidden]``: the raw embedding-table lookup (no scaling).

        Under ``sharding.kernel_mesh`` with the table split by vocabulary, each device looks up the
        ids of its slice and an all-reduce sums the rows (exactly one device holds each): left to
        itself, XLA may gather the whole table onto every device first (1.2 GB for Qwen3-8B).
        """
        table = self.embed_tokens[...]
        table_axes = ("vocab", "embed")
        across = sharding.kernel_mesh_axes(table_axes, table.shape, 0)
        if not across or sharding.kernel_mesh_axes(table_axes, table.shape, 1):
            return jnp.take(table, ids, axis=0)
        ids_axes = ("batch",) + ("length",) * (ids.ndim - 1)
        out_shape = lambda t, i: (jax.ShapeDtypeStruct(i.shape + t.shape[1:], t.dtype),)  # noqa: E731
        lookup = sharding.shard_kernel(functools.partial(_embed_slice, vocab_axes=across), [table_axes, ids_axes],
                                       [ids_axes + (None,)], out_shapes=out_shape)
        return lookup(table, ids)[0]

    def head(self, hidden: jax.Array) -> jax.Array:
        """The LM head on already-normed ``hidden [..., hidden]`` -> ``[..., vocab]``."""
        if self.lm_head is None:  # the table ``[vocab, hidden]`` is the head's weight stored input-last
            return dot_input_last(hidden, self.embed_tokens[...])
        return dense(hidden, self.lm_head)

    # -- forward passes ------------------------------------------------------------------------

    def _run(self, h, positions, ctx_lens, blk_lens, cache, starts, tap_layers, ops, fresh=False):
        """Shared layer loop over one causal block per row: ``h [batch, 1, seq, hidden]`` -> the
        final-normed ``h [batch, seq, hidden]``, the taps, the cache.

        ``fresh``: the cache holds nothing yet (prefill), so only the block is attended to.
        """
        n = len(self.layers)
        decoding = cache is not None and not fresh
        h, taps, cache = self._run_layers(h, positions, ctx_lens, blk_lens, cache, starts, tap_layers, ops, decoding)
        if n - 1 in tap_layers:
            taps[n - 1] = h
        tapped = jnp.concatenate([taps[i] for i in tap_layers], axis=-1)[:, 0] if tap_layers else None
        return h[:, 0], tapped, cache

    def _run_layers(self, h, positions, ctx_lens, blk_lens, cache, starts, tap_layers, ops, decoding):
        """``_run``'s layer loop -> the final-normed ``h``, the raw taps (not the last layer's), the cache."""
        n = len(self.layers)
        taps = {}
        empty = jnp.zeros((h.shape[0], 0, self.config.num_kv_heads, self.config.head_dim), h.dtype)
        ks, vs = (list(cache.k), list(cache.v)) if cache is not None else (None, None)
        delta = None  # decoding: a layer's output is h + delta, the add left to the next norm
        for i, layer in enumerate(self.layers):
            if decoding:
                h, delta, ks[i], vs[i] = layer.cached(h, delta, starts, ks[i], vs[i], blk_lens[:, 0],
                                                      ops=ops)
            else:
                h, k_blk, v_blk = layer(
                    h, positions, empty, empty, ctx_lens, blk_lens, causal=True, ops=ops
                )
                if cache is not None:
                    ks[i], vs[i] = write_rows(ks[i], k_blk[:, 0], starts), write_rows(vs[i], v_blk[:, 0], starts)
            if i in tap_layers and i != n - 1:
                taps[i] = h if delta is None else h + delta
        _, h = self.norm.add_norm(h, delta)
        return h, taps, (KVCache(tuple(ks), tuple(vs)) if cache is not None else None)

    def step(
        self,
        ids: jax.Array,
        starts: jax.Array,
        cache: KVCache,
        *,
        blk_lens: jax.Array | None = None,
        tap_layers: tuple[int, ...] = (),
        ops: OpsConfig = XLA,
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
                         ops, fresh=prefill)

    def forward(
        self,
        ids: jax.Array,
        *,
        tap_layers: tuple[int, ...] = (),
        ops: OpsConfig = XLA,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Cache-free causal forward: ``ids [batch, seq]`` -> ``(logits [batch, seq, vocab], taps)``."""
        batch, seq = ids.shape
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, 1, seq))
        zeros = jnp.zeros((batch, 1), jnp.int32)
        full = jnp.full((batch, 1), seq, jnp.int32)
        h = self.embed(ids)[:, None]
        hidden, taps, _ = self._run(h, positions, zeros, full, None, None, tuple(tap_layers), ops)
        return self.head(hidden), taps


# ----------------------------------------------------------------------------------------------
# Training: the frozen target's decoder layers stacked once and run under ``lax.scan``.
#
# Unrolled, the 36 layers of an 8B target are 36 copies of the layer in the train step's XLA
# module, each optimised and compiled separately; under ``lax.scan`` one layer body is compiled.
# The stacking happens once at setup and the stacked copy replaces the per-layer arrays
# (docs/training.md).
# ----------------------------------------------------------------------------------------------

LAYERS_AXIS = "layers"  # logical name of the stacked axis (``sharding.py`` maps it to no mesh axis)


@dataclasses.dataclass(frozen=True)
class ScanGraph:
    """The static half of a target split by ``stack_layers``."""

    shell: nnx.GraphDef  # the Target without its decoder layers: embedding, final norm, LM head
    layer: nnx.GraphDef  # one DecoderLayer (all layers share it)
    num_layers: int


class ScanParams(NamedTuple):
    """The array half of a target split by ``stack_layers`` (a pytree; jit argument)."""

    shell: nnx.State  # embedding, final norm, LM head
    layers: nnx.State  # one DecoderLayer's state, every leaf ``[num_layers, ...]``


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _with_layers_axis(v: nnx.Variable, value: jax.Array) -> nnx.Variable:
    """``v`` holding the stacked ``value [layers, ...]``; its logical axes gain ``LAYERS_AXIS``."""
    axes = v.get_metadata().get("axes")
    if axes is None:
        return v.replace(value)
    return v.replace(value, axes=(LAYERS_AXIS,) + tuple(axes))


def _stack_vars(*vs: nnx.Variable) -> nnx.Variable:
    return _with_layers_axis(vs[0], jnp.stack([v.get_value() for v in vs]))


def _index_var(v: nnx.Variable, i: int) -> nnx.Variable:
    axes = v.get_metadata().get("axes")
    value = v.get_value()[i]
    if axes is None:
        return v.replace(value)
    return v.replace(value, axes=tuple(axes)[1:])


def layers_stackable(target: Target) -> bool:
    """Whether every decoder layer is shaped like the first (``stack_layers`` needs it; a dense layer
    among mixture-of-experts ones, or gpt-oss's alternating windows, are not)."""
    first = nnx.split(target.layers[0])[0]
    return all(nnx.split(layer)[0] == first for layer in target.layers[1:])


def stack_layers(target: Target) -> tuple[ScanGraph, ScanParams]:
    """Splits ``target`` for ``scanned_forward``: its decoder layers' states stacked along a new
    leading axis (whatever variables a ``DecoderLayer`` holds), the rest as a layer-less shell.

    Run once at setup: the stacked arrays are new copies, so drop ``target`` afterwards to free
    its per-layer arrays (the shell shares the embedding, norm and head arrays with ``target``).
    ``target`` itself is not modified.
    """
    layer_gd = nnx.split(target.layers[0])[0]
    states = []
    for i, layer in enumerate(target.layers):
        gd, state = nnx.split(layer)
        if gd != layer_gd:
            raise ValueError(f"target layer {i} is not shaped like layer 0: cannot stack the layers")
        states.append(state)
    stacked = jax.tree.map(_stack_vars, *states, is_leaf=_is_var)
    shell = nnx.merge(*nnx.split(target))  # a new module object over the same variables
    shell.layers = nnx.List([])
    shell_gd, shell_state = nnx.split(shell)
    return ScanGraph(shell_gd, layer_gd, len(target.layers)), ScanParams(shell_state, stacked)


def init_stacked(config: TargetConfig, *, dtype=jnp.float32, seed: int = 0) -> tuple[ScanGraph, ScanParams]:
    """A random target directly in ``stack_layers``'s form (for benchmarks): the layers come from
    one vmapped layer initialisation, so a large target never exists in per-layer form."""
    box = {}

    def shell() -> nnx.State:
        # Traces the whole target for its graph; XLA drops the unused per-layer initialisation.
        graph, params = stack_layers(Target(config, dtype=dtype, rngs=nnx.Rngs(seed)))
        box["graph"] = graph
        return params.shell

    one = dataclasses.replace(config, num_layers=1)

    def layer(key: jax.Array) -> nnx.State:
        return nnx.split(Target(one, dtype=dtype, rngs=nnx.Rngs(key)).layers[0])[1]

    shell_state = jax.jit(shell)()
    graph = box["graph"]
    keys = jax.random.split(jax.random.key(seed + 1), config.num_layers)
    layer_gd = nnx.split(nnx.eval_shape(lambda: Target(one, dtype=dtype, rngs=nnx.Rngs(0))).layers[0])[0]
    if layer_gd != graph.layer:
        raise ValueError("a one-layer target's layer differs from the full target's: cannot stack")
    layers = jax.jit(jax.vmap(layer))(keys)
    layers = jax.tree.map(lambda v: _with_layers_axis(v, v.get_value()), layers, is_leaf=_is_var)
    return graph, ScanParams(shell_state, layers)


def unstack_layers(graph: ScanGraph, params: ScanParams) -> Target:
    """The ``Target`` module back from ``stack_layers``'s split (per-layer copies of the arrays:
    for the engine, which runs the unrolled layers)."""
    target = nnx.merge(graph.shell, params.shell)
    target.layers = nnx.List([
        nnx.merge(graph.layer, jax.tree.map(lambda v: _index_var(v, i), params.layers, is_leaf=_is_var))
        for i in range(graph.num_layers)
    ])
    return target


def scan_depth(num_layers: int, tap_layers: tuple[int, ...], logits: bool) -> int:
    """How many layers a forward must run: all for logits, else up to the deepest tap."""
    if logits:
        return num_layers
    return max(tap_layers) + 1 if tap_layers else 0


def scanned_forward(
    graph: ScanGraph,
    params: ScanParams,
    ids: jax.Array,
    *,
    tap_layers: tuple[int, ...],
    logits: bool,
    ops: OpsConfig = XLA,
) -> tuple[jax.Array | None, jax.Array | None]:
    """``Target.forward`` with the layers under ``lax.scan``: ``ids [batch, seq]`` ->
    ``(logits [batch, seq, vocab] or None, taps [batch, seq, len(tap_layers) * hidden] or None)``.

    Without ``logits`` only the layers up to the deepest tap run (the later layers and the head are
    skipped). Taps follow ``Target._run``: the raw output of layer ``lid``, except the last layer,
    whose tap is the final-normed hidden state.
    """
    shell = nnx.merge(graph.shell, params.shell)
    c = shell.config
    n = graph.num_layers
    taps = tuple(int(i) for i in tap_layers)
    if any(not 0 <= i < n for i in taps):
        raise ValueError(f"tap layers {taps} out of range for {n} layers")
    depth = scan_depth(n, taps, logits)
    batch, seq = ids.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, 1, seq))
    ctx_lens = jnp.zeros((batch, 1), jnp.int32)
    blk_lens = jnp.full((batch, 1), seq, jnp.int32)
    h = shell.embed(ids)[:, None]  # [batch, 1, seq, hidden]: one causal block per row
    empty = jnp.zeros((batch, 0, c.num_kv_heads, c.head_dim), h.dtype)

    # Raw taps go to their slot of a buffer carried through the loop (an in-place update); the
    # other layers write to one spare slot, so the loop body is the same for every layer.
    raw = [i for i in taps if i != n - 1]
    slots = {lid: j for j, lid in enumerate(dict.fromkeys(raw))}
    slot_of = jnp.asarray([slots.get(i, len(slots)) for i in range(max(depth, 1))], jnp.int32)
    buf = jnp.zeros((len(slots) + 1,) + h.shape, h.dtype)

    def body(carry, i):
        h, buf = carry
        # Index the stacked weights inside the loop: slicing them to ``depth`` outside it would
        # copy them.
        state = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), params.layers)
        layer = nnx.merge(graph.layer, state)
        h, _, _ = layer(h, positions, empty, empty, ctx_lens, blk_lens, causal=True, ops=ops)
        buf = jax.lax.dynamic_update_index_in_dim(buf, h, slot_of[i], 0)
        return (h, buf), None

    if depth:
        (h, buf), _ = jax.lax.scan(body, (h, buf), jnp.arange(depth, dtype=jnp.int32))
    final = shell.norm(h) if depth == n else None
    tapped = None
    if taps:
        parts = [final if i == n - 1 else buf[slots[i]] for i in taps]
        tapped = jnp.concatenate(parts, axis=-1)[:, 0]
    out = shell.head(final[:, 0]) if logits else None
    return out, tapped
