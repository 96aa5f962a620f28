"""A fake engine with the real ``Engine.generate`` interface, for server tests and HTTP-layer benchmarks.

``FakeEngine`` "generates" a deterministic function of the prompt: token ``t+1`` is a hash of the last
two tokens, committed in steps of 1..block_size tokens (so ``acceptance_lengths`` and tau look like
DFlash's), reported through ``on_tokens`` every ``steps_per_sync`` steps. Each row is independent of the
batch it runs in, so a request must get the same answer alone or batched.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable


@dataclasses.dataclass
class FakeResult:
    output_ids: list[int]
    acceptance_lengths: list[int]
    num_prompt_tokens: int
    finish_reason: str
    time_to_first_token: float
    time_per_output_token: float

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0


class FakeEngine:
    def __init__(self, vocab_size: int, *, block_size: int = 4, steps_per_sync: int = 2, step_time_s: float = 0.0,
                 fail_on_token: int | None = None, draft: bool = True, token_range: tuple[int, int] | None = None):
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.steps_per_sync = steps_per_sync
        self.step_time_s = step_time_s
        self.fail_on_token = fail_on_token  # a prompt containing this id makes generate() raise
        self.draft = draft
        lo, hi = token_range or (0, vocab_size)
        self.token_range = (lo, hi)
        self.calls: list[list[list[int]]] = []  # every batch of prompts received
        self.lock = threading.Lock()
        self.running = 0
        self.max_concurrent = 0

    def next_token(self, a: int, b: int) -> int:
        lo, hi = self.token_range
        return lo + (a * 31 + b * 17 + 7) % (hi - lo)

    def reference(self, prompt: list[int], max_new_tokens: int, stop_token_ids=None) -> list[int]:
        """The tokens a prompt gets (what generate() returns for it)."""
        ids = list(prompt)
        out: list[int] = []
        stop = set(stop_token_ids or ())
        while len(out) < max_new_tokens:
            t = self.next_token(ids[-2] if len(ids) > 1 else 0, ids[-1])
            ids.append(t)
            out.append(t)
            if t in stop:
                break
        return out

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], stop_token_ids=None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[FakeResult]:
        with self.lock:
            self.running += 1
            self.max_concurrent = max(self.max_concurrent, self.running)
            self.calls.append([list(p) for p in prompts])
        try:
            return self._generate(prompts, max_new_tokens, stop_token_ids, on_tokens)
        finally:
            with self.lock:
                self.running -= 1

    def _generate(self, prompts, max_new_tokens, stop_token_ids, on_tokens):
        t0 = time.perf_counter()
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(prompts)
        if self.fail_on_token is not None and any(self.fail_on_token in p for p in prompts):
            raise RuntimeError(f"FakeEngine: prompt contains the failing token {self.fail_on_token}")
        for p in prompts:
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"FakeEngine: token ids {bad} outside the vocabulary")
        refs = [self.reference(p, m, stop_token_ids) for p, m in zip(prompts, max_new_tokens)]
        stop = set(stop_token_ids or ())
        pos = [0] * len(prompts)
        acc: list[list[int]] = [[] for _ in prompts]
        pending: list[list[int]] = [[] for _ in prompts]
        first: list[float | None] = [None] * len(prompts)
        step = 0
        while any(pos[i] < len(refs[i]) for i in range(len(prompts))):
            step += 1
            if self.step_time_s:
                time.sleep(self.step_time_s)
            for i, ref in enumerate(refs):
                if pos[i] >= len(ref):
                    continue
                n = 1 + (ref[pos[i]] + step) % self.block_size if self.draft else 1
                new = ref[pos[i]: pos[i] + n]
                pos[i] += len(new)
                if self.draft:
                    acc[i].append(len(new))
                pending[i].extend(new)
                if first[i] is None:
                    first[i] = time.perf_counter() - t0
            if on_tokens is not None and step % self.steps_per_sync == 0:
                for i in range(len(prompts)):
                    if pending[i]:
                        on_tokens(i, pending[i])
                        pending[i] = []
        if on_tokens is not None:
            for i in range(len(prompts)):
                if pending[i]:
                    on_tokens(i, pending[i])
        elapsed = time.perf_counter() - t0
        results = []
        for i, ref in enumerate(refs):
            reason = "stop" if ref and ref[-1] in stop else "length"
            results.append(FakeResult(
                output_ids=list(ref), acceptance_lengths=acc[i], num_prompt_tokens=len(prompts[i]),
                finish_reason=reason, time_to_first_token=first[i] or 0.0,
                time_per_output_token=elapsed / max(len(ref), 1),
            ))
        return results


class GatedEngine:
    """Wraps an engine; ``generate`` waits while the gate is closed (tests use it to queue requests
    deterministically behind a running batch)."""

    def __init__(self, engine):
        self.engine = engine
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a generate call is waiting at (or past) the gate

    def generate(self, *args, **kwargs):
        self.entered.set()
        self.gate.wait()
        return self.engine.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)
