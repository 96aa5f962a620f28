"""The logits processors against transformers' and vLLM's definitions, the keyed draws, and SamplingParams."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the oracles; without torch (e.g. a jax-only venv) the module skips
from transformers.generation import logits_process as hf

from dflash_jax import SamplingParams
from dflash_jax.runtime import sampling as smp
from dflash_jax.runtime.sampling import SamplingFlags

ALL_FILTERS = SamplingFlags(sample=True, top_k=True, top_p=True, top_p_whole_row=True, min_p=True)


def _hf_warped(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """transformers' warpers in generate's order (temperature, top-k, top-p, min-p) on one row."""
    scores = torch.tensor(logits[None])
    warpers = [hf.TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(hf.TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(hf.TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(hf.MinPLogitsWarper(min_p))
    for w in warpers:
        scores = w(None, scores)
    return scores[0].numpy()


def _ours(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, candidates: int):
    return np.asarray(_processed(jnp.asarray(logits), temperature, top_k, top_p, min_p, candidates=candidates))


@functools.partial(jax.jit, static_argnames=("candidates",))
def _processed(logits, temperature, top_k, top_p, min_p, *, candidates: int):
    """The filters as the decode step compiles them: one program per shape and candidate count, the
    settings its arguments."""
    rows = logits.shape[0]
    t = jnp.full((rows,), temperature, jnp.float32)
    scaled = logits / t[:, None]
    theta = smp.filter_thresholds(scaled, jnp.full((rows,), top_k, jnp.int32), jnp.full((rows,), top_p, jnp.float32),
                                  jnp.full((rows,), min_p, jnp.float32), flags=ALL_FILTERS, candidates=candidates)
    return smp.processed_logits(logits, t, theta)


_FAST = pytest.param
_SLOW = lambda *a: pytest.param(*a, marks=pytest.mark.slow)  # noqa: E731


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    _FAST(0.7, 50, 0.9, 0.0), _FAST(1.5, 0, 0.5, 0.05), _SLOW(0.7, 0, 0.9, 0.0), _SLOW(1.0, 50, 1.0, 0.0),
    _SLOW(0.3, 10, 0.95, 0.1), _SLOW(1.0, 0, 1.0, 0.2), _SLOW(1.0, 3, 0.3, 0.0), _SLOW(2.0, 200, 0.999, 0.0),
])
@pytest.mark.parametrize("candidates", [8, 64, 1000])
def test_filters_equal_transformers_warpers(temperature, top_k, top_p, min_p, candidates):
    """Kept sets and values equal transformers' warpers, whether read from the candidates (exact when
    the kept set fits them) or from the whole row (the fallback's search, here with 8 candidates)."""
    rs = np.random.RandomState(0)
    logits = (rs.randn(6, 300) * rs.choice([0.5, 3.0, 8.0], (6, 1))).astype(np.float32)
    got = _ours(logits, temperature, top_k, top_p, min_p, candidates)
    for row in range(len(logits)):
        want = _hf_warped(logits[row], temperature, top_k, top_p, min_p)
        np.testing.assert_array_equal(np.isfinite(got[row]), np.isfinite(want), err_msg=f"row {row}")
        keep = np.isfinite(want)
        np.testing.assert_allclose(got[row][keep], want[keep], rtol=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_p_and_every_tie():
    probs = np.array([[0.5, 0.2, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]], np.float32)
    logits = np.log(probs)
    kept = np.isfinite(_ours(logits, 1.0, 0, 0.6, 0.0, candidates=2))
    # 0.5 < 0.6: the next token joins, and the token tied with it too; 0.4 + 0.3 >= 0.6; all four tie.
    np.testing.assert_array_equal(kept, [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    kept = np.isfinite(_ours(logits, 1.0, 0, 0.5, 0.0, candidates=4))
    np.testing.assert_array_equal(kept[0], [1, 0, 0, 0])  # the first token's mass reaches p exactly


def test_top_k_keeps_ties_with_the_kth_like_transformers():
    logits = np.array([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]], np.float32)
    got = np.isfinite(_ours(logits, 1.0, 2, 1.0, 0.0, candidates=3))
    want = np.isfinite(_hf_warped(logits[0], 1.0, 2, 1.0, 0.0))
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(got[0], [1, 1, 1, 1, 0, 0])


def test_whole_row_threshold_keeps_the_sorted_rows_sets_without_a_sort():
    """The fallback's threshold (a search, no sort) keeps the same tokens as the threshold read from the
    whole sorted row: ties, -inf, top-k past the row, top-k and top-p together and apart; and the
    program of the filters holds no sort of a whole row (it would keep the decode loop out of the CUDA
    graph on a GPU)."""
    rs = np.random.RandomState(12)
    sorted_rows = jax.jit(lambda x, n, k, p: smp._sorted_threshold(-jnp.sort(-x, axis=-1), n, k, p))
    searched = jax.jit(smp._searched_threshold, static_argnames=("any_top_k", "any_top_p"))
    for trial in range(24):
        vocab = (7, 397)[trial % 2]
        x = (rs.randn(8, vocab) * rs.choice([0.3, 3.0, 10.0], (8, 1))).astype(np.float32)
        x[trial % 3::3] = np.round(x[trial % 3::3])
        x[trial % 5::5, : vocab // 3] = -np.inf
        top_k = jnp.asarray(rs.randint(0, vocab + 3, 8) * (rs.rand(8) < 0.7), jnp.int32)
        top_p = jnp.asarray(rs.choice([0.1, 0.5, 0.9, 0.999, 1.0], 8), jnp.float32)
        scaled = jnp.asarray(x)
        log_norm = jax.nn.logsumexp(scaled, axis=-1)
        for k_on, p_on in ((True, True), (True, False), (False, True)):  # the filters the batch uses
            ks = top_k if k_on else jnp.zeros_like(top_k)
            ps = top_p if p_on else jnp.ones_like(top_p)
            want = sorted_rows(scaled, log_norm, ks, ps)
            got = searched(scaled, log_norm, ks, ps, any_top_k=k_on, any_top_p=p_on)
            np.testing.assert_array_equal(x >= np.asarray(got)[:, None], x >= np.asarray(want)[:, None],
                                          err_msg=f"trial {trial}, top-k {k_on}, top-p {p_on}")
    ones = jnp.ones((2,))
    program = jax.make_jaxpr(lambda s: smp.filter_thresholds(s, 5 * ones.astype(jnp.int32), 0.9 * ones, 0 * ones,
                                                             flags=ALL_FILTERS, candidates=8))
    text = str(program(jnp.zeros((2, 3000))))  # the branches' jaxprs included
    assert "= sort" in text and "f32[2,3000] = sort" not in text  # the candidates' short sorts only


def test_neutral_filters_keep_every_token():
    logits = np.random.RandomState(1).randn(3, 50).astype(np.float32)
    np.testing.assert_array_equal(_ours(logits, 1.0, 0, 1.0, 0.0, candidates=4), logits)


def test_repetition_penalty_equals_transformers():
    rs = np.random.RandomState(2)
    logits = rs.randn(2, 40).astype(np.float32) * 3
    input_ids = rs.randint(0, 40, (2, 12))
    want = hf.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(input_ids), torch.tensor(logits)).numpy()
    seen = np.zeros((2, 40), bool)
    for r in range(2):
        seen[r, input_ids[r]] = True
    ones = jnp.ones((2,), jnp.float32)
    got = smp.penalize(jnp.asarray(logits), jnp.zeros((2, 40), jnp.int32), jnp.asarray(seen), 1.3 * ones, 0 * ones,
                       0 * ones)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_presence_and_frequency_penalties_are_openais():
    """logit - frequency * count - presence * (count > 0), over the generated tokens (OpenAI, vLLM)."""
    rs = np.random.RandomState(3)
    logits = rs.randn(2, 30).astype(np.float32)
    generated = [[4, 4, 7, 29, 4], [0]]
    counts = np.zeros((2, 30), np.int32)
    for r, ids in enumerate(generated):
        for t in ids:
            counts[r, t] += 1
    want = logits.copy()
    for r, (presence, frequency) in enumerate([(0.5, 0.25), (-1.0, 2.0)]):
        for t in set(generated[r]):
            want[r, t] -= frequency * generated[r].count(t) + presence
    got = smp.penalize(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(counts > 0), jnp.ones((2,)),
                       jnp.asarray([0.5, -1.0]), jnp.asarray([0.25, 2.0]))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_neutral_penalties_and_bias_change_nothing_bit_for_bit():
    logits = jnp.asarray(np.random.RandomState(4).randn(2, 30).astype(np.float32))
    counts = jnp.asarray(np.random.RandomState(5).randint(0, 3, (2, 30)), jnp.int32)
    out = smp.penalize(logits, counts, counts > 0, jnp.ones((2,)), jnp.zeros((2,)), jnp.zeros((2,)))
    out = smp.bias_and_block(out, jnp.zeros((2, 30)), jnp.full((2, 2), -1, jnp.int32), jnp.ones((2,), bool))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(logits))


def test_logit_bias_and_min_tokens_block_stop_ids_like_transformers():
    rs = np.random.RandomState(6)
    logits = rs.randn(2, 20).astype(np.float32)
    bias = np.zeros((2, 20), np.float32)
    bias[0, 3], bias[1, 5] = 5.0, -100.0
    stop_ids = jnp.asarray([[7, 9, -1], [7, -1, -1]], jnp.int32)
    got = np.asarray(smp.bias_and_block(jnp.asarray(logits), jnp.asarray(bias), stop_ids, jnp.asarray([True, False])))
    hf_min = hf.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=4, min_new_tokens=2, eos_token_id=[7, 9])
    want0 = hf_min(torch.zeros((1, 5), dtype=torch.long), torch.tensor(logits[:1] + bias[:1])).numpy()[0]
    np.testing.assert_array_equal(got[0], want0)
    np.testing.assert_array_equal(got[1], logits[1] + bias[1])  # past min_tokens: nothing blocked


def test_gumbel_draws_depend_on_seed_and_position_only():
    seeds = jnp.asarray([[0, 1], [0, 2], [0, 1]], jnp.uint32)
    noise = np.asarray(smp.gumbel_noise(seeds, jnp.asarray([5, 5, 5]), 50))
    np.testing.assert_array_equal(noise[0], noise[2])
    assert not np.array_equal(noise[0], noise[1])
    alone = np.asarray(smp.gumbel_noise(seeds[:1], jnp.asarray([5]), 50))
    np.testing.assert_array_equal(alone[0], noise[0])
    later = np.asarray(smp.gumbel_noise(seeds[:1], jnp.asarray([6]), 50))
    assert not np.array_equal(later[0], noise[0])


def test_logprobs_are_the_log_softmax_of_raw_logits():
    logits = np.random.RandomState(7).randn(3, 40).astype(np.float32) * 4
    chosen = jnp.asarray([0, 5, 39])
    lp, ids, vals = smp.logprobs_of(jnp.asarray(logits), chosen, 4)
    want = torch.log_softmax(torch.tensor(logits), -1).numpy()
    np.testing.assert_allclose(np.asarray(lp), want[np.arange(3), [0, 5, 39]], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-want, -1)[:, :4])
    np.testing.assert_allclose(np.asarray(vals), -np.sort(-want, -1)[:, :4], atol=1e-5)


