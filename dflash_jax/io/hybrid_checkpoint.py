"""Reading hybrid linear-attention targets (Qwen3.5 / Qwen3.6 dense) from HF safetensors.

Names follow transformers: ``{prefix}layers.{i}.linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,
in_proj_a,out_proj}.weight``, ``.conv1d.weight [conv_dim, 1, kernel]``, ``.A_log``, ``.dt_bias``,
``.norm.weight``; ``{prefix}layers.{i}.self_attn.*`` (``q_proj`` holds per head the query and the
output gate); the prefix is ``model.`` (``qwen3_5_text``) or ``model.language_model.`` (``qwen3_5``,
whose vision tower ``model.visual.*`` and multi-token-prediction head ``mtp.*`` are ignored).

Transformers' decoder and q/k norms scale by ``1 + weight``; ours hold ``1 + weight`` (the plain
``RMSNorm``), converted here. The linear layers' gated output norm scales by its weight as stored.
"""

from __future__ import annotations

from pathlib import Path

from flax import nnx

from dflash_jax.io.checkpoint import Convert, _populate, _tensor_spec
from dflash_jax.io.errors import parse_dtype
from dflash_jax.models.hybrid import HybridTarget, Rollback
from dflash_jax.models.hybrid_config import load_hybrid_config
from dflash_jax.ops import gated_delta

_IGNORED_PREFIXES = ("model.visual.", "mtp.")
_ONE_CENTRED_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm")


def hybrid_tensor_spec(path: tuple, shape: tuple[int, ...]) -> tuple[str, Convert, Convert]:
    """How the hybrid target's parameter at ``path`` (our ``shape``) is named and laid out in torch."""
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
    if leaf == "weight" and keys[-2] in _ONE_CENTRED_NORMS:
        return (name, lambda t: t + 1, lambda x: x - 1)
    return _tensor_spec(path, shape)


def load_hybrid_target(path: str | Path, dtype="float32", *, chunk: int = gated_delta.DEFAULT_CHUNK,
                       rollback: Rollback = "recompute") -> HybridTarget:
    """Loads a ``qwen3_5`` / ``qwen3_5_text`` target from an HF directory (config.json + safetensors).

    A missing, misshapen or unused tensor is a ``CheckpointError`` naming the file and the tensor.
    """
    directory = Path(path)
    config = load_hybrid_config(directory)
    dt = parse_dtype(dtype)

    def ignored(name: str) -> bool:
        return name.startswith(_IGNORED_PREFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")

    def build() -> HybridTarget:
        return HybridTarget(config, dtype=dt, rngs=nnx.Rngs(0), chunk=chunk, rollback=rollback)

    return _populate(build, directory, config.weight_prefix, dt, ignored, spec=hybrid_tensor_spec)
