"""What the checkpoint readers share: their error class, the names of the dtypes they load into, and how
an error lists tensor names."""

from __future__ import annotations

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class CheckpointError(ValueError):
    """A checkpoint cannot be used: unreadable, incomplete, or not fitting its config; the message names
    the file and the tensor. The one class of both loaders (``io.orbax`` raises it too)."""


def some_names(names: list[str]) -> str:
    """The first few of ``names`` and how many in all, for an error about a long list of tensors."""
    shown = ", ".join(repr(n) for n in names[:4])
    more = f" and {len(names) - 4} more ({len(names)} in all)" if len(names) > 4 else ""
    return shown + more


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
