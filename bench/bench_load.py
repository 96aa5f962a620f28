"""Speculation under load: tokens/s of target-only decoding, DFlash at a fixed block of 16 and adaptive
DFlash (``EngineConfig.speculation: adaptive``) per batch size, context and acceptance level.

Qwen3-8B shapes with random bf16 weights: the target made to repeat its last token
(``synthetic.repeat_target``: same shapes, same step cost) and a 5-layer block-16 drafter whose drafts
are right with a chosen per-position rate (``synthetic.SyntheticDrafter``), so acceptance is known:
each level is given as the tau a block of 16 reaches (``--taus``). Per (context, batch):

- the step costs of the adaptive engine's blocks (16, 8, 4 and its target-only step) and of a plain
  target-only engine, by synchronised calls (the b16 DFlash step / target step ratio comes from them);
- per acceptance level, ``--calls`` synchronised decode calls of ``--steps`` steps from a fresh state in
  each mode, tokens/s = committed tokens / seconds: target-only (the plain engine), fixed block 16, and
  adaptive, where before every call ``runtime.speculation.SpeculationPolicy`` (the batcher's policy,
  with the step costs measured here) picks the block from the rows' acceptance seen so far.

Compilation dominates (five decode programs per context and batch): ``--budget-s`` stops the sweep
before a configuration that would start past it, and says what it skipped.

    python3 bench/bench_load.py --json /tmp/load.json                   # default: context 1k, batches 1,16,32,4; < 4 min
    python3 bench/bench_load.py --batches 1,2,4,8,16,32,64 --contexts 1024,8192 --budget-s 3000   # the full sweep
    python3 bench/bench_load.py --contexts 32768 --batches 1,4 --window 2048   # long context, windowed drafter
    JAX_PLATFORMS=cpu python3 bench/bench_load.py --tiny --json /tmp/load_tiny.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import timing
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.runtime.speculation import SpeculationPolicy, expected_tokens, rate_for_tau
from dflash_jax.synthetic import repeat_target, set_accept_rate, synthetic_drafter
from dflash_jax.tiny import tiny_target_config


def fresh_state(engine: Engine, batch: int, context: int, seed: int):
    """``timing.synthetic_state`` whose rows each hold one repeated token (what the repeat target
    generates after it): random caches, every row live at ``context``."""
    state = timing.synthetic_state(engine, batch, context, seed=seed)
    token = 1 + (jnp.arange(batch, dtype=jnp.int32) * 7919) % (engine.vocab_size - 2)
    return dataclasses.replace(state, tokens=jnp.broadcast_to(token[:, None], state.tokens.shape))


def call(engine: Engine, state, steps: int, block: int | None):
    """One synchronised decode call: (state, snapshot on the host, seconds)."""
    t0 = time.perf_counter()
    state, snap = engine.decode(state, steps, block=block)
    snap = jax.device_get(snap)
    return state, snap, time.perf_counter() - t0


def step_cost(engine: Engine, batch: int, context: int, steps: int, repeats: int, block: int | None) -> float:
    """Median seconds per step of ``repeats`` synchronised calls after a compiling one."""
    state = fresh_state(engine, batch, context, seed=batch)
    state, _, _ = call(engine, state, steps, block)
    times = []
    for _ in range(repeats):
        state, snap, seconds = call(engine, state, steps, block)
        times.append(seconds / steps)
    del state
    return statistics.median(times)


def run_mode(engine: Engine, batch: int, context: int, steps: int, calls: int, mode: str,
             costs: dict) -> dict:
    """``calls`` timed decode calls after an untimed one, from a fresh state: tokens/s, tau and the blocks
    run (adaptive: chosen per call by the policy, from the acceptance seen in the calls before; the
    untimed call is its first, at the prior)."""
    state = fresh_state(engine, batch, context, seed=batch + 11)
    policy = SpeculationPolicy(engine.speculation_blocks, costs) if mode == "adaptive" else None
    rows = [policy.new_row() for _ in range(batch)] if policy else []
    seen = np.zeros(batch, np.int64)
    seconds, blocks = 0.0, []
    for call_index in range(calls + 1):
        block = {"fixed": engine.block_size, "target_only": None}.get(mode)
        if policy is not None:
            block = policy.choose(rows, batch).block
        state, snap, t = call(engine, state, steps, block)
        if call_index == 0:
            start = np.asarray(snap.starts).copy()
        else:
            seconds += t
            blocks.append(block or 1)
        if policy is not None:
            for r, row in enumerate(rows):
                n = int(snap.num_steps[r])
                policy.observe(row, snap.accepted[r, seen[r]:n].tolist(), block)
                seen[r] = n
    tokens = int((np.asarray(snap.starts) - start).sum())
    del state
    return dict(tok_s=tokens / seconds, tau=tokens / (batch * calls * steps), blocks=blocks)


def bench_context(args, target, drafter, context: int, t_start: float, report: dict) -> None:
    blocks = tuple(int(b) for b in args.blocks.split(","))
    room = drafter.config.block_size * args.steps * (args.calls + 3) + 64
    cfg = EngineConfig(max_batch_size=1, max_length=context + room, prompt_buckets=(16,), steps_per_sync=args.steps,
                       speculation="adaptive", speculation_blocks=blocks, drafter_context_window=args.window)
    spec, plain = Engine(target, drafter, cfg), Engine(target, None, cfg)
    rates = {tau: rate_for_tau(tau, drafter.config.block_size) for tau in args.taus}
    for batch in args.batches:
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            report["skipped"].append(dict(context=context, batch=batch))
            print(f"context {context}, batch {batch}: skipped, {elapsed:.0f} s past the --budget-s", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            costs = {(batch, b): step_cost(spec, batch, context, args.steps, args.repeats, b)
                     for b in spec.speculation_blocks}
            target_step = step_cost(plain, batch, context, args.steps, args.repeats, None)
            entry = dict(context=context, batch=batch, target_step_s=target_step,
                         step_s={str(b): c for (_, b), c in costs.items()},
                         dflash_step_ratio={str(b): c / target_step for (_, b), c in costs.items()}, levels=[])
            for tau, rate in rates.items():
                set_accept_rate(spec, rate)
                level = dict(tau16=tau, rate=rate)
                for mode, engine in (("target_only", plain), ("fixed", spec), ("adaptive", spec)):
                    level[mode] = run_mode(engine, batch, context, args.steps, args.calls, mode, costs)
                level["expected_fixed_tok_s"] = batch * expected_tokens(rate, spec.block_size) / costs[(batch, spec.block_size)]
                entry["levels"].append(level)
        except Exception as err:  # noqa: BLE001 - e.g. out of memory at the largest shapes: keep the rest
            entry = dict(context=context, batch=batch, error=repr(err)[:500])
            print(f"context {context}, batch {batch}: failed: {err!r:.300}", flush=True)
        entry["wall_s"] = time.perf_counter() - t0
        report["results"].append(entry)
        timing.write_json(args.json, report)
        if "error" not in entry:
            print_entry(entry)
        gc.collect()
    del spec, plain
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
    for e in report["results"]:
        if "error" not in e and e["batch"] in (16, 32) and "16" in e["dflash_step_ratio"]:
            print(f"batch {e['batch']}, context {e['context']}: the DFlash block-16 step costs "
                  f"{e['dflash_step_ratio']['16']:.2f} target steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,32,4", help="batch sizes, in this order (the full sweep: 1,2,4,8,16,32,64)")
    ap.add_argument("--contexts", default="1024", help="context lengths (the full sweep: 1024,8192; 32768 optional)")
    ap.add_argument("--taus", default="1.5,3,6", help="acceptance levels: tau of a block of 16 (1 to 16)")
    ap.add_argument("--blocks", default="16,8,4", help="EngineConfig.speculation_blocks")
    ap.add_argument("--window", type=int, default=0, help="EngineConfig.drafter_context_window (0: none)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per call")
    ap.add_argument("--calls", type=int, default=6, help="decode calls per mode and level")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per step cost")
    ap.add_argument("--layers", type=int, default=36, help="the target's layers")
    ap.add_argument("--budget-s", type=float, default=150.0, help="start no configuration past this many seconds")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, contexts 64 and batches 1,2: a CPU smoke test")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args()
    if args.tiny:
        args.batches, args.contexts, args.steps, args.calls, args.repeats = "1,2", "64", 2, 3, 1
    args.batches = [int(b) for b in args.batches.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.taus = [float(t) for t in args.taus.split(",")]

    t_start = time.perf_counter()
    print(timing.device_line(), flush=True)
    tcfg = tiny_target_config(num_layers=4) if args.tiny else timing.qwen3_8b(args.layers)
    target, base = timing.random_pair(tcfg)
    target = repeat_target(target)
    drafter = synthetic_drafter(base, 0.0)
    del base
    report = dict(config={k: v for k, v in vars(args).items()}, device=timing.device_line(), results=[], skipped=[])
    print(f"models built in {time.perf_counter() - t_start:.1f} s", flush=True)
    for context in args.contexts:
        bench_context(args, target, drafter, context, t_start, report)
    report["wall_s"] = time.perf_counter() - t_start
    timing.write_json(args.json, report)
    print_table(report)
    if report["skipped"]:
        print(f"skipped past --budget-s {args.budget_s:.0f}: {report['skipped']}")
    print(f"total {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
