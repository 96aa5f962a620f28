#!/usr/bin/env python
"""Decode matmuls on TMA + tensor cores (``matvec_mgpu.py``, Pallas Mosaic GPU) against XLA's dot.

Per Qwen3-8B decode matmul (fused QKV 4096x6144, output 4096x4096, fused gate-up 4096x24576, down
12288x4096) and row count (1: a decode token, padded to 8 for the kernel; 16: a verify block):

1. XLA's dot ``x @ w`` (its split-K reduction kernel included), the baseline;
2. the kernel's float32 partials alone over a sweep of tiles, stages and K splits (each variant
   first checked against a float32 reference on the device);
3. the best variant with the pad, the sum over splits and the transpose done by XLA (``matvec``),
   what it would cost without a consumer kernel that folds them in.

36 distinct weights per timing (up to 2.5 GB), so nothing stays in the 60 MB L2. The timed chains
include the harness's small per-call kernels (the input add, the output sums); ``--profile DIR``
also reads each chain's kernels off a profiler trace (median microseconds per kernel name), so the
matmul kernels can be compared without them.

    python bench/bench_matvec_mgpu.py --out $OUT/matvec_mgpu.json       # on an H100/H200: the sweep
    python bench/bench_matvec_mgpu.py --no-sweep --profile /tmp/prof    # the best tiles of the sweep
    python bench/bench_matvec_mgpu.py --chain                           # dependent chains, PDL prefetch
    python bench/bench_matvec_mgpu.py --back-to-back                    # the kernel after itself, under PDL?
    python bench/bench_matvec_mgpu.py --norm-chain                      # after add_rms_norm, which signals

``--chain`` times 36 dependent matmuls of one shape (each input the RMS-normalised output of the
last, as in a decode step) three ways: XLA's dot, the kernel, and the kernel with
``MgpuConfig.prefetch`` (its first weight copies issued before ``griddepcontrol.wait``). The last two
differ only if the kernel is launched under programmatic dependent launch and can start streaming
weights while the previous kernel still runs.
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

from bench_engine import kernel_time  # noqa: E402
from bench_matvec import normal, timeit  # noqa: E402
from matvec_mgpu import MgpuConfig, matvec, matvec_partials, pad_rows, supports  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate-up": (4096, 24576), "down": (12288, 4096)}
# The fastest tiles per shape of the sweep on the H200 (docs/benchmarks.md, tenth session).
BEST = {"qkv": MgpuConfig(64, 128, 4, 4), "o": MgpuConfig(64, 128, 4, 2),
        "gate-up": MgpuConfig(64, 256, 4, 1), "down": MgpuConfig(64, 128, 6, 1)}


def rel_error(x_padded: jax.Array, w: jax.Array, want: jax.Array, config: MgpuConfig) -> float:
    """The kernel's largest error against ``want [rows, N]`` (float32), relative to its largest entry."""
    got = jax.jit(lambda a, b: matvec_partials(a, b, config))(x_padded, w).sum(0).T[:want.shape[0]]
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def sweep(rows: int, k: int, n: int) -> list[MgpuConfig]:
    out = [MgpuConfig()]
    for block_n in (64, 128):
        for block_k in (128, 256, 64):
            for stages in (4, 6, 3):
                for splits in (1, 2, 4):
                    c = MgpuConfig(block_n=block_n, block_k=block_k, stages=stages, splits=splits)
                    programs = n // block_n * splits
                    if c not in out and supports(rows, k, n, c) and programs <= 132 * 6:
                        out.append(c)
    return out


def next_input(y: jax.Array, k: int) -> jax.Array:
    """The next matmul's rows from this one's ``[rows, N]`` output: its first ``k`` columns,
    RMS-normalised. Every column feeds it (the row sum), so XLA cannot narrow the dot to ``k``."""
    y = y.astype(jnp.float32)
    y = y[:, :k] + 1e-9 * jnp.sum(y, axis=-1, keepdims=True)
    return (y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)


