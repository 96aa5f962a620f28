"""Drafting with a DFlash2 drafter: the selector's path inside the jitted draft step, losslessness."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax import Engine, EngineConfig, load_drafter, load_target
from dflash_jax.models.dflash2 import DFlash2Drafter
from dflash_jax.runtime import decoding
from dflash_jax.runtime.serving_params import serving_drafter
from copycat_fixtures import shallow_copycat_pair
from dflash_jax.tiny import random_drafter, tiny_dflash2_config


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The copycat pair (varied acceptance without training; over a 2-layer target: copycat_fixtures)
    with its drafter turned DFlash2: random convolutions around its layers and a random selector."""
    target_dir, drafter_dir = shallow_copycat_pair(tmp_path_factory.mktemp("copycat"), block_size=8)
    target, base = load_target(target_dir), load_drafter(drafter_dir)
    cfg = tiny_dflash2_config(target.config, **{f: getattr(base.config, f) for f in (
        "num_layers", "block_size", "mask_token_id", "target_layer_ids", "num_heads", "num_kv_heads", "head_dim")})
    drafter = random_drafter(dataclasses.replace(cfg, selector_top_k=6), seed=3, std=0.05)
    for mine, theirs in zip(drafter.layers, base.layers):
        for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            nnx.update(getattr(mine, name), nnx.state(getattr(theirs, name)))
    drafter.fc[...] = base.fc[...]
    return target, drafter


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [rs.randint(0, 95, n).tolist() for n in (5, 17, 9, 30)]


@pytest.mark.slow
def test_draft_block_takes_the_selectors_path(models, prompts):
    """The jitted draft step's block == the numpy transcription of the reference's selection over the
    drafter's own logits and hidden states, for a batch of rows at different positions."""
    from dflash2_oracle import numpy_select

    target, drafter = models
    served = serving_drafter(drafter)
    plen = max(map(len, prompts))
    ids = jnp.asarray([p + [0] * (plen - len(p)) for p in prompts], jnp.int32)
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    # Each computation compiled whole (op by op, every layer's small programs compile for every shape).
    state = jax.jit(lambda ids, lens: decoding.prefill(
        target, served, ids, lens, lens + 20, jnp.full((len(prompts), 1), -1, jnp.int32), capacity=64, max_steps=20,
        mask_token_id=drafter.config.mask_token_id))(ids, lens)
    B = drafter.config.block_size
    block_ids, _, _ = jax.jit(lambda s: decoding.draft_block(target, served, s, block_size=B))(state)

    anchor = np.asarray(state.tokens)[np.arange(len(prompts)), np.asarray(state.starts)]
    first = jnp.concatenate([jnp.asarray(anchor)[:, None], jnp.full((len(prompts), B - 1),
                                                                     drafter.config.mask_token_id)], axis=1)

    @jax.jit
    def drafted(first, state):
        hidden = served.draft(target.embed(first)[:, None], state.starts, state.draft_cache,
                              jnp.full((len(prompts),), B, jnp.int32))[:, 0, 1:]
        return hidden, drafter.logits(target, hidden)

    hidden, logits = drafted(first, state)
    sel = drafter.candidate_selector
    want = numpy_select(np.asarray(logits), np.asarray(hidden), anchor, np.asarray(sel.predecessor_codebook[...]),
                        np.asarray(sel.successor_codebook[...]), np.asarray(sel.hidden_projection[...]),
                        drafter.config.selector_top_k)
    np.testing.assert_array_equal(np.asarray(block_ids)[:, 1:], want)
    np.testing.assert_array_equal(np.asarray(block_ids)[:, 0], anchor)


@pytest.mark.slow
def test_dflash2_speculative_output_equals_target_only_batched(models, prompts):
    target, drafter = models
    assert isinstance(drafter, DFlash2Drafter)
    config = EngineConfig(max_batch_size=4, max_length=80, steps_per_sync=4)
    spec, plain = Engine(target, drafter, config), Engine(target, None, config)
    max_new = [40, 9, 23, 31]
    got = spec.generate(prompts, max_new, stop_token_ids=[11])
    want = plain.generate(prompts, max_new, stop_token_ids=[11])
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        assert sum(g.acceptance_lengths) + 1 == len(g.output_ids)
    assert max(a for g in got for a in g.acceptance_lengths) > 1  # drafts were accepted
    alone = spec.generate(prompts[1:2], max_new[1:2], stop_token_ids=[11])[0]
    assert alone.output_ids == got[1].output_ids and alone.acceptance_lengths == got[1].acceptance_lengths


