"""The HTTP server: real HTTP through uvicorn on 127.0.0.1 (a free port, a background thread), hit by httpx.

The first part runs against ``FakeEngine`` (fast: protocol, streaming, continuous batching, errors, auth,
shutdown); the second against the real ``Engine`` with a tiny random Qwen3 target and DFlash drafter.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import numpy as np
import pytest
import tokenizer_fixtures as tf

from dflash_jax.serving import ServerThread, create_app
from dflash_jax.serving.metrics import LATENCY_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from dflash_jax.serving.testing import FakeEngine, GatedEngine
from dflash_jax.io.tokenizer import Tokenizer

TOKENIZER_VOCAB = 512
MODEL_VOCAB = 520  # the model's embedding table is larger than the tokenizer, as in Qwen checkpoints
MAX_LENGTH = 64


# ----------------------------------------------------------------------------------------- helpers


def sse_events(response: httpx.Response) -> list:
    """The ``data:`` payloads of an SSE response (JSON-decoded, ``[DONE]`` kept as a string)."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def join_stream(events: list, chat: bool) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str]]:
    """(text, token ids, finish reason) per choice index from OpenAI chunks."""
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    for ev in events[:-1]:
        assert "error" not in ev, ev
        assert ev["object"] == ("chat.completion.chunk" if chat else "text_completion")
        for c in ev["choices"]:
            i = c["index"]
            piece = c["delta"].get("content", "") if chat else c["text"]
            texts[i] = texts.get(i, "") + (piece or "")
            ids.setdefault(i, []).extend(c.get("token_ids") or [])
            if c["finish_reason"] is not None:
                assert i not in finish, "two finish chunks"
                finish[i] = c["finish_reason"]
    return texts, ids, finish


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = "<any>",
                 contains: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param != "<any>":
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err
    return err


