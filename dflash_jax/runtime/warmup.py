"""Warm-up: compiling the shapes an engine's requests can meet before they meet them.

A shape compiled while serving stalls every running request for its compile (seconds for an 8B model
on an accelerator; ~10 s per decode shape for a 25M-parameter model on two CPU cores). A server meets
many: decode per running state's row count (``Engine.state_rows``) and attention window
(``Engine.windows``), a lone request's prefill into a state of its own per prompt bucket (one program:
``Engine.prefill(alone=True)``), a prefill per row count (``Engine.prefill_rows``) and prompt bucket and an
admission of each into the batch's running state, the prefills of one prompt's ``n`` > 1
choices (a shared prefill: the prompt runs once on one row, copied to each choice's row), the states
resized into each other, a row of each released (a cancelled request's).

Sampled batches decode with programs of their own, one per combination of ``SamplingFlags`` (what
the batch's rows use: sampling, each filter, penalties, rejection, logprobs); a prefill with a sampled
row, or one asking for logprobs, draws its first tokens after it with one program per row count
(``Engine.draw_first``, every processor compiled in), compiled with the first prefill of that row count. The plan adds, for each combination it is given, a decode per state and
window; ``sampling_flags`` turns a server's ``server.warmup_sampling`` entries (``"sample"``,
``"sample+top_p+logprobs"``, ...) into those combinations.

``warmup_plan`` lists them in the order a server meets them (a lone request's shapes first, then a
batch's); ``first_request_shapes`` picks those of a lone request with a short prompt, which a server
compiles before it binds while the rest (``staged_plan``: sampled decoding among them) compile on a
``BackgroundWarmup`` thread as it serves. ``Engine.warmup`` compiles the whole plan before it returns
(decode first, prefills on several threads).

Nothing here runs a model over a token: the prefills are compiled only (``Engine.prefill_compiled``;
a paged engine's with the admission into the state whose pools they read, ``Engine.prefill_paged_compiled``),
decode runs for zero steps, and the admissions, page tables, resizes and releases run on states of the
warm-up's own (an empty state per row count, zero stand-ins for the prefills' outputs).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from dflash_jax.runtime.sampling import SamplingFlags, SamplingParams

log = logging.getLogger("dflash_jax.runtime.warmup")

PHASES = ("decode", "prefill", "admit", "pages", "write", "resize", "release")

# The features of a ``server.warmup_sampling`` entry, each as the parameters of a request using it
# (``top_k=N`` besides: the candidates of a top-k of N, one program per power of two). An entry's
# features together are a batch whose rows use them: ``SamplingFlags.of`` of the stand-in request.
SAMPLING_FEATURES: dict[str, dict[str, Any]] = {
    "sample": {"temperature": 1.0},              # temperature > 0 (any value: one program)
    "top_p": {"top_p": 0.9},
    "min_p": {"min_p": 0.05},
    "penalties": {"presence_penalty": 0.5},      # also frequency/repetition penalties, logit_bias, min_tokens
    "rejection": {"verify": "rejection"},        # verify="rejection"
    "logprobs": {"logprobs": 0},                 # the chosen tokens' logprobs only
    "top_logprobs": {"logprobs": 1},             # and the top ones (up to the engine's max_logprobs)
}
# Filters and verification act on sampled rows only: an entry naming them without "sample" would be greedy.
SAMPLED_ONLY = ("top_p", "top_k", "min_p", "rejection")

# Linux caps a process's memory mappings (vm.max_map_count, 65,530 by default) and XLA:CPU maps each compiled
# kernel's code into the process: ~300 mappings per decode or prefill program of the embedded pair. A compile
# past the cap fails and takes the process down, so the warm-up leaves this share of it to the requests.
MAPPINGS_SHARE = 0.75


def memory_mappings() -> tuple[int, int] | None:
    """``(mappings this process holds, the cap)``, or None where ``/proc`` does not tell (not Linux)."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps", "rb") as maps:
            used = sum(1 for _ in maps)
    except (OSError, ValueError):
        return None
    return used, limit


