"""The HTTP server's own host cost: tokens/s through it when the engine costs nothing.

``FakeEngine`` (host-only, numpy, no device work: ``dflash_jax.serving.testing``) behind ``create_app``
under uvicorn in this process, with the embedded pair's tokenizer; N client threads each stream one
``/v1/completions`` request of M tokens (``ignore_eos``) at once, per round. What limits it is what a
small model's server spends per token on the host: the scheduler's host syncs, detokenizing, SSE
framing and the clients themselves (which share the machine). ``--stop`` adds a stop string that never
occurs, so every chunk also goes through the stop check on the scheduler thread.

    python3 bench/bench_server_host.py --streams 8 --tokens 1024 --rounds 5 [--stop]

Prints one JSON line: each round's tokens/s and the median of the rounds after the first.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time

import httpx

import timing
from dflash_jax import embedded
from dflash_jax.io.tokenizer import Tokenizer
from dflash_jax.serving import ServerThread, create_app
from dflash_jax.serving.settings import ServerSettings
from dflash_jax.serving.testing import FakeEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=8, help="the fake engine's tokens per step, at most")
    ap.add_argument("--stop", action="store_true", help="a stop string that never occurs")
    ap.add_argument("--out", default=None, help="also write the JSON line's object to this file")
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
    result = {"streams": args.streams, "tokens": args.tokens, "stop": args.stop,
              "tokens_per_s": [round(r) for r in rates],
              "median_after_first": round(statistics.median(rates[1:] or rates))}
    print(json.dumps(result))
    timing.write_json(args.out, result)


if __name__ == "__main__":
    main()
