"""Engine cost: a Qwen3-8B-shaped target and a 5-layer block-16 drafter, random bf16 weights.

Per batch size: one target-only greedy step and one DFlash draft + verify + commit step, inside the
engine's jitted on-device loop (state donated), each timed by synchronised calls and back to back
(one sync after many calls: the device's steady rate); the draft pass alone (what share of the
DFlash step drafting and verifying take); the target step against its HBM roofline (weights of the
serving layout plus the K/V read). At batch 1 also the host overhead of ``Engine.generate`` per step
and the time to first token. Random weights accept ~1 token per step, so DFlash tokens/s are also
projected at ``--tau`` (the published 6.5 on GSM8K) from the measured step. ``--profile-batch N`` does
only this: the GPU time of the batch-N DFlash and target-only steps by kind of op (GEMMs by role),
against the step's compute and memory roofline (``profile_ops.py``).

    python3 bench/bench_engine.py --batches 1,4,16,32 --draft-batches 1,16 --out bench/results/engine.json
    python3 bench/bench_engine.py --reference        # also the authors' PyTorch code on the same shapes
    python3 bench/bench_engine.py --tensor 2         # on a (data=1, tensor=2) mesh; roofline per GPU
    python3 bench/bench_engine.py --shape 32b --tensor 4,8 --batches 1,8,32 --collectives   # one process, each TP in turn
    python3 bench/bench_engine.py --profile-batch 16 --context 1024 --repeats 3 --out $OUT/profile16.json  # < 60 s
    JAX_PLATFORMS=cpu python3 bench/bench_engine.py --tiny --batches 1 --steps 2 --repeats 1   # smoke test
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import timing
from dflash_jax.models.config import TargetConfig
from dflash_jax.runtime import decoding
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.sharding import MeshConfig, hlo_collectives, make_mesh
from dflash_jax.tiny import tiny_target_config


def time_draft(engine: Engine, batch: int, context: int, steps: int, repeats: int) -> float:
    """Median seconds of the drafter pass alone (embed, its layers, head, argmax), ``steps`` passes in
    one jitted loop per call."""
    loop, args = draft_loop(engine, batch, context, steps)
    return timing.median_time(loop, *args, repeats=repeats)[0] / steps


def draft_loop(engine: Engine, batch: int, context: int, steps: int):
    """``steps`` drafter passes (embed, its layers, head, the drafts) in one jitted loop, and its arguments."""
    tdef, tstate = nnx.split(engine.target)
    ddef, dstate = nnx.split(engine.drafter)

    @jax.jit
    def loop(ts, ds, state):
        t, d = nnx.merge(tdef, ts), nnx.merge(ddef, ds)

        def body(i, acc):
            s = dataclasses.replace(state, starts=state.starts + (acc % 2))  # no pass hoisted out of the loop
            ids, _, _ = decoding.draft_block(t, d, s, block_size=engine.block_size, ops=engine.ops)
            return acc + ids.sum() % 7

        return jax.lax.fori_loop(0, steps, body, jnp.int32(0))

    return loop, (tstate, dstate, timing.synthetic_state(engine, batch, context, seed=batch + 1))


def host_overhead(engine: Engine, context: int, new_tokens: int, device_step: float) -> dict:
    """Wall time per step of ``Engine.generate`` against the on-device loop's time per step; its TTFT
    and the prefill alone."""
    prompt = np.random.RandomState(0).randint(0, engine.target.config.vocab_size - 1, context).tolist()
    engine.generate([prompt], new_tokens)  # compiles everything the timed generation runs
    t0 = time.perf_counter()
    (res,) = engine.generate([prompt], new_tokens)
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    np.asarray(engine.prefill([prompt], [new_tokens], [()])[1])
    prefill = time.perf_counter() - t0
    steps = max(1, res.num_steps if engine.drafter is not None else res.num_output_tokens - 1)
    decode = res.time_per_output_token * max(1, res.num_output_tokens - 1)  # first token to last
    return dict(ttft_s=res.time_to_first_token, prefill_s=prefill, wall_s=wall, steps=steps,
                wall_per_step_s=decode / steps, device_per_step_s=device_step,
                host_overhead_per_step_s=decode / steps - device_step)


def print_collectives(engine: Engine, name: str, hlo_out: Path | None) -> dict[str, int]:
    """The collectives of the compiled batch-1 decode call, largest first: what a mesh moves between
    devices (an accidental gather of a weight shows up here). Returns the count of each kind."""
    hlo = engine.decode_hlo(engine.empty_state(1))
    if hlo_out is not None:
        hlo_out.write_text(hlo)
    found = sorted(hlo_collectives(hlo), key=lambda c: -c.elements)
    print(f"collectives of the {name} decode call: {len(found)}", flush=True)
    for c in found[:6]:
        print(f"  {c.kind:10s} {c.dtype}{list(c.shape)!s:20s} {c.op_name[-90:]}", flush=True)
    return dict(collections.Counter(c.kind for c in found))


def profile_decode(engine: Engine, context: int, steps: int, out_dir: str, top: int = 20) -> None:
    """Traces batch-1 decode calls and prints the top kernels by GPU time per step. In a CUDA graph
    the profiler may see one loop iteration per call, so steps are counted by the attention kernels'
    launches (one per target and drafter layer)."""
    state = timing.warmed_state(engine, 1, context, steps, seed=7)

    def run():
        nonlocal state
        state, _ = engine.decode(state, n_steps=steps)
        jax.block_until_ready(state.starts)

    durations = timing.gpu_kernel_times(run, out_dir, calls=3)
    if not durations:
        print(f"profile: no GPU trace under {out_dir}", flush=True)
        return
    layers = engine.target.config.num_layers + (engine.drafter.config.num_layers if engine.drafter else 0)
    launches = sum(len(d) for name, d in durations.items() if "attention" in name)
    traced = launches / layers if launches else 3 * steps
    print(f"profile ({out_dir}): {traced:.1f} steps traced; top kernels, us per step (launches per step):")
    for name, d in sorted(durations.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(d) / traced:9.1f} us  {len(d) / traced:5.1f}x  {name[:110]}", flush=True)


def profile_step(args, base: Engine, out_dir: str, calls: int = 3) -> dict:
    """``--profile-batch``: the DFlash and target-only decode steps of ``args.profile_batch`` rows at
    ``args.context``, compiled in parallel, timed by synchronised calls, then traced: each one's GPU
    kernel time per step by kind of op (``profile_ops.CATEGORIES``; GEMMs by role and shape, with the
    TFLOP/s they reach), beside the step's roofline from the model's shapes. Matching kernels to HLO
    instructions uses the profiler's ``hlo_op`` annotation or XLA's kernel names; what matches
    neither is listed by name."""
    import concurrent.futures

    import profile_ops

    batch, steps = args.profile_batch, 8
    cfg = EngineConfig(max_batch_size=batch, max_length=args.context + 512, prompt_buckets=(args.context,),
                       steps_per_sync=steps, attention_impl=args.attention, decode_loop=args.decode_loop,
                       cached_attention_tiles=args.cached_config, gpu_lowering=args.gpu_lowering)
    engines = {"dflash": base.derive(cfg), "target-only": base.derive(cfg, drafter=None)}
    t0 = time.perf_counter()
    lowered = {name: engine.decode_lowered(jax.eval_shape(
        lambda e=engine: timing.synthetic_state(e, batch, args.context, seed=0)), steps)
        for name, engine in engines.items()}
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
        hlo = dict(zip(lowered, pool.map(lambda low: low.compile().as_text(), lowered.values())))
    print(f"profile: batch {batch}, context {args.context}: both decode programs compiled in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    tc, dc = base.target.config, base.drafter.config
    roles = profile_ops.model_roles(tc, dc)
    report = dict(batch=batch, context=args.context, engines={})
    for name, engine in engines.items():
        step_s, _ = timing.time_decode(engine, batch, args.context, steps, args.repeats)
        state = timing.warmed_state(engine, batch, args.context, steps, seed=5)

        def run():
            nonlocal state
            state, _ = engine.decode(state, n_steps=steps)
            jax.block_until_ready(state.starts)

        events = timing.gpu_kernel_events(run, str(Path(out_dir) / name), calls=calls) or []
        if not events:
            print(f"profile: no GPU kernels in the {name} trace ({jax.default_backend()})", flush=True)
        attributed = profile_ops.attribute(events, profile_ops.hlo_kernels(hlo[name], roles))
        # In a CUDA graph the profiler may see fewer loop iterations than ran: steps are counted by the
        # attention kernels' launches (one per target layer, and per drafter layer in a DFlash step).
        layers = tc.num_layers + (dc.num_layers if engine.drafter is not None else 0)
        launches = sum(1 for a in attributed if a["category"] == "attention")
        traced = launches / layers if launches else calls * steps
        entry = dict(step_s=step_s, steps_traced=traced, **profile_ops.summarize(attributed, traced),
                     unattributed=sorted({a["name"] for a in attributed
                                          if a["label"].startswith(profile_ops.NOT_IN_HLO + " ")}),
                     event_args=sorted(events[0]["args"]) if events else [],
                     roofline=profile_ops.roofline(tc, dc, batch, engine.block_size, args.context))
        report["engines"][name] = entry
        del state
    print_profile(report)
    return report


def print_profile(report: dict) -> None:
    """``profile_step``'s tables."""
    import profile_ops

    engines = report["engines"]
    spec, plain = engines["dflash"], engines["target-only"]
    print(f"\nbatch {report['batch']}, context {report['context']}: DFlash step {spec['step_s'] * 1e3:.3f} ms, "
          f"target-only {plain['step_s'] * 1e3:.3f} ms ({spec['step_s'] / plain['step_s']:.2f}x); GPU kernel time per "
          f"step {spec['kernel_us'] / 1e3:.3f} / {plain['kernel_us'] / 1e3:.3f} ms ({spec['steps_traced']:.1f} / "
          f"{plain['steps_traced']:.1f} steps traced; profiler args: {spec['event_args']})")
    print("category                      | DFlash us/step | target-only us/step | DFlash - target | % of DFlash kernels")
    for cat in profile_ops.CATEGORIES:
        a, b = (e["categories"].get(cat, {}).get("us", 0.0) for e in (spec, plain))
        if a or b:
            print(f"{cat:29s} | {a:14.1f} | {b:19.1f} | {a - b:15.1f} | {100 * a / max(spec['kernel_us'], 1e-9):6.1f}%")
    for name, e in engines.items():
        print(f"\n{name}: the 14 largest ops (us per step, launches per step, TFLOP/s and % of the bf16 peak for GEMMs)")
        for row in e["labels"][:14]:
            cat, label = row["category"], row["label"]
            rate = f"{row['flops'] / row['us'] / 1e6:6.0f} TFLOP/s ({100 * row['flops'] / row['us'] * 1e6 / profile_ops.H200_BF16_FLOPS:3.0f}%)" \
                if row["flops"] and row["us"] else ""
            print(f"  {row['us']:8.1f} us {row['launches']:6.1f}x  {cat[:14]:14s} {label[:60]:60s} {rate} "
                  f"[{', '.join(row['hlo'][:2])}]")
        if e["unattributed"]:
            print(f"  kernels matched by name only: {', '.join(n[:60] for n in e['unattributed'][:8])}")
        ops = e["roofline"]
        gemm_flops, gemm_us = sum(o["flops"] for o in ops if o["flops"] and "attention" not in o["op"]), \
            e["categories"].get("GEMM", {}).get("us", 0.0)
        if gemm_us:
            print(f"  GEMMs: {gemm_flops / 1e12:.2f} TFLOP per step (from the shapes) in {gemm_us:.0f} us of kernels: "
                  f"{gemm_flops / gemm_us / 1e6:.0f} TFLOP/s, {100 * gemm_flops / gemm_us * 1e6 / profile_ops.H200_BF16_FLOPS:.0f}% "
                  "of the bf16 peak")
        flops, nbytes = sum(o["flops"] for o in ops), sum(o["bytes"] for o in ops)
        compute_s, memory_s = sum(o["compute_s"] for o in ops), sum(o["memory_s"] for o in ops)
        print(f"  roofline from the shapes: {flops / 1e12:.2f} TFLOP ({compute_s * 1e3:.3f} ms at "
              f"{profile_ops.H200_BF16_FLOPS / 1e12:.0f} TFLOP/s), {nbytes / 1e9:.2f} GB ({memory_s * 1e3:.3f} ms at "
              f"{timing.HBM_BYTES_PER_S / 1e12:.1f} TB/s); the step takes {e['step_s'] * 1e3:.3f} ms = "
              f"{100 * max(compute_s, memory_s) / e['step_s']:.0f}% of the larger")
        for o in ops:
            print(f"    {o['op'][:40]:40s} {o['flops'] / 1e9:9.1f} GFLOP {o['bytes'] / 1e6:9.1f} MB  "
                  f"{o['compute_s'] * 1e6:8.1f} us compute {o['memory_s'] * 1e6:8.1f} us memory")


