"""A host-only engine with ``Engine``'s slot interface, for server tests and HTTP-layer benchmarks.

``FakeEngine`` "generates" a deterministic function of the prompt: token ``t+1`` is a hash of the last
two tokens, committed in steps of 1..block_size tokens (so ``acceptance_lengths`` and tau look like
DFlash's). Its state is numpy arrays with ``DecodeState``'s row semantics, so the real
``ContinuousBatcher`` drives it; rows are independent, so a request gets the same answer alone or
batched, whenever it was admitted.

``FakePagedEngine`` adds a paged engine's interface (``prefill_paged``, ``admit_paged``, ``set_pages``,
``write_pages``): the batcher's page accounting, admission by pages and preemption run as they do on a
device, and every decode step checks that a row's committed positions lie in the pages it was given.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from typing import Sequence

import numpy as np

from dflash_jax.runtime.batcher import ContinuousBatcher, RowSnapshot
from dflash_jax.runtime.engine import EngineConfig


@dataclasses.dataclass
class FakeState:
    """``DecodeState`` without caches, in numpy; updated in place (as a donated state would be)."""

    tokens: np.ndarray     # [rows, max_length + 1]
    starts: np.ndarray     # [rows]
    max_lens: np.ndarray   # [rows]
    done: np.ndarray       # [rows] bool
    num_steps: np.ndarray  # [rows]
    accepted: np.ndarray   # [rows, max_length]
    stop_ids: np.ndarray   # [rows, n_stop], -1 pads
    pages: np.ndarray      # [rows]: the pages a paged engine's row holds (its page table's length)

    @classmethod
    def empty(cls, rows: int, max_length: int, n_stop: int) -> "FakeState":
        zeros = np.zeros((rows,), np.int64)
        return cls(np.zeros((rows, max_length + 1), np.int64), zeros.copy(), zeros.copy(), np.ones((rows,), bool),
                   zeros.copy(), np.zeros((rows, max_length), np.int64), np.full((rows, n_stop), -1, np.int64),
                   zeros.copy())

    def copy_row(self, row: int, into: "FakeState", slot: int) -> None:
        for field in dataclasses.fields(self):
            getattr(into, field.name)[slot] = getattr(self, field.name)[row]


class FakeEngine:
    def __init__(self, vocab_size: int, *, max_batch_size: int = 4, max_length: int = 64, block_size: int = 4,
                 steps_per_sync: int = 2, step_time_s: float = 0.0, fail_on_token: int | None = None,
                 draft: bool = True, token_range: tuple[int, int] | None = None):
        self.config = EngineConfig(max_batch_size=max_batch_size, max_length=max_length,
                                   steps_per_sync=steps_per_sync)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.speculative = draft
        self.max_stop_ids = 16
        self.step_time_s = step_time_s   # sleeps this long per decode step (the device's work)
        self.fail_on_token = fail_on_token  # a prompt containing this id makes its prefill raise
        lo, hi = token_range or (0, vocab_size)
        self.token_range = (lo, hi)
        self.prefills: list[list[list[int]]] = []  # the prompts of every prefill (an admission each)
        self.released: list[int] = []              # rows released for cancelled requests
        self.max_live = 0                          # most rows decoding at once

    def next_token(self, a: int, b: int) -> int:
        lo, hi = self.token_range
        return lo + (a * 31 + b * 17 + 7) % (hi - lo)

    def reference(self, prompt: list[int], max_new_tokens: int, stop_token_ids=None) -> list[int]:
        """The tokens a prompt gets (what generation returns for it)."""
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

    # -- the slot interface (see dflash_jax.runtime.batcher) ----------------------------------------------

    def state_rows(self, live: int) -> int:
        return self.config.max_batch_size

    def empty_state(self, rows: int) -> FakeState:
        return FakeState.empty(rows, self.config.max_length, self.max_stop_ids)

    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                stop_token_ids: Sequence[Sequence[int]], sampling=None, *, alone: bool = False
                ) -> tuple[FakeState, np.ndarray]:
        # ``alone``: one prompt as a running state of one row, which is what its prefilled rows are here
        if alone and len(prompts) != 1:
            raise ValueError(f"a prefill alone takes one prompt; got {len(prompts)}")
        if sampling is not None:  # the batcher passes it only for sampled rows or logprobs
            raise ValueError("FakeEngine decodes greedily: it takes no sampling state (no temperature, no logprobs)")
        self.prefills.append([list(p) for p in prompts])
        if self.fail_on_token is not None and any(self.fail_on_token in p for p in prompts):
            raise RuntimeError(f"FakeEngine: prompt contains the failing token {self.fail_on_token}")
        state = self.empty_state(len(prompts))
        for i, (p, m, stops) in enumerate(zip(prompts, max_new_tokens, stop_token_ids)):
            n = len(p)
            first = self.next_token(p[-2] if n > 1 else 0, p[-1])
            state.tokens[i, :n] = p
            state.tokens[i, n] = first
            state.starts[i] = n
            state.max_lens[i] = min(n + m, self.config.max_length)
            state.stop_ids[i, : len(stops)] = stops
            state.done[i] = first in stops or n + 1 >= state.max_lens[i]
        return state, state.tokens[np.arange(len(prompts)), state.starts].copy()

    def admit(self, state: FakeState, rows: FakeState, slots: Sequence[int]) -> FakeState:
        for row, slot in enumerate(slots):
            rows.copy_row(row, state, slot)
        return state

    def resize(self, state: FakeState, keep: Sequence[int], *, rows: int) -> FakeState:
        new = self.empty_state(rows)
        for slot, row in enumerate(keep):
            state.copy_row(row, new, slot)
        return new

    def release(self, state: FakeState, slots: Sequence[int]) -> FakeState:
        state.done[list(slots)] = True
        self.released.extend(slots)
        return state

    def decode(self, state: FakeState, n_steps: int | None = None, *,
               window: int | None = None, sampling=None) -> tuple[FakeState, RowSnapshot]:
        if sampling is not None:
            raise ValueError("FakeEngine decodes greedily: it takes no sampling state (no temperature, no logprobs)")
        for _ in range(self.config.steps_per_sync if n_steps is None else n_steps):
            live = np.flatnonzero(~state.done)
            if not len(live):
                break
            self.max_live = max(self.max_live, len(live))
            if self.step_time_s:
                time.sleep(self.step_time_s)
            for row in live:
                self._step(state, row)
        return state, RowSnapshot(tokens=state.tokens.copy(), starts=state.starts.copy(), done=state.done.copy(),
                                  num_steps=state.num_steps.copy(), accepted=state.accepted.copy())

    def _step(self, s: FakeState, row: int) -> None:
        """One draft-verify step of ``row``: commits 1..block_size tokens, cut at a stop id and the max length."""
        start, tokens = int(s.starts[row]), s.tokens[row]
        stops = set(s.stop_ids[row][s.stop_ids[row] >= 0].tolist())
        guess = self.next_token(int(tokens[start - 1]), int(tokens[start]))
        accepted = 1 + (guess + int(s.num_steps[row])) % self.block_size if self.speculative else 1
        produced, stopped = 0, False
        while produced < min(accepted, int(s.max_lens[row]) - start - 1) and not stopped:
            pos = start + produced
            tokens[pos + 1] = self.next_token(int(tokens[pos - 1]), int(tokens[pos]))
            stopped = int(tokens[pos + 1]) in stops
            produced += 1
        s.starts[row] += produced
        s.accepted[row, s.num_steps[row]] = produced
        s.num_steps[row] += 1
        s.done[row] = stopped or s.starts[row] + 1 >= s.max_lens[row]


class FakePagedEngine(FakeEngine):
    """``FakeEngine`` with a paged engine's interface: a pool of ``num_pages`` pages of ``page_size``
    positions (the null page besides), handed out by the batcher's ``PageAllocator``. Nothing is stored in
    the pages; each row knows how many it holds, and a decode step whose committed positions pass them
    raises (the device would have lost their K/V)."""

    paged = True

    def __init__(self, vocab_size: int, *, page_size: int, num_pages: int, prefix_cache: bool = True,
                 prefill_chunk: int = 0, max_preemptions: int = 2, **kwargs):
        super().__init__(vocab_size, **kwargs)
        self.config = dataclasses.replace(self.config, page_size=page_size, num_pages=num_pages,
                                          prefix_cache=prefix_cache, prefill_chunk=prefill_chunk,
                                          max_preemptions=max_preemptions)
        self.config.validate()
        self.page_size = page_size
        self.num_pages = num_pages + 1  # as ``Engine``: page 0 is the null page

    def prefill_paged(self, state: FakeState, prompts, max_new_tokens, stop_token_ids, pages, cached,
                      sampling=None) -> tuple[FakeState, FakeState, np.ndarray, list[int]]:
        rows, first = self.prefill(prompts, max_new_tokens, stop_token_ids, sampling)
        rows.pages[:len(pages)] = [len(p) for p in pages]
        return state, rows, first, [len(p) for p in pages]

    def admit_paged(self, state: FakeState, rows: FakeState, slots: Sequence[int], admission) -> FakeState:
        return self.admit(state, rows, slots)

    def set_pages(self, state: FakeState, pages: dict[int, Sequence[int]]) -> FakeState:
        for slot, row_pages in pages.items():
            state.pages[slot] = len(row_pages)
        return state

    def write_pages(self, state: FakeState, rows: FakeState, admission) -> FakeState:
        return state

    def _step(self, s: FakeState, row: int) -> None:
        super()._step(s, row)
        if s.starts[row] > s.pages[row] * self.page_size:
            raise RuntimeError(f"row {row} committed position {int(s.starts[row]) - 1} past its "
                               f"{int(s.pages[row])} pages of {self.page_size}")


def live_rows(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict:
    """How many requests ``engine``'s ``ContinuousBatcher`` runs at once on a workload: every prompt
    submitted at once (no stop ids), then steps until all are done. Returns the rows admitted by the first
    step (``first``), the mean and the most rows live after a step while requests were still waiting
    (``mean``, ``most``: admission, growth and preemption at work on a saturated engine), and the
    preemptions. Host-only with a ``FakeEngine`` or ``FakePagedEngine``: admission is accounting."""
    batcher = ContinuousBatcher(engine)
    generations = [batcher.submit(p, max_new_tokens) for p in prompts]
    live: list[int] = []
    while batcher.waiting:
        batcher.step()
        live.append(batcher.running)
    batcher.run()
    failed = [g.error for g in generations if g.error is not None]
    if failed:
        raise failed[0]
    if batcher.pages is not None and not batcher.pages.all_free():
        raise RuntimeError("pages were not all given back")
    return {"first": live[0], "mean": float(np.mean(live)), "most": max(live), "preemptions": batcher.preemptions}


class GatedEngine:
    """Wraps an engine; ``prefill`` waits while the gate is closed (tests use it to queue requests
    deterministically behind the first one)."""

    def __init__(self, engine):
        self.engine = engine
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a prefill is waiting at (or past) the gate

    def prefill(self, *args, **kwargs):
        self.entered.set()
        self.gate.wait()
        return self.engine.prefill(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def wait_until_serving(url: str, process, timeout: float, log_path=None) -> None:
    """Waits until ``url``'s ``/health`` answers 200 (a ``serve.py`` subprocess coming up); fails with
    the server's log (``log_path``) if ``process`` exits first or ``timeout`` seconds pass."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        log = "" if log_path is None else open(log_path).read()
        assert process.poll() is None, f"the server exited with status {process.returncode}:\n{log}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server did not come up in {timeout} s:\n{log}"
        time.sleep(0.2)


