"""The small, stable Python API for notebooks, tests and users (re-exported by ``dflash_jax``)."""

from __future__ import annotations

import functools
import operator
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.config import pair_mismatch
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target


def target_forward(
    target: Target, input_ids, layer_ids: Sequence[int] | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """Full-sequence forward without a cache.

    ``input_ids [batch, seq]`` -> ``(logits [batch, seq, vocab], taps)`` where taps are the hidden
    states after ``layer_ids`` (HF ``hidden_states[i + 1]``) concatenated on the feature axis,
    ``[batch, seq, len(layer_ids) * hidden]`` (None when ``layer_ids`` is None).
    """
    _check_target(target, "target_forward")
    ids = _token_ids(input_ids, "input_ids", 2, target.config.vocab_size)
    layers = target.config.num_layers
    taps = tuple(layer_ids or ())
    if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < layers for i in taps):
        raise ValueError(f"layer_ids must be layer indices in [0, {layers}), got {list(taps)}")
    return _forward(target, ids, tap_layers=tuple(int(i) for i in taps))


def _check_target(target, where: str) -> None:
    if not callable(getattr(target, "forward", None)) or not hasattr(target.config, "num_layers"):
        raise TypeError(f"{where}: target must be a target model (dflash_jax.load_target), got {type(target).__name__}")


def token_id_list(values: Any, what: str) -> list[int]:
    """``values`` as Python ints, refusing what is not an integer (numpy's are) and booleans, which
    ``operator.index`` and numpy take as 0 and 1: ``int()`` truncated token ids like 1.5 to 1 and read
    strings ("7", and "hello" failed as a bad literal). A ``ValueError`` names ``what``."""
    ids = []
    try:
        for v in values:  # one pass: ``values`` may be an iterator
            if isinstance(v, (bool, np.bool_)):
                raise ValueError(f"{what} must be integers (token ids), not booleans: got {values!r:.100}")
            ids.append(operator.index(v))
    except TypeError:
        raise ValueError(f"{what} must be integers (token ids), got {values!r:.100}") from None
    return ids


def _token_ids(values, name: str, ndim: int, vocab_size: int) -> jax.Array:
    """``values`` as int32 token ids of ``ndim`` dimensions, none empty, each in ``[0, vocab_size)``: a
    float or out-of-range id would be truncated or read past the embedding table (NaN logits), and a
    boolean in a list of ints taken as the id 0 or 1."""
    shape = "[batch, seq]" if ndim == 2 else "[seq]"
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name} must be token ids {shape}, got a string (encode text with a Tokenizer)")
    try:
        ids = np.asarray(values)
    except ValueError:  # ragged rows
        raise ValueError(f"{name} must be token ids {shape} (rows of equal length), got {values!r:.100}") from None
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name} must be integer token ids, got {ids.dtype} values {values!r:.100}")
    if ids.ndim != ndim or ids.size == 0:
        raise ValueError(f"{name} must be non-empty token ids {shape}, got shape {ids.shape}")
    if not isinstance(values, (np.ndarray, jax.Array)):  # nested lists: numpy made their booleans ints
        for i, row in enumerate(values if ndim == 2 else [values]):
            token_id_list(row, f"{name}[{i}]" if ndim == 2 else name)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{name} has token ids outside [0, {vocab_size})")
    return jnp.asarray(ids, jnp.int32)


@functools.partial(jax.jit, static_argnames=("tap_layers",))
def _forward(target: Target, ids: jax.Array, *, tap_layers: tuple[int, ...]):
    return target.forward(ids, tap_layers=tap_layers)


def draft_logits(drafter: Drafter, target: Target, context_ids: Sequence[int], anchor_id: int,
                 block_size: int | None = None) -> jax.Array:
    """The drafter's logits ``[B - 1, vocab]`` for block slots 1..B-1 of the first drafting step.

    The context is ``context_ids`` at positions 0..n-1 (its taps from the target's forward); the block
    ``[anchor_id, MASK, ...]`` sits at positions n..n+B-1.
    """
    _check_target(target, "draft_logits")
    if not callable(getattr(drafter, "context_kv", None)):
        raise TypeError(f"draft_logits: drafter must be a Drafter (dflash_jax.load_drafter), got "
                        f"{type(drafter).__name__}")
    cfg, tcfg = drafter.config, target.config
    if (mismatch := pair_mismatch(cfg, tcfg)) is not None:
        field, ours, _, theirs = mismatch
        raise ValueError(f"draft_logits: drafter {field} {ours} != the target's {theirs} (a drafter of another target)")
    ctx = _token_ids(context_ids, "context_ids", 1, tcfg.vocab_size)[None]
    try:
        anchor = operator.index(anchor_id)
    except TypeError:
        anchor = None
    if isinstance(anchor_id, bool) or anchor is None or not 0 <= anchor < tcfg.vocab_size:
        raise ValueError(f"anchor_id must be one token id in [0, {tcfg.vocab_size}), got {anchor_id!r:.100}")
    block = cfg.block_size if block_size is None else block_size
    # a block is the anchor plus at least one slot to draft (a DFlash2 drafter: at least its convolutions' span)
    least = max(2, getattr(cfg, "conv_kernel_size", 1))
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < least:
        raise ValueError(f"block_size must be an integer >= {least} (None: the drafter's {cfg.block_size}), "
                         f"got {block_size!r}")
    return _draft_logits(drafter, target, ctx, jnp.int32(anchor), block=int(block))


@functools.partial(jax.jit, static_argnames=("block",))
def _draft_logits(drafter: Drafter, target: Target, ctx: jax.Array, anchor_id: jax.Array, *, block: int):
    cfg = drafter.config
    n = ctx.shape[1]
    _, taps = target.forward(ctx, tap_layers=cfg.target_layer_ids)
    k_ctx, v_ctx = drafter.context_kv(taps, jnp.arange(n, dtype=jnp.int32)[None])
    block_ids = jnp.concatenate([anchor_id[None], jnp.full((block - 1,), cfg.mask_token_id, jnp.int32)])[None]
    positions = (n + jnp.arange(block, dtype=jnp.int32))[None, None]
    lens = jnp.asarray([[n]], jnp.int32)
    hidden = drafter(target.embed(block_ids)[:, None], positions, k_ctx, v_ctx, lens,
                     jnp.asarray([[block]], jnp.int32))
    return drafter.logits(target, hidden[0, 0, 1:])
