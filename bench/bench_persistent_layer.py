#!/usr/bin/env python
"""The stretch of a Qwen3-8B layer between two attentions at batch 1: the engine's kernels (XLA's
GEMMs and split-K reductions, the ``add_rms_norm`` kernel, XLA's SwiGLU) against one persistent
kernel per layer (``kernels_pallas/layer_tail_gpu.py``).

36 layers of distinct random weights (nothing stays in the L2), chained as in a decode step: layer
``l + 1``'s attention output is a stand-in, the first 4096 columns of layer ``l``'s QKV, and its
residual is layer ``l``'s ``h2``. Each variant is first checked on layer 0 against a float32
reference of the model's math (unfolded norms), then timed: wall time per layer (one jit, chained
calls) and, with ``--profile``, GPU kernel time per layer off a trace (what the engine's step is
made of).

    python bench/bench_persistent_layer.py --profile /tmp/prof --out $OUT/layer.json   # on an H100/H200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_engine import kernel_time  # noqa: E402
from bench_matvec import normal, timeit  # noqa: E402
from kernels_pallas.rms_norm_gpu import add_rms_norm  # noqa: E402
from kernels_pallas.layer_tail_gpu import LayerConfig, fold_norm, interleave_gate_up, layer_tail, supports  # noqa: E402
from matvec_mgpu import pad_rows  # noqa: E402

HIDDEN, INTERMEDIATE, QKV_COLS, EPS = 4096, 12288, 6144, 1e-6  # Qwen3-8B
# (label, config): the default, and ring / tile variations.
VARIANTS = [("default", LayerConfig()),
            ("s7", LayerConfig(stages=7)),
            ("flags 1024", LayerConfig(flag_cols=1024)),
            ("s9", LayerConfig(stages=9)),
            ("s6", LayerConfig(stages=6))]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    """One layer's weights in both layouts: the engine's ``[K, N]`` (gate-up ``[H, I, 2]``) and the
    kernel's ``[N, K]`` with the norms folded."""

    o: jax.Array
    gate_up: jax.Array
    down: jax.Array
    qkv: jax.Array
    norm_post: jax.Array
    norm_next: jax.Array
    k_o: jax.Array
    k_gu: jax.Array
    k_d: jax.Array
    k_qkv: jax.Array


def make_layer(key, dtype) -> LayerWeights:
    ks = jax.random.split(key, 7)
    o = normal(ks[0], (HIDDEN, HIDDEN), dtype, scale=HIDDEN ** -0.5)
    gate = normal(ks[1], (HIDDEN, INTERMEDIATE), dtype, scale=HIDDEN ** -0.5)
    up = normal(ks[2], (HIDDEN, INTERMEDIATE), dtype, scale=HIDDEN ** -0.5)
    down = normal(ks[3], (INTERMEDIATE, HIDDEN), dtype, scale=INTERMEDIATE ** -0.5)
    qkv = normal(ks[4], (HIDDEN, QKV_COLS), dtype, scale=HIDDEN ** -0.5)
    norm_post = (1.0 + normal(ks[5], (HIDDEN,), jnp.float32, scale=0.1)).astype(dtype)
    norm_next = (1.0 + normal(ks[6], (HIDDEN,), jnp.float32, scale=0.1)).astype(dtype)
    fold = jax.jit(fold_norm)
    return LayerWeights(o=o, gate_up=jnp.stack([gate, up], axis=-1), down=down, qkv=qkv, norm_post=norm_post,
                        norm_next=norm_next, k_o=o.T + 0, k_gu=jax.jit(interleave_gate_up)(fold(norm_post, gate), fold(norm_post, up)),
                        k_d=down.T + 0, k_qkv=fold(norm_next, qkv).T + 0)


def model_reference(a, h, w_o, w_gate, w_up, w_d, w_qkv, norm_post, norm_next, *, eps: float):
    """The model's math for the stretch (weights ``[K, N]``, norms unfolded), float32 throughout ->
    ``h1, s, h2, qkv``."""
    f = lambda x: x.astype(jnp.float32)  # noqa: E731

    def norm(x, w):
        return f(w) * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)

    h1 = f(h) + f(a[:, :h.shape[1]]) @ f(w_o)
    x = norm(h1, norm_post)
    s = jax.nn.silu(x @ f(w_gate)) * (x @ f(w_up))
    h2 = h1 + s @ f(w_d)
    return h1, s, h2, norm(h2, norm_next) @ f(w_qkv)


def engine_tail(a, h, w: LayerWeights):
    """The engine's ops for the stretch (``layers.py``: ``dense``, ``add_rms_norm``, SwiGLU)."""
    o = a[:, :HIDDEN] @ w.o
    h1, x = add_rms_norm(h, o, w.norm_post, eps=EPS)
    gu = jnp.einsum("rk,kit->rit", x, w.gate_up)
    s = jax.nn.silu(gu[..., 0]) * gu[..., 1]
    h2, x2 = add_rms_norm(h1, s @ w.down, w.norm_next, eps=EPS)
    return h1, s, h2, x2 @ w.qkv


