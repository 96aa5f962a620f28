"""Engine cost benchmark: Qwen3-8B-shaped target + 5-layer B=16 drafter, random bf16 weights.

Times, per batch size, one target-only greedy step, one DFlash draft+verify+commit step and the
draft pass alone (all inside the engine's jitted on-device loop, state donated), then the host
overhead of ``Engine.generate`` at batch 1 and, optionally, the authors' PyTorch code on the same
shapes. Random weights accept ~1 token per step, so DFlash tokens/s are also projected at the
published tau (6.5 on GSM8K) from the measured step cost.

    python bench/bench_engine.py --batches 1,4,16,32 --out $OUT/engine.json [--reference]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dflash_jax import decoding, tail_layout  # noqa: E402
from dflash_jax.cache import KVCache  # noqa: E402
from dflash_jax.drafter import Drafter  # noqa: E402
from dflash_jax import engine as engine_module  # noqa: E402
from dflash_jax.engine import Engine, EngineConfig  # noqa: E402
from dflash_jax.model_config import TargetConfig  # noqa: E402
from dflash_jax.sharding import MeshConfig, hlo_collectives  # noqa: E402
from dflash_jax.target import Target  # noqa: E402
from dflash_jax.tiny import tiny_drafter_config  # noqa: E402

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy on this card (docs/benchmarks.md)


def qwen3_8b(layers: int) -> TargetConfig:
    return TargetConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                        num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                        rope_theta=1e6, tie_word_embeddings=False)


def int_fields(text: str, sep: str = ",") -> dict[str, int]:
    """``"min_chunk=64,num_stages=2"`` -> ``{"min_chunk": 64, "num_stages": 2}``: config overrides
    given on a command line."""
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(sep))}


def _option(text: str) -> tuple[str, bool | int | str]:
    """``KEY=VALUE`` of an XLA option: true/false as bools, integers as ints, the rest as strings."""
    key, _, value = text.partition("=")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    return key, int(value) if value.lstrip("-").isdigit() else value


def add_variant_args(ap: argparse.ArgumentParser) -> None:
    """The flags of ``use_variant``: ``--unfused``, ``--unfused-norms``, ``--decode-option``."""
    ap.add_argument("--unfused", action="store_true",
                    help="the target's attention without the fused cached-attention kernel (the earlier path)")
    ap.add_argument("--unfused-norms", action="store_true",
                    help="residual adds and RMSNorms as XLA ops, without the add_rms_norm kernel (the earlier path)")
    ap.add_argument("--decode-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an XLA option added to the decode jit's (repeatable; true/false/ints parsed)")


def use_variant(*, unfused: bool = False, unfused_norms: bool = False, decode_options: Sequence[str] = ()) -> None:
    """Engines built after this call run the earlier unfused attention (``unfused``), XLA's residual
    adds and RMSNorms (``unfused_norms``), and their decode jit with these extra XLA options
    (``KEY=VALUE`` strings)."""
    import kernels_pallas

    if unfused:
        kernels_pallas.cached_block_attention_supported = lambda *a, **k: False
    if unfused_norms:
        kernels_pallas.add_rms_norm_supported = lambda *a, **k: False
    if decode_options:
        extra = dict(_option(o) for o in decode_options)
        shipped = engine_module._decode_compiler_options
        engine_module._decode_compiler_options = lambda: {**(shipped() or {}), **extra}
        print(f"decode options: {engine_module._decode_compiler_options()}", flush=True)


def random_pair(tcfg: TargetConfig, dtype=jnp.bfloat16) -> tuple[Target, Drafter]:
    """The benchmarks' random target of ``tcfg`` and a 5-layer, block-16 drafter for it."""
    dcfg = tiny_drafter_config(tcfg, num_layers=5, block_size=16, mask_token_id=tcfg.vocab_size - 1)
    return Target(tcfg, dtype=dtype, rngs=nnx.Rngs(0)), Drafter(dcfg, dtype=dtype, rngs=nnx.Rngs(1))


def param_bytes(module) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def streamed_bytes(target: Target) -> int:
    """The target weights a bf16 decode step reads: all but the embedding table (one row of it)."""
    return param_bytes(target) - target.config.vocab_size * target.config.hidden_size * 2


def hbm_roofline_s(target: Target, batch: int, context: int) -> float:
    """A bf16 target-only decode step at HBM bandwidth: its weights plus every row's K/V of
    ``context`` positions."""
    c = target.config
    kv_bytes = 2 * c.num_layers * batch * context * c.num_kv_heads * c.head_dim * 2
    return (streamed_bytes(target) + kv_bytes) / HBM_BYTES_PER_S


CACHE_CAPACITY = 1024  # positions of ``layout_logits``'s cache


def layout_logits(target: Target, ids: jax.Array, context: int) -> tuple[jax.Array, jax.Array]:
    """Logits ``[block, vocab]`` float32 after a prefill of ``ids[:, :context]`` (XLA attention): of
    the next token alone (a decode pass) and of the next 16 as a verify block (Pallas attention)."""
    graph, state = nnx.split(target)

    @jax.jit
    def run(state, ids):
        t = nnx.merge(graph, state)
        cache = KVCache.zeros(t.config.num_layers, 1, CACHE_CAPACITY, t.config.num_kv_heads, t.config.head_dim,
                              t.embed_tokens.dtype)
        zeros = jnp.zeros((1,), jnp.int32)
        _, _, cache = t.step(ids[:, :context], zeros, cache, attention_impl="xla", prefill=True)
        starts = zeros + context
        one, _, _ = t.step(ids[:, context:context + 1], starts, cache, attention_impl="pallas")
        block, _, _ = t.step(ids[:, context:context + 16], starts, cache, attention_impl="pallas")
        return (t.head(one[0]).astype(jnp.float32), t.head(block[0]).astype(jnp.float32))

    return run(state, ids)


