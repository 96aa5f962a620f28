"""Programmatic dependent launch (PDL) signals from Pallas Triton kernels.

On Hopper and later GPUs XLA launches its own kernels with PDL: such a kernel may be launched before
the kernel it depends on has finished, once every program of that kernel has issued
``griddepcontrol.launch_dependents`` or exited, and it waits on ``griddepcontrol.wait`` (which
returns when that kernel has finished and its writes are visible) before it reads. XLA launches no
Pallas Triton kernel that way (docs/performance.md), but a Triton kernel can still
signal, so that the XLA kernel after it is launched early and has its programs resident when the
signal's kernel ends, instead of paying the launch then.

The signal goes where XLA's own kernels put it: after the program's last read and before its first
dependent write (a kernel launched early must not find this one still reading a buffer that it may
write). The first thread of a program to issue it signals for the whole program, so the value it
is attached to should depend on what every thread loaded: the attention's dot products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

def hopper_or_later() -> bool:
    """Whether the default device is a CUDA GPU of compute capability 9.0 or more (``griddepcontrol``
    is an sm_90 instruction)."""
    try:
        device = jax.devices()[0]
        capability = getattr(device, "compute_capability", None)
        return device.platform == "gpu" and capability is not None and float(capability) >= 9.0
    except (RuntimeError, ValueError):
        return False


def signals(*, interpret: bool) -> bool:
    """Whether a kernel built now signals (``signal_after``): compiled (not in interpret mode) for a
    Hopper-or-later GPU. A static argument of the kernels' jitted builders, so that a kernel traced
    under one answer is never reused under the other."""
    return not interpret and hopper_or_later()


def signal_after(y: jax.Array, *, signal: bool) -> jax.Array:
    """Inside a Pallas Triton kernel: ``y`` (16- or 32-bit elements) unchanged, each element passed
    through an inline ``griddepcontrol.launch_dependents``. Compute ``y`` from every value the program
    reads and store it after: the signal then follows the last read and precedes the store. A no-op
    unless ``signal`` (``signals``: compiled for a Hopper-or-later GPU)."""
    if not signal:
        return y
    from jax.experimental.pallas import triton as plt

    width = 8 * jnp.dtype(y.dtype).itemsize
    if width not in (16, 32):
        raise ValueError(f"signal_after takes 16- or 32-bit elements, got {y.dtype}")
    bits, reg = (jnp.int16, "h") if width == 16 else (jnp.int32, "r")
    [out] = plt.elementwise_inline_asm(
        f"griddepcontrol.launch_dependents;\n\tmov.b{width} $0, $1;",
        args=[jax.lax.bitcast_convert_type(y, bits)], constraints=f"={reg},{reg}", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, bits)])
    return jax.lax.bitcast_convert_type(out, y.dtype)
