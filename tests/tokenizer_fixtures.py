"""Tiny HF tokenizer directories for tests (no hub): a byte-level BPE trained here on local text.

- ``write_qwen_tokenizer(dir)``: Qwen2/Qwen3 pipeline (NFC, Qwen's split regex, byte-level), special
  tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (plus ``<think>``/``</think>`` as plain added
  tokens), a Qwen3-style chat template (system/user/assistant/tool roles, ``<think>`` handling,
  ``enable_thinking``), eos ``<|im_end|>`` and generation_config eos ids ``[<|im_end|>, <|endoftext|>]``.
- ``write_llama3_tokenizer(dir)``: Llama-3 style (``<|begin_of_text|>`` added by tokenizer.json's
  TemplateProcessing post-processor, header/eot tokens, a template using ``bos_token``,
  ``strftime_now`` and ``raise_exception``).
- ``write_metaspace_tokenizer(dir)``: SentencePiece-like (Metaspace) BPE with ``add_bos_token: true``
  and no post-processor in tokenizer.json, AddedToken dicts for the special tokens, and a list of named
  chat templates.

Every writer takes ``vocab_size`` (the total number of ids, special tokens included; at least ~300, the
byte alphabet plus special tokens) so the tokenizer fits a tiny model's embedding table, and returns the
directory. ``write_tiny_models_with_tokenizer(dir)`` writes a tiny target + drafter (``dflash_jax.tiny``)
with a Qwen tokenizer in the target directory. ``write_wordpiece_cleanup_tokenizer(dir)`` is a
WordPiece tokenizer whose decode cleans up spaces. ``stop_string_reference`` is where stop strings end
a generation, by brute force.
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA3_CHAT_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'user' or message.role == 'assistant') %}
        {{- raise_exception('Only user and assistant roles are supported after the system message, got ' + message.role) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

# Mistral-ish templates, as a list of named templates (the "default" one is used).
METASPACE_CHAT_TEMPLATES = [
    {
        "name": "default",
        "template": "{{ bos_token }}{% for message in messages %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
        "{% else %}{{ raise_exception('unsupported role ' + message['role']) }}{% endif %}{% endfor %}",
    },
    {
        "name": "plain",
        "template": "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}",
    },
]

_TEXT = """\
DFlash drafts a whole block of tokens in one forward pass, conditioned on the hidden states of the
target model. The target verifies the block and keeps the longest accepted prefix plus one bonus
token. Speculative decoding is lossless under greedy decoding: the output equals the target's own.
Hello, world! How are you today? I'm fine, thanks; and you? We'll see what the numbers say.
The quick brown fox jumps over the lazy dog. 0123456789 3.14159 2.71828 1e-6 42 7 13
def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n
Ünïcödé: café, naïve, Straße, 東京, 北京, Привет, مرحبا, 🙂🚀 — emoji and accents survive byte-level BPE.
Question: what is 12 * 7? Answer: 12 * 7 = 84. Question: what is 9 + 10? Answer: 19.
"""


def _corpus() -> list[str]:
    import inspect
    import json as _json
    import textwrap

    texts = [_TEXT] * 4
    for module in (_json, textwrap):
        texts.append(inspect.getsource(module))
    return texts


def _train_bpe(pre_tokenizer, decoder, normalizer, special: list[str], vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    n_base = vocab_size - len(special)
    trainer = trainers.BpeTrainer(
        vocab_size=n_base,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer)
    if tok.get_vocab_size() > n_base:
        raise ValueError(f"the byte alphabet alone needs {tok.get_vocab_size()} ids; vocab_size is {vocab_size}")
    return tok, AddedToken


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_qwen_tokenizer(directory, vocab_size: int = 512, chat_template: str = QWEN3_CHAT_TEMPLATE) -> Path:
    """A Qwen3-style tokenizer (see the module docstring). Returns ``directory``."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    plain_added = ["<think>", "</think>"]
    tok, AddedToken = _train_bpe(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        decoders.ByteLevel(),
        normalizers.NFC(),
        special + plain_added,
        vocab_size,
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Pad the base vocabulary so the added tokens land on the last ids, as in Qwen checkpoints.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_added])
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in special + plain_added}
    added_decoder = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in special,
        }
        for t in special + plain_added
    }
    _write_json(
        directory / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": added_decoder,
            "bos_token": None,
            "chat_template": chat_template,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]},
    )
    return directory


