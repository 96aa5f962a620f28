"""DFlash2 against DFlash step cost: a Qwen3-8B-shaped target, a 5-layer block-16 drafter of each
generation (DFlash2: 2-tap convolutions in groups of 16, a rank-256 top-16 selector), random bf16 weights.

Per batch size: the draft pass alone (embed, the drafter's layers, head, argmax or the selector's
path, ``steps`` passes in one jitted loop) and the whole speculative step (draft + verify + commit in
the engine's on-device loop). Everything is compiled before anything is timed (DFlash's decode
first and alone, so that the target's GEMMs autotune undisturbed, then the rest on threads), and
the two generations are timed in interleaved rounds. The convolutions and the selector should add
at most 5% to the draft pass.

Then one traced call of each draft loop (one profile; ``--no-profile``: none): the GPU kernels of
a draft pass, their count and busy time per pass, and DFlash2's largest kernels, each with the JAX op and
source line it was traced from, which say where its extra time goes (kernels, or the gaps between them).
``--baseline`` prints another run's report beside this one's (by default the committed
``bench/results/dflash2.json``, read before anything is written).

    python3 bench/bench_dflash2.py --json bench/results/dflash2.json        # < 90 s on one H200
    JAX_PLATFORMS=cpu python3 bench/bench_dflash2.py --tiny --steps 2 --repeats 1   # smoke test
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

import profile_ops
import timing
from bench_engine import draft_loop
from dflash_jax.models.dflash2 import DFlash2Config
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.tiny import random_drafter, tiny_target_config


def dflash2_twin(drafter, *, rank: int, top_k: int, taps: int, group: int):
    """A DFlash2 drafter of ``drafter``'s shape with random weights everywhere (convolutions included)."""
    c = drafter.config
    cfg = DFlash2Config(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}, conv_kernel_size=taps,
                        conv_group_size=group, selector_rank=rank, selector_top_k=top_k)
    cfg.validate("bench")
    return random_drafter(cfg, seed=2, std=0.02, dtype=drafter.dtype)


def time_batch(engines: dict, batch: int, context: int, steps: int, repeats: int,
               profile: bool = True) -> tuple[dict, float]:
    """Seconds per draft pass and per decode step of each engine (medians over interleaved rounds),
    with ``profile`` each draft pass's kernels (``draft_kernels``), and the seconds spent compiling."""
    drafts = {name: draft_loop(e, batch, context, steps) for name, e in engines.items()}
    states = {name: timing.synthetic_state(e, batch, context, seed=batch) for name, e in engines.items()}
    first, *rest = engines
    t0 = time.perf_counter()
    engines[first].decode_compiled(states[first], steps)  # the target's GEMMs autotune alone
    jobs = [lambda n=n: engines[n].decode_compiled(states[n], steps) for n in rest]
    jobs += [lambda n=n: drafts[n][0].lower(*drafts[n][1]).compile() for n in engines]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # XLA compiles outside the GIL
        compiled = list(pool.map(lambda job: job(), jobs))[-len(engines):]  # the draft loops, last
    # Each draft loop's instructions' JAX origins: what the trace's kernels were traced from.
    sources = {name: profile_ops.op_sources(c.as_text()) for name, c in zip(engines, compiled)}
    compile_s = time.perf_counter() - t0
    for name, e in engines.items():  # untimed: the calls' own tracing, warm clocks
        for _ in range(2):
            states[name], _ = e.decode(states[name], n_steps=steps)
            jax.block_until_ready(drafts[name][0](*drafts[name][1]))
        jax.block_until_ready(states[name].starts)
    draft_times = {name: [] for name in engines}
    step_times = {name: [] for name in engines}
    for _ in range(repeats):
        for name, e in engines.items():
            t = time.perf_counter()
            jax.block_until_ready(drafts[name][0](*drafts[name][1]))
            draft_times[name].append((time.perf_counter() - t) / steps)
            t = time.perf_counter()
            states[name], _ = e.decode(states[name], n_steps=steps)
            jax.block_until_ready(states[name].starts)
            step_times[name].append((time.perf_counter() - t) / steps)
    entry = {}
    for name in engines:
        entry[f"{name}_draft_s"] = statistics.median(draft_times[name])
        entry[f"{name}_step_s"] = statistics.median(step_times[name])
    if profile:
        layers = next(iter(engines.values())).drafter.config.num_layers
        for name, kernels in draft_kernels(drafts, steps, layers, sources).items():
            entry[f"{name}_kernels"] = kernels
    return entry, compile_s


