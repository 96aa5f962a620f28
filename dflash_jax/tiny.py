"""Tiny random targets and drafters for tests, self-checks and cost benchmarks.

Models are built by our own modules with random weights and written in HF / z-lab format, so every
test goes through the real loaders and the references read exactly the same files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.io.checkpoint import save_drafter, save_target
from dflash_jax.models.dflash2 import DFlash2Config, DFlash2Drafter
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.config import (DrafterConfig, ModelConfigError, TargetConfig, default_target_layer_ids,
                                      freeze_rope_scaling)
from dflash_jax.models.target import Target


def tiny_target_config(model_type: str = "qwen3", **overrides) -> TargetConfig:
    base = dict(
        model_type=model_type, vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        qk_norm=model_type == "qwen3", tie_word_embeddings=False, max_position_embeddings=2048,
    )
    if model_type == "qwen3_moe":  # an odd expert count, top-2, a dense layer among sparse ones
        base.update(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                    mlp_only_layers=(1,), qk_norm=True)
    if model_type == "gpt_oss":  # sliding (window 6) and full layers, sinks, biases, YaRN, top-2 of 5
        base.update(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=64, qk_norm=False,
                    attention_bias=True, sliding_window=6, attention_sinks=True, rms_norm_eps=1e-5,
                    rope_theta=150000.0, rope_scaling=freeze_rope_scaling({
                        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "original_max_position_embeddings": 64, "truncate": False}))
        layers = overrides.get("num_layers", base["num_layers"])
        base["layer_types"] = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
    if model_type == "llama":
        base["rope_scaling"] = freeze_rope_scaling({
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        })
        base["rope_theta"] = 500000.0
    base.update(overrides)
    return TargetConfig(**base)


def tiny_taps(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The target layers a tiny drafter taps by default: the published rule where the target is deep
    enough for it; a shallower target (tests run 2-layer ones: every compiled program holds each layer)
    has every one of its layers tapped, in order."""
    try:
        return default_target_layer_ids(num_target_layers, num_draft_layers)
    except ModelConfigError:
        return tuple(range(num_target_layers))


def tiny_drafter_config(target: TargetConfig, *, num_layers: int = 2, block_size: int = 8,
                        mask_token_id: int | None = None, target_layer_ids=None, **overrides) -> DrafterConfig:
    """A drafter config for ``target``'s dimensions; ``target_layer_ids`` None: ``tiny_taps``."""
    ids = tuple(target_layer_ids) if target_layer_ids is not None else tiny_taps(target.num_layers, num_layers)
    base = dict(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_layers=num_layers, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling, qk_norm=True, block_size=block_size,
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=ids, num_target_layers=target.num_layers,
        max_position_embeddings=target.max_position_embeddings,
    )
    base.update(overrides)
    return DrafterConfig(**base)


def _scale_params(module: nnx.Module, std: float, seed: int) -> None:
    """Re-draws every matrix with ``std`` (norm weights around 1) so logits are far from uniform."""
    key = jax.random.key(seed)
    state = nnx.state(module, nnx.Param)
    flat = nnx.to_flat_state(state)
    new = []
    for i, (path, var) in enumerate(flat):
        value = var.get_value()
        k = jax.random.fold_in(key, i)
        if jnp.issubdtype(value.dtype, jnp.integer):  # MXFP4 experts: drawn at construction
            continue
        if "weight" == str(path[-1]):  # RMSNorm
            fresh = 1.0 + 0.1 * jax.random.normal(k, value.shape)
        elif str(path[-1]).endswith("bias"):
            fresh = 0.1 * jax.random.normal(k, value.shape)
        else:
            fresh = std * jax.random.normal(k, value.shape)
        new.append((path, var.replace(fresh.astype(value.dtype))))
    nnx.update(module, nnx.from_flat_state(new))


def random_target(config: TargetConfig, *, seed: int = 0, std: float = 0.2, dtype=jnp.float32) -> Target:
    target = Target(config, dtype=dtype, rngs=nnx.Rngs(seed))
    _scale_params(target, std, seed)
    return target


def tiny_dflash2_config(target: TargetConfig, *, selector_rank: int = 8, selector_top_k: int = 4,
                        conv_kernel_size: int = 2, conv_group_size: int = 16, **overrides) -> DFlash2Config:
    """``tiny_drafter_config``'s drafter as a DFlash2 drafter (a small selector; 4 conv groups)."""
    base = tiny_drafter_config(target, **overrides)
    return DFlash2Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                         selector_rank=selector_rank, selector_top_k=selector_top_k,
                         conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size)


