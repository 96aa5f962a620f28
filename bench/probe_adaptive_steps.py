#!/usr/bin/env python
"""Which step counts ``EngineConfig.max_steps_per_sync`` gives an engine's decode calls, and at what
speed: ``Engine.generate`` on N prompts with fixed calls and with adaptive ones, the steps of every
call recorded.

    python bench/probe_adaptive_steps.py --model 8b --prompts 1,8 --max-new 256     # Qwen3-8B shapes, random
    python bench/probe_adaptive_steps.py --model embedded --prompts 1,8             # the shipped pair

Prints per model, prompt count and variant: the calls' step counts (first 12 and their histogram),
the wall time and tokens/s of the second of two runs (the first compiles).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(model: str, max_new: int, rows: int, max_steps: int | None):
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax import embedded
    from dflash_jax.engine import Engine, EngineConfig

    if model == "embedded":
        target, drafter, _ = embedded.load_default(dtype="bfloat16")
    else:
        from bench_engine import qwen3_8b, random_pair

        target, drafter = random_pair(qwen3_8b(36), dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(16, 4000, 512).tolist() for _ in range(rows)]
    config = EngineConfig(max_batch_size=rows, max_length=512 + max_new + 16, prompt_buckets=(512,),
                          max_steps_per_sync=max_steps)
    return Engine(target, drafter, config), prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b", choices=["8b", "embedded"])
    ap.add_argument("--prompts", default="1,8")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--max-steps", type=int, default=64)
    args = ap.parse_args()
    for rows in (int(n) for n in args.prompts.split(",")):
        for max_steps in (None, args.max_steps):
            engine, prompts = build(args.model, args.max_new, rows, max_steps)
            steps: list[int] = []
            decode = engine.decode

            def spy(state, n_steps=None, *, window=None, _decode=decode):
                steps.append(n_steps)
                return _decode(state, n_steps, window=window)

            engine.decode = spy
            engine.generate(prompts, args.max_new, stop_token_ids=[])  # compiles
            steps.clear()
            t0 = time.perf_counter()
            results = engine.generate(prompts, args.max_new, stop_token_ids=[])
            wall = time.perf_counter() - t0
            tokens = sum(len(r.output_ids) for r in results)
            print(json.dumps({"model": args.model, "prompts": rows, "max_steps_per_sync": max_steps,
                              "calls": len(steps), "first_steps": steps[:12],
                              "histogram": dict(sorted(collections.Counter(steps).items())),
                              "wall_s": round(wall, 4), "tokens_per_s": round(tokens / wall, 1)}), flush=True)
            del engine


if __name__ == "__main__":
    main()
