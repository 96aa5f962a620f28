"""Concurrent rows in the same KV memory: paged against contiguous caches, by the batcher's own admission.

A mixed workload (``--requests`` prompts of 100-8,000 tokens, uniformly; ``--new-tokens`` each, no stop)
is submitted at once to a ``ContinuousBatcher`` over a host-only engine (``dflash_jax.serving.testing``:
admission is accounting, no device work), for each ``--max-lengths``:

- contiguous: ``--budget-rows`` row slots of ``max_length`` positions each;
- paged: the same positions as a pool of ``--page-size``-position pages (``budget_rows * max_length /
  page_size``; prefix caching off, the prompts share nothing), rows admitted with pages for their context
  and one decode call, given more as they grow, the newest paused when the pool runs dry.

Printed per max_length: rows admitted by the first step, the mean and most rows live after each host sync
while requests still waited (a saturated server), the ratio of the means, and the preemptions.

    python3 bench/bench_paged_rows.py                      # the docs/performance.md table (~30 s, CPU)
    python3 bench/bench_paged_rows.py --max-lengths 16384 --budget-rows 4 --requests 120
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dflash_jax.serving.testing import FakeEngine, FakePagedEngine, live_rows

VOCAB = 512


def measure(max_length: int, budget_rows: int, page_size: int, prompts: list[list[int]], new_tokens: int,
            block: int, steps: int) -> dict:
    common = dict(max_length=max_length, block_size=block, steps_per_sync=steps)
    contiguous = live_rows(FakeEngine(VOCAB, max_batch_size=budget_rows, **common), prompts, new_tokens)
    paged = live_rows(FakePagedEngine(VOCAB, page_size=page_size, num_pages=budget_rows * max_length // page_size,
                                      prefix_cache=False, max_batch_size=len(prompts), **common), prompts, new_tokens)
    return {"max_length": max_length, "contiguous": contiguous, "paged": paged,
            "ratio": paged["mean"] / contiguous["mean"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-lengths", default="8448,16384,32768",
                    help="contiguous row lengths (8,448: the longest request, 8,000 + 256, rounded to 128)")
    ap.add_argument("--budget-rows", type=int, default=8, help="the KV memory, in contiguous rows")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=320)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps-per-sync", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args()
    rs = np.random.RandomState(args.seed)
    prompts = [rs.randint(0, VOCAB, int(rs.randint(100, 8001))).tolist() for _ in range(args.requests)]
    print(f"{args.requests} prompts of 100-8,000 tokens (mean {np.mean([len(p) for p in prompts]):.0f}), "
          f"{args.new_tokens} new tokens each; KV memory of {args.budget_rows} contiguous rows; pages of "
          f"{args.page_size}")
    print(f"{'max_length':>10} | {'contiguous: first / mean live':>29} | {'paged: first / mean / most live':>31} | "
          f"{'paged / contiguous':>18} | preemptions")
    rows = []
    t0 = time.perf_counter()
    for max_length in (int(x) for x in args.max_lengths.split(",")):
        row = measure(max_length, args.budget_rows, args.page_size, prompts, args.new_tokens, args.block_size,
                      args.steps_per_sync)
        c, p = row["contiguous"], row["paged"]
        print(f"{max_length:>10} | {c['first']:>14d} / {c['mean']:>12.1f} | {p['first']:>10d} / {p['mean']:>8.1f} / "
              f"{p['most']:>7d} | {row['ratio']:>17.2f}x | {p['preemptions']:>11d}", flush=True)
        rows.append(row)
    print(f"{time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
