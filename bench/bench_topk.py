"""Top-k over vocabulary-wide rows: ``ops.topk`` against ``jax.lax.top_k`` and staged variants.

The rows of a sampled DFlash step (the drafter's block and the verify block: 16 rows a sequence, k = 64
candidates) over Qwen3's 151,936-token vocabulary, bf16 logits with ties. Every variant is checked
against ``lax.top_k`` (values and ids, ties to the lower id) before it is timed.

Variants (``--variants``, ';'-separated): ``lax``; ``ops`` (the library's, with its default stages for
the row count); ``chunks:W1,W2``: ``ops.topk.top_k`` with these stage widths (``chunks:128``: one stage).

    python3 bench/bench_topk.py --rows 16,256
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import timing
from dflash_jax.ops import topk


def variant(name: str):
    if name == "lax":
        return lambda x, k: jax.lax.top_k(x, k)
    if name == "ops":
        return lambda x, k: topk.top_k(x, k)
    if name.startswith("chunks:"):
        return lambda x, k: topk.top_k(x, k, chunks=tuple(int(c) for c in name[7:].split(",")))
    raise SystemExit(f"unknown variant {name!r}: lax, ops or chunks:W1[,W2...]")


def logits(rows: int, vocab: int, seed: int) -> jax.Array:
    """Peaked bf16 rows (a trained model's spread), with ties at the top."""
    x = jax.random.normal(jax.random.key(seed), (rows, vocab), jnp.float32) * 3.0
    return (jnp.round(x * 4) / 4).astype(jnp.bfloat16)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,256")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--variants", default="lax;ops;chunks:128;chunks:128,16", help="';'-separated")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    print(timing.device_line())
    names = args.variants.split(";")
    want = jax.jit(lambda x: jax.lax.top_k(x, args.k))
    print(f"{'variant':<26}" + "".join(f"{'rows ' + r + ' us':>14}" for r in args.rows.split(",")))
    for name in names:
        fn = jax.jit(functools.partial(variant(name), k=args.k))
        row = []
        for r in map(int, args.rows.split(",")):
            for seed in range(2):
                x = logits(r, args.vocab, seed)
                got, ref = fn(x), want(x)
                if not (np.array_equal(np.asarray(got[0], np.float32), np.asarray(ref[0], np.float32))
                        and np.array_equal(np.asarray(got[1]), np.asarray(ref[1]))):
                    raise SystemExit(f"{name}: differs from lax.top_k at {r} rows")
            row.append(timing.per_call_time(fn, x, repeats=args.repeats) * 1e6)
        print(f"{name:<26}" + "".join(f"{t:>14.1f}" for t in row), flush=True)


if __name__ == "__main__":
    main()
