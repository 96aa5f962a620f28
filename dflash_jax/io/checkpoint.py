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
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from dflash_jax.models.drafter import Drafter
from dflash_jax.models.config import (
    TargetConfig,
    drafter_config_to_dict,
    load_drafter_config,
    load_target_config,
    read_config_json,
    target_config_to_dict,
)
from dflash_jax.models.dflash2 import DFlash2Config, DFlash2Drafter, dflash2_config_to_dict
from dflash_jax.models.hybrid import HybridTarget
from dflash_jax.models.hybrid_config import is_hybrid_config, load_hybrid_config
from dflash_jax.io.hybrid_checkpoint import hybrid_ignored, hybrid_tensor_spec
from dflash_jax.models.target import Target
from dflash_jax.io import moe_checkpoint
from dflash_jax.io.dflash2_checkpoint import read_other_config
from dflash_jax.io.errors import CheckpointError, FiniteCheck, parse_dtype, some_names


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
    if leaf in ("gate_proj", "up_proj", "down_proj", "fc", "lm_head", "kernel_projection", "hidden_projection"):
        # ours [in, out]
        return (f"{name}.weight", lambda t: t.T, lambda x: x.T)
    if leaf in ("base_kernel", "predecessor_codebook", "successor_codebook"):  # DFlash2: plain tensors
        return (name, same, same)
    if leaf == "embed_tokens":
        return (f"{name}.weight", same, same)
    if leaf in ("weight", "bias", "sinks"):  # RMSNorm; a router (stored as torch's); gpt-oss attention sinks
        return (name, same, same)
    if leaf in ("qkv_proj", "qkv_bias", "gate_up_proj", "gate_up_bias", "context_kv_proj", "context_kv_bias"):
        raise ValueError(f"parameter {name} is in a serving layout (runtime.serving_params, an "
                         "Engine's engine.target / engine.drafter); checkpoints "
                         "hold the separate projections: save the module that was passed to the Engine")
    raise KeyError(f"no checkpoint name for parameter {name}")


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Safetensors dtypes a weight may be stored in (cast to the dtype asked for); integer, boolean and
# 8-bit tensors would need a dequantization we do not implement.
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# Tensors a loader may find next to the weights and ignore: the RoPE buffers of older Llama
# checkpoints (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_index(index: Path) -> dict[str, Path]:
    """The tensor -> shard map of a sharded checkpoint, every shard checked to exist."""
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{index}: malformed index ({type(err).__name__}: {err})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: malformed index (no 'weight_map' object of tensor name -> shard file)")
    files = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).name != file:
            raise CheckpointError(f"{index}: malformed index (tensor {name!r} maps to {file!r}, not a shard file name "
                                  "in the same directory)")
        shard = index.parent / file
        if not shard.is_file():
            raise CheckpointError(f"{index}: shard {file!r} (of tensor {name!r}) is missing")
        files[name] = shard
    return files


def _open(file: Path):
    """An open safetensors file; a damaged or truncated one is a ``CheckpointError`` naming it."""
    try:
        return safe_open(file, framework="numpy").__enter__()
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from None