def metric_values(client: httpx.Client) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}``."""
    values = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


# ----------------------------------------------------------------------------------------- fake engine


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer(tf.write_qwen_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=TOKENIZER_VOCAB))


@pytest.fixture(scope="module")
def fake(tokenizer):
    engine = FakeEngine(MODEL_VOCAB, max_batch_size=4, max_length=MAX_LENGTH, block_size=4, steps_per_sync=2,
                        step_time_s=0.002, token_range=(0, TOKENIZER_VOCAB), fail_on_token=3)
    gated = GatedEngine(engine)
    app = create_app(gated, tokenizer, model_name="tiny", max_length=MAX_LENGTH, vocab_size=MODEL_VOCAB,
                     default_max_tokens=16, batch_wait_s=0.0)
    app.state.gated = gated
    with ServerThread(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            yield engine, client, srv


def expected(engine: FakeEngine, tokenizer: Tokenizer, ids: list[int], max_tokens: int) -> tuple[list[int], str, str]:
    out = engine.reference(ids, max_tokens, tokenizer.stop_token_ids)
    reason = "stop" if out and out[-1] in tokenizer.stop_token_ids else "length"
    return out, tokenizer.decode(out), reason


def test_health_models_and_bind(fake):
    engine, client, srv = fake
    assert srv.host == "127.0.0.1"
    assert client.get("/health").json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == MAX_LENGTH


def test_completion(fake, tokenizer):
    engine, client, _ = fake
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello, world", "max_tokens": 12,
                                             "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer.encode("Hello, world")
    out, text, reason = expected(engine, tokenizer, ids, 12)
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["token_ids"] == out and choice["prompt_token_ids"] == ids
    assert choice["text"] == text and choice["finish_reason"] == reason
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(out),
                             "total_tokens": len(ids) + len(out)}
    stats = body["dflash"][0]
    # The prefill commits the first token, each decode step the rest.
    assert stats["num_steps"] == len(stats["acceptance_lengths"]) and sum(stats["acceptance_lengths"]) + 1 == len(out)


def test_completion_token_ids_and_several_prompts(fake, tokenizer):
    engine, client, _ = fake
    prompts = [[10, 11, 12], "The quick brown fox", [200, 201]]
    r = client.post("/v1/completions", json={"prompt": [10, 11, 12], "max_tokens": 5})
    assert r.json()["choices"][0]["text"] == expected(engine, tokenizer, [10, 11, 12], 5)[1]
    r = client.post("/v1/completions", json={"prompt": ["The quick brown fox", "Hello"], "max_tokens": 6})
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [expected(engine, tokenizer, tokenizer.encode(p), 6)[1] for p in ("The quick brown fox", "Hello")]
    r = client.post("/v1/completions", json={"prompt": [[10, 11, 12], [200, 201]], "max_tokens": 7,
                                             "return_token_ids": True})
    got = [c["token_ids"] for c in r.json()["choices"]]
    assert got == [expected(engine, tokenizer, p, 7)[0] for p in (prompts[0], prompts[2])]
    # Without max_tokens: the server default (16), capped by the maximum length.
    r = client.post("/v1/completions", json={"prompt": [10, 11, 12], "return_token_ids": True, "ignore_eos": True})
    assert len(r.json()["choices"][0]["token_ids"]) == 16


def test_stop_token_ids_end_generation_besides_the_models_own(fake, tokenizer):
    engine, client, _ = fake
    ids = [30, 31, 32]
    free = engine.reference(ids, 12, tokenizer.stop_token_ids)
    stop = next(t for t in free[1:] if t not in tokenizer.stop_token_ids and t != free[0])
    stops = list(tokenizer.stop_token_ids) + [stop]
    want = engine.reference(ids, 12, stops)
    assert want[-1] == stop and len(want) < len(free)
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "stop_token_ids": [stop],
                                             "return_token_ids": True})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["token_ids"] == want and choice["finish_reason"] == "stop"
    messages = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "stop_token_ids": [stop],
                                                  "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == engine.reference(tokenizer.apply_chat_template(messages), 12, stops)
    # With ignore_eos the request's own stop ids still end generation.
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "stop_token_ids": [stop],
                                             "ignore_eos": True, "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == engine.reference(ids, 12, [stop])


def test_stop_strings_cut_the_text_and_end_the_row(fake, tokenizer):
    """A stop string ends a choice at the token that completes it: the text is cut before it, streamed
    or not, and the freed row serves the next request."""
    engine, client, _ = fake
    ids = tokenizer.encode("Hello, world")
    free = engine.reference(ids, 16, tokenizer.stop_token_ids)
    text = tokenizer.decode(free)
    stops = {text[at: at + 2] for at in range(1, len(text) - 2)
             if text[at: at + 2].strip() and "\ufffd" not in text[at: at + 2]}
    cuts = set()
    for stop in sorted(stops)[:8]:  # ends at several tokens, inside and at the end of a host sync's chunk
        kept, want, found = tf.stop_string_reference(tokenizer, free, [stop])
        assert found == stop
        cuts.add(kept)
        body = {"prompt": ids, "max_tokens": 16, "stop": [stop, "never in this text"], "return_token_ids": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (want, free[:kept], "stop")
        assert r.json()["usage"]["completion_tokens"] == kept
        stats = r.json()["dflash"][0]
        assert sum(stats["acceptance_lengths"]) + 1 == kept and stats["num_steps"] == len(stats["acceptance_lengths"])
        texts, streamed, finish = join_stream(stream(client, "/v1/completions", {**body, "stop": stop}), chat=False)
        assert (texts[0], streamed[0], finish[0]) == (want, free[:kept], "stop")
    assert len(cuts) >= 4
    # Several prompts: each choice ends at its own stop (or runs to max_tokens); the rows end apart.
    other = [200, 201]
    other_free = engine.reference(other, 16, tokenizer.stop_token_ids)
    kept, want, _ = tf.stop_string_reference(tokenizer, free, [stop])
    other_kept, other_want, _ = tf.stop_string_reference(tokenizer, other_free, [stop])
    body = {"prompt": [ids, other], "max_tokens": 16, "stop": stop, "return_token_ids": True}
    r = client.post("/v1/completions", json=body)
    got = [(c["text"], c["token_ids"]) for c in r.json()["choices"]]
    assert got == [(want, free[:kept]), (other_want, other_free[:other_kept])]
    texts, streamed, _ = join_stream(stream(client, "/v1/completions", body), chat=False)
    assert [(texts[i], streamed[i]) for i in (0, 1)] == got

    messages = [{"role": "user", "content": "Say something."}]
    free = engine.reference(tokenizer.apply_chat_template(messages), 16, tokenizer.stop_token_ids)
    kept, want, _ = tf.stop_string_reference(tokenizer, free, [stop])
    chat = {"messages": messages, "max_tokens": 16, "stop": stop, "return_token_ids": True}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.json()["choices"][0]["message"]["content"] == want and r.json()["choices"][0]["token_ids"] == free[:kept]
    texts, streamed, _ = join_stream(stream(client, "/v1/chat/completions", chat), chat=True)
    assert (texts[0], streamed[0]) == (want, free[:kept])
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 16, "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == engine.reference(ids, 16, tokenizer.stop_token_ids)


def test_chat_completion(fake, tokenizer):
    engine, client, _ = fake
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer.apply_chat_template(messages)
    out, text, reason = expected(engine, tokenizer, ids, 10)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["prompt_token_ids"] == ids
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["token_ids"] == out and choice["finish_reason"] == reason
    # Content parts, chat_template_kwargs (Qwen3's enable_thinking) and max_completion_tokens.
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]}]
    r = client.post("/v1/chat/completions", json={"messages": parts, "max_completion_tokens": 4,
                                                  "chat_template_kwargs": {"enable_thinking": False},
                                                  "return_token_ids": True})
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is\n2+2?"}], enable_thinking=False)
    assert r.json()["prompt_token_ids"] == ids
    assert r.json()["choices"][0]["token_ids"] == expected(engine, tokenizer, ids, 4)[0]


def test_streaming_equals_non_streamed(fake, tokenizer):
    engine, client, _ = fake
    body = {"prompt": ["Hello, world", "café 東京"], "max_tokens": 24, "return_token_ids": True}
    plain = client.post("/v1/completions", json=body).json()
    events = stream(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    texts, ids, finish = join_stream(events, chat=False)
    for c in plain["choices"]:
        assert texts[c["index"]] == c["text"]
        assert ids[c["index"]] == c["token_ids"]
        assert finish[c["index"]] == c["finish_reason"]
    assert len(events) > 6  # tokens arrive in several chunks
    assert events[-2]["choices"] == [] and events[-2]["usage"] == plain["usage"]
    # Each choice's finish chunk carries its decoding statistics, as the plain response's dflash list.
    streamed = {e["dflash"][0]["index"]: e["dflash"][0] for e in events[:-1] if "dflash" in e}
    assert sorted(streamed) == [0, 1]
    for want in plain["dflash"]:
        got = streamed[want["index"]]
        assert {k: got[k] for k in ("tau", "num_steps", "acceptance_lengths")} == \
            {k: want[k] for k in ("tau", "num_steps", "acceptance_lengths")}
        assert got["time_to_first_token"] > 0 and got["time_per_output_token"] > 0

    messages = [{"role": "user", "content": "Tell me a story 🙂"}]
    chat = {"messages": messages, "max_tokens": 30, "return_token_ids": True}
    plain = client.post("/v1/chat/completions", json=chat).json()
    events = stream(client, "/v1/chat/completions", chat)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    texts, ids, finish = join_stream(events, chat=True)
    assert texts[0] == plain["choices"][0]["message"]["content"]
    assert ids[0] == plain["choices"][0]["token_ids"]
    assert finish[0] == plain["choices"][0]["finish_reason"]
    assert all("usage" not in e for e in events[:-1])  # no include_usage


def run_concurrently(srv: ServerThread, bodies: list[dict]) -> list[dict]:
    """Posts every body at once; the engine is held at its gate until all are queued, so admission is
    deterministic: the first request alone, then the rest in arrival order as rows free up."""
    gated, scheduler = srv.app.state.gated, srv.app.state.ctx.scheduler
    start = scheduler.submitted
    gated.gate.clear()
    gated.entered.clear()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            futures = []
            for i, body in enumerate(bodies):
                futures.append(pool.submit(_one, srv.url, body))
                if i == 0:  # the first request reaches the engine alone
                    assert gated.entered.wait(30)
            deadline = time.monotonic() + 30
            while scheduler.submitted < start + len(bodies):
                assert time.monotonic() < deadline, "requests did not arrive"
                time.sleep(0.005)
            gated.gate.set()
            return [f.result() for f in futures]
    finally:
        gated.gate.set()


def _one(url: str, body: dict) -> dict:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()


def test_concurrent_requests_are_batched_and_correct(fake, tokenizer):
    engine, client, srv = fake
    prompts = [[i + 20, i + 21, i + 22] for i in range(10)]
    before = len(engine.prefills)
    answers = run_concurrently(srv, [{"prompt": p, "max_tokens": 8 + i, "return_token_ids": True}
                                     for i, p in enumerate(prompts)])
    for i, (p, a) in enumerate(zip(prompts, answers)):
        assert a["choices"][0]["token_ids"] == expected(engine, tokenizer, p, 8 + i)[0]
    admitted = [len(b) for b in engine.prefills[before:]]
    # The first request runs alone; the other nine queue behind it: three fill the free rows at the
    # next host sync, the rest take rows as they free up, never more than max_batch_size at once.
    assert admitted[:2] == [1, 3] and sum(admitted) == 10 and max(admitted) <= 4


BAD_COMPLETIONS = [
    (b"{bad json", "invalid_json", None),
    (b"[1, 2]", "invalid_json", None),
    (b"", "invalid_json", None),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json", None),  # deeper than Python recurses
    (rb'{"prompt": "a\ud800b"}', "invalid_json", "prompt"),  # a lone surrogate: valid JSON, no character
    (rb'{"prompt": ["hi", "\udc00"]}', "invalid_json", "prompt"),
    (rb'{"prompt": "hi", "\udc00": 1}', "invalid_json", "\\udc00"),  # the key, escaped
    (b'{"prompt": "\xed\xa0\x80"}', "invalid_json", None),  # an encoded surrogate is no UTF-8
    ('{"prompt": "hi"}'.encode("utf-16"), "invalid_json", None),  # JSON over HTTP is UTF-8
    (b"null", "invalid_json", None),
    ({"prompt": "hi", "foo": 1}, "unknown_field", "foo"),
    ({}, "missing_field", "prompt"),
    ({"prompt": 5}, "invalid_type", "prompt"),
    ({"prompt": [1, "a"]}, "invalid_type", "prompt"),
    ({"prompt": ""}, "empty_prompt", "prompt"),
    ({"prompt": []}, "empty_prompt", "prompt"),
    ({"prompt": ["ok", ""]}, "empty_prompt", "prompt"),
    ({"prompt": "hi", "max_tokens": "5"}, "invalid_type", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "invalid_value", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, "invalid_type", "max_tokens"),
    ({"prompt": "hi", "stream": "yes"}, "invalid_type", "stream"),
    ({"prompt": "hi", "stream_options": {"foo": True}}, "unknown_field", "stream_options"),
    ({"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "invalid_type", "stream_options"),
    ({"prompt": "hi", "temperature": 2.5}, "invalid_value", "temperature"),
    ({"prompt": "hi", "temperature": -1}, "invalid_value", "temperature"),
    ({"prompt": "hi", "top_p": 0}, "invalid_value", "top_p"),
    ({"prompt": "hi", "top_k": -2}, "invalid_value", "top_k"),
    ({"prompt": "hi", "min_p": 1.5}, "invalid_value", "min_p"),
    ({"prompt": "hi", "n": 0}, "invalid_value", "n"),
    ({"prompt": "hi", "best_of": 3}, "unsupported_parameter", "best_of"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "invalid_value", "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": "1"}, "invalid_type", "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "invalid_value", "repetition_penalty"),
    ({"prompt": "hi", "min_tokens": -1}, "invalid_value", "min_tokens"),
    ({"prompt": "hi", "stop": 5}, "invalid_type", "stop"),
    ({"prompt": "hi", "stop": ["\n", 5]}, "invalid_type", "stop"),
    ({"prompt": "hi", "stop": ["\n", ""]}, "invalid_value", "stop"),
    ({"prompt": "hi", "stop": [str(i) for i in range(17)]}, "invalid_value", "stop"),
    ({"prompt": "hi", "stop": "x" * 1001}, "invalid_value", "stop"),
    ({"prompt": "hi", "logprobs": 6}, "invalid_value", "logprobs"),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, "unsupported_parameter", "echo"),
    ({"prompt": "hi", "logit_bias": {"x": 5}}, "invalid_value", "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"1_0": 5}}, "invalid_value", "logit_bias"),  # int() reads it as 10
    ({"prompt": "hi", "logit_bias": {" 5": 5}}, "invalid_value", "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"1": 101}}, "invalid_value", "logit_bias"),
    ({"prompt": "hi", "logit_bias": {str(MODEL_VOCAB): 1}}, "invalid_token_id", "logit_bias"),
    ({"prompt": "hi", "suffix": "x"}, "unsupported_parameter", "suffix"),
    ({"prompt": [1, 2, MODEL_VOCAB]}, "invalid_token_id", "prompt"),
    ({"prompt": [-1]}, "invalid_token_id", "prompt"),
    ({"prompt": list(range(10, 10 + MAX_LENGTH))}, "context_length_exceeded", "prompt"),
    ({"prompt": "word " * 200}, "context_length_exceeded", "prompt"),
    ({"prompt": [10, 11], "max_tokens": MAX_LENGTH}, "context_length_exceeded", "max_tokens"),
    ({"prompt": [10, 11], "max_tokens": int("9" * 4300)}, "context_length_exceeded", "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": ' + b"1" * 4301 + b"}", "invalid_json", None),  # past Python's digit limit
    ({"prompt": [[1]] * 1025}, "too_many_prompts", "prompt"),  # more than the server queues (1,024): never fits
    ({"prompt": "hi", "stop_token_ids": "2"}, "invalid_type", "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": [1, 2.5]}, "invalid_type", "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "invalid_token_id", "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": [MODEL_VOCAB]}, "invalid_token_id", "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": list(range(100, 117))}, "too_many_stop_token_ids", "stop_token_ids"),
]

GOOD_MSG = [{"role": "user", "content": "hi"}]
BAD_CHATS = [
    ({"messages": []}, "empty_prompt", "messages"),
    ({}, "missing_field", "messages"),
    ({"messages": "hi"}, "invalid_type", "messages"),
    ({"messages": ["hi"]}, "invalid_type", "messages"),
    ({"messages": [{"role": "user"}]}, "missing_field", "messages"),
    ({"messages": [{"content": "x"}]}, "invalid_type", "messages[0].role"),
    ({"messages": [{"role": "", "content": "x"}]}, "invalid_type", "messages[0].role"),
    ({"messages": [*GOOD_MSG, {"role": "robot", "content": "x"}]}, "invalid_value", "messages[1].role"),
    ({"messages": [{"role": "User", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "invalid_type", "messages"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "unknown_field", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "unsupported_content", "messages"),
    ({"messages": GOOD_MSG, "prompt": "x"}, "unknown_field", "prompt"),
    ({"messages": GOOD_MSG, "temperature": "hot"}, "invalid_type", "temperature"),
    ({"messages": GOOD_MSG, "n": -1}, "invalid_value", "n"),
    ({"messages": GOOD_MSG, "logprobs": 1}, "invalid_type", "logprobs"),
    ({"messages": GOOD_MSG, "logprobs": True, "top_logprobs": 21}, "invalid_value", "top_logprobs"),
    ({"messages": GOOD_MSG, "top_logprobs": 2}, "invalid_value", "top_logprobs"),
    ({"messages": GOOD_MSG, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "unsupported_parameter", "tools"),
    ({"messages": GOOD_MSG, "response_format": {"type": "json_object"}}, "unsupported_parameter", "response_format"),
    ({"messages": GOOD_MSG, "chat_template_kwargs": "x"}, "invalid_type", "chat_template_kwargs"),
    ({"messages": GOOD_MSG, "chat_template_kwargs": {"messages": []}}, "invalid_value", "chat_template_kwargs"),
    ({"messages": GOOD_MSG, "chat_template_kwargs": {"self": 1}}, "invalid_value", "chat_template_kwargs"),
    ({"messages": GOOD_MSG, "max_completion_tokens": -1}, "invalid_value", "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 200}]}, "context_length_exceeded", "messages"),
    ({"messages": GOOD_MSG, "max_completion_tokens": MAX_LENGTH}, "context_length_exceeded", "max_completion_tokens"),
    (rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}', "invalid_json",
     "messages"),
]


def _post(client, path, payload):
    if isinstance(payload, bytes):
        return client.post(path, content=payload, headers={"content-type": "application/json"})
    return client.post(path, json=payload)


def test_bad_input_is_400_and_the_server_keeps_serving(fake, tokenizer):
    engine, client, _ = fake
    calls = len(engine.prefills)
    for payload, code, param in BAD_COMPLETIONS:
        for streaming in (False, True):
            if streaming and isinstance(payload, dict) and payload:
                payload = {**payload, "stream": True} if "stream" not in payload else payload
            assert_error(_post(client, "/v1/completions", payload), 400, code, param)
    for payload, code, param in BAD_CHATS:
        assert_error(_post(client, "/v1/chat/completions", payload), 400, code, param)
    assert len(engine.prefills) == calls  # nothing reached the engine
    # Errors name the problem.
    err = assert_error(_post(client, "/v1/completions", {"prompt": "hi", "temperature": 2.5}), 400)
    assert "temperature" in err["message"] and "[0, 2]" in err["message"]
    err = assert_error(_post(client, "/v1/completions", {"prompt": "hi", "foo": 1, "bar": 2}), 400)
    assert "'bar'" in err["message"] and "'foo'" in err["message"]
    err = assert_error(_post(client, "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}),
                       400, "invalid_value", "stream_options")
    assert "'stream': true" in err["message"]
    # Other statuses keep the OpenAI error body.
    assert_error(_post(client, "/v1/completions", {"prompt": "hi", "model": "gpt-4"}), 404, "model_not_found", "model")
    assert_error(client.get("/v1/completions"), 405, "method_not_allowed")
    assert_error(client.get("/v2/nothing"), 404, "not_found")
    # The next good request is served.
    r = client.post("/v1/completions", json={"prompt": [10, 11, 12], "max_tokens": 5, "return_token_ids": True})
    assert r.status_code == 200
    assert r.json()["choices"][0]["token_ids"] == expected(engine, tokenizer, [10, 11, 12], 5)[0]
    # Surrogate pairs (an emoji, as ASCII-only JSON writers send it) are one character, not an error.
    r = _post(client, "/v1/completions", rb'{"prompt": "\ud83d\ude42 hi", "max_tokens": 2, "return_token_ids": true}')
    assert r.status_code == 200 and r.json()["choices"][0]["prompt_token_ids"] == tokenizer.encode("\U0001f642 hi")
    metrics = client.get("/metrics").text
    assert 'dflash_http_requests_total{model="tiny",endpoint="/v1/completions",status="400"}' in metrics


def test_an_unknown_message_role_is_400_naming_the_field(fake, tokenizer):
    """Messages take OpenAI's roles (less function calling's "function"): another role reached the chat
    template, which rendered it as it pleased or dropped it. The error names the field and the roles."""
    engine, client, _ = fake
    calls = len(engine.prefills)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "robot", "content": "beep"}]
    for streaming in (False, True):
        err = assert_error(_post(client, "/v1/chat/completions", {"messages": messages, "stream": streaming}), 400,
                           "invalid_value", "messages[2].role")
        assert err["type"] == "invalid_request_error"
        assert err["message"] == ("'messages[2].role' must be one of system, developer, user, assistant, tool, "
                                  'got "robot"')
    assert len(engine.prefills) == calls  # nothing reached the engine
    # Every supported role is served, empty content too.
    for role in ("system", "developer", "user", "assistant", "tool"):
        messages = [{"role": role, "content": ""}, {"role": "user", "content": "hi"}]
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "return_token_ids": True})
        assert r.status_code == 200, (role, r.text)
        assert r.json()["prompt_token_ids"] == tokenizer.apply_chat_template(messages)


def test_engine_error_is_500_and_the_server_keeps_serving(fake, tokenizer):
    engine, client, _ = fake
    err = assert_error(client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}), 500,
                       "engine_error")
    assert "failing token" in err["message"] and err["type"] == "server_error"
    events = stream(client, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4})
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
    r = client.post("/v1/completions", json={"prompt": [10, 11, 12], "max_tokens": 5})
    assert r.status_code == 200
    assert client.get("/health").json()["status"] == "ok"


def test_metrics(fake):
    engine, client, _ = fake
    client.post("/v1/completions", json={"prompt": [10, 11, 12], "max_tokens": 5})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = metric_values(client)
    assert values['dflash_generation_tokens_total{model="tiny"}'] > 0
    assert values['dflash_prompt_tokens_total{model="tiny"}'] > 0
    assert values['dflash_requests_failed_total{model="tiny"}'] >= 1
    tau = values['dflash_acceptance_length_mean{model="tiny"}']
    assert 1.0 <= tau <= 4.0  # FakeEngine commits 1..block_size (4) tokens per step
    assert values['dflash_generation_tokens_per_second{model="tiny"}'] > 0
    assert values['dflash_http_requests_total{model="tiny",endpoint="/v1/completions",status="200"}'] >= 1
    assert "# TYPE dflash_generation_tokens_total counter" in r.text
    # Latency histograms: cumulative buckets ending in +Inf = _count, observations that fit their bounds.
    for name, bounds in (("dflash_time_to_first_token_seconds", TTFT_BUCKETS),
                         ("dflash_time_per_output_token_seconds", TPOT_BUCKETS),
                         ("dflash_request_latency_seconds", LATENCY_BUCKETS)):
        assert f"# TYPE {name} histogram" in r.text
        buckets = [values[f'{name}_bucket{{model="tiny",le="{b}"}}'] for b in (*map(repr, bounds), "+Inf")]
        count, total = values[f'{name}_count{{model="tiny"}}'], values[f'{name}_sum{{model="tiny"}}']
        assert buckets == sorted(buckets) and buckets[-1] == count >= 1 and total > 0
    # The fake engine's requests take milliseconds: every time to first token is under 5 s.
    assert values['dflash_time_to_first_token_seconds_bucket{model="tiny",le="5.0"}'] == \
        values['dflash_time_to_first_token_seconds_count{model="tiny"}']


def test_request_body_limit(tokenizer):
    """A body over max_request_bytes is refused 413 before it is read whole (bodies are parsed and
    tokenized on the event loop: one huge prompt stalled every stream and the scheduler), whether its
    length is declared or it comes in chunks; the server keeps serving."""
    engine = FakeEngine(MODEL_VOCAB, token_range=(0, TOKENIZER_VOCAB))
    app = create_app(engine, tokenizer, model_name="tiny", max_length=MAX_LENGTH, max_request_bytes=1000)
    big = json.dumps({"prompt": "word " * 400, "max_tokens": 2}).encode()
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert_error(client.post(path, content=big), 413, "request_too_large", None, "1000 bytes")
            chunks = (big[i: i + 100] for i in range(0, len(big), 100))  # no Content-Length: chunked
            assert_error(client.post(path, content=chunks), 413, "request_too_large", None)
        r = client.post("/v1/completions", json={"prompt": "word " * 10, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert metric_values(client)['dflash_http_requests_total{model="tiny",endpoint="/v1/completions",status="413"}'] == 2


def test_rejection_verification_is_refused_by_a_drafter_that_selects_its_drafts(tokenizer):
    """``verify: "rejection"`` needs drafts drawn from the drafter's distribution: a server whose drafter
    selects a path (DFlash2) answers 400 naming ``verify`` and keeps serving; a bad mode is a 400 too."""
    from types import SimpleNamespace

    engine = FakeEngine(MODEL_VOCAB, token_range=(0, TOKENIZER_VOCAB))
    engine.drafter = SimpleNamespace(selects_drafts=True)
    app = create_app(engine, tokenizer, model_name="tiny", max_length=MAX_LENGTH)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        body = {"prompt": [10, 11], "max_tokens": 3, "temperature": 0.7, "seed": 1}
        assert_error(client.post("/v1/completions", json={**body, "verify": "rejection"}), 400, None, "verify",
                     "DFlash2")
        assert_error(client.post("/v1/completions", json={**body, "verify": "sometimes"}), 400, None, "verify")
        r = client.post("/v1/completions", json={"prompt": [10, 11], "max_tokens": 3})  # (the fake decodes greedily)
        assert r.status_code == 200, r.text


def test_api_key(tokenizer):
    engine = FakeEngine(MODEL_VOCAB, token_range=(0, TOKENIZER_VOCAB))
    app = create_app(engine, tokenizer, model_name="tiny", max_length=MAX_LENGTH, api_key="s3cret")
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        body = {"prompt": [10, 11], "max_tokens": 3}
        assert_error(client.post("/v1/completions", json=body), 401, "invalid_api_key")
        assert_error(client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert_error(client.get("/v1/models"), 401)
        ok = {"Authorization": "Bearer s3cret"}
        assert client.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert client.get("/v1/models", headers=ok).status_code == 200
        assert client.get("/health").status_code == 200  # probes need no key
        assert client.get("/metrics").status_code == 200  # nor scrapers, by default
    app = create_app(engine, tokenizer, model_name="tiny", max_length=MAX_LENGTH, api_key="s3cret",
                     metrics_api_key=True)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        assert_error(client.get("/metrics"), 401, "invalid_api_key")
        assert "dflash_http_requests_total" in client.get("/metrics", headers=ok).text
        assert client.get("/health").status_code == 200


def test_unexpected_error_is_500_counted_and_the_server_keeps_serving(tokenizer):
    """A bug in a handler (here the tokenizer raising) answers 500 with an OpenAI error body, shows in
    the request metrics, and the next request is served."""

    class Flaky:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode(self, text, **kwargs):
            if text == "boom":
                raise RuntimeError("tokenizer bug")
            return tokenizer.encode(text, **kwargs)

    engine = FakeEngine(MODEL_VOCAB, token_range=(0, TOKENIZER_VOCAB))
    app = create_app(engine, Flaky(), model_name="tiny", max_length=MAX_LENGTH, vocab_size=MODEL_VOCAB)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        err = assert_error(client.post("/v1/completions", json={"prompt": "boom"}), 500, "internal_error")
        assert "tokenizer bug" in err["message"] and err["type"] == "server_error"
        assert client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 3}).status_code == 200
        assert 'endpoint="/v1/completions",status="500"} 1' in client.get("/metrics").text


def test_a_full_queue_refuses_a_request_whole_and_keeps_serving(tokenizer):
    """With ``max_waiting`` requests queued, a request of several prompts that does not fit is
    answered 503 before any of its prompts is queued: none of them runs, none holds a place, and a
    request that fits the queue's room is still taken and served."""
    engine = FakeEngine(MODEL_VOCAB, max_batch_size=1, max_length=MAX_LENGTH, token_range=(0, TOKENIZER_VOCAB))
    gated = GatedEngine(engine)
    gated.gate.clear()
    app = create_app(gated, tokenizer, model_name="tiny", max_length=MAX_LENGTH, max_waiting=2)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as client, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        def post(prompt):
            return pool.submit(httpx.post, srv.url + "/v1/completions",
                               json={"prompt": prompt, "max_tokens": 3, "return_token_ids": True}, timeout=60)

        def waiting() -> float:
            return metric_values(client)['dflash_requests_waiting{model="tiny"}']

        try:
            running = post([1, 2])  # taken by the worker, which waits at the gate in its prefill
            assert gated.entered.wait(10)
            queued = post([3, 4])
            deadline = time.monotonic() + 10
            while waiting() < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            err = assert_error(client.post("/v1/completions", json={"prompt": [[5, 6], [7, 8]], "max_tokens": 3}),
                               503, "server_overloaded")
            assert "room for 1 more, not 2" in err["message"]
            assert waiting() == 1  # the refused request's prompts left nothing behind
            fits = post([9, 10])  # the queue's last place
            while waiting() < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            gated.gate.set()  # also when an assertion failed: the server must stop
        for future, prompt in ((running, [1, 2]), (queued, [3, 4]), (fits, [9, 10])):
            r = future.result()
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == engine.reference(prompt, 3)
        ran = [list(prompt) for group in engine.prefills for prompt in group]
        assert [1, 2] in ran and [5, 6] not in ran and [7, 8] not in ran  # the refused prompts never ran
        assert client.post("/v1/completions", json={"prompt": [[5, 6], [7, 8]], "max_tokens": 3}).status_code == 200


