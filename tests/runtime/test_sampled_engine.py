"""Sampled generation through the engine: exact verification equals target-only decoding token for token,
a row is the same alone and in any batch, greedy rows are unchanged, logprobs are the target's, and the
draws follow the processed target distribution (chi-square) in both verification modes."""

import dataclasses
import itertools

import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the oracles; without torch (e.g. a jax-only venv) the module skips
from transformers.generation import logits_process as hf

from dflash_jax import Engine, EngineConfig, SamplingParams, target_forward

MAX_NEW = 24
# A chi-square test passes at p > 1e-3: a correct sampler fails one run in a thousand (the seeds are
# fixed, so a pass is reproducible); the same test against a slightly wrong distribution fails (below).
P_VALUE = 1e-3

MIXED = [
    None,
    SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.2, presence_penalty=0.5, seed=2, logprobs=2),
    SamplingParams(temperature=1.5, min_p=0.05, frequency_penalty=0.3, seed=3),
    SamplingParams(temperature=0.3, logit_bias={7: 2.0, 11: -5.0}, min_tokens=5, seed=4),
]


@pytest.fixture(scope="module")
def engines(models):
    target, drafter = models
    config = EngineConfig(max_batch_size=8, max_length=64, steps_per_sync=4, sampling_candidates=8)
    return Engine(target, drafter, config), Engine(target, None, config)


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [rs.randint(0, 95, n).tolist() for n in (5, 17, 9, 30, 2)]


def _ids(results):
    return [r.output_ids for r in results]


def test_mixed_batch_speculative_equals_target_only(engines, prompts):
    spec, plain = engines
    stops = [67]
    batch = spec.generate(prompts, MAX_NEW, stops, sampling=MIXED)
    assert _ids(batch) == _ids(plain.generate(prompts, MAX_NEW, stops, sampling=MIXED))
    assert batch[0].logprobs is None and len(batch[2].logprobs) == len(batch[2].output_ids)
    assert 67 not in batch[4].output_ids[:5]  # min_tokens blocks the stop id


@pytest.mark.slow
def test_a_row_is_the_same_alone_and_greedy_rows_are_unchanged(engines, prompts):
    spec, _ = engines
    stops = [67]
    batch = spec.generate(prompts, MAX_NEW, stops, sampling=MIXED)
    alone = spec.generate(prompts[2:3], MAX_NEW, stops, sampling=MIXED[2:3])
    assert alone[0].output_ids == batch[2].output_ids
    # The same logprobs up to float32 rounding: a state of 1 row and one of 8 run different matmul shapes.
    assert alone[0].logprobs == pytest.approx(batch[2].logprobs, abs=1e-4)
    greedy = spec.generate(prompts, MAX_NEW, stops)
    assert batch[0].output_ids == greedy[0].output_ids  # a greedy row among sampled ones is unchanged
    assert [r.output_ids for r in batch[1:]] != [r.output_ids for r in greedy[1:]]


@pytest.mark.slow
def test_same_seed_same_tokens_and_other_seeds_differ(engines, prompts):
    spec, _ = engines
    params = [SamplingParams(temperature=1.0, seed=s) for s in (5, 5, 6)]
    out = spec.generate([prompts[1]] * 3, MAX_NEW, sampling=params)
    assert out[0].output_ids == out[1].output_ids != out[2].output_ids


def test_logprobs_equal_the_targets_log_softmax(engines, prompts, models):
    spec, _ = engines
    params = SamplingParams(temperature=0.9, top_k=20, seed=11, logprobs=3)
    for prompt, result in zip(prompts[:2], spec.generate(prompts[:2], MAX_NEW, sampling=params)):
        ids = prompt + result.output_ids
        logits, _ = target_forward(models[0], np.asarray([ids]))
        want = torch.log_softmax(torch.tensor(np.asarray(logits[0], np.float64)), -1).numpy()[len(prompt) - 1:-1]
        chosen = want[np.arange(len(result.output_ids)), result.output_ids]
        # Within 1e-5 absolute and relative: the engine's cached block passes and this full forward round
        # the logits differently (float32), by up to ~1e-5 of a logit.
        np.testing.assert_allclose(result.logprobs, chosen, rtol=1e-5, atol=1e-5)
        for row, top in zip(want, result.top_logprobs):
            best = np.argsort(-row)[:3]
            assert list(top) == best.tolist()
            np.testing.assert_allclose(list(top.values()), row[best], rtol=1e-5, atol=1e-5)


