"""Top-k over vocabulary-wide rows: ``ops.topk`` against ``jax.lax.top_k`` and staged variants.

The rows of a sampled DFlash step (the drafter's block and the verify block: 16 rows a sequence, k = 64
candidates) over Qwen3's 151,936-token vocabulary, bf16 logits with ties. Every variant is checked
against ``lax.top_k`` (values and ids, ties to the lower id) before it is timed.

Variants (``--variants``, ';'-separated): ``lax``; ``ops`` (the library's, with its default stages for
the row count); ``chunks:W1,W2``: ``ops.topk.top_k`` with these stage widths (``chunks:128``: one stage).

    python3 bench/bench_topk.py --rows 16,256

``--thresholds``: the sampler's whole-row fallback instead (top-k 50 then top-p 0.9 over float32 rows
of the vocabulary), read from the sorted row (``sort``) and by ``ops.topk.largest_threshold``'s search
(``search``, the library's); both must keep the same tokens before they are timed:

    python3 bench/bench_topk.py --rows 16,256 --thresholds
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import timing
from dflash_jax.ops import topk
from dflash_jax.runtime import sampling


def variant(name: str):
    if name == "lax":
        return lambda x, k: jax.lax.top_k(x, k)
    if name == "ops":
        return lambda x, k: topk.top_k(x, k)
    if name.startswith("chunks:"):
        return lambda x, k: topk.top_k(x, k, chunks=tuple(int(c) for c in name[7:].split(",")))
    raise SystemExit(f"unknown variant {name!r}: lax, ops or chunks:W1[,W2...]")


def threshold_variant(name: str):
    """The whole-row threshold of top-k 50 and top-p 0.9 over float32 rows ``x [R, V]``."""
    def run(x):
        ks, ps = jnp.full(x.shape[:1], 50, jnp.int32), jnp.full(x.shape[:1], 0.9, jnp.float32)
        log_norm = jax.nn.logsumexp(x, axis=-1)
        if name == "sort":
            return sampling._sorted_threshold(-jnp.sort(-x, axis=-1), log_norm, ks, ps)
        return sampling._searched_threshold(x, log_norm, ks, ps)

    if name not in ("sort", "search"):
        raise SystemExit(f"unknown threshold variant {name!r}: sort or search")
    return run


def thresholds(rows: list[int], vocab: int, repeats: int) -> None:
    fns = {name: jax.jit(threshold_variant(name)) for name in ("sort", "search")}
    times = {name: [] for name in fns}
    for r in rows:
        x = logits(r, vocab, 0).astype(jnp.float32)
        kept = {name: np.asarray(x) >= np.asarray(fn(x))[:, None] for name, fn in fns.items()}
        if not np.array_equal(kept["sort"], kept["search"]):
            raise SystemExit(f"the searched threshold keeps other tokens than the sorted row's at {r} rows")
        for name, fn in fns.items():
            times[name].append(timing.per_call_time(fn, x, repeats=repeats) * 1e6)
    print(f"{'threshold':<26}" + "".join(f"{'rows ' + str(r) + ' us':>14}" for r in rows))
    for name, row in times.items():
        print(f"{name:<26}" + "".join(f"{t:>14.1f}" for t in row), flush=True)


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
    ap.add_argument("--thresholds", action="store_true", help="time the whole-row top-k/top-p threshold instead")
    args = ap.parse_args(argv)
    print(timing.device_line())
    if args.thresholds:
        return thresholds([int(r) for r in args.rows.split(",")], args.vocab, args.repeats)
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
