"""The embedded default pair shipped with the repository (``models/embedded/``).

A Qwen3-architecture code model (``DEFAULT_TARGET``, HF format, bfloat16 safetensors, possibly sharded,
+ tokenizer files with a ChatML chat template) pretrained here on the Python standard library's sources
and chat-formatted "write a function" requests made from them, and its DFlash drafter trained here on the
target's own greedy answers, in z-lab format (``DEFAULT_DRAFTER``). Rebuild everything with
``bash scripts/build_embedded_default.sh`` (see ``docs/embedded_default.md``).
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "models" / "embedded"
DEFAULT_TARGET = EMBEDDED_DIR / "target"
DEFAULT_DRAFTER = EMBEDDED_DIR / "drafter"
DEFAULT_DRAFTER2 = EMBEDDED_DIR / "drafter2"  # the same recipe, DFlash2 (convolutions + candidate selector)
HELDOUT_PROMPTS = EMBEDDED_DIR / "heldout_prompts.jsonl"  # {"prompt": ..., "source": ..., "kind"?: ...} per line
EVAL_REPORT = EMBEDDED_DIR / "eval.json"
SERVED_NAME = "dflash-embedded"  # the model id the server gives the pair (serve.py without --target)


def _has_weights(directory: Path) -> bool:
    return (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists()


def available() -> bool:
    """Whether the shipped pair is present (a source checkout; not in a wheel without models/)."""
    return _has_weights(DEFAULT_TARGET) and _has_weights(DEFAULT_DRAFTER)


def load_default(dtype: str = "float32"):
    """``(target, drafter, tokenizer)`` of the embedded default (weights cast to ``dtype``)."""
    from dflash_jax.io.checkpoint import load_drafter, load_target
    from dflash_jax.io.tokenizer import Tokenizer

    if not available():
        raise FileNotFoundError(f"{EMBEDDED_DIR}: the embedded default pair is missing "
                                "(bash scripts/build_embedded_default.sh rebuilds it)")
    target = load_target(DEFAULT_TARGET, dtype=dtype)
    drafter = load_drafter(DEFAULT_DRAFTER, dtype=dtype)
    return target, drafter, Tokenizer(DEFAULT_TARGET)


def heldout_prompts(limit: int | None = None, kind: str | None = None) -> list[str]:
    """Held-out prompts as text: function signatures + docstrings of held-out stdlib files ("code") and,
    for a pair with a chat template, chat requests rendered by it ("chat"); ``kind`` keeps one kind."""
    import json

    rows = [json.loads(line) for line in HELDOUT_PROMPTS.read_text().splitlines() if line.strip()]
    if kind is not None:
        rows = [r for r in rows if r.get("kind", "code") == kind]
    return [r["prompt"] for r in rows][:limit]


__all__ = ["DEFAULT_DRAFTER", "DEFAULT_DRAFTER2", "DEFAULT_TARGET", "EMBEDDED_DIR", "HELDOUT_PROMPTS", "SERVED_NAME",
           "available", "heldout_prompts", "load_default"]
