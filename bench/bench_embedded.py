#!/usr/bin/env python
"""tau and speedup of the shipped embedded pair (``models/embedded/``) on its held-out prompts.

Batch 1, greedy, the engine with and without the drafter on the same prompts (every prompt bucket
compiled before timing; each prompt timed ``--repeats`` times, best kept), for several block sizes.
The same measurement as the build's eval stage, on whatever device JAX picks.

    python bench/bench_embedded.py --blocks 16,8,4 --out $OUT/embedded.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from dflash_jax import embedded  # noqa: E402
from dflash_jax.embedded_build import evaluate  # noqa: E402
from dflash_jax.tokenizer import Tokenizer  # noqa: E402
from bench_engine import int_fields  # noqa: E402
from kernels_pallas import cached_attention_gpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="16,8,4")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attention-config", default="", metavar="FIELD=N,...",
                    help="the cached-attention kernel's tile fields (GpuConfig), e.g. stacked_members=1,"
                         "members_per_program=2 (GPUs: the engine's kernels)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.attention_config:
        cached_attention_gpu.DEFAULT_CONFIG = dataclasses.replace(cached_attention_gpu.DEFAULT_CONFIG,
                                                                  **int_fields(args.attention_config))
    tok = Tokenizer(embedded.DEFAULT_TARGET)
    prompts = [tok.encode(t, add_special_tokens=False) for t in embedded.heldout_prompts(args.prompts)]
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    print(f"device: {device}; {len(prompts)} prompts, {args.max_new_tokens} new tokens", flush=True)
    print(f"{'block':>5} {'tau':>6} {'DFlash tok/s':>12} {'target tok/s':>12} {'speedup':>8} {'identical':>9}", flush=True)
    rows = []
    for block in (int(b) for b in args.blocks.split(",")):
        r = evaluate(embedded.DEFAULT_TARGET, embedded.DEFAULT_DRAFTER, prompts, args.max_new_tokens,
                     block_size=block, repeats=args.repeats)
        r.pop("tau_per_prompt")
        r["device"] = device
        rows.append(r)
        print(f"{block:>5} {r['tau']:>6.2f} {r['dflash_tok_per_s']:>12.0f} {r['target_only_tok_per_s']:>12.0f} "
              f"{r['speedup']:>7.2f}x {str(r['identical']):>9}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
