"""Model configs read from HF ``config.json`` files (targets) and z-lab DFlash drafter configs.

Both styles found in the wild are accepted: top-level ``rope_theta`` / ``rope_scaling`` and
transformers-5 ``rope_parameters``. Errors name the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any, ClassVar

SUPPORTED_TARGETS = ("qwen3", "llama", "qwen3_moe", "gpt_oss")
# A drafter config without a block size drafts blocks of 16, as the reference (``dflash.model.DFlashDraftModel``)
# reads it; said in a warning, since the block size the drafter was trained with is what it should draft.
DEFAULT_BLOCK_SIZE = 16

log = logging.getLogger("dflash_jax.models")


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
    # Per-layer attention: "full_attention" / "sliding_attention" (() : all full) and the window of the
    # sliding layers (gpt-oss targets; drafters with sliding layers, as the reference reads them).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    sliding_needs_window: ClassVar[bool] = True  # a sliding layer without a window is a config error

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (keys at most ``window - 1`` positions back), None: full."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def validate_layer_types(self, source: str) -> None:
        """``layer_types`` of attention layers, full or sliding; a family whose layers are of other kinds
        checks its own."""
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ModelConfigError(f"{source}: layer_types has {len(self.layer_types)} entries for "
                                       f"num_hidden_layers={self.num_layers}")
            bad_types = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if bad_types:
                raise ModelConfigError(f"{source}: layer_types {bad_types} are not supported "
                                       "(full_attention, sliding_attention)")
            windowless = self.sliding_window is None and not self.sliding_needs_window
            if "sliding_attention" in self.layer_types and not windowless and not (self.sliding_window or 0) > 0:
                raise ModelConfigError(f"{source}: sliding_attention layers need a positive sliding_window, "
                                       f"got {self.sliding_window}")

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    def validate(self, source: str = "config") -> None:
        for name, field in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                            ("intermediate_size", "intermediate_size"), ("num_layers", "num_hidden_layers"),
                            ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                            ("head_dim", "head_dim")):  # named as in config.json
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{source}: {field} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"{source}: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"{source}: head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ModelConfigError(f"{source}: rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ModelConfigError(f"{source}: rope_theta must be a finite number > 0, got {self.rope_theta}")


@dataclasses.dataclass(frozen=True)
class TargetConfig(TransformerShape):
    model_type: str = "qwen3"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (qwen3_moe, gpt_oss; models/moe.py). ``num_experts == 0``: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # qwen3_moe: the top-k probabilities renormalised to sum to 1
    decoder_sparse_step: int = 1  # qwen3_moe: layer i is sparse iff (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    experts_quantization: str | None = None  # "mxfp4": experts kept 4-bit (gpt_oss checkpoints)
    attention_sinks: bool = False  # gpt_oss: a learned sink logit per query head

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` routes to experts (else a dense MLP of ``intermediate_size``)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def model_types(self) -> tuple[str, ...]:
        """The ``model_type`` values this config class describes (a subclass's family names its own)."""
        return SUPPORTED_TARGETS

    def validate(self, source: str = "config") -> None:
        super().validate(source)
        if self.model_type not in self.model_types():
            raise ModelConfigError(f"{source}: model_type {self.model_type!r} is not supported")
        bad_eos = [i for i in self.eos_token_ids if i >= self.vocab_size]
        if bad_eos:  # a stop id the model can never produce would let every row run to its length limit
            raise ModelConfigError(f"{source}: eos_token_id {bad_eos} outside the vocabulary [0, {self.vocab_size})")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ModelConfigError(f"{source}: num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                                       f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                raise ModelConfigError(f"{source}: moe_intermediate_size must be positive, "
                                       f"got {self.moe_intermediate_size}")
            if self.decoder_sparse_step <= 0:
                raise ModelConfigError(f"{source}: decoder_sparse_step must be positive, got {self.decoder_sparse_step}")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ModelConfigError(f"{source}: mlp_only_layers {bad} outside [0, num_hidden_layers={self.num_layers})")
        if self.experts_quantization not in (None, "mxfp4"):
            raise ModelConfigError(f"{source}: experts quantization {self.experts_quantization!r} is not supported "
                                   "(mxfp4)")
        if self.experts_quantization and (not self.num_experts or self.hidden_size % 32
                                          or self.moe_intermediate_size % 32):
            raise ModelConfigError(f"{source}: mxfp4 experts need hidden_size and the expert intermediate_size to be "
                                   f"multiples of 32 (blocks of 32 values), got {self.hidden_size} and "
                                   f"{self.moe_intermediate_size}")
        self.validate_layer_types(source)

@dataclasses.dataclass(frozen=True)
class DrafterConfig(TransformerShape):
    block_size: int = DEFAULT_BLOCK_SIZE
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] = ()
    num_target_layers: int = 0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # The config's is_causal: whether a layer's block is causal. None (the field missing or null): as the
    # reference reads it, sliding_attention layers are causal and full_attention ones bidirectional.
    causal: bool | None = False
    max_position_embeddings: int = 40960
    # A sliding layer may have no window: the reference's config without use_sliding_window (transformers
    # then nulls sliding_window), a causal block over the whole context.
    sliding_needs_window: ClassVar[bool] = False

    def layer_causal(self, layer: int) -> bool:
        """Whether layer ``layer`` attends causally inside its block."""
        if self.causal is not None:
            return self.causal
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def validate(self, source: str = "config") -> None:
        super().validate(source)
        self.validate_layer_types(source)
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


