"""Sampling cost: a DFlash step with sampled rows against the same step greedy, per filter.

A Qwen3-8B-shaped target (vocabulary 151,936) and a 5-layer block-16 drafter, random bf16 weights,
the LM head scaled by ``--logit-scale`` so that the distributions are peaked like a trained model's
(random weights give nearly flat ones: top-p 0.9 then keeps ~90% of the vocabulary, and every row
takes the whole-row fallback; ``--logit-scale 1`` measures that worst case). Every row of the batch
uses the mode's parameters; each mode is the engine's jitted decode loop with that mode's
``SamplingFlags``. Per batch size, every mode is compiled before any is timed (greedy first and
alone, so that its GEMM autotuning runs undisturbed, then the others on threads), then the modes
are timed in interleaved rounds of synchronised calls (state donated), and printed against greedy.

With ``--profile`` (the default on a GPU), the largest batch's greedy call and each other mode's call
are traced once more: the kernels of a sampled step that the greedy step does not launch, by total time
a step, each with the JAX op and source line it came from, beside both steps' kernel counts and busy time
(where a mode's extra time goes), unless a trace lost kernels (its busy time under half its step).

``--ablate``: the largest batch's sampled step again with pieces of the sampler replaced, each traced on
its own engine (the engine's weights shared) and timed in interleaved rounds beside greedy and the real
sampled step: every ``lax.cond`` of the step taking its common branch (the candidates' draw; the
whole-row fallbacks compiled out), and also the candidates' top-k replaced by one argmax pass (a stand-in
that reads each row once, as greedy does); and the whole step with XLA's own sort kernels for every sort
(the top-ks' short sorts off CUB's radix sort). The replaced steps draw wrong tokens:
timing only. Where a sampled step's time goes, for a step whose kernels run in CUDA graphs, where a trace
misses kernels.

Before the timing, a check on the device: draws read from the candidates (noise at their ids only)
equal the draws over whole rows, bit for bit, on random rows of the vocabulary's width.

    python3 bench/bench_sampling.py --json bench/results/sampling.json        # < 90 s on one H200
    python3 bench/bench_sampling.py --modes greedy,temperature,top_k,top_p,min_p,sampled,logprobs,penalties,rejection
    python3 bench/bench_sampling.py --layers 4 --batches 16 --modes greedy,sampled --ablate --no-profile
    JAX_PLATFORMS=cpu python3 bench/bench_sampling.py --tiny --batches 1 --steps 2 --repeats 1   # smoke test
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import profile_ops
import timing
from dflash_jax.ops import topk
from dflash_jax.runtime import decoding
from dflash_jax.runtime import engine as engine_module
from dflash_jax.runtime import sampling as smp
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.runtime.sampling import SamplingFlags, SamplingParams
from dflash_jax.tiny import tiny_target_config

SAMPLED = dict(temperature=0.7, top_p=0.9, top_k=50)
# name -> (every row's parameters, what the name measures)
MODES = {
    "greedy": (SamplingParams(), "temperature 0 (the greedy step)"),
    "temperature": (SamplingParams(temperature=0.7, seed=0), "T=0.7, no filter: the Gumbel draw alone"),
    "top_k": (SamplingParams(temperature=0.7, top_k=50, seed=0), "T=0.7, top_k=50"),
    "top_p": (SamplingParams(temperature=0.7, top_p=0.9, seed=0), "T=0.7, top_p=0.9"),
    "min_p": (SamplingParams(temperature=0.7, min_p=0.05, seed=0), "T=0.7, min_p=0.05"),
    "sampled": (SamplingParams(**SAMPLED, seed=0), "T=0.7, top_p=0.9, top_k=50"),
    "logprobs": (SamplingParams(**SAMPLED, seed=0, logprobs=0), "sampled + the chosen tokens' logprobs"),
    "top_logprobs": (SamplingParams(**SAMPLED, seed=0, logprobs=5), "sampled + 5 top logprobs"),
    "penalties": (SamplingParams(**SAMPLED, seed=0, presence_penalty=0.5, frequency_penalty=0.5,
                                 repetition_penalty=1.1), "sampled + presence, frequency, repetition penalties"),
    "rejection": (SamplingParams(**SAMPLED, seed=0, verify="rejection"), "sampled, rejection-sampling verification"),
}
DEFAULT_MODES = "greedy,sampled,logprobs"


def sampled_state(engine: Engine, batch: int, context: int, params: SamplingParams):
    """``timing.synthetic_state`` with every row sampling per ``params``."""
    state = timing.synthetic_state(engine, batch, context, seed=batch)
    arrays = smp.row_arrays([params] * batch, batch, engine.vocab_size, [context] * batch)
    sampling = smp.new_state({k: jnp.asarray(v) for k, v in arrays.items()}, capacity=engine.capacity,
                             max_logprobs=engine.config.max_logprobs)
    return dataclasses.replace(state, sampling=sampling)


def interleaved_rounds(runs: dict[str, tuple[Engine, SamplingFlags]], states: dict, steps: int, repeats: int
                       ) -> dict[str, list[float]]:
    """Seconds per step of each run's ``repeats`` synchronised decode calls of ``steps`` steps, one call of
    every run a round; each run's state (``states``, by run) is donated and replaced as it goes."""
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (engine, flags) in runs.items():
            t = time.perf_counter()
            states[name], _ = engine.decode(states[name], n_steps=steps, sampling=flags)
            jax.block_until_ready(states[name].starts)
            times[name].append((time.perf_counter() - t) / steps)
    return times


