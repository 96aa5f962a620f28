"""Paged against contiguous caches on 8B shapes: decode steps, the time to first token over a cached prefix,
and the running streams' inter-token gap while a long prompt is prefilled in chunks.

A Qwen3-8B-shaped target with random bf16 weights and a 5-layer block-16 drafter. One paged DFlash engine
(``--page-size``, a pool of ``--pages`` pages, ``max_length`` 16,896) serves all three parts; the
contiguous engines and the paged target-only one are sized for part 1 (``--context`` + 1,024 positions):

1. ``decode``: ms per step at each ``--batches``, target-only and DFlash, contiguous and paged, from a
   ``--context``-token context (synthetic states, synchronised calls of ``--steps`` steps at the window the
   batcher would pick; a paged row's pages shuffled through the pool), and the paged / contiguous ratios;
2. ``ttft``: the time to first token of a ``--prefix + --suffix``-token prompt through the paged engine's
   ``ContinuousBatcher``, uncached, and with its first ``--prefix`` tokens cached by an earlier request
   (medians of ``--repeats`` fresh prompts, after a round that compiles);
3. ``gap``: ``--streams`` streams of ``--stream-prompt``-token prompts decode; after ``--steady-syncs`` host
   syncs a ``--long``-token prompt arrives and is prefilled ``--chunk`` tokens per sync
   (``engine.prefill_chunk``) between their decode calls. Per stream, the gap between successive token
   deliveries: the median before the arrival (steady state), and the largest from the arrival to the long
   prompt's admission (its last chunk), over all streams; the second of two runs (the first compiles).

    python3 bench/bench_paged.py --json bench/results/paged.json         # the H200 command (< 150 s)
    JAX_PLATFORMS=cpu python3 bench/bench_paged.py --tiny                 # CPU smoke test of this script
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time

import jax.numpy as jnp
import numpy as np

import timing
from dflash_jax.runtime.batcher import ContinuousBatcher
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.tiny import tiny_target_config


class WithChunks:
    """``engine`` as the batcher sees it with ``prefill_chunk`` set (the engine's programs do not read it)."""

    def __init__(self, engine: Engine, chunk: int):
        self.engine = engine
        self.config = dataclasses.replace(engine.config, prefill_chunk=chunk)
        self.config.validate()

    def __getattr__(self, name):
        return getattr(self.engine, name)


def decode_rows(engines: dict[str, Engine], args) -> list[dict]:
    print(f"decode step, context {args.context}: ms per step (paged / contiguous)")
    rows = []
    for batch in args.batch_list:
        row = {"batch": batch}
        # the window the batcher would pick: every row's reach over the calls (a paged step copies it)
        window = args.context + (2 + args.repeats) * args.steps * engines["dflash_paged"].block_size
        for name, engine in engines.items():
            seconds, tau = timing.time_decode(engine, batch, args.context, args.steps, args.repeats, window=window)
            row[name] = {"ms_per_step": 1e3 * seconds, "tau": tau}
            gc.collect()
        for kind in ("target", "dflash"):
            row[f"{kind}_paged_over_contiguous"] = (row[f"{kind}_paged"]["ms_per_step"]
                                                    / row[f"{kind}_contiguous"]["ms_per_step"])
        rows.append(row)
        print(f"  batch {batch:3d}: target-only {row['target_contiguous']['ms_per_step']:7.3f} / "
              f"{row['target_paged']['ms_per_step']:7.3f} ({row['target_paged_over_contiguous']:.3f}x)   DFlash "
              f"{row['dflash_contiguous']['ms_per_step']:7.3f} / {row['dflash_paged']['ms_per_step']:7.3f} "
              f"({row['dflash_paged_over_contiguous']:.3f}x)", flush=True)
    return rows


def first_token_s(batcher: ContinuousBatcher, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first token of ``prompt`` (one new token), and its cached tokens."""
    g = batcher.submit(prompt, 1, submitted=time.perf_counter())
    batcher.run()
    if g.error is not None:
        raise g.error
    return g.result.time_to_first_token, g.cached_tokens


def ttft_row(engine: Engine, args, rng: np.random.Generator) -> dict:
    prompt = lambda n: rng.integers(0, engine.vocab_size - 1, n).tolist()  # noqa: E731
    batcher = ContinuousBatcher(engine)
    uncached, cached, hits = [], [], []
    for i in range(1 + args.repeats):  # the first round compiles
        first = prompt(args.prefix + args.suffix)
        seconds, _ = first_token_s(batcher, first)
        again, hit = first_token_s(batcher, first[:args.prefix] + prompt(args.suffix))
        if i:
            uncached.append(seconds)
            cached.append(again)
            hits.append(hit)
    row = {"uncached_ms": 1e3 * statistics.median(uncached), "cached_prefix_ms": 1e3 * statistics.median(cached),
           "cached_tokens": hits[-1], "pages_all_free": batcher.pages.all_free()}
    row["cached_over_uncached"] = row["cached_prefix_ms"] / row["uncached_ms"]
    print(f"time to first token, {args.prefix} + {args.suffix} tokens: uncached {row['uncached_ms']:.1f} ms, "
          f"{hits[-1]} tokens cached {row['cached_prefix_ms']:.1f} ms ({row['cached_over_uncached']:.3f}x)", flush=True)
    return row


def stream_gaps(engine: Engine, args, rng: np.random.Generator) -> dict:
    """One run of part 3 (see the module docstring)."""
    prompt = lambda n: rng.integers(0, engine.vocab_size - 1, n).tolist()  # noqa: E731
    batcher = ContinuousBatcher(WithChunks(engine, args.chunk))
    deliveries: list[list[float]] = [[] for _ in range(args.streams)]
    streams = [batcher.submit(prompt(args.stream_prompt), args.stream_tokens,
                              on_tokens=lambda ids, i=i: deliveries[i].append(time.perf_counter()))
               for i in range(args.streams)]
    while any(g.admitted is None for g in streams):
        batcher.step()
    for _ in range(args.steady_syncs):
        batcher.step()
    arrival = time.perf_counter()
    # Ended at its first token, before a decode call runs it: the streams' calls keep their window (the
    # long row's would copy every row's view of 16k positions in the paged step).
    long = batcher.submit(prompt(args.long), 2, stop_check=lambda new: 1)
    syncs = 0
    while long.admitted is None:
        batcher.step()
        syncs += 1
        if any(g.finished for g in streams):
            raise RuntimeError("a stream ended before the long prompt was admitted: raise --stream-tokens")
    admitted = time.perf_counter()
    for g in streams + [long]:
        g.cancel()
    batcher.run()
    steady, during = [], []
    for times in deliveries:
        gaps = [(b, b - a) for a, b in zip(times[2:], times[3:])]  # past the first token and the first call
        steady.append(statistics.median(g for t, g in gaps if t <= arrival))
        during.extend(g for t, g in gaps if arrival < t <= admitted)
    if not during:
        raise RuntimeError("no stream got tokens while the long prompt was prefilled")
    out = {"steady_gap_ms": 1e3 * statistics.median(steady), "max_gap_ms": 1e3 * max(during),
           "median_gap_ms": 1e3 * statistics.median(during), "syncs_to_admission": syncs,
           "long_prompt_ttft_ms": 1e3 * (long.first_token_time - long.submitted)}
    out["max_over_steady"] = out["max_gap_ms"] / out["steady_gap_ms"]
    return out


def gap_row(engine: Engine, args, rng: np.random.Generator) -> dict:
    stream_gaps(engine, args, rng)  # compiles
    row = stream_gaps(engine, args, rng)
    print(f"{args.streams} streams, a {args.long}-token prompt arriving, chunks of {args.chunk}: token gap steady "
          f"{row['steady_gap_ms']:.1f} ms, while it is prefilled median {row['median_gap_ms']:.1f} / max "
          f"{row['max_gap_ms']:.1f} ms ({row['max_over_steady']:.2f}x steady; {row['syncs_to_admission']} syncs, "
          f"its first token after {row['long_prompt_ttft_ms']:.0f} ms)", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per call (steps_per_sync)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages", type=int, default=4096, help="the paged DFlash engine's pool")
    ap.add_argument("--prefix", type=int, default=4000)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-prompt", type=int, default=512)
    ap.add_argument("--stream-tokens", type=int, default=2048)
    ap.add_argument("--steady-syncs", type=int, default=6)
    ap.add_argument("--long", type=int, default=16000)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--parts", default="decode,ttft,gap")
    ap.add_argument("--tiny", action="store_true", help="tiny float32 shapes: a CPU smoke test of this script")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    if args.tiny:
        tcfg, dtype = tiny_target_config(vocab_size=512, num_layers=4), jnp.float32
        args.context, args.prefix, args.suffix, args.repeats = 64, 100, 8, 2
        args.long, args.chunk, args.stream_prompt, args.stream_tokens, args.pages = 200, 64, 16, 400, 2048
    else:
        tcfg, dtype = timing.qwen3_8b(args.layers), jnp.bfloat16
    t0 = time.perf_counter()
    target, drafter = timing.random_pair(tcfg, dtype)
    small = EngineConfig(max_batch_size=max(args.batch_list), max_length=args.context + 1024,
                         steps_per_sync=args.steps, prompt_buckets=(64,))
    longest = -(-(max(args.long, args.prefix + args.suffix) + 1) // 512) * 512
    large = dataclasses.replace(small, max_batch_size=max(max(args.batch_list), 2 * args.streams),
                                max_length=longest + 512, page_size=args.page_size, num_pages=args.pages,
                                prompt_buckets=tuple(sorted({64, args.stream_prompt, args.chunk,
                                                             args.prefix + args.suffix, longest})))
    paged = Engine(target, drafter, large)
    engines = {"target_contiguous": Engine(target, None, small),
               "target_paged": Engine(target, None, dataclasses.replace(small, page_size=args.page_size)),
               "dflash_contiguous": Engine(target, drafter, small), "dflash_paged": paged}
    del target, drafter
    gc.collect()
    print(timing.device_line())
    print(f"models and engines built in {time.perf_counter() - t0:.0f} s", flush=True)
    result = {"device": timing.device_line(), "page_size": args.page_size, "layers": tcfg.num_layers,
              "context": args.context, "args": {k: v for k, v in vars(args).items() if k != "batch_list"}}
    rng = np.random.default_rng(0)
    if "decode" in args.parts:
        result["decode"] = decode_rows(engines, args)
    for name in ("target_contiguous", "target_paged", "dflash_contiguous"):
        del engines[name]  # their weights and programs: the rest runs on the paged DFlash engine
    gc.collect()
    if "ttft" in args.parts:
        result["ttft"] = ttft_row(paged, args, rng)
    if "gap" in args.parts:
        result["gap"] = gap_row(paged, args, rng)
    result["seconds"] = time.perf_counter() - t0
    print(f"{result['seconds']:.0f} s in all")
    timing.write_json(args.json, result)


if __name__ == "__main__":
    main()
