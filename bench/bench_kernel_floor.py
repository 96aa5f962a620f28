#!/usr/bin/env python
"""The floor of a small kernel at batch 1: what one launch of a tiny XLA fusion, a tiny Pallas
(Triton) kernel and the engine's ``add_rms_norm`` cost when they run back to back, as they do
between a decode layer's matmuls.

Each variant is a chain of ``--steps`` dependent ops on a ``[rows, 4096]`` bf16 vector in one jit
(``lax.optimization_barrier`` between the XLA steps, so each is its own kernel). Reported per step:
the wall time of the chain over its steps (median of ``--repeats`` synchronised calls: launch gaps
included) and the median GPU duration of its kernel (profiler trace: no gaps).

    python3 bench/bench_kernel_floor.py --profile /tmp/floor          # on the GPU
    python bench/bench_kernel_floor.py --steps 4 --repeats 2           # CPU smoke test (interpret mode)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

import kernels_pallas  # noqa: E402
from bench_engine import gpu_span_durations  # noqa: E402
from dflash_jax.layers import rms_norm  # noqa: E402
from kernels_pallas._flash import triton_params  # noqa: E402

EPS = 1e-6


def _affine_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 0.5 + 1.0


def pallas_affine(x: jax.Array, *, num_warps: int) -> jax.Array:
    """``x * 0.5 + 1``, one program per row: the least a Pallas kernel can do."""
    row = pl.BlockSpec((None, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(_affine_kernel, grid=(x.shape[0],), in_specs=[row], out_specs=row,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          compiler_params=triton_params(num_warps, 1), interpret=jax.default_backend() != "gpu",
                          name="floor_affine")(x)


def chains(steps: int):
    """Variant name -> ``f(x, d, w) -> x`` running ``steps`` dependent ops."""
    barrier = jax.lax.optimization_barrier

    def xla_affine(x, d, w):
        for _ in range(steps):
            x = barrier(x * 0.5 + 1.0)
        return x

    def xla_rms_norm(x, d, w):
        for _ in range(steps):
            x = barrier(rms_norm(x + d, w, EPS))
        return x

    def pallas(num_warps):
        def run(x, d, w):
            for _ in range(steps):
                x = pallas_affine(x, num_warps=num_warps)
            return x
        return run

    def add_rms_norm(x, d, w):
        for _ in range(steps):
            d, x = kernels_pallas.add_rms_norm(x, d, w, eps=EPS)
        return x

    return {"xla affine": xla_affine, "xla add + rms_norm": xla_rms_norm, "pallas affine, 4 warps": pallas(4),
            "pallas affine, 1 warp": pallas(1), "pallas add_rms_norm": add_rms_norm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--profile", default=None, help="also read the kernels' GPU durations off a trace in this dir")
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    print("rows | variant | wall us per step | kernel us (median) | kernels per step")
    for rows in (int(r) for r in args.rows.split(",")):
        keys = jax.random.split(jax.random.key(rows), 3)
        x, d = (jax.random.normal(k, (rows, 4096), jnp.bfloat16) for k in keys[:2])
        w = (1 + 0.1 * jax.random.normal(keys[2], (4096,))).astype(jnp.bfloat16)
        for name, chain in chains(args.steps).items():
            fn = jax.jit(chain)
            jax.block_until_ready(fn(x, d, w))
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, d, w))
                times.append(time.perf_counter() - t0)
            wall = statistics.median(times) / args.steps * 1e6
            kernel, count = float("nan"), float("nan")
            if args.profile:
                trace = str(Path(args.profile) / f"{rows}_{name}".replace(" ", "_").replace(",", ""))
                durs = gpu_span_durations(lambda: jax.block_until_ready(fn(x, d, w)), trace, calls=2) or {}
                main_kernels = {n: v for n, v in durs.items() if len(v) >= args.steps}
                if main_kernels:
                    spans = max(main_kernels.values(), key=len)
                    kernel, count = statistics.median(spans), sum(map(len, main_kernels.values())) / 2 / args.steps
            print(f"{rows:4d} | {name:24s} | {wall:7.2f} | {kernel:6.2f} | {count:4.1f}", flush=True)


if __name__ == "__main__":
    main()
