"""The ``speculators`` 0.9.0 DFlash2 modules (the authors' code, vendored MIT) as a CPU oracle.

``torch_model(drafter, target)`` builds speculators' ``DFlash2DraftModel`` holding exactly the
weights of one of our drafters (through our own writer: the tensors of the authors' layout) and of
the target's embedding, head and final norm, with eager attention in float32.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
speculators_dflash2 = pytest.importorskip("speculators.models.dflash2")

from safetensors.numpy import load_file  # noqa: E402
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from dflash_jax.io.checkpoint import save_drafter  # noqa: E402


def t(x) -> "torch.Tensor":
    return torch.from_numpy(np.asarray(x, np.float32).copy())


def layer_config(cfg) -> Qwen3Config:
    """The transformers config of the drafter's decoder layers (eager attention)."""
    tl = Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings, attention_bias=cfg.attention_bias,
        **(dict(layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window, use_sliding_window=True)
           if getattr(cfg, "layer_types", ()) else {}),
    )
    tl._attn_implementation = "eager"
    return tl


def speculators_config(cfg, *, dflash2: bool = True):
    kwargs = dict(
        transformer_layer_config=layer_config(cfg), draft_vocab_size=cfg.vocab_size, block_size=cfg.block_size,
        aux_hidden_state_layer_ids=list(cfg.target_layer_ids), mask_token_id=cfg.mask_token_id,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2" if dflash2 else "dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=cfg.block_size - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])),
    )
    if not dflash2:
        from speculators.models.dflash import DFlashSpeculatorConfig
        return DFlashSpeculatorConfig(**kwargs)
    return DFlash2SpeculatorConfig(**kwargs, conv_kernel_size=cfg.conv_kernel_size,
                                   conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank,
                                   selector_top_k=cfg.selector_top_k,
                                   sliding_window_non_causal=cfg.sliding_window_non_causal)


def torch_model(drafter, target, directory: Path):
    """speculators' DFlash2 (or DFlash, for a DFlash drafter) model with our weights."""
    from speculators.models.dflash import DFlashDraftModel

    cfg = drafter.config
    dflash2 = hasattr(cfg, "selector_rank")
    model = (DFlash2DraftModel if dflash2 else DFlashDraftModel)(speculators_config(cfg, dflash2=dflash2))
    save_drafter(drafter, directory)
    state = {k: torch.from_numpy(v.copy()) for k, v in load_file(str(directory / "model.safetensors")).items()}
    state["embed_tokens.weight"] = t(target.embed_tokens[...])
    state["lm_head.weight"] = t(np.asarray(target.lm_head[...]).T)
    state["verifier_lm_head.weight"] = state["lm_head.weight"].clone()
    state["verifier_norm.weight"] = t(target.norm.weight[...])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert not [m for m in missing if m not in ("d2t", "t2d")], missing
    return model.float().eval()


@contextlib.contextmanager
def fixed_anchors(anchors, valid):
    """speculators draws its anchors at random: these instead."""
    import speculators.models.dflash.core as core

    saved = core.select_anchors
    core.select_anchors = lambda loss_mask, n, block: (torch.as_tensor(np.asarray(anchors), dtype=torch.long),
                                                       torch.as_tensor(np.asarray(valid), dtype=torch.bool))
    try:
        yield
    finally:
        core.select_anchors = saved


def numpy_select(logits, hidden, anchors, pred_book, succ_book, proj, top_k):
    """The reference's greedy selection, transcribed: per row and slot, the unary top-k (stable:
    ties to the lower id), scored ``unary + <pred[prev] * (h @ W), succ[c]>`` in float64, the first
    maximum taken, and the chosen token the next slot's ``prev``."""
    out = np.zeros(logits.shape[:2], np.int64)
    for b in range(logits.shape[0]):
        prev = anchors[b]
        for s in range(logits.shape[1]):
            cand = np.argsort(-logits[b, s], kind="stable")[:top_k]
            ctx = pred_book[prev].astype(np.float64) * (hidden[b, s].astype(np.float64) @ proj)
            scores = logits[b, s, cand].astype(np.float64) + succ_book[cand].astype(np.float64) @ ctx
            prev = cand[int(np.argmax(scores))]
            out[b, s] = prev
    return out
