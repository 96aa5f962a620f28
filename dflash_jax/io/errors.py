"""What the checkpoint readers share: their error class and the names of the dtypes they load into."""

from __future__ import annotations

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class CheckpointError(ValueError):
    """A checkpoint cannot be used: unreadable, incomplete, or not fitting its config; the message names
    the file and the tensor. The one class of both loaders (``io.orbax`` raises it too)."""


def parse_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    return jnp.dtype(dtype)