def test_logprobs_of_bfloat16_logits_equal_those_of_their_float32_values():
    """The logits' own dtype in, no float32 copy: the same logprobs as from the converted rows, rows of
    -inf entries and ties at the top included."""
    logits = np.random.RandomState(8).randn(4, 3000).astype(np.float32) * 6
    logits[1, :2990] = -np.inf
    logits[2] = np.round(logits[2])
    raw = jnp.asarray(logits).astype(jnp.bfloat16)
    chosen = jnp.asarray([0, 2995, 7, 2999])
    got = smp.logprobs_of(raw, chosen, 5)
    want = smp.logprobs_of(raw.astype(jnp.float32), chosen, 5)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    wanted = torch.log_softmax(torch.tensor(np.asarray(raw.astype(jnp.float32))), -1).numpy()
    np.testing.assert_allclose(np.asarray(got[0]), wanted[np.arange(4), np.asarray(chosen)], atol=1e-5)


def test_block_counts_see_the_earlier_drafts_as_generated():
    counts = jnp.zeros((1, 6), jnp.int32).at[0, 2].set(1)
    c, seen = smp.block_counts(counts, counts > 0, jnp.asarray([[5, 1, 1, 3]]))
    np.testing.assert_array_equal(np.asarray(c[0, :, [1, 2, 3]]).T, [[0, 1, 0], [1, 1, 0], [2, 1, 0], [2, 1, 1]])
    assert not bool(seen[0, 3, 5])  # the anchor (slot 0) was counted when it was committed


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.1, "temperature must be >= 0"), ("top_p", 0.0, "top_p must be in"),
    ("top_k", -1, "top_k must be >= 0"), ("min_p", 1.5, "min_p must be in"), ("seed", -3, "seed must be in"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"), ("logit_bias", {-1: 1.0}, "negative token id"),
    ("min_tokens", -1, "min_tokens must be >= 0"), ("logprobs", -1, "logprobs must be None or >= 0"),
    ("verify", "greedy", "verify must be one of"), ("temperature", float("nan"), "must be finite"),
    ("top_k", 2.5, "top_k must be an integer"), ("temperature", "hot", "temperature must be a number"),
    pytest.param("temperature", 10**400, "temperature must be finite", id="temperature-past-float-range"),
])
def test_sampling_params_refuse_bad_values_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_sampling_params_are_frozen_and_seeded_on_request():
    p = SamplingParams(temperature=0.7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0
    assert p.with_seed().seed is not None and SamplingParams().with_seed().seed is None
    assert SamplingParams(temperature=0.7, seed=3).with_seed().seed == 3
    assert SamplingParams(logit_bias={np.int64(3): np.float32(-2.5)}).logit_bias  # numpy scalars are numbers
    with pytest.raises(ValueError, match=r"logit_bias\[3\] must be a number"):
        SamplingParams(logit_bias={3: True})
    with pytest.raises(ValueError, match="outside"):
        SamplingParams(logit_bias={100: 1.0}).check_vocab(100, 20)
    with pytest.raises(ValueError, match="max_logprobs"):
        SamplingParams(logprobs=21).check_vocab(100, 20)


def test_flags_compile_in_only_what_the_rows_use():
    assert SamplingFlags.of([SamplingParams(), SamplingParams(top_k=5)], 20).greedy  # greedy rows ignore filters
    flags = SamplingFlags.of([SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(logprobs=0)], 20)
    assert flags.sample and flags.top_p and not flags.top_k and not flags.edits and flags.logprobs == 0
    assert SamplingFlags.of([SamplingParams(logprobs=2)], 20).logprobs == 20
    assert SamplingFlags.of([SamplingParams(repetition_penalty=1.1)], 20).edits
    # Candidates for the largest top-k: above it (its survivors must fit), a power of two, at most 1024.
    sizes = [SamplingFlags.of([SamplingParams(temperature=1.0, top_k=k)], 20).top_k_candidates for k in (50, 64, 5000)]
    assert sizes == [64, 128, 1024]


def test_row_arrays_take_a_top_k_and_min_tokens_past_int32():
    """A request's top_k past the vocabulary keeps every token and its min_tokens past any length blocks
    stop ids throughout: both fit the device's int32 rows instead of failing the admission."""
    big = SamplingParams(temperature=1.0, top_k=10 ** 12, min_tokens=10 ** 40)
    arrays = smp.row_arrays([big, SamplingParams(temperature=1.0, top_k=5, min_tokens=2)], 2, 100, [3, 4])
    assert arrays["top_k"].tolist() == [100, 5]
    assert arrays["min_end"].tolist() == [np.iinfo(np.int32).max, 6]


def test_a_top_k_above_the_candidates_gets_enough_of_them():
    logits = np.random.RandomState(11).randn(2, 3000).astype(np.float32)
    flags = SamplingFlags.of([SamplingParams(temperature=1.0, top_k=100, top_p=0.5)], 20)
    theta = smp.filter_thresholds(jnp.asarray(logits), jnp.full((2,), 100, jnp.int32), jnp.full((2,), 0.5),
                                  jnp.zeros((2,)), flags=flags, candidates=8)
    kept = np.isfinite(np.asarray(smp.processed_logits(jnp.asarray(logits), jnp.ones((2,)), theta)))
    for row in range(2):
        want = _hf_warped(logits[row], 1.0, 100, 0.5, 0.0)
        np.testing.assert_array_equal(kept[row], np.isfinite(want))


def test_draws_match_the_processed_distribution():
    """Many keyed draws of one row against softmax of its processed logits (chi-square, p > 1e-3)."""
    from scipy import stats

    logits = np.random.RandomState(8).randn(1, 12).astype(np.float32) * 2
    n = 4000
    rows = smp.Rows(temperature=jnp.full((n,), 0.8), top_p=jnp.full((n,), 0.9), top_k=jnp.full((n,), 6, jnp.int32),
                    min_p=jnp.full((n,), 0.02), seeds=jnp.stack([jnp.zeros(n, jnp.uint32), jnp.arange(n, dtype=jnp.uint32)], 1),
                    presence=jnp.zeros(n), frequency=jnp.zeros(n), repetition=jnp.ones(n), min_end=jnp.zeros(n, jnp.int32),
                    bias=jnp.zeros((n, 12)), stop_ids=jnp.full((n, 1), -1, jnp.int32))
    flags = dataclasses.replace(ALL_FILTERS)
    tiled = jnp.tile(jnp.asarray(logits), (n, 1))
    draws = np.asarray(jnp.argmax(smp.draw_scores(tiled, rows, jnp.full((n,), 7), flags=flags, candidates=4), -1))
    want = torch.softmax(torch.tensor(_hf_warped(logits[0], 0.8, 6, 0.9, 0.02)).double(), -1).numpy()
    support = want > 0
    observed = np.bincount(draws, minlength=12)
    assert observed[~support].sum() == 0
    assert stats.chisquare(observed[support], want[support] * n).pvalue > 1e-3



def _rejection_state(batch: int, vocab: int, seeds, temperature: float = 1.0):
    from dflash_jax.runtime.decoding import DecodeState

    arrays = smp.row_arrays([SamplingParams(temperature=temperature, seed=int(s), verify="rejection") for s in seeds],
                            batch, vocab, [0] * batch)
    sampling = smp.new_state({k: jnp.asarray(v) for k, v in arrays.items()}, capacity=8, max_logprobs=0)
    zeros = jnp.zeros((batch,), jnp.int32)
    return DecodeState(tokens=jnp.zeros((batch, 9), jnp.int32), starts=zeros, max_lens=zeros + 8,
                       done=jnp.zeros((batch,), bool), num_steps=zeros, accepted=jnp.zeros((batch, 8), jnp.int32),
                       stop_ids=jnp.full((batch, 1), -1, jnp.int32), target_cache=None, draft_cache=None,
                       sampling=sampling)


def test_rejection_sampling_commits_the_targets_distribution():
    """Slot 0 of a verify block by rejection sampling: the draft (drawn from q) kept with probability
    min(1, p/q), else a draw from max(0, p - q): the committed token follows p (chi-square, p > 1e-3);
    a drafter equal to the target has every draft accepted."""
    from scipy import stats

    from dflash_jax.runtime.decoding import sampled_posterior

    n, vocab, block = 4000, 6, 2
    rs = np.random.RandomState(10)
    p_logits = rs.randn(vocab).astype(np.float32)
    q_logits = rs.randn(vocab).astype(np.float32)
    q = np.exp(q_logits - q_logits.max()) / np.exp(q_logits - q_logits.max()).sum()
    drafts = rs.choice(vocab, size=n, p=q)
    state = _rejection_state(n, vocab, range(n))
    logits = jnp.broadcast_to(jnp.asarray(p_logits), (n, block, vocab))
    block_ids = jnp.stack([jnp.zeros(n, jnp.int32), jnp.asarray(drafts, jnp.int32)], axis=1)
    positions = jnp.tile(jnp.arange(1, block + 1), (n, 1))
    flags = SamplingFlags(sample=True, rejection=True)
    committed = np.asarray(sampled_posterior(logits, state, block_ids, positions, flags=flags, candidates=4,
                                             draft_logits=jnp.broadcast_to(jnp.asarray(q_logits), (n, 1, vocab))))
    p = torch.softmax(torch.tensor(p_logits).double(), -1).numpy()
    assert stats.chisquare(np.bincount(committed[:, 0], minlength=vocab), p * n).pvalue > 1e-3
    accepted = committed[:, 0] == drafts
    assert 0 < accepted.mean() < 1
    same = np.asarray(sampled_posterior(logits, state, block_ids, positions, flags=flags, candidates=4,
                                        draft_logits=logits[:, :1]))
    np.testing.assert_array_equal(same[:, 0], drafts)


# -- draws read from the candidates against the same draws over the whole row ----------------------


def test_noise_at_ids_equals_the_whole_rows_noise_bit_for_bit():
    seeds = jnp.asarray([[0, 1], [7, 2**32 - 1], [3, 3]], jnp.uint32)
    positions = jnp.asarray([5, 0, 123456])
    whole = np.asarray(smp.gumbel_noise(seeds, positions, 5000))
    ids = jnp.asarray(np.random.RandomState(1).randint(0, 5000, (3, 64)), jnp.int32)
    got = np.asarray(smp.gumbel_at(seeds, positions, ids, 5000))
    np.testing.assert_array_equal(got, np.take_along_axis(whole, np.asarray(ids), axis=1))
    assert whole.max() < smp.GUMBEL_MAX
    other = np.asarray(smp.gumbel_at(seeds, positions, ids, 5000, smp.RESIDUAL_STREAM))
    np.testing.assert_array_equal(other, np.take_along_axis(
        np.asarray(smp.gumbel_noise(seeds, positions, 5000, smp.RESIDUAL_STREAM)), np.asarray(ids), axis=1))


CANDIDATE_ROWS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=1),
    SamplingParams(temperature=1.0, top_p=0.8, seed=2),
    SamplingParams(temperature=1.5, min_p=0.05, seed=3),
    SamplingParams(temperature=0.3, seed=4),
    SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.3, presence_penalty=0.5, seed=5),
    SamplingParams(logit_bias={3: 40.0}),
]


