"""Sampling cost: a DFlash step with sampled rows against the same step greedy, per filter.

A Qwen3-8B-shaped target (vocabulary 151,936) and a 5-layer block-16 drafter, random bf16 weights,
the LM head scaled by ``--logit-scale`` so that the distributions are peaked like a trained model's
(random weights give nearly flat ones: top-p 0.9 then keeps ~90% of the vocabulary, and every row
takes the whole-row sort; ``--logit-scale 1`` measures that worst case). Every row of the batch
uses the mode's parameters; each mode is the engine's jitted decode loop with that mode's
``SamplingFlags``, timed over synchronised calls (state donated), and printed against greedy.

    python3 bench/bench_sampling.py --batches 1,16 --out bench/results/sampling.json
    python3 bench/bench_sampling.py --modes greedy,sampled,penalties,rejection,min_p
    JAX_PLATFORMS=cpu python3 bench/bench_sampling.py --tiny --batches 1 --steps 2 --repeats 1   # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import timing
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
DEFAULT_MODES = "greedy,temperature,top_k,top_p,sampled,logprobs"


def sampled_state(engine: Engine, batch: int, context: int, params: SamplingParams):
    """``timing.synthetic_state`` with every row sampling per ``params``."""
    state = timing.synthetic_state(engine, batch, context, seed=batch)
    arrays = smp.row_arrays([params] * batch, batch, engine.vocab_size, [context] * batch)
    sampling = smp.new_state({k: jnp.asarray(v) for k, v in arrays.items()}, capacity=engine.capacity,
                             max_logprobs=engine.config.max_logprobs)
    return dataclasses.replace(state, sampling=sampling)


def time_mode(engine: Engine, batch: int, context: int, params: SamplingParams, steps: int, repeats: int):
    """Median seconds per decode step over ``repeats`` synchronised calls of ``steps`` steps (after
    two untimed calls: compile, warm), and tokens committed per step."""
    flags = SamplingFlags.of([params], engine.config.max_logprobs)
    state = sampled_state(engine, batch, context, params)
    for _ in range(2):
        state, _ = engine.decode(state, n_steps=steps, sampling=flags)
    jax.block_until_ready(state.starts)
    start = np.asarray(state.starts)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, _ = engine.decode(state, n_steps=steps, sampling=flags)
        jax.block_until_ready(state.starts)
        times.append((time.perf_counter() - t0) / steps)
    advanced = int((np.asarray(state.starts) - start).min())
    if advanced < repeats * steps:
        raise ValueError(f"rows reached max_length during the timing (advanced {advanced} tokens in "
                         f"{repeats * steps} steps); raise --max-length")
    tau = float((np.asarray(state.starts) - start).mean() / (repeats * steps))
    return statistics.median(times), tau


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--logit-scale", type=float, default=8.0, help="multiplies the random LM head (peaked logits)")
    ap.add_argument("--candidates", type=int, default=64, help="EngineConfig.sampling_candidates")
    ap.add_argument("--max-length", type=int, default=None, help="default: context + room for every timed step")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    ap.add_argument("--out", default=None, help="JSON report (e.g. bench/results/sampling.json)")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    if "greedy" not in modes:
        modes.insert(0, "greedy")

    print(timing.device_line(), flush=True)
    tcfg = tiny_target_config(num_layers=4) if args.tiny else timing.qwen3_8b(args.layers)
    target, drafter = timing.random_pair(tcfg)
    target.lm_head.value = target.lm_head.value * args.logit_scale
    block = drafter.config.block_size
    max_length = args.max_length or args.context + (args.repeats + 3) * args.steps * block + 2 * block
    engine = Engine(target, drafter, EngineConfig(max_batch_size=max(int(b) for b in args.batches.split(",")),
                                                  max_length=max_length, sampling_candidates=args.candidates))
    report = dict(config=vars(args), vocab=tcfg.vocab_size, results={})
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for mode in modes:
            t0 = time.perf_counter()
            step, tau = time_mode(engine, batch, args.context, MODES[mode][0], args.steps, args.repeats)
            report["results"][f"{mode}@{batch}"] = dict(step_s=step, tau=tau)
            rows.append((batch, mode, step, tau))
            print(f"batch {batch:3d} {mode:13s} {step * 1e3:8.3f} ms/step (tau {tau:.2f}; "
                  f"{time.perf_counter() - t0:.0f} s with its compile)", flush=True)
            timing.write_json(args.out, report)

    print(f"\nDFlash step cost by sampling mode (vocabulary {tcfg.vocab_size}, block {block}, context "
          f"{args.context}, LM head x{args.logit_scale}, {args.candidates} candidates)")
    print(f"{'batch':>5} {'mode':13s} {'ms/step':>9} {'x greedy':>9}  what")
    for batch, mode, step, _ in rows:
        greedy = next(s for b, m, s, _ in rows if b == batch and m == "greedy")
        print(f"{batch:5d} {mode:13s} {step * 1e3:9.3f} {step / greedy:9.3f}  {MODES[mode][1]}")
    print("target: sampled and logprobs <= 1.03 x greedy")


if __name__ == "__main__":
    main()
