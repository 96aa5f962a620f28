"""Speculation under load: tokens/s of target-only decoding, DFlash at a fixed block of 16 and adaptive
DFlash (``EngineConfig.speculation: adaptive``) per batch size, context and acceptance level.

Qwen3-8B shapes with random bf16 weights: the target made to repeat its last token
(``synthetic.repeat_target``: same shapes, same step cost) and a 5-layer block-16 drafter whose drafts
are right with a chosen per-position rate (``synthetic.SyntheticDrafter``; each row draws its own,
keyed by its first token, recorded as ``first_tokens``), so acceptance is known: each level is given as
the tau a block of 16 reaches (``--taus``). Per context (``--sweep``, each with
its batch sizes), first every decode program of the context is compiled, in parallel
(``--compile-threads``: XLA compiles outside the GIL; the tracing runs on this thread meanwhile), then
per batch size, each measurement from the same random rows (made again for each, one state on the
device at a time; a batch whose state would not fit the device's free memory is skipped, saying so):

- the step costs of the adaptive engine's blocks (16, 8, 4 and its target-only step, whose taps
  feed the drafter's context in one projection per call) and of a plain target-only engine, by synchronised calls (the block-16
  DFlash step / target step ratio comes from them);
- ``--calls`` synchronised decode calls of ``--steps`` steps after an untimed one, tokens/s =
  committed tokens / seconds: target-only (the plain engine, once: it does not depend on the level),
  and per acceptance level fixed block 16 and adaptive, where before every call
  ``runtime.speculation.SpeculationPolicy`` (the batcher's policy, with the step costs measured here)
  picks the block from the rows' acceptance seen so far.

Compiling and measuring never overlap (XLA's autotuning runs on the device). ``--budget-s`` starts no
context's compilation and no batch's measurement past it, and says what it skipped; the JSON is
rewritten after every batch. ``--png`` (default: beside ``--json``) plots the JSON (``plot_load.py``;
skipped without matplotlib).

    python3 bench/bench_load.py --json $OUT/load.json        # the sweep below on one H200, < 240 s
    python3 bench/bench_load.py --sweep 32768:1,4 --window 2048 --json /tmp/w.json   # windowed drafter
    JAX_PLATFORMS=cpu python3 bench/bench_load.py --tiny --json /tmp/load_tiny.json  # CPU smoke test
    python3 bench/plot_load.py /tmp/load_tiny.json --png /tmp/load_tiny.png           # the plot alone
    python3 bench/simulate_speculation.py /tmp/load_tiny.json   # the policy replayed on the measured costs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring

import timing
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.runtime.speculation import SpeculationPolicy, expected_tokens, rate_for_tau
from dflash_jax.synthetic import repeat_target, set_accept_rate, synthetic_drafter
from dflash_jax.tiny import tiny_target_config

# Context 1k at every batch size, then long contexts at a few (the drafter's context pass grows with it).
DEFAULT_SWEEP = ("1024:1,2,4,8,16,32,64", "8192:1,16", "32768:1,4")
TINY_SWEEP = ("64:1,2", "128:1")


def parse_sweep(items) -> list[tuple[int, list[int]]]:
    """``["CONTEXT:B,B,...", ...]`` -> ``[(context, [batch, ...]), ...]`` (a clear error for a bad item)."""
    sweep = []
    for item in items:
        context, _, batches = item.partition(":")
        try:
            sweep.append((int(context), [int(b) for b in batches.split(",")]))
        except ValueError:
            raise SystemExit(f"--sweep {item!r}: expected CONTEXT:BATCH,BATCH,... (e.g. 1024:1,2,4)") from None
    return sweep


def fresh_state(engine: Engine, batch: int, context: int, seed: int):
    """``timing.synthetic_state`` whose rows each hold one repeated token (what the repeat target
    generates after it): random caches, every row live at ``context``."""
    state = timing.synthetic_state(engine, batch, context, seed=seed)
    return dataclasses.replace(state, tokens=jnp.broadcast_to(row_tokens(engine, batch)[:, None], state.tokens.shape))


def row_tokens(engine: Engine, batch: int) -> jax.Array:
    """The token each of ``fresh_state``'s rows repeats: distinct per row (the synthetic drafter's row key)."""
    return 1 + (jnp.arange(batch, dtype=jnp.int32) * 7919) % (engine.vocab_size - 2)


@dataclasses.dataclass(frozen=True)
class Rows:
    """The random rows every measurement of one (context, batch) starts from: ``fresh_state(spec, ...)``,
    made again for each (the same seed gives the same values), so that one state at a time is on the
    device. A copy of one kept state held two: at batch 64, 1k context, 8B shapes, ~25 GB each, more than
    an 80 GB card holds beside the weights."""

    spec: Engine
    batch: int
    context: int
    seed: int

    def state(self):
        return fresh_state(self.spec, self.batch, self.context, self.seed)

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(self.state)))


def state_for(engine: Engine, rows: Rows):
    """``rows``' state for ``engine`` (decode donates its state: every measurement starts from its own);
    a target-only engine's has no drafter cache."""
    state = rows.state()
    return dataclasses.replace(state, draft_cache=None) if engine.drafter is None else state


