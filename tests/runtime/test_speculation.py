"""Adaptive speculation: the policy alone (cost model, acceptance estimates, choices), and the engine
forced through every choice (block sizes, target-only, switching between calls mid-generation) giving
target-only decoding's tokens, greedy and seeded-sampled, batched rows equal to rows alone; the
drafter interface's override hook, the largest block checked against the drafter; the synthetic drafter's
acceptance is the one asked for."""

import dataclasses
import inspect
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax import ContinuousBatcher, Engine, EngineConfig, SamplingParams
from dflash_jax.sharding import MeshConfig
from dflash_jax.models.drafter import Drafter
from dflash_jax.runtime import decoding
from dflash_jax.runtime import speculation as spec
from dflash_jax.synthetic import SyntheticDrafter, repeat_target, set_accept_rate, synthetic_drafter
from dflash_jax.tiny import random_drafter, random_target, tiny_drafter_config, tiny_target_config

MAX_NEW = 30
_SLOW = lambda *values: pytest.param(*values, marks=pytest.mark.slow)  # noqa: E731

# -- the policy ---------------------------------------------------------------------------------------


def test_expected_tokens_and_its_inverse():
    assert spec.expected_tokens(0.0, 16) == 1.0
    assert spec.expected_tokens(1.0, 16) == 16.0
    assert spec.expected_tokens(0.5, 4) == pytest.approx(1.875)
    assert spec.expected_tokens(0.9, 1) == 1.0
    for tau, block in ((3.3, 16), (1.5, 8), (7.9, 8)):
        assert spec.expected_tokens(spec.rate_for_tau(tau, block), block) == pytest.approx(tau)
    with pytest.raises(ValueError, match="tau"):
        spec.rate_for_tau(17, 16)


def test_acceptance_estimate_recovers_a_geometric_rate_at_any_block():
    rs = np.random.RandomState(0)
    for rate, block in ((0.3, 16), (0.8, 16), (0.8, 4), (0.95, 8)):
        est = spec.AcceptanceEstimate(0.0, 0.0)
        lengths = []
        for _ in range(4000):
            acc = 0
            while acc < block - 1 and rs.rand() < rate:
                acc += 1
            lengths.append(acc + 1)
        est.observe(lengths, block, decay=1.0)
        assert est.rate == pytest.approx(rate, abs=0.02)
    est = spec.AcceptanceEstimate(5.0, 1.0)
    est.observe([1, 1], spec.OFF, decay=0.5)  # target-only steps say nothing about the drafter
    assert (est.accepted, est.rejected) == (5.0, 1.0)


def test_choose_maximises_expected_tokens_per_second():
    costs = {(32, 16): 3.3, (32, 8): 2.0, (32, 4): 1.4, (32, 1): 1.0, (1, 16): 1.29, (1, 8): 1.2, (1, 4): 1.15,
             (1, 1): 1.0}
    blocks = (16, 8, 4, 1)
    good, bad = spec.rate_for_tau(6.0, 16), spec.rate_for_tau(1.2, 16)
    assert spec.choose([good], 1, costs, blocks).block == 16
    assert spec.choose([bad] * 20, 32, costs, blocks).block == 1
    mid = spec.choose([spec.rate_for_tau(3.0, 16)] * 32, 32, costs, blocks)
    assert mid.block == 4 and mid.tokens_per_second[4] == max(mid.tokens_per_second.values())
    assert mid.tokens_per_step[1] == 32
    assert spec.choose([0.0], 2, {(2, 8): 1.0, (2, 1): 1.0}, (8, 1)).block == 1  # a tie: the cheaper step
    assert spec.choose([good], 1, {k: v for k, v in costs.items() if k != (1, 16)}, blocks).block == 8
    with pytest.raises(ValueError, match="no step cost"):
        spec.choose([0.5], 4, costs, blocks)


