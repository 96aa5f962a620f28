"""The request scheduler: one worker thread runs the engine's continuous batcher for the HTTP server.

Requests are submitted from the server's threads into a queue; the worker hands them to a
``ContinuousBatcher`` as rows free up (first come, first served) and steps it, so a request that
arrives while others decode is admitted at the next host sync and never waits for them to finish.
While the engine is idle, the first requests may wait ``batch_wait_s`` for company to share a prefill.

Tokens flow back through each request's ``sink(kind, payload)``, called on the worker thread:
``("tokens", ids)`` at every host sync, then ``("done", GenerationResult)`` or ``("error", exception)``.
A request's ``stop_check`` (stop strings) runs there too, before its sink gets the tokens.
A cancelled request (its client went away) gets nothing more, and its row is released at the next
host sync. :func:`asyncio_sink` turns that into an ``asyncio.Queue`` on the server's event loop
through ``loop.call_soon_threadsafe``.

``close(drain=True)`` stops taking new requests, finishes everything queued and in flight, and joins
the worker (the server calls it on shutdown, after uvicorn has finished the open HTTP requests).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Callable, Sequence

from dflash_jax.runtime.batcher import ContinuousBatcher, Generation, StopCheck, stop_checks_per_prompt
from dflash_jax.runtime.sampling import SamplingParams
from dflash_jax.serving.metrics import Metrics

log = logging.getLogger("dflash_jax.serving")

Sink = Callable[[str, Any], None]


class SchedulerClosed(RuntimeError):
    """The scheduler is shutting down and takes no new requests."""


class QueueFull(RuntimeError):
    """Too many requests are waiting."""


@dataclasses.dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] | None
    sink: Sink
    stop_check: StopCheck | None = None  # run on the worker thread (see ``ContinuousBatcher.submit``)
    sampling: SamplingParams | None = None  # None: greedy
    id: int = 0
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    generation: Generation | None = None  # set when the worker hands the request to the batcher

    def cancel(self) -> None:
        """Gives the request up: dropped while queued, its row released at the next host sync once
        running. Safe from any thread; a finished request ignores it."""
        self.cancelled = True


class Scheduler:
    """Runs queued requests through a ``ContinuousBatcher`` on a worker thread (see the module docstring)."""

    def __init__(
        self,
        engine: Any,
        *,
        batch_wait_s: float = 0.0,
        max_waiting: int = 1024,
        metrics: Metrics | None = None,
    ):
        if batch_wait_s < 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {batch_wait_s}")
        self.engine = engine
        self.batch_wait_s = batch_wait_s
        self.max_waiting = max_waiting
        self.metrics = metrics or Metrics()
        self._batcher = ContinuousBatcher(engine)  # the worker thread's alone
        self._running: list[Request] = []         # handed to the batcher, not finished
        self._queue: collections.deque[Request] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self.admissions: list[int] = []  # requests handed to the batcher per host sync, for tests and logs
        self.submitted = 0

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> "Scheduler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dflash-scheduler", daemon=True)
            self._thread.start()
        return self

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops taking requests; with ``drain`` finishes the queued ones, else fails them (requests
        already running always finish). Joins the worker."""
        with self._cond:
            self._closing = True
            if not drain:
                dropped = list(self._queue)
                self._queue.clear()
                self.metrics.waiting = 0
            else:
                dropped = []
            self._cond.notify_all()
        for req in dropped:
            _safe(req.sink, "error", SchedulerClosed("the server is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---------------------------------------------------------------- submit

    def submit(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sink: Sink,
        stop_token_ids: Sequence[int] | None = None,
        stop_check: StopCheck | None = None,
    ) -> Request:
        return self.submit_all([(prompt_ids, max_new_tokens, sink)], stop_token_ids, [stop_check])[0]

    def submit_all(
        self,
        prompts: Sequence[tuple[Sequence[int], int, Sink]],
        stop_token_ids: Sequence[int] | None = None,
        stop_checks: Sequence[StopCheck | None] | None = None,
        sampling: Sequence[SamplingParams | None] | None = None,
    ) -> list[Request]:
        """Queues the prompts of one HTTP request, each ``(prompt_ids, max_new_tokens, sink)``, all
        together or none: a request whose prompts do not all fit the waiting queue is refused whole
        (``QueueFull``), so none of them runs, and none holds a place in the queue that the next
        request could take. ``stop_checks``, ``sampling``: one per prompt, or None."""
        stops = None if stop_token_ids is None else tuple(int(t) for t in stop_token_ids)
        checks = stop_checks_per_prompt(stop_checks, len(prompts))
        params = [None] * len(prompts) if sampling is None else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"sampling has {len(params)} entries for {len(prompts)} prompts")
        reqs = [Request(prompt_ids=[int(t) for t in ids], max_new_tokens=int(m), stop_token_ids=stops, sink=sink,
                        stop_check=check, sampling=sp)
                for (ids, m, sink), check, sp in zip(prompts, checks, params)]
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the server is shutting down")
            if len(self._queue) + len(reqs) > self.max_waiting:
                room = max(0, self.max_waiting - len(self._queue))
                raise QueueFull(f"{len(self._queue)} requests are already waiting"
                                + (f"; room for {room} more, not {len(reqs)}" if len(reqs) > 1 else ""))
            for req in reqs:
                req.id = next(self._ids)
                self._queue.append(req)
            self.submitted += len(reqs)
            self.metrics.waiting = len(self._queue)
            self._cond.notify_all()
        return reqs

    # ---------------------------------------------------------------- worker

    def _run(self) -> None:
        while True:
            incoming = self._take_requests()
            if incoming is None:
                return
            if incoming:
                self.admissions.append(len(incoming))
            for req in incoming:
                self._start(req)
            self._cancel_given_up()
            t0 = time.perf_counter()
            running = self._batcher.running + self._batcher.waiting
            self._batcher.step()
            if running:
                self.metrics.engine_step(running, time.perf_counter() - t0)
                policy = getattr(self._batcher, "speculation", None)
                if policy is not None and policy.last is not None:
                    self.metrics.speculation_choice(policy.last)
            self.metrics.running = self._batcher.running
            if self._batcher.pages is not None:
                self.metrics.pages = self._batcher.page_stats()
            if hasattr(self.engine, "prefilled_tokens"):
                self.metrics.prefilled = (self.engine.prefilled_prompts, self.engine.prefilled_tokens)

    def _take_requests(self) -> list[Request] | None:
        """Waits for work; returns the queued requests that fit in free rows now (None: closed and done)."""
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._queue or not self._batcher.idle:
                    break
                if self._closing:
                    return None
                self._cond.wait()
            if self._batcher.idle and self.batch_wait_s > 0 and not self._closing:
                deadline = time.monotonic() + self.batch_wait_s
                while len(self._queue) < self._batcher.free_slots and not self._closing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self._drop_cancelled()
            incoming = [self._queue.popleft() for _ in range(min(len(self._queue), self._batcher.free_slots))]
            self.metrics.waiting = len(self._queue)
            return incoming

    def _drop_cancelled(self) -> None:
        kept = collections.deque(req for req in self._queue if not req.cancelled)
        for _ in range(len(self._queue) - len(kept)):
            self.metrics.request_cancelled()
        self._queue = kept

    def _start(self, req: Request) -> None:
        """Hands ``req`` to the batcher, its callbacks bound to the request's sink."""

        def on_tokens(ids: list[int]) -> None:
            if not req.cancelled:
                _safe(req.sink, "tokens", ids)

        def on_finish(generation: Generation) -> None:
            self._running.remove(req)
            if generation.error is not None:
                log.error("request %d failed: %s: %s", req.id, type(generation.error).__name__, generation.error)
                self.metrics.request_failed()
                _safe(req.sink, "error", generation.error)
                return
            admitted = generation.admitted if generation.admitted is not None else req.arrival
            self.metrics.request_done(generation.result, admitted - req.arrival)
            _safe(req.sink, "done", generation.result)

        try:
            req.generation = self._batcher.submit(
                req.prompt_ids, req.max_new_tokens, req.stop_token_ids, on_tokens=on_tokens, on_finish=on_finish,
                stop_check=req.stop_check, submitted=req.arrival,
                **({} if req.sampling is None else {"sampling": req.sampling}))
        except ValueError as err:  # a request the engine cannot take (the app checks most of them first)
            self.metrics.request_failed()
            _safe(req.sink, "error", err)
            return
        self._running.append(req)

    def _cancel_given_up(self) -> None:
        """Passes the cancellations of running requests on to the batcher, which releases their rows."""
        for req in [r for r in self._running if r.cancelled]:
            req.generation.cancel()
            self._running.remove(req)
            self.metrics.request_cancelled()


def _safe(sink: Sink, kind: str, payload: Any) -> None:
    try:
        sink(kind, payload)
    except Exception:  # a sink must never kill the worker (e.g. its event loop is gone)
        log.debug("dropping %s for a request whose consumer is gone", kind, exc_info=True)


def asyncio_sink(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, tag: Any = None) -> Sink:
    """A sink that puts ``(tag, kind, payload)`` on ``queue`` from any thread."""

    def sink(kind: str, payload: Any) -> None:
        if loop.is_closed():
            return
        loop.call_soon_threadsafe(queue.put_nowait, (tag, kind, payload))

    return sink