def test_scheduler_admits_requests_at_host_syncs_and_drains():
    from dflash_jax.serving.scheduler import Scheduler, SchedulerClosed

    engine = FakeEngine(100, max_batch_size=3, step_time_s=0.01)
    gated = GatedEngine(engine)
    events: dict[int, list] = {}

    def sink_for(i):
        return lambda kind, payload: events.setdefault(i, []).append((kind, payload))

    sched = Scheduler(gated).start()
    # A lone request is run at once (it never waits for company that will not come).
    t0 = time.monotonic()
    sched.submit([1, 2], 3, sink_for(0))
    while not events.get(0) or events[0][-1][0] != "done":
        time.sleep(0.005)
        assert time.monotonic() - t0 < 10
    # While request 1 runs, the others queue; the next host sync admits as many as there are free
    # rows (two), whatever their stop tokens, and the rest take rows as they free up.
    gated.gate.clear()
    gated.entered.clear()
    sched.submit([1, 2], 20, sink_for(1))
    assert gated.entered.wait(10)
    for i in range(2, 6):
        sched.submit([i, i + 1], 20, sink_for(i), stop_token_ids=[7] if i == 2 else None)
    gated.gate.set()
    sched.close(drain=True)  # finishes everything queued
    assert not sched.alive
    with pytest.raises(SchedulerClosed):
        sched.submit([1], 1, sink_for(9))
    for i in range(6):
        kinds = [k for k, _ in events[i]]
        assert kinds[-1] == "done" and set(kinds[:-1]) <= {"tokens"}
        streamed = [t for k, p in events[i] if k == "tokens" for t in p]
        assert streamed == events[i][-1][1].output_ids
    assert events[2][-1][1].output_ids == engine.reference([2, 3], 20, [7])
    assert events[3][-1][1].output_ids == engine.reference([3, 4], 20)
    assert sched.admissions[:3] == [1, 1, 2] and max(sched.admissions) <= 3 and sum(sched.admissions) == 6
    assert [[2, 3], [3, 4]] in engine.prefills  # different stop tokens, one prefill
    # batch_wait_s: an idle engine waits a little for more requests to share its first prefill.
    engine2 = FakeEngine(100, max_batch_size=4)
    sched2 = Scheduler(engine2, batch_wait_s=0.3).start()
    for i in range(3):
        sched2.submit([i + 1], 2, lambda kind, payload: None)
    sched2.close()
    assert sched2.admissions == [3]