def test_policy_learns_rows_probes_when_off_and_seeds_new_rows_from_the_population():
    costs = {(4, 8): 2.0, (4, 4): 1.5, (4, 1): 1.0}
    policy = spec.SpeculationPolicy((8, 4, 1), costs, spec.SpeculationSettings(prior_rate=0.8, probe_interval=3))
    rows = [policy.new_row() for _ in range(4)]
    assert policy.choose(rows, 4).block == 8
    for row in rows:  # the drafter fails every draft
        policy.observe(row, [1] * 30, 8)
    assert [policy.choose(rows, 4).block for _ in range(5)] == [1, 1, 1, 4, 1]
    assert policy.last.block == 1 and policy.new_row().rate < 0.1
    with pytest.raises(ValueError, match="prior_rate"):
        spec.SpeculationPolicy((8, 1), costs, spec.SpeculationSettings(prior_rate=1.0))
    with pytest.raises(ValueError, match="target-only"):
        spec.SpeculationPolicy((8, 4), costs)


def test_posterior_expected_tokens_exceed_the_plug_in_while_evidence_is_thin():
    thin = spec.AcceptanceEstimate(0.0, 0.0, prior_accepted=7.0, prior_rejected=3.0)
    ample = spec.AcceptanceEstimate(7000.0, 3000.0)
    assert thin.rate == ample.rate == pytest.approx(0.7)
    assert thin.expected_tokens(16) > spec.expected_tokens(0.7, 16) + 0.2
    assert ample.expected_tokens(16) == pytest.approx(spec.expected_tokens(0.7, 16), rel=1e-3)
    assert thin.expected_tokens(1) == 1.0 and spec.AcceptanceEstimate(0.0, 4.0).expected_tokens(8) == 1.0


def test_population_follows_the_batchs_steps_and_rows_read_its_current_rate():
    costs = {(64, 8): 4.0, (64, 4): 1.3, (64, 1): 1.0}
    policy = spec.SpeculationPolicy((8, 4, 1), costs, spec.SpeculationSettings(prior_rate=0.7, decay=0.9))
    rows = [policy.new_row() for _ in range(64)]
    policy.choose(rows, 64)
    for row in rows:  # one call of 8 steps accepting nothing: the prior's weight falls by 0.9 ** 8, not 0.9 ** 512
        policy.observe(row, [1] * 8, 4)
    kept = 4 * 0.7 / 0.3 * 0.9 ** 8
    assert policy.population.accepted == pytest.approx(kept, rel=1e-6)
    late = policy.new_row()
    policy.choose(rows + [late], 64)
    assert late.rate == pytest.approx(policy.population.rate) and rows[0].rate < policy.population.rate


# -- the engine, forced through every choice -----------------------------------------------------------


@pytest.fixture(scope="module")
def engines(models):
    target, drafter = models
    config = EngineConfig(max_batch_size=4, max_length=64, steps_per_sync=3, sampling_candidates=8,
                          speculation="adaptive", speculation_blocks=(8, 4))
    adaptive = Engine(target, drafter, config)
    return adaptive, Engine(target, None, config)


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [rs.randint(0, 95, n).tolist() for n in (5, 17, 9, 2)]


class _Forced(ContinuousBatcher):
    """A batcher whose calls run the given blocks in turn, whatever the policy would choose."""

    def __init__(self, engine, blocks):
        super().__init__(engine)
        self._blocks = itertools.cycle(blocks)

    def _choose_block(self, live):
        block = next(self._blocks)
        return spec.Choice(block, {}, {}, 0.0)


def _run(engine, prompts, blocks, sampling=None):
    batcher = _Forced(engine, blocks)
    gens = [batcher.submit(p, MAX_NEW, [67], sampling=s)
            for p, s in zip(prompts, sampling or [None] * len(prompts))]
    batcher.run()
    return [g.result for g in gens]


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [(1,), (8, 1, 4, 4, 1)])
def test_every_choice_gives_target_only_tokens_and_rows_alone_equal_batched(engines, prompts, blocks):
    adaptive, plain = engines
    want = [r.output_ids for r in plain.generate(prompts, MAX_NEW, [67])]
    batched = _run(adaptive, prompts, blocks)
    assert [r.output_ids for r in batched] == want
    assert [_run(adaptive, [p], blocks)[0].output_ids for p in prompts[:2]] == want[:2]
    for r in batched:  # every step is counted once, by the block it ran
        assert sum(r.block_steps.values()) == r.num_steps == len(r.acceptance_lengths)
        assert set(r.block_steps) <= set(blocks)
        assert sum(r.acceptance_lengths) == len(r.output_ids) - 1
        assert all(n <= max(r.block_steps) for n in r.acceptance_lengths)
    if 1 in blocks:
        assert any(r.block_steps.get(1) for r in batched)


