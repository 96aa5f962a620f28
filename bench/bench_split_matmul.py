#!/usr/bin/env python
"""Split-K partials handed to the next kernel, and weights prefetched into L2: two ways to close the
batch-1 gap between the decode step and its matmuls.

At batch 1 XLA runs each skinny matmul as a split-K GEMM followed by a reduction kernel, and the
residual add + RMSNorm or SwiGLU after it as one more kernel (~1.2-2.4 us each, docs/benchmarks.md).
This script measures, on Qwen3-8B shapes in bf16, 36 distinct weights per timing (nothing stays in L2):

1. per matmul and row count: XLA's dot against an explicit split ``[K, N] -> [S, K/S, N]`` as one
   batched dot writing float32 partials ``[S, rows, N]`` (no reduction kernel), with the number of
   kernels XLA compiled for each;
2. the consumers: the ``add_rms_norm`` kernel on a bf16 delta against a prototype that sums S
   float32 partials in its prologue; SwiGLU after the dot against SwiGLU over summed partials;
3. L2 prefetch: a matmul right after a reduction that read its weight, against the matmul alone;
4. the step's layer chain (36 layers + LM head, attention replaced by a stand-in): the engine's way
   against the partials handed on.

    python bench/bench_split_matmul.py --out $OUT/split.json       # on the GPU
    python bench/bench_split_matmul.py --tiny                       # CPU smoke test (interpret)

All four sections with the default splits take more than the device's 10 minutes per command on
the H200 (the sixth session's run stopped in section 2); ``--sections`` and ``--splits`` narrow it.
Findings (docs/benchmarks.md, sixth session): the explicit split loses to XLA's dot except for QKV
at 8 splits, and a weight in L2 saves only 2-3 us per matmul; neither is in the engine. (The
twenty-first session's ``sweep_split_k.py`` times two-row explicit splits in interleaved rounds:
as fast as XLA's own; ``sweep_decode_options.py``'s ``partials:`` variant puts ``split_dot`` and
``add_rms_norm_partials`` in the engine: 0.11-0.23 ms slower per step.)
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

import bench_matvec as mv  # noqa: E402
import kernels_pallas  # noqa: E402
from kernels_pallas._flash import triton_params  # noqa: E402
from kernels_pallas._pdl import signal_after  # noqa: E402
from dflash_jax.layers import split_k_partials  # noqa: E402

EPS = 1e-6


# ``x [rows, K] @ w [K, N]`` as ``splits`` float32 partial products ``[splits, rows, N]``: the engine's
split_dot = split_k_partials


def _norm_partials_kernel(h_ref, d_ref, w_ref, y_ref, s_ref, *, eps, interpret):
    s = h_ref[...] + jnp.sum(d_ref[...], axis=0).astype(h_ref.dtype)
    s_ref[...] = s
    xf = s.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.sum(xf * xf) / xf.shape[0] + eps)
    y_ref[...] = signal_after(w_ref[...] * (xf * r).astype(s.dtype), interpret=interpret)  # as rms_norm_gpu


def add_rms_norm_partials(h, partials, weight, *, eps, interpret):
    """Prototype: ``add_rms_norm(h, bf16(sum(partials, 0)), weight)``, ``h [rows, hidden]``, partials
    ``[S, >= rows, hidden]`` (program i reads row i of each partial: a padded matmul's extra rows
    are never read)."""
    rows, hidden = h.shape
    splits = partials.shape[0]
    row = pl.BlockSpec((None, hidden), lambda i: (i, 0))
    out = jax.ShapeDtypeStruct(h.shape, h.dtype)
    y, s = pl.pallas_call(
        functools.partial(_norm_partials_kernel, eps=eps, interpret=interpret), grid=(rows,),
        in_specs=[row, pl.BlockSpec((splits, None, hidden), lambda i: (0, i, 0)), pl.BlockSpec((hidden,), lambda i: (0,))],
        out_specs=[row, row], out_shape=[out, out], compiler_params=triton_params(4, 1), interpret=interpret,
        name="add_rms_norm_partials")(h, partials, weight)
    return s, y


def swiglu(gu: jax.Array) -> jax.Array:
    g, u = jnp.split(gu, 2, axis=-1)
    return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(jnp.bfloat16)


def kernel_count(fn, *args) -> dict[str, int]:
    """The kernels of ``fn``'s compiled entry computation, by kind (fusion kind or custom call target)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    entry = text[text.find("ENTRY"):]
    kinds = collections.Counter()
    for line in entry.splitlines():
        m = re.search(r"= \S+ (fusion|custom-call)\(", line)
        if m:
            kind = re.search(r'kind=(\w+)|custom_call_target="([^"]+)"', line)
            kinds[(kind.group(1) or kind.group(2)) if kind else m.group(1)] += 1
    return dict(kinds)


def chain_time(fn, weights, x, args) -> float:
    """Seconds per call of ``fn(x, w)`` over the distinct ``weights`` (median, see bench_matvec.timeit)."""
    return mv.timeit(lambda ws, i: [fn(x + i.astype(x.dtype), w) for w in ws], weights,
                     repeats=args.repeats, inner=args.inner) / len(weights)