def median_time(fn: Callable, *args, repeats: int) -> tuple[float, float]:
    """Seconds per call of ``fn(*args)`` after a warm-up call (which compiles): (median, min) over
    ``repeats`` calls, each ended by ``block_until_ready``."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def card_streaming_rate(repeats: int, *, passes: int = 8, gemvs: int = 8, vocab: int = 151936,
                        hidden: int = 4096) -> dict[str, float]:
    """This card's weight-streaming rate, to tell a slower card from slower code: bytes per second
    of ``passes`` rounds of a chain of ``gemvs`` dependent one-row GEMVs over distinct
    ``[hidden, vocab]`` bf16 weights (the LM head's shape, far larger than L2), XLA's dots streaming
    weights back to back as a decode step's do, with a kernel boundary per 1.2 GB instead of per
    ~50 MB.

    A call streams 79.7 GB (~18 ms on the H200), so its dispatch and sync stay under 1%; median of
    ``repeats`` calls, each ended by ``block_until_ready``; random weights, not zeros."""
    key = jax.random.key(11)
    weights = [jax.random.normal(jax.random.fold_in(key, i), (hidden, vocab), jnp.bfloat16) for i in range(gemvs)]
    row = jax.random.normal(key, (1, hidden), jnp.bfloat16)

    @jax.jit
    def chain(row, weights):
        for _ in range(passes):
            for w in weights:  # each GEMV waits for the last
                row = (row @ w)[:, :hidden] * jnp.bfloat16(0.01)
        return row

    t_chain, _ = median_time(chain, row, weights, repeats=repeats)
    del weights
    return {"gemv_bytes_per_s": passes * gemvs * hidden * vocab * 2 / t_chain, "gemv_chain_s": t_chain}


def relative_error(got: jax.Array, want: jax.Array) -> float:
    """The largest difference of ``got`` from ``want``, relative to ``want``'s largest entry (float32)."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def check_tail_layout(target: Target, context: int = 256) -> dict:
    """Puts ``target`` in the layer-tail layout (in place) and reports what that changed: the logits
    of a decode pass and of a 16-row verify block against the fused layout's (largest error relative
    to the largest logit, and how often the argmax agrees; beside them the fused layout's own decode
    against verify difference, bf16 rounding alone), and on layer 0 the Mosaic kernel against
    its jnp reference at 8 and 16 rows (largest error per output relative to its largest entry)."""
    import kernels_pallas
    from dflash_jax import tail_layout
    from kernels_pallas import layer_tail_gpu

    ids = jax.random.randint(jax.random.key(7), (1, context + 16), 0, target.config.vocab_size - 1, jnp.int32)
    fused = layout_logits(target, ids, context)
    tail_layout.to_tail_layout(target.layers, target.config)
    tail = layout_logits(target, ids, context)
    # The scale of bf16 rounding alone: the fused layout's decode pass against row 0 of its verify
    # block, the same math through GEMMs of other shapes.
    scale = jnp.max(jnp.abs(fused[0]))
    report = {"fused_decode_vs_verify_row0": float(jnp.max(jnp.abs(fused[0][0] - fused[1][0])) / scale)}
    for name, want, got in zip(("decode", "verify16"), fused, tail):
        report[name] = dict(rel_error=relative_error(got, want),
                            argmax_agrees=float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(want, -1))))
    layer = target.layers[0]
    c = target.config
    for rows in (8, 16):
        key = jax.random.key(rows)
        a = jax.random.normal(key, (rows, c.num_heads * c.head_dim), jnp.bfloat16)
        h = jax.random.normal(jax.random.fold_in(key, 1), (rows, c.hidden_size), jnp.bfloat16)
        args = (a, h, *layer.tail.matrices(), target.layers[1].tail.qkv_matrix())
        config = kernels_pallas.layer_tail_kernel_config(rows, c.hidden_size, c.intermediate_size, args[-1].shape[0],
                                                         attention=a.shape[1], dtype=h.dtype)
        if config is None:
            report[f"kernel_rows{rows}"] = "the kernel does not take these shapes here"
            continue
        got = jax.jit(lambda *x, cfg=config: layer_tail_gpu.layer_tail(*x, eps=c.rms_norm_eps, config=cfg))(*args)
        want = jax.jit(lambda *x: layer_tail_gpu.layer_tail_reference(*x, eps=c.rms_norm_eps))(*args)
        report[f"kernel_rows{rows}"] = {name: relative_error(g, w)
                                        for name, g, w in zip(("h1", "s", "h2", "qkv"), got, want)}
    try:
        report.update(check_attention_in_tail(target, ids, context, fused[0]))
    except Exception as err:  # report it; the layouts' timings still run
        report["attn_check_failed"] = repr(err)[:2000]
    print(f"tail layout check: {json.dumps(report)}", flush=True)
    return report


