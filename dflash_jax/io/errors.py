"""What the checkpoint readers share: their error class, the names of the dtypes they load into, how
an error lists tensor names, and the check that the weights they load are finite."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
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


@functools.partial(jax.jit, static_argnums=1)
def _count_nonfinite(x: jax.Array, as_dtype=None) -> jax.Array:
    return jnp.sum(~jnp.isfinite(x if as_dtype is None else x.astype(as_dtype)), dtype=jnp.int32)


def _narrower_range(stored, loaded) -> bool:
    """Whether casting ``stored`` floats to ``loaded`` can overflow (float32 or bfloat16 to float16)."""
    return loaded is not None and float(ml_dtypes.finfo(loaded).max) < float(ml_dtypes.finfo(stored).max)


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

    def add(self, where, name: str, tensor: jax.Array, host: np.ndarray | None = None, as_dtype=None) -> None:
        """Counts ``tensor``'s NaN/inf values (named ``name`` in file ``where``) if it is floating; ``host``:
        the numpy array it was placed from, counted instead where ``tensor`` is on the CPU (no wait for the
        copy). ``as_dtype``: the dtype the loader casts it to; where that range is narrower (float16), the
        values are counted as cast, so a weight beyond it (which the cast makes inf) is refused too."""
        if not jnp.issubdtype(tensor.dtype, jnp.floating):
            return
        cast = jnp.dtype(as_dtype) if _narrower_range(tensor.dtype, as_dtype) else None
        if _on_cpu(tensor):
            array = np.asarray(tensor) if host is None else host
            with np.errstate(over="ignore"):  # the overflow is what is counted
                count = _count_nonfinite_host(array if cast is None else array.astype(cast))
        else:
            count = _count_nonfinite(tensor, cast)
        self._counts.append((str(where), name, count, cast))

    def check(self) -> None:
        counts = jax.device_get([entry[2] for entry in self._counts])
        bad = [(where, name, int(n), cast) for (where, name, _, cast), n in zip(self._counts, counts) if n]
        self._counts = []
        if not bad:
            return
        where, name, n, cast = bad[0]
        others = (f"; so do {len(bad) - 1} more {self.noun}{'s' if len(bad) > 2 else ''}: "
                  f"{some_names([b[1] for b in bad[1:]])}") if len(bad) > 1 else ""
        if cast is not None:
            raise CheckpointError(
                f"{where}: {self.noun} {name!r} holds {n} value{'s' if n != 1 else ''} that {'are' if n != 1 else 'is'} "
                f"NaN or inf as {cast.name} (beyond its range of +-{float(ml_dtypes.finfo(cast).max):g}){others} "
                f"(load it as bfloat16 or float32; check_finite=False loads it anyway)")
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