def completion_ids(client, prompt: list[int], max_tokens: int, streamed: bool) -> list[int]:
    """The token ids a server (``client``: an ``httpx.Client`` on its URL) answers ``prompt`` with on
    ``/v1/completions``: an SSE stream joined, or one JSON body. Raises ``AssertionError`` on an error."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True}
    if not streamed:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    ids: list[int] = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            for choice in event["choices"]:
                ids.extend(choice.get("token_ids") or [])
    return ids


def run_clients(url: str, requests: Sequence[tuple[list[int], int]], clients: int, duration_s: float,
                timeout_s: float = 300.0) -> tuple[list[tuple[int, list[int], float]], list[BaseException]]:
    """A bounded load: ``clients`` threads, each with its own connection, send requests drawn from
    ``requests`` (``(prompt ids, max_tokens)``; half of them streamed) one after the other until
    ``duration_s`` has passed, then wait for their last answers. Returns ``(index, token ids, seconds)`` per
    answered request and the errors met (a client stops at its first)."""
    import httpx

    deadline = time.monotonic() + duration_s
    answers: list[tuple[int, list[int], float]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def user(n: int) -> None:
        rng = random.Random(n)
        try:
            with httpx.Client(base_url=url, timeout=timeout_s) as client:
                while time.monotonic() < deadline:
                    i = rng.randrange(len(requests))
                    t0 = time.perf_counter()
                    ids = completion_ids(client, *requests[i], streamed=rng.random() < 0.5)
                    with lock:
                        answers.append((i, ids, time.perf_counter() - t0))
        except BaseException as err:  # noqa: BLE001 - returned to the caller
            with lock:
                errors.append(err)

    threads = [threading.Thread(target=user, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, errors


def metric_values(client) -> dict[str, float]:
    """A server's ``/metrics`` as ``{name: value}`` (labels dropped; ``client``: an ``httpx.Client``)."""
    values = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def pages_back(client, timeout_s: float = 10.0) -> dict[str, float]:
    """``metric_values`` once no KV page is in use (the last rows' pages go back at the host sync that
    retires them, after their answers), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = metric_values(client)
        if metrics.get("dflash_kv_pages_in_use", 0) == 0 or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)
