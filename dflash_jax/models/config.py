"""Model configs read from HF ``config.json`` files (targets) and z-lab DFlash drafter configs.

Both styles found in the wild are accepted: top-level ``rope_theta`` / ``rope_scaling`` and
transformers-5 ``rope_parameters``. Errors name the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_TARGETS = ("qwen3", "llama")


class ModelConfigError(ValueError):
    """A model config.json is unsupported or malformed; the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """What a stack of decoder layers needs (shared by targets and drafters)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # sorted items: hashable, jit-static
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = True

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    def validate(self, source: str = "config") -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{source}: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"{source}: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"{source}: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ModelConfigError(f"{source}: rms_norm_eps must be > 0, got {self.rms_norm_eps}")


@dataclasses.dataclass(frozen=True)
class TargetConfig(TransformerShape):
    model_type: str = "qwen3"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    eos_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class DrafterConfig(TransformerShape):
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] = ()
    num_target_layers: int = 0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    causal: bool = False
    max_position_embeddings: int = 40960

    def validate(self, source: str = "config") -> None:
        super().validate(source)
        if self.block_size < 2:
            raise ModelConfigError(f"{source}: block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ModelConfigError(
                f"{source}: dflash_config.mask_token_id={self.mask_token_id} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        if not self.target_layer_ids:
            raise ModelConfigError(f"{source}: target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ModelConfigError(
                f"{source}: target_layer_ids {bad} outside [0, num_target_layers={self.num_target_layers})"
            )


def freeze_rope_scaling(scaling: dict | tuple | None) -> tuple | None:
    """RoPE scaling as sorted items, so configs stay hashable (they are static under jit)."""
    if scaling is None:
        return None
    items = scaling.items() if isinstance(scaling, dict) else scaling
    return tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in items))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The published rule, used only when a drafter config lists no ``target_layer_ids``."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = (num_target_layers - 3) - 1
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path}: not found") from None
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{path}: invalid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: the top level must be an object")
    return data


def _field(data: dict, name: str, source: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
    if name not in data or data[name] is None:
        if default is dataclasses.MISSING:
            raise ModelConfigError(f"{source}: missing field {name!r}")
        return default
    value = data[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ModelConfigError(f"{source}: field {name!r} must be {kind.__name__}, got {value!r}")
    return value


def _rope(data: dict, source: str) -> tuple[float, dict | None]:
    params = data.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5
        theta = float(params.get("rope_theta", data.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind == "default" else dict(params)
    else:
        theta = float(data.get("rope_theta", 10000.0))
        scaling = data.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ModelConfigError(f"{source}: rope_scaling must be an object or null")
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("linear", "llama3"):
            raise ModelConfigError(f"{source}: rope type {kind!r} is not supported (default, linear, llama3)")
        need = ["factor"] + (["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
                             if kind == "llama3" else [])
        for key in need:
            if key not in scaling:
                raise ModelConfigError(f"{source}: rope scaling {kind!r} needs {key!r}")
    if theta <= 0:
        raise ModelConfigError(f"{source}: rope_theta must be > 0, got {theta}")
    return theta, scaling


def _shape_fields(data: dict, source: str, *, qk_norm: bool) -> dict[str, Any]:
    hidden = _field(data, "hidden_size", source, int)
    heads = _field(data, "num_attention_heads", source, int)
    if heads <= 0 or hidden <= 0:
        raise ModelConfigError(f"{source}: hidden_size and num_attention_heads must be positive")
    theta, scaling = _rope(data, source)
    if data.get("use_sliding_window"):
        raise ModelConfigError(f"{source}: use_sliding_window=true is not supported")
    return dict(
        vocab_size=_field(data, "vocab_size", source, int),
        hidden_size=hidden,
        intermediate_size=_field(data, "intermediate_size", source, int),
        num_layers=_field(data, "num_hidden_layers", source, int),
        num_heads=heads,
        num_kv_heads=_field(data, "num_key_value_heads", source, int, heads),
        head_dim=_field(data, "head_dim", source, int, hidden // heads),
        rms_norm_eps=_field(data, "rms_norm_eps", source, float, 1e-6),
        rope_theta=theta,
        rope_scaling=freeze_rope_scaling(scaling),
        attention_bias=_field(data, "attention_bias", source, bool, False),
        mlp_bias=_field(data, "mlp_bias", source, bool, False),
        qk_norm=qk_norm,
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def target_config_from_dict(data: dict[str, Any], source: str = "config.json") -> TargetConfig:
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_TARGETS:
        raise ModelConfigError(
            f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_TARGETS)})"
        )
    cfg = TargetConfig(
        **_shape_fields(data, source, qk_norm=model_type == "qwen3"),
        model_type=model_type,
        tie_word_embeddings=_field(data, "tie_word_embeddings", source, bool, False),
        max_position_embeddings=_field(data, "max_position_embeddings", source, int, 40960),
        eos_token_ids=_eos_ids(data.get("eos_token_id")),
    )
    cfg.validate(source)
    return cfg


def drafter_config_from_dict(data: dict[str, Any], source: str = "config.json") -> DrafterConfig:
    dflash = data.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ModelConfigError(f"{source}: dflash_config must be an object")

    def draft_value(name: str, default: Any = None) -> Any:  # dflash_config first, then top level
        return dflash.get(name, data.get(name, default))

    shape = _shape_fields(data, source, qk_norm=True)
    num_target_layers = _field(data, "num_target_layers", source, int)
    layer_ids = draft_value("target_layer_ids")
    if layer_ids is None:
        layer_ids = default_target_layer_ids(num_target_layers, shape["num_layers"])
    if not isinstance(layer_ids, (list, tuple)) or not all(isinstance(i, int) for i in layer_ids):
        raise ModelConfigError(f"{source}: target_layer_ids must be a list of integers, got {layer_ids!r}")
    mask_token_id = draft_value("mask_token_id")
    if not isinstance(mask_token_id, int):
        raise ModelConfigError(f"{source}: dflash_config.mask_token_id must be an integer, got {mask_token_id!r}")
    layer_types = data.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ModelConfigError(f"{source}: only full_attention drafter layers are supported, got {layer_types}")
    softcap = draft_value("final_logit_softcapping")
    cfg = DrafterConfig(
        **shape,
        block_size=int(draft_value("block_size", 16)),
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(layer_ids),
        num_target_layers=num_target_layers,
        input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
        output_multiplier=float(draft_value("output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap else None,
        causal=bool(data.get("is_causal") or False),
        max_position_embeddings=_field(data, "max_position_embeddings", source, int, 40960),
    )
    cfg.validate(source)
    return cfg


def load_target_config(directory: str | Path) -> TargetConfig:
    path = Path(directory) / "config.json"
    return target_config_from_dict(_read_json(path), str(path))


def load_drafter_config(directory: str | Path) -> DrafterConfig:
    path = Path(directory) / "config.json"
    return drafter_config_from_dict(_read_json(path), str(path))


def _shape_to_dict(cfg: TransformerShape) -> dict[str, Any]:
    """The HF ``config.json`` fields of a decoder stack."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling_dict,
    }


def target_config_to_dict(cfg: TargetConfig) -> dict[str, Any]:
    """The HF ``config.json`` of a target."""
    arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[cfg.model_type]
    out = {"architectures": [arch], "model_type": cfg.model_type, **_shape_to_dict(cfg),
           "max_position_embeddings": cfg.max_position_embeddings,
           "tie_word_embeddings": cfg.tie_word_embeddings}
    if cfg.eos_token_ids:
        out["eos_token_id"] = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0]
    return out


def drafter_config_to_dict(cfg: DrafterConfig) -> dict[str, Any]:
    """The z-lab ``config.json`` of a drafter (Qwen3 fields + block_size + dflash_config)."""
    out: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **_shape_to_dict(cfg),
        "attention_dropout": 0.0,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
    }
    if cfg.input_embedding_scale != 1.0:
        out["dflash_config"]["input_embedding_scale"] = cfg.input_embedding_scale
    if cfg.output_multiplier != 1.0:
        out["dflash_config"]["output_multiplier"] = cfg.output_multiplier
    if cfg.final_logit_softcapping:
        out["dflash_config"]["final_logit_softcapping"] = cfg.final_logit_softcapping
    return out