def write_llama3_tokenizer(directory, vocab_size: int = 512) -> Path:
    """A Llama-3-style tokenizer (see the module docstring). Returns ``directory``."""
    from tokenizers import Regex, decoders, pre_tokenizers, processors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    llama3_regex = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok, AddedToken = _train_bpe(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(llama3_regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        ),
        decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True),
        None,
        special,
        vocab_size,
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    bos_id = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos_id)],
            ),
        ]
    )
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in special}
    _write_json(
        directory / "tokenizer_config.json",
        {
            "bos_token": "<|begin_of_text|>",
            "chat_template": LLAMA3_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": True,
            "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]},
    )
    _write_json(
        directory / "config.json",
        {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids["<|end_of_text|>"]},
    )
    return directory


def write_metaspace_tokenizer(directory, vocab_size: int = 512) -> Path:
    """A SentencePiece-like tokenizer with ``add_bos_token`` (see the module docstring)."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    special = ["<unk>", "<s>", "</s>"]
    tok, AddedToken = _train_bpe(
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False),
        decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False),
        normalizers.NFKC(),
        special,
        vocab_size,
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(directory / "tokenizer.json"))

    def added(content):
        return {
            "__type": "AddedToken",
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        }

    _write_json(
        directory / "tokenizer_config.json",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": added("<s>"),
            "chat_template": METASPACE_CHAT_TEMPLATES,
            "clean_up_tokenization_spaces": False,
            "eos_token": added("</s>"),
            "unk_token": added("<unk>"),
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    return directory


def write_tiny_models_with_tokenizer(directory, *, model_vocab_size: int = 520, tokenizer_vocab_size: int = 512,
                                     **tiny_kwargs) -> tuple[Path, Path]:
    """``dflash_jax.tiny.write_tiny_pair`` with a model vocabulary that fits a Qwen-style tokenizer, which is
    written into the target directory (the model's table is larger than the tokenizer, as in Qwen checkpoints).
    The target has 2 layers unless ``target_overrides`` says otherwise (the serving tests compile every
    program the engine runs, each of which holds every layer, and every layer runs alike), each tapped by
    the drafter (``dflash_jax.tiny.tiny_taps``). Returns ``(target_dir, drafter_dir)``."""
    from dflash_jax.tiny import write_tiny_pair

    overrides = {"vocab_size": model_vocab_size, "num_layers": 2, **tiny_kwargs.pop("target_overrides", {})}
    target_dir, drafter_dir = write_tiny_pair(directory, target_overrides=overrides, **tiny_kwargs)
    write_qwen_tokenizer(target_dir, vocab_size=tokenizer_vocab_size)
    return Path(target_dir), Path(drafter_dir)


def tiny_engine_with_tokenizer(directory, *, model_vocab_size: int = 520, tokenizer_vocab_size: int = 512,
                               **engine_config):
    """``write_tiny_models_with_tokenizer``'s pair loaded into an ``Engine`` of ``engine_config``
    (``EngineConfig`` fields). Returns ``(tokenizer, target, engine)``."""
    from dflash_jax.io.checkpoint import load_drafter, load_target
    from dflash_jax.io.tokenizer import Tokenizer
    from dflash_jax.runtime.engine import Engine, EngineConfig

    target_dir, drafter_dir = write_tiny_models_with_tokenizer(
        directory, model_vocab_size=model_vocab_size, tokenizer_vocab_size=tokenizer_vocab_size)
    target = load_target(target_dir)
    return Tokenizer(target_dir), target, Engine(target, load_drafter(drafter_dir), EngineConfig(**engine_config))


def write_wordpiece_cleanup_tokenizer(directory) -> Path:
    """A tiny WordPiece tokenizer with ``clean_up_tokenization_spaces`` (BERT-era: its decode joins
    tokens with spaces, then the cleanup removes those before punctuation and contractions)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "a": 1, "'": 2, "b": 3, ".": 4, "n't": 5, "do": 6, "s": 7, "?": 8, "go": 9, ",": 10,
             "##es": 11, "m": 12, "ve": 13}
    tok = HFTokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", {"clean_up_tokenization_spaces": True})
    return directory


def write_byte_fallback_tokenizer(directory) -> Path:
    """A tiny SentencePiece-style BPE with byte fallback (Llama 2's decoder): a character outside the
    vocabulary is spelled as byte tokens ``<0xE4><0xB8><0xAD>``, and a run of them that is not valid
    UTF-8 decodes to one U+FFFD per byte."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for word in ["▁hello", "▁world", "▁a", "b", "▁", "x"]:
        vocab[word] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                                      "clean_up_tokenization_spaces": False})
    return directory


def stop_string_reference(tokenizer, ids: list[int], stops: list[str]) -> tuple[int, str, str | None]:
    """(ids kept, text, the stop string) of a generation of ``ids`` with ``stops``: the first prefix of
    the ids whose decode (less an incomplete last character) holds a stop string, its text cut before
    it (all of them and their text if none does)."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k]).rstrip("\ufffd")  # an incomplete character: not out yet
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            at, stop = min(hits)
            return k, text[:at], stop
    return len(ids), tokenizer.decode(ids), None