def free_device_bytes() -> int | None:
    """Bytes the first device's allocator can still give (None where it does not say)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def too_large(rows: Rows, free: int | None) -> str | None:
    """Why ``rows`` cannot be measured here (its state and the decode's temporaries, ~10% more, past
    the device's free memory: XLA's allocator would wait and retry instead of failing), or None."""
    need = rows.nbytes()
    if free is None or need * 1.1 <= free:
        return None
    return f"its state needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free on the device"


def call(engine: Engine, state, steps: int, block: int | None, timed: "CompileCounter | None" = None):
    """One synchronised decode call: (state, snapshot on the host, seconds). ``timed``: a timed call,
    whose compilations (none expected) the counter records as such."""
    was = timed is not None and timed.timing
    if timed is not None:
        timed.timing = True
    t0 = time.perf_counter()
    state, snap = engine.decode(state, steps, block=block)
    snap = jax.device_get(snap)
    seconds = time.perf_counter() - t0
    if timed is not None:
        timed.timing = was
    return state, snap, seconds


class CompileCounter:
    """Counts XLA compilations by function name while ``active`` (a decode program compiled during
    the measurement would mean the parallel compilation missed it), and apart those inside a timed
    call (``timing``: a compilation there would be in a tokens/s)."""

    def __init__(self):
        self.active, self.timing, self.names, self.timed_names = False, False, [], []
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event.endswith("backend_compile_duration"):
            name = str(kwargs.get("fun_name", "?"))
            if self.active:
                self.names.append(name)
            if self.timing:
                self.timed_names.append(name)


def compile_context(engines: dict, batches: list[int], context: int, steps: int, threads: int,
                    deadline: float) -> dict:
    """Compiles the decode program of every (engine, batch, block) of a context: traced and lowered here
    one by one (Python, under the GIL; ``Engine.decode_lowered``), each compiled on a pool of
    ``threads`` as soon as it is lowered. A later ``engine.decode`` of a state of the same shapes runs
    the compiled program. Lowers nothing past ``deadline`` (``time.perf_counter()``). Returns the
    batches whose programs all compiled, and the timings."""
    t0 = time.perf_counter()
    jobs = [(batch, engine, block) for batch in batches for engine in engines.values()
            for block in (engine.speculation_blocks if engine.drafter is not None else (None,))]
    pending = {batch: 0 for batch in batches}  # programs of each batch not (yet) compiled
    futures, lowering_s, failed = [], 0.0, {}
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for batch, engine, block in jobs:
            pending[batch] += 1
            if time.perf_counter() > deadline or batch in failed:
                continue
            try:
                shapes = jax.eval_shape(lambda: fresh_state(engine, batch, context, seed=0))
                t = time.perf_counter()
                lowered = engine.decode_lowered(shapes, steps, block=block)
                lowering_s += time.perf_counter() - t
                futures.append((batch, pool.submit(lowered.compile)))
            except Exception as err:  # noqa: BLE001 - reported with the batch, the others go on
                failed[batch] = repr(err)[:300]
        for batch, future in futures:
            try:
                future.result()
                pending[batch] -= 1
            except Exception as err:  # noqa: BLE001 - e.g. out of memory while autotuning
                failed[batch] = repr(err)[:300]
    return dict(context=context, programs=len(futures), of=len(jobs), threads=threads, lowering_s=lowering_s,
                wall_s=time.perf_counter() - t0, ready=[b for b in batches if pending[b] == 0], failed=failed)


def step_cost(engine: Engine, rows: Rows, steps: int, repeats: int, block: int | None, counter: CompileCounter) -> float:
    """Median seconds per step of ``repeats`` synchronised calls after an untimed one."""
    state, _, _ = call(engine, state_for(engine, rows), steps, block)
    times = []
    for _ in range(repeats):
        state, _, seconds = call(engine, state, steps, block, timed=counter)
        times.append(seconds / steps)
    del state
    return statistics.median(times)


def run_mode(engine: Engine, rows: Rows, steps: int, calls: int, mode: str, costs: dict, counter: CompileCounter) -> dict:
    """``calls`` timed decode calls after an untimed one, from ``rows``: tokens/s, tau and the blocks run
    (adaptive: chosen per call by the policy, from the acceptance seen in the calls before; the untimed
    call is its first, at the prior)."""
    batch = rows.batch
    state = state_for(engine, rows)
    policy = SpeculationPolicy(engine.speculation_blocks, costs) if mode == "adaptive" else None
    beliefs = [policy.new_row() for _ in range(batch)] if policy else []  # the policy's view of each row
    seen = np.zeros(batch, np.int64)
    seconds, blocks = 0.0, []
    for call_index in range(calls + 1):
        block = {"fixed": engine.block_size, "target_only": None}.get(mode)
        if policy is not None:
            block = policy.choose(beliefs, batch).block
        state, snap, t = call(engine, state, steps, block, timed=counter if call_index else None)
        if call_index == 0:
            start = np.asarray(snap.starts).copy()
        else:
            seconds += t
            blocks.append(block or 1)
        if policy is not None:
            for r, belief in enumerate(beliefs):
                n = int(snap.num_steps[r])
                policy.observe(belief, snap.accepted[r, seen[r]:n].tolist(), block)
                seen[r] = n
    tokens = int((np.asarray(snap.starts) - start).sum())
    del state
    return dict(tok_s=tokens / seconds, tau=tokens / (batch * calls * steps), blocks=blocks)


def bench_batch(args, spec: Engine, plain: Engine, rates: dict, batch: int, context: int,
                counter: CompileCounter) -> dict:
    """One (context, batch): the step costs, then target-only once and fixed / adaptive per level."""
    rows = Rows(spec, batch, context, seed=batch)
    costs = {(batch, b): step_cost(spec, rows, args.steps, args.repeats, b, counter) for b in spec.speculation_blocks}
    target_step = step_cost(plain, rows, args.steps, args.repeats, None, counter)
    entry = dict(context=context, window=args.window, batch=batch, target_step_s=target_step,
                 first_tokens=np.asarray(row_tokens(spec, batch)).tolist(),  # the synthetic drafter's row keys
                 step_s={str(b): c for (_, b), c in costs.items()},
                 dflash_step_ratio={str(b): c / target_step for (_, b), c in costs.items()}, levels=[])
    target_only = run_mode(plain, rows, args.steps, args.calls, "target_only", costs, counter)
    for tau, rate in rates.items():
        set_accept_rate(spec, rate)
        level = dict(tau16=tau, rate=rate, target_only=target_only)
        for mode in ("fixed", "adaptive"):
            level[mode] = run_mode(spec, rows, args.steps, args.calls, mode, costs, counter)
        level["expected_fixed_tok_s"] = batch * expected_tokens(rate, spec.block_size) / costs[(batch, spec.block_size)]
        entry["levels"].append(level)
    return entry


def bench_context(args, models: Engine, context: int, batches: list[int], t_start: float, report: dict,
                  counter: CompileCounter) -> None:
    """The engines of one context, on ``models``' copy of the weights (``Engine.derive``)."""
    blocks = tuple(int(b) for b in args.blocks.split(","))
    drafter = models.drafter
    room = drafter.config.block_size * args.steps * (args.calls + 3) + 64
    cfg = EngineConfig(max_batch_size=1, max_length=context + room, prompt_buckets=(16,), steps_per_sync=args.steps,
                       speculation="adaptive", speculation_blocks=blocks, drafter_context_window=args.window)
    engines = dict(spec=models.derive(cfg), plain=models.derive(cfg, drafter=None))
    spec, plain = engines["spec"], engines["plain"]
    compiled = compile_context(engines, batches, context, args.steps, args.compile_threads,
                               deadline=t_start + args.budget_s)
    report["compile"].append(compiled)
    print(f"context {context}: {compiled['programs']} of {compiled['of']} decode programs compiled in "
          f"{compiled['wall_s']:.0f} s on {compiled['threads']} threads (tracing and lowering "
          f"{compiled['lowering_s']:.0f} s of it)" + (f"; failed: {compiled['failed']}" if compiled["failed"] else ""),
          flush=True)
    rates = {tau: rate_for_tau(tau, drafter.config.block_size) for tau in args.taus}
    for batch in batches:
        elapsed = time.perf_counter() - t_start
        why = ("not compiled" if batch not in compiled["ready"] else
               f"{elapsed:.0f} s past the --budget-s" if elapsed > args.budget_s else
               too_large(Rows(spec, batch, context, seed=batch), free_device_bytes()))
        if why:
            report["skipped"].append(dict(context=context, batch=batch, why=why))
            print(f"context {context}, batch {batch}: skipped, {why}", flush=True)
            continue
        t0 = time.perf_counter()
        counter.active, before, timed_before = True, len(counter.names), len(counter.timed_names)
        try:
            entry = bench_batch(args, spec, plain, rates, batch, context, counter)
        except Exception as err:  # noqa: BLE001 - e.g. out of memory at the largest shapes: keep the rest
            entry = dict(context=context, batch=batch, error=repr(err)[:500])
            print(f"context {context}, batch {batch}: failed: {err!r:.300}", flush=True)
        counter.active = False
        entry["compiled_while_measuring"] = sorted(set(counter.names[before:]))
        entry["compiled_while_timing"] = sorted(set(counter.timed_names[timed_before:]))  # in a tokens/s
        entry["wall_s"] = time.perf_counter() - t0
        report["results"].append(entry)
        timing.write_json(args.json, report)
        if "error" not in entry:
            print_entry(entry)
        gc.collect()
    del engines, spec, plain
    gc.collect()


