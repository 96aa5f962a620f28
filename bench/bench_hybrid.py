"""Hybrid linear-attention targets on one GPU: Qwen3.5-4B-like and Qwen3.5-27B-like shapes, random
bf16 weights, a random 5-layer block-16 drafter, batches 1 and 16, context 1,024.

Per shape and batch: the target-only decode step, the DFlash step (draft + verify + commit + the
rollback), their ratio, each against its HBM roofline at ``timing.HBM_BYTES_PER_S`` (target-only:
the target's weights, the full-attention layers' K/V, the linear layers' recurrent and convolution
states read and written; DFlash adds the drafter's weights, its context K/V and a second read of the
LM head), and the rollback's share of the DFlash step: ``settle`` (every linear layer's state and
convolution state advanced to a per-row count from a verify record) timed in a jitted loop of its
own, each settling the state the previous left, over the DFlash step.

Depth: the 4B-like shape runs its published 32 layers. The 27B-like shape runs 4 and 8 layers and is
extrapolated linearly to its published 64: every group of 4 layers (3 linear, 1 full attention) costs
the same, the rest (embedding, LM head, drafter, sampling) is fixed, so ``t(64) = t(8) + 56 *
(t(8) - t(4)) / 4`` (rows marked ``x``; the measured depths are in the JSON).

Steps run through ``runtime.decoding`` inside one jitted loop of ``--steps`` steps with the state
donated, from a synthetic state as after a prefill of ``--context`` tokens (caches and recurrent
states of random data: a step's cost does not depend on the values). Random weights accept ~1 token
a step: this measures the DFlash step's cost, not its tokens/s. Each timed number is the median of
``--repeats`` loops after a compiling one.

    python3 bench/bench_hybrid.py --json $OUT/hybrid.json                  # H200: the table (< 2 min)
    JAX_PLATFORMS=cpu python3 bench/bench_hybrid.py --tiny                  # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import timing
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.hybrid import BlockRecord, HybridCache, HybridTarget
from dflash_jax.models.hybrid_config import FULL, LINEAR, HybridTargetConfig
from dflash_jax.ops.cache import KVCache
from dflash_jax.ops.config import OpsConfig, resolve_attention_impl
from dflash_jax.runtime import decoding
from dflash_jax.tiny import tiny_drafter_config

BLOCK = 16
SHAPES = {
    "4b": dict(hidden_size=2560, intermediate_size=9216, num_layers=32, num_heads=16, num_kv_heads=4,
               linear_num_value_heads=32, tie_word_embeddings=True),
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_layers=64, num_heads=24, num_kv_heads=4,
                linear_num_value_heads=48, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=96, num_layers=12, num_heads=4, num_kv_heads=2,
                 linear_num_value_heads=4, tie_word_embeddings=False),
}
# Depths measured per shape: one (the published depth) or two (extrapolated to the published depth).
DEPTHS = {"4b": (32,), "27b": (4, 8), "tiny": (4, 8)}


def hybrid_shape(name: str, layers: int | None = None) -> HybridTargetConfig:
    """Published Qwen3.5 shapes (every 4th layer full attention); ``layers``: only that many."""
    s = dict(SHAPES[name])
    tiny = name == "tiny"
    depth = s.pop("num_layers")
    layers = layers or depth
    return HybridTargetConfig(
        model_type="qwen3_5_text", vocab_size=512 if tiny else 248320, num_layers=layers,
        head_dim=16 if tiny else 256, rope_theta=1e7, max_position_embeddings=262144,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)),
        linear_num_key_heads=2 if tiny else 16, linear_key_head_dim=16 if tiny else 128,
        linear_value_head_dim=16 if tiny else 128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25, **s)


def drafter_config(config: HybridTargetConfig):
    ids = tuple(int(round(1 + i * (config.num_layers - 4) / 4)) for i in range(5))
    return tiny_drafter_config(config, num_layers=5, block_size=BLOCK, mask_token_id=config.vocab_size - 1,
                               target_layer_ids=ids)


def random_pair(config: HybridTargetConfig, seed: int = 0) -> tuple[HybridTarget, Drafter]:
    """A random bf16 target and a 5-layer block-16 drafter."""
    target = HybridTarget(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
    return target, Drafter(drafter_config(config), dtype=jnp.bfloat16, rngs=nnx.Rngs(seed + 1))


# -- bytes ------------------------------------------------------------------------------------------


def _abstract_bytes(make) -> int:
    """Parameter bytes of the module ``make()`` builds, without building it."""
    state = nnx.state(nnx.eval_shape(make), nnx.Param)
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))


def roofline_bytes(config: HybridTargetConfig, batch: int, context: int) -> dict[str, int]:
    """What the steps must move at the published depth of ``config``: ``target`` (weights read, less
    the embedding table of an untied head: a step reads a row of it), ``kv`` (the full layers' K/V),
    ``states`` (recurrent float32 and convolution states, read and written), and what a DFlash step
    adds, ``drafter`` (its weights, its context K/V, the LM head read again for the drafts)."""
    c = config
    itemsize = 2  # bf16
    table = c.vocab_size * c.hidden_size * itemsize
    target = _abstract_bytes(lambda: HybridTarget(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    target -= 0 if c.tie_word_embeddings else table
    kv = 2 * len(c.full_layers) * batch * context * c.num_kv_heads * c.head_dim * itemsize
    rec = len(c.linear_layers) * batch * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = len(c.linear_layers) * batch * (c.linear_conv_kernel_dim - 1) * c.conv_dim * itemsize
    dc = drafter_config(c)
    drafter = _abstract_bytes(lambda: Drafter(dc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    drafter += table + 2 * dc.num_layers * batch * context * dc.num_kv_heads * dc.head_dim * itemsize
    return {"target": target, "kv": kv, "states": 2 * (rec + conv), "drafter": drafter}


# -- states and steps ---------------------------------------------------------------------------------


def synthetic_state(target: HybridTarget, drafter: Drafter, batch: int, context: int, capacity: int,
                    max_steps: int, seed: int) -> decoding.DecodeState:
    """A decode state as after a prefill of ``context`` tokens a row: caches, convolution and
    recurrent states of random data, rows that do not finish within ``max_steps`` DFlash steps."""
    empty = decoding.empty_state(target, drafter, batch, capacity=capacity, max_steps=max_steps, n_stop=1)
    keys = iter(jax.random.split(jax.random.key(seed), 1024))

    def fill(x, scale=1.0):
        return timing.normal(next(keys), x.shape, x.dtype, scale)

    tc, dc = empty.target_cache, empty.draft_cache
    target_cache = HybridCache(KVCache(tuple(map(fill, tc.kv.k)), tuple(map(fill, tc.kv.v))),
                               tuple(map(fill, tc.conv)), tuple(fill(s, 0.1) for s in tc.recurrent))
    draft_cache = KVCache(tuple(map(fill, dc.k)), tuple(map(fill, dc.v)))
    vocab = target.config.vocab_size
    return dataclasses.replace(
        empty, tokens=jax.random.randint(next(keys), empty.tokens.shape, 0, vocab - 2, jnp.int32),
        starts=jnp.full((batch,), context, jnp.int32), max_lens=jnp.full((batch,), capacity - BLOCK - 1, jnp.int32),
        done=jnp.zeros((batch,), bool), target_cache=target_cache, draft_cache=draft_cache)


def synthetic_record(target: HybridTarget, batch: int, seed: int) -> BlockRecord:
    """A verify pass's record of random data of its shapes (decays < 0,
    cumulative as the verify pass keeps them)."""
    c = target.config
    keys = iter(jax.random.split(jax.random.key(seed), 4 * len(c.linear_layers) + 1))
    heads, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    n = len(c.linear_layers)
    window = tuple(timing.normal(next(keys), (batch, c.linear_conv_kernel_dim - 1 + BLOCK, c.conv_dim), jnp.bfloat16)
                   for _ in range(n))
    gc = tuple(jnp.cumsum(-jax.random.uniform(next(keys), (batch, heads, BLOCK), minval=0.01, maxval=1.0), axis=-1)
               for _ in range(n))
    k = tuple(timing.normal(next(keys), (batch, heads, BLOCK, dk), jnp.float32, dk ** -0.5) for _ in range(n))
    v_new = tuple(timing.normal(next(keys), (batch, heads, BLOCK, dv), jnp.float32) for _ in range(n))
    return BlockRecord(window, k=k, gc=gc, v_new=v_new)


def time_settle(target: HybridTarget, cache: HybridCache, record: BlockRecord, *, steps: int,
                repeats: int) -> float:
    """Median seconds of one ``settle`` (all linear layers, the row counts varying) in a jitted loop of
    ``steps``, each settling the state the previous one left (the cache donated): the rollback's
    work without the dispatch of a call of its own."""
    tdef, tstate = nnx.split(target)
    batch = cache.kv.k[0].shape[0]

    def loop(ts, cache, record):
        t = nnx.merge(tdef, ts)

        def body(i, c):
            lens = (jnp.arange(batch, dtype=jnp.int32) + i) % BLOCK + 1
            return t.settle(dataclasses.replace(c, pending=record), lens)

        return jax.lax.fori_loop(0, steps, body, cache)

    run = jax.jit(loop, donate_argnums=(1,))
    box = {"c": cache}

    def call():
        box["c"] = run(tstate, box["c"], record)
        return box["c"].recurrent

    seconds, _ = timing.median_time(call, repeats=repeats)  # the first call compiles
    return seconds / steps


def time_steps(target, drafter, state, *, spec: bool, steps: int, repeats: int, ops: OpsConfig) -> float:
    """Median seconds per step of ``steps`` steps in one jitted loop, the state donated."""
    tdef, tstate = nnx.split(target)
    ddef, dstate = nnx.split(drafter)

    def loop(ts, ds, s):
        t, d = nnx.merge(tdef, ts), nnx.merge(ddef, ds)

        def body(_, s):
            if spec:
                return decoding.speculative_step(t, d, s, block_size=BLOCK, ops=ops)
            return decoding.target_only_step(t, s, ops=ops)

        return jax.lax.fori_loop(0, steps, body, s)

    run = jax.jit(loop, donate_argnums=(2,))
    box = {"s": state}

    def call():
        box["s"] = run(tstate, dstate, box["s"])
        return box["s"].starts

    seconds, _ = timing.median_time(call, repeats=repeats)  # the first call compiles
    return seconds / steps


def measure(name: str, layers: int, batches: list[int], args, ops: OpsConfig, t0: float) -> dict:
    """Seconds of every step and ``settle`` at every batch for ``name`` at ``layers`` layers:
    ``{(batch, label): seconds or None}``."""
    config = hybrid_shape(name, layers)
    target, drafter = random_pair(config)
    max_steps = args.steps * (args.repeats + 1) + 1
    capacity = -(-(args.context + BLOCK * (max_steps + 2)) // 128) * 128
    labels = ["target_only", "dflash", "settle"]
    out = {}
    for batch in batches:
        for label in labels:
            kind = label
            state = synthetic_state(target, drafter, batch, args.context, capacity, max_steps, seed=batch)
            try:
                if kind == "settle":
                    seconds = time_settle(target, state.target_cache, synthetic_record(target, batch, seed=batch),
                                          steps=args.steps, repeats=args.repeats)
                else:
                    seconds = time_steps(target, drafter, state, spec=kind == "dflash", steps=args.steps,
                                         repeats=args.repeats, ops=ops)
            except Exception as err:  # noqa: BLE001  (out of memory at a large shape: report, go on)
                print(f"  {name} x{layers} batch {batch} {label}: failed: {type(err).__name__}: {str(err)[:160]}")
                seconds = None
            out[(batch, label)] = seconds
            del state
        print(f"  [{time.perf_counter() - t0:5.0f} s] {name} {layers} layers, batch {batch}: "
              + ", ".join(f"{label} {out[(batch, label)] * 1e3:.3f} ms" for label in labels
                          if out[(batch, label)] is not None), flush=True)
    del target, drafter
    return out


def extrapolate(measured: dict[int, float | None], depths: tuple[int, ...], to: int) -> float | None:
    """The published depth's seconds from one depth (itself) or two (linear in the layer count)."""
    if any(measured[d] is None for d in depths):
        return None
    if len(depths) == 1:
        return measured[depths[0]] * to / depths[0] if depths[0] != to else measured[depths[0]]
    lo, hi = depths
    per_layer = (measured[hi] - measured[lo]) / (hi - lo)
    return measured[hi] + (to - hi) * per_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="4b,27b")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depths", default=None,
                        help="MODEL=D or MODEL=D1:D2 comma list (two depths: extrapolated to the published one)")
    parser.add_argument("--attention-impl", default="xla", help="xla, pallas or auto (OpsConfig.attention)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--json", "--out", dest="json", default=None, help="write the rows here as JSON")
    args = parser.parse_args()
    depths = dict(DEPTHS)
    if args.tiny:
        args.models, args.context, args.steps, args.repeats = "tiny", 32, 2, 1
    for item in filter(None, (args.depths or "").split(",")):
        model, _, spec = item.partition("=")
        depths[model] = tuple(int(d) for d in spec.split(":"))
    ops = OpsConfig(attention=resolve_attention_impl(args.attention_impl))
    batches = [int(b) for b in args.batches.split(",")]
    print(timing.device_line(), f"ops: {ops.attention}", flush=True)
    t0 = time.perf_counter()
    rows = []
    for name in args.models.split(","):
        published = SHAPES[name]["num_layers"]
        ds = depths[name]
        per_depth = {d: measure(name, d, batches, args, ops, t0) for d in ds}
        for batch in batches:
            nbytes = roofline_bytes(hybrid_shape(name), batch, args.context)
            roof_target = (nbytes["target"] + nbytes["kv"] + nbytes["states"]) / timing.HBM_BYTES_PER_S
            roof_dflash = roof_target + nbytes["drafter"] / timing.HBM_BYTES_PER_S

            def at(label):
                return extrapolate({d: per_depth[d][(batch, label)] for d in ds}, ds, published)

            base = at("target_only")
            step, settle = at("dflash"), at("settle")
            rows.append(dict(
                model=name, layers=published, measured_layers=list(ds), extrapolated=ds != (published,),
                batch=batch, target_only_s=base, dflash_s=step, settle_s=settle,
                ratio=step / base if step and base else None,
                rollback_share=settle / step if step and settle else None,
                target_only_roofline_s=roof_target, dflash_roofline_s=roof_dflash,
                target_only_roof_share=roof_target / base if base else None,
                dflash_roof_share=roof_dflash / step if step else None, bytes=nbytes,
                measured={str(d): {f"{b}:{k}": v for (b, k), v in per_depth[d].items()} for d in ds}))
    print(f"\n{'model':6} {'layers':>8} {'batch':>5} {'target ms':>9} {'% roof':>6} "
          f"{'DFlash ms':>9} {'% roof':>6} {'ratio':>6} {'settle ms':>9} {'share':>6}")

    def fmt(x, spec):
        return format(x, spec) if x is not None else "-"

    for r in rows:
        layers = f"{r['layers']}" + ("x" if r["extrapolated"] else "")
        print(f"{r['model']:6} {layers:>8} {r['batch']:5d} "
              f"{fmt(r['target_only_s'] and r['target_only_s'] * 1e3, '9.3f')} "
              f"{fmt(r['target_only_roof_share'], '6.1%')} {fmt(r['dflash_s'] and r['dflash_s'] * 1e3, '9.3f')} "
              f"{fmt(r['dflash_roof_share'], '6.1%')} {fmt(r['ratio'], '6.3f')} "
              f"{fmt(r['settle_s'] and r['settle_s'] * 1e3, '9.3f')} {fmt(r['rollback_share'], '6.1%')}")
    measured = "; ".join(f"{m} at {', '.join(map(str, depths[m]))}" for m in args.models.split(","))
    print(f"(layers measured: {measured}; x: extrapolated to the published depth; total "
          f"{time.perf_counter() - t0:.0f} s)")
    timing.write_json(args.json, {"device": timing.device_line(), "ops": ops.attention, "args": vars(args),
                                  "rows": rows})


if __name__ == "__main__":
    main()
