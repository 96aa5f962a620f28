"""Training data: JSONL conversations or text -> token ids + loss mask -> a grain pipeline.

Record formats (one JSON object per line):

- ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the tokenizer's chat
  template; only assistant tokens are supervised. Assistant spans are found by rendering the
  template on prefixes of the conversation: the span of assistant message ``i`` runs from the
  end of ``render(messages[:i], add_generation_prompt=True)`` to the end of
  ``render(messages[:i + 1])``, measured against the full rendering (robust to templates that
  render a turn differently once it is no longer the last one, such as Qwen3's ``<think>`` blocks).
- ``{"text": "..."}``: every token supervised.
- ``{"prompt": str | messages, "response" | "completion" | "output" | "answer": str}``: a
  prompt/answer pair (what ``serve.py generate`` writes), treated as a two-turn conversation.
- ``{"input_ids": [...], "loss_mask": [...]}``: already tokenized (``loss_mask`` defaults to all 1).
- ``serve.py generate`` output lines (``prompt_ids`` / ``prompt`` / ``messages`` plus ``output_ids``):
  the prompt is rebuilt exactly as serve.py built it and the target's own ``output_ids`` are
  appended unchanged and supervised (no re-tokenization of the answer). This is the regenerated-data
  recipe of docs/training.md.

Examples are truncated to ``seq_len`` and either padded (one example per row) or first-fit packed
(several per row, ``segment_ids`` telling them apart; the trainer never lets a label cross into
another segment). The pipeline is grain: a ``MapDataset`` over the records (sliced per host,
shuffled with a seed, repeated with a fresh shuffle each epoch, tokenized lazily), then an
``IterDataset`` (filter, pack, batch, background prefetch) whose iterator state is checkpointed.

The tokenizer is duck-typed: anything with ``encode(text, add_special_tokens=...)`` and
``apply_chat_template(messages, add_generation_prompt=..., tokenize=True)`` returning ids works
(``dflash_jax.io.tokenizer.Tokenizer`` in production, a tiny stand-in in tests).
"""

from __future__ import annotations

import difflib

from pathlib import Path
from typing import Any, Protocol, Sequence

import grain
import grain.experimental as grain_exp
import numpy as np

from dflash_jax.io.jsonl import iter_jsonl
from dflash_jax.training.config import DataConfig

_ANSWER_KEYS = ("response", "completion", "output", "answer")


class DataError(ValueError):
    """A data file (or the records given) cannot be used: the message names the file and line."""


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = ..., tokenize: bool = ...
    ) -> Any: ...


def read_records(paths: Sequence[str | Path], max_examples: int | None = None) -> list[tuple[str, dict]]:
    """``("path:line", record)`` for every record of the JSONL files (blank lines skipped); every
    error is a ``DataError`` naming the file (and the line, for a bad line)."""
    out: list[tuple[str, dict]] = []
    for path in paths:
        path = Path(path)
        if path.is_dir():
            raise DataError(f"{path}: is a directory; list the JSONL files in it instead")
        try:
            for lineno, record in iter_jsonl(path):
                out.append((f"{path}:{lineno}", record))
                if max_examples is not None and len(out) >= max_examples:
                    return out
        except FileNotFoundError:
            raise
        except OSError as err:  # no permission, a device, ...
            raise DataError(f"{path}: cannot be read: {err.strerror or err}") from None
        except ValueError as err:  # iter_jsonl names the file and the line
            raise DataError(str(err)) from None
    return out


def read_jsonl(paths: Sequence[str | Path], max_examples: int | None = None) -> list[dict]:
    """All records of the JSONL files (blank lines skipped); errors name the file and line."""
    return [record for _, record in read_records(paths, max_examples)]


def _show(value: Any) -> str:
    """A short rendering of a JSON value for an error message."""
    if isinstance(value, bool) or value is None:
        return "null" if value is None else str(value).lower()
    if isinstance(value, (int, np.integer)):
        value = int(value)
        return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else repr(value[:40]) + "..."
    if isinstance(value, float):
        return repr(value)
    return {dict: "an object", list: "a list"}.get(type(value), type(value).__name__)