def _candidate_case(scale: float, *, ties: bool = False):
    """Logits ``[rows, 3, vocab]`` of the ``CANDIDATE_ROWS``, their state and the block's ids."""
    from dflash_jax.runtime.decoding import DecodeState

    rows, n, vocab = len(CANDIDATE_ROWS), 3, 3000
    rs = np.random.RandomState(int(scale * 10) + ties)
    logits = rs.randn(rows, n, vocab).astype(np.float32) * scale
    if ties:
        logits = np.round(logits)
    arrays = smp.row_arrays(CANDIDATE_ROWS, rows, vocab, [4] * rows)
    s = smp.new_state({k: jnp.asarray(v) for k, v in arrays.items()}, capacity=16, max_logprobs=0)
    block = jnp.asarray(rs.randint(0, vocab, (rows, n)), jnp.int32)
    counts, seen = smp.add_tokens(s.counts, s.seen, block, jnp.ones((rows, n), bool))
    s = dataclasses.replace(s, counts=counts, seen=seen)
    zeros = jnp.zeros((rows,), jnp.int32)
    state = DecodeState(tokens=jnp.zeros((rows, 17), jnp.int32), starts=zeros + 4, max_lens=zeros + 16,
                        done=jnp.zeros((rows,), bool), num_steps=zeros, accepted=jnp.zeros((rows, 8), jnp.int32),
                        stop_ids=jnp.full((rows, 1), 7, jnp.int32), target_cache=None, draft_cache=None, sampling=s)
    positions = jnp.asarray(4 + np.arange(1, n + 1)[None].repeat(rows, 0), jnp.int32)
    return jnp.asarray(logits), state, block, positions