def test_graceful_shutdown_finishes_requests_in_flight(tokenizer):
    engine = FakeEngine(MODEL_VOCAB, max_batch_size=2, max_length=MAX_LENGTH, block_size=2, steps_per_sync=1,
                        step_time_s=0.02, token_range=(0, TOKENIZER_VOCAB))
    app = create_app(engine, tokenizer, model_name="tiny", max_length=MAX_LENGTH)
    srv = ServerThread(app).start()
    scheduler = app.state.ctx.scheduler
    results: dict[str, object] = {}
    started = threading.Event()

    def streaming():
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": [10, 11], "max_tokens": 40, "stream": True,
                                                           "ignore_eos": True, "return_token_ids": True}) as r:
                started.set()
                results["stream"] = sse_events(r)

    def plain():
        started.wait(30)
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            results["plain"] = c.post("/v1/completions", json={"prompt": [20, 21], "max_tokens": 30,
                                                               "ignore_eos": True}).json()

    threads = [threading.Thread(target=streaming), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    assert started.wait(30)
    deadline = time.monotonic() + 30
    while scheduler.submitted < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.submitted == 2
    srv.stop()  # what SIGTERM does: stop accepting, finish requests in flight, then drain the scheduler
    for t in threads:
        t.join(60)
    texts, ids, finish = join_stream(results["stream"], chat=False)
    assert ids[0] == engine.reference([10, 11], 40) and finish[0] == "length"
    assert results["plain"]["usage"]["completion_tokens"] == 30
    assert scheduler.closing and not scheduler.alive
    with pytest.raises(httpx.TransportError):
        httpx.get(srv.url + "/health", timeout=2)


def test_short_request_joins_a_running_one_and_finishes_first(tokenizer):
    """A request that arrives while another decodes is admitted at the next host sync: it streams
    and finishes while the long one is still running."""
    engine = FakeEngine(MODEL_VOCAB, max_batch_size=2, max_length=MAX_LENGTH, block_size=2, steps_per_sync=1,
                        step_time_s=0.01, token_range=(0, TOKENIZER_VOCAB))
    app = create_app(engine, tokenizer, model_name="tiny", max_length=MAX_LENGTH)
    finished: list[str] = []
    long_events: list[dict] = []
    first_tokens = threading.Event()

    def run_long():
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": [10, 11], "max_tokens": 60, "stream": True,
                                                           "ignore_eos": True, "return_token_ids": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        long_events.append(json.loads(line[len("data: "):]))
                        first_tokens.set()
                finished.append("long")

    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        long = threading.Thread(target=run_long)
        long.start()
        assert first_tokens.wait(30)
        events = stream(client, "/v1/completions", {"prompt": [20, 21], "max_tokens": 4, "ignore_eos": True,
                                                    "return_token_ids": True})
        finished.append("short")
        long.join(60)
        assert finished == ["short", "long"]
        _, ids, _ = join_stream(events, chat=False)
        assert ids[0] == engine.reference([20, 21], 4)
        assert sum(1 for e in events[:-1] if e["choices"][0].get("token_ids")) >= 2  # streamed, not at the end
        assert [t for e in long_events for t in e["choices"][0].get("token_ids") or []] == \
            engine.reference([10, 11], 60)
        assert metric_values(client)['dflash_requests_finished_total{model="tiny",finish_reason="length"}'] == 2


@pytest.mark.parametrize("stream", [True, False])
def test_disconnected_client_frees_its_row(tokenizer, stream):
    """A client that goes away before its answer, streamed or not, cancels its request: its row is
    released on the engine and the next request takes it at once instead of waiting for the
    abandoned generation (Starlette watches for a disconnect only while it streams)."""
    engine = FakeEngine(MODEL_VOCAB, max_batch_size=1, max_length=MAX_LENGTH, block_size=1, steps_per_sync=1,
                        step_time_s=0.05, draft=False, token_range=(0, TOKENIZER_VOCAB))
    app = create_app(engine, tokenizer, model_name="tiny", max_length=MAX_LENGTH)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        body = {"prompt": [10, 11], "max_tokens": 60, "ignore_eos": True, "stream": stream}  # 60 steps of 50 ms
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as r:
                next(line for line in r.iter_lines() if line.startswith("data: {"))
        else:
            with pytest.raises(httpx.ReadTimeout):  # httpx closes the connection: the client is gone
                httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
        t0 = time.monotonic()
        r = client.post("/v1/completions", json={"prompt": [20, 21], "max_tokens": 3, "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == engine.reference([20, 21], 3)
        assert time.monotonic() - t0 < 2.5
        assert engine.released == [0]
        metrics = metric_values(client)
        assert metrics['dflash_requests_cancelled_total{model="tiny"}'] == 1
        assert metrics['dflash_requests_running{model="tiny"}'] == 0
        assert metrics['dflash_requests_finished_total{model="tiny",finish_reason="length"}'] == 1
        if not stream:  # nobody reads the answer; its status is for the metrics
            assert metrics['dflash_http_requests_total{model="tiny",endpoint="/v1/completions",status="499"}'] == 1


def test_stop_checks_end_rows_on_the_host():
    """A stop check ends its row at the token it names: the result is cut there (acceptance lengths as
    at a stop token), the row is released at the next step and reused; a failing check fails its own
    request alone."""
    from dflash_jax.runtime.batcher import ContinuousBatcher, cut_acceptance
    from dflash_jax.serving.scheduler import Scheduler

    engine = FakeEngine(100, max_batch_size=2, max_length=64, block_size=4, steps_per_sync=2)

    def stop_after(n):
        seen = [0]

        def check(ids):
            if seen[0] + len(ids) >= n:
                return n - seen[0]
            seen[0] += len(ids)
            return None
        return check

    def broken(ids):
        raise RuntimeError("a broken stop check")

    prompts = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    full = ContinuousBatcher(engine)
    alone = [full.submit(p, 20) for p in prompts]
    full.run()
    batcher = ContinuousBatcher(engine)
    engine.released.clear()
    stops = [1, 7, None, 13, "broken"]
    gens = [batcher.submit(p, 20, stop_check=broken if n == "broken" else None if n is None else stop_after(n))
            for p, n in zip(prompts, stops)]
    batcher.run()
    for g, a, n in zip(gens, alone, stops):
        if n == "broken":
            assert isinstance(g.error, RuntimeError) and g.result is None
            continue
        if n is None:
            assert g.result.output_ids == a.result.output_ids and g.result.finish_reason == "length"
            continue
        res = g.result
        assert res.output_ids == a.result.output_ids[:n] and res.finish_reason == "stop"
        assert res.acceptance_lengths == cut_acceptance(a.result.acceptance_lengths, n - 1)
        assert res.num_steps == len(res.acceptance_lengths)
    assert len(engine.released) == 4  # the rows of the three stopped requests and the failed one
    assert batcher.idle and batcher.running == 0
    with pytest.raises(ValueError, match="stop_checks has 1 entries for 2 prompts"):
        Scheduler(engine).submit_all([([1, 2], 4, lambda *a: None)] * 2, stop_checks=[None])


def test_adaptive_steps_grow_while_the_device_idles_and_shrink_when_the_host_waits():
    """With max_steps_per_sync, a call that is done when the next is dispatched (always, for the
    host-only FakeEngine) doubles the steps of the next, up to the cap; a host that waited on the
    device for over 60% of a sync period halves them, down to steps_per_sync. The tokens stay each
    request's own."""
    import dataclasses

    from dflash_jax.runtime.batcher import ContinuousBatcher

    engine = FakeEngine(100, max_batch_size=2, max_length=64, block_size=4, steps_per_sync=2)
    steps = []
    decode = engine.decode

    def spy(state, n_steps=None, *, window=None):
        steps.append(n_steps)
        # The window covers every live row's reach in this call (a block per step).
        live = ~state.done
        reach = np.minimum(state.starts + n_steps * engine.block_size, state.max_lens - 2 + engine.block_size)
        assert window >= reach[live].max(initial=0)
        return decode(state, n_steps, window=window)

    engine.decode = spy
    fixed = ContinuousBatcher(engine)
    gens = [fixed.submit(p, 40) for p in ([1, 2], [3, 4], [5, 6])]
    fixed.run()
    assert set(steps) == {2}
    want = [g.result.output_ids for g in gens]

    engine.config = dataclasses.replace(engine.config, max_steps_per_sync=16)
    steps.clear()
    adaptive = ContinuousBatcher(engine)
    gens = [adaptive.submit(p, 40) for p in ([1, 2], [3, 4], [5, 6])]
    adaptive.run()
    assert [g.result.output_ids for g in gens] == want
    assert steps[:5] == [2, 4, 8, 16, 16]
    # From the cap: the run's last calls may have halved it already on a loaded machine (real waits).
    adaptive.steps_per_call = 16
    adaptive._adapt_steps(waited=0.7, period=1.0)
    assert adaptive.steps_per_call == 8
    adaptive._adapt_steps(waited=0.5, period=1.0)  # busy for half a call: a halved call would starve
    assert adaptive.steps_per_call == 8
    for _ in range(3):
        adaptive._adapt_steps(waited=0.9, period=1.0)
    assert adaptive.steps_per_call == 2


# ----------------------------------------------------------------------------------------- real engine


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    tok, target, engine = tf.tiny_engine_with_tokenizer(
        tmp_path_factory.mktemp("tiny"), model_vocab_size=MODEL_VOCAB, tokenizer_vocab_size=TOKENIZER_VOCAB,
        max_batch_size=2, max_length=MAX_LENGTH, prompt_buckets=(32,), steps_per_sync=2)
    prompts = {
        "hello": tok.encode("Hello, world"),
        "fox": tok.encode("The quick brown fox"),
        "ids": [10, 11, 12, 13],
        "chat": tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]),
        "chat2": tok.apply_chat_template([{"role": "user", "content": "Hi!"}]),
    }
    # Each prompt alone, before the server shares the engine (the same shapes as batch-1 requests).
    alone = {k: engine.generate([p], MAX_TOKENS, tok.stop_token_ids)[0] for k, p in prompts.items()}
    gated = GatedEngine(engine)
    app = create_app(gated, tok, model_name="tiny-qwen3", max_length=MAX_LENGTH, vocab_size=target.config.vocab_size)
    app.state.gated = gated
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=300) as client:
        yield tok, prompts, alone, client, srv, app


