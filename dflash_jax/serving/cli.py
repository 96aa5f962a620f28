"""``serve.py`` / ``dflash-serve``: serve a target with its DFlash drafter, or run batch generation over a JSONL file.

    python serve.py [serve] --target DIR --draft DIR [--host 127.0.0.1 --port 8000 --api-key K]
    python serve.py generate --target DIR --draft DIR --input prompts.jsonl --output out.jsonl \\
        [--no-draft] [--block-size N] [--max-new-tokens N] [--batch-size N] [--resume]

Settings come from ``--config`` (default ``configs/serve.yaml`` beside this file, see
``dflash_jax/serving/settings.py``), then ``--set section.key=value``, then the flags.

Batch mode: each input line is a JSON object with one of ``prompt_ids`` (token ids), ``prompt`` (text,
encoded with the tokenizer's special tokens) or ``messages`` (checked as the server checks a chat
request's, then the chat template is applied), and an
optional ``max_new_tokens`` (the prompt plus it must fit ``--max-length``; the default,
``--max-new-tokens``, is capped to fit) and ``stop`` (stop strings, a string or a list; default
``generate.stop``: the text is cut before the first, the ids after the one that completed it) and
``sampling`` (an object of ``dflash_jax.SamplingParams`` fields, e.g. ``{"temperature": 0.7, "top_p":
0.9, "seed": 1, "logprobs": 2}``; default ``generate.sampling``, greedy when empty; a sampled line
without a seed gets a random one); other
fields are copied to the output. Each output line adds
``output_ids``, ``text``, ``finish_reason``, ``num_prompt_tokens``, ``num_output_tokens``, ``num_steps``,
``acceptance_lengths``, ``tau``, ``time_to_first_token`` and ``time_per_output_token``, and with
``sampling.logprobs`` ``logprobs`` and ``top_logprobs`` (token id -> logprob per token), and with
``sampling.prompt_logprobs`` ``prompt_logprobs`` and ``prompt_top_logprobs`` (per prompt token, null for the
first) (an input field
of one of these names is an error, not overwritten). Input lines must be
standard JSON: ``NaN``, ``Infinity`` and numbers too large for a float (``1e999``) are refused, as are
lines nested too deeply or with integers too long for Python to read (each error names the file and
line). A JSON summary goes to stderr; its ``compile_seconds`` (the engine compiles for the shapes it
meets: the first prompts' times to first token include it) is part of ``wall_seconds``.

Batch output and interruptions. Each result is written as soon as its prompt finishes (one line,
flushed, in the order the prompts finish); when every prompt is done the output is rewritten in input
order through a fresh temporary file beside it, renamed over it (it is never seen half-written; an
existing file keeps its permissions, and where the output is a symlink its target is rewritten and
the link kept). While the run goes on, the finished lines go:

* where no output file exists: into the output file itself. A run that stops early (Ctrl-C, exit
  status 130; SIGTERM, 143; an error; a kill) leaves every finished result there;
* with ``--resume``: appended to the existing output. Its lines are kept, and the input lines whose
  result is already there (an output line less the fields above equals the input line; a repeated
  input line needs a result per repeat) are skipped. An unfinished last line (a write cut by a kill)
  is dropped and generated again; a line that is not a result of this input is an error, before any
  model loads. Without an output file, ``--resume`` starts from nothing;
* where an output exists and ``--resume`` is not given: the output is replaced only once every
  prompt is done. Until then the finished lines go to a new file beside it, ``NAME.XXXXXXXX.partial``;
  a run that stops early leaves it (stderr names it) and the output as it was. To continue from it,
  move it over the output and rerun with ``--resume``.

A run that stops before any prompt finished leaves no new file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parents[2]  # the repository: configs/ lives beside the package
DEFAULT_CONFIG = HERE / "configs" / "serve.yaml"

log = logging.getLogger("dflash_jax.serve")


# The fields run_generate adds to each output line.
OUTPUT_FIELDS = ("output_ids", "text", "finish_reason", "num_prompt_tokens", "num_output_tokens", "num_steps",
                 "acceptance_lengths", "tau", "time_to_first_token", "time_per_output_token")
# ... and those it adds for lines whose sampling asks for logprobs.
LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")


class CLIError(Exception):
    """A usage or input error: printed as ``serve.py: error: ...`` with exit status 2."""


class Terminated(BaseException):
    """SIGTERM during batch generation: ends the run as Ctrl-C does (exit status 143)."""


# ----------------------------------------------------------------------------------------- arguments


def positive_int(text: str) -> int:
    """An argparse type for counts that must be at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("model and engine")
    g.add_argument("--config", default=None, help=f"YAML settings (default: {DEFAULT_CONFIG.relative_to(HERE)})")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set engine.steps_per_sync=4 (repeatable)")
    g.add_argument("--target", help="HF target model directory")
    g.add_argument("--draft", help="DFlash drafter directory")
    g.add_argument("--no-draft", action="store_true", default=None, help="target-only greedy decoding")
    g.add_argument("--tokenizer", help="tokenizer directory (default: the target's)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="parameter dtype")
    g.add_argument("--block-size", type=int, help="draft block size (at most the drafter's)")
    g.add_argument("--batch-size", type=int, help="requests decoding at once (engine.max_batch_size)")
    g.add_argument("--max-length", type=int, help="prompt plus generated tokens per request")
    g.add_argument("--compilation-cache", metavar="DIR",
                   help="save compiled programs to DIR and load them on the next start (engine.compilation_cache_dir; "
                        "the embedded default pair uses the user cache directory unless told otherwise)")
    g.add_argument("--no-compilation-cache", action="store_true", default=None,
                   help="compile in every process (the embedded default pair otherwise keeps compiled programs in "
                        "the user cache directory: model.embedded_compilation_cache false)")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="also print the frameworks' INFO and WARNING lines (JAX, XLA, absl, Orbax)")
    g.add_argument("--max-new-tokens", type=int,
                   help="default number of tokens to generate (batch mode: for lines without max_new_tokens; "
                        "server: for requests without max_tokens)")

    parser = argparse.ArgumentParser(
        prog="serve.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `serve.py serve -h` or `serve.py generate -h` for the flags.",
    )
    sub = parser.add_subparsers(dest="command")
    s = sub.add_parser("serve", parents=[common], help="the OpenAI-compatible HTTP server (default)")
    s.add_argument("--host", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default 8000)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $DFLASH_API_KEY)")
    s.add_argument("--model-name", "--served-model-name", dest="model_name",
                   help="the served model id (default: dflash-embedded for the embedded pair, else the target "
                        "directory's name)")
    s.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    gen = sub.add_parser("generate", parents=[common], help="batch generation over a JSONL file")
    gen.add_argument("--input", help="JSONL prompts (or generate.input in the config)")
    gen.add_argument("--output", help="JSONL results, one line per prompt as it finishes, in input order once "
                                      "all are done (or generate.output)")
    gen.add_argument("--resume", action="store_true",
                     help="keep the results already in --output, generate only the input lines without one and "
                          "append them (a run that stopped early); without it an existing output is replaced "
                          "once every prompt is done")
    gen.add_argument("--ignore-eos", action="store_true", default=None,
                     help="generate exactly max_new_tokens per prompt")
    gen.add_argument("--no-progress", action="store_true", default=None, help="no progress bar")
    demo = sub.add_parser("demo", help="self-check: DFlash vs target-only on the embedded default pair")
    # checked here: the demo has no settings file to validate them (--prompts -2 ran all but two prompts)
    demo.add_argument("--prompts", type=positive_int, default=8)
    demo.add_argument("--max-new-tokens", type=positive_int, default=96)
    demo.add_argument("--block-sizes", default="16,12,8", metavar="N,N,...",
                      help="the block sizes tried during the warm-up; the fastest on this device is used "
                           "(at most the drafter's)")
    demo.add_argument("--temperatures", default="0.7,1.0", metavar="T,T,...",
                      help="also report tau of seeded sampling at these temperatures, exact and rejection "
                           "verification ('' : greedy only)")
    demo.add_argument("--no-compilation-cache", action="store_true",
                      help="compile in this process only (default: the user cache directory keeps the programs)")
    demo.add_argument("-v", "--verbose", action="store_true",
                      help="also print the frameworks' INFO and WARNING lines (JAX, XLA, absl, Orbax)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "generate", "demo", "-h", "--help"):
        argv.insert(0, "serve")
    return build_parser().parse_args(argv)


def load_settings(args: argparse.Namespace):
    from dflash_jax.serving.settings import load_serve_config

    flags: dict[str, dict[str, Any]] = {
        "model": {"target": args.target, "draft": args.draft, "no_draft": args.no_draft,
                  "tokenizer": args.tokenizer, "dtype": args.dtype},
        "engine": {"block_size": args.block_size, "max_batch_size": args.batch_size, "max_length": args.max_length,
                   "compilation_cache_dir": args.compilation_cache},
    }
    if args.no_compilation_cache:
        if args.compilation_cache:
            raise CLIError("--compilation-cache and --no-compilation-cache contradict each other")
        flags["model"]["embedded_compilation_cache"] = False
    if args.command == "generate":
        flags["generate"] = {"max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos,
                             "input": args.input, "output": args.output,
                             "progress": None if args.no_progress is None else not args.no_progress}
    else:
        flags["server"] = {"host": args.host, "port": args.port, "api_key": args.api_key,
                           "default_max_tokens": args.max_new_tokens, "log_level": args.log_level}
        flags["model"]["name"] = args.model_name
    path = args.config if args.config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    cfg = load_serve_config(path, args.overrides, flags)
    m = cfg.model
    if m.no_draft and m.draft:
        log.warning("model.draft %s is ignored: --no-draft (model.no_draft) decodes target-only", m.draft)
    if not m.target:  # the embedded default pair shipped in models/embedded
        from dflash_jax import embedded

        if not embedded.available():
            raise CLIError(f"no target model: pass --target DIR (or set model.target in the config); the "
                           f"embedded default pair is missing from {embedded.EMBEDDED_DIR}")
        m = dataclasses.replace(m, target=str(embedded.DEFAULT_TARGET),
                                draft=m.draft or str(embedded.DEFAULT_DRAFTER), name=m.name or embedded.SERVED_NAME)
        cfg = dataclasses.replace(cfg, model=m)
        if m.embedded_compilation_cache and cfg.engine.compilation_cache_dir is None:
            from dflash_jax.runtime.compile_cache import user_cache_dir

            cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine,
                                                                      compilation_cache_dir=str(user_cache_dir())))
        log.info("using the embedded default pair in %s%s", embedded.EMBEDDED_DIR,
                 "" if cfg.engine.compilation_cache_dir is None else
                 f" (compiled programs kept in {cfg.engine.compilation_cache_dir}; --no-compilation-cache: none)")
    if args.no_compilation_cache and cfg.engine.compilation_cache_dir is not None:  # one from the config file
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, compilation_cache_dir=None))
    if not m.no_draft and not m.draft:
        raise CLIError("no drafter: pass --draft DIR (or set model.draft in the config), "
                       "or --no-draft for target-only decoding")
    if args.command == "generate":
        for name in ("input", "output"):
            if getattr(cfg.generate, name) is None:
                raise CLIError(f"no {name} file: pass --{name} FILE (or set generate.{name} in the config)")
    for name, value in (("--target", m.target), ("--draft", None if m.no_draft else m.draft),
                        ("--tokenizer", m.tokenizer)):
        if value is not None and not Path(value).is_dir():
            raise CLIError(f"{name} {value}: not a directory")
    return cfg


