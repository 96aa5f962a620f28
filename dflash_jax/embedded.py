"""The embedded default pair shipped with the repository (``models/embedded/``).

A small Qwen3-architecture code model (``DEFAULT_TARGET``, HF format + tokenizer files) pretrained here
on the Python standard library's sources, and its DFlash drafter trained here on the target's own greedy
answers, in z-lab format (``DEFAULT_DRAFTER``) and as the final Orbax training checkpoint
(``DEFAULT_DRAFTER_ORBAX``, loadable with ``dflash_jax.load_drafter``). Rebuild everything with
``bash scripts/build_embedded_default.sh`` (see ``docs/embedded_default.md``).
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "models" / "embedded"
DEFAULT_TARGET = EMBEDDED_DIR / "target"
DEFAULT_DRAFTER = EMBEDDED_DIR / "drafter"
DEFAULT_DRAFTER_ORBAX = EMBEDDED_DIR / "drafter_orbax"
HELDOUT_PROMPTS = EMBEDDED_DIR / "heldout_prompts.jsonl"  # {"prompt": ..., "source": ...} per line
EVAL_REPORT = EMBEDDED_DIR / "eval.json"
SERVED_NAME = "dflash-embedded"  # the model id the server gives the pair (serve.py without --target)


def available() -> bool:
    """Whether the shipped pair is present (a source checkout; not in a wheel without models/)."""
    return (DEFAULT_TARGET / "model.safetensors").exists() and (DEFAULT_DRAFTER / "model.safetensors").exists()


def load_default(dtype: str = "float32", orbax: bool = False):
    """``(target, drafter, tokenizer)`` of the embedded default."""
    from dflash_jax.io.checkpoint import load_drafter, load_target
    from dflash_jax.io.tokenizer import Tokenizer

    if not available():
        raise FileNotFoundError(f"{EMBEDDED_DIR}: the embedded default pair is missing "
                                "(bash scripts/build_embedded_default.sh rebuilds it)")
    target = load_target(DEFAULT_TARGET, dtype=dtype)
    drafter = load_drafter(DEFAULT_DRAFTER_ORBAX if orbax else DEFAULT_DRAFTER, dtype=dtype)
    return target, drafter, Tokenizer(DEFAULT_TARGET)


def heldout_prompts(limit: int | None = None) -> list[str]:
    """Held-out prompts (function signatures + docstrings of held-out stdlib files) as text."""
    import json

    rows = [json.loads(line) for line in HELDOUT_PROMPTS.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows][:limit]


__all__ = ["DEFAULT_DRAFTER", "DEFAULT_DRAFTER_ORBAX", "DEFAULT_TARGET", "EMBEDDED_DIR", "HELDOUT_PROMPTS", "SERVED_NAME",
           "available", "heldout_prompts", "load_default"]
