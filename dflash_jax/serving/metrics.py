"""Server metrics: thread-safe counters and latency histograms per request and per engine step, in
Prometheus' text format."""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Any

# Histogram bounds in seconds (Prometheus' ``le``; ``+Inf`` is implied), as vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class Histogram:
    """Observations counted into fixed buckets, with their sum (not thread-safe: ``Metrics`` locks)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self, labels: str) -> list[tuple[str, str, float]]:
        """(suffix, labels, value) of the ``_bucket`` (cumulative), ``_sum`` and ``_count`` series."""
        out, running = [], 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts):
            running += n
            out.append(("_bucket", f'{labels},le="{bound}"', running))
        return out + [("_sum", labels, self.sum), ("_count", labels, self.count)]


class Metrics:
    """Counters the scheduler and the HTTP layer update; :meth:`render` writes them for ``/metrics``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.http_requests: collections.Counter = collections.Counter()  # (endpoint, status) -> n
        self.requests_finished: collections.Counter = collections.Counter()  # finish_reason -> n
        self.requests_failed = 0
        self.requests_cancelled = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.draft_steps = 0
        self.accepted_tokens = 0  # sum of acceptance lengths (acc + 1) over drafted steps
        self.engine_steps = 0     # host syncs with requests holding rows
        self.engine_step_rows = 0  # sum over those steps of the requests holding rows
        self.engine_seconds = 0.0
        self.queue_wait_seconds = 0.0
        self.ttft = Histogram(TTFT_BUCKETS)         # from the request's arrival
        self.tpot = Histogram(TPOT_BUCKETS)         # per request, over the tokens after the first
        self.latency = Histogram(LATENCY_BUCKETS)   # from arrival to the last token
        self.waiting = 0
        self.running = 0
        self.pages: Any = None  # a paged engine's ``runtime.pages.PageStats`` after the last step
        # The engine's distinct prompts prefilled and their tokens computed (``Engine.prefilled_prompts``).
        self.prefilled: tuple[int, int] | None = None
        # Adaptive speculation (``runtime.speculation``): decode steps of finished requests per block
        # size (1: target-only), and the last call's choice with the model's estimates.
        self.speculation_steps: collections.Counter = collections.Counter()
        self.speculation_calls: collections.Counter = collections.Counter()
        self.speculation_last: Any = None

    def http(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.http_requests[(endpoint, int(status))] += 1

    def request_done(self, result: Any, queue_wait: float) -> None:
        """A request finished with ``result`` (a ``GenerationResult``) after waiting ``queue_wait``
        seconds for a row."""
        with self._lock:
            self.requests_finished[result.finish_reason] += 1
            self.prompt_tokens += result.num_prompt_tokens
            self.generation_tokens += len(result.output_ids)
            self.draft_steps += len(result.acceptance_lengths)
            self.accepted_tokens += sum(result.acceptance_lengths)
            for block, steps in (getattr(result, "block_steps", None) or {}).items():
                self.speculation_steps[block] += steps
            self.queue_wait_seconds += queue_wait
            ttft, tpot = float(result.time_to_first_token), float(result.time_per_output_token)
            self.ttft.observe(ttft)
            if len(result.output_ids) > 1:
                self.tpot.observe(tpot)
            self.latency.observe(ttft + tpot * max(1, len(result.output_ids) - 1))

    def speculation_choice(self, choice: Any) -> None:
        """A decode call's adaptive choice (a ``runtime.speculation.Choice``)."""
        with self._lock:
            self.speculation_calls[choice.block] += 1
            self.speculation_last = choice

    def request_failed(self) -> None:
        with self._lock:
            self.requests_failed += 1

    def request_cancelled(self) -> None:
        with self._lock:
            self.requests_cancelled += 1

    def engine_step(self, running: int, seconds: float) -> None:
        """One host sync of the engine that ran ``running`` requests and took ``seconds``."""
        with self._lock:
            self.engine_steps += 1
            self.engine_step_rows += running
            self.engine_seconds += seconds

    @property
    def tau(self) -> float:
        return self.accepted_tokens / self.draft_steps if self.draft_steps else 0.0

    def render(self, model_name: str) -> str:
        label = f'model="{_escape(model_name)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{{{labels}}} {_num(value)}")

        def histogram(name: str, help_: str, h: Histogram) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} histogram")
            for suffix, labels, value in h.samples(label):
                lines.append(f"{name}{suffix}{{{labels}}} {_num(value)}")

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
            metric("dflash_requests_cancelled_total", "counter",
                   "Generation requests given up before they finished (the client went away).",
                   [(label, self.requests_cancelled)])
            metric("dflash_prompt_tokens_total", "counter", "Prompt tokens processed.", [(label, self.prompt_tokens)])
            metric("dflash_generation_tokens_total", "counter", "Tokens generated.",
                   [(label, self.generation_tokens)])
            if self.prefilled is not None:
                metric("dflash_prefill_prompts_total", "counter",
                       "Distinct prompts the prefills ran (the choices of an n > 1 request share one).",
                       [(label, self.prefilled[0])])
                metric("dflash_prefill_tokens_total", "counter",
                       "Prompt tokens the prefills computed (cached prefixes and shared prompts excluded).",
                       [(label, self.prefilled[1])])
            metric("dflash_draft_steps_total", "counter", "Draft-verify steps run (speculative decoding only).",
                   [(label, self.draft_steps)])
            metric("dflash_accepted_tokens_total", "counter",
                   "Sum over draft-verify steps of the tokens committed per step (acc + 1).",
                   [(label, self.accepted_tokens)])
            metric("dflash_acceptance_length_mean", "gauge",
                   "Mean acceptance length tau (tokens committed per draft-verify step) since start.",
                   [(label, self.tau)])
            metric("dflash_engine_steps_total", "counter", "Host syncs of the engine (one decode call each).",
                   [(label, self.engine_steps)])
            metric("dflash_batch_size_mean", "gauge", "Mean number of requests holding a row per engine step.",
                   [(label, self.engine_step_rows / self.engine_steps if self.engine_steps else 0.0)])
            metric("dflash_engine_busy_seconds_total", "counter", "Seconds the engine spent generating.",
                   [(label, self.engine_seconds)])
            metric("dflash_generation_tokens_per_second", "gauge",
                   "Tokens generated per second of engine time since start.",
                   [(label, self.generation_tokens / self.engine_seconds if self.engine_seconds else 0.0)])
            histogram("dflash_time_to_first_token_seconds", "Time to first token, from the request's arrival.",
                      self.ttft)
            histogram("dflash_time_per_output_token_seconds",
                      "Per request, seconds from the first token to the last over the tokens after the first.",
                      self.tpot)
            histogram("dflash_request_latency_seconds", "Seconds from a request's arrival to its last token.",
                      self.latency)
            metric("dflash_queue_wait_seconds_total", "counter", "Seconds requests waited for a row.",
                   [(label, self.queue_wait_seconds)])
            if self.speculation_calls:
                self._render_speculation(metric, label)
            metric("dflash_requests_waiting", "gauge", "Requests waiting for a row.", [(label, self.waiting)])
            metric("dflash_requests_running", "gauge", "Requests holding a row.", [(label, self.running)])
            if self.pages is not None:
                pages = self.pages
                metric("dflash_kv_pages_total", "gauge", "Pages of the paged KV cache requests may hold.",
                       [(label, pages.total)])
                metric("dflash_kv_pages_in_use", "gauge", "KV cache pages held by running requests.",
                       [(label, pages.in_use)])
                metric("dflash_kv_pages_cached", "gauge",
                       "KV cache pages no request holds that keep a cached prefix (evicted as needed).",
                       [(label, pages.cached)])
                metric("dflash_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
                       [(label, pages.prefix_queries)])
                metric("dflash_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
                       [(label, pages.prefix_hits)])
                metric("dflash_preemptions_total", "counter",
                       "Running requests paused because the KV cache ran out of pages (resumed later).",
                       [(label, pages.preemptions)])
        return "\n".join(lines) + "\n"


    def _render_speculation(self, metric, label: str) -> None:
        """Adaptive speculation's series (the caller holds the lock)."""
        last = self.speculation_last
        metric("dflash_speculation_calls_total", "counter",
               "Decode calls by the block size adaptive speculation chose (1: target-only).",
               [(f'{label},block="{b}"', n) for b, n in sorted(self.speculation_calls.items())])
        metric("dflash_speculation_steps_total", "counter",
               "Decode steps of finished requests by block size (1: target-only).",
               [(f'{label},block="{b}"', n) for b, n in sorted(self.speculation_steps.items())])
        metric("dflash_speculation_block", "gauge", "The block size of the last decode call (1: target-only).",
               [(label, last.block)])
        metric("dflash_speculation_acceptance_rate", "gauge",
               "The live rows' mean estimated per-position acceptance rate at the last decode call.",
               [(label, last.mean_rate)])
        metric("dflash_speculation_expected_tokens_per_second", "gauge",
               "The cost model's expected tokens/s of each block size at the last decode call.",
               [(f'{label},block="{b}"', v) for b, v in sorted(last.tokens_per_second.items())])


def _escape(s: str) -> str:
    return str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))