# ----------------------------------------------------------------------------------------- models


def load_engine(cfg):
    """The engine of the settings. The loaded modules are dropped once it is built (it runs its own copies
    in the serving layout), so their memory is free for the KV pages and the activations."""
    from dflash_jax.io.checkpoint import load_drafter, load_target
    from dflash_jax.runtime.engine import Engine

    if cfg.engine.compilation_cache_dir is not None:  # checked before the weights take minutes to load
        from dflash_jax.runtime.compile_cache import use_compilation_cache

        try:
            use_compilation_cache(cfg.engine.compilation_cache_dir)
        except ValueError as err:
            raise CLIError(f"engine.{err}") from None
    check_block_size(cfg)
    t0 = time.perf_counter()
    log.info("loading the models")
    try:
        # The drafter (small) first, checked against the target's config.json: a drafter of another
        # model is refused before the target's weights take minutes to load.
        drafter = None if cfg.model.no_draft else load_drafter(cfg.model.draft, dtype=cfg.model.dtype)
        if drafter is not None:
            check_pair(cfg.model.target, cfg.model.draft, drafter.config)
        target = load_target(cfg.model.target, dtype=cfg.model.dtype)
        engine = Engine(target, drafter, cfg.engine)
        del target, drafter
        if engine.paged:  # sized from the memory left now (engine.kv_memory_fraction); its errors at the start
            log.info("a pool of %d pages of %d positions", engine.num_pages - 1, engine.page_size)
    except (ValueError, FileNotFoundError) as err:  # CheckpointError, ModelConfigError, engine settings
        raise CLIError(f"cannot load the models: {err}") from None
    log.info("loaded %s%s in %.1f s", cfg.model.target,
             "" if engine.drafter is None else f" with drafter {cfg.model.draft} (block size {engine.block_size})",
             time.perf_counter() - t0)
    return engine


