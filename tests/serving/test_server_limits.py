"""The server against slow and hostile clients: header and body timeouts, the connection limit, huge
prompts, shutdown past its timeout, error bodies, numbers out of range, and the compilation cache's directory.

Every test runs uvicorn on 127.0.0.1 (a free port, a background thread) with ``FakeEngine`` and
short limits, and stops by itself.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
import time
import types

import httpx
import pytest
import tokenizer_fixtures as tf

from dflash_jax.io.config import ConfigError
from dflash_jax.io.tokenizer import Tokenizer
from dflash_jax.runtime import compile_cache
from dflash_jax.serving import ServerThread, create_app
from dflash_jax.serving.settings import ServeConfig, load_serve_config
from dflash_jax.serving.testing import FakeEngine

TOKENIZER_VOCAB = 512
MODEL_VOCAB = 520
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer(tf.write_qwen_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=TOKENIZER_VOCAB))


def fake_engine(**kwargs) -> FakeEngine:
    return FakeEngine(MODEL_VOCAB, max_length=MAX_LENGTH, token_range=(0, TOKENIZER_VOCAB), **kwargs)


def error_of(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def closed_by_server(sock: socket.socket, within: float) -> bytes | None:
    """What the server sent before closing ``sock`` within ``within`` s (b"" for nothing), or None if
    it is still open then."""
    sock.settimeout(within)
    received = b""
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                return received
            received += data
    except (ConnectionResetError, BrokenPipeError):
        return received
    except socket.timeout:
        return None
    return None


# ----------------------------------------------------------------------------------------- slow clients


def test_slow_clients_are_closed_and_cannot_crowd_out_requests(tokenizer):
    """200 connections that never finish their headers (or body, or send nothing) are held by their
    clients; the server keeps at most max_connections open, closing the oldest one still sending a
    request for each new one, so normal requests are served meanwhile; and past header_timeout_s
    every slow connection has been closed."""
    app = create_app(fake_engine(), tokenizer, model_name="tiny", max_length=MAX_LENGTH, body_timeout_s=3.0)
    slow: list[socket.socket] = []
    limit = 40
    with ServerThread(app, header_timeout_s=4.0, max_connections=limit) as srv:
        try:
            for i in range(200):
                s = socket.create_connection((srv.host, srv.port), timeout=5)
                if i % 3 == 0:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
                elif i % 3 == 1:  # headers whole, the body never
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{")
                slow.append(s)
            t0 = time.monotonic()
            for k in range(5):  # each a new connection, as a fresh client's
                r = httpx.post(srv.url + "/v1/completions", json={"prompt": [10, 11 + k], "max_tokens": 3},
                               timeout=5)
                assert r.status_code == 200, r.text
            # Served at once: well before the first slow connection's deadline (its body's, 3 s), with a
            # margin for a loaded machine.
            assert time.monotonic() - t0 < 2.0
            deadline = time.monotonic() + 2
            while len(srv.server.server_state.connections) > limit:
                assert time.monotonic() < deadline, len(srv.server.server_state.connections)
                time.sleep(0.01)
            # Past the header deadline the server has closed every slow connection.
            for s in slow:
                assert closed_by_server(s, within=5.0) is not None
            assert len(srv.server.server_state.connections) == 0
            assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        finally:
            for s in slow:
                s.close()


def test_a_body_that_does_not_arrive_in_time_is_408_and_a_silent_connection_is_closed(tokenizer):
    app = create_app(fake_engine(), tokenizer, model_name="tiny", max_length=MAX_LENGTH, body_timeout_s=0.5)
    with ServerThread(app, header_timeout_s=0.5) as srv:
        with socket.create_connection((srv.host, srv.port), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            answer = closed_by_server(s, within=3.0)
            assert answer is not None and answer.startswith(b"HTTP/1.1 408 "), answer
            body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "request_timeout"
        with socket.create_connection((srv.host, srv.port), timeout=5) as s:  # sends nothing at all
            t0 = time.monotonic()
            assert closed_by_server(s, within=3.0) == b""
            assert time.monotonic() - t0 < 2.0
        # A keep-alive connection gets the same deadline after each response.
        with socket.create_connection((srv.host, srv.port), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            time.sleep(0.1)
            s.sendall(b"GET /hea")
            answer = closed_by_server(s, within=3.0)
            assert answer is not None and answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1") == 1


def test_the_connection_limit_refuses_when_every_connection_is_served(tokenizer):
    """With max_connections requests being answered, a new connection is answered 503 (OpenAI's error
    body) and closed; none of the requests in flight is cut."""
    engine = fake_engine(max_batch_size=2, step_time_s=0.02, steps_per_sync=1, block_size=1)
    app = create_app(engine, tokenizer, model_name="tiny", max_length=MAX_LENGTH)
    results: list[httpx.Response] = []

    def long_request():
        results.append(httpx.post(srv.url + "/v1/completions", json={"prompt": [10, 11], "max_tokens": 30,
                                                                      "ignore_eos": True}, timeout=30))

    with ServerThread(app, max_connections=2) as srv:
        threads = [threading.Thread(target=long_request) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while app.state.ctx.scheduler.submitted < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with socket.create_connection((srv.host, srv.port), timeout=5) as s:
            answer = closed_by_server(s, within=3.0)
        assert answer is not None and answer.startswith(b"HTTP/1.1 503 "), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "server_overloaded"
        for t in threads:
            t.join(30)
        assert [r.status_code for r in results] == [200, 200]


# ----------------------------------------------------------------------------------------- huge prompts


LONG = 3000  # a long prompt's characters: over what the app encodes inline


class SlowEncoder:
    """The tokenizer, with long texts taking ``delay`` s to encode (a stand-in for a huge prompt) and
    every encoded text's length and thread recorded."""

    def __init__(self, tokenizer: Tokenizer, delay: float):
        self.tokenizer, self.delay = tokenizer, delay
        self.calls: list[tuple[int, str]] = []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def _record(self, text: str) -> None:
        self.calls.append((len(text), threading.current_thread().name))
        if len(text) > LONG:
            time.sleep(self.delay)

    def encode(self, text, **kwargs):
        self._record(text)
        return self.tokenizer.encode(text, **kwargs)

    def encode_batch(self, texts, **kwargs):
        for text in texts:
            self._record(text)
        return self.tokenizer.encode_batch(texts, **kwargs)


