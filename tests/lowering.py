"""Lowering a kernel for an accelerator on this CPU (the kernel tests' compile check)."""

from __future__ import annotations

import jax


def lower_for(fn, args, platform: str):
    """``fn(*args)`` traced and lowered for ``platform`` on this CPU. Since jax 0.12 the Triton lowering
    asks which GPU it compiles for, and a host without one names it through an abstract mesh active
    while tracing: an abstract H200 (132 SMs, sm_90)."""
    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    if platform != "cuda" or abstract_device is None:
        return fn.trace(*args).lower(lowering_platforms=(platform,))
    h200 = abstract_device(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=h200)
    with jax.sharding.use_abstract_mesh(mesh):
        return fn.trace(*args).lower(lowering_platforms=(platform,))