def sampling_kind(entry: str) -> SamplingParams:
    """A request of the kind a ``server.warmup_sampling`` entry names: features of ``SAMPLING_FEATURES``
    or ``top_k=N`` joined by ``+`` (``"sample+top_p+logprobs"``). Raises ValueError naming the entry."""
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(f"warmup_sampling entry {entry!r}: expected features joined by '+', "
                         f"e.g. 'sample+top_p'; known: {sorted(SAMPLING_FEATURES)} and top_k=N")
    fields: dict[str, Any] = {}
    names = []
    for feature in (part.strip() for part in entry.split("+")):
        name, _, value = feature.partition("=")
        names.append(name)
        if name == "top_k":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"warmup_sampling entry {entry!r}: top_k needs its value, e.g. top_k=40 "
                                 f"(each power of two above it is a program of its own), got {feature!r}")
            fields["top_k"] = int(value)
        elif name in SAMPLING_FEATURES and not value:
            fields.update(SAMPLING_FEATURES[name])
        else:
            raise ValueError(f"warmup_sampling entry {entry!r}: unknown feature {feature!r}; known: "
                             f"{sorted(SAMPLING_FEATURES)} and top_k=N")
    if "sample" not in names and (unsampled := [n for n in names if n in SAMPLED_ONLY]):
        raise ValueError(f"warmup_sampling entry {entry!r}: {unsampled} act on sampled rows only; "
                         f"add 'sample' (e.g. 'sample+{unsampled[0]}')")
    return SamplingParams(**fields)


def sampling_flags(entries: Sequence[str], max_logprobs: int) -> list[SamplingFlags]:
    """The decode flags of batches of ``entries``' kinds (``sampling_kind``) on an engine of
    ``max_logprobs``, each once, in order: what ``warmup_plan(sampling=...)`` compiles besides greedy."""
    flags: list[SamplingFlags] = []
    for entry in entries:
        f = SamplingFlags.of([sampling_kind(entry)], max_logprobs)
        if f not in flags:
            flags.append(f)
    return flags


def describe_flags(flags: SamplingFlags) -> str:
    """``flags`` in ``server.warmup_sampling``'s words (``"sample+top_p+logprobs"``; ``"greedy"``)."""
    names = [name for name, on in (("sample", flags.sample), ("top_p", flags.top_p), ("min_p", flags.min_p),
                                   ("penalties", flags.edits), ("rejection", flags.rejection)) if on]
    if flags.top_k:
        names.insert(1, f"top_k({flags.top_k_candidates} candidates)")
    if flags.logprobs is not None:
        names.append("logprobs" if flags.logprobs == 0 else "top_logprobs")
    return "+".join(names) or "greedy"


@dataclasses.dataclass(frozen=True)
class Shape:
    """One program of an engine to compile.

    ``rows``: the running state's rows (decode, resize, release) or the prefill's rows (prefill,
    admit, write); ``size``: the attention window (decode) or the prompt bucket (prefill, admit, write);
    ``into``: the running state's rows an admission or a write goes into, or the rows a resize makes;
    ``distinct``: a shared prefill's rows of distinct prompts, whose pass is copied to its ``rows`` (0: a
    row per prompt); ``cached``: a paged admission's prefill runs over cached prefixes, ``size`` the bucket
    of the prompts' rest. ``write``: a paged prefill's K/V written into its pages without an admission
    (the first chunk of a prompt prefilled in chunks).
    """

    phase: str
    rows: int
    size: int = 0
    into: int = 0
    sampling: Any = None  # decode: the batch's ``SamplingFlags`` (None: greedy)
    block: int | None = None  # decode: an adaptive speculation block other than the engine's (1: target-only)
    distinct: int = 0
    cached: bool = False

    @property
    def lone(self) -> bool:
        """A lone request's admission: its prefill into a running state of its own (one row into one)."""
        return self.phase == "admit" and self.rows == self.into == 1

    def __str__(self) -> str:
        rows = f"{self.rows} row{'s' if self.rows > 1 else ''}"
        if self.phase == "decode":
            kind = ("" if self.sampling is None else f", {describe_flags(self.sampling)}") + (
                "" if self.block is None else f", block {self.block}")
            return f"decode{kind}, {rows}, attention window {self.size}"
        shared = f" sharing {self.distinct} prompt{'s' if self.distinct > 1 else ''}" if self.distinct else ""
        if self.phase == "prefill":
            return f"prefill, {rows}{shared}, prompt bucket {self.size}"
        if self.phase == "admit" and self.cached:
            return (f"admission of a {rows} prefill{shared} over cached prefixes (the rest's bucket {self.size}) "
                    f"into {self.into} rows")
        if self.lone:
            return f"a lone request's prefill into its own row, prompt bucket {self.size}"
        if self.phase == "admit":
            return f"admission of a {rows} prefill{shared} (bucket {self.size}) into {self.into} rows"
        if self.phase == "write":
            return f"a {rows} prefill (bucket {self.size}) written into the pages of {self.into} rows"
        if self.phase == "pages":
            return f"page tables of {rows} set"
        if self.phase == "resize":
            return f"resize, {self.rows} to {self.into} rows"
        return f"release, {rows}"


