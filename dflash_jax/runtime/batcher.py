"""Continuous batching: the host loop that runs requests through an engine's row slots.

``ContinuousBatcher`` owns the running ``DecodeState`` (a few row slots, one request each) and a queue
of pending requests. Every ``step`` is one host sync:

1. rows of cancelled requests, and of requests that a stop check ended, are released (marked done
   on device); pending requests are admitted into free rows: the state is first moved to the
   engine's row count for its live requests (one row for a lone request), then one prefill of just
   the new prompts is scattered into free slots, and their first tokens (the prefill's) are read
   and streamed at once;
2. a paged engine's live rows get the pages the next call may write, the newest rows preempted (paused,
   requeued first, resumed later by a prefill of what they have) if the pool is short (``_grow_pages``);
   the next decode call is dispatched, its attention window covering every live row (with the
   engine's ``max_steps_per_sync``, its step count follows the host: ``_adapt_steps``; with adaptive
   speculation, its block size is the ``runtime.speculation`` policy's choice for the live rows);
3. the snapshot of the *previous* call is read while the device runs the new one: new tokens stream
   to their requests, and rows that finished become ``GenerationResult``s and free slots.

A request's ``StopCheck`` sees its tokens before they stream and may end it at any of them (stop
strings: ``dflash_jax.serving.text_stream``): the result is cut there, as the device cuts a block at a stop
token, and the row, still decoding on the device, is released at the next step. The call already
in flight runs it once more, for nothing.

The first tokens are read as soon as the prefill has run, before the admission and the next decode
call are dispatched, at the price of a short device idle per admission: read later, they arrived
only once the work dispatched in between had run (on the H200 the device-to-host copy, though
started right after the prefill, was queued behind it: a time to first token of 81-96 ms with the
read after the next decode call, 32 ms with it after the admission, for a 16 ms prefill;
docs/performance.md).

Reusing a slot that the lagging snapshot shows done is safe: done rows never change, and every
device operation is ordered after the call in flight. Each call remembers which request held each row
when it was dispatched, so its snapshot is read against that layout even after rows moved or were
reused.

The engine is anything with ``Engine``'s slot interface: ``config`` (``max_batch_size``,
``max_length``, ``steps_per_sync``), ``block_size``, ``vocab_size``, ``speculative``,
``max_stop_ids``, ``state_rows``, ``empty_state``, ``prefill``, ``admit``, ``resize``, ``release``
and ``decode`` (``dflash_jax.serving.testing.FakeEngine`` is a host-only one); an engine whose
``adaptive`` is true also ``speculation_blocks``, ``step_costs`` and ``calibrate_speculation``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import numpy as np

from dflash_jax.models.api import token_id_list
from dflash_jax.runtime.pages import PageAllocator, PageStats
from dflash_jax.runtime.sampling import GREEDY, SamplingFlags, SamplingParams
from dflash_jax.runtime.speculation import AcceptanceEstimate, Choice, SpeculationPolicy

if TYPE_CHECKING:
    from dflash_jax.runtime.engine import Engine


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSnapshot:
    """What the host reads of a state after a decode call: copies that stay readable after the
    state is donated to the next call."""

    tokens: jax.Array           # [batch, capacity + 1] int32
    starts: jax.Array           # [batch] int32
    done: jax.Array             # [batch] bool
    num_steps: jax.Array        # [batch] int32
    accepted: jax.Array         # [batch, max_length] int32
    # Only when a row asked for logprobs: per position, the committed token's logprob and the top ones.
    logprob: jax.Array | None = None       # [batch, capacity + 1] float32
    top_ids: jax.Array | None = None       # [batch, capacity + 1, k] int32
    top_logprobs: jax.Array | None = None  # [batch, capacity + 1, k] float32


def _is_ready(tree: Any) -> bool:
    """Whether the computation behind ``tree``'s device arrays has finished (host arrays are)."""
    return all(leaf.is_ready() for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array))


