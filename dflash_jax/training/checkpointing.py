"""Training checkpoints (Orbax) and their export to the z-lab format.

A run directory holds::

    config.yaml            the resolved TrainConfig
    drafter_config.json    the drafter's z-lab config.json (shape, block size, mask id, taps)
    checkpoints/<step>/    params (float32 drafter weights), opt_state, data (grain iterator
                           state, one file per host), meta (step counters, JSON)
    metrics.jsonl, tb/     observability

Orbax writes every checkpoint into a temporary directory and renames it into place only when all
of it is written (``commit_success`` / atomic rename), so a save interrupted by a crash leaves the
previous checkpoints intact and the partial one invisible to ``latest_step``; the next save (or an
explicit cleanup on startup) removes the leftover temporary directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from dflash_jax.drafter import Drafter
from dflash_jax.model_config import DrafterConfig, drafter_config_from_dict, drafter_config_to_dict

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DRAFTER_CONFIG = "drafter_config.json"
CHECKPOINTS = "checkpoints"


class CheckpointError(ValueError):
    """A checkpoint cannot be used as asked (unreadable, or a step that contradicts its path)."""


def step_dirs(run_dir: str | Path) -> list[int]:
    """The finalized step directories of a run, found without Orbax and without creating anything
    (an interrupted save's temporary directory has a non-numeric name)."""
    directory = Path(run_dir) / CHECKPOINTS
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def _unreadable(directory: Path, step: int, err: Exception) -> CheckpointError:
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


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    """An Orbax ``CheckpointManager`` over ``<run>/checkpoints`` with the items of a training run."""

    def __init__(self, run_dir: str | Path, *, keep: int = 3, async_save: bool = True):
        self.run_dir = Path(run_dir).absolute()
        self.directory = self.run_dir / CHECKPOINTS
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_partial_saves()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "params": ocp.StandardCheckpointHandler(),
                "opt_state": ocp.StandardCheckpointHandler(),
                "data": grain.checkpoint.CheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def _remove_partial_saves(self) -> None:
        """Deletes temporary directories left by an interrupted save (never a finalized step)."""
        if jax.process_index() != 0:
            return
        for child in self.directory.iterdir():
            if child.is_dir() and ".orbax-checkpoint-tmp" in child.name:
                shutil.rmtree(child, ignore_errors=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, data_iter, meta: dict[str, Any]) -> bool:
        args = dict(
            params=ocp.args.StandardSave(state.params),
            opt_state=ocp.args.StandardSave(state.opt_state),
            meta=ocp.args.JsonSave(meta),
        )
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iter)
        return self.manager.save(step, args=ocp.args.Composite(**args), force=True)

    def restore(self, step: int, state, data_iter) -> tuple[Any, dict[str, Any]]:
        """``(state, meta)`` at ``step``; ``state`` gives the structure, dtypes and shardings, and
        ``data_iter`` (if any) is set to its saved position in place."""
        args = dict(
            params=ocp.args.StandardRestore(_abstract(state.params)),
            opt_state=ocp.args.StandardRestore(_abstract(state.opt_state)),
            meta=ocp.args.JsonRestore(),
        )
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as err:  # damaged files fail in Orbax/TensorStore with untyped errors (plain Exception)
            raise _unreadable(self.directory, step, err) from err
        new_state = type(state)(
            params=restored.params,
            opt_state=restored.opt_state,
            step=jnp.asarray(restored.meta["micro_step"], jnp.int32),
        )
        return new_state, dict(restored.meta)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def save_drafter_config(run_dir: str | Path, config: DrafterConfig) -> None:
    path = Path(run_dir) / DRAFTER_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(drafter_config_to_dict(config), indent=2))


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
    return drafter_config_from_dict(json.loads(path.read_text()), str(path))


def load_drafter_from_orbax(ckpt_dir: str | Path, step: int | None = None, dtype="float32") -> Drafter:
    """The drafter of a training run (latest checkpoint unless ``step`` is given).

    ``ckpt_dir`` may be the run directory, its ``checkpoints/`` directory or one ``checkpoints/<step>``.
    """
    run_dir, path_step = _resolve(ckpt_dir)
    if step is not None and path_step is not None and step != path_step:
        raise CheckpointError(f"{ckpt_dir} is the checkpoint of step {path_step}, but step {step} was asked for")
    step = step if step is not None else path_step
    config = load_drafter_config_from_run(run_dir)
    dt = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    abstract = nnx.eval_shape(lambda: Drafter(config, dtype=jnp.float32, rngs=nnx.Rngs(0)))
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
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
            params,
        )
        try:
            restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
        except Exception as err:  # as in Checkpointer.restore: damaged files give untyped errors
            raise _unreadable(run_dir / CHECKPOINTS, step, err) from err
    finally:
        manager.close()
    loaded = jax.tree.map(lambda x: jnp.asarray(x, dt), restored.params)
    return nnx.merge(graphdef, loaded, _concrete_rest(config, rest))


def _concrete_rest(config: DrafterConfig, rest):
    """The non-parameter leaves (RoPE inverse frequencies) as concrete arrays."""
    from dflash_jax.layers import rope_inv_freq

    inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    return jax.tree.map(lambda x: inv if getattr(x, "shape", None) == inv.shape else x, rest)


def export_checkpoint(ckpt_dir: str | Path, output: str | Path, *, step: int | None = None, dtype="bfloat16") -> Path:
    """Writes the z-lab format (config.json + model.safetensors) of a training checkpoint."""
    from dflash_jax.checkpoint import save_drafter

    drafter = load_drafter_from_orbax(ckpt_dir, step=step, dtype="float32")
    save_drafter(drafter, output, dtype=dtype)
    return Path(output)
