#!/usr/bin/env python
"""The batch-1 MLP of a Qwen3-8B layer (gate-up, SwiGLU, down: 302 MB): the dynamically balanced
persistent kernel (``persistent_mlp.py``) against what the engine runs, XLA's gate-up GEMM (the
engine's interleaved ``[H, I, 2]`` layout), its SwiGLU, and the down GEMM with its split-K reduction.

Both run as chains of ``--layers`` layers with distinct weights (12 are already 3.6 GB, far beyond
the 50 MB L2), each layer's output the
next one's input; the kernel's down partials are summed by XLA (one reduction kernel per layer, as
XLA's own split-K reduction). First the kernel is checked on the device against float32 XLA (the
SwiGLU output and the layer output, relative to their largest entry), and twice in a row: its
counters must be back at zero, and its result bit for bit the same.

Reported per layer: the wall time of the chain (median of ``--repeats``, inner calls chained in one
jit), and with ``--profile`` the GPU kernel time off a trace (kernels back to back: what the engine's
step is made of), with the weight bytes over each, against the ~4.4-4.6 TB/s a long stream reaches.

Variants (``--variants``, indices into VARIANTS): ring depth, step size (``k128``: 16 KB steps),
program count, a down item's K slice, a producer warpgroup, and the kernel's diagnostics: round-robin
items instead of claimed ones (``static``), no wait for a down item's slice (``no-wait``, a race) and
no epilogue stores (``no-store``), both timed although wrong, weights stored tile-major (``tiled``).

    python bench/bench_persistent_mlp.py --layers 12 --profile /tmp/prof    # on an H100/H200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_engine import kernel_time  # noqa: E402
from bench_matvec import normal, timeit  # noqa: E402
from persistent_mlp import (ROWS, MlpConfig, gate_up_layout, persistent_mlp, persistent_mlp_reference,  # noqa: E402
                            supports, tile_major)

HIDDEN, INTER = 4096, 12288
# The measured variants (docs/benchmarks.md). Sixteenth session: the default (5 stages), one stage
# less or two, and the diagnostics.
VARIANTS = [MlpConfig(stages=5), MlpConfig(stages=4), MlpConfig(stages=5, static=True),
            MlpConfig(stages=5, no_wait=True), MlpConfig(stages=3), MlpConfig(stages=5, tiled=True),
            MlpConfig(stages=4, tiled=True),
            # Seventeenth session: a producer warpgroup, 128 programs (the eleventh session's chains streamed at 4.4 TB/s on
            # 128) and 16 KB steps (one copy each, more of them in flight).
            MlpConfig(stages=5, producer_warp=True), MlpConfig(stages=4, producer_warp=True),
            MlpConfig(programs=128), MlpConfig(programs=128, static=True), MlpConfig(step_k=128, stages=9),
            MlpConfig(step_k=128, stages=9, programs=128), MlpConfig(step_k=128, stages=9, producer_warp=True),
            # Then the items' length and epilogues: down items twice as long (K slices of 2048, in 16 KB
            # steps to fit), and no epilogue stores (with and without the slices' wait).
            MlpConfig(x_cols=2048, step_k=128, stages=8), MlpConfig(x_cols=2048, step_k=128, stages=8, static=True),
            MlpConfig(no_store=True), MlpConfig(no_store=True, no_wait=True)]


def label(c: MlpConfig) -> str:
    return (f"persistent s{c.stages} p{c.programs} x{c.x_cols}" + (f" k{c.step_k}" if c.step_k != 256 else "")
            + (" static" if c.static else "")
            + (" no-wait" if c.no_wait else "") + (" no-store" if c.no_store else "") + (" tiled" if c.tiled else "") + (" producer" if c.producer_warp else ""))


def one_profiled(x, w_gate_up, w_down, c: MlpConfig, trace_dir: str) -> None:
    """One call under Mosaic GPU's in-kernel profile (its trace lands in ``trace_dir``)."""
    jax.block_until_ready(jax.jit(lambda *a: persistent_mlp(*a, c, profile_dir=trace_dir, profile_ranges=384))(
        x, w_gate_up, w_down))
    jax.effects_barrier()  # the profile is written by a host callback