def warmup_plan(engine, batch_sizes: Sequence[int] | None = None, *, sampling: Sequence[Any] = ()) -> list[Shape]:
    """Every shape that requests of up to ``batch_sizes`` prompts at a time run (default: 1 and
    ``max_batch_size``), in the order a server meets them: a lone request's (decode on one row from
    the smallest window, its prefill into its own state by prompt bucket: an ``admit`` shape into one
    row), then a batch's (decode on the batch's rows, the one-row prefills admitted into it, the resizes
    between the states, the larger prefills, then the prefills of one prompt's ``n`` choices for each of
    those row counts above one), then the releases.
    A shared prefill's rows are admitted by the program of a plain prefill of as many rows; prefills
    mixing several prompts with choices (more distinct rows than one) compile when first met: ``n`` is
    unbounded, and their row combinations would double the prefills. ``sampling``: ``SamplingFlags``
    of sampled batches, each one more decode program per state and window, after the greedy one.

    A paged engine's plan has no prefill shapes: its admissions compile their prefills (of prompts with
    nothing cached) beside the state they join, and a ``pages`` shape per state follows its decode. Where
    a prefill over cached prefixes is one program per row count and bucket of the rest (the kernels:
    ``Engine.context_pages``), every admission has a twin over cached prefixes, after all the others; with
    ``prefill_chunk``, a chunk's write into each state follows."""
    sizes = sorted({1, engine.config.max_batch_size} if batch_sizes is None else set(batch_sizes))
    states = sorted({engine.state_rows(size) for size in sizes})  # one row, and the batch's
    prefills = sorted({engine.prefill_rows(n) for n in range(1, max(sizes) + 1)})
    buckets = [bucket for bucket, _ in engine.prompt_buckets()]
    largest = max(states)
    plan: list[Shape] = []
    for state in states:
        blocks = [None] + [b for b in getattr(engine, "speculation_blocks", ()) if b != engine.block_size]
        plan += [Shape("decode", state, window, sampling=flags, block=block) for window in engine.windows
                 for flags in (None, *sampling) for block in blocks]
        if state != largest:  # one row: a lone request, prefilled into a state of its own (one program)
            plan += [Shape("admit", 1, bucket, state) for bucket in buckets]
            continue
        for rows in prefills:  # the batch: every prefill joins it
            for bucket in buckets:
                if largest > 1 and Shape("prefill", rows, bucket) not in plan:  # into one row: the admission is it
                    plan.append(Shape("prefill", rows, bucket))
                plan.append(Shape("admit", rows, bucket, largest))
            if rows == 1:
                plan += [Shape("resize", a, 0, b) for a in states for b in states if a != b]
        shared = [(rows, bucket) for rows in prefills if rows > 1 for bucket in buckets]  # one prompt's n choices
        if getattr(engine, "paged", False):
            plan += [Shape("admit", rows, bucket, largest, distinct=1) for rows, bucket in shared]
        else:  # admitted by a plain prefill's program of as many rows
            plan += [Shape("prefill", rows, bucket, distinct=1) for rows, bucket in shared]
    if getattr(engine, "paged", False):
        # A paged prefill takes the running state (its pools): each admission compiles its prefill of prompts with
        # nothing cached beside it. A state's rows get page tables as they grow. Prefills over a cached prefix
        # whose page count varies with the prefix (the XLA attention's) compile when first met.
        plan = [s for s in plan if s.phase != "prefill"]
        for state in states:
            last = max(i for i, s in enumerate(plan) if s.phase == "decode" and s.rows == state)
            plan.insert(last + 1, Shape("pages", state))
        if engine.context_pages(0) == engine.max_pages:
            plan += [dataclasses.replace(s, cached=True) for s in plan if s.phase == "admit"]
        chunk = getattr(engine.config, "prefill_chunk", 0)
        if chunk and chunk < engine.config.max_prompt_length:
            bucket = next(b for b, _ in engine.prompt_buckets() if b >= chunk)
            plan += [Shape("write", 1, bucket, state) for state in states]
    return plan + [Shape("release", state) for state in states]