def test_a_huge_prompt_is_refused_before_it_is_encoded_and_long_ones_are_encoded_off_the_loop(tokenizer):
    spy = SlowEncoder(tokenizer, delay=1.0)
    app = create_app(fake_engine(), spy, model_name="tiny", max_length=MAX_LENGTH, vocab_size=MODEL_VOCAB)
    bound = app.state.ctx.max_prompt_chars
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        for path, body in (("/v1/completions", {"prompt": "x" * 2_000_000}),
                           ("/v1/completions", {"prompt": ["hi", "x" * 2_000_000]}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2_000_000}]})):
            t0 = time.monotonic()
            err = error_of(client.post(path, json=body), 400, "context_length_exceeded")
            assert "characters" in err["message"] and time.monotonic() - t0 < 0.5
        assert all(n <= bound for n, _ in spy.calls)  # nothing over the bound was encoded
        # A long prompt under the bound is encoded on a worker thread: the event loop keeps serving.
        assert bound > LONG
        long = {"prompt": "word " * (bound // 5 - 1), "max_tokens": 2}
        done = threading.Event()

        def post_long():
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                error_of(c.post("/v1/completions", json=long), 400, "context_length_exceeded")  # too many tokens
            done.set()

        thread = threading.Thread(target=post_long)
        thread.start()
        deadline = time.monotonic() + 10
        while not any(n > LONG for n, _ in spy.calls):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        t0 = time.monotonic()
        assert client.get("/health").status_code == 200
        assert time.monotonic() - t0 < 0.5 and not done.is_set()  # answered while the encode ran
        thread.join(30)
        assert all(name != "uvicorn" for n, name in spy.calls if n > LONG)


# ----------------------------------------------------------------------------------------- shutdown


def test_shutdown_past_its_timeout_answers_shutting_down(tokenizer):
    """A shutdown timeout shorter than the work in flight: a plain request is answered 503 with an
    OpenAI error body (code shutting_down), a stream ends with an error event and [DONE]."""
    engine = fake_engine(max_batch_size=2, step_time_s=0.05, steps_per_sync=1, block_size=1)
    app = create_app(engine, tokenizer, model_name="tiny", max_length=MAX_LENGTH)
    srv = ServerThread(app, timeout_graceful_shutdown=0.3).start()
    results: dict[str, object] = {}
    streaming = threading.Event()

    def stream():
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": [10, 11], "max_tokens": 60, "stream": True,
                                                           "ignore_eos": True}) as r:
                lines = []
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        streaming.set()
                results["stream"] = lines

    def plain():
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            results["plain"] = c.post("/v1/completions", json={"prompt": [20, 21], "max_tokens": 60,
                                                               "ignore_eos": True})

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while app.state.ctx.scheduler.submitted < 2 or not streaming.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    t0 = time.monotonic()
    srv.stop(timeout=10)
    for t in threads:
        t.join(10)
    assert time.monotonic() - t0 < 3.0
    error_of(results["plain"], 503, "shutting_down")
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2][len("data: "):])
    assert last["error"]["code"] == "shutting_down" and last["error"]["type"] == "server_error"


