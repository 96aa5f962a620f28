"""Acceptance of a drafter measured with the engine: tau of seeded sampled decoding per temperature and
verification mode, with the check that exact verification reproduces target-only sampling token for
token. Shared by ``serve.py demo``, the embedded pair's benchmark and its build."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dflash_jax.runtime.engine import Engine
from dflash_jax.runtime.sampling import SamplingParams

VERIFY_MODES = ("exact", "rejection")


def mean_acceptance(results) -> float:
    """Mean accepted length over every DFlash step of ``results`` (1.0 when none ran)."""
    lengths = [int(n) for r in results for n in r.acceptance_lengths]
    return float(np.mean(lengths)) if lengths else 1.0


def sampled_tau(spec: Engine, plain: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                temperatures: Sequence[float], stop_token_ids: Sequence[int] | None = None,
                seed: int = 0) -> list[dict]:
    """tau of seeded sampling with ``spec`` (an engine with a drafter) per temperature and verification
    mode the drafter supports (a drafter whose selector picks a path, DFlash2, is not drafted from its
    distribution: exact only); prompt ``i`` is seeded ``seed + i``. For exact verification also whether
    every output equals ``plain``'s (target-only) sampling of the same seeds: it must, token for token.
    Rows: ``{"temperature", "verify", "block_size", "tau", "identical_to_target_only" (exact only)}``."""
    modes = ("exact",) if getattr(spec.drafter, "selects_drafts", False) else VERIFY_MODES
    rows = []
    for temperature in temperatures:
        seeded = [SamplingParams(temperature=float(temperature), seed=seed + i) for i in range(len(prompts))]
        want = [r.output_ids for r in plain.generate(prompts, max_new_tokens, stop_token_ids, sampling=seeded)]
        for verify in modes:
            params = [dataclasses.replace(p, verify=verify) for p in seeded]
            out = spec.generate(prompts, max_new_tokens, stop_token_ids, sampling=params)
            row = {"temperature": float(temperature), "verify": verify, "block_size": spec.block_size,
                   "tau": mean_acceptance(out)}
            if verify == "exact":
                row["identical_to_target_only"] = [r.output_ids for r in out] == want
            rows.append(row)
    return rows