def chains(args) -> list[dict]:
    """Per shape, 36 dependent matmuls: XLA's dot, the kernel, the kernel with the PDL prefetch."""
    dtype, key, out = jnp.bfloat16, jax.random.key(1), []
    print(f"\n{'chain of 36':<14} {'XLA us/layer':>12} {'kernel':>8} {'prefetch':>9}   (errors of one call)", flush=True)
    for name in [s for s in args.shapes.split(",") if s in ("qkv", "o", "gate-up")]:  # K = 4096: x fits in SMEM
        k, n = SHAPES[name]
        ws = [normal(jax.random.fold_in(key, c), (k, n), dtype) for c in range(36)]
        h = normal(jax.random.fold_in(key, 99), (1, k), dtype, 1.0)
        h8 = pad_rows(h)
        plain = BEST[name]
        variants = {"kernel": plain, "prefetch": dataclasses.replace(plain, prefetch=True)}
        want = jnp.dot(h.astype(jnp.float32), ws[0].astype(jnp.float32))
        errs = {label: rel_error(h8, ws[0], want, cfg) for label, cfg in variants.items()}

        def xla_chain(ws_, x, i):
            x = x + i.astype(dtype)
            for w in ws_:
                x = next_input(x @ w, k)
            return x

        def kernel_chain(ws_, x, i, cfg):
            x = x + i.astype(dtype)
            for w in ws_:
                x = next_input(matvec_partials(x, w, cfg).sum(0).T, k)
            return x

        row = {"shape": name, "errors": errs,
               "xla_s": timeit(lambda ws_, i: xla_chain(ws_, h, i), ws, repeats=args.repeats, inner=args.inner) / 36}
        for label, cfg in variants.items():
            row[f"{label}_s"] = timeit(lambda ws_, i, c=cfg: kernel_chain(ws_, h8, i, c), ws,
                                       repeats=args.repeats, inner=args.inner) / 36
        out.append(row)
        print(f"{name:<14} {row['xla_s'] * 1e6:>12.1f} {row['kernel_s'] * 1e6:>8.1f} {row['prefetch_s'] * 1e6:>9.1f}"
              f"   ({errs['kernel']:.1e}, {errs['prefetch']:.1e})", flush=True)
        del ws
    return out


def norm_chains(args) -> list[dict]:
    """Per shape, 36 dependent links of ``add_rms_norm`` (our Triton kernel, which signals
    ``launch_dependents`` once each program has read its inputs) and a matmul: XLA's dot, the kernel,
    the kernel with the PDL prefetch. The tenth session's chain put an XLA norm before the kernel,
    and XLA's kernels never signal; here the kernel launched under PDL may start its weight copies
    while the norm still runs. Interleaved rounds, as in ``sweep_split_k.py``."""
    import kernels_pallas
    from sweep_split_k import time_interleaved

    dtype, key, out = jnp.bfloat16, jax.random.key(3), []
    for name in [s for s in args.shapes.split(",") if s in ("qkv", "o", "gate-up")]:  # K = 4096: x fits in SMEM
        k, n = SHAPES[name]
        ws = [normal(jax.random.fold_in(key, c), (k, n), dtype) for c in range(36)]
        gain = normal(jax.random.fold_in(key, 98), (k,), dtype, 1.0)
        h = normal(jax.random.fold_in(key, 99), (1, k), dtype, 1.0)
        plain = BEST[name]

        def link_xla(h, delta, w):
            h, x = kernels_pallas.add_rms_norm(h, delta, gain, eps=1e-6)
            return h, (x @ w)[:, :k]

        def link_kernel(h, delta, w, cfg):  # rows padded to 8 (the WGMMA's least N); the pad stays zero
            h, x = kernels_pallas.add_rms_norm(h, delta, gain, eps=1e-6)
            return h, matvec_partials(x, w, cfg).sum(0).T[:, :k].astype(dtype)

        def chain(ws_, h, link):
            delta = None
            for w in ws_:
                h, delta = link(h, delta, w)
            return h + delta

        variants = {"xla": (h, link_xla),
                    "kernel": (pad_rows(h), functools.partial(link_kernel, cfg=plain)),
                    "prefetch": (pad_rows(h), functools.partial(link_kernel, cfg=dataclasses.replace(plain, prefetch=True)))}
        compiled, results = {}, {}
        for label, (h0, link) in variants.items():
            exe = jax.jit(lambda ws_, h_, link=link: chain(ws_, h_, link)).lower(ws, h0).compile()
            compiled[label] = functools.partial(exe, ws, h0)
            results[label] = compiled[label]()[:1].astype(jnp.float32)
        errs = {label: float(jnp.linalg.norm(r - results["xla"]) / jnp.linalg.norm(results["xla"]))
                for label, r in results.items()}
        us = time_interleaved(compiled, rounds=args.rounds, repeats=args.repeats, warmup=1.0, per_call=36)
        row = {"shape": name, "errors": errs, "us_per_link": us}
        out.append(row)
        print(f"{name:<8} " + "  ".join(f"{label} {statistics.median(v):6.2f} us ({' '.join(f'{u:.1f}' for u in v)})"
                                        for label, v in us.items()) + f"   errors {errs}", flush=True)
        del ws
    return out