def first_request_shapes(engine, plan: Sequence[Shape], prompt_tokens: int, max_new_tokens: int, *,
                         sampling: SamplingFlags | None = None) -> list[Shape]:
    """The shapes in ``plan`` that a lone request with at most ``prompt_tokens`` prompt tokens and
    ``max_new_tokens`` new tokens runs: its prefill and admission by prompt bucket, and decode on one
    row at the windows the host picks for it (``ContinuousBatcher``: a call's window covers its row's
    start plus a block per step, up to the last block the request can write), with the decode flags
    ``sampling`` (None: a greedy request)."""
    prompt_tokens = max(1, min(prompt_tokens, engine.config.max_prompt_length))
    buckets = {bucket for bucket, shortest in engine.prompt_buckets() if shortest <= prompt_tokens}
    block, steps = engine.block_size, engine.config.steps_per_sync
    end = min(prompt_tokens + max_new_tokens, engine.config.max_length)  # the last block starts at end - 2
    def window(needed: int) -> int:
        return next((w for w in engine.windows if w >= needed), engine.windows[-1])

    smallest = window(min(1 + steps * block, min(1 + max_new_tokens, engine.config.max_length) - 2 + block))
    largest = window(end - 2 + block)
    return [s for s in plan if (s.lone and s.size in buckets and not s.cached)
            or (s.phase == "decode" and s.rows == 1 and smallest <= s.size <= largest and s.sampling == sampling)
            or (s.phase == "pages" and s.rows == 1)]


def staged_plan(engine, plan: Sequence[Shape], prompt_tokens: int, max_new_tokens: int,
                ) -> tuple[list[Shape], list[Shape]]:
    """``plan`` in the two parts of a server's staged start: the shapes of a lone greedy request with
    up to ``prompt_tokens`` prompt tokens and ``max_new_tokens`` new tokens (``first_request_shapes``),
    compiled before it binds; and the rest, for a ``BackgroundWarmup`` while it serves, what a lone
    request meets next first: longer prompts, the same request sampled (each of the plan's sampled
    decode flags, in order), longer answers; then the rest in plan order (batches' shapes)."""
    first = first_request_shapes(engine, plan, prompt_tokens, max_new_tokens)
    flags = list(dict.fromkeys(s.sampling for s in plan if s.phase == "decode" and s.sampling is not None))
    sampled = [s for f in flags for s in first_request_shapes(engine, plan, prompt_tokens, max_new_tokens, sampling=f)
               if s.phase == "decode"]
    longest = max((s.size for s in first if s.phase == "decode"), default=0)

    def order(shape: Shape) -> tuple[int, int]:
        if shape.lone:  # a lone request's, longer prompts
            return 0, 0
        if shape in sampled:  # each flags' windows together: a request meets all of them
            return 1, flags.index(shape.sampling)
        return (2 if shape.phase == "decode" and shape.rows == 1 and shape.size > longest else 3), 0

    return first, sorted((s for s in plan if s not in first), key=order)  # a stable sort: plan order within


def compiles_prefill(engine, shape: Shape) -> bool:
    """Whether ``shape`` is a prefill program of its own, which ``run_warmup`` may compile beside others: a
    prefill, or a lone request's prefill into its own state (an engine without pages; a paged admission
    compiles beside the state whose pools it reads)."""
    return shape.phase == "prefill" or (shape.lone and not getattr(engine, "paged", False))


def _rows_stand_in(compiled: jax.stages.Compiled, on_mesh: bool, output: int = 0, *, caches: bool = True) -> Any:
    """Zeros shaped and placed as the rows a compiled prefill returns first (``output``: another of its
    outputs, e.g. its last logits, -1): what an admission of its result compiles for. Only those: a paged
    prefill's other output is the state, whose pools may take most of the device's memory. Off a mesh
    they stay uncommitted to a device, as the outputs of a prefill of uncommitted inputs (``Engine._put``):
    a committed argument is another program for jit. ``caches`` False: the rows without their caches."""
    def zeros(info):
        return jax.device_put(np.zeros(info.shape, info.dtype), info.sharding if on_mesh else None)

    info = compiled.out_info[output]
    if not caches:
        info = dataclasses.replace(info, target_cache=None, draft_cache=None)
    return jax.tree.map(zeros, info)


