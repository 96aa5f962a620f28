"""The sampler's top-k: ``ops.topk``'s sort-free select against its sort method, per call and in the step.

Three measurements, each method's result checked equal on the device:

1. ``top_k_and_argmax`` with k = 64 (the sampler's candidates) on ``[rows, vocab]`` logits, bf16 (the
   LM head's output) and float32 (edited logits), peaked like a trained model's: the select (chunks of
   128 and of 64) and the sort (``lax.top_k``: CUB segmented radix sorts on XLA:GPU), against
   ``jax.lax.top_k`` of the whole rows.
2. The draws built on it: ``sampling.candidate_tokens`` (the target's verify rows) and
   ``sampling.draft_candidates`` (the drafter's rows), T = 0.7, top-p 0.9, top-k 50, per method.
3. The engine's DFlash step (Qwen3-8B shapes, block 16, LM head x``--logit-scale``) at ``--batch``
   with every row sampled (and with logprobs), per method, against the greedy step: ms a step and
   x greedy, and the committed tokens equal across methods (a sampled generation does not depend on
   how its candidates were found). Beside it, from each compiled step, outside its conditionals (what
   runs every step): its sorts (XLA sort kernels and CUB sort calls) and its fusions making float32
   ``[..., vocab]`` arrays (whole-row float32 copies; their names are the trace's kernel names).

With ``--profile`` (the default on a GPU) the steps are traced once: per sampled step, the kernels
greedy does not launch, by time a step (as ``bench_sampling.py`` prints them), each with its HLO
output shape and whether it sits in a conditional's branch (run only when some row needs it).

    python3 bench/bench_topk.py --json bench/results/topk.json          # < 90 s on one H200
    JAX_PLATFORMS=cpu python3 bench/bench_topk.py --tiny                # smoke test
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import re
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import timing
from bench_sampling import MODES, SAMPLED, print_extra_kernels, sampled_state
from dflash_jax.ops import topk
from dflash_jax.runtime import sampling as smp
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.runtime.sampling import SamplingFlags, SamplingParams
from dflash_jax.tiny import tiny_target_config

CANDIDATES = 64
# name -> top_k_and_argmax keywords
VARIANTS = {"sort": dict(method="sort"), "select": dict(method="select"), "select/64": dict(method="select", chunk=64)}


@contextlib.contextmanager
def topk_method(method: str):
    """Every top-k traced inside takes ``method`` (the sampler calls ``topk.top_k_and_argmax``)."""
    original = topk.top_k_and_argmax

    def forced(x, k, *, chunk=128, **_):  # whatever method the caller names
        return original(x, k, chunk=chunk, method=method)

    with mock.patch.object(topk, "top_k_and_argmax", forced):
        yield


def peaked_logits(rows: int, vocab: int, dtype, scale: float) -> jax.Array:
    return timing.normal(jax.random.key(0), (rows, vocab), dtype, scale)


def time_top_k(rows: int, vocab: int, dtype, scale: float, repeats: int) -> dict:
    """Per variant: us a call and whether values, ids and argmax equal ``lax.top_k``'s / ``jnp.argmax``'s."""
    x = peaked_logits(rows, vocab, dtype, scale)
    want_v, want_i = jax.jit(lambda x: jax.lax.top_k(x, CANDIDATES))(x)
    want_a = jax.jit(lambda x: jnp.argmax(x, axis=-1))(x)
    out = {}
    for name, kw in VARIANTS.items():
        fn = jax.jit(lambda x, kw=kw: topk.top_k_and_argmax(x, CANDIDATES, **kw))
        v, i, a = fn(x)
        equal = bool(jnp.all(v == want_v) & jnp.all(i == want_i) & jnp.all(a == want_a))
        out[name] = dict(us=timing.per_call_time(fn, x, repeats=repeats) * 1e6, equal=equal)
    return out


def time_draws(rows: int, vocab: int, scale: float, repeats: int) -> dict:
    """Per method: us a call of ``candidate_tokens`` and ``draft_candidates`` on bf16 rows; outputs equal."""
    params = SamplingParams(**SAMPLED, seed=0)
    flags = SamplingFlags.of([params], 0)
    arrays = smp.row_arrays([dataclasses.replace(params, seed=i) for i in range(rows)], rows, vocab, [0] * rows)
    s = smp.new_state({k: jnp.asarray(v) for k, v in arrays.items()}, capacity=8, max_logprobs=0)
    r = smp.Rows.of(s, jnp.full((rows, 1), -1, jnp.int32))
    pos = jnp.full((rows,), 3, jnp.int32)
    x = peaked_logits(rows, vocab, jnp.bfloat16, scale)
    paths = {
        "candidate_tokens": lambda x: smp.candidate_tokens(x, r, pos, flags=flags, candidates=CANDIDATES),
        "draft_candidates": lambda x: smp.draft_candidates(x, s.temperature, s.top_k, s.seeds, pos,
                                                           count=CANDIDATES)[:2],
    }
    out = {}
    for path, fn in paths.items():
        got = {}
        for method in ("select", "sort"):
            with topk_method(method):
                compiled = jax.jit(fn).lower(x).compile()
            got[method] = compiled(x)
            out[f"{path}/{method}"] = dict(us=timing.per_call_time(compiled, x, repeats=repeats) * 1e6)
        equal = all(bool(jnp.all(a == b)) for a, b in zip(got["select"], got["sort"]))
        out[f"{path}/select"]["equal"] = out[f"{path}/sort"]["equal"] = equal
    return out


def hlo_summary(text: str, vocab: int) -> dict:
    """From a compiled program's HLO text, outside conditional branches (what runs every step): its sort
    instructions, its CUB sort calls, and the fusions producing float32 ``[..., vocab]`` arrays; and
    every fusion, sort and custom call by kernel name (``.`` as ``_``, as the trace names kernels):
    its output shape, `` (in a cond)`` when it sits in a conditional's branch."""
    branches = set(re.findall(r"(?:true_computation|false_computation)=%?([\w.\-]+)", text))
    for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
        branches.update(name.strip().lstrip("%") for name in group.split(","))
    computation, sorts, cub, whole_f32, shapes = None, 0, 0, [], {}
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            words = line.split()
            computation = (words[1] if words[0] == "ENTRY" else words[0]).lstrip("%")
            continue
        op = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) (fusion|custom-call|sort)\(", line)
        if op:
            shape = re.sub(r"\{[^}]*\}", "", op.group(2))
            shapes[op.group(1).replace(".", "_")] = shape + (" (in a cond)" if computation in branches else "")
        if computation in branches:
            continue
        if " sort(" in line:
            sorts += 1
        if "custom-call(" in line and re.search(r"cub|Sort", line):
            cub += 1
        match = re.match(rf"\s*(?:ROOT\s+)?%?([\w.\-]+) = \(?f32\[[\d,]*{vocab}\]", line)
        if match and " fusion(" in line:
            whole_f32.append(match.group(1))
    return dict(sorts=sorts, cub_sorts=cub, f32_vocab_fusions=whole_f32, shapes=shapes)


def time_steps(args, tcfg) -> tuple[dict, dict, dict]:
    """The DFlash step per (mode, method): ms a step, tokens committed a step; the compiled steps'
    ``hlo_summary``; the traced kernels (``--profile``)."""
    target, drafter = timing.random_pair(tcfg)
    target.lm_head[...] = target.lm_head[...] * args.logit_scale
    block = drafter.config.block_size
    max_length = args.context + (args.repeats + 4) * args.steps * block + 2 * block
    config = EngineConfig(max_batch_size=args.batch, max_length=max_length, sampling_candidates=CANDIDATES)
    engines = {"select": Engine(target, drafter, config), "sort": Engine(target, drafter, config)}
    programs = [("greedy", "select")] + [(m, method) for m in args.modes.split(",") if m
                                         for method in ("select", "sort")]
    names = ["greedy"] + [f"{m}/{method}" for m, method in programs[1:]]

    def call(i, fn):
        with topk_method(programs[i][1]):  # a retrace of the sort engine's step still takes the sort
            return fn()

    flags = [SamplingFlags.of([MODES[m][0]], config.max_logprobs) for m, _ in programs]
    states = [sampled_state(engines[method], args.batch, args.context, MODES[m][0]) for m, method in programs]
    t0 = time.perf_counter()
    # Traced one at a time on this thread (the method is a patch of the module), compiled on threads.
    lowered = [call(i, lambda i=i: engines[programs[i][1]].decode_lowered(states[i], args.steps, sampling=flags[i]))
               for i in range(len(programs))]
    compiled = [lowered[0].compile()]  # greedy first and alone: its GEMMs autotune undisturbed
    with concurrent.futures.ThreadPoolExecutor(max(1, len(programs) - 1)) as pool:  # XLA compiles outside the GIL
        compiled += list(pool.map(lambda low: low.compile(), lowered[1:]))
    compile_s = time.perf_counter() - t0
    summaries = {name: hlo_summary(c.as_text(), tcfg.vocab_size) for name, c in zip(names, compiled)}

    def run(i):
        m, method = programs[i]
        states[i], _ = call(i, lambda: engines[method].decode(states[i], n_steps=args.steps, sampling=flags[i]))
        jax.block_until_ready(states[i].starts)

    for i in range(len(programs)):
        run(i), run(i)
    start = [np.asarray(s.starts) for s in states]
    times = [[] for _ in programs]
    for _ in range(args.repeats):
        for i in range(len(programs)):
            t = time.perf_counter()
            run(i)
            times[i].append((time.perf_counter() - t) / args.steps)
    results = {}
    for i, name in enumerate(names):
        advanced = np.asarray(states[i].starts) - start[i]
        results[name] = dict(step_s=statistics.median(times[i]), tau=float(advanced.mean() / (args.repeats * args.steps)),
                             x_greedy=statistics.median(times[i]) / statistics.median(times[0]))
    for m in {m for m, _ in programs[1:]}:  # the same calls from the same states: the same tokens
        a, b = names.index(f"{m}/select"), names.index(f"{m}/sort")
        same = bool(np.array_equal(np.asarray(states[a].tokens), np.asarray(states[b].tokens)))
        results[f"{m}/select"]["tokens_equal"] = results[f"{m}/sort"]["tokens_equal"] = same
    kernels = {}
    profile = jax.default_backend() == "gpu" if args.profile is None else args.profile
    if profile:
        for i, name in enumerate(names):
            durations = timing.gpu_kernel_times(lambda i=i: run(i), f"{args.profile_dir}/{name.replace('/', '_')}",
                                                calls=1)
            if durations is not None:
                kernels[name] = {k: sum(d) / args.steps for k, d in durations.items()}
    results["compile_s"] = compile_s
    return results, summaries, kernels


def main() -> None:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=272, help="logits rows of the per-call measurements")
    ap.add_argument("--batch", type=int, default=16, help="the DFlash step's batch")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds")
    ap.add_argument("--call-repeats", type=int, default=15, help="timing rounds of the per-call measurements")
    ap.add_argument("--modes", default="sampled,logprobs", help=f"sampled modes of the step, of: {', '.join(MODES)}")
    ap.add_argument("--logit-scale", type=float, default=8.0, help="multiplies the random LM head (peaked logits)")
    ap.add_argument("--scale", type=float, default=4.0, help="spread of the per-call measurements' random logits")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                    help="trace the steps once and print the sampled steps' extra kernels (default: on a GPU)")
    ap.add_argument("--profile-dir", default="/tmp/bench_topk_profile")
    ap.add_argument("--json", "--out", dest="out", default=None, help="JSON report (e.g. bench/results/topk.json)")
    args = ap.parse_args()
    unknown = sorted(set(args.modes.split(",")) - set(MODES) - {""})
    if unknown or "greedy" in args.modes.split(","):
        ap.error(f"--modes takes sampled modes of: {', '.join(m for m in MODES if m != 'greedy')}; got {args.modes}")
    if args.tiny:
        args.rows, args.batch, args.steps, args.repeats, args.call_repeats = 8, 2, 2, 1, 2
    print(timing.device_line(), flush=True)
    vocab = 5003 if args.tiny else 151936
    report = dict(config=vars(args), vocab=vocab)

    report["top_k"] = {str(np.dtype(d)): time_top_k(args.rows, vocab, d, args.scale, args.call_repeats)
                       for d in (jnp.bfloat16, jnp.float32)}
    report["draws"] = time_draws(args.rows, vocab, args.scale, args.call_repeats)
    print(f"\ntop-k of {CANDIDATES} and argmax, [{args.rows}, {vocab}] (us a call; equal: == lax.top_k / jnp.argmax)")
    print(f"{'dtype':9s} " + " ".join(f"{v:>16s}" for v in VARIANTS))
    for dtype, res in report["top_k"].items():
        print(f"{dtype:9s} " + " ".join(f"{res[v]['us']:9.1f} {str(res[v]['equal']):>6s}" for v in VARIANTS))
    print(f"\ndraws from the candidates, [{args.rows}, {vocab}] bf16, T=0.7 top-p 0.9 top-k 50 (us a call; equal: "
          f"select == sort)")
    for name, res in report["draws"].items():
        print(f"  {name:26s} {res['us']:9.1f}  equal {res['equal']}")
    timing.write_json(args.out, report)

    tcfg = tiny_target_config(num_layers=4) if args.tiny else timing.qwen3_8b(args.layers)
    steps, summaries, kernels = time_steps(args, tcfg)
    report.update(steps=steps, hlo={k: {f: v for f, v in h.items() if f != "shapes"} for k, h in summaries.items()},
                  kernels_us_per_step=kernels)
    print(f"\nDFlash step at batch {args.batch} (vocabulary {tcfg.vocab_size}, context {args.context}, LM head "
          f"x{args.logit_scale}; {steps['compile_s']:.0f} s compiling)")
    print(f"{'program':18s} {'ms/step':>9} {'x greedy':>9} {'tau':>5} {'tokens=':>7} {'sorts':>5} {'cub':>4}  "
          f"float32 [.., vocab] fusions outside conditionals")
    for name, res in steps.items():
        if name == "compile_s":
            continue
        h = summaries[name]
        print(f"{name:18s} {res['step_s'] * 1e3:9.3f} {res['x_greedy']:9.3f} {res['tau']:5.2f} "
              f"{str(res.get('tokens_equal', '-')):>7s} {h['sorts']:5d} {h['cub_sorts']:4d}  "
              f"{', '.join(h['f32_vocab_fusions'][:6]) or '-'}")
    if kernels:
        print_extra_kernels(kernels, args.batch, top=10, notes={k: h["shapes"] for k, h in summaries.items()})
    print(f"target: sampled and logprobs <= 1.03 x greedy; {time.perf_counter() - t_start:.0f} s in all")
    report["total_s"] = time.perf_counter() - t_start
    timing.write_json(args.out, report)


if __name__ == "__main__":
    main()