def check_attention_in_tail(target: Target, ids: jax.Array | None, context: int,
                            fused_decode: jax.Array | None) -> dict:
    """The layer tail's attention phase (``tail_layout.ATTENTION_IN_TAIL``) on a target in the
    layer-tail layout: a decode pass's logits against the fused layout's ``fused_decode`` (if given),
    and on layers 0 -> 1 the Mosaic kernel's outputs against the references fed the same inputs (the
    attention's against ``next_attention_reference`` of the kernel's own QKV)."""
    import kernels_pallas
    from kernels_pallas import layer_tail_gpu, tail_attention_gpu

    c = target.config
    report = {}
    if fused_decode is not None:
        default = tail_layout.ATTENTION_IN_TAIL
        tail_layout.ATTENTION_IN_TAIL = True
        try:
            decode = layout_logits(target, ids, context)[0]
        finally:
            tail_layout.ATTENTION_IN_TAIL = default
        report["attn_decode"] = dict(
            rel_error=relative_error(decode, fused_decode),
            argmax_agrees=float(jnp.mean(jnp.argmax(decode, -1) == jnp.argmax(fused_decode, -1))))
    rows, groups = 8, c.num_heads // c.num_kv_heads
    key = jax.random.key(99)
    ks = jax.random.split(key, 4)
    row = lambda k, n: jnp.broadcast_to(jax.random.normal(k, (1, n), jnp.bfloat16), (rows, n))  # noqa: E731
    a, h = row(ks[0], c.num_heads * c.head_dim), row(ks[1], c.hidden_size)
    caches = [jax.random.normal(k, (CACHE_CAPACITY, c.num_kv_heads, c.head_dim), jnp.bfloat16) for k in ks[2:]]
    starts = jnp.array([context + 44], jnp.int32)
    meta, rope_table = tail_layout._attention_tables(target, starts, jnp.bfloat16)
    tables = (meta, tail_layout._norm_tables(target.layers[1].self_attn, jnp.bfloat16), rope_table)
    args = (a, h, *target.layers[0].tail.matrices(), target.layers[1].tail.qkv_matrix(), *caches, *tables)
    config = kernels_pallas.layer_tail_kernel_config(rows, c.hidden_size, c.intermediate_size, args[5].shape[0],
                                                     attention=a.shape[1], dtype=h.dtype)
    static = dict(eps=c.rms_norm_eps, groups=groups, scale=c.head_dim ** -0.5)
    if config is None or not layer_tail_gpu.attention_supported(rows, args[5].shape[0], c.num_kv_heads, groups,
                                                                c.head_dim, CACHE_CAPACITY, config):
        report["attn_kernel"] = "the kernel takes no attention phase here"
        return report
    got = jax.jit(lambda *x: layer_tail_gpu.layer_tail(*x, config=config, **static))(*args)
    again = jax.jit(lambda *x: layer_tail_gpu.layer_tail(*x, config=config, **static))(*args)
    want = jax.jit(lambda *x: layer_tail_gpu.layer_tail_reference(*x, eps=c.rms_norm_eps))(*args[:6])
    want += jax.jit(lambda q, *x: tail_attention_gpu.next_attention_reference(q, *x, **static))(got[3], *args[6:])
    names = ("h1", "s", "h2", "qkv", "attn", "k_new", "v_new")
    report["attn_kernel"] = {name: relative_error(g, w) for name, g, w in zip(names, got, want)}
    report["attn_kernel"]["rows_equal"] = bool(jnp.all(got[4] == got[4][:1]))
    report["attn_kernel"]["second_call_same"] = bool(all(jnp.array_equal(x, y) for x, y in zip(got[:7], again[:7])))
    return report


def synthetic_state(engine: Engine, batch: int, context: int, seed: int) -> decoding.DecodeState:
    """A decode state as after a prefill of ``context`` random tokens, caches full of random data."""
    tc, cap = engine.target.config, engine.capacity
    key = jax.random.key(seed)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)

    def cache(k, layers, kv, dim):
        shape = (batch, cap, kv, dim)
        keys = jax.random.split(k, 2 * layers)
        return KVCache(tuple(jax.random.normal(keys[i], shape, jnp.bfloat16) for i in range(layers)),
                       tuple(jax.random.normal(keys[layers + i], shape, jnp.bfloat16) for i in range(layers)))

    draft_cache = None
    if engine.drafter is not None:
        dc = engine.drafter.config
        draft_cache = cache(k2, dc.num_layers, dc.num_kv_heads, dc.head_dim)
    return decoding.DecodeState(
        tokens=jax.random.randint(k3, (batch, cap + 1), 0, tc.vocab_size - 1, jnp.int32),
        starts=jnp.full((batch,), context, jnp.int32),
        max_lens=jnp.full((batch,), engine.config.max_length, jnp.int32),
        done=jnp.zeros((batch,), bool),
        num_steps=jnp.zeros((batch,), jnp.int32),
        accepted=jnp.zeros((batch, engine.config.max_length), jnp.int32),
        stop_ids=jnp.full((batch, engine.max_stop_ids), -1, jnp.int32),
        target_cache=cache(k1, tc.num_layers, tc.num_kv_heads, tc.head_dim),
        draft_cache=draft_cache,
    )


def warmed_state(engine: Engine, batch: int, context: int, steps: int, seed: int) -> decoding.DecodeState:
    """``synthetic_state`` after two decode calls of ``steps`` (compile and warm-up; on a mesh the
    second call compiles for the sharded state; a fixed loop compiles per step count), synced."""
    state = synthetic_state(engine, batch, context, seed=seed)
    for _ in range(2):
        state, _ = engine.decode(state, n_steps=steps)
    jax.block_until_ready(state.starts)
    return state


def time_decode(engine: Engine, batch: int, context: int, steps: int, repeats: int) -> tuple[float, float]:
    """Median seconds per decode step over ``repeats`` calls of ``steps`` on-device steps; and tau."""
    state = warmed_state(engine, batch, context, steps, seed=batch)
    times = []
    for _ in range(repeats):
        before = np.asarray(state.starts)
        t0 = time.perf_counter()
        state, _ = engine.decode(state, n_steps=steps)
        jax.block_until_ready(state.starts)
        times.append((time.perf_counter() - t0) / steps)
    tau = float((np.asarray(state.starts) - before).mean() / steps)
    return statistics.median(times), tau


