"""Evaluation during training: tau (mean accepted length) of real greedy speculative decoding
with the project's engine on held-out prompts."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def speculative_tau(target, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    stop_token_ids: Sequence[int] | None = None) -> dict[str, float]:
    """Runs ``dflash_jax.runtime.engine.generate`` (greedy) and returns ``{"tau", "tokens"}``.

    ``tau`` pools all prompts: total committed tokens / total draft-verify steps, when the engine
    reports them, else the mean of the per-prompt ``.tau``.
    """
    from dflash_jax.runtime.engine import generate

    results = generate(target, drafter, [list(p) for p in prompts], max_new_tokens, stop_token_ids)
    taus = [float(r.tau) for r in results]
    steps = [getattr(r, "acceptance_lengths", None) for r in results]
    if all(s is not None and len(s) for s in steps):
        flat = np.concatenate([np.asarray(s, np.float64) for s in steps])
        tau = float(flat.mean())
    else:
        tau = float(np.mean(taus))
    tokens = sum(len(r.output_ids) for r in results)
    return {"tau": tau, "tau_mean_of_prompts": float(np.mean(taus)), "tokens": float(tokens)}
