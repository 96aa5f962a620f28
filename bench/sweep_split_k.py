#!/usr/bin/env python
"""Split-K of the batch-1 decode matmuls: XLA's own choice against splits written out, weights streamed from HBM.

XLA:GPU (JAX 0.11.2) picks a matmul's split-K before autotuning, from a cost model
(``SplitkRewriter``), and autotunes only the tiles of the split dot. On the H200, for one row, it
splits QKV 4 ways, the output projection 8, down 8 and gate-up not at all (read off the fusions'
output shapes here, twenty-first session). A split written out as a batched dot
(``bench_split_matmul.split_dot``: ``[S, rows, N]`` float32 partials, then a sum over S) is left
as written, so the split can be chosen per projection. One row goes in as two, so that no per-split
weight is small enough for XLA to strength-reduce the dot into a multiply and a reduction: the row
repeated (``--pad repeat``, as ``layers.single_row_partials`` does), which XLA fuses into the GEMM,
or a zero second row (``--pad zeros``, as ``layers.dense`` padded a small weight's row before the
twenty-fourth session), which is a pad kernel of its own (twenty-third session; the twenty-first
session's splits carried it).

Per shape (Qwen3-8B: QKV 4096x6144, output 4096x4096, gate-up 4096x24576, down 12288x4096; and
``o_tp2``, the output projection's shard at TP=2, 2048x4096, under XLA's strength-reduction limit):

- a chain of dots over 36 distinct weights (nothing stays in L2), each dot's input taken from the
  last one's output, as in the step;
- variants: XLA's dot (``xla``), the same with a zero second row (``xla2``) or the row repeated
  (``xla2r``), and written-out splits ``S2``, ``S4``, ... (their rows padded as ``--pad`` says);
- all variants compiled first, then timed in interleaved rounds after a warm-up
  (``time_interleaved``: timed right after its compile, one and the same kernel read 12.7-18.1 us
  across 50 compiles, twenty-first session, call 1);
- each variant's GEMM fusions read back from its optimized HLO: the output shape (the split is its
  leading dimension), the tiles XLA autotuned, and the kernels in the module;
- each variant's output checked against the first's (direction of the output vector).

``--override`` forces one tile config on every dot (``xla_gpu_override_gemm_autotuner``); it
takes effect only in a process that has not compiled the fusion before (XLA keeps one autotuning
result per fusion and process), and in JAX 0.11.2 it moves the dots off Triton.

Findings (docs/benchmarks.md, twenty-first session): no written-out split beats XLA's choice by more
than the rounds' spread, and in the engine (``sweep_decode_options.py`` ``splitk:``) none helps;
the override costs the engine's step 0.2 ms. Twenty-third session: in the engine those splits had
carried a pad kernel per projection; with the row repeated, the output projection's 8-way split
streams 0.7 us faster than XLA's (``layers.OUTPUT_PARTIALS``). In this chain the zero row's pad
fuses into the slice before it, so the two paddings time alike here.

    python bench/sweep_split_k.py --out $OUT/splitk.json       # on the GPU
    python bench/sweep_split_k.py --shapes o --override "block_m:16 block_n:64 block_k:256 split_k:1 num_stages:4 num_warps:4 num_ctas:1"
    python bench/sweep_split_k.py --tiny                       # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench_matvec import normal
from bench_split_matmul import split_dot

SHAPES = {  # name: (K, N, written-out splits to try)
    "o": (4096, 4096, (2, 8, 16)),
    "qkv": (4096, 6144, (2, 8, 16)),
    "down": (12288, 4096, (4, 8, 16)),
    "gate_up": (4096, 24576, (2, 4)),
    "o_tp2": (2048, 4096, (2, 4)),
}
WEIGHTS = 36


def triton_fusions(hlo_text: str) -> list[dict]:
    """Output shape and backend config of every Triton fusion in an optimized HLO module's text."""
    found = []
    for line in hlo_text.splitlines():
        at = line.find('"fusion_backend_config":')
        if at < 0 or "__triton" not in line:
            continue
        start = line.index("{", at)
        depth = 0
        for end in range(start, len(line)):
            depth += {"{": 1, "}": -1}.get(line[end], 0)
            if depth == 0:
                break
        config = json.loads(line[start:end + 1])
        shape = re.search(r"= (\S+) fusion\(", line)
        tiles = config.get("block_level_fusion_config") or config.get("triton_gemm_config") or {}
        found.append(dict(shape=shape.group(1) if shape else "?", kind=config.get("kind"),
                          tiles=[t.get("sizes") for t in tiles.get("output_tiles", [])] or tiles.get("block_n"),
                          stages=tiles.get("num_stages"), warps=tiles.get("num_warps")))
    return found


def kernels_per_call(hlo_text: str) -> int:
    """Fusions and custom calls in the module (the chain's loop body and its carry's sum)."""
    return len(re.findall(r"^\s*(?:ROOT )?\S+ = \S+ (?:fusion|custom-call)\(", hlo_text, re.M))


def matmul(x: jax.Array, w: jax.Array, split: int | None) -> jax.Array:
    """``x [rows, K] @ w [K, N]`` in bf16: XLA's dot (``split`` None), or the ``split`` float32
    partial products of one batched dot (``bench_split_matmul.split_dot``), summed."""
    return jnp.dot(x, w) if split is None else jnp.sum(split_dot(x, w, split), axis=0).astype(x.dtype)


