"""Pallas's two GPU lowerings side by side: the Triton kernels against their Mosaic GPU ports.

Attention over a KV cache (Qwen3-8B heads: 32 q / 8 kv, head_dim 128, bf16) at contexts 1k / 4k /
16k / 32k (the cache full), batches 1 / 8 / 32, a verify block (16 slots, causal; ``--blocks 1,16``
adds the decode token):

- ``triton``: ``kernels_pallas.block_attention`` (Triton), the queries already normed and rotated;
- ``mosaic``: the same call with ``lowering="mosaic"`` (``block_attention/mosaic_gpu.py``);
- ``mosaic_ctx``: its Mosaic GPU kernel alone (``attention_partials``: the context's and the block's
  split partials, without XLA's packing of the inputs before and the split merge after);
- ``fused``: ``ops.attention.cached_attention`` on the Triton lowering from the raw QKV projection
  (the fused kernel: q/k norms, RoPE, attention; caches only read, as the drafter's blocks);
- ``mosaic_ops``: the same call on ``gpu_lowering="mosaic"`` (the prologue in XLA,
  ``cached_attention_prologue``, then ``attend_and_write``: ~12 small kernels and the packing around
  the Mosaic GPU attention and the merge of its splits).

Each case is a chain of 8 dependent calls in one jit (the host's dispatch would dominate the small
ones); bandwidth counts the context K/V read once, in % of 4.3 TB/s. ``mosaic vs triton`` is the
largest relative difference of the two kernels' outputs (a sanity check; correctness is
tests/gpu/test_gpu_mosaic.py). Then the training pattern (``--train``: batch 1 x 4,096 tokens x 512
anchor blocks of 16 and batch 2 x 2,048 x 256, bidirectional, the Qwen3-8B drafter's heads): the
forward, the backward kernels alone and a training step's attention (forward + backward) on each
lowering (Triton: gpu.py + gpu_bwd.py; Mosaic GPU: mosaic_gpu.py + mosaic_gpu_bwd.py); the Mosaic
GPU attention's tile / split configs on the batch-1 token at the longest context (``MosaicConfig``:
stages, splits, 128-key tiles). Every variant runs on its own: one that fails to compile or run
prints its error and the others are still timed.

    python3 bench/bench_mosaic.py --json bench/results/mosaic.json     # attention cases start until --budget-s
    JAX_PLATFORMS=cpu python3 bench/bench_mosaic.py --tiny       # smoke test (interpret modes)
    python3 bench/bench_mosaic.py --skip attention,sweep --json bench/results/mosaic_train.json  # training
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import timing
from dflash_jax.ops import OpsConfig
from dflash_jax.ops import attention as attention_ops
from dflash_jax.ops.rope import rope_inv_freq
from kernels_pallas.block_attention import block_attention, block_attention_fwd, mosaic_gpu_bwd
from kernels_pallas.block_attention.mosaic_gpu_bwd import MosaicBwdConfig
from kernels_pallas.block_attention.gpu_bwd import block_attention_bwd_pallas
from kernels_pallas.block_attention.mosaic_gpu import MosaicConfig, attention_partials, pack_inputs, plan

CHAIN = 8


def log(msg: str = "") -> None:
    print(msg, flush=True)


def chained(fn, chain: int):
    """jit of ``chain`` dependent calls of ``fn(x, *rest)`` (x_{i+1} = x_i + [out_i == inf], which is
    x_i): returns ``(x, the last out)``; the host's dispatch is paid once per ``chain`` calls."""
    def run(x, *rest):
        out = None
        for _ in range(chain):
            out = fn(x, *rest)
            flat = (out[0] if isinstance(out, (tuple, list)) else out).reshape(-1)[: x.size]
            bump = jnp.pad(jnp.where(flat == jnp.inf, 1, 0).astype(x.dtype), (0, x.size - flat.size))
            x = x + bump.reshape(x.shape)
        return x, out
    return jax.jit(run)