def time_decode_pipelined(engine: Engine, batch: int, context: int, steps: int, calls: int) -> float:
    """Seconds per decode step over ``calls`` calls of ``steps`` dispatched back to back, one sync at
    the end: the device's steady rate, as the batcher runs it (each call dispatched while the last
    runs). ``time_decode`` syncs after every call, so each of its calls also pays the host's dispatch
    (~2.7-2.9 ms on the H200 for an 8B engine, docs/benchmarks.md, nineteenth session)."""
    state = warmed_state(engine, batch, context, steps, seed=batch + 3)
    before = np.asarray(state.starts)
    t0 = time.perf_counter()
    for _ in range(calls):
        state, _ = engine.decode(state, n_steps=steps)
    jax.block_until_ready(state.starts)
    elapsed = time.perf_counter() - t0
    # Every step commits at least one token per row; fewer means the rows reached the engine's maximum
    # length and stopped advancing (the steps after that would be counted without having run).
    advanced = int((np.asarray(state.starts) - before).min())
    if advanced < calls * steps:
        raise ValueError(f"time_decode_pipelined: {calls} calls of {steps} steps from context {context} "
                         f"run past the engine's maximum length (rows advanced {advanced} tokens); ask for fewer calls")
    return elapsed / (calls * steps)


def time_draft(engine: Engine, batch: int, context: int, steps: int, repeats: int) -> float:
    """Median seconds of the drafter pass alone (embed, 5 layers, head, argmax)."""
    target, drafter = engine.target, engine.drafter
    tdef, tstate = nnx.split(target)
    ddef, dstate = nnx.split(drafter)
    block = engine.block_size

    @jax.jit
    def loop(ts, ds, state):
        t, d = nnx.merge(tdef, ts), nnx.merge(ddef, ds)

        def body(i, acc):
            s = dataclasses.replace(state, starts=state.starts + (acc % 2))  # defeats loop hoisting
            ids, _, _ = decoding.draft_block(t, d, s, block_size=block, attention_impl=engine.attention_impl)
            return acc + ids.sum() % 7

        return jax.lax.fori_loop(0, steps, body, jnp.int32(0))

    state = synthetic_state(engine, batch, context, seed=batch + 1)
    jax.block_until_ready(loop(tstate, dstate, state))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(tstate, dstate, state))
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def _load_trace(out_dir: str):
    """The events of the last Perfetto trace under ``out_dir``, with process and thread names."""
    import gzip

    paths = sorted(Path(out_dir).rglob("perfetto_trace.json.gz"))
    if not paths:
        print(f"profile: no perfetto trace under {out_dir}", flush=True)
        return None
    events = json.loads(gzip.open(paths[-1]).read())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return events, procs, threads


def on_gpu(event: dict, procs: dict) -> bool:
    """Whether a trace event (``_load_trace``) is a span on a GPU (a kernel or a copy), not the host."""
    return event.get("ph") == "X" and "GPU" in str(procs.get(event.get("pid"), ""))


def gpu_spans(run: Callable[[], None], out_dir: str, calls: int = 3) -> list[dict] | None:
    """Runs ``run`` (one synchronised call) once, then ``calls`` times under a profiler trace into
    ``out_dir``: the trace's GPU spans (Perfetto events: ``name``, ``ts``, ``dur`` in us), in trace
    order (None: no trace written)."""
    run()
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        for _ in range(calls):
            run()
    loaded = _load_trace(out_dir)
    if loaded is None:
        return None
    events, procs, _ = loaded
    return [e for e in events if on_gpu(e, procs)]


def durations_by_name(spans: list[dict]) -> dict[str, list[float]]:
    """The durations (us) of trace spans (``gpu_spans``), by kernel name."""
    durations: dict[str, list[float]] = {}
    for e in spans:
        durations.setdefault(e["name"], []).append(e["dur"])
    return durations


def gpu_span_durations(run: Callable[[], None], out_dir: str, calls: int = 3) -> dict[str, list[float]] | None:
    """``gpu_spans``' durations (us) by kernel name (None: no trace written)."""
    spans = gpu_spans(run, out_dir, calls)
    return None if spans is None else durations_by_name(spans)


def kernel_time(run: Callable[[], None], out_dir: str, per: int, calls: int = 3) -> tuple[float, str]:
    """GPU kernel time of one ``run`` divided by ``per`` (us; kernels back to back, no launch gaps:
    per kernel name its median duration times its count), and the kernels by name with their median
    duration and count per ``per``, longest first (``nan``, "no trace" when none was written)."""
    durations = gpu_span_durations(run, out_dir, calls)
    if not durations:
        return float("nan"), "no trace"
    kernels = {n: (statistics.median(d), len(d) / calls / per) for n, d in durations.items()}
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0] * kv[1][1])
    return (sum(us * count for us, count in kernels.values()),
            ", ".join(f"{n[:40]} {us:.1f} us x{count:.2g}" for n, (us, count) in ranked))


