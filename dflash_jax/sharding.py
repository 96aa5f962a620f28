"""Logical axis names -> a (``data``, ``fsdp``, ``tensor``) mesh; physical mapping only in config.

Every parameter carries ``axes`` metadata (see ``layers.py``); caches and per-row engine state use
``CACHE_AXES`` and ``("batch", ...)``, paged caches' pools ``POOL_AXES``. A logical axis maps to its mesh axes only where the dimension
divides evenly, so KV heads are replicated when there are fewer of them than the TP degree.

Pallas kernels are opaque to XLA's sharding propagation (it would gather their operands onto every
device). Traced under ``kernel_mesh``, the layers call them through ``shard_kernel``: a
``shard_map`` over the mesh that hands each device its shards (rows on ``batch``, heads on
``kv_heads``), with the specs derived from the same logical axes and rules as the arrays'.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash_jax.io.config import check_field_types

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "taps": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "experts": ("tensor",),  # expert parallelism: a mixture of experts' experts split beside the heads
    "head_dim": (),
    "norm": (),
    "layers": (),
    "length": (),
    "pages": (),  # a paged cache's pool: every row's pages, so never split where rows are
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape and logical-axis rules; ``-1`` in one axis takes the remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    rules: dict = dataclasses.field(default_factory=dict)
    distributed: bool = False  # call jax.distributed.initialize() first (multi-host)

    def validate(self) -> None:
        check_field_types(self)
        sizes = [self.data, self.fsdp, self.tensor]
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError("at most one of data/fsdp/tensor may be -1")
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"mesh sizes must be positive or -1, got {sizes}")
        unknown = set(self.rules) - set(DEFAULT_RULES)
        if unknown:
            raise ValueError(f"rules: unknown logical axes {sorted(unknown)}; known: {sorted(DEFAULT_RULES)}")
        for name, axes in self.rules.items():
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            bad = [a for a in axes if a not in MESH_AXES]
            if bad:
                raise ValueError(f"rules.{name}: unknown mesh axes {bad}; mesh axes are {MESH_AXES}")

    def resolved_rules(self) -> dict[str, tuple[str, ...]]:
        rules = dict(DEFAULT_RULES)
        for name, axes in self.rules.items():
            rules[name] = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return rules


def make_mesh(config: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh with Auto axes (GSPMD propagation inside jit)."""
    config.validate()
    devices = list(devices if devices is not None else jax.devices())
    sizes = [config.data, config.fsdp, config.tensor]
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not divide by mesh sizes {sizes}")
        sizes[sizes.index(-1)] = len(devices) // known
    total = int(np.prod(sizes))
    if total > len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {total} devices, only {len(devices)} present")
    grid = np.asarray(devices[:total]).reshape(sizes)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def logical_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
                 rules: dict[str, tuple[str, ...]] | None = None) -> PartitionSpec:
    """The PartitionSpec for a value with logical ``axes``; uneven dimensions stay replicated."""
    rules = rules or DEFAULT_RULES
    used: set[str] = set()
    spec: list[Any] = []
    for name, dim in zip(axes, shape):
        mesh_axes = [a for a in rules.get(name, ()) if a not in used and mesh.shape[a] > 1] if name else []
        size = int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1
        if not mesh_axes or dim % size:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(tuple(mesh_axes) if len(mesh_axes) > 1 else mesh_axes[0])
    return PartitionSpec(*spec)


def named_sharding(axes, shape, mesh: Mesh, rules=None) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(tuple(axes), tuple(shape), mesh, rules))


def shard_module(module: nnx.Module, mesh: Mesh, rules=None) -> None:
    """Places every parameter of ``module`` on ``mesh`` by its ``axes`` metadata (in place)."""
    state = nnx.state(module, nnx.Param)
    placed = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        axes = var.get_metadata().get("axes")
        if axes is None:
            raise ValueError(f"parameter {'.'.join(map(str, path))} has no logical axes")
        placed.append((path, var.replace(jax.device_put(value, named_sharding(axes, value.shape, mesh, rules)))))
    nnx.update(module, nnx.from_flat_state(placed))


def shard_tree(tree, axes_of, mesh: Mesh, rules=None):
    """Places each array leaf of ``tree`` with the logical axes ``axes_of(leaf)`` returns."""
    return jax.tree.map(lambda x: jax.device_put(x, named_sharding(axes_of(x), x.shape, mesh, rules)), tree)


_KERNEL_MESH: contextvars.ContextVar[tuple[Mesh, dict] | None] = contextvars.ContextVar("kernel_mesh", default=None)


@contextlib.contextmanager
def kernel_mesh(mesh: Mesh | None, rules: dict[str, tuple[str, ...]] | None = None) -> Iterator[None]:
    """While tracing inside it, ``shard_kernel`` runs kernels per device over ``mesh`` (None or a
    single device: kernels run as they are)."""
    token = _KERNEL_MESH.set((mesh, rules or DEFAULT_RULES) if mesh is not None and mesh.size > 1 else None)
    try:
        yield
    finally:
        _KERNEL_MESH.reset(token)


