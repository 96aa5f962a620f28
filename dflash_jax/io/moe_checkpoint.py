"""Checkpoint names and layouts of mixture-of-experts weights (``models.moe.Experts``).

Layouts a user meets, all read; the writer picks the one transformers' ``save_pretrained`` writes:

- Qwen3-MoE (and Qwen3.5-MoE, whose experts are laid out alike: every family but gpt-oss), hub layout (what the published checkpoints and ``save_pretrained`` hold): one tensor per
  expert and projection, ``mlp.experts.{e}.gate_proj.weight [inter, hidden]``, ``up_proj``,
  ``down_proj [hidden, inter]``;
- Qwen3-MoE, transformers' fused in-memory layout: ``mlp.experts.gate_up_proj [E, 2 * inter,
  hidden]`` (gate rows, then up rows) and ``mlp.experts.down_proj [E, hidden, inter]``;
- gpt-oss: fused and inputs-first, ``mlp.experts.gate_up_proj [E, hidden, 2 * inter]`` (gate, up
  interleaved), ``down_proj [E, inter, hidden]``, their ``*_bias``; or MXFP4, ``*_blocks [E, out,
  in / 32, 16]`` and ``*_scales [E, out, in / 32]`` uint8, kept as they are.

Ours: ``gate_up_proj [E, hidden, 2 * inter]``, ``down_proj [E, inter, hidden]`` (float), the MXFP4
tensors as stored.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from dflash_jax.models.config import TargetConfig

EXPERT_LEAVES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", "gate_up_proj_blocks",
                 "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
INTEGER_LEAVES = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")

# read(name, torch_shape) -> the checked tensor (its shape, dtype and file checked by the caller)
Read = Callable[[str, tuple[int, ...]], jax.Array]


def is_expert_param(keys: list[str]) -> bool:
    return len(keys) >= 2 and keys[-2] == "experts" and keys[-1] in EXPERT_LEAVES


def _qwen_experts(config: TargetConfig) -> bool:
    """Whether the experts are laid out as Qwen3-MoE's (every family but gpt-oss)."""
    return config.model_type != "gpt_oss"


def _per_expert_layout(config: TargetConfig, name: str, has: Callable[[str], bool]) -> bool:
    return _qwen_experts(config) and not has(name) and has(name.rsplit(".", 1)[0] + ".0.gate_proj.weight")


def read_expert_param(config: TargetConfig, name: str, shape: tuple[int, ...], read: Read,
                      has: Callable[[str], bool]) -> jax.Array:
    """Our expert parameter ``name`` (``model.layers.{i}.mlp.experts.<leaf>``, of our ``shape``) from
    whichever layout the checkpoint holds."""
    leaf = name.rsplit(".", 1)[1]
    if not _qwen_experts(config) or leaf not in ("gate_up_proj", "down_proj"):
        return read(name, shape)  # gpt-oss: stored as we hold it
    e = shape[0]
    base = name.rsplit(".", 1)[0]
    if _per_expert_layout(config, name, has):
        if leaf == "gate_up_proj":
            hidden, inter = shape[1], shape[2] // 2
            return jnp.stack([jnp.concatenate([read(f"{base}.{i}.gate_proj.weight", (inter, hidden)).T,
                                               read(f"{base}.{i}.up_proj.weight", (inter, hidden)).T], axis=-1)
                              for i in range(e)])
        inter, hidden = shape[1], shape[2]
        return jnp.stack([read(f"{base}.{i}.down_proj.weight", (hidden, inter)).T for i in range(e)])
    return jnp.swapaxes(read(name, (shape[0], shape[2], shape[1])), 1, 2)  # fused: outputs first


def expected_names(config: TargetConfig, name: str, shape: tuple[int, ...], has: Callable[[str], bool]) -> list[str]:
    """The checkpoint tensors ``read_expert_param`` would read (for the missing-tensor error)."""
    if _per_expert_layout(config, name, has):
        base, leaf = name.rsplit(".", 1)
        projs = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
        return [f"{base}.{i}.{p}.weight" for i in range(shape[0]) for p in projs]
    return [name]


def expert_tensors(config: TargetConfig, name: str, value: jax.Array) -> dict[str, jax.Array]:
    """Our expert parameter ``name`` as the tensors ``save_pretrained`` writes (Qwen3-MoE: per expert)."""
    leaf = name.rsplit(".", 1)[1]
    if not _qwen_experts(config) or leaf not in ("gate_up_proj", "down_proj"):
        return {name: value}
    base = name.rsplit(".", 1)[0]
    if leaf == "down_proj":
        return {f"{base}.{i}.down_proj.weight": value[i].T for i in range(value.shape[0])}
    inter = value.shape[2] // 2
    out = {}
    for i in range(value.shape[0]):
        out[f"{base}.{i}.gate_proj.weight"] = value[i, :, :inter].T
        out[f"{base}.{i}.up_proj.weight"] = value[i, :, inter:].T
    return out