def draft_kernels(drafts: dict, steps: int, drafter_layers: int, sources: dict[str, dict[str, str]],
                  top: int = 12) -> dict:
    """The GPU kernels of one call of each draft loop in ``drafts`` (name -> (jitted fn, args); ``steps``
    passes a call), all traced in one profile, each call inside its own annotation: ``kernel_table`` of
    each ({}: no GPU trace). ``sources``: per name, its program's ``profile_ops.op_sources``."""
    with tempfile.TemporaryDirectory() as out_dir:
        with jax.profiler.trace(out_dir, create_perfetto_trace=True):
            for name, (fn, args) in drafts.items():
                with jax.profiler.TraceAnnotation(f"draft_loop_{name}"):
                    jax.block_until_ready(fn(*args))
        paths = sorted(Path(out_dir).rglob("perfetto_trace.json.gz"))
        events = json.loads(gzip.open(paths[-1]).read())["traceEvents"] if paths else []
    return kernel_table(events, steps, drafter_layers, sources, top)


def kernel_table(events: list[dict], steps: int, drafter_layers: int, sources: dict[str, dict[str, str]],
                 top: int = 12) -> dict:
    """Per draft loop annotated ``draft_loop_<name>`` in a Perfetto trace's ``events``: per pass the
    number of GPU kernels, their busy time and the ``top`` largest, each with the JAX op and source line
    its HLO instruction came from (the profiler's ``hlo_op`` where it names one: XLA launches identical
    fusions under one kernel name). Under a CUDA graph the trace may show fewer loop iterations than
    ran: passes are counted by the drafter's attention kernels when their names say so (one per layer),
    else taken as ``steps``."""
    gpu = {e["pid"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in str(e["args"].get("name"))}
    windows = {e["name"][len("draft_loop_"):]: (e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("ph") == "X" and str(e.get("name", "")).startswith("draft_loop_")}
    out = {}
    for name, (start, end) in windows.items():
        durations: dict[str, list[float]] = {}
        origins: dict[str, set[str]] = {}
        for e in events:
            if e.get("ph") == "X" and e.get("pid") in gpu and start <= e["ts"] <= end:
                durations.setdefault(e["name"], []).append(e["dur"])
                key = str((e.get("args") or {}).get("hlo_op") or e["name"])
                origin = profile_ops.lookup(sources.get(name, {}), key)
                if origin:
                    origins.setdefault(e["name"], set()).add(origin)
        if not durations:
            continue
        attention = sum(len(d) for k, d in durations.items() if "attention" in k)
        passes = attention / drafter_layers if attention else steps
        largest = sorted(durations.items(), key=lambda kv: -sum(kv[1]))[:top]
        out[name] = dict(passes_traced=passes, per_pass=sum(map(len, durations.values())) / passes,
                         busy_us_per_pass=sum(map(sum, durations.values())) / passes,
                         largest=[dict(name=k[:120], us_per_pass=sum(d) / passes, launches_per_pass=len(d) / passes,
                                       sources=sorted(origins.get(k, ()))[:3])
                                  for k, d in largest])
    return out


def main() -> None:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8, help="steps per timed call")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds")
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "pallas"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--json", "--out", dest="out", default=None, help="JSON report")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="no traced call, no kernel table")
    ap.add_argument("--baseline", default=str(Path(__file__).parent / "results" / "dflash2.json"),
                    help="another run's JSON report, printed beside this run's ('' for none)")
    args = ap.parse_args()
    baseline = read_baseline(args.baseline)

    print(timing.device_line(), flush=True)
    tcfg = tiny_target_config(num_layers=4) if args.tiny else timing.qwen3_8b(args.layers)
    t0 = time.perf_counter()
    target, dflash = timing.random_pair(tcfg)
    group = 16 if tcfg.hidden_size % 16 == 0 else 1
    dflash2 = dflash2_twin(dflash, rank=min(args.rank, 8) if args.tiny else args.rank,
                           top_k=min(args.top_k, 4) if args.tiny else args.top_k, taps=2, group=group)
    print(f"init {time.perf_counter() - t0:.1f}s; DFlash2 adds {timing.param_bytes(dflash2) / 1e9 - timing.param_bytes(dflash) / 1e9:.3f} GB "
          "of weights", flush=True)
    # Every engine is derived from this one: the target's weights are held once, in the serving layout.
    models = Engine(target, dflash, EngineConfig(max_batch_size=1, max_length=64, attention_impl=args.attention))
    del target

    report = dict(config=vars(args), batches={})
    rows = []
    for batch in (int(b) for b in args.batches.split(",") if b):
        t0 = time.perf_counter()
        config = EngineConfig(max_batch_size=batch, max_length=args.context + 16 * (args.steps * (args.repeats + 3) + 8),
                              attention_impl=args.attention)
        engines = {"dflash": models.derive(config), "dflash2": models.derive(config, drafter=dflash2)}
        entry, compile_s = time_batch(engines, batch, args.context, args.steps, args.repeats, args.profile)
        del engines
        entry["draft_overhead"] = entry["dflash2_draft_s"] / entry["dflash_draft_s"] - 1
        entry["step_overhead"] = entry["dflash2_step_s"] / entry["dflash_step_s"] - 1
        report["batches"][batch] = entry
        rows.append((batch, entry))
        timing.write_json(args.out, report)
        print(f"batch {batch}: {time.perf_counter() - t0:.0f} s ({compile_s:.0f} s compiling)", flush=True)

    print(f"\n{'tiny' if args.tiny else 'Qwen3-8B'} shapes, bf16, context {args.context}, 5-layer block-16 drafters; "
          f"DFlash2: 2 taps / group {group}, selector rank {dflash2.config.selector_rank} top-{dflash2.config.selector_top_k}")
    print("batch | DFlash draft ms | DFlash2 draft ms | draft +% (goal <= 5) | DFlash step ms | DFlash2 step ms | step +%"
          + (" | baseline draft +% | baseline step +%" if baseline else ""))
    for batch, e in rows:
        line = (f"{batch:5d} | {e['dflash_draft_s'] * 1e3:15.3f} | {e['dflash2_draft_s'] * 1e3:16.3f} | "
                f"{100 * e['draft_overhead']:20.1f} | {e['dflash_step_s'] * 1e3:14.3f} | {e['dflash2_step_s'] * 1e3:15.3f} | "
                f"{100 * e['step_overhead']:7.1f}")
        if baseline:
            old = baseline.get(str(batch))
            line += (f" | {100 * old['draft_overhead']:18.1f} | {100 * old['step_overhead']:17.1f}" if old
                     else " |                  - |                 -")
        print(line)
    if baseline:
        print(f"(baseline: {args.baseline})")
    print_kernels(rows)
    report["total_s"] = time.perf_counter() - t_start
    print(f"{report['total_s']:.0f} s in all")
    timing.write_json(args.out, report)


def read_baseline(path: str) -> dict:
    """``batches`` of another run's report, by batch size as a string ({}: none or unreadable)."""
    if not path or not Path(path).is_file():
        return {}
    try:
        return json.loads(Path(path).read_text()).get("batches", {})
    except (OSError, ValueError) as err:
        print(f"baseline {path} unreadable ({err}); printing none")
        return {}


def print_kernels(rows: list[tuple[int, dict]]) -> None:
    """Kernels per draft pass of each generation and DFlash2's largest, from ``draft_kernels``."""
    for batch, e in rows:
        if not e.get("dflash_kernels") or not e.get("dflash2_kernels"):
            continue
        one, two = e["dflash_kernels"], e["dflash2_kernels"]
        print(f"\nbatch {batch}: kernels per draft pass {one['per_pass']:.0f} -> {two['per_pass']:.0f}, busy "
              f"{one['busy_us_per_pass']:.0f} -> {two['busy_us_per_pass']:.0f} us of "
              f"{e['dflash_draft_s'] * 1e6:.0f} -> {e['dflash2_draft_s'] * 1e6:.0f} us; DFlash2's largest kernels:")
        for k in two["largest"]:
            print(f"  {k['us_per_pass']:8.1f} us  {k['launches_per_pass']:5.1f}x  {k['name']}")
            for origin in k.get("sources", []):
                print(f"{'':26s}<- {origin[:150]}")


if __name__ == "__main__":
    main()
