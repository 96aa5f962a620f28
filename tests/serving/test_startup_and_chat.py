"""``python serve.py`` as a newcomer meets it: the embedded pair's settings (served as dflash-embedded,
compiled programs kept in the user cache directory), a server that says what it compiles and comes up
before compiling everything, chat completions through the official ``openai`` client whenever the
tokenizer has a chat template, and no framework chatter on stderr at the default verbosity."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizer_fixtures as tf

from dflash_jax import embedded
from dflash_jax.serving import cli as serve
from dflash_jax.serving.testing import wait_until_serving

REPO = Path(__file__).resolve().parents[2]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# What JAX, XLA, absl and Orbax print at their INFO and WARNING levels: never at the default verbosity.
NOISE = ("Unable to initialize backend", "jax._src", "absl", "orbax", "xla_bridge", "TF_CPP", "W0000", "I0000")


@pytest.mark.skipif(not embedded.available(), reason="the embedded default pair is not in this checkout")
def test_embedded_pair_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = serve.load_settings(serve.parse_args([]))
    assert cfg.model.target == str(embedded.DEFAULT_TARGET) and cfg.model.name == "dflash-embedded"
    assert cfg.engine.compilation_cache_dir == str(tmp_path / "cache" / "dflash-jax" / "xla")
    assert cfg.server.warmup and cfg.server.warmup_background
    assert serve.load_settings(serve.parse_args(["--no-compilation-cache"])).engine.compilation_cache_dir is None
    named = serve.load_settings(serve.parse_args(["--served-model-name", "coder", "--compilation-cache",
                                                  str(tmp_path / "mine")]))
    assert named.model.name == "coder" and named.engine.compilation_cache_dir == str(tmp_path / "mine")
    off = serve.load_settings(serve.parse_args(["--set", "model.embedded_compilation_cache=false"]))
    assert off.engine.compilation_cache_dir is None
    monkeypatch.delenv("XDG_CACHE_HOME")
    from dflash_jax.runtime.compile_cache import user_cache_dir

    assert user_cache_dir() == Path.home() / ".cache" / "dflash-jax" / "xla"


def test_other_targets_are_served_under_their_directory_name(tmp_path):
    target_dir, drafter_dir = tf.write_tiny_models_with_tokenizer(tmp_path)
    cfg = serve.load_settings(serve.parse_args(["--target", str(target_dir), "--draft", str(drafter_dir)]))
    assert cfg.model.name is None and cfg.engine.compilation_cache_dir is None  # the app names it "target"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_chat_through_the_openai_client_with_a_quiet_staged_start(tmp_path):
    """A tiny pair whose tokenizer has a ChatML template written here: the server binds after the
    shapes of a lone short request, logging each, compiles the rest in the background, and answers
    chat completions (plain and streamed) through the ``openai`` client under its served name."""
    openai = pytest.importorskip("openai")
    from dflash_jax.io.tokenizer import Tokenizer
    from dflash_jax.tiny import write_tiny_pair

    target_dir, drafter_dir = write_tiny_pair(tmp_path / "pair", target_overrides={"vocab_size": 520})
    tf.write_qwen_tokenizer(target_dir, vocab_size=512, chat_template=CHATML)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for name in ("TF_CPP_MIN_LOG_LEVEL", "JAX_PLATFORMS"):  # JAX probes its backends, and is told to hush
        env.pop(name, None)
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "serve.py"), "--target", str(target_dir), "--draft", str(drafter_dir),
             "--served-model-name", "tiny-chat", "--port", str(port), "--batch-size", "2", "--dtype", "float32",
             "--max-length", "96", "--max-new-tokens", "16", "--set", "engine.prompt_buckets=[32,64]"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url, proc, 240, log_path)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=240)
        assert [m.id for m in client.models.list().data] == ["tiny-chat"]
        messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
        reply = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=12)
        choice = reply.choices[0]
        assert reply.model == "tiny-chat" and choice.message.role == "assistant"
        assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
        templated = Tokenizer(target_dir).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert reply.usage.prompt_tokens == len(templated)
        stream = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=12, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert streamed == choice.message.content  # greedy: the same answer
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="target", messages=messages, max_tokens=4)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log_path.read_text()
    assert "warm-up: compiling the " in text and "warm-up 1/" in text, text
    assert re.search(r"serving 'tiny-chat' on http://127\.0\.0\.1:\d+ \(ready [0-9.]+ s after start\)", text), text
    assert "in the background while serving" in text, text
    assert not [line for line in text.splitlines() if any(n in line for n in NOISE)], text


@pytest.mark.slow
def test_verbose_shows_the_frameworks_and_errors_stay_visible(tmp_path):
    """``--verbose`` lets JAX's INFO lines through; at the default verbosity a real error still
    reaches stderr, in one line."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for name in ("TF_CPP_MIN_LOG_LEVEL", "JAX_PLATFORMS"):  # JAX probes its backends: INFO lines to hide or show
        env.pop(name, None)
    target_dir, drafter_dir = tf.write_tiny_models_with_tokenizer(tmp_path / "pair")
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [5, 6, 7]}\n')
    base = [sys.executable, str(REPO / "serve.py"), "generate", "--target", str(target_dir), "--draft",
            str(drafter_dir), "--input", str(tmp_path / "in.jsonl"), "--max-new-tokens", "4", "--dtype", "float32",
            "--max-length", "32", "--set", "engine.prompt_buckets=[16]", "--no-progress"]
    quiet = subprocess.run(base + ["--output", str(tmp_path / "a.jsonl")], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=600)
    assert quiet.returncode == 0, quiet.stderr
    assert not [line for line in quiet.stderr.splitlines() if any(n in line for n in NOISE)], quiet.stderr
    loud = subprocess.run(base + ["--output", str(tmp_path / "b.jsonl"), "--verbose"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert loud.returncode == 0 and "jax._src" in loud.stderr, loud.stderr
    bad = subprocess.run(base[:-1] + ["--output", str(tmp_path / "c.jsonl"), "--set", "engine.max_length=1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "serve.py: error: " in bad.stderr and "max_length" in bad.stderr, bad.stderr
