"""The only place that chooses an implementation: the XLA reference or a ``kernels_pallas`` kernel.

``OpsConfig`` (static under jit) says which; models pass it down with every call.
"""

from dflash_jax.ops.config import XLA, OpsConfig, resolve_attention_impl

__all__ = ["XLA", "OpsConfig", "resolve_attention_impl"]