def _is_int(t: type) -> bool:
    return issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_))


def check_ids(value: Any, field: str, where: str, vocab_size: int | None) -> None:
    """Raises a ``DataError`` naming ``where`` unless ``value`` is a list (or 1-D integer array) of
    token ids in ``[0, vocab_size)`` (``[0, 2**31)`` when the vocabulary is not known)."""
    limit = vocab_size if vocab_size is not None else 2**31 - 1
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or (value.size and value.dtype.kind not in "iu"):
            raise DataError(f"{where}: {field} must be a list of integer token ids, got an array of "
                            f"{value.dtype} and shape {value.shape}")
        value = value.tolist()
    if not isinstance(value, list):
        raise DataError(f"{where}: {field} must be a list of integer token ids, got {_show(value)}")
    if not value:
        return
    if not all(map(_is_int, set(map(type, value)))):
        i, bad = next((i, v) for i, v in enumerate(value) if not _is_int(type(v)))
        raise DataError(f"{where}: {field}[{i}] is {_show(bad)}, not an integer token id")
    if min(value) < 0 or max(value) >= limit:
        i = next(i for i, v in enumerate(value) if not 0 <= v < limit)
        what = f"the vocabulary [0, {limit})" if vocab_size is not None else f"[0, {limit})"
        raise DataError(f"{where}: {field}[{i}] = {_show(value[i])} is outside {what}")


def _check_messages(value: Any, field: str, where: str) -> None:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {field} must be a non-empty list of messages, got {_show(value)}")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {field}[{i}] must be an object with 'role' and 'content', got {_show(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise DataError(f"{where}: {field}[{i}].role must be a non-empty string, got {_show(role)}")
        content = message.get("content")
        if not (content is None or isinstance(content, str)
                or (isinstance(content, list) and all(isinstance(part, dict) for part in content))):
            raise DataError(f"{where}: {field}[{i}].content must be a string (or a list of content-part objects, "
                            f"or null), got {_show(content)}")


def _check_text(value: Any, field: str, where: str) -> None:
    if not isinstance(value, str):
        raise DataError(f"{where}: {field} must be a string, got {_show(value)}")


