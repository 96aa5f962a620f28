"""The residual add + RMSNorm kernel in Pallas's Mosaic GPU lowering: ``s = h + delta; y = rms_norm(s) * w``.

The same function as ``gpu.py`` (the Triton lowering) and ``reference.add_rms_norm_reference``:
the sum rounded to the input dtype, the norm in float32, cast back, then scaled by the weight in the
input dtype. One program (one warpgroup) per row, so a row's result does not depend on how many rows
run with it.

A program copies its row of ``h`` (and ``delta``) and the weight from HBM into shared memory with
the bulk tensor-copy engine (TMA), computes in registers, and copies ``s`` and ``y`` back the same
way. A TMA box holds at most 256 elements a dimension, so a row of ``hidden`` elements travels as a
``[hidden / 128, 128]`` tile (a free reshape of the row-major rows): widths up to 32,768.

Forward only (inference). Mosaic GPU compiles for Hopper and later (sm_90); on the CPU the kernel
runs in Mosaic GPU's interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas._mosaic import interpret_params, mosaic_runs_here

LANES = 128  # a row travels as [hidden / LANES, LANES]: TMA boxes hold <= 256 elements per dimension
MAX_HIDDEN = 256 * LANES


def supports(hidden: int, dtype) -> bool:
    """Whether the kernel takes rows of ``hidden`` elements of ``dtype``: whole 128-element lanes of
    16- or 32-bit floats, at most 32,768 of them."""
    return (hidden % LANES == 0 and 0 < hidden <= MAX_HIDDEN
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)))


def add_rms_norm_supported(hidden: int, dtype) -> bool:
    """Whether ``add_rms_norm`` runs on this platform (GPUs, and the CPU in Mosaic GPU's
    interpret mode: jax >= 0.11)."""
    return mosaic_runs_here() and supports(hidden, dtype)


def _kernel(*refs, eps: float, hidden: int, has_delta: bool):
    """One program per row: TMA the row (and delta) and the weight in, compute, TMA ``s`` and ``y`` out.

    refs (GMEM): h [R, H/128, 128], (delta [R, H/128, 128]), w [H/128, 128]; outputs y, (s); then the
    scratch: shared-memory buffers for h, delta, w, y, s and one barrier for the loads."""
    if has_delta:
        h_gmem, d_gmem, w_gmem, y_gmem, s_gmem, h_smem, d_smem, w_smem, y_smem, s_smem, loaded = refs
    else:
        h_gmem, w_gmem, y_gmem, h_smem, w_smem, y_smem, loaded = refs
    row = lax.axis_index("rows")
    plgpu.copy_gmem_to_smem(h_gmem.at[row], h_smem, loaded)
    if has_delta:
        plgpu.copy_gmem_to_smem(d_gmem.at[row], d_smem, loaded)
    plgpu.copy_gmem_to_smem(w_gmem, w_smem, loaded)
    plgpu.barrier_wait(loaded)

    s = h_smem[...]
    if has_delta:
        s = s + d_smem[...]
        s_smem[...] = s
    xf = s.astype(jnp.float32)
    r = lax.rsqrt(jnp.sum(xf * xf) / hidden + eps)
    y_smem[...] = w_smem[...] * (xf * r).astype(s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(y_smem, y_gmem.at[row])
    if has_delta:
        plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[row])
    plgpu.wait_smem_to_gmem(0)


def add_rms_norm(
    h: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float, interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``h, delta [..., hidden]`` (``delta`` None: nothing to add), ``weight [hidden]`` -> ``(s, y)``:
    the sum ``h + delta`` and ``rms_norm(s) * weight``, both ``[..., hidden]`` in ``h.dtype``.
    ``interpret``: Mosaic GPU's interpret mode (default: off a GPU)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _add_rms_norm(h, delta, weight, eps=float(eps), interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _add_rms_norm(h: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float,
                  interpret: bool) -> tuple[jax.Array, jax.Array]:
    """``add_rms_norm``, jitted: the layers' identical calls in a program share one trace and one
    lowering of the kernel (a call of one function, which XLA inlines: the same kernels run)."""
    hidden, dtype = h.shape[-1], h.dtype
    if delta is not None and (delta.shape != h.shape or delta.dtype != dtype):
        raise ValueError(f"delta {delta.shape} {delta.dtype} must match h {h.shape} {dtype}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {weight.shape}")
    if not supports(hidden, dtype):
        raise ValueError(f"the Mosaic GPU add_rms_norm does not take rows of {hidden} {dtype} "
                         f"(whole {LANES}-element lanes, <= {MAX_HIDDEN}, 16/32-bit floats)")
    tile = (hidden // LANES, LANES)
    rows = h.reshape((-1,) + tile)
    has_delta = delta is not None
    inputs = [rows] + ([delta.reshape(rows.shape)] if has_delta else []) + [weight.astype(dtype).reshape(tile)]
    out_type = jax.ShapeDtypeStruct(rows.shape, dtype)
    buffers = [plgpu.SMEM(tile, dtype)] * (len(inputs) + (2 if has_delta else 1))
    outs = plgpu.kernel(
        functools.partial(_kernel, eps=eps, hidden=hidden, has_delta=has_delta),
        out_type=[out_type, out_type] if has_delta else [out_type],
        scratch_types=[*buffers, plgpu.Barrier(num_arrivals=len(inputs))],
        grid=(rows.shape[0],),
        grid_names=("rows",),
        interpret=interpret_params(interpret),
        kernel_name="dflash_add_rms_norm_mgpu",
    )(*inputs)
    y = outs[0].reshape(h.shape)
    s = outs[1].reshape(h.shape) if has_delta else h
    return s, y
