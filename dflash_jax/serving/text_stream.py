"""A generation's text as its tokens arrive, ended by stop strings (OpenAI's ``stop``).

Stop strings are matched in the decoded text, so they end generation wherever the tokenizer splits
them: inside one token, across several, or across the host syncs that deliver them. As in vLLM, the
text is cut before the first stop string found (it and everything after it are left out), while the
generation keeps the tokens through the one that completed the stop string.

``TextStream.add`` is the ``stop_check`` of ``dflash_jax.runtime.batcher.Generation``: the batcher hands it
each chunk of new token ids and, once a stop string is complete, ends the row after the id that
completed it. While the text ends with the beginning of a stop string (``"\\nd"`` of ``"\\ndef"``) that
tail is held back, so a stream never sends text that the stop string will remove.
"""

from __future__ import annotations

from typing import Any, Sequence

from dflash_jax.io.tokenizer import IncrementalDetokenizer, Tokenizer


MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1000  # a text's tail is compared with every prefix of every stop string


def parse_stop_strings(stop: Any, where: str = "stop") -> tuple[str, ...]:
    """``stop`` as OpenAI's requests give it: a string or a list of strings (None, "" and [] mean
    none). A TypeError or ValueError names the field ``where``."""
    if stop is None or stop == "":
        return ()
    if not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise TypeError(f"'{where}' must be a string or an array of strings")
    strings = [stop] if isinstance(stop, str) else stop
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"'{where}' has {len(strings)} strings; at most {MAX_STOP_STRINGS} are taken")
    for i, s in enumerate(strings):
        name = f"'{where}'" if isinstance(stop, str) else f"'{where}[{i}]'"
        if not s:
            raise ValueError(f"{name} is empty, which would end every generation at once")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"{name} has {len(s)} characters; at most {MAX_STOP_STRING_CHARS} are taken")
    return tuple(strings)


class TextStream:
    """Detokenizes one generation's ids (``IncrementalDetokenizer``) and finds its ``stop`` strings.

    ``add(ids)`` feeds ids and returns None, or how many of them to keep when a stop string ended the
    text; ``take()`` returns the text decoded since the last ``take`` that no stop string can remove;
    ``finish()`` returns the rest once the generation has ended. ``text`` is the whole text (cut at a
    stop string), ``stop_reason`` the stop string found (None if none), ``num_ids`` the ids kept.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), *, skip_special_tokens: bool = True):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r:.200}")
        self.stop = tuple(dict.fromkeys(stop))
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._text = ""         # decoded so far; cut before the stop string once one is found
        self._taken = 0         # characters of _text that take() returned
        self.stop_reason: str | None = None
        self.num_ids = 0

    @property
    def text(self) -> str:
        return self._text

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def add(self, ids: Sequence[int]) -> int | None:
        """Feeds ``ids``; returns None, or how many of them to keep (>= 1) if a stop string is now
        complete, whose text is then cut before it. Nothing may be added after a stop."""
        if self.stopped:
            raise RuntimeError("the text already ended at a stop string")
        if not self.stop:
            self._append(ids)
            return None
        mark, before, seen = self._detok.mark(), len(self._text), self.num_ids

        def holds(keep: int) -> bool:
            """Whether the text holds a stop string with the chunk's first ``keep`` ids, added from the
            chunk's own state, so decoded in the chunk's window."""
            self._detok.rewind(mark)
            self._text, self.num_ids = self._text[:before], seen
            self._append(ids[:keep])
            return self._find(before) is not None

        if not holds(len(ids)):
            return None
        # The id that completed it: the chunk's shortest prefix whose text holds a stop string, by
        # bisection (a longer prefix's text extends a shorter one's; once per generation). Trying
        # one prefix after another cost a 1,024-id chunk 0.6 s on the host.
        lo, hi = 0, len(ids)  # holds(hi); not holds(lo)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if holds(mid) else (mid, hi)
        holds(hi)
        self._cut_at_stop(before)
        return hi

    def take(self) -> str:
        """The text decoded since the last ``take`` that no stop string can remove (while a stop string
        may still begin in the text's tail, that tail waits)."""
        end = len(self._text) if self.stopped else len(self._text) - self._held_back()
        if end <= self._taken:
            return ""
        piece, self._taken = self._text[self._taken:end], end
        return piece

    def finish(self) -> str:
        """The rest of the text, once no more ids will come (the detokenizer's held-back bytes too)."""
        if not self.stopped:
            before = len(self._text)
            self._text += self._detok.finish()
            self._cut_at_stop(before)
        piece, self._taken = self._text[self._taken:], len(self._text)
        return piece

    # -- matching ----------------------------------------------------------------------------------

    def _append(self, ids: Sequence[int]) -> None:
        self._text += self._detok.add(ids)
        self.num_ids += len(ids)

    def _find(self, scanned: int) -> tuple[int, str] | None:
        """The first stop string in the text that ends after ``scanned`` characters: (its start, it)."""
        hits = [(at, s) for s in self.stop
                if (at := self._text.find(s, max(0, scanned - len(s) + 1))) >= 0]
        return min(hits, default=None, key=lambda hit: hit[0])

    def _cut_at_stop(self, scanned: int) -> bool:
        hit = self._find(scanned)
        if hit is None:
            return False
        at, self.stop_reason = hit
        self._text = self._text[:at]
        return True

    def _held_back(self) -> int:
        """Characters at the text's end that begin a stop string (the longest such tail)."""
        text, held = self._text, 0
        for s in self.stop:
            at = text.find(s[0], max(0, len(text) - len(s) + 1))
            while at >= 0 and len(text) - at > held:
                if s.startswith(text[at:]):
                    held = len(text) - at
                    break
                at = text.find(s[0], at + 1)
        return held


def finish_text(text: TextStream, result: Any) -> tuple[list[int], str, str]:
    """A generation's output ids, the text not yet taken and its finish reason, once its result
    (``GenerationResult``) is in.

    The result is authoritative: ids the text has not seen (all of them, where nothing streamed them
    through ``add``) are decoded now, and a stop string among them cuts the ids. A stop string that
    only the detokenizer's last held-back bytes complete ends the text, not the ids.
    """
    out = list(result.output_ids)
    if len(out) > text.num_ids and not text.stopped:
        if text.add(out[text.num_ids:]) is not None:
            out = out[:text.num_ids]
    rest = text.take() + text.finish()
    return out, rest, "stop" if text.stopped else result.finish_reason
