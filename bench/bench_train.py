#!/usr/bin/env python
"""Training throughput of the DFlash train step: tokens/s and MFU, random weights.

Default: a Qwen3-8B-shaped target (36 layers, hidden 4096, GQA 32/8, vocab 151936, bf16) and a
5-layer B=16 drafter, seq_len 4096, 512 anchors, one jitted step (target forward + drafter forward
and backward + AdamW) per micro-batch. Prints a short table; ``--tiny`` runs a CPU-sized smoke test.

    python bench/bench_train.py                      # on the accelerator
    python bench/bench_train.py --tiny               # anywhere
    python bench/bench_train.py --batch 1 2 --loss-chunk 64 --attention-impl pallas
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.drafter import Drafter
from dflash_jax.model_config import DrafterConfig, TargetConfig, default_target_layer_ids
from dflash_jax.target import Target
from dflash_jax.training.config import OptimConfig
from dflash_jax.training.monitor import peak_flops_per_device, train_flops_per_sequence
from dflash_jax.training.optim import make_optimizer
from dflash_jax.training.trainer import StepSpec, init_state, make_train_step

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=6, num_heads=4,
            num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0)


def build(shape: dict, layers: int, block: int, dtype):
    tcfg = TargetConfig(**shape, model_type="qwen3")
    dcfg = DrafterConfig(**dict(shape, num_layers=layers), block_size=block, mask_token_id=shape["vocab_size"] - 1,
                         target_layer_ids=default_target_layer_ids(shape["num_layers"], layers),
                         num_target_layers=shape["num_layers"])
    # Random weights, built directly on the device (jit) so an 8B target never sits on the host.
    target_gd, target_state = nnx.split(nnx.eval_shape(lambda: Target(tcfg, dtype=dtype, rngs=nnx.Rngs(0))))
    target_state = jax.jit(lambda: nnx.split(Target(tcfg, dtype=dtype, rngs=nnx.Rngs(0)))[1])()
    drafter = jax.jit(lambda: nnx.split(Drafter(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(1)), nnx.Param, ...)[1:])()
    d_gd = nnx.split(nnx.eval_shape(lambda: Drafter(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(1))), nnx.Param, ...)[0]
    return tcfg, dcfg, target_gd, target_state, d_gd, drafter


def bench_one(tcfg, dcfg, target_gd, target_state, d_gd, drafter, *, batch, seq, anchors, chunk, impl, steps):
    params, rest = drafter
    tx = make_optimizer(OptimConfig(lr=6e-4), 1000)
    spec = StepSpec(block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                    target_layer_ids=tuple(dcfg.target_layer_ids), num_anchors=anchors, loss_chunk=chunk,
                    compute_dtype=jnp.bfloat16, attention_impl=impl)
    step = jax.jit(make_train_step(d_gd, rest, target_gd, tx, spec), donate_argnums=(0,))
    state = init_state(jax.tree.map(jnp.copy, params), tx)  # the step donates its state
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, tcfg.vocab_size - 1, (batch, seq)), jnp.int32)
    mask = np.ones((batch, seq), np.int32)
    mask[:, : seq // 8] = 0  # a prompt part
    data = {"input_ids": ids, "loss_mask": jnp.asarray(mask), "segment_ids": jnp.ones_like(ids)}
    t0 = time.perf_counter()
    state, m = step(state, target_state, data)
    jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, target_state, data)
    jax.block_until_ready(m["loss"])
    dt = (time.perf_counter() - t0) / steps
    flops = train_flops_per_sequence(tcfg, dcfg, seq, anchors, distill=False) * batch
    peak = peak_flops_per_device()
    try:
        mem = jax.devices()[0].memory_stats() or {}
        peak_mem = mem.get("peak_bytes_in_use", 0) / 2**30
    except Exception:  # noqa: BLE001
        peak_mem = 0.0
    return {
        "batch": batch, "seq_len": seq, "anchors": anchors, "loss_chunk": chunk, "attention": impl,
        "step_s": dt, "compile_s": compile_s, "tokens_per_s": batch * seq / dt,
        "draft_tokens_per_s": batch * anchors * dcfg.block_size / dt,
        "tflops": flops / dt / 1e12, "mfu": (flops / dt / peak) if peak else None,
        "peak_mem_gib": peak_mem, "loss": float(m["loss"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--anchors", type=int, default=None)
    ap.add_argument("--loss-chunk", type=int, nargs="+", default=None)
    ap.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"])
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    shape = TINY if args.tiny else QWEN3_8B
    seq = args.seq_len or (128 if args.tiny else 4096)
    anchors = args.anchors or (16 if args.tiny else 512)
    chunks = args.loss_chunk or ([0, 4] if args.tiny else [64])
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; peak bf16 "
          f"{(peak_flops_per_device() or 0) / 1e12:.0f} TFLOP/s per device")
    built = build(shape, args.draft_layers, args.block, jnp.bfloat16)
    rows = []
    header = f"{'batch':>5} {'chunk':>5} {'step s':>8} {'compile s':>9} {'tok/s':>9} {'draft tok/s':>11} {'TFLOP/s':>8} {'MFU':>6} {'GiB':>6}"
    print(header)
    for batch in args.batch:
        for chunk in chunks:
            try:
                r = bench_one(*built, batch=batch, seq=seq, anchors=anchors, chunk=chunk, impl=args.attention_impl,
                              steps=args.steps)
            except Exception as err:  # noqa: BLE001  (e.g. out of memory: report and go on)
                print(f"{batch:>5} {chunk:>5} failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
                continue
            rows.append(r)
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
            print(f"{batch:>5} {chunk:>5} {r['step_s']:>8.3f} {r['compile_s']:>9.1f} {r['tokens_per_s']:>9.0f} "
                  f"{r['draft_tokens_per_s']:>11.0f} {r['tflops']:>8.1f} {mfu:>6} {r['peak_mem_gib']:>6.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