def profile_generate(engine: Engine, context: int, new_tokens: int, out_dir: str, listing: Path, *,
                     horizon_ms: float | None = 100.0, kernels: bool = True) -> None:
    """Traces one ``Engine.generate`` of a ``context``-token prompt and writes its host events to
    ``listing`` (offset from the first event, duration, where, name: those of 50 us or more, and with
    ``kernels`` every non-Python one), with either every device event (``kernels``: what the time to
    first token is made of) or only the gaps of 50 us or more between a GPU line's kernels (what the
    host makes the device wait for). ``horizon_ms``: only the first that many ms (None: all)."""
    prompt = np.random.RandomState(1).randint(0, engine.target.config.vocab_size - 1, context).tolist()
    engine.generate([prompt], new_tokens)
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        (res,) = engine.generate([prompt], new_tokens)
    trace = _load_trace(out_dir)
    if trace is None:
        return
    events, procs, threads = trace
    where = lambda e: f"{procs.get(e['pid'], e['pid'])}/{threads.get((e['pid'], e['tid']), e['tid'])}"  # noqa: E731
    spans = [e for e in events if e.get("ph") == "X"]
    t0 = min(e["ts"] for e in spans)
    horizon = float("inf") if horizon_ms is None else horizon_ms * 1e3
    rows = [(e["ts"] - t0, e.get("dur", 0), where(e), e["name"]) for e in spans
            if (kernels or not on_gpu(e, procs)) and (e.get("dur", 0) >= 50 or (kernels and "python" not in where(e)))]
    if not kernels:
        lines: dict = {}
        for e in spans:
            if on_gpu(e, procs):
                lines.setdefault(where(e), []).append(e)
        for line, evs in lines.items():
            evs.sort(key=lambda e: e["ts"])
            rows += [(a["ts"] + a["dur"] - t0, b["ts"] - a["ts"] - a["dur"], line, "(idle)")
                     for a, b in zip(evs, evs[1:]) if b["ts"] - a["ts"] - a["dur"] >= 50]
    rows = sorted(r for r in rows if r[0] < horizon)
    listing.write_text(f"TTFT {res.time_to_first_token * 1e3:.1f} ms, {res.num_output_tokens} tokens, "
                       f"{res.time_per_output_token * 1e3:.2f} ms per token\n" + "".join(
        f"{t / 1e3:9.3f} ms {d / 1e3:8.3f} ms  {w[:40]:40s} {name[:100]}\n" for t, d, w, name in rows))
    print(f"generate profile: TTFT {res.time_to_first_token * 1e3:.1f} ms; {len(rows)} events in {listing}", flush=True)


def attention_layers(engine: Engine) -> int:
    """Attention kernels a decode step launches: one per target layer, one per drafter layer."""
    return engine.target.config.num_layers + (engine.drafter.config.num_layers if engine.drafter is not None else 0)


def traced_steps(launches: dict[str, int], layers: int, steps: int) -> float:
    """How many decode steps a trace holds, from its attention kernels' launches (``launches``: per
    kernel name) and ``layers`` attention kernels a step (``attention_layers``); ``steps`` when no
    kernel is named for attention. When the loop runs in a CUDA graph the profiler sees one of its
    iterations per call, not all ``steps`` (docs/benchmarks.md, thirty-fifth session)."""
    found = sum(n for name, n in launches.items() if "attention" in name)
    return found / layers if found else steps


def profile_decode(engine: Engine, batch: int, context: int, steps: int, out_dir: str, top: int = 30,
                   listing: Path | None = None) -> None:
    """Traces a call of ``steps`` decode steps (jax.profiler, Perfetto JSON) and prints the GPU time
    per kernel name per traced step (``traced_steps``): where a step's time goes. ``listing``: also
    write every kernel of the trace, in launch order, to this file."""
    state = synthetic_state(engine, batch, context, seed=batch + 7)
    state, _ = engine.decode(state, n_steps=steps)
    jax.block_until_ready(state.starts)
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        state, _ = engine.decode(state, n_steps=steps)
        jax.block_until_ready(state.starts)
    trace = _load_trace(out_dir)
    if trace is None:
        return
    events, procs, threads = trace
    lines: dict = {}
    for e in events:
        if on_gpu(e, procs):
            lines.setdefault((e["pid"], e["tid"]), []).append(e)
    if not lines:
        return
    key = max(lines, key=lambda k: len(lines[k]))  # the kernel line
    by_name: dict = {}
    for e in lines[key]:
        n, t = by_name.get(e["name"], (0, 0.0))
        by_name[e["name"]] = (n + 1, t + e["dur"])
    traced = traced_steps({name: n for name, (n, _) in by_name.items()}, attention_layers(engine), steps)
    print(f"profile: the trace holds {traced:.1f} of the call's {steps} steps", flush=True)
    for line, evs in lines.items():
        total = sum(e["dur"] for e in evs)
        print(f"profile line {procs[line[0]]!r} / {threads.get(line, line[1])!r}: {len(evs)} events, "
              f"{total / traced / 1e3:.3f} ms per step", flush=True)
    print(f"top kernels of {threads.get(key, key[1])!r} (us per step, launches per step):", flush=True)
    for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {t / traced:9.1f} us  {n / traced:6.1f}x  {name[:110]}", flush=True)
    # One middle layer's kernels in launch order: from one attention kernel to the next.
    ordered = sorted(lines[key], key=lambda e: e["ts"])
    if listing is not None:  # every GPU line, in time order: what the streams do alongside the kernel line
        gpu = sorted((e for evs in lines.values() for e in evs), key=lambda e: e["ts"])
        t0 = gpu[0]["ts"]
        listing.write_text("start us, duration us, stream, kernel\n" + "".join(
            f"{e['ts'] - t0:10.2f} {e['dur']:8.2f}  {procs[e['pid']][-5:]}/{threads.get((e['pid'], e['tid']), e['tid'])[:24]:24s} "
            f"{e['name'][:100]}\n" for e in gpu))
    marks = [i for i, e in enumerate(ordered) if "attention" in e["name"]]
    if len(marks) > 11:
        print("one layer, in launch order (us):", flush=True)
        for e in ordered[marks[10]:marks[11]]:
            print(f"  {e['dur']:7.2f}  {e['name'][:110]}", flush=True)