def in_kernel_profile(run, trace_dir: str) -> dict:
    """Where the programs' time goes in one call: per range name (``persistent_mlp``'s ``ring``,
    ``x``, ``epilogue``, ``claim``), the mean time per program as a share of its ``loop``; and how
    far apart the programs finish (max - min and max - median of the loop's end, in the trace's
    units: SM clock cycles / 1000, each program from its own start). A program is the timeline that
    has a ``loop`` range."""
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    run(trace_dir)
    events = json.loads(next(Path(trace_dir).glob("*trace.json")).read_text())["traceEvents"]
    per_program: dict[int, dict[str, float]] = {}
    ends = []
    for tid in sorted({e["tid"] for e in events}):
        opened: dict[str, float] = {}
        totals = per_program.setdefault(tid, {})
        for e in (e for e in events if e["tid"] == tid):  # in time order within a program
            if e["ph"] == "B":
                opened[e["name"]] = e["ts"]
            elif e["name"] in opened:
                totals[e["name"]] = totals.get(e["name"], 0.0) + e["ts"] - opened.pop(e["name"])
                if e["name"] == "loop":
                    ends.append(e["ts"])
    # With a producer warpgroup only the consumer's timeline has ranges (the producer's has no ``loop``).
    per_program = {tid: t for tid, t in per_program.items() if "loop" in t}
    names = sorted({n for t in per_program.values() for n in t})
    mean = {n: float(np.mean([t.get(n, 0.0) for t in per_program.values()])) for n in names}
    out = {"share_of_loop": {n: mean[n] / mean["loop"] for n in names if n != "loop"},
           "loop_kcycles": mean["loop"], "end_spread_kcycles": float(np.max(ends) - np.min(ends)),
           "last_after_median_kcycles": float(np.max(ends) - np.median(ends))}
    print("    in-kernel profile: " + ", ".join(f"{n} {v:.0%}" for n, v in out["share_of_loop"].items())
          + f" of the loop ({out['loop_kcycles']:.1f} kcycles); programs end {out['end_spread_kcycles']:.1f} "
          f"apart, the last {out['last_after_median_kcycles']:.1f} after the median", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--variants", default="", help="indices into VARIANTS (default: all)")
    ap.add_argument("--profile", default=None, metavar="DIR")
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA baseline")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="also profile one call of each variant from inside the kernel: where its programs' time goes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype, key, layers = jnp.bfloat16, jax.random.key(0), args.layers
    mb = 3 * HIDDEN * INTER * 2 / 1e6
    results = {"device": jax.devices()[0].device_kind, "rows": []}
    w_gate = [normal(jax.random.fold_in(key, 3 * i), (HIDDEN, INTER), dtype, HIDDEN ** -0.5) for i in range(layers)]
    w_up = [normal(jax.random.fold_in(key, 3 * i + 1), (HIDDEN, INTER), dtype, HIDDEN ** -0.5) for i in range(layers)]
    w_down = [normal(jax.random.fold_in(key, 3 * i + 2), (INTER, HIDDEN), dtype, INTER ** -0.5) for i in range(layers)]
    x = normal(jax.random.fold_in(key, 10 ** 6), (ROWS, HIDDEN), dtype, 1.0)
    print(f"device {results['device']}, {layers} layers, {mb:.1f} MB of weights per layer", flush=True)

    def report(name, seconds, fn, fn_args, error=float("nan")):
        row = {"variant": name, "us_per_layer": seconds * 1e6, "tb_per_s": mb / seconds / 1e12 * 1e6, "error": error}
        line = f"{name:<36} wall {row['us_per_layer']:8.2f} us ({row['tb_per_s']:.2f} TB/s)"
        if args.profile:
            us, names = kernel_time(lambda f=jax.jit(fn): jax.block_until_ready(f(*fn_args)),
                                    f"{args.profile}/{len(results['rows'])}", layers)
            row["kernel_us_per_layer"], row["kernels"] = us, names
            line += f"  kernels {us:8.2f} us ({mb / us:.2f} TB/s)  error {error:.1e}\n    {names}"
        results["rows"].append(row)
        print(line, flush=True)

    # XLA as the engine runs it: one row, gate and up interleaved as [H, I, 2].
    w_gu = [jnp.stack([g, u], axis=-1).reshape(HIDDEN, 2 * INTER) for g, u in zip(w_gate, w_up)]

    def xla_chain(ws, i, h):
        h = h + i.astype(dtype)
        for layer in range(layers):
            gu = (h @ ws[0][layer]).reshape(h.shape[0], INTER, 2)
            h = ((jax.nn.silu(gu[..., 0]) * gu[..., 1]).astype(dtype) @ ws[1][layer]).astype(dtype)
        return h

    xla_ws = (w_gu, w_down)
    if not args.no_xla:
        report("xla rows 1", timeit(lambda ws, i: xla_chain(ws, i, x[:1]), xla_ws, repeats=args.repeats,
                                    inner=args.inner) / layers,
               lambda ws: xla_chain(ws, jnp.zeros((), jnp.int32), x[:1]), (xla_ws,))
    del w_gu, xla_ws

    def kernel_chain(ws, i, h, c):
        h = h + i.astype(dtype)
        for layer in range(layers):
            _, partials = persistent_mlp(h, ws[0][layer], ws[1][layer], c)
            h = partials.sum(axis=0).astype(dtype)
        return h

    ws = ([gate_up_layout(g, u) for g, u in zip(w_gate, w_up)], w_down)
    ws_tiled = {}  # per step_k
    picked = [VARIANTS[int(i)] for i in args.variants.split(",") if i] or VARIANTS
    for c in picked:
        if c.tiled and c.step_k not in ws_tiled:
            ws_tiled[c.step_k] = tuple([tile_major(w, c.step_k) for w in group] for group in ws)
        ws_c = ws_tiled[c.step_k] if c.tiled else ws
        if not supports(HIDDEN, INTER, c):
            print(f"{label(c):<36} unsupported", flush=True)
            continue
        try:
            one = jax.jit(lambda *a, c=c: persistent_mlp(*a, c))
            h1, p1 = one(x, ws_c[0][0], ws_c[1][0])
            h2, p2 = one(x, ws_c[0][0], ws_c[1][0])
            want_h, want_y = persistent_mlp_reference(x, w_gate[0], w_up[0], w_down[0])
            err_h = float(jnp.max(jnp.abs(h1.astype(jnp.float32) - want_h)) / jnp.max(jnp.abs(want_h)))
            err_y = float(jnp.max(jnp.abs(p1.sum(0) - want_y)) / jnp.max(jnp.abs(want_y)))
            same = bool(jnp.array_equal(h1, h2) & jnp.array_equal(p1, p2))
            print(f"{label(c):<36} check: SwiGLU error {err_h:.1e}, output error {err_y:.1e}, "
                  f"second call identical: {same}", flush=True)
            if not (err_h < 2e-2 and err_y < 2e-2 and same):
                print(f"{label(c):<36} WRONG" + ("" if c.no_wait or c.no_store else ", not timed"), flush=True)
                if not (c.no_wait or c.no_store):  # a diagnostic, wrong by design, is timed all the same
                    continue
            if args.trace:
                try:  # the profile's buffers take shared memory a variant may not have to spare
                    results.setdefault("profiles", {})[label(c)] = in_kernel_profile(
                        lambda d, c=c: one_profiled(x, ws_c[0][0], ws_c[1][0], c, d),
                        f"{args.trace}/{len(results['rows'])}")
                except Exception as e:
                    print(f"{label(c):<36} in-kernel profile FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            report(label(c), timeit(lambda ws_, i, c=c: kernel_chain(ws_, i, x, c), ws_c, repeats=args.repeats,
                                    inner=args.inner) / layers,
                   lambda ws_, c=c: kernel_chain(ws_, jnp.zeros((), jnp.int32), x, c), (ws_c,), max(err_h, err_y))
        except Exception as e:  # one failing variant must not lose the others' numbers
            print(f"{label(c):<36} FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