def layer_chain(h, layers, head, mode: str, splits: dict, interpret: bool):
    """One step's matmuls, norms and residual adds; "engine": XLA dots and the add_rms_norm kernel;
    "partials": the o / gate-up / down dots as split partials, summed by the kernel that reads them."""
    c = mv
    delta = None
    for w in layers:
        if mode == "engine":
            h, x = kernels_pallas.add_rms_norm(h, delta, w["n1"], eps=EPS, interpret=interpret)
        else:
            h, x = ((h, kernels_pallas.add_rms_norm(h, None, w["n1"], eps=EPS, interpret=interpret)[1])
                    if delta is None else add_rms_norm_partials(h, delta, w["n1"], eps=EPS, interpret=interpret))
        qkv = x @ w["qkv"]
        attn = qkv[:, :c.HEADS * c.HD] + qkv[:, c.HEADS * c.HD:c.HEADS * c.HD + 1]  # stand-in, keeps k/v live
        if mode == "engine":
            h, x = kernels_pallas.add_rms_norm(h, attn @ w["o"], w["n2"], eps=EPS, interpret=interpret)
            delta = swiglu(x @ w["gate-up"]) @ w["down"]
        else:
            h, x = add_rms_norm_partials(h, split_dot(attn, w["o"], splits["o"]), w["n2"], eps=EPS, interpret=interpret)
            delta = split_dot(swiglu(jnp.sum(split_dot(x, w["gate-up"], splits["gate-up"]), 0)), w["down"],
                              splits["down"])
    if mode == "engine":
        h, x = kernels_pallas.add_rms_norm(h, delta, layers[0]["n1"], eps=EPS, interpret=interpret)
    else:
        h, x = add_rms_norm_partials(h, delta, layers[0]["n1"], eps=EPS, interpret=interpret)
    return x @ head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--splits", default="2,4,8")
    ap.add_argument("--sections", default="matmuls,consumers,prefetch,chain",
                    help="comma-separated: matmuls, consumers, prefetch, chain (chain needs matmuls)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    if args.tiny:
        for k, v in mv.TINY.items():
            setattr(mv, k, v)
    c = mv
    interpret = jax.default_backend() != "gpu"
    dtype = jnp.bfloat16
    key = jax.random.key(0)
    split_counts = [int(s) for s in args.splits.split(",")]
    res: dict = {"device": jax.devices()[0].device_kind, "matmuls": [], "consumers": [], "prefetch": [], "chain": []}
    print(f"device {res['device']}, interpret={interpret}", flush=True)
    shapes = {"qkv": (c.HIDDEN, (c.HEADS + 2 * c.KV) * c.HD), "o": (c.HEADS * c.HD, c.HIDDEN),
              "gate-up": (c.HIDDEN, 2 * c.MLP), "down": (c.MLP, c.HIDDEN)}
    weights = {}
    for j, (name, (k, n)) in enumerate(shapes.items()):
        copies = 2 if args.tiny else max(8, min(36, int(2.5e9 // (k * n * 2))))
        weights[name] = [mv.normal(jax.random.fold_in(key, 100 * j + i), (k, n), dtype) for i in range(copies)]

    # 1. the matmuls --------------------------------------------------------------------------------
    print(f"{'matmul':>8} {'rows':>4} {'variant':>14} {'us':>7} {'err':>8}  kernels", flush=True)
    for name, (k, n) in shapes.items() if "matmuls" in sections else ():
        for rows in (1, 16):
            x = mv.normal(jax.random.fold_in(key, rows), (rows, k), dtype, 1.0)
            want = (x @ weights[name][0]).astype(jnp.float32)
            variants = {"xla": lambda a, w: a @ w}
            for s in split_counts:
                variants[f"split{s}"] = lambda a, w, s=s: split_dot(a, w, s)
                variants[f"split{s}+sum"] = lambda a, w, s=s: jnp.sum(split_dot(a, w, s), 0).astype(dtype)
            for vname, fn in variants.items():
                got = jax.jit(fn)(x, weights[name][0])
                got = (got.sum(0) if got.ndim == 3 else got).astype(jnp.float32)
                err = float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-9))
                t = chain_time(fn, weights[name], x, args)
                kinds = kernel_count(fn, x, weights[name][0])
                res["matmuls"].append(dict(matmul=name, rows=rows, variant=vname, s=t, rel_err=err, kernels=kinds,
                                           bytes=k * n * 2))
                print(f"{name:>8} {rows:>4} {vname:>14} {t * 1e6:7.1f} {err:8.1e}  {kinds}", flush=True)

    # 2. the consumers ------------------------------------------------------------------------------
    nw = 1.0 + mv.normal(jax.random.fold_in(key, 7), (c.HIDDEN,), dtype, 0.1)
    reps = [nw + i for i in range(36)]  # 36 calls per timing, as many as a step has of each
    print(f"\n{'consumer':>22} {'rows':>4} {'us':>7} {'err':>8}", flush=True)
    for rows in (1, 16) if "consumers" in sections else ():
        h = mv.normal(jax.random.fold_in(key, 8), (rows, c.HIDDEN), dtype, 1.0)
        for s in [0] + split_counts:
            parts = mv.normal(jax.random.fold_in(key, 9 + s), (max(s, 1), rows, c.HIDDEN), jnp.float32, 0.3)
            delta = jnp.sum(parts, 0).astype(dtype)
            want = kernels_pallas.add_rms_norm(h, delta, nw, eps=EPS, interpret=interpret)
            if s == 0:
                fn = lambda a, w, d=delta: kernels_pallas.add_rms_norm(a, d, w, eps=EPS, interpret=interpret)  # noqa: E731
                label = "add_rms_norm bf16"
            else:
                fn = lambda a, w, p=parts: add_rms_norm_partials(a, p, w, eps=EPS, interpret=interpret)  # noqa: E731
                label = f"add_rms_norm {s} parts"
            got = fn(h, nw)
            err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)))) for g, r in zip(got, want))
            t = chain_time(fn, reps, h, args)
            res["consumers"].append(dict(consumer=label, rows=rows, s=t, max_abs_err=err))
            print(f"{label:>22} {rows:>4} {t * 1e6:7.1f} {err:8.1e}", flush=True)
        for s in [0] + split_counts:
            parts = mv.normal(jax.random.fold_in(key, 19 + s), (max(s, 1), rows, 2 * c.MLP), jnp.float32, 0.3)
            gu = jnp.sum(parts, 0).astype(dtype)
            fn = ((lambda a, w, g=gu: swiglu(g + a[:, :1])) if s == 0 else
                  (lambda a, w, p=parts: swiglu(jnp.sum(p, 0).astype(dtype) + a[:, :1])))
            label = "swiglu bf16" if s == 0 else f"swiglu {s} parts"
            t = chain_time(fn, reps, h, args)
            res["consumers"].append(dict(consumer=label, rows=rows, s=t, kernels=kernel_count(fn, h, nw)))
            print(f"{label:>22} {rows:>4} {t * 1e6:7.1f}  {kernel_count(fn, h, nw)}", flush=True)

    # 3. L2 prefetch ----------------------------------------------------------------------------------
    print(f"\n{'matmul':>8} {'dot us':>7} {'max us':>7} {'max+dot us':>10} {'dot after max':>13}", flush=True)
    x1 = {name: mv.normal(jax.random.fold_in(key, 3), (1, k), dtype, 1.0) for name, (k, n) in shapes.items()}
    for name in ("qkv", "o") if "prefetch" in sections else ():
        x = x1[name]

        def touched_dot(a, w):
            m = jnp.max(w, keepdims=True)  # a full read of w: the dot after it finds w in L2 if it stays there
            m, a = jax.lax.optimization_barrier((m, a))
            return a @ w, m

        t_dot = chain_time(lambda a, w: a @ w, weights[name], x, args)
        t_max = chain_time(lambda a, w: jnp.max(w, keepdims=True) + a[:1, :1], weights[name], x, args)
        t_both = chain_time(touched_dot, weights[name], x, args)
        res["prefetch"].append(dict(matmul=name, dot_s=t_dot, max_s=t_max, max_then_dot_s=t_both))
        print(f"{name:>8} {t_dot * 1e6:7.1f} {t_max * 1e6:7.1f} {t_both * 1e6:10.1f} {(t_both - t_max) * 1e6:13.1f}",
              flush=True)

    # 4. the layer chain ------------------------------------------------------------------------------
    if not {"matmuls", "chain"} <= sections:
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        return
    layers = [{name: weights[name][i % len(weights[name])] for name in shapes} | {"n1": nw, "n2": nw}
              for i in range(c.LAYERS)]
    head = mv.normal(jax.random.fold_in(key, 11), (c.HIDDEN, c.VOCAB), dtype)
    best = {}
    for name in ("o", "gate-up", "down"):
        rows1 = [r for r in res["matmuls"] if r["matmul"] == name and r["rows"] == 1 and re.fullmatch(r"split\d+", r["variant"])]
        best[name] = int(min(rows1, key=lambda r: r["s"])["variant"][5:])
    print(f"\nchain splits {best}", flush=True)
    for rows in (1, 16):
        h = mv.normal(jax.random.fold_in(key, 12), (rows, c.HIDDEN), dtype, 1.0)
        outs = {}
        for mode in ("engine", "partials"):
            fn = lambda a, i, m=mode: layer_chain(a + i.astype(dtype), layers, head, m, best, interpret)  # noqa: E731
            outs[mode] = jax.jit(lambda a, m=mode: layer_chain(a, layers, head, m, best, interpret))(h)
            t = mv.timeit(fn, h, repeats=args.repeats, inner=1)
            res["chain"].append(dict(mode=mode, rows=rows, s=t, splits=best))
            print(f"chain {mode:>9} rows {rows:>2}: {t * 1e3:.3f} ms", flush=True)
        a, b = (outs[m].astype(jnp.float32) for m in ("engine", "partials"))
        print(f"  logits rel diff {float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a))):.1e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