def print_collectives(engine: Engine, name: str, hlo_out: Path | None = None) -> None:
    """The collectives of the compiled decode step (one row), largest first: what a mesh moves
    between devices every step (an accidental gather of a weight shows up here). ``hlo_out``: also
    write the compiled HLO there (the CUDA graphs are formed later, from XLA's thunks, and do not show
    in it: ``TF_CPP_VMODULE=command_buffer_conversion_pass=2`` logs what they leave out)."""
    hlo = engine.decode_hlo(engine.empty_state(1))
    if hlo_out is not None:
        hlo_out.write_text(hlo)
    found = sorted(hlo_collectives(hlo), key=lambda c: -c.elements)
    print(f"collectives of the {name} decode step: {len(found)}", flush=True)
    for c in found[:6]:
        print(f"  {c.kind:10s} {c.dtype}{list(c.shape)!s:20s} {c.op_name[-90:]}", flush=True)


def host_overhead(engine: Engine, context: int, new_tokens: int, device_step: float) -> dict:
    """Wall time per step of Engine.generate vs the on-device loop's time per step."""
    rng = np.random.RandomState(0)
    prompt = rng.randint(0, engine.target.config.vocab_size - 1, context).tolist()
    engine.generate([prompt], new_tokens)  # compile + warm up everything the timed generation runs
    t0 = time.perf_counter()
    (res,) = engine.generate([prompt], new_tokens)
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()  # the prefill alone, for what TTFT adds to it
    _, first = engine.prefill([prompt], [new_tokens], [()])
    np.asarray(first)
    prefill = time.perf_counter() - t0
    steps = max(1, res.num_steps if engine.drafter is not None else res.num_output_tokens - 1)
    decode = res.time_per_output_token * max(1, res.num_output_tokens - 1)  # its span: first token to last
    return dict(ttft_s=res.time_to_first_token, prefill_s=prefill, wall_s=wall, steps=steps, wall_per_step_s=decode / steps,
                device_per_step_s=device_step, host_overhead_per_step_s=decode / steps - device_step)


