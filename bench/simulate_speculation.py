"""Adaptive speculation offline: ``runtime.speculation.SpeculationPolicy`` replayed on the step costs a
``bench_load.py`` JSON measured, with the synthetic drafter's acceptance (``dflash_jax.synthetic``), no device.

Per measured (context, batch, acceptance level) it runs what ``bench_load.run_mode`` runs: an untimed decode
call, then ``--calls`` calls of ``--steps`` steps, each call's block chosen by the policy from the
acceptance seen so far (adaptive), or block 16 (fixed); a call's seconds are its steps times the measured
``step_s`` of its block (per-call host overhead left out, the same for every mode). Acceptance:

- exact: the synthetic drafter's own draws (``jax.random`` keyed by seed, the row's first token where the
  report lists them and position), from the state's start position: the blocks chosen are the ones the
  benchmark saw (given the same policy);
- ``--paths``: that many random draws of the same geometric law (``--rows`` independent ones per row,
  ``shared``: one per batch, as the synthetic drafter's), for the mean and the worst over paths.

Prints per row: tok/s relative to target-only (the plain engine's step) for fixed-16 and adaptive, adaptive
over fixed, and the blocks chosen.

    python3 bench/simulate_speculation.py /work/main/bench/results/load.json more.json ...
    python3 bench/simulate_speculation.py load.json --paths 200 --prior-rate 0.7
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable, Sequence

import numpy as np

from dflash_jax.runtime.speculation import OFF, SpeculationPolicy, SpeculationSettings

# bits(row, position) -> whether the synthetic drafter's proposal at that position is right
Bits = Callable[[int, int], bool]


def synthetic_bits(rate: float, start: int, count: int, seed: int = 0, first_token: int | None = None) -> np.ndarray:
    """The synthetic drafter's draws at positions ``0 .. start + count - 1`` of a row whose first token is
    ``first_token`` (None: keyed by position only, the drafter of reports without ``first_tokens``):
    right where ``uniform(fold_in(fold_in(key(seed), first_token), position)) < rate`` (float32, as
    ``SyntheticDrafter.override_drafts``); positions before ``start`` are left False."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(seed)
    if first_token is not None:
        key = jax.random.fold_in(key, first_token)
    positions = jnp.arange(start, start + count, dtype=jnp.int32)
    u = jax.vmap(lambda p: jax.random.uniform(jax.random.fold_in(key, p)))(positions)
    return np.concatenate([np.zeros(start, bool), np.asarray(u < jnp.float32(rate))])


def step(bits: np.ndarray, start: int, block: int) -> int:
    """Tokens one step of ``block`` slots commits from anchor position ``start``: 1 + the drafts right in
    a row at ``start + 1 ..`` (at most ``block - 1``)."""
    acc = 0
    while acc < block - 1 and bits[start + 1 + acc]:
        acc += 1
    return acc + 1


def run(mode: str, bits: Sequence[np.ndarray], start: int, costs: dict, batch: int, steps: int, calls: int,
        fixed_block: int = 16, settings: SpeculationSettings | None = None, blocks=(16, 8, 4, OFF)) -> dict:
    """``bench_load.run_mode`` offline: ``bits[r]`` the acceptance draws of row ``r`` (indexed by position)."""
    policy = SpeculationPolicy(blocks, costs, settings or SpeculationSettings()) if mode == "adaptive" else None
    estimates = [policy.new_row() for _ in range(batch)] if policy else []
    pos = [start] * batch
    tokens = seconds = 0.0
    chosen = []
    for call in range(calls + 1):
        block = fixed_block if policy is None else policy.choose(estimates, batch).block
        committed = []
        for r in range(batch):
            lengths = []
            for _ in range(steps):
                n = 1 if block == OFF else step(bits[r], pos[r], block)
                pos[r] += n
                lengths.append(n)
            committed.append(lengths)
        if policy is not None:
            for est, lengths in zip(estimates, committed):
                policy.observe(est, lengths, block)
        if call:
            tokens += sum(map(sum, committed))
            seconds += steps * costs[(batch, block)]
            chosen.append(block)
    return dict(tok_s=tokens / seconds, blocks=chosen, tau=tokens / (batch * steps * calls))


