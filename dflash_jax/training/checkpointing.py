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

from dflash_jax.models.config import DrafterConfig, drafter_config_to_dict
from dflash_jax.models.dflash2 import DFlash2Config, dflash2_config_to_dict
from dflash_jax.io.checkpoint import save_drafter
from dflash_jax.io.orbax import CHECKPOINTS, DRAFTER_CONFIG, load_drafter_from_orbax, unreadable_checkpoint

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
            raise unreadable_checkpoint(self.directory, step, err) from err
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
    to_dict = dflash2_config_to_dict if isinstance(config, DFlash2Config) else drafter_config_to_dict
    path.write_text(json.dumps(to_dict(config), indent=2))


def export_checkpoint(ckpt_dir: str | Path, output: str | Path, *, step: int | None = None, dtype="bfloat16") -> Path:
    """Writes the z-lab format (config.json + model.safetensors) of a training checkpoint."""
    drafter = load_drafter_from_orbax(ckpt_dir, step=step, dtype="float32")
    save_drafter(drafter, output, dtype=dtype)
    return Path(output)
