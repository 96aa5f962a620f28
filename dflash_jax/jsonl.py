"""The one JSONL reader: records with their line numbers; errors name the file and the line."""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Iterator


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields ``(line_number, record)`` for every non-blank line of ``path`` (UTF-8; a leading BOM is
    skipped, as editors on Windows write one).

    Raises ``FileNotFoundError`` or ``ValueError("path:line: ...")`` for a missing file, a line that
    is not UTF-8, invalid JSON, a line that is not a JSON object or a string with a lone surrogate
    escape (``"\\ud800"``: valid JSON, but no UTF-8 text, so it could neither be tokenized nor written
    back out). Other ``OSError``s (a directory, no permission) propagate.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: file not found")
    with path.open("rb") as f:  # decoded line by line, so that bad bytes are reported with their line
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text: byte {raw[err.start]:#04x} at column "
                                 f"{err.start + 1}") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {err}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            if "\\u" in line:  # only \u escapes make surrogates, and the check re-encodes the record
                try:
                    json.dumps(record, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"{path}:{lineno}: a string has a lone surrogate escape (\\ud800-\\udfff "
                                     "without its pair): not valid Unicode text") from None
            yield lineno, record