def check_pair(target_dir: str, draft_dir: str, drafter_config) -> None:
    """The drafter's vocabulary, hidden size and tapped layer count against the target's config.json
    (the drafter embeds with the target's table and projects its layers' outputs)."""
    from dflash_jax.models.config import load_target_config, pair_mismatch, read_config_json
    from dflash_jax.models.hybrid_config import is_hybrid_config, load_hybrid_config

    path = Path(target_dir) / "config.json"
    target = load_hybrid_config(target_dir) if is_hybrid_config(read_config_json(path)) else \
        load_target_config(target_dir)
    if (mismatch := pair_mismatch(drafter_config, target)) is not None:
        field, drafter_value, theirs, target_value = mismatch
        raise CLIError(f"the drafter {draft_dir} does not fit the target {target_dir}: its {field} is "
                       f"{drafter_value}, the target's {theirs} is {target_value} ({path})")


def check_block_size(cfg) -> None:
    """``engine.block_size`` and, with adaptive speculation, ``engine.speculation_blocks`` against the
    drafter's block size, from its config.json, before any weights load (``EngineConfig.drafter_block_error``)."""
    from dflash_jax.models.config import load_drafter_config

    block = cfg.engine.block_size
    adaptive_blocks = cfg.engine.speculation_blocks if cfg.engine.speculation == "adaptive" else None
    if block is None and not adaptive_blocks:  # the drafter's blocks
        return
    if cfg.model.no_draft:
        if block is not None:
            log.warning("engine.block_size (--block-size) %d is ignored: target-only decoding drafts no blocks", block)
        return
    if not (Path(cfg.model.draft) / "config.json").exists():  # an Orbax checkpoint: the engine checks
        return
    try:
        drafter_block = load_drafter_config(cfg.model.draft).block_size
    except ValueError as err:
        raise CLIError(f"cannot read the drafter's config: {err}") from None
    if block is not None and block > drafter_block:
        raise CLIError(f"engine.block_size (--block-size) {block} exceeds the drafter's block size {drafter_block} "
                       f"({cfg.model.draft}/config.json): it may only lower it")
    if (error := cfg.engine.drafter_block_error(drafter_block)) is not None:
        raise CLIError(f"engine.{error} ({cfg.model.draft}/config.json)")


def load_tokenizer(cfg, required: bool):
    from dflash_jax.io.tokenizer import Tokenizer, TokenizerError

    directory = cfg.model.tokenizer or cfg.model.target
    try:
        return Tokenizer(directory)
    except TokenizerError as err:
        if required:
            raise CLIError(f"cannot load the tokenizer: {err}") from None
        log.warning("no tokenizer (%s): outputs will have token ids only", err)
        return None


def stop_ids(cfg, tokenizer, engine) -> list[int]:
    """The stop token ids of every generation: ``model.stop_token_ids``, else the tokenizer's, else the
    target config's EOS ids. Ids outside the vocabulary, or more distinct ids than the engine takes
    (each submission would fail), are an error here, at the start."""
    if cfg.model.stop_token_ids is not None:
        vocab = engine.vocab_size
        if bad := [t for t in cfg.model.stop_token_ids if not 0 <= t < vocab]:
            raise CLIError(f"model.stop_token_ids has ids outside the vocabulary [0, {vocab}): {brief(bad[:5])}")
        ids = list(cfg.model.stop_token_ids)
    elif tokenizer is not None:
        ids = list(tokenizer.stop_token_ids)
    else:
        ids = list(getattr(engine.target.config, "eos_token_ids", ()) or ())
    if len(set(ids)) > engine.max_stop_ids:
        raise CLIError(f"{len(set(ids))} distinct stop ids (model.stop_token_ids, or the tokenizer's); the engine "
                       f"takes at most {engine.max_stop_ids}")
    return ids


