"""``ServeConfig``: the settings of ``serve.py`` (server and batch mode), loaded through ``dflash_jax.io.config``.

The YAML file (``configs/serve.yaml``) has four sections; command-line flags override it::

    model:    target, draft, no_draft, tokenizer, dtype, name, stop_token_ids, embedded_compilation_cache
    engine:   dflash_jax.runtime.engine.EngineConfig (max_batch_size, max_length, prompt_buckets, block_size, ...)
    server:   host, port, api_key, default_max_tokens, max_waiting_requests, batch_wait_ms, ...
    generate: input, output, progress, max_new_tokens, chat_template_kwargs, ignore_eos (batch mode)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from dflash_jax.io.config import ConfigError, config_from_dict, config_to_dict, load_config
from dflash_jax.runtime.engine import EngineConfig
from dflash_jax.runtime.warmup import sampling_kind
from dflash_jax.serving.text_stream import parse_stop_strings

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    target: str | None = None        # HF directory of the target (config.json + safetensors)
    draft: str | None = None         # z-lab directory of the DFlash drafter (or an Orbax training checkpoint)
    no_draft: bool = False           # target-only greedy decoding (the baseline)
    tokenizer: str | None = None     # directory with tokenizer.json; None: the target's
    dtype: str = "bfloat16"          # float32 | bfloat16 | float16
    name: str | None = None          # the served model id; None: the target directory's name (embedded: dflash-embedded)
    stop_token_ids: tuple[int, ...] | None = None  # None: the tokenizer's (generation_config eos ids)
    # The embedded default pair (no target given) keeps compiled programs in the user cache directory
    # (``compile_cache.user_cache_dir``) unless engine.compilation_cache_dir names another: a second
    # start loads them instead of compiling. False: compile in every process.
    embedded_compilation_cache: bool = True

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")


def api_key_problem(key: str) -> str | None:
    """Why ``key`` could never match a client's ``Authorization`` header, or None: HTTP headers are
    read as latin-1 (a non-ASCII key arrives other than it was sent), and the token is stripped."""
    if not key or not key.isascii() or not key.isprintable() or key != key.strip():
        return "must be printable ASCII without surrounding spaces (clients send it in an HTTP header)"
    return None


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"          # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None       # Bearer key for /v1/*; the DFLASH_API_KEY variable when null
    metrics_api_key: bool = False    # require the key on /metrics too (Prometheus then needs authorization)
    default_max_tokens: int = 256    # for requests without max_tokens (capped by the maximum length)
    max_waiting_requests: int = 1024  # beyond this, requests are answered 503
    # Larger request bodies are answered 413. 2 MiB, as TGI's payload limit: a prompt of 32k tokens
    # is ~150 kB of text.
    max_request_bytes: int = 2 * 1024 * 1024
    batch_wait_ms: float = 0.0       # idle engine: the first requests wait this long to share a prefill
    # Slow clients: a connection's request line and headers must arrive within header_timeout_s of its
    # opening (or of its previous response), and a request's body within body_timeout_s of its
    # headers; else the connection is closed (the body: answered 408). At most max_connections are
    # open: a new one then closes the oldest that is still sending its headers or body, or is refused
    # 503 when every one is being served. Each connection holds a file descriptor (runner.py).
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    max_connections: int = 512
    # None: wait for every request in flight; else requests still running after this many seconds
    # are answered 503 shutting_down (a stream: an error event, then [DONE]).
    graceful_shutdown_timeout_s: float | None = None
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    warmup: bool = True              # compile every shape requests can meet (false: each when first met)
    # True: compile before listening only the shapes of a lone request with a short prompt
    # (``runtime.warmup.first_request_shapes``), the rest on a background thread while serving, so the
    # server is up in seconds to a minute (a request meeting a shape first compiles it itself). False:
    # every shape before listening (minutes for an 8B model or on a CPU; no request ever waits for XLA).
    warmup_background: bool = True
    # The sampled decoding to compile too (greedy decoding always is), after listening with
    # warmup_background: each entry one more decode program per running state and attention window, for
    # batches whose rows together use its features, joined by '+': sample, top_p, top_k=N, min_p,
    # penalties, rejection, logprobs, top_logprobs (``runtime.warmup.sampling_kind``; "sample" also covers
    # a batch of greedy and sampled rows). A combination not listed compiles when a batch first uses it.
    warmup_sampling: tuple[str, ...] = ("sample",)
    # Python's GIL switch interval while serving (its default is 5 ms): after each device wait the
    # scheduler thread waits up to this long for the GIL while the event loop streams; on the H200 a
    # small model served 1-26% more tokens/s at 0.2 ms than at 5, by load (docs/performance.md).
    gil_switch_interval_ms: float = 0.2

    def validate(self) -> None:
        if self.api_key and (problem := api_key_problem(self.api_key)):  # '' is no key, as null
            raise ValueError(f"api_key {problem}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:  # also NaN
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.graceful_shutdown_timeout_s is not None and not self.graceful_shutdown_timeout_s >= 0:
            raise ValueError("graceful_shutdown_timeout_s must be >= 0 or null, got "
                             f"{self.graceful_shutdown_timeout_s}")
        for entry in self.warmup_sampling:
            sampling_kind(entry)  # raises naming the entry
        if self.gil_switch_interval_ms <= 0:
            raise ValueError(f"gil_switch_interval_ms must be > 0, got {self.gil_switch_interval_ms}")


@dataclasses.dataclass(frozen=True)
class GenerateSettings:
    input: str | None = None         # JSONL prompts (--input)
    output: str | None = None        # JSONL results, written when every prompt is done (--output)
    progress: bool = True            # a progress bar on stderr (--no-progress)
    max_new_tokens: int = 256        # default for input lines without max_new_tokens
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)  # e.g. {enable_thinking: false}
    ignore_eos: bool = False         # generate exactly max_new_tokens (benchmarks)
    stop: tuple[str, ...] = ()       # stop strings for input lines without 'stop' (the text is cut before them)
    sampling: dict = dataclasses.field(default_factory=dict)  # SamplingParams fields for lines without 'sampling'

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        parse_stop_strings(list(self.stop), "stop")
        for name in ("input", "output"):
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise ValueError(f"{name} must be a file or null, got an empty string")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: ModelSettings = ModelSettings()
    engine: EngineConfig = EngineConfig()
    server: ServerSettings = ServerSettings()
    generate: GenerateSettings = GenerateSettings()


def load_serve_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                      flags: dict[str, dict[str, Any]] | None = None) -> ServeConfig:
    """The YAML file, then ``key=value`` overrides, then flags (``{section: {field: value}}``, None skipped)."""
    config = load_config(ServeConfig, path, overrides)
    if not flags:
        return config
    data = config_to_dict(config)
    for section, values in flags.items():
        for key, value in values.items():
            if value is not None:
                data[section][key] = value
    return config_from_dict(ServeConfig, data, source=f"{path or '<defaults>'} + flags")


__all__ = ["api_key_problem", "ServeConfig", "ModelSettings", "ServerSettings", "GenerateSettings", "load_serve_config",
           "ConfigError"]
