"""The optimizer of the published recipe: AdamW, linear warmup then cosine, global-norm clipping,
gradient accumulation through ``optax.MultiSteps``. Master weights stay float32."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from dflash_jax.training.config import OptimConfig


def lr_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    """Warmup over ``ceil(warmup_ratio * steps)`` optimizer steps from 0, then cosine to ``lr * min_lr_ratio``."""
    warmup = max(1, math.ceil(config.warmup_ratio * total_steps)) if config.warmup_ratio > 0 else 0
    decay = max(total_steps, warmup + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else config.lr,
        peak_value=config.lr,
        warmup_steps=warmup,
        decay_steps=decay,
        end_value=config.lr * config.min_lr_ratio,
    )


def global_norm(tree) -> jax.Array:
    """The gradients' global L2 norm (the training logs' ``grad_norm``), summed in float32 whatever the
    leaves' dtype: bf16 sums of squares over millions of elements lose the norm's digits."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _decay_mask(params):
    """Weight decay on matrices only (not on norm weights)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    inner = optax.chain(
        optax.clip_by_global_norm(config.clip_norm) if config.clip_norm > 0 else optax.identity(),
        optax.adamw(
            lr_schedule(config, total_steps),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=_decay_mask,
        ),
    )
    if config.grad_accum > 1:
        return optax.MultiSteps(inner, every_k_schedule=config.grad_accum)
    return inner