def brief(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that echo input values."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int too long to print, a structure nested too deeply
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ----------------------------------------------------------------------------------------- batch mode


@dataclasses.dataclass
class InputLine:
    lineno: int
    row: dict[str, Any]
    text: str  # the row as standard JSON, serialized once (deep rows recurse as deeply to serialize)
    key: str  # the row with sorted keys: what a result line less OUTPUT_FIELDS is matched by (--resume)


def read_jsonl(path: Path) -> list[InputLine]:
    """The input's lines; each error names the file and the line."""
    from dflash_jax.io.jsonl import iter_jsonl

    records: list[tuple[int, dict[str, Any]]] = []
    try:
        for lineno, row in iter_jsonl(path):
            records.append((lineno, row))
    except (FileNotFoundError, ValueError) as err:  # ValueError: a line's decoding, its JSON or its type
        raise CLIError(str(err)) from None
    except OSError as err:  # a directory, no permission
        raise CLIError(f"{path}: cannot read: {err.strerror or err}") from None
    if not records:
        raise CLIError(f"{path}: no prompts")
    return [input_line(f"{path}:{lineno}", lineno, row) for lineno, row in records]


def input_line(where: str, lineno: int, row: dict[str, Any]) -> InputLine:
    try:
        return InputLine(lineno, row, json.dumps(row, ensure_ascii=False, allow_nan=False),
                         json.dumps(row, ensure_ascii=False, allow_nan=False, sort_keys=True))
    except ValueError:
        raise CLIError(f"{where}: {nonfinite_field(row)} is {nonfinite_field(row, value=True)}, which is not "
                       "standard JSON (nor a number that is larger than a float's range, such as 1e999)") from None
    except RecursionError:
        raise CLIError(f"{where}: nested too deeply to write back out") from None


def nonfinite_field(row: dict[str, Any], value: bool = False) -> str:
    """The path (e.g. ``'a.b[2]'``) of the first NaN or infinite number in ``row``, or that number."""
    stack: list[tuple[str, Any]] = [(repr(k), v) for k, v in reversed(row.items())]
    while stack:
        name, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return str(v) if value else f"field {name}"
        if isinstance(v, dict):
            stack.extend((f"{name}.{k}", x) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((f"{name}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return "a number"


def check_output(input_path: Path, output_path: Path) -> Path:
    """The file the results go to: the output, or its target where it is a symlink. Fails now, not
    after the run, where the results could not be written: its folder is created; an output that is
    a folder or the input itself (which it would replace) is an error."""
    where = f"generate.output (--output) {output_path}"
    real = Path(os.path.realpath(output_path))
    if real.is_dir():
        raise CLIError(f"{where}: is a directory")
    if real.exists() and real.samefile(input_path):
        raise CLIError(f"{where}: is the input file, which the results would replace")
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CLIError(f"{where}: cannot create its directory: {err}") from None
    if not os.access(real.parent, os.W_OK):
        raise CLIError(f"{where}: its directory {real.parent} is not writable")
    return real


def previous_results(output: Path, lines: list[InputLine]) -> tuple[dict[int, str], int]:
    """For ``--resume``: ``({input index: its result line}, bytes of the output to keep)``. An
    unfinished last line (no newline: a write that a kill cut) is dropped, to be generated again."""
    try:
        data = output.read_bytes()
    except OSError as err:
        raise CLIError(f"{output}: cannot read it to resume: {err.strerror or err}") from None
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        log.warning("%s: its last line is unfinished (a write that was cut): it is dropped and its prompt "
                    "generated again", output)
    waiting: dict[str, list[int]] = {}  # an input line's key -> the indices of its repeats still without a result
    for i, line in enumerate(lines):
        waiting.setdefault(line.key, []).append(i)
    done: dict[int, str] = {}
    for lineno, raw in enumerate(data[:keep].split(b"\n")[:-1], 1):
        where = f"{output}:{lineno}"
        try:
            text = raw.decode("utf-8").rstrip("\r")
            if not text.strip():
                continue
            result = json.loads(text)
        except (ValueError, RecursionError):  # not UTF-8, not JSON, a huge integer, nested too deeply
            raise CLIError(f"{where}: not a result line of this command (unreadable JSON): --resume continues an "
                           "output that this command wrote") from None
        if not isinstance(result, dict) or (missing := [k for k in OUTPUT_FIELDS if k not in result]):
            raise CLIError(f"{where}: not a result line of this command (no {', '.join(missing or OUTPUT_FIELDS)}): "
                           "--resume continues an output that this command wrote")
        row = {k: v for k, v in result.items() if k not in OUTPUT_FIELDS + LOGPROB_FIELDS}
        try:
            key = json.dumps(row, ensure_ascii=False, allow_nan=False, sort_keys=True)
        except (ValueError, RecursionError):
            key = None
        if not waiting.get(key):
            raise CLIError(f"{where}: the result of no line of the input (or one more than the input repeats "
                           "it): this output belongs to another input, or the input changed")
        done[waiting[key].pop(0)] = text
    return done, keep


def prompt_of(row: dict[str, Any], where: str, tokenizer, cfg) -> tuple[list[int], int, tuple[str, ...]]:
    """(prompt token ids, max_new_tokens, stop strings) of one input line."""
    from dflash_jax.serving.text_stream import parse_stop_strings
    from dflash_jax.io.tokenizer import ChatTemplateError, TokenizerError

    given = [k for k in ("prompt_ids", "prompt", "messages") if k in row]
    if len(given) != 1:
        raise CLIError(f"{where}: needs exactly one of 'prompt_ids', 'prompt' or 'messages'"
                       + (f", got {given}" if given else ""))
    clash = [k for k in OUTPUT_FIELDS + LOGPROB_FIELDS if k in row]
    if clash:  # the output line would silently replace them
        raise CLIError(f"{where}: field(s) {clash} are written by the output; rename them (or drop them, if "
                       "this is an earlier run's output)")
    key = given[0]
    value = row[key]
    if key == "prompt_ids":
        if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in value):
            raise CLIError(f"{where}: 'prompt_ids' must be a non-empty list of integers")
        ids = list(value)
    else:
        if tokenizer is None:
            raise CLIError(f"{where}: '{key}' needs a tokenizer (tokenizer.json in the target or --tokenizer)")
        if key == "prompt":
            if not isinstance(value, str) or not value:
                raise CLIError(f"{where}: 'prompt' must be a non-empty string")
            ids = tokenizer.encode(value, add_special_tokens=True)
        else:
            from dflash_jax.serving.protocol import APIError, parse_messages

            try:  # the server's checks, so a line is read as the same chat request would be
                messages = parse_messages(value)
            except APIError as err:
                raise CLIError(f"{where}: {err.message}") from None
            try:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    **cfg.generate.chat_template_kwargs)
            except (ChatTemplateError, TokenizerError) as err:
                raise CLIError(f"{where}: {err}") from None
            except RecursionError:
                raise CLIError(f"{where}: 'messages' is nested too deeply for the chat template") from None
        if not ids:
            raise CLIError(f"{where}: the prompt encodes to no tokens")
    max_new = row.get("max_new_tokens", cfg.generate.max_new_tokens)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        raise CLIError(f"{where}: 'max_new_tokens' must be a positive integer, got {brief(max_new)}")
    try:
        stop = parse_stop_strings(row["stop"]) if "stop" in row else cfg.generate.stop
    except (TypeError, ValueError) as err:
        raise CLIError(f"{where}: {err}") from None
    if stop and tokenizer is None:
        raise CLIError(f"{where}: stop strings need a tokenizer (tokenizer.json in the target or --tokenizer)")
    return ids, max_new, stop


def sampling_of(row: dict, where: str, cfg):
    """The line's ``sampling`` object (or ``generate.sampling``) as ``SamplingParams``."""
    from dflash_jax.runtime.sampling import SamplingParams

    fields = row.get("sampling", cfg.generate.sampling)
    if not isinstance(fields, dict):
        raise CLIError(f"{where}: 'sampling' must be an object of SamplingParams fields, got {brief(fields)}")
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    if unknown := sorted(set(fields) - known):
        raise CLIError(f"{where}: unknown 'sampling' field(s) {unknown}; known: {sorted(known)}")
    fields = dict(fields)
    try:
        if isinstance(fields.get("logit_bias"), dict):  # JSON object keys are strings
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        return SamplingParams(**fields)
    except ValueError as err:
        raise CLIError(f"{where}: 'sampling': {err}") from None


def result_line(line: InputLine, ids: list[int], res: Any, stream: Any, tokenizer) -> str:
    """The input line with its generation's fields: one JSON line, without its newline. The row's own
    JSON, serialized when it was read, is reused as it is."""
    from dflash_jax.serving.text_stream import finish_text

    output_ids, finish = list(res.output_ids), res.finish_reason
    if stream is not None:  # the text and ids that the stop strings leave
        output_ids, _, finish = finish_text(stream, res)
    fields = json.dumps(dict(
        output_ids=output_ids,
        text=stream.text if stream is not None else tokenizer.decode(res.output_ids) if tokenizer else None,
        finish_reason=finish,
        num_prompt_tokens=len(ids),
        num_output_tokens=len(output_ids),
        num_steps=res.num_steps,
        acceptance_lengths=list(res.acceptance_lengths),
        tau=res.tau,
        time_to_first_token=float(res.time_to_first_token),
        time_per_output_token=float(res.time_per_output_token),
        **({} if res.logprobs is None else dict(
            logprobs=res.logprobs[:len(output_ids)],
            top_logprobs=[{str(t): v for t, v in d.items()} for d in res.top_logprobs[:len(output_ids)]])),
        **({} if res.prompt_logprobs is None else dict(
            prompt_logprobs=res.prompt_logprobs,
            prompt_top_logprobs=[None if d is None else {str(t): v for t, v in d.items()}
                                 for d in res.prompt_top_logprobs])),
    ), ensure_ascii=False, allow_nan=False)
    return line.text[:-1] + (", " if line.row else "") + fields[1:]


class WriteFailed(BaseException):
    """A result could not be written: ends the run at once (the engine takes an ``Exception`` raised
    in its callbacks for a failed generation and carries on)."""

    def __init__(self, err: OSError):
        super().__init__(err)
        self.err = err


def new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class ResultSink:
    """Where finished lines go while the run goes on, and the final rewrite in input order (the module
    docstring says which file, and what a run that stops early leaves)."""

    def __init__(self, output: Path, shown: Path, resume: bool, keep_bytes: int | None, kept: int):
        self.output, self.shown, self.written, self.kept = output, shown, 0, kept
        self.created = False  # the output file, created by this run
        try:
            if resume and keep_bytes is not None:  # the existing output, cut after its last whole line
                self.path = output
                self.file = output.open("r+b")
                self.file.truncate(keep_bytes)
                self.file.seek(keep_bytes)
            elif output.exists():  # replaced at the end only: its results go beside it meanwhile
                fd, name = tempfile.mkstemp(dir=output.parent, prefix=f"{output.name}.", suffix=".partial")
                self.path, self.file = Path(name), os.fdopen(fd, "wb")
                os.chmod(fd, output.stat().st_mode & 0o7777)
            else:
                self.path, self.created = output, True
                self.file = output.open("xb")
        except OSError as err:
            raise CLIError(f"generate.output (--output) {shown}: cannot write: {err.strerror or err}") from None

    def write(self, text: str) -> None:
        try:
            self.file.write(text.encode("utf-8") + b"\n")
            self.file.flush()
        except OSError as err:
            raise WriteFailed(err) from None
        self.written += 1

    def abandon(self, total: int) -> None:
        """The run stopped early: says where its finished lines are, or removes a file left empty."""
        self.file.close()
        if self.written == 0 and self.path != self.output:
            self.path.unlink(missing_ok=True)
        elif self.written == 0 and self.created:
            self.output.unlink(missing_ok=True)
        elif self.path == self.output:
            print(f"serve.py: {self.kept + self.written} of {total} results written to {self.shown}; rerun with "
                  "--resume to generate the rest", file=sys.stderr)
        else:
            print(f"serve.py: {self.written} of {total} results written to {self.path}; {self.shown} is unchanged "
                  f"(to continue from them, move {self.path.name} over it and rerun with --resume)", file=sys.stderr)

    def finish(self, lines: list[str]) -> None:
        """Every prompt is done: the output becomes ``lines`` (input order), through a fresh temporary
        file renamed over it. A fixed name such as "out.jsonl.tmp" could be the input, or anybody's
        file, and would be overwritten."""
        self.file.close()
        mode = self.output.stat().st_mode & 0o7777 if self.output.exists() else new_file_mode()
        fd, name = tempfile.mkstemp(dir=self.output.parent, prefix=f".{self.output.name}.", suffix=".tmp")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write("".join(line + "\n" for line in lines).encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            tmp.chmod(mode)  # mkstemp's file is private (0600)
            tmp.replace(self.output)
        except BaseException as err:
            tmp.unlink(missing_ok=True)
            if isinstance(err, OSError):
                raise WriteFailed(err) from None
            raise
        if self.path != self.output:
            self.path.unlink(missing_ok=True)


def raise_terminated(signum, frame) -> None:
    raise Terminated()


def run_generate(cfg, resume: bool = False, loaded: Callable[[], None] | None = None) -> dict[str, Any]:
    """Batch mode (the module docstring); ``loaded()`` is called once the engine is loaded."""
    from tqdm import tqdm

    from dflash_jax.runtime.compile_cache import compile_seconds, track_compile_time
    from dflash_jax.serving.text_stream import TextStream

    track_compile_time()
    input_path, output_path = Path(cfg.generate.input), Path(cfg.generate.output)
    lines = read_jsonl(input_path)
    output = check_output(input_path, output_path)
    done, keep_bytes = previous_results(output, lines) if resume and output.exists() else ({}, None)
    todo = [i for i in range(len(lines)) if i not in done]
    if done:
        log.info("%s: %d of %d results already there (--resume): generating the other %d", output_path,
                 len(done), len(lines), len(todo))
    needs_tokenizer = bool(todo) and (bool(cfg.generate.stop) or any(
        "prompt" in lines[i].row or "messages" in lines[i].row or lines[i].row.get("stop") for i in todo))
    tokenizer = load_tokenizer(cfg, required=needs_tokenizer) if todo else None
    max_length = cfg.engine.max_length
    prompts, max_new, texts, sampling = {}, {}, {}, {}
    for i in todo:
        row, where = lines[i].row, f"{input_path}:{lines[i].lineno}"
        ids, m, stop = prompt_of(row, where, tokenizer, cfg)
        sampling[i] = sampling_of(row, where, cfg)
        texts[i] = TextStream(tokenizer, stop) if stop else None
        if len(ids) >= max_length:
            raise CLIError(f"{where}: the prompt has {len(ids)} tokens; the maximum length is {max_length} "
                           "(prompt plus output): raise --max-length")
        if (too_long := cfg.engine.prompt_bucket_error(len(ids))) is not None:
            raise CLIError(f"{where}: the prompt has {len(ids)} tokens, {too_long} (engine.prompt_buckets)")
        room = max_length - len(ids)
        if "max_new_tokens" in row and m > room:  # as the server's max_tokens; only the default is capped
            raise CLIError(f"{where}: the prompt has {len(ids)} tokens and 'max_new_tokens' is {brief(m)}: "
                           f"{brief(len(ids) + m)} tokens exceed the maximum length {max_length} (prompt plus "
                           f"output): lower it to at most {room} or raise --max-length")
        prompts[i] = ids
        max_new[i] = min(m, room)

    engine = None
    if todo:
        engine = load_engine(cfg)
        vocab = engine.vocab_size
        for i in todo:
            if bad := [t for t in prompts[i] if not 0 <= t < vocab]:
                raise CLIError(f"{input_path}:{lines[i].lineno}: token ids outside the vocabulary [0, {vocab}): "
                               f"{brief(bad[:5])}")
            try:
                sampling[i].check_vocab(vocab, engine.config.max_logprobs)
            except ValueError as err:
                raise CLIError(f"{input_path}:{lines[i].lineno}: 'sampling': {err}") from None
        stops = [] if cfg.generate.ignore_eos else stop_ids(cfg, tokenizer, engine)
    if loaded is not None:
        loaded()

    # Shortest first: prompts admitted together have similar lengths (less prefill padding). Rows
    # are reused as soon as they free.
    order = sorted(todo, key=lambda i: len(prompts[i]))
    results: dict[int, Any] = {}
    finished_lines = dict(done)
    draft_steps = committed = 0  # over the finished prompts, for the progress bar
    sink = ResultSink(output, output_path, resume, keep_bytes, kept=len(done))
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGTERM, raise_terminated) if on_main_thread else None
    t0 = time.perf_counter()
    compiling = compile_seconds()
    try:
        with tqdm(total=len(order), unit="prompt", disable=not cfg.generate.progress or not order,
                  file=sys.stderr, dynamic_ncols=True) as bar:

            def finished(j: int, res: Any) -> None:
                nonlocal draft_steps, committed
                i = order[j]
                results[i] = res
                finished_lines[i] = result_line(lines[i], prompts[i], res, texts[i], tokenizer)
                sink.write(finished_lines[i])
                bar.update(1)
                draft_steps += len(res.acceptance_lengths)
                committed += sum(res.acceptance_lengths)
                if draft_steps:
                    bar.set_postfix(tau=f"{committed / draft_steps:.2f}")

            if order:
                engine.generate([prompts[i] for i in order], [max_new[i] for i in order], stop_token_ids=stops,
                                on_done=finished, stop_checks=[None if texts[i] is None else texts[i].add
                                                               for i in order],
                                sampling=[sampling[i] for i in order])
        wall = time.perf_counter() - t0
        compiling = compile_seconds() - compiling
        if on_main_thread:  # the rewrite is atomic: a SIGTERM now ends the process, not the rewrite
            signal.signal(signal.SIGTERM, previous_handler)
            on_main_thread = False
        sink.finish([finished_lines[i] for i in range(len(lines))])
    except BaseException as err:
        sink.abandon(len(lines))
        if isinstance(err, WriteFailed):
            raise CLIError(f"generate.output (--output) {output_path}: cannot write: "
                           f"{err.err.strerror or err.err}") from None
        raise
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)

    res_list = list(results.values())
    n_out = sum(len(r.output_ids) for r in res_list)
    steps = sum(len(r.acceptance_lengths) for r in res_list)
    summary = {
        "prompts": len(res_list),
        "resumed": len(done),  # results kept from the output (--resume), not generated again
        "output_tokens": n_out,
        "wall_seconds": round(wall, 3),
        "tokens_per_second": round(n_out / wall, 2) if wall > 0 else None,
        # tracing and compiling the engine's programs for the shapes this run met, part of wall_seconds
        "compile_seconds": round(compiling, 3),
        "tokens_per_second_excluding_compile": round(n_out / (wall - compiling), 2) if wall > compiling else None,
        "tau": round(sum(sum(r.acceptance_lengths) for r in res_list) / steps, 4) if steps else 1.0,
        "drafter": None if cfg.model.no_draft else cfg.model.draft,
        "block_size": None if engine is None else engine.block_size,
        "output": str(output_path),
    }
    if cfg.engine.compilation_cache_dir is not None:
        from dflash_jax.runtime.compile_cache import cache_report

        summary["compilation_cache"] = cache_report()
    print(json.dumps(summary), file=sys.stderr)
    return summary


# ----------------------------------------------------------------------------------------- server


def run_serve(cfg, started: float | None = None, ready: Callable[[], None] | None = None) -> None:
    """Serves until SIGINT/SIGTERM; ``started`` (``time.perf_counter()`` at the start) dates "ready",
    ``ready()`` is called once the server is about to take requests."""
    from dflash_jax.serving.runner import bind_socket
    from dflash_jax.serving.settings import api_key_problem

    s = cfg.server
    api_key = s.api_key or os.environ.get("DFLASH_API_KEY") or None
    if api_key is not None and (problem := api_key_problem(api_key)):
        raise CLIError(f"{'server.api_key' if s.api_key else 'DFLASH_API_KEY'} {problem}")
    try:  # before the models load and compile (minutes for a large one): a port in use fails now
        sock = bind_socket(s.host, s.port)
    except OSError as err:
        raise CLIError(f"server.host:server.port (--host, --port) {s.host}:{s.port}: cannot bind: "
                       f"{err.strerror or err}") from None
    try:
        _serve_on(cfg, sock, api_key, started, ready)
    finally:
        sock.close()


def _serve_on(cfg, sock, api_key: str | None, started: float | None, ready: Callable[[], None] | None) -> None:
    from dflash_jax.serving import create_app, run_server

    s = cfg.server
    tokenizer = load_tokenizer(cfg, required=True)
    if not tokenizer.chat_template_names:
        log.warning("%s has no chat template (tokenizer_config.json, chat_template.jinja): /v1/chat/completions "
                    "will answer 400; /v1/completions serves text prompts (--tokenizer DIR names another tokenizer)",
                    tokenizer.directory)
    engine = load_engine(cfg)
    stops = stop_ids(cfg, tokenizer, engine)  # before the warmup: a client could not fix them
    background = warm_up(cfg, engine)
    name = cfg.model.name or Path(cfg.model.target).resolve().name
    app = create_app(
        engine, tokenizer,
        model_name=name,
        max_length=cfg.engine.max_length,
        vocab_size=engine.vocab_size,
        default_max_tokens=s.default_max_tokens,
        api_key=api_key,
        metrics_api_key=s.metrics_api_key,
        max_waiting=s.max_waiting_requests,
        max_request_bytes=s.max_request_bytes,
        batch_wait_s=s.batch_wait_ms / 1000.0,
        stop_token_ids=stops,
        body_timeout_s=s.body_timeout_s,
        # the drafter directory's name: a model card should not tell clients the server's file system
        info={"drafter": None if cfg.model.no_draft else Path(cfg.model.draft).resolve().name,
              "block_size": engine.block_size,
              "max_batch_size": cfg.engine.max_batch_size},
    )
    sys.setswitchinterval(s.gil_switch_interval_ms / 1000)
    if s.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("binding %s without an API key: anyone who can reach it can use it", s.host)
    log.info("serving %r on http://%s:%d%s", name, s.host, sock.getsockname()[1],
             "" if started is None else f" (ready {time.perf_counter() - started:.1f} s after start)")
    if ready is not None:
        ready()
    if background is not None:
        background.start()
    try:
        run_server(app, host=s.host, port=s.port, log_level=s.log_level,
                   timeout_graceful_shutdown=s.graceful_shutdown_timeout_s, header_timeout_s=s.header_timeout_s,
                   max_connections=s.max_connections, sock=sock)
    finally:
        if background is not None:
            background.stop(timeout=60)  # after the shape being compiled


# A lone request with a prompt of up to this many tokens meets only the shapes compiled before the
# server binds (server.warmup_background): a short chat turn with its template. Each larger prompt
# bucket is the first thing compiled after binding (~5 s each for a 25M-parameter target on 2 CPU
# cores, where each bucket before binding adds as much to the start-up).
FIRST_PROMPT_TOKENS = 32


def warm_up(cfg, engine):
    """Compiles what ``server.warmup`` asks before the server binds, logging each shape; returns the ``BackgroundWarmup`` of the shapes left
    for after binding, or None."""
    from dflash_jax.runtime.compile_cache import cache_counts
    from dflash_jax.runtime.warmup import BackgroundWarmup, run_warmup, sampling_flags, staged_plan, warmup_plan

    s = cfg.server
    if not s.warmup:
        log.info("server.warmup is false: each shape compiles when a request first meets it")
        return None
    plan = warmup_plan(engine, sampling=sampling_flags(s.warmup_sampling, engine.config.max_logprobs))
    # A paged engine's warm-up runs on a set of KV pools of its own: in the background it would hold it beside
    # the server's (together, twice what engine.kv_memory_fraction gives). It compiles everything first.
    paged = getattr(engine, "paged", False)
    background = s.warmup_background and not paged
    if s.warmup_background and paged:
        log.info("warm-up: a paged engine compiles every shape before serving (server.warmup_background: a "
                 "warm-up beside the server would hold a second set of KV pages)")
    first, rest = staged_plan(engine, plan, FIRST_PROMPT_TOKENS, s.default_max_tokens) if background else (plan, [])
    before, t0 = cache_counts(), time.perf_counter()
    log.info("warm-up: compiling the %d shapes of %s before serving (%d in all)", len(first),
             f"a lone greedy request with up to {FIRST_PROMPT_TOKENS} prompt tokens" if background
             else "every request", len(plan))

    def progress(i: int, shape) -> None:
        log.info("warm-up %d/%d: %s", i + 1, len(first), shape)

    run_warmup(engine, first, on_shape=progress)
    counts = cache_counts() - before
    cached = ""
    if cfg.engine.compilation_cache_dir is not None:
        cached = (f" ({counts.loaded} programs loaded from the compilation cache {cfg.engine.compilation_cache_dir}, "
                  f"{counts.compiled} compiled)")
    log.info("warm-up: %d shapes ready in %.1f s%s", len(first), time.perf_counter() - t0, cached)
    if getattr(engine, "adaptive", False):  # before serving: the first request would wait for it
        log.info("adaptive speculation: timing a decode step of each block size %s", engine.speculation_blocks)
        engine.calibrate_speculation()
    return BackgroundWarmup(engine, rest, log) if rest else None


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    from dflash_jax.verbosity import Heartbeat, configure_logging

    configure_logging(verbose=args.verbose)
    # A line at least every few seconds until the server binds, the batch run's progress bar starts or
    # the demo's warm-up ends.
    with Heartbeat(logging.getLogger("dflash_jax")) as heartbeat:
        log.info("starting: importing JAX" if args.command == "demo" else
                 "starting: importing JAX, reading the settings")
        return run_command(args, started, heartbeat)


def run_command(args: argparse.Namespace, started: float, heartbeat) -> int:
    if args.command == "demo":
        from dflash_jax.serving.demo import print_demo, run_demo

        try:
            sizes = [int(n) for n in args.block_sizes.split(",") if n.strip()]
            if not sizes or min(sizes) < 2:
                raise ValueError
        except ValueError:
            print(f"serve.py: error: --block-sizes must be block sizes >= 2 separated by commas, got "
                  f"{args.block_sizes!r}", file=sys.stderr)
            return 2
        try:
            temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
            if any(not (0 < t < float("inf")) for t in temperatures):
                raise ValueError
        except ValueError:
            print(f"serve.py: error: --temperatures must be temperatures > 0 separated by commas (or ''), got "
                  f"{args.temperatures!r}", file=sys.stderr)
            return 2
        report = run_demo(num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, block_sizes=sizes,
                          compilation_cache=not args.no_compilation_cache, warmed_up=heartbeat.stop,
                          temperatures=temperatures)
        print_demo(report)
        exact = all(row.get("identical_to_target_only", True) for row in report["sampled"])
        exact = exact and report.get("dflash2", {}).get("identical", True)  # the DFlash2 drafter's too, if run
        return 0 if report["identical"] and exact else 1
    from dflash_jax.io.config import ConfigError

    try:
        cfg = load_settings(args)
        if args.command == "generate":
            run_generate(cfg, resume=args.resume, loaded=heartbeat.stop)
        else:
            run_serve(cfg, started, ready=heartbeat.stop)
    except (CLIError, ConfigError) as err:
        print(f"serve.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: batch mode keeps the results that finished (see the docstring)
        print("serve.py: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("serve.py: terminated (SIGTERM)", file=sys.stderr)
        return 128 + int(signal.SIGTERM)
    return 0

