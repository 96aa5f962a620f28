"""Mesh and shardings of a training run: batch over (``data``, ``fsdp``), the frozen target
tensor-parallel over ``tensor``, the drafter's weights (and so its optimizer state) FSDP-sharded
over ``fsdp`` on their ``embed``/``taps`` dimension and tensor-parallel like the target.

Parameters are placed by their logical axis names (the ``axes`` metadata of every ``nnx.Param``)
through ``dflash_jax.sharding``; a dimension that the mesh axes do not divide stays replicated.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax import sharding as project_sharding
from dflash_jax.training.config import MeshConfig
from dflash_jax.training.trainer import TrainState

MESH_AXES = project_sharding.MESH_AXES
BATCH = ("data", "fsdp")

# Logical axis -> mesh axes (``dflash_jax.sharding``'s rules). The drafter uses the project's
# defaults (model dim ``embed``/``taps`` on ``fsdp``, heads/MLP on ``tensor``); the frozen target is
# tensor-parallel only (it has no optimizer state to shard, and FSDP would all-gather it every step).
DRAFTER_RULES: dict[str, tuple[str, ...]] = dict(project_sharding.DEFAULT_RULES)
TARGET_RULES: dict[str, tuple[str, ...]] = dict(project_sharding.DEFAULT_RULES, embed=(), taps=())


def maybe_initialize_distributed(config: MeshConfig) -> None:
    """``jax.distributed.initialize()`` (multi-host) when configured; must run before any other JAX
    call touches the backend (``setup`` calls it first)."""
    if not config.distributed:
        return
    try:
        jax.distributed.initialize()
    except RuntimeError as err:  # already initialized by the launcher
        if "already" not in str(err).lower():
            raise


def make_mesh(config: MeshConfig, devices=None) -> Mesh:
    """The (data, fsdp, tensor) mesh of ``config`` (``-1``: the remaining devices), Auto axes."""
    return project_sharding.make_mesh(config, devices)


def state_shardings(state: nnx.State, mesh: Mesh, kind: str) -> Any:
    """A tree of ``NamedSharding`` matching ``state`` (an ``nnx.State``) from each variable's ``axes``
    (``kind``: "target" or "drafter" rules); variables without axes are replicated."""
    rules = TARGET_RULES if kind == "target" else DRAFTER_RULES

    def one(var):
        if isinstance(var, nnx.Variable):
            value = var.get_value()
            axes = var.get_metadata().get("axes")
            if not axes or len(axes) != np.ndim(value):
                return var.replace(NamedSharding(mesh, P()))
            return var.replace(project_sharding.named_sharding(axes, np.shape(value), mesh, rules))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def tree_shardings(tree: Any) -> Any:
    """The shardings of a tree of (committed) arrays."""
    return jax.tree.map(lambda x: x.sharding, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Assembles host-local batches into global arrays sharded over (data, fsdp)."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local.items()}


def on_mesh(tree: Any, mesh: Mesh) -> Any:
    """Leaves already on the mesh keep their sharding; the others (scalars such as optimizer
    counts) are replicated over it."""
    rep = replicated(mesh)

    def place(x):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh == mesh:
            return x
        return jax.device_put(x, rep)

    return jax.tree.map(place, tree)


def opt_state_shardings(abstract_opt_state: Any, params_shardings: Any, mesh: Mesh) -> Any:
    """Shardings of an optimizer state: every sub-tree shaped like the parameters (Adam's moments,
    MultiSteps' accumulator) gets the parameters' shardings; everything else is replicated."""
    p_def = jax.tree.structure(params_shardings)
    p_leaves = jax.tree.leaves(params_shardings)
    rep = replicated(mesh)

    def is_param_tree(x):
        try:
            return jax.tree.structure(x) == p_def
        except Exception:  # noqa: BLE001
            return False

    def assign(x):
        if is_param_tree(x):
            return jax.tree.unflatten(p_def, p_leaves)
        return rep

    return jax.tree.map(assign, abstract_opt_state, is_leaf=is_param_tree)


def train_state_shardings(params: Any, tx: Any, mesh: Mesh) -> Any:
    """A ``trainer.TrainState``'s shardings for the drafter's ``params`` (arrays or their shapes) and the
    optimizer ``tx``: the weights by their logical axes, the optimizer's moments as the weights, the step
    replicated."""
    p_sh = state_shardings(params, mesh, "drafter")
    return TrainState(p_sh, opt_state_shardings(jax.eval_shape(tx.init, params), p_sh, mesh), replicated(mesh))


def jit_train_step(step: Any, mesh: Mesh, state_sh: Any, target_sh: Any) -> Any:
    """``step(state, target_params, batch) -> (state, metrics)`` jitted on ``mesh``: the state donated and
    kept in ``state_sh``, the batch over (data, fsdp), the metrics replicated. Traced under the mesh, its
    attention kernels run per device on their shards (rows over data and fsdp, heads over tensor): a Pallas
    call left to XLA's partitioner would be gathered onto every device."""
    return jax.jit(project_sharding.with_kernel_mesh(step, mesh, DRAFTER_RULES),
                   in_shardings=(state_sh, target_sh, batch_sharding(mesh)),
                   out_shardings=(state_sh, replicated(mesh)), donate_argnums=(0,))