def time_modes(engine: Engine, batch: int, context: int, modes: list[str], steps: int, repeats: int,
               profile_dir: str | None = None):
    """Per mode: median seconds per decode step over ``repeats`` interleaved rounds of one synchronised
    call of ``steps`` steps each, and tokens committed per step. Every mode is compiled, and run twice
    untimed, before any is timed."""
    flags = {m: SamplingFlags.of([MODES[m][0]], engine.config.max_logprobs) for m in modes}
    states = {m: sampled_state(engine, batch, context, MODES[m][0]) for m in modes}
    t0 = time.perf_counter()
    # greedy first and alone: its GEMMs autotune undisturbed
    compiled = {modes[0]: engine.decode_compiled(states[modes[0]], steps, sampling=flags[modes[0]])}
    with concurrent.futures.ThreadPoolExecutor(max(1, len(modes) - 1)) as pool:  # XLA compiles outside the GIL
        compiled |= zip(modes[1:], pool.map(lambda m: engine.decode_compiled(states[m], steps, sampling=flags[m]),
                                            modes[1:]))
    compile_s = time.perf_counter() - t0
    for m in modes:
        for _ in range(2):
            states[m], _ = engine.decode(states[m], n_steps=steps, sampling=flags[m])
        jax.block_until_ready(states[m].starts)
    start = {m: np.asarray(states[m].starts) for m in modes}
    times = interleaved_rounds({m: (engine, flags[m]) for m in modes}, states, steps, repeats)
    out = {}
    for m in modes:
        advanced = np.asarray(states[m].starts) - start[m]
        if advanced.min() < repeats * steps:
            raise ValueError(f"rows reached max_length during the timing (advanced {advanced.min()} tokens in "
                             f"{repeats * steps} steps); raise --max-length")
        out[m] = (statistics.median(times[m]), float(advanced.mean() / (repeats * steps)))
    kernels = {}
    if profile_dir is not None:  # after the timing: the traced calls move the rows on
        for m in modes:
            def run(m=m):
                states[m], _ = engine.decode(states[m], n_steps=steps, sampling=flags[m])
                jax.block_until_ready(states[m].starts)
            events = timing.gpu_kernel_events(run, f"{profile_dir}/{m}", calls=1)
            if events is None:
                continue
            sources = profile_ops.op_sources(compiled[m].as_text())
            kernels[m] = {}
            for e in events:
                entry = kernels[m].setdefault(e["name"], {"us": 0.0, "source": profile_ops.lookup(
                    sources, str(e["args"].get("hlo_op") or e["name"])) or ""})
                entry["us"] += e["dur"] / steps
    return out, compile_s, kernels