def under_kernel_mesh() -> bool:
    """Whether tracing runs inside ``kernel_mesh`` of more than one device."""
    return _KERNEL_MESH.get() is not None


def with_kernel_mesh(fn: Callable, mesh: Mesh | None, rules: dict[str, tuple[str, ...]] | None = None) -> Callable:
    """``fn`` run (so traced, under ``jax.jit``) inside ``kernel_mesh(mesh, rules)``: its kernels per device."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with kernel_mesh(mesh, rules):
            return fn(*args, **kwargs)

    return traced


def _kernel_mesh_split(axes: tuple[str | None, ...], shape: tuple[int, ...]) -> tuple[Mesh, list[tuple[str, ...]]] | None:
    """Under ``kernel_mesh``: the mesh and, per dimension, the mesh axes it is split over (as
    ``logical_spec`` places it, so as ``shard_kernel`` splits it); None outside."""
    active = _KERNEL_MESH.get()
    if active is None:
        return None
    mesh, rules = active
    spec = logical_spec(tuple(axes), tuple(shape), mesh, rules)
    return mesh, [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def kernel_mesh_axes(axes: tuple[str | None, ...], shape: tuple[int, ...], dim: int) -> tuple[str, ...]:
    """Under ``kernel_mesh``: the mesh axes that dimension ``dim`` of a value with logical ``axes``
    and ``shape`` is split over inside ``shard_kernel`` (its collectives' axis names); () outside
    ``kernel_mesh`` or where that dimension is not split."""
    split = _kernel_mesh_split(axes, shape)
    return () if split is None else split[1][dim]


def local_shape(axes: tuple[str | None, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """Under ``kernel_mesh``: the shape of one device's shard of a value with logical ``axes``
    (what the device's own kernels see, e.g. the GEMM XLA compiles for it); else ``shape``."""
    split = _kernel_mesh_split(axes, shape)
    if split is None:
        return tuple(shape)
    mesh, per_dim = split
    return tuple(d // int(np.prod([mesh.shape[a] for a in names])) for d, names in zip(shape, per_dim))


def shard_kernel(fn: Callable, in_axes: Sequence[tuple[str | None, ...]],
                 out_axes: Sequence[tuple[str | None, ...]], out_shapes: Callable | None = None) -> Callable:
    """``fn(*arrays) -> tuple of arrays``, run on each device's shards under ``kernel_mesh``.

    ``in_axes`` / ``out_axes``: the logical axes of every argument / output (one name or None per
    dimension). Each is split on the mesh as ``logical_spec`` places it, so ``fn`` must be
    independent along every sharded axis (rows, KV heads), or combine across one itself with
    collectives over the mesh axes ``kernel_mesh_axes`` names; such an ``fn`` cannot be traced on the
    whole arrays, so ``out_shapes(*arrays)`` gives its outputs' (global) ``jax.ShapeDtypeStruct``s
    (default: ``jax.eval_shape(fn, ...)``). Outside ``kernel_mesh``: ``fn`` itself.
    """
    active = _KERNEL_MESH.get()
    if active is None:
        return fn
    mesh, rules = active

    def sharded(*args):
        outs = out_shapes(*args) if out_shapes is not None else jax.eval_shape(fn, *args)
        if len(outs) != len(out_axes) or len(args) != len(in_axes):
            raise ValueError(f"shard_kernel: {len(args)} arguments / {len(outs)} outputs for "
                             f"{len(in_axes)} / {len(out_axes)} axis tuples")
        in_specs = tuple(logical_spec(a, x.shape, mesh, rules) for a, x in zip(in_axes, args))
        out_specs = tuple(logical_spec(a, o.shape, mesh, rules) for a, o in zip(out_axes, outs))
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

    return sharded


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled XLA program (``hlo_collectives``)."""

    kind: str                # "all-gather", "all-reduce", ...
    dtype: str               # HLO element type: "bf16", "f32", "s32", ...
    shape: tuple[int, ...]   # the result's shape (an all-gather: the gathered value)
    op_name: str             # the JAX operation it came from (HLO metadata)

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape))


_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                         r"(-start)?\((.*)")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def hlo_collectives(hlo_text: str) -> list[Collective]:
    """The collectives of a compiled program's HLO text (``jax.jit(f).lower(...).compile().as_text()``):
    what a step on a mesh moves between devices, one entry per result (an asynchronous
    ``all-gather-start`` counts by its gathered outputs). A weight or a whole row of logits among
    them is a partitioning defect (docs/performance.md)."""
    found = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        arrays = _ARRAY.findall(m.group(1))
        if m.group(3) and m.group(2) == "all-gather" and m.group(1).startswith("("):
            arrays = arrays[len(arrays) // 2:]  # (operands..., gathered...)
        op = re.search(r'op_name="([^"]*)"', m.group(4))
        found.extend(Collective(m.group(2), dtype, tuple(int(d) for d in dims.split(",") if d),
                                op.group(1) if op else "") for dtype, dims in arrays)
    return found