def reference_torch(cfg: TargetConfig, drafter_layers: int, block: int, context: int, new_tokens: int,
                    repeats: int = 3) -> dict:
    """The authors' PyTorch code (transformers backend) on the same shapes, random weights: per mode
    the median of ``repeats`` generations, each run's tok/s, and the share of its wall time the calling
    thread spent on the CPU (near 1: the eager loop is host-bound, its speed the host's)."""
    import dflash.model as dm
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    tconf = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, tie_word_embeddings=False)
    base = {k: v for k, v in tconf.to_dict().items() if k != "layer_types"}
    dconf = Qwen3Config(**{**base, "num_hidden_layers": drafter_layers, "block_size": block,
                           "num_target_layers": cfg.num_layers,
                           "dflash_config": {"mask_token_id": cfg.vocab_size - 1}})
    with torch.device("cuda"):
        target = Qwen3ForCausalLM(tconf).eval()
        drafter = dm.DFlashDraftModel(dconf).eval()
    prompt = torch.randint(0, cfg.vocab_size - 1, (1, context), device="cuda")
    out = {}
    for name, b in (("target_only", 1), ("dflash", block)):
        dm.dflash_generate(drafter, target, prompt, 8, None, block_size=b)
        runs = []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.thread_time()
            stats = dm.dflash_generate(drafter, target, prompt, new_tokens, None, block_size=b, return_stats=True)
            torch.cuda.synchronize()
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            steps = max(1, len(stats.acceptance_lengths))
            decode = stats.time_per_output_token * stats.num_output_tokens
            runs.append(dict(tok_s=1.0 / stats.time_per_output_token, step_s=decode / steps, cpu_share=cpu / wall))
        median = sorted(runs, key=lambda r: r["step_s"])[len(runs) // 2]
        out[name] = dict(median, runs=runs, torch_threads=torch.get_num_threads())
    del target, drafter
    torch.cuda.empty_cache()
    return out


def bench_batch(args, base: Engine, batch: int, draft_batches: set[int], tensor: int) -> dict:
    """The engines of one batch size, on ``base``'s copy of the weights (``Engine.derive``)."""
    cfg = EngineConfig(max_batch_size=batch, max_length=args.context + 512, prompt_buckets=(args.context,),
                       steps_per_sync=args.steps_per_sync, attention_impl=args.attention, mesh=base.config.mesh,
                       decode_loop=args.decode_loop, cached_attention_tiles=args.cached_config,
                       gpu_lowering=args.gpu_lowering)
    spec, plain = base.derive(cfg), base.derive(cfg, drafter=None)
    t0 = time.perf_counter()
    t_plain, _ = timing.time_decode(plain, batch, args.context, args.steps, args.repeats)
    t_spec, tau = timing.time_decode(spec, batch, args.context, args.steps, args.repeats)
    t_draft = time_draft(spec, batch, args.context, args.steps, args.repeats) if batch in draft_batches else None
    # As many back-to-back calls as the rows' spare positions allow after the two warm-up calls.
    spare = cfg.max_length - args.context - spec.block_size
    calls = max(1, min(2 * args.repeats, spare // args.steps - 2))
    t_plain_piped = timing.time_decode_pipelined(plain, batch, args.context, args.steps, calls)
    t_spec_piped = timing.time_decode_pipelined(spec, batch, args.context, args.steps, calls)
    print(f"batch {batch}: step ms {t_plain * 1e3:.3f} / DFlash {t_spec * 1e3:.3f}; back to back "
          f"{t_plain_piped * 1e3:.3f} / {t_spec_piped * 1e3:.3f} ({calls} calls)", flush=True)
    roofline = timing.hbm_roofline_s(plain.target, batch, args.context) / tensor  # each GPU its shard
    entry = dict(target_step_s=t_plain, spec_step_s=t_spec, draft_s=t_draft, tau_random=tau,
                 target_tok_s=batch / t_plain, spec_tok_s_random=batch * tau / t_spec,
                 spec_tok_s_projected=batch * args.tau / t_spec, step_ratio=t_spec / t_plain,
                 draft_ratio=(t_draft / t_plain) if t_draft else None,
                 # the rest of a DFlash step: the verify pass, the commit, the drafter's context K/V
                 verify_ratio=((t_spec - t_draft) / t_plain) if t_draft else None,
                 hbm_roofline_step_s=roofline, target_hbm_fraction=roofline / t_plain,
                 target_step_pipelined_s=t_plain_piped, spec_step_pipelined_s=t_spec_piped,
                 target_hbm_fraction_pipelined=roofline / t_plain_piped, wall_s=time.perf_counter() - t0)
    if batch == 1:
        if args.collectives:
            for name, engine in (("target-only", plain), ("dflash", spec)):
                hlo = Path(args.out).with_name(f"decode_hlo_{name}_tp{tensor}.txt") if args.out else None
                entry.setdefault("collectives", {})[name] = print_collectives(engine, name, hlo)
        if args.host_overhead:
            try:
                entry["host"] = host_overhead(spec, args.context, 128, t_spec)
                entry["host_target_only"] = host_overhead(plain, args.context, 64, t_plain)
            except Exception as err:  # noqa: BLE001  (keep the step timings of this batch)
                print(f"host-overhead run failed: {err!r}", flush=True)
        if args.profile:  # last: the step timings are taken before any trace
            for name, engine in (("target-only", plain), ("dflash", spec)):
                profile_decode(engine, args.context, 8, str(Path(args.profile) / name))
    return entry


def print_table(args, report: dict, rows: list[tuple[int, dict]], tensor: int) -> None:
    shape = "tiny" if args.tiny else f"Qwen3-{args.shape.upper()}"
    print(f"\n{shape} shapes, bf16, context {args.context}, attention={args.attention}"
          f"{f' (cached tiles {args.cached_config})' if args.cached_config else ''}"
          f"{f', TP={tensor} (roofline per GPU: its shard)' if tensor > 1 else ''}, HBM roofline at "
          f"{timing.HBM_BYTES_PER_S / 1e12:.1f} TB/s")
    print(f"batch | target step ms | tok/s | % HBM roofline | DFlash step ms | step ratio | draft ratio | verify ratio "
          f"| DFlash tok/s @tau={args.tau} | back to back: target step ms (% roofline), DFlash step ms, ratio")
    for batch, e in rows:
        draft, verify = (f"{e[k]:.2f}" if e.get(k) else "-" for k in ("draft_ratio", "verify_ratio"))
        print(f"{batch:5d} | {e['target_step_s'] * 1e3:14.2f} | {e['target_tok_s']:5.0f} | "
              f"{100 * e['target_hbm_fraction']:13.0f}% | {e['spec_step_s'] * 1e3:14.2f} | {e['step_ratio']:10.2f} | "
              f"{draft:>11} | {verify:>12} | {e['spec_tok_s_projected']:8.0f} | {e['target_step_pipelined_s'] * 1e3:.2f} "
              f"({100 * e['target_hbm_fraction_pipelined']:.1f}%), {e['spec_step_pipelined_s'] * 1e3:.2f}, "
              f"{e['spec_step_pipelined_s'] / e['target_step_pipelined_s']:.3f}")
    card = report.get("card")
    if card:
        print(f"this card's GEMV chain streams {card['gemv_bytes_per_s'] / 1e12:.2f} TB/s; the back-to-back target "
              "step reads its bytes at")
        for batch, e in rows:
            rate = e["hbm_roofline_step_s"] * timing.HBM_BYTES_PER_S / e["target_step_pipelined_s"]
            print(f"  batch {batch}: {rate / 1e12:.2f} TB/s, {rate / card['gemv_bytes_per_s']:.1%} of that")
    for batch, e in rows:
        for key, mode in (("host", "DFlash"), ("host_target_only", "target-only")):
            if h := e.get(key):
                print(f"host overhead at batch 1, {mode}: {h['host_overhead_per_step_s'] * 1e3:.2f} ms/step "
                      f"(wall {h['wall_per_step_s'] * 1e3:.2f} vs device {h['device_per_step_s'] * 1e3:.2f}); "
                      f"TTFT {h['ttft_s'] * 1e3:.1f} ms (prefill alone {h['prefill_s'] * 1e3:.1f} ms)")
    r = report.get("reference_torch")
    if r and "error" not in r:
        b1 = next((e for batch, e in rows if batch == 1), None)
        runs = ", ".join(f"{x['tok_s']:.1f}" for x in r["target_only"]["runs"])
        print(f"authors' PyTorch: target-only {r['target_only']['tok_s']:.1f} tok/s (runs {runs}; CPU busy "
              f"{r['target_only']['cpu_share']:.0%} of the wall time), block-16 step "
              f"{r['dflash']['step_s'] / r['target_only']['step_s']:.2f} target steps"
              + (f"; ours target-only {b1['target_tok_s']:.0f} tok/s "
                 f"({b1['target_tok_s'] / r['target_only']['tok_s']:.1f}x)" if b1 else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b", choices=sorted(timing.SHAPES), help="Qwen3-8B or Qwen3-32B shapes")
    ap.add_argument("--layers", type=int, default=None, help="target layers (default: the shape's)")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--draft-batches", default="1,16", help="batch sizes for the draft-only breakdown")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
    ap.add_argument("--steps-per-sync", type=int, default=8, help="EngineConfig.steps_per_sync (Engine.generate)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-loop", default="auto", choices=["auto", "until_done", "fixed"],
                    help="EngineConfig.decode_loop")
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "pallas"],
                    help="EngineConfig.attention_impl (auto: pallas on GPUs and TPUs)")
    ap.add_argument("--cached-config", default="", metavar="FIELD=N,...",
                    help="EngineConfig.cached_attention_tiles, e.g. min_chunk=128,block_k=32")
    ap.add_argument("--gpu-lowering", default="triton", choices=["triton", "mosaic"],
                    help="EngineConfig.gpu_lowering: the Pallas GPU lowering of the kernels")
    ap.add_argument("--tensor", default="1",
                    help="tensor-parallel degrees, e.g. 1,2,4,8: for each in turn, engines on a (data=1, tensor=N) "
                         "mesh of the first N devices, the weights created in their shards; the roofline is per GPU")
    ap.add_argument("--reference", action="store_true", help="also time the authors' PyTorch code")
    ap.add_argument("--tau", type=float, default=6.5, help="acceptance length for projected tokens/s")
    ap.add_argument("--collectives", action="store_true", help="list the collectives of the batch-1 decode steps")
    ap.add_argument("--host-overhead", action=argparse.BooleanOptionalAction, default=True,
                    help="at batch 1, Engine.generate's wall time per step and the time to first token")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="trace batch-1 decode steps into DIR and print the top kernels per step")
    ap.add_argument("--profile-batch", type=int, default=0, metavar="N",
                    help="only profile the DFlash and target-only steps of N rows at --context: GPU time per step "
                         "by kind of op against the roofline (trace into --profile, default /tmp/dflash_profile)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--out", default=None, help="JSON report (e.g. bench/results/engine.json)")
    args = ap.parse_args()

    print(timing.device_line(), flush=True)
    tcfg = tiny_target_config(num_layers=4) if args.tiny else timing.SHAPES[args.shape](
        *(() if args.layers is None else (args.layers,)))
    tensors = [int(t) for t in args.tensor.split(",")]
    if args.profile_batch and len(tensors) > 1:
        raise SystemExit("--profile-batch takes one --tensor degree")
    report = dict(config=vars(args), by_tensor={})
    if not args.tiny:
        report["card"] = card = timing.card_streaming_rate(max(5, 4 * args.repeats))
        print(f"this card streams weights through XLA's GEMVs at {card['gemv_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    draft_batches = {int(b) for b in args.draft_batches.split(",") if b}
    tables = []
    for tensor in tensors:
        t0 = time.perf_counter()
        mesh = MeshConfig(data=1, fsdp=1, tensor=tensor) if tensor > 1 else None
        devices = make_mesh(mesh, jax.devices()[:tensor]) if mesh is not None else None
        target, drafter = timing.random_pair(tcfg, mesh=devices, drafter_layers=timing.drafter_layers(args.tiny))
        # Every engine below is derived from this one: the weights are held once, in the serving layout.
        base = Engine(target, drafter, EngineConfig(max_batch_size=1, max_length=64, attention_impl="xla", mesh=mesh),
                      mesh=devices)
        del target, drafter
        if args.profile_batch:
            report = dict(config=vars(args), profile=profile_step(args, base, args.profile or "/tmp/dflash_profile"))
            timing.write_json(args.out, report)
            return
        tbytes, dbytes = timing.streamed_bytes(base.target), timing.param_bytes(base.drafter)
        print(f"TP={tensor}: init {time.perf_counter() - t0:.1f}s; the target streams {tbytes / 1e9:.2f} GB per step, "
              f"the drafter {dbytes / 1e9:.2f} GB", flush=True)
        runs = report["by_tensor"][tensor] = dict(target_gb=tbytes / 1e9, drafter_gb=dbytes / 1e9, batches={})
        rows = []
        for batch in (int(b) for b in args.batches.split(",")):
            entry = bench_batch(args, base, batch, draft_batches, tensor)
            runs["batches"][batch] = entry
            rows.append((batch, entry))
            timing.write_json(args.out, report)
        tables.append((tensor, rows))
        del base
        gc.collect()

    if args.reference:
        try:
            report["reference_torch"] = reference_torch(tcfg, 5, 16, args.context, 64)
        except Exception as err:  # noqa: BLE001  (the table still prints)
            report["reference_torch"] = dict(error=repr(err))
            print(f"reference failed: {err!r}", flush=True)
    timing.write_json(args.out, report)
    for tensor, rows in tables:
        print_table(args, report, rows, tensor)
        if rows and statistics.fmean(e["tau_random"] for _, e in rows) < 1:
            print("WARNING: a DFlash step committed under one token per row: the decode loop is broken")


if __name__ == "__main__":
    main()
