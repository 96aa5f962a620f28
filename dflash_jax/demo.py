"""The self-check demo behind ``python serve.py demo``: DFlash vs target-only in one engine.

It writes a small pair in HF / z-lab format, loads it through the public API, generates for a
batch of prompts with and without the drafter, checks that the outputs are identical, and reports
tau, the acceptance-length histogram and the measured speedup. Until the shipped trained pair exists
(issue 6), the pair is the synthetic ``write_copycat_pair`` (a noisy repeat-the-last-token target and
a drafter built to propose "repeat the anchor"): real acceptance, no training.
"""

from __future__ import annotations

import collections
import tempfile
import time

import numpy as np

from dflash_jax.checkpoint import load_drafter, load_target
from dflash_jax.engine import Engine, EngineConfig
from dflash_jax.tiny import write_copycat_pair


# A target large enough that, on a CPU too, one step costs far more than the one-layer drafter.
DEMO_SHAPE = dict(vocab_size=2048, hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8,
                  num_kv_heads=8, head_dim=64)


def run_demo(num_prompts: int = 4, max_new_tokens: int = 96, block_size: int = 8, noise: float = 0.15,
             seed: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, drafter_dir = write_copycat_pair(tmp, noise=noise, block_size=block_size, seed=seed,
                                                     shape=DEMO_SHAPE, drafter_layers=1)
        target, drafter = load_target(target_dir), load_drafter(drafter_dir)
    rng = np.random.RandomState(seed)
    prompts = [rng.randint(0, target.config.vocab_size - 1, rng.randint(4, 40)).tolist() for _ in range(num_prompts)]
    config = EngineConfig(max_batch_size=1, max_length=64 + max_new_tokens, steps_per_sync=8)  # latency mode
    spec, plain = Engine(target, drafter, config), Engine(target, None, config)
    for engine in (spec, plain):  # compile outside the timed runs
        engine.generate(prompts, 4)
    t0 = time.perf_counter()
    fast = spec.generate(prompts, max_new_tokens)
    t_spec = time.perf_counter() - t0
    t0 = time.perf_counter()
    slow = plain.generate(prompts, max_new_tokens)
    t_plain = time.perf_counter() - t0
    identical = all(a.output_ids == b.output_ids for a, b in zip(fast, slow))
    lengths = [n for r in fast for n in r.acceptance_lengths]
    tokens = sum(r.num_output_tokens for r in fast)
    return dict(
        prompts=num_prompts, output_tokens=tokens, identical=identical, tau=float(np.mean(lengths)),
        histogram=dict(sorted(collections.Counter(lengths).items())), dflash_s=t_spec, target_only_s=t_plain,
        speedup=t_plain / t_spec,
    )


def print_demo(report: dict) -> None:
    print(f"DFlash demo (synthetic self-check pair): {report['prompts']} prompts, "
          f"{report['output_tokens']} tokens generated")
    print(f"  greedy output identical with and without the drafter: {report['identical']}")
    print(f"  tau (mean accepted tokens per step): {report['tau']:.2f}")
    hist = "  ".join(f"{k}:{v}" for k, v in report["histogram"].items())
    print(f"  acceptance-length histogram: {hist}")
    print(f"  time: DFlash {report['dflash_s']:.2f}s, target-only {report['target_only_s']:.2f}s, "
          f"speedup {report['speedup']:.2f}x")
