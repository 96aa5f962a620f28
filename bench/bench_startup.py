"""Startup benchmark: what a server pays before its first request, with and without the persistent
compilation cache (``EngineConfig.compilation_cache_dir``), and whether a program loaded from the
cache runs as fast as, and computes the same as, the one compiled for it.

Each run is a fresh process (the cache matters between processes): it builds the Qwen3-8B-shaped
random bf16 target and 5-layer block-16 drafter of ``bench_engine.py``, then for a DFlash engine and
a target-only engine with serve.py's default shapes (8 rows, 2048 positions) times ``Engine.warmup``
(what ``serve.py`` runs before it binds), the back-to-back batch-1 decode step from a 512-token
context, and generates 48 tokens from a fixed prompt. Runs share one cache directory, in order:
``none`` (no cache), ``cold`` (an empty cache: compile and save), ``warm`` (load), and the
diagnostic kinds of ``RUNS``. For why processes differ: ``--profile`` traces each run's decode and
compares its kernels, the time they overlap and the gaps between them; ``--dump`` has XLA write the
decode programs it compiles; ``--serialize`` writes the executables themselves; ``--vmodule`` with
``--logs`` keeps XLA's verbose log of the named source files (are the CUDA graphs re-recorded between
the timed calls?) and, with ``cuda_command_buffer=2`` in it, reads the graphs of each timed decode
back through the driver API (``graph_census``: nodes, programmatic edges); ``--context`` records the
CUDA context's settings (``context_state``).

    python bench/bench_startup.py --runs none,cold,warm,warm --out $OUT/startup.json
    python bench/bench_startup.py --runs cold,autotune,warm --layers 8 --profile /tmp/prof --dump /tmp/dump
    python bench/bench_startup.py --runs cold,warm --layers 8 --vmodule command_buffer_thunk=3,cuda_command_buffer=2 \
        --logs /tmp/logs --context
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONTEXT, STEPS, CALLS = 512, 16, 10
_DECODE_FLAGS = ["--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
                 "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"]
_NO_XLA_CACHES = {"JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"}
_CACHED_AUTOTUNING = "--xla_gpu_per_fusion_autotune_cache_dir={cache}/xla_gpu_per_fusion_autotune_cache_dir"
# run kind: (whether the process uses the compilation cache, XLA_FLAGS added to its environment,
# other environment variables)
RUNS = {
    "none": (False, [], {}),
    "cold": (True, [], {}),
    "warm": (True, [], {}),
    # the decode jit's XLA options as the process's flags: does a loaded program take them from there?
    "warm-decode-flags": (True, _DECODE_FLAGS, {}),
    # no executable cache, only XLA's per-fusion autotuning results of the earlier runs
    "autotune": (False, [_CACHED_AUTOTUNING], {}),
    # the same with XLA's early launch signal in its Triton GEMMs off (xla_gpu_enable_pdl_launch)
    "autotune-nolaunch": (False, [_CACHED_AUTOTUNING, "--xla_gpu_enable_pdl_launch=false"], {}),
    # executables only: without the XLA autotuning cache JAX otherwise keeps beside them
    "cold-exec": (True, [], _NO_XLA_CACHES),
    "warm-exec": (True, [], _NO_XLA_CACHES),
    # a warm run that first autotunes GEMMs of its own (autotune_fresh_gemms)
    "warm-pre-autotune": (True, [], {"BENCH_PRE_AUTOTUNE": "other"}),
    # a warm run whose CUDA modules load every kernel when loaded, not at its first launch
    "warm-eager": (True, [], {"CUDA_MODULE_LOADING": "EAGER"}),
    # a warm run that first sets the CUDA context's cache configuration and limits as the first run
    # had them at its timed decode (context_state)
    "warm-context-as-first": (True, [], {"BENCH_CONTEXT": "first"}),
    # an executables-only warm run that first compiles the engines' batch-1 decode step as a fixed
    # loop, a program the cache does not hold, so that XLA measures the engines' own GEMM fusions in
    # the process (autotune_engine_gemms); then it loads everything else
    "warm-exec-self-autotune": (True, [], {**_NO_XLA_CACHES, "BENCH_PRE_AUTOTUNE": "engine"}),
}


def autotune_fresh_gemms(hidden: int, intermediate: int) -> float:
    """Compiles and runs GEMMs of shapes no engine program has (5-row blocks), so that XLA autotunes
    in this process even when every engine program comes from the cache; returns the seconds."""
    import jax
    import jax.numpy as jnp

    t0, key = time.perf_counter(), jax.random.key(5)
    for n, k in ((hidden, 3 * hidden // 2), (hidden, hidden), (intermediate, hidden), (hidden, 2 * intermediate)):
        a = jax.random.normal(key, (5, n), jnp.bfloat16)
        b = jax.random.normal(key, (n, k), jnp.bfloat16)
        jax.block_until_ready(jax.jit(jnp.dot)(a, b))
    return time.perf_counter() - t0


def autotune_engine_gemms(target, drafter, config) -> float:
    """Compiles the batch-1 decode step of a DFlash and a target-only engine as a fixed loop (the same
    GEMM fusions as the engines' own decode, in a program of another cache key), so that XLA measures
    those fusions in this process while the engines' programs still come from the cache; returns the
    seconds."""
    import dataclasses

    from dflash_jax.engine import Engine

    t0 = time.perf_counter()
    for draft in (drafter, None):
        probe = Engine(target, draft, dataclasses.replace(config, decode_loop="fixed"))
        probe.decode_compiled(probe.empty_state(1), 2)
    return time.perf_counter() - t0


def child(cache: str | None, layers: int, tiny: bool, pre_autotune: str | None = None, profile: str | None = None,
          serialize: str | None = None) -> dict:
    """One process's startup and step times (printed as one JSON line by ``--child``). ``profile``: a
    directory for a trace of each engine's batch-1 decode; the result then holds each kernel's GPU time
    per step and the device addresses of the weights and caches. ``serialize``: a directory for each
    engine's batch-1 decode executable as JAX serializes it (``serialized_decode``). ``pre_autotune``:
    "other" (``autotune_fresh_gemms``) or "engine" (``autotune_engine_gemms``) before the engines."""
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    t_start = time.perf_counter()
    import jax

    from bench_engine import qwen3_8b, random_pair, time_decode_pipelined
    from dflash_jax.compile_cache import cache_counts
    from dflash_jax.engine import Engine, EngineConfig
    from dflash_jax.tiny import tiny_target_config

    # BENCH_CONTEXT: unset, nothing; "{}", record the context before each timed decode; an earlier
    # run's context, first set this process's to it
    context_to_apply = json.loads(os.environ.get("BENCH_CONTEXT") or "{}")
    if context_to_apply:
        jax.devices()  # the primary context exists once the backend is up
        context_to_apply = context_state(apply=context_to_apply)
    t0 = time.perf_counter()
    target, drafter = random_pair(tiny_target_config(num_layers=layers) if tiny else qwen3_8b(layers))
    jax.block_until_ready(jax.tree.leaves(target))
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, cache=cache,
               import_s=t0 - t_start, init_s=time.perf_counter() - t0)
    if context_to_apply:
        out["context_applied"] = context_to_apply
    prompt = [(7 * i + 3) % (target.config.vocab_size - 1) for i in range(40)]
    config = EngineConfig(max_batch_size=8, max_length=2048, compilation_cache_dir=cache)
    if pre_autotune == "other":
        out["pre_autotune_s"] = autotune_fresh_gemms(target.config.hidden_size, target.config.intermediate_size)
    elif pre_autotune == "engine":
        before = cache_counts()
        out["pre_autotune_s"] = autotune_engine_gemms(target, drafter, config)
        out["pre_autotune_compiled"] = (cache_counts() - before).compiled
    for name, draft in (("dflash", drafter), ("target_only", None)):
        before = cache_counts()
        t0 = time.perf_counter()
        engine = Engine(target, draft, config)
        built = time.perf_counter() - t0
        warmup = engine.warmup()
        counts = cache_counts() - before
        context = context_state() if "BENCH_CONTEXT" in os.environ else None
        log_from = mark_phase(f"{name} timed decode start")
        step = time_decode_pipelined(engine, 1, CONTEXT, STEPS, CALLS)
        mark_phase(f"{name} timed decode end")
        graphs = graph_census(log_from)
        traced = profile_kernels(engine, f"{profile}/{name}") if profile else {}
        if serialize:
            traced.update(serialized_decode(engine, Path(serialize) / f"{name}.bin"))
        results = [engine.generate([prompt], max_new_tokens=48)[0] for _ in range(3)]
        out[name] = dict(engine_s=built, warmup_s=warmup, loaded=counts.loaded, compiled=counts.compiled,
                         step_ms=step * 1e3, dispatch_ms=dispatch_seconds(engine) * 1e3,
                         ttft_ms=min(r.time_to_first_token for r in results) * 1e3,
                         output_ids=list(map(int, results[0].output_ids)),
                         acceptance_lengths=list(map(int, results[0].acceptance_lengths)), **traced)
        if graphs:
            out[name]["graphs"] = graphs
        if context:
            out[name]["context"] = context
        del engine
    out["total_s"] = time.perf_counter() - t_start
    return out


def mark_phase(text: str) -> int:
    """Writes a BENCH_PHASE line to stderr (the run's log, beside XLA's); returns the log's size
    before it (where the phase's log lines start) when stderr is a file, else 0."""
    sys.stderr.flush()
    try:
        offset = os.lseek(2, 0, os.SEEK_END)
    except OSError:  # a pipe
        offset = 0
    print(f"BENCH_PHASE {text}", file=sys.stderr, flush=True)
    return offset


_LIMITS = ("stack_size", "printf_fifo_size", "malloc_heap_size", "dev_runtime_sync_depth",
           "dev_runtime_pending_launch_count", "max_l2_fetch_granularity", "persisting_l2_cache_size")


def context_state(apply: dict | None = None) -> dict:
    """The CUDA primary context's settings that outlive a kernel (its cache configuration, flags,
    limits such as the per-thread stack that local memory is sized by, the module loading mode),
    read through the driver API; with ``apply`` (an earlier process's state), first sets its cache
    configuration and limits to those. Could compiling and autotuning leave a
    context that runs the same graph differently?"""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    cuda.cuDeviceGet(ctypes.byref(device), 0)
    cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
    cuda.cuCtxPushCurrent_v2(context)
    try:
        if apply:
            if apply["cache_config"] >= 0:
                cuda.cuCtxSetCacheConfig(apply["cache_config"])
            for i, name in enumerate(_LIMITS):
                if apply["limits"].get(name) is not None:
                    cuda.cuCtxSetLimit(i, ctypes.c_size_t(apply["limits"][name]))
        cache_config, flags, mode = ctypes.c_int(-1), ctypes.c_uint(0), ctypes.c_int(-1)
        cuda.cuCtxGetCacheConfig(ctypes.byref(cache_config))
        cuda.cuCtxGetFlags(ctypes.byref(flags))
        cuda.cuModuleGetLoadingMode(ctypes.byref(mode))
        limits = {}
        for i, name in enumerate(_LIMITS):
            value = ctypes.c_size_t(0)
            limits[name] = value.value if cuda.cuCtxGetLimit(ctypes.byref(value), i) == 0 else None
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    finally:
        cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        cuda.cuDevicePrimaryCtxRelease_v2(device)
    return dict(cache_config=cache_config.value, flags=flags.value, module_loading=mode.value, limits=limits,
                free_mb=free.value >> 20)


def graph_census(log_from: int) -> list[dict]:
    """The CUDA graphs XLA created since ``log_from`` in this process's log (their handles, which
    XLA logs with ``cuda_command_buffer=2``), read back through the driver API: their nodes, kernel
    nodes, and edges by type: programmatic edges (XLA's programmatic dependent launch in a graph:
    the kernel after the edge may start before the one before it ends) against full ones. Empty
    without the run's log file (``--logs``: BENCH_LOG)."""
    import ctypes
    import re

    if not os.environ.get("BENCH_LOG"):  # stderr is the parent's pipe: no log to read back
        return []
    with open(os.environ["BENCH_LOG"], "rb") as log:
        log.seek(log_from)
        text = log.read().decode(errors="replace")
    # a new executable evicts every other executable's graphs: only those created since are alive
    text = text[text.rfind("Evict command buffer thunk command buffers") + 1:]
    handles = re.findall(r"Created (conditional )?CUDA graph (0x[0-9a-f]+)", text)
    if not handles:
        return []
    cuda = ctypes.CDLL("libcuda.so.1")
    size = ctypes.c_size_t
    census = []
    for conditional, handle in handles:
        graph = ctypes.c_void_p(int(handle, 16))
        n_nodes = size(0)
        if cuda.cuGraphGetNodes(graph, None, ctypes.byref(n_nodes)) != 0:
            census.append(dict(graph=handle, error="cuGraphGetNodes failed (destroyed?)"))
            continue
        nodes = (ctypes.c_void_p * n_nodes.value)()
        cuda.cuGraphGetNodes(graph, nodes, ctypes.byref(n_nodes))
        kinds = []
        for node in nodes:
            kind = ctypes.c_int(-1)
            cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
            kinds.append(kind.value)
        n_edges = size(0)
        cuda.cuGraphGetEdges_v2(graph, None, None, None, ctypes.byref(n_edges))
        sources, targets = (ctypes.c_void_p * n_edges.value)(), (ctypes.c_void_p * n_edges.value)()
        data = (ctypes.c_uint8 * (8 * n_edges.value))()  # CUgraphEdgeData: from_port, to_port, type, 5 reserved
        cuda.cuGraphGetEdges_v2(graph, sources, targets, data, ctypes.byref(n_edges))
        types = [(data[8 * i], data[8 * i + 2]) for i in range(n_edges.value)]
        census.append(dict(graph=handle, conditional_body=bool(conditional), nodes=len(kinds),
                           kernel_nodes=kinds.count(0), edges=len(types),
                           programmatic_edges=sum(t == 1 for _, t in types),
                           programmatic_port_edges=sum(port == 1 for port, _ in types)))
    return census


def profile_kernels(engine, out_dir: str, calls: int = 3) -> dict:
    """Each kernel's GPU time per batch-1 decode step (us) in a trace of ``calls`` synchronised calls of
    ``STEPS`` steps; per step, the GPU spans' sum, their union and the gaps under 100 us between them
    (sum minus union: the time kernels overlap, as XLA's programmatic dependent launch lets them);
    and where the buffers lie: the lowest and highest device address of the weights and of the decode
    state."""
    import jax

    from bench_engine import attention_layers, durations_by_name, gpu_spans, traced_steps, warmed_state

    state = warmed_state(engine, 1, CONTEXT, STEPS, seed=13)

    def run():
        nonlocal state
        state, _ = engine.decode(state, n_steps=STEPS)
        jax.block_until_ready(state.starts)

    spans = gpu_spans(run, out_dir, calls) or []
    by_name = durations_by_name(spans)
    per_step = traced_steps({name: len(d) for name, d in by_name.items()}, attention_layers(engine), calls * STEPS)
    kernels = {name: [len(d) / per_step, sum(d) / per_step] for name, d in by_name.items()}
    covered = idle = 0.0  # gaps of 100 us and more are the syncs between calls
    end = None
    for e in sorted(spans, key=lambda e: e["ts"]):
        if end is not None and 0 < e["ts"] - end < 100:
            idle += e["ts"] - end
        covered += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end or e["ts"]))
        end = max(end or 0.0, e["ts"] + e["dur"])

    def span(arrays) -> list[int]:
        pointers = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(arrays) if hasattr(a, "unsafe_buffer_pointer")]
        return [min(pointers), max(pointers)] if pointers else []

    return dict(kernels=kernels, traced_steps=per_step, gpu_busy_us=sum(t for _, t in kernels.values()),
                gpu_covered_us=covered / per_step, gpu_idle_us=idle / per_step,
                weights_at=span(engine._target_state + list(engine._drafter_state)), state_at=span(state))


