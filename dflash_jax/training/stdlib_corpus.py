"""The offline corpus of the embedded default: the running interpreter's standard-library sources split
into train and held-out files by path, a byte-level BPE tokenizer with ChatML role tokens and template,
and instruction-shaped chat examples ("write a function ..." -> its code) made from documented functions.

Used by ``dflash_jax.training.pretrain`` (the ``stdlib`` corpus) and ``dflash_jax.training.embedded_build``.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import shutil
import sysconfig
from pathlib import Path

EOS = "<|endoftext|>"
MASK = "<|mask|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # ChatML role markers
SPECIAL_TOKENS = (EOS, MASK, IM_START, IM_END)  # ids 0..3
# ChatML, as Qwen's instruct models write it (no system prompt unless the messages bring one).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SKIP_DIRS = {"test", "tests", "idlesave", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo",
             "__pycache__", "ensurepip", "config-3.11-x86_64-linux-gnu", "tkinter"}
# A file's split from the first byte of md5(its path relative to the stdlib root): < 26 (~10%) "heldout",
# the evaluation's; < 64 (~15%) "drafter", text the target never trains on, where the drafter's training
# prompts come from (a 17M-parameter target memorises its own training text, and a drafter trained on
# its recitations of it learns that text instead of how the target continues text it does not know);
# the rest "train", the target's.
HELDOUT_BYTE = 26
DRAFTER_BYTE = 64
SPLITS = ("train", "heldout", "drafter")
MAX_FILE_BYTES = 200_000  # skip generated giants (e.g. pydoc_data/topics.py)


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """The split ("train" | "heldout" | "drafter") of the stdlib file at ``relpath``."""
    byte = hashlib.md5(relpath.encode()).digest()[0]
    return "heldout" if byte < HELDOUT_BYTE else "drafter" if byte < DRAFTER_BYTE else "train"


def corpus_files(split: str, root: Path | None = None, max_files: int = 0) -> list[Path]:
    """The stdlib ``.py`` files of ``split`` ("train" | "heldout" | "drafter"), sorted by relative path
    (the first ``max_files`` only, when > 0)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("test") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
        except OSError:
            continue
        if split_of(rel.as_posix()) == split:
            out.append(path)
    return out[:max_files] if max_files else out


def read_text(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text.replace("\r\n", "\n")


def corpus_texts(split: str, max_files: int = 0) -> list[str]:
    return [t for t in (read_text(p) for p in corpus_files(split, max_files=max_files)) if t and t.strip()]


# ---------------------------------------------------------------------------------------------
# Instruction-shaped examples
# ---------------------------------------------------------------------------------------------

# How a user asks for a function; picked per function by a seeded RNG.
REQUEST_FORMS = (
    "Write a function `{sig}`. {doc}",
    "Write a Python function `{sig}` that does this: {doc}",
    "Implement `{sig}`.\n{doc}",
    "{doc} Write it as `{sig}`.",
)
MAX_ANSWER_CHARS = 2400  # longer functions are left out of the chat examples (windows are 512 tokens)


def _dedent(src: str) -> str:
    indent = len(src) - len(src.lstrip(" "))
    out = "\n".join(l[indent:] if l[:indent].strip() == "" else l for l in src.split("\n"))
    return out if out.endswith("\n") else out + "\n"


@functools.lru_cache(maxsize=4)  # parsed once per build, read by several stages
def documented_functions(split: str, max_files: int = 0) -> tuple[dict, ...]:
    """Every undecorated function of ``split``'s files that has a docstring: ``{"name", "signature",
    "doc" (the docstring's first line), "header" (def line through the docstring, dedented), "code" (the
    whole function, dedented), "source"}``, in file order."""
    found = []
    for path in corpus_files(split, max_files=max_files):
        text = read_text(path)
        if not text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
                continue
            first = node.body[0] if node.body else None
            if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                continue
            doc = first.value.value.strip().split("\n")[0].strip()
            if not doc:
                continue
            args = ast.unparse(node.args) if hasattr(ast, "unparse") else ""
            found.append({
                "name": node.name,
                "signature": f"{node.name}({args})",
                "doc": doc,
                "header": _dedent("".join(lines[node.lineno - 1: first.end_lineno])),
                "code": _dedent("".join(lines[node.lineno - 1: node.end_lineno])),
                "source": f"{path.name}:{node.lineno}",
            })
    return tuple(found)


def chat_request(fn: dict, rng: random.Random) -> str:
    """The user turn asking for ``fn``: its signature and its docstring's first line as the request."""
    doc = fn["doc"] if fn["doc"].endswith((".", "?", "!")) else fn["doc"] + "."
    return rng.choice(REQUEST_FORMS).format(sig=fn["signature"], doc=doc)


def instruction_texts(tokenizer, split: str, max_files: int = 0, seed: int = 0) -> list[str]:
    """Chat-formatted examples of ``split``, rendered with ``tokenizer``'s chat template: the user asks
    for a function (signature + the docstring's first line), the assistant answers with its code.
    Shuffled with ``seed``; functions longer than ``MAX_ANSWER_CHARS`` are left out."""
    rng = random.Random(seed)
    out = []
    for fn in documented_functions(split, max_files):
        if len(fn["code"]) > MAX_ANSWER_CHARS:
            continue
        messages = [{"role": "user", "content": chat_request(fn, rng)},
                    {"role": "assistant", "content": fn["code"].rstrip("\n")}]
        out.append(tokenizer.render_chat_template(messages, add_generation_prompt=False))
    rng.shuffle(out)
    return out


def mix_documents(code: list[str], chats: list[str], share: float, seed: int = 0) -> list[str]:
    """``code`` plus as many ``chats`` as make about ``share`` of the characters (all of them when they
    are fewer), in a seeded random order."""
    budget = share / (1.0 - share) * sum(map(len, code))
    picked, total = [], 0
    for text in chats:
        if total >= budget:
            break
        picked.append(text)
        total += len(text)
    docs = code + picked
    random.Random(seed).shuffle(docs)
    return docs


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(out_dir: str | Path, vocab_size: int = 8192, max_files: int = 0) -> Path:
    """Byte-level BPE on the train split -> ``tokenizer.json``, ``tokenizer_config.json`` (with the ChatML
    ``chat_template``) and ``generation_config.json`` (stop tokens ``<|endoftext|>`` and ``<|im_end|>``).

    Ids 0..3 are ``<|endoftext|>`` (EOS), ``<|mask|>`` (the drafter's mask token), ``<|im_start|>`` and
    ``<|im_end|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_texts("train", max_files), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "mask_token": MASK,
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "additional_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                          "normalized": False, "single_word": False}
            for t in SPECIAL_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    # A chat answer ends with <|im_end|>, a document with <|endoftext|>: both stop generation.
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[EOS], ids[IM_END]],
                                                            "pad_token_id": ids[EOS]}, indent=2))
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def copy_tokenizer(src: str | Path, dst: str | Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, Path(dst) / name)