def kernel_tail(a, h, w: LayerWeights, config: LayerConfig):
    return layer_tail(a, h, w.k_o, w.k_gu, w.k_d, w.k_qkv, eps=EPS, config=config)


def errors(got, want, rows: int) -> list[float]:
    """Per output, the largest error over the real rows relative to the largest reference entry."""
    return [float(jnp.max(jnp.abs(g[:rows].astype(jnp.float32) - r[:rows])) / jnp.max(jnp.abs(r[:rows])))
            for g, r in zip(got, want)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--variants", default=None, help="indices into VARIANTS (default: all)")
    ap.add_argument("--rows", type=int, default=1, help="1 (a decode token) or up to 16 (a verify block)")
    ap.add_argument("--no-wall", action="store_true", help="only the kernel time off the trace (fewer compiles)")
    ap.add_argument("--profile", default=None, metavar="DIR")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype, key = jnp.bfloat16, jax.random.key(0)
    layers = [make_layer(jax.random.fold_in(key, i), dtype) for i in range(args.layers)]
    a0 = normal(jax.random.fold_in(key, 1000), (args.rows, QKV_COLS), dtype, scale=1.0)
    h0 = normal(jax.random.fold_in(key, 1001), (args.rows, HIDDEN), dtype, scale=1.0)
    bytes_per_layer = 2 * (HIDDEN * HIDDEN + 2 * HIDDEN * INTERMEDIATE + INTERMEDIATE * HIDDEN + HIDDEN * QKV_COLS)
    results = {"device": jax.devices()[0].device_kind, "layers": args.layers, "rows": []}
    print(f"device {results['device']}, {args.layers} layers, {args.rows} rows, {bytes_per_layer / 1e6:.1f} MB per layer",
          flush=True)

    w0 = layers[0]
    want = model_reference(a0, h0, w0.o, w0.gate_up[..., 0], w0.gate_up[..., 1], w0.down, w0.qkv,
                           w0.norm_post, w0.norm_next, eps=EPS)

    def chain(tail, a, h, ws, i):
        a = a + i.astype(a.dtype)  # a fresh input per timed call
        for w in ws:
            _, _, h, qkv = tail(a, h, w)
            a = qkv
        return qkv, h

    def report(label, fn, rows_in, error):
        seconds = float("nan") if args.no_wall else timeit(
            lambda ws, i: chain(fn, *rows_in, ws, i), layers, repeats=args.repeats, inner=args.inner)
        row = {"variant": label, "us_per_layer": seconds * 1e6 / args.layers, "error": error}
        line = f"{label:<28} wall {row['us_per_layer']:8.2f} us/layer"
        if args.profile:
            us, names = kernel_time(
                lambda f=jax.jit(lambda ws: chain(fn, *rows_in, ws, jnp.zeros((), jnp.int32))): jax.block_until_ready(f(layers)),
                f"{args.profile}/{len(results['rows'])}", args.layers)
            row["kernel_us_per_layer"], row["kernels"] = us, names
            line += f"  kernels {us:8.2f} us/layer ({bytes_per_layer / us / 1e6:.2f} TB/s)"
        results["rows"].append(row)
        print(line + f"  errors {' '.join(f'{e:.1e}' for e in error)}", flush=True)
        if args.profile:
            print(f"{'':<28} {row['kernels']}", flush=True)

    got = jax.jit(engine_tail)(a0, h0, w0)
    report("engine (XLA + add_rms_norm)", engine_tail, (a0, h0), errors(got, want, args.rows))
    chosen = range(len(VARIANTS)) if args.variants is None else [int(v) for v in args.variants.split(",")]
    a8, h8 = pad_rows(a0), pad_rows(h0)
    for index in chosen:
        label, cfg = VARIANTS[index]
        if not supports(a8.shape[0], HIDDEN, INTERMEDIATE, QKV_COLS, cfg):
            print(f"{label:<28} unsupported", flush=True)
            continue
        try:
            fn = lambda a, h, w, cfg=cfg: kernel_tail(a, h, w, cfg)  # noqa: E731
            got = jax.jit(fn)(a8, h8, w0)
            error = errors(got, want, args.rows)
            again = jax.jit(fn)(a8, h8, w0)  # the counters reset: a second call gives the same bits
            same = all(bool(jnp.array_equal(x, y)) for x, y in zip(got, again))
            if not (max(error) < 3e-2 and same):
                print(f"{label:<28} WRONG: errors {error}, repeatable {same}", flush=True)
                continue
            report(f"persistent {label}", fn, (a8, h8), error)
        except Exception as e:  # one failing variant must not lose the others' numbers
            print(f"{label:<28} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