@pytest.mark.slow
def test_every_choice_gives_seeded_sampling_its_target_only_tokens(engines, prompts):
    adaptive, plain = engines
    params = [SamplingParams(temperature=0.8, seed=s, top_k=20) for s in range(len(prompts))]
    want = [r.output_ids for r in plain.generate(prompts, MAX_NEW, [67], sampling=params)]
    assert [r.output_ids for r in _run(adaptive, prompts, (8, 1, 4), params)] == want


@pytest.mark.slow
def test_adaptive_engine_goes_target_only_when_speculating_cannot_pay(engines, prompts):
    adaptive, plain = engines
    blocks = adaptive.speculation_blocks
    assert blocks == (8, 4, 1)
    adaptive.set_step_costs({(rows, b): (100.0 if b > 1 else 1.0) for rows in (1, 4) for b in blocks})
    results = adaptive.generate(prompts, MAX_NEW, [67])
    assert [r.output_ids for r in results] == [r.output_ids for r in plain.generate(prompts, MAX_NEW, [67])]
    assert all(set(r.block_steps) == {1} for r in results)
    adaptive.set_step_costs({(rows, b): 1.0 for rows in (1, 4) for b in blocks})  # free speculation: block 8
    results = adaptive.generate(prompts, MAX_NEW, [67])
    assert all(set(r.block_steps) == {8} and 0 < r.acceptance_rate < 1 for r in results)
    with pytest.raises(ValueError, match="speculation blocks"):
        adaptive.set_step_costs({(4, 16): 1.0})
    measured = adaptive.calibrate_speculation(rows=[4], steps=2, repeats=1)
    assert set(measured) == {(4, 8), (4, 4), (4, 1)} and all(t > 0 for t in measured.values())
    assert adaptive.step_costs[(4, 8)] == measured[(4, 8)]


@pytest.mark.parametrize("layout", ["contiguous", "paged", _SLOW("mesh")])
def test_target_only_calls_extend_the_drafters_context_as_a_prefill_of_their_tokens(prompts, layout):
    """A target-only call keeps its steps' taps and projects them into the drafter's context after its
    last step: then every committed position's context K/V is what a prefill of the same tokens writes
    (float32, to rounding), through the page tables too; a call of more steps than the buffer holds
    runs as several. The rows stop at different steps (max lengths), one is done before the call. A target of
    two layers, each tapped by the drafter."""
    tcfg = tiny_target_config(num_layers=2)
    target = random_target(tcfg, seed=5)
    drafter = random_drafter(tiny_drafter_config(tcfg, block_size=8), seed=6)
    page_size = 8 if layout == "paged" else 0
    mesh = dict(mesh=MeshConfig(data=2, fsdp=1, tensor=4), decode_loop="fixed") if layout == "mesh" else {}
    engine = Engine(target, drafter, EngineConfig(max_batch_size=4, max_length=64, steps_per_sync=3,
                                                  speculation="adaptive", speculation_blocks=(8, 4),
                                                  page_size=page_size, **mesh))
    new_tokens = [20, 4, 1, 8]
    if page_size:
        pages = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(4)]
        state = engine.empty_state(4)
        state, rows, _, admission = engine.prefill_paged(state, prompts, new_tokens, [()] * 4, pages, [0] * 4)
        state = engine.admit_paged(state, rows, [0, 1, 2, 3], admission)
    else:
        rows, _ = engine.prefill(prompts, new_tokens, [()] * 4)
        state = engine.admit(engine.empty_state(4), rows, [0, 1, 2, 3])
    before = np.asarray(state.starts)
    state, _ = engine.decode(state, 3, block=1)   # the buffer's 3 slots
    state, snap = engine.decode(state, 8, block=1)  # 3 + 3 + 2 (a fixed loop: one call of 8 slots)
    starts, tokens = np.asarray(snap.starts), np.asarray(snap.tokens)
    assert (starts - before).tolist() == [11, 3, 0, 7]
    cache = state.draft_cache
    if page_size:
        from dflash_jax.ops.cache import KVCache
        from dflash_jax.ops.paged_cache import gather_pages
        cache = KVCache(*(tuple(gather_pages(x, state.page_table, engine.max_pages) for x in xs)
                          for xs in (cache.k, cache.v)))
    for row in range(4):
        n = int(starts[row])
        fresh, _ = engine.prefill([tokens[row, :n].tolist()], [1], [()])
        for got, want in zip(cache.k + cache.v, fresh.draft_cache.k + fresh.draft_cache.v):
            np.testing.assert_allclose(np.asarray(got[row, :n]), np.asarray(want[0, :n]), atol=2e-5, rtol=1e-5)


