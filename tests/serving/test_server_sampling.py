"""Sampling through the HTTP server with the official ``openai`` client, on the real engine (a tiny random
Qwen3 target and DFlash drafter): seeded texts repeat and equal ``Engine.generate`` with the same
``SamplingParams``, ``n`` choices, logprobs in OpenAI's shapes (streamed too), ``echo``."""

from __future__ import annotations

import math

import httpx

import pytest
import tokenizer_fixtures as tf

from dflash_jax import SamplingParams
from dflash_jax.serving import ServerThread, create_app
from dflash_jax.serving.protocol import choice_seed

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # each sampling mix compiles its decode step (~2 min on 2 cores)

TOKENIZER_VOCAB = 512
MODEL_VOCAB = 520
MAX_LENGTH = 64
MAX_TOKENS = 10
HELLO = "Hello, world"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok, _, engine = tf.tiny_engine_with_tokenizer(
        tmp_path_factory.mktemp("tiny"), model_vocab_size=MODEL_VOCAB, tokenizer_vocab_size=TOKENIZER_VOCAB,
        max_batch_size=4, max_length=MAX_LENGTH, prompt_buckets=(32,), steps_per_sync=2)
    app = create_app(engine, tok, model_name="tiny", max_length=MAX_LENGTH, vocab_size=MODEL_VOCAB)
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        yield tok, engine, client


def test_seeded_completion_repeats_and_equals_the_engine(server):
    tok, engine, client = server
    ask = dict(model="tiny", prompt=HELLO, max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=7,
               extra_body={"top_k": 50, "return_token_ids": True})
    first, again = client.completions.create(**ask), client.completions.create(**ask)
    assert first.choices[0].text == again.choices[0].text
    want = engine.generate([tok.encode(HELLO)], MAX_TOKENS, tok.stop_token_ids,
                           sampling=SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7))[0]
    assert first.choices[0].model_extra["token_ids"] == want.output_ids
    other = client.completions.create(**{**ask, "seed": 8})
    assert other.choices[0].model_extra["token_ids"] != want.output_ids
    # Rejection sampling (the extension field ``verify``): the engine's own rejection-sampled text.
    rejection = client.completions.create(**{**ask, "extra_body": {**ask["extra_body"], "verify": "rejection"}})
    want = engine.generate([tok.encode(HELLO)], MAX_TOKENS, tok.stop_token_ids,
                           sampling=SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, verify="rejection"))[0]
    assert rejection.choices[0].model_extra["token_ids"] == want.output_ids


def test_n_choices_have_their_own_seeds(server):
    tok, engine, client = server
    prefilled = engine.prefilled_prompts
    r = client.completions.create(model="tiny", prompt=HELLO, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=3,
                                  extra_body={"return_token_ids": True})
    assert engine.prefilled_prompts - prefilled == 1  # the three choices share the prompt's prefill
    ids = [c.model_extra["token_ids"] for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len({tuple(i) for i in ids}) == 3
    solo = [engine.generate([tok.encode(HELLO)], MAX_TOKENS, tok.stop_token_ids,
                            sampling=SamplingParams(temperature=1.0, seed=choice_seed(3, j)))[0] for j in range(3)]
    assert ids == [w.output_ids for w in solo]
    assert r.usage.completion_tokens == sum(len(i) for i in ids)
    greedy = client.completions.create(model="tiny", prompt=HELLO, max_tokens=MAX_TOKENS, n=3,
                                       extra_body={"return_token_ids": True})
    assert len({tuple(c.model_extra["token_ids"]) for c in greedy.choices}) == 1
    metrics = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    assert f'dflash_prefill_prompts_total{{model="tiny"}} {engine.prefilled_prompts}' in metrics


def test_streamed_chat_choices_equal_the_unstreamed_ones(server):
    _, engine, client = server
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=MAX_TOKENS, temperature=1.0,
               top_p=0.95, seed=11, n=3)
    prefilled = engine.prefilled_prompts
    whole = client.chat.completions.create(**ask)
    assert engine.prefilled_prompts - prefilled == 1
    texts = [""] * 3
    for c in client.chat.completions.create(**ask, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in whole.choices] and len(set(texts)) > 1


def test_chat_logprobs_in_openais_shape_streamed_or_not(server):
    _, _, client = server
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=MAX_TOKENS, temperature=0.7,
               seed=5, logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    r = client.chat.completions.create(**ask)
    (choice,) = r.choices
    content = choice.logprobs.content
    assert len(content) == len(choice.model_extra["token_ids"])
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3 and isinstance(entry.bytes, list)
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == choice.message.content


def test_completion_logprobs_and_echo(server):
    tok, engine, client = server
    r = client.completions.create(model="tiny", prompt=HELLO, max_tokens=MAX_TOKENS, temperature=0.9, seed=1,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(d) <= 2 for d in lp.top_logprobs) and all(x <= 0 and math.isfinite(x) for x in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text
    echoed = client.completions.create(model="tiny", prompt=HELLO, max_tokens=MAX_TOKENS, temperature=0.9, seed=1,
                                       echo=True)
    assert echoed.choices[0].text == HELLO + r.choices[0].text
    streamed = client.completions.create(model="tiny", prompt=HELLO, max_tokens=MAX_TOKENS, temperature=0.9, seed=1,
                                         echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    # echo with logprobs: the prompt's own logprobs first (None for its first token), then the output's.
    both = client.completions.create(model="tiny", prompt=HELLO, max_tokens=MAX_TOKENS, temperature=0.9, seed=1,
                                     echo=True, logprobs=2)
    blp, n = both.choices[0].logprobs, len(tok.encode(HELLO))
    assert len(blp.tokens) == n + len(lp.tokens) and blp.token_logprobs[0] is None and blp.top_logprobs[0] is None
    assert blp.token_logprobs[n:] == pytest.approx(lp.token_logprobs, abs=1e-6)
    (want,) = engine.generate([tok.encode(HELLO)], 1, sampling=SamplingParams(prompt_logprobs=2))
    assert blp.token_logprobs[1:n] == pytest.approx(want.prompt_logprobs[1:], abs=1e-6)
    streamed = list(client.completions.create(model="tiny", prompt=HELLO, max_tokens=MAX_TOKENS, temperature=0.9,
                                              seed=1, echo=True, logprobs=2, stream=True))
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [x for p in pieces for x in p.token_logprobs] == pytest.approx(blp.token_logprobs, abs=1e-6)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == both.choices[0].text


def test_penalties_bias_and_bad_sampling_fields(server):
    tok, engine, client = server
    r = client.completions.create(model="tiny", prompt=HELLO, max_tokens=MAX_TOKENS, temperature=0.5, seed=2,
                                  presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"17": 100},
                                  extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 3,
                                              "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"][0] == 17  # +100 wins the draw
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=HELLO, temperature=3.0)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=HELLO, temperature=0.5, extra_body={"verify": "maybe"})
    assert err.value.body["param"] == "verify" and "exact, rejection" in err.value.body["message"]
