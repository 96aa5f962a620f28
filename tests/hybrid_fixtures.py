"""Tiny random Qwen3.5 checkpoints (dense and MoE) written by transformers itself (the oracle builds
the files)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Odd shapes: value heads > key heads, key/value head dims unlike each other and unlike the full
# layers' head_dim, linear layers first and last.
TINY_HYBRID = dict(
    vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=5,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=12,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=10,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 0], "mrope_interleaved": True},
)


# The MoE variant: an odd expert count, top-3, expert and shared-expert widths unlike each other.
TINY_HYBRID_MOE = dict(num_experts=7, num_experts_per_tok=3, moe_intermediate_size=20,
                       shared_expert_intermediate_size=28)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):  # one-centred: scale 1 + weight
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(0.4 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):  # the router: logits of std ~2, distinct top-k choices
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("shared_expert_gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def write_hf_hybrid(directory: str | Path, *, nesting: str = "text", seed: int = 0, moe: bool = False,
                    **overrides):
    """A random ``Qwen3_5ForCausalLM`` (``nesting="text"``, model_type ``qwen3_5_text``) or
    ``Qwen3_5ForConditionalGeneration`` (``"vl"``, model_type ``qwen3_5``, a tiny vision tower
    included) saved to ``directory``; with ``moe`` their ``Qwen3_5Moe*`` counterparts
    (``qwen3_5_moe_text`` / ``qwen3_5_moe``). Returns ``(directory, the torch model in float32, eval
    mode)``."""
    import transformers

    family = "Qwen3_5Moe" if moe else "Qwen3_5"
    causal_lm, vl_model, text_config, vl_config = (getattr(transformers, family + suffix) for suffix in (
        "ForCausalLM", "ForConditionalGeneration", "TextConfig", "Config"))
    text = dict(TINY_HYBRID, **(TINY_HYBRID_MOE if moe else {}))
    if moe:
        del text["intermediate_size"]  # the MoE config has no dense MLP width
    text.update(overrides)
    torch.manual_seed(seed)
    if nesting == "text":
        model = causal_lm(text_config(**text))
    else:
        tie = text.pop("tie_word_embeddings")
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text["hidden_size"],
                      patch_size=2, temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
        model = vl_model(vl_config(text_config=text, vision_config=vision, tie_word_embeddings=tie))
    model = model.float().eval()
    _randomize(model, seed)
    if model.config.get_text_config().tie_word_embeddings or getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    json.loads((directory / "config.json").read_text())  # written and readable
    return directory, model
