"""The HTTP server against its own engine: does serving through HTTP keep the accelerator busy?

A child process builds an engine, times ``Engine.generate`` on each load's prompts (the batch
handed over at once, no HTTP), then serves the same engine with ``create_app`` under uvicorn, as
``serve.py`` does. This process is the clients: for each concurrency N, N streaming
``/v1/completions`` requests sent at once (token-id prompts, ``ignore_eos``, ``max_tokens`` M), so
both sides generate the same tokens through the same compiled programs. Reported per load: tokens/s
both ways and their ratio (the price of the server: the event loop, the scheduler thread, detokenizing,
SSE, admission at host syncs), the median time to first token, the engine's busy fraction of
the round's wall time from ``/metrics``, and the first round's tokens/s and TTFT (shapes compiled
while serving would show there).

    python3 bench/bench_server.py --model 8b --concurrency 1,16 --out bench/results/server.json  # Qwen3-8B shapes
    python3 bench/bench_server.py --model embedded --concurrency 1,16                           # the shipped pair
    JAX_PLATFORMS=cpu python3 bench/bench_server.py --model tiny --concurrency 1,4 --max-tokens 16  # smoke test
    python3 bench/bench_server.py --model 8b --modes dflash --concurrency 1,8 --stop "@@never@@"  # + stop strings

``8b`` and ``tiny`` are random weights under the embedded pair's tokenizer (4,096 ids): the LM head's
columns past the tokenizer are zeroed, as a real checkpoint's padded vocabulary is never predicted,
so every generated id detokenizes (the weights are read all the same).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import timing
from dflash_jax.serving.settings import ServerSettings

MODES = ("target-only", "dflash")


# ------------------------------------------------------------------------------------------ the server


def build_engine(model: str, mode: str, max_batch: int, max_length: int, layers: int,
                 max_steps_per_sync: int | None = None):
    """``(engine, tokenizer, prompt source)``: ``prompts(n, length)`` returns n token-id prompts."""
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax import embedded
    from dflash_jax.runtime.engine import Engine, EngineConfig
    from dflash_jax.io.tokenizer import Tokenizer

    tokenizer = Tokenizer(embedded.DEFAULT_TARGET)
    if model == "embedded":
        target, drafter, _ = embedded.load_default(dtype="bfloat16")
        texts = embedded.heldout_prompts()

        def prompts(n: int, length: int) -> list[list[int]]:  # held-out text, where the drafter is at home
            return [tokenizer.encode(texts[i % len(texts)])[:length] for i in range(n)]
    else:
        from dflash_jax.tiny import tiny_target_config

        config = timing.qwen3_8b(layers) if model == "8b" else tiny_target_config(vocab_size=4352)
        target, drafter = timing.random_pair(config, dtype=jnp.bfloat16)
        target.lm_head[...] = target.lm_head[...].at[:, tokenizer.vocab_size:].set(0)

        def prompts(n: int, length: int) -> list[list[int]]:
            rng = np.random.default_rng(0)
            return [rng.integers(16, tokenizer.vocab_size, length).tolist() for _ in range(n)]
    engine = Engine(target, None if mode == "target-only" else drafter,
                    EngineConfig(max_batch_size=max_batch, max_length=max_length,
                                 max_steps_per_sync=max_steps_per_sync))
    return engine, tokenizer, prompts


def timed_generate(engine, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict:
    engine.generate(prompts, max_tokens, stop_token_ids=[])  # compiles this load's shapes
    walls, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = engine.generate(prompts, max_tokens, stop_token_ids=[])
        walls.append(time.perf_counter() - t0)
        tokens = sum(len(r.output_ids) for r in results)
    wall = statistics.median(walls)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def serve_child(spec: dict) -> None:
    """Builds the engine, times ``Engine.generate`` per load, writes ``spec['ready']``, then serves."""
    from dflash_jax.serving import create_app, run_server

    sys.setswitchinterval(spec["switch_interval_ms"] / 1000)
    concurrency = spec["concurrency"]
    engine, tokenizer, prompt_source = build_engine(spec["model"], spec["mode"], max(concurrency),
                                                    spec["prompt_len"] + spec["max_tokens"] + 16, spec["layers"],
                                                    spec["max_steps_per_sync"])
    t0 = time.perf_counter()
    engine.warmup()
    warmup_s = time.perf_counter() - t0
    print(f"[{spec['mode']}] warm-up {warmup_s:.1f} s, prompt buckets {[b for b, _ in engine.prompt_buckets()]}",
          flush=True)
    loads = {}
    for n in concurrency:
        prompts = prompt_source(n, spec["prompt_len"])
        loads[n] = {"prompts": prompts, **timed_generate(engine, prompts, spec["max_tokens"], spec["repeats"])}
        print(f"[{spec['mode']}] engine, {n} prompts: {loads[n]['tokens_per_s']:.0f} tok/s", flush=True)
    app = create_app(engine, tokenizer, model_name="bench", max_length=engine.config.max_length,
                     vocab_size=engine.vocab_size, stop_token_ids=[])
    Path(spec["ready"]).write_text(json.dumps({"warmup_s": warmup_s, "block_size": engine.block_size,
                                               "prompt_buckets": [b for b, _ in engine.prompt_buckets()],
                                               "loads": loads}))
    run_server(app, port=spec["port"], log_level="warning")


# ----------------------------------------------------------------------------------------- the clients


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


async def one_stream(client, prompt: list[int], max_tokens: int, stop: str | None = None) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if stop is not None:
        body["stop"] = [stop]
    t0 = time.perf_counter()
    first, tokens, stats = None, 0, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if first is None and any(c.get("text") for c in event.get("choices", ())):
                first = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event.get("dflash"):
                stats = event["dflash"][0]
    return {"ttft_s": first, "tokens": tokens, "latency_s": time.perf_counter() - t0, "stats": stats}


async def http_round(url: str, prompts: list[list[int]], max_tokens: int, stop: str | None = None) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        busy0 = metric((await client.get("/metrics")).text, "dflash_engine_busy_seconds_total")
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(one_stream(client, p, max_tokens, stop) for p in prompts))
        wall = time.perf_counter() - t0
        busy = metric((await client.get("/metrics")).text, "dflash_engine_busy_seconds_total") - busy0
    tokens = sum(s["tokens"] for s in streams)
    ttfts = [s["ttft_s"] for s in streams if s["ttft_s"] is not None]
    taus = [s["stats"]["tau"] for s in streams if s["stats"] and s["stats"].get("tau") is not None]
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "busy_fraction": busy / wall,
            "ttft_median_s": statistics.median(ttfts) if ttfts else None,
            "tau_mean": statistics.fmean(taus) if taus else None}


def wait_ready(proc: subprocess.Popen, ready: Path, url: str, timeout: float) -> dict:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server process exited with status {proc.returncode}")
        if ready.exists():
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return json.loads(ready.read_text())
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready within {timeout} s")


def run_mode(args, mode: str, port: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        spec = {"model": args.model, "mode": mode, "concurrency": args.concurrency, "prompt_len": args.prompt_len,
                "max_tokens": args.max_tokens, "repeats": args.repeats, "layers": args.layers, "port": port,
                "switch_interval_ms": args.switch_interval_ms,
                "max_steps_per_sync": args.max_steps_per_sync, "ready": str(ready)}
        proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)])
        url = f"http://127.0.0.1:{port}"
        try:
            info = wait_ready(proc, ready, url, args.start_timeout)
            rows = []
            stops = [None] if args.stop is None else [None, args.stop]
            for n in args.concurrency:
                load = info["loads"][str(n)]
                first = asyncio.run(http_round(url, load["prompts"], args.max_tokens))  # any shapes left to compile
                rounds = {stop: [] for stop in stops}
                for _ in range(args.repeats):  # with --stop, rounds with and without it interleaved
                    for stop in stops:
                        rounds[stop].append(asyncio.run(http_round(url, load["prompts"], args.max_tokens, stop)))
                for stop, runs in rounds.items():
                    best = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]  # the median round
                    rows.append({"mode": mode, "concurrency": n, "stop": stop,
                                 "engine_tokens_per_s": load["tokens_per_s"], "engine_tokens": load["tokens"],
                                 **{f"server_{k}": v for k, v in best.items()},
                                 "server_over_engine": best["tokens_per_s"] / load["tokens_per_s"],
                                 "server_rounds_tokens_per_s": [r["tokens_per_s"] for r in runs],
                                 **{f"first_round_{k}": v for k, v in first.items()}})
                    print(f"[{mode}] server, {n} streams{'' if stop is None else ', stop string'}: "
                          f"{best['tokens_per_s']:.0f} tok/s", flush=True)
            return {"warmup_s": info["warmup_s"], "block_size": info["block_size"],
                    "prompt_buckets": info["prompt_buckets"], "rows": rows}
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b", choices=["8b", "embedded", "tiny"])
    ap.add_argument("--layers", type=int, default=36, help="8b: the target's layers")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--switch-interval-ms", type=float, default=ServerSettings().gil_switch_interval_ms,
                    help="the serving process's sys.setswitchinterval, as server.gil_switch_interval_ms (default: "
                         "serve.py's)")
    ap.add_argument("--max-steps-per-sync", type=int, default=None,
                    help="EngineConfig.max_steps_per_sync: calls grow while the device outruns the host")
    ap.add_argument("--stop", default=None,
                    help="also time rounds whose requests carry this stop string (one that never occurs), "
                         "interleaved with plain rounds on the same server: the cost of matching stop strings")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        serve_child(json.loads(args.child))
        return
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        ap.error(f"--modes: unknown {sorted(unknown)}; choose from {list(MODES)}")
    results = {"args": {k: v for k, v in vars(args).items() if k != "child"}, "modes": {}}
    for i, mode in enumerate(modes):
        results["modes"][mode] = run_mode(args, mode, args.port + i)
    print(f"\n{args.model}, prompts of {args.prompt_len} tokens, {args.max_tokens} new tokens, median of "
          f"{args.repeats} rounds")
    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.1f}"

    print("mode | warm-up s | streams | stop string | engine tok/s | server tok/s | server / engine | engine busy | TTFT median ms "
          "| tau | first round: tok/s, TTFT median ms")
    for mode, res in results["modes"].items():
        for r in res["rows"]:
            tau = r["server_tau_mean"]
            print(f"{mode} | {res['warmup_s']:.1f} | {r['concurrency']} | {'-' if r['stop'] is None else 'yes'} | "
                  f"{r['engine_tokens_per_s']:.0f} | "
                  f"{r['server_tokens_per_s']:.0f} | {r['server_over_engine']:.3f} | {r['server_busy_fraction']:.1%} | "
                  f"{ms(r['server_ttft_median_s'])} | {'-' if tau is None else f'{tau:.2f}'} | "
                  f"{r['first_round_tokens_per_s']:.0f}, {ms(r['first_round_ttft_median_s'])}")
    timing.write_json(args.out, results)


if __name__ == "__main__":
    main()
