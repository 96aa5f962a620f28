"""The fused cached attention (q/k norm + RoPE + cache write + attention in one kernel) against the
unfused path, on 36 layers of Qwen3-8B attention shapes.

Usage (on the H200):  python3 bench/bench_cached_attention.py --out $OUT/cached.json
Kernel time alone per variant (profiler):  ... --kernel-profile /tmp/kprof --out $OUT/kernel.json
CPU dry run (tiny shapes, interpret mode):  python bench/bench_cached_attention.py --tiny

For every (batch, block) it first checks, on the device, the kernel against the unfused reference
(``layers.Attention.attend_unfused`` with ``impl="xla"``: norms + RoPE + ``block_attention_reference``
+ cache writes), then times one call of all 36 layers' attention with the caches donated, from
the raw fused projection ``qkv [batch, block, 8, 6, 128]`` to the attention output, for:

- ``fused``: ``kernels_pallas.cached_block_attention`` (and tile variants);
- ``unfused-pallas``: XLA's norm / RoPE / pads / cache writes around the block-attention kernel
  (the engine's path before the fused kernel);
- ``unfused-xla``: the same with the XLA attention reference over the whole cache.

The QKV matmul is not in the timed region (it is the same for all variants). Median of 20 calls
after warm-up, each ended by ``block_until_ready``; random bf16 inputs, contexts of 512 tokens in a
cache of 1152 positions (the engine's capacity for max_length 1024).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import kernels_pallas  # noqa: E402
from bench_engine import gpu_span_durations, int_fields  # noqa: E402
from dflash_jax.layers import Attention, rope_inv_freq  # noqa: E402
from kernels_pallas.block_attention_gpu import GpuConfig  # noqa: E402


def build(tiny: bool, dtype):
    """One Qwen3-8B attention module (fused layout) and the shapes around it."""
    heads, kv_heads, head_dim, hidden = (8, 2, 32, 64) if tiny else (32, 8, 128, 4096)
    attn = Attention(hidden, heads, kv_heads, head_dim, eps=1e-6, qk_norm=True, bias=False,
                     inv_freq=rope_inv_freq(head_dim, 1e6, None), dtype=dtype, rngs=nnx.Rngs(0))
    attn.q_norm.weight[...] = (1 + 0.2 * jax.random.normal(jax.random.key(1), (head_dim,))).astype(dtype)
    attn.k_norm.weight[...] = (1 + 0.2 * jax.random.normal(jax.random.key(2), (head_dim,))).astype(dtype)
    attn.fuse()
    return attn


def unfused(attn: Attention, qkv, k_cache, v_cache, starts, blk_lens, impl):
    """The pre-kernel path from the raw projection (``Attention.attend_unfused``, with ``impl``'s
    attention)."""
    out, k_cache, v_cache = attn.attend_unfused(qkv, starts, k_cache, v_cache, blk_lens, impl=impl)
    return out[:, 0], k_cache, v_cache


def fused(attn: Attention, qkv, k_cache, v_cache, starts, blk_lens, config=None, *, qk_norm=True, write=True):
    return kernels_pallas.cached_block_attention(
        qkv, k_cache, v_cache, starts, blk_lens, attn.q_norm.weight[...], attn.k_norm.weight[...],
        jnp.asarray(attn.inv_freq, jnp.float32), eps=attn.eps, qk_norm=qk_norm, write=write, config=config)


def kernel_profile(attn: Attention, layers: int, capacity: int, context: int, out_dir: str,
                   sweep: dict[str, dict], blocks: tuple[int, ...] = (1, 16), anatomy: bool = True,
                   batch: int = 1) -> list[dict]:
    """GPU time of the fused kernel alone, per variant, read off a profiler trace (no harness in it):
    what the ~8.7 us per layer of the engine's batch-1 attention is made of. Variants: the tile
    config, the context length (0 = the fixed cost of a program), the q/k norm, the cache write.
    Each variant runs ``layers`` kernels per call, 3 traced calls; median per kernel name.

    Each variant with the q/k norm is first checked on the device against the XLA reference
    (layer 0), and for determinism: 20 calls of one layer must give bit-identical outputs (a
    variant that merges its splits across programs could race).

    ``sweep``: tile configs by name (``GpuConfig`` fields; ``{}`` is the default); ``blocks``: the
    query slots per row; ``anatomy``: also the context, norm and write variants of the first config;
    ``batch``: rows per call (each with the same context)."""
    kv_heads, head_dim = attn.num_kv_heads, attn.head_dim
    groups = attn.num_heads // kv_heads
    configs = {name: GpuConfig(**kw) for name, kw in sweep.items()}
    rows = []
    for block in blocks:
        keys = jax.random.split(jax.random.key(block), 3)
        qkvs = jax.random.normal(keys[0], (layers, batch, block, kv_heads, groups + 2, head_dim), jnp.bfloat16)
        shape = (layers, batch, capacity, kv_heads, head_dim)
        k_all, v_all = (jax.random.normal(k, shape, jnp.bfloat16) for k in keys[1:])
        variants = [(name, cfg, context, True, True) for name, cfg in configs.items()]
        best = configs[next(iter(configs))]
        if anatomy:
            variants += [(f"context={c}", best, c, True, True) for c in (0, 64, 1024) if c + block <= capacity]
            variants += [("no q/k norm", best, context, False, True), ("no cache write", best, context, True, False),
                         ("context=0, no norm, no write", best, 0, False, False)]
        for name, cfg, ctx, qk_norm, write in variants:
            def one(q, k, v, s, b, cfg=cfg, qk_norm=qk_norm, write=write):
                return fused(attn, q, k, v, s, b, cfg, qk_norm=qk_norm, write=write)

            starts, blk_lens = jnp.full((batch,), ctx, jnp.int32), jnp.full((batch,), block, jnp.int32)
            error, deterministic = None, None
            if qk_norm:
                single = jax.jit(lambda q, k, v, one=one, s=starts, b=blk_lens: one(q, k, v, s, b)[0])
                want = jax.jit(lambda q, k, v, s=starts, b=blk_lens: unfused(attn, q, k, v, s, b, "xla")[0])(
                    qkvs[0], k_all[0], v_all[0])
                outs = [np.asarray(single(qkvs[0], k_all[0], v_all[0]), np.float32) for _ in range(20)]
                w = np.asarray(want, np.float32)
                error = float(np.linalg.norm(outs[0] - w) / (np.linalg.norm(w) + 1e-9))
                deterministic = all(np.array_equal(o, outs[0]) for o in outs[1:])
            fn = layers_fn(one, layers)
            caches = [[k_all[i] + 0 for i in range(layers)], [v_all[i] + 0 for i in range(layers)]]

            def run():  # called right here, so the loop's variables are the ones meant
                total, caches[0], caches[1] = fn(qkvs, caches[0], caches[1], starts, blk_lens)
                jax.block_until_ready(total)

            try:
                trace_dir = str(Path(out_dir) / f"b{block}_{name}".replace(" ", "_").replace("/", "_"))
                durs = gpu_span_durations(run, trace_dir, calls=3)
                if durs is None:
                    raise RuntimeError(f"no trace written under {trace_dir}")
            except Exception as err:  # noqa: BLE001  (one failing variant must not lose the others)
                print(f"  block {block:2d} {name:30s} FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
                continue
            kernel = {n: statistics.median(d) for n, d in durs.items() if "cached_attention" in n}
            others = sum(sum(d) for n, d in durs.items() if n not in kernel) / (3 * layers)
            row = dict(batch=batch, block=block, variant=name, kernel_us=max(kernel.values(), default=float("nan")),
                       other_us_per_layer=others, error=error, deterministic=deterministic)
            rows.append(row)
            check = "" if error is None else (f"  error {error:.1e}{'' if error < 1e-2 else ' MISMATCH'}"
                                              f"{'' if deterministic else ' NONDETERMINISTIC'}")
            print(f"  block {block:2d} {name:30s} kernel {row['kernel_us']:6.2f} us   "
                  f"(other kernels {others:5.2f} us/layer: the harness's sums){check}", flush=True)
            caches.clear()  # frees this variant's caches before the next one's are made
    return rows


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--capacity", type=int, default=1152)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernel-profile", default=None, metavar="DIR",
                    help="only the per-variant kernel times from a profiler trace (traces under DIR)")
    ap.add_argument("--sweep", default="default;min_chunk=128;min_chunk=64;min_chunk=64,num_stages=1;"
                    "min_chunk=64,num_stages=2;min_chunk=64,num_warps=8;num_splits=8",
                    help="--kernel-profile's tile configs, ';'-separated (the first also runs the context, "
                         "norm and write variants)")
    ap.add_argument("--blocks", default="1,16", help="--kernel-profile's query slots per row, comma-separated")
    ap.add_argument("--batch", type=int, default=1, help="--kernel-profile's rows per call")
    ap.add_argument("--no-anatomy", action="store_true",
                    help="--kernel-profile: only the --sweep configs (no context, norm and write variants)")
    args = ap.parse_args()
    dtype = jnp.bfloat16
    layers = 2 if args.tiny else args.layers
    capacity = 128 if args.tiny else args.capacity
    context = 40 if args.tiny else args.context
    attn = build(args.tiny, dtype)
    kv_heads, head_dim = attn.num_kv_heads, attn.head_dim
    groups = attn.num_heads // kv_heads
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {layers} layers, context {context}, "
          f"capacity {capacity}", flush=True)

    if args.kernel_profile:
        sweep = {name: {} if name == "default" else int_fields(name) for name in args.sweep.split(";")}
        rows = kernel_profile(attn, min(layers, 8), capacity, context, args.kernel_profile, sweep,
                              tuple(int(b) for b in args.blocks.split(",")), anatomy=not args.no_anatomy,
                              batch=args.batch)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2))
        return

    results = []
    for batch, block in ((1, 1), (1, 16), (16, 1), (16, 16)):
        keys = jax.random.split(jax.random.key(batch * 100 + block), 3)
        qkvs = jax.random.normal(keys[0], (layers, batch, block, kv_heads, groups + 2, head_dim), dtype)
        shape = (layers, batch, capacity, kv_heads, head_dim)
        k_all = jax.random.normal(keys[1], shape, dtype)
        v_all = jax.random.normal(keys[2], shape, dtype)
        starts = jnp.full((batch,), context, jnp.int32)
        blk_lens = jnp.full((batch,), block, jnp.int32)

        # correctness on the device: layer 0, the kernel against the XLA reference path
        want = jax.jit(lambda q, k, v: unfused(attn, q, k, v, starts, blk_lens, "xla"))(qkvs[0], k_all[0], v_all[0])
        got = jax.jit(lambda q, k, v: fused(attn, q, k, v, starts, blk_lens))(qkvs[0], k_all[0], v_all[0])
        errs = {}
        for name, g, w in zip(("out", "k_cache", "v_cache"), got, want):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            errs[name] = float(np.linalg.norm(g - w) / (np.linalg.norm(w) + 1e-9))
        ok = all(e < 1e-2 for e in errs.values())
        print(f"batch {batch} block {block}: relative error {errs} -> {'OK' if ok else 'MISMATCH'}", flush=True)

        variants = {
            "fused": lambda q, k, v, s, b: fused(attn, q, k, v, s, b),
            "unfused-pallas": lambda q, k, v, s, b: unfused(attn, q, k, v, s, b, "pallas"),
            "unfused-xla": lambda q, k, v, s, b: unfused(attn, q, k, v, s, b, "xla"),
        }
        for name, cfg in (("block_k=32", GpuConfig(block_k=32)), ("block_k=128", GpuConfig(block_k=128)),
                          ("num_warps=8", GpuConfig(num_warps=8)), ("num_stages=2", GpuConfig(num_stages=2))):
            variants[f"fused {name}"] = lambda q, k, v, s, b, cfg=cfg: fused(attn, q, k, v, s, b, cfg)
        row = dict(batch=batch, block=block, errors=errs, ok=ok, times_us={})
        for name, one in variants.items():
            fn = layers_fn(one, layers)
            ks, vs = [k_all[i] + 0 for i in range(layers)], [v_all[i] + 0 for i in range(layers)]
            try:
                total, ks, vs = fn(qkvs, ks, vs, starts, blk_lens)
                jax.block_until_ready(total)
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    total, ks, vs = fn(qkvs, ks, vs, starts, blk_lens)
                    jax.block_until_ready(total)
                    times.append(time.perf_counter() - t0)
                row["times_us"][name] = statistics.median(times) * 1e6
                print(f"  {name:28s} {row['times_us'][name]:9.1f} us per {layers} layers "
                      f"({row['times_us'][name] / layers:6.2f} us/layer)", flush=True)
            except Exception as err:  # noqa: BLE001  (one failing variant must not lose the others)
                print(f"  {name:28s} FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
            del ks, vs
        results.append(row)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))

    print("\nbatch | block | fused us/layer | unfused-pallas | unfused-xla | fused / unfused-pallas")
    for r in results:
        t = r["times_us"]
        f, p, x = (t.get(k, float("nan")) / layers for k in ("fused", "unfused-pallas", "unfused-xla"))
        print(f"{r['batch']:5d} | {r['block']:5d} | {f:14.2f} | {p:14.2f} | {x:11.2f} | {f / p:6.2f}")


if __name__ == "__main__":
    main()