@pytest.mark.parametrize("scale,ties", [(8.0, False), _SLOW(2.0, True), _SLOW(0.5, False)])
def test_target_draws_from_candidates_equal_the_whole_rows_draws(scale, ties):
    """Where ``candidate_tokens`` says exact, its token is the whole row's draw; ``_draw`` (both paths
    under one ``lax.cond``) equals the whole row's draw everywhere. Peaked rows are exact."""
    from dflash_jax.runtime.decoding import _draw, greedy_argmax

    logits, state, block, positions = _candidate_case(scale, ties=ties)
    s, (b, n, vocab) = state.sampling, logits.shape
    flags = SamplingFlags.of(CANDIDATE_ROWS, 0)
    rows, pos = smp.Rows.of(s, state.stop_ids, per_row=n), positions.reshape(-1)
    counts, seen = smp.block_counts(s.counts, s.seen, block)
    flat = smp.edit_logits(logits.reshape(b * n, vocab), rows, pos, counts.reshape(b * n, vocab),
                           seen.reshape(b * n, vocab))
    want = np.asarray(greedy_argmax(smp.draw_scores(flat, rows, pos, flags=flags, candidates=8)))
    tokens, exact = (np.asarray(x) for x in smp.candidate_tokens(flat, rows, pos, flags=flags, candidates=8))
    np.testing.assert_array_equal(tokens[exact], want[exact])
    if scale == 8.0:
        assert exact.all()
    else:
        assert not exact.all()  # the whole-row branch runs below
    got = _draw(logits, s, state.stop_ids, block, positions, flags=flags, candidates=8)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), want)


