"""Reading a drafter out of a training run's Orbax checkpoints.

A run directory (``dflash_jax.training``) holds ``drafter_config.json`` (the z-lab config.json of the
drafter) and ``checkpoints/<step>/params`` (float32 weights); ``load_drafter_from_orbax`` restores one
step's params into a ``Drafter`` without the optimizer state. ``io.checkpoint.load_drafter`` falls
back to it for a directory without a ``config.json``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from dflash_jax.io.errors import CheckpointError, FiniteCheck, parse_dtype, some_names
from dflash_jax.models.config import DrafterConfig, drafter_config_from_dict, read_config_json
from dflash_jax.models.dflash2 import DFlash2Config, DFlash2Drafter, dflash2_config_from_dict, is_dflash2_config
from dflash_jax.models.drafter import Drafter
from dflash_jax.ops.rope import rope_inv_freq

DRAFTER_CONFIG = "drafter_config.json"
CHECKPOINTS = "checkpoints"


def step_dirs(run_dir: str | Path) -> list[int]:
    """The finalized step directories of a run, found without Orbax and without creating anything
    (an interrupted save's temporary directory has a non-numeric name)."""
    directory = Path(run_dir) / CHECKPOINTS
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def unreadable_checkpoint(directory: Path, step: int, err: Exception) -> CheckpointError:
    reason = (str(err).splitlines() or [""])[0].split(" See full")[0][:160]
    earlier = [s for s in step_dirs(directory.parent) if s < step]
    bad = directory / str(step)
    if "do not match" in reason:  # Orbax's tree-structure mismatch: readable, but another state's shape
        return CheckpointError(f"{bad}: checkpoint step {step} does not fit the drafter and optimizer of this "
                               f"config ({reason})")
    if earlier:
        hint = (f"the earlier checkpoints (steps {', '.join(map(str, earlier))}) are untouched: move {bad} out of "
                f"{directory} to resume from step {earlier[-1]}, or export one with --step")
    else:
        hint = "there is no earlier checkpoint"
    return CheckpointError(f"{bad}: checkpoint step {step} cannot be read ({type(err).__name__}: {reason}); {hint}")


def _resolve(path: str | Path) -> tuple[Path, int | None]:
    """``(run_dir, step)`` from a run directory, its ``checkpoints`` directory or a step directory."""
    p = Path(path).absolute()
    if (p / DRAFTER_CONFIG).exists():
        return p, None
    if p.name == CHECKPOINTS and (p.parent / DRAFTER_CONFIG).exists():
        return p.parent, None
    if p.name.isdigit() and p.parent.name == CHECKPOINTS and (p.parent.parent / DRAFTER_CONFIG).exists():
        return p.parent.parent, int(p.name)
    raise FileNotFoundError(
        f"{path}: not a training run directory (no {DRAFTER_CONFIG} here, in its parent, or grandparent)"
    )


def load_drafter_config_from_run(run_dir: str | Path) -> DrafterConfig:
    path = Path(run_dir) / DRAFTER_CONFIG
    data = read_config_json(path)
    if is_dflash2_config(data):
        return dflash2_config_from_dict(data, str(path))
    return drafter_config_from_dict(data, str(path))


def load_drafter_from_orbax(ckpt_dir: str | Path, step: int | None = None, dtype="float32",
                            check_finite: bool = True) -> Drafter:
    """The drafter of a training run (latest checkpoint unless ``step`` is given).

    ``ckpt_dir`` may be the run directory, its ``checkpoints/`` directory or one ``checkpoints/<step>``.
    ``check_finite``: a parameter holding NaN or inf is a ``CheckpointError`` naming the step and the
    parameter (False loads it as it is).
    """
    run_dir, path_step = _resolve(ckpt_dir)
    if step is not None and path_step is not None and step != path_step:
        raise CheckpointError(f"{ckpt_dir} is the checkpoint of step {path_step}, but step {step} was asked for")
    step = step if step is not None else path_step
    config = load_drafter_config_from_run(run_dir)
    dt = parse_dtype(dtype)
    cls = DFlash2Drafter if isinstance(config, DFlash2Config) else Drafter
    abstract = nnx.eval_shape(lambda: cls(config, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    manager = ocp.CheckpointManager(
        run_dir / CHECKPOINTS, item_handlers={"params": ocp.StandardCheckpointHandler()}
    )
    try:
        if step is None:
            step = manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"{run_dir / CHECKPOINTS}: no finished checkpoint")
        elif step not in manager.all_steps():
            raise FileNotFoundError(f"{run_dir / CHECKPOINTS}: no checkpoint of step {step} "
                                    f"(steps: {list(manager.all_steps()) or 'none'})")
        _check_params_fit(manager, step, params, run_dir)
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
            params,
        )
        try:
            restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
        except Exception as err:  # as in Checkpointer.restore: damaged files give untyped errors
            raise unreadable_checkpoint(run_dir / CHECKPOINTS, step, err) from err
    finally:
        manager.close()
    if check_finite:
        finite = FiniteCheck("parameter")
        for name, leaf in _flat_params(restored.params).items():
            finite.add(run_dir / CHECKPOINTS / str(step), name, leaf, as_dtype=dt)
        finite.check()
    loaded = jax.tree.map(lambda x: jnp.asarray(x, dt), restored.params)
    return nnx.merge(graphdef, loaded, _concrete_rest(config, rest))


def _flat_params(tree) -> dict[str, object]:
    """Parameter name (``layers.0.self_attn.k_proj``) -> leaf."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value"): leaf for path, leaf in flat}


def _param_shapes(tree) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, for the abstract params or Orbax's metadata."""
    return {name: tuple(leaf.shape) for name, leaf in _flat_params(tree).items()}


def _check_params_fit(manager: ocp.CheckpointManager, step: int, params, run_dir: Path) -> None:
    """Refuses a step whose stored parameters are not the ones ``drafter_config.json`` builds, naming the
    parameter: Orbax's own refusal names neither it nor the config."""
    try:
        stored = _param_shapes(manager.item_metadata(step)["params"])
    except Exception:  # unreadable metadata: left to the restore, whose error names the damage
        return
    wanted = _param_shapes(params)
    config = run_dir / DRAFTER_CONFIG
    where = run_dir / CHECKPOINTS / str(step)
    for name, shape in wanted.items():
        if name not in stored:
            raise CheckpointError(f"{where}: parameter {name!r} is missing from the checkpoint (does {config} "
                                  "describe this run?)")
        if stored[name] != shape:
            raise CheckpointError(f"{where}: parameter {name!r} has shape {stored[name]}, which does not fit "
                                  f"{config} (expected {shape})")
    if unused := sorted(set(stored) - set(wanted)):
        raise CheckpointError(f"{where}: the checkpoint holds parameters that {config} uses nowhere: "
                              f"{some_names(unused)}")


def _concrete_rest(config: DrafterConfig, rest):
    """The non-parameter leaves (RoPE inverse frequencies) as concrete arrays."""
    inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    return jax.tree.map(lambda x: inv if getattr(x, "shape", None) == inv.shape else x, rest)