def test_selector_candidates_lead_with_the_targets_draw_and_keep_greedy_rows():
    """A sampled row's first candidate is the token the target draws at that position (argmax of
    logits / T + the position's Gumbel noise, computed over the whole row here); a greedy row's
    candidates are the selector's own top-k of the logits, values and ids."""
    from dflash_jax.ops.topk import top_k
    from dflash_jax.runtime import sampling as smp

    b, n, vocab, k = 3, 5, 300, 6
    logits = jax.random.normal(jax.random.key(0), (b, n, vocab)) * 4.0  # peaked: draws stay in the top 64
    positions = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n) + 10
    params = [smp.SamplingParams(temperature=0.7, seed=1), smp.SamplingParams(),
              smp.SamplingParams(temperature=1.0, seed=5)]
    s = smp.new_state(smp.row_arrays(params, b, vocab, [4] * b), capacity=64, max_logprobs=0)
    unary, ids, noise = decoding.selector_candidates(logits, s, positions, k)
    assert unary.shape == ids.shape == noise.shape == (b, n, k)
    np.testing.assert_array_equal(np.asarray(unary), np.asarray(jnp.take_along_axis(logits, ids, axis=-1)))
    assert not np.asarray(noise[1]).any()
    for row in (0, 2):
        noise = smp.gumbel_noise(jnp.repeat(s.seeds[row:row + 1], n, axis=0), positions[row], vocab)
        draw = jnp.argmax(logits[row] / s.temperature[row] + noise, axis=-1)
        np.testing.assert_array_equal(np.asarray(ids[row, :, 0]), np.asarray(draw))
    want_unary, want_ids = top_k(logits[1], k)
    np.testing.assert_array_equal(np.asarray(ids[1]), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(unary[1]), np.asarray(want_unary))


@pytest.mark.slow
def test_dflash2_seeded_sampling_equals_target_only_and_accepts_drafts(models, prompts):
    """Exact verification with a DFlash2 drafter in a batch of sampled and greedy rows: every row's tokens
    are target-only decoding's of the same seed."""
    from dflash_jax.runtime.sampling import SamplingParams

    target, drafter = models
    config = EngineConfig(max_batch_size=4, max_length=80, steps_per_sync=4)
    spec, plain = Engine(target, drafter, config), Engine(target, None, config)
    sampling = [SamplingParams(temperature=0.7, seed=3), None, SamplingParams(temperature=1.0, seed=4, top_p=0.9),
                SamplingParams(temperature=0.7, seed=9)]
    got = spec.generate(prompts, 30, stop_token_ids=[11], sampling=sampling)
    want = plain.generate(prompts, 30, stop_token_ids=[11], sampling=sampling)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]


@pytest.mark.parametrize("scale", [40.0, 0.05])  # peaked rows (read from the top 64), flat rows (the whole row)
def test_a_selector_without_transitions_walks_the_targets_draws(scale):
    """With zero codebooks the selector's sampled path is, slot by slot, the token the target draws from
    the same logits with the same seed and position: the noise-led walk agrees with exact verification."""
    from dflash_jax.models.dflash2 import CandidateSelector
    from dflash_jax.runtime import sampling as smp

    b, n, vocab, hidden = 2, 6, 500, 16
    logits = jax.random.normal(jax.random.key(1), (b, n, vocab)) * scale
    positions = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n) + 3
    params = [smp.SamplingParams(temperature=0.7, seed=11), smp.SamplingParams(temperature=1.3, seed=2)]
    s = smp.new_state(smp.row_arrays(params, b, vocab, [4] * b), capacity=64, max_logprobs=0)
    selector = CandidateSelector(vocab, hidden, rank=4, top_k=5, dtype=jnp.float32, rngs=nnx.Rngs(0))
    for name in ("predecessor_codebook", "successor_codebook"):
        getattr(selector, name)[...] = jnp.zeros_like(getattr(selector, name)[...])
    unary, ids, noise = decoding.selector_candidates(logits, s, positions, 5)
    path = selector.select_path(logits, jnp.ones((b, n, hidden)), jnp.zeros((b,), jnp.int32), (unary, ids),
                                (noise, s.temperature))
    for row in range(b):
        g = smp.gumbel_noise(jnp.repeat(s.seeds[row:row + 1], n, axis=0), positions[row], vocab)
        np.testing.assert_array_equal(np.asarray(path[row]),
                                      np.asarray(jnp.argmax(logits[row] / s.temperature[row] + g, axis=-1)))
