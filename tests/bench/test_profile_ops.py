"""bench/profile_ops.py: a traced kernel's HLO instruction named by the JAX op and the source line it was
traced from (the stack-frame tables of the optimised HLO), what a benchmark's kernel table prints."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import profile_ops  # noqa: E402


def _sorted_scaled(x):
    scaled = x.astype(jnp.float32) * 2
    return jnp.sort(scaled, axis=-1)


def test_op_sources_name_the_op_and_the_line_that_traced_it():
    hlo = jax.jit(_sorted_scaled).lower(jnp.ones((4, 64), jnp.bfloat16)).compile().as_text()
    sources = profile_ops.op_sources(hlo)
    lines, first = inspect.getsourcelines(_sorted_scaled)
    sort_line = first + next(i for i, line in enumerate(lines) if "jnp.sort" in line)
    sorts = {name: text for name, text in sources.items() if text.endswith(f"{Path(__file__).name}:{sort_line} "
                                                                           f"(_sorted_scaled)")}
    assert sorts and all("sort" in text for text in sorts.values()), sources
    # A kernel name from a trace (``.`` as ``_``, a suffix XLA adds) finds its instruction.
    name = next(iter(sorts))
    assert profile_ops.lookup(sources, name + "_impl") == sorts[name]


def test_a_mesh_programs_collectives_and_nccl_kernels_are_their_own_category():
    """A tensor-parallel product's all-reduce (its HLO instruction, and an NCCL kernel met by name only in
    a trace) is counted as "collectives", the share of a mesh step that moves data between devices."""
    from dflash_jax.sharding import MeshConfig, make_mesh
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=2), jax.devices()[:2])
    x = jax.device_put(jnp.ones((4, 64)), NamedSharding(mesh, P(None, "tensor")))
    w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("tensor", None)))
    hlo = jax.jit(jnp.dot, out_shardings=NamedSharding(mesh, P())).lower(x, w).compile().as_text()
    kernels = profile_ops.hlo_kernels(hlo, {})
    collectives = [k for k in kernels.values() if k.category == "collectives"]
    assert collectives and collectives[0].label.startswith("all-reduce"), kernels
    traced = profile_ops.attribute([dict(name="ncclDevKernel_AllReduce_Sum_bf16_RING_LL", dur=3.0)], kernels)
    assert traced[0]["category"] == "collectives"


def test_a_fusion_without_metadata_takes_its_roots_origin():
    """XLA may build a fusion instruction without metadata: its kernel is named by the fused root's op."""
    hlo = """HloModule m

%fused_computation.7 (param_0: bf16[4,8]) -> f32[4,8] {
  %param_0 = bf16[4,8]{1,0} parameter(0)
  ROOT %convert.3 = f32[4,8]{1,0} convert(%param_0), metadata={op_name="jit(f)/convert_element_type" source_file="/x/sampling.py" source_line=534}
}

ENTRY %main (p: bf16[4,8]) -> f32[4,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  ROOT %loop_convert_fusion.2 = f32[4,8]{1,0} fusion(%p), kind=kLoop, calls=%fused_computation.7
}
"""
    sources = profile_ops.op_sources(hlo)
    assert profile_ops.lookup(sources, "loop_convert_fusion_2") == "convert_element_type @ sampling.py:534"
