"""Which implementation each op runs: the one object the models pass down to ``dflash_jax.ops``.

A frozen (hashable) dataclass, so that it is static under ``jax.jit``: two engines of different
settings compile different programs, and nothing global is switched at run time.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from dflash_jax.ops.experts import IMPLEMENTATIONS as EXPERT_IMPLEMENTATIONS

AttentionImpl = Literal["xla", "pallas"]
GpuLowering = Literal["triton", "mosaic"]


@dataclasses.dataclass(frozen=True)
class OpsConfig:
    """``attention``: "xla" runs every op's pure-jnp reference; "pallas" the kernels of
    ``kernels_pallas`` where the platform and shapes take them (the block and cached attention, the
    routed experts), a library flash attention for prompts, and XLA elsewhere.

    ``cached_attention_tiles``: overrides of the cached-attention kernel's tile fields
    (``kernels_pallas.cached_attention.gpu.GpuConfig``) as ``(field, value)`` pairs; empty: its
    defaults.

    ``experts``: how a mixture of experts' routed experts run (``ops.experts.routed_experts``):
    "auto" (per-pair matrix-vector products for a decode or verify step's few tokens, grouped matmuls
    for more), "gemv", "ragged_dot" (grouped matmuls) or "capacity" (batched GEMMs of a fixed row
    count per expert).

    ``gpu_lowering``: which Pallas GPU lowering the kernels use. "triton" (the default): the Triton
    kernels (``kernels_pallas/<op>/gpu.py``). "mosaic": the ops with a Mosaic GPU kernel
    (``kernels_pallas/<op>/mosaic_gpu.py``: the block attention's forward:
    training blocks and the decode / verify / draft blocks over the KV cache, whose q/k norms, RoPE
    and cache write then run in XLA around it; and its backward, ``mosaic_gpu_bwd.py``; the routed
    experts of MoE decode and verify steps, ``kernels_pallas/experts``) run it; the others keep their
    Triton kernel."""

    attention: AttentionImpl = "xla"
    cached_attention_tiles: tuple[tuple[str, int], ...] = ()
    # A decode token's fused QKV and output projections on one GPU as this many float32 split-K
    # partials (``ops.linear.single_row_partials``; < 2: one dot, split by XLA). The QKV's partials
    # are summed inside the cached-attention kernel (no reduction kernel after the GEMM), the output
    # projection's by XLA (a faster GEMM than XLA's own split). Blocks of several rows keep the plain
    # dot: as partials a 16-row verify block cost the DFlash step 5%.
    qkv_partials: int = 8
    output_partials: int = 8
    experts: str = "auto"
    gpu_lowering: GpuLowering = "triton"

    def __post_init__(self):
        if self.attention not in ("xla", "pallas"):
            raise ValueError(f"ops attention must be 'xla' or 'pallas', got {self.attention!r}")
        if self.experts not in EXPERT_IMPLEMENTATIONS:
            raise ValueError(f"ops experts must be one of {EXPERT_IMPLEMENTATIONS}, got {self.experts!r}")
        if self.gpu_lowering not in ("triton", "mosaic"):
            raise ValueError(f"ops gpu_lowering must be 'triton' or 'mosaic', got {self.gpu_lowering!r}")

    @property
    def kernels(self) -> bool:
        """Whether the Pallas kernels (and library flash attention) may run."""
        return self.attention == "pallas"

    @property
    def mosaic(self) -> bool:
        """Whether the kernels on (``kernels``) take their Mosaic GPU versions where one exists."""
        return self.kernels and self.gpu_lowering == "mosaic"


XLA = OpsConfig()


def resolve_attention_impl(impl: str) -> AttentionImpl:
    """A configured ``attention_impl`` ("xla", "pallas" or "auto") for this platform: "auto" is the
    kernels on GPUs and TPUs, the reference elsewhere."""
    if impl == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
    if impl not in ("xla", "pallas"):
        raise ValueError(f"attention_impl must be 'xla', 'pallas' or 'auto', got {impl!r}")
    return impl


def parse_tiles(spec: str, *, field: str = "cached_attention_tiles") -> tuple[tuple[str, int], ...]:
    """``"min_chunk=128,block_k=32"`` -> ``(("min_chunk", 128), ("block_k", 32))``, each name a field
    of the cached-attention kernel's ``GpuConfig``; a clear error naming ``field`` otherwise."""
    from kernels_pallas.cached_attention.gpu import GpuConfig

    known = {f.name for f in dataclasses.fields(GpuConfig)}
    pairs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in known:
            raise ValueError(f"{field}: {item!r} is not NAME=INT with NAME one of {sorted(known)}")
        try:
            pairs.append((name, int(value)))
        except ValueError:
            raise ValueError(f"{field}: {name} must be an integer, got {value.strip()!r}") from None
    return tuple(pairs)