def _start_transfer(tree: Any) -> None:
    """Asks for device arrays on the host as early as possible: a copy requested only when they are
    read could be queued behind the work dispatched in between (on a GPU the device-to-host copies
    share the compute stream)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.copy_to_host_async()


@dataclasses.dataclass
class GenerationResult:
    output_ids: list[int]            # generated tokens only (prompt excluded)
    acceptance_lengths: list[int]    # acc + 1 per decode step (cut at stop / max length); [] target-only
    num_prompt_tokens: int
    finish_reason: str               # "stop" | "length"
    time_to_first_token: float       # seconds from submission to the first token on the host
    time_per_output_token: float     # seconds: time from the first token to the last / the tokens after the first
    num_steps: int                   # decode steps that committed this row's tokens (the prefill's first excluded)
    # With ``SamplingParams.logprobs``: each output token's logprob (log-softmax of the target's raw
    # logits) and the top ``logprobs`` tokens' (id -> logprob, most likely first).
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    # With ``SamplingParams.prompt_logprobs``: per prompt token, its logprob and the top ones, from the
    # prefill (None for the first token, which nothing predicts).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    # Adaptive speculation (``EngineConfig.speculation``): decode steps per block size (1: target-only)
    # and the row's last per-position acceptance estimate (``runtime.speculation``).
    block_steps: dict[int, int] | None = None
    acceptance_rate: float | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tau(self) -> float:
        """Mean tokens committed per decode step (1.0 for target-only decoding)."""
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 1.0


# Called with each chunk of a generation's new token ids, before ``on_tokens``: None to go on, or how
# many of them to keep, ending the generation after them (finish_reason "stop"; a stop string, say,
# as ``dflash_jax.serving.text_stream.TextStream.add`` finds them).
StopCheck = Callable[[list[int]], "int | None"]


def stop_checks_per_prompt(stop_checks: Sequence[StopCheck | None] | None, prompts: int) -> list[StopCheck | None]:
    """One stop check (or None) per prompt: ``stop_checks`` as a list, or Nones when it is None."""
    checks = [None] * prompts if stop_checks is None else list(stop_checks)
    if len(checks) != prompts:
        raise ValueError(f"stop_checks has {len(checks)} entries for {prompts} prompts")
    return checks


@dataclasses.dataclass(eq=False)
class Generation:
    """One request in a ``ContinuousBatcher``: what it asks for, how far it got, how it ended."""

    prompt_ids: list[int]
    max_len: int                     # prompt + max_new_tokens, capped at the engine's max_length
    stop_token_ids: tuple[int, ...]
    on_tokens: Callable[[list[int]], None] | None
    on_finish: Callable[[Generation], None] | None  # once, with ``result`` or ``error`` set
    submitted: float                 # perf_counter time the request arrived
    stop_check: StopCheck | None = None
    sampling: SamplingParams = GREEDY  # seeded when sampled (``SamplingParams.with_seed``)
    admitted: float | None = None    # perf_counter time it got a row
    first_token_time: float | None = None
    result: GenerationResult | None = None
    error: Exception | None = None
    cancelled: bool = False
    # The host's view of the row: tokens before position ``emitted`` went to ``on_tokens`` (the
    # generated ones are ``output_ids``); the anchor was at ``start`` after the first ``seen_steps``
    # decode steps the batcher dispatched (it may be further now).
    emitted: int = 0
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # With ``sampling.logprobs``: one entry per output id (filled before ``on_tokens`` sees the ids).
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    # With ``sampling.prompt_logprobs``: set from the prefill at the admission (before the first token).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    start: int = 0
    seen_steps: int = 0
    # A paged engine's: the pages the request holds (``runtime.pages``) and how many leading prompt
    # tokens it found cached; its place in arrival order (the newest rows are preempted first), and
    # the decode steps and acceptance lengths of its rows before preemptions.
    pages: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    order: int = 0
    preemptions: int = 0
    prior_steps: int = 0
    prior_accepted: list[int] = dataclasses.field(default_factory=list)
    # The row's decode steps and acceptance lengths as last read (a view into that snapshot).
    read_steps: int = 0
    read_accepted: Any = None
    # Adaptive speculation: the row's acceptance estimate, its decode steps read so far, per block.
    acceptance: AcceptanceEstimate | None = None
    row_steps: int = 0
    block_steps: dict[int, int] = dataclasses.field(default_factory=dict)

    def cancel(self) -> None:
        """Gives the request up at the next step, with no further callbacks (from any thread)."""
        self.cancelled = True

    @property
    def finished(self) -> bool:
        return self.cancelled or self.result is not None or self.error is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its next prefill records its prompt's logprobs (asked, and not read yet)."""
        return self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def context_ids(self) -> list[int]:
        """What its (re)admission prefills: the prompt, then the output tokens but the last (a preempted
        request resumes there, its prefill's first token being its last output token again)."""
        return self.prompt_ids + self.output_ids[:-1]


@dataclasses.dataclass(frozen=True)
class _Call:
    """A dispatched decode call: its snapshot and which request held each row when it started."""

    snapshot: RowSnapshot
    rows: tuple[Generation | None, ...]
    steps_end: int                   # the steps dispatched by the batcher up to and with this call
    block: int | None = None         # adaptive speculation: the call's block size (1: target-only)


def cut_acceptance(accepted: Sequence[int], tokens: int) -> list[int]:
    """The per-step acceptance lengths of the steps that committed the first ``tokens`` tokens after the
    prefill's, the last step's cut to what it adds: ``[3, 4, 2]`` cut at 5 tokens is ``[3, 2]``."""
    out: list[int] = []
    for n in accepted:
        if tokens <= 0:
            break
        out.append(min(int(n), tokens))
        tokens -= out[-1]
    if tokens > 0:
        raise ValueError(f"{sum(out)} tokens committed in {len(out)} steps, fewer than the {sum(out) + tokens} asked")
    return out


