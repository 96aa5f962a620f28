"""Startup: what a server pays before its first request, with and without the persistent compilation
cache (``EngineConfig.compilation_cache_dir``), and whether a program loaded from the cache runs as
fast as, and computes the same as, the one compiled for it.

Each run is a fresh process (the cache matters between processes): it builds the Qwen3-8B-shaped
random bf16 target and 5-layer block-16 drafter of ``bench_engine.py``, then for a DFlash engine and
a target-only engine with serve.py's default shapes (8 rows, 2048 positions) times ``Engine.warmup``
(what ``serve.py`` runs before it binds), the back-to-back batch-1 decode step from a 512-token
context, how soon a decode call returns to the host, the time to first token, and generates 48
tokens from a fixed prompt (every run must give the first run's tokens). Runs share one cache
directory, in order: ``none`` (no cache), ``cold`` (an empty cache: compile and save), ``warm`` (load).

    python3 bench/bench_startup.py --runs none,cold,warm,warm --out bench/results/startup.json
    JAX_PLATFORMS=cpu python3 bench/bench_startup.py --tiny --runs cold,warm      # smoke test
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTEXT, STEPS, CALLS = 512, 16, 10
RUNS = {"none": False, "cold": True, "warm": True}  # run kind: whether its process uses the cache


def child(cache: str | None, layers: int, tiny: bool) -> dict:
    """One process's startup and step times (printed as one JSON line by ``--child``)."""
    t_start = time.perf_counter()
    import jax

    import timing
    from dflash_jax.runtime.compile_cache import cache_counts
    from dflash_jax.runtime.engine import Engine, EngineConfig
    from dflash_jax.tiny import tiny_target_config

    t0 = time.perf_counter()
    target, drafter = timing.random_pair(tiny_target_config(num_layers=4) if tiny else timing.qwen3_8b(layers))
    jax.block_until_ready(jax.tree.leaves(target))
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, cache=cache,
               import_s=t0 - t_start, init_s=time.perf_counter() - t0)
    prompt = [(7 * i + 3) % (target.config.vocab_size - 1) for i in range(40)]
    # --tiny: a smaller engine, so that a CPU compiles its warm-up in seconds
    context = 64 if tiny else CONTEXT
    config = EngineConfig(max_batch_size=2 if tiny else 8, max_length=320 if tiny else 2048,
                          compilation_cache_dir=cache)
    for name, draft in (("dflash", drafter), ("target_only", None)):
        before = cache_counts()
        t0 = time.perf_counter()
        engine = Engine(target, draft, config)
        built = time.perf_counter() - t0
        warmup = engine.warmup()
        counts = cache_counts() - before
        step = timing.time_decode_pipelined(engine, 1, context, STEPS, CALLS)
        results = [engine.generate([prompt], max_new_tokens=48)[0] for _ in range(3)]
        out[name] = dict(engine_s=built, warmup_s=warmup, loaded=counts.loaded, compiled=counts.compiled,
                         step_ms=step * 1e3, dispatch_ms=dispatch_seconds(engine, context) * 1e3,
                         ttft_ms=min(r.time_to_first_token for r in results) * 1e3,
                         output_ids=list(map(int, results[0].output_ids)),
                         acceptance_lengths=list(map(int, results[0].acceptance_lengths)))
        del engine
    out["total_s"] = time.perf_counter() - t_start
    return out


