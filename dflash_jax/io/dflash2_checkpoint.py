"""DFlash2 drafters on disk: the authors' layout in and out, the ``speculators`` layout in.

- The authors' layout (what their DFlash2 releases publish, and what vLLM and SGLang load): the
  z-lab DFlash ``config.json`` with ``architectures: ["DFlash2DraftModel"]`` and the DFlash2
  fields in ``dflash_config`` (``models.dflash2.dflash2_config_from_dict``), and the z-lab tensor
  names plus ``layers.{i}.attention_conv / mlp_conv.{base_kernel, kernel_projection.weight}`` and
  ``candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}``.
- ``speculators`` (vLLM's trainer): ``speculators_model_type: "dflash2"`` with the decoder shape
  under ``transformer_layer_config`` and the tap ids as ``aux_hidden_state_layer_ids``; the same
  tensor names, plus copies of the verifier's embedding, head and final norm that a drafter here
  takes from the target itself (skipped by name, nothing else is).
"""

from __future__ import annotations

from pathlib import Path

from flax import nnx

from dflash_jax.io.checkpoint import _populate, _save
from dflash_jax.io.errors import CheckpointError, parse_dtype
from dflash_jax.models.config import ModelConfigError, read_config_json
from dflash_jax.models.dflash2 import (
    DFlash2Config,
    DFlash2Drafter,
    dflash2_config_from_dict,
    dflash2_config_to_dict,
    is_dflash2_config,
)

# Verifier tensors a speculators checkpoint may carry; the drafter here uses the target's own.
SPECULATORS_VERIFIER_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                "verifier_norm.weight", "d2t", "t2d")
# The speculators config fields this reader understands; any other is refused by name.
_SPECULATORS_KNOWN = frozenset({
    "speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
    "draft_vocab_size", "block_size", "target_hidden_size", "aux_hidden_state_layer_ids", "mask_token_id",
    "sliding_window_non_causal", "sample_from_anchor", "conv_kernel_size", "conv_group_size", "selector_rank",
    "selector_top_k", "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tie_word_embeddings", "auto_map",
})


def is_other_format(directory: Path) -> bool:
    """Whether ``directory/config.json`` is a DFlash2 or a speculators drafter (not plain DFlash)."""
    data = read_config_json(Path(directory) / "config.json")
    return "speculators_model_type" in data or is_dflash2_config(data)


def load_any_drafter(directory: str | Path, dtype="float32"):
    """A DFlash2 drafter from either layout (``is_other_format`` said which it is not: DFlash)."""
    directory = Path(directory)
    data = read_config_json(directory / "config.json")
    if "speculators_model_type" in data:
        return load_speculators_drafter(directory, dtype)
    return load_dflash2_drafter(directory, dtype)


def load_dflash2_drafter(path: str | Path, dtype="float32") -> DFlash2Drafter:
    """A DFlash2 drafter from the authors' layout (config.json + model.safetensors)."""
    directory = Path(path)
    config = dflash2_config_from_dict(read_config_json(directory / "config.json"), str(directory / "config.json"))
    return _build(config, directory, dtype)


def save_dflash2_drafter(drafter: DFlash2Drafter, path: str | Path, dtype=None) -> None:
    """Writes the authors' layout, which their code, vLLM and SGLang read."""
    _save(drafter, dflash2_config_to_dict(drafter.config), path, "", dtype)


def speculators_config_from_dict(data: dict, source: str) -> DFlash2Config:
    """A DFlash2 config from a speculators config.json (``speculators_model_type: dflash2``)."""
    kind = data.get("speculators_model_type")
    if kind != "dflash2":
        raise ModelConfigError(f"{source}: speculators_model_type {kind!r} is not supported here (dflash2; "
                               "DFlash drafters load from the z-lab layout)")
    unknown = sorted(set(data) - _SPECULATORS_KNOWN)
    if unknown:
        raise ModelConfigError(f"{source}: unknown speculators field(s) {', '.join(map(repr, unknown))}")
    layer = data.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ModelConfigError(f"{source}: field 'transformer_layer_config' must be an object")
    vocab = layer.get("vocab_size")
    if data.get("draft_vocab_size", vocab) != vocab:
        raise ModelConfigError(f"{source}: draft_vocab_size={data.get('draft_vocab_size')} differs from "
                               f"transformer_layer_config.vocab_size={vocab}: a reduced draft vocabulary is not "
                               "supported")
    ids = data.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ModelConfigError(f"{source}: field 'aux_hidden_state_layer_ids' must list the target's tap layers")
    if data.get("mask_token_id") is None:
        raise ModelConfigError(f"{source}: missing field 'mask_token_id'")
    dflash = {"mask_token_id": data["mask_token_id"], "target_layer_ids": ids, "block_size": data.get("block_size", 8)}
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "sample_from_anchor",
                 "sliding_window_non_causal"):
        if name in data:
            dflash[name] = data[name]
    zlab = {k: v for k, v in layer.items() if k not in ("architectures", "dflash_config")}
    zlab.update(architectures=["DFlash2DraftModel"], dflash_config=dflash,
                # The speculators config does not record the target's depth: the taps bound it; the
                # engine checks the drafter against the target it is paired with.
                num_target_layers=max(ids) + 1)
    zlab.setdefault("is_causal", False)
    return dflash2_config_from_dict(zlab, source)


def load_speculators_drafter(path: str | Path, dtype="float32") -> DFlash2Drafter:
    """A DFlash2 drafter from a speculators checkpoint directory."""
    directory = Path(path)
    source = directory / "config.json"
    config = speculators_config_from_dict(read_config_json(source), str(source))
    return _build(config, directory, dtype, ignored=lambda name: name in SPECULATORS_VERIFIER_TENSORS)


def _build(config: DFlash2Config, directory: Path, dtype, ignored=lambda name: False) -> DFlash2Drafter:
    dt = parse_dtype(dtype)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such directory")
    return _populate(lambda: DFlash2Drafter(config, dtype=dt, rngs=nnx.Rngs(0)), directory, "", dt, ignored)