# ----------------------------------------------------------------------------------------- error bodies


class PathEngine(FakeEngine):
    def prefill(self, prompts, *args, **kwargs):
        raise OSError("/srv/models/secret-target/model-00001.safetensors: read error")


def test_error_bodies_show_no_server_paths_and_clip_echoed_values(tmp_path, tokenizer, caplog):
    broken = Tokenizer(tf.write_qwen_tokenizer(tmp_path / "broken", vocab_size=TOKENIZER_VOCAB,
                                               chat_template="{% if %}"))
    app = create_app(PathEngine(MODEL_VOCAB, max_length=MAX_LENGTH, token_range=(0, TOKENIZER_VOCAB)), broken,
                     model_name="tiny", max_length=MAX_LENGTH, vocab_size=MODEL_VOCAB)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        err = error_of(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}),
                       400, "chat_template_error")
        assert "syntax error" in err["message"] and str(tmp_path) not in err["message"] and "/" not in err["message"]
        err = error_of(client.post("/v1/completions", json={"prompt": [1, 2]}), 500, "engine_error")
        assert "read error" in err["message"] and "/srv/models" not in err["message"]
        huge = "z" * 100_000
        cases = [
            ({"prompt": "hi", "model": huge}, 404, "model_not_found"),
            ({"prompt": "hi", huge: 1}, 400, "unknown_field"),
            ({"prompt": "hi", "max_tokens": -(10 ** 4000)}, 400, "invalid_value"),
            ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(20_000)}}, 400, "invalid_token_id"),
            ({"prompt": "hi", "suffix": huge}, 400, "unsupported_parameter"),
            ({"prompt": [10 ** 4000, 1]}, 400, "invalid_token_id"),
            ({"prompt": "hi", "stop_token_ids": [10 ** 4000]}, 400, "invalid_token_id"),
        ]
        for body, status, code in cases:
            err = error_of(client.post("/v1/completions", json=body), status, code)
            assert len(err["message"]) < 600 and len(err["param"] or "") < 300, (code, len(err["message"]))
        err = error_of(client.get("/" + "p" * 30_000), 404, "not_found")
        assert len(err["message"]) < 600
    # The model without a chat template: the client is told so, without the directory, and the server's log
    # keeps its errors for its own faults (serve.py warns about the missing template once, at start-up).
    bare = Tokenizer(tf.write_qwen_tokenizer(tmp_path / "bare", vocab_size=TOKENIZER_VOCAB, chat_template=None))
    app = create_app(fake_engine(), bare, model_name="tiny", max_length=MAX_LENGTH)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as client, \
            caplog.at_level(logging.WARNING, logger="dflash_jax"):
        caplog.clear()
        err = error_of(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}),
                       400, "chat_template_error")
        assert "no chat template" in err["message"] and str(tmp_path) not in err["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# ----------------------------------------------------------------------------------------- out-of-range values


@pytest.fixture(scope="module")
def client(tokenizer):
    app = create_app(fake_engine(), tokenizer, model_name="tiny", max_length=MAX_LENGTH, vocab_size=MODEL_VOCAB)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


HUGE = 10 ** 400  # valid JSON, past a float's range
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body, code, param", [
    *(("/v1/chat/completions", {**CHAT, name: value}, "invalid_type", name)
      for name, value in (("temperature", HUGE), ("top_p", HUGE), ("min_p", -HUGE), ("presence_penalty", HUGE),
                          ("frequency_penalty", -HUGE), ("repetition_penalty", HUGE))),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": HUGE}}, "invalid_value", "logit_bias"),
    # more choices than the server ever queues: a 400 (a 503 says to retry), before they are built
    ("/v1/chat/completions", {**CHAT, "n": 5000}, "too_many_prompts", "n"),
    ("/v1/chat/completions", {**CHAT, "n": HUGE}, "too_many_prompts", "n"),
    ("/v1/completions", {"prompt": "hi", "n": HUGE}, "too_many_prompts", "n"),
], ids=lambda v: v if isinstance(v, str) and not v.startswith("/") else None)
def test_numbers_out_of_range_are_400_naming_the_field(client, path, body, code, param):
    t0 = time.monotonic()
    err = error_of(client.post(path, json=body), 400, code)
    assert err["param"] == param and len(err["message"]) < 600 and time.monotonic() - t0 < 2.0, err
    r = client.post("/v1/completions", json={"prompt": [10, 11], "max_tokens": 2})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------------------- settings