def print_entry(e: dict) -> None:
    ratios = ", ".join(f"b{b} {r:.2f}" for b, r in e["dflash_step_ratio"].items())
    print(f"context {e['context']}, batch {e['batch']}: target step {e['target_step_s'] * 1e3:.2f} ms; DFlash step / "
          f"target step: {ratios} ({e['wall_s']:.0f} s)", flush=True)


def print_table(report: dict) -> None:
    print("\ncontext | batch | tau@16 | target-only tok/s | fixed-16 tok/s (x) | adaptive tok/s (x) | adaptive blocks")
    for e in report["results"]:
        if "error" in e:
            print(f"{e['context']:7d} | {e['batch']:5d} | failed: {e['error'][:80]}")
            continue
        for lv in e["levels"]:
            base = lv["target_only"]["tok_s"]
            fixed, adaptive = lv["fixed"]["tok_s"], lv["adaptive"]["tok_s"]
            used = sorted(set(lv["adaptive"]["blocks"]), reverse=True)
            print(f"{e['context']:7d} | {e['batch']:5d} | {lv['tau16']:6.2f} | {base:17.1f} | {fixed:9.1f} ({fixed / base:4.2f}) "
                  f"| {adaptive:9.1f} ({adaptive / base:4.2f}) | {','.join(map(str, used))}")
    print("\nDFlash step / target-only step, per block (1: target-only steps of the speculative engine)")
    for e in report["results"]:
        if "error" not in e:
            print(f"context {e['context']:6d}, batch {e['batch']:3d}: "
                  + ", ".join(f"b{b} {r:.2f}" for b, r in e["dflash_step_ratio"].items()))
    for e in report["results"]:
        if "error" not in e and e["batch"] in (16, 32) and "16" in e["dflash_step_ratio"]:
            print(f"batch {e['batch']}, context {e['context']}: the DFlash block-16 step costs "
                  f"{e['dflash_step_ratio']['16']:.2f} target steps")
    stray = sorted({n for e in report["results"] for n in e.get("compiled_while_measuring", ()) if "decode" in n})
    if stray:  # its compile fell in an untimed call, but the sweep took longer than it had to
        print(f"WARNING: decode programs compiled while measuring, not in parallel beforehand: {stray}")
    timed = sorted({n for e in report["results"] for n in e.get("compiled_while_timing", ())})
    if timed:  # the compile's seconds are in a tokens/s or a step cost
        print(f"WARNING: compiled inside timed calls: {timed}")


