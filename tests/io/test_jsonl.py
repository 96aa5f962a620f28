"""The JSONL reader's errors point into the file: its line, and the column within that line."""

from __future__ import annotations

import pytest

from dflash_jax.io.jsonl import iter_jsonl


@pytest.mark.parametrize("text, expected", [
    ('{"a": 1}\n\n{"prompt": "x", "n": 8\n{"a": 2}\n', ":3: invalid JSON: Expecting ',' delimiter at the end of the line"),
    ('{"a": 1}\n{"a": 1', ":2: invalid JSON: Expecting ',' delimiter at the end of the line"),
    ('{"a": 1}\r\n{"a" 1}\r\n', ":2: invalid JSON: Expecting ':' delimiter at column 6"),
    ('{"a": 1}\n{"prompt": x}\n', ":2: invalid JSON: Expecting value at column 12"),
    ('{"a": 1}}\n', ":1: invalid JSON: Extra data at column 9"),
])
def test_invalid_json_names_the_file_line_and_column(tmp_path, text, expected):
    path = tmp_path / "in.jsonl"
    path.write_bytes(text.encode())
    with pytest.raises(ValueError) as err:
        list(iter_jsonl(path))
    assert str(err.value) == f"{path}{expected}"
    assert "line 1" not in str(err.value) and "line 2" not in str(err.value)