def random_drafter(config: DrafterConfig, *, seed: int = 1, std: float = 0.2, dtype=jnp.float32) -> Drafter:
    """Random weights (a DFlash2 config: random convolution kernels and selector too)."""
    cls = DFlash2Drafter if isinstance(config, DFlash2Config) else Drafter
    drafter = cls(config, dtype=dtype, rngs=nnx.Rngs(seed))
    _scale_params(drafter, std, seed)
    return drafter


def write_tiny_pair(
    directory: str | Path,
    *,
    model_type: str = "qwen3",
    target_overrides: dict | None = None,
    drafter_overrides: dict | None = None,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Writes a tiny random target (``directory/target``) and drafter (``directory/drafter``)."""
    directory = Path(directory)
    tcfg = tiny_target_config(model_type, **(target_overrides or {}))
    dcfg = tiny_drafter_config(tcfg, **(drafter_overrides or {}))
    target_dir, drafter_dir = directory / "target", directory / "drafter"
    save_target(random_target(tcfg, seed=seed), target_dir)
    save_drafter(random_drafter(dcfg, seed=seed + 1), drafter_dir)
    return target_dir, drafter_dir


def write_copycat_pair(directory: str | Path, *, noise: float = 0.35, block_size: int = 8,
                       model_type: str = "qwen3", seed: int = 0, shape: dict | None = None,
                       drafter_layers: int = 2, target_layer_ids: tuple[int, ...] | None = None) -> tuple[Path, Path]:
    """A tiny pair with real, varied acceptance lengths and no training.

    The target's layers are small noise around the identity and its LM head is its embedding table,
    so it mostly repeats the last token and sometimes moves on. The mask token's embedding is zero
    and the drafter's fc is zero, so every mask slot attends uniformly and, through identity V/O
    projections, carries only the anchor: the drafter proposes "repeat the anchor" for the whole
    block. Acceptance then measures how long the target keeps repeating.

    ``shape``: the target's dimensions over the defaults; ``target_layer_ids``: the drafter's taps
    (None: ``tiny_taps``). The taps change no token: the drafter's fc is zero.
    """
    directory = Path(directory)
    dims = dict(num_heads=4, num_kv_heads=4, head_dim=16, num_layers=4)
    dims.update(shape or {})
    tcfg = tiny_target_config(model_type, **dims)
    if tcfg.num_kv_heads * tcfg.head_dim != tcfg.hidden_size or tcfg.num_heads != tcfg.num_kv_heads:
        raise ValueError("the copycat drafter needs num_heads == num_kv_heads and heads * head_dim == hidden")
    dcfg = tiny_drafter_config(tcfg, num_layers=drafter_layers, block_size=block_size,
                               mask_token_id=tcfg.vocab_size - 1, target_layer_ids=target_layer_ids)
    target = random_target(tcfg, seed=seed, std=noise * (64 / tcfg.hidden_size) ** 0.5)
    key = jax.random.key(seed + 100)
    table = jax.random.normal(key, (tcfg.vocab_size, tcfg.hidden_size)).at[dcfg.mask_token_id].set(0.0)
    target.embed_tokens[...] = table
    target.lm_head[...] = table.T
    for layer in target.layers:
        layer.input_layernorm.weight[...] = jnp.ones_like(layer.input_layernorm.weight[...])
        layer.post_attention_layernorm.weight[...] = jnp.ones_like(layer.post_attention_layernorm.weight[...])
    target.norm.weight[...] = jnp.ones_like(target.norm.weight[...])

    drafter = random_drafter(dcfg, seed=seed + 1, std=0.2)
    drafter.fc[...] = jnp.zeros_like(drafter.fc[...])
    eye = jnp.eye(dcfg.hidden_size)
    for layer in drafter.layers:
        attn = layer.self_attn
        attn.v_proj[...] = eye.reshape(dcfg.hidden_size, dcfg.num_kv_heads, dcfg.head_dim)
        attn.o_proj[...] = eye.reshape(dcfg.num_heads, dcfg.head_dim, dcfg.hidden_size)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name)[...] = jnp.zeros_like(getattr(layer.mlp, name)[...])
    target_dir, drafter_dir = directory / "target", directory / "drafter"
    save_target(target, target_dir)
    save_drafter(drafter, drafter_dir)
    return target_dir, drafter_dir