class ContinuousBatcher:
    """Admits requests into the free rows of one running batch between decode calls (see the module
    docstring). Not thread-safe: one thread submits and steps (``Generation.cancel`` excepted)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._pending: collections.deque[Generation] = collections.deque()
        self._rows: list[Generation | None] = []  # the request in each row of the running state
        self._state: Any = None                   # the running state; None when no row is live
        self._in_flight: _Call | None = None
        self._steps_dispatched = 0
        self.steps_per_call = engine.config.steps_per_sync  # the next call's (see ``_adapt_steps``)
        self._last_read: float | None = None
        self._unreleased: list[int] = []  # slots of rows ended on the host (stop checks), live on the device
        # A paged engine's pages (None: contiguous caches), and the pages of rows ended on the host, freed
        # once their rows are released (the device writes them until then).
        self.pages: PageAllocator | None = None
        if getattr(engine, "paged", False):
            self.pages = PageAllocator(engine.num_pages, engine.page_size, prefix_cache=engine.config.prefix_cache)
        self._unreleased_pages: list[list[int]] = []
        self.preemptions = 0  # rows paused because the pool ran out of pages
        self._arrivals = itertools.count()
        self.speculation: SpeculationPolicy | None = None  # adaptive speculation, made at the first call

    @property
    def running(self) -> int:
        """Requests holding a row (finished rows not yet read included)."""
        return sum(g is not None for g in self._rows)

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def free_slots(self) -> int:
        """Requests that can be submitted now without waiting for a row."""
        return self.engine.config.max_batch_size - self.running - self.waiting

    @property
    def idle(self) -> bool:
        return not self._pending and not self.running and self._in_flight is None

    def submit(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] | None = None,
        *,
        on_tokens: Callable[[list[int]], None] | None = None,
        on_finish: Callable[[Generation], None] | None = None,
        stop_check: StopCheck | None = None,
        submitted: float | None = None,
        name: str = "the prompt",
        sampling: SamplingParams | None = None,
    ) -> Generation:
        """Queues a generation of up to ``max_new_tokens`` after ``prompt_ids``, greedy unless
        ``sampling`` says otherwise (a sampled request without a seed gets a random one here).

        ``on_tokens(new_ids)`` gets the tokens committed since the last call at every host sync;
        ``on_finish(generation)`` is called once when it ends. ``stop_check`` (``StopCheck``) may end
        it earlier, at a token of the host's choosing: its row is released at the next step, and its
        result is cut after that token (acceptance lengths too, as at a stop token).
        ``submitted``: when the request arrived (``time.perf_counter``; default now), the start of
        its time to first token. ``name`` names the prompt in errors.
        """
        config = self.engine.config
        prompt = token_id_list(prompt_ids, name)
        stops = tuple(sorted(set(token_id_list(() if stop_token_ids is None else stop_token_ids, "stop_token_ids"))))
        if not isinstance(max_new_tokens, (int, np.integer)):  # int() truncated 4.5
            raise ValueError(f"max_new_tokens for {name} must be an integer, got {max_new_tokens!r}")
        vocab = self.engine.vocab_size
        if not prompt:
            raise ValueError(f"{name} is empty")
        if len(prompt) >= config.max_length:
            raise ValueError(f"{name} has {len(prompt)} tokens; the engine's max_length is {config.max_length}")
        if (too_long := config.prompt_bucket_error(len(prompt))) is not None:
            raise ValueError(f"{name} has {len(prompt)} tokens, {too_long}")
        if self.pages is not None and isinstance(max_new_tokens, (int, np.integer)):
            needed = self.pages.pages_for(min(len(prompt) + int(max_new_tokens), config.max_length))
            if needed > self.pages.total:
                raise ValueError(f"{name} needs {needed} pages of {self.pages.page_size} positions; the engine's "
                                 f"pool has {self.pages.total}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens for {name} must be >= 1, got {max_new_tokens}")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"{name} has token ids outside [0, {vocab})")
        if stops and (stops[0] < 0 or stops[-1] >= vocab):
            raise ValueError(f"stop_token_ids for {name} holds ids outside [0, {vocab}): {list(stops)!r:.100}")
        if len(stops) > self.engine.max_stop_ids:
            raise ValueError(f"stop_token_ids has {len(stops)} distinct ids; the engine takes at most "
                             f"{self.engine.max_stop_ids}")
        sampling = GREEDY if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling for {name} must be a SamplingParams, got {type(sampling).__name__}")
        sampling.check_vocab(vocab, getattr(config, "max_logprobs", 0))
        if sampling.verify == "rejection" and getattr(self.engine.drafter, "selects_drafts", False):
            raise ValueError(f"sampling for {name}: verify='rejection' needs drafts drawn from the drafter's "
                             "distribution; a DFlash2 drafter's selector picks a path instead (use verify='exact')")
        generation = Generation(
            prompt_ids=prompt, max_len=min(len(prompt) + int(max_new_tokens), config.max_length),
            stop_token_ids=stops, on_tokens=on_tokens, on_finish=on_finish, stop_check=stop_check,
            submitted=time.perf_counter() if submitted is None else submitted, sampling=sampling.with_seed(),
            order=next(self._arrivals),
        )
        self._pending.append(generation)
        return generation

    def run(self) -> None:
        """Steps until every submitted request has finished."""
        while not self.idle:
            self.step()

    def step(self) -> None:
        """One host sync (see the module docstring).

        An engine error fails the requests it touched through ``on_finish`` (``error`` set): a
        failed prefill its own prompts; anything else every request holding a row, and the running
        state is dropped. Pending requests stay queued either way.
        """
        try:
            self._release_given_up()
            admitted = self._admit()
            if admitted is not None:
                self._read_first_tokens(*admitted)
                self._release_given_up()  # rows that their first token ended: before a call runs them
            call = self._dispatch(admitted=admitted is not None)  # may read the call in flight first
            previous, self._in_flight = self._in_flight, call
            if previous is not None:
                self._read(previous)
        except Exception as err:  # noqa: BLE001 - reported to every request it touched
            failed = [g for g in self._rows if g is not None and not g.finished]
            self._state, self._rows, self._in_flight, self._unreleased = None, [], None, []
            if self.pages is not None:  # the pools went with the state
                self.pages.reset()
                self._unreleased_pages = []
                for g in self._pending:  # a prompt's chunks prefilled so far went too
                    g.pages, g.cached_tokens = [], 0
            self._fail(failed, err)

    # -- the phases of a step ----------------------------------------------------------------------

    def _release_given_up(self) -> None:
        """Releases the rows of cancelled requests and of those that a stop check ended."""
        slots = sorted({i for i, g in enumerate(self._rows) if g is not None and g.cancelled} | set(self._unreleased))
        self._unreleased = []
        if slots:
            self._state = self.engine.release(self._state, slots)
            for i in slots:
                if self._rows[i] is not None:
                    self._free_pages(self._rows[i])
                self._rows[i] = None
        for pages in self._unreleased_pages:  # their rows are done on the device from here on
            self.pages.release(pages)
        self._unreleased_pages = []

    def _admit(self) -> tuple[Any, list[Generation]] | None:
        """Sizes the running state for its live rows plus the pending requests that fit, runs their
        prefill and dispatches their admission; returns the prefill's first tokens (on the host) and
        the newly admitted requests (None if none)."""
        for g in self._pending:
            if g.cancelled:  # a prompt given up on between its chunks
                self._free_pages(g, written=False)
        self._pending = collections.deque(g for g in self._pending if not g.cancelled)
        if self._prefill_chunk():
            return None
        keep = [i for i, g in enumerate(self._rows) if g is not None]
        admitting = min(self.engine.config.max_batch_size - len(keep), len(self._pending))
        if self.pages is not None:
            admitting = self._allocate_pages(admitting)
        live = len(keep) + admitting
        rows = self.engine.state_rows(live) if live else 0
        if rows == 0 and self.pages is not None and self._state is not None:
            rows = len(self._rows)  # a paged state stays: its pools hold the prefix cache
        # A lone request without pages is prefilled straight into a running state of its own (one program);
        # a state of free rows there may be is dropped.
        alone = self.pages is None and not keep and admitting == 1 and rows == 1
        if alone:
            self._state, self._rows = None, [None]
        elif rows != len(self._rows):
            if rows == 0:
                self._state = None
            elif self._state is None:
                self._state = self.engine.empty_state(rows)
            else:
                self._state = self.engine.resize(self._state, keep, rows=rows)
            self._rows = [self._rows[i] for i in keep] + [None] * (rows - len(keep))
        if not admitting:
            return None
        group = [self._pending.popleft() for _ in range(admitting)]
        try:
            params = [g.sampling if g.wants_prompt_logprobs or g.sampling.prompt_logprobs is None
                      else dataclasses.replace(g.sampling, prompt_logprobs=None) for g in group]
            extra = {} if all(p.plain for p in params) else {"sampling": params}
            contexts = [g.context_ids for g in group]  # a resumed request's output so far too
            args = (contexts, [g.max_len - len(c) for g, c in zip(group, contexts)], [g.stop_token_ids for g in group])
            if self.pages is None:
                fresh, first = self.engine.prefill(*args, **extra, alone=alone)
            else:
                self._state, fresh, first, admission = self.engine.prefill_paged(
                    self._state, *args, [g.pages for g in group], [g.cached_tokens for g in group], **extra)
        except Exception as err:  # noqa: BLE001 - fail these prompts only, unless the state went with them
            for g in group:
                self._free_pages(g, written=False)
            self._fail(group, err)
            if _consumed(self._state):  # donated to a paged prefill that failed running: step() fails the rows
                raise
            return None
        first = np.asarray(first)  # before the admission too: queued behind it, the copy waited for it
        fresh = _keep_emitted(fresh, first, group, contexts)
        first_logprobs = None
        if any(g.sampling.logprobs is not None for g in group):  # the first tokens' entries, from the prefill
            first_logprobs = _first_logprobs(fresh, [len(c) for c in contexts])
        if any(p.prompt_logprobs is not None for p in params):
            _read_prompt_logprobs(fresh, group, params)
        slots = [i for i, g in enumerate(self._rows) if g is None][:admitting]
        now = time.perf_counter()
        for slot, g, context in zip(slots, group, contexts):  # before the admission: if it fails, step() fails them too
            self._rows[slot] = g
            if g.admitted is None:
                g.admitted = now
            # A resumed request's output so far was emitted: only the tokens after it are new.
            g.emitted, g.start, g.seen_steps = len(context) + bool(g.output_ids), len(context), self._steps_dispatched
            g.row_steps = g.read_steps = 0
        if alone:
            self._state = fresh
        elif self.pages is None:
            self._state = self.engine.admit(self._state, fresh, slots)
        else:
            self._state = self.engine.admit_paged(self._state, fresh, slots, admission)
            for g, context in zip(group, contexts):  # their full prompt pages, for later prompts
                self.pages.register(context, g.pages)
        return first, group, first_logprobs

    def _prefill_chunk(self) -> bool:
        """With ``prefill_chunk``: prefills the next chunk of the first pending request if more of its
        prompt than a chunk is left to compute (one chunk per host sync, between the running rows'
        decode calls), its K/V written into its pages and cached; True if it did. The last chunk is its
        admission."""
        chunk = getattr(self.engine.config, "prefill_chunk", 0)
        if self.pages is None or not chunk or not self._pending:
            return False
        g = self._pending[0]
        if g.wants_prompt_logprobs:  # whole: each of its positions' logits is read from the one prefill
            return False
        if not g.pages and self._allocate_pages(1) == 0:
            return False
        end = g.cached_tokens + chunk
        context = g.context_ids
        if len(context) - g.cached_tokens <= chunk:
            return False
        if self._state is None:
            self._state = self.engine.empty_state(self.engine.state_rows(1))
            self._rows = [None] * self.engine.state_rows(1)
        try:
            self._state, rows, _, admission = self.engine.prefill_paged(self._state, [context[:end]], [1], [()],
                                                                        [g.pages], [g.cached_tokens])
        except Exception as err:  # noqa: BLE001 - fail this prompt only, unless the state went with it
            self._pending.popleft()
            self._free_pages(g, written=False)
            self._fail([g], err)
            if _consumed(self._state):
                raise
            return True
        self._state = self.engine.write_pages(self._state, rows, admission)
        g.cached_tokens = end
        self.pages.register(context[:end], g.pages)
        return True

    def _allocate_pages(self, most: int) -> int:
        """Gives pages to up to ``most`` leading pending requests, in order, stopping at the first the
        pool cannot hold now; returns how many have theirs (a prompt prefilled in chunks has them already).

        A request gets pages for its context and one decode call's positions (``_first_stretch``), more
        as it advances (``_grow_pages``), leaving the pages the running rows' next call needs; one that
        cannot be preempted (``_reserves_whole_length``) gets its whole length. A request whose context
        equals an earlier one's in this admission (``n`` > 1 choices of a prompt) shares that one's full
        context pages: the prefill runs the context once (``Engine.prefill_paged``)."""
        keep = sum(self._growth(g, self._steps_dispatched + self.steps_per_call) for g in self._rows if g is not None)
        firsts: dict[tuple[int, ...], Generation] = {}  # context -> the first request admitted with it
        for n, g in enumerate(itertools.islice(self._pending, most)):
            context = g.context_ids
            first = firsts.setdefault(tuple(context), g)
            if g.pages:
                continue
            positions = g.max_len if self._reserves_whole_length(g) else min(
                len(context) + self._first_stretch(), g.max_len)
            if first is not g and first.wants_prompt_logprobs == g.wants_prompt_logprobs:
                grant = self.pages.share(first.pages[:len(context) // self.pages.page_size], positions, keep=keep)
            else:  # a prompt whose logprobs are asked is computed whole
                grant = self.pages.allocate(context, positions, keep=keep, reuse=not g.wants_prompt_logprobs)
            if grant is None:
                return n
            g.pages, g.cached_tokens = grant.pages, grant.cached_tokens
        return most

    def _first_stretch(self) -> int:
        """The positions a row may write in one decode call."""
        return self.steps_per_call * self.engine.block_size

    def _reserves_whole_length(self, g: Generation) -> bool:
        """Whether ``g`` gets pages for its whole length at admission and is never preempted: it was
        preempted ``max_preemptions`` times already (resumed with room to finish, it is not paused again
        and again while older rows grow, prefilling its context anew each time), or a resumption could
        not give its output again, as its sampling depends on its output's history (penalties' token
        counts, min_tokens' count), which a prefill does not restore, or its context could outgrow the
        largest prompt bucket."""
        config = self.engine.config
        return (g.preemptions >= getattr(config, "max_preemptions", 2) or g.sampling.penalized
                or g.sampling.min_tokens > 0 or g.max_len - 2 > getattr(config, "max_prompt_length", config.max_length))

    def _needed_positions(self, g: Generation, end: int) -> int:
        """The positions ``g``'s row may have written once the decode steps dispatched up to ``end`` ran:
        at most ``block`` per step since its start was last seen, its last step starting at max_len - 2
        (``_dispatch``'s window for one row); positions past ``max_len`` go to the null page."""
        block = self.engine.block_size
        return min(g.start + (end - g.seen_steps) * block, g.max_len - 2 + block, g.max_len)

    def _growth(self, g: Generation, end: int) -> int:
        """The pages ``g``'s row lacks to run the decode steps dispatched up to ``end``."""
        return max(0, self.pages.pages_for(self._needed_positions(g, end)) - len(g.pages))

    def _grow_pages(self, end: int) -> None:
        """Gives the live rows the pages the decode steps up to ``end`` may write, and their page tables
        on the device. When the pool is short, the call in flight is read first (rows it finished give
        their pages back, and the rest need fewer), then the newest rows are preempted until the others
        fit (``_preempt``); a pending request's pages from a chunked prefill go before an older row's."""
        short = lambda: sum(self._growth(g, end) for g in self._rows if g is not None) - self.pages.available
        if short() > 0 and self._in_flight is not None:
            call, self._in_flight = self._in_flight, None
            self._read(call)
            self._release_given_up()
        while short() > 0:
            live = [g for g in self._rows if g is not None]
            held = [g for g in self._pending if g.pages]
            victims = [g for g in live + held if not self._reserves_whole_length(g)]
            if len(live) <= 1 and not held or not victims:
                break  # a lone row fits the pool (``submit`` checks it)
            victim = max(victims, key=lambda g: g.order)
            if victim in held:
                self._free_pages(victim, written=False)
            else:
                self._preempt(victim)
        grown = {}
        for slot, g in enumerate(self._rows):
            if g is not None and self._growth(g, end):
                if not self.pages.grow(g.pages, self._needed_positions(g, end)):  # its writes would be lost
                    raise RuntimeError(f"the page pool ({self.pages.total} pages) cannot hold the running rows")
                grown[slot] = g.pages
        if grown:
            self._state = self.engine.set_pages(self._state, grown)

    def _preempt(self, g: Generation) -> None:
        """Pauses ``g``'s row (no call in flight: the host knows its tokens): the row is released, its
        pages given back (the full ones of its context cached), and ``g`` queued first, to resume by a
        prefill of its context, which the prefix cache usually holds. Its output stays as it is."""
        slot = self._rows.index(g)
        self._state = self.engine.release(self._state, [slot])
        self._rows[slot] = None
        self._free_pages(g)
        g.cached_tokens = 0
        if g.read_steps:
            g.prior_steps += g.read_steps
            g.prior_accepted += g.read_accepted[:g.read_steps].tolist()
        g.preemptions += 1
        self.preemptions += 1
        # First in the queue, but behind a prompt being prefilled in chunks: that one keeps its pages and
        # goes on (queued before it, ``g`` could wait for its pages while it waited for its turn).
        self._pending.insert(next((i for i, p in enumerate(self._pending) if not p.pages), len(self._pending)), g)

    def page_stats(self) -> PageStats:
        """A paged engine's page counters for ``/metrics``, preemptions included."""
        return dataclasses.replace(self.pages.stats(), preemptions=self.preemptions)

    def _free_pages(self, g: Generation, *, written: bool = True) -> None:
        """Lets ``g``'s pages go (a paged engine); ``written``: its admission ran, so they hold the K/V of
        its prompt and of every output token but the last, whose full pages are cached."""
        if self.pages is None or not g.pages:
            return
        if written:
            self.pages.register(g.prompt_ids + g.output_ids[:-1], g.pages)
        self.pages.release(g.pages)
        g.pages = []

    def _dispatch(self, admitted: bool = False) -> _Call | None:
        """Dispatches the next decode call over the live rows (None if there are none). ``admitted``:
        this step admitted requests, waiting for their prefill and so for the call in flight."""
        live = [g for g in self._rows if g is not None]
        if not live:
            return None
        if (self.engine.config.max_steps_per_sync is not None and not admitted and self._in_flight is not None
                and _is_ready(self._in_flight.snapshot)):
            self._adapt_steps(device_idle=True)
        block, steps = self.engine.block_size, self.steps_per_call
        end = self._steps_dispatched + steps
        if self.pages is not None:  # the pages the call may write, preempting rows if the pool is short
            self._grow_pages(end)
            live = [g for g in self._rows if g is not None]
            if not live:
                return None
        # A row advances at most ``block`` positions per step dispatched since its start was last
        # seen, and its last step starts at max_len - 2, writing a block up to max_len - 2 + block.
        window = max(min(g.start + (end - g.seen_steps) * block, g.max_len - 2 + block) for g in live)
        flags = SamplingFlags.of([g.sampling for g in live], getattr(self.engine.config, "max_logprobs", 0))
        extra = {} if flags.greedy else {"sampling": flags}
        choice = self._choose_block(live) if getattr(self.engine, "adaptive", False) else None
        if choice is not None:
            extra["block"] = choice.block
        self._state, snapshot = self.engine.decode(self._state, steps, window=window, **extra)
        _start_transfer(snapshot)
        self._steps_dispatched = end
        return _Call(snapshot, tuple(self._rows), end, block=None if choice is None else choice.block)

    def _choose_block(self, live: list[Generation]) -> Choice:
        """Adaptive speculation: the next call's block for the live rows (``runtime.speculation``); the
        engine measures its step costs first if nothing gave them."""
        if self.speculation is None:
            if not self.engine.step_costs:
                self.engine.calibrate_speculation()
            self.speculation = SpeculationPolicy(self.engine.speculation_blocks, self.engine.step_costs)
        for g in live:
            if g.acceptance is None:
                g.acceptance = self.speculation.new_row()
        return self.speculation.choose([g.acceptance for g in live], len(self._rows))

    def _observe(self, g: Generation, snap: RowSnapshot, row: int, block: int) -> None:
        """Records the steps of ``g`` that ``snap`` shows since the last read, all run at ``block``."""
        steps = int(snap.num_steps[row])
        if steps > g.row_steps:
            g.block_steps[block] = g.block_steps.get(block, 0) + steps - g.row_steps
            if self.speculation is not None and g.acceptance is not None:
                self.speculation.observe(g.acceptance, snap.accepted[row, g.row_steps: steps].tolist(), block)
            g.row_steps = steps

    def _adapt_steps(self, *, device_idle: bool = False, waited: float = 0.0, period: float = 0.0) -> None:
        """Sizes the next calls to what the host can keep up with (for ``max_steps_per_sync``; the
        callers check it is set, before they look at the device).

        A call that has finished when the host dispatches the next means the device idles while the
        host works through a sync (a small model's server streaming to many clients): the next calls
        run twice the steps, so the host syncs half as often per token. A host that spent over 60% of
        the last sync period waiting on the device would still be ahead with half the steps: they
        halve, back towards ``steps_per_sync`` (finer streaming, sooner admissions). Between the two
        (the host busy for 40-100% of a call) nothing changes, so the size does not oscillate.
        """
        config = self.engine.config
        if device_idle:
            self.steps_per_call = min(2 * self.steps_per_call, config.max_steps_per_sync)
        elif period > 0 and waited > 0.6 * period:
            self.steps_per_call = max(self.steps_per_call // 2, config.steps_per_sync)

    def _read_first_tokens(self, tokens: np.ndarray, group: list[Generation], logprobs=None) -> None:
        now = time.perf_counter()
        for i, (g, token) in enumerate(zip(group, tokens)):
            if g.cancelled or g.first_token_time is not None:  # resumed: its first token was emitted
                continue
            g.first_token_time = now
            entries = None if logprobs is None else [(logprobs[0][i], logprobs[1][i], logprobs[2][i])]
            self._deliver(g, [int(token)], None, 0, now, entries)

    def _read(self, call: _Call) -> None:
        """Streams the tokens ``call`` committed and retires the rows it finished. A call whose rows had all
        finished before it ran (dispatched before the previous call's read ended them) is not waited for."""
        if all(g is None or g.finished for g in call.rows):
            return
        t0 = time.perf_counter()
        snap = jax.device_get(call.snapshot)
        now = time.perf_counter()
        if self._last_read is not None and self.engine.config.max_steps_per_sync is not None:
            self._adapt_steps(waited=now - t0, period=now - self._last_read)
        self._last_read = now
        for row, g in enumerate(call.rows):
            if g is None or g.finished:
                continue
            if call.block is not None:
                self._observe(g, snap, row, call.block)
            g.start, g.seen_steps = int(snap.starts[row]), call.steps_end
            g.read_steps, g.read_accepted = int(snap.num_steps[row]), snap.accepted[row]
            upto = min(g.start + 1, g.max_len)
            if upto > g.emitted:
                entries = None
                if g.sampling.logprobs is not None and snap.logprob is not None:
                    entries = [(snap.logprob[row, p], snap.top_ids[row, p], snap.top_logprobs[row, p])
                               for p in range(g.emitted, upto)]
                self._deliver(g, snap.tokens[row, g.emitted: upto].tolist(), snap, row, now, entries)
            if snap.done[row] and not g.finished:
                self._retire(g, snap, row, now)

    def _deliver(self, g: Generation, new: list[int], snap: RowSnapshot | None, row: int, now: float,
                 entries: list | None = None) -> None:
        """Passes ``g``'s new tokens through its stop check to ``on_tokens``; ends ``g`` if the check
        says so. ``snap``: the snapshot they come from (None for the prefill's first token);
        ``entries``: per token, ``(logprob, top ids, top logprobs)`` when ``g`` asked for logprobs."""
        keep = None
        if g.stop_check is not None:
            try:
                keep = g.stop_check(new)
                if keep is not None and not (type(keep) is int and 1 <= keep <= len(new)):
                    raise ValueError(f"a stop check kept {keep!r} of {len(new)} new tokens")
            except Exception as err:  # noqa: BLE001 - fails this request alone
                self._end_on_host(g)
                self._fail([g], err)
                return
            new = new[:keep]
        g.emitted += len(new)
        g.output_ids.extend(new)
        if entries is not None:
            k = g.sampling.logprobs
            for lp, ids, vals in entries[:len(new)]:
                g.logprobs.append(float(lp))
                g.top_logprobs.append({int(t): float(v) for t, v in zip(ids[:k], vals[:k])})
        if g.on_tokens is not None:
            g.on_tokens(new)
        if keep is not None:
            self._end_on_host(g)
            self._retire(g, snap, row, now, stopped=True)

    def _end_on_host(self, g: Generation) -> None:
        """Frees ``g``'s row, still live on the device: it is released at the next step."""
        slot = self._rows.index(g)
        self._rows[slot] = None
        self._unreleased.append(slot)
        if self.pages is not None and g.pages:  # freed once the row is released
            self.pages.register(g.prompt_ids + g.output_ids[:-1], g.pages)
            self._unreleased_pages.append(g.pages)
            g.pages = []

    def _retire(self, g: Generation, snap: RowSnapshot | None, row: int, now: float, stopped: bool = False) -> None:
        out = list(g.output_ids)
        if not stopped:  # with the steps of its rows before preemptions
            steps = int(snap.num_steps[row])
            accepted = g.prior_accepted + snap.accepted[row, :steps].tolist()
            steps += g.prior_steps
        elif self.engine.speculative:  # cut after the stop check's last token, as at a stop token
            history = [] if snap is None else snap.accepted[row, :int(snap.num_steps[row])].tolist()
            accepted = cut_acceptance(g.prior_accepted + history, len(out) - 1)
            steps = len(accepted)
        else:
            accepted, steps = [], len(out) - 1
        g.result = GenerationResult(
            output_ids=out,
            acceptance_lengths=accepted if self.engine.speculative else [],
            num_prompt_tokens=len(g.prompt_ids),
            finish_reason="stop" if stopped or (out and out[-1] in g.stop_token_ids) else "length",
            time_to_first_token=g.first_token_time - g.submitted,
            time_per_output_token=(now - g.first_token_time) / max(1, len(out) - 1),
            num_steps=steps,
            logprobs=list(g.logprobs) if g.sampling.logprobs is not None else None,
            top_logprobs=list(g.top_logprobs) if g.sampling.logprobs is not None else None,
            prompt_logprobs=g.prompt_logprobs, prompt_top_logprobs=g.prompt_top_logprobs,
            block_steps=dict(sorted(g.block_steps.items(), reverse=True)) if g.block_steps else None,
            acceptance_rate=None if g.acceptance is None else g.acceptance.rate,
        )
        if not stopped:  # a stopped row was freed by ``_end_on_host``, to be released
            self._rows[self._rows.index(g)] = None
            self._free_pages(g)  # done on the device: its pages are written no more
        if g.on_finish is not None:
            g.on_finish(g)

    @staticmethod
    def _fail(generations: list[Generation], err: Exception) -> None:
        for g in generations:
            g.error = err
            if g.on_finish is not None:
                g.on_finish(g)


def _consumed(state: Any) -> bool:
    """Whether ``state``'s device arrays were donated to a call that failed (deleted: the state is lost)."""
    return state is not None and any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state))


