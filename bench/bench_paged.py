"""Paged against contiguous caches: decode step times and the time to first token over a cached prefix.

On a Qwen3-8B-shaped target with random bf16 weights and a 5-layer block-16 drafter (DFlash), one
engine with contiguous caches (``page_size`` 0) and one with paged caches (``--page-size``):

1. ``decode``: ms per DFlash step at each ``--batches`` from a ``--context``-token context (synthetic
   states, synchronised calls of ``--steps`` steps at the attention window the batcher would pick; the
   paged state's rows hold shuffled pages);
2. ``ttft``: the time to first token of a ``--prefix + --suffix``-token prompt through the paged
   engine's ``ContinuousBatcher``, uncached, and with its first ``--prefix`` tokens cached by an
   earlier request (the median of ``--repeats`` fresh prompts each); ``--ttft-engines paged,contiguous``
   adds the contiguous engine's (two more compiled 8B programs);
3. ``rows`` (host only): with the memory of ``--rows-budget`` contiguous rows of ``--max-length``
   positions, how many requests of a mixed workload (prompts uniform in 100-8,000 tokens, 256 new
   tokens each) hold pages at once, admitted in order by ``PageAllocator`` until the pool is full.

    python3 bench/bench_paged.py --json bench/results/paged.json
    JAX_PLATFORMS=cpu python3 bench/bench_paged.py --tiny            # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp
import numpy as np

import timing
from dflash_jax.runtime.batcher import ContinuousBatcher
from dflash_jax.runtime.pages import PageAllocator
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.tiny import tiny_target_config


def ttft(batcher: ContinuousBatcher, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first token of ``prompt`` (one new token), and its cached tokens."""
    g = batcher.submit(prompt, 1, submitted=time.perf_counter())
    batcher.run()
    if g.error is not None:
        raise g.error
    return g.result.time_to_first_token, g.cached_tokens


def ttft_rows(engines: dict[str, Engine], args, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(0, vocab - 1, n).tolist()  # noqa: E731
    out = {}
    for name, engine in engines.items():
        batcher = ContinuousBatcher(engine)
        for _ in range(2):  # compiles: uncached and (paged) cached shapes
            first = prompt(args.prefix + args.suffix)
            ttft(batcher, first)
            ttft(batcher, first[:args.prefix] + prompt(args.suffix))
        uncached, cached, hits = [], [], []
        for _ in range(args.repeats):
            first = prompt(args.prefix + args.suffix)
            uncached.append(ttft(batcher, first)[0])
            seconds, hit = ttft(batcher, first[:args.prefix] + prompt(args.suffix))
            cached.append(seconds)
            hits.append(hit)
        row = {"uncached_ms": 1e3 * statistics.median(uncached), "cached_prefix_ms": 1e3 * statistics.median(cached),
               "cached_tokens": hits[-1]}
        row["cached_over_uncached"] = row["cached_prefix_ms"] / row["uncached_ms"]
        if batcher.pages is not None:
            row["pages_all_free"] = batcher.pages.all_free()
        out[name] = row
        print(f"  TTFT {name:10s}: uncached {row['uncached_ms']:8.1f} ms   second request, {hits[-1]} tokens cached: "
              f"{row['cached_prefix_ms']:8.1f} ms ({row['cached_over_uncached']:.2f}x)", flush=True)
    return out


def concurrent_rows(budget_rows: int, max_length: int, page_size: int, requests: int = 4096) -> dict:
    """Requests of a mixed-length workload that a pool of ``budget_rows * max_length`` positions holds
    at once (admitted in order until one does not fit), against the ``budget_rows`` contiguous rows."""
    rng = np.random.default_rng(0)
    pages = PageAllocator(budget_rows * max_length // page_size + 1, page_size, prefix_cache=False)
    admitted = 0
    for _ in range(requests):
        prompt = rng.integers(0, 1000, int(rng.integers(100, 8001))).tolist()
        if pages.allocate(prompt, min(len(prompt) + 256, max_length)) is None:
            break
        admitted += 1
    return {"contiguous_rows": budget_rows, "paged_rows": admitted, "ratio": admitted / budget_rows,
            "max_length": max_length, "page_size": page_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=4000)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--rows-budget", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=32768)
    ap.add_argument("--parts", default="decode,ttft,rows")
    ap.add_argument("--ttft-engines", default="paged")
    ap.add_argument("--tiny", action="store_true", help="tiny float32 shapes: a CPU smoke test of this script")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.tiny:
        tcfg, dtype = tiny_target_config(vocab_size=512, num_layers=6), jnp.float32
        args.context, args.prefix, args.suffix, args.repeats = 64, 100, 8, 2
    else:
        tcfg, dtype = timing.qwen3_8b(args.layers), jnp.bfloat16
    target, drafter = timing.random_pair(tcfg, dtype)
    longest = args.prefix + args.suffix
    buckets = tuple(sorted({64, 1 << (longest - 1).bit_length()}))
    config = EngineConfig(max_batch_size=max(batches), max_length=max(buckets[-1], args.context) + 256,
                          steps_per_sync=args.steps, prompt_buckets=buckets)
    engines = {"contiguous": Engine(target, drafter, config),
               "paged": Engine(target, drafter, EngineConfig(**{**config.__dict__, "page_size": args.page_size}))}
    del target, drafter
    print(timing.device_line())
    t0 = time.perf_counter()
    result = {"device": timing.device_line(), "page_size": args.page_size, "layers": tcfg.num_layers,
              "context": args.context, "decode": [], "ttft": None}
    if "decode" in args.parts:
        print(f"DFlash decode step, context {args.context}: ms per step")
        for batch in batches:
            row = {"batch": batch}
            # the window the batcher would pick: every row's reach over the calls (a paged step copies it)
            window = args.context + (2 + args.repeats) * args.steps * engines["paged"].block_size
            for name, engine in engines.items():
                seconds, tau = timing.time_decode(engine, batch, args.context, args.steps, args.repeats, window=window)
                row[name] = {"ms_per_step": 1e3 * seconds, "tau": tau}
            row["paged_over_contiguous"] = row["paged"]["ms_per_step"] / row["contiguous"]["ms_per_step"]
            result["decode"].append(row)
            print(f"  batch {batch:3d}: contiguous {row['contiguous']['ms_per_step']:8.3f}   paged "
                  f"{row['paged']['ms_per_step']:8.3f}   ({row['paged_over_contiguous']:.3f}x)", flush=True)
    if "ttft" in args.parts:
        print(f"time to first token, {args.prefix} + {args.suffix} tokens")
        chosen = {name: engines[name] for name in args.ttft_engines.split(",")}
        result["ttft"] = ttft_rows(chosen, args, tcfg.vocab_size)
    if "rows" in args.parts:
        result["rows"] = rows = concurrent_rows(args.rows_budget, args.max_length, args.page_size)
        print(f"mixed prompts of 100-8,000 tokens in the memory of {rows['contiguous_rows']} contiguous rows of "
              f"{rows['max_length']} positions: {rows['paged_rows']} paged rows ({rows['ratio']:.1f}x)")
    result["seconds"] = time.perf_counter() - t0
    print(f"{result['seconds']:.0f} s after the models were built")
    timing.write_json(args.json, result)


if __name__ == "__main__":
    main()
