"""The DFlash2 selector objective: a K-way cross-entropy over each slot's training candidates.

At every supervised slot the unary top-K candidates (no gradient through the choice) are scored by
the candidate selector given the slot's final hidden state and its predecessor token (the data
token before the slot's label: teacher forcing, so slot 1's predecessor is the anchor). When the
target token is not among them it replaces the K-th candidate, so every slot has a label among K.
The per-slot CE is weighted like the unary loss (decay weights, or D-PACE weights computed from the
selector's own CE) and added to the unary loss's numerator times ``selector_alpha``: the total is
``(unary + alpha * selector) / den`` with the unary loss's normaliser.

The target token is the unary loss's label: the data token for hard labels (``ce``), the target's
argmax when distilling (as the reference trainer takes it from the target's logits).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dflash_jax.training.losses import decay_weights, dpace_weights


class SelectorSums(NamedTuple):
    num: jax.Array  # sum of weighted selector CE
    correct: jax.Array  # teacher-forced selector picks the target, among slots whose top-K held it
    recalled: jax.Array  # supervised slots whose unary top-K held the target
    count: jax.Array  # supervised slots

    def __add__(self, other: "SelectorSums") -> "SelectorSums":  # type: ignore[override]
        return SelectorSums(*(a + b for a, b in zip(self, other)))


def training_candidates(candidate_ids: jax.Array, target_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``candidate_ids [..., K]``, ``target_ids [...]`` -> (candidates with a missing target in the last
    place, the target's place ``[...]``, whether the unary top-K held it ``[...]``)."""
    k = candidate_ids.shape[-1]
    hit = candidate_ids == target_ids[..., None]
    held = jnp.any(hit, axis=-1)
    place = jnp.where(held, jnp.argmax(hit, axis=-1), k - 1)
    last = jnp.where(held, candidate_ids[..., -1], target_ids)
    return candidate_ids.at[..., -1].set(last), place.astype(jnp.int32), held


def predecessor_ids(input_ids: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
    """``[batch, blocks, B]``: the data token before each slot's label (slot 0: the anchor's own)."""
    pos = anchors[..., None] + jnp.maximum(jnp.arange(block_size) - 1, 0)
    flat = jnp.take_along_axis(input_ids, pos.reshape(pos.shape[0], -1), axis=1)
    return flat.reshape(pos.shape)


def selector_sums(selector, logits: jax.Array, hidden: jax.Array, predecessors: jax.Array, target_ids: jax.Array,
                  mask: jax.Array, *, weighting: str, gamma: float, dpace_alpha: float) -> SelectorSums:
    """The selector's additive sums over blocks: ``logits [..., B, vocab]``, ``hidden [..., B, hidden]``,
    ``predecessors / target_ids / mask [..., B]``."""
    mask = mask.astype(jnp.float32)
    _, cand = jax.lax.top_k(jax.lax.stop_gradient(logits), selector.top_k)
    cand, place, held = training_candidates(cand.astype(jnp.int32), target_ids)
    scores = selector.score_candidates(logits, hidden, predecessors, cand).astype(jnp.float32)
    logp = jax.nn.log_softmax(scores, axis=-1)
    ce = -jnp.take_along_axis(logp, place[..., None], axis=-1)[..., 0]
    if weighting == "dpace":
        w = dpace_weights(jnp.exp(-ce), mask, dpace_alpha)
    elif weighting == "decay":
        w = decay_weights(mask.shape[-1], gamma) * mask
    elif weighting == "uniform":
        w = mask
    else:
        raise ValueError(f"unknown slot weighting {weighting!r}")
    picked = jnp.argmax(scores, axis=-1) == place
    heldf = held.astype(jnp.float32) * mask
    return SelectorSums(num=jnp.sum(w * ce), correct=jnp.sum(picked * heldf), recalled=jnp.sum(heldf),
                        count=jnp.sum(mask))


def selector_metrics(sums: SelectorSums) -> dict[str, jax.Array]:
    return {
        "selector_acc": sums.correct / jnp.maximum(sums.recalled, 1.0),
        "candidate_recall": sums.recalled / jnp.maximum(sums.count, 1.0),
    }
