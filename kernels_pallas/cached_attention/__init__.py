"""The fused cached-attention kernel (README.md beside this file)."""

from kernels_pallas.cached_attention.gpu import cached_block_attention, cached_block_attention_supported

__all__ = ["cached_block_attention", "cached_block_attention_supported"]