# What a drafter shares with its target: it embeds with the target's table (vocabulary, width) and projects the
# outputs of the target's layers (their count fixes its tapped layer ids). (drafter field, target field as in an
# HF config.json, TargetConfig attribute)
PAIRED_FIELDS = (("vocab_size", "vocab_size", "vocab_size"), ("hidden_size", "hidden_size", "hidden_size"),
                 ("num_target_layers", "num_hidden_layers", "num_layers"))


def pair_mismatch(drafter: "DrafterConfig", target: "TargetConfig") -> tuple[str, int, str, int] | None:
    """The first of ``PAIRED_FIELDS`` where ``drafter`` does not fit ``target``: ``(drafter field, its value,
    target field, its value)``; None where the drafter fits."""
    for mine, theirs, attribute in PAIRED_FIELDS:
        ours, target_value = getattr(drafter, mine), getattr(target, attribute)
        if ours != target_value:
            return mine, ours, theirs, target_value
    return None


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The published rule, used only when a drafter config lists no ``target_layer_ids``. It spans
    layers ``1 .. N - 3``, so it needs a target of at least 4 layers (2 for a one-layer drafter);
    below that it is an error asking for explicit ids, not a negative layer id."""
    if num_draft_layers == 1:
        ids = (num_target_layers // 2,)
    else:
        span = (num_target_layers - 3) - 1
        ids = tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))
    if num_target_layers < 1 or num_draft_layers < 1 or not all(0 <= i < num_target_layers for i in ids):
        raise ModelConfigError(
            f"target_layer_ids: the default rule for {num_draft_layers} draft layers over {num_target_layers} "
            f"target layers gives {list(ids)}, outside the target's layers; list target_layer_ids explicitly")
    return ids


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelConfigError(f"{path}: invalid JSON: {err}") from None
    except OSError as err:  # a directory, no permission
        raise ModelConfigError(f"{path}: cannot be read: {err.strerror or err}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: the top level must be an object")
    return data


_REQUIRED = object()
_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean (true or false)", str: "a string",
               list: "a list", dict: "an object"}


def _describe(value: Any) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check(value: Any, label: str, source: str, kind: type) -> Any:
    """``value`` if it is a JSON value of ``kind`` (no bool for numbers, finite floats), else an error."""
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        finite = " finite" if kind is float and isinstance(value, float) else ""
        raise ModelConfigError(f"{source}: field {label!r} must be{finite} {_KIND_NAMES[kind]}, got {_describe(value)}")
    return value


def _field(data: dict, name: str, source: str, kind: type, default: Any = _REQUIRED, *,
           nullable: bool = False, label: str | None = None) -> Any:
    """``data[name]`` checked (never converted) against ``kind``. Absent: ``default`` (an error without
    one); ``null``: ``default`` when ``nullable`` (transformers reads it as unset), else an error."""
    label = label or name
    if name not in data or (data[name] is None and nullable):
        if default is _REQUIRED:
            raise ModelConfigError(f"{source}: missing field {label!r}")
        return default
    return _check(data[name], label, source, kind)


def _positive(value: float, label: str, source: str) -> float:
    if not value > 0:
        raise ModelConfigError(f"{source}: field {label!r} must be > 0, got {value!r}")
    return value


def _rope(data: dict, source: str) -> tuple[float, dict | None]:
    params = data.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ModelConfigError(f"{source}: field 'rope_parameters' must be an object or null, got {_describe(params)}")
    if params is not None:  # transformers >= 5
        if "rope_theta" in params:
            theta = _field(params, "rope_theta", source, float, label="rope_parameters.rope_theta")
            theta_label = "rope_parameters.rope_theta"
        else:
            theta, theta_label = _field(data, "rope_theta", source, float, 10000.0), "rope_theta"
        kind = params.get("rope_type", params.get("type", "default"))
        scaling, where = (None if kind == "default" else dict(params)), "rope_parameters"
    else:
        theta, theta_label = _field(data, "rope_theta", source, float, 10000.0), "rope_theta"
        scaling, where = data.get("rope_scaling"), "rope_scaling"
        if scaling is not None and not isinstance(scaling, dict):
            raise ModelConfigError(f"{source}: field 'rope_scaling' must be an object or null, got {_describe(scaling)}")
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    _positive(theta, theta_label, source)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("linear", "llama3", "yarn"):
            raise ModelConfigError(
                f"{source}: rope type {_describe(kind)} is not supported (default, linear, llama3, yarn)")
        if kind == "yarn":
            _yarn_fields(scaling, where, source)
            return theta, scaling
        need = ["factor"] + (["low_freq_factor", "high_freq_factor"] if kind == "llama3" else [])
        for key in need:
            if key not in scaling:
                raise ModelConfigError(f"{source}: rope scaling {kind!r} needs {key!r}")
            _positive(_field(scaling, key, source, float, label=f"{where}.{key}"), f"{where}.{key}", source)
        if kind == "llama3":
            label = f"{where}.original_max_position_embeddings"
            if "original_max_position_embeddings" not in scaling:
                raise ModelConfigError(f"{source}: rope scaling {kind!r} needs 'original_max_position_embeddings'")
            _positive(_field(scaling, "original_max_position_embeddings", source, int, label=label), label, source)
            if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
                raise ModelConfigError(
                    f"{source}: field '{where}.high_freq_factor' ({scaling['high_freq_factor']}) must be greater "
                    f"than '{where}.low_freq_factor' ({scaling['low_freq_factor']})"
                )
    return theta, scaling


def _yarn_fields(scaling: dict, where: str, source: str) -> None:
    """YaRN's fields checked as ``ops.rope`` reads them (transformers' ``_compute_yarn_parameters``)."""
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise ModelConfigError(f"{source}: rope scaling 'yarn' needs {key!r}")
    _positive(_field(scaling, "factor", source, float, label=f"{where}.factor"), f"{where}.factor", source)
    label = f"{where}.original_max_position_embeddings"
    _positive(_field(scaling, "original_max_position_embeddings", source, int, label=label), label, source)
    for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        _field(scaling, key, source, float, None, nullable=True, label=f"{where}.{key}")
    _field(scaling, "truncate", source, bool, True, nullable=True, label=f"{where}.truncate")


SUPPORTED_ACTIVATIONS = ("silu", "swish")


# transformers' Qwen3Config default: with use_sliding_window and no layer_types, layers from this index on slide.
QWEN3_MAX_WINDOW_LAYERS = 28


def _shape_fields(data: dict, source: str, *, qk_norm: bool, sliding_window_ok: bool = False) -> dict[str, Any]:
    hidden = _field(data, "hidden_size", source, int)
    heads = _field(data, "num_attention_heads", source, int)
    if heads <= 0 or hidden <= 0:
        raise ModelConfigError(f"{source}: hidden_size and num_attention_heads must be positive, "
                               f"got {hidden} and {heads}")
    theta, scaling = _rope(data, source)
    if _field(data, "use_sliding_window", source, bool, False, nullable=True) and not sliding_window_ok:
        raise ModelConfigError(f"{source}: use_sliding_window=true is not supported")
    act = _field(data, "hidden_act", source, str, "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelConfigError(f"{source}: field 'hidden_act' is {act!r}; only SiLU is implemented "
                               f"({', '.join(SUPPORTED_ACTIVATIONS)})")
    eps = _field(data, "rms_norm_eps", source, float, 1e-6)
    return dict(
        vocab_size=_field(data, "vocab_size", source, int),
        hidden_size=hidden,
        intermediate_size=_field(data, "intermediate_size", source, int),
        num_layers=_field(data, "num_hidden_layers", source, int),
        num_heads=heads,
        num_kv_heads=_field(data, "num_key_value_heads", source, int, heads, nullable=True),
        head_dim=_field(data, "head_dim", source, int, hidden // heads, nullable=True),
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=freeze_rope_scaling(scaling),
        attention_bias=_field(data, "attention_bias", source, bool, False, nullable=True),
        mlp_bias=_field(data, "mlp_bias", source, bool, False, nullable=True),
        qk_norm=qk_norm,
    )


def _max_positions(data: dict, source: str) -> int:
    value = _field(data, "max_position_embeddings", source, int, 40960, nullable=True)
    return _positive(value, "max_position_embeddings", source)


def _eos_ids(data: dict, source: str) -> tuple[int, ...]:
    value = data.get("eos_token_id")
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    out = tuple(_check(v, "eos_token_id", source, int) for v in ids)
    if any(i < 0 for i in out):
        raise ModelConfigError(f"{source}: field 'eos_token_id' must hold token ids >= 0, got {_describe(value)}")
    return out


def _moe_fields(data: dict, model_type: str, source: str) -> dict[str, Any]:
    """The mixture-of-experts and gpt-oss attention fields of a qwen3_moe / gpt_oss config.json."""
    if model_type not in ("qwen3_moe", "gpt_oss"):
        return {}
    # transformers 5 writes num_local_experts; the published Qwen3-MoE configs say num_experts.
    name = "num_experts" if "num_experts" in data else "num_local_experts"
    out: dict[str, Any] = dict(num_experts=_field(data, name, source, int),
                               num_experts_per_tok=_field(data, "num_experts_per_tok", source, int))
    if model_type == "qwen3_moe":
        out.update(moe_intermediate_size=_field(data, "moe_intermediate_size", source, int),
                   norm_topk_prob=_field(data, "norm_topk_prob", source, bool, False, nullable=True),
                   decoder_sparse_step=_field(data, "decoder_sparse_step", source, int, 1, nullable=True))
        only = _field(data, "mlp_only_layers", source, list, [], nullable=True)
        out["mlp_only_layers"] = tuple(_check(i, f"mlp_only_layers[{n}]", source, int) for n, i in enumerate(only))
        if out["num_experts"] <= 0:
            raise ModelConfigError(f"{source}: field {name!r} must be positive, got {out['num_experts']}")
        return out
    out["moe_intermediate_size"] = _field(data, "intermediate_size", source, int)
    limit = _field(data, "swiglu_limit", source, float, 7.0, nullable=True)
    if limit != 7.0:  # ops.experts.GPT_OSS_LIMIT, as transformers hard-codes it
        raise ModelConfigError(f"{source}: field 'swiglu_limit' is {limit}; only 7.0 is implemented")
    types = _field(data, "layer_types", source, list, None, nullable=True)
    if types is None:  # transformers' default: sliding and full layers alternating, sliding first
        types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                 for i in range(_field(data, "num_hidden_layers", source, int))]
    out["layer_types"] = tuple(_check(t, f"layer_types[{n}]", source, str) for n, t in enumerate(types))
    out["sliding_window"] = _field(data, "sliding_window", source, int, None, nullable=True)
    out["attention_sinks"] = True
    quant = _field(data, "quantization_config", source, dict, None, nullable=True)
    if quant is not None:
        method = quant.get("quant_method")
        if method != "mxfp4":
            raise ModelConfigError(f"{source}: field 'quantization_config.quant_method' is {_describe(method)}; "
                                   "only mxfp4 experts are supported")
        out["experts_quantization"] = "mxfp4"
    if out["num_experts"] <= 0:
        raise ModelConfigError(f"{source}: field {name!r} must be positive, got {out['num_experts']}")
    return out


def target_config_from_dict(data: dict[str, Any], source: str = "config.json") -> TargetConfig:
    model_type = _field(data, "model_type", source, str)
    if model_type not in SUPPORTED_TARGETS:
        raise ModelConfigError(
            f"{source}: model_type {_describe(model_type)} is not supported (supported: {', '.join(SUPPORTED_TARGETS)})"
        )
    cfg = TargetConfig(
        **_shape_fields(data, source, qk_norm=model_type in ("qwen3", "qwen3_moe")),
        **_moe_fields(data, model_type, source),
        model_type=model_type,
        tie_word_embeddings=_field(data, "tie_word_embeddings", source, bool, False, nullable=True),
        max_position_embeddings=_max_positions(data, source),
        eos_token_ids=_eos_ids(data, source),
    )
    cfg.validate(source)
    return cfg


def drafter_config_from_dict(data: dict[str, Any], source: str = "config.json") -> DrafterConfig:
    dflash = data.get("dflash_config")
    if dflash is None:
        dflash = {}
    if not isinstance(dflash, dict):
        raise ModelConfigError(f"{source}: field 'dflash_config' must be an object, got {_describe(dflash)}")

    def draft_field(name: str, kind: type, default: Any = _REQUIRED, nullable: bool = False) -> Any:
        """A DFlash setting: from ``dflash_config`` first, then the top level (as the reference reads it)."""
        if name in dflash or name not in data:
            return _field(dflash, name, source, kind, default, nullable=nullable, label=f"dflash_config.{name}")
        return _field(data, name, source, kind, default, nullable=nullable)

    shape = _shape_fields(data, source, qk_norm=True, sliding_window_ok=True)
    num_target_layers = _field(data, "num_target_layers", source, int)
    if num_target_layers <= 0:
        raise ModelConfigError(f"{source}: field 'num_target_layers' must be > 0, got {num_target_layers}")
    layer_ids = draft_field("target_layer_ids", list, None, nullable=True)
    if layer_ids is None:
        layer_ids = default_target_layer_ids(num_target_layers, shape["num_layers"])
    where = "dflash_config.target_layer_ids" if "target_layer_ids" in dflash else "target_layer_ids"
    layer_ids = tuple(_check(i, f"{where}[{n}]", source, int) for n, i in enumerate(layer_ids))
    mask_token_id = draft_field("mask_token_id", int)
    # Sliding layers as the reference reads a drafter's Qwen3 config: the window only with use_sliding_window
    # (transformers nulls it otherwise); layer_types as given, else sliding from max_window_layers on.
    window = (_field(data, "sliding_window", source, int, None, nullable=True)
              if _field(data, "use_sliding_window", source, bool, False, nullable=True) else None)
    given = _field(data, "layer_types", source, list, None, nullable=True)
    if given is not None:
        layer_types = tuple(_check(t, f"layer_types[{n}]", source, str) for n, t in enumerate(given))
    elif window is not None:
        first = _field(data, "max_window_layers", source, int, QWEN3_MAX_WINDOW_LAYERS, nullable=True)
        layer_types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(shape["num_layers"]))
    else:
        layer_types = ()
    sliding = "sliding_attention" in layer_types
    softcap = draft_field("final_logit_softcapping", float, None, nullable=True)
    if softcap is not None and softcap < 0:
        raise ModelConfigError(f"{source}: field 'final_logit_softcapping' must be > 0 (or 0 or null: none), got {softcap}")
    scales = {}
    for name in ("input_embedding_scale", "output_multiplier"):
        scales[name] = draft_field(name, float, 1.0)
        if not scales[name] > 0:
            raise ModelConfigError(f"{source}: field {name!r} must be > 0, got {scales[name]}")
    if "block_size" not in dflash and "block_size" not in data:
        log.warning("%s: field 'block_size' is missing (neither dflash_config.block_size nor a top-level block_size): "
                    "drafting blocks of %d, the reference's default; set it to the block size the drafter was "
                    "trained with", source, DEFAULT_BLOCK_SIZE)
    cfg = DrafterConfig(
        **shape,
        block_size=draft_field("block_size", int, DEFAULT_BLOCK_SIZE),
        mask_token_id=mask_token_id,
        target_layer_ids=layer_ids,
        num_target_layers=num_target_layers,
        **scales,
        final_logit_softcapping=softcap or None,  # 0: none, as the reference reads it
        # missing or null: None, read per layer as the reference does (DrafterConfig.layer_causal)
        causal=_field(data, "is_causal", source, bool, None, nullable=True),
        max_position_embeddings=_max_positions(data, source),
        layer_types=layer_types if sliding else (),  # all full_attention: the default
        sliding_window=window if sliding else None,
    )
    cfg.validate(source)
    return cfg


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A config file's top-level object; a missing, unreadable or malformed file is a ``ModelConfigError``."""
    return _read_json(Path(path))


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
    arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "gpt_oss": "GptOssForCausalLM"}[cfg.model_type]
    out = {"architectures": [arch], "model_type": cfg.model_type, **_shape_to_dict(cfg),
           "max_position_embeddings": cfg.max_position_embeddings,
           "tie_word_embeddings": cfg.tie_word_embeddings}
    if cfg.model_type == "qwen3_moe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers))
    elif cfg.model_type == "gpt_oss":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   intermediate_size=cfg.moe_intermediate_size, layer_types=list(cfg.layer_types),
                   sliding_window=cfg.sliding_window)
        if cfg.rope_scaling is not None:  # gpt-oss reads rope_parameters only
            out["rope_parameters"] = {**cfg.rope_scaling_dict, "rope_theta": cfg.rope_theta}
            del out["rope_scaling"]
        if cfg.experts_quantization:
            out["quantization_config"] = {"quant_method": cfg.experts_quantization}
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
        "is_causal": cfg.causal,
        **({"layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window,
            "use_sliding_window": cfg.sliding_window is not None} if cfg.layer_types else {}),
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
