"""A bounded load on loopback against a paged server: ``--clients`` HTTP clients (threads, one connection
each, half of them streaming) send requests that share system prompts, with varied lengths, for
``--duration`` seconds, against ``serve``'s app under uvicorn on 127.0.0.1 with the embedded pair
(``dflash_jax.embedded``; float32) on a paged engine (``--page-size``, a pool of ``--pages`` pages, prefix
caching on). Every request is checked against its solo run (the same engine, each request alone, before
the server starts), and every page must be back in the pool at the end (``/metrics``).

Printed: requests and tokens answered per second, latency percentiles, and the server's preemptions,
prefix-cache hits and pages in use at the end.

    python3 bench/bench_paged_load.py --clients 64 --duration 60 --json /tmp/paged_load.json
    JAX_PLATFORMS=cpu python3 bench/bench_paged_load.py --clients 16 --duration 5 --requests 8   # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
import numpy as np

import timing
from dflash_jax import embedded
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.serving import ServerThread, create_app
from dflash_jax.serving.testing import pages_back, run_clients


def workload(tokenizer, n: int, systems: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` requests: ``systems`` system prompts (the embedded pair's held-out prompts, at most 256 tokens)
    each followed by another held-out prompt, cut to 16-160 tokens, with 16-128 new tokens."""
    rs = np.random.RandomState(seed)
    texts = embedded.heldout_prompts()
    heads = [tokenizer.encode(texts[i])[:256] for i in range(systems)]
    requests = []
    for i in range(n):
        user = tokenizer.encode(texts[systems + i % (len(texts) - systems)])[: int(rs.randint(16, 161))]
        requests.append((heads[i % systems] + user, int(rs.choice([16, 32, 64, 128]))))
    return requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--requests", type=int, default=32, help="distinct requests the clients draw from")
    ap.add_argument("--systems", type=int, default=4, help="system prompts they share")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    target, drafter, tokenizer = embedded.load_default()
    requests = workload(tokenizer, args.requests, args.systems)
    config = EngineConfig(max_batch_size=args.max_batch_size, max_length=args.max_length, page_size=args.page_size,
                          num_pages=args.pages, prefix_cache=True)
    engine = Engine(target, drafter, config)
    stops = tokenizer.stop_token_ids
    t0 = time.perf_counter()
    solo = [engine.generate([p], m, stops)[0].output_ids for p, m in requests]
    print(f"{len(requests)} solo runs in {time.perf_counter() - t0:.0f} s", flush=True)
    app = create_app(engine, tokenizer, model_name="embedded", max_length=args.max_length,
                     vocab_size=target.config.vocab_size)
    with ServerThread(app) as srv:
        t0 = time.perf_counter()
        answers, errors = run_clients(srv.url, requests, args.clients, args.duration)
        wall = time.perf_counter() - t0
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            metrics = pages_back(client)
    wrong = sum(ids != solo[i] for i, ids, _ in answers)
    latencies = sorted(s for _, _, s in answers)
    tokens = sum(len(ids) for _, ids, _ in answers)
    result = {"answered": len(answers), "errors": [repr(e) for e in errors[:5]], "wrong": wrong, "wall_s": wall,
              "requests_per_s": len(answers) / wall, "tokens_per_s": tokens / wall,
              "latency_p50_s": statistics.median(latencies) if latencies else None,
              "latency_p99_s": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
              "preemptions": metrics.get("dflash_preemptions_total"),
              "prefix_hit_tokens": metrics.get("dflash_prefix_cache_hits_total"),
              "prefix_query_tokens": metrics.get("dflash_prefix_cache_queries_total"),
              "pages_in_use_at_end": metrics.get("dflash_kv_pages_in_use"), "args": vars(args)}
    print(f"{args.clients} clients, {wall:.1f} s: {len(answers)} answered ({result['requests_per_s']:.1f}/s, "
          f"{result['tokens_per_s']:.0f} tokens/s), {len(errors)} errors, {wrong} not equal to their solo run; "
          f"latency p50 {result['latency_p50_s']:.2f} s, p99 {result['latency_p99_s']:.2f} s; "
          f"{result['preemptions']:.0f} preemptions, prefix hits {result['prefix_hit_tokens']:.0f} of "
          f"{result['prefix_query_tokens']:.0f} prompt tokens; pages in use at the end "
          f"{result['pages_in_use_at_end']:.0f}")
    timing.write_json(args.json, result)
    if errors or wrong or result["pages_in_use_at_end"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
