"""The one reader and writer of HF-format safetensors: targets and z-lab DFlash drafters.

Names follow transformers (``model.layers.{i}.self_attn.q_proj.weight``, ...) for targets and the
z-lab layout (``fc.weight``, ``layers.{i}...``, no ``model.`` prefix) for drafters. Torch Linear
weights are ``[out, in]``; ours are ``[in, out]`` with attention projections split per head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from dflash_jax.models.drafter import Drafter
from dflash_jax.models.config import (
    drafter_config_to_dict,
    load_drafter_config,
    load_target_config,
    target_config_to_dict,
)
from dflash_jax.models.target import Target

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class CheckpointError(ValueError):
    """A checkpoint is incomplete or does not fit its config; the message names file and tensor."""


def _dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    return jnp.dtype(dtype)


# ----------------------------------------------------------------------------------------------
# Name and layout mapping: our parameter path -> (torch name, ours-from-torch, torch-from-ours).
# ----------------------------------------------------------------------------------------------

Convert = Callable[[jax.Array], jax.Array]


def _tensor_spec(path: tuple, shape: tuple[int, ...]) -> tuple[str, Convert, Convert]:
    """How the parameter at ``path`` (with our ``shape``) is named and laid out in torch."""
    keys = [str(p) for p in path]
    name = ".".join(keys)
    leaf = keys[-1]
    same: Convert = lambda x: x  # noqa: E731
    if leaf in ("q_proj", "k_proj", "v_proj"):  # ours [in, heads, dim]; torch [heads*dim, in]
        return (f"{name}.weight", lambda t: t.T.reshape(shape), lambda x: x.reshape(shape[0], -1).T)
    if leaf == "o_proj":  # ours [heads, dim, out]; torch [out, heads*dim]
        return (f"{name}.weight", lambda t: t.T.reshape(shape), lambda x: x.reshape(-1, shape[-1]).T)
    if leaf in ("q_bias", "k_bias", "v_bias", "o_bias"):
        torch_name = ".".join(keys[:-1] + [leaf[0] + "_proj", "bias"])
        return (torch_name, lambda t: t.reshape(shape), lambda x: x.reshape(-1))
    if leaf in ("gate_bias", "up_bias", "down_bias"):
        torch_name = ".".join(keys[:-1] + [leaf.replace("_bias", "_proj"), "bias"])
        return (torch_name, same, same)
    if leaf in ("gate_proj", "up_proj", "down_proj", "fc", "lm_head"):  # ours [in, out]
        return (f"{name}.weight", lambda t: t.T, lambda x: x.T)
    if leaf == "embed_tokens":
        return (f"{name}.weight", same, same)
    if leaf == "weight":  # RMSNorm
        return (name, same, same)
    if leaf in ("qkv_proj", "qkv_bias", "gate_up_proj", "gate_up_bias", "context_kv_proj", "context_kv_bias"):
        raise ValueError(f"parameter {name} is in a serving layout (runtime.serving_params, an "
                         "Engine's engine.target / engine.drafter); checkpoints "
                         "hold the separate projections: save the module that was passed to the Engine")
    raise KeyError(f"no checkpoint name for parameter {name}")


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def _safetensors_files(directory: Path) -> dict[str, Path]:
    """Maps every tensor name to the file that holds it (single file or sharded index)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: malformed index ({err})") from None
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{directory}: neither model.safetensors nor model.safetensors.index.json found")
    with safe_open(single, framework="flax") as f:
        return {name: single for name in f.keys()}


def _populate(module_fn: Callable[[], nnx.Module], directory: Path, prefix: str, dtype,
              optional: Callable[[str], bool] = lambda name: False) -> nnx.Module:
    """Builds the module abstractly, then fills every parameter from the checkpoint."""
    abstract = nnx.eval_shape(module_fn)
    graphdef, state = nnx.split(abstract)
    files = _safetensors_files(directory)
    handles: dict[Path, object] = {}
    filled = []
    try:
        for path, var in nnx.to_flat_state(state):
            shape = tuple(var.get_value().shape)
            torch_name, from_torch, _ = _tensor_spec(path, shape)
            full_name = torch_name if torch_name == "lm_head.weight" else prefix + torch_name
            if full_name not in files:
                if optional(full_name):
                    continue
                raise CheckpointError(f"{directory}: tensor {full_name!r} is missing from the checkpoint")
            file = files[full_name]
            if file not in handles:
                handles[file] = safe_open(file, framework="flax").__enter__()
            tensor = handles[file].get_tensor(full_name)
            try:
                value = from_torch(tensor)
            except (TypeError, ValueError):
                value = None
            if value is None or tuple(value.shape) != shape:
                raise CheckpointError(
                    f"{file}: tensor {full_name!r} has shape {tuple(tensor.shape)}, which does not fit the "
                    f"config (expected {shape} in our layout)"
                )
            filled.append((path, var.replace(jnp.asarray(value, dtype))))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def load_target(path: str | Path, dtype="float32") -> Target:
    """Loads a Qwen3 / Llama target from an HF directory (config.json + safetensors)."""
    directory = Path(path)
    config = load_target_config(directory)
    dt = _dtype(dtype)
    return _populate(lambda: Target(config, dtype=dt, rngs=nnx.Rngs(0)), directory, "model.", dt)


def load_drafter(path: str | Path, dtype="float32") -> Drafter:
    """Loads a DFlash drafter from a z-lab directory (config.json + model.safetensors).

    An Orbax training checkpoint directory (see ``dflash_jax.training``) is accepted too.
    """
    directory = Path(path)
    if not (directory / "config.json").exists():
        from dflash_jax.io.orbax import load_drafter_from_orbax  # Orbax is slow to import: only when needed

        return load_drafter_from_orbax(directory, dtype=dtype)
    config = load_drafter_config(directory)
    dt = _dtype(dtype)
    return _populate(lambda: Drafter(config, dtype=dt, rngs=nnx.Rngs(0)), directory, "", dt)


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def _tensors(module: nnx.Module, prefix: str, dtype) -> dict[str, jax.Array]:
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        value = var.get_value()
        name, _, to_torch = _tensor_spec(path, tuple(value.shape))
        full = name if name == "lm_head.weight" else prefix + name
        out[full] = jnp.asarray(to_torch(value), dtype if dtype is not None else value.dtype)
    return out


def _save(module: nnx.Module, config: dict, path: str | Path, prefix: str, dtype) -> None:
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    dt = None if dtype is None else _dtype(dtype)
    tensors = _tensors(module, prefix, dt)
    config["torch_dtype"] = str(next(iter(tensors.values())).dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def save_drafter(drafter: Drafter, path: str | Path, dtype=None) -> None:
    """Writes the z-lab format (config.json + model.safetensors), readable by the reference,
    vLLM and SGLang."""
    _save(drafter, drafter_config_to_dict(drafter.config), path, "", dtype)


def save_target(target: Target, path: str | Path, dtype=None) -> None:
    """Writes an HF directory for a target (used for the shipped demo model and tests)."""
    _save(target, target_config_to_dict(target.config), path, "model.", dtype)
