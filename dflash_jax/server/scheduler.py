"""A batching scheduler: one worker thread feeds the engine batches of queued requests.

The engine runs static batches (``Engine.generate`` on a list of prompts), so the policy is simple:
when the engine is idle, the worker takes whatever is queued (up to ``max_batch_size`` requests, first
come first served, optionally waiting ``batch_wait_s`` for a fuller batch) and runs it; requests that
arrive meanwhile wait for the next batch. A request never waits for a batch that will not come.

Tokens flow back through each request's ``sink(kind, payload)``, called on the worker thread:
``("tokens", ids)`` at every host sync (the engine's ``on_tokens``), then ``("done", GenerationResult)``
or ``("error", exception)``. :func:`asyncio_sink` turns that into an ``asyncio.Queue`` on the server's
event loop through ``loop.call_soon_threadsafe``.

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

log = logging.getLogger("dflash_jax.server")

Sink = Callable[[str, Any], None]


class SchedulerClosed(RuntimeError):
    """The scheduler is shutting down and takes no new requests."""


class QueueFull(RuntimeError):
    """Too many requests are waiting."""


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] | None
    sink: Sink
    id: int = 0
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    started: float | None = None

    def cancel(self) -> None:
        """Drops the request if it has not started; a running batch cannot be stopped, its tokens are dropped."""
        self.cancelled = True


class Metrics:
    """Thread-safe counters, rendered in Prometheus' text format by :meth:`render`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.http_requests: collections.Counter = collections.Counter()  # (endpoint, status) -> n
        self.requests_finished: collections.Counter = collections.Counter()  # finish_reason -> n
        self.requests_failed = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.draft_steps = 0
        self.accepted_tokens = 0  # sum of acceptance lengths (acc + 1) over drafted steps
        self.batches = 0
        self.batch_rows = 0
        self.engine_seconds = 0.0
        self.queue_wait_seconds = 0.0
        self.ttft_seconds = 0.0
        self.ttft_count = 0
        self.waiting = 0
        self.running = 0
        self.last_batch_tokens_per_second = 0.0

    def http(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.http_requests[(endpoint, int(status))] += 1

    def batch_done(self, requests: Sequence[Request], results: Sequence[Any] | None, seconds: float) -> None:
        with self._lock:
            self.batches += 1
            self.batch_rows += len(requests)
            self.engine_seconds += seconds
            if results is None:
                self.requests_failed += len(requests)
                return
            new_tokens = 0
            for req, res in zip(requests, results):
                self.requests_finished[res.finish_reason] += 1
                self.prompt_tokens += res.num_prompt_tokens
                new_tokens += len(res.output_ids)
                self.draft_steps += len(res.acceptance_lengths)
                self.accepted_tokens += sum(res.acceptance_lengths)
                if req.started is not None:
                    self.queue_wait_seconds += req.started - req.arrival
                self.ttft_seconds += float(res.time_to_first_token)
                self.ttft_count += 1
            self.generation_tokens += new_tokens
            self.last_batch_tokens_per_second = new_tokens / seconds if seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        return self.accepted_tokens / self.draft_steps if self.draft_steps else 0.0

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests_finished": dict(self.requests_finished),
                "requests_failed": self.requests_failed,
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "draft_steps": self.draft_steps,
                "tau": self.tau,
                "batches": self.batches,
                "engine_seconds": self.engine_seconds,
                "tokens_per_second": self.generation_tokens / self.engine_seconds if self.engine_seconds else 0.0,
                "waiting": self.waiting,
                "running": self.running,
            }

    def render(self, model_name: str) -> str:
        label = f'model="{_escape(model_name)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{{{labels}}} {_num(value)}")

        with self._lock:
            http = sorted(self.http_requests.items())
            metric("dflash_http_requests_total", "counter", "HTTP requests answered, by endpoint and status.",
                   [(f'{label},endpoint="{_escape(e)}",status="{s}"', n) for (e, s), n in http] or [(label, 0)])
            reasons = dict(self.requests_finished)
            for r in ("stop", "length"):
                reasons.setdefault(r, 0)
            metric("dflash_requests_finished_total", "counter", "Generation requests finished, by finish reason.",
                   [(f'{label},finish_reason="{_escape(r)}"', n) for r, n in sorted(reasons.items())])
            metric("dflash_requests_failed_total", "counter", "Generation requests failed by an engine error.",
                   [(label, self.requests_failed)])
            metric("dflash_prompt_tokens_total", "counter", "Prompt tokens processed.", [(label, self.prompt_tokens)])
            metric("dflash_generation_tokens_total", "counter", "Tokens generated.",
                   [(label, self.generation_tokens)])
            metric("dflash_draft_steps_total", "counter", "Draft-verify steps run (speculative decoding only).",
                   [(label, self.draft_steps)])
            metric("dflash_accepted_tokens_total", "counter",
                   "Sum over draft-verify steps of the tokens committed per step (acc + 1).",
                   [(label, self.accepted_tokens)])
            metric("dflash_acceptance_length_mean", "gauge",
                   "Mean acceptance length tau (tokens committed per draft-verify step) since start.",
                   [(label, self.tau)])
            metric("dflash_batches_total", "counter", "Engine batches run.", [(label, self.batches)])
            metric("dflash_batch_size_mean", "gauge", "Mean number of requests per engine batch.",
                   [(label, self.batch_rows / self.batches if self.batches else 0.0)])
            metric("dflash_engine_busy_seconds_total", "counter", "Seconds the engine spent generating.",
                   [(label, self.engine_seconds)])
            metric("dflash_generation_tokens_per_second", "gauge",
                   "Tokens generated per second of engine time since start.",
                   [(label, self.generation_tokens / self.engine_seconds if self.engine_seconds else 0.0)])
            metric("dflash_last_batch_tokens_per_second", "gauge", "Tokens per second of the last engine batch.",
                   [(label, self.last_batch_tokens_per_second)])
            metric("dflash_time_to_first_token_seconds_sum", "counter", "Sum of times to first token.",
                   [(label, self.ttft_seconds)])
            metric("dflash_time_to_first_token_seconds_count", "counter", "Number of times to first token summed.",
                   [(label, self.ttft_count)])
            metric("dflash_queue_wait_seconds_total", "counter", "Seconds requests waited before their batch began.",
                   [(label, self.queue_wait_seconds)])
            metric("dflash_requests_waiting", "gauge", "Requests queued for the next batch.", [(label, self.waiting)])
            metric("dflash_requests_running", "gauge", "Requests in the running batch.", [(label, self.running)])
        return "\n".join(lines) + "\n"


