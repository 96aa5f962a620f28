"""The embedded default pair shipped with the repository (``models/embedded/``).

A Qwen3-architecture code model (``DEFAULT_TARGET``, HF format + tokenizer files; safetensors possibly
sharded) pretrained here on the Python standard library's sources, and its DFlash drafter trained here on
the target's own greedy answers, in z-lab format (``DEFAULT_DRAFTER``); beside it a DFlash2 drafter
(``DEFAULT_DRAFTER2``, the authors' DFlash2 format) trained the same way, starting from the DFlash one. The
target also chats: its tokenizer carries a ChatML chat template and it was pretrained on chat-formatted
"write a function" requests too. Rebuild everything with ``bash scripts/build_embedded_default.sh``
(see ``docs/embedded_default.md``).
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "models" / "embedded"
DEFAULT_TARGET = EMBEDDED_DIR / "target"
DEFAULT_DRAFTER = EMBEDDED_DIR / "drafter"
DEFAULT_DRAFTER2 = EMBEDDED_DIR / "drafter2"  # the DFlash2 drafter (convolutions + candidate selector)
HELDOUT_PROMPTS = EMBEDDED_DIR / "heldout_prompts.jsonl"  # {"prompt": ..., "source": ..., "kind"?: ...} per line
EVAL_REPORT = EMBEDDED_DIR / "eval.json"
SERVED_NAME = "dflash-embedded"  # the model id the server gives the pair (serve.py without --target)


def _has_weights(directory: Path) -> bool:
    return (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists()


def available() -> bool:
    """Whether the shipped pair is present (a source checkout; not in a wheel without models/)."""
    return _has_weights(DEFAULT_TARGET) and _has_weights(DEFAULT_DRAFTER)


def drafter2_available() -> bool:
    """Whether the shipped pair has its DFlash2 drafter too."""
    return available() and _has_weights(DEFAULT_DRAFTER2)


def load_default(dtype: str = "float32", generation: int = 1):
    """``(target, drafter, tokenizer)`` of the embedded default (weights cast to ``dtype``);
    ``generation=2``: with the DFlash2 drafter (``DEFAULT_DRAFTER2``) instead of the DFlash one."""
    from dflash_jax.io.checkpoint import load_drafter, load_target
    from dflash_jax.io.tokenizer import Tokenizer

    if generation not in (1, 2):
        raise ValueError(f"generation must be 1 (DFlash) or 2 (DFlash2), got {generation!r}")
    if not available():
        raise FileNotFoundError(f"{EMBEDDED_DIR}: the embedded default pair is missing "
                                "(bash scripts/build_embedded_default.sh rebuilds it)")
    if generation == 2 and not drafter2_available():
        raise FileNotFoundError(f"{DEFAULT_DRAFTER2}: the embedded DFlash2 drafter is missing "
                                "(bash scripts/build_embedded_default.sh --force drafter2 rebuilds it)")
    target = load_target(DEFAULT_TARGET, dtype=dtype)
    source = DEFAULT_DRAFTER2 if generation == 2 else DEFAULT_DRAFTER
    return target, load_drafter(source, dtype=dtype), Tokenizer(DEFAULT_TARGET)


def heldout_prompts(limit: int | None = None, kind: str | None = None) -> list[str]:
    """Held-out prompts as text: function signatures + docstrings of held-out stdlib files ("code") and,
    for a pair with a chat template, chat requests rendered by it ("chat"); ``kind`` keeps one kind."""
    import json

    rows = [json.loads(line) for line in HELDOUT_PROMPTS.read_text().splitlines() if line.strip()]
    if kind is not None:
        rows = [r for r in rows if r.get("kind", "code") == kind]
    return [r["prompt"] for r in rows][:limit]


__all__ = ["DEFAULT_DRAFTER", "DEFAULT_DRAFTER2", "DEFAULT_TARGET", "EMBEDDED_DIR",
           "HELDOUT_PROMPTS", "SERVED_NAME", "available", "drafter2_available", "heldout_prompts", "load_default"]