def _common_branch_cond(pred, true_fun, false_fun, *operands):
    """``lax.cond`` as the sampler's conditionals run when no row needs its whole-row fallback: the draws
    from the candidates (the first branch, a lambda returning them)."""
    return true_fun(*operands)


_DECODE_COMPILER_OPTIONS = engine_module._decode_compiler_options


def _no_cub_sorts():
    """The decode loop's XLA options with every sort on XLA's own sort kernels instead of CUB's radix sort
    (whether the top-ks' short sorts cost less either way)."""
    options = dict(_DECODE_COMPILER_OPTIONS() or {})
    if jax.default_backend() == "gpu":
        options["xla_gpu_enable_cub_radix_sort"] = False
    return options or None


def _argmax_top_k(x, k, *, chunks=None):
    """A stand-in for ``ops.topk.top_k_and_argmax`` reading each row once: the argmax, and the row's first
    ``k`` entries as the "candidates" (wrong tokens; timing only)."""
    rows = x.reshape(-1, x.shape[-1])
    first = rows[:, :k]
    ids = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), first.shape)
    return (first.reshape(*x.shape[:-1], k), ids.reshape(*x.shape[:-1], k),
            jnp.argmax(rows, axis=-1).astype(jnp.int32).reshape(x.shape[:-1]))


ABLATIONS = {
    "sampled, no conditionals": (mock.patch.object(jax.lax, "cond", _common_branch_cond),),
    "sampled, no conditionals, argmax for top-k": (mock.patch.object(jax.lax, "cond", _common_branch_cond),
                                                   mock.patch.object(topk, "top_k_and_argmax", _argmax_top_k)),
    "sampled, no CUB sorts": (mock.patch.object(engine_module, "_decode_compiler_options", _no_cub_sorts),),
}


def ablate(engine: Engine, batch: int, context: int, steps: int, repeats: int) -> dict[str, float]:
    """Median seconds per step of greedy, sampled and each ``ABLATIONS`` variant of the sampled step (the
    module's ``--ablate``), each on an engine of its own over ``engine``'s weights, traced under its patches,
    then timed in ``repeats`` interleaved rounds of one synchronised call of ``steps`` steps."""
    params = MODES["sampled"][0]
    variants = {"greedy": (MODES["greedy"][0], ()), "sampled": (params, ()),
                **{name: (params, patches) for name, patches in ABLATIONS.items()}}
    runs, states = {}, {}
    for name, (p, patches) in variants.items():
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            derived = engine.derive()  # under the patches: its jits take their compiler options here
            flags = SamplingFlags.of([p], derived.config.max_logprobs)
            state = sampled_state(derived, batch, context, p)
            state, _ = derived.decode(state, n_steps=steps, sampling=flags)  # traced and compiled here
            jax.block_until_ready(state.starts)
        state, _ = derived.decode(state, n_steps=steps, sampling=flags)
        jax.block_until_ready(state.starts)
        runs[name], states[name] = (derived, flags), state
    times = interleaved_rounds(runs, states, steps, repeats)
    return {name: statistics.median(t) for name, t in times.items()}


