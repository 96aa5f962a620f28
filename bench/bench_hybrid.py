"""Hybrid linear-attention targets (Qwen3.5-4B-like and Qwen3.5-27B-like shapes, random bf16 weights):
the target-only decode step and the DFlash step (5-layer block-16 drafter) at each batch size, with
both rollback schemes of the verify pass, against the HBM roofline (weights, the full-attention
layers' K/V, and the linear layers' recurrent and convolution states read and written), and the
rollback's share of the DFlash step (``settle`` alone, timed on a verify pass's record).

Steps run through ``runtime.decoding`` under ``jax.jit`` with the state donated, after a prefill of
``--context`` random tokens. Random weights accept ~1 token per step: the DFlash step's cost, not its
tokens/s, is what this measures.

    python3 bench/bench_hybrid.py --out bench/results/hybrid.json          # H200: both shapes, batch 1 and 16
    JAX_PLATFORMS=cpu python3 bench/bench_hybrid.py --tiny                 # smoke test
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import timing
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.hybrid import HybridTarget
from dflash_jax.models.hybrid_config import FULL, LINEAR, HybridTargetConfig
from dflash_jax.runtime import decoding, recurrent_state
from dflash_jax.tiny import tiny_drafter_config


def hybrid_shape(name: str, layers: int | None = None) -> HybridTargetConfig:
    """Published Qwen3.5 shapes (every 4th layer full attention); ``layers``: only that many."""
    shapes = {
        "4b": dict(hidden_size=2560, intermediate_size=9216, num_layers=32, num_heads=16, num_kv_heads=4,
                   linear_num_value_heads=32, tie_word_embeddings=True),
        "27b": dict(hidden_size=5120, intermediate_size=17408, num_layers=64, num_heads=24, num_kv_heads=4,
                    linear_num_value_heads=48, tie_word_embeddings=False),
        "tiny": dict(hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
                     linear_num_value_heads=4, tie_word_embeddings=False),
    }
    s = shapes[name]
    tiny = name == "tiny"
    layers = layers or s.pop("num_layers")
    s.pop("num_layers", None)
    return HybridTargetConfig(
        model_type="qwen3_5_text", vocab_size=512 if tiny else 248320, num_layers=layers,
        head_dim=16 if tiny else 256, rope_theta=1e7, max_position_embeddings=262144,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)),
        linear_num_key_heads=2 if tiny else 16, linear_key_head_dim=16 if tiny else 128,
        linear_value_head_dim=16 if tiny else 128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25, **s)


def random_pair(config: HybridTargetConfig, seed: int = 0) -> tuple[HybridTarget, Drafter]:
    """A random bf16 target (norm weights ones, decays moderate) and a 5-layer block-16 drafter."""
    target = HybridTarget(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
    ids = tuple(int(round(1 + i * (config.num_layers - 4) / 4)) for i in range(5))
    dcfg = tiny_drafter_config(config, num_layers=5, block_size=16, mask_token_id=config.vocab_size - 1,
                               target_layer_ids=ids)
    return target, Drafter(dcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed + 1))


def roofline_bytes(target: HybridTarget, batch: int, context: int) -> dict[str, int]:
    """What a target-only decode step must move: the weights it reads, the full layers' K/V, the
    linear layers' states (float32 recurrent state and the convolution state, read and written)."""
    c = target.config
    table = target.embed_tokens[...]
    weights = timing.param_bytes(target) - (0 if target.lm_head is None else table.size * table.dtype.itemsize)
    kv = 2 * len(c.full_layers) * batch * context * c.num_kv_heads * c.head_dim * table.dtype.itemsize
    rec = len(c.linear_layers) * batch * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = len(c.linear_layers) * batch * (c.linear_conv_kernel_dim - 1) * c.conv_dim * table.dtype.itemsize
    return {"weights": weights, "kv": kv, "states": 2 * (rec + conv)}


def prefill_fn(target, drafter, context: int, capacity: int, max_steps: int):
    """A jitted ``batch -> state`` of ``context`` random prompt tokens per row (compiled once per batch size)."""
    tdef, tstate = nnx.split(target)
    ddef, dstate = nnx.split(drafter)

    @jax.jit
    def run(ts, ds, ids):
        t, d = nnx.merge(tdef, ts), nnx.merge(ddef, ds)
        batch = ids.shape[0]
        lens = jnp.full((batch,), context, jnp.int32)
        rows = decoding.prefill(t, d, ids, lens, lens + max_steps * 16, jnp.full((batch, 1), -1, jnp.int32),
                                capacity=capacity, max_steps=max_steps, mask_token_id=d.config.mask_token_id)
        empty = decoding.empty_state(t, d, batch, capacity=capacity, max_steps=max_steps, n_stop=1)
        return decoding.scatter_rows(empty, rows, jnp.arange(batch))

    def state(batch: int):
        ids = jax.random.randint(jax.random.key(batch), (batch, context), 0, target.config.vocab_size - 2)
        return run(tstate, dstate, ids)

    return state