def _keep_emitted(rows: Any, first: np.ndarray, group: list[Generation], contexts: list[list[int]]) -> Any:
    """The prefilled ``rows`` with a resumed request's first token set to the last token it emitted,
    where the prefill drew another (a prefill's logits can differ from the decode step's by rounding):
    the row goes on from what the client has."""
    fixes = [(i, len(c), g.output_ids[-1]) for i, (g, c) in enumerate(zip(group, contexts))
             if g.output_ids and first[i] != g.output_ids[-1]]
    if not fixes:
        return rows
    index, position, token = (np.asarray(x) for x in zip(*fixes))
    return dataclasses.replace(rows, tokens=rows.tokens.at[index, position].set(token),
                               done=rows.done.at[index].set(False))


def _first_logprobs(rows: Any, prompt_lens: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each prefilled row's first token's ``(logprob, top ids, top logprobs)``, read at its prompt length."""
    s = rows.sampling
    index = np.asarray(prompt_lens)
    take = np.arange(len(prompt_lens))
    logprob, top_ids, top_lps = (np.asarray(x) for x in jax.device_get((s.logprob, s.top_ids, s.top_logprobs)))
    return logprob[take, index], top_ids[take, index], top_lps[take, index]


def _read_prompt_logprobs(rows: Any, group: list[Generation], params: list[SamplingParams]) -> None:
    """Sets the prompt logprobs of the requests of ``group`` that asked (``params``: what their prefill
    was asked) from the prefilled ``rows``: position p's entry is the prompt token p's."""
    s, end = rows.sampling, max(len(g.prompt_ids) for g in group)
    logprob, top_ids, top_lps = (np.asarray(x) for x in jax.device_get(
        (s.logprob[:, :end], s.top_ids[:, :end], s.top_logprobs[:, :end])))
    for i, (g, p) in enumerate(zip(group, params)):
        if p.prompt_logprobs is None:
            continue
        n, k = len(g.prompt_ids), p.prompt_logprobs
        g.prompt_logprobs = [None] + logprob[i, 1:n].tolist()
        g.prompt_top_logprobs = [None] + [{int(t): float(v) for t, v in zip(top_ids[i, j, :k], top_lps[i, j, :k])}
                                          for j in range(1, n)]
