"""dflash-jax: train and serve DFlash block-diffusion speculative-decoding drafters in JAX/Flax."""

from dflash_jax.models.api import draft_logits, target_forward
from dflash_jax.runtime.batcher import ContinuousBatcher, GenerationResult
from dflash_jax.io.checkpoint import load_drafter, load_target, save_drafter, save_target
from dflash_jax.models.dflash2 import DFlash2Config, DFlash2Drafter
from dflash_jax.models.drafter import Drafter
from dflash_jax.runtime.engine import Engine, EngineConfig, generate
from dflash_jax.runtime.sampling import SamplingParams
from dflash_jax.models.config import DrafterConfig, TargetConfig
from dflash_jax.models.target import Target

__all__ = [
    "ContinuousBatcher", "DFlash2Config", "DFlash2Drafter", "Drafter", "DrafterConfig", "Engine", "EngineConfig",
    "GenerationResult", "SamplingParams", "Target", "TargetConfig", "draft_logits", "generate", "load_drafter",
    "load_target", "save_drafter", "save_target",
    "target_forward",
]