def _safetensors_files(directory: Path) -> dict[str, Path]:
    """Maps every tensor name to the file that holds it (single file or sharded index)."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory")
    index = directory / INDEX
    if index.exists():
        return _read_index(index)
    single = directory / SINGLE
    if not single.exists():
        raise CheckpointError(f"{directory}: neither {SINGLE} nor {INDEX} found")
    handle = _open(single)
    try:
        return {name: single for name in handle.keys()}
    finally:
        handle.__exit__(None, None, None)


def _torch_shape(spec_to_torch: Convert, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(jax.eval_shape(spec_to_torch, jax.ShapeDtypeStruct(shape, jnp.float32)).shape)


def _populate(module_fn: Callable[[], nnx.Module], directory: Path, prefix: str, dtype,
              ignored: Callable[[str], bool] = lambda name: False, config: TargetConfig | None = None,
              spec: Callable[[tuple, tuple[int, ...]], tuple[str, Convert, Convert]] = _tensor_spec,
              check_finite: bool = True) -> nnx.Module:
    """Builds the module abstractly, then fills every parameter from the checkpoint.

    Every tensor is checked in the torch layout (``[out, in]``) before it is reshaped into ours, so
    a transposed or reshaped tensor of the right size is refused; so are non-float tensors and tensors
    of the checkpoint that no parameter uses (``ignored`` names excepted). ``spec``: how a parameter
    is named and laid out in torch (``_tensor_spec``'s signature). ``check_finite``: a floating tensor
    holding NaN or inf is refused too (``FiniteCheck``: one reduction per tensor where it was placed).
    """
    abstract = nnx.eval_shape(module_fn)
    graphdef, state = nnx.split(abstract)
    files = _safetensors_files(directory)
    handles: dict[Path, object] = {}
    filled, used = [], set()
    finite = FiniteCheck() if check_finite else None

    def read(full_name: str, want: tuple[int, ...], dtypes: tuple[str, ...] = _FLOAT_DTYPES) -> jax.Array:
        """The checkpoint's tensor ``full_name``, checked to be of torch shape ``want`` and a dtype of ``dtypes``."""
        if full_name not in files:
            raise CheckpointError(f"{directory}: tensor {full_name!r} is missing from the checkpoint")
        used.add(full_name)
        file = files[full_name]
        if file not in handles:
            handles[file] = _open(file)
        try:
            view = handles[file].get_slice(full_name)
            stored_shape, stored_dtype = tuple(view.get_shape()), view.get_dtype()
        except SafetensorError as err:
            raise CheckpointError(f"{file}: tensor {full_name!r} cannot be read ({err})") from None
        if stored_shape != tuple(want):
            raise CheckpointError(
                f"{file}: tensor {full_name!r} has shape {stored_shape}, which does not fit the config "
                f"(expected {tuple(want)}, torch's [out, in] layout)"
            )
        if stored_dtype not in dtypes:
            kind = "weights must be floating point" if dtypes == _FLOAT_DTYPES else "expected"
            raise CheckpointError(f"{file}: tensor {full_name!r} has dtype {stored_dtype}; {kind} "
                                  f"({', '.join(dtypes)})")
        try:
            array = handles[file].get_tensor(full_name)
        except SafetensorError as err:
            raise CheckpointError(f"{file}: tensor {full_name!r} cannot be read ({err})") from None
        tensor = jnp.asarray(array)
        if finite is not None:
            finite.add(file, full_name, tensor, host=array, as_dtype=dtype)
        return tensor

    try:
        for path, var in nnx.to_flat_state(state):
            shape = tuple(var.get_value().shape)
            keys = [str(p) for p in path]
            if config is not None and moe_checkpoint.is_expert_param(keys):
                name = prefix + ".".join(keys)
                if keys[-1] in moe_checkpoint.INTEGER_LEAVES:  # MXFP4: kept 4-bit, as stored
                    filled.append((path, var.replace(jnp.asarray(read(name, shape, ("U8",))))))
                    continue
                has = files.__contains__
                if not all(map(has, moe_checkpoint.expected_names(config, name, shape, has))):
                    missing = [n for n in moe_checkpoint.expected_names(config, name, shape, has) if not has(n)]
                    raise CheckpointError(f"{directory}: tensor {missing[0]!r} is missing from the checkpoint"
                                          + (f" ({len(missing)} expert tensors in all)" if len(missing) > 1 else ""))
                value = moe_checkpoint.read_expert_param(config, name, shape, read, has)
                filled.append((path, var.replace(jnp.asarray(value, dtype))))
                continue
            torch_name, from_torch, to_torch = spec(path, shape)
            full_name = torch_name if torch_name == "lm_head.weight" else prefix + torch_name
            tensor = read(full_name, _torch_shape(to_torch, shape))
            filled.append((path, var.replace(jnp.asarray(from_torch(tensor), dtype))))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    unused = sorted(n for n in files if n not in used and not n.endswith(_IGNORED_SUFFIXES) and not ignored(n))
    if unused:
        where = files[unused[0]] if len({files[n] for n in unused}) == 1 else directory
        raise CheckpointError(
            f"{where}: the checkpoint holds tensors that the config uses nowhere: {some_names(unused)} "
            "(does config.json describe this checkpoint: num_hidden_layers, tie_word_embeddings, biases?)"
        )
    if finite is not None:
        finite.check()
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def load_target(path: str | Path, dtype="float32", check_finite: bool = True) -> Target | HybridTarget:
    """Loads a Qwen3 / Llama target, or a hybrid Qwen3.5 one (``models.hybrid``), from an HF
    directory (config.json + safetensors). ``check_finite``: a weight holding NaN or inf is a
    ``CheckpointError`` naming the file and the tensor (False loads it as it is)."""
    directory = _directory(path, "load_target")
    if not (directory / "config.json").is_file() and _is_training_run(directory):
        raise CheckpointError(f"{directory}: a drafter's training run, not a target (load it with load_drafter)")
    data = read_config_json(directory / "config.json")
    if _is_drafter_config(data):
        raise CheckpointError(f"{directory / 'config.json'}: a DFlash drafter's config, not a target's "
                              "(load it with load_drafter)")
    if is_hybrid_config(data):
        config = load_hybrid_config(directory)
        dt = parse_dtype(dtype)
        return _populate(lambda: HybridTarget(config, dtype=dt, rngs=nnx.Rngs(0)), directory, config.weight_prefix,
                         dt, hybrid_ignored(config), config, spec=lambda p, s: hybrid_tensor_spec(p, s, _tensor_spec),
                         check_finite=check_finite)
    config = load_target_config(directory)
    dt = parse_dtype(dtype)
    tied = (lambda name: name == "lm_head.weight") if config.tie_word_embeddings else (lambda name: False)
    target = _populate(lambda: Target(config, dtype=dt, rngs=nnx.Rngs(0)), directory, "model.", dt, tied, config,
                       check_finite=check_finite)
    if config.tie_word_embeddings:
        _check_tied_head(directory)
    return target


def _check_tied_head(directory: Path) -> None:
    """A tied head reads the embedding table: a saved ``lm_head.weight`` must be a copy of it (a
    different one means the config's ``tie_word_embeddings: true`` does not describe this checkpoint)."""
    files = _safetensors_files(directory)
    if "lm_head.weight" not in files:
        return
    handles = {file: _open(file) for file in {files["lm_head.weight"], files["model.embed_tokens.weight"]}}
    try:
        head = handles[files["lm_head.weight"]].get_tensor("lm_head.weight")
        table = handles[files["model.embed_tokens.weight"]].get_tensor("model.embed_tokens.weight")
    except SafetensorError as err:
        raise CheckpointError(f"{files['lm_head.weight']}: tensor 'lm_head.weight' cannot be read ({err})") from None
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    if head.shape != table.shape or not bool(jnp.array_equal(head, table)):
        raise CheckpointError(
            f"{files['lm_head.weight']}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', but "
            f"{directory / 'config.json'} sets tie_word_embeddings: true (the head would be the embedding table)"
        )


def _directory(path, where: str) -> Path:
    """``path`` as an existing directory; else an error naming it (a model is a directory, not a file in it)."""
    if not isinstance(path, (str, Path)) and not hasattr(path, "__fspath__"):
        raise TypeError(f"{where}: path must be a directory path (str or Path), got {type(path).__name__}")
    directory = Path(path)
    if directory.is_file():
        raise FileNotFoundError(f"{directory}: a file, not a directory (pass the directory that holds config.json)")
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory")
    return directory


def _is_drafter_config(data: dict) -> bool:
    """Whether a config.json describes a DFlash or DFlash2 drafter rather than a target."""
    return ("dflash_config" in data or "num_target_layers" in data or "speculators_model_type" in data
            or any("DFlash" in str(a) or "Speculator" in str(a) for a in data.get("architectures") or ()))


def _is_training_run(directory: Path) -> bool:
    """Whether ``directory`` is a run directory, its ``checkpoints/`` or a ``checkpoints/<step>`` (as
    ``io.orbax`` resolves them)."""
    p = directory.absolute()
    return ((p / "drafter_config.json").exists()
            or (p.name == "checkpoints" and (p.parent / "drafter_config.json").exists())
            or (p.name.isdigit() and p.parent.name == "checkpoints"
                and (p.parent.parent / "drafter_config.json").exists()))


def load_drafter(path: str | Path, dtype="float32", check_finite: bool = True) -> Drafter:
    """Loads a DFlash drafter from a z-lab directory (config.json + model.safetensors), or a DFlash2
    drafter from the authors' DFlash2 layout or a speculators checkpoint (``io.dflash2_checkpoint``).

    An Orbax training checkpoint directory (see ``dflash_jax.training``) is accepted too.
    ``check_finite``: a weight holding NaN or inf is a ``CheckpointError`` naming the file and the
    tensor (False loads it as it is).
    """
    directory = _directory(path, "load_drafter")
    if not (directory / "config.json").exists():
        if not _is_training_run(directory):
            raise CheckpointError(
                f"{directory}: not a drafter: neither a z-lab drafter directory (no config.json) nor a training run "
                "(no drafter_config.json here, in its parent or grandparent)"
            )
        from dflash_jax.io.orbax import load_drafter_from_orbax  # Orbax is slow to import: only when needed

        return load_drafter_from_orbax(directory, dtype=dtype, check_finite=check_finite)
    dt = parse_dtype(dtype)
    data = read_config_json(directory / "config.json")
    if not _is_drafter_config(data) and "num_hidden_layers" in data:
        raise CheckpointError(f"{directory / 'config.json'}: a target model's config, not a drafter's (no "
                              "num_target_layers or dflash_config; load it with load_target)")
    dflash2 = read_other_config(directory)  # a DFlash2 drafter (the authors' or the speculators layout)
    if dflash2 is not None:
        config2, skipped = dflash2
        return _populate(lambda: DFlash2Drafter(config2, dtype=dt, rngs=nnx.Rngs(0)), directory, "", dt, skipped,
                         check_finite=check_finite)
    config = load_drafter_config(directory)
    return _populate(lambda: Drafter(config, dtype=dt, rngs=nnx.Rngs(0)), directory, "", dt,
                     check_finite=check_finite)


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def _tensors(module: nnx.Module, prefix: str, dtype) -> dict[str, jax.Array]:
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        value = var.get_value()
        keys = [str(p) for p in path]
        if moe_checkpoint.is_expert_param(keys):
            for name, tensor in moe_checkpoint.expert_tensors(module.config, prefix + ".".join(keys), value).items():
                integer = jnp.issubdtype(tensor.dtype, jnp.integer)
                out[name] = jnp.asarray(tensor, None if dtype is None or integer else dtype)
            continue
        name, _, to_torch = _tensor_spec(path, tuple(value.shape))
        full = name if name == "lm_head.weight" else prefix + name
        out[full] = jnp.asarray(to_torch(value), dtype if dtype is not None else value.dtype)
    return out


def _remove_stale_index(directory: Path) -> None:
    """Removes a sharded checkpoint's index and the shards it names, so that the single file written
    next is what loads (a loader reads the index first)."""
    index = directory / INDEX
    if not index.exists():
        return
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = {f for f in weight_map.values() if isinstance(f, str)}
    except (OSError, ValueError, AttributeError):  # unreadable: its shards stay, unreferenced
        shards = set()
    index.unlink()
    for name in sorted(shards):
        shard = directory / name
        if Path(name).name == name and name.endswith(".safetensors") and name != SINGLE and shard.is_file():
            shard.unlink()


def _save(module: nnx.Module, config: dict, path: str | Path, prefix: str, dtype) -> None:
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    dt = None if dtype is None else parse_dtype(dtype)
    tensors = _tensors(module, prefix, dt)
    config["torch_dtype"] = str(next(iter(tensors.values())).dtype)
    _remove_stale_index(directory)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / SINGLE), metadata={"format": "pt"})