def print_extra_kernels(kernels: dict[str, dict[str, dict]], batch: int, step_s: dict[str, float],
                        top: int = 12) -> None:
    """Per mode against greedy (us a step): kernel counts and busy time, and the kernels the greedy step
    does not launch, largest first: XLA's name for each (its fusions and custom calls of that program) and
    the JAX op and source line its HLO instruction came from (``profile_ops.op_sources``). A trace whose
    busy time is under half its mode's measured step (``step_s``) has lost kernels (the profiler misses
    kernels of CUDA graphs at times): the comparison is then refused and ``--ablate`` is the measure."""
    greedy = kernels.get("greedy")
    if not greedy:
        return
    busy = lambda ks: sum(k["us"] for k in ks.values())  # noqa: E731
    lost = [m for m, ks in kernels.items() if m in step_s and busy(ks) < 0.5 * step_s[m] * 1e6]
    if lost:
        print(f"\nbatch {batch}: the traces of {', '.join(lost)} hold under half their steps' time (kernels "
              f"lost by the profiler): no kernel comparison; --ablate measures where the time goes")
        return
    for mode, ks in kernels.items():
        if mode == "greedy":
            continue
        extra = sorted(((k["us"], name, k["source"]) for name, k in ks.items() if name not in greedy), reverse=True)
        print(f"\nbatch {batch}, {mode}: busy {busy(greedy):.0f} -> {busy(ks):.0f} us a step, "
              f"{len(greedy)} -> {len(ks)} kernel names; {sum(us for us, *_ in extra):.0f} us in kernels greedy "
              f"does not launch:")
        for us, name, source in extra[:top]:
            print(f"  {us:9.1f} us  {name[:60]:60s}  {source[-110:]}")


def check_candidate_draws(vocab: int, rows: int, scale: float, candidates: int) -> dict:
    """On the device: ``_draw`` and ``draft_tokens`` (their candidate paths) against the same draws over
    the whole rows, on random ``[rows, vocab]`` logits of spread ``scale``: (equal, exact fraction)."""
    params = SamplingParams(**SAMPLED, seed=0)
    flags = SamplingFlags.of([params], 0)
    logits = jax.random.normal(jax.random.key(0), (rows, 1, vocab), jnp.float32).astype(jnp.bfloat16) * scale
    arrays = smp.row_arrays([dataclasses.replace(params, seed=i) for i in range(rows)], rows, vocab, [0] * rows)
    s = smp.new_state({k: jnp.asarray(v) for k, v in arrays.items()}, capacity=8, max_logprobs=0)
    stop_ids = jnp.full((rows, 1), -1, jnp.int32)
    positions = jnp.full((rows, 1), 3, jnp.int32)
    block = jnp.zeros((rows, 1), jnp.int32)

    @jax.jit
    def run(logits):
        r, pos = smp.Rows.of(s, stop_ids), positions[:, 0]
        flat = logits[:, 0]
        fast, exact = smp.candidate_tokens(flat, r, pos, flags=flags, candidates=candidates)
        whole = decoding.greedy_argmax(smp.draw_scores(flat.astype(jnp.float32), r, pos, flags=flags,
                                                       candidates=candidates))
        drawn = decoding._draw(logits, s, stop_ids, block, positions, flags=flags, candidates=candidates)[:, 0]
        t, k = s.temperature, jnp.where(s.rejection, 0, s.top_k)
        draft, draft_exact, boundary = smp.draft_candidates(flat, t, k, s.seeds, pos,
                                                            count=smp.candidate_count(flags, candidates))
        draft_whole = decoding.greedy_argmax(smp.draft_scores(flat, t, boundary, s.seeds, pos))
        ids = jax.lax.top_k(flat, 64)[1]
        noise_equal = jnp.all(smp.gumbel_at(s.seeds, pos, ids, vocab)
                              == jnp.take_along_axis(smp.gumbel_noise(s.seeds, pos, vocab), ids, axis=-1))
        return (jnp.all(jnp.where(exact, fast == whole, True)) & jnp.all(drawn == whole)
                & jnp.all(jnp.where(draft_exact, draft == draft_whole, True)) & noise_equal,
                exact.mean(), draft_exact.mean())

    equal, exact, draft_exact = run(logits)
    return dict(equal=bool(equal), exact_fraction=float(exact), draft_exact_fraction=float(draft_exact))


