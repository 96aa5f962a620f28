#!/usr/bin/env python
"""Batch-1 decode matmuls against the HBM roofline: XLA vs the Pallas skinny matmul, split vs fused.

A batch-1 target step is ~7 weight-streaming matmuls per layer; this script isolates them.

1. Read ceiling: one jit that reads every weight once (a column sum; a poor ceiling: XLA's
   column reductions do not stream at full bandwidth, kept only as a sanity line).
2. Per shape (Qwen3-8B: q/o 4096x4096, k/v 4096x1024, fused qkv 4096x6144, gate/up 4096x12288,
   fused gate-up 4096x24576, down 12288x4096, head 4096x151936): XLA's dot at M=1 and M=4 and a
   sweep of the skinny-matmul kernel's tilings (below) at M=1, over 36 distinct weights (nothing stays
   in the 60 MB L2). Median of repeats of a jitted loop, after warm-up.
3. The layer chain of a whole step (36 layers + LM head, no attention): the model's per-head
   einsums, 2-D dots with fused QKV / gate-up, and the Pallas kernel on each, at M=1 (and XLA at M=4).

    python bench/bench_matvec.py --out $OUT/matvec.json            # on the GPU
    python bench/bench_matvec.py --tiny                             # CPU smoke test (interpret)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# -- the candidate kernel: a skinny matmul for decode, Pallas with the Triton lowering ------------
# Streams ``w [K, N]`` in ``[block_k, block_n]`` tiles through Triton's software pipeline, one
# program per (column block, K split); the rows of ``x`` are padded to 16, the smallest MMA tile.
# Measured here against XLA's dots; not used by the engine (see docs/benchmarks.md).

ROWS = 16  # the MMA's smallest M


@dataclasses.dataclass(frozen=True)
class MatvecConfig:
    block_n: int = 64
    block_k: int = 256
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 4


def reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` in x.dtype, float32 accumulation."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, k_per_split: int):
    """x_ref ``[16, K]``, w_ref ``[K, block_n]`` (strided view), o_ref ``[16, block_n]``."""
    s = pl.program_id(1)
    k0 = s * k_per_split

    def body(i, acc):
        ks = pl.multiple_of(k0 + i * block_k, block_k)
        xs = x_ref[:, pl.ds(ks, block_k)]
        ws = w_ref[pl.ds(ks, block_k), :]
        return acc + lax.dot_general(xs, ws, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    acc = lax.fori_loop(0, k_per_split // block_k, body, acc)
    o_ref[...] = acc.astype(o_ref.dtype)


def matvec(x: jax.Array, w: jax.Array, *, config: MatvecConfig | None = None, interpret: bool = False) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` (M <= 16) in x.dtype; K and N multiples of the tiles."""
    cfg = config or MatvecConfig()
    m, k = x.shape
    k2, n = w.shape
    if k != k2 or m > ROWS:
        raise ValueError(f"matvec: x {x.shape} @ w {w.shape} needs equal K and M <= {ROWS}")
    bn = min(cfg.block_n, n)
    bk = min(cfg.block_k, k)
    if n % bn or k % (bk * cfg.splits):
        raise ValueError(f"matvec: N={n} / K={k} not divisible by block_n={bn} / block_k*splits={bk * cfg.splits}")
    xp = jnp.pad(x, ((0, ROWS - m), (0, 0)))
    k_per_split = k // cfg.splits
    out_dtype = x.dtype if cfg.splits == 1 else jnp.float32
    from jax.experimental.pallas import triton as plgpu_triton

    out = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, k_per_split=k_per_split),
        grid=(n // bn, cfg.splits),
        in_specs=[
            pl.BlockSpec((ROWS, k), lambda j, s: (0, 0)),
            pl.BlockSpec((k, bn), lambda j, s: (0, j)),
        ],
        out_specs=pl.BlockSpec((None, ROWS, bn), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((cfg.splits, ROWS, n), out_dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="dflash_matvec",
    )(xp, w)
    out = out[0] if cfg.splits == 1 else jnp.sum(out, axis=0)
    return out[:m].astype(x.dtype)


# -- the benchmark ------------------------------------------------------------------------------

HIDDEN, HEADS, KV, HD, MLP, VOCAB, LAYERS = 4096, 32, 8, 128, 12288, 151936, 36
TINY = dict(HIDDEN=256, HEADS=4, KV=2, HD=64, MLP=512, VOCAB=1024, LAYERS=2)


def timeit(fn, *args, repeats: int, inner: int) -> float:
    """Median seconds of one of ``inner`` chained calls inside one jit (``fn(*args, i)``)."""

    @jax.jit
    def loop(*a):
        def body(i, acc):
            out = fn(*a, i)  # every output feeds the carry: nothing is dead code
            return acc + sum(jnp.sum(o[..., :1].astype(jnp.float32)) for o in jax.tree.leaves(out))

        return jax.lax.fori_loop(0, inner, body, jnp.zeros((), jnp.float32))

    jax.block_until_ready(loop(*args))
    jax.block_until_ready(loop(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def normal(key, shape, dtype):
    return jax.jit(lambda k: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype), static_argnums=())(key)


def rms(h):
    hf = h.astype(jnp.float32)
    return (hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + 1e-6)).astype(h.dtype)


def make_layers(key, dtype, fused: bool):
    layers = []
    for i in range(LAYERS):
        ks = jax.random.split(jax.random.fold_in(key, i), 7)
        if fused:
            layers.append(dict(
                qkv=normal(ks[0], (HIDDEN, (HEADS + 2 * KV) * HD), dtype), o=normal(ks[3], (HEADS * HD, HIDDEN), dtype),
                gu=normal(ks[4], (HIDDEN, 2 * MLP), dtype), d=normal(ks[6], (MLP, HIDDEN), dtype)))
        else:
            layers.append(dict(
                q=normal(ks[0], (HIDDEN, HEADS, HD), dtype), k=normal(ks[1], (HIDDEN, KV, HD), dtype),
                v=normal(ks[2], (HIDDEN, KV, HD), dtype), o=normal(ks[3], (HEADS, HD, HIDDEN), dtype),
                g=normal(ks[4], (HIDDEN, MLP), dtype), u=normal(ks[5], (HIDDEN, MLP), dtype),
                d=normal(ks[6], (MLP, HIDDEN), dtype)))
    return layers


def fake_attention(q, k, v):
    """[M, H, D], [M, KV, D] x2 -> [M, H, D]: keeps k and v live at elementwise cost."""
    g = q.shape[1] // k.shape[1]
    return q + jnp.repeat(k + v, g, axis=1)


def step_heads(h, layers, head):
    """The model's layout: per-head einsums, separate projections."""
    for w in layers:
        x = rms(h)
        q = jnp.einsum("mh,hkd->mkd", x, w["q"])
        k = jnp.einsum("mh,hkd->mkd", x, w["k"])
        v = jnp.einsum("mh,hkd->mkd", x, w["v"])
        h = h + jnp.einsum("mkd,kdh->mh", fake_attention(q, k, v), w["o"])
        x = rms(h)
        h = h + (jax.nn.silu(x @ w["g"]) * (x @ w["u"])) @ w["d"]
    return h + (rms(h) @ head)[:, :HIDDEN]


def step_split_2d(h, layers, head):
    """The model's separate projections, each as a 2-D dot on a reshaped (bitcast) weight."""
    def dot2(x, w):
        return reference(x, w.reshape(HIDDEN, -1))

    for w in layers:
        x = rms(h)
        m = h.shape[0]
        q = dot2(x, w["q"]).reshape(m, HEADS, HD)
        k = dot2(x, w["k"]).reshape(m, KV, HD)
        v = dot2(x, w["v"]).reshape(m, KV, HD)
        h = h + reference(fake_attention(q, k, v).reshape(m, HEADS * HD), w["o"].reshape(HEADS * HD, HIDDEN))
        x = rms(h)
        h = h + reference(jax.nn.silu(reference(x, w["g"])) * reference(x, w["u"]), w["d"])
    return h + reference(rms(h), head)[:, :HIDDEN]


def step_fused(h, layers, head, dot):
    """Fused QKV and gate-up 2-D weights through ``dot(x, w)``."""
    for w in layers:
        x = rms(h)
        qkv = dot(x, w["qkv"])
        q, k, v = jnp.split(qkv, [HEADS * HD, (HEADS + KV) * HD], axis=-1)
        m = h.shape[0]
        attn = fake_attention(q.reshape(m, HEADS, HD), k.reshape(m, KV, HD), v.reshape(m, KV, HD))
        h = h + dot(attn.reshape(m, HEADS * HD), w["o"])
        x = rms(h)
        g, u = jnp.split(dot(x, w["gu"]), 2, axis=-1)
        h = h + dot(jax.nn.silu(g) * u, w["d"])
    return h + dot(rms(h), head)[:, :HIDDEN]


def sweep_configs(k: int, n: int, sms: int) -> list[MatvecConfig]:
    out = []
    for bn in (32, 64, 128):
        for bk in (128, 256):
            for programs in (2 * sms, 4 * sms):
                splits = 1
                while (n // bn) * splits < programs and k % (bk * splits * 2) == 0:
                    splits *= 2
                cfg = MatvecConfig(block_n=bn, block_k=bk, splits=splits, num_stages=4)
                if n % bn == 0 and k % (bk * splits) == 0 and cfg not in out:
                    out.append(cfg)
    return out


def main() -> None:
    global HIDDEN, HEADS, KV, HD, MLP, VOCAB, LAYERS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the %% column")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the tiling sweep")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        HIDDEN, HEADS, KV, HD, MLP, VOCAB, LAYERS = (TINY[k] for k in ("HIDDEN", "HEADS", "KV", "HD", "MLP", "VOCAB", "LAYERS"))
    interpret = jax.default_backend() != "gpu"
    dtype = jnp.bfloat16
    sms = getattr(jax.devices()[0], "core_count", None) or 132
    results: dict = {"device": jax.devices()[0].device_kind, "shapes": [], "steps": []}
    print(f"device {results['device']} ({sms} SMs), interpret={interpret}", flush=True)
    key = jax.random.key(0)

    # -- per-shape sweep -------------------------------------------------------------------------
    shapes = {
        "q/o": (HIDDEN, HEADS * HD), "k/v": (HIDDEN, KV * HD), "qkv": (HIDDEN, (HEADS + 2 * KV) * HD),
        "gate/up": (HIDDEN, MLP), "gate-up": (HIDDEN, 2 * MLP), "down": (MLP, HIDDEN), "head": (HIDDEN, VOCAB),
    }
    best: dict[tuple[int, int], MatvecConfig] = {}
    print(f"{'shape':>8} {'K x N':>14} {'MB':>7} {'xla M1 us':>9} {'%':>4} {'xla M4 us':>9} {'pallas us':>9} {'%':>4}  best config", flush=True)
    for name, (k, n) in shapes.items():
        copies = 2 if args.tiny else max(8, min(36, int(2.5e9 // (k * n * 2))))
        ws = [normal(jax.random.fold_in(key, 1000 + c), (k, n), dtype) for c in range(copies)]
        x1 = normal(jax.random.fold_in(key, 1), (1, k), dtype) * 50
        x4 = normal(jax.random.fold_in(key, 4), (4, k), dtype) * 50
        nbytes = k * n * 2

        def chain(dot, x):
            return lambda ws_, i: [dot(x + i.astype(x.dtype), w) for w in ws_]

        want = reference(x1.astype(jnp.float32), ws[0].astype(jnp.float32))
        t_x1 = timeit(chain(reference, x1), ws, repeats=args.repeats, inner=args.inner) / copies
        t_x4 = timeit(chain(reference, x4), ws, repeats=args.repeats, inner=args.inner) / copies
        row = {"shape": name, "k": k, "n": n, "bytes": nbytes, "xla_m1_s": t_x1, "xla_m4_s": t_x4, "pallas": []}
        t_shape = time.perf_counter()
        configs = sweep_configs(k, n, sms)[: 2 if args.tiny else None]
        for cfg in configs:
            if time.perf_counter() - t_shape > args.budget / len(shapes) and row["pallas"]:
                break
            dot = lambda a, b, c=cfg: matvec(a, b, config=c, interpret=interpret)  # noqa: E731
            try:
                got = dot(x1, ws[0])
                err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / (jnp.max(jnp.abs(want)) + 1e-9))
                t = timeit(chain(dot, x1), ws, repeats=args.repeats, inner=args.inner) / copies
            except Exception as e:  # noqa: BLE001
                print(f"    {cfg}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            row["pallas"].append({"config": cfg.__dict__, "s": t, "rel_err": err})
        if row["pallas"]:
            top = min(row["pallas"], key=lambda r: r["s"])
            best[(k, n)] = MatvecConfig(**top["config"])
            ok = all(r["rel_err"] < 2e-2 for r in row["pallas"])
            print(f"{name:>8} {f'{k}x{n}':>14} {nbytes / 1e6:>7.1f} {t_x1 * 1e6:>9.1f} {nbytes / t_x1 / args.bandwidth:>4.0%} "
                  f"{t_x4 * 1e6:>9.1f} {top['s'] * 1e6:>9.1f} {nbytes / top['s'] / args.bandwidth:>4.0%}  "
                  f"{top['config']} {'ok' if ok else 'ERR'}", flush=True)
        results["shapes"].append(row)
        del ws

    # -- whole-step chains -----------------------------------------------------------------------
    head = normal(jax.random.fold_in(key, 7), (HIDDEN, VOCAB), dtype)
    split_layers = make_layers(jax.random.fold_in(key, 8), dtype, fused=False)
    step_bytes = sum(x.size * 2 for x in jax.tree.leaves(split_layers)) + head.size * 2

    def read_all(ws, hd, i):
        return [jnp.sum(w, axis=0) for w in jax.tree.leaves(ws)] + [jnp.sum(hd, axis=0)]

    h1 = normal(jax.random.fold_in(key, 9), (1, HIDDEN), dtype) * 50
    h4 = normal(jax.random.fold_in(key, 10), (4, HIDDEN), dtype) * 50
    variants = [("read ceiling (column sums)", read_all, (split_layers, head))]
    variants.append(("xla per-head einsums (model today), M=1",
                     lambda ws, hd, i: step_heads(h1 + i.astype(dtype), ws, hd), (split_layers, head)))
    variants.append(("xla separate 2-D dots (reshaped), M=1",
                     lambda ws, hd, i: step_split_2d(h1 + i.astype(dtype), ws, hd), (split_layers, head)))
    variants.append(("xla per-head einsums, M=4",
                     lambda ws, hd, i: step_heads(h4 + i.astype(dtype), ws, hd), (split_layers, head)))
    print(f"\n{'step variant':<44} {'ms':>7} {'% of BW':>7}", flush=True)
    for name, fn, a in variants:
        t = timeit(fn, *a, repeats=args.repeats, inner=args.inner)
        results["steps"].append({"variant": name, "s": t, "bytes": step_bytes})
        print(f"{name:<44} {t * 1e3:>7.3f} {step_bytes / t / args.bandwidth:>7.0%}", flush=True)
    del split_layers
    fused_layers = make_layers(jax.random.fold_in(key, 11), dtype, fused=True)

    def pallas_dot(x, w):
        cfg = best.get(tuple(w.shape))
        if cfg is None:
            return reference(x, w)
        return matvec(x, w, config=cfg, interpret=interpret)

    for name, fn in [
        ("xla fused qkv / gate-up 2-D dots, M=1", lambda ws, hd, i: step_fused(h1 + i.astype(dtype), ws, hd, reference)),
        ("xla fused, M=4", lambda ws, hd, i: step_fused(h4 + i.astype(dtype), ws, hd, reference)),
        ("pallas matvec fused (best tiles), M=1", lambda ws, hd, i: step_fused(h1 + i.astype(dtype), ws, hd, pallas_dot)),
    ]:
        t = timeit(fn, fused_layers, head, repeats=args.repeats, inner=args.inner)
        results["steps"].append({"variant": name, "s": t, "bytes": step_bytes})
        print(f"{name:<44} {t * 1e3:>7.3f} {step_bytes / t / args.bandwidth:>7.0%}", flush=True)
    results["best"] = {f"{k}x{n}": c.__dict__ for (k, n), c in best.items()}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