def per_position_bytes(target, batch: int, block: int) -> int:
    c = target.config
    return batch * block * len(c.linear_layers) * c.linear_num_value_heads * c.linear_key_head_dim * (
        c.linear_value_head_dim * 4)


def time_steps(target, drafter, state, *, spec: bool, steps: int, repeats: int) -> float:
    """Median seconds per step of ``steps`` steps in one jitted loop, the state donated."""
    tdef, tstate = nnx.split(target)
    ddef, dstate = nnx.split(drafter)

    def loop(ts, ds, s):
        t, d = nnx.merge(tdef, ts), nnx.merge(ddef, ds)

        def body(_, s):
            if spec:
                return decoding.speculative_step(t, d, s, block_size=d.config.block_size)
            return decoding.target_only_step(t, s)

        return jax.lax.fori_loop(0, steps, body, s)

    run = jax.jit(loop, donate_argnums=(2,))
    box = {"s": run(tstate, dstate, state)}  # compiles
    jax.block_until_ready(box["s"].starts)

    def call():
        box["s"] = run(tstate, dstate, box["s"])
        return box["s"].starts

    seconds, _ = timing.median_time(call, repeats=repeats)
    return seconds / steps


def time_settle(target, drafter, state, repeats: int) -> float:
    """Seconds of ``settle`` alone: the rollback of a verify pass's record to a per-row count."""
    tdef, tstate = nnx.split(target)
    block = drafter.config.block_size
    batch = state.starts.shape[0]
    ids = jax.random.randint(jax.random.key(3), (batch, block), 0, target.config.vocab_size - 2)

    @jax.jit
    def verify(ts, cache):
        t = nnx.merge(tdef, ts)
        return t.step(ids, state.starts, cache, **recurrent_state.verify_kwargs(t))[2]

    pending = verify(tstate, state.target_cache)
    produced = jnp.asarray(np.arange(batch) % block + 1, jnp.int32)
    settle = jax.jit(lambda ts, cache: nnx.merge(tdef, ts).settle(cache, produced))
    return timing.median_time(settle, tstate, pending, repeats=repeats)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="4b,27b")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rollbacks", default="recompute,per_position")
    parser.add_argument("--max-state-gb", type=float, default=30.0,
                        help="skip the per-position rollback where its states would exceed this")
    parser.add_argument("--layers", type=int, default=None, help="only this many layers (a quick look at the shapes)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tiny:
        args.models, args.context, args.steps, args.repeats = "tiny", 32, 2, 1
    print(timing.device_line())
    rows = []
    header = f"{'model':6} {'batch':>5} {'step':24} {'ms':>8} {'roofline ms':>11} {'% roof':>7} {'settle ms':>9} {'share':>6}"
    print(header)
    max_steps = args.steps * (args.repeats + 3) + 2
    capacity = -(-(args.context + 16 * max_steps) // 128) * 128
    for name in args.models.split(","):
        target, drafter = random_pair(hybrid_shape(name, args.layers))
        fresh_state = prefill_fn(target, drafter, args.context, capacity, max_steps)
        for batch in (int(b) for b in args.batches.split(",")):
            nbytes = roofline_bytes(target, batch, args.context)
            roof = sum(nbytes.values()) / timing.HBM_BYTES_PER_S
            variants = [("target-only", False, None)] + [(f"dflash ({r})", True, r) for r in args.rollbacks.split(",")]
            base = None
            for label, spec, rollback in variants:
                if rollback is not None:
                    target.rollback = rollback
                if rollback == "per_position" and per_position_bytes(target, batch, 16) > args.max_state_gb * 1e9:
                    print(f"{name:6} {batch:5d} {label:24} skipped: "
                          f"{per_position_bytes(target, batch, 16) / 1e9:.0f} GB of per-position states")
                    continue
                try:
                    state = fresh_state(batch)
                    settle = time_settle(target, drafter, state, args.repeats) if spec else None
                    step = time_steps(target, drafter, state, spec=spec, steps=args.steps, repeats=args.repeats)
                except Exception as err:  # noqa: BLE001  (out of memory at a large shape: report, go on)
                    print(f"{name:6} {batch:5d} {label:24} failed: {type(err).__name__}: {str(err)[:120]}")
                    continue
                base = step if not spec else base
                row = dict(model=name, batch=batch, step=label, seconds=step, roofline_s=roof, bytes=nbytes,
                           settle_s=settle, vs_target_only=(step / base if base else None))
                rows.append(row)
                share = f"{settle / step:6.1%}" if settle else ""
                settle_ms = f"{settle * 1e3:9.3f}" if settle else ""
                print(f"{name:6} {batch:5d} {label:24} {step * 1e3:8.3f} {roof * 1e3:11.3f} {roof / step:7.1%} "
                      f"{settle_ms:>9} {share:>6}" + (f"  ({step / base:.2f}x target-only)" if spec and base else ""))
                del state
        del target, drafter
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": timing.device_line(), "args": vars(args), "rows": rows},
                                             indent=2, default=str))


if __name__ == "__main__":
    main()