def serialized_decode(engine, path: Path) -> dict:
    """Writes the batch-1 decode executable, serialized, to ``path`` (do two processes run the same
    bytes?); returns its size and hash."""
    import hashlib

    from jax.experimental.serialize_executable import serialize

    payload, _, _ = serialize(engine.decode_compiled(engine.empty_state(1), STEPS))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(payload)
    return dict(serialized_bytes=len(payload), serialized_sha=hashlib.sha256(payload).hexdigest()[:16])


def dispatch_seconds(engine, calls: int = 5) -> float:
    """Median seconds until a decode call of ``STEPS`` steps returns to the host. A call whose loop
    runs in the CUDA graph returns at once; one whose loop condition the host reads after every
    step returns when the loop is done."""
    import jax

    from bench_engine import warmed_state

    state, times = warmed_state(engine, 1, CONTEXT, STEPS, seed=11), []
    for _ in range(calls):
        t0 = time.perf_counter()
        state, _ = engine.decode(state, n_steps=STEPS)
        times.append(time.perf_counter() - t0)
        jax.block_until_ready(state.starts)
    return sorted(times)[len(times) // 2]


def gpu_state() -> str | None:
    """Temperature, clocks and power of GPU 0 as nvidia-smi reports them (None without nvidia-smi)."""
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
    ap.add_argument("--profile", default=None, help="a directory: trace each run's batch-1 decode and compare "
                    "its kernels' GPU time with the first run's")
    ap.add_argument("--dump", default=None, help="a directory: XLA dumps the decode programs each run compiles "
                    "(optimised HLO, thunk sequences, autotuning results) under DIR/<n>_<run>")
    ap.add_argument("--serialize", default=None, help="a directory: write each run's batch-1 decode executables, "
                    "serialized, under DIR/<n>_<run> and report their hashes")
    ap.add_argument("--vmodule", default=None, help="XLA's verbose logging for these source files in every run "
                    "(TF_CPP_VMODULE, e.g. command_buffer_thunk=3,gpu_command_buffer=5); needs --logs")
    ap.add_argument("--logs", default=None, help="a directory: each run's stderr as DIR/<n>_<run>.log, with "
                    "BENCH_PHASE lines around the timed decode")
    ap.add_argument("--context", action="store_true", help="record the CUDA context's settings before each "
                    "timed decode (context_state)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        if os.environ.get("BENCH_LOG"):  # XLA's log and the phase marks into one file the census can read
            os.dup2(os.open(os.environ["BENCH_LOG"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 2)
        pre = os.environ.get("BENCH_PRE_AUTOTUNE")
        print("RESULT " + json.dumps(child(args.child or None, args.layers, args.tiny, pre, args.profile,
                                           args.serialize)), flush=True)
        return

    if args.vmodule and not args.logs:
        raise SystemExit("--vmodule: the verbose log goes to each run's stderr; give --logs DIR to keep it")
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="dflash_startup_"))
    runs, report = args.runs.split(","), dict(config=vars(args), cache_dir=str(cache), runs=[])
    for kind in runs:
        if kind not in RUNS:
            raise SystemExit(f"--runs: unknown run {kind!r} ({', '.join(RUNS)})")
        if kind.startswith("cold") and cache.exists() and any(cache.iterdir()):
            raise SystemExit(f"--runs: a cold run needs an empty cache, {cache} has files")
        uses_cache, flags, extra_env = RUNS[kind]
        env, tag = {**os.environ, **extra_env}, f"{len(report['runs']) + 1}_{kind}"
        if env.get("BENCH_CONTEXT") == "first":
            first = report["runs"][0]["target_only"].get("context") if report["runs"] else None
            if not first:
                raise SystemExit(f"--runs: {kind} needs an earlier run and --context")
            env["BENCH_CONTEXT"] = json.dumps(first)
        elif args.context:
            env["BENCH_CONTEXT"] = "{}"
        if args.dump:
            flags = [*flags, f"--xla_dump_to={args.dump}/{tag}",
                     "--xla_dump_hlo_module_re=jit__decode_fn"]
        if args.vmodule:
            env.update(TF_CPP_VMODULE=args.vmodule, TF_CPP_MIN_LOG_LEVEL="0")
        log = Path(args.logs) / f"{tag}.log" if args.logs else None
        if log:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.unlink(missing_ok=True)
            env["BENCH_LOG"] = str(log)
        if flags:
            env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip().replace("{cache}", str(cache))
        cmd = [sys.executable, __file__, "--child", str(cache) if uses_cache else "", "--layers", str(args.layers)]
        cmd += ["--tiny"] if args.tiny else []
        cmd += ["--profile", f"{args.profile}/{tag}"] if args.profile else []
        cmd += ["--serialize", f"{args.serialize}/{tag}"] if args.serialize else []
        before = gpu_state()
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired:
            print(f"{kind}: timed out after {args.timeout:.0f} s", flush=True)
            break
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            errors = log.read_text(errors="replace") if log and log.exists() else proc.stderr
            print(f"{kind}: failed ({proc.returncode})\n{errors[-3000:]}", flush=True)
            break
        run = dict(kind=kind, process_s=time.perf_counter() - t0, gpu_before=before, gpu_after=gpu_state(),
                   **json.loads(lines[-1][len("RESULT "):]))
        if kind != "none":
            run["cache_files"], run["cache_mb"] = dir_stats(cache)
        report["runs"].append(run)
        d, t = run["dflash"], run["target_only"]
        if "pre_autotune_s" in run:
            print(f"{kind}: autotuning beforehand took {run['pre_autotune_s']:.1f} s "
                  f"({run.get('pre_autotune_compiled', '-')} programs compiled)", flush=True)
        print(f"{kind}: process {run['process_s']:.1f} s (init {run['init_s']:.1f}); warmup DFlash "
              f"{d['warmup_s']:.1f} s ({d['loaded']} loaded, {d['compiled']} compiled), target-only "
              f"{t['warmup_s']:.1f} s ({t['loaded']} loaded, {t['compiled']} compiled); step {t['step_ms']:.3f} / "
              f"{d['step_ms']:.3f} ms; decode call returns after {t['dispatch_ms']:.2f} / {d['dispatch_ms']:.2f} ms; "
              f"TTFT {t['ttft_ms']:.1f} / {d['ttft_ms']:.1f} ms; GPU before / after: {before} / {run['gpu_after']}",
              flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))

    done = report["runs"]
    if not done:
        return
    first = done[0]
    print(f"\n{first['device']}, jax {first['jax']}; warm-up = Engine.warmup() for batch 1 and 8, max_length 2048; "
          f"step = back-to-back batch-1 decode step, context {CONTEXT}")
    print("| run | process s | warm-up DFlash s | warm-up target-only s | loaded / compiled | target-only ms | "
          "DFlash ms | ratio | call returns ms (target-only / DFlash) | TTFT ms | tokens as run 1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for i, run in enumerate(done, 1):
        d, t = run["dflash"], run["target_only"]
        same = all(run[k]["output_ids"] == first[k]["output_ids"] for k in ("dflash", "target_only")) and \
            run["dflash"]["acceptance_lengths"] == first["dflash"]["acceptance_lengths"]
        print(f"| {i} {run['kind']} | {run['process_s']:.1f} | {d['warmup_s']:.1f} | {t['warmup_s']:.1f} | "
              f"{d['loaded'] + t['loaded']} / {d['compiled'] + t['compiled']} | {t['step_ms']:.3f} | "
              f"{d['step_ms']:.3f} | {d['step_ms'] / t['step_ms']:.3f} | "
              f"{t['dispatch_ms']:.2f} / {d['dispatch_ms']:.2f} | "
              f"{t['ttft_ms']:.1f} / {d['ttft_ms']:.1f} | {'yes' if same else 'NO'} |")
    if args.profile:
        compare_kernels(done)
    if args.logs:
        compare_logs([Path(args.logs) / f"{i}_{run['kind']}.log" for i, run in enumerate(done, 1)])
        for i, run in enumerate(done, 1):
            for engine in ("target_only", "dflash"):
                for g in run[engine].get("graphs", []):
                    print(f"{i} {run['kind']} {engine}: graph {g}")
    for i, run in enumerate(done, 1):
        if "context_applied" in run:
            print(f"{i} {run['kind']}: context applied at start {run['context_applied']}")
        for engine in ("target_only", "dflash"):
            if "context" in run[engine]:
                print(f"{i} {run['kind']} {engine}: context {run[engine]['context']}")


# what XLA logs about its command buffers (CUDA graphs), by TF_CPP_VMODULE source file and level
LOG_EVENTS = {
    "graph instantiated": "Instantiated executable graph",  # gpu_command_buffer=5
    "recorded at initialisation": "Initialize command buffer on device",  # command_buffer_thunk=3
    "run as thunks (warm-up)": "Executing warm up iteration",  # command_buffer_thunk=2
    "re-recorded (buffers moved)": "Create/Update command buffer by recoding",  # command_buffer_thunk=3
    "launched": "Execute command buffer",  # command_buffer_thunk=3
    "kernel nodes added": "Add kernel node",  # cuda_command_buffer=2
    "kernel nodes updated": "Set kernel node params",  # cuda_command_buffer=2
    "graphs evicted": "Evicted ",  # command_buffer_thunk=3
}


def log_events(path: Path) -> dict[str, dict[str, int]]:
    """Counts of ``LOG_EVENTS`` in one run's log, inside each timed decode (between its
    BENCH_PHASE lines) and in the rest of the process."""
    counts: dict[str, dict[str, int]] = {}
    phase = "rest"
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("BENCH_PHASE "):
            _, name, *_, edge = line.split()
            phase = f"{name} timed" if edge == "start" else "rest"
            continue
        for event, needle in LOG_EVENTS.items():
            if needle in line:
                bucket = counts.setdefault(phase, {})
                bucket[event] = bucket.get(event, 0) + 1
    return counts


def compare_logs(paths: list[Path]) -> None:
    """Per run, what XLA did with its CUDA graphs during each timed decode and outside them."""
    per_run = [(path.stem, log_events(path)) for path in paths if path.exists()]
    phases = sorted({phase for _, counts in per_run for phase in counts})
    print("\n| run | phase | " + " | ".join(LOG_EVENTS) + " |")
    print("|---|---|" + "---:|" * len(LOG_EVENTS))
    for run, counts in per_run:
        for phase in phases:
            row = counts.get(phase, {})
            print(f"| {run} | {phase} | " + " | ".join(str(row.get(e, 0)) for e in LOG_EVENTS) + " |")


def compare_kernels(runs: list[dict], top: int = 14) -> None:
    """Each traced kernel's GPU time per step in every run, as a ratio to the first run: are the
    slower processes' kernels all slower (bandwidth, placement) or some (other programs), or is the
    time between kernels?"""
    for engine in ("target_only", "dflash"):
        base = runs[0][engine].get("kernels")
        if not base:
            continue
        print(f"\n{engine}: GPU us per step, kernels summed / covered / idle between: " + ", ".join(
            f"{r['kind']} {r[engine]['gpu_busy_us']:.1f} / {r[engine]['gpu_covered_us']:.1f} / "
            f"{r[engine]['gpu_idle_us']:.1f}" for r in runs)
              + "; weights at " + ", ".join(f"{r['kind']} {[hex(p) for p in r[engine]['weights_at']]}" for r in runs)
              + "; state at " + ", ".join(f"{r['kind']} {[hex(p) for p in r[engine]['state_at']]}" for r in runs))
        print("| kernel | launches / step | " + " | ".join(f"{i} {r['kind']} us" for i, r in enumerate(runs, 1))
              + " | " + " | ".join(f"{i} / 1" for i in range(2, len(runs) + 1)) + " |")
        print("|---|---:|" + "---:|" * (2 * len(runs) - 1))
        for name, (count, t) in sorted(base.items(), key=lambda kv: -kv[1][1])[:top]:
            times = [r[engine]["kernels"].get(name, [0, float("nan")])[1] for r in runs]
            print(f"| {name[:60]} | {count:.1f} | " + " | ".join(f"{x:.1f}" for x in times) + " | "
                  + " | ".join(f"{x / t:.3f}" for x in times[1:]) + " |")


if __name__ == "__main__":
    main()
