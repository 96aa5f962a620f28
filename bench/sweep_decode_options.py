#!/usr/bin/env python
"""A decode step (batch 1 unless ``--batch``) under variants of the engine's kernels and XLA options, in one process.

Each variant builds fresh engines over the same Qwen3-8B-shaped weights (bench_engine.py's model
and method: on-device loop, state donated, median of repeats) with

- ``options``: XLA options for the decode jit only (``jax.jit(..., compiler_options=...)``, as the
  engine passes its own per-backend options; an option this XLA does not know fails that variant);
- ``unfused_norms``: residual adds and RMSNorms as XLA ops instead of the add_rms_norm kernel;
- ``no_row_padding``: ``layers.dense`` without its padding of single rows to two (the A/B of that
  padding: it only changes projections whose shard is under ``GPU_STRENGTH_REDUCTION_LIMIT``);
- ``attn:FIELD=N+...``: the cached-attention kernel's tile config (``GpuConfig`` fields), e.g.
  ``attn:min_chunk=64+num_stages=2``;
- ``norm_warps:N``: the add_rms_norm kernel with N warps (``rms_norm_gpu.NUM_WARPS``);
- ``qkv_partials:S``: a decode token's fused QKV projection as S float32 split-K partials that the
  cached-attention kernel sums (``layers.QKV_PARTIALS``, 8 by default; ``qkv_partials:0``: one dot
  and XLA's split-K reduction kernel); ``o_partials:S``: its output projection as S partials that
  XLA sums (``layers.OUTPUT_PARTIALS``, 8 by default; 0: one dot, split by XLA); ``xla_splits``:
  both as one dot, split by XLA (the engine before the twenty-third session);
- ``pad_all:repeat`` / ``pad_all:zeros``: every one-row dot of ``layers.dense`` padded to two rows
  (the strength-reduction limit raised past every weight), the row repeated (``dense``'s padding) or a
  zero row (its padding before the twenty-fourth session): the cost of the padding itself, which on
  one GPU no 8B projection needs (at TP=2 the output projection does);
- ``partials:PROJ=S+...``: the output and down projections (``o``, ``down``) of one row written
  out as S float32 partials, which the ``add_rms_norm`` after them sums in its prologue (a prototype
  kernel): no split-K reduce kernel after either (target-only decode; verify blocks unchanged);
- ``xla:KEY=VALUE``: one XLA option for the decode jit, e.g.
  ``xla:xla_gpu_override_gemm_autotuner=block_m:16 block_n:64 ...`` (an option that only steers the
  GEMM autotuner needs a process of its own: XLA keeps one autotuning result per fusion and process,
  docs/benchmarks.md, twenty-first session);
- ``splitk:PROJ=S+...``: one-row projections that go through ``layers.dense`` (``gate_up``, ``down``;
  ``qkv`` and ``o`` with ``qkv_partials:0`` / ``o_partials:0``) with their split-K written out
  (``layers.single_row_partials``: S float32 partials, summed) instead of the split XLA's cost model
  picks; e.g. ``splitk:down=4``;
- ``l2-MODE:PROJ=MB+...``: the weights of the named projections (``qkv``, ``o``, ``gate_up``,
  ``down``), MB each, fetched into L2 by a reduction of their own beside the short kernels before
  their matmuls, ``MODE`` ``concurrent``, ``stream`` or ``serial`` (``l2_prefetch.py``); e.g.
  ``l2-concurrent:o=16+qkv=8``; ``concurrent`` / ``lhs_graph``: the decode loop's CUDA graph
  ordered by data flow (the engine's default) / chained in XLA's schedule (XLA's default);
- ``kv_prefetch``: a decode token's K/V cache pulled into L2 (priority "last") by a kernel of its own
  beside the layer's QKV matmul, before the attention reads it (``kv_prefetch.py``);
- ``mlp_chains:C[+P][+lag]``: a decode token's MLP as C independent chains over slices of its
  intermediate units, branches of the decode loop's CUDA graph (``mlp_chains.py``); each chain's down
  as P float32 split-K partials (all summed in one reduction) or XLA's dot; ``lag``: each chain's
  input behind an ``optimization_barrier`` with the last one's gate-up (meant to stagger the chains;
  it adds no edge to the graph, twenty-fifth session);
- ``argmax_two_stage``: the greedy argmax over the vocabulary as ``decoding._argmax_two_stage`` (the
  max of 128-wide slices first, written for XLA:CPU) instead of XLA's one (value, index) reduction;
- ``fixed_loop``: the engine's decode loop as a fixed number of steps (``EngineConfig.decode_loop``
  ``fixed``, the GPU mesh's loop) instead of a ``while`` that reads its condition after every step;
- ``unfolded_norms``: the target's norms not folded into its matmuls (``layers.FOLD_NORMS`` off: an
  ``add_rms_norm`` kernel before QKV and gate-up, the engine before the twenty-sixth session). The
  variants that patch the layer's norms, dots or MLP (``unfused_norms``, ``partials:``, ``splitk:``,
  ``l2-*``, ``kv_prefetch``, ``mlp_chains``) run unfolded too: they were written against that layer.
  The random weights' norms are ones, so the two layouts hold the same weights.

``--pipelined N`` also times each engine's steady rate (N decode calls dispatched back to back, one
sync: ``bench_engine.time_decode_pipelined``), which leaves out the host's dispatch that each
synchronous call pays.

Within one process the same step drifts by up to ~1.5% over a sweep (docs/benchmarks.md,
fourteenth session), so a 1% difference needs ``--rounds N``: the variant list runs N times, one
round after the other (A B A B ...), and the table gives each variant's median over its runs, its
runs, and the difference of medians from the first variant.

    python bench/sweep_decode_options.py --out $OUT/sweep.json             # on the GPU
    python bench/sweep_decode_options.py --only base,attn:block_k=32 --rounds 3
    python bench/sweep_decode_options.py --tiny --only base                  # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kernels_pallas  # noqa: E402
from kernels_pallas import _pdl, cached_attention_gpu, rms_norm_gpu  # noqa: E402
from bench_split_matmul import add_rms_norm_partials  # noqa: E402
from kv_prefetch import kv_prefetching_cached  # noqa: E402
from mlp_chains import attach_chains, chained_call, detach_chains  # noqa: E402
from l2_prefetch import MODES as L2_MODES, prefetching_cached  # noqa: E402
from bench_engine import (_option, hbm_roofline_s, int_fields, profile_decode, qwen3_8b, random_pair,  # noqa: E402
                          time_decode, time_decode_pipelined)
from dflash_jax import decoding  # noqa: E402
from dflash_jax import engine as engine_module  # noqa: E402
from dflash_jax import layers  # noqa: E402
from dflash_jax import target as target_module  # noqa: E402
from dflash_jax.engine import Engine, EngineConfig  # noqa: E402
from dflash_jax.layers import fuse_projections  # noqa: E402
from dflash_jax.sharding import MeshConfig  # noqa: E402
from dflash_jax.tiny import tiny_target_config  # noqa: E402

NO_SPLIT_K = {"xla_gpu_experimental_force_split_k": 1}
GRAPHED = engine_module._GPU_DECODE_COMMAND_BUFFER
VARIANTS = {  # name: (XLA options, unfused norms)
    "base": ({}, False),
    "unfused_norms": ({}, True),
    "no_split_k": (NO_SPLIT_K, False),
    "no_split_k+unfused_norms": (NO_SPLIT_K, True),
    "gemm_fusion_v2": ({"xla_gpu_experimental_gemm_fusion_v2": True}, False),
    "gemm_fusion_v2+unfused_norms": ({"xla_gpu_experimental_gemm_fusion_v2": True}, True),
    "block_level_rewriter+unfused_norms": ({"xla_gpu_experimental_enable_fusion_block_level_rewriter": True}, True),
    "all_fusions_with_triton+unfused_norms": ({"xla_gpu_experimental_all_fusions_with_triton": True}, True),
    "heroless_priority_fusion+unfused_norms": ({"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True},
                                               True),
    "triton_multi_output_fusion+unfused_norms": ({"xla_gpu_unsupported_enable_triton_multi_output_fusion": True}, True),
    "exhaustive_tiling_search": ({"xla_gpu_exhaustive_tiling_search": True}, False),
    "pdl_off": ({"xla_gpu_enable_pdl": False}, False),
    "pdl_on": ({"xla_gpu_enable_pdl": True}, False),
    "pdl_launch": ({"xla_gpu_enable_pdl": True, "xla_gpu_enable_pdl_launch": True}, False),
    "pdl_launch+unfused_norms": ({"xla_gpu_enable_pdl": True, "xla_gpu_enable_pdl_launch": True}, True),
    # on a mesh (--tensor): collectives on the compute stream, and inside the CUDA graphs
    "sync_collectives": ({"xla_gpu_disable_async_collectives": "ALLCOLLECTIVES"}, False),
    "graph_collectives": ({"xla_gpu_enable_command_buffer": GRAPHED + ",COLLECTIVES"}, False),
    "sync+graph_collectives": ({"xla_gpu_disable_async_collectives": "ALLCOLLECTIVES",
                                "xla_gpu_enable_command_buffer": GRAPHED + ",COLLECTIVES"}, False),
    # the decode loop's while evaluated on the host (XLA's default; the engine puts it in the graph)
    "host_while": ({"xla_gpu_enable_command_buffer": engine_module.GPU_DEFAULT_COMMAND_BUFFER}, False),
    # every dot through cuBLAS (XLA's autotuner otherwise picks among its Triton GEMMs and cuBLAS)
    "cublas": ({"xla_gpu_enable_triton_gemm": False}, False),
    "cublaslt": ({"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cublaslt": True}, False),
    "unfolded_norms": ({}, False),
    "no_row_padding": ({}, False),  # layers.dense never pads a single row to two (GPU_STRENGTH_REDUCTION_LIMIT = 0)
    # XLA graphs a run of fewer than this many commands as plain launches (default 5 in XLA 0.11.2)
    "min_graph_1": ({"xla_gpu_graph_min_graph_size": 1}, False),
    # the Pallas Triton kernels without their griddepcontrol.launch_dependents (kernels_pallas._pdl)
    "no_pdl_signal": ({}, False),
    "concurrent": (L2_MODES["concurrent"], False),  # the engine's mode (twenty-second session)
    "lhs_graph": (L2_MODES["serial"], False),  # XLA's default mode: the graph's kernels chained in its schedule
}


PROJECTIONS = {(4096, 6144): "qkv", (4096, 4096): "o", (4096, 24576): "gate_up", (12288, 4096): "down"}


def _written_out_splits(splits: dict[str, int], dense, *, keep_partials: bool):
    """``layers.dense`` with the split-K of the named one-row projections written out
    (``layers.single_row_partials``): the float32 partials ``[S, 2, N]`` summed back (``splitk:``),
    or left for ``_partials_add_rms_norm`` to sum (``partials:``)."""

    def patched(x, w, in_dims=1):
        value = w[...]
        k, n = math.prod(value.shape[:in_dims]), math.prod(value.shape[in_dims:])
        split = splits.get(PROJECTIONS.get((k, n), ""), 0)
        y = (layers.single_row_partials if keep_partials else layers.single_row_dot)(x, w, split, in_dims)
        if y is None:
            return dense(x, w, in_dims)
        return y.reshape(y.shape[:2] + (n,)) if keep_partials else y

    return patched


def _row_and_zeros(row):
    """``layers._two_rows`` as ``dense`` padded a single row before the twenty-fourth session: a zero row."""
    return jnp.concatenate([row, jnp.zeros_like(row)])


def _partials_add_rms_norm(add_rms_norm):
    """``layers.add_rms_norm`` that takes a one-row delta as float32 partials ``[S, 2, hidden]``
    (``bench_split_matmul.add_rms_norm_partials`` sums them in its prologue)."""

    def patched(h, delta, norm, *, fused):
        if delta is None or delta.dtype != jnp.float32 or delta.ndim != 3:
            return add_rms_norm(h, delta, norm, fused=fused)
        hidden = h.shape[-1]
        s, y = add_rms_norm_partials(h.reshape(1, hidden), delta, norm.weight[...].astype(h.dtype), eps=norm.eps,
                                     interpret=jax.default_backend() != "gpu")
        return s.reshape(h.shape), y.reshape(h.shape)

    return patched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="rows per decode step (the engine's batch size)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="run the variant list this many times, interleaved")
    ap.add_argument("--dflash", default="base,unfused_norms,no_split_k", help="variants that also time the DFlash step")
    ap.add_argument("--tensor", type=int, default=1, help="run the engines on a (data=1, tensor=N) mesh")
    ap.add_argument("--pipelined", type=int, default=0,
                    help="also time this many decode calls dispatched back to back (one sync), per engine")
    ap.add_argument("--tokens", type=int, default=0,
                    help="also generate this many tokens per engine from one fixed prompt and compare them with "
                         "the first variant's (variants that must not change results)")
    ap.add_argument("--profile", default=None,
                    help="trace 8 target-only steps (and 4 DFlash steps, with --dflash) of each variant's first run "
                         "into DIR/NAME (DIR/dflash_NAME), with every kernel in time order (and its stream) in "
                         "DIR/NAME.txt")
    ap.add_argument("--memory", action="store_true",
                    help="also print each engine's decode-step temporaries (XLA's memory analysis of the compiled loop)")
    ap.add_argument("--hlo", default=None,
                    help="write each variant's compiled target-only decode loop (optimised HLO) to DIR/NAME.hlo")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    tcfg = tiny_target_config() if args.tiny else qwen3_8b(36)
    target, drafter = random_pair(tcfg)
    assert all(bool(jnp.all(norm.weight[...] == 1)) for layer in target.layers
               for norm in (layer.input_layernorm, layer.post_attention_layernorm))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; Triton kernels signal dependents: "
          f"{_pdl.hopper_or_later()}", flush=True)

    default_options = engine_module._decode_compiler_options
    default_attention = cached_attention_gpu.DEFAULT_CONFIG
    default_norm_warps = rms_norm_gpu.NUM_WARPS
    limit = layers.GPU_STRENGTH_REDUCTION_LIMIT
    supported = kernels_pallas.add_rms_norm_supported
    default_cached = layers.DecoderLayer.cached
    default_dense = layers.dense
    default_two_rows = layers._two_rows
    default_add_rms_norm = layers.add_rms_norm
    default_argmax = decoding._local_argmax
    default_mlp_call = layers.MLP.__call__
    default_qkv_partials, default_output_partials = layers.QKV_PARTIALS, layers.OUTPUT_PARTIALS
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    with_dflash = set(args.dflash.split(","))
    roofline_s = hbm_roofline_s(target, args.batch, args.context) / args.tensor  # per device
    results: dict[str, list[dict]] = {}  # every run of each variant, in order
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, tcfg.vocab_size, args.context)]
    first_tokens: dict[str, list[int]] = {}  # --tokens: the first variant's output, per engine kind
    for name in names * args.rounds:
        kind, _, splits = name.partition(":")
        l2_mode = kind[len("l2-"):] if kind.startswith("l2-") else None
        overrides = {}
        if name.startswith("attn:"):
            overrides = int_fields(name[len("attn:"):], sep="+")
        options, unfused_norms = VARIANTS.get(name, ({}, False))
        if name.startswith("xla:"):
            options = dict([_option(name[len("xla:"):])])
        if l2_mode:
            options = L2_MODES[l2_mode]
        cached_attention_gpu.DEFAULT_CONFIG = dataclasses.replace(default_attention, **overrides)
        rms_norm_gpu.NUM_WARPS = int(name[len("norm_warps:"):]) if name.startswith("norm_warps:") else default_norm_warps
        engine_module._decode_compiler_options = lambda o=options: {**(default_options() or {}), **o} or None
        kernels_pallas.add_rms_norm_supported = (lambda *a, **k: False) if unfused_norms else supported
        layers.GPU_STRENGTH_REDUCTION_LIMIT = (0 if name == "no_row_padding" else 2**62 if kind == "pad_all"
                                              else limit)
        layers.QKV_PARTIALS = (int(splits) if kind == "qkv_partials" else 0 if name == "xla_splits"
                               else default_qkv_partials)
        layers.OUTPUT_PARTIALS = (int(splits) if kind == "o_partials" else 0 if name == "xla_splits"
                                  else default_output_partials)
        decoding._local_argmax = decoding._argmax_two_stage if name == "argmax_two_stage" else default_argmax
        _pdl.ENABLED = name != "no_pdl_signal"
        layers.DecoderLayer.cached = kv_prefetching_cached if name == "kv_prefetch" else default_cached
        layers.FOLD_NORMS = not (name in ("unfolded_norms", "unfused_norms", "kv_prefetch") or l2_mode
                                 or kind in ("partials", "splitk", "mlp_chains"))
        for layer in target.layers:  # unit norm weights (asserted at the start): folded or not, the same weights
            layer.norms_folded = layers.FOLD_NORMS
        if l2_mode:
            layers.DecoderLayer.cached = prefetching_cached(int_fields(splits, sep="+"), l2_mode)
        layers.dense = (_written_out_splits(int_fields(splits, sep="+"), default_dense, keep_partials=kind == "partials")
                        if kind in ("splitk", "partials") else default_dense)
        layers._two_rows = _row_and_zeros if name == "pad_all:zeros" else default_two_rows
        layers.add_rms_norm = target_module.add_rms_norm = (_partials_add_rms_norm(default_add_rms_norm)
                                                            if name.startswith("partials:") else default_add_rms_norm)
        detach_chains(target)
        layers.MLP.__call__ = default_mlp_call
        if kind == "mlp_chains":
            chains, *rest = splits.split("+")
            parts = next((int(r) for r in rest if r.isdigit()), 0)
            fuse_projections(target)
            attach_chains(target, int(chains))
            layers.MLP.__call__ = chained_call(default_mlp_call, parts=parts, lag="lag" in rest)
        cfg = EngineConfig(max_batch_size=args.batch, max_length=args.context + 512, prompt_buckets=(args.context,),
                           steps_per_sync=8, attention_impl="pallas",
                           decode_loop="fixed" if name == "fixed_loop" else "auto",
                           mesh=MeshConfig(data=1, fsdp=1, tensor=args.tensor) if args.tensor > 1 else None)
        stem = "".join(c if c.isalnum() else "_" for c in name)  # the variant's output files
        t0 = time.perf_counter()
        try:
            plain = Engine(target, None, cfg)
            t_plain, _ = time_decode(plain, args.batch, args.context, args.steps, args.repeats)
            t_plain_b2b = (time_decode_pipelined(plain, args.batch, args.context, args.steps, args.pipelined)
                           if args.pipelined else None)
            if args.hlo and name not in results:
                Path(args.hlo).mkdir(parents=True, exist_ok=True)
                hlo = plain.decode_hlo(plain.empty_state(args.batch), args.steps)
                (Path(args.hlo) / f"{stem}.hlo").write_text(hlo)
            if args.profile and name not in results:
                out = Path(args.profile) / stem
                profile_decode(plain, args.batch, args.context, 8, str(out), top=12, listing=out.with_suffix(".txt"))
            t_spec = t_spec_b2b = None
            engines = [("target-only", plain)]
            if name in with_dflash:
                spec = Engine(target, drafter, cfg)
                t_spec, _ = time_decode(spec, args.batch, args.context, args.steps, args.repeats)
                t_spec_b2b = (time_decode_pipelined(spec, args.batch, args.context, args.steps, args.pipelined)
                              if args.pipelined else None)
                engines.append(("DFlash", spec))
                if args.profile and name not in results:
                    out = Path(args.profile) / f"dflash_{stem}"
                    profile_decode(spec, args.batch, args.context, 4, str(out), top=12,
                                   listing=out.with_suffix(".txt"))
            if args.memory:
                for kind, engine in engines:
                    mem = engine.decode_compiled(engine.empty_state(args.batch), args.steps).memory_analysis()
                    print(f"{name} {kind}: decode temporaries {mem.temp_size_in_bytes / 2**20:.1f} MiB", flush=True)
            if args.tokens:
                outputs = {}
                for kind, engine in engines:
                    [result] = engine.generate([prompt], max_new_tokens=args.tokens)
                    outputs[kind] = result.output_ids
                    first = first_tokens.setdefault(kind, result.output_ids)
                    print(f"{name} {kind}: {args.tokens} tokens {'equal' if result.output_ids == first else 'DIFFER'} "
                          "to the first variant's", flush=True)
                if len(outputs) == 2:  # greedy speculative decoding against the same engine's target-only
                    a, b = outputs.values()
                    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                    print(f"{name}: DFlash tokens {'equal' if same is None else f'differ from token {same} on'} "
                          "to target-only's", flush=True)
        except Exception as err:  # noqa: BLE001  (an option this XLA rejects fails its variant only)
            print(f"{name}: failed: {str(err).splitlines()[0][:200]}", flush=True)
            results.setdefault(name, []).append(dict(error=str(err)[:500]))
            continue
        run = dict(options=options, unfused_norms=unfused_norms, target_step_s=t_plain, spec_step_s=t_spec,
                   target_b2b_step_s=t_plain_b2b, spec_b2b_step_s=t_spec_b2b,
                   hbm_fraction=roofline_s / t_plain,
                   wall_s=time.perf_counter() - t0)
        results.setdefault(name, []).append(run)
        print(json.dumps({name: run}), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
    print_table(results, roofline_s)


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key)]
    return statistics.median(values) if values else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def print_table(results: dict[str, list[dict]], roofline_s: float) -> None:
    """Per variant and timing (synchronous calls; back-to-back calls, with ``--pipelined``): the
    median over its runs (ms), the runs, and the difference of medians from the first variant's."""
    for prefix, label in (("", "synchronous calls"), ("b2b_", "back-to-back calls")):
        if any(r.get(f"target_{prefix}step_s") for runs in results.values() for r in runs):
            print(f"\n{label}:")
            _print_rows(results, roofline_s, f"target_{prefix}step_s", f"spec_{prefix}step_s")


def _print_rows(results: dict[str, list[dict]], roofline_s: float, target_key: str, spec_key: str) -> None:
    medians = {name: (_median(runs, target_key), _median(runs, spec_key)) for name, runs in results.items()}
    first = next(iter(medians.values()), (None, None))
    print("variant | target step ms (runs) | vs first | % HBM roofline | DFlash step ms (runs) | vs first | DFlash / target")
    for name, runs in results.items():
        target, spec = medians[name]
        if target is None:
            print(f"{name} | failed")
            continue
        each = lambda key: " (" + ", ".join(_ms(r[key]) for r in runs if r.get(key)) + ")"  # noqa: E731
        diff = lambda x, x0: "-" if x is None or x0 is None else f"{(x - x0) * 1e3:+.3f}"  # noqa: E731
        ratio = "-" if spec is None else f"{spec / target:.3f}"
        print(f"{name} | {_ms(target)}{each(target_key)} | {diff(target, first[0])} | "
              f"{100 * roofline_s / target:.1f}% | {_ms(spec)}{each(spec_key) if spec else ''} | "
              f"{diff(spec, first[1])} | {ratio}")


if __name__ == "__main__":
    main()
