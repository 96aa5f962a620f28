"""What the Mosaic GPU kernels share: their interpret mode across JAX versions.

Mosaic GPU kernels (``plgpu.kernel``) copy with TMA, wait on barriers and run ``wgmma``: the generic
Pallas interpreter has no rule for those. JAX 0.11 added Mosaic GPU's own interpreter
(``plgpu.InterpretGPUParams``), which runs them on the CPU; with JAX 0.10 they only lower (for CUDA,
on any host), and do not run off a GPU.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


def mosaic_interpret_available() -> bool:
    """Whether this JAX runs Mosaic GPU kernels in interpret mode (jax >= 0.11)."""
    return hasattr(plgpu, "InterpretGPUParams")


def hopper_or_later() -> bool:
    """Whether the default device is a GPU of compute capability 9.0 or later: TMA and ``wgmma``, which
    every Mosaic GPU kernel here uses, came with Hopper (an A100 or a GPU that reports no capability
    runs the Triton kernels)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return False
    try:
        return float(getattr(device, "compute_capability", "")) >= 9.0
    except ValueError:
        return False


def mosaic_runs_here() -> bool:
    """Whether Mosaic GPU kernels run on this platform: a Hopper or later GPU (``hopper_or_later``), or
    the CPU in Mosaic GPU's interpret mode (jax >= 0.11); never a TPU."""
    platform = jax.default_backend()
    if platform == "gpu":
        return hopper_or_later()
    return platform != "tpu" and mosaic_interpret_available()


def interpret_params(interpret: bool) -> Any:
    """``plgpu.kernel``'s ``interpret`` argument: Mosaic GPU's interpreter, or None (compile)."""
    if not interpret:
        return None
    if not mosaic_interpret_available():
        raise RuntimeError("Mosaic GPU kernels run in interpret mode with jax >= 0.11 only "
                           "(jax.experimental.pallas.mosaic_gpu.InterpretGPUParams); on this JAX they "
                           "compile for a GPU or lower for CUDA")
    return plgpu.InterpretGPUParams()


def load(ref: Any, layout: Any, *, optimized: bool = True) -> Any:
    """``plgpu.load`` of the whole ``ref`` in ``layout``: JAX 0.10 requires the index argument that
    JAX 0.11 deprecates and JAX 0.12 no longer takes. ``optimized=False`` accepts a transfer with
    shared-memory bank conflicts (an unswizzled tile whose rows are a multiple of 128 bytes apart)."""
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def store(ref: Any, value: Any, *, optimized: bool = True) -> None:
    """``ref[...] = value``; ``optimized=False`` accepts a transfer with shared-memory bank conflicts
    where this JAX has ``plgpu.store`` (0.12; 0.10 and 0.11 store without that check)."""
    if hasattr(plgpu, "store"):
        plgpu.store(ref, value, optimized=optimized)
    else:
        ref[...] = value
