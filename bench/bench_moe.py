"""Mixture-of-experts targets: decode and DFlash steps against the touched-bytes roofline, and the
cost of verifying a block as a function of the distinct experts it touches.

Two families, random weights: Qwen3-30B-A3B shapes in bf16 (128 experts, top-8) and gpt-oss-20b
shapes with MXFP4 experts (32 experts, top-4, sinks, sliding windows of 128), each with a random
5-layer block-16 drafter. ``--layers`` decoder layers of the published width (every layer costs the
same; ``--layers 0``: the published depth, 48 and 24).

Expert implementations: ``--experts-impl`` (``EngineConfig.experts_impl``; default "auto", which runs
a step of few (token, expert) pairs -- decode, small verify blocks -- as per-pair matrix-vector
products reading only the routed experts, and more pairs as ``jax.lax.ragged_dot``); ``--gpu-lowering
mosaic`` runs such steps through the Mosaic GPU expert-products kernel (``kernels_pallas/experts``),
rows naming it "mosaic"; with tokamax installed, "ragged_dot" steps run its Mosaic GPU ragged dot,
rows naming it "ragged_dot (tokamax)".

1. Per batch (1, 4, 16): the engine's target-only step and DFlash step (draft + verify + commit),
   back to back in its jitted loop, each against its own roofline at ``timing.HBM_BYTES_PER_S``:
   the bytes of the experts the step touches (expected distinct experts of a uniform router:
   ``E * (1 - (1 - k / E) ** tokens)`` per layer), attention, routers, norms, the LM head, an
   embedding row per token, the K/V read (full context: the sliding layers mask, they do not skip).
   The DFlash roofline adds the drafter's weights and touches experts for ``batch * 16`` tokens.
   Each row names the implementation "auto" resolves to for the step's pair count.
2. The expert op alone, one layer, ``--op-tokens`` tokens of random routing: ``routed_experts`` by
   each implementation against the bytes of the experts touched (which one the GPU should run).
3. ``--verify``: ``Target.step`` of a block of 16 tokens per row at batch 1 with the router forced
   to touch exactly N distinct experts per layer (N = 8, 32, 64, all), against the decode step of
   one token (natural routing): a user's routing statistics predict their verify cost from it.

    python3 bench/bench_moe.py --json bench/results/moe.json           # 1 and 2, 8 layers: < 90 s on an H200
    python3 bench/bench_moe.py --verify --json bench/results/moe_verify.json
    python3 bench/bench_moe.py --layers 0 --families qwen3_moe       # the published depth
    python3 bench/bench_moe.py --experts-impl ragged_dot --json bench/results/moe_ragged.json
    python3 bench/bench_moe.py --gpu-lowering mosaic --op-tokens '' --json bench/results/moe_mosaic.json
    python3 bench/bench_moe.py --families qwen3_moe --layers 0 --tensor 8 --batches 1,8,32 --op-tokens ''  # 8 GPUs
    JAX_PLATFORMS=cpu python3 bench/bench_moe.py --tiny --verify   # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import timing
from dflash_jax.models import moe
from dflash_jax.models.config import TargetConfig, freeze_rope_scaling
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target
from dflash_jax.ops.cache import KVCache
from dflash_jax.ops.config import OpsConfig, resolve_attention_impl
from dflash_jax.ops.experts import (IMPLEMENTATIONS, library_ragged_dot, resolve_implementation, route, routed_experts,
                                    touched_experts, uses_mosaic_kernel)
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.sharding import MeshConfig, make_mesh
from dflash_jax.tiny import tiny_drafter_config, tiny_target_config

BLOCK = 16


def qwen3_30b_a3b(layers: int) -> TargetConfig:
    return TargetConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                        num_layers=layers or 48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
                        rope_theta=1e6, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                        norm_topk_prob=True)


def gpt_oss_20b(layers: int) -> TargetConfig:
    n = layers or 24
    return TargetConfig(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_layers=n,
        num_heads=64, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling=freeze_rope_scaling({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "original_max_position_embeddings": 4096, "truncate": False}),
        attention_bias=True, qk_norm=False, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880,
        experts_quantization="mxfp4", attention_sinks=True, sliding_window=128,
        layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)))


def tiny(family: str) -> TargetConfig:
    if family == "gpt_oss":
        return tiny_target_config("gpt_oss", experts_quantization="mxfp4", num_experts=8)
    return tiny_target_config("qwen3_moe", num_experts=16, num_experts_per_tok=4, mlp_only_layers=())


# -- bytes --------------------------------------------------------------------------------------------


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def expected_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts ``tokens`` tokens touch under a uniform router (top-k distinct per token)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def step_bytes(target: Target, tokens: int, batch: int, context: int, touched: float | None = None) -> float:
    """The bytes a step of ``tokens`` tokens over ``batch`` rows of ``context`` cached positions must read:
    every weight but the experts and the embedding table, ``touched`` experts per MoE layer (default:
    ``expected_touched``), an embedding row per token, the K/V."""
    c = target.config
    total = 0.0
    for layer in target.layers:
        if isinstance(layer.mlp, moe.MoeMLP):
            experts = _bytes(nnx.state(layer.mlp.experts, nnx.Param))
            per_expert = experts / c.num_experts
            n = expected_touched(c.num_experts, c.num_experts_per_tok, tokens) if touched is None else touched
            total += _bytes(nnx.state(layer, nnx.Param)) - experts + n * per_expert
        else:
            total += _bytes(nnx.state(layer, nnx.Param))
    table = target.embed_tokens[...]
    total += _bytes(nnx.state(target.norm, nnx.Param)) + tokens * c.hidden_size * table.dtype.itemsize
    total += table.size * table.dtype.itemsize if target.lm_head is None else _bytes(target.lm_head[...])
    total += 2 * c.num_layers * batch * context * c.num_kv_heads * c.head_dim * table.dtype.itemsize
    return total


# -- forced routing -------------------------------------------------------------------------------------


@contextlib.contextmanager
def forced_routing(distinct: int):
    """While tracing inside it, every MoE layer routes the (token, slot) pair ``p = t * k + j`` to expert
    ``p % distinct`` with equal weights: exactly ``min(distinct, tokens * k)`` distinct experts a layer."""
    original = moe.MoeMLP.route

    def route(self, x):
        t = x.shape[0]
        pairs = jnp.arange(t * self.top_k, dtype=jnp.int32).reshape(t, self.top_k)
        return jnp.full((t, self.top_k), 1.0 / self.top_k, x.dtype), pairs % distinct

    moe.MoeMLP.route = route
    try:
        yield
    finally:
        moe.MoeMLP.route = original


def time_target_step(target: Target, batch: int, tokens: int, context: int, repeats: int, ops: OpsConfig) -> float:
    """Median seconds of ``Target.step`` extending every row by ``tokens`` tokens over a cache of
    ``context`` random positions (the verify pass at ``tokens = 16``, a decode step at 1)."""
    c = target.config
    graph, state = nnx.split(target)
    key = jax.random.key(tokens)
    dtype = target.embed_tokens.dtype
    shape = (batch, context + tokens, c.num_kv_heads, c.head_dim)
    cache = KVCache(tuple(timing.normal(jax.random.fold_in(key, i), shape, dtype) for i in range(c.num_layers)),
                    tuple(timing.normal(jax.random.fold_in(key, 99 + i), shape, dtype) for i in range(c.num_layers)))
    ids = jax.random.randint(key, (batch, tokens), 0, c.vocab_size, jnp.int32)
    starts = jnp.full((batch,), context, jnp.int32)

    @jax.jit
    def step(state, ids, cache):
        t = nnx.merge(graph, state)
        hidden, _, cache = t.step(ids, starts, cache, ops=ops)
        return t.head(hidden[:, -1]).argmax(-1), cache

    return timing.median_time(step, state, ids, cache, repeats=repeats)[0]


# -- the benchmark --------------------------------------------------------------------------------------


def build(family: str, layers: int, tiny_shapes: bool, mesh: Mesh | None = None) -> tuple[Target, Drafter]:
    """A random target and drafter, built on the device (no host copy of the weights); on ``mesh``, each
    parameter in its shards (the experts split over ``tensor``: expert parallelism)."""
    cfg = tiny(family) if tiny_shapes else (gpt_oss_20b if family == "gpt_oss" else qwen3_30b_a3b)(layers)
    dcfg = tiny_drafter_config(cfg, num_layers=timing.drafter_layers(tiny_shapes), block_size=BLOCK,
                               mask_token_id=cfg.vocab_size - 1, rope_scaling=None,
                               intermediate_size=cfg.intermediate_size)
    dtype = jnp.bfloat16
    return (timing.on_mesh(lambda: Target(cfg, dtype=dtype, rngs=nnx.Rngs(0)), mesh),
            timing.on_mesh(lambda: Drafter(dcfg, dtype=dtype, rngs=nnx.Rngs(1)), mesh))


def bench_expert_op(target: Target, tokens_list, repeats: int) -> dict:
    """One MoE layer's routed experts alone (random router logits), per implementation of
    ``ops.experts.routed_experts``, against the bytes of the experts touched."""
    layer = next(layer.mlp for layer in target.layers if isinstance(layer.mlp, moe.MoeMLP))
    w = layer.experts.weights()
    c = target.config
    per_expert = _bytes(jax.tree.leaves(nnx.state(layer.experts, nnx.Param))) / c.num_experts
    act = "gpt_oss" if layer.gpt_oss else "silu"
    impls = [impl for impl in IMPLEMENTATIONS if impl != "auto"]
    out = {}
    for tokens in tokens_list:
        key = jax.random.key(tokens)
        x = timing.normal(key, (tokens, c.hidden_size), target.embed_tokens.dtype)
        weights, ids = route(jax.random.normal(jax.random.fold_in(key, 1), (tokens, c.num_experts)),
                             c.num_experts_per_tok, softmax_first=True, normalize=True)
        weights = weights.astype(x.dtype)
        touched = int(touched_experts(ids, c.num_experts))
        roof = touched * per_expert / timing.HBM_BYTES_PER_S
        row = dict(touched=touched, roofline_s=roof, auto=resolve_implementation("auto", ids.size, w))
        for impl in impls:
            fn = jax.jit(lambda x, ids, weights, w, impl=impl: routed_experts(x, ids, weights, w, activation=act,
                                                                              implementation=impl))
            row[impl] = timing.median_time(fn, x, ids, weights, w, repeats=repeats)[0]
        out[tokens] = row
        print(f"  expert op, {tokens:4d} tokens, {touched:3d} experts touched (auto: {row['auto']}): "
              + ", ".join(f"{impl} {row[impl] * 1e3:.3f} ms ({roof / row[impl]:5.1%})" for impl in impls),
              flush=True)
    return out


def experts_path(args, experts_shape: tuple[int, int], w) -> str:
    """What a step routing ``experts_shape`` (tokens, top_k) pairs runs: "mosaic" (the Mosaic GPU
    kernel), or the implementation ``--experts-impl`` resolves to ("ragged_dot (tokamax)" where its
    grouped matmuls are tokamax's, ``library_ragged_dot``)."""
    kernels = resolve_attention_impl("auto") == "pallas"
    if uses_mosaic_kernel(args.experts_impl, experts_shape, w, jnp.bfloat16, kernels=kernels,
                          mosaic=kernels and args.gpu_lowering == "mosaic"):
        return "mosaic"
    impl = resolve_implementation(args.experts_impl, experts_shape[0] * experts_shape[1], w)
    return f"{impl} (tokamax)" if impl == "ragged_dot" and library_ragged_dot(jnp.bfloat16, kernels=kernels) else impl


def bench_family(args, family: str) -> dict:
    t0 = time.perf_counter()
    mesh_config = MeshConfig(data=1, fsdp=1, tensor=args.tensor) if args.tensor > 1 else None
    mesh = make_mesh(mesh_config, jax.devices()[:args.tensor]) if mesh_config is not None else None
    target, drafter = build(family, args.layers, args.tiny, mesh)
    c = target.config
    jax.block_until_ready(jax.tree.leaves(nnx.state(target)))
    weights, dbytes = _bytes(nnx.state(target, nnx.Param)), _bytes(nnx.state(drafter, nnx.Param))
    print(f"\n{family}: {c.num_layers} layers, {c.num_experts} experts top-{c.num_experts_per_tok}, weights "
          f"{weights / 1e9:.1f} GB (+ drafter {dbytes / 1e9:.2f} GB), built in {time.perf_counter() - t0:.0f} s",
          flush=True)
    report: dict = dict(config=dataclasses.asdict(c), weight_bytes=weights, drafter_bytes=dbytes, batches={})
    if args.op_tokens:
        report["expert_op"] = bench_expert_op(target, args.op_tokens, args.repeats)
    steps = args.steps
    w = next(layer.mlp for layer in target.layers if isinstance(layer.mlp, moe.MoeMLP)).experts.weights()
    for batch in args.batches:
        config = EngineConfig(max_batch_size=batch, max_length=args.context + BLOCK * steps * (args.calls + 3),
                              prompt_buckets=(args.context,), experts_impl=args.experts_impl,
                              gpu_lowering=args.gpu_lowering, mesh=mesh_config)
        spec = Engine(target, drafter, config, mesh=mesh)
        plain = spec.derive(config, drafter=None)
        t_plain = timing.time_decode_pipelined(plain, batch, args.context, steps, args.calls)
        t_spec = timing.time_decode_pipelined(spec, batch, args.context, steps, args.calls)
        # On a mesh each GPU reads its share of the bytes (its experts, its heads): the roofline per GPU.
        roof_plain = step_bytes(target, batch, batch, args.context) / timing.HBM_BYTES_PER_S / args.tensor
        roof_spec = ((step_bytes(target, batch * BLOCK, batch, args.context) + dbytes) / timing.HBM_BYTES_PER_S
                     / args.tensor)
        top_k = c.num_experts_per_tok
        impl_plain = experts_path(args, (batch, top_k), w)
        impl_spec = experts_path(args, (batch * BLOCK, top_k), w)
        report["batches"][batch] = e = dict(
            target_step_s=t_plain, spec_step_s=t_spec, target_roofline_s=roof_plain, spec_roofline_s=roof_spec,
            target_roofline_share=roof_plain / t_plain, spec_roofline_share=roof_spec / t_spec,
            target_experts_impl=impl_plain, verify_experts_impl=impl_spec,
            touched_decode=expected_touched(c.num_experts, top_k, batch),
            touched_verify=expected_touched(c.num_experts, top_k, batch * BLOCK))
        print(f"  batch {batch:2d}: target step {t_plain * 1e3:7.2f} ms ({roof_plain / t_plain:5.1%} of its roofline, "
              f"~{e['touched_decode']:.0f} experts/layer, {impl_plain}) | DFlash step {t_spec * 1e3:7.2f} ms "
              f"({roof_spec / t_spec:5.1%}, ~{e['touched_verify']:.0f} experts/layer, verify {impl_spec}) | "
              f"ratio {t_spec / t_plain:.2f} = acceptance length to break even", flush=True)
        del plain, spec
    if args.verify:
        report["verify"] = bench_verify(args, target)
    report["wall_s"] = time.perf_counter() - t0
    return report


def bench_verify(args, target: Target) -> dict:
    """The verify block's cost by the distinct experts it touches (forced routings), in decode steps."""
    c = target.config
    ops = OpsConfig(attention=resolve_attention_impl("auto"), experts=args.experts_impl,
                    gpu_lowering=args.gpu_lowering)
    t_decode = time_target_step(target, 1, 1, args.context, args.repeats, ops)
    report: dict = dict(decode_step_s=t_decode)
    for n in sorted({min(n, c.num_experts) for n in (8, 32, 64, c.num_experts)}):
        with forced_routing(n):
            t_verify = time_target_step(target, 1, BLOCK, args.context, args.repeats, ops)
        touched = min(n, BLOCK * c.num_experts_per_tok)
        roof = step_bytes(target, BLOCK, 1, args.context, touched=touched) / timing.HBM_BYTES_PER_S
        report[n] = dict(verify_s=t_verify, roofline_s=roof, decode_steps=t_verify / t_decode)
        print(f"  verify block of {BLOCK}, {touched:3d} experts/layer: {t_verify * 1e3:7.2f} ms = "
              f"{t_verify / t_decode:5.2f} decode steps ({roof / t_verify:5.1%} of its roofline)", flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="qwen3_moe,gpt_oss")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (0: the published depth)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
    ap.add_argument("--calls", type=int, default=4, help="back-to-back calls timed")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--experts-impl", default="auto", choices=list(IMPLEMENTATIONS),
                    help="EngineConfig.experts_impl for the engine and verify tables")
    ap.add_argument("--gpu-lowering", default="triton", choices=["triton", "mosaic"],
                    help="EngineConfig.gpu_lowering: 'mosaic' runs decode and verify experts on the Mosaic GPU kernel")
    ap.add_argument("--op-tokens", default="1,16", help="token counts of the expert-op table ('': none)")
    ap.add_argument("--verify", action="store_true", help="also the verify cost by forced distinct experts")
    ap.add_argument("--tensor", type=int, default=1,
                    help="the engine table on a (data=1, tensor=N) mesh of the first N devices: experts split over "
                         "them (expert parallelism), attention heads too; the roofline is per GPU")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--json", "--out", dest="json", default=None, help="JSON report (e.g. $OUT/moe.json)")
    args = ap.parse_args()
    if args.tensor > 1 and (args.verify or args.op_tokens):
        ap.error("--tensor > 1 times the engine table only: pass --op-tokens '' and no --verify")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.op_tokens = [int(t) for t in args.op_tokens.split(",") if t]
    if args.tiny:
        args.context = min(args.context, 32)
    t0 = time.perf_counter()
    print(timing.device_line(), f"; roofline at {timing.HBM_BYTES_PER_S / 1e12:.1f} TB/s", flush=True)
    report = {"device": timing.device_line(), "args": vars(args)}
    for family in args.families.split(","):
        report[family] = bench_family(args, family)
        timing.write_json(args.json, report)
    print(f"\nfamily  batch  target ms  % roof  DFlash ms  % roof  break-even tau   ({time.perf_counter() - t0:.0f} s)")
    for family in args.families.split(","):
        for batch, e in report[family]["batches"].items():
            print(f"{family:9s} {batch:3d}  {e['target_step_s'] * 1e3:8.2f}  {e['target_roofline_share']:6.1%}"
                  f"  {e['spec_step_s'] * 1e3:8.2f}  {e['spec_roofline_share']:6.1%}"
                  f"  {e['spec_step_s'] / e['target_step_s']:6.2f}")


if __name__ == "__main__":
    main()
