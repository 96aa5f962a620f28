"""Rows sharing a prompt (a request's ``n`` > 1 choices) share its prefill: the prompt runs once, each
row draws its own first token, and every row generates what it generates alone; a paged engine's rows
share the prompt's full pages and give every page back."""

import numpy as np
import pytest

from dflash_jax import ContinuousBatcher, Engine, EngineConfig, SamplingParams
from dflash_jax.runtime.engine import shared_prompts
from dflash_jax.serving.protocol import choice_seed

MAX_NEW = 16
PAGE = 8
CONFIG = dict(max_batch_size=4, max_length=80, steps_per_sync=4, prompt_buckets=(64,), sampling_candidates=8)


@pytest.fixture(scope="module")
def engines(models):
    target, drafter = models
    return (Engine(target, drafter, EngineConfig(**CONFIG)),
            Engine(target, drafter, EngineConfig(page_size=PAGE, **CONFIG)))


@pytest.fixture(scope="module")
def prompt():
    return np.random.RandomState(3).randint(0, 95, 21).tolist()  # two full pages and a part


def _choices(seed: int, n: int = 3, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=choice_seed(seed, j), **kw) for j in range(n)]


def test_shared_prompts_maps_equal_prompts_to_the_least_cached():
    assert shared_prompts([[1, 2], [3], [4]]) is None
    assert shared_prompts([[1, 2], [3], [1, 2], [1, 2]]) == [0, 1, 0, 0]
    assert shared_prompts([[1, 2], [1, 2], [1, 2]], cached=[8, 0, 8]) == [1, 1, 1]


def test_n_choices_prefill_once_and_equal_solo_runs(engines, prompt):
    spec, _ = engines
    params = _choices(7, logprobs=2)
    solo = [spec.generate([prompt], MAX_NEW, [11], sampling=p)[0] for p in params]
    before = (spec.prefilled_prompts, spec.prefilled_tokens)
    shared = spec.generate([prompt] * 3, MAX_NEW, [11], sampling=params)
    assert (spec.prefilled_prompts - before[0], spec.prefilled_tokens - before[1]) == (1, len(prompt))
    assert [r.output_ids for r in shared] == [r.output_ids for r in solo]
    assert len({tuple(r.output_ids) for r in shared}) == 3
    for a, b in zip(shared, solo):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    greedy = spec.generate([prompt] * 3, MAX_NEW, [11])
    alone = spec.generate([prompt], MAX_NEW, [11])[0]
    assert all(r.output_ids == alone.output_ids for r in greedy)


@pytest.mark.slow
def test_shared_prompts_among_distinct_ones_in_one_prefill(engines, prompt):
    spec, _ = engines
    other = prompt[:9]
    prompts = [prompt, other, prompt, other]
    params = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3, 4)]
    before = spec.prefilled_prompts
    got = spec.generate(prompts, MAX_NEW, [11], sampling=params)
    assert spec.prefilled_prompts - before == 2
    assert [r.output_ids for r in got] == [spec.generate([p], MAX_NEW, [11], sampling=sp)[0].output_ids
                                           for p, sp in zip(prompts, params)]


@pytest.mark.slow
@pytest.mark.parametrize("cached", [False, True])
def test_paged_choices_share_the_prompt_pages_and_give_them_back(engines, prompt, cached):
    """``cached``: the prompt's first pages are in the prefix cache already (an earlier request): the
    choices compute only the rest, once."""
    spec, paged = engines
    params = _choices(5)
    batcher = ContinuousBatcher(paged)
    if cached:
        batcher.submit(prompt[:17], 2, [11])
        batcher.run()
    before = (paged.prefilled_prompts, paged.prefilled_tokens)
    generations = [batcher.submit(prompt, MAX_NEW, [11], sampling=p) for p in params]
    batcher.step()  # the admission: one prefill of the prompt, its two full pages held by all three rows
    full = len(prompt) // PAGE
    assert paged.prefilled_prompts - before[0] == 1
    assert paged.prefilled_tokens - before[1] == len(prompt) - (2 * PAGE if cached else 0)
    assert all(g.pages[:full] == generations[0].pages[:full] for g in generations)
    assert len({p for g in generations for p in g.pages}) == full + 3 * (len(generations[0].pages) - full)
    batcher.run()
    assert [g.result.output_ids for g in generations] == [
        spec.generate([prompt], MAX_NEW, [11], sampling=p)[0].output_ids for p in params]
    assert batcher.pages.all_free()


@pytest.mark.slow
def test_paged_prompt_logprobs_compute_the_whole_prompt_despite_a_cached_prefix(models, engines, prompt):
    """A prompt whose logprobs are asked is computed whole (its cached prefix and chunking skipped): the
    logprobs equal the contiguous engine's, for each of its choices, and every page comes back."""
    spec, _ = engines
    paged = Engine(*models, EngineConfig(page_size=PAGE, prefill_chunk=PAGE, **CONFIG))
    params = [SamplingParams(temperature=0.7, seed=s, prompt_logprobs=2) for s in (1, 2)]
    want = spec.generate([prompt], MAX_NEW, [11], sampling=params[0])[0]
    batcher = ContinuousBatcher(paged)
    batcher.submit(prompt, 2, [11])
    batcher.run()  # the prompt's full pages are cached now
    before = paged.prefilled_tokens
    generations = [batcher.submit(prompt, MAX_NEW, [11], sampling=p) for p in params]
    batcher.run()
    assert paged.prefilled_tokens - before == len(prompt)  # once, whole, in one prefill
    for g in generations:
        assert g.result.prompt_logprobs[0] is None
        np.testing.assert_allclose(g.result.prompt_logprobs[1:], want.prompt_logprobs[1:], atol=1e-5)
        assert [list(d) for d in g.result.prompt_top_logprobs[1:]] == [list(d) for d in want.prompt_top_logprobs[1:]]
    assert generations[0].result.output_ids == want.output_ids
    assert batcher.pages.all_free()