@pytest.mark.parametrize("scale,ties", [(8.0, False), _SLOW(2.0, True), _SLOW(0.5, False)])
def test_drafts_from_candidates_equal_the_whole_rows_draws(scale, ties):
    """``draft_candidates`` where exact, and ``draft_tokens`` of a batch verifying by rejection sampling
    everywhere, equal the whole row's draw (``draft_scores``); under exact verification ``draft_tokens``
    are the candidates' draws; rows without top-k draw from the whole distribution, those with it from the
    drafter's k most likely tokens, and rows verifying by rejection sampling ignore their top-k."""
    import jax

    from dflash_jax.runtime.decoding import draft_tokens, greedy_argmax

    logits, state, _, positions = _candidate_case(scale, ties=ties)
    s, (b, n, vocab) = state.sampling, logits.shape
    s = dataclasses.replace(s, rejection=s.rejection.at[5].set(True))
    flags = SamplingFlags.of(CANDIDATE_ROWS, 0)
    temperature, seeds, pos = jnp.repeat(s.temperature, n), jnp.repeat(s.seeds, n, axis=0), positions.reshape(-1)
    top_k = jnp.repeat(jnp.where(s.rejection, 0, s.top_k), n)
    flat = logits.reshape(b * n, vocab)
    tokens, exact, boundary = smp.draft_candidates(flat, temperature, top_k, seeds, pos, count=64)
    want = np.asarray(greedy_argmax(smp.draft_scores(flat, temperature, boundary, seeds, pos)))
    tokens, exact = np.asarray(tokens), np.asarray(exact)
    np.testing.assert_array_equal(tokens[exact], want[exact])
    limited = np.asarray(boundary[2]).reshape(b, n)
    assert limited[1].all() and not np.delete(limited, 1, axis=0).any()
    assert exact.reshape(b, n)[[0, 1, 6]].all()  # greedy rows, and a top-k bounds the draw
    # The top-k rows' drafts are among the drafter's k most likely tokens (ties: the lower ids).
    top50 = np.asarray(jax.lax.top_k(flat, 50)[1]).reshape(b, n, 50)
    assert all(want.reshape(b, n)[1, j] in top50[1, j] for j in range(n))
    # Without a filter, the draw of the whole distribution: argmax(logits / T + noise).
    noise = np.asarray(smp.gumbel_noise(seeds, pos, vocab))
    t = np.asarray(temperature)
    plain = np.argmax(np.asarray(flat) / np.where(t == 0, 1, t)[:, None] + noise, axis=-1)
    sampled = (t > 0) & ~limited.reshape(-1)
    np.testing.assert_array_equal(want[sampled], plain[sampled])
    if scale == 8.0:  # without a top-k, the noise could reach past 64 candidates here
        assert exact.reshape(b, n)[4].all()
    # Under rejection sampling a draft is a draw from q: the whole rows where a candidate draw is not exact.
    got = draft_tokens(logits, s, positions, flags=dataclasses.replace(flags, rejection=True), candidates=64)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), want)
    # Under exact verification a draft is a proposal: the candidates' draws stand, exact or not.
    got = draft_tokens(logits, s, positions, flags=flags, candidates=64)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), tokens)
    if scale == 0.5:  # flat rows: some draws could reach past the candidates
        assert not exact.all() and (tokens != want).any()


