"""dflash_jax.io.tokenizer against transformers' AutoTokenizer on tiny tokenizers built in tests/tokenizer_fixtures."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import tokenizer_fixtures as tf

from dflash_jax.io.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    " leading space and trailing space ",
    "café naïve Straße 東京 🙂🚀 — done",
    "def add(a, b):\n    return a + b\n\n\n",
    "<|im_start|>user\nhi<|im_end|> <|endoftext|><s></s><|eot_id|>",
    "",
    "12 * 7 = 84; 3.14159",
    "a\n\n\nb  c\t\td",
]

WRITERS = {
    "qwen": tf.write_qwen_tokenizer,
    "llama3": tf.write_llama3_tokenizer,
    "metaspace": tf.write_metaspace_tokenizer,
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: writer(root / name) for name, writer in WRITERS.items()}


@pytest.fixture(scope="module")
def pair(dirs):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = (Tokenizer(dirs[name]), transformers.AutoTokenizer.from_pretrained(str(dirs[name])))
        return cache[name]

    return get


def _hf_chat_ids(hf, messages, **kwargs):
    ids = hf.apply_chat_template(messages, add_generation_prompt=kwargs.pop("add_generation_prompt", True),
                                 tokenize=True, **kwargs)
    if not isinstance(ids, list):  # a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_encode_decode_equal_transformers(pair, name):
    ours, hf = pair(name)
    assert ours.vocab_size == len(hf)
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == hf.encode(text, add_special_tokens=add_special), (name, text, add_special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (
                    name, text, skip)
    # Arbitrary id sequences (not produced by encode) decode identically too.
    ids = list(range(0, ours.vocab_size, 7))
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.encode_batch(TEXTS[:3]) == [hf.encode(t) for t in TEXTS[:3]]


def test_llama3_encode_adds_bos_through_post_processor(pair):
    ours, _ = pair("llama3")
    ids = ours.encode("hi")
    assert ids[0] == ours.bos_token_id == ours.token_to_id("<|begin_of_text|>")
    assert ours.encode("hi", add_special_tokens=False) == ids[1:]


QWEN_CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3? café 🙂"},
    ],
    [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": "<20°C> & dry"}'},
    ],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a <city> & its \"region\"",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.mark.parametrize("index", range(len(QWEN_CHATS)))
def test_qwen3_chat_template_equal_transformers(pair, index):
    ours, hf = pair("qwen")
    messages = QWEN_CHATS[index]
    kwargs = {"tools": TOOLS} if index == 3 else {}
    for add_generation_prompt in (True, False):
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        want = _hf_chat_ids(hf, messages, add_generation_prompt=add_generation_prompt, **kwargs)
        assert got == want
        text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                              **kwargs)
    # Template kwargs reach the template (Qwen3's enable_thinking).
    got = ours.apply_chat_template(messages, enable_thinking=False, **kwargs)
    assert got == _hf_chat_ids(hf, messages, enable_thinking=False, **kwargs)
    assert ours.decode(got, skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    if index == 3:  # our tojson does not escape HTML, like transformers'
        assert 'a <city> & its \\"region\\""' in ours.apply_chat_template(messages, tokenize=False, tools=TOOLS)


LLAMA_CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye 🙂"},
    ],
]


@pytest.mark.parametrize("index", range(len(LLAMA_CHATS)))
def test_llama3_chat_template_equal_transformers(pair, index):
    ours, hf = pair("llama3")
    messages = LLAMA_CHATS[index]
    got = ours.apply_chat_template(messages, date_string="26 Jul 2024")
    assert got == _hf_chat_ids(hf, messages, date_string="26 Jul 2024")
    assert got[0] == ours.bos_token_id and got[1] != ours.bos_token_id  # bos comes from the template, once
    # Without date_string the template calls strftime_now.
    assert ours.apply_chat_template(messages, tokenize=False) == hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)


def test_llama3_raise_exception(pair):
    ours, hf = pair("llama3")
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles are supported.*got tool"):
        ours.apply_chat_template(messages)
    with pytest.raises(Exception, match="Only user and assistant roles"):
        hf.apply_chat_template(messages)


def test_named_templates_and_added_token_dicts(pair):
    ours, hf = pair("metaspace")
    assert ours.bos_token == "<s>" and ours.eos_token == "</s>"  # AddedToken dicts
    assert ours.chat_template_names == ["default", "plain"]
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert ours.apply_chat_template(messages) == _hf_chat_ids(hf, messages)
    assert ours.apply_chat_template(messages, chat_template="plain", tokenize=False) == hf.apply_chat_template(
        messages, chat_template="plain", tokenize=False)
    assert ours.add_bos_token is True  # read, but (like transformers 5) tokenizer.json decides the ids


def test_stop_token_ids(pair):
    qwen, _ = pair("qwen")
    assert qwen.stop_token_ids == [qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")]
    assert qwen.eos_token_id == qwen.token_to_id("<|im_end|>")
    assert qwen.bos_token is None and qwen.pad_token == "<|endoftext|>"
    llama, _ = pair("llama3")
    assert set(llama.stop_token_ids) == {llama.token_to_id("<|end_of_text|>"), llama.token_to_id("<|eot_id|>")}
    meta, _ = pair("metaspace")
    assert meta.stop_token_ids == [meta.token_to_id("</s>")]  # no generation_config: the eos token


def test_chat_template_jinja_file_wins(tmp_path):
    d = tf.write_qwen_tokenizer(tmp_path / "q")
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    ours = Tokenizer(d)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == "[user]hi"
    assert ours.apply_chat_template(messages) == _hf_chat_ids(hf, messages)


@pytest.mark.parametrize("windowed", [True, False])
def test_incremental_detokenizer_joins_to_decode(pair, windowed):
    """Chunk by chunk, the deltas join to the whole decode, on a window of recent ids (or, for
    tokenizers that clean up spaces, every id)."""
    for name in sorted(WRITERS):
        ours, _ = pair(name)
        for text in TEXTS + ["".join(TEXTS) * 3]:
            ids = ours.encode(text, add_special_tokens=False)
            for step in (1, 2, 5):
                detok = IncrementalDetokenizer(ours)
                detok._windowed = windowed
                decoded: list[int] = []
                detok.tokenizer = SimpleNamespace(decode=lambda i, skip: decoded.append(len(i)) or ours.decode(i, skip))
                pieces = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
                pieces.append(detok.finish())
                assert "".join(pieces) == ours.decode(ids), (name, text, step)
                assert not any("\ufffd" in p for p in pieces) or "\ufffd" in ours.decode(ids)
                if windowed and len(ids) > 200:  # windows (longer only while a character is incomplete)
                    assert max(decoded) <= 8 * step + 24 < len(ids) // 4, (name, step, max(decoded), len(ids))


def test_incremental_detokenizer_over_undecodable_bytes(pair):
    """Random ids rich in lone UTF-8 lead, continuation and multi-byte pieces, special tokens and
    text, in random chunks: the deltas join to the whole decode, and a long run of undecodable
    bytes keeps the windows short (it grew one window without end: quadratic)."""
    rng = random.Random(7)
    for name in sorted(WRITERS):
        ours, _ = pair(name)
        vocab = ours.vocab_size
        pieces = {i: ours.decode([i], False) for i in range(vocab)}
        odd = [i for i, t in pieces.items() if "\ufffd" in t]  # byte pieces of multi-byte characters
        special = [i for i in range(vocab) if ours.decode([i], True) == "" and pieces[i]]
        plain = [i for i in range(vocab) if i not in odd and i not in special]
        runs = [[rng.choice(odd[:3] or plain)] * 300] * 2  # one lone byte, over and over
        for _ in range(12):
            runs.append([rng.choice(odd or plain) if rng.random() < 0.6 else
                         rng.choice(special or plain) if rng.random() < 0.2 else rng.choice(plain)
                         for _ in range(rng.randint(1, 120))])
        for ids in runs:
            for skip in (True, False):
                detok = IncrementalDetokenizer(ours, skip)
                decoded: list[int] = []
                detok.tokenizer = SimpleNamespace(decode=lambda i, sk: decoded.append(len(i)) or ours.decode(i, sk))
                out, at, steady = [], 0, rng.random() < 0.3  # chunks of one id, or of 1 to 9
                while at < len(ids):
                    step = 1 if steady else rng.randint(1, 9)
                    out.append(detok.add(ids[at: at + step]))
                    at += step
                out.append(detok.finish())
                assert "".join(out) == ours.decode(ids, skip), (name, skip, ids)
                if len(set(ids)) == 1 and odd:
                    assert max(decoded) <= 40, (name, max(decoded))


def test_incremental_detokenizer_with_byte_fallback(tmp_path):
    """Byte fallback spells a character as byte tokens and decodes an incomplete run to one U+FFFD per
    byte, all of which the next byte can complete: the whole trailing run waits (and the window with
    it), so characters spelled in bytes, in random chunks, join to the whole decode."""
    ours = Tokenizer(tf.write_byte_fallback_tokenizer(tmp_path / "bf"))
    assert ours.byte_fallback and not Tokenizer(tf.write_wordpiece_cleanup_tokenizer(tmp_path / "wp")).byte_fallback
    vocab = ours._tok.get_vocab()
    assert ours.decode([vocab["<0xE4>"], vocab["<0xB8>"]]) == "\ufffd\ufffd"
    rng = random.Random(3)
    words = [vocab[w] for w in ("▁hello", "▁world", "b", "x", "</s>")]
    for _ in range(200):
        ids: list[int] = []
        while len(ids) < 40:
            ids += ([vocab[f"<0x{b:02X}>"] for b in rng.choice("中é€😀").encode()] if rng.random() < 0.5
                    else [rng.choice(words)])
        for skip in (True, False):
            detok = IncrementalDetokenizer(ours, skip)
            out, at = [], 0
            while at < len(ids):
                step = rng.randint(1, 6)
                out.append(detok.add(ids[at: at + step]))
                at += step
            out.append(detok.finish())
            assert "".join(out) == ours.decode(ids, skip), ids
            assert not any("\ufffd" in piece for piece in out)


# --------------------------------------------------------------------------- errors name the file and field


def test_missing_directory_and_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer directory not found"):
        Tokenizer(tmp_path / "nope")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: file not found"):
        Tokenizer(tmp_path)


def test_malformed_files(tmp_path):
    d = tf.write_qwen_tokenizer(tmp_path / "q")
    cfg_path = d / "tokenizer_config.json"
    good = json.loads(cfg_path.read_text())

    cfg_path.write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: invalid JSON"):
        Tokenizer(d)

    cfg_path.write_text(json.dumps({**good, "eos_token": {"lstrip": False}}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: field 'eos_token'.*content"):
        Tokenizer(d)

    cfg_path.write_text(json.dumps({**good, "eos_token": 5}))
    with pytest.raises(TokenizerError, match=r"field 'eos_token'"):
        Tokenizer(d)

    cfg_path.write_text(json.dumps({**good, "chat_template": [{"name": "plain", "template": "x"}]}))
    with pytest.raises(TokenizerError, match="none is named 'default'"):
        Tokenizer(d).apply_chat_template([{"role": "user", "content": "hi"}])

    cfg_path.write_text(json.dumps({**good, "chat_template": [{"name": "default"}]}))
    with pytest.raises(TokenizerError, match=r"field 'chat_template'\[0\]"):
        Tokenizer(d)

    cfg_path.write_text(json.dumps({**good, "chat_template": 3}))
    with pytest.raises(TokenizerError, match=r"field 'chat_template'"):
        Tokenizer(d)

    cfg_path.write_text(json.dumps({**good, "chat_template": "{% for m in messages %}"}))
    with pytest.raises(TokenizerError, match="chat template syntax error"):
        Tokenizer(d).apply_chat_template([{"role": "user", "content": "hi"}])

    no_template = {k: v for k, v in good.items() if k != "chat_template"}
    cfg_path.write_text(json.dumps(no_template))
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(d).apply_chat_template([{"role": "user", "content": "hi"}])

    cfg_path.write_text(json.dumps(good))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerError, match=r"generation_config\.json: field 'eos_token_id'"):
        Tokenizer(d)

    (d / "generation_config.json").unlink()
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot load"):
        Tokenizer(d)


def test_empty_messages_rejected(pair):
    ours, _ = pair("qwen")
    with pytest.raises(ChatTemplateError, match="non-empty"):
        ours.apply_chat_template([])
