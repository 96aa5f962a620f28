"""How hybrid linear-attention targets (Qwen3.5 / Qwen3.6, dense and MoE) are named and laid out in
HF safetensors (``io.checkpoint.load_target`` reads them).

Names follow transformers: ``{prefix}layers.{i}.linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,
in_proj_a,out_proj}.weight``, ``.conv1d.weight [conv_dim, 1, kernel]``, ``.A_log``, ``.dt_bias``,
``.norm.weight``; ``{prefix}layers.{i}.self_attn.*`` (``q_proj`` holds per head the query and the
output gate); the prefix is ``model.`` (``qwen3_5_text``, ``qwen3_5_moe_text``) or
``model.language_model.`` (``qwen3_5``, ``qwen3_5_moe``, whose vision tower ``model.visual.*`` and
multi-token-prediction head ``mtp.*`` are ignored).

The MoE variant's ``{prefix}layers.{i}.mlp.``: ``gate.weight [E, hidden]`` (the router, as stored),
``shared_expert.{gate,up,down}_proj.weight``, ``shared_expert_gate.weight [1, hidden]``, and the
routed experts in either layout ``io.moe_checkpoint`` reads for Qwen-style experts: one tensor per
expert and projection (``experts.{e}.gate_proj.weight``..., what ``save_pretrained`` writes) or fused
``experts.gate_up_proj [E, 2 * inter, hidden]`` and ``experts.down_proj [E, hidden, inter]``.

Transformers' decoder and q/k norms scale by ``1 + weight``; ours hold ``1 + weight`` (the plain
``RMSNorm``), converted here. The linear layers' gated output norm scales by its weight as stored.
"""

from __future__ import annotations

from typing import Callable

import jax

from dflash_jax.models.hybrid_config import HybridTargetConfig

Convert = Callable[[jax.Array], jax.Array]
Spec = Callable[[tuple, tuple[int, ...]], tuple[str, Convert, Convert]]

_IGNORED_PREFIXES = ("model.visual.", "mtp.")
_ONE_CENTRED_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm")


def hybrid_tensor_spec(path: tuple, shape: tuple[int, ...], dense_spec: Spec) -> tuple[str, Convert, Convert]:
    """How the hybrid target's parameter at ``path`` (our ``shape``) is named and laid out in torch;
    what it shares with the dense targets (attention, MLP, embedding, head) is ``dense_spec``'s."""
    keys = [str(p) for p in path]
    name = ".".join(keys)
    leaf = keys[-1]
    same: Convert = lambda x: x  # noqa: E731
    if "linear_attn" in keys:
        if leaf in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):  # ours [in, out]
            return (f"{name}.weight", lambda t: t.T, lambda x: x.T)
        if leaf == "conv1d":  # ours [kernel, channels]; torch [channels, 1, kernel]
            return (f"{name}.weight", lambda t: t[:, 0, :].T, lambda x: x.T[:, None, :])
        if leaf in ("A_log", "dt_bias"):
            return (name, same, same)
        if keys[-2:] == ["norm", "weight"]:  # the gated norm: weight as stored
            return (name, same, same)
    if leaf == "shared_expert_gate":  # ours [hidden, 1]; torch [1, hidden]
        return (f"{name}.weight", lambda t: t.T, lambda x: x.T)
    if leaf == "weight" and keys[-2] in _ONE_CENTRED_NORMS:
        return (name, lambda t: t + 1, lambda x: x - 1)
    return dense_spec(path, shape)


def hybrid_ignored(config: HybridTargetConfig) -> Callable[[str], bool]:
    """Checkpoint tensors a text-only hybrid target does not use: the vision tower, the
    multi-token-prediction head, and a tied head's copy of the embedding table."""
    def ignored(name: str) -> bool:
        return name.startswith(_IGNORED_PREFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")

    return ignored