class _Runner:
    """Compiles shapes of one engine, keeping the warm-up's own running states and prefill stand-ins."""

    def __init__(self, engine):
        self.engine = engine
        self.states: dict[int, Any] = {}
        self.prefilled: dict[tuple[int, int], Any] = {}
        self.drawn: set[int] = set()
        self.shortest = {bucket: shortest for bucket, shortest in engine.prompt_buckets()}

    def draw(self, compiled: jax.stages.Compiled) -> None:
        """The first-token draw of a compiled prefill's rows (one program per row count, run once on
        stand-ins): what a prefill with a sampled row, or one asking for logprobs, runs after it."""
        on_mesh = self.engine.mesh is not None
        rows = compiled.out_info[0].starts.shape[0]
        if rows not in self.drawn:
            self.drawn.add(rows)
            # the draw leaves the caches out (a lone request's state holds them whole): no stand-ins for them
            _, first = self.engine.draw_first(_rows_stand_in(compiled, on_mesh, caches=False), None,
                                              _rows_stand_in(compiled, on_mesh, -1))
            jax.block_until_ready(first)

    def state(self, rows: int):
        """The warm-up's running state of ``rows`` rows. A paged engine's states share one set of pools
        (they may take most of the device's memory): a state of another row count takes them over from
        the one there is (``Engine.resize``, a program of the plan), which then is gone."""
        if rows not in self.states:
            if getattr(self.engine, "paged", False) and self.states:
                _, other = self.states.popitem()
                self.states[rows] = self.engine.resize(other, [], rows=rows)
            else:
                self.states[rows] = self.engine.empty_state(rows)
        return self.states[rows]

    def prefill(self, rows: int, bucket: int, distinct: int = 0):
        if (rows, bucket, distinct) not in self.prefilled:
            compiled = self.engine.prefill_compiled(rows, self.shortest[bucket], distinct=distinct or None)
            self.prefilled[rows, bucket, distinct] = _rows_stand_in(compiled, self.engine.mesh is not None)
            self.draw(compiled)
        return self.prefilled[rows, bucket, distinct]

    def compile_prefill(self, shape: Shape) -> None:
        """A shape of ``compiles_prefill``, compiled (and its first-token draw)."""
        if shape.phase == "prefill":
            self.prefill(shape.rows, shape.size, shape.distinct)
        else:
            self.draw(self.engine.prefill_compiled(1, self.shortest[shape.size], alone=True))

    def run(self, shape: Shape) -> None:
        engine = self.engine
        paged = getattr(engine, "paged", False)
        if shape.phase == "decode":
            # Run for no step (a fixed loop: its serving count, on a state of free rows): the running
            # states the later phases compile for are then, as a server's, decode outputs.
            steps = None if engine.fixed_loop else 0
            flags = {} if shape.sampling is None else {"sampling": shape.sampling}
            if shape.block is not None:
                flags["block"] = shape.block
            self.states[shape.rows], _ = engine.decode(self.state(shape.rows), steps, window=shape.size, **flags)
            jax.block_until_ready(self.states[shape.rows].starts)
        elif compiles_prefill(engine, shape):
            self.compile_prefill(shape)
        elif shape.phase == "admit" and paged:  # its prefill reads the state's pools: compiled beside it
            state = self.state(shape.into)
            compiled, admission = engine.prefill_paged_compiled(
                state, shape.rows, self.shortest[shape.size], distinct=shape.distinct or None,
                context_pages=engine.max_pages if shape.cached else 0)
            self.draw(compiled)
            rows = _rows_stand_in(compiled, False)
            self.states[shape.into] = engine.admit_paged(state, rows, range(shape.rows), admission)
            jax.block_until_ready(self.states[shape.into].starts)
        elif shape.phase == "write":
            state = self.state(shape.into)
            compiled, admission = engine.prefill_paged_compiled(state, shape.rows, self.shortest[shape.size])
            self.states[shape.into] = engine.write_pages(state, _rows_stand_in(compiled, False), admission)
            jax.block_until_ready(self.states[shape.into].starts)
        elif shape.phase == "admit":
            rows = self.prefill(shape.rows, shape.size, shape.distinct)
            self.states[shape.into] = engine.admit(self.state(shape.into), rows, range(shape.rows))
            jax.block_until_ready(self.states[shape.into].starts)
        elif shape.phase == "pages":
            self.states[shape.rows] = engine.set_pages(self.state(shape.rows), {0: [0]})
            jax.block_until_ready(self.states[shape.rows].starts)
        elif shape.phase == "resize":
            resized = engine.resize(self.state(shape.rows), [0], rows=shape.into)
            if paged:  # the pools moved into the new state (donated)
                del self.states[shape.rows]
                self.states[shape.into] = resized
            jax.block_until_ready(resized.starts)
        elif shape.phase == "release":
            self.states[shape.rows] = engine.release(self.state(shape.rows), [0])
            jax.block_until_ready(self.states[shape.rows].starts)
        else:
            raise ValueError(f"unknown warm-up phase {shape.phase!r}; expected one of {PHASES}")


