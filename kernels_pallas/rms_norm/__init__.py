"""The residual add + RMSNorm kernel (README.md beside this file)."""

from kernels_pallas.rms_norm.gpu import add_rms_norm, add_rms_norm_supported

__all__ = ["add_rms_norm", "add_rms_norm_supported"]
