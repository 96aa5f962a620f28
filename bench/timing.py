"""What the benchmarks share: timing, the HBM roofline, random models, engine states, JSON output.

Scripts run from the repository root as ``python3 bench/bench_X.py`` with the package importable
(``pip install -e .`` or ``PYTHONPATH=.``); Python puts the script's folder on ``sys.path``, so
``import timing`` finds this module.

Timing rules everywhere: a warm-up call first (it compiles), every timed call ended by
``jax.block_until_ready``, the median of the repeats reported. Weights and inputs are random, never
zeros: a GPU multiplies zeros faster than data.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash_jax.models.config import TargetConfig
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target
from dflash_jax.ops.cache import KVCache
from dflash_jax.runtime import decoding
from dflash_jax.sharding import logical_spec
from dflash_jax.tiny import tiny_drafter_config

# A device-to-device copy on the H200 moves ~4.3 TB/s (read + write; docs/performance.md): the rate of
# the HBM roofline. ``card_streaming_rate`` measures what this card's GEMVs reach.
HBM_BYTES_PER_S = 4.3e12


def device_line() -> str:
    dev = jax.devices()[0]
    return f"jax {jax.__version__} on {jax.device_count()} x {dev.device_kind} ({jax.default_backend()})"


# -- timing ---------------------------------------------------------------------------------------


def median_time(fn: Callable, *args, repeats: int) -> tuple[float, float]:
    """Seconds per call of ``fn(*args)`` after a warm-up call: (median, min) of ``repeats`` calls."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def per_call_time(fn: Callable, *args, repeats: int = 15, round_s: float = 3e-3) -> float:
    """Median seconds per call for calls of microseconds: each round runs as many calls back to back
    as fill ``round_s`` (at most 100), one sync at its end, so the host's sync is not what is timed."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    inner = max(1, min(100, int(round_s / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def relative_error(got, want) -> float:
    """The largest difference of ``got`` from ``want``, relative to ``want``'s largest entry."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def normal(key: jax.Array, shape: tuple[int, ...], dtype, scale: float = 1.0) -> jax.Array:
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


# -- models and the roofline ------------------------------------------------------------------------


def qwen3_8b(layers: int = 36) -> TargetConfig:
    return TargetConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                        num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                        rope_theta=1e6, tie_word_embeddings=False)


def qwen3_32b(layers: int = 64) -> TargetConfig:
    return TargetConfig(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                        num_layers=layers, num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                        rope_theta=1e6, tie_word_embeddings=False)


SHAPES = {"8b": qwen3_8b, "32b": qwen3_32b}


def drafter_layers(tiny: bool) -> int:
    """The benchmarks' drafter depth: the published 5 layers, or 2 on the tiny shapes of the CPU smoke tests
    (the same programs with less to compile)."""
    return 2 if tiny else 5


def random_pair(tcfg: TargetConfig, dtype=jnp.bfloat16, mesh: Mesh | None = None,
                drafter_layers: int = 5) -> tuple[Target, Drafter]:
    """A random target of ``tcfg`` and a block-16 drafter of ``drafter_layers`` layers for it (5: the published
    shape). On ``mesh`` each parameter is created in its shards (its logical axes, the default rules): a 32B
    target never sits whole on one device."""
    dcfg = tiny_drafter_config(tcfg, num_layers=drafter_layers, block_size=16, mask_token_id=tcfg.vocab_size - 1)
    return (on_mesh(lambda: Target(tcfg, dtype=dtype, rngs=nnx.Rngs(0)), mesh),
            on_mesh(lambda: Drafter(dcfg, dtype=dtype, rngs=nnx.Rngs(1)), mesh))