def run_warmup(engine, shapes: Sequence[Shape], *, threads: int = 1,
               on_shape: Callable[[int, Shape], None] | None = None,
               stop: threading.Event | None = None) -> int:
    """Compiles ``shapes`` in order (``on_shape(index, shape)`` before each); with ``threads`` > 1
    the prefills are compiled on that many threads at once first (XLA compiles outside the GIL).
    Stops early once ``stop`` is set, or once the process holds more than ``MAPPINGS_SHARE`` of the memory
    mappings Linux allows it (warning). Returns the number of shapes done."""
    runner = _Runner(engine)
    pooled = False
    for i, shape in enumerate(shapes):
        if stop is not None and stop.is_set():
            return i
        mappings = memory_mappings()
        if mappings is not None and mappings[0] > MAPPINGS_SHARE * mappings[1]:
            log.warning("warm-up: stopped before %s: the process holds %d of the %d memory mappings Linux allows "
                        "it (vm.max_map_count; each compiled program maps its kernels); the %d shapes left compile "
                        "when a request meets them. Raising the cap (sysctl -w vm.max_map_count=262144) lets "
                        "them all compile", shape, *mappings, len(shapes) - i)
            return i
        prefill = compiles_prefill(engine, shape)
        if prefill and pooled:
            continue  # compiled in the pool
        if on_shape is not None:
            on_shape(i, shape)
        prefills = [s for s in shapes[i:] if compiles_prefill(engine, s)] if prefill else []
        if threads > 1 and len(prefills) > 1:
            with concurrent.futures.ThreadPoolExecutor(min(threads, len(prefills))) as pool:
                list(pool.map(runner.compile_prefill, prefills))  # re-raises a failed compile
            pooled = True
        else:
            runner.run(shape)
    return len(shapes)


class BackgroundWarmup:
    """Compiles shapes on a daemon thread while the engine serves; ``stop`` ends it after the shape in
    progress. A request meeting a shape not compiled yet compiles it itself (correct, only slower)."""

    def __init__(self, engine, shapes: Sequence[Shape], logger: logging.Logger = log):
        self.engine, self.shapes, self.log = engine, list(shapes), logger
        self.done = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="warmup", daemon=True)

    def start(self) -> "BackgroundWarmup":
        if self.shapes:
            self.log.info("warm-up: compiling the other %d shapes in the background while serving (a request "
                          "meeting one first compiles it itself)", len(self.shapes))
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def finished(self) -> bool:
        return self.done == len(self.shapes)

    def _run(self) -> None:
        t0 = time.perf_counter()
        last = t0

        def progress(i: int, shape: Shape) -> None:
            nonlocal last
            self.done = i
            now = time.perf_counter()
            if now - last >= 30:  # now and then: it runs for minutes on a CPU
                self.log.info("warm-up: %d of %d background shapes compiled (%.0f s); now %s", i,
                              len(self.shapes), now - t0, shape)
                last = now

        try:
            self.done = run_warmup(self.engine, self.shapes, on_shape=progress, stop=self._stop)
        except Exception as err:  # a compile that fails here fails again, and is reported, for its request
            self.error = err
            self.log.warning("warm-up: background compilation stopped: %s", err)
            return
        if self.finished:
            self.log.info("warm-up: every shape compiled (%d in the background in %.0f s)", len(self.shapes),
                          time.perf_counter() - t0)


__all__ = ["BackgroundWarmup", "SAMPLING_FEATURES", "Shape", "compiles_prefill", "describe_flags", "first_request_shapes", "run_warmup",
           "sampling_flags", "sampling_kind", "staged_plan", "warmup_plan"]