def variant_fn(k: int, n: int, rows: int, split: int | None, pad: str = "zeros"):
    def chain(ws, x, i):
        h = x + i.astype(x.dtype)
        for w in ws:
            a = h if rows == 1 else jnp.concatenate([h, jnp.zeros_like(h)]) if pad == "zeros" else jnp.broadcast_to(h, (2, k))
            y = matmul(a, w, split)[:1]
            h = y[:, :k] if n >= k else jnp.tile(y, (1, k // n))
        return h

    def loop(ws, x, inner):
        def body(i, carry):
            acc, _ = carry
            h = chain(ws, x, i)
            return acc + jnp.sum(h[:, :1].astype(jnp.float32)), h
        return jax.lax.fori_loop(0, inner, body, (jnp.zeros((), jnp.float32), x))

    return loop


def run_shape(name: str, args) -> list[dict]:
    k, n, splits = SHAPES[name]
    count = WEIGHTS
    if args.tiny:
        k, n, count = k // 64, n // 64, 3
    keys = jax.random.split(jax.random.key(0), count + 1)
    ws = [normal(kk, (k, n), jnp.bfloat16) for kk in keys[:count]]
    x = normal(keys[-1], (1, k), jnp.bfloat16, scale=1.0)
    jax.block_until_ready(ws)
    variants = ([("xla", 1, None, "zeros"), ("xla2", 2, None, "zeros"), ("xla2r", 2, None, "repeat")]
                + [(f"S{s}", 2, s, args.pad) for s in splits])
    compiled = {}
    rows = {}
    options = {"xla_gpu_override_gemm_autotuner": args.override} if args.override else None
    for label, r, split, pad in variants:
        fn = jax.jit(variant_fn(k, n, r, split, pad), static_argnums=2, compiler_options=options)
        t0 = time.perf_counter()
        exe = fn.lower(ws, x, args.inner).compile()
        compile_s = round(time.perf_counter() - t0, 2)
        text = exe.as_text()
        compiled[label] = exe
        _, out = exe(ws, x)
        out = out.astype(jnp.float32)
        rows[label] = dict(shape=name, variant=label, compile_s=compile_s,
                           kernels=kernels_per_call(text), fusions=triton_fusions(text)[:3], out=out / jnp.linalg.norm(out))
    reference = rows[variants[0][0]]["out"]
    for row in rows.values():
        row["rel_err"] = float(jnp.linalg.norm(row.pop("out") - reference))
    calls = {label: (lambda e=exe: e(ws, x)) for label, exe in compiled.items()}
    for label, us in time_interleaved(calls, rounds=args.rounds, repeats=args.repeats, warmup=args.warmup,
                                      per_call=args.inner * count).items():
        rows[label]["us"] = us
    gb = k * n * 2 / 1e9
    for row in rows.values():
        row["median_us"] = statistics.median(row["us"])
        row["tb_s"] = gb / row["median_us"] * 1e6 / 1e3
        print(json.dumps(row), flush=True)
    return list(rows.values())


def time_interleaved(calls: dict, *, rounds: int, repeats: int, warmup: float, per_call: int = 1) -> dict:
    """Microseconds per unit (a call's time / ``per_call``) of each of the compiled ``calls``, one
    median of ``repeats`` per round, the variants interleaved within each round, after ``warmup``
    seconds of running them all (a GPU idle through a compile clocks down for the next short burst)."""
    until = time.perf_counter() + warmup
    while time.perf_counter() < until:
        for call in calls.values():
            jax.block_until_ready(call())
    out: dict = {label: [] for label in calls}
    for _ in range(rounds):
        for label, call in calls.items():
            jax.block_until_ready(call())
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                jax.block_until_ready(call())
                times.append((time.perf_counter() - t) / per_call)
            out[label].append(statistics.median(times) * 1e6)
    return out


def print_table(rows: list[dict]) -> None:
    print("\n| shape | variant | us per matmul (median of rounds) | rounds | TB/s | GEMM fusion: shape, tiles, stages, warps | kernels | error |")
    print("|---|---|---:|---|---:|---|---:|---:|")
    for r in rows:
        f = next((f for f in r["fusions"] if "gemm" in (f["kind"] or "")), r["fusions"][0] if r["fusions"] else {})
        fusion = f"{f.get('shape')} {f.get('tiles')} {f.get('stages')} {f.get('warps')}" if f else "-"
        print(f"| {r['shape']} | {r['variant']} | {r['median_us']:.2f} | {' '.join(f'{u:.1f}' for u in r['us'])} | "
              f"{r['tb_s']:.2f} | {fusion} | {r['kernels']} | {r['rel_err']:.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="o,qkv,down,gate_up")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of running every variant before timing")
    ap.add_argument("--pad", default="repeat", choices=["repeat", "zeros"], help="the written-out splits' second row")
    ap.add_argument("--override", default="",
                    help="a TritonGemmKey textproto forced on every GEMM (xla_gpu_override_gemm_autotuner), e.g. "
                         "'block_m:16 block_n:128 block_k:128 split_k:1 num_stages:4 num_warps:4 num_ctas:1'")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows: list[dict] = []
    for name in args.shapes.split(","):
        rows += run_shape(name, args)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
    print_table(rows)


if __name__ == "__main__":
    main()