def _escape(s: str) -> str:
    return str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


class Scheduler:
    """Batches queued requests onto ``engine.generate`` on a worker thread (see the module docstring)."""

    def __init__(
        self,
        engine: Any,
        *,
        max_batch_size: int,
        batch_wait_s: float = 0.0,
        max_waiting: int = 1024,
        metrics: Metrics | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_waiting = max_waiting
        self.metrics = metrics or Metrics()
        self._queue: collections.deque[Request] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self.batch_sizes: list[int] = []  # history, for tests and logs
        self.submitted = 0

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> "Scheduler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dflash-scheduler", daemon=True)
            self._thread.start()
        return self

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops taking requests; with ``drain`` finishes the queued ones, else fails them. Joins the worker."""
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
    ) -> Request:
        req = Request(
            prompt_ids=[int(t) for t in prompt_ids],
            max_new_tokens=int(max_new_tokens),
            stop_token_ids=None if stop_token_ids is None else tuple(int(t) for t in stop_token_ids),
            sink=sink,
        )
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the server is shutting down")
            if len(self._queue) >= self.max_waiting:
                raise QueueFull(f"{len(self._queue)} requests are already waiting")
            req.id = next(self._ids)
            self.submitted += 1
            self._queue.append(req)
            self.metrics.waiting = len(self._queue)
            self._cond.notify_all()
        return req

    # ---------------------------------------------------------------- worker

    def _take_batch(self) -> list[Request] | None:
        with self._cond:
            while True:
                while self._queue and self._queue[0].cancelled:
                    self._queue.popleft()
                if self._queue:
                    break
                if self._closing:
                    return None
                self._cond.wait()
            if self.batch_wait_s > 0 and len(self._queue) < self.max_batch_size and not self._closing:
                deadline = time.monotonic() + self.batch_wait_s
                while len(self._queue) < self.max_batch_size and not self._closing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            # First come first served; one batch shares one stop-token set.
            stop = self._queue[0].stop_token_ids
            batch: list[Request] = []
            rest: collections.deque[Request] = collections.deque()
            while self._queue:
                req = self._queue.popleft()
                if req.cancelled:
                    continue
                if len(batch) < self.max_batch_size and req.stop_token_ids == stop:
                    batch.append(req)
                else:
                    rest.append(req)
            self._queue = rest
            self.metrics.waiting = len(self._queue)
            self.metrics.running = len(batch)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            if batch:
                self._run_batch(batch)

    def _run_batch(self, batch: list[Request]) -> None:
        start = time.perf_counter()
        for req in batch:
            req.started = start
        self.batch_sizes.append(len(batch))

        def on_tokens(row: int, ids: list[int]) -> None:
            req = batch[row]
            if not req.cancelled and len(ids):
                _safe(req.sink, "tokens", [int(t) for t in ids])

        stop = batch[0].stop_token_ids
        try:
            results = self.engine.generate(
                [req.prompt_ids for req in batch],
                [req.max_new_tokens for req in batch],
                stop_token_ids=None if stop is None else list(stop),
                on_tokens=on_tokens,
            )
            if len(results) != len(batch):
                raise RuntimeError(f"the engine returned {len(results)} results for {len(batch)} prompts")
        except Exception as err:  # the engine failed: fail this batch, keep serving
            log.exception("engine.generate failed on a batch of %d request(s)", len(batch))
            self.metrics.batch_done(batch, None, time.perf_counter() - start)
            self.metrics.running = 0
            for req in batch:
                _safe(req.sink, "error", err)
            return
        self.metrics.batch_done(batch, results, time.perf_counter() - start)
        self.metrics.running = 0
        for req, res in zip(batch, results):
            _safe(req.sink, "done", res)


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
