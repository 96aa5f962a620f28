"""The jitted DFlash training step.

One micro-step:

1. the frozen target runs causally over the batch (no gradient): taps at the drafter's
   ``target_layer_ids`` (+ its logits when distilling). By default its decoder layers are stacked
   once (``split_target``) and run under ``lax.scan`` up to the deepest tap (all of them, and the
   head, only when distilling): one compiled layer body instead of 36 unrolled ones;
2. anchors are re-sampled (``fold_in(seed, micro_step)``: identical after a resume);
3. the drafter projects the taps of the whole sequence into context K/V once, then drafts every
   anchor block at once (each block sees context strictly before its anchor plus itself);
4. draft logits come from the TARGET's LM head (shared, frozen: not copied into the drafter),
   optionally in chunks of anchor blocks under ``jax.checkpoint`` so that only one chunk of
   ``[blocks, B, vocab]`` logits is alive at a time;
5. the loss's gradient w.r.t. the drafter's float32 master weights (compute in ``compute_dtype``)
   goes through optax (AdamW + warmup/cosine + clipping, ``MultiSteps`` accumulation).

Everything is a pure function of ``(TrainState, target_params, batch)``; the NNX modules are
``nnx.merge``d inside from their graph definitions (``target_params`` and its graph come from
``split_target``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dflash_jax.ops.config import XLA, OpsConfig
from dflash_jax.models.hybrid import HybridTarget
from dflash_jax.models.target import (ScanGraph, ScanParams, Target, layers_stackable, scanned_forward,
                                      stack_layers)
from dflash_jax.training import anchors as anc
from dflash_jax.models.dflash2 import DFlash2Drafter
from dflash_jax.training.dflash2_loss import predecessor_ids, selector_metrics, selector_sums
from dflash_jax.training.losses import finalize, loss_sums
from dflash_jax.training.optim import global_norm

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


class TrainState(NamedTuple):
    params: Any  # nnx.State of the drafter's nnx.Param leaves, float32
    opt_state: Any
    step: jax.Array  # int32 micro-steps taken (optimizer steps = step // grad_accum)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The static settings of a train step."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_anchors: int
    kind: str = "ce"
    weighting: str = "decay"
    gamma: float = 7.0
    dpace_alpha: float = 0.5
    loss_chunk: int = 0
    compute_dtype: Any = jnp.bfloat16
    ops: OpsConfig = XLA
    seed: int = 0
    normalizer: str = "weights"  # "weights": as ``losses``; "slots": the number of supervised slots
    selector_alpha: float = 1.0  # DFlash2: the selector loss's weight


def split_drafter(drafter: nnx.Module):
    """``(graphdef, params, rest)``: trainable ``nnx.Param`` leaves and the static remainder."""
    return nnx.split(drafter, nnx.Param, ...)


def merge_drafter(graphdef, params, rest, dtype=None) -> nnx.Module:
    if dtype is not None:
        params = jax.tree.map(lambda p: p.astype(dtype), params)
    return nnx.merge(graphdef, params, rest)


def init_state(params, tx: optax.GradientTransformation) -> TrainState:
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32))


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """``[batch, blocks, ...]`` -> ``[blocks // chunk, batch, chunk, ...]``."""
    b, n = x.shape[:2]
    return jnp.moveaxis(x.reshape((b, n // chunk, chunk) + x.shape[2:]), 1, 0)


class _Forward(NamedTuple):
    taps: jax.Array
    teacher_logits: jax.Array | None


TargetGraph = ScanGraph | nnx.GraphDef
TargetParams = ScanParams | nnx.State


def split_target(target: Target, *, scan: bool = True) -> tuple[TargetGraph, TargetParams]:
    """The frozen target as ``(graph, params)`` for ``make_train_step``.

    ``scan=True``: the decoder layers stacked once (``target.stack_layers``; a copy, so drop
    ``target`` afterwards) and run under ``lax.scan``; ``scan=False``: the plain ``nnx.split``,
    layers unrolled in the step (kept for comparisons: it compiles far more slowly at 36 layers).
    A target whose layers differ in shape (``layers_stackable``) is split unrolled.
    """
    # A hybrid target's layers differ in kind (linear or full attention): they stay unrolled.
    stackable = not isinstance(target, HybridTarget) and layers_stackable(target)
    return stack_layers(target) if scan and stackable else nnx.split(target)


def target_shell(graph: TargetGraph, params: TargetParams) -> Target:
    """The target module whose embedding and LM head the drafter shares (inside the step)."""
    if isinstance(graph, ScanGraph):
        return nnx.merge(graph.shell, params.shell)
    return nnx.merge(graph, params)


def target_forward(graph: TargetGraph, params: TargetParams, ids: jax.Array, spec: StepSpec) -> _Forward:
    """Taps ``[batch, seq, n_taps * hidden]`` (and the logits when distilling), no gradient."""
    distill = spec.kind != "ce"
    # The target's block is the whole sequence (as in prefill): with the kernels on (``spec.ops``)
    # it takes a library flash attention (``attention.prompt_attention``), the drafter's the kernel.
    if isinstance(graph, ScanGraph):
        logits, taps = scanned_forward(graph, params, ids, tap_layers=spec.target_layer_ids, logits=distill,
                                       ops=spec.ops)
    else:
        logits, taps = nnx.merge(graph, params).forward(ids, tap_layers=spec.target_layer_ids, ops=spec.ops)
    teacher = jax.lax.stop_gradient(logits) if distill else None
    return _Forward(jax.lax.stop_gradient(taps), teacher)


def anchor_block_hidden(drafter, target, block_ids, positions, ctx_lens, blk_lens, taps, spec: StepSpec) -> jax.Array:
    """The drafter's final hidden ``[batch, blocks, B, hidden]`` for all anchor blocks at once: the
    taps of the whole sequence projected to context K/V once, each block seeing ``ctx_lens``."""
    b, seq = taps.shape[:2]
    embeds = jax.lax.stop_gradient(target.embed(block_ids)).astype(spec.compute_dtype)
    ctx_pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
    k_ctx, v_ctx = drafter.context_kv(taps.astype(spec.compute_dtype), ctx_pos)
    return drafter(embeds, positions, k_ctx, v_ctx, ctx_lens, blk_lens, ops=spec.ops)


def drafter_loss(
    params,
    drafter_graphdef,
    drafter_rest,
    target: nnx.Module,
    batch: dict[str, jax.Array],
    fwd: _Forward,
    key: jax.Array,
    spec: StepSpec,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss of the drafter ``params`` on one batch (the target's outputs already computed)."""
    anchors, valid = anc.sample_anchors(key, batch["loss_mask"], spec.block_size, spec.num_anchors)
    return anchored_loss(params, drafter_graphdef, drafter_rest, target, batch, fwd, anchors, valid, spec)


def anchored_loss(
    params, drafter_graphdef, drafter_rest, target: nnx.Module, batch: dict[str, jax.Array], fwd: _Forward,
    anchors: jax.Array, valid: jax.Array, spec: StepSpec,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``drafter_loss`` with the anchors given: ``anchors, valid [batch, num_anchors]``."""
    ids = batch["input_ids"]
    loss_mask = batch["loss_mask"]
    segment_ids = batch.get("segment_ids")
    b, seq = ids.shape
    B = spec.block_size
    labels, lmask = anc.block_labels(ids, loss_mask, segment_ids, anchors, valid, B)
    block_ids = anc.block_token_ids(ids, anchors, valid, B, spec.mask_token_id)
    positions = anc.block_positions(anchors, B)
    ctx_lens, blk_lens = anc.attention_lengths(anchors, valid, B)

    drafter = merge_drafter(drafter_graphdef, params, drafter_rest, spec.compute_dtype)
    hidden = anchor_block_hidden(drafter, target, block_ids, positions, ctx_lens, blk_lens, fwd.taps, spec)
    dflash2 = isinstance(drafter, DFlash2Drafter)
    preds = predecessor_ids(ids, anchors, B) if dflash2 else None

    teacher_pos = anc.teacher_positions(anchors, B) if fwd.teacher_logits is not None else None

    def chunk_sums(h, lab, m, tpos, pred):
        logits = drafter.logits(target, h)
        teacher = None
        if tpos is not None:
            bb, nn_, BB = tpos.shape
            flat = tpos.reshape(bb, nn_ * BB)
            teacher = jnp.take_along_axis(fwd.teacher_logits, flat[..., None], axis=1)
            teacher = teacher.reshape(bb, nn_, BB, -1)
        sums = loss_sums(
            logits, lab, m, kind=spec.kind, weighting=spec.weighting, gamma=spec.gamma,
            dpace_alpha=spec.dpace_alpha, teacher_logits=teacher,
        )
        if pred is None:
            return sums, None
        # The selector's target: the unary loss's (the target's argmax when distilling).
        goal = lab if teacher is None else jnp.argmax(teacher, axis=-1).astype(jnp.int32)
        return sums, selector_sums(drafter.candidate_selector, logits, h, pred, goal, m, weighting=spec.weighting,
                                   gamma=spec.gamma, dpace_alpha=spec.dpace_alpha)

    n = anchors.shape[1]
    if spec.loss_chunk and spec.loss_chunk < n:
        c = spec.loss_chunk
        if n % c:
            raise ValueError(f"loss.loss_chunk={c} must divide loss.num_anchors={n}")
        xs = tuple(_chunks(a, c) if a is not None else None for a in (hidden, labels, lmask, teacher_pos, preds))

        @jax.checkpoint
        def body(carry, x):
            return jax.tree.map(jnp.add, carry, chunk_sums(*x)), None

        zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(chunk_sums, *(a[0] if a is not None else None for a in xs)))
        (sums, sel), _ = jax.lax.scan(body, zero, xs)
    else:
        sums, sel = chunk_sums(hidden, labels, lmask, teacher_pos, preds)
    if spec.normalizer == "slots":
        sums = sums._replace(den=jnp.sum(sums.count))
    unary = sums.num / jnp.maximum(sums.den, 1e-6)
    if sel is not None:
        sums = sums._replace(num=sums.num + spec.selector_alpha * sel.num)
    loss, metrics = finalize(sums)
    if sel is not None:
        metrics.update(selector_metrics(sel), unary_loss=unary, selector_loss=sel.num / jnp.maximum(sums.den, 1e-6))
    metrics["valid_anchors"] = jnp.sum(valid.astype(jnp.float32)) / b
    return loss, metrics


def make_train_step(drafter_graphdef, drafter_rest, target_graph: TargetGraph, tx: optax.GradientTransformation,
                    spec: StepSpec):
    """``step(state, target_params, batch) -> (state, metrics)``, not yet jitted; ``target_graph``
    and ``target_params`` from ``split_target``."""

    def step(state: TrainState, target_params: TargetParams, batch):
        target = target_shell(target_graph, target_params)
        fwd = target_forward(target_graph, target_params, batch["input_ids"], spec)
        key = jax.random.fold_in(jax.random.key(spec.seed), state.step)
        grad_fn = jax.value_and_grad(drafter_loss, has_aux=True)
        (loss, metrics), grads = grad_fn(
            state.params, drafter_graphdef, drafter_rest, target, batch, fwd, key, spec
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["grad_norm"] = global_norm(grads)
        return TrainState(params, opt_state, state.step + 1), metrics

    return step


def make_eval_loss(drafter_graphdef, drafter_rest, target_graph: TargetGraph, spec: StepSpec):
    """``loss(params, target_params, batch, step) -> metrics`` without an update (for checks/notebooks)."""

    def fn(params, target_params: TargetParams, batch, step):
        target = target_shell(target_graph, target_params)
        fwd = target_forward(target_graph, target_params, batch["input_ids"], spec)
        key = jax.random.fold_in(jax.random.key(spec.seed), step)
        _, metrics = drafter_loss(params, drafter_graphdef, drafter_rest, target, batch, fwd, key, spec)
        return metrics

    return fn