def dispatch_seconds(engine, context: int, calls: int = 5) -> float:
    """Median seconds until a decode call of ``STEPS`` steps returns to the host: at once when its loop
    runs in the CUDA graph, after the loop when the host reads its condition after every step."""
    import jax

    import timing

    state, times = timing.warmed_state(engine, 1, context, STEPS, seed=11), []
    for _ in range(calls):
        t0 = time.perf_counter()
        state, _ = engine.decode(state, n_steps=STEPS)
        times.append(time.perf_counter() - t0)
        jax.block_until_ready(state.starts)
    return sorted(times)[len(times) // 2]


def gpu_state() -> str | None:
    """Temperature, clocks and power of GPU 0 (nvidia-smi; None without it): a hot or throttled card
    explains a slower run."""
    query = "temperature.gpu,clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active"
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None


def dir_stats(path: Path) -> tuple[int, float]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="none,cold,warm,warm", help=f"processes in order, of: {', '.join(RUNS)}")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--cache-dir", default=None, help="the cache directory (default: a new temporary one)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per process")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.child or None, args.layers, args.tiny)), flush=True)
        return

    import timing

    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="dflash_startup_"))
    report = dict(config=vars(args), cache_dir=str(cache), runs=[])
    for kind in args.runs.split(","):
        if kind not in RUNS:
            raise SystemExit(f"--runs: unknown run {kind!r} ({', '.join(RUNS)})")
        if kind == "cold" and cache.exists() and any(cache.iterdir()):
            raise SystemExit(f"--runs: a cold run needs an empty cache, {cache} has files")
        cmd = [sys.executable, __file__, "--child", str(cache) if RUNS[kind] else "", "--layers", str(args.layers)]
        cmd += ["--tiny"] if args.tiny else []
        before, t0 = gpu_state(), time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{kind}: timed out after {args.timeout:.0f} s", flush=True)
            break
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{kind}: failed ({proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            break
        run = dict(kind=kind, process_s=time.perf_counter() - t0, gpu_before=before, gpu_after=gpu_state(),
                   **json.loads(lines[-1][len("RESULT "):]))
        if kind != "none":
            run["cache_files"], run["cache_mb"] = dir_stats(cache)
        report["runs"].append(run)
        d, t = run["dflash"], run["target_only"]
        print(f"{kind}: process {run['process_s']:.1f} s (init {run['init_s']:.1f}); warmup DFlash "
              f"{d['warmup_s']:.1f} s ({d['loaded']} loaded, {d['compiled']} compiled), target-only "
              f"{t['warmup_s']:.1f} s ({t['loaded']} loaded, {t['compiled']} compiled); step {t['step_ms']:.3f} / "
              f"{d['step_ms']:.3f} ms; decode call returns after {t['dispatch_ms']:.2f} / {d['dispatch_ms']:.2f} ms; "
              f"TTFT {t['ttft_ms']:.1f} / {d['ttft_ms']:.1f} ms; GPU before / after: {before} / {run['gpu_after']}",
              flush=True)
        timing.write_json(args.out, report)

    done = report["runs"]
    if not done:
        return
    first = done[0]
    shape = "batch 1 and 2, max_length 320" if args.tiny else "batch 1 and 8, max_length 2048"
    print(f"\n{first['device']}, jax {first['jax']}; warm-up = Engine.warmup() for {shape}; "
          f"step = back-to-back batch-1 decode step, context {64 if args.tiny else CONTEXT}")
    print("| run | process s | warm-up DFlash s | warm-up target-only s | loaded / compiled | target-only ms | "
          "DFlash ms | ratio | call returns ms (target-only / DFlash) | TTFT ms | tokens as run 1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for i, run in enumerate(done, 1):
        d, t = run["dflash"], run["target_only"]
        same = all(run[k]["output_ids"] == first[k]["output_ids"] for k in ("dflash", "target_only")) and \
            run["dflash"]["acceptance_lengths"] == first["dflash"]["acceptance_lengths"]
        print(f"| {i} {run['kind']} | {run['process_s']:.1f} | {d['warmup_s']:.1f} | {t['warmup_s']:.1f} | "
              f"{d['loaded'] + t['loaded']} / {d['compiled'] + t['compiled']} | {t['step_ms']:.3f} | "
              f"{d['step_ms']:.3f} | {d['step_ms'] / t['step_ms']:.3f} | {t['dispatch_ms']:.2f} / {d['dispatch_ms']:.2f} | "
              f"{t['ttft_ms']:.1f} / {d['ttft_ms']:.1f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
