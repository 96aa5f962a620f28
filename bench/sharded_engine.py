#!/usr/bin/env python
"""The Pallas kernels on a mesh of GPUs (``sharding.shard_kernel``) against one device.

A small float32 Qwen3-shaped pair (random weights; 2 KV heads, so a 2-way tensor axis splits them)
runs the same prompts through engines on one device (XLA attention, Pallas kernels) and on meshes of
every visible device (tensor-parallel, data-parallel) with the Pallas kernels. Prints, per engine,
how many requests give the one-device XLA engine's tokens and acceptance lengths, and the wall time
of the batch (a tiny model: a check of the sharded kernels, not a performance figure).

    python bench/sharded_engine.py --out $OUT/sharded.json        # on a machine of 2+ GPUs
    python bench/sharded_engine.py --cpu-devices 8                 # CPU smoke test (interpret)
    python bench/sharded_engine.py --attention-config stacked_members=1,members_per_program=4   # + a tile config
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-devices", type=int, default=0, help="fake CPU devices (smoke test)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: prefill takes the library's flash attention on GPUs (per device on a mesh); "
                         "the engines then agree up to bf16 rounding, not bit for bit")
    ap.add_argument("--attention-config", action="append", default=[], metavar="FIELD=N,...",
                    help="also run the one-device kernel engine with these cached-attention tile fields "
                         "(GpuConfig, e.g. stacked_members=1,members_per_program=4); repeatable")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
        os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash_jax.drafter import Drafter
    from dflash_jax.engine import Engine, EngineConfig
    from dflash_jax.sharding import MeshConfig
    from dflash_jax.target import Target
    from dflash_jax.tiny import tiny_drafter_config, tiny_target_config
    from kernels_pallas import cached_attention_gpu

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engine import int_fields

    n = len(jax.devices())
    print(f"jax {jax.__version__}: {n} x {jax.devices()[0].device_kind}", flush=True)
    tcfg = tiny_target_config(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                              num_kv_heads=2, head_dim=64)
    dcfg = tiny_drafter_config(tcfg, num_layers=2, block_size=16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tcfg.vocab_size - 1, size=int(rng.integers(8, 40))).tolist()
               for _ in range(args.prompts)]

    default_attention = cached_attention_gpu.DEFAULT_CONFIG
    # (name, attention impl, mesh, the cached-attention kernel's tile fields)
    variants = [("one device, xla", "xla", None, {}), ("one device, pallas", "pallas", None, {})]
    variants += [(f"one device, pallas {fields}", "pallas", None, int_fields(fields))
                 for fields in args.attention_config]
    if n > 1:
        variants += [(f"tensor={n}, pallas", "pallas", MeshConfig(data=1, fsdp=1, tensor=n), {}),
                     (f"data={n}, pallas", "pallas", MeshConfig(data=n, fsdp=1, tensor=1), {})]
        if n >= 4:
            variants.append((f"data={n // 2} x tensor=2, pallas", "pallas",
                             MeshConfig(data=n // 2, fsdp=1, tensor=2), {}))
    dtype = jnp.dtype(args.dtype)
    report, want = {}, None
    for name, impl, mesh, tile_fields in variants:
        cached_attention_gpu.DEFAULT_CONFIG = dataclasses.replace(default_attention, **tile_fields)
        target = Target(tcfg, dtype=dtype, rngs=nnx.Rngs(0))  # each engine fuses and shards its own copy
        drafter = Drafter(dcfg, dtype=dtype, rngs=nnx.Rngs(1))
        engine = Engine(target, drafter, EngineConfig(max_batch_size=args.prompts, max_length=128, steps_per_sync=4,
                                                      attention_impl=impl, mesh=mesh))
        engine.generate(prompts, args.new_tokens)  # compiles every attention window it needs
        t0 = time.perf_counter()
        got = engine.generate(prompts, args.new_tokens)
        wall = time.perf_counter() - t0
        outs = [(g.output_ids, g.acceptance_lengths) for g in got]
        want = want or outs
        same = sum(a == b for a, b in zip(outs, want))
        report[name] = dict(identical=same, prompts=len(prompts), wall_s=wall,
                            tau=float(np.mean([g.tau for g in got])))
        print(json.dumps({name: report[name]}), flush=True)
    print("\nengine | identical to one-device xla | wall s")
    for name, r in report.items():
        print(f"{name} | {r['identical']}/{r['prompts']} | {r['wall_s']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