MAX_TOKENS = 12  # one max_tokens everywhere: one compiled program per batch size


@pytest.mark.slow
def test_real_engine_completion_and_chat(real):
    tok, prompts, alone, client, _, _ = real
    r = client.post("/v1/completions", json={"prompt": "Hello, world", "max_tokens": MAX_TOKENS,
                                             "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["token_ids"] == alone["hello"].output_ids
    assert body["choices"][0]["text"] == tok.decode(alone["hello"].output_ids)
    assert body["choices"][0]["finish_reason"] == alone["hello"].finish_reason
    assert body["usage"]["prompt_tokens"] == len(prompts["hello"])
    assert body["dflash"][0]["acceptance_lengths"] == alone["hello"].acceptance_lengths
    assert 1 <= body["dflash"][0]["tau"] <= 8

    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "What is 2+2?"}],
                                                  "max_tokens": MAX_TOKENS, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == prompts["chat"]
    assert r.json()["choices"][0]["token_ids"] == alone["chat"].output_ids
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(alone["chat"].output_ids)


def test_real_engine_streaming(real):
    tok, prompts, alone, client, _, _ = real
    events = stream(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}],
                                                     "max_tokens": MAX_TOKENS, "return_token_ids": True})
    texts, ids, finish = join_stream(events, chat=True)
    assert ids[0] == alone["chat2"].output_ids
    assert texts[0] == tok.decode(alone["chat2"].output_ids)
    assert finish[0] == alone["chat2"].finish_reason
    assert sum(1 for e in events[1:-1] if e["choices"] and e["choices"][0].get("token_ids")) >= 2  # streamed
    events = stream(client, "/v1/completions", {"prompt": prompts["ids"], "max_tokens": MAX_TOKENS,
                                                "return_token_ids": True})
    texts, ids, _ = join_stream(events, chat=False)
    assert ids[0] == alone["ids"].output_ids and texts[0] == tok.decode(alone["ids"].output_ids)


