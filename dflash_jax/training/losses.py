"""Per-slot losses, slot weights and acceptance metrics of DFlash training.

Shapes: ``logits [..., B, vocab]`` (slot k of a block predicts the token at ``anchor + k``),
``labels / label_mask [..., B]`` (slot 0 always masked). All reductions are written as additive
sums (``LossSums``) so that the head + loss can be computed over chunks of anchor blocks and
combined exactly.

Slot weights (the published recipe):

- ``decay``: ``w_k = exp(-(k - 1) / gamma)`` for k >= 1; the loss is the weighted mean
  ``sum(w * m * l) / sum(w * m)`` over all supervised slots.
- ``dpace``: per block, ``q_i = exp(-CE_i)`` (the drafter's probability of the label),
  ``q~_i = (1 - alpha) q_i + alpha``, ``w_j = sum_{m >= j} prod_{i <= m} q~_i`` with masked slots
  neutral in the products (``q~ = 1``) and excluded from the sums; weights are stop-gradient. The
  loss is ``sum(w * m * l)`` divided by the number of blocks with at least one supervised slot.
- ``uniform``: all supervised slots weigh 1 (weighted mean).

Per-slot loss ``l``: cross-entropy on the label (``ce``), or distillation from the target's
logits at ``anchor + k - 1``: ``kl`` = KL(p_target || p_draft), ``soft_ce`` = -sum p_target log p_draft
(same gradient).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LossSums(NamedTuple):
    num: jax.Array  # sum of weighted per-slot losses
    den: jax.Array  # the normaliser (sum of weights, or number of supervised blocks)
    correct: jax.Array  # [B] argmax == label on supervised slots
    count: jax.Array  # [B] supervised slots
    ce: jax.Array  # [B] summed hard-label CE on supervised slots (a metric for every loss kind)
    accept: jax.Array  # sum over full blocks of the teacher-forced accepted length (1 + leading correct)
    full_blocks: jax.Array  # number of blocks whose slots 1..B-1 are all supervised

    def __add__(self, other: "LossSums") -> "LossSums":  # type: ignore[override]
        return LossSums(*(a + b for a, b in zip(self, other)))


def decay_weights(block_size: int, gamma: float) -> jax.Array:
    """``[B]``: 0 for slot 0, ``exp(-(k - 1) / gamma)`` for slot k >= 1."""
    k = jnp.arange(block_size, dtype=jnp.float32)
    return jnp.where(k >= 1, jnp.exp(-(k - 1.0) / gamma), 0.0)


def dpace_weights(q: jax.Array, mask: jax.Array, alpha: float) -> jax.Array:
    """``[..., B]`` D-PACE weights from ``q`` (prob. of the label) and the 0/1 ``mask``; detached."""
    q = jax.lax.stop_gradient(q.astype(jnp.float32))
    mask = mask.astype(jnp.float32)
    smooth = jnp.where(mask > 0, (1.0 - alpha) * q + alpha, 1.0)
    prefix = jnp.cumprod(smooth, axis=-1)
    contrib = prefix * mask
    suffix = jnp.flip(jnp.cumsum(jnp.flip(contrib, -1), axis=-1), -1)
    return jax.lax.stop_gradient(suffix * mask)


def label_ce(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(ce, logp_all)``: float32 hard-label cross-entropy ``[..., B]`` and log-softmax ``[..., B, V]``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return ce, logp


def distill_per_slot(logp: jax.Array, teacher_logits: jax.Array, kind: str) -> jax.Array:
    """``[..., B]`` distillation loss of the draft log-probs against the teacher's logits."""
    t_logp = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32), axis=-1)
    t_p = jnp.exp(t_logp)
    soft_ce = -jnp.sum(t_p * logp, axis=-1)
    if kind == "soft_ce":
        return soft_ce
    if kind == "kl":
        return soft_ce + jnp.sum(t_p * t_logp, axis=-1)
    raise ValueError(f"unknown distillation kind {kind!r}")


def loss_sums(
    logits: jax.Array,
    labels: jax.Array,
    mask: jax.Array,
    *,
    kind: str = "ce",
    weighting: str = "decay",
    gamma: float = 7.0,
    dpace_alpha: float = 0.5,
    teacher_logits: jax.Array | None = None,
) -> LossSums:
    """The additive loss and metric sums of a set of blocks (see the module docstring)."""
    block_size = labels.shape[-1]
    mask = mask.astype(jnp.float32)
    ce, logp = label_ce(logits, labels)
    if kind == "ce":
        per_slot = ce
    else:
        if teacher_logits is None:
            raise ValueError(f"loss kind {kind!r} needs the target's logits")
        per_slot = distill_per_slot(logp, teacher_logits, kind)

    lead = tuple(range(mask.ndim - 1))
    if weighting == "dpace":
        w = dpace_weights(jnp.exp(-ce), mask, dpace_alpha)
        num = jnp.sum(w * per_slot)
        den = jnp.sum(jnp.any(mask > 0, axis=-1).astype(jnp.float32))
    else:
        if weighting == "decay":
            w = decay_weights(block_size, gamma) * mask
        elif weighting == "uniform":
            w = mask
        else:
            raise ValueError(f"unknown slot weighting {weighting!r}")
        num = jnp.sum(w * per_slot)
        den = jnp.sum(w)

    pred = jnp.argmax(logits, axis=-1)
    hit = (pred == labels).astype(jnp.float32) * mask
    correct = jnp.sum(hit, axis=lead)
    count = jnp.sum(mask, axis=lead)
    ce_sum = jnp.sum(jax.lax.stop_gradient(ce) * mask, axis=lead)
    full = jnp.all(mask[..., 1:] > 0, axis=-1).astype(jnp.float32)
    leading = jnp.sum(jnp.cumprod(hit[..., 1:], axis=-1), axis=-1)
    accept = jnp.sum(full * (1.0 + leading))
    return LossSums(
        num=num,
        den=den,
        correct=correct,
        count=count,
        ce=ce_sum,
        accept=accept,
        full_blocks=jnp.sum(full),
    )


def finalize(sums: LossSums) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss, metrics)`` from (possibly accumulated) sums."""
    loss = sums.num / jnp.maximum(sums.den, 1e-6)
    acc = sums.correct / jnp.maximum(sums.count, 1.0)
    metrics = {
        "loss": loss,
        "slot_acc": acc,  # [B], slot 0 meaningless (never supervised)
        "slot_ce": sums.ce / jnp.maximum(sums.count, 1.0),
        "acc1": acc[1],
        "tau_slots": expected_acceptance(acc),
        "tau_blocks": sums.accept / jnp.maximum(sums.full_blocks, 1.0),
        "supervised": jnp.sum(sums.count),
    }
    return loss, metrics


def expected_acceptance(slot_acc: jax.Array) -> jax.Array:
    """``1 + sum_{k >= 1} prod_{1 <= i <= k} acc_i``: the acceptance length implied by per-slot accuracies."""
    return 1.0 + jnp.sum(jnp.cumprod(slot_acc[1:]))
