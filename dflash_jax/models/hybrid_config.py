"""Configs of hybrid linear-attention targets (Qwen3.5 / Qwen3.6, dense and MoE): Gated DeltaNet
layers interleaved with gated full-attention layers, read from HF ``config.json``.

Two nestings are accepted for each: ``model_type: qwen3_5_text`` / ``qwen3_5_moe_text`` (the language
model alone, weights under ``model.``) and ``qwen3_5`` / ``qwen3_5_moe`` (as published: a
vision-language checkpoint whose language model is ``text_config``, weights under
``model.language_model.``; the vision tower is ignored).

The MoE variant's every layer routes to ``num_experts`` experts (``moe_intermediate_size``; softmax
over all, top ``num_experts_per_tok``, always renormalised) and adds a shared expert gated by a
sigmoid; ``intermediate_size`` holds the shared expert's width (``shared_expert_intermediate_size``
in config.json, which has no dense MLP width).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_jax.models.config import (
    ModelConfigError,
    TargetConfig,
    _describe,
    _eos_ids,
    _field,
    _max_positions,
    _read_json,
    _shape_fields,
)

HYBRID_TARGETS = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
# The vision-language nesting's model_type -> its text_config's.
_TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LINEAR, FULL = "linear_attention", "full_attention"
# Older names transformers still maps onto the two layer kinds.
_LAYER_TYPE_ALIASES = {"mamba": LINEAR, "conv": LINEAR, "attention": FULL}


@dataclasses.dataclass(frozen=True)
class HybridTargetConfig(TargetConfig):
    """A ``TargetConfig`` (its head fields describe the full-attention layers, its expert fields the
    MoE variant's routed experts) plus the linear layers."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    weight_prefix: str = "model."  # "model.language_model." for the vision-language nesting

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head RoPE rotates (transformers: ``int(head_dim * factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v of every linear head."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim)

    def model_types(self) -> tuple[str, ...]:
        return HYBRID_TARGETS

    def validate_layer_types(self, source: str) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ModelConfigError(f"{source}: field 'layer_types' has {len(self.layer_types)} entries for "
                                   f"num_hidden_layers={self.num_layers}")
        bad = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        if bad:
            raise ModelConfigError(f"{source}: field 'layer_types' holds {bad}; only {LINEAR!r} and {FULL!r} "
                                   "are supported")

    def validate(self, source: str = "config") -> None:
        super().validate(source)
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{source}: field {name!r} must be positive, got {getattr(self, name)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelConfigError(
                f"{source}: linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}")
        rot = self.rotary_dim
        if not (0 < rot <= self.head_dim and rot % 2 == 0):
            raise ModelConfigError(
                f"{source}: partial_rotary_factor={self.partial_rotary_factor} gives {rot} rotary dims of "
                f"head_dim={self.head_dim}; they must be even and in (0, head_dim]")


def _layer_types(data: dict, source: str, num_layers: int) -> tuple[str, ...]:
    types = _field(data, "layer_types", source, list, None, nullable=True)
    if types is None:
        interval = _field(data, "full_attention_interval", source, int, 4, nullable=True)
        if interval <= 0:
            raise ModelConfigError(f"{source}: field 'full_attention_interval' must be > 0, got {interval}")
        return tuple(LINEAR if (i + 1) % interval else FULL for i in range(num_layers))
    for n, t in enumerate(types):
        if not isinstance(t, str):
            raise ModelConfigError(f"{source}: field 'layer_types[{n}]' must be a string, got {_describe(t)}")
    return tuple(_LAYER_TYPE_ALIASES.get(t, t) for t in types)


def _partial_rotary_factor(data: dict, source: str) -> float:
    params = data.get("rope_parameters") if isinstance(data.get("rope_parameters"), dict) else {}
    if "partial_rotary_factor" in params:
        return _field(params, "partial_rotary_factor", source, float, label="rope_parameters.partial_rotary_factor")
    return _field(data, "partial_rotary_factor", source, float, 0.25, nullable=True)


def hybrid_config_from_dict(data: dict[str, Any], source: str = "config.json") -> HybridTargetConfig:
    """A ``HybridTargetConfig`` from a ``qwen3_5`` or ``qwen3_5_text`` config.json object."""
    model_type = data.get("model_type")
    if model_type not in HYBRID_TARGETS:
        raise ModelConfigError(f"{source}: model_type {_describe(model_type)} is not a hybrid target "
                               f"(supported: {', '.join(HYBRID_TARGETS)})")
    outer, prefix = data, "model."
    if model_type in _TEXT_MODEL_TYPES:
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ModelConfigError(f"{source}: model_type {model_type!r} needs a 'text_config' object, got "
                                   f"{_describe(text)}")
        data, source, prefix = text, f"{source} (text_config)", "model.language_model."
        want = _TEXT_MODEL_TYPES[model_type]
        if text.get("model_type", want) != want:
            raise ModelConfigError(f"{source}: model_type {_describe(text.get('model_type'))} is not {want}")
    moe = _moe_fields(data, model_type, source)
    if moe:
        data = {**data, "intermediate_size": moe.pop("shared_expert_intermediate_size")}
    if _field(data, "attention_bias", source, bool, False, nullable=True):
        raise ModelConfigError(f"{source}: attention_bias=true is not supported for {model_type}")
    if "head_dim" not in data:  # transformers' default for this family, not hidden / heads
        data = {**data, "head_dim": 256}
    shape = _shape_fields(data, source, qk_norm=True)
    # A vision-language checkpoint ties (or not) at its top level; the text config's own flag
    # describes the language model alone.
    tie_from = outer if "tie_word_embeddings" in outer else data
    eos = _eos_ids(data, source) or _eos_ids(outer, source)
    cfg = HybridTargetConfig(
        **shape,
        **moe,
        model_type=model_type,
        tie_word_embeddings=_field(tie_from, "tie_word_embeddings", source, bool, False, nullable=True),
        max_position_embeddings=_max_positions(data, source),
        eos_token_ids=eos,
        layer_types=_layer_types(data, source, shape["num_layers"]),
        linear_num_key_heads=_field(data, "linear_num_key_heads", source, int, 16),
        linear_num_value_heads=_field(data, "linear_num_value_heads", source, int, 32),
        linear_key_head_dim=_field(data, "linear_key_head_dim", source, int, 128),
        linear_value_head_dim=_field(data, "linear_value_head_dim", source, int, 128),
        linear_conv_kernel_dim=_field(data, "linear_conv_kernel_dim", source, int, 4),
        partial_rotary_factor=_partial_rotary_factor(data, source),
        weight_prefix=prefix,
    )
    cfg.validate(source)
    return cfg


def _moe_fields(data: dict, model_type: str, source: str) -> dict[str, Any]:
    """The expert fields of a ``qwen3_5_moe(_text)`` config (none for the dense variant)."""
    if "moe" not in model_type:
        return {}
    out = {name: _field(data, name, source, int)
           for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "shared_expert_intermediate_size")}
    for name, value in out.items():
        if value <= 0:
            raise ModelConfigError(f"{source}: field {name!r} must be positive, got {value}")
    # transformers' router always renormalises the top-k probabilities (no norm_topk_prob field).
    return dict(out, norm_topk_prob=True)


def is_hybrid_config(data: dict[str, Any]) -> bool:
    return data.get("model_type") in HYBRID_TARGETS


def load_hybrid_config(directory) -> HybridTargetConfig:
    from pathlib import Path

    path = Path(directory) / "config.json"
    return hybrid_config_from_dict(_read_json(path), str(path))
