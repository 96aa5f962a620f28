#!/usr/bin/env python
"""A chain of 36 dependent decode matmuls: one persistent kernel (``persistent_chain.py``) against
XLA's one GEMM (and split-K reduction) per matmul, to measure the per-matmul fixed cost that kernel
boundaries add.

Per ``D`` (4096: the output projection's 33.6 MB, 64 programs; 8192: 134 MB, 128 programs), bf16,
36 distinct ``[D, D]`` weights (nothing stays in the 60 MB L2), 1 row (a decode token) and 16 (a
verify block):
- ``xla``: ``x = x @ w[l]`` 36 times, as the engine's decode step runs its matmuls (also with the
  engine's decode-jit options: the loop as one CUDA graph);
- ``persistent``: the whole chain in one kernel; ``independent``: every matmul on ``x[0]``, no
  barrier, the kernel's streaming ceiling.
Each persistent variant is first checked link by link against a float32 dot of its own input.

The wall column carries the harness's own cost per timed call (~130 us on the H200, a few us per
matmul, the same for both); ``--profile`` reads each chain's GPU kernel time off a trace, which is
what the engine's step is made of (its kernels run back to back), so compare those.

    python bench/bench_persistent_chain.py --profile /tmp/prof --out $OUT/chain.json   # on an H100/H200
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

from bench_engine import kernel_time  # noqa: E402
from bench_matvec import normal, timeit  # noqa: E402
from dflash_jax.engine import _decode_compiler_options  # noqa: E402
from persistent_chain import ChainConfig, padded_rows, persistent_chain, supports  # noqa: E402

# (config, rows) per D: the measured best tiles (docs/benchmarks.md, eleventh session), one row and
# a verify block, and the streaming ceiling (no barrier).
CONFIGS = {4096: [(ChainConfig(64, 256, 6), 1), (ChainConfig(64, 256, 5), 16), (ChainConfig(64, 256, 6, dependent=False), 1)],
           8192: [(ChainConfig(64, 256, 6), 1), (ChainConfig(64, 256, 5), 16), (ChainConfig(64, 128, 12), 1),
                  (ChainConfig(64, 256, 6, dependent=False), 1)]}


def link_errors(y: jax.Array, x0: jax.Array, w: jax.Array, rows: int, dependent: bool) -> float:
    """Largest error of ``y[l] = x[l] @ w[l]`` over the links and the real rows, each against a
    float32 dot of the kernel's own input to it (``x[0]`` throughout if not ``dependent``), relative
    to the largest output entry."""
    y = y[:, :rows]
    x = jnp.concatenate([x0[None, :rows], y[:-1]]) if dependent else jnp.broadcast_to(x0[:rows], y.shape)
    want = jax.lax.map(lambda xw: xw[0].astype(jnp.float32) @ xw[1].astype(jnp.float32), (x, w))  # one weight at a time
    return float(jnp.max(jnp.abs(y.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--dims", default="4096,8192")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also read each chain's GPU kernel time per matmul off a trace (no launch gaps)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype, key, results = jnp.bfloat16, jax.random.key(0), {"device": jax.devices()[0].device_kind, "rows": []}
    print(f"device {results['device']}, {args.layers} dependent matmuls per timing", flush=True)
    print(f"{'D':>6} {'variant':<44} {'us/matmul':>10} {'TB/s':>6} {'error':>8}", flush=True)
    for d in [int(v) for v in args.dims.split(",") if v]:
        # Scaled so that the chain keeps unit-size activations over its 36 links.
        w = normal(jax.random.fold_in(key, d), (args.layers, d, d), dtype, scale=d ** -0.5)
        x16 = normal(jax.random.fold_in(key, 1), (16, d), dtype, scale=1.0)
        x = x16[:1]
        bytes_per_link = d * d * jnp.dtype(dtype).itemsize

        def report(label, seconds, error=float("nan"), profiled=None):
            row = {"d": d, "variant": label, "us_per_matmul": seconds * 1e6,
                   "tb_per_s": bytes_per_link / seconds / 1e12, "error": error}
            results["rows"].append(row)
            print(f"{d:>6} {label:<44} {row['us_per_matmul']:>10.2f} {row['tb_per_s']:>6.2f} {error:>8.1e}", flush=True)
            if args.profile and profiled is not None:
                fn, fn_args = profiled
                us, names = kernel_time(lambda f=jax.jit(fn): jax.block_until_ready(f(*fn_args)),
                                        f"{args.profile}/{d}_{len(results['rows'])}", args.layers)
                row["kernel_us_per_matmul"], row["kernels"] = us, names
                print(f"{'':>6} {'  kernel time off the trace':<44} {us:>10.2f} {bytes_per_link / us / 1e6:>6.2f}   {names}",
                      flush=True)

        def xla_chain(ws, i, x=x):
            h = x + i.astype(dtype)
            for w_l in ws:
                h = h @ w_l
            return h

        # Separate arrays, as the engine's weights are: slices of the stacked w would be copied first.
        ws = [w[layer] + 0 for layer in range(args.layers)]
        report(f"xla ({args.layers} dots)", timeit(xla_chain, ws, repeats=args.repeats, inner=args.inner) / args.layers,
               profiled=(lambda ws_: xla_chain(ws_, jnp.zeros((), jnp.int32)), (ws,)))
        report(f"xla ({args.layers} dots) rows 16", timeit(lambda ws_, i: xla_chain(ws_, i, x16), ws, repeats=args.repeats,
                                                           inner=args.inner) / args.layers,
               profiled=(lambda ws_: xla_chain(ws_, jnp.zeros((), jnp.int32), x16), (ws,)))
        # The engine's decode jit keeps its loop on the device as one CUDA graph (docs/design.md);
        # without that the host launches every kernel of the loop, which the persistent kernel escapes.
        report(f"xla ({args.layers} dots), engine's graph options",
               timeit(xla_chain, ws, repeats=args.repeats, inner=args.inner,
                      compiler_options=_decode_compiler_options()) / args.layers)
        del ws
        for cfg, rows in CONFIGS.get(d, [(ChainConfig(), 1)]):
            label = (f"persistent n{cfg.block_n} k{cfg.block_k} s{cfg.stages} rows {rows}"
                     + ("" if cfg.dependent else " independent"))
            if not supports(args.layers, d, rows, cfg):
                print(f"{d:>6} {label:<44} unsupported", flush=True)
                continue
            x0 = jnp.pad(x16[:rows], ((0, padded_rows(rows) - rows), (0, 0)))
            try:
                y = jax.jit(lambda a, b, c=cfg: persistent_chain(a, b, c))(x0, w)
                error = link_errors(y, x0, w, rows, cfg.dependent)
                if not error < 2e-2:
                    print(f"{d:>6} {label:<44} WRONG (error {error:.1e})", flush=True)
                    continue
                seconds = timeit(lambda w_, i, c=cfg, a=x0: persistent_chain(a + i.astype(dtype), w_, c)[:, 0],
                                 w, repeats=args.repeats, inner=args.inner) / args.layers
                report(label, seconds, error, profiled=(lambda a, b, c=cfg: persistent_chain(a, b, c), (x0, w)))
            except Exception as e:  # one failing variant must not lose the others' numbers
                print(f"{d:>6} {label:<44} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        del w
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
