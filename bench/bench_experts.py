"""The routed experts of one MoE layer alone, by implementation, against the bytes of the experts touched.

The Mosaic GPU expert-products kernel (``kernels_pallas.experts``, what ``OpsConfig.gpu_lowering =
"mosaic"`` runs for decode and verify steps) beside the XLA implementations of
``ops.experts.routed_experts`` ("gemv", "ragged_dot", "capacity"), at Qwen3-30B-A3B shapes (bf16, 128
experts, top-8, hidden 2,048, expert intermediate 768) and gpt-oss-20b shapes (MXFP4, 32 experts,
top-4, hidden 2,880, intermediate 2,880, biases, clamped SwiGLU), for 1 and 16 tokens of random
routing (a softmax router over random logits).

Every output is first held to the reference (``ragged_dot``; on the CPU in ``--tiny`` mode the dense
``routed_experts_reference``); an implementation that fails to compile or is off the reference is
reported as such (``failed`` in the JSON) and not timed. Times are per layer: each timed call runs ``--layers`` layers back to
back, each with its own weights and routing, so a layer's experts are not in the L2 cache from the call
before (gpt-oss's 4 touched experts are 52 MB, the H200's L2 50 MB). The roofline: the bytes of the
experts the routing touches (codes and scales for MXFP4, biases) at ``timing.HBM_BYTES_PER_S``.
"mosaic kernels" is the kernel's two calls alone (gate-up and down products on prepared rows), without
the grouping, activation and combination XLA runs around them in "mosaic".

    python3 bench/bench_experts.py --json $OUT/experts.json       # < 90 s on an H200
    JAX_PLATFORMS=cpu python3 bench/bench_experts.py --tiny         # smoke test (interpret mode: jax >= 0.11)
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

import timing
from dflash_jax.ops.experts import (ExpertWeights, mosaic_kernel_fits, mosaic_routed_experts, route,
                                    routed_experts, routed_experts_reference, touched_experts)
from kernels_pallas._mosaic import mosaic_interpret_available
from kernels_pallas.experts import mosaic_gpu

XLA_IMPLEMENTATIONS = ("gemv", "ragged_dot", "capacity")

# family: (experts, top_k, hidden, intermediate, MXFP4 with biases and gpt-oss's activation)
SHAPES = {"qwen3_moe": (128, 8, 2048, 768, False), "gpt_oss": (32, 4, 2880, 2880, True)}
TINY = {"qwen3_moe": (7, 3, 128, 64, False), "gpt_oss": (5, 2, 128, 64, True)}


def random_experts(key, experts: int, hidden: int, inter: int, quantized: bool) -> ExpertWeights:
    """Random experts in the checkpoints' layouts: bf16 inputs first, or MXFP4 codes of every value with
    scales around 2 ** -5 (outputs first) plus biases, gate and up interleaved (gpt-oss)."""
    ks = jax.random.split(key, 4)

    def mxfp4(k, outputs, inputs):
        kb, kscale = jax.random.split(k)
        blocks = jax.random.randint(kb, (experts, outputs, inputs // 32, 16), 0, 256, jnp.int32).astype(jnp.uint8)
        scales = jax.random.randint(kscale, (experts, outputs, inputs // 32), 120, 124, jnp.int32).astype(jnp.uint8)
        return blocks, scales

    if quantized:
        return ExpertWeights(mxfp4(ks[0], 2 * inter, hidden), mxfp4(ks[1], hidden, inter),
                             timing.normal(ks[2], (experts, 2 * inter), jnp.bfloat16, 0.1),
                             timing.normal(ks[3], (experts, hidden), jnp.bfloat16, 0.1), interleaved=True)
    return ExpertWeights(timing.normal(ks[0], (experts, hidden, 2 * inter), jnp.bfloat16, hidden**-0.5),
                         timing.normal(ks[1], (experts, inter, hidden), jnp.bfloat16, inter**-0.5))


def expert_bytes(w: ExpertWeights) -> float:
    """The bytes of one expert (every leaf of ``w`` over the expert count)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(w)) / w.num_experts