def test_speculation_settings_are_validated(models):
    target, drafter = models
    with pytest.raises(ValueError, match="speculation must be"):
        EngineConfig(speculation="auto").validate()
    with pytest.raises(ValueError, match="speculation_blocks"):
        EngineConfig(speculation_blocks=(8, 1)).validate()
    fixed = Engine(target, drafter, EngineConfig(max_length=32))
    assert fixed.speculation_blocks == (8,) and not fixed.adaptive
    with pytest.raises(ValueError, match="not one of"):
        fixed.decode(fixed.empty_state(1), 1, block=4)


def test_the_largest_speculation_block_is_checked_against_the_drafter_and_sizes_the_engine(models):
    target, drafter = models  # a drafter of block 8
    adaptive = dict(max_length=32, speculation="adaptive")
    with pytest.raises(ValueError, match=r"speculation_blocks \(16, 4\): block 16 exceeds the drafter's block size 8"):
        Engine(target, drafter, EngineConfig(**adaptive, speculation_blocks=(16, 4)))
    with pytest.raises(ValueError, match="block_size 16 exceeds the drafter's block size 8"):
        Engine(target, drafter, EngineConfig(**adaptive, block_size=16, speculation_blocks=(4,)))
    # A block_size below the largest speculation block: the engine's block is the largest, what its caches hold.
    engine = Engine(target, drafter, EngineConfig(**adaptive, block_size=4, speculation_blocks=(8, 2)))
    assert engine.block_size == 8 and engine.speculation_blocks == (8, 4, 2, 1)
    assert engine.capacity >= 32 + 8
    assert EngineConfig(**adaptive, block_size=4, speculation_blocks=(8, 2)).largest_block(8) == 8
    # Fixed speculation runs block_size alone: its speculation_blocks are no block of it.
    fixed = EngineConfig(max_length=32, block_size=4, speculation_blocks=(16,))
    assert fixed.largest_block(8) == 4 and fixed.drafter_block_error(8) is None
    assert Engine(target, drafter, fixed).speculation_blocks == (4,)


# -- the drafter interface's override hook and the synthetic drafter ----------------------------------------


class _Fives(Drafter):
    """A drafter that always proposes token 5, through ``Drafter.override_drafts``."""

    def override_drafts(self, draft, tokens, positions):
        return jnp.full_like(draft, 5)