def test_prompt_logprobs_come_from_the_prefill_and_equal_the_targets_log_softmax(engines, prompts, models):
    """Prompt logprobs (completions' ``echo``) are recorded by the prefill itself: a row asking for them
    among rows that do not, and rows sharing the prompt (``n`` > 1 choices), get the target's."""
    spec, _ = engines
    prompt = prompts[3]
    before = spec.prefilled_prompts
    asks = SamplingParams(temperature=0.8, seed=4, prompt_logprobs=3)
    results = spec.generate([prompts[0], prompt, prompt], 4, sampling=[None, asks, dataclasses.replace(asks, seed=5)])
    assert spec.prefilled_prompts - before == 2  # one pass per distinct prompt, the logprobs' included
    assert results[0].prompt_logprobs is None
    logits, _ = target_forward(models[0], np.asarray([prompt]))
    want = torch.log_softmax(torch.tensor(np.asarray(logits[0], np.float64)), -1).numpy()
    for result in results[1:]:
        lps, tops = result.prompt_logprobs, result.prompt_top_logprobs
        assert lps[0] is None and tops[0] is None and len(lps) == len(tops) == len(prompt)
        # As the output tokens' logprobs (above): within 1e-5 absolute and relative. The top values, near 0
        # (no relative slack), within 5e-5: this full forward and the prefill's pass round logits of up to
        # ~27 differently in float32, by up to ~3e-5 (1e-6 of the logit).
        np.testing.assert_allclose(lps[1:], want[np.arange(len(prompt) - 1), prompt[1:]], rtol=1e-5, atol=1e-5)
        for row, top in zip(want, tops[1:]):
            best = np.argsort(-row)[:3]
            assert list(top) == best.tolist()
            np.testing.assert_allclose(list(top.values()), row[best], rtol=1e-5, atol=5e-5)


COMBOS = [dict(), dict(top_p=0.8), dict(top_k=4, min_p=0.05), dict(top_p=0.95, top_k=30, repetition_penalty=1.3,
                                                                   presence_penalty=0.4, frequency_penalty=0.2)]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.5])
def test_sweep_speculative_equals_target_only(engines, prompts, temperature):
    """Every combination x three seeds, all in one batch and each row alone, at a temperature below,
    at and above 1 (0.7, another below, is in ``MIXED``)."""
    spec, plain = engines
    cases = [(p, SamplingParams(temperature=temperature, seed=seed, **combo))
             for (p, combo), seed in itertools.product(zip(prompts, COMBOS), (0, 1, 2))]
    rows, params = [c[0] for c in cases], [c[1] for c in cases]
    got = spec.generate(rows, MAX_NEW, sampling=params)
    assert _ids(got) == _ids(plain.generate(rows, MAX_NEW, sampling=params))
    assert _ids(spec.generate(rows[:1], MAX_NEW, sampling=params[:1])) == _ids(got[:1])


# -- distribution: the first three tokens after one prompt, many seeds ----------------------------------


def _warped_probs(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    scores = torch.tensor(np.asarray(logits, np.float64)[None])
    for w in (hf.TemperatureLogitsWarper(temperature), hf.TopKLogitsWarper(top_k)):
        scores = w(None, scores)
    return torch.softmax(scores, -1)[0].numpy()


def _joint(target, prompt, temperature, top_k) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) of the processed target distribution, from full forwards (no cache, no engine)."""
    joint = {(): 1.0}
    for _ in range(3):
        prefixes = list(joint)
        logits, _ = target_forward(target, np.asarray([prompt + list(p) for p in prefixes]))
        nxt = {}
        for prefix, row in zip(prefixes, np.asarray(logits[:, -1])):
            probs = _warped_probs(row, temperature, top_k)
            for t in np.flatnonzero(probs):
                nxt[prefix + (int(t),)] = joint[prefix] * probs[t]
        joint = nxt
    return joint


def _chi_square_p(samples: list[tuple[int, ...]], joint: dict) -> float:
    from scipy import stats

    cells = sorted(joint, key=joint.get, reverse=True)
    n = len(samples)
    observed = np.array([sum(s == c for s in samples) for c in cells], np.float64)
    assert observed.sum() == n, "a draw outside the processed distribution's support"
    expected = np.array([joint[c] for c in cells]) * n
    big = expected >= 5  # cells expected fewer than 5 times are pooled
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()
    return stats.chisquare(obs[keep], exp).pvalue


@pytest.fixture(scope="module")
def wide_engine(models):
    target, drafter = models
    return Engine(target, drafter, EngineConfig(max_batch_size=256, max_length=24, steps_per_sync=4))


@pytest.mark.slow
@pytest.mark.parametrize("verify", ["exact", "rejection"])
def test_sampled_tokens_follow_the_processed_target_distribution(wide_engine, models, prompts, verify):
    """The joint distribution of the first three tokens (the prefill's draw, then verify steps) over
    1,024 seeds against the product of the processed target conditionals."""
    temperature, top_k, n = 1.5, 3, 1024
    prompt = prompts[0]
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=seed, verify=verify) for seed in range(n)]
    out = wide_engine.generate([prompt] * n, 3, sampling=params)
    samples = [tuple(r.output_ids) for r in out]
    joint = _joint(models[0], prompt, temperature, top_k)
    assert _chi_square_p(samples, joint) > P_VALUE
    wrong = _joint(models[0], prompt, 1.2, top_k)  # the test tells a nearby distribution apart
    assert _chi_square_p(samples, wrong) < P_VALUE


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(data=2, tensor=2), dict(data=1, tensor=4)])
def test_sharded_sampled_engine_equals_single_device(models, prompts, engines, mesh):
    from dflash_jax.sharding import MeshConfig

    spec, _ = engines
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i, logprobs=2, repetition_penalty=1.1)
              for i in range(4)]
    want = spec.generate(prompts[:4], MAX_NEW, sampling=params)
    sharded = Engine(*models, EngineConfig(max_batch_size=8, max_length=64, steps_per_sync=4, sampling_candidates=8,
                                           mesh=MeshConfig(fsdp=1, **mesh)))
    got = sharded.generate(prompts[:4], MAX_NEW, sampling=params)
    assert _ids(got) == _ids(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
