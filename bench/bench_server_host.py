#!/usr/bin/env python
"""The HTTP server's own host cost: tokens/s through it when the engine costs nothing.

``FakeEngine`` (host-only, numpy, no device work: ``dflash_jax.server.testing``) behind ``create_app``
under uvicorn in this process, with the embedded pair's tokenizer; N client threads each stream one
``/v1/completions`` request of M tokens (``ignore_eos``) at once, per round. What limits it is what a
small model's server spends per token on the host: the scheduler's host syncs, detokenizing, SSE
framing and the clients themselves (which share the machine). ``--stop`` adds a stop string that never
occurs, so every chunk also goes through the stop check on the scheduler thread.

    python bench/bench_server_host.py --streams 8 --tokens 1024 --rounds 5 [--stop]

Prints one JSON line: each round's tokens/s and the median of the rounds after the first.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from dflash_jax import embedded  # noqa: E402
from dflash_jax.server import ServerThread, create_app  # noqa: E402
from dflash_jax.server.settings import ServerSettings  # noqa: E402
from dflash_jax.server.testing import FakeEngine  # noqa: E402
from dflash_jax.tokenizer import Tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=8, help="the fake engine's tokens per step, at most")
    ap.add_argument("--stop", action="store_true", help="a stop string that never occurs")
    args = ap.parse_args()

    sys.setswitchinterval(ServerSettings().gil_switch_interval_ms / 1000)  # as serve.py sets it
    tokenizer = Tokenizer(embedded.DEFAULT_TARGET)
    vocab = tokenizer.vocab_size
    engine = FakeEngine(vocab, max_batch_size=args.streams, max_length=args.tokens + 16, block_size=args.block_size,
                        steps_per_sync=1, token_range=(0, vocab))
    app = create_app(engine, tokenizer, model_name="fake", max_length=args.tokens + 16, vocab_size=vocab)
    body = {"max_tokens": args.tokens, "stream": True, "ignore_eos": True}
    if args.stop:
        body["stop"] = ["\u2603 never generated \u2603"]

    with ServerThread(app) as srv:
        def one(i: int) -> int:
            with httpx.Client(base_url=srv.url, timeout=300) as client:
                with client.stream("POST", "/v1/completions", json={**body, "prompt": [10 + i, 11, 12]}) as r:
                    return sum(1 for _ in r.iter_lines())

        rates = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
                list(pool.map(one, range(args.streams)))
            rates.append(args.streams * args.tokens / (time.perf_counter() - t0))
    print(json.dumps({"streams": args.streams, "tokens": args.tokens, "stop": args.stop,
                      "tokens_per_s": [round(r) for r in rates],
                      "median_after_first": round(statistics.median(rates[1:] or rates))}))


if __name__ == "__main__":
    main()