def default_threads() -> int:
    """The compile pool: one thread per core but the one tracing, at most 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(16, cores - 1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="append", default=None, metavar="CONTEXT:B,B,...",
                    help=f"a context and its batch sizes, in order; repeatable (default: {' '.join(DEFAULT_SWEEP)})")
    ap.add_argument("--contexts", default=None, help="with --batches: every context at every batch (instead of --sweep)")
    ap.add_argument("--batches", default=None, help="with --contexts (default 1024): the batch sizes, e.g. 1,16")
    ap.add_argument("--taus", default="1.5,3,6", help="acceptance levels: tau of a block of 16 (1 to 16)")
    ap.add_argument("--blocks", default="16,8,4", help="EngineConfig.speculation_blocks")
    ap.add_argument("--window", type=int, default=0, help="EngineConfig.drafter_context_window (0: none)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per call")
    ap.add_argument("--calls", type=int, default=6, help="timed decode calls per mode and level")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per step cost")
    ap.add_argument("--layers", type=int, default=36, help="the target's layers")
    ap.add_argument("--compile-threads", type=int, default=default_threads(), help="parallel XLA compilations")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no context's compilation and no batch's measurement past this many seconds "
                         "(default: 190; none with --tiny)")
    ap.add_argument("--tiny", action="store_true", help=f"tiny shapes, sweep {' '.join(TINY_SWEEP)}: a CPU smoke test")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--png", default=None, help="plot the report here (default: the --json path with .png)")
    args = ap.parse_args(argv)
    if args.batches or args.contexts:
        if args.sweep:
            raise SystemExit("give --sweep, or --contexts and --batches, not both")
        batches = args.batches or "1,2,4,8,16,32,64"
        args.sweep = [f"{c}:{batches}" for c in (args.contexts or "1024").split(",")]
    if args.tiny:
        args.sweep, args.steps, args.calls, args.repeats = args.sweep or list(TINY_SWEEP), 2, 3, 1
    if args.budget_s is None:
        args.budget_s = float("inf") if args.tiny else 190.0
    sweep = parse_sweep(args.sweep or DEFAULT_SWEEP)
    args.taus = [float(t) for t in args.taus.split(",")]

    t_start = time.perf_counter()
    counter = CompileCounter()
    print(timing.device_line(), flush=True)
    tcfg = tiny_target_config(num_layers=4) if args.tiny else timing.qwen3_8b(args.layers)
    target, random_drafter = timing.random_pair(tcfg, drafter_layers=timing.drafter_layers(args.tiny))
    # Every engine is derived from this one: the weights are held once, in the serving layout.
    models = Engine(repeat_target(target), synthetic_drafter(random_drafter, 0.0),
                    EngineConfig(max_batch_size=1, max_length=64, prompt_buckets=(16,)))
    del target, random_drafter
    report = dict(config={**vars(args), "sweep": [f"{c}:{','.join(map(str, b))}" for c, b in sweep]},
                  device=timing.device_line(), results=[], skipped=[], compile=[])
    print(f"models built in {time.perf_counter() - t_start:.1f} s", flush=True)
    for context, batches in sweep:
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            report["skipped"] += [dict(context=context, batch=b, why=f"{elapsed:.0f} s past the --budget-s")
                                  for b in batches]
            print(f"context {context}: skipped, {elapsed:.0f} s past the --budget-s", flush=True)
            continue
        bench_context(args, models, context, batches, t_start, report, counter)
    report["wall_s"] = time.perf_counter() - t_start
    timing.write_json(args.json, report)
    print_table(report)
    if report["skipped"]:
        print(f"skipped: {report['skipped']}")
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        import plot_load

        plot_load.plot(report, png)
    print(f"total {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
