"""The main job behind ``python serve.py demo``: DFlash vs target-only greedy in one engine.

With the embedded default pair (``models/embedded``: a small code model trained here on Python's
standard library and its DFlash drafter) it answers held-out prompts (function signatures and
docstrings of held-out stdlib files) with and without the drafter, checks that the greedy outputs
are identical, and reports tau, the acceptance-length histogram and the measured speedup. Without
the shipped pair (a wheel without ``models/``) it falls back to the synthetic ``write_copycat_pair``.
"""

from __future__ import annotations

import collections
import tempfile
import time

import numpy as np

from dflash_jax.io.checkpoint import load_drafter, load_target
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.tiny import write_copycat_pair

# A synthetic target large enough that, on a CPU too, a step costs far more than a 1-layer drafter.
COPYCAT_SHAPE = dict(vocab_size=2048, hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8,
                     num_kv_heads=8, head_dim=64)


def compare(target, drafter, prompts: list[list[int]], max_new_tokens: int,
            stop_token_ids: list[int] | None = None) -> dict:
    """Greedy generation with and without the drafter (batch 1: latency mode), timed after warm-up."""
    config = EngineConfig(max_batch_size=1, max_length=max(map(len, prompts)) + max_new_tokens, steps_per_sync=8)
    spec, plain = Engine(target, drafter, config), Engine(target, None, config)
    for engine in (spec, plain):  # every prompt bucket and decode window compiled outside the timed runs
        engine.warmup([1])
    t0 = time.perf_counter()
    fast = spec.generate(prompts, max_new_tokens, stop_token_ids)
    t_spec = time.perf_counter() - t0
    t0 = time.perf_counter()
    slow = plain.generate(prompts, max_new_tokens, stop_token_ids)
    t_plain = time.perf_counter() - t0
    lengths = [n for r in fast for n in r.acceptance_lengths]
    return dict(
        prompts=len(prompts), output_tokens=sum(r.num_output_tokens for r in fast),
        identical=all(a.output_ids == b.output_ids for a, b in zip(fast, slow)),
        tau=float(np.mean(lengths)) if lengths else 1.0,
        histogram=dict(sorted(collections.Counter(lengths).items())),
        dflash_s=t_spec, target_only_s=t_plain, speedup=t_plain / t_spec,
        results=fast,
    )


def run_demo(num_prompts: int = 8, max_new_tokens: int = 96) -> dict:
    from dflash_jax import embedded

    if embedded.available():
        target, drafter, tokenizer = embedded.load_default()
        texts = embedded.heldout_prompts(num_prompts)
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        report = compare(target, drafter, prompts, max_new_tokens, list(tokenizer.stop_token_ids))
        report["pair"] = f"embedded default ({embedded.EMBEDDED_DIR}), held-out stdlib prompts"
        report["sample"] = texts[0] + tokenizer.decode(report["results"][0].output_ids)
        return report
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, drafter_dir = write_copycat_pair(tmp, noise=0.15, block_size=8, shape=COPYCAT_SHAPE,
                                                     drafter_layers=1)
        target, drafter = load_target(target_dir), load_drafter(drafter_dir)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, target.config.vocab_size - 1, rng.randint(4, 40)).tolist()
               for _ in range(num_prompts)]
    report = compare(target, drafter, prompts, max_new_tokens)
    report["pair"] = "synthetic self-check pair (models/embedded not found)"
    return report


def print_demo(report: dict) -> None:
    print(f"DFlash demo: {report['pair']}")
    print(f"  {report['prompts']} prompts, {report['output_tokens']} tokens generated at batch 1")
    print(f"  greedy output identical with and without the drafter: {report['identical']}")
    print(f"  tau (mean accepted tokens per step): {report['tau']:.2f}")
    print("  acceptance-length histogram: " + "  ".join(f"{k}:{v}" for k, v in report["histogram"].items()))
    print(f"  time: DFlash {report['dflash_s']:.2f}s, target-only {report['target_only_s']:.2f}s, "
          f"speedup {report['speedup']:.2f}x")
    if "sample" in report:
        print("  sample (prompt + DFlash output):\n" + "\n".join("    " + line for line in
                                                               report["sample"].splitlines()[:12]))
