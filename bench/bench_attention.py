"""Attention kernels on the accelerator: the block-attention kernel against XLA and cuDNN, and with
``--cached`` the fused cached attention against the paths around the block-attention kernel.

Block attention (default), Qwen3-8B heads (32 q / 8 kv, head_dim 128), bf16:

- ``check``: the kernel against ``block_attention_reference`` on one case (a sanity check; the
  correctness tests are ``pytest -m gpu tests/gpu``);
- ``draft``: blocks = 1, block 16, non-causal, full context 1k/4k/16k/32k, batch 1/8/32: the Pallas
  kernel, the XLA reference and ``jax.nn.dot_product_attention(implementation="cudnn")``. Each case
  is a chain of 8 dependent calls in one jit (the host's dispatch would dominate the small ones);
  bandwidth counts the context K/V read once plus q and out (and the block's K/V for ours);
- ``sweep``: the kernel's tile and split parameters at long contexts;
- ``train``: the training pattern (seq 4096, 512 anchors, block 16): forward and forward + backward
  of the kernel (Pallas backward; blockwise jnp backward) against the reference.

    python3 bench/bench_attention.py --out bench/results/attention [--short] [--skip sweep]
    JAX_PLATFORMS=cpu python3 bench/bench_attention.py --tiny            # smoke test (interpret mode)

``--cached``: all ``--layers`` layers' attention of a decode/verify step in one jit, caches donated,
from the raw fused projection ``qkv [batch, block, 8, 6, 128]`` to the attention output, at (batch,
block) in (1, 1), (1, 16), (16, 1), (16, 16), contexts of 512 in caches of 1152 positions:

- ``fused``: ``kernels_pallas.cached_attention`` (q/k norm, RoPE, cache write, attention; and tile
  variants), the engine's path;
- ``unfused-pallas``: XLA's norms, RoPE and cache writes around the block-attention kernel;
- ``unfused-xla``: the same with the XLA reference attention (``dflash_jax.ops`` with the kernels off).

    python3 bench/bench_attention.py --cached --out bench/results/cached_attention.json
    python3 bench/bench_attention.py --cached --kernel-profile /tmp/kprof --out bench/results/kernel.json

``--kernel-profile DIR`` reads the fused kernel's own GPU time off profiler traces, per tile config
(``--sweep``), and for the first config its anatomy: the context length (0: a program's fixed cost),
without the q/k norm, without the cache write. With ``--cached``, ``--out`` is a JSON file; without, a
directory for ``bench_attention.jsonl`` and ``bench_attention.md``.
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

import jax
import jax.numpy as jnp
import numpy as np

import timing
from dflash_jax.ops import OpsConfig
from dflash_jax.ops import attention as attention_ops
from dflash_jax.ops.config import parse_tiles
from dflash_jax.ops.rope import rope_inv_freq
from kernels_pallas.block_attention import block_attention
from kernels_pallas.block_attention.gpu import GpuConfig, plan
from kernels_pallas.block_attention.reference import block_attention_reference
from kernels_pallas.cached_attention import cached_block_attention

HQ, HKV, D, BLOCK = 32, 8, 128, 16
CHAIN = 8
RESULTS: list[dict] = []
T_START = time.time()


def log(msg: str = "") -> None:
    print(msg, flush=True)


def record(out_dir: str | None, **row) -> None:
    RESULTS.append(row)
    if out_dir:
        with open(os.path.join(out_dir, "bench_attention.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def chained(fn, chain: int = CHAIN):
    """jit of ``chain`` dependent calls of ``fn(q, *rest)`` (q_{i+1} = q_i + [out_i == inf]): the
    host's dispatch is paid once per ``chain`` kernels. Time per call = ``per_call_time`` / chain."""
    def run(q, *rest):
        for _ in range(chain):
            out = fn(q, *rest)
            q = q + jnp.where(out == jnp.inf, 1, 0).astype(q.dtype).reshape(q.shape)
        return q
    return jax.jit(run)


