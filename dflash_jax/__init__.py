"""dflash-jax: train and serve DFlash block-diffusion speculative-decoding drafters in JAX/Flax.

The public API loads on first use (``dflash_jax.Engine`` imports JAX then, ``dflash_jax.lazy``)."""

from dflash_jax.lazy import lazy_api

_API = {
    "draft_logits": "dflash_jax.models.api", "target_forward": "dflash_jax.models.api",
    "ContinuousBatcher": "dflash_jax.runtime.batcher", "GenerationResult": "dflash_jax.runtime.batcher",
    "load_drafter": "dflash_jax.io.checkpoint", "load_target": "dflash_jax.io.checkpoint",
    "save_drafter": "dflash_jax.io.checkpoint", "save_target": "dflash_jax.io.checkpoint",
    "Drafter": "dflash_jax.models.drafter",
    "DFlash2Config": "dflash_jax.models.dflash2", "DFlash2Drafter": "dflash_jax.models.dflash2",
    "SamplingParams": "dflash_jax.runtime.sampling",
    "Engine": "dflash_jax.runtime.engine", "EngineConfig": "dflash_jax.runtime.engine",
    "generate": "dflash_jax.runtime.engine",
    "DrafterConfig": "dflash_jax.models.config", "TargetConfig": "dflash_jax.models.config",
    "Target": "dflash_jax.models.target",
}
__all__ = sorted(_API)
__getattr__ = lazy_api(__name__, globals(), _API)
