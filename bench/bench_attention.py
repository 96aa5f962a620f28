"""Block attention on the accelerator: correctness, then the Pallas kernel vs XLA vs cuDNN.

Usage (on the H200):  PYTHONUNBUFFERED=1 python3 bench/bench_attention.py --out $OUT [--short]
CPU dry run of the script's logic (tiny shapes, interpret mode): python bench/bench_attention.py --tiny

1. Correctness on the device: the kernel vs ``block_attention_reference`` (bf16 Qwen3-8B heads with
   random lengths, split-K included; float32 with odd shapes under HIGHEST matmul precision; the
   gradients of the training pattern).
2. Drafting (blocks = 1, block 16, non-causal, full context) for Qwen3-8B heads (32 q / 8 kv,
   head_dim 128), bf16, context 1k/4k/16k/32k, batch 1/8/32: median time of the Pallas kernel,
   the XLA reference and ``jax.nn.dot_product_attention(implementation="cudnn")`` (the cache
   holding the block's K/V at its end: q [B, 16, 32, 128] over T keys). Bandwidth counts the
   context K and V read once plus q and out (and the block K/V for ours).
3. A small sweep of the kernel's tile / split parameters at 32k.
4. The training pattern (seq 4096, 512 anchors, block 16, batch 1): forward and forward+backward
   of the kernel (custom VJP; Pallas backward, and the blockwise jnp backward) vs the reference
   (dense masked scores).

Timing: the drafting cases run a chain of 8 dependent calls inside one jit (the host's dispatch
cost would otherwise dominate the small cases), median over 15 rounds after warm-up, each round
ended by block_until_ready; the training cases are ms-scale and timed call by call.

Results go to stdout and, with --out, to bench_attention.jsonl / bench_attention.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.attention import block_attention_reference  # noqa: E402
from kernels_pallas import block_attention  # noqa: E402
from kernels_pallas.block_attention_gpu import GpuConfig, plan  # noqa: E402

PEAK_BW = 4.3e12  # bytes/s, measured device-to-device copy on the H200 (docs: KINDS.md)
HQ, HKV, D, BLOCK = 32, 8, 128, 16

RESULTS: list[dict] = []
ARGS = None
OUT_DIR: str | None = None
T_START = time.time()


def log(msg: str = "") -> None:
    print(msg, flush=True)


def record(**row) -> None:
    RESULTS.append(row)
    if OUT_DIR:
        with open(os.path.join(OUT_DIR, "bench_attention.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def timeit(fn, *args, reps: int = 15, target_s: float = 3e-3) -> float:
    """Median seconds per call: warm-up, then rounds of back-to-back calls, block_until_ready."""
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    inner = max(1, min(100, int(target_s / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


CHAIN = 8


def chained(fn, chain: int = CHAIN):
    """jit of ``chain`` dependent calls of ``fn(q, *rest)`` (q_{i+1} = q_i + [out_i == inf]), so
    the host's dispatch cost is paid once per ``chain`` kernels: small cases measure the device,
    not Python. ``timeit(chained(fn), ...)`` / chain = time per call."""
    def run(q, *rest):
        for _ in range(chain):
            out = fn(q, *rest)
            q = q + jnp.where(out == jnp.inf, 1, 0).astype(q.dtype).reshape(q.shape)
        return q
    return jax.jit(run)


def make(batch, blocks, ctx, *, dtype=jnp.bfloat16, seed=0, hq=HQ, hkv=HKV, d=D, block=BLOCK,
         ctx_lens=None, blk_lens=None):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (batch, blocks, block, hq, d), dtype)
    k_ctx = jax.random.normal(ks[1], (batch, ctx, hkv, d), dtype)
    v_ctx = jax.random.normal(ks[2], (batch, ctx, hkv, d), dtype)
    k_blk = jax.random.normal(ks[3], (batch, blocks, block, hkv, d), dtype)
    v_blk = jax.random.normal(ks[4], (batch, blocks, block, hkv, d), dtype)
    if ctx_lens is None:
        ctx_lens = jnp.full((batch, blocks), ctx, jnp.int32)
    if blk_lens is None:
        blk_lens = jnp.full((batch, blocks), block, jnp.int32)
    return q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens


def err(got, want):
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    return (float(np.max(np.abs(got - want))),
            float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)),
            bool(np.all(np.isfinite(got))))


# --------------------------------------------------------------------------------------------
def correctness(tiny: bool) -> bool:
    log("== correctness on the device ==")
    ok = True
    rng = np.random.default_rng(0)
    shapes = [(2, 1, 300), (1, 1, 4096)] if tiny else [(2, 1, 4096), (1, 1, 32768), (4, 3, 2048)]
    for (b, n, t) in shapes:
        cl = jnp.asarray(rng.integers(0, t + 1, (b, n)), jnp.int32).at[0, 0].set(t)
        if b * n > 1:
            cl = cl.at[-1, -1].set(0)
        bl = jnp.asarray(rng.integers(0, BLOCK + 1, (b, n)), jnp.int32)
        args = make(b, n, t, seed=b + t, ctx_lens=cl, blk_lens=bl)
        for causal in ((False, True) if not ARGS.short else (b * n * t % 2 == 1 or t == 32768,)):
            got = jax.jit(lambda *a: block_attention(*a, causal=causal))(*args)
            want = jax.jit(lambda *a: block_attention_reference(*a, causal=causal))(*args)
            mx, rel, fin = err(got, want)
            good = fin and rel < 1e-2 and mx < 6e-2
            ok &= good
            log(f"bf16 B={b} N={n} T={t} causal={causal} splits={plan(b, n, HKV, t, GpuConfig())[2]}:"
                f" max|err|={mx:.2e} rel={rel:.2e} {'OK' if good else 'FAIL'}")
            record(kind="check", case=f"bf16 B{b} N{n} T{t} c{int(causal)}", max_err=mx, rel_err=rel,
                   ok=good)
    # float32, odd shapes, exact matmuls
    args = make(2, 3, 1000 if not tiny else 77, dtype=jnp.float32, seed=7, hq=12, hkv=4, d=64,
                block=7, ctx_lens=jnp.array([[0, 999, 500], [1, 77, 640]], jnp.int32) % (77 if tiny else 1001),
                blk_lens=jnp.array([[0, 1, 7], [3, 7, 0]], jnp.int32))
    with jax.default_matmul_precision("highest"):
        for causal in ((False, True) if not ARGS.short else (True,)):
            got = jax.jit(lambda *a: block_attention(*a, causal=causal))(*args)
            want = jax.jit(lambda *a: block_attention_reference(*a, causal=causal))(*args)
            mx, rel, fin = err(got, want)
            good = fin and mx < 1e-4
            ok &= good
            log(f"f32 odd shapes causal={causal}: max|err|={mx:.2e} rel={rel:.2e} {'OK' if good else 'FAIL'}")
            record(kind="check", case=f"f32 odd c{int(causal)}", max_err=mx, rel_err=rel, ok=good)
    # training-pattern gradients (bf16)
    b, n, t = (1, 8, 256) if tiny else (1, 64, 1024)
    anchors = jnp.asarray(np.sort(rng.integers(0, t - BLOCK + 1, (b, n))), jnp.int32)
    args = make(b, n, t, seed=3, ctx_lens=anchors)
    ct = jax.random.normal(jax.random.PRNGKey(5), args[0].shape, jnp.float32)

    def grads(fn, **kw):
        def loss(q, kc, vc, kb, vb, cl, bl, ct):
            out = fn(q, kc, vc, cl, kb, vb, bl, causal=False, **kw)
            return jnp.sum(out.astype(jnp.float32) * ct)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(
            *[args[i] for i in (0, 1, 2, 4, 5, 3, 6)], ct)

    want = grads(block_attention_reference)
    bwds = ["xla", "pallas"]
    for bwd in bwds:
        try:
            got = grads(block_attention, bwd=bwd)
        except Exception:  # noqa: BLE001
            ok = False
            log(f"!! grads with bwd={bwd} failed:\n{traceback.format_exc()}")
            continue
        for name, g, w in zip(["dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"], got, want):
            mx, rel, fin = err(g, w)
            good = fin and rel < 2e-2
            ok &= good
            log(f"train grad ({bwd} bwd) {name}: max|err|={mx:.2e} rel={rel:.2e} {'OK' if good else 'FAIL'}")
            record(kind="check", case=f"grad {bwd} {name}", max_err=mx, rel_err=rel, ok=good)
    return ok


# --------------------------------------------------------------------------------------------
def drafting_bytes(b, t, with_block=True):
    kv = 2 * b * t * HKV * D * 2
    qo = 2 * b * BLOCK * HQ * D * 2
    blk = 2 * b * BLOCK * HKV * D * 2 if with_block else 0
    return kv + qo + blk


def cudnn_fn():
    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    return jax.jit(f)


def bench_drafting(tiny: bool, budget_s: float):
    log("== drafting: blocks=1, block 16, non-causal, full context, bf16, 32q/8kv heads, d=128 ==")
    ctxs = [4096, 1024] if tiny else [32768, 16384, 4096, 1024]  # the long contexts first
    batches = [1, 2] if tiny else [1, 8, 32]
    rows = []
    kern = chained(lambda *a: block_attention(*a, causal=False))
    ref = chained(lambda *a: block_attention_reference(*a, causal=False))
    cud = chained(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    for t in ctxs:
        for b in batches:
            if time.time() - T_START > budget_s:
                log(f"(time budget reached, skipping T={t} B={b})")
                continue
            args = make(b, 1, t, seed=t + b)
            row = dict(kind="draft", ctx=t, batch=b, splits=plan(b, 1, HKV, t, GpuConfig())[2],
                       bytes=drafting_bytes(b, t), timing=f"chain of {CHAIN} in one jit")
            for name, fn, fargs, nbytes in (
                ("pallas", kern, args, drafting_bytes(b, t)),
                ("xla", ref, args, drafting_bytes(b, t)),
                ("cudnn", cud, (args[0][:, 0], args[1], args[2]), drafting_bytes(b, t, False)),
            ):
                try:
                    sec = timeit(fn, *fargs, reps=5 if tiny else 15) / CHAIN
                    row[name + "_ms"] = sec * 1e3
                    row[name + "_bw"] = nbytes / sec / PEAK_BW
                except Exception as e:  # noqa: BLE001
                    row[name + "_ms"] = None
                    row[name + "_err"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            record(**row)
            log(fmt_row(row))
            del args
    return rows


def fmt_ms(row, name):
    ms = row.get(name + "_ms")
    if ms is None:
        return f"{'n/a':>8} {'':>5}"
    return f"{ms:8.3f} {100 * row[name + '_bw']:4.0f}%"


def fmt_row(row):
    return (f"T={row['ctx']:>6} B={row['batch']:>3} splits={row['splits']:>3} "
            f"MB={row['bytes'] / 1e6:8.1f} | pallas {fmt_ms(row, 'pallas')} | "
            f"xla {fmt_ms(row, 'xla')} | cudnn {fmt_ms(row, 'cudnn')}"
            + (f" | cudnn error: {row['cudnn_err']}" if row.get("cudnn_err") else "")
            + (f" | pallas error: {row['pallas_err']}" if row.get("pallas_err") else ""))


# --------------------------------------------------------------------------------------------
SWEEP = [
    GpuConfig(),
    GpuConfig(block_k=128),
    GpuConfig(num_warps=8),
    GpuConfig(block_k=128, num_warps=8),
    GpuConfig(num_stages=2),
    GpuConfig(num_stages=4),
    GpuConfig(ctas_per_sm=1),
    GpuConfig(ctas_per_sm=4),
    GpuConfig(min_chunk=1024),
    GpuConfig(block_k=32),
    GpuConfig(partial_dtype="bfloat16"),
    GpuConfig(block_k=128, min_chunk=1024, partial_dtype="bfloat16"),
]


SPLIT_SWEEP = {  # the wave-model plan vs fixed split counts (second H200 run)
    (1, 32768): [GpuConfig(), GpuConfig(num_splits=64)],
    (8, 32768): [GpuConfig(), GpuConfig(num_splits=8), GpuConfig(num_splits=17)],
    (32, 32768): [GpuConfig(), GpuConfig(num_splits=3)],
}


def bench_sweep(tiny: bool, budget_s: float):
    log("== sweep of GpuConfig at long context (drafting) ==")
    shapes = [(1, 1024)] if tiny else [(1, 32768), (8, 32768), (32, 16384)]
    if ARGS.short:
        shapes = [(1, 1024)] if tiny else list(SPLIT_SWEEP)
    for b, t in shapes:
        args = make(b, 1, t, seed=11)
        nbytes = drafting_bytes(b, t)
        cfgs = SWEEP[:2] if tiny else SWEEP
        if ARGS.short:
            cfgs = SWEEP[:2] if tiny else SPLIT_SWEEP[(b, t)]
        for cfg in cfgs:
            if time.time() - T_START > budget_s:
                log("(time budget reached, sweep cut short)")
                return
            fn = chained(lambda *a, cfg=cfg: block_attention(*a, causal=False, config=cfg))
            try:
                sec = timeit(fn, *args, reps=5 if tiny else 10) / CHAIN
                res = dict(ms=sec * 1e3, bw=nbytes / sec / PEAK_BW)
            except Exception as e:  # noqa: BLE001
                res = dict(ms=None, err=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            diff = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                    if getattr(cfg, f.name) != getattr(GpuConfig(), f.name)}
            record(kind="sweep", batch=b, ctx=t, config=diff, splits=plan(b, 1, HKV, t, cfg)[2], **res)
            ms = f"{res['ms']:.3f} ms {100 * res['bw']:.0f}%" if res.get("ms") else res.get("err")
            log(f"B={b} T={t} {diff or 'default'} splits={plan(b, 1, HKV, t, cfg)[2]}: {ms}")
        del args


# --------------------------------------------------------------------------------------------
def bench_training(tiny: bool):
    b, n, t = (1, 16, 256) if tiny else (1, 512, 4096)
    log(f"== training pattern: batch {b}, seq {t}, {n} anchors, block {BLOCK}, bf16 ==")
    rng = np.random.default_rng(1)
    anchors = jnp.asarray(rng.integers(0, t - BLOCK + 1, (b, n)), jnp.int32)
    args = make(b, n, t, seed=21, ctx_lens=anchors)
    ct = jax.random.normal(jax.random.PRNGKey(2), args[0].shape, jnp.bfloat16)

    def fwd(fn):
        return jax.jit(lambda *a: fn(*a, causal=False))  # ms-scale: host dispatch is negligible

    def fwd_bwd(fn, **kw):
        def loss(q, kc, vc, kb, vb, cl, bl, ct):
            out = fn(q, kc, vc, cl, kb, vb, bl, causal=False, **kw)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

    # everything is an argument (a closed-over cotangent gets constant-folded by XLA)
    gargs = [args[i] for i in (0, 1, 2, 4, 5, 3, 6)] + [ct]
    row = dict(kind="train", batch=b, seq=t, anchors=n)
    # "pallas": the default (Pallas forward, Pallas backward on a GPU); "pallas+jnpbwd": the
    # Pallas forward with the blockwise jnp backward (the TPU / interpret default)
    variants = [("pallas", block_attention, {}),
                ("pallas+jnpbwd", block_attention, {"bwd": "xla"}),
                ("xla", block_attention_reference, {})]
    for name, fn, kw in variants:
        for what, f, a in (("fwd", fwd(fn), args), ("fwdbwd", fwd_bwd(fn, **kw), gargs)):
            if what == "fwd" and kw:
                continue
            try:
                row[f"{name}_{what}_ms"] = timeit(f, *a, reps=5 if tiny else 10) * 1e3
            except Exception as e:  # noqa: BLE001
                row[f"{name}_{what}_ms"] = None
                row[f"{name}_{what}_err"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    record(**row)
    log(json.dumps(row))
    return row


# --------------------------------------------------------------------------------------------
def main():
    global OUT_DIR
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run with tiny shapes")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds before skipping work")
    ap.add_argument("--skip", default="", help="comma list of: check,draft,sweep,train")
    ap.add_argument("--extra", default="", help="ignored (both backwards are always run now)")
    ap.add_argument("--short", action="store_true",
                    help="fewer correctness cases; sweep only split counts (second run)")
    a = ap.parse_args()
    global ARGS
    ARGS = a
    OUT_DIR = a.out
    if OUT_DIR:
        os.makedirs(OUT_DIR, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    dev = jax.devices()[0]
    log(f"jax {jax.__version__} backend {jax.default_backend()} device {dev.device_kind} "
        f"({getattr(dev, 'core_count', '?')} SMs) date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    ok = True
    sections = [
        ("check", lambda: correctness(a.tiny)),
        ("draft", lambda: bench_drafting(a.tiny, a.budget * 0.65)),
        ("sweep", lambda: bench_sweep(a.tiny, a.budget * 0.8)),
        ("train", lambda: bench_training(a.tiny)),
    ]
    for name, fn in sections:
        if name in skip:
            continue
        t0 = time.time()
        try:
            res = fn()
            if name == "check":
                ok = bool(res)
        except Exception:  # noqa: BLE001
            ok = False if name == "check" else ok
            log(f"!! section {name} failed:\n{traceback.format_exc()}")
        log(f"-- {name}: {time.time() - t0:.1f} s (total {time.time() - T_START:.1f} s)")
    drafts = [r for r in RESULTS if r.get("kind") == "draft"]
    if drafts:
        lines = ["| ctx | batch | splits | MB read | Pallas ms (% of 4.3 TB/s) | XLA ms (%) | cuDNN ms (%) |",
                 "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in drafts:
            cells = []
            for name in ("pallas", "xla", "cudnn"):
                ms = r.get(name + "_ms")
                cells.append("n/a" if ms is None else f"{ms:.3f} ({100 * r[name + '_bw']:.0f}%)")
            lines.append(f"| {r['ctx']} | {r['batch']} | {r['splits']} | {r['bytes'] / 1e6:.1f} | "
                         + " | ".join(cells) + " |")
        table = "\n".join(lines)
        log(table)
        if OUT_DIR:
            with open(os.path.join(OUT_DIR, "bench_attention.md"), "w") as f:
                f.write(table + "\n")
    log(f"correctness: {'OK' if ok else 'FAILED'}; total {time.time() - T_START:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
