"""Stop strings in a streamed text (``dflash_jax.serving.text_stream``) against a brute-force reference
(``tokenizer_fixtures.stop_string_reference``): the first prefix of the ids whose whole decode holds
a stop string, cut before it."""

from __future__ import annotations

import random

import pytest
import tokenizer_fixtures as tf

from dflash_jax.runtime.batcher import cut_acceptance
from dflash_jax.serving.text_stream import TextStream
from dflash_jax.io.tokenizer import Tokenizer

TEXT = ("def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 1  # café naïve Straße 東京 🙂🚀\n"
        "Hello, world! 12 * 7 = 84; done.\n\ndef sub(a, b):\n    return a - b\n")
WRITERS = {"qwen": tf.write_qwen_tokenizer, "llama3": tf.write_llama3_tokenizer,
           "metaspace": tf.write_metaspace_tokenizer}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: Tokenizer(write(root / name)) for name, write in WRITERS.items()}


def run(tok: Tokenizer, ids: list[int], stops: list[str], chunk: int) -> tuple[int, str, str | None, list[str]]:
    """Feeds ``ids`` in chunks as the batcher would: (ids kept, text, stop string, the pieces taken)."""
    stream = TextStream(tok, stops)
    kept, pieces = 0, []
    for i in range(0, len(ids), chunk):
        part = ids[i: i + chunk]
        keep = stream.add(part)
        pieces.append(stream.take())
        kept += len(part) if keep is None else keep
        if keep is not None:
            break
    pieces.append(stream.finish())
    assert stream.num_ids == kept and stream.text == "".join(pieces)
    return kept, stream.text, stream.stop_reason, pieces


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_stop_strings_cut_where_the_reference_does(tokenizers, name):
    tok = tokenizers[name]
    ids = tok.encode(TEXT, add_special_tokens=False)
    full = tok.decode(ids)
    rng = random.Random(0)
    cases = [["\n\n"], ["\ndef"], ["東京"], ["🚀"], ["return a - b"], [" + b\n", "Point"], ["never there"],
             ["b"], ["Hello, world!"], [full[-3:]]]
    for _ in range(12):  # substrings anywhere, across token boundaries
        at, n = rng.randrange(len(full) - 8), rng.randrange(1, 8)
        cases.append([full[at: at + n]])
    for stops in cases:
        want = tf.stop_string_reference(tok, ids, stops)
        for chunk in (1, 3, 16):
            kept, text, stop, pieces = run(tok, ids, stops, chunk)
            assert (kept, text, stop) == want, (name, stops, chunk)
            # Nothing the stop string removes was ever sent: each piece is a piece of the final text.
            assert "".join(pieces) == want[1]


def test_a_tokenizer_that_cleans_up_spaces(tmp_path):
    """Its decode rewrites text across chunks (" '" then "b" becomes "'b"): a tail that may begin a
    cleanup pattern waits, so the pieces still join to the decode. A stop string is found in the
    text once it is stable: at the reference's token, or later where the cleanup rewrote the
    prefix's text ("s a '" is "s a've" one token on)."""
    tok = Tokenizer(tf.write_wordpiece_cleanup_tokenizer(tmp_path / "wp"))
    assert tok.cleans_up_spaces
    rng, differ = random.Random(0), 0
    for _ in range(200):
        ids = [rng.randrange(1, 14) for _ in range(rng.randrange(1, 12))]
        full = tok.decode(ids)
        for chunk in (1, 2, 5):
            assert run(tok, ids, [], chunk)[1] == full, (ids, chunk)
        at = rng.randrange(len(full))
        stops = [full[at: at + rng.randrange(1, 4)]] if full.strip() else ["never"]
        want = tf.stop_string_reference(tok, ids, stops)
        for chunk in (1, 3):
            kept, text, stop, _ = run(tok, ids, stops, chunk)
            # Never before the reference's token; later where the cleanup rewrote the prefix's text.
            assert kept >= want[0] and (kept, text, stop) == want or kept > want[0], (ids, stops, chunk)
            kept_text = tok.decode(ids[:kept])
            assert full.startswith(text) and (stop is None or kept_text[len(text):].startswith(stop)), (ids, stops)
            differ += (kept, text, stop) != want
    assert differ <= 40  # of 400 (16 when written): the cleanup seldom moves a stop


def test_the_tail_that_may_begin_a_stop_string_waits(tokenizers):
    tok = tokenizers["qwen"]
    stream = TextStream(tok, ["\ndef"])
    stream.add(tok.encode("x = 1\n", add_special_tokens=False))
    assert stream.take() == "x = 1"  # "\n" may begin "\ndef"
    stream.add(tok.encode("y", add_special_tokens=False))
    assert stream.take() == "\ny"
    stream.add(tok.encode("\nde", add_special_tokens=False))
    assert stream.take() == ""
    assert stream.finish() == "\nde" and stream.stop_reason is None  # the end releases it

    stream = TextStream(tok, ["\ndef"])
    ids = tok.encode("a\nde", add_special_tokens=False) + tok.encode("f b", add_special_tokens=False)
    assert stream.add(ids) is not None and stream.take() == "a" and stream.stop_reason == "\ndef"
    with pytest.raises(RuntimeError, match="already ended"):
        stream.add([1])


def test_without_stop_strings_the_pieces_join_to_decode(tokenizers):
    for tok in tokenizers.values():
        ids = tok.encode(TEXT, add_special_tokens=False)
        kept, text, stop, pieces = run(tok, ids, [], 5)
        assert (kept, text, stop) == (len(ids), tok.decode(ids), None)


def test_bad_stop_strings():
    with pytest.raises(ValueError, match="non-empty strings"):
        TextStream(None, ["a", ""])


def test_cut_acceptance():
    assert cut_acceptance([3, 4, 2], 5) == [3, 2]
    assert cut_acceptance([3, 4, 2], 9) == [3, 4, 2]
    assert cut_acceptance([3, 4, 2], 3) == [3]
    assert cut_acceptance([3, 4, 2], 0) == []
    with pytest.raises(ValueError, match="fewer than"):
        cut_acceptance([1, 1], 3)
