"""Pure model math (Flax NNX): the target families, the DFlash drafter, shared layers and configs.

Models call ``dflash_jax.ops`` for every op whose implementation can vary; they import nothing
from the runtime, serving, training or ``kernels_pallas``.
"""
