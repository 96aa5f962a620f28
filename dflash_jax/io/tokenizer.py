"""Tokenizer and chat template of an HF model directory, without transformers.

``Tokenizer(directory)`` reads

- ``tokenizer.json`` through the ``tokenizers`` library (the fast tokenizer every HF checkpoint ships);
- ``tokenizer_config.json``: the chat template (a string, or a list of ``{name, template}`` of which
  ``default`` is used), the named special tokens (strings or AddedToken dicts with a ``content`` key),
  ``add_bos_token`` / ``add_eos_token``, ``added_tokens_decoder``, ``clean_up_tokenization_spaces``;
- ``chat_template.jinja`` / ``chat_template.json`` when present (transformers 5 saves the template there;
  they win over ``tokenizer_config.json`` as in transformers);
- ``generation_config.json`` and ``config.json`` for the ``eos_token_id`` list used as stop tokens.

The chat template is rendered the way ``transformers`` renders it (``ImmutableSandboxedEnvironment``
with ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, a no-op ``{% generation %}`` tag,
``raise_exception``, a ``tojson`` that does not escape HTML, ``strftime_now``, and the named special
tokens as variables), and the rendered text is encoded without adding special tokens, so the ids equal
``AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tokenize=True)``.

Every problem with the files raises :class:`TokenizerError` naming the file and the field.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["Tokenizer", "TokenizerError", "ChatTemplateError", "IncrementalDetokenizer"]

# transformers' SPECIAL_TOKENS_ATTRIBUTES (v5): these become template variables (``bos_token`` ...).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed; the message names the file and the field.

    ``reason``: the problem without the file's path, where one is set (the chat-template errors), for
    messages to clients, which must not learn the server's file system."""

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