def test_draft_block_proposes_a_drafters_own_drafts_unless_it_overrides_them(models):
    target, drafter = models
    draft = jnp.arange(14, dtype=jnp.int32).reshape(2, 7)
    assert drafter.override_drafts(draft, jnp.zeros((2, 40), jnp.int32), jnp.zeros((2, 8), jnp.int32)) is draft
    hook = inspect.signature(Drafter.override_drafts)  # the synthetic drafter implements the interface's hook
    assert inspect.signature(SyntheticDrafter.override_drafts) == hook
    assert list(hook.parameters) == ["self", "draft", "tokens", "positions"]
    fives = _Fives(drafter.config, rngs=nnx.Rngs(0))
    nnx.update(fives, nnx.state(drafter, nnx.Param))
    state = decoding.empty_state(target, drafter, 2, capacity=40, max_steps=30, n_stop=1)
    state = dataclasses.replace(state, starts=jnp.asarray([4, 2], jnp.int32), max_lens=jnp.asarray([30, 30], jnp.int32),
                                done=jnp.zeros(2, bool), tokens=state.tokens.at[:, :5].set(jnp.asarray([[3], [7]])))
    own, replaced = jax.jit(lambda s: [decoding.draft_block(target, d, s, block_size=8) for d in (drafter, fives)])(state)
    assert own[0].shape == replaced[0].shape == (2, 8) and replaced[0].dtype == own[0].dtype
    assert jnp.all(replaced[0][:, 0] == own[0][:, 0]) and jnp.all(replaced[0][:, 0] == jnp.asarray([3, 7]))
    assert jnp.all(replaced[0][:, 1:] == 5) and not jnp.all(own[0][:, 1:] == 5)  # the anchors stay, the drafts go
    assert jnp.all(replaced[2][:, 0] == jnp.asarray([4, 2]))  # positions from each row's anchor


# -- the synthetic drafter -------------------------------------------------------------------------------


@pytest.mark.slow
def test_synthetic_drafter_accepts_at_the_rate_asked_and_keeps_the_targets_tokens():
    tcfg = tiny_target_config(num_layers=2)
    target = repeat_target(random_target(tcfg, seed=3))
    base = random_drafter(tiny_drafter_config(tcfg, block_size=8), seed=4)
    prompts = [[5, 9, 11], [7, 3]]
    config = EngineConfig(max_batch_size=2, max_length=100, prompt_buckets=(16,))
    want = Engine(target, None, config).generate(prompts, 90)
    assert all(set(r.output_ids) == {p[-1]} for r, p in zip(want, prompts))  # it repeats its last token
    engine = Engine(target, synthetic_drafter(base, 0.0, seed=1), config)
    for rate in (0.5, 1.0):
        set_accept_rate(engine, rate)  # one engine, nothing recompiled
        got = engine.generate(prompts, 90)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        lengths = [n for r in got for n in r.acceptance_lengths[:-1]]  # the last step is cut at max_length
        assert np.mean(lengths) == pytest.approx(spec.expected_tokens(rate, 8), rel=0.15)
    with pytest.raises(ValueError, match="accept_rate"):
        synthetic_drafter(base, 1.5)
    assert jnp.all(synthetic_drafter(base, 0.5).fc[...] == base.fc[...])


def test_synthetic_drafter_steps_run_the_drafters_whole_pass():
    """Its cost is a real drafter's: the step computes every product the real drafter's does, though
    right proposals ignore the drafter's own (a pass no one read would be compiled out)."""
    tcfg = tiny_target_config(num_layers=2)
    target = random_target(tcfg, seed=3)
    base = random_drafter(tiny_drafter_config(tcfg, block_size=8), seed=4)
    config = EngineConfig(max_batch_size=2, max_length=64, prompt_buckets=(16,))

    def products(drafter) -> int:
        engine = Engine(target, drafter, config)
        state, _ = engine.prefill([[5, 9, 11], [7, 3]], [8, 8], [(), ()])
        return len(re.findall(r" dot\(", engine.decode_hlo(state, 2)))

    assert products(synthetic_drafter(base, 1.0)) == products(base)


def test_warmup_plan_compiles_every_block_of_an_adaptive_engine(engines, models):
    from dflash_jax.runtime.warmup import warmup_plan

    adaptive, _ = engines
    decodes = [s for s in warmup_plan(adaptive) if s.phase == "decode"]
    for rows in (1, 4):
        for window in adaptive.windows:
            assert {s.block for s in decodes if s.rows == rows and s.size == window} == {None, 4, 1}
    assert "block 4" in str(next(s for s in decodes if s.block == 4))
    fixed = Engine(*models, EngineConfig(max_batch_size=4, max_length=64))
    assert all(s.block is None for s in warmup_plan(fixed))