def check_record(record: Any, where: str, vocab_size: int | None = None) -> None:
    """Raises a ``DataError`` naming ``where`` (``path:line``) unless ``record`` has one of the
    formats of this module's docstring with values of the right types (token ids in the vocabulary).
    Keys the format does not use are ignored (``serve.py generate`` lines carry several)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {_show(record)}")
    if "output_ids" in record:
        check_ids(record["output_ids"], "output_ids", where, vocab_size)
        if "prompt_ids" in record:
            check_ids(record["prompt_ids"], "prompt_ids", where, vocab_size)
        elif "prompt" in record:
            _check_text(record["prompt"], "prompt", where)
        elif "messages" in record:
            _check_messages(record["messages"], "messages", where)
        else:
            raise DataError(f"{where}: a record with output_ids needs prompt_ids, prompt or messages; "
                            f"keys {_keys(record)}")
    elif "input_ids" in record:
        check_ids(record["input_ids"], "input_ids", where, vocab_size)
        near = difflib.get_close_matches("loss_mask", [k for k in record if isinstance(k, str)], n=1, cutoff=0.75)
        if "loss_mask" not in record and near:
            # A misspelled mask would otherwise train on every token, prompt included, without a word.
            raise DataError(f"{where}: unknown key {_show(near[0])}; did you mean 'loss_mask'?")
        if "loss_mask" in record:
            mask = record["loss_mask"]
            if not isinstance(mask, (list, np.ndarray)) or len(mask) != len(record["input_ids"]):
                raise DataError(f"{where}: loss_mask must be a list of 0/1 of the length of input_ids "
                                f"({len(record['input_ids'])}), got {_show(mask)}"
                                + (f" of length {len(mask)}" if isinstance(mask, list) else ""))
            mask = mask.tolist() if isinstance(mask, np.ndarray) else mask
            if not (set(map(type, mask)) <= {int, bool} and set(mask) <= {0, 1}):
                i, m = next((i, m) for i, m in enumerate(mask) if not (type(m) in (int, bool) and m in (0, 1)))
                raise DataError(f"{where}: loss_mask[{i}] is {_show(m)}; expected 0 or 1")
    elif "messages" in record:
        _check_messages(record["messages"], "messages", where)
    elif "prompt" in record:
        prompt = record["prompt"]
        if isinstance(prompt, list):
            _check_messages(prompt, "prompt", where)
        else:
            _check_text(prompt, "prompt", where)
        key = next((k for k in _ANSWER_KEYS if k in record), None)
        if key is None:
            raise DataError(f"{where}: a record with 'prompt' needs an answer ({', '.join(_ANSWER_KEYS)}) or "
                            f"output_ids; keys {_keys(record)}")
        _check_text(record[key], key, where)
    elif "text" in record:
        _check_text(record["text"], "text", where)
    else:
        raise DataError(f"{where}: a record needs input_ids, output_ids, messages, prompt or text; "
                        f"keys {_keys(record)}")


def _keys(record: dict) -> str:
    keys = [_show(k) for k in list(record)[:10]]
    return "[" + ", ".join(keys) + (", ...]" if len(record) > 10 else "]")


def _ids(x: Any) -> list[int]:
    """Token ids from whatever ``apply_chat_template(tokenize=True)`` returned."""
    if isinstance(x, dict) or hasattr(x, "keys"):
        x = x["input_ids"]
    x = list(np.asarray(x).reshape(-1).tolist())
    return [int(t) for t in x]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prompt_ids(record: dict, tokenizer: TokenizerLike | None) -> list[int]:
    """The prompt tokens of a ``serve.py generate`` line, built as serve.py builds them:
    ``prompt_ids`` as is, ``prompt`` encoded with special tokens, ``messages`` through the chat
    template with the generation prompt."""
    if "prompt_ids" in record:
        return [int(t) for t in record["prompt_ids"]]
    if tokenizer is None:
        raise ValueError("records with 'prompt' or 'messages' need a tokenizer")
    if "prompt" in record:
        return list(tokenizer.encode(record["prompt"], add_special_tokens=True))
    if "messages" in record:
        return _ids(tokenizer.apply_chat_template(list(record["messages"]), add_generation_prompt=True, tokenize=True))
    raise ValueError(f"record with output_ids has no prompt_ids, prompt or messages: keys {sorted(record)}")


def record_messages(record: dict) -> list[dict] | None:
    """The conversation of a record, or None for a plain-text record."""
    if "messages" in record:
        return list(record["messages"])
    if "prompt" in record:
        answer = next((record[k] for k in _ANSWER_KEYS if k in record), None)
        if answer is None:
            raise ValueError(f"record with 'prompt' has no answer key (one of {_ANSWER_KEYS})")
        prompt = record["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return messages + [{"role": "assistant", "content": answer}]
    if "text" in record:
        return None
    raise ValueError(f"record has none of 'messages', 'prompt', 'text': keys {sorted(record)}")


def _tail_match(through: Sequence[int], start_in_through: int, full: Sequence[int], start: int,
                max_drop: int = 256) -> int:
    """The largest ``L`` such that the last ``L`` tokens of ``through`` (after ``start_in_through``)
    equal ``full[start:start + L]``: the assistant turn as ``full`` renders it when the template
    rewrote it while it was the last turn (e.g. Qwen3 adds an empty ``<think>`` block only there)."""
    t = np.asarray(through[start_in_through:], np.int64)
    f = np.asarray(full[start:], np.int64)
    n = len(t)
    for L in range(min(n, len(f)), max(0, n - max_drop) - 1, -1):
        if L and np.array_equal(t[n - L:], f[:L]):
            return L
    return 0


def chat_ids_and_mask(tokenizer: TokenizerLike, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the rendered conversation and a 0/1 mask of its assistant tokens.

    Assistant turn ``i`` starts where ``render(messages[:i], add_generation_prompt=True)`` stops
    matching the full rendering, and ends where ``render(messages[:i + 1])`` does; when the template
    renders a turn differently while it is the last one (Qwen3's ``<think>`` handling), the turn is
    the longest tail of that rendering found in the full one at the start position.
    """
    full = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True))
    mask = np.zeros(len(full), np.int32)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _ids(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True)) if i else []
        through = _ids(tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=False, tokenize=True))
        start = _common_prefix(before, full)
        if _common_prefix(through, full) == len(through):
            end = len(through)
        else:
            end = start + _tail_match(through, _common_prefix(before, through), full, start)
        if end > start:
            mask[start:end] = 1
    return np.asarray(full, np.int32), mask


