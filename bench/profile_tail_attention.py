#!/usr/bin/env python
"""Where the layer tail's attention phase spends its time: one Qwen3-8B-shaped layer through
``kernels_pallas.layer_tail_gpu.layer_tail`` without the next layer's attention, with it, and with
it under approximate math (``approx_math``, checked against the exact outputs first), timed by wall
clock over repeated calls; then the two attention variants once each under Mosaic GPU's in-kernel
profile, whose named ranges (``m0``-``m3`` the matmul phases, ``wait``, ``attention`` and its steps
``a_*``) are averaged over the programs that ran them (docs/benchmarks.md, twenty-fourth session).

    python bench/profile_tail_attention.py --out-dir /tmp/tailprof     # on the GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_engine import relative_error  # noqa: E402
from kernels_pallas import layer_tail_gpu, tail_attention_gpu  # noqa: E402

H, I, HQ, HKV, D, CAP = 4096, 12288, 32, 8, 128, 1152
Q = HKV * (HQ // HKV + 2) * D


def inputs(position: int):
    ks = jax.random.split(jax.random.key(0), 9)
    normal = lambda k, shape, s=1.0: (s * jax.random.normal(k, shape, jnp.float32)).astype(jnp.bfloat16)  # noqa: E731
    row = lambda k, n: jnp.broadcast_to(normal(k, (1, n)), (8, n))  # noqa: E731
    weights = [normal(ks[2], (H, HQ * D), (HQ * D) ** -0.5), normal(ks[3], (2 * I, H), H ** -0.5),
               normal(ks[4], (H, I), I ** -0.5), normal(ks[5], (Q, H), H ** -0.5)]
    caches = [normal(ks[6], (CAP, HKV, D)), normal(ks[7], (CAP, HKV, D))]
    meta = jnp.zeros((tail_attention_gpu.META,), jnp.int32).at[0].set(position)
    freqs = position * (1e6 ** (-jnp.arange(0, D, 2) / D))
    rope = jnp.broadcast_to(jnp.concatenate([jnp.cos(freqs), jnp.sin(freqs)]).astype(jnp.bfloat16), (64, D))
    norms = jnp.ones((2, 64, D), jnp.bfloat16)
    return [row(ks[0], HQ * D), row(ks[1], H), *weights], [*caches, meta, norms, rope]


def ranges(trace: Path) -> dict[str, dict[str, float]]:
    """Per named range: its mean and max duration over the programs that ran it, and how many did
    (the trace's units: k-cycles of each program's SM clock)."""
    events = json.loads(trace.read_text())["traceEvents"]
    per: dict[str, list[float]] = {}
    open_at: dict[tuple, float] = {}
    for e in events:
        key = (e.get("pid"), e.get("tid"), e.get("name"))
        if e.get("ph") == "B":
            open_at[key] = e["ts"]
        elif e.get("ph") == "E" and key in open_at:
            per.setdefault(e["name"], []).append(e["ts"] - open_at.pop(key))
    return {name: dict(mean=statistics.fmean(v), max=max(v), n=len(v)) for name, v in sorted(per.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--position", type=int, default=512)
    ap.add_argument("--out-dir", default="/tmp/tailprof")
    args = ap.parse_args()
    tail, attention = inputs(args.position)
    static = dict(eps=1e-6, groups=HQ // HKV, scale=D ** -0.5)
    config = layer_tail_gpu.config_for(8, H, I, Q, attention=HQ * D)
    plain = jax.jit(lambda *x: layer_tail_gpu.layer_tail(*x, eps=1e-6, config=config))
    attend = jax.jit(lambda *x: layer_tail_gpu.layer_tail(*x, config=config, **static))
    approx = jax.jit(lambda *x: layer_tail_gpu.layer_tail(*x, config=config, approx_math=True, **static))
    want = attend(*tail, *attention)
    got = approx(*tail, *attention)
    rel = [relative_error(g, w) for g, w in zip(got[:7], want[:7])]
    print(f"approx_math against exact, per output (h1, s, h2, qkv, attn, k_new, v_new): "
          f"{', '.join(f'{r:.1e}' for r in rel)}", flush=True)
    for name, fn, args_ in (("tail", plain, tail), ("tail+attention", attend, tail + attention),
                            ("tail+attention, approx_math", approx, tail + attention)):
        for _ in range(20):
            jax.block_until_ready(fn(*args_))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20):
                out = fn(*args_)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / 20)
        print(f"{name}: {statistics.median(times) * 1e6:.1f} us per call (wall, one layer, weights from HBM "
              f"after the first call only partly: 386 MB > L2)", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, extra, args_ in (("attention", static, tail + attention),
                               ("attention_approx_math", dict(static, approx_math=True), tail + attention)):
        d = out / name
        d.mkdir(exist_ok=True)
        fn = jax.jit(lambda *x, d=str(d), extra=extra: layer_tail_gpu.layer_tail(
            *x, config=config, profile_dir=d, profile_ranges=64, **(extra or dict(eps=1e-6))))
        jax.block_until_ready(fn(*args_))
        jax.effects_barrier()
        trace = next(d.glob("*trace.json"))
        report = ranges(trace)
        print(f"== in-kernel profile, {name} (k-cycles; ~1.8 per us):", flush=True)
        for r, v in report.items():
            print(f"  {r:<14} mean {v['mean']:8.2f}  max {v['max']:8.2f}  programs {v['n']}", flush=True)


if __name__ == "__main__":
    main()
