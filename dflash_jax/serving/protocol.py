"""OpenAI-style request parsing and validation, response bodies and error bodies.

Requests are parsed strictly: unknown fields, ill-typed fields and settings this server does not
implement (suffix, best_of > 1, tools, structured output, ...) are errors that name the field.
Sampling fields become a ``SamplingParams`` (``dflash_jax.runtime.sampling``). Every error becomes an OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import uuid
from typing import Any

from dflash_jax.io.jsonl import has_lone_surrogate
from dflash_jax.runtime.sampling import MAX_SEED, VERIFY_MODES, SamplingParams
from dflash_jax.serving.text_stream import parse_stop_strings

# ----------------------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered to the client as an OpenAI error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    # The backstop of ``clip`` at each echoed value: no error body grows with what a client sent.
    return {"error": {"message": clip(message, MAX_MESSAGE_CHARS),
                      "param": None if param is None else clip(param), "type": type, "code": code}}


MAX_ECHO_CHARS = 200      # an echoed value (a field name, a model name, a number) in an error message
MAX_MESSAGE_CHARS = 2000  # a whole error message


def clip(text: Any, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` (or its ``str``) cut to about ``limit`` characters, saying how long it was."""
    text = text if isinstance(text, str) else str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def echo(value: Any, limit: int = MAX_ECHO_CHARS) -> str:
    """A client's value as JSON, clipped (a huge integer is clipped by digits, not converted whole)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    try:
        return clip(json.dumps(value, ensure_ascii=False), limit)
    except (TypeError, ValueError, RecursionError):
        return clip(repr(value), limit)


# An absolute POSIX path of two or more components (not the path part of a URL).
_PATH = re.compile(r"(?<![\w.:/~-])/(?:[\w.+@-]+/)+[\w.+@-]*")


def server_text(text: Any, limit: int = MAX_MESSAGE_CHARS // 2) -> str:
    """A server-side error text (an exception's message) fit for a client: absolute file-system
    paths replaced by ``<path>``, and clipped."""
    return clip(_PATH.sub("<path>", text if isinstance(text, str) else str(text)), limit)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(message, status=400, param=param, code=code)


def unsupported(param: str, value: Any, what: str) -> APIError:
    return APIError(
        f"{param}={echo(value)} is not supported yet: {what}",
        status=400,
        param=param,
        code="unsupported_parameter",
    )


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 naming the problem."""
    if not raw:
        raise invalid("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        # JSON over HTTP is UTF-8 (json.loads would take bytes in UTF-16 or 32, and encoded surrogates)
        text = raw.decode("utf-8-sig")
        data = json.loads(text)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's digit limit
        raise invalid(f"the request body is not valid JSON: {clip(err)}", code="invalid_json") from None
    except RecursionError:  # json's parser recurses per level of nesting
        raise invalid("the request body nests arrays or objects too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid(f"the request body must be a JSON object, got {_type_name(data)}", code="invalid_json")
    if _SURROGATE_ESCAPE.search(text):  # rare: only then look for a lone one
        for key, value in data.items():
            if has_lone_surrogate(key) or has_lone_surrogate(value):
                name = clip(key.encode("utf-8", "backslashreplace").decode("utf-8"))
                raise invalid(f"'{name}' holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
                              "which is not a character", param=name, code="invalid_json")
    return data


# JSON's \uXXXX escapes of UTF-16 surrogates: only they can make a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


# ----------------------------------------------------------------------------------------- type checks


# JSON type names for error messages; bool before int (a bool is an int in Python).
_JSON_TYPE_NAMES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                    (list, "array"), (dict, "object"))


def _type_name(value: Any) -> str:
    return next((name for kind, name in _JSON_TYPE_NAMES if isinstance(value, kind)), type(value).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """A JSON number that is a finite float: sampling fields become floats, and an integer past a
    float's range (JSON allows any) makes ``math.isfinite`` and ``float`` raise ``OverflowError``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _expect(body: dict, name: str, check, what: str, default: Any = None, *, nullable: bool = True) -> Any:
    if name not in body:
        return default
    value = body[name]
    if value is None:
        if nullable:
            return default
        raise invalid(f"'{name}' must be {what}, got null", param=name, code="invalid_type")
    if not check(value):
        raise invalid(f"'{name}' must be {what}, got {_type_name(value)} {echo(value, 80)}", param=name,
                      code="invalid_type")
    return value


def _bool(body, name, default=False):
    return _expect(body, name, lambda v: isinstance(v, bool), "a boolean", default)


def _check_unknown(body: dict, known: frozenset[str], endpoint: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(
            f"unknown field{'s' if len(unknown) > 1 else ''} {_names(unknown)} for {endpoint}",
            param=unknown[0],
            code="unknown_field",
        )


def _names(names: list[str], most: int = 10) -> str:
    """Field names a client sent, quoted, each clipped, at most ``most`` of them."""
    shown = ", ".join(repr(clip(n, 100)) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


# ----------------------------------------------------------------------------------------- requests


@dataclasses.dataclass
class CommonParams:
    """What completions and chat completions share after validation."""

    model: str | None
    max_tokens: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool
    seed: int | None
    user: str | None
    stop_token_ids: tuple[int, ...] = ()  # vLLM's extension: ids that end generation besides the model's
    stop: tuple[str, ...] = ()  # strings that end generation, left out of the text (dflash_jax.serving.text_stream)
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from (chat: or max_completion_tokens)
    sampling: SamplingParams = SamplingParams()  # logprobs: set by the endpoint's own fields
    n: int = 1                                   # choices per prompt


@dataclasses.dataclass
class CompletionRequest:
    # Each prompt is a string or a list of token ids; several prompts give several choices.
    prompts: list[str | list[int]]
    params: CommonParams
    echo: bool = False  # the prompt before each choice's text (and its logprobs, with logprobs)


@dataclasses.dataclass
class ChatCompletionRequest:
    messages: list[dict[str, Any]]
    params: CommonParams
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


_COMMON_FIELDS = frozenset(
    {
        "model", "max_tokens", "stream", "stream_options", "temperature", "top_p", "top_k", "n", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "logit_bias", "stop", "seed", "user", "ignore_eos",
        "return_token_ids", "stop_token_ids", "min_p", "min_tokens", "verify",
    }
)
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "logprobs", "suffix", "best_of"}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "chat_template_kwargs", "add_generation_prompt",
}

# OpenAI's limits: completions' logprobs up to 5, chat's top_logprobs up to 20, logit biases in [-100, 100].
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice ``choice`` of a request seeded ``seed``: choice 0 keeps it (a request with
    n = 1 and the same seed gives the same text), the others a deterministic mix of both."""
    if seed is None or choice == 0:
        return seed
    x = (seed + 0x9E3779B97F4A7C15 * choice) % MAX_SEED  # splitmix64's finalizer
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % MAX_SEED
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % MAX_SEED
    return x ^ (x >> 31)


def _sampling(body: dict) -> SamplingParams:
    """The request's sampling fields as ``SamplingParams`` (logprobs left to the endpoint)."""
    temperature = _expect(body, "temperature", _is_number, "a finite number")
    if temperature is not None and not 0 <= temperature <= 2:
        raise invalid(f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
    top_p = _expect(body, "top_p", _is_number, "a finite number")
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _expect(body, "top_k", _is_int, "an integer")
    if top_k is not None and top_k < -1:
        raise invalid(f"'top_k' must be -1 or 0 (off) or positive, got {echo(top_k)}", param="top_k")
    min_p = _expect(body, "min_p", _is_number, "a finite number")
    if min_p is not None and not 0 <= min_p <= 1:
        raise invalid(f"'min_p' must be in [0, 1], got {min_p}", param="min_p")
    penalties = {}
    for name, low, high in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("repetition_penalty", 0, None)):
        value = _expect(body, name, _is_number, "a finite number")
        if value is not None:
            if value < low or (high is not None and value > high) or (name == "repetition_penalty" and value == 0):
                bounds = f"in [{low}, {high}]" if high is not None else "> 0"
                raise invalid(f"'{name}' must be {bounds}, got {value}", param=name)
            penalties[name] = value
    logit_bias = _expect(body, "logit_bias", lambda v: isinstance(v, dict), "an object")
    bias = {}
    for key, value in (logit_bias or {}).items():
        # Plain ASCII digits only: int() also reads "1_0" (10), " 5" and other scripts' digits.
        if not re.fullmatch(r"-?[0-9]+", key):
            raise invalid(f"'logit_bias' keys must be token ids, got {echo(key)}", param="logit_bias")
        token = int(key)
        if token < 0:
            raise invalid(f"'logit_bias' has a negative token id {token}", param="logit_bias",
                          code="invalid_token_id")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise invalid(f"'logit_bias[{key}]' must be a number in [-100, 100], got {echo(value)}",
                          param="logit_bias")
        bias[token] = float(value)
    min_tokens = _expect(body, "min_tokens", _is_int, "an integer")
    if min_tokens is not None and min_tokens < 0:
        raise invalid(f"'min_tokens' must be >= 0, got {echo(min_tokens)}", param="min_tokens")
    seed = _expect(body, "seed", _is_int, "an integer")
    # An extension field (as vLLM's extra sampling fields): how a sampled row's drafts are verified.
    verify = _expect(body, "verify", lambda v: isinstance(v, str), "a string")
    if verify is not None and verify not in VERIFY_MODES:
        raise invalid(f"'verify' must be one of {', '.join(VERIFY_MODES)}, got {echo(verify)}", param="verify")
    return SamplingParams(
        temperature=float(temperature or 0.0), top_p=float(1.0 if top_p is None else top_p),
        top_k=max(0, top_k or 0), min_p=float(min_p or 0.0), seed=None if seed is None else seed % MAX_SEED,
        presence_penalty=float(penalties.get("presence_penalty", 0.0)),
        frequency_penalty=float(penalties.get("frequency_penalty", 0.0)),
        repetition_penalty=float(penalties.get("repetition_penalty", 1.0)), logit_bias=bias or None,
        min_tokens=min_tokens or 0, verify=verify or "exact",
    )


def _common(body: dict, *, max_tokens_fields: tuple[str, ...]) -> CommonParams:
    model = _expect(body, "model", lambda v: isinstance(v, str), "a string")

    max_tokens, max_tokens_param = None, max_tokens_fields[0]
    for name in max_tokens_fields:  # the later name wins (max_completion_tokens over max_tokens)
        value = _expect(body, name, _is_int, "an integer")
        if value is not None:
            if value < 1:
                raise invalid(f"'{name}' must be at least 1, got {echo(value)}", param=name)
            max_tokens, max_tokens_param = value, name

    stream = _bool(body, "stream")
    include_usage = False
    opts = _expect(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if opts is not None:
        bad = sorted(set(opts) - {"include_usage"})
        if bad:
            raise invalid(f"unknown field(s) {_names(bad)} in 'stream_options'", param="stream_options",
                          code="unknown_field")
        include_usage = opts.get("include_usage")
        if include_usage is None:
            include_usage = False
        elif not isinstance(include_usage, bool):  # named as a field of stream_options, the request's param
            raise invalid(f"'stream_options.include_usage' must be a boolean, got {_type_name(include_usage)}",
                          param="stream_options", code="invalid_type")
        if not stream:  # as OpenAI's and vLLM's: the options of a stream that was not asked for
            raise invalid("'stream_options' is only allowed with 'stream': true", param="stream_options")

    sampling = _sampling(body)
    n = _expect(body, "n", _is_int, "an integer")
    if n is not None and n < 1:
        raise invalid(f"'n' must be at least 1, got {echo(n)}", param="n")
    stop = _stop_strings(body.get("stop"))
    # their range (the vocabulary) is checked by the app, as a prompt's
    stop_token_ids = _expect(body, "stop_token_ids", _token_list, "an array of token ids")
    seed = sampling.seed
    user = _expect(body, "user", lambda v: isinstance(v, str), "a string")
    ignore_eos = _bool(body, "ignore_eos")
    return_token_ids = _bool(body, "return_token_ids")
    return CommonParams(
        model=model, max_tokens=max_tokens, stream=stream, include_usage=include_usage, ignore_eos=ignore_eos,
        return_token_ids=return_token_ids, seed=seed, user=user, stop_token_ids=tuple(stop_token_ids or ()),
        stop=stop, max_tokens_param=max_tokens_param, sampling=sampling, n=n or 1,
    )


def _stop_strings(stop: Any) -> tuple[str, ...]:
    try:
        return parse_stop_strings(stop)
    except TypeError as err:
        raise invalid(f"{err}, got {_type_name(stop)}", param="stop", code="invalid_type") from None
    except ValueError as err:
        raise invalid(str(err), param="stop") from None


def _token_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    _check_unknown(body, COMPLETION_FIELDS, "/v1/completions")
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("'prompt' is required", param="prompt", code="missing_field")
    prompt = body["prompt"]
    what = "a string, an array of token ids, or an array of strings or of token-id arrays"
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif _token_list(prompt) and (prompt == [] or _is_int(prompt[0])):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise invalid(f"'prompt' must be {what}, got {_type_name(prompt)}", param="prompt", code="invalid_type")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            where = "'prompt'" if len(prompts) == 1 else f"'prompt[{i}]'"
            raise invalid(f"{where} must not be empty", param="prompt", code="empty_prompt")

    params = _common(body, max_tokens_fields=("max_tokens",))
    echo_prompt = _bool(body, "echo")
    logprobs = _expect(body, "logprobs", _is_int, "an integer")
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise invalid(f"'logprobs' must be in [0, {MAX_COMPLETION_LOGPROBS}], got {echo(logprobs)}",
                          param="logprobs")
        params.sampling = dataclasses.replace(params.sampling, logprobs=logprobs)
    suffix = _expect(body, "suffix", lambda v: isinstance(v, str), "a string")
    if suffix:
        raise unsupported("suffix", suffix, "insertion (suffix) is not implemented")
    best_of = _expect(body, "best_of", _is_int, "an integer")
    if best_of is not None and best_of != 1:
        raise unsupported("best_of", best_of, "best_of is not implemented; send best_of 1 (or n for several choices)")
    return CompletionRequest(prompts=prompts, params=params, echo=echo_prompt)


_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"})
# The roles a chat template is written for (OpenAI's, less the deprecated "function" of function calling,
# which this server does not implement).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(f"'{where}' must be an object with 'role' and 'content', got {_type_name(m)}",
                      param="messages", code="invalid_type")
    bad = sorted(set(m) - _MESSAGE_FIELDS)
    if bad:
        raise invalid(f"unknown field(s) {_names(bad)} in '{where}'", param="messages", code="unknown_field")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise invalid(f"'{where}.role' must be a non-empty string, got {_type_name(role)}", param=f"{where}.role",
                      code="invalid_type")
    if role not in CHAT_ROLES:
        raise invalid(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {echo(role)}",
                      param=f"{where}.role")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text is supported, joined by newlines
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise invalid(f"'{where}.content[{j}]': only text parts {{'type': 'text', 'text': ...}} are "
                              f"supported, got {echo(kind)}", param="messages", code="unsupported_content")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is None:
        if not m.get("tool_calls"):
            raise invalid(f"'{where}.content' is required", param="messages", code="missing_field")
    elif not isinstance(content, str):
        raise invalid(f"'{where}.content' must be a string or an array of text parts, got {_type_name(content)}",
                      param="messages", code="invalid_type")
    out = dict(m)
    out["content"] = content
    for key in ("name", "tool_call_id", "reasoning_content"):
        if key in m and m[key] is not None and not isinstance(m[key], str):
            raise invalid(f"'{where}.{key}' must be a string", param="messages", code="invalid_type")
    if "tool_calls" in m and m["tool_calls"] is not None and not isinstance(m["tool_calls"], list):
        raise invalid(f"'{where}.tool_calls' must be an array", param="messages", code="invalid_type")
    return out


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """A chat's ``messages`` checked (each an object of known fields, a known role and text content)
    and as the chat template takes them (content parts joined); an ``APIError`` names the bad field.
    The server's chat requests and ``serve.py generate``'s input lines both read messages here."""
    if messages is None:
        raise invalid("'messages' is required", param="messages", code="missing_field")
    if not isinstance(messages, list):
        raise invalid(f"'messages' must be an array, got {_type_name(messages)}", param="messages",
                      code="invalid_type")
    if not messages:
        raise invalid("'messages' must not be empty", param="messages", code="empty_prompt")
    return [_message(i, m) for i, m in enumerate(messages)]


def parse_chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    _check_unknown(body, CHAT_FIELDS, "/v1/chat/completions")
    messages = parse_messages(body.get("messages"))

    params = _common(body, max_tokens_fields=("max_tokens", "max_completion_tokens"))
    logprobs = _expect(body, "logprobs", lambda v: isinstance(v, bool), "a boolean")
    top_logprobs = _expect(body, "top_logprobs", _is_int, "an integer")
    if top_logprobs is not None:
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {echo(top_logprobs)}",
                          param="top_logprobs")
        if not logprobs and top_logprobs:
            raise invalid("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if logprobs:
        params.sampling = dataclasses.replace(params.sampling, logprobs=top_logprobs or 0)
    fmt = _expect(body, "response_format", lambda v: isinstance(v, dict), "an object")
    if fmt is not None and fmt != {"type": "text"}:
        raise unsupported("response_format", fmt, "structured output is not implemented; use {\"type\": \"text\"}")
    tools = _expect(body, "tools", lambda v: isinstance(v, list), "an array")
    if tools:
        raise unsupported("tools", "[...]", "tool calling is not implemented")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "none"):
        raise unsupported("tool_choice", tool_choice, "tool calling is not implemented")
    ptc = _expect(body, "parallel_tool_calls", lambda v: isinstance(v, bool), "a boolean")
    if ptc:
        raise unsupported("parallel_tool_calls", ptc, "tool calling is not implemented")
    kwargs = _expect(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
    # What the server sets itself, and the names of the tokenizer's (and jinja's) own parameters:
    # the kwargs are passed on as keyword arguments, and a second 'self' is a TypeError.
    reserved = sorted(set(kwargs) & {"messages", "add_generation_prompt", "tools", "documents", "chat_template",
                                    "tokenize", "self"})
    if reserved:
        raise invalid(f"'chat_template_kwargs' must not set {_names(reserved)}", param="chat_template_kwargs")
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    return ChatCompletionRequest(
        messages=messages, params=params, add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=dict(kwargs),
    )


# ----------------------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")