def tokenize_record(record: dict, tokenizer: TokenizerLike | None, seq_len: int) -> dict[str, np.ndarray]:
    """``{"input_ids", "loss_mask"}`` int32 arrays, truncated to ``seq_len``."""
    if "output_ids" in record:  # serve.py generate output: the target's own tokens, exactly
        prompt = np.asarray(prompt_ids(record, tokenizer), np.int32)
        out = np.asarray(record["output_ids"], np.int32)
        ids = np.concatenate([prompt, out])
        mask = np.concatenate([np.zeros(len(prompt), np.int32), np.ones(len(out), np.int32)])
        return {"input_ids": ids[:seq_len], "loss_mask": mask[:seq_len]}
    if "input_ids" in record:  # pre-tokenized
        ids = np.asarray(record["input_ids"], np.int32)
        mask = np.asarray(record.get("loss_mask", np.ones(len(ids))), np.int32)
        if mask.shape != ids.shape:
            raise ValueError(f"loss_mask has {mask.shape[0]} entries for {ids.shape[0]} input_ids")
        return {"input_ids": ids[:seq_len], "loss_mask": mask[:seq_len]}
    if tokenizer is None:
        raise ValueError("records with text or messages need a tokenizer")
    messages = record_messages(record)
    if messages is None:
        ids = np.asarray(tokenizer.encode(record["text"], add_special_tokens=True), np.int32)
        mask = np.ones(len(ids), np.int32)
    else:
        ids, mask = chat_ids_and_mask(tokenizer, messages)
    return {"input_ids": ids[:seq_len], "loss_mask": mask[:seq_len]}


