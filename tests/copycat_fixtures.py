"""The copycat pair (``dflash_jax.tiny.write_copycat_pair``: varied acceptance lengths without training)
over a 2-layer target, for the engine tests: what a test compiles grows with the target's depth (every
program holds each layer), while the engine runs every layer alike, so two layers cover what four do."""

from __future__ import annotations

from pathlib import Path

from dflash_jax.tiny import write_copycat_pair

TARGET_LAYERS = 2


def shallow_copycat_pair(directory: str | Path, *, shape: dict | None = None, **kwargs) -> tuple[Path, Path]:
    """``write_copycat_pair(directory, **kwargs)`` with a target of ``TARGET_LAYERS`` layers, each tapped by
    the 2-layer drafter (``dflash_jax.tiny.tiny_taps``)."""
    return write_copycat_pair(directory, shape={"num_layers": TARGET_LAYERS, **(shape or {})}, **kwargs)
