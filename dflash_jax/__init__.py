"""dflash-jax: train and serve DFlash block-diffusion speculative-decoding drafters in JAX/Flax.

The public API loads on first use (``dflash_jax.Engine`` imports JAX then): the command-line tools
import this package before they can say anything, and JAX takes seconds to import on a busy CPU.
"""

import importlib

_API = {
    "draft_logits": "dflash_jax.models.api", "target_forward": "dflash_jax.models.api",
    "ContinuousBatcher": "dflash_jax.runtime.batcher", "GenerationResult": "dflash_jax.runtime.batcher",
    "load_drafter": "dflash_jax.io.checkpoint", "load_target": "dflash_jax.io.checkpoint",
    "save_drafter": "dflash_jax.io.checkpoint", "save_target": "dflash_jax.io.checkpoint",
    "Drafter": "dflash_jax.models.drafter",
    "Engine": "dflash_jax.runtime.engine", "EngineConfig": "dflash_jax.runtime.engine",
    "generate": "dflash_jax.runtime.engine",
    "DrafterConfig": "dflash_jax.models.config", "TargetConfig": "dflash_jax.models.config",
    "Target": "dflash_jax.models.target",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dflash_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