def test_limit_settings_are_checked():
    cfg = load_serve_config(None)
    assert cfg.server.header_timeout_s <= 30 and cfg.server.body_timeout_s <= 30 and cfg.server.max_connections > 0
    assert cfg.server == ServeConfig().server == load_serve_config("configs/serve.yaml").server
    for override in ("server.header_timeout_s=0", "server.body_timeout_s=-1", "server.max_connections=0",
                     "server.header_timeout_s=nan", "server.graceful_shutdown_timeout_s=-1"):
        with pytest.raises(ConfigError):
            load_serve_config(None, [override])


def test_warmup_sampling_setting_is_checked():
    assert load_serve_config(None).server.warmup_sampling == ("sample",)
    cfg = load_serve_config(None, ["server.warmup_sampling=[sample, sample+top_p+top_logprobs, logprobs]"])
    assert cfg.server.warmup_sampling == ("sample", "sample+top_p+top_logprobs", "logprobs")
    assert load_serve_config(None, ["server.warmup_sampling=[]"]).server.warmup_sampling == ()
    for entry, problem in (("sample+top_k", "top_k needs its value"), ("top_p", "act on sampled rows only"),
                           ("sample+temperature", "unknown feature 'temperature'"), ("''", "expected features")):
        with pytest.raises(ConfigError, match=problem) as err:
            load_serve_config(None, [f"server.warmup_sampling=[sample, {entry}]"])
        assert "warmup_sampling" in str(err.value)


# ----------------------------------------------------------------------------------------- compilation cache


@pytest.fixture
def no_jax_cache(monkeypatch):
    """``compile_cache`` with JAX's process-wide settings stubbed out (they cannot be undone)."""
    settings = types.SimpleNamespace(jax_compilation_cache_dir=None, updates={})
    settings.update = lambda name, value: settings.updates.__setitem__(name, value)
    fake = types.SimpleNamespace(config=settings, monitoring=types.SimpleNamespace(register_event_listener=id))
    monkeypatch.setattr(compile_cache, "jax", fake)
    monkeypatch.setattr(compile_cache, "_listening", compile_cache._listening)
    return settings


def test_compilation_cache_directory_must_be_private(tmp_path, no_jax_cache):
    old = os.umask(0)
    try:
        made = compile_cache.use_compilation_cache(tmp_path / "new" / "cache")
    finally:
        os.umask(old)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert no_jax_cache.updates["jax_compilation_cache_dir"] == str(made)

    shared = tmp_path / "shared"
    shared.mkdir()
    for mode in (0o777, 0o775, 0o757):
        shared.chmod(mode)
        for check in (compile_cache.check_setting, compile_cache.use_compilation_cache):
            with pytest.raises(ValueError, match="writable by other users"):
                check(str(shared))
    shared.chmod(0o755)
    (shared / "entry").write_bytes(b"code")
    (shared / "entry").chmod(0o666)
    with pytest.raises(ValueError, match="'entry' is writable by other users"):
        compile_cache.check_setting(str(shared))
    shared.chmod(0o700)  # others cannot reach the entry
    compile_cache.check_setting(str(shared))
    if os.getuid() == 0:  # only root can give a file away
        os.chown(shared / "entry", 12345, -1)
        with pytest.raises(ValueError, match="'entry' belongs to another user"):
            compile_cache.check_setting(str(shared))
        os.chown(shared, 12345, -1)
        with pytest.raises(ValueError, match="owned by another user"):
            compile_cache.use_compilation_cache(shared)
    assert no_jax_cache.updates["jax_compilation_cache_dir"] == str(made)  # nothing unsafe was taken
