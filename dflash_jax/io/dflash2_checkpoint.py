"""DFlash2 drafter configs on disk (``io.checkpoint.load_drafter`` / ``save_drafter`` read and write the
tensors): the authors' layout in and out, the ``speculators`` layout in.

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
from typing import Callable

from dflash_jax.models.config import ModelConfigError, _field, read_config_json
from dflash_jax.models.dflash2 import DFlash2Config, dflash2_config_from_dict, is_dflash2_config

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


def read_other_config(directory: Path) -> tuple[DFlash2Config, Callable[[str], bool]] | None:
    """The config of a DFlash2 drafter in ``directory`` (authors' or speculators layout) and which
    checkpoint tensors its loader skips; None for a DFlash drafter (the z-lab layout)."""
    source = Path(directory) / "config.json"
    data = read_config_json(source)
    if "speculators_model_type" in data:
        return speculators_config_from_dict(data, str(source)), lambda name: name in SPECULATORS_VERIFIER_TENSORS
    if is_dflash2_config(data):
        return dflash2_config_from_dict(data, str(source)), lambda name: False
    return None


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
                num_target_layers=_verifier_depth(data, source) or max(ids) + 1)
    zlab.setdefault("is_causal", False)
    return dflash2_config_from_dict(zlab, source)


def _verifier_depth(data: dict, source: str) -> int | None:
    """The target's layer count, which a speculators config does not record: read from the verifier's
    config.json when ``speculators_config.verifier.name_or_path`` is a local directory (else None: the
    taps bound it from below, and the engine refuses a target of another depth, naming both)."""
    speculators = _field(data, "speculators_config", source, dict, {}, nullable=True)
    verifier = speculators.get("verifier") or {}
    path = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
        return None
    layers = read_config_json(Path(path) / "config.json").get("num_hidden_layers")
    return layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None