class ChatTemplateError(ValueError):
    """The chat template could not be rendered (``raise_exception`` in the template, a syntax error, ...)."""


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.exists():
        if required:
            raise TokenizerError(f"{path}: file not found")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{path}: invalid JSON: {err}") from None
    except OSError as err:
        raise TokenizerError(f"{path}: cannot read: {err}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: the top level must be a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, where: str) -> str | None:
    """A special token in tokenizer_config.json: null, a string, or an AddedToken dict with ``content``."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = value.get("content")
        if not isinstance(content, str):
            raise TokenizerError(f"{where}: an AddedToken object needs a string 'content', got {value!r}")
        return content
    raise TokenizerError(f"{where}: expected a string, an AddedToken object or null, got {value!r}")


def _eos_ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        raise TokenizerError(f"{where}: expected an integer or a list of integers, got {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise TokenizerError(f"{where}: expected an integer or a list of integers, got {value!r}")


@functools.lru_cache(maxsize=32)
def _compile_template(source: str):
    """Compiles a chat template exactly as transformers' ``_compile_jinja_template`` does."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        # transformers' AssistantTracker: ``{% generation %}...{% endgeneration %}`` renders its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


# transformers' clean_up_tokenization (``clean_up_tokenization_spaces``), applied in this order.
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _uses_decoder(decoder: Any, kind: str) -> bool:
    """Whether a ``tokenizers`` decoder is ``kind`` or a ``Sequence`` holding one."""
    if decoder is None:
        return False

    def walk(node: Any) -> bool:
        return isinstance(node, dict) and (node.get("type") == kind or any(walk(d) for d in node.get("decoders", ())))

    return walk(json.loads(decoder.__getstate__()))


_MAX_PENDING = 3  # U+FFFD at a text's end that may still become a character: an incomplete sequence's bytes
_MAX_MARKS = 4     # chunk boundaries an IncrementalDetokenizer keeps while a character is incomplete


def _cleanup_tail(text: str) -> int:
    """Characters at the end of ``text`` that begin a cleanup pattern, which later text may complete."""
    held = 0
    for old, _ in _CLEANUP:
        for n in range(min(len(old) - 1, len(text)), held, -1):
            if text.endswith(old[:n]):
                held = n
                break
    return held


class Tokenizer:
    """The tokenizer and chat template of an HF model directory (see the module docstring)."""

    def __init__(self, directory: str | Path):
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as _HFTokenizer

        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise TokenizerError(f"{self.directory}: tokenizer directory not found")

        tok_path = self.directory / "tokenizer.json"
        if not tok_path.exists():
            raise TokenizerError(
                f"{tok_path}: file not found (the model directory must ship a fast tokenizer, tokenizer.json)"
            )
        try:
            self._tok = _HFTokenizer.from_file(str(tok_path))
        except Exception as err:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"{tok_path}: cannot load: {err}") from None

        cfg_path = self.directory / "tokenizer_config.json"
        cfg = _read_json(cfg_path, required=False) or {}
        self.config = cfg

        # Named special tokens (bos_token, eos_token, ...).
        self.special_tokens: dict[str, str] = {}
        for name in _NAMED_SPECIAL_TOKENS:
            content = _token_content(cfg.get(name), f"{cfg_path}: field '{name}'")
            if content is not None:
                self.special_tokens[name] = content

        # Tokens transformers adds on load when tokenizer.json lacks them: added_tokens_decoder entries,
        # extra/additional special tokens and the named special tokens.
        vocab = self._tok.get_vocab(with_added_tokens=True)
        to_add: list[Any] = []
        added = cfg.get("added_tokens_decoder") or {}
        if not isinstance(added, dict):
            raise TokenizerError(f"{cfg_path}: field 'added_tokens_decoder' must be an object, got {added!r}")
        for key, spec in sorted(added.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
            where = f"{cfg_path}: field 'added_tokens_decoder.{key}'"
            if not isinstance(spec, dict):
                raise TokenizerError(f"{where}: expected an AddedToken object, got {spec!r}")
            content = _token_content(spec, where)
            if content not in vocab:
                to_add.append(
                    AddedToken(
                        content,
                        single_word=bool(spec.get("single_word", False)),
                        lstrip=bool(spec.get("lstrip", False)),
                        rstrip=bool(spec.get("rstrip", False)),
                        normalized=bool(spec.get("normalized", not spec.get("special", False))),
                        special=bool(spec.get("special", False)),
                    )
                )
                vocab[content] = -1
        extra: list[str] = []
        for field in ("extra_special_tokens", "additional_special_tokens"):
            value = cfg.get(field)
            if value is None:
                continue
            items = value.values() if isinstance(value, dict) else value
            if not isinstance(items, (list, tuple, type({}.values()))):
                raise TokenizerError(f"{cfg_path}: field '{field}' must be a list, got {value!r}")
            for i, item in enumerate(items):
                content = _token_content(item, f"{cfg_path}: field '{field}[{i}]'")
                if content is not None:
                    extra.append(content)
        for content in list(self.special_tokens.values()) + extra:
            if content not in vocab:
                to_add.append(AddedToken(content, special=True, normalized=False))
                vocab[content] = -1
        if to_add:
            self._tok.add_tokens(to_add)

        # Special tokens added by encode(add_special_tokens=True) come from tokenizer.json's post-processor
        # alone. transformers 5 drops add_bos_token/add_eos_token from tokenizer_config.json whenever a
        # tokenizer.json exists (and a post-processor-less tokenizer.json adds nothing), so the flags are
        # read and kept as attributes but do not change the ids: this keeps our ids equal to
        # AutoTokenizer's (and so to vLLM/SGLang, which use it).
        for field in ("add_bos_token", "add_eos_token"):
            if field in cfg and cfg[field] is not None and not isinstance(cfg[field], bool):
                raise TokenizerError(f"{cfg_path}: field '{field}' must be true or false, got {cfg[field]!r}")
        self.add_bos_token = bool(cfg.get("add_bos_token") or False)
        self.add_eos_token = bool(cfg.get("add_eos_token") or False)

        clean = cfg.get("clean_up_tokenization_spaces", False)
        # transformers skips the (WordPiece-era) cleanup for BPE models.
        self._clean_up_spaces = bool(clean) and type(self._tok.model).__name__ != "BPE"
        self._byte_fallback = _uses_decoder(self._tok.decoder, "ByteFallback")

        self._chat_templates, self._chat_template_source = self._load_chat_templates(cfg, cfg_path)

        # Stop tokens: eos ids of generation_config.json, config.json and the tokenizer's eos token.
        stop: list[int] = []
        for name in ("generation_config.json", "config.json"):
            path = self.directory / name
            data = _read_json(path, required=False)
            if data is None:
                continue
            for i in _eos_ids(data.get("eos_token_id"), f"{path}: field 'eos_token_id'"):
                if i not in stop:
                    stop.append(i)
        if self.eos_token is not None:
            eos_id = self.token_to_id(self.eos_token)
            if eos_id is not None and eos_id not in stop:
                stop.append(eos_id)
        self.stop_token_ids: list[int] = stop

    # ------------------------------------------------------------------ chat templates

    def _load_chat_templates(self, cfg: dict[str, Any], cfg_path: Path) -> tuple[dict[str, str], str]:
        jinja_path = self.directory / "chat_template.jinja"
        if jinja_path.exists():
            templates = {"default": jinja_path.read_text(encoding="utf-8")}
            extra_dir = self.directory / "additional_chat_templates"
            if extra_dir.is_dir():
                for p in sorted(extra_dir.glob("*.jinja")):
                    templates[p.stem] = p.read_text(encoding="utf-8")
            return templates, str(jinja_path)
        json_path = self.directory / "chat_template.json"
        data = _read_json(json_path, required=False)
        if data is not None and "chat_template" in data:
            return self._parse_template_field(data["chat_template"], f"{json_path}: field 'chat_template'"), str(
                json_path
            )
        if "chat_template" in cfg and cfg["chat_template"] is not None:
            where = f"{cfg_path}: field 'chat_template'"
            return self._parse_template_field(cfg["chat_template"], where), where
        return {}, ""

    @staticmethod
    def _parse_template_field(value: Any, where: str) -> dict[str, str]:
        if isinstance(value, str):
            return {"default": value}
        if isinstance(value, list):
            templates: dict[str, str] = {}
            for i, item in enumerate(value):
                if (
                    not isinstance(item, dict)
                    or not isinstance(item.get("name"), str)
                    or not isinstance(item.get("template"), str)
                ):
                    raise TokenizerError(f"{where}[{i}]: expected {{'name': str, 'template': str}}, got {item!r}")
                templates[item["name"]] = item["template"]
            return templates
        raise TokenizerError(f"{where}: expected a string or a list of {{name, template}}, got {type(value).__name__}")

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None when the model has none."""
        return self._chat_templates.get("default")

    @property
    def chat_template_names(self) -> list[str]:
        return sorted(self._chat_templates)

    def get_chat_template(self, name: str | None = None, tools: Any = None) -> str:
        if not self._chat_templates:
            reason = ("the model has no chat template (no 'chat_template' in tokenizer_config.json, "
                      "no chat_template.jinja)")
            raise TokenizerError(f"{self.directory}: {reason}", reason=reason)
        if name is not None:
            if name in self._chat_templates:
                return self._chat_templates[name]
            if "{" in name:  # a template given inline
                return name
            reason = f"no chat template named {name!r:.200}; available: {self.chat_template_names}"
            raise TokenizerError(f"{self._chat_template_source}: {reason}", reason=reason)
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        reason = f"several chat templates and none is named 'default'; available: {self.chat_template_names}"
        raise TokenizerError(f"{self._chat_template_source}: {reason}", reason=reason)

    def render_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat as text, rendered by the model's template (transformers' ``tokenize=False``)."""
        if not isinstance(messages, (list, tuple)) or len(messages) == 0:
            raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
        source = self.get_chat_template(chat_template, tools)
        import jinja2

        try:
            template = _compile_template(source)
        except jinja2.exceptions.TemplateSyntaxError as err:
            reason = f"chat template syntax error at line {err.lineno}: {err.message}"
            raise TokenizerError(f"{self._chat_template_source}: {reason}", reason=reason) from None
        variables = {**self.special_tokens, **template_kwargs}
        try:
            return template.render(
                messages=list(messages),
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as err:  # raise_exception(...), undefined names, sandbox
            raise ChatTemplateError(f"chat template error: {err}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:  # e.g. str + list
            raise ChatTemplateError(f"chat template error: {type(err).__name__}: {err}") from None

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Renders ``messages`` with the chat template; token ids when ``tokenize`` else the text.

        Like transformers, the rendered text is encoded WITHOUT adding special tokens (the template
        writes the BOS itself). Extra keyword arguments (``tools``, ``documents``, ``enable_thinking``,
        ``date_string``, ...) are template variables.
        """
        text = self.render_chat_template(messages, add_generation_prompt, **template_kwargs)
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a string, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def cleans_up_spaces(self) -> bool:
        """Whether ``decode`` removes spaces before punctuation (``clean_up_tokenization_spaces``, which
        transformers applies to WordPiece and Unigram models only)."""
        return self._clean_up_spaces

    @property
    def byte_fallback(self) -> bool:
        """Whether the decoder turns byte tokens (``<0xE4>``) into text (SentencePiece's byte fallback): a
        run of them that is not valid UTF-8 as a whole decodes to one U+FFFD per byte."""
        return self._byte_fallback

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.directory)!r}, vocab_size={self.vocab_size}, stop_token_ids={self.stop_token_ids})"


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas whose concatenation equals
    ``tokenizer.decode(all_ids)``.

    Text is held back while it is not an extension of what was already sent, and an incomplete UTF-8
    sequence at its end (U+FFFD) until it completes; ``finish()`` sends the rest.

    Each call decodes a window, the ids of the last chunk sent plus the new ones, and sends what the
    new ones add to the chunk's text (as TGI's and vLLM's detokenizers do): decoding every id each
    time made a stream quadratic in its length, on the event loop and holding the GIL (8,192 tokens
    in chunks of 8: 1.0 s). A window starts where an earlier one ended, at a character boundary, so
    a decoder's treatment of a sequence's first token (Metaspace drops its space) applies to both
    texts alike (never at a chunk without text: skipped special tokens). Tokenizers that clean up
    spaces (``clean_up_tokenization_spaces`` on a WordPiece or Unigram model) rewrite text across
    chunk boundaries, so for them each call decodes every id, and a tail that may begin a cleanup
    pattern (`` '``) waits for the text after it.

    While the text ends with an incomplete character the window cannot start after it, so a long run
    of undecodable bytes (a lone UTF-8 lead byte per id: a model gone astray, random weights) grew one
    window without end, quadratic again (8,192 such ids: 1.0 s in chunks of 8, 10.5 s one by one; now
    0.02 and 0.1 s). Only the last ``_MAX_PENDING`` U+FFFD can still become a character (not so with
    byte fallback, where the whole run waits as before), so the window moves to a recent chunk
    boundary whose text is all sent and splits its text exactly (``_move_pending_window``).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._windowed = not tokenizer.cleans_up_spaces
        self._start = 0    # the window's first id: where the last chunk sent began (0 unwindowed)
        self._read = 0     # ids before this are sent
        self._before = ""  # ids[_start:_read] decoded
        # While a character is incomplete: (ids, the window's text) at the last few chunk boundaries.
        self._pending_marks: tuple[tuple[int, str], ...] = ()
        # Byte fallback decodes an incomplete run of byte tokens to one U+FFFD per byte, all of which
        # the next byte may turn into characters: the whole trailing run of U+FFFD waits, as it is.
        self._max_pending = None if getattr(tokenizer, "byte_fallback", False) else _MAX_PENDING

    def add(self, new_ids: Sequence[int]) -> str:
        if not new_ids:
            return ""
        self.ids.extend(int(i) for i in new_ids)
        return self._send(final=False)

    def finish(self) -> str:
        return self._send(final=True)

    def mark(self) -> tuple:
        """The stream's position, for ``rewind``."""
        return len(self.ids), self._start, self._read, self._before, self._pending_marks

    def rewind(self, mark: tuple) -> None:
        """Forgets the ids added since ``mark`` (their text must not have been used)."""
        n, self._start, self._read, self._before, self._pending_marks = mark
        del self.ids[n:]

    def _send(self, final: bool) -> str:
        text = self.tokenizer.decode(self.ids[self._start:], self.skip_special_tokens)
        # Not an extension (a decoder rewrote sent text): what was sent cannot be taken back.
        if not text.startswith(self._before):
            return ""
        # An incomplete character (U+FFFD) at the end waits; the text before it goes now (a stop
        # string there must be seen with the ids that completed it: dflash_jax.serving.text_stream).
        end = len(text)
        if not final:  # an incomplete UTF-8 sequence decodes to one U+FFFD (byte-level BPE)
            pending = len(text) - len(text.rstrip("\ufffd"))
            end -= pending if self._max_pending is None else min(self._max_pending, pending)
        if not self._windowed and not final:  # the cleanup may yet rewrite a tail that begins a pattern
            end -= _cleanup_tail(text[:end])
        delta = text[len(self._before): end]
        if end < len(text):  # the window keeps its start until its last character is complete
            self._before = text[:max(end, len(self._before))]
            if self._windowed and self._max_pending is not None:
                self._move_pending_window(text)
            return delta
        self._pending_marks = ()
        chunk = self.tokenizer.decode(self.ids[self._read:], self.skip_special_tokens) if self._windowed else ""
        if chunk:  # the next window starts with this chunk, decoded on its own
            self._start, self._read, self._before = self._read, len(self.ids), chunk
        else:  # unwindowed, or a chunk with no text (skipped special tokens): a window starting there
            # would make the next id the decoder's first, whose space Metaspace and Strip decoders drop
            self._read, self._before = len(self.ids), text
        return delta

    def _move_pending_window(self, text: str) -> None:
        """Starts the window (whose text is ``text``, sent up to ``len(_before)``) at a recent chunk
        boundary ``s`` whose text ``head`` was all sent, if ``text`` is exactly ``head +
        decode(ids[s:])``: no character spans ``s`` (an incomplete one before it was ended by the bytes
        after it) and no decoder treats the id at ``s`` as a sequence's first (Metaspace). Else the
        window keeps its start, as before. Then records this call's boundary."""
        decodes = 0
        for s, head in reversed(self._pending_marks):  # the latest first; two short decodes at most
            if len(head) > len(self._before) or not text.startswith(head) or decodes == 2:
                continue
            decodes += 1
            tail = self.tokenizer.decode(self.ids[s:], self.skip_special_tokens)
            if tail and head + tail == text:
                self._start = self._read = s
                self._before, text = self._before[len(head):], tail
                self._pending_marks = tuple((n, t[len(head):]) for n, t in self._pending_marks
                                            if n > s and t.startswith(head))
                break
        self._pending_marks = (self._pending_marks + ((len(self.ids), text),))[-_MAX_MARKS:]

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids, self.skip_special_tokens)
