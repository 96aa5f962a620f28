"""Adaptive speculation: which block size (or none) the next decode call should run.

A DFlash step costs more than a target-only step, and the more so the larger the batch (its verify
pass runs ``rows * B`` tokens through the target): at batch 32 on the H200 one step of block 16 costs
3.3 target-only steps, so a drafter committing fewer tokens per step than that makes decoding slower
than not speculating. Per decode call the engine (``EngineConfig.speculation: adaptive``) picks the
option with the most expected tokens per second among the drafter's block and smaller ones (each a
compiled step of its own) and *off*, a target-only step (block 1):

- step cost: seconds per step of each ``(state rows, block)``, measured on the device
  (``Engine.calibrate_speculation``) or given (``Engine.set_step_costs``);
- tokens per step: per live row, from its acceptance. Acceptance is modelled as geometric: each draft
  after the anchor is accepted with a per-position probability ``rate`` while the ones before it were, so
  a block of ``B`` slots commits ``1 + rate + ... + rate ** (B - 1)`` tokens on average, and a rate
  measured at one block size extrapolates to the others;
- a row's rate is uncertain: its evidence is the drafts it had accepted and rejected (a step that accepts
  its whole block has no rejection; counts decaying by ``decay`` per step), read with a prior of
  ``prior_steps`` steps at the population's current rate (the population: every row's steps, decaying
  by ``decay`` per step of the batch, starting from ``prior_steps`` at ``prior_rate``), a
  ``Beta(accepted, rejected)`` posterior with those pseudo-counts. The option's tokens per step are their
  mean over the posterior (``AcceptanceEstimate.expected_tokens``), above the plug-in
  ``expected_tokens(mean rate)`` while the evidence is thin: a fresh row tries the large block where it may
  pay (at batch 1-8 block 16 costs little more than block 8), and a row's estimate converges to its own
  rate, shrunk toward the batch's while it has few steps.

A call's block applies to every row (the batched step takes one block size): a row whose drafter keeps
failing lowers the batch's expected tokens, and once speculating no longer pays for the batch, the call
runs target-only. While off nothing is observed, so every ``probe_interval`` consecutive target-only
calls the next runs the smallest block once, to see whether acceptance came back.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

OFF = 1  # the block size of a target-only step


@dataclasses.dataclass(frozen=True)
class SpeculationSettings:
    """Knobs of the adaptive policy (validated)."""

    prior_rate: float = 0.7      # the population's per-position acceptance rate before any observation
    prior_steps: float = 4.0     # how many steps of evidence the population's rate is worth in a row's prior
    decay: float = 0.9           # per step: a row's (and the batch's) evidence is its last ~1 / (1 - decay) steps
    probe_interval: int = 16     # consecutive target-only calls before one speculative call re-measures

    def validate(self) -> None:
        if not 0.0 <= self.prior_rate < 1.0:
            raise ValueError(f"prior_rate must be in [0, 1), got {self.prior_rate}")
        if self.prior_steps <= 0:
            raise ValueError(f"prior_steps must be > 0, got {self.prior_steps}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {self.probe_interval}")


def expected_tokens(rate: float, block: int) -> float:
    """Mean tokens one step of ``block`` slots commits at per-position acceptance ``rate``:
    ``1 + rate + ... + rate ** (block - 1)`` (the bonus token, then the drafts accepted in a row;
    1 for a target-only step, ``block`` 1)."""
    return sum(rate ** k for k in range(block))


def rate_for_tau(tau: float, block: int) -> float:
    """The per-position rate at which a block of ``block`` slots commits ``tau`` tokens per step
    (``expected_tokens``' inverse; bisection)."""
    if not 1.0 <= tau <= block:
        raise ValueError(f"tau must be in [1, {block}] for a block of {block}, got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, block) < tau else (lo, mid)
    return (lo + hi) / 2


@dataclasses.dataclass
class AcceptanceEstimate:
    """A row's (decayed) evidence about its per-position acceptance rate, and the prior it is read with:
    the posterior over the rate is ``Beta(accepted + prior_accepted, rejected + prior_rejected)``."""

    accepted: float    # drafts accepted
    rejected: float    # drafts rejected (at most one per step)
    prior_accepted: float = 0.0   # pseudo-counts of the prior (``SpeculationPolicy``: the population's)
    prior_rejected: float = 0.0

    @property
    def rate(self) -> float:
        """The posterior mean rate (with no prior: the maximum-likelihood estimate; 0 with no evidence)."""
        a, b = self.accepted + self.prior_accepted, self.rejected + self.prior_rejected
        return a / (a + b) if a + b > 0 else 0.0

    def expected_tokens(self, block: int) -> float:
        """Mean tokens per step of ``block`` slots over the posterior: ``sum_k E[rate ** k]``, with
        ``E[rate ** k] = prod_{i<k} (a + i) / (a + b + i)`` for ``Beta(a, b)``. Above the plug-in
        ``expected_tokens(rate, block)`` while the evidence is thin (``rate ** k`` is convex), so a large
        block is tried while it may pay, and equal to it once the evidence is ample."""
        a, b = self.accepted + self.prior_accepted, self.rejected + self.prior_rejected
        if a + b <= 0:
            return 1.0
        total, moment = 1.0, 1.0
        for i in range(block - 1):
            moment *= (a + i) / (a + b + i)
            total += moment
        return total

    def observe(self, lengths: Sequence[int], block: int, decay: float) -> None:
        """Adds the steps that committed ``lengths`` tokens each (acc + 1) at ``block`` slots. A step
        that committed the whole block rejected nothing; one cut by the row's end reads as a rejection."""
        if block <= OFF:
            return
        for n in lengths:
            acc = max(0, min(int(n) - 1, block - 1))
            self.accepted = self.accepted * decay + acc
            self.rejected = self.rejected * decay + (acc < block - 1)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A decode call's choice and what the model expected of every option."""

    block: int                                   # OFF: target-only
    tokens_per_second: Mapping[int, float]       # per option (block), the expected tokens/s of the batch
    tokens_per_step: Mapping[int, float]         # per option, the expected tokens per step of the batch
    mean_rate: float                             # the live rows' mean acceptance estimate
    probe: bool = False                          # a speculative call forced to re-measure acceptance


def choose(rates: Sequence[float], rows: int, costs: Mapping[tuple[int, int], float],
           blocks: Sequence[int]) -> Choice:
    """The option in ``blocks`` (``OFF`` among them) with the most expected tokens per second for live
    rows of per-position acceptance ``rates``, in a running state of ``rows`` rows whose step of each
    block costs ``costs[(rows, block)]`` seconds (blocks without a cost are left out). Ties go to the
    cheaper step (the smaller block)."""
    if not rates:
        raise ValueError("choose needs at least one live row")
    return best_option({b: sum(expected_tokens(r, b) for r in rates) for b in blocks}, rows, costs,
                       sum(rates) / len(rates))


def best_option(tokens_per_step: Mapping[int, float], rows: int, costs: Mapping[tuple[int, int], float],
                mean_rate: float) -> Choice:
    """``choose`` from the batch's expected tokens per step of each block."""
    blocks = [b for b in tokens_per_step if (rows, b) in costs]  # a block without a measured cost is no option
    if not blocks:
        raise ValueError(f"no step cost for {rows} rows")
    per_step = {b: tokens_per_step[b] for b in blocks}
    per_second = {b: per_step[b] / costs[(rows, b)] for b in blocks}
    best = max(sorted(blocks, key=lambda b: (costs[(rows, b)], b)), key=lambda b: per_second[b])
    return Choice(best, per_second, per_step, mean_rate)


class SpeculationPolicy:
    """The host side of adaptive speculation: each row's evidence, the population's, the choice."""

    def __init__(self, blocks: Sequence[int], costs: Mapping[tuple[int, int], float],
                 settings: SpeculationSettings = SpeculationSettings()):
        settings.validate()
        if OFF not in blocks or any(b < 1 for b in blocks):
            raise ValueError(f"blocks must be block sizes including {OFF} (target-only), got {tuple(blocks)}")
        self.blocks = tuple(sorted(set(blocks), reverse=True))
        self.costs = dict(costs)
        self.settings = settings
        # The population: every row's steps, ``prior_steps`` of them at ``prior_rate`` to start.
        self.population = AcceptanceEstimate(*self._prior_counts(settings.prior_rate))
        self._live_rows = 1
        self._off_calls = 0
        self.last: Choice | None = None

    def new_row(self) -> AcceptanceEstimate:
        """A new request's estimate: no evidence of its own, read with the population's prior."""
        return self._with_prior(AcceptanceEstimate(0.0, 0.0))

    def _prior_counts(self, rate: float) -> tuple[float, float]:
        """(accepted, rejected) of ``prior_steps`` untruncated steps at ``rate``: rate / (1 - rate)
        accepted drafts and one rejection each."""
        steps = self.settings.prior_steps
        return steps * rate / (1 - rate), steps

    def _with_prior(self, estimate: AcceptanceEstimate) -> AcceptanceEstimate:
        # ``prior_steps`` steps at the population's current rate.
        estimate.prior_accepted, estimate.prior_rejected = self._prior_counts(min(self.population.rate, 0.999))
        return estimate

    def observe(self, estimate: AcceptanceEstimate, lengths: Sequence[int], block: int) -> None:
        """Steps of one row that committed ``lengths`` at ``block`` slots (its and the population's).
        The population decays by ``decay`` per step of the batch, not per step of each row: shared over
        the rows of the last call (``decay ** (1 / rows)`` per row's step), it follows the batch's last
        ``~1 / (1 - decay)`` steps at any batch size."""
        estimate.observe(lengths, block, self.settings.decay)
        self.population.observe(lengths, block, self.settings.decay ** (1.0 / self._live_rows))

    def choose(self, estimates: Sequence[AcceptanceEstimate], rows: int) -> Choice:
        """The next call's block for live rows with ``estimates`` in a state of ``rows`` rows: each row's
        expected tokens of each block over its posterior (``AcceptanceEstimate.expected_tokens``), its
        own evidence read with ``prior_steps`` of the population's current rate."""
        if not estimates:
            raise ValueError("choose needs at least one live row")
        self._live_rows = len(estimates)
        estimates = [self._with_prior(e) for e in estimates]
        choice = best_option({b: sum(e.expected_tokens(b) for e in estimates) for b in self.blocks}, rows,
                             self.costs, sum(e.rate for e in estimates) / len(estimates))
        if choice.block == OFF:
            self._off_calls += 1
            speculative = [b for b in self.blocks if b != OFF]
            if self._off_calls > self.settings.probe_interval and speculative:
                self._off_calls = 0
                choice = dataclasses.replace(choice, block=min(speculative), probe=True)
        else:
            self._off_calls = 0
        self.last = choice
        return choice