def rows_of(report: dict):
    """(context, batch, rate, tau16, costs, target_step_s, measured level) of a load JSON's levels."""
    for e in report["results"]:
        if "error" in e:
            continue
        batch = e["batch"]
        costs = {(batch, int(b)): s for b, s in e["step_s"].items()}
        for lv in e["levels"]:
            yield e["context"], batch, lv["rate"], lv["tau16"], costs, e["target_step_s"], \
                dict(lv, first_tokens=e.get("first_tokens"))


def simulate(report: dict, *, steps: int, calls: int, paths: int, rows: int, settings: SpeculationSettings,
             shared: bool, seed: int = 0) -> list[dict]:
    out = []
    for context, batch, rate, tau16, costs, target_step, measured in rows_of(report):
        target = batch / target_step
        room = context + (calls + 1) * steps * 16 + 16
        first_tokens = measured.get("first_tokens") or [None]
        draws = {t: synthetic_bits(rate, context, room - context, first_token=t) for t in first_tokens}
        exact = [draws[first_tokens[r % len(first_tokens)]] for r in range(batch)]
        res = dict(context=context, batch=batch, tau16=tau16)
        for mode in ("fixed", "adaptive"):
            res[mode] = run(mode, exact, context, costs, batch, steps, calls, settings=settings)
            res[mode]["x"] = res[mode]["tok_s"] / target
        res["a_over_f"] = res["adaptive"]["tok_s"] / res["fixed"]["tok_s"]
        res["measured"] = {m: dict(x=measured[m]["tok_s"] / measured["target_only"]["tok_s"],
                                   blocks=measured[m]["blocks"]) for m in ("fixed", "adaptive")}
        if paths:
            rs = np.random.RandomState(seed)
            n_rows = 1 if shared else min(batch, rows)
            af, ax = [], []
            for _ in range(paths):
                drawn = [rs.rand(room) < rate for _ in range(n_rows)]
                path_bits = [drawn[r % n_rows] for r in range(batch)]
                f = run("fixed", path_bits, context, costs, batch, steps, calls)
                a = run("adaptive", path_bits, context, costs, batch, steps, calls, settings=settings)
                af.append(a["tok_s"] / f["tok_s"])
                ax.append(a["tok_s"] / target)
            res["paths"] = dict(a_over_f_mean=statistics.mean(af), a_over_f_p10=float(np.percentile(af, 10)),
                                x_mean=statistics.mean(ax), x_p10=float(np.percentile(ax, 10)))
        out.append(res)
    return out


def print_rows(results: list[dict]) -> None:
    print("context | batch | tau16 | fixed x (measured) | adaptive x (measured) | a/f (measured) | blocks "
          "(measured) | paths: a/f mean, p10; adaptive x mean, p10")
    for r in results:
        m = r["measured"]
        line = (f"{r['context']:7d} | {r['batch']:5d} | {r['tau16']:5.1f} | {r['fixed']['x']:5.2f} ({m['fixed']['x']:5.2f}) "
                f"| {r['adaptive']['x']:5.2f} ({m['adaptive']['x']:5.2f}) | {r['a_over_f']:5.3f} "
                f"({m['adaptive']['x'] / m['fixed']['x']:5.3f}) | {r['adaptive']['blocks']} ({m['adaptive']['blocks']})")
        if "paths" in r:
            p = r["paths"]
            line += f" | {p['a_over_f_mean']:.3f}, {p['a_over_f_p10']:.3f}; {p['x_mean']:.3f}, {p['x_p10']:.3f}"
        print(line)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="bench_load.py reports")
    ap.add_argument("--steps", type=int, default=None, help="steps per call (default: the report's)")
    ap.add_argument("--calls", type=int, default=None, help="timed calls (default: the report's)")
    ap.add_argument("--paths", type=int, default=0, help="random acceptance paths per row (0: the exact draws only)")
    ap.add_argument("--rows", type=int, default=64, help="independent paths per batch (rows beyond reuse them)")
    ap.add_argument("--shared", action="store_true", help="one path for all rows of a batch (the synthetic drafter's)")
    for field in SpeculationSettings.__dataclass_fields__.values():
        ap.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default)
    args = ap.parse_args(argv)
    settings = SpeculationSettings(**{f: getattr(args, f) for f in SpeculationSettings.__dataclass_fields__})
    for path in args.json:
        report = json.load(open(path))
        cfg = report["config"]
        print(path)
        print_rows(simulate(report, steps=args.steps or cfg["steps"], calls=args.calls or cfg["calls"],
                            paths=args.paths, rows=args.rows, settings=settings, shared=args.shared))


if __name__ == "__main__":
    main()
