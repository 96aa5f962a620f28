#!/usr/bin/env python
"""Decode matmuls against the HBM roofline: XLA against the candidate kernel ``decode_matmul.py``.

A batch-1 decode step is weight streaming: four matmuls per layer (Qwen3-8B: fused QKV 4096x6144,
output 4096x4096, fused gate-up 4096x24576, down 12288x4096) plus the LM head. This script:

1. checks the kernel on the GPU against ``decode_matmul_reference`` (each shape in its engine role:
   QKV and gate-up with the residual add + RMSNorm prologue, gate-up with the SwiGLU epilogue);
2. per shape, weight layout (``[K, N]`` as the engine stores it, ``[N, K]``) and row count (1: a
   decode token, 16: a verify block), times XLA's dot and the kernel over a sweep of tiles (at 16
   rows also without its prologue, to see what the prologue costs), 36 distinct weights per timing
   so nothing stays in the 60 MB L2;
3. times the layer chain of a whole step (36 layers + LM head, attention replaced by an
   elementwise stand-in) four ways: XLA throughout, the engine's way (XLA matmuls, the
   ``add_rms_norm`` kernel), and the candidate kernel on ``[K, N]`` and on ``[N, K]`` weights.

    python bench/bench_matvec.py --out $OUT/matvec.json            # on the GPU
    python bench/bench_matvec.py --tiny                             # CPU smoke test (interpret)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kernels_pallas  # noqa: E402
from decode_matmul import MatmulConfig, decode_matmul, decode_matmul_reference, supports  # noqa: E402

HIDDEN, HEADS, KV, HD, MLP, VOCAB, LAYERS = 4096, 32, 8, 128, 12288, 151936, 36
TINY = dict(HIDDEN=256, HEADS=4, KV=2, HD=64, MLP=512, VOCAB=1024, LAYERS=2)
EPS = 1e-6


def timeit(fn, *args, repeats: int, inner: int, compiler_options: dict | None = None) -> float:
    """Median seconds of one of ``inner`` chained calls inside one jit (``fn(*args, i)``). Timed right
    after the compile: a GPU idle through it runs short bursts at a lower clock, which spread one
    kernel over 12.7-18.1 us in the twenty-first session; compare variants with
    ``sweep_split_k.time_interleaved`` instead."""

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def loop(*a):
        def body(i, acc):
            out = fn(*a, i)  # every output feeds the carry: nothing is dead code
            return acc + sum(jnp.sum(o[..., :1].astype(jnp.float32)) for o in jax.tree.leaves(out))

        return jax.lax.fori_loop(0, inner, body, jnp.zeros((), jnp.float32))

    jax.block_until_ready(loop(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def normal(key, shape, dtype, scale=0.02):
    return jax.jit(lambda k: (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype))(key)


def xla_role(x, w, delta, norm, swiglu):
    """The XLA ops the kernel replaces: add, RMSNorm, dot, SwiGLU (separate kernels at batch 1)."""
    return decode_matmul_reference(x, w, delta=delta, norm=norm, eps=EPS, swiglu=swiglu)


def sweep(k: int, n: int, swiglu: bool, w_nk: bool) -> list[MatmulConfig]:
    out = [MatmulConfig()]
    for block_n in ((16, 32, 64) if w_nk else (32, 64)):
        for block_k in ((256, 512) if w_nk else (256,)):
            for stages in (3, 4):
                out.append(MatmulConfig(block_n=block_n, block_k=block_k, num_stages=stages))
    return [c for c in out if supports(1, k, n, swiglu=swiglu, config=c)]


def layer_chain(h, layers, head, mode: str, tiles=None):
    """One step's matmuls with their norms and residual adds; ``mode``: "xla", "norm-kernel" (XLA
    matmuls, the ``add_rms_norm`` kernel) or "decode-matmul kn" / "decode-matmul nk" (the kernel
    on ``[K, N]`` / ``[N, K]`` weights, ``tiles`` per shape name)."""
    delta = None
    for w in layers:
        rows = h.shape[0]
        if mode.startswith("decode-matmul"):
            layout = mode.split()[-1]
            mm = lambda a, name, **kw: decode_matmul(  # noqa: E731
                a, w[name], w_nk=layout == "nk", config=tiles.get((name, layout)), **kw)
            qkv, h = mm(h, "qkv", delta=delta, norm=w["n1"], eps=EPS)
            attn = qkv[:, :HEADS * HD] + qkv[:, HEADS * HD:HEADS * HD + 1]  # stand-in, keeps k/v live
            o, _ = mm(attn, "o")
            m, h = mm(h, "gate-up", delta=o, norm=w["n2"], eps=EPS, swiglu=True)
            delta, _ = mm(m, "down")
            continue
        if mode == "norm-kernel":
            h, x = kernels_pallas.add_rms_norm(h, delta, w["n1"], eps=EPS)
        else:
            h = h if delta is None else h + delta
            hf = h.astype(jnp.float32)
            x = w["n1"] * (hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + EPS)).astype(h.dtype)
        qkv = x @ w["qkv"]
        attn = qkv[:, :HEADS * HD] + qkv[:, HEADS * HD:HEADS * HD + 1]
        o = attn @ w["o"]
        if mode == "norm-kernel":
            h, x = kernels_pallas.add_rms_norm(h, o, w["n2"], eps=EPS)
        else:
            h = h + o
            hf = h.astype(jnp.float32)
            x = w["n2"] * (hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + EPS)).astype(h.dtype)
        gu = (x @ w["gate-up"]).reshape(rows, MLP, 2)
        delta = (jax.nn.silu(gu[..., 0]) * gu[..., 1]) @ w["down"]
    h = h + delta
    hf = h.astype(jnp.float32)
    return (hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + EPS)).astype(h.dtype) @ head


def main() -> None:
    global HIDDEN, HEADS, KV, HD, MLP, VOCAB, LAYERS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the %% column")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the tile sweep (all shapes)")
    ap.add_argument("--rows", default="1,16", help="row counts for the per-shape table")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        HIDDEN, HEADS, KV, HD, MLP, VOCAB, LAYERS = (TINY[k] for k in ("HIDDEN", "HEADS", "KV", "HD", "MLP", "VOCAB", "LAYERS"))
    interpret = jax.default_backend() != "gpu"
    dtype = jnp.bfloat16
    results: dict = {"device": jax.devices()[0].device_kind, "shapes": [], "steps": []}
    print(f"device {results['device']}, interpret={interpret}", flush=True)
    key = jax.random.key(0)
    row_counts = [int(r) for r in args.rows.split(",") if r]

    # -- per shape: correctness, XLA, the kernel's tile sweep --------------------------------------
    shapes = {  # name: (K, N, prologue add + norm, swiglu)
        "qkv": (HIDDEN, (HEADS + 2 * KV) * HD, True, False), "o": (HEADS * HD, HIDDEN, False, False),
        "gate-up": (HIDDEN, 2 * MLP, True, True), "down": (MLP, HIDDEN, False, False),
    }
    best: dict[tuple[str, str], MatmulConfig] = {}
    print(f"{'shape':>8} {'w':>3} {'rows':>4} {'MB':>6} {'xla us':>8} {'%':>4} {'kernel us':>9} {'%':>4} "
          f"{'err':>7}  best tiles", flush=True)
    for name, (k, n, prologue, swiglu) in shapes.items():
        t_sweep = time.perf_counter()
        copies = 2 if args.tiny else max(8, min(36, int(2.5e9 // (k * n * 2))))
        ws = [normal(jax.random.fold_in(key, 1000 + c), (k, n), dtype) for c in range(copies)]
        ws_nk = [jnp.asarray(w.T) for w in ws]  # the same weights, each output's K contiguous
        nbytes = k * n * 2
        nw = 1.0 + normal(jax.random.fold_in(key, 5), (k,), dtype, 0.1)
        for rows in row_counts:
            x = normal(jax.random.fold_in(key, rows), (rows, k), dtype, 1.0)
            d = normal(jax.random.fold_in(key, 100 + rows), (rows, k), dtype, 1.0) if prologue else None
            extra = dict(delta=d, norm=nw if prologue else None, eps=EPS, swiglu=swiglu)
            want = xla_role(x, ws[0], d, extra["norm"], swiglu)[0].astype(jnp.float32)

            def chain(fn):
                return lambda ws_, i: [fn(x + i.astype(dtype), w) for w in ws_]

            for layout, weights in (("kn", ws), ("nk", ws_nk)):
                w_nk = layout == "nk"
                dot = (lambda a, w: a @ w.T) if w_nk else (lambda a, w: a @ w)
                t_dot = timeit(chain(dot), weights, repeats=args.repeats, inner=args.inner) / copies
                row = {"shape": name, "layout": layout, "rows": rows, "k": k, "n": n, "bytes": nbytes,
                       "xla_dot_s": t_dot, "kernel": []}
                key_ = (name, layout)
                configs = sweep(k, n, swiglu, w_nk) if rows == row_counts[0] else [best.get(key_, MatmulConfig())]
                if args.tiny:
                    configs = configs[:2]
                variants = [(cfg, extra) for cfg in configs]
                if prologue and rows != row_counts[0]:  # what the prologue costs at this row count
                    variants.append((configs[0], dict(extra, delta=None)))
                    variants.append((configs[0], dict(extra, delta=None, norm=None)))
                for cfg, ex in variants:
                    if (time.perf_counter() - t_sweep > args.budget / len(shapes) and row["kernel"]) or not supports(
                            rows, k, n, swiglu=swiglu, compiled=not interpret, config=cfg):
                        continue
                    fn = lambda a, w, c=cfg, e=ex, t=w_nk: decode_matmul(  # noqa: E731
                        a, w, interpret=interpret, config=c, w_nk=t, **e)[0]
                    role = "add+norm" if ex["delta"] is not None else "norm" if ex["norm"] is not None else "plain"
                    try:
                        got = jax.jit(fn)(x, weights[0]).astype(jnp.float32)
                        err = (float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-9))
                               if ex is extra else 0.0)
                        t = timeit(chain(fn), weights, repeats=args.repeats, inner=args.inner) / copies
                    except Exception as e:  # noqa: BLE001
                        print(f"    {layout} {cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    row["kernel"].append({"config": dataclasses.asdict(cfg), "role": role, "s": t, "rel_err": err})
                results["shapes"].append(row)
                full = [r for r in row["kernel"] if r["role"] == row["kernel"][0]["role"]] if row["kernel"] else []
                if not full:
                    continue
                top = min(full, key=lambda r: r["s"])
                if rows == row_counts[0]:
                    best[key_] = MatmulConfig(**top["config"])
                print(f"{name:>8} {layout:>3} {rows:>4} {nbytes / 1e6:>6.1f} {t_dot * 1e6:>8.1f} "
                      f"{nbytes / t_dot / args.bandwidth:>4.0%} {top['s'] * 1e6:>9.1f} {nbytes / top['s'] / args.bandwidth:>4.0%} "
                      f"{max(r['rel_err'] for r in full):>7.1e}  {top['config']}", flush=True)
                for r in sorted(row["kernel"], key=lambda r: r["s"])[:5]:
                    print(f"{'':>14}{r['s'] * 1e6:>8.1f} us  {r['role']:<8} {r['config']}", flush=True)
        del ws, ws_nk

    # -- whole-step chains ---------------------------------------------------------------------------
    layers = []
    for i in range(LAYERS):
        ks = jax.random.split(jax.random.fold_in(key, 2000 + i), 6)
        layers.append(dict(
            qkv=normal(ks[0], (HIDDEN, (HEADS + 2 * KV) * HD), dtype), o=normal(ks[1], (HEADS * HD, HIDDEN), dtype),
            n1=1.0 + normal(ks[4], (HIDDEN,), dtype, 0.1), n2=1.0 + normal(ks[5], (HIDDEN,), dtype, 0.1)))
        layers[-1]["gate-up"] = normal(ks[2], (HIDDEN, 2 * MLP), dtype)
        layers[-1]["down"] = normal(ks[3], (MLP, HIDDEN), dtype)
    head = normal(jax.random.fold_in(key, 7), (HIDDEN, VOCAB), dtype)
    step_bytes = sum(x.size * 2 for x in jax.tree.leaves(layers)) + head.size * 2
    print(f"\n{'step chain':<28} {'rows':>4} {'ms':>7} {'% of BW':>7}", flush=True)
    for rows in row_counts:
        h = normal(jax.random.fold_in(key, 9 + rows), (rows, HIDDEN), dtype, 1.0)
        for mode in ("xla", "norm-kernel", "decode-matmul kn", "decode-matmul nk"):
            if mode.startswith("decode-matmul") and not supports(rows, HIDDEN, HIDDEN, compiled=not interpret):
                continue
            if mode.endswith("nk"):  # the same weights transposed, in place of the [K, N] ones
                for w in layers:
                    for name in shapes:
                        w[name] = jnp.asarray(w[name].T)
            try:
                t = timeit(lambda ws, hd, i, m=mode: layer_chain(h + i.astype(dtype), ws, hd, m, best), layers, head,
                           repeats=args.repeats, inner=args.inner)
            except Exception as e:  # noqa: BLE001
                print(f"{mode}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            finally:
                if mode.endswith("nk"):
                    for w in layers:
                        for name in shapes:
                            w[name] = jnp.asarray(w[name].T)
            results["steps"].append({"variant": mode, "rows": rows, "s": t, "bytes": step_bytes})
            print(f"{mode:<28} {rows:>4} {t * 1e3:>7.3f} {step_bytes / t / args.bandwidth:>7.0%}", flush=True)
    results["best"] = {"/".join(name): dataclasses.asdict(c) for name, c in best.items()}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
