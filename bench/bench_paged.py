"""Paged against contiguous caches on 8B shapes: decode steps, the time to first token over a cached prefix,
and the running streams' inter-token gap while a long prompt is prefilled in chunks.

A Qwen3-8B-shaped target with random bf16 weights and a 5-layer block-16 drafter.

1. ``decode``: ms per step at each ``--batches`` from a ``--context``-token context (synthetic states,
   synchronised calls of ``--steps`` steps at the window the batcher would pick; a paged row's pages
   shuffled through the pool), for each of ``--kinds`` (target-only, DFlash) and ``--variants``:
   ``contiguous`` (the default kernels), ``paged`` (pages of ``--page-size``; the default kernels, the
   fused cached attention reading and writing the pools through the page tables), ``paged_in_order``
   (the same, each row's pages consecutive in the pool: the cost of the shuffle),
   ``paged_mosaic`` (``gpu_lowering="mosaic"``: the Mosaic GPU block attention TMA-loads the pages the
   table names) and ``contiguous_mosaic`` (its contiguous counterpart); the ratios to ``contiguous``.
   One engine at a time, sized for the part (``--context`` + 1,024 positions);
2. ``ttft``: the time to first token of a ``--prefix + --suffix``-token prompt through the paged engine's
   ``ContinuousBatcher``, uncached, and with its first ``--prefix`` tokens cached by an earlier request
   (medians of ``--repeats`` fresh prompts, after a round that compiles); with ``--profile`` (the default
   on a GPU), three more prefix hits traced: their GPU kernel time and span against the time to first
   token, the largest kernels and the host's longest events (the dispatches);
3. ``gap``: ``--streams`` streams of ``--stream-prompt``-token prompts decode; after ``--steady-syncs`` host
   syncs a ``--long``-token prompt arrives and is prefilled ``--chunk`` tokens per sync
   (``engine.prefill_chunk``) between their decode calls. Per stream, the gap between successive token
   deliveries: the median before the arrival (steady state), and the largest from the arrival to the long
   prompt's admission (its last chunk), over all streams; the second of two runs (the first compiles).

4. ``kernel``: the decode token's fused cached attention alone (Qwen3-8B heads, ``--context`` positions of a
   ``--context`` + 1,024-position capacity, read only) over ``--layers`` layers' caches, contiguous and
   through page tables (rows' pages shuffled, or in order), us a layer at each ``--batches``.

Parts 2 and 3 run on one paged DFlash engine (a pool of ``--pages`` pages, ``max_length`` 16,896).

    python3 bench/bench_paged.py --parts decode --batches 1,16,32 --kinds dflash --layers 12 \
        --json bench/results/paged_steps.json                             # the step comparison on an H200
    python3 bench/bench_paged.py --json bench/results/paged.json         # every part
    JAX_PLATFORMS=cpu python3 bench/bench_paged.py --tiny                 # CPU smoke test of this script
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


VARIANTS = {"contiguous": dict(), "paged": dict(paged=True), "paged_in_order": dict(paged=True, shuffled=False),
            "paged_mosaic": dict(paged=True, gpu_lowering="mosaic"),
            "contiguous_mosaic": dict(gpu_lowering="mosaic")}


def decode_rows(target, drafter, config: EngineConfig, args) -> list[dict]:
    """Part 1 (see the module docstring): one engine at a time (each holds a serving copy of the weights)."""
    print(f"decode step, context {args.context}, pages of {args.page_size}: ms per step (ratio to contiguous)")
    rows = {batch: {"batch": batch} for batch in args.batch_list}
    kernels: dict[tuple[str, str], dict[str, float] | None] = {}
    for kind in args.kind_list:
        for variant in args.variant_list:
            how = VARIANTS[variant]
            engine = Engine(target, drafter if kind == "dflash" else None, dataclasses.replace(
                config, page_size=args.page_size if how.get("paged") else 0,
                gpu_lowering=how.get("gpu_lowering", config.gpu_lowering)))
            for batch in args.batch_list:
                # the window the batcher would pick: every row's reach over the calls
                window = args.context + (2 + args.repeats) * args.steps * engine.block_size
                t0 = time.perf_counter()
                seconds, tau = timing.time_decode(engine, batch, args.context, args.steps, args.repeats, window=window,
                                                shuffled=how.get("shuffled", True))
                rows[batch][f"{kind}_{variant}"] = {"ms_per_step": 1e3 * seconds, "tau": tau}
                # each case as it is measured: a run cut short by its time limit keeps what it timed
                print(f"  {kind} {variant} batch {batch}: {1e3 * seconds:.3f} ms per step "
                      f"({time.perf_counter() - t0:.0f} s with compiling)", flush=True)
                timing.write_json(args.json, {"decode_partial": list(rows.values())})
                if batch == args.profile_batch:
                    kernels[(kind, variant)] = step_kernels(engine, batch, window, args)
            del engine
            gc.collect()
    for row in rows.values():
        line = [f"  batch {row['batch']:3d}:"]
        for kind in args.kind_list:
            base = row[f"{kind}_contiguous"]["ms_per_step"] if "contiguous" in args.variant_list else None
            line.append(f"{kind}")
            for variant in args.variant_list:
                ms = row[f"{kind}_{variant}"]["ms_per_step"]
                if base is not None and variant != "contiguous":
                    row[f"{kind}_{variant}_over_contiguous"] = ms / base
                    line.append(f"{variant} {ms:.3f} ({ms / base:.3f}x)")
                else:
                    line.append(f"{variant} {ms:.3f}")
        print("  ".join(line), flush=True)
    for kind in args.kind_list:
        for variant in args.variant_list:
            if variant != "contiguous" and kernels.get((kind, variant)) and kernels.get((kind, "contiguous")):
                rows[args.profile_batch][f"{kind}_{variant}_kernel_delta_us"] = kernel_delta(
                    kernels[(kind, "contiguous")], kernels[(kind, variant)], f"{kind} {variant}")
    return list(rows.values())


def step_kernels(engine: Engine, batch: int, window: int, args) -> dict[str, float] | None:
    """A traced decode call of ``engine`` at ``batch`` (as ``timing.time_decode`` runs it): each GPU kernel's
    time, us a step (None: no trace)."""
    state = timing.warmed_state(engine, batch, args.context, args.steps, seed=batch, window=window)

    def run() -> None:
        nonlocal state
        state, _ = engine.decode(state, n_steps=args.steps, window=window)
        jax.block_until_ready(state.starts)

    calls = 2
    durations = timing.gpu_kernel_times(run, f"{args.profile_dir}/decode", calls=calls)
    if not durations:
        return None
    return {name: sum(d) / (calls * args.steps) for name, d in durations.items()}


def kernel_delta(base: dict[str, float], other: dict[str, float], what: str, top: int = 12) -> dict[str, float]:
    """Prints and returns the kernels whose time a step differs most between ``base`` (contiguous) and
    ``other`` (us a step, ``other - base``), beside both totals."""
    delta = {name: other.get(name, 0.0) - base.get(name, 0.0) for name in set(base) | set(other)}
    ranked = dict(sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:top])
    print(f"{what}: {sum(other.values()):.1f} us of kernels a step against contiguous {sum(base.values()):.1f}; "
          f"the largest differences, us a step:", flush=True)
    for name, us in ranked.items():
        print(f"  {us:+9.1f}  {name[:100]}", flush=True)
    return ranked


def kernel_rows(args) -> list[dict]:
    """Part 4 (see the module docstring)."""
    from kernels_pallas.cached_attention.gpu import cached_block_attention

    kv_heads, groups, head_dim, layers = 8, 4, 128, 2 if args.tiny else args.layers
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    capacity, page = args.context + (64 if args.tiny else 1024), args.page_size
    read_pages = capacity // page
    rows = []
    print(f"decode attention alone, {layers} layers' caches, context {args.context} of {capacity}, pages of {page}: "
          f"us a layer", flush=True)
    for batch in args.batch_list:
        key = jax.random.key(batch)
        qkv = timing.normal(key, (batch, 1, kv_heads, groups + 2, head_dim), dtype)
        starts, lens = jnp.full((batch,), args.context, jnp.int32), jnp.ones((batch,), jnp.int32)
        norm, inv_freq = jnp.ones((head_dim,), dtype), 1.0 / 1e6 ** (jnp.arange(0, head_dim, 2) / head_dim)
        caches = [timing.normal(jax.random.fold_in(key, i), (batch, capacity, kv_heads, head_dim), dtype)
                  for i in range(2 * layers)]
        tables = {variant: timing.page_order(batch, read_pages, batch, shuffled=variant == "paged")
                  for variant in ("paged", "paged_in_order")}
        pools = [jnp.concatenate([jnp.zeros((1, page, kv_heads, head_dim), dtype),
                                  c.reshape(batch * read_pages, page, kv_heads, head_dim)]) for c in caches]
        row = {"batch": batch}
        for variant in ("contiguous", "paged", "paged_in_order"):
            paged = variant != "contiguous"
            # the pools hold the contiguous caches' pages at the table's entries: the same values attended
            table = jnp.asarray(tables[variant]) if paged else None
            where = (np.argsort(tables[variant].ravel()) + 1) if paged else None
            args_k = [p[jnp.asarray(np.concatenate([[0], where]))] for p in pools] if paged else caches

            def layer_stack(qkv, *kv, table=table):
                outs = []
                for i in range(layers):
                    out, _, _ = cached_block_attention(qkv, kv[2 * i], kv[2 * i + 1], starts, lens, norm, norm,
                                                       inv_freq, eps=1e-6, qk_norm=True, write=False,
                                                       page_table=table, read_pages=read_pages if paged else None)
                    outs.append(out)
                return sum(o.astype(jnp.float32) for o in outs)

            fn = jax.jit(layer_stack)
            row[variant] = {"us_per_layer": 1e6 * timing.per_call_time(fn, qkv, *args_k) / layers,
                            "output": np.asarray(fn(qkv, *args_k))}
            del args_k
        want = row["contiguous"].pop("output")
        line = [f"  batch {batch:3d}: contiguous {row['contiguous']['us_per_layer']:.1f}"]
        for variant in ("paged", "paged_in_order"):
            got = row[variant].pop("output")
            if not np.allclose(got, want, rtol=1e-2, atol=1e-2):
                raise AssertionError(f"{variant}: the paged kernel's output differs from the contiguous kernel's")
            us = row[variant]["us_per_layer"]
            row[f"{variant}_over_contiguous"] = us / row["contiguous"]["us_per_layer"]
            line.append(f"{variant} {us:.1f} ({row[f'{variant}_over_contiguous']:.3f}x)")
        print("  ".join(line), flush=True)
        rows.append(row)
        del caches, pools
        gc.collect()
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
    if args.profile:  # after the timing: where a prefix hit's time to first token goes
        row["cached_prefix_kernels"] = cached_prefix_kernels(batcher, first[:args.prefix], args, prompt)
    return row


def cached_prefix_kernels(batcher: ContinuousBatcher, prefix: list[int], args, prompt, calls: int = 3,
                          top: int = 15) -> dict | None:
    """The GPU kernels of a request whose ``prefix`` is cached, each call a fresh suffix: the kernel time a
    request (their durations summed, without the gaps between them) against its time to first token, and
    the ``top`` kernels by time a request."""
    seconds: list[float] = []

    def run() -> None:
        ttft, hit = first_token_s(batcher, prefix + prompt(args.suffix))
        if hit < len(prefix) // args.page_size * args.page_size:
            raise RuntimeError(f"the profiled request found {hit} of its {len(prefix)} prefix tokens cached")
        seconds.append(ttft)

    traced = timing.trace_events(run, args.profile_dir, calls=calls)
    if not traced or not traced[0]:
        print("no GPU kernels traced: no kernel table", flush=True)
        return None
    kernels, host = traced

    def per_request(events: list[dict]) -> dict[str, float]:  # us a request by event name
        total: dict[str, float] = {}
        for e in events:
            total[e["name"]] = total.get(e["name"], 0.0) + e["dur"] / calls
        return total

    per_kernel = per_request(kernels)
    busy = sum(per_kernel.values())
    spans = timing.call_spans(kernels, calls)
    span = statistics.median(b - a for a, b in spans)
    ttft = 1e3 * statistics.median(seconds[1:])
    print(f"a prefix hit: {busy / 1e3:.2f} ms of GPU kernels ({len(kernels) // calls} launches) over a "
          f"{span / 1e3:.2f} ms span of the GPU (its prefill and the call that ends it), in a {ttft:.1f} ms "
          f"time to first token; its largest kernels, us a request:", flush=True)
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    for name, us in ranked:
        print(f"  {us:9.1f}  {name[:100]}", flush=True)
    # The host's side of the same requests: its longest events (dispatches, transfers, waits) a request,
    # but the profiler's own (stopping the trace).
    on_host = per_request([e for e in host if "profiler.py" not in e["name"] and "contextlib.py" not in e["name"]])
    host_ranked = sorted(on_host.items(), key=lambda kv: -kv[1])[:top]
    print("its longest host events, us a request:", flush=True)
    for name, us in host_ranked:
        print(f"  {us:9.1f}  {name[:100]}", flush=True)
    return {"kernel_ms": busy / 1e3, "gpu_span_ms": span / 1e3, "ttft_ms": ttft, "top_us": dict(ranked),
            "host_top_us": dict(host_ranked)}


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
    ap.add_argument("--page-size", type=int, default=64,
                    help="positions per page (the Mosaic GPU paged attention takes multiples of 64)")
    ap.add_argument("--kinds", default="target,dflash", help="part 1's steps: target (target-only), dflash")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"part 1's caches and kernels: {list(VARIANTS)}")
    ap.add_argument("--pages", type=int, default=1536,
                    help="the paged DFlash engine's pool (parts 2-3 need ~600 pages of 64; 4,096 beside the 8B "
                         "weights overflow an H100)")
    ap.add_argument("--prefix", type=int, default=4000)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-prompt", type=int, default=512)
    ap.add_argument("--stream-tokens", type=int, default=2048)
    ap.add_argument("--steady-syncs", type=int, default=6)
    ap.add_argument("--long", type=int, default=16000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--parts", default="decode,ttft,gap", help="of decode, ttft, gap, kernel")
    ap.add_argument("--tiny", action="store_true", help="tiny float32 shapes: a CPU smoke test of this script")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                    help="part 2: trace prefix hits and print their largest GPU kernels (default: on a GPU)")
    ap.add_argument("--profile-dir", default="/tmp/bench_paged_profile")
    ap.add_argument("--profile-batch", type=int, default=0,
                    help="part 1: trace a decode call at this batch per kind and variant and print the kernels "
                         "whose time differs most from the contiguous cache's (0: none)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args()
    if args.profile is None:
        args.profile = jax.default_backend() == "gpu"
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.kind_list, args.variant_list = args.kinds.split(","), args.variants.split(",")
    for name in args.kind_list + args.variant_list:
        if name not in ("target", "dflash", *VARIANTS):
            ap.error(f"unknown kind or variant {name!r}: --kinds of target, dflash; --variants of {list(VARIANTS)}")
    if args.tiny:
        tcfg, dtype = tiny_target_config(vocab_size=512, num_layers=4), jnp.float32
        args.context, args.prefix, args.suffix, args.repeats = 64, 100, 8, 2
        args.long, args.chunk, args.stream_prompt, args.stream_tokens, args.pages = 200, 64, 16, 400, 2048
    else:
        tcfg, dtype = timing.qwen3_8b(args.layers), jnp.bfloat16
    t0 = time.perf_counter()
    result = {"device": timing.device_line(), "page_size": args.page_size, "layers": tcfg.num_layers,
              "context": args.context, "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")}}
    if "kernel" in args.parts:
        result["kernel"] = kernel_rows(args)
    if not {"decode", "ttft", "gap"} & set(args.parts.split(",")):
        timing.write_json(args.json, result)
        return
    target, drafter = timing.random_pair(tcfg, dtype)
    small = EngineConfig(max_batch_size=max(args.batch_list), max_length=args.context + 1024,
                         steps_per_sync=args.steps, prompt_buckets=(64,))
    print(timing.device_line())
    print(f"models built in {time.perf_counter() - t0:.0f} s", flush=True)
    rng = np.random.default_rng(0)
    if "decode" in args.parts:
        result["decode"] = decode_rows(target, drafter, small, args)
    paged = None
    if "ttft" in args.parts or "gap" in args.parts:
        longest = -(-(max(args.long, args.prefix + args.suffix) + 1) // 512) * 512
        # The uncached rest of a prompt whose prefix is cached, in full pages: its bucket as the engine's
        # default buckets (powers of two) give it, not the next of this list's larger ones.
        rest = args.prefix + args.suffix - args.prefix // args.page_size * args.page_size
        rest_bucket = max(16, 1 << (rest - 1).bit_length())
        paged = Engine(target, drafter, dataclasses.replace(
            small, max_batch_size=max(max(args.batch_list), 2 * args.streams), max_length=longest + 512,
            page_size=args.page_size, num_pages=args.pages,
            prompt_buckets=tuple(sorted({64, rest_bucket, args.stream_prompt, args.chunk, args.prefix + args.suffix,
                                         longest}))))
    del target, drafter
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