def on_mesh(make: Callable[[], nnx.Module], mesh: Mesh | None) -> nnx.Module:
    """``make()``, its parameters initialised in place in their shards on ``mesh`` (None: ``make()``)."""
    if mesh is None:
        return make()
    graph, abstract = nnx.split(nnx.eval_shape(make))

    def placement(var):
        axes = var.get_metadata().get("axes")
        value = var.get_value()
        spec = logical_spec(tuple(axes), value.shape, mesh) if axes else PartitionSpec()
        return var.replace(NamedSharding(mesh, spec))

    shardings = jax.tree.map(placement, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    state = jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()
    return nnx.merge(graph, state)


def param_bytes(module: nnx.Module) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def streamed_bytes(target: Target) -> int:
    """The weights a decode step reads: all of them but the embedding table, of which it reads a row
    (unless the table is also the LM head). Pass an engine's ``engine.target`` (its serving layout)."""
    table = target.embed_tokens[...]
    return param_bytes(target) - (0 if target.lm_head is None else table.size * table.dtype.itemsize)


def hbm_roofline_s(target: Target, batch: int, context: int) -> float:
    """A target-only decode step at ``HBM_BYTES_PER_S``: its weights plus every row's K/V of
    ``context`` positions."""
    c = target.config
    kv_bytes = 2 * c.num_layers * batch * context * c.num_kv_heads * c.head_dim * target.embed_tokens.dtype.itemsize
    return (streamed_bytes(target) + kv_bytes) / HBM_BYTES_PER_S


def card_streaming_rate(repeats: int, *, passes: int = 8, gemvs: int = 8, vocab: int = 151936,
                        hidden: int = 4096) -> dict[str, float]:
    """This card's weight-streaming rate, to tell a slower card from slower code: bytes per second of
    ``passes`` rounds of a chain of ``gemvs`` dependent one-row GEMVs over distinct ``[hidden, vocab]``
    bf16 weights (the LM head's shape, far larger than L2). A call streams 80 GB (~18 ms on the
    H200), so its dispatch and sync stay under 1%."""
    key = jax.random.key(11)
    weights = [normal(jax.random.fold_in(key, i), (hidden, vocab), jnp.bfloat16) for i in range(gemvs)]
    row = normal(key, (1, hidden), jnp.bfloat16)

    @jax.jit
    def chain(row, weights):
        for _ in range(passes):
            for w in weights:  # each GEMV waits for the last
                row = (row @ w)[:, :hidden] * jnp.bfloat16(0.01)
        return row

    t_chain, _ = median_time(chain, row, weights, repeats=repeats)
    return {"gemv_bytes_per_s": passes * gemvs * hidden * vocab * 2 / t_chain, "gemv_chain_s": t_chain}


# -- engine states ----------------------------------------------------------------------------------


def synthetic_state(engine, batch: int, context: int, seed: int, window: int | None = None,
                    shuffled: bool = True) -> decoding.DecodeState:
    """A decode state as after a prefill of ``context`` random tokens, its caches full of random data
    (a paged engine's: ``paged_synthetic_state``, its rows holding pages for ``window`` positions,
    ``shuffled`` or in order)."""
    if getattr(engine, "paged", False):
        return paged_synthetic_state(engine, batch, context, seed, positions=window, shuffled=shuffled)
    tc, cap = engine.target.config, engine.capacity
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    dtype = engine.target.embed_tokens.dtype

    def cache(key, layers, kv, dim):
        keys = jax.random.split(key, 2 * layers)
        shape = (batch, cap, kv, dim)
        return KVCache(tuple(normal(keys[i], shape, dtype) for i in range(layers)),
                       tuple(normal(keys[layers + i], shape, dtype) for i in range(layers)))

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


def page_order(batch: int, held: int, seed: int, shuffled: bool = True) -> np.ndarray:
    """``[batch, held]`` page tables over pages ``1 .. batch * held`` of a pool (page 0 the null page):
    shuffled across the rows (``seed``), or each row's pages consecutive in order."""
    order = np.arange(1, 1 + batch * held, dtype=np.int32)
    return (np.random.default_rng(seed).permutation(order) if shuffled else order).reshape(batch, held)


def paged_synthetic_state(engine, batch: int, context: int, seed: int, positions: int | None = None,
                          shuffled: bool = True) -> decoding.DecodeState:
    """``synthetic_state`` of a paged engine: each row holds the pages of its first ``positions``
    positions (None: ``max_pages`` pages) in a shuffled order (rows' pages interleave, as after admissions
    and evictions) or, not ``shuffled``, consecutive pages of the pool in order (as a fresh pool gives
    them), filled with random data; the rest of its table is the null page."""
    held = engine.max_pages if positions is None else min(-(-positions // engine.page_size), engine.max_pages)
    if batch * held >= engine.num_pages:
        raise ValueError(f"{batch} rows of {held} pages exceed the pool's {engine.num_pages - 1}")
    rows = engine.empty_state(batch)
    key = jax.random.key(seed)
    table = np.zeros((batch, engine.max_pages), np.int32)
    table[:, :held] = page_order(batch, held, seed, shuffled)
    dtype = engine.target.embed_tokens.dtype

    def fill(pools: KVCache | None, salt: int) -> KVCache | None:
        if pools is None:
            return None
        keys = jax.random.split(jax.random.fold_in(key, salt), 2 * pools.num_layers)
        n = pools.num_layers
        return KVCache(tuple(normal(keys[i], x.shape, dtype) for i, x in enumerate(pools.k)),
                       tuple(normal(keys[n + i], x.shape, dtype) for i, x in enumerate(pools.v)))

    tc = engine.target.config
    return dataclasses.replace(
        rows, tokens=jax.random.randint(jax.random.fold_in(key, 3), rows.tokens.shape, 0, tc.vocab_size - 1,
                                        jnp.int32),
        starts=jnp.full((batch,), context, jnp.int32), max_lens=jnp.full((batch,), engine.config.max_length, jnp.int32),
        done=jnp.zeros((batch,), bool), target_cache=fill(rows.target_cache, 1), draft_cache=fill(rows.draft_cache, 2),
        sampling=None, page_table=jnp.asarray(table))


def warmed_state(engine, batch: int, context: int, steps: int, seed: int,
                 window: int | None = None, shuffled: bool = True) -> decoding.DecodeState:
    """``synthetic_state`` after two decode calls of ``steps`` steps (the first compiles; on a mesh
    the second compiles for the sharded state), synced. ``window``: the calls' attention window, as
    ``Engine.decode`` takes it (None: the whole cache); ``shuffled``: a paged engine's page order."""
    state = synthetic_state(engine, batch, context, seed=seed, window=window, shuffled=shuffled)
    for _ in range(2):
        state, _ = engine.decode(state, n_steps=steps, window=window)
    jax.block_until_ready(state.starts)
    return state


def time_decode(engine, batch: int, context: int, steps: int, repeats: int,
                window: int | None = None, shuffled: bool = True) -> tuple[float, float]:
    """Median seconds per decode step over ``repeats`` synchronised calls of ``steps`` on-device
    steps (state donated), and the tokens committed per step (tau); ``window``, ``shuffled`` as in
    ``warmed_state``."""
    state = warmed_state(engine, batch, context, steps, seed=batch, window=window, shuffled=shuffled)
    times = []
    for _ in range(repeats):
        before = np.asarray(state.starts)
        t0 = time.perf_counter()
        state, _ = engine.decode(state, n_steps=steps, window=window)
        jax.block_until_ready(state.starts)
        times.append((time.perf_counter() - t0) / steps)
        _check_advanced(np.asarray(state.starts) - before, steps, context, "time_decode")
    tau = float((np.asarray(state.starts) - before).mean() / steps)
    return statistics.median(times), tau


def time_decode_pipelined(engine, batch: int, context: int, steps: int, calls: int) -> float:
    """Seconds per decode step over ``calls`` calls dispatched back to back, one sync at the end: the
    device's steady rate, as the batcher runs it. ``time_decode`` syncs after every call, so each of
    its calls also pays the host's dispatch (milliseconds for an 8B engine)."""
    state = warmed_state(engine, batch, context, steps, seed=batch + 3)
    before = np.asarray(state.starts)
    t0 = time.perf_counter()
    for _ in range(calls):
        state, _ = engine.decode(state, n_steps=steps)
    jax.block_until_ready(state.starts)
    elapsed = time.perf_counter() - t0
    _check_advanced(np.asarray(state.starts) - before, calls * steps, context, "time_decode_pipelined")
    return elapsed / (calls * steps)


def _check_advanced(advanced: np.ndarray, steps: int, context: int, what: str) -> None:
    """Every step commits at least one token per row: rows that advanced fewer than ``steps`` tokens
    stopped (at max_length, or their window's edge), and the steps after that were timed without having
    run. Raises ValueError saying so."""
    least = int(advanced.min())
    if least < steps:
        raise ValueError(f"{what}: {steps} steps from context {context} ran past the engine's max_length or the "
                         f"attention window (rows advanced {least} tokens); ask for fewer steps or calls, or a "
                         f"larger max_length")


# -- profiles and output ----------------------------------------------------------------------------


def gpu_kernel_times(run: Callable[[], None], out_dir: str, calls: int = 3) -> dict[str, list[float]] | None:
    """Runs ``run`` (one synchronised call) once, then ``calls`` times under ``jax.profiler``: the GPU
    kernels' durations (us) by kernel name, read off the Perfetto trace written under ``out_dir``
    (None: no trace). Kernel time without the launch gaps between them."""
    events = gpu_kernel_events(run, out_dir, calls)
    if events is None:
        return None
    durations: dict[str, list[float]] = {}
    for e in events:
        durations.setdefault(e["name"], []).append(e["dur"])
    return durations


def gpu_kernel_events(run: Callable[[], None], out_dir: str, calls: int = 3) -> list[dict] | None:
    """``gpu_kernel_times``' trace as its GPU kernel events: ``name``, ``ts`` (start) and ``dur`` (us) and
    the profiler's ``args`` of each (on XLA:GPU, where the profiler annotates them, ``hlo_op`` names the
    HLO instruction that launched it). None: no trace."""
    traced = trace_events(run, out_dir, calls)
    return None if traced is None else traced[0]


def trace_events(run: Callable[[], None], out_dir: str, calls: int = 3) -> tuple[list[dict], list[dict]] | None:
    """Runs ``run`` once, then ``calls`` times under ``jax.profiler``: the trace's complete events
    (``name``, ``ts``, ``dur`` in us, ``args``) on the GPU (the first GPU of several) and on the host
    threads, each list in time order. None: no trace."""
    run()
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        for _ in range(calls):
            run()
    paths = sorted(Path(out_dir).rglob("perfetto_trace.json.gz"))
    if not paths:
        return None
    events = json.loads(gzip.open(paths[-1]).read())["traceEvents"]
    gpus = {e["pid"]: str(e["args"].get("name")) for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in str(e["args"].get("name"))}
    # On a mesh every GPU runs the same program: the first one's kernels stand for a device's step.
    first = {pid for pid, name in gpus.items() if re.search(r"GPU:0(\D|$)", name)}
    gpu = first or set(gpus)
    complete = sorted((e for e in events if e.get("ph") == "X" and "dur" in e), key=lambda e: e["ts"])
    pick = lambda on_gpu: [dict(name=e["name"], ts=e["ts"], dur=e["dur"], args=e.get("args", {}))  # noqa: E731
                           for e in complete if (e.get("pid") in gpu) == on_gpu]
    return pick(True), pick(False)


def call_spans(events: list[dict], calls: int) -> list[tuple[float, float]]:
    """The (start, end) in us of each of ``calls`` calls in time-ordered ``events``, split at the
    ``calls - 1`` longest gaps between one event's end and the next one's start."""
    if not events:
        return []
    ends = np.maximum.accumulate([e["ts"] + e["dur"] for e in events])
    gaps = sorted(range(1, len(events)), key=lambda i: events[i]["ts"] - ends[i - 1])[len(events) - calls:]
    cuts = [0, *sorted(gaps), len(events)]
    return [(events[a]["ts"], float(ends[b - 1])) for a, b in zip(cuts, cuts[1:]) if b > a]


def write_json(path: str | Path | None, obj) -> None:
    """Writes ``obj`` to ``path`` (parents created; nothing when ``path`` is None)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_jsonable))


def _jsonable(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    if isinstance(x, (np.generic, np.ndarray)):
        return x.tolist()
    return str(x)
