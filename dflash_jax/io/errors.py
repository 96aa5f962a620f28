"""What the checkpoint readers share: their error class, the names of the dtypes they load into, how
an error lists tensor names, and the check that the weights they load are finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class CheckpointError(ValueError):
    """A checkpoint cannot be used: unreadable, incomplete, or not fitting its config; the message names
    the file and the tensor. The one class of both loaders (``io.orbax`` raises it too)."""


def some_names(names: list[str]) -> str:
    """The first few of ``names`` and how many in all, for an error about a long list of tensors."""
    shown = ", ".join(repr(n) for n in names[:4])
    more = f" and {len(names) - 4} more ({len(names)} in all)" if len(names) > 4 else ""
    return shown + more


@jax.jit
def _count_nonfinite(x: jax.Array) -> jax.Array:
    return jnp.sum(~jnp.isfinite(x), dtype=jnp.int32)


def _count_nonfinite_host(a: np.ndarray) -> int:
    if a.dtype.itemsize == 2:  # float16, bfloat16: all exponent bits set (numpy's isfinite is slow on these)
        mask = np.uint16(0x7C00 if a.dtype == np.float16 else 0x7F80)
        return int(np.count_nonzero((a.view(np.uint16) & mask) == mask))
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def _on_cpu(tensor: jax.Array) -> bool:
    return all(device.platform == "cpu" for device in tensor.devices())


class FiniteCheck:
    """Whether every floating tensor a loader reads is finite (no NaN, no inf), counted where the tensor
    lies: on an accelerator one jitted reduction per tensor, dispatched without waiting, and one transfer
    of all the counts at the end (no pass over the weights on the host); on the CPU, where device memory
    is host memory, numpy counts on the array's own buffer (no copy, and no compilation per shape).

    ``add`` each tensor as it is read (integer tensors, e.g. MXFP4 blocks and scales, are skipped), then
    ``check``: a ``CheckpointError`` naming the file, the tensor (``noun``) and how many of its values are
    NaN or inf.
    """

    def __init__(self, noun: str = "tensor"):
        self.noun = noun
        self._counts: list[tuple[str, str, int | jax.Array]] = []

    def add(self, where, name: str, tensor: jax.Array, host: np.ndarray | None = None) -> None:
        """Counts ``tensor``'s NaN/inf values (named ``name`` in file ``where``) if it is floating; ``host``:
        the numpy array it was placed from, counted instead where ``tensor`` is on the CPU (no wait for the
        copy)."""
        if not jnp.issubdtype(tensor.dtype, jnp.floating):
            return
        if _on_cpu(tensor):
            count = _count_nonfinite_host(np.asarray(tensor) if host is None else host)
        else:
            count = _count_nonfinite(tensor)
        self._counts.append((str(where), name, count))

    def check(self) -> None:
        counts = jax.device_get([count for _, _, count in self._counts])
        bad = [(where, name, int(n)) for (where, name, _), n in zip(self._counts, counts) if n]
        self._counts = []
        if not bad:
            return
        where, name, n = bad[0]
        others = (f"; so do {len(bad) - 1} more {self.noun}{'s' if len(bad) > 2 else ''}: "
                  f"{some_names([b[1] for b in bad[1:]])}") if len(bad) > 1 else ""
        raise CheckpointError(f"{where}: {self.noun} {name!r} holds {n} NaN/inf value{'s' if n != 1 else ''}{others} "
                              "(a damaged or diverged checkpoint; check_finite=False loads it anyway)")


def parse_dtype(dtype) -> jnp.dtype:
    """One of the float dtypes models load into, by name or as a dtype; anything else (None meant float64,
    which JAX truncates to float32 with a warning per tensor) is a ``ValueError``."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    try:
        resolved = None if dtype is None else jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved not in {jnp.dtype(d) for d in _DTYPES.values()}:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return resolved