def reference_torch(cfg: TargetConfig, drafter_layers: int, block: int, context: int, new_tokens: int,
                    repeats: int = 3) -> dict:
    """The authors' PyTorch code (transformers backend) on the same shapes, random weights: the median
    of ``repeats`` generations per mode, each run's tok/s, and the share of its wall time that the
    calling thread spent on the CPU (near 1: the eager loop is host-bound, its speed the host's)."""
    import torch
    import dflash.model as dm
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    tconf = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, tie_word_embeddings=False)
    base = {k: v for k, v in tconf.to_dict().items() if k != "layer_types"}
    dconf = Qwen3Config(**{**base, "num_hidden_layers": drafter_layers, "block_size": block,
                           "num_target_layers": cfg.num_layers,
                           "dflash_config": {"mask_token_id": cfg.vocab_size - 1}})
    with torch.device("cuda"):
        target = Qwen3ForCausalLM(tconf).eval()
        drafter = dm.DFlashDraftModel(dconf).eval()
    prompt = torch.randint(0, cfg.vocab_size - 1, (1, context), device="cuda")
    out = {}
    for name, b in (("target_only", 1), ("dflash", block)):
        dm.dflash_generate(drafter, target, prompt, 8, None, block_size=b)
        runs = []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.thread_time()
            stats = dm.dflash_generate(drafter, target, prompt, new_tokens, None, block_size=b, return_stats=True)
            torch.cuda.synchronize()
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            steps = max(1, len(stats.acceptance_lengths))
            decode = stats.time_per_output_token * stats.num_output_tokens
            runs.append(dict(tok_s=1.0 / stats.time_per_output_token, step_s=decode / steps, cpu_share=cpu / wall))
        median = sorted(runs, key=lambda r: r["step_s"])[len(runs) // 2]
        out[name] = dict(median, runs=runs, torch_threads=torch.get_num_threads())
    del target, drafter
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--steps-per-sync", type=int, default=8,
                    help="decode steps per host sync in the engines (the host-overhead generation runs with it)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-loop", default="auto", choices=["auto", "until_done", "fixed"],
                    help="EngineConfig.decode_loop (auto: fixed on a GPU mesh)")
    ap.add_argument("--host-while", action="store_true",
                    help="the decode loop's while on the host, outside the CUDA graph (XLA's default before "
                         "the seventh session): the A/B of the host overhead")
    ap.add_argument("--graph-collectives", action="store_true",
                    help="COLLECTIVES in the decode jit's command buffers (XLA 0.11.2 converts none of the "
                         "all-reduces, so on a mesh the loop stays on the host with it too)")
    ap.add_argument("--draft-batches", default="1,16", help="batch sizes for the draft-only breakdown")
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "pallas"],
                    help="EngineConfig.attention_impl (auto, the engine's default: pallas on GPUs and TPUs)")
    ap.add_argument("--tail-layout", default="off",
                    help="EngineConfig.tail_layout, or several in turn (e.g. off,on: every batch with the fused "
                         "layout, then the target converted, checked against it and timed again); attn: the tail "
                         "layout with a decode token's attention in the layer tail before it "
                         "(tail_layout.ATTENTION_IN_TAIL)")
    ap.add_argument("--reference", action="store_true", help="also time the authors' PyTorch code")
    ap.add_argument("--tau", type=float, default=6.5, help="acceptance length for projected tokens/s")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--collectives", action="store_true", help="list the collectives of the batch-1 decode steps")
    ap.add_argument("--profile", default=None, help="trace batch-1 steps (target-only and DFlash) into this dir")
    add_variant_args(ap)
    ap.add_argument("--cached-config", default="",
                    help="tile overrides of the cached-attention kernel, e.g. min_chunk=128,block_k=32")
    ap.add_argument("--tensor", type=int, default=1,
                    help="tensor-parallel degree: the engines on a (data=1, tensor=N) mesh; the roofline is per GPU")
    args = ap.parse_args()
    from kernels_pallas import cached_attention_gpu

    if args.host_while:
        engine_module._GPU_DECODE_COMMAND_BUFFER = engine_module.GPU_DEFAULT_COMMAND_BUFFER
    if args.graph_collectives:
        engine_module._GPU_DECODE_COMMAND_BUFFER += ",COLLECTIVES"
    use_variant(unfused=args.unfused, unfused_norms=args.unfused_norms, decode_options=args.decode_option)
    if args.cached_config:
        overrides = int_fields(args.cached_config)
        cached_attention_gpu.DEFAULT_CONFIG = dataclasses.replace(cached_attention_gpu.DEFAULT_CONFIG, **overrides)
        print(f"cached-attention kernel config: {cached_attention_gpu.DEFAULT_CONFIG}", flush=True)

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    tcfg = qwen3_8b(args.layers)
    if args.tiny:
        from dflash_jax.tiny import tiny_target_config

        tcfg = tiny_target_config(num_layers=args.layers)
    t0 = time.perf_counter()
    target, drafter = random_pair(tcfg)
    tbytes = streamed_bytes(target)
    dbytes = param_bytes(drafter)
    print(f"init {time.perf_counter() - t0:.1f}s; target streams {tbytes / 1e9:.2f} GB/token-step, "
          f"drafter {dbytes / 1e9:.2f} GB", flush=True)

    rows, report = [], dict(config=vars(args), target_gb=tbytes / 1e9, drafter_gb=dbytes / 1e9, batches={})
    card = None if args.tiny else card_streaming_rate(max(5, 4 * args.repeats))
    if card:
        report["card"] = card
        print(f"this card streams weights through XLA's GEMVs at {card['gemv_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    draft_batches = {int(b) for b in args.draft_batches.split(",") if b}
    layouts = args.tail_layout.split(",")
    runs = [(layout, int(b)) for layout in layouts for b in args.batches.split(",")]
    for layout, batch in runs:
        if layout in ("on", "attn") and target.layers[0].tail is None and "off" in layouts:
            report["tail_layout_check"] = check_tail_layout(target)
        tail_layout.ATTENTION_IN_TAIL = layout == "attn"  # "attn": the tail layout, the attention in the tail
        if layout == "attn" and target.layers[0].tail is not None and "tail_layout_check" not in report:
            report["attn_check"] = check_attention_in_tail(target, None, args.context, None)
            print(f"attention-in-tail check: {json.dumps(report['attn_check'])}", flush=True)
        mesh = MeshConfig(data=1, fsdp=1, tensor=args.tensor) if args.tensor > 1 else None
        cfg = EngineConfig(max_batch_size=batch, max_length=args.context + 512, prompt_buckets=(args.context,),
                           steps_per_sync=args.steps_per_sync, attention_impl=args.attention, mesh=mesh,
                           decode_loop=args.decode_loop, tail_layout="on" if layout == "attn" else layout)
        spec, plain = Engine(target, drafter, cfg), Engine(target, None, cfg)
        t0 = time.perf_counter()
        t_plain, _ = time_decode(plain, batch, args.context, args.steps, args.repeats)
        t_spec, tau = time_decode(spec, batch, args.context, args.steps, args.repeats)
        t_draft = time_draft(spec, batch, args.context, args.steps, args.repeats) if batch in draft_batches else None
        # The steady rate of back-to-back calls, as many as the rows' spare positions allow after the
        # two warm-up calls (a row that reaches its max_length is done, and its later steps cost nothing).
        spare = cfg.max_length - args.context - spec.block_size
        calls = max(1, min(2 * args.repeats, spare // args.steps - 2))
        t_plain_piped = time_decode_pipelined(plain, batch, args.context, args.steps, calls)
        t_spec_piped = time_decode_pipelined(spec, batch, args.context, args.steps, calls)
        print(f"batch {batch} ({layout}): step ms {t_plain * 1e3:.3f} / DFlash {t_spec * 1e3:.3f}; back to back "
              f"{t_plain_piped * 1e3:.3f} / {t_spec_piped * 1e3:.3f} ({calls} calls)", flush=True)
        roofline = hbm_roofline_s(target, batch, args.context) / args.tensor  # each GPU streams its shard
        entry = dict(target_step_s=t_plain, spec_step_s=t_spec, draft_s=t_draft, tau_random=tau,
                     target_tok_s=batch / t_plain, spec_tok_s_random=batch * tau / t_spec,
                     spec_tok_s_projected=batch * args.tau / t_spec, step_ratio=t_spec / t_plain,
                     draft_ratio=(t_draft / t_plain) if t_draft else None,
                     # the rest of a DFlash step: the verify pass, the commit, the drafter's context K/V
                     verify_ratio=((t_spec - t_draft) / t_plain) if t_draft else None,
                     hbm_roofline_step_s=roofline, target_hbm_fraction=roofline / t_plain,
                     target_step_pipelined_s=t_plain_piped, spec_step_pipelined_s=t_spec_piped,
                     target_hbm_fraction_pipelined=roofline / t_plain_piped,
                     tail_layout=layout if plain.tail_layout else False, wall_s=time.perf_counter() - t0)
        if batch == 1 and args.collectives:
            for name, engine in (("target-only", plain), ("dflash", spec)):
                print_collectives(engine, name, Path(args.out).with_name(f"decode_hlo_{name}.txt") if args.out else None)
        if batch == 1:
            try:
                entry["host"] = host_overhead(spec, args.context, 128, t_spec)
                entry["host_target_only"] = host_overhead(plain, args.context, 64, t_plain)
            except Exception as err:  # keep the step timings of this batch
                print(f"host-overhead run failed: {err!r}", flush=True)
        # The traces come last: at TP=2 the first decode call on a new state after a decode trace can
        # fault and poison the process (docs/benchmarks.md, ninth and tenth sessions); with this order
        # no process has faulted yet, and the step timings are taken before any trace in any case.
        if batch == 1 and args.profile:
            for name, engine in (("target-only", plain), ("dflash", spec)):
                print(f"== profile: {name}, batch 1", flush=True)
                try:
                    listing = Path(args.out).parent / f"launch_order_{name}.txt" if args.out else None
                    profile_decode(engine, 1, args.context, 8, str(Path(args.profile) / name), listing=listing)
                    if listing is not None:
                        profile_generate(engine, args.context, 8, str(Path(args.profile) / f"ttft_{name}"),
                                         listing.with_name(f"ttft_{name}.txt"))
                        profile_generate(engine, args.context, 64, str(Path(args.profile) / f"gen_{name}"),
                                         listing.with_name(f"generate_{name}.txt"), horizon_ms=None, kernels=False)
                except Exception as err:  # noqa: BLE001  (profiling is a diagnostic: keep the timings)
                    print(f"profile failed: {err!r}", flush=True)
        report["batches"][batch if len(layouts) == 1 else f"{batch} {layout}"] = entry
        print(json.dumps({batch: entry}), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
        rows.append((batch, entry))
        del spec, plain

    if args.reference:
        try:
            report["reference_torch"] = reference_torch(tcfg, 5, 16, args.context, 64)
            print(json.dumps(report["reference_torch"]), flush=True)
        except Exception as err:  # the table below still prints
            report["reference_torch"] = dict(error=repr(err))
            print(f"reference failed: {err!r}", flush=True)

    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nQwen3-8B shapes, bf16, context {args.context}, attention={args.attention}"
          f"{' (unfused)' if args.unfused else ''}{' (unfused norms)' if args.unfused_norms else ''}"
          f"{f' (cached {args.cached_config})' if args.cached_config else ''}"
          f"{f', TP={args.tensor}' if args.tensor > 1 else ''}, "
          f"HBM roofline at {HBM_BYTES_PER_S / 1e12:.1f} TB/s")
    print("batch | tail layout | target step ms | tok/s | % HBM roofline | DFlash step ms | step ratio | draft ratio | "
          f"verify ratio | DFlash tok/s @tau={args.tau} | back to back: target step ms (% roofline), DFlash step ms, "
          "ratio")
    for batch, e in rows:
        draft, verify = (f"{e[k]:.2f}" if e.get(k) else "-" for k in ("draft_ratio", "verify_ratio"))
        print(f"{batch:5d} | {str(e['tail_layout']):>11} | {e['target_step_s'] * 1e3:14.2f} | "
              f"{e['target_tok_s']:5.0f} | "
              f"{100 * e['target_hbm_fraction']:13.0f}% | {e['spec_step_s'] * 1e3:14.2f} | {e['step_ratio']:10.2f} | "
              f"{draft:>11} | {verify:>12} | {e['spec_tok_s_projected']:8.0f} | {e['target_step_pipelined_s'] * 1e3:.2f} "
              f"({100 * e['target_hbm_fraction_pipelined']:.1f}%), {e['spec_step_pipelined_s'] * 1e3:.2f}, "
              f"{e['spec_step_pipelined_s'] / e['target_step_pipelined_s']:.3f}")
    if card:
        print(f"this card's GEMV chain streams {card['gemv_bytes_per_s'] / 1e12:.2f} TB/s; the back-to-back target "
              "step reads its bytes at")
        for batch, e in rows:
            rate = e["hbm_roofline_step_s"] * HBM_BYTES_PER_S / e["target_step_pipelined_s"]  # bytes per second
            print(f"  batch {batch}: {rate / 1e12:.2f} TB/s, {rate / card['gemv_bytes_per_s']:.1%} of that")
    for batch, e in rows:
        for key, mode in (("host", "DFlash"), ("host_target_only", "target-only")):
            h = e.get(key)
            if h:
                print(f"host overhead at batch 1 (tail layout {e['tail_layout']}), {mode}: "
                      f"{h['host_overhead_per_step_s'] * 1e3:.2f} ms/step "
                      f"(wall {h['wall_per_step_s'] * 1e3:.2f} vs device {h['device_per_step_s'] * 1e3:.2f}); "
                      f"TTFT {h['ttft_s'] * 1e3:.1f} ms (prefill alone {h['prefill_s'] * 1e3:.1f} ms)")
    if "reference_torch" in report and "error" not in report["reference_torch"]:
        r = report["reference_torch"]
        b1 = next((e for batch, e in reversed(rows) if batch == 1), None)
        runs = ", ".join(f"{x['tok_s']:.1f}" for x in r["target_only"]["runs"])
        print(f"authors' PyTorch: target-only {r['target_only']['tok_s']:.1f} tok/s (runs {runs}; CPU busy "
              f"{r['target_only']['cpu_share']:.0%} of the wall time), block-16 step "
              f"{r['dflash']['step_s'] / r['target_only']['step_s']:.2f} target steps"
              + (f"; ours target-only {b1['target_tok_s']:.0f} tok/s "
                 f"({b1['target_tok_s'] / r['target_only']['tok_s']:.1f}x)" if b1 else ""))


if __name__ == "__main__":
    main()