def test_whole_row_normalizer_is_read_only_for_top_p_without_top_k():
    """The whole rows' softmax normalizer is compiled in only when some sampled row has top-p without
    top-k (``SamplingFlags.top_p_whole_row``, known on the host): rows whose top-p follows a top-k draw
    the same tokens without it, and a top-p row without top-k needs it."""
    assert SamplingFlags.of([SamplingParams(temperature=0.8, top_p=0.7, top_k=20)], 0).top_p_whole_row is False
    assert SamplingFlags.of([SamplingParams(top_p=0.7), SamplingParams(temperature=0.8, top_k=20)], 0).top_p_whole_row \
        is False  # a greedy row's top-p is never applied
    assert SamplingFlags.of([SamplingParams(temperature=0.8, top_p=0.7, top_k=20),
                             SamplingParams(temperature=0.8, top_p=0.9)], 0).top_p_whole_row is True
    rows, vocab = 6, 2000
    # Shifted far below 0 (the softmax is not moved): a top-p over a normalizer taken as 0 would keep every candidate.
    logits = jnp.asarray(np.random.RandomState(4).randn(rows, vocab).astype(np.float32) * 6 - 40)

    def draws(params, flags):
        arrays = smp.row_arrays(params, rows, vocab, [0] * rows)
        s = smp.new_state({k: jnp.asarray(v) for k, v in arrays.items()}, capacity=4, max_logprobs=0)
        r, pos = smp.Rows.of(s, jnp.full((rows, 1), -1, jnp.int32)), jnp.arange(rows)
        return [np.asarray(x) for x in smp.candidate_tokens(logits, r, pos, flags=flags, candidates=64)]

    with_k = [SamplingParams(temperature=0.8, top_p=0.7, top_k=20, seed=i) for i in range(rows)]
    flags = SamplingFlags.of(with_k, 0)
    lean, full = draws(with_k, flags), draws(with_k, dataclasses.replace(flags, top_p_whole_row=True))
    np.testing.assert_array_equal(lean[0], full[0])
    np.testing.assert_array_equal(lean[1], full[1])
    assert lean[1].all()
    alone = [SamplingParams(temperature=0.8, top_p=0.7, seed=i) for i in range(rows)]
    flags = SamplingFlags.of(alone, 0)
    tokens, exact = draws(alone, flags)
    assert exact.all()
    r = smp.Rows.of(smp.new_state({k: jnp.asarray(v) for k, v in smp.row_arrays(alone, rows, vocab, [0] * rows).items()},
                                  capacity=4, max_logprobs=0), jnp.full((rows, 1), -1, jnp.int32))
    whole = np.asarray(jnp.argmax(smp.draw_scores(logits, r, jnp.arange(rows), flags=flags, candidates=vocab), axis=-1))
    np.testing.assert_array_equal(tokens, whole)
    # Without the normalizer these rows' top-p would renormalize over a wrong mass: other kept sets.
    wrong = draws(alone, dataclasses.replace(flags, top_p_whole_row=False))
    assert (wrong[0] != tokens).any() or not wrong[1].all()
