"""The one JSONL reader: records with their line numbers; errors name the file and the line."""

from __future__ import annotations

import codecs
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields ``(line_number, record)`` for every non-blank line of ``path`` (UTF-8; a leading BOM is
    skipped, as editors on Windows write one).

    Raises ``FileNotFoundError`` or ``ValueError("path:line: ...")`` for a missing file, a line that
    is not UTF-8, invalid JSON (nesting deeper than Python's parser takes and integers past its digit
    limit included, which ``json`` reports without a line), a line that is not a JSON object or a string with a lone surrogate
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
            except RecursionError:
                raise ValueError(f"{path}:{lineno}: invalid JSON: nested too deeply (Python's parser takes under "
                                 "1,000 levels)") from None
            except json.JSONDecodeError as err:
                # json counts lines and columns in the text it was given: past the line's own end its
                # "line 2 column 1" would contradict the file's line number named before it
                end = len(line.rstrip("\r\n"))
                where = "at the end of the line" if err.pos >= end else f"at column {err.pos + 1}"
                raise ValueError(f"{path}:{lineno}: invalid JSON: {err.msg} {where}") from None
            except ValueError as err:  # an integer past Python's digit limit
                message = str(err)
                if "integer string conversion" in message:
                    message = f"an integer has more than {sys.get_int_max_str_digits()} digits"
                raise ValueError(f"{path}:{lineno}: invalid JSON: {message}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            if "\\u" in line and has_lone_surrogate(record):  # only \u escapes make surrogates
                raise ValueError(f"{path}:{lineno}: a string has a lone surrogate escape (\\ud800-\\udfff "
                                 "without its pair): not valid Unicode text")
            yield lineno, record


# json.loads joins an escaped pair into one character: a surrogate left in a string is a lone one.
_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(value: Any) -> bool:
    """Whether a string in parsed JSON ``value`` (object keys included) holds a lone UTF-16 surrogate:
    valid JSON (a ``\\ud800`` escape without its pair) but no character, so neither a tokenizer nor
    UTF-8 output can take it."""
    stack = [value]
    while stack:  # no recursion: parsed JSON may nest as deeply as json's parser took
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False