def back_to_back(args) -> list[dict]:
    """Per shape, 36 kernels back to back with nothing between them (each ordered after the last by
    an operand it does not read): plain, signalling ``launch_dependents`` first, and signalling with
    the PDL prefetch. If the custom calls were launched under programmatic dependent launch, the
    last two would overlap each kernel's start with its predecessor's tail."""
    dtype, key, out = jnp.bfloat16, jax.random.key(2), []
    print(f"\n{'36 back to back':<16} {'plain us':>9} {'signal':>8} {'signal+prefetch':>16}", flush=True)
    for name in [s for s in args.shapes.split(",") if s in ("qkv", "o", "gate-up")]:
        k, n = SHAPES[name]
        ws = [normal(jax.random.fold_in(key, c), (k, n), dtype) for c in range(36)]
        h8 = pad_rows(normal(jax.random.fold_in(key, 99), (1, k), dtype, 1.0))
        plain = BEST[name]
        variants = {"plain": plain, "signal": dataclasses.replace(plain, signal=True),
                    "signal+prefetch": dataclasses.replace(plain, signal=True, prefetch=True)}

        def chain(ws_, i, cfg):
            y = matvec_partials(h8 + i.astype(dtype), ws_[0], cfg)
            for w in ws_[1:]:
                y = matvec_partials(h8, w, cfg, after=y)
            return y

        row = {"shape": name}
        for label, cfg in variants.items():
            row[f"{label}_s"] = timeit(lambda ws_, i, c=cfg: chain(ws_, i, c), ws, repeats=args.repeats,
                                       inner=args.inner) / 36
        out.append(row)
        print(f"{name:<16} {row['plain_s'] * 1e6:>9.2f} {row['signal_s'] * 1e6:>8.2f} "
              f"{row['signal+prefetch_s'] * 1e6:>16.2f}", flush=True)
        del ws
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the %% column")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the sweeps (all shapes)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-sweep", action="store_true", help="only the tiles of BEST")
    ap.add_argument("--profile", default=None, metavar="DIR", help="also list each chain's kernels off a trace")
    ap.add_argument("--chain", action="store_true", help="only the dependent chains (XLA, kernel, PDL prefetch)")
    ap.add_argument("--back-to-back", action="store_true",
                    help="only the kernels back to back (plain, launch_dependents, with the PDL prefetch)")
    ap.add_argument("--norm-chain", action="store_true",
                    help="only the chains of add_rms_norm and a matmul (XLA, kernel, PDL prefetch), interleaved")
    ap.add_argument("--rounds", type=int, default=5, help="--norm-chain: interleaved rounds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = jnp.bfloat16
    key = jax.random.key(0)
    shapes = [s for s in args.shapes.split(",") if s]
    results = {"device": jax.devices()[0].device_kind, "rows": []}
    print(f"device {results['device']}", flush=True)
    if args.back_to_back:
        results["back_to_back"] = back_to_back(args)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        return
    if args.norm_chain:
        results["norm_chains"] = norm_chains(args)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        return
    if args.chain:
        results["chains"] = chains(args)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        return
    print(f"{'shape':>8} {'rows':>4} {'MB':>6} {'xla us':>7} {'%':>4} {'kernel us':>9} {'%':>4} {'+XLA glue us':>12} "
          f"{'err':>7}  best", flush=True)
    for name in shapes:
        k, n = SHAPES[name]
        nbytes = k * n * 2
        copies = max(8, min(36, int(2.5e9 // nbytes)))
        ws = [normal(jax.random.fold_in(key, 1000 + c), (k, n), dtype) for c in range(copies)]
        best_r8: list[MgpuConfig] = []
        for rows in (1, 16):
            x = normal(jax.random.fold_in(key, rows), (rows, k), dtype, 1.0)
            xp = pad_rows(x)
            want = jnp.dot(x.astype(jnp.float32), ws[0].astype(jnp.float32))
            t_xla = timeit(lambda ws_, i: [(x + i.astype(dtype)) @ w for w in ws_], ws,
                           repeats=args.repeats, inner=args.inner) / copies
            configs = [BEST[name]] if args.no_sweep else sweep(xp.shape[0], k, n) if rows == 1 else best_r8
            row = {"shape": name, "rows": rows, "k": k, "n": n, "bytes": nbytes, "xla_s": t_xla, "kernel": []}
            t0 = time.perf_counter()
            for cfg in configs:
                if time.perf_counter() - t0 > args.budget / len(shapes) / 2 and row["kernel"]:
                    break
                try:
                    err = rel_error(xp, ws[0], want, cfg)
                    t = timeit(lambda ws_, i, c=cfg: [matvec_partials(xp + i.astype(dtype), w, c) for w in ws_], ws,
                               repeats=args.repeats, inner=args.inner) / copies
                except Exception as e:  # noqa: BLE001
                    print(f"    {cfg}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                row["kernel"].append({"config": dataclasses.asdict(cfg), "s": t, "rel_err": err})
            if not row["kernel"]:
                results["rows"].append(row)
                print(f"{name:>8} {rows:>4} {nbytes / 1e6:>6.1f} {t_xla * 1e6:>7.1f}  (no kernel variant ran)", flush=True)
                continue
            ranked = sorted(row["kernel"], key=lambda r: r["s"])
            top = ranked[0]
            cfg = MgpuConfig(**top["config"])
            if rows == 1:
                best_r8 = [MgpuConfig(**r["config"]) for r in ranked[:3]]
            t_glue = timeit(lambda ws_, i: [matvec(x + i.astype(dtype), w, cfg) for w in ws_], ws,
                            repeats=args.repeats, inner=args.inner) / copies
            row["with_glue_s"] = t_glue
            results["rows"].append(row)
            bad = max(r["rel_err"] for r in row["kernel"])
            print(f"{name:>8} {rows:>4} {nbytes / 1e6:>6.1f} {t_xla * 1e6:>7.1f} {nbytes / t_xla / args.bandwidth:>4.0%} "
                  f"{top['s'] * 1e6:>9.1f} {nbytes / top['s'] / args.bandwidth:>4.0%} {t_glue * 1e6:>12.1f} "
                  f"{bad:>7.1e}  {cfg}", flush=True)
            for r in ranked[1:6]:
                print(f"{'':>30}{r['s'] * 1e6:>9.1f} us  {r['config']}", flush=True)
            if args.profile:
                profiled = {"xla": lambda ws_: [x @ w for w in ws_],
                            "kernel": lambda ws_: [matvec_partials(xp, w, cfg) for w in ws_],
                            "kernel+glue": lambda ws_: [matvec(x, w, cfg) for w in ws_]}
                row["profile"] = {}
                for chain_name, chain in profiled.items():
                    per_matmul, listing = kernel_time(lambda f=jax.jit(chain), a=ws: jax.block_until_ready(f(a)),
                                                      f"{args.profile}/{name}_{rows}_{chain_name}", copies)
                    row["profile"][chain_name] = {"us_per_matmul": per_matmul, "kernels": listing}
                    print(f"{'':>10}trace {chain_name:<12} {per_matmul:6.1f} us per matmul: {listing}", flush=True)
        del ws
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
