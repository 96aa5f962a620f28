"""A residual add and the RMSNorm after it, in one kernel: ``s = h + delta; y = rms_norm(s) * w``.

At batch 1 a decode step is weight streaming, and between a layer's matmuls XLA runs each
RMSNorm as three kernels (the residual add, the sum of squares, the scale), each ~1.4 us of launch
and latency for 8 KB of data (docs/performance.md). This kernel is one launch for all three, and the
decoder layers defer each residual add to the norm that reads it (``layers.add_rms_norm``).

The numerics are ``layers.rms_norm``'s (transformers'): the sum rounded to the input dtype, the
norm in float32, cast back, then scaled by the weight in the input dtype. One program per row, so a
row's result does not depend on how many rows run with it (a 1-token and a 16-token pass agree).

Forward only (inference); the reference is ``layers.add_rms_norm`` with ``fused=False``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas._common import next_pow2
from kernels_pallas._flash import triton_params
from kernels_pallas._pdl import signal_after, signals

NUM_WARPS = 4


def supports(hidden: int, *, compiled: bool = True) -> bool:
    """Whether the kernel takes rows of ``hidden`` elements: a Triton tile is a power of two."""
    return hidden >= 1 and (not compiled or (next_pow2(hidden) == hidden and hidden >= 128))


def add_rms_norm_supported(hidden: int) -> bool:
    """Whether ``add_rms_norm`` runs on this platform (GPUs, and the CPU in interpret mode)."""
    platform = jax.default_backend()
    return platform != "tpu" and supports(hidden, compiled=platform == "gpu")


def _kernel(*refs, eps: float, has_delta: bool, signal: bool):
    if has_delta:
        h_ref, d_ref, w_ref, y_ref, s_ref = refs
        s = h_ref[...] + d_ref[...]
        s_ref[...] = s
    else:
        h_ref, w_ref, y_ref = refs
        s = h_ref[...]
    xf = s.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.sum(xf * xf) / xf.shape[0] + eps)
    y = w_ref[...] * (xf * r).astype(s.dtype)
    # y needs every load of the program: the matmul after this kernel may launch from here on
    y_ref[...] = signal_after(y, signal=signal)


def add_rms_norm(
    h: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float, interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``h, delta [..., hidden]`` (``delta`` None: nothing to add), ``weight [hidden]`` ->
    ``(s, y)``: the sum ``h + delta`` and ``rms_norm(s) * weight``, both ``[..., hidden]`` in
    ``h.dtype``. On Hopper and later GPUs each program signals the kernel after it once it has read
    everything (``_pdl.signal_after``)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _add_rms_norm(h, delta, weight, eps=float(eps), interpret=interpret, signal=signals(interpret=interpret))


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "signal"))
def _add_rms_norm(h: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float, interpret: bool,
                  signal: bool) -> tuple[jax.Array, jax.Array]:
    """``add_rms_norm``, jitted: the layers' identical calls in a program share one trace and one
    lowering of the kernel (a call of one function, which XLA inlines: the same kernels run)."""
    hidden = h.shape[-1]
    if delta is not None and (delta.shape != h.shape or delta.dtype != h.dtype):
        raise ValueError(f"delta {delta.shape} {delta.dtype} must match h {h.shape} {h.dtype}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {weight.shape}")
    if not supports(hidden, compiled=not interpret):
        raise ValueError(f"add_rms_norm does not take rows of {hidden} (see rms_norm_gpu.supports)")
    rows = h.reshape(-1, hidden)
    row = pl.BlockSpec((None, hidden), lambda i: (i, 0))
    inputs = [rows] + ([delta.reshape(-1, hidden)] if delta is not None else []) + [weight.astype(h.dtype)]
    out_shape = jax.ShapeDtypeStruct(rows.shape, h.dtype)
    outs = pl.pallas_call(
        functools.partial(_kernel, eps=eps, has_delta=delta is not None, signal=signal),
        grid=(rows.shape[0],),
        in_specs=[row] * (len(inputs) - 1) + [pl.BlockSpec((hidden,), lambda i: (0,))],
        out_specs=[row, row] if delta is not None else [row],
        out_shape=[out_shape, out_shape] if delta is not None else [out_shape],
        compiler_params=triton_params(NUM_WARPS, 1),
        interpret=interpret,
        name="dflash_add_rms_norm",
    )(*inputs)
    y = outs[0].reshape(h.shape)
    s = outs[1].reshape(h.shape) if delta is not None else h
    return s, y