def _pad_row(example: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    n = len(example["input_ids"])
    out = {}
    for key in ("input_ids", "loss_mask"):
        row = np.zeros(seq_len, np.int32)
        row[:n] = example[key]
        out[key] = row
    seg = np.zeros(seq_len, np.int32)
    seg[:n] = 1
    out["segment_ids"] = seg
    return out


def _packed_row(example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "input_ids": example["input_ids"].astype(np.int32),
        "loss_mask": example["loss_mask"].astype(np.int32),
        "segment_ids": example["input_ids_segment_ids"].astype(np.int32),
    }


def build_dataset(
    config: DataConfig,
    tokenizer: TokenizerLike,
    *,
    records: list[dict] | None = None,
    vocab_size: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.IterDataset:
    """The training pipeline: an infinite ``IterDataset`` of host-local batches.

    Each batch is ``{"input_ids", "loss_mask", "segment_ids"}``, int32 ``[batch / hosts, seq_len]``;
    ``segment_ids`` is 0 on padding and numbers the examples of a packed row from 1.

    Every record is checked as it is read (``check_record``: its format, the types of its values,
    token ids in ``[0, vocab_size)``); a record the tokenizer fails on, or whose tokenized ids fall
    outside the vocabulary, fails when it is reached. Errors are ``DataError``s naming the file and
    line (``records[i]`` for records given in memory). Before the pipeline is returned, this host's
    records are tokenized in order until one keeps ``data.min_supervised`` supervised tokens within
    ``seq_len`` (usually the first): when none does, a ``DataError`` says so instead of a pipeline
    that would filter forever.
    """
    if config.batch_size % process_count:
        raise ValueError(f"data.batch_size={config.batch_size} is not divisible by {process_count} hosts")
    if records is None:
        located = read_records(config.train_files, config.max_examples)
        source = f"data.train_files {list(config.train_files)}"
    else:
        located = [(f"records[{i}]", r) for i, r in enumerate(records)]
        source = "the records given"
    if not located:
        raise DataError(f"data.train_files: no records in {list(config.train_files)}")
    for where, record in located:
        check_record(record, where, vocab_size)
    seq_len = config.seq_len
    min_sup = max(1, config.min_supervised)

    def example(i: int) -> dict[str, np.ndarray]:
        where, record = located[i]
        try:
            ex = tokenize_record(record, tokenizer, seq_len)
        except DataError:
            raise
        except Exception as err:  # the tokenizer or its chat template failed on this record
            raise DataError(f"{where}: cannot tokenize the record: {type(err).__name__}: {err}") from err
        ids = ex["input_ids"]
        if vocab_size is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
            raise DataError(f"{where}: the tokenized record has token id {bad}, outside the target's vocabulary "
                            f"[0, {vocab_size}): the tokenizer does not match the target")
        return ex

    local = range(len(located))[process_index::process_count]
    if not any(int(example(i)["loss_mask"].sum()) >= min_sup for i in local):
        host = f" on host {process_index} of {process_count}" if process_count > 1 else ""
        raise DataError(
            f"{source}: none of the {len(local)} records{host} has data.min_supervised={min_sup} supervised tokens "
            f"within data.seq_len={seq_len} tokens (all-zero loss masks, or prompts longer than seq_len): "
            "nothing to train on"
        )
    ds = grain.MapDataset.range(len(located))
    if process_count > 1:
        ds = ds[process_index::process_count]
    if config.shuffle:
        ds = ds.shuffle(seed=config.seed)
    ds = ds.repeat(None)
    ds = ds.map(example)
    it = ds.to_iter_dataset()
    it = it.filter(lambda ex: int(ex["loss_mask"].sum()) >= min_sup)
    if config.pack:
        it = grain_exp.FirstFitPackIterDataset(
            it,
            length_struct={"input_ids": seq_len, "loss_mask": seq_len},
            num_packing_bins=max(2, config.batch_size // process_count),
            seed=config.seed,
            shuffle_bins=config.shuffle,
        )
        it = it.map(_packed_row)
    else:
        it = it.map(lambda ex: _pad_row(ex, seq_len))
    it = it.batch(config.batch_size // process_count, drop_remainder=True)
    if config.worker_count > 0:
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.worker_count))
    elif config.prefetch > 0:
        it = grain_exp.ThreadPrefetchIterDataset(it, prefetch_buffer_size=config.prefetch)
    return it


def read_prompts(path: str | Path, tokenizer: TokenizerLike | None, limit: int | None = None,
                 vocab_size: int | None = None) -> list[list[int]]:
    """Held-out prompts as token ids, built as ``serve.py generate`` builds them: ``prompt_ids`` as
    is, ``prompt`` (a string) encoded with special tokens, ``messages`` through the chat template with
    the generation prompt (a trailing assistant turn is dropped); also ``input_ids`` / ``text``.
    Errors are ``DataError``s naming the file and line."""
    prompts: list[list[int]] = []
    for where, record in read_records([path], limit):
        try:
            if "input_ids" in record or "prompt_ids" in record:
                key = "input_ids" if "input_ids" in record else "prompt_ids"
                check_ids(record[key], key, where, vocab_size)
                prompts.append([int(t) for t in record[key]])
            elif "messages" in record:
                _check_messages(record["messages"], "messages", where)
                messages = list(record["messages"])
                while messages and messages[-1].get("role") == "assistant":
                    messages.pop()
                prompts.append(prompt_ids({"messages": messages}, tokenizer))
            elif "prompt" in record:
                _check_text(record["prompt"], "prompt", where)
                prompts.append(prompt_ids(record, tokenizer))
            elif "text" in record:
                _check_text(record["text"], "text", where)
                if tokenizer is None:
                    raise DataError(f"{where}: text prompts need a tokenizer")
                prompts.append(list(tokenizer.encode(record["text"], add_special_tokens=True)))
            else:
                raise DataError(f"{where}: a prompt record needs prompt_ids, prompt, messages, input_ids or text; "
                                f"keys {_keys(record)}")
        except DataError:
            raise
        except Exception as err:  # the tokenizer or its chat template failed on this record
            raise DataError(f"{where}: cannot tokenize the prompt: {type(err).__name__}: {err}") from err
    return prompts