def timed(name: str, fn, args, row: dict, *, chain: int, repeats: int, nbytes: float | None):
    """Times ``fn`` into ``row[name + "_us"]`` (and its bandwidth); an error is recorded and printed,
    never raised, so the other variants still run. Returns the call's output (None on an error)."""
    try:
        sec = timing.per_call_time(fn, *args, repeats=repeats) / chain
        row[name + "_us"] = sec * 1e6
        if nbytes is not None:
            row[name + "_bw"] = nbytes / sec / timing.HBM_BYTES_PER_S
        return fn(*args)[1]
    except Exception as e:  # noqa: BLE001  (a kernel that does not compile must not stop the others)
        row[name + "_us"] = None
        row[name + "_err"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        log(f"  {name}: {row[name + '_err']}")
        return None


def attention_cases(args, shapes) -> list[dict]:
    hq, hkv, d = shapes
    groups = hq // hkv
    inv_freq = tuple(float(f) for f in rope_inv_freq(d, 1e6, None))
    mosaic_cfg = MosaicConfig(splits=1) if args.tiny else MosaicConfig()
    kernels = OpsConfig(attention="pallas")
    mosaic_ops_cfg = OpsConfig(attention="pallas", gpu_lowering="mosaic")
    rows, t_start = [], time.time()

    def ops_call(ops, qkv, k_cache, v_cache, starts, blk_lens, q_norm, k_norm):
        return attention_ops.cached_attention(qkv, starts, k_cache, v_cache, blk_lens, q_norm=q_norm, k_norm=k_norm,
                                              eps=1e-6, inv_freq=inv_freq, num_heads=hq, causal=False, write=False,
                                              ops=ops)[0]

    def lowered(lowering, config=None):
        return lambda q, kb, vb, kc, vc, s, bl: block_attention(
            q[:, None], kc, vc, s[:, None], kb[:, None], vb[:, None], bl[:, None], causal=True, config=config,
            lowering=lowering)[:, 0]

    def mosaic_kernel(packed, kc, vc, s, bl, *, block):
        return attention_partials(packed, kc, vc, s, bl, block=block, groups=groups, causal=True,
                                  scale=d ** -0.5, config=mosaic_cfg)

    variants = {
        "triton": lowered("triton"),
        "mosaic": lowered("mosaic", mosaic_cfg),
        "mosaic_ctx": None,  # per block size, below
        "fused": functools.partial(ops_call, kernels),
        "mosaic_ops": functools.partial(ops_call, mosaic_ops_cfg),
    }
    fns = {name: fn and chained(fn, args.chain) for name, fn in variants.items()}
    kernel_fns = {block: chained(functools.partial(mosaic_kernel, block=block), args.chain) for block in args.blocks}
    for ctx in args.contexts:
        for batch in args.batches:
            for block in args.blocks:
                if time.time() - t_start > args.budget_s:
                    log(f"(time budget reached: skipping T={ctx} B={batch} block={block})")
                    continue
                ks = jax.random.split(jax.random.key(ctx + 7 * batch + block), 8)
                dt = jnp.bfloat16
                q = timing.normal(ks[0], (batch, block, hq, d), dt)
                k_blk, v_blk = (timing.normal(k, (batch, block, hkv, d), dt) for k in ks[1:3])
                k_cache, v_cache = (timing.normal(k, (batch, ctx, hkv, d), dt) for k in ks[3:5])
                starts = jnp.full((batch,), ctx, jnp.int32)
                blk_lens = jnp.full((batch,), block, jnp.int32)
                qkv = timing.normal(ks[5], (batch, block, hkv, groups + 2, d), dt)
                norms = [(1 + 0.1 * timing.normal(k, (d,), jnp.float32)).astype(dt) for k in ks[6:8]]
                kv_bytes = 2 * batch * ctx * hkv * d * 2
                tiles = -(-block * groups // 64)
                row = dict(kind="attention", ctx=ctx, batch=batch, block=block, kv_bytes=kv_bytes,
                           mosaic_splits=plan(batch, hkv, tiles, ctx, mosaic_cfg)[0])
                kernel_args = (q, k_blk, v_blk, k_cache, v_cache, starts, blk_lens)
                ops_args = (qkv, k_cache, v_cache, starts, blk_lens, *norms)
                packed = pack_inputs(q[:, None], k_blk[:, None], v_blk[:, None], mosaic_cfg.block_k)
                fns["mosaic_ctx"] = kernel_fns[block]
                inputs = dict(fused=ops_args, mosaic_ops=ops_args, mosaic_ctx=(packed, k_cache, v_cache, starts, blk_lens))
                outs = {}
                for name, fn in fns.items():
                    outs[name] = timed(name, fn, inputs.get(name, kernel_args), row, chain=args.chain,
                                       repeats=args.repeats, nbytes=kv_bytes)
                if outs["triton"] is not None and outs["mosaic"] is not None:
                    row["mosaic_vs_triton"] = timing.relative_error(outs["mosaic"], outs["triton"])
                if outs["fused"] is not None and outs["mosaic_ops"] is not None:
                    row["mosaic_ops_vs_fused"] = timing.relative_error(outs["mosaic_ops"], outs["fused"])
                rows.append(row)
                cells = " | ".join(f"{n} " + ("  failed      " if row.get(n + "_us") is None else
                                              f"{row[n + '_us']:8.1f} {100 * row[n + '_bw']:3.0f}%")
                                   for n in fns)
                check = row.get("mosaic_vs_triton")
                check = "n/a" if check is None else f"{check:.1e}" + (" MISMATCH" if check > 2e-2 else "")
                ops_check = row.get("mosaic_ops_vs_fused")
                check += " / ops " + ("n/a" if ops_check is None else f"{ops_check:.1e}"
                                      + (" MISMATCH" if ops_check > 2e-2 else ""))
                log(f"T={ctx:>6} B={batch:>3} blk={block:>2} S={row['mosaic_splits']:>3} | {cells} | diff {check}")
    return rows


SWEEP = [MosaicConfig(), MosaicConfig(stages=3), MosaicConfig(stages=6), MosaicConfig(splits=32, wide_stages=2),
         MosaicConfig(splits=32, wide_stages=3), MosaicConfig(block_k=128, stages=2),
         MosaicConfig(block_k=128, stages=3),
         MosaicConfig(block_k=128, splits=32, wide_stages=2)]


def sweep_cases(args, shapes) -> list[dict]:
    """The Mosaic GPU attention's tile and split configs on the batch-1 decode token at the longest
    context (the bandwidth target)."""
    hq, hkv, d = shapes
    ctx = max(args.contexts)
    ks = jax.random.split(jax.random.key(1), 5)
    q = timing.normal(ks[0], (1, 1, hq, d), jnp.bfloat16)
    k_blk, v_blk = (timing.normal(k, (1, 1, hkv, d), jnp.bfloat16) for k in ks[1:3])
    k_cache, v_cache = (timing.normal(k, (1, ctx, hkv, d), jnp.bfloat16) for k in ks[3:5])
    kernel_args = (q, k_blk, v_blk, k_cache, v_cache, jnp.full((1,), ctx, jnp.int32), jnp.ones((1,), jnp.int32))
    kv_bytes, rows = 2 * ctx * hkv * d * 2, []
    for cfg in SWEEP[:2] if args.tiny else SWEEP:
        fn = chained(lambda q, kb, vb, kc, vc, s, bl, cfg=cfg: block_attention(
            q[:, None], kc, vc, s[:, None], kb[:, None], vb[:, None], bl[:, None], causal=True, config=cfg,
            lowering="mosaic")[:, 0], args.chain)
        row = dict(kind="sweep", ctx=ctx, batch=1, block=1, config=str(cfg), kv_bytes=kv_bytes,
                   splits_stages=plan(1, hkv, 1, ctx, cfg))
        timed("mosaic", fn, kernel_args, row, chain=args.chain, repeats=args.repeats, nbytes=kv_bytes)
        rows.append(row)
        cell = ("failed" if row.get("mosaic_us") is None
                else f"{row['mosaic_us']:8.1f} us {100 * row['mosaic_bw']:3.0f}%")
        log(f"T={ctx} B=1 token (splits, stages)={row['splits_stages']} {cfg} | {cell}")
    return rows


BWD_SWEEP = [(3, 2), (2, 3), (3, 3)]  # (dq_stages, dkv_stages) beside the default (2, 2)


def training_cases(args, shapes) -> list[dict]:
    """The training pattern per ``--train`` shape (batch x tokens x anchor blocks of 16 per row, each
    over the context before its anchor, bidirectional inside the block): ms per call of the forward
    (``triton_fwd``, ``mosaic_fwd``), the backward kernels alone from the same forward output, lse and
    output gradient (``triton_bwd``: gpu_bwd.py; ``mosaic_bwd``: mosaic_gpu_bwd.py), and a training
    step's attention, forward + backward, each lowering end to end (``triton_step``, ``mosaic_step``);
    at the first shape also the Mosaic GPU backward at other pipeline depths (``mosaic_bwd_<dq><dkv>``).
    ``fwd diff`` / ``bwd diff``: the largest relative difference of the two lowerings' outputs and
    gradients (sanity; correctness is tests/gpu/test_gpu_mosaic.py)."""
    hq, hkv, d = shapes
    train = [(1, 128, 4)] if args.tiny else args.train
    block = 4 if args.tiny else 16
    rows, t_start = [], time.time()
    for b, t, n in train:
        if time.time() - t_start > args.budget_s:
            log(f"(time budget reached: skipping train B={b} seq={t} anchors={n})")
            continue
        ks = jax.random.split(jax.random.key(21 + t + n), 6)
        dt = jnp.bfloat16
        q = timing.normal(ks[0], (b, n, block, hq, d), dt)
        k_ctx, v_ctx = (timing.normal(k, (b, t, hkv, d), dt) for k in ks[1:3])
        k_blk, v_blk = (timing.normal(k, (b, n, block, hkv, d), dt) for k in ks[3:5])
        ctx_lens = jnp.asarray(np.sort(np.random.default_rng(t).integers(0, t - block + 1, (b, n))), jnp.int32)
        blk_lens = jnp.full((b, n), block, jnp.int32)
        cotangent = timing.normal(ks[5], q.shape, dt)
        kernel_args = (q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens)
        scale, on_cpu = d ** -0.5, jax.default_backend() != "gpu"
        out, lse = block_attention_fwd(*kernel_args, causal=False, lowering="triton")
        backward = {
            "triton": lambda *a: block_attention_bwd_pallas(*a, causal=False, scale=scale, interpret=on_cpu),
            "mosaic": lambda *a: mosaic_gpu_bwd.backward(*a, causal=False, scale=scale),
        }

        def forward(lowering):
            return jax.jit(lambda q, kc, vc, kb, vb: block_attention(q, kc, vc, ctx_lens, kb, vb, blk_lens,
                                                                     causal=False, lowering=lowering))

        def step(lowering):  # bwd="pallas": a GPU's default, and the kernels (interpreted) on the CPU
            def loss(q, kc, vc, kb, vb, ct):
                out = block_attention(q, kc, vc, ctx_lens, kb, vb, blk_lens, causal=False, lowering=lowering,
                                      bwd="pallas")
                return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

        row = dict(kind="train", batch=b, seq=t, anchors=n, block=block)
        outs = {}
        for lowering in ("triton", "mosaic"):
            for what, fn, fargs in (("fwd", forward(lowering), (q, k_ctx, v_ctx, k_blk, v_blk)),
                                    ("bwd", jax.jit(backward[lowering]), (*kernel_args, out, lse, cotangent)),
                                    ("step", step(lowering), (q, k_ctx, v_ctx, k_blk, v_blk, cotangent))):
                name = f"{lowering}_{what}"
                try:  # ms-scale calls: timed one by one
                    row[name + "_ms"] = timing.median_time(fn, *fargs, repeats=max(args.repeats, 5))[0] * 1e3
                    if what != "step":
                        outs[name] = fn(*fargs)
                except Exception as e:  # noqa: BLE001  (a variant that fails must not stop the others)
                    row[name + "_ms"] = None
                    row[name + "_err"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
                    log(f"  {name}: {row[name + '_err']}")
        for what in ("fwd", "bwd"):
            if f"triton_{what}" in outs and f"mosaic_{what}" in outs:
                row[f"{what}_mosaic_vs_triton"] = max(
                    timing.relative_error(m, t) for m, t in zip(jax.tree.leaves(outs[f"mosaic_{what}"]),
                                                                jax.tree.leaves(outs[f"triton_{what}"])))
        if (b, t, n) == train[0]:  # the Mosaic GPU backward's pipeline depths, at the first shape
            for depths in BWD_SWEEP[:1] if args.tiny else BWD_SWEEP:
                cfg = MosaicBwdConfig(*depths)
                fn = jax.jit(lambda *a, cfg=cfg: mosaic_gpu_bwd.backward(*a, causal=False, scale=scale, config=cfg))
                try:
                    row[f"mosaic_bwd_{depths[0]}{depths[1]}_ms"] = timing.median_time(
                        fn, *kernel_args, out, lse, cotangent, repeats=max(args.repeats, 5))[0] * 1e3
                except Exception as e:  # noqa: BLE001
                    row[f"mosaic_bwd_{depths[0]}{depths[1]}_ms"] = None
                    log(f"  mosaic_bwd {cfg}: {type(e).__name__}: {str(e).strip()[:200]}")
        rows.append(row)
        cells = " | ".join(f"{k[:-3]} " + ("failed" if v is None else f"{v:7.3f}")
                           for k, v in row.items() if k.endswith("_ms"))
        diffs = " ".join(f"{w} diff {row.get(w + '_mosaic_vs_triton', float('nan')):.1e}" for w in ("fwd", "bwd"))
        log(f"train B={b} seq={t} anchors={n} block={block} | {cells} ms | {diffs}")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="32768,16384,4096,1024")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--blocks", default="16", help="query slots per row (1: a decode token; 16: a verify block)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chain", type=int, default=CHAIN)
    ap.add_argument("--train", default="1x4096x512,2x2048x256",
                    help="training pattern shapes, batch x tokens x anchor blocks per row, comma separated")
    ap.add_argument("--budget-s", type=float, default=50.0,
                    help="stop starting attention cases, and training shapes, after this many seconds of each")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: attention,train,sweep")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, interpret modes")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    args.contexts, args.batches, args.blocks = map(ints, (args.contexts, args.batches, args.blocks))
    args.train = [tuple(int(x) for x in shape.split("x")) for shape in args.train.split(",") if shape]
    shapes = (32, 8, 128)
    if args.tiny:
        args.contexts, args.batches, args.blocks = [128], [1], [1, 4]
        args.repeats, args.chain = 1, 1
        shapes = (4, 2, 64)
    skip = set(filter(None, args.skip.split(",")))
    log(timing.device_line())
    t0 = time.time()
    result = dict(device=timing.device_line(), hbm_bytes_per_s=timing.HBM_BYTES_PER_S, chain=args.chain)
    if "attention" not in skip:
        log(f"== attention over a full cache, {shapes[0]}q/{shapes[1]}kv heads of {shapes[2]}, bf16: us per call, "
            f"% of {timing.HBM_BYTES_PER_S / 1e12:.1f} TB/s ==")
        result["attention"] = attention_cases(args, shapes)
    if "train" not in skip:
        log("== block attention, training pattern, bf16: ms per call ==")
        result["train"] = training_cases(args, shapes)
    if "sweep" not in skip:
        log("== Mosaic GPU attention configs, batch-1 decode token at the longest context ==")
        result["sweep"] = sweep_cases(args, shapes)
    result["wall_s"] = time.time() - t0
    log(f"total {result['wall_s']:.0f} s")
    timing.write_json(args.json, result)


if __name__ == "__main__":
    main()
