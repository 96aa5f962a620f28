"""serve.py end to end: batch mode on JSONL with tiny random models, input errors, settings, and the
server's graceful SIGTERM shutdown."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import tokenizer_fixtures as tf

from dflash_jax.serving import cli as serve
from dflash_jax.serving.testing import wait_until_serving
from dflash_jax.io.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_VOCAB = 512
MODEL_VOCAB = 520
ENGINE_FLAGS = ["--dtype", "float32", "--max-length", "64", "--set", "engine.prompt_buckets=[32]"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tf.write_tiny_models_with_tokenizer(tmp_path_factory.mktemp("tiny"), model_vocab_size=MODEL_VOCAB,
                                               tokenizer_vocab_size=TOKENIZER_VOCAB)


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, str(REPO / "serve.py"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


LINES = [
    {"id": "text", "prompt": "Hello, world"},
    {"id": "chat", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_new_tokens": 6},
    "",
    {"id": "ids", "prompt_ids": [10, 11, 12, 13], "category": "kept"},
    {"id": "long", "prompt": "The quick brown fox", "max_new_tokens": 10},
]


@pytest.mark.slow
def test_generate_end_to_end(models, tmp_path):
    target_dir, drafter_dir = models
    tok = Tokenizer(target_dir)
    src = write_jsonl(tmp_path / "prompts.jsonl", LINES)
    out_draft, out_plain = tmp_path / "dflash.jsonl", tmp_path / "target_only.jsonl"
    common = ["--target", str(target_dir), "--input", str(src), "--max-new-tokens", "8", "--batch-size", "4",
              *ENGINE_FLAGS]

    r = run_cli("generate", *common, "--draft", str(drafter_dir), "--output", str(out_draft))
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stderr.strip().splitlines()[-1])
    assert summary["prompts"] == 4 and summary["block_size"] == 8 and summary["tau"] >= 1.0
    assert 0 < summary["compile_seconds"] < summary["wall_seconds"]  # this process compiled its programs
    assert summary["tokens_per_second_excluding_compile"] > summary["tokens_per_second"]
    assert "prompt/s" in r.stderr  # the tqdm bar

    rows = read_jsonl(out_draft)
    assert [row["id"] for row in rows] == ["text", "chat", "ids", "long"]  # input order
    assert rows[2]["category"] == "kept"  # other fields are copied
    assert set(rows[2]) == {"id", "prompt_ids", "category", *serve.OUTPUT_FIELDS}
    want_prompt = [
        tok.encode("Hello, world"),
        tok.apply_chat_template(LINES[1]["messages"]),
        [10, 11, 12, 13],
        tok.encode("The quick brown fox"),
    ]
    for row, ids, limit in zip(rows, want_prompt, (8, 6, 8, 10)):
        assert row["num_prompt_tokens"] == len(ids)
        assert 1 <= row["num_output_tokens"] == len(row["output_ids"]) <= limit
        assert row["finish_reason"] in ("stop", "length")
        if row["finish_reason"] == "length":
            assert row["num_output_tokens"] == limit
        assert row["text"] == tok.decode(row["output_ids"])
        acc = row["acceptance_lengths"]
        assert acc and all(1 <= a <= 8 for a in acc) and sum(acc) <= row["num_output_tokens"]
        assert row["tau"] == pytest.approx(sum(acc) / len(acc)) and row["num_steps"] == len(acc)
        assert row["time_to_first_token"] > 0 and row["time_per_output_token"] > 0

    # Target-only: the same tokens (greedy speculative decoding is lossless), no acceptance lengths,
    # one decode step per token after the prefill's; the settings file holds what the flags can.
    settings = tmp_path / "generate.yaml"
    settings.write_text(f"model: {{target: {target_dir}, no_draft: true}}\n"
                        f"generate: {{input: {src}, output: {out_plain}, progress: false}}\n")
    r = run_cli("generate", "--config", str(settings), "--max-new-tokens", "8", "--batch-size", "4", *ENGINE_FLAGS)
    assert r.returncode == 0, r.stderr
    assert "prompt/s" not in r.stderr  # progress: false
    plain = read_jsonl(out_plain)
    assert [p["output_ids"] for p in plain] == [row["output_ids"] for row in rows]
    assert all(p["acceptance_lengths"] == [] and p["tau"] == 1.0 for p in plain)
    assert all(p["num_steps"] == p["num_output_tokens"] - 1 for p in plain)

    # A lower block size drafts shorter blocks, to the same tokens; a line's stop strings cut its
    # text before the first of them and its tokens after the one that completed it.
    text = rows[3]["text"]
    stop = next(text[at: at + 2] for at in range(len(text) // 3, len(text) - 2)
                if text[at: at + 2].strip() and "\ufffd" not in text[at: at + 2])
    kept, want, _ = tf.stop_string_reference(tok, rows[3]["output_ids"], [stop])
    assert kept < len(rows[3]["output_ids"])
    stopped = write_jsonl(tmp_path / "stop.jsonl", LINES[:4] + [{**LINES[4], "stop": [stop, "never here"]}])
    out_block = tmp_path / "block4.jsonl"
    r = run_cli("generate", *common[:2], "--input", str(stopped), *common[4:], "--draft", str(drafter_dir),
                "--block-size", "4", "--no-progress", "--output", str(out_block))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stderr.strip().splitlines()[-1])["block_size"] == 4
    short = read_jsonl(out_block)
    assert [b["output_ids"] for b in short[:3]] == [row["output_ids"] for row in rows[:3]]
    assert all(1 <= a <= 4 for b in short for a in b["acceptance_lengths"])
    assert short[3]["output_ids"] == rows[3]["output_ids"][:kept] and short[3]["text"] == want
    assert short[3]["finish_reason"] == "stop" and short[3]["num_output_tokens"] == kept
    assert sum(short[3]["acceptance_lengths"]) + 1 == kept


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"id": 1}, "needs exactly one of 'prompt_ids', 'prompt' or 'messages'"),
        ({"prompt": "a", "prompt_ids": [1]}, "needs exactly one of"),
        ({"prompt_ids": []}, "'prompt_ids' must be a non-empty list of integers"),
        ({"prompt_ids": [1, "x"]}, "'prompt_ids' must be a non-empty list of integers"),
        ({"prompt": ""}, "'prompt' must be a non-empty string"),
        ({"messages": "hi"}, "'messages' must be an array, got string"),
        ({"messages": []}, "'messages' must not be empty"),
        # the server's checks of chat messages, by the same code
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]},
         "'messages[1].role' must be one of system, developer, user, assistant, tool, got \"robot\""),
        ({"messages": [{"role": "user", "content": 3}]}, "'messages[0].content' must be a string"),
        ({"messages": [{"role": "user", "content": "hi", "extra": 1}]}, "unknown field(s) 'extra' in 'messages[0]'"),
        ({"prompt": "hi", "max_new_tokens": 0}, "'max_new_tokens' must be a positive integer"),
        ({"prompt": "hi", "stop": 5}, "'stop' must be a string or an array of strings"),
        ({"prompt": "hi", "stop": ["\n", ""]}, "'stop[1]' is empty"),
        ({"prompt": "word " * 100}, "the maximum length is 64"),
        ({"prompt_ids": [1] * 10, "max_new_tokens": 60}, "the prompt has 10 tokens and 'max_new_tokens' is 60: 70 "
                                                         "tokens exceed the maximum length 64"),  # was cut to 54
        ({"prompt": "hi", "text": "a reference answer", "tau": 2},  # were replaced by the output's
         "field(s) ['text', 'tau'] are written by the output"),
        ({"prompt_ids": [1] * 33}, "the prompt has 33 tokens, more than the largest prompt bucket, 32 "
                                   "(engine.prompt_buckets)"),  # it failed the run after the other prompts
    ],
)
def test_bad_line_names_file_and_line(models, tmp_path, capsys, bad, message):
    target_dir, drafter_dir = models
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "fine"}, "", bad])
    rc = serve.main(["generate", "--target", str(target_dir), "--draft", str(drafter_dir), "--input", str(src),
                     "--output", str(tmp_path / "out.jsonl"), *ENGINE_FLAGS])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{src}:3: " in err and message in err, err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"prompt": "\xff"}\n', "not UTF-8 text: byte 0xff at column 13"),
        # Lone surrogates: an extra field would fail the output's write at the end; a prompt, its encoding.
        (b'{"prompt": "a", "id": "\\ud800"}\n', "a string has a lone surrogate"),
        (b'{"prompt": "\\udc00 a"}\n', "a string has a lone surrogate"),
    ],
)
def test_undecodable_line_names_file_and_line(tmp_path, capsys, raw, message):
    """Checked while reading the input, before any model loads (so no models are needed here)."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"prompt": "\\ud83d\\ude00 fine"}\n\n' + raw)  # a BOM and a surrogate pair are fine
    rc = serve.main(["generate", "--target", str(tmp_path), "--no-draft", "--input", str(src),
                     "--output", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{src}:3: {message}" in err, err
    assert serve.main(["generate", "--target", str(tmp_path), "--no-draft", "--input", str(tmp_path),
                       "--output", str(tmp_path / "out.jsonl")]) == 2
    assert f"{tmp_path}: cannot read: Is a directory" in capsys.readouterr().err

    from dflash_jax.io.jsonl import iter_jsonl

    src.write_bytes(b'\xef\xbb\xbf{"prompt": "\\ud83d\\ude00"}\r\n')
    assert list(iter_jsonl(src)) == [(1, {"prompt": "\U0001f600"})]


def test_unwritable_output_is_refused_before_loading(tmp_path, capsys):
    """The output is written when every prompt is done: where it cannot be, the run stops at the start.
    (``--target`` holds no model: the checks come before any model loads.)"""
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt_ids": [1, 2]}])
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for output, message in ((a_file / "out.jsonl", "cannot create its directory"),
                            (tmp_path, "is a directory"),
                            (src, "is the input file, which the results would replace")):
        rc = serve.main(["generate", "--target", str(tmp_path), "--no-draft", "--input", str(src),
                         "--output", str(output)])
        err = capsys.readouterr().err
        assert rc == 2 and f"generate.output (--output) {output}: {message}" in err, err
        assert "cannot load the models" not in err
    assert json.loads(src.read_text()) == {"prompt_ids": [1, 2]}


def test_token_ids_outside_vocabulary_and_too_many_stop_ids(models, tmp_path, capsys):
    target_dir, drafter_dir = models
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt_ids": [1, 2]}, {"prompt_ids": [MODEL_VOCAB]}])
    rc = serve.main(["generate", "--target", str(target_dir), "--no-draft", "--input", str(src),
                     "--output", str(tmp_path / "out.jsonl"), *ENGINE_FLAGS])
    assert rc == 2 and f"{src}:2: token ids outside the vocabulary" in capsys.readouterr().err
    write_jsonl(src, [{"prompt_ids": [1, 2]}])
    rc = serve.main(["generate", "--target", str(target_dir), "--no-draft", "--input", str(src), "--set",
                     f"model.stop_token_ids={list(range(17))}", "--output", str(tmp_path / "out.jsonl"), *ENGINE_FLAGS])
    assert rc == 2 and "17 distinct stop ids (model.stop_token_ids, or the tokenizer's); the engine takes at most 16" \
        in capsys.readouterr().err  # it was a traceback
    rc = serve.main(["generate", "--target", str(target_dir), "--no-draft", "--input", str(src), "--set",
                     "model.stop_token_ids=[3, -1]", "--output", str(tmp_path / "out.jsonl"), *ENGINE_FLAGS])
    assert rc == 2 and "model.stop_token_ids has ids outside the vocabulary" in capsys.readouterr().err


def test_output_replaced_whole_through_a_fresh_temporary_file(models, tmp_path, capsys):
    """The results go to a fresh temporary file beside the output, renamed over it: an input named like
    the fixed temporary name that was used (``out.jsonl.tmp``) is kept, and nothing else is left."""
    target_dir, _ = models
    src = write_jsonl(tmp_path / "out.jsonl.tmp", [{"prompt_ids": [1, 2], "max_new_tokens": 2}])
    before = src.read_bytes()
    (tmp_path / "out.jsonl").write_text("old results\n")
    rc = serve.main(["generate", "--target", str(target_dir), "--no-draft", "--input", str(src),
                     "--output", str(tmp_path / "out.jsonl"), *ENGINE_FLAGS])
    assert rc == 0, capsys.readouterr().err
    assert src.read_bytes() == before
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert len(rows) == 1 and len(rows[0]["output_ids"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.tmp"]
    assert (tmp_path / "out.jsonl").stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_missing_models_and_files(models, tmp_path, capsys, monkeypatch):
    import dflash_jax.embedded

    target_dir, drafter_dir = models
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    out = str(tmp_path / "o.jsonl")
    with monkeypatch.context() as m:  # without the shipped pair, no target is an error
        m.setattr(dflash_jax.embedded, "available", lambda: False)
        assert serve.main(["generate", "--input", str(src), "--output", out]) == 2
    assert "no target model: pass --target DIR" in capsys.readouterr().err
    assert serve.main(["generate", "--target", str(target_dir), "--input", str(src), "--output", out]) == 2
    assert "no drafter: pass --draft DIR" in capsys.readouterr().err
    assert serve.main(["--target", str(tmp_path / "nope"), "--no-draft"]) == 2
    assert "nope: not a directory" in capsys.readouterr().err
    assert serve.main(["generate", "--target", str(target_dir), "--no-draft", "--input", str(tmp_path / "x.jsonl"),
                       "--output", out]) == 2
    assert "x.jsonl: file not found" in capsys.readouterr().err
    assert serve.main(["generate", "--target", str(target_dir), "--draft", str(target_dir), "--input", str(src),
                       "--output", out, *ENGINE_FLAGS]) == 2  # a target is not a drafter
    assert "cannot load the models" in capsys.readouterr().err
    assert serve.main(["generate", "--target", str(target_dir), "--no-draft", "--output", out]) == 2
    assert "no input file: pass --input FILE (or set generate.input in the config)" in capsys.readouterr().err
    # A block size above the drafter's is refused before any weights load.
    assert serve.main(["generate", "--target", str(target_dir), "--draft", str(drafter_dir), "--block-size", "16",
                       "--input", str(src), "--output", out, *ENGINE_FLAGS]) == 2
    err = capsys.readouterr().err
    assert "--block-size) 16 exceeds the drafter's block size 8" in err and "cannot load" not in err
    # So is an adaptive engine's largest speculation block.
    assert serve.main(["generate", "--target", str(target_dir), "--draft", str(drafter_dir), "--input", str(src),
                       "--output", out, *ENGINE_FLAGS, "--set", "engine.speculation=adaptive",
                       "--set", "engine.speculation_blocks=[16, 4]"]) == 2
    err = capsys.readouterr().err
    assert "engine.speculation_blocks (16, 4): block 16 exceeds the drafter's block size 8" in err
    assert "cannot load" not in err
    assert not Path(out).exists()


def test_settings_file_set_and_flags(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: {target: /t, draft: /d}\nserver: {port: 9000, batch_wait_ms: 1.0}\n"
                   "engine: {max_batch_size: 4, steps_per_sync: 2}\n")
    args = serve.parse_args(["--config", str(cfg), "--port", "9100", "--set", "server.batch_wait_ms=5",
                             "--set", "engine.prompt_buckets=[16, 64]", "--batch-size", "2"])
    assert args.command == "serve"  # the default subcommand
    from dflash_jax.serving.settings import load_serve_config

    flags = {"server": {"port": args.port, "host": None}, "engine": {"max_batch_size": args.batch_size}}
    c = load_serve_config(args.config, args.overrides, flags)
    assert c.server.port == 9100 and c.server.host == "127.0.0.1" and c.server.batch_wait_ms == 5.0
    assert c.engine.max_batch_size == 2 and c.engine.steps_per_sync == 2 and c.engine.prompt_buckets == (16, 64)
    assert c.model.target == "/t"
    # The shipped config loads and binds loopback.
    shipped = load_serve_config(REPO / "configs" / "serve.yaml")
    assert shipped.server.host == "127.0.0.1" and shipped.model.target is None
    # Unknown keys and bad values are errors naming the file and the key.
    cfg.write_text("server: {prot: 9000}\n")
    assert serve.main(["--config", str(cfg), "--target", "/t", "--no-draft"]) == 2
    err = capsys.readouterr().err
    assert str(cfg) in err and "prot" in err
    cfg.write_text("engine: {max_batch_size: 0}\n")
    assert serve.main(["--config", str(cfg), "--target", "/t", "--no-draft"]) == 2
    assert "max_batch_size must be >= 1" in capsys.readouterr().err
    cfg.write_text("engine: {compilation_cache_dir: ''}\n")
    assert serve.main(["--config", str(cfg), "--target", "/t", "--no-draft"]) == 2
    assert "compilation_cache_dir must be a directory or null" in capsys.readouterr().err
    # An API key no client could send in a header: refused before any model loads.
    assert serve.main(["--target", "/t", "--no-draft", "--api-key", " s3cret"]) == 2
    assert "flags.server: api_key must be printable ASCII" in capsys.readouterr().err
    monkeypatch.setenv("DFLASH_API_KEY", "cl\u00e9")
    assert serve.main(["--target", str(tmp_path), "--no-draft"]) == 2
    assert "DFLASH_API_KEY must be printable ASCII" in capsys.readouterr().err


def test_unreadable_settings_and_bad_overrides_are_errors(tmp_path, capsys):
    """A settings file that cannot be read or decoded and an override that is not YAML: usage errors
    naming the file or the override, not tracebacks."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_bytes(b"model: {name: \xff}\n")
    for argv, message in ((["--config", str(cfg)], f"{cfg}: invalid YAML: unacceptable character"),
                          (["--config", str(tmp_path)], f"{tmp_path}: cannot read: Is a directory"),
                          (["--set", "engine.prompt_buckets=[16, 32"],
                           "override 'engine.prompt_buckets=[16, 32': invalid YAML value")):
        assert serve.main([*argv, "--target", "/t", "--no-draft"]) == 2
        err = capsys.readouterr().err
        assert f"serve.py: error: {message}" in err, err
    cfg.write_bytes(b"\xef\xbb\xbfmodel: {name: served}\n")  # a BOM is fine
    settings = serve.load_settings(serve.parse_args(["--config", str(cfg), "--target", str(tmp_path), "--no-draft"]))
    assert settings.model.name == "served"


@pytest.mark.parametrize("argv", [["--prompts", "0"], ["--prompts", "-2"], ["--max-new-tokens", "0"]])
def test_demo_refuses_counts_below_one(argv, capsys):
    """Refused by the parser (--prompts 0 was a traceback, -2 ran all but two prompts, --max-new-tokens 0
    a traceback after loading the pair)."""
    with pytest.raises(SystemExit) as exit_:
        serve.main(["demo", *argv])
    assert exit_.value.code == 2
    assert f"argument {argv[0]}: must be a positive integer, got {int(argv[1])}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0.7,x", "-1", "0", "inf"])
def test_demo_refuses_temperatures_that_are_not_positive_numbers(value, capsys):
    assert serve.main(["demo", "--temperatures", value]) == 2
    assert f"--temperatures must be temperatures > 0 separated by commas (or ''), got {value!r}" in \
        capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_sigterm_finishes_requests_in_flight(models, tmp_path):
    target_dir, drafter_dir = models
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "serve.py"), "--target", str(target_dir), "--draft", str(drafter_dir),
             "--port", str(port), "--api-key", "k", "--batch-size", "2", *ENGINE_FLAGS],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url, proc, 120, log_path)

        headers = {"Authorization": "Bearer k"}
        first_chunk = threading.Event()
        events: list = []

        def client():
            body = {"prompt": [10, 11, 12], "max_tokens": 12, "stream": True, "ignore_eos": True,
                    "return_token_ids": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        payload = line[6:]
                        events.append(payload if payload == "[DONE]" else json.loads(payload))
                        first_chunk.set()

        thread = threading.Thread(target=client)
        thread.start()
        assert first_chunk.wait(120), log_path.read_text()
        proc.send_signal(signal.SIGTERM)  # mid-request: the decode program is still compiling
        thread.join(300)
        assert proc.wait(120) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "[DONE]"
    ids = [t for e in events[:-1] for c in e["choices"] for t in (c.get("token_ids") or [])]
    assert len(ids) == 12 and events[-2]["choices"][0]["finish_reason"] == "length"
    text = log_path.read_text()
    assert "scheduler drained" in text


@pytest.mark.slow
def test_generate_with_compilation_cache(models, tmp_path):
    """A second run loads every program the first compiled from ``--compilation-cache`` and writes the
    same tokens; a directory that cannot be created is an error naming the setting, before loading."""
    target_dir, drafter_dir = models
    src = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt_ids": [5, 6, 7]}, {"prompt_ids": [9] * 12}])

    def generate(cache: Path, output: Path) -> subprocess.CompletedProcess:
        return run_cli("generate", "--target", str(target_dir), "--draft", str(drafter_dir), "--input", str(src),
                       "--output", str(output), "--max-new-tokens", "8", "--batch-size", "2",
                       "--compilation-cache", str(cache), *ENGINE_FLAGS)

    cache, runs = tmp_path / "xla_cache", []
    for name in ("first", "second"):
        r = generate(cache, tmp_path / f"{name}.jsonl")
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stderr.strip().splitlines()[-1])["compilation_cache"])
    first, second = runs
    assert first["dir"] == str(cache)
    assert first["loaded"] == 0 and first["compiled"] > 5 and any(cache.iterdir())
    assert second == {**first, "loaded": first["compiled"], "compiled": 0}
    outputs = [[row["output_ids"] for row in read_jsonl(tmp_path / f"{name}.jsonl")] for name in ("first", "second")]
    assert outputs[0] == outputs[1] and all(outputs[0])

    not_a_dir = tmp_path / "a_file"
    not_a_dir.write_text("")
    r = generate(not_a_dir / "sub", tmp_path / "never.jsonl")
    assert r.returncode == 2
    assert f"engine.compilation_cache_dir '{not_a_dir / 'sub'}': cannot create it" in r.stderr
    assert "loaded" not in r.stderr and not (tmp_path / "never.jsonl").exists()


def test_one_compilation_cache_directory_per_process(tmp_path):
    """JAX opens its persistent cache once: asking for a second directory is an error, not ignored."""
    import jax

    from dflash_jax.runtime.compile_cache import use_compilation_cache

    assert jax.config.jax_compilation_cache_dir is None  # the suite compiles without a cache
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "first"))
    try:
        with pytest.raises(ValueError, match="already caches compiled programs in .*first"):
            use_compilation_cache(tmp_path / "second")
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
    assert not (tmp_path / "second").exists()


# ----------------------------------------------------------------------------------------- batch output: interrupts, resume

_ENGINES: dict = {}


@pytest.fixture
def shared_engine(monkeypatch):
    """``serve.load_engine`` once per model and engine settings in this module (a tiny engine
    compiles in seconds; the runs below would compile it again each time)."""
    load = serve.load_engine

    def cached(cfg):
        key = (cfg.model.target, cfg.model.draft, cfg.model.no_draft, cfg.model.dtype, repr(cfg.engine))
        if key not in _ENGINES:
            _ENGINES[key] = load(cfg)
        return _ENGINES[key]

    monkeypatch.setattr(serve, "load_engine", cached)


def _stop_after(monkeypatch, count: int, stop) -> list:
    """Makes ``Engine.generate`` call ``stop()`` once ``count`` of its prompts have finished (each written
    first); returns the number of prompts handed to each call."""
    from dflash_jax.runtime.engine import Engine

    generate, calls = Engine.generate, []

    def patched(self, prompts, max_new_tokens, stop_token_ids=None, on_done=None, stop_checks=None, **kw):
        calls.append(len(prompts))
        done = [0]

        def counting(i, res):
            on_done(i, res)
            done[0] += 1
            if done[0] == count:
                stop()

        return generate(self, prompts, max_new_tokens, stop_token_ids, on_done=counting, stop_checks=stop_checks,
                        **kw)

    monkeypatch.setattr(Engine, "generate", patched)
    return calls


def _interrupt():
    raise KeyboardInterrupt


BATCH = [{"id": i, "prompt_ids": list(range(5, 5 + n)), "max_new_tokens": m}
         for i, (n, m) in enumerate([(9, 3), (2, 4), (6, 2), (3, 5), (12, 3), (4, 2), (7, 4), (5, 3)])]
TIMING = ("time_to_first_token", "time_per_output_token")


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def _generate(target_dir, src, out, *extra) -> int:
    return serve.main(["generate", "--target", str(target_dir), "--no-draft", "--input", str(src), "--output",
                       str(out), "--batch-size", "1", "--no-progress", *extra, *ENGINE_FLAGS])


def test_interrupt_keeps_finished_results_and_resume_finishes(models, tmp_path, capsys, monkeypatch, shared_engine):
    """Ctrl-C after 3 of 8 prompts leaves their 3 results in a new output; ``--resume`` generates only
    the prompts without a result and leaves the input's order."""
    target_dir, _ = models
    src = write_jsonl(tmp_path / "in.jsonl", BATCH)
    assert _generate(target_dir, src, tmp_path / "ref.jsonl") == 0, capsys.readouterr().err
    want = _untimed(read_jsonl(tmp_path / "ref.jsonl"))
    capsys.readouterr()

    out = tmp_path / "out.jsonl"
    with monkeypatch.context() as m:
        calls = _stop_after(m, 3, _interrupt)
        assert _generate(target_dir, src, out) == 130
    err = capsys.readouterr().err
    assert "serve.py: interrupted" in err and f"3 of 8 results written to {out}; rerun with --resume" in err, err
    partial = _untimed(read_jsonl(out))
    assert len(partial) == 3 and all(row in want for row in partial) and calls == [8]

    with monkeypatch.context() as m:  # a resumed run interrupted in turn keeps both runs' results
        calls = _stop_after(m, 2, _interrupt)
        assert _generate(target_dir, src, out, "--resume") == 130
    assert f"5 of 8 results written to {out}" in capsys.readouterr().err and calls == [5]
    with monkeypatch.context() as m:
        calls = _stop_after(m, 99, _interrupt)
        assert _generate(target_dir, src, out, "--resume") == 0
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert calls == [3] and summary["prompts"] == 3 and summary["resumed"] == 5
    assert _untimed(read_jsonl(out)) == want  # the input's order, the same tokens

    # Nothing left to do: no model loads, and the output stays as it is.
    before = out.read_bytes()
    with monkeypatch.context() as m:
        m.setattr(serve, "load_engine", lambda cfg: pytest.fail("loaded the models with nothing to generate"))
        assert _generate(target_dir, src, out, "--resume") == 0
    assert out.read_bytes() == before and json.loads(capsys.readouterr().err.strip().splitlines()[-1])["prompts"] == 0


def test_sigterm_and_a_crash_keep_finished_results(models, tmp_path, capsys, monkeypatch, shared_engine):
    """SIGTERM ends the run as Ctrl-C does (exit status 143); an engine that fails after some prompts
    finished keeps theirs too. An existing output is not the run's to destroy: it stays as it was, the
    results going to a ``.partial`` file beside it, which ``--resume`` continues once moved over it."""
    target_dir, _ = models
    src = write_jsonl(tmp_path / "in.jsonl", BATCH)
    out = tmp_path / "out.jsonl"
    with monkeypatch.context() as m:
        _stop_after(m, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
        assert _generate(target_dir, src, out) == 143
    assert "terminated (SIGTERM)" in capsys.readouterr().err
    assert len(read_jsonl(out)) == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is the run's only

    out.write_text("old results\n")
    from dflash_jax.runtime.engine import Engine

    generate = Engine.generate

    def crashing(self, prompts, max_new_tokens, stop_token_ids=None, on_done=None, stop_checks=None, **kw):
        generate(self, prompts[:4], max_new_tokens[:4], stop_token_ids, on_done=on_done, stop_checks=stop_checks[:4])
        raise RuntimeError("the device went away")

    with monkeypatch.context() as m:
        m.setattr(Engine, "generate", crashing)
        with pytest.raises(RuntimeError, match="the device went away"):
            _generate(target_dir, src, out)
    assert out.read_text() == "old results\n"
    (partial,) = tmp_path.glob("out.jsonl.*.partial")
    err = capsys.readouterr().err
    assert f"4 of 8 results written to {partial}; {out} is unchanged" in err, err
    assert len(read_jsonl(partial)) == 4
    partial.replace(out)
    assert _generate(target_dir, src, out, "--resume") == 0
    assert [row["id"] for row in read_jsonl(out)] == list(range(8))
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["resumed"] == 4

    # A run that fails before any prompt finished leaves no new file, and the old output whole.
    out.write_text("old results\n")
    with monkeypatch.context() as m:
        m.setattr(Engine, "generate", lambda self, *a, **k: _interrupt())
        assert _generate(target_dir, src, out) == 130
    assert out.read_text() == "old results\n" and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl",
                                                                                                   "out.jsonl"]
    out.unlink()
    with monkeypatch.context() as m:
        m.setattr(Engine, "generate", lambda self, *a, **k: _interrupt())
        assert _generate(target_dir, src, out) == 130
    assert not out.exists()


def test_resume_checks_the_output_it_continues(models, tmp_path, capsys, caplog, shared_engine):
    """``--resume`` drops an unfinished last line (a write cut by a kill) and generates it again; an
    output line that is no result of this input, or not a result at all, is an error naming it, and the
    output is left as it was."""
    target_dir, _ = models
    src = write_jsonl(tmp_path / "in.jsonl", BATCH[:3] + BATCH[:1])  # a repeated line: a result per repeat
    out = tmp_path / "out.jsonl"
    assert _generate(target_dir, src, out) == 0
    full = out.read_text().splitlines()
    out.write_text(full[3] + "\n\n" + full[1] + "\n" + full[0][:40])
    capsys.readouterr()
    assert _generate(target_dir, src, out, "--resume") == 0
    assert "its last line is unfinished" in caplog.text
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["resumed"] == 2
    assert _untimed(read_jsonl(out)) == _untimed([json.loads(line) for line in full])

    for lines, message in (([full[0], full[0], full[0]], "out.jsonl:3: the result of no line of the input"),
                           ([full[1], json.dumps({"id": 9, **json.loads(full[1])})], "out.jsonl:2: the result of no"),
                           ([json.dumps(BATCH[0])], "out.jsonl:1: not a result line of this command (no output_ids"),
                           (["{oops"], "out.jsonl:1: not a result line of this command (unreadable JSON)")):
        out.write_text("\n".join(lines) + "\n")
        before = out.read_bytes()
        assert _generate(target_dir, src, out, "--resume") == 2
        err = capsys.readouterr().err
        assert message in err, err
        assert out.read_bytes() == before


def test_rewrite_keeps_the_mode_and_writes_through_a_symlink(models, tmp_path, capsys, shared_engine):
    """Rewriting an existing output keeps its permissions, not a new file's, and, where it is a symlink,
    rewrites its target and keeps the link."""
    target_dir, _ = models
    src = write_jsonl(tmp_path / "in.jsonl", BATCH[:2])
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / "results.jsonl"
    target.write_text("old\n")
    target.chmod(0o600)
    link = tmp_path / "out.jsonl"
    link.symlink_to(target)
    assert _generate(target_dir, src, link) == 0, capsys.readouterr().err
    assert link.is_symlink() and link.resolve() == target
    assert target.stat().st_mode & 0o777 == 0o600
    assert [row["id"] for row in read_jsonl(target)] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["results.jsonl"]
    # A dangling link: its target is created.
    target.unlink()
    assert _generate(target_dir, src, link) == 0
    assert link.is_symlink() and [row["id"] for row in read_jsonl(target)] == [0, 1]
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"prompt": "x", "a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "invalid JSON: nested too deeply"),
        (b'{"prompt_ids": [' + b"7" * 5000 + b"]}", "invalid JSON: an integer has more than 4300 digits"),
        (b'{"prompt": "x", "score": NaN}', "field 'score' is nan, which is not standard JSON"),
        (b'{"prompt": "x", "m": {"s": [1, -Infinity]}}', "field 'm'.s[1] is -inf, which is not standard JSON"),
        (b'{"prompt": "x", "big": 1e999}', "field 'big' is inf, which is not standard JSON"),
    ],
)
def test_json_the_parser_or_the_output_cannot_take_names_the_line(tmp_path, capsys, raw, message):
    """Deep nesting, an integer too long for Python's parser, and NaN or Infinity (which standard JSON
    output cannot hold) are errors naming the line, checked while reading, before any model loads."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"prompt": "fine"}\n\n' + raw + b"\n")
    rc = serve.main(["generate", "--target", str(tmp_path), "--no-draft", "--input", str(src),
                     "--output", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{src}:3: {message}" in err, err
    assert len(err) < 500 and not (tmp_path / "out.jsonl").exists()


def test_serve_refuses_more_stop_ids_than_the_engine_takes(models, capsys, monkeypatch, shared_engine):
    """Refused at start, as the batch mode does, not at every request."""
    import dflash_jax.serving

    target_dir, _ = models
    monkeypatch.setattr(dflash_jax.serving, "run_server", lambda *a, **k: pytest.fail("the server started"))
    monkeypatch.setattr(sys, "setswitchinterval", lambda s: None)
    rc = serve.main(["serve", "--target", str(target_dir), "--no-draft", "--set", "server.warmup=false",
                     "--set", f"model.stop_token_ids={list(range(17))}", *ENGINE_FLAGS])
    err = capsys.readouterr().err
    assert rc == 2 and "serve.py: error: 17 distinct stop ids (model.stop_token_ids, or the tokenizer's); the " \
        "engine takes at most 16" in err, err



def test_a_port_in_use_is_an_error_before_the_models_load(models, capsys, monkeypatch):
    """The server binds its port first: a port taken by another server is one line at once, not
    uvicorn's error after the models loaded and compiled."""
    target_dir, draft_dir = models
    monkeypatch.setattr(serve, "load_tokenizer", lambda *a, **k: pytest.fail("the models were loaded"))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        rc = serve.main(["serve", "--target", str(target_dir), "--draft", str(draft_dir), "--port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2 and f"serve.py: error: server.host:server.port (--host, --port) 127.0.0.1:{port}: cannot bind: " \
        "Address already in use" in err, err


_FUZZ_VALUES = [
    "null", "true", "false", "0", "-1", "1.5", "1.0", '"x"', '""', '" "', "[]", "{}", "[null]", "[1.5]", '["a"]',
    "[true]", "[-3]", "[99999]", "[5, 6]", '"hello"', "7" * 5000, "1" + "0" * 400, "[1" + "0" * 4000 + "]",
    "NaN", "Infinity", "-Infinity", "1e999", "[NaN]", '"\\ud800"', '"a\\udc00"', '"\\u0000"', '"\\n"',
    "[" * 3000 + "]" * 3000, "[" * 100 + "]" * 100, '{"a": ' * 100 + "1" + "}" * 100,
    '[{"role": "user", "content": null}]', '[{"role": "user", "content": 5}]', '[{"role": "user"}]',
    '[{"role": 5, "content": "x"}]', '[{"role": "user", "content": [[[[1]]]]}]',
    '[{"role": "user", "content": {"a": [1, {"b": null}]}}]', '[{"role": "user", "content": "hi"}, 3]',
    '[{"role": "user", "content": ' + "[" * 150 + "]" * 150 + "}]", '[{"role": "user", "content": "x" }]',
    '["stop", ""]', '["' + "s" * 5000 + '"]', '["a", "b", "c", "d", "e"]',
]
_FUZZ_FIELDS = ["prompt_ids", "prompt", "messages", "max_new_tokens", "stop", "extra"]


def _fuzz_lines() -> list[bytes]:
    import random

    lines = []
    for field in _FUZZ_FIELDS:
        for value in _FUZZ_VALUES:
            rest = "" if field in ("prompt_ids", "prompt", "messages") else '"prompt_ids": [5, 6], '
            lines.append(f'{{{rest}"{field}": {value}}}'.encode())
    lines += [b'{"prompt": "\xff"}', b'{"prompt": "\xc3\x28"}', b'{"prompt": "\xed\xa0\x80"}', b"\x00", b"[1]",
              b'{"prompt_ids": [5]}{"prompt_ids": [6]}', b'{"prompt_ids": [5], "prompt_ids": [6]}',
              b'{"": 1, "prompt_ids": [5]}', b'{"prompt_ids": [5]', b'"just a string"', b"\xef\xbb\xbf{}"]
    rng = random.Random(0)  # byte-level mutations of a good line
    good = b'{"prompt": "fuzz me", "max_new_tokens": 2, "stop": ["zz"], "id": [1, 2.5, {"k": null}]}'
    for _ in range(60):
        line = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(line))
            op = rng.randrange(3)
            if op == 0:
                line[at] = rng.randrange(256)
            elif op == 1:
                del line[at]
            else:
                line.insert(at, rng.choice(b'[]{}",:\\0e-.9nNI\xff\x80 '))
        lines.append(bytes(line).replace(b"\n", b" ").replace(b"\r", b" "))
    return lines


@pytest.mark.parametrize("sample", [pytest.param(7, id="every-7th"), pytest.param(1, id="all", marks=pytest.mark.slow)])
def test_fuzzed_batch_lines_generate_or_name_their_line(models, tmp_path, capsys, shared_engine, sample):
    """Lines of wrong types, nulls, huge integers, deep nesting, NaN, bad bytes, lone surrogates and
    random byte damage after two good lines: each run either generates (the good lines' results kept
    as they were) or exits 2 with an error naming the file and the line, never a traceback; the output
    of the good lines, continued with --resume or replaced without it, is never lost."""
    target_dir, _ = models
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = b'{"id": "a", "prompt_ids": [5, 6, 7], "max_new_tokens": 2}\n{"id": "b", "prompt": "hello"}\n'
    src.write_bytes(good)
    argv = ["generate", "--target", str(target_dir), "--no-draft", "--input", str(src), "--output", str(out),
            "--batch-size", "1", "--max-new-tokens", "2", "--no-progress", *ENGINE_FLAGS]
    assert serve.main(argv) == 0
    base = out.read_bytes()
    (tmp_path / "base").write_bytes(base)
    outcomes = {0: 0, 2: 0}
    cases = _fuzz_lines()[::sample]
    for n, line in enumerate(cases):
        src.write_bytes(good + line + b"\n")
        out.write_bytes(base)
        capsys.readouterr()
        try:
            rc = serve.main(argv + (["--resume"] if n % 2 == 0 else []))
        except BaseException as err:  # noqa: BLE001 - reported with the line that caused it
            pytest.fail(f"{line[:200]!r}: {type(err).__name__}: {err}")
        err = capsys.readouterr().err
        assert rc in (0, 2) and "Traceback" not in err, (line[:200], rc, err[-2000:])
        outcomes[rc] += 1
        if rc == 2:
            assert f"serve.py: error: {src}:3: " in err and len(err) < 1000, (line[:200], err[-2000:])
            assert out.read_bytes() == base, line[:200]
        else:
            results = out.read_bytes().splitlines(keepends=True)
            assert len(results) == 3, line[:200]
            if n % 2 == 0:  # resumed: kept byte for byte
                assert b"".join(results[:2]) == base, line[:200]
            else:  # generated again: the same tokens
                assert _untimed([json.loads(r) for r in results[:2]]) == _untimed(read_jsonl(tmp_path / "base"))
            assert json.loads(results[2], parse_constant=lambda c: pytest.fail(f"{c} written"))
    assert outcomes[0] > len(cases) // 10 and outcomes[2] > len(cases) // 3, outcomes


def test_generate_samples_per_line_and_writes_logprobs(models, tmp_path, capsys, shared_engine):
    """A line's ``sampling`` object: seeded lines repeat exactly (the same line twice), logprobs are
    written per output token; a bad field names the line."""
    target_dir, drafter_dir = models
    sampled = {"prompt_ids": [10, 11, 12], "max_new_tokens": 8,
               "sampling": {"temperature": 0.8, "top_p": 0.9, "seed": 4, "logprobs": 2, "prompt_logprobs": 1}}
    src = write_jsonl(tmp_path / "in.jsonl", [sampled, {"prompt_ids": [10, 11, 12], "max_new_tokens": 8}, sampled])
    out = tmp_path / "out.jsonl"
    rc = serve.main(["generate", "--target", str(target_dir), "--draft", str(drafter_dir), "--input", str(src),
                     "--output", str(out), "--no-progress", *ENGINE_FLAGS])
    assert rc == 0, capsys.readouterr().err
    first, greedy, again = read_jsonl(out)
    assert first["output_ids"] == again["output_ids"] and "logprobs" not in greedy
    assert len(first["logprobs"]) == len(first["top_logprobs"]) == first["num_output_tokens"]
    assert all(len(d) == 2 and lp <= 0 for d, lp in zip(first["top_logprobs"], first["logprobs"]))
    assert first["prompt_logprobs"][0] is None and first["prompt_top_logprobs"][0] is None
    assert len(first["prompt_logprobs"]) == 3 and all(len(d) == 1 for d in first["prompt_top_logprobs"][1:])
    assert first["prompt_logprobs"] == again["prompt_logprobs"] and "prompt_logprobs" not in greedy
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt_ids": [1], "sampling": {"temperature": -1}}])
    rc = serve.main(["generate", "--target", str(target_dir), "--draft", str(drafter_dir), "--input", str(bad),
                     "--output", str(tmp_path / "bad_out.jsonl"), *ENGINE_FLAGS])
    err = capsys.readouterr().err
    assert rc == 2 and "bad.jsonl:1" in err and "temperature must be >= 0" in err


def test_load_engine_keeps_no_loaded_module(models, monkeypatch):
    """The engine runs its own copies in the serving layout: the modules loaded from the checkpoints are
    dropped once it is built, so a server does not hold the target's weights twice."""
    import gc
    import weakref

    from dflash_jax.io import checkpoint

    loaded = []
    for name in ("load_target", "load_drafter"):
        def load(*args, _load=getattr(checkpoint, name), **kwargs):
            module = _load(*args, **kwargs)
            loaded.append(weakref.ref(module))
            return module

        monkeypatch.setattr(checkpoint, name, load)
    cfg = serve.load_settings(serve.parse_args(["--target", str(models[0]), "--draft", str(models[1]),
                                                *ENGINE_FLAGS]))
    engine = serve.load_engine(cfg)
    gc.collect()
    assert len(loaded) == 2 and all(ref() is None for ref in loaded)
    assert engine.drafter is not None and engine.vocab_size == MODEL_VOCAB



@pytest.mark.parametrize("field", ["hidden_size", "num_target_layers"])
def test_a_drafter_of_another_target_is_refused_before_the_target_loads(models, monkeypatch, tmp_path, field):
    """A drafter whose hidden size or tapped layer count is not the target's is named with both
    directories, the field and the target's config.json, before the target's weights load (an 8B
    target takes minutes)."""
    import dataclasses

    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax.io import checkpoint
    from dflash_jax.models.config import load_drafter_config
    from dflash_jax.models.drafter import Drafter

    dcfg = load_drafter_config(models[1])
    if field == "hidden_size":
        other = dataclasses.replace(dcfg, hidden_size=dcfg.hidden_size * 2, head_dim=dcfg.head_dim * 2)
        want = f"its hidden_size is {dcfg.hidden_size * 2}, the target's hidden_size is {dcfg.hidden_size}"
    else:
        other = dataclasses.replace(dcfg, num_target_layers=dcfg.num_target_layers + 4)
        want = (f"its num_target_layers is {dcfg.num_target_layers + 4}, the target's num_hidden_layers is "
                f"{dcfg.num_target_layers}")
    checkpoint.save_drafter(Drafter(other, dtype=jnp.float32, rngs=nnx.Rngs(0)), tmp_path / "other")

    def no_target(*args, **kwargs):
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr(checkpoint, "load_target", no_target)
    cfg = serve.load_settings(serve.parse_args(["--target", str(models[0]), "--draft", str(tmp_path / "other"),
                                                *ENGINE_FLAGS]))
    with pytest.raises(serve.CLIError) as err:
        serve.load_engine(cfg)
    assert str(err.value) == (f"the drafter {tmp_path / 'other'} does not fit the target {models[0]}: {want} "
                              f"({models[0] / 'config.json'})")


def test_a_paged_server_warms_up_before_binding(models, caplog):
    """A paged engine's warm-up runs on its own KV pools: in the background it would hold them beside the
    server's, so serve.py compiles every shape before it binds, and says so."""
    import logging

    cfg = serve.load_settings(serve.parse_args(["--target", str(models[0]), "--no-draft", *ENGINE_FLAGS,
                                                "--set", "engine.page_size=8", "--set", "engine.max_batch_size=2"]))
    assert cfg.server.warmup and cfg.server.warmup_background
    engine = serve.load_engine(cfg)
    with caplog.at_level(logging.INFO):
        assert serve.warm_up(cfg, engine) is None
    assert any("a paged engine compiles every shape before serving" in r.getMessage() for r in caplog.records)
