"""The chunked gated delta rule kernel (README.md beside this file)."""

from kernels_pallas.gated_delta.gpu import chunk_gated_delta, chunk_gated_delta_supported

__all__ = ["chunk_gated_delta", "chunk_gated_delta_supported"]