def main() -> None:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds")
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--logit-scale", type=float, default=8.0, help="multiplies the random LM head (peaked logits)")
    ap.add_argument("--candidates", type=int, default=64, help="EngineConfig.sampling_candidates")
    ap.add_argument("--max-length", type=int, default=None, help="default: context + room for every timed step")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                    help="trace the largest batch's calls and print the sampled steps' extra kernels "
                         "(default: on a GPU)")
    ap.add_argument("--profile-dir", default="/tmp/bench_sampling_profile")
    ap.add_argument("--ablate", action="store_true",
                    help="also time the largest batch's sampled step with pieces of the sampler replaced")
    ap.add_argument("--json", "--out", dest="out", default=None, help="JSON report (e.g. bench/results/sampling.json)")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    modes = ["greedy"] + [m for m in modes if m != "greedy"]

    print(timing.device_line(), flush=True)
    tcfg = tiny_target_config(num_layers=4) if args.tiny else timing.qwen3_8b(args.layers)
    report = dict(config=vars(args), vocab=tcfg.vocab_size, results={})
    rows_checked = 16 if args.tiny else 256
    report["candidate_check"] = check_candidate_draws(tcfg.vocab_size, rows_checked, args.logit_scale, args.candidates)
    print(f"candidate draws == whole-row draws on {rows_checked} random rows: {report['candidate_check']}", flush=True)
    target, drafter = timing.random_pair(tcfg, drafter_layers=timing.drafter_layers(args.tiny))
    target.lm_head.value = target.lm_head.value * args.logit_scale
    block = drafter.config.block_size
    max_length = args.max_length or args.context + (args.repeats + 3) * args.steps * block + 2 * block
    engine = Engine(target, drafter, EngineConfig(max_batch_size=max(int(b) for b in args.batches.split(",")),
                                                  max_length=max_length, sampling_candidates=args.candidates))
    rows = []
    batches = [int(b) for b in args.batches.split(",")]
    profile = jax.default_backend() == "gpu" if args.profile is None else args.profile
    for batch in batches:
        t0 = time.perf_counter()
        traced = f"{args.profile_dir}/b{batch}" if profile and batch == max(batches) else None
        timed, compile_s, kernels = time_modes(engine, batch, args.context, modes, args.steps, args.repeats, traced)
        if kernels:
            report.setdefault("kernels_us_per_step", {})[batch] = kernels
        for mode, (step, tau) in timed.items():
            report["results"][f"{mode}@{batch}"] = dict(step_s=step, tau=tau, x_greedy=step / timed["greedy"][0])
            rows.append((batch, mode, step, tau))
        print(f"batch {batch}: {time.perf_counter() - t0:.0f} s ({compile_s:.0f} s compiling)", flush=True)
        timing.write_json(args.out, report)

    print(f"\nDFlash step cost by sampling mode (vocabulary {tcfg.vocab_size}, block {block}, context "
          f"{args.context}, LM head x{args.logit_scale}, {args.candidates} candidates)")
    print(f"{'batch':>5} {'mode':13s} {'ms/step':>9} {'x greedy':>9} {'tau':>5}  what")
    for batch, mode, step, tau in rows:
        greedy = next(s for b, m, s, _ in rows if b == batch and m == "greedy")
        print(f"{batch:5d} {mode:13s} {step * 1e3:9.3f} {step / greedy:9.3f} {tau:5.2f}  {MODES[mode][1]}")
    for batch, kernels in report.get("kernels_us_per_step", {}).items():
        print_extra_kernels(kernels, batch, {m: report["results"][f"{m}@{batch}"]["step_s"] for m in kernels})
    if args.ablate:
        batch = max(batches)
        ablated = ablate(engine, batch, args.context, args.steps, args.repeats)
        report["ablation"] = {"batch": batch, "step_s": ablated}
        print(f"\nbatch {batch}, the sampled step with pieces replaced (timing only):")
        for name, step in ablated.items():
            print(f"  {name:45s} {step * 1e3:9.3f} ms  x{step / ablated['greedy']:.3f} greedy  "
                  f"{(step - ablated['greedy']) * 1e6:+7.0f} us")
    print(f"target: sampled and logprobs <= 1.03 x greedy; {time.perf_counter() - t_start:.0f} s in all")
    report["total_s"] = time.perf_counter() - t_start
    timing.write_json(args.out, report)


if __name__ == "__main__":
    main()