def test_real_engine_stop_strings(real):
    """Stop strings on the real engine: the tokens and acceptance lengths of the request alone, cut at
    the token that completes the stop string, streamed or not."""
    from dflash_jax.runtime.batcher import cut_acceptance

    tok, prompts, alone, client, _, _ = real
    out = alone["hello"].output_ids
    text = tok.decode(out)
    stop = next(text[at: at + 3] for at in range(len(text) // 3, len(text) - 3)
                if text[at: at + 3].strip() and "\ufffd" not in text[at: at + 3])
    kept, want, _ = tf.stop_string_reference(tok, out, [stop])
    assert kept < len(out)
    body = {"prompt": "Hello, world", "max_tokens": MAX_TOKENS, "stop": stop, "return_token_ids": True}
    r = client.post("/v1/completions", json=body)
    (choice,) = r.json()["choices"]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (want, out[:kept], "stop")
    assert r.json()["dflash"][0]["acceptance_lengths"] == cut_acceptance(alone["hello"].acceptance_lengths, kept - 1)
    texts, ids, finish = join_stream(stream(client, "/v1/completions", body), chat=False)
    assert (texts[0], ids[0], finish[0]) == (want, out[:kept], "stop")


@pytest.mark.slow
def test_real_engine_concurrent_requests(real):
    tok, prompts, alone, client, srv, app = real
    order = ["hello", "fox", "ids", "hello", "fox", "ids"]
    before = len(app.state.ctx.scheduler.admissions)
    answers = run_concurrently(srv, [{"prompt": prompts[k], "max_tokens": MAX_TOKENS, "return_token_ids": True}
                                     for k in order])
    for k, a in zip(order, answers):
        assert a["choices"][0]["token_ids"] == alone[k].output_ids, k
    admitted = app.state.ctx.scheduler.admissions[before:]
    # The first alone, then one at each host sync where a row freed (max_batch_size is 2): each
    # request joined rows already decoding and still got exactly its answer alone.
    assert admitted[0] == 1 and max(admitted) <= 2 and sum(admitted) == len(order)


def test_real_engine_bad_input_then_good(real):
    tok, prompts, alone, client, _, _ = real
    assert_error(client.post("/v1/completions", json={"prompt": "word " * 100}), 400, "context_length_exceeded")
    assert_error(client.post("/v1/completions", json={"prompt": [MODEL_VOCAB + 5]}), 400, "invalid_token_id")
    assert_error(client.post("/v1/chat/completions", json={"messages": GOOD_MSG, "temperature": 5}), 400,
                 "invalid_value", "temperature")
    r = client.post("/v1/completions", json={"prompt": prompts["ids"], "max_tokens": MAX_TOKENS,
                                             "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == alone["ids"].output_ids
    assert "dflash_draft_steps_total" in client.get("/metrics").text


def test_real_engine_prompt_over_the_largest_bucket_is_400(real):
    """A prompt that fits the maximum length but not the engine's largest prompt bucket (32 here) is
    refused up front, naming the limit: it reached the prefill, which raised (a 500, and a prefill
    fails every request admitted with it)."""
    tok, prompts, alone, client, srv, app = real
    long_prompt = list(range(10, 50))  # 40 tokens: < MAX_LENGTH (64), > the bucket (32)
    failed = app.state.ctx.metrics.requests_failed
    assert_error(client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 4}), 400,
                 "context_length_exceeded", "prompt", "32")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 30}],
                                                          "max_tokens": 4}), 400, "context_length_exceeded", "messages")
    assert app.state.ctx.metrics.requests_failed == failed  # nothing reached the engine
    r = client.post("/v1/completions", json={"prompt": prompts["ids"], "max_tokens": MAX_TOKENS,
                                             "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == alone["ids"].output_ids