def save_drafter(drafter: Drafter, path: str | Path, dtype=None) -> None:
    """Writes the z-lab format (config.json + model.safetensors), readable by the reference,
    vLLM and SGLang (a DFlash2 drafter: the authors' DFlash2 layout, ``io.dflash2_checkpoint``)."""
    if not isinstance(drafter, Drafter):
        raise TypeError("save_drafter: drafter must be a Drafter (dflash_jax.load_drafter), got "
                        f"{type(drafter).__name__}"
                        + (" (save a target with save_target)" if isinstance(drafter, (Target, HybridTarget)) else ""))
    to_dict = dflash2_config_to_dict if isinstance(drafter.config, DFlash2Config) else drafter_config_to_dict
    _save(drafter, to_dict(drafter.config), path, "", dtype)


def save_target(target: Target, path: str | Path, dtype=None) -> None:
    """Writes an HF directory for a target (used for the shipped demo model and tests)."""
    if isinstance(target, Drafter):
        raise TypeError(f"save_target: target must be a Target (dflash_jax.load_target), got {type(target).__name__} "
                        "(save a drafter with save_drafter)")
    _save(target, target_config_to_dict(target.config), path, "model.", dtype)


def shard_safetensors(directory: str | Path, max_shard_bytes: int) -> list[Path]:
    """Splits ``directory/model.safetensors`` into ``model-0000k-of-0000n.safetensors`` files of at most
    ``max_shard_bytes`` of tensor data each (tensors in name order, never split) plus
    ``model.safetensors.index.json``, the layout that HF loaders and ``load_target`` read; removes the
    single file. A checkpoint that fits in one shard stays one file."""
    directory = Path(directory)
    single = directory / SINGLE
    handle = _open(single)
    try:
        metadata = handle.metadata() or {"format": "pt"}
        tensors = {n: handle.get_tensor(n) for n in sorted(handle.keys())}
    finally:
        handle.__exit__(None, None, None)
    names = list(tensors)
    groups, current, size = [], [], 0
    for name in names:
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    groups.append(current)
    if len(groups) == 1:
        return [single]
    files, weight_map = [], {}
    for k, group in enumerate(groups, 1):
        fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(directory / fname), metadata=metadata)
        weight_map.update({n: fname for n in group})
        files.append(directory / fname)
    total = sum(t.nbytes for t in tensors.values())
    (directory / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    single.unlink()
    return files