def make(batch, blocks, ctx, *, dtype=jnp.bfloat16, seed=0, ctx_lens=None):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = timing.normal(ks[0], (batch, blocks, BLOCK, HQ, D), dtype)
    k_ctx, v_ctx = (timing.normal(k, (batch, ctx, HKV, D), dtype) for k in ks[1:3])
    k_blk, v_blk = (timing.normal(k, (batch, blocks, BLOCK, HKV, D), dtype) for k in ks[3:5])
    ctx_lens = jnp.full((batch, blocks), ctx, jnp.int32) if ctx_lens is None else ctx_lens
    return q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, jnp.full((batch, blocks), BLOCK, jnp.int32)


def drafting_bytes(b, t, with_block=True):
    return 2 * b * t * HKV * D * 2 + 2 * b * BLOCK * HQ * D * 2 + (2 * b * BLOCK * HKV * D * 2 if with_block else 0)


# -- block attention ---------------------------------------------------------------------------------


def sanity_check(args, tiny: bool) -> bool:
    b, t = (1, 300) if tiny else (2, 4096)
    lens = jnp.array([[t]] + [[t // 3]] * (b - 1), jnp.int32)
    qkv = make(b, 1, t, seed=1, ctx_lens=lens)
    got = jax.jit(lambda *a: block_attention(*a, causal=True))(*qkv)
    err = timing.relative_error(got, jax.jit(lambda *a: block_attention_reference(*a, causal=True))(*qkv))
    log(f"check: kernel vs reference, bf16 B={b} T={t}: rel err {err:.1e} {'OK' if err < 2e-2 else 'FAIL'}")
    record(args.out, kind="check", case=f"bf16 B{b} T{t}", rel_err=err, ok=err < 2e-2)
    return err < 2e-2


def bench_drafting(args, tiny: bool, budget_s: float):
    log("== drafting: blocks=1, block 16, non-causal, full context, bf16, 32q/8kv heads, d=128 ==")
    ctxs = [1024, 256] if tiny else [32768, 16384, 4096, 1024]  # the long contexts first
    kern = chained(lambda *a: block_attention(*a, causal=False))
    ref = chained(lambda *a: block_attention_reference(*a, causal=False))
    cud = chained(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    for t in ctxs:
        for b in [1, 2] if tiny else [1, 8, 32]:
            if time.time() - T_START > budget_s:
                log(f"(time budget reached, skipping T={t} B={b})")
                continue
            a = make(b, 1, t, seed=t + b)
            row = dict(kind="draft", ctx=t, batch=b, splits=plan(b, 1, HKV, t, GpuConfig())[2],
                       bytes=drafting_bytes(b, t), timing=f"chain of {CHAIN} in one jit")
            for name, fn, fargs, nbytes in (("pallas", kern, a, drafting_bytes(b, t)),
                                            ("xla", ref, a, drafting_bytes(b, t)),
                                            ("cudnn", cud, (a[0][:, 0], a[1], a[2]), drafting_bytes(b, t, False))):
                try:
                    sec = timing.per_call_time(fn, *fargs, repeats=5 if tiny else 15) / CHAIN
                    row[name + "_ms"], row[name + "_bw"] = sec * 1e3, nbytes / sec / timing.HBM_BYTES_PER_S
                except Exception as e:  # noqa: BLE001  (cuDNN may refuse a shape: the others still run)
                    row[name + "_ms"], row[name + "_err"] = None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            record(args.out, **row)
            cells = " | ".join(f"{n} " + ("n/a" if row.get(n + "_ms") is None else
                                          f"{row[n + '_ms']:8.3f} {100 * row[n + '_bw']:4.0f}%")
                               for n in ("pallas", "xla", "cudnn"))
            log(f"T={t:>6} B={b:>3} splits={row['splits']:>3} MB={row['bytes'] / 1e6:8.1f} | {cells}")


SWEEP = [GpuConfig(), GpuConfig(block_k=128), GpuConfig(num_warps=8), GpuConfig(block_k=128, num_warps=8),
         GpuConfig(num_stages=2), GpuConfig(num_stages=4), GpuConfig(ctas_per_sm=1), GpuConfig(ctas_per_sm=4),
         GpuConfig(min_chunk=1024), GpuConfig(block_k=32), GpuConfig(partial_dtype="bfloat16"),
         GpuConfig(block_k=128, min_chunk=1024, partial_dtype="bfloat16")]
SPLIT_SWEEP = {  # the wave-model plan against fixed split counts (--short)
    (1, 32768): [GpuConfig(), GpuConfig(num_splits=64)],
    (8, 32768): [GpuConfig(), GpuConfig(num_splits=8), GpuConfig(num_splits=17)],
    (32, 32768): [GpuConfig(), GpuConfig(num_splits=3)],
}


def bench_sweep(args, tiny: bool, budget_s: float):
    log("== sweep of GpuConfig at long context (drafting) ==")
    shapes = [(1, 1024)] if tiny else (list(SPLIT_SWEEP) if args.short else [(1, 32768), (8, 32768), (32, 16384)])
    for b, t in shapes:
        a = make(b, 1, t, seed=11)
        for cfg in SWEEP[:2] if tiny else (SPLIT_SWEEP[(b, t)] if args.short else SWEEP):
            if time.time() - T_START > budget_s:
                log("(time budget reached, sweep cut short)")
                return
            fn = chained(lambda *x, cfg=cfg: block_attention(*x, causal=False, config=cfg))
            try:
                sec = timing.per_call_time(fn, *a, repeats=5 if tiny else 10) / CHAIN
                res = dict(ms=sec * 1e3, bw=drafting_bytes(b, t) / sec / timing.HBM_BYTES_PER_S)
            except Exception as e:  # noqa: BLE001  (a config the kernel refuses is a result too)
                res = dict(ms=None, err=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            diff = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                    if getattr(cfg, f.name) != getattr(GpuConfig(), f.name)}
            record(args.out, kind="sweep", batch=b, ctx=t, config=diff, splits=plan(b, 1, HKV, t, cfg)[2], **res)
            ms = f"{res['ms']:.3f} ms {100 * res['bw']:.0f}%" if res.get("ms") else res.get("err")
            log(f"B={b} T={t} {diff or 'default'} splits={plan(b, 1, HKV, t, cfg)[2]}: {ms}")


def bench_training(args, tiny: bool):
    b, n, t = (1, 16, 256) if tiny else (1, 512, 4096)
    log(f"== training pattern: batch {b}, seq {t}, {n} anchors, block {BLOCK}, bf16 ==")
    anchors = jnp.asarray(np.random.default_rng(1).integers(0, t - BLOCK + 1, (b, n)), jnp.int32)
    a = make(b, n, t, seed=21, ctx_lens=anchors)
    ct = timing.normal(jax.random.PRNGKey(2), a[0].shape, jnp.bfloat16)

    def fwd_bwd(fn, **kw):
        def loss(q, kc, vc, kb, vb, cl, bl, ct):
            out = fn(q, kc, vc, cl, kb, vb, bl, causal=False, **kw)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

    gargs = [a[i] for i in (0, 1, 2, 4, 5, 3, 6)] + [ct]  # all arguments: a closed-over cotangent is folded
    row = dict(kind="train", batch=b, seq=t, anchors=n)
    # "pallas": Pallas forward and (on a GPU) backward; "pallas+jnpbwd": the blockwise jnp backward
    for name, fn, kw in (("pallas", block_attention, {}), ("pallas+jnpbwd", block_attention, {"bwd": "xla"}),
                         ("xla", block_attention_reference, {})):
        for what, f, fargs in (("fwd", jax.jit(lambda *x, fn=fn: fn(*x, causal=False)), a),
                               ("fwdbwd", fwd_bwd(fn, **kw), gargs)):
            if what == "fwd" and kw:
                continue
            try:  # ms-scale calls: timed one by one
                row[f"{name}_{what}_ms"] = timing.median_time(f, *fargs, repeats=5 if tiny else 10)[0] * 1e3
            except Exception as e:  # noqa: BLE001  (e.g. out of memory: the other variants still run)
                row[f"{name}_{what}_ms"], row[f"{name}_{what}_err"] = None, f"{type(e).__name__}: {str(e)[:160]}"
    record(args.out, **row)
    log(json.dumps(row))


def block_main(args) -> int:
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    ok = True
    for name, fn in (("check", lambda: sanity_check(args, args.tiny)),
                     ("draft", lambda: bench_drafting(args, args.tiny, args.budget * 0.65)),
                     ("sweep", lambda: bench_sweep(args, args.tiny, args.budget * 0.8)),
                     ("train", lambda: bench_training(args, args.tiny))):
        if name in skip:
            continue
        t0 = time.time()
        try:
            res = fn()
            ok = ok and (res is not False)
        except Exception:  # noqa: BLE001  (a failed section is reported; the next one runs)
            ok = False if name == "check" else ok
            log(f"!! section {name} failed:\n{traceback.format_exc()}")
        log(f"-- {name}: {time.time() - t0:.1f} s (total {time.time() - T_START:.1f} s)")
    drafts = [r for r in RESULTS if r.get("kind") == "draft"]
    if drafts:
        lines = ["| ctx | batch | splits | MB read | Pallas ms (% of 4.3 TB/s) | XLA ms (%) | cuDNN ms (%) |",
                 "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in drafts:
            cells = ["n/a" if r.get(n + "_ms") is None else f"{r[n + '_ms']:.3f} ({100 * r[n + '_bw']:.0f}%)"
                     for n in ("pallas", "xla", "cudnn")]
            lines.append(f"| {r['ctx']} | {r['batch']} | {r['splits']} | {r['bytes'] / 1e6:.1f} | " + " | ".join(cells) + " |")
        log("\n".join(lines))
        if args.out:
            with open(os.path.join(args.out, "bench_attention.md"), "w") as f:
                f.write("\n".join(lines) + "\n")
    log(f"check: {'OK' if ok else 'FAILED'}; total {time.time() - T_START:.1f} s")
    return 0 if ok else 1


# -- cached attention (--cached) ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Heads:
    heads: int
    kv_heads: int
    head_dim: int
    q_norm: jax.Array
    k_norm: jax.Array
    inv_freq: tuple[float, ...]
    eps: float = 1e-6


def heads(tiny: bool) -> Heads:
    h, kv, d = (8, 2, 32) if tiny else (HQ, HKV, D)
    norm = lambda seed: (1 + 0.2 * jax.random.normal(jax.random.key(seed), (d,))).astype(jnp.bfloat16)  # noqa: E731
    return Heads(h, kv, d, norm(1), norm(2), tuple(float(f) for f in rope_inv_freq(d, 1e6, None)))


def fused(hd: Heads, qkv, k, v, starts, blk_lens, config=None, *, qk_norm=True, write=True):
    return cached_block_attention(qkv, k, v, starts, blk_lens, hd.q_norm, hd.k_norm,
                                  jnp.asarray(hd.inv_freq, jnp.float32), eps=hd.eps, qk_norm=qk_norm,
                                  write=write, config=config)


def unfused(hd: Heads, qkv, k, v, starts, blk_lens, attention: str):
    """Norms, RoPE and cache writes by XLA around ``attention``'s block attention ("pallas": the
    kernel; "xla": the reference): the steps the fused kernel replaces."""
    ops = OpsConfig(attention=attention)
    positions = starts[:, None] + jnp.arange(qkv.shape[1], dtype=jnp.int32)
    q, kb, vb = attention_ops.split_qkv(qkv, hd.heads)
    q = attention_ops.finish_qk(q, positions, hd.q_norm, hd.eps, hd.inv_freq)
    kb = attention_ops.finish_qk(kb, positions, hd.k_norm, hd.eps, hd.inv_freq)
    out, k, v = attention_ops.attend_and_write(q[:, None], kb[:, None], vb[:, None], starts, k, v, blk_lens,
                                               causal=True, write=True, ops=ops)
    return out[:, 0], k, v


def layers_fn(one, layers: int):
    """All layers' attention in one jit, caches donated: ``[layers]`` qkv, k and v caches."""
    def run(qkvs, ks, vs, starts, blk_lens):
        total, new_k, new_v = 0.0, [], []
        for i in range(layers):
            out, k, v = one(qkvs[i], ks[i], vs[i], starts, blk_lens)
            total = total + jnp.sum(out.astype(jnp.float32))
            new_k.append(k)
            new_v.append(v)
        return total, new_k, new_v
    return jax.jit(run, donate_argnums=(1, 2))


def random_layers(hd: Heads, seed: int, layers: int, batch: int, block: int, capacity: int):
    keys = jax.random.split(jax.random.key(seed), 3)
    qkvs = timing.normal(keys[0], (layers, batch, block, hd.kv_heads, hd.heads // hd.kv_heads + 2, hd.head_dim),
                         jnp.bfloat16)
    shape = (layers, batch, capacity, hd.kv_heads, hd.head_dim)
    return qkvs, timing.normal(keys[1], shape, jnp.bfloat16), timing.normal(keys[2], shape, jnp.bfloat16)


def cached_timings(args, hd: Heads, layers: int, capacity: int, context: int) -> list[dict]:
    results = []
    for batch, block in ((1, 1), (1, 16), (16, 1), (16, 16)):
        qkvs, k_all, v_all = random_layers(hd, batch * 100 + block, layers, batch, block, capacity)
        starts, blk_lens = jnp.full((batch,), context, jnp.int32), jnp.full((batch,), block, jnp.int32)
        want = jax.jit(lambda q, k, v: unfused(hd, q, k, v, starts, blk_lens, "xla"))(qkvs[0], k_all[0], v_all[0])
        got = jax.jit(lambda q, k, v: fused(hd, q, k, v, starts, blk_lens))(qkvs[0], k_all[0], v_all[0])
        errs = {name: timing.relative_error(g, w) for name, g, w in zip(("out", "k_cache", "v_cache"), got, want)}
        ok = all(e < 1e-2 for e in errs.values())
        print(f"batch {batch} block {block}: fused vs reference, rel err {errs} -> {'OK' if ok else 'MISMATCH'}")
        variants = {"fused": lambda q, k, v, s, b: fused(hd, q, k, v, s, b),
                    "unfused-pallas": lambda q, k, v, s, b: unfused(hd, q, k, v, s, b, "pallas"),
                    "unfused-xla": lambda q, k, v, s, b: unfused(hd, q, k, v, s, b, "xla")}
        for tiles in ("block_k=32", "block_k=128", "num_warps=8", "num_stages=2"):
            cfg = GpuConfig(**dict(parse_tiles(tiles)))
            variants[f"fused {tiles}"] = lambda q, k, v, s, b, cfg=cfg: fused(hd, q, k, v, s, b, cfg)
        row = dict(batch=batch, block=block, errors=errs, ok=ok, times_us={})
        for name, one in variants.items():
            fn = layers_fn(one, layers)
            ks, vs = [k_all[i] + 0 for i in range(layers)], [v_all[i] + 0 for i in range(layers)]
            try:
                times = []
                for i in range(args.reps + 1):  # the first call compiles
                    t0 = time.perf_counter()
                    total, ks, vs = fn(qkvs, ks, vs, starts, blk_lens)
                    jax.block_until_ready(total)
                    times.append(time.perf_counter() - t0)
                row["times_us"][name] = statistics.median(times[1:]) * 1e6
                print(f"  {name:28s} {row['times_us'][name]:9.1f} us per {layers} layers "
                      f"({row['times_us'][name] / layers:6.2f} us/layer)", flush=True)
            except Exception as err:  # noqa: BLE001  (one failing variant must not lose the others)
                print(f"  {name:28s} FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
            del ks, vs
        results.append(row)
        timing.write_json(args.out, results)
    print("\nbatch | block | fused us/layer | unfused-pallas | unfused-xla | fused / unfused-pallas")
    for r in results:
        f, p, x = (r["times_us"].get(k, float("nan")) / layers for k in ("fused", "unfused-pallas", "unfused-xla"))
        print(f"{r['batch']:5d} | {r['block']:5d} | {f:14.2f} | {p:14.2f} | {x:11.2f} | {f / p:6.2f}")
    return results


def kernel_profile(args, hd: Heads, layers: int, capacity: int, context: int) -> list[dict]:
    """The fused kernel's GPU time per variant, off profiler traces (3 traced calls of ``layers``
    kernels; the median per kernel): tile configs, and for the first its anatomy."""
    configs = {name: GpuConfig(**dict(parse_tiles("" if name == "default" else name)))
               for name in args.sweep.split(";")}
    first = next(iter(configs.values()))
    rows = []
    for block in (int(b) for b in args.blocks.split(",")):
        qkvs, k_all, v_all = random_layers(hd, block, layers, args.batch, block, capacity)
        variants = [(name, cfg, context, True, True) for name, cfg in configs.items()]
        if not args.no_anatomy:
            variants += [(f"context={c}", first, c, True, True) for c in (0, 64, 1024) if c + block <= capacity]
            variants += [("no q/k norm", first, context, False, True), ("no cache write", first, context, True, False),
                         ("context=0, no norm, no write", first, 0, False, False)]
        for name, cfg, ctx, qk_norm, write in variants:
            fn = layers_fn(lambda q, k, v, s, b, cfg=cfg, n=qk_norm, w=write: fused(hd, q, k, v, s, b, cfg,
                                                                                     qk_norm=n, write=w), layers)
            starts, blk_lens = jnp.full((args.batch,), ctx, jnp.int32), jnp.full((args.batch,), block, jnp.int32)
            caches = [[k_all[i] + 0 for i in range(layers)], [v_all[i] + 0 for i in range(layers)]]

            def run():
                total, caches[0], caches[1] = fn(qkvs, caches[0], caches[1], starts, blk_lens)
                jax.block_until_ready(total)

            trace_dir = os.path.join(args.kernel_profile, f"b{block}_{name}".replace(" ", "_").replace("/", "_"))
            try:
                durs = timing.gpu_kernel_times(run, trace_dir)
                if durs is None:
                    raise RuntimeError(f"no trace written under {trace_dir}")
            except Exception as err:  # noqa: BLE001  (one failing variant must not lose the others)
                print(f"  block {block:2d} {name:30s} FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
                continue
            kernel = {n: statistics.median(d) for n, d in durs.items() if "cached_attention" in n}
            others = sum(sum(d) for n, d in durs.items() if n not in kernel) / (3 * layers)
            rows.append(dict(batch=args.batch, block=block, variant=name,
                             kernel_us=max(kernel.values(), default=float("nan")), other_us_per_layer=others))
            print(f"  block {block:2d} {name:30s} kernel {rows[-1]['kernel_us']:6.2f} us   "
                  f"(other kernels {others:5.2f} us/layer: the harness's sums)", flush=True)
            caches.clear()  # this variant's caches go before the next one's are made
    timing.write_json(args.out, rows)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="a directory (block attention) or a JSON file (--cached)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test (interpret mode)")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds before skipping work")
    ap.add_argument("--skip", default="", help="comma list of: check,draft,sweep,train")
    ap.add_argument("--short", action="store_true", help="the sweep only over split counts")
    ap.add_argument("--cached", action="store_true", help="the fused cached attention instead (see above)")
    ap.add_argument("--layers", type=int, default=36, help="--cached: layers per timed call")
    ap.add_argument("--context", type=int, default=512, help="--cached: context tokens per row")
    ap.add_argument("--capacity", type=int, default=1152, help="--cached: cache positions")
    ap.add_argument("--reps", type=int, default=20, help="--cached: timed calls per variant")
    ap.add_argument("--kernel-profile", default=None, metavar="DIR",
                    help="--cached: only the kernel's GPU time per variant, off traces under DIR")
    ap.add_argument("--sweep", default="default;min_chunk=128;min_chunk=64;min_chunk=64,num_stages=1;"
                    "min_chunk=64,num_stages=2;min_chunk=64,num_warps=8;num_splits=8",
                    help="--kernel-profile's tile configs, ';'-separated (the first also runs the anatomy)")
    ap.add_argument("--blocks", default="1,16", help="--kernel-profile's query slots per row")
    ap.add_argument("--batch", type=int, default=1, help="--kernel-profile's rows per call")
    ap.add_argument("--no-anatomy", action="store_true", help="--kernel-profile: only the --sweep configs")
    args = ap.parse_args()
    log(f"{timing.device_line()}; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    if not args.cached:
        return block_main(args)
    hd = heads(args.tiny)
    layers, capacity, context = (2, 128, 40) if args.tiny else (args.layers, args.capacity, args.context)
    log(f"cached attention: {layers} layers, context {context}, capacity {capacity}")
    if args.kernel_profile:
        kernel_profile(args, hd, min(layers, 8), capacity, context)
    else:
        rows = cached_timings(args, hd, layers, capacity, context)
        return 0 if all(r["ok"] for r in rows) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
