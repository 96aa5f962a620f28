"""Training throughput of the DFlash train step: compile time, step time, tokens/s and MFU.

Default: a Qwen3-8B-shaped target (36 layers, hidden 4096, GQA 32/8, vocab 151936, bf16, random
weights) and a 5-layer B=16 drafter, seq_len 4096, 512 anchors, loss_chunk 64: one jitted step
(frozen target forward + drafter forward/backward + AdamW) per micro-batch, the target's layers
stacked and run under ``lax.scan`` as in ``train.py`` (``--unrolled-target``: the 36 layers unrolled,
for comparison). Variants = every ``--batch`` x ``--attention-impl`` (``OpsConfig.attention`` of the
step: with "pallas" the drafter's attention is the Pallas kernel and the target's full-sequence
attention a library flash attention, cuDNN's on GPUs; with "xla" both the reference) x
``--gpu-lowering`` (the Pallas kernels' lowering with "pallas": Triton or Mosaic GPU). Each row is
printed when it finishes and written to ``--out/<variant>.json``; a variant that fails (e.g. out of
memory) writes its error and the next one runs.

    python3 bench/bench_train.py --out bench/results/train                         # on the accelerator
    JAX_PLATFORMS=cpu python3 bench/bench_train.py --tiny --out /tmp/bench_train   # smoke test
    python3 bench/bench_train.py --batch 8 --attention-impl pallas --mesh 1,1,1 8,1,1 1,8,1 2,2,2 1,1,8   # 8 GPUs
    python3 bench/bench_train.py --compile-only --batch 1                          # compile time only

``--compile-only`` compiles the step for the local backend from abstract arguments
(``jax.ShapeDtypeStruct``): on a CPU it measures the compile time and XLA's buffer assignment of
the 8B step without allocating it.

MFU = model FLOPs per step / step time / peak bf16 FLOP/s of the devices (``--mesh``: all of its devices). Model FLOPs per sequence
(``dflash_jax.training.monitor.train_flops_per_sequence``; recomputation not counted):

    target forward, D = deepest tap + 1 layers:   2 D P_t S + 2 D S^2 h d   (causal attention)
    drafter fc over S tokens, fwd + weight grad:  2 x 2 S n_taps H H
    drafter context K/V over S tokens, fwd+bwd:   3 x 2 S L H 2 kv d
    drafter layers over T = anchors x B tokens:   3 x 2 L P_d T
    drafter attention:                            3 x 4 T (S/2 + B) h d L
    LM head over T tokens, fwd + input grad:      2 x 2 T H V

with ``P`` a layer's matmul parameters (Q, K, V, O, gate, up, down), ``h, kv, d`` heads, KV heads,
head dim, ``H`` hidden, ``V`` vocabulary, ``L`` drafter layers (plus the head ``2 S H V`` and all
target layers when distilling, which this benchmark does not).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import timing
from dflash_jax.models.config import DrafterConfig, TargetConfig, default_target_layer_ids
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target, init_stacked, stack_layers, unstack_layers
from dflash_jax.ops import OpsConfig
from dflash_jax.sharding import MeshConfig
from dflash_jax.training import parallel
from dflash_jax.training.config import OptimConfig
from dflash_jax.training.monitor import peak_flops_per_device, train_flops_per_sequence
from dflash_jax.training.optim import make_optimizer
from dflash_jax.training.trainer import StepSpec, init_state, make_train_step, split_drafter

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=6, num_heads=4,
            num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0)


@dataclasses.dataclass(frozen=True)
class Models:
    tcfg: TargetConfig
    dcfg: DrafterConfig
    target_graph: object  # ScanGraph, or the Target's GraphDef with --unrolled-target
    target_params: object
    drafter_graph: nnx.GraphDef
    drafter_params: object  # nnx.State, float32
    drafter_rest: object


def configs(shape: dict, draft_layers: int, block: int) -> tuple[TargetConfig, DrafterConfig]:
    tcfg = TargetConfig(**shape, model_type="qwen3")
    dcfg = DrafterConfig(**dict(shape, num_layers=draft_layers), block_size=block,
                         mask_token_id=shape["vocab_size"] - 1,
                         target_layer_ids=default_target_layer_ids(shape["num_layers"], draft_layers),
                         num_target_layers=shape["num_layers"])
    return tcfg, dcfg


def build(tcfg: TargetConfig, dcfg: DrafterConfig, *, unrolled: bool, abstract: bool) -> Models:
    """Random models on the default device (or their ``ShapeDtypeStruct``s when ``abstract``)."""
    box = {}

    def drafter():
        graph, params, rest = split_drafter(Drafter(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(1)))
        box["drafter"] = graph
        return params, rest

    def target():
        t = Target(tcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        box["target"], params = nnx.split(t) if unrolled else stack_layers(t)
        return params

    if abstract:
        d_params, d_rest = jax.eval_shape(drafter)
        t_params = jax.eval_shape(target)
        t_graph = box["target"]
    else:
        d_params, d_rest = jax.jit(drafter)()
        # The layers from one vmapped initialisation: an 8B target never sits on the device twice.
        t_graph, t_params = init_stacked(tcfg, dtype=jnp.bfloat16, seed=0)
        if unrolled:
            t_graph, t_params = nnx.split(unstack_layers(t_graph, t_params))
    d_rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, d_rest)
    return Models(tcfg, dcfg, t_graph, t_params, box["drafter"], d_params, d_rest)


def make_batch(batch: int, seq: int, vocab: int, abstract: bool) -> dict:
    if abstract:
        s = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        return {"input_ids": s, "loss_mask": s, "segment_ids": s}
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab - 1, (batch, seq))
    mask = np.ones((batch, seq), np.int32)
    mask[:, : seq // 8] = 0  # a prompt part
    return {"input_ids": jnp.asarray(ids, jnp.int32), "loss_mask": jnp.asarray(mask),
            "segment_ids": jnp.ones((batch, seq), jnp.int32)}


def bench_one(m: Models, *, batch: int, seq: int, anchors: int, chunk: int, impl: str, steps: int, warmup: int,
              abstract: bool, lowering: str = "triton", mesh: Mesh | None = None) -> dict:
    """One variant's step. On ``mesh`` (a training run's: ``training.parallel``) the drafter's weights and
    optimizer state, the frozen target and the batch are placed as ``train.py`` places them and the step
    is traced under the mesh for the kernels; ``batch`` is the global batch."""
    tx = make_optimizer(OptimConfig(lr=6e-4), 1000)
    spec = StepSpec(block_size=m.dcfg.block_size, mask_token_id=m.dcfg.mask_token_id,
                    target_layer_ids=tuple(m.dcfg.target_layer_ids), num_anchors=anchors, loss_chunk=chunk,
                    compute_dtype=jnp.bfloat16, ops=OpsConfig(attention=impl, gpu_lowering=lowering))
    train_step = make_train_step(m.drafter_graph, m.drafter_rest, m.target_graph, tx, spec)
    data = make_batch(batch, seq, m.tcfg.vocab_size, abstract)
    target_params = m.target_params
    if mesh is None:
        step = jax.jit(train_step, donate_argnums=(0,))
        if abstract:
            state = jax.eval_shape(lambda p: init_state(p, tx), m.drafter_params)
        else:
            state = init_state(jax.tree.map(jnp.copy, m.drafter_params), tx)  # the step donates its state
    else:
        state_sh = parallel.train_state_shardings(m.drafter_params, tx, mesh)
        t_sh = parallel.state_shardings(m.target_params, mesh, "target")
        step = parallel.jit_train_step(train_step, mesh, state_sh, t_sh)
        if abstract:
            state = jax.eval_shape(lambda p: init_state(p, tx), m.drafter_params)
        else:
            state = jax.jit(lambda p: init_state(p, tx), out_shardings=state_sh)(m.drafter_params)
            target_params = jax.device_put(m.target_params, t_sh)
            data = jax.device_put(data, parallel.batch_sharding(mesh))
    t0 = time.perf_counter()
    lowered = step.lower(state, target_params, data)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    flops = train_flops_per_sequence(m.tcfg, m.dcfg, seq, anchors, distill=False) * batch
    row = {"batch": batch, "seq_len": seq, "anchors": anchors, "loss_chunk": chunk, "attention": impl,
           "gpu_lowering": lowering,
           "lower_s": t1 - t0, "compile_s": t2 - t1, "model_tflop_per_step": flops / 1e12}
    try:
        mem = compiled.memory_analysis()
        row["xla_temp_gib"] = mem.temp_size_in_bytes / 2**30
        row["xla_args_gib"] = mem.argument_size_in_bytes / 2**30
    except Exception:  # noqa: BLE001  (not every backend reports it)
        pass
    if abstract:
        return row
    for _ in range(warmup):
        state, metrics = compiled(state, target_params, data)
        jax.block_until_ready(metrics["loss"])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, target_params, data)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    peak = peak_flops_per_device()
    devices = 1 if mesh is None else mesh.size
    row.update({
        "devices": devices, "step_s": dt, "step_s_all": times, "tokens_per_s": batch * seq / dt,
        "draft_tokens_per_s": batch * anchors * m.dcfg.block_size / dt, "tflops": flops / dt / 1e12,
        "mfu": flops / dt / (peak * devices) if peak else None, "loss": float(metrics["loss"]),
    })
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in (mesh.devices.flat if mesh else jax.devices()[:1])]
    if all(p is not None for p in peaks):
        row["process_peak_gib"] = max(peaks) / 2**30  # the fullest device, since the process started
    return row


def fmt(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name:<14} failed: {r['error'][:160]}"
    s = f"{name:<14} compile {r['compile_s']:6.1f} s"
    if "xla_temp_gib" in r:
        s += f"  temp {r['xla_temp_gib']:6.1f} GiB"
    if "step_s" in r:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        s += (f"  step {r['step_s']:.3f} s  {r['tokens_per_s']:8.0f} tok/s  {r['draft_tokens_per_s']:8.0f} draft tok/s"
              f"  {r['tflops']:6.1f} TFLOP/s  MFU {mfu}  loss {r['loss']:.3f}")
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes (smoke test)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--attention-impl", nargs="+", default=["pallas", "xla"], choices=["pallas", "xla"])
    ap.add_argument("--gpu-lowering", nargs="+", default=["mosaic"], choices=["triton", "mosaic"],
                    help="the Pallas kernels' GPU lowering, one variant each (with --attention-impl pallas)")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--anchors", type=int, default=None)
    ap.add_argument("--loss-chunk", type=int, default=None)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--unrolled-target", action="store_true", help="the target's layers unrolled (no scan)")
    ap.add_argument("--compile-only", action="store_true", help="abstract arguments; compile, do not run")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds; variants not started by then are skipped")
    ap.add_argument("--mesh", nargs="+", default=["1,1,1"], metavar="D,F,T",
                    help="(data, fsdp, tensor) meshes, one variant each, on the first D*F*T devices (1,1,1: one "
                         "device, unsharded); --batch is then the global batch")
    ap.add_argument("--out", default=None, help="directory for one JSON per variant")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    shape = TINY if args.tiny else QWEN3_8B
    seq = args.seq_len or (128 if args.tiny else 4096)
    anchors = args.anchors or (16 if args.tiny else 512)
    chunk = args.loss_chunk if args.loss_chunk is not None else (4 if args.tiny else 64)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    peak = peak_flops_per_device()
    peak_s = f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown"
    print(f"{timing.device_line()}; peak bf16 {peak_s}; "
          f"target layers {'unrolled' if args.unrolled_target else 'scanned'}", flush=True)
    tcfg, dcfg = configs(shape, args.draft_layers, args.block)
    t0 = time.perf_counter()
    models = build(tcfg, dcfg, unrolled=args.unrolled_target, abstract=args.compile_only)
    if not args.compile_only:
        jax.block_until_ready(jax.tree.leaves(models.target_params))
    print(f"built the models in {time.perf_counter() - t0:.1f} s", flush=True)
    meta = {"jax": jax.__version__, "device": dev.device_kind, "devices": jax.device_count(),
            "python": platform.python_version(), "target": "tiny" if args.tiny else "qwen3-8b-shaped",
            "draft_layers": args.draft_layers, "block_size": args.block,
            "target_layers": "unrolled" if args.unrolled_target else "scanned",
            "compile_only": args.compile_only, "steps": args.steps, "warmup": args.warmup}
    rows = 0
    failures = 0
    variants = [(impl, lowering, mesh) for impl in args.attention_impl
                for lowering in (args.gpu_lowering if impl == "pallas" else ["triton"]) for mesh in args.mesh]
    for batch in args.batch:
        for impl, lowering, mesh_arg in variants:
            sizes = tuple(int(x) for x in mesh_arg.split(","))
            mesh = None if sizes == (1, 1, 1) else parallel.make_mesh(
                MeshConfig(data=sizes[0], fsdp=sizes[1], tensor=sizes[2]), jax.devices()[:int(np.prod(sizes))])
            name = (f"b{batch}_{impl}" + (f"_{lowering}" if lowering != "triton" else "")
                    + ("_unrolled" if args.unrolled_target else "")
                    + (f"_mesh{'x'.join(map(str, sizes))}" if mesh is not None else ""))
            if args.time_limit is not None and time.perf_counter() - start > args.time_limit:
                print(f"{name:<14} skipped: --time-limit {args.time_limit:.0f} s reached", flush=True)
                continue
            print(f"{name:<14} compiling ...", flush=True)  # so that a run cut short shows where
            try:
                row = bench_one(models, batch=batch, seq=seq, anchors=anchors, chunk=chunk, impl=impl,
                                steps=args.steps, warmup=args.warmup, abstract=args.compile_only, lowering=lowering,
                                mesh=mesh)
            except Exception as err:  # noqa: BLE001  (e.g. out of memory: record it, run the next variant)
                failures += 1
                row = {"batch": batch, "attention": impl, "gpu_lowering": lowering, "mesh": mesh_arg,
                       "error": f"{type(err).__name__}: {err}"[:2000]}
            rows += 1
            gc.collect()  # free a failed variant's buffers before the next one
            print(fmt(name, row), flush=True)
            if out:
                timing.write_json(out / f"{name}.json", dict(meta, **row))
    return 1 if rows and failures == rows else 0  # expected OOMs of some variants are results too


if __name__ == "__main__":
    sys.exit(main())
