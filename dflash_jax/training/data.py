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


def read_jsonl(paths: Sequence[str | Path], max_examples: int | None = None) -> list[dict]:
    """All records of the JSONL files (blank lines skipped); errors name the file and line."""
    records: list[dict] = []
    try:
        for path in paths:
            for _, record in iter_jsonl(path):
                records.append(record)
                if max_examples is not None and len(records) >= max_examples:
                    return records
    except ValueError as err:  # iter_jsonl's "path:line: ..." errors: a bad line in the user's file
        raise DataError(str(err)) from None
    return records


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
    process_index: int = 0,
    process_count: int = 1,
) -> grain.IterDataset:
    """The training pipeline: an infinite ``IterDataset`` of host-local batches.

    Each batch is ``{"input_ids", "loss_mask", "segment_ids"}``, int32 ``[batch / hosts, seq_len]``;
    ``segment_ids`` is 0 on padding and numbers the examples of a packed row from 1.
    """
    if config.batch_size % process_count:
        raise ValueError(f"data.batch_size={config.batch_size} is not divisible by {process_count} hosts")
    if records is None:
        records = read_jsonl(config.train_files, config.max_examples)
    if not records:
        raise DataError(f"data.train_files: no records in {list(config.train_files)}")
    seq_len = config.seq_len
    ds = grain.MapDataset.source(records)
    if process_count > 1:
        ds = ds[process_index::process_count]
    if config.shuffle:
        ds = ds.shuffle(seed=config.seed)
    ds = ds.repeat(None)
    ds = ds.map(lambda r: tokenize_record(r, tokenizer, seq_len))
    it = ds.to_iter_dataset()
    min_sup = max(1, config.min_supervised)
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


def read_prompts(path: str | Path, tokenizer: TokenizerLike | None, limit: int | None = None) -> list[list[int]]:
    """Held-out prompts as token ids, built as ``serve.py generate`` builds them: ``prompt_ids`` as
    is, ``prompt`` (a string) encoded with special tokens, ``messages`` through the chat template with
    the generation prompt (a trailing assistant turn is dropped); also ``input_ids`` / ``text``."""
    prompts: list[list[int]] = []
    for record in read_jsonl([path], limit):
        if "input_ids" in record:
            prompts.append([int(t) for t in record["input_ids"]])
        elif "messages" in record:
            messages = list(record["messages"])
            while messages and messages[-1].get("role") == "assistant":
                messages.pop()
            prompts.append(prompt_ids({"messages": messages}, tokenizer))
        elif "prompt_ids" in record or "prompt" in record:
            prompts.append(prompt_ids(record, tokenizer))
        elif "text" in record:
            prompts.append(list(tokenizer.encode(record["text"], add_special_tokens=True)))
        else:
            raise DataError(f"{path}: a prompt record needs prompt_ids, prompt, messages, input_ids or text")
    return prompts