def kernel_products(rows: jax.Array, h: jax.Array, w: ExpertWeights, ids: jax.Array, counts: jax.Array):
    """The kernel's two calls alone: gate-up products of ``rows``, down products of ``h``."""
    def products(r, weight):
        if isinstance(weight, tuple):
            return mosaic_gpu.mxfp4_expert_partials(r, *weight, ids, counts)
        return mosaic_gpu.expert_partials(r, weight, ids, counts)

    return products(rows, w.gate_up), products(h, w.down)


def all_layers(x, routings, layers, fn):
    """Every layer in turn, each output the next layer's input; also the first layer's output (the one
    held to the reference)."""
    first = None
    for r, w in zip(routings, layers):
        x = fn(x, r, w)
        first = x if first is None else first
    return x, first


def bench_family(args, family: str) -> dict:
    num_experts, top_k, hidden, inter, quantized = (TINY if args.tiny else SHAPES)[family]
    activation = "gpt_oss" if quantized else "silu"
    key = jax.random.key(0)
    layers = [random_experts(jax.random.fold_in(key, i), num_experts, hidden, inter, quantized)
              for i in range(args.layers)]
    per_expert = expert_bytes(layers[0])
    mosaic_ok = jax.default_backend() == "gpu" or mosaic_interpret_available()
    report: dict = dict(experts=num_experts, top_k=top_k, hidden=hidden, inter=inter, mxfp4=quantized,
                        expert_bytes=per_expert, tokens={})
    print(f"\n{family}: {num_experts} experts top-{top_k}, hidden {hidden}, intermediate {inter}, "
          f"{'MXFP4' if quantized else 'bf16'}, {per_expert / 1e6:.2f} MB an expert", flush=True)
    for tokens in args.tokens:
        k = jax.random.fold_in(key, 1000 + tokens)
        x = timing.normal(k, (tokens, hidden), jnp.bfloat16)
        routings = [route(jax.random.normal(jax.random.fold_in(k, i), (tokens, num_experts)), top_k,
                          softmax_first=not quantized, normalize=True) for i in range(args.layers)]
        routings = [(weights.astype(jnp.bfloat16), ids) for weights, ids in routings]
        touched = [int(touched_experts(ids, num_experts)) for _, ids in routings]
        roofline = sum(touched) * per_expert / args.layers / timing.HBM_BYTES_PER_S
        impls = {impl: (lambda x, r, w, impl=impl: routed_experts(x, r[1], r[0], w, activation=activation,
                                                                 implementation=impl))
                 for impl in XLA_IMPLEMENTATIONS}
        fits = mosaic_kernel_fits(tokens, layers[0], jnp.bfloat16)
        if mosaic_ok and fits:
            impls["mosaic"] = lambda x, r, w: mosaic_routed_experts(x, r[1], r[0], w, activation)

        if args.tiny:
            want = routed_experts_reference(x, routings[0][1], routings[0][0], layers[0], activation=activation)
        row: dict = dict(touched=touched, roofline_s=roofline, errors={}, seconds={}, failed={})
        for impl in ["ragged_dot"] + [impl for impl in impls if impl != "ragged_dot"]:  # the reference first
            run = jax.jit(functools.partial(all_layers, fn=impls[impl]))
            try:
                first = run(x, routings, layers)[1]  # compiles
            except Exception as e:  # noqa: BLE001 -- a kernel that does not compile here is a result too
                if impl == "ragged_dot" and not args.tiny:
                    raise
                row["failed"][impl] = f"{type(e).__name__}: {str(e)[:400]}"
                print(f"  {impl} failed: {row['failed'][impl]}", flush=True)
                continue
            if impl == "ragged_dot" and not args.tiny:
                want = first
            row["errors"][impl] = timing.relative_error(first, want)
            if row["errors"][impl] > 2e-2:  # not timed: a wrong result's time means nothing
                row["failed"][impl] = f"off the reference by {row['errors'][impl]:.2e} (relative)"
                print(f"  {impl} is {row['failed'][impl]}", flush=True)
                continue
            row["seconds"][impl] = timing.per_call_time(run, x, routings, layers, repeats=args.repeats) / args.layers
        if "mosaic" in impls:
            slots = mosaic_gpu.slots_for(tokens)
            groups = min(tokens * top_k, num_experts)
            rows = timing.normal(k, (groups, slots, hidden), jnp.bfloat16)
            h = timing.normal(k, (groups, slots, inter), jnp.bfloat16)
            groups_of = []
            for _, ids in routings:  # each layer's touched experts, one group each; the padding groups unused
                unique = jnp.unique(ids, size=groups, fill_value=num_experts)
                groups_of.append((jnp.minimum(unique, num_experts - 1), (unique < num_experts).astype(jnp.int32)))

            def kernels_only(rows, h, groups_of, layers):
                return [kernel_products(rows, h, w, ids, counts) for (ids, counts), w in zip(groups_of, layers)]

            try:
                row["seconds"]["mosaic kernels"] = timing.per_call_time(
                    jax.jit(kernels_only), rows, h, groups_of, layers, repeats=args.repeats) / args.layers
            except Exception as e:  # noqa: BLE001
                row["failed"]["mosaic kernels"] = f"{type(e).__name__}: {str(e)[:400]}"
                print(f"  mosaic kernels failed: {row['failed']['mosaic kernels']}", flush=True)
        elif not fits:
            row["mosaic_skipped"] = "shapes the kernel does not take"
        else:
            row["mosaic_skipped"] = "no GPU and no Mosaic GPU interpret mode (jax < 0.11)"
        report["tokens"][tokens] = row
        print(f"  {tokens:3d} tokens, {sum(touched) / len(touched):5.1f} experts touched, roofline "
              f"{roofline * 1e3:.3f} ms: " + ", ".join(
                  f"{impl} {s * 1e3:.3f} ms ({roofline / s:5.1%})" for impl, s in row["seconds"].items())
              + (f"  [mosaic: {row['mosaic_skipped']}]" if "mosaic_skipped" in row else ""), flush=True)
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="qwen3_moe,gpt_oss")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--layers", type=int, default=4, help="layers a timed call runs (each its own weights)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--json", "--out", dest="json", default=None, help="JSON report (e.g. $OUT/experts.json)")
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.tiny:
        args.tokens = [min(t, 3) for t in args.tokens]
        args.layers, args.repeats = min(args.layers, 2), min(args.repeats, 2)
    t0 = time.perf_counter()
    print(timing.device_line(), f"; roofline at {timing.HBM_BYTES_PER_S / 1e12:.1f} TB/s", flush=True)
    report: dict = {"device": timing.device_line(), "args": vars(args)}
    for family in args.families.split(","):
        report[family] = bench_family(args, family)
        timing.write_json(args.json, report)
    impls = ("mosaic", "mosaic kernels") + XLA_IMPLEMENTATIONS
    print(f"\nms per layer (% of the touched experts' roofline)   ({time.perf_counter() - t0:.0f} s)")
    print(f"{'family':10s} {'tokens':>6s} {'touched':>7s} " + " ".join(f"{impl:>16s}" for impl in impls))
    for family in args.families.split(","):
        for tokens, row in report[family]["tokens"].items():
            cells = []
            for impl in impls:
                s = row["seconds"].get(impl)
                cells.append(f"{s * 1e3:7.3f} ({row['roofline_s'] / s:5.1%})" if s else f"{'-':>16s}")
            touched = sum(row["touched"]) / len(row["touched"])
            print(f"{family:10s} {tokens:6d} {touched:7.1f} " + " ".join(cells))
            for impl, why in row["failed"].items():
                print(f"{'':18s} {impl} failed: {why[:200]}")
    report["wall_s"] = time.perf_counter() - t0
    timing.write_json(args.json, report)


if __name__ == "__main__":
    main()
