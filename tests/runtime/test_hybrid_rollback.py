"""Speculative decoding on a hybrid target: the verify pass's linear states are rolled back to
exactly the accepted prefix of every row, and the generated text equals target-only decoding and
transformers' greedy ``generate``."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the oracles; without torch (e.g. a jax-only venv) the module skips

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid_fixtures import write_hf_hybrid  # noqa: E402

from dflash_jax.io.checkpoint import load_target  # noqa: E402
from dflash_jax.runtime import decoding  # noqa: E402
from dflash_jax.runtime.engine import Engine, EngineConfig, generate  # noqa: E402
from dflash_jax.runtime.sampling import SamplingParams  # noqa: E402
from dflash_jax.tiny import random_drafter, tiny_drafter_config  # noqa: E402

BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_hf_hybrid(tmp_path_factory.mktemp("hybrid_rollback"), nesting="text", seed=5)


def _drafter(target, block_size=BLOCK):
    c = target.config
    dcfg = tiny_drafter_config(c, num_layers=1, block_size=block_size, target_layer_ids=(1, 4), num_heads=4,
                               num_kv_heads=2, head_dim=12)
    return random_drafter(dcfg)


def _greedy(ref, prompt, n):
    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: no prompt token is taken for padding
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_forced_acceptance_rolls_back_to_every_offset(model):
    """Row r of the batch is proposed the target's own tokens for its first r drafts and wrong ones
    after: it accepts exactly r, and its settled linear states equal a fresh prefill of everything it
    has committed, for every offset 0 .. B-1 at once (rows of mixed prompt lengths)."""
    directory, ref = model
    target = load_target(directory)
    drafter = _drafter(target)
    vocab = target.config.vocab_size
    rng = np.random.RandomState(0)
    lens = np.array([5, 9, 3, 12])
    prompts = [list(rng.randint(0, vocab, n)) for n in lens]
    cont = [_greedy(ref, p, BLOCK + 1) for p in prompts]
    plen = int(lens.max())
    ids = np.array([p + [0] * (plen - len(p)) for p in prompts])
    # Compiled whole, as the engine runs them (op by op, the hybrid layers' hundreds of small programs
    # compile for every shape).
    prefill = jax.jit(lambda ids: decoding.scatter_rows(
        decoding.empty_state(target, drafter, 4, capacity=32, max_steps=20, n_stop=1),
        decoding.prefill(target, drafter, ids, jnp.asarray(lens), jnp.asarray(lens + 20),
                         jnp.full((4, 1), -1, jnp.int32), capacity=32, max_steps=20,
                         mask_token_id=drafter.config.mask_token_id),
        jnp.arange(4)))
    state = prefill(jnp.asarray(ids))
    assert [int(t) for t in state.tokens[jnp.arange(4), lens]] == [c[0] for c in cont]
    offsets = np.arange(4)
    block = np.array([[c[j] if j <= m else (c[j] + 1) % vocab for j in range(BLOCK)] for c, m in zip(cont, offsets)])
    positions = jnp.asarray(lens[:, None] + np.arange(BLOCK)[None], jnp.int32)
    verify = jax.jit(lambda s, b: decoding.verify_block(target, drafter, s, b, jnp.full((4,), BLOCK, jnp.int32),
                                                        positions))
    after = verify(state, jnp.asarray(block))
    np.testing.assert_array_equal(np.asarray(after.starts), lens + offsets + 1)
    assert after.target_cache.pending is None
    for r in range(4):
        committed = prompts[r] + cont[r][:offsets[r] + 1]
        n = len(committed)
        np.testing.assert_array_equal(np.asarray(after.tokens[r, :n + 1]), committed + [cont[r][offsets[r] + 1]])
        fresh = jax.jit(lambda ids: target.step(ids, jnp.zeros(1, jnp.int32), target.new_cache(1, ids.shape[1]),
                                                prefill=True)[2])(jnp.asarray([committed]))
        for got, want in zip(after.target_cache.conv + after.target_cache.recurrent, fresh.conv + fresh.recurrent):
            np.testing.assert_allclose(np.asarray(got[r]), np.asarray(want[0]), atol=2e-5)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return write_hf_hybrid(tmp_path_factory.mktemp("hybrid_moe_rollback"), nesting="vl", moe=True, seed=8)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_speculative_equals_target_only_equals_transformers(model, moe_model, variant):
    """Mixed-length prompts; the MoE variant (routed experts and the gated shared expert, the
    vision-language nesting) included."""
    directory, ref = model if variant == "dense" else moe_model
    target = load_target(directory)
    rng = np.random.RandomState(1)
    prompts = [list(rng.randint(0, 96, n)) for n in (5, 17, 9)]
    want = [_greedy(ref, p, 12) for p in prompts]
    only = generate(target, None, prompts, 12)
    assert [r.output_ids for r in only] == want
    spec = generate(target, _drafter(target), prompts, 12)
    assert [r.output_ids for r in spec] == want


@pytest.mark.slow
def test_multi_step_decoding_with_varied_acceptance_equals_transformers(model):
    """Steps of the jitted verify pass with proposals right up to an offset that changes per row and
    per step (every offset 0 .. B-1 comes up, rows of mixed lengths, a shorter last block): the
    committed text is transformers' greedy output."""
    directory, ref = model
    target = load_target(directory)
    drafter = _drafter(target)
    vocab, new = target.config.vocab_size, 14
    rng = np.random.RandomState(3)
    lens = np.array([5, 9, 3, 12])
    prompts = [list(rng.randint(0, vocab, n)) for n in lens]
    cont = [_greedy(ref, p, new + BLOCK) for p in prompts]
    plen = int(lens.max())
    ids = np.array([p + [0] * (plen - len(p)) for p in prompts])
    max_lens = lens + new
    state = jax.jit(lambda ids: decoding.scatter_rows(  # compiled whole, as in the test above
        decoding.empty_state(target, drafter, 4, capacity=48, max_steps=new, n_stop=1),
        decoding.prefill(target, drafter, ids, jnp.asarray(lens), jnp.asarray(max_lens),
                         jnp.full((4, 1), -1, jnp.int32), capacity=48, max_steps=new,
                         mask_token_id=drafter.config.mask_token_id),
        jnp.arange(4)))(jnp.asarray(ids))
    verify = jax.jit(lambda s, b, valid, pos: decoding.verify_block(target, drafter, s, b, valid, pos))
    offsets_seen = set()
    for step in range(new):
        if bool(np.all(np.asarray(state.done))):
            break
        starts = np.asarray(state.starts)
        block = []
        for r in range(4):
            at, m = starts[r] - lens[r], (3 * step + r) % BLOCK
            offsets_seen.add(m)
            block.append([cont[r][at + j] if j <= m else (cont[r][at + j] + 1) % vocab for j in range(BLOCK)])
        valid = np.clip(max_lens - starts, 1, BLOCK)
        state = verify(state, jnp.asarray(block), jnp.asarray(valid, jnp.int32),
                       jnp.asarray(starts[:, None] + np.arange(BLOCK), jnp.int32))
    assert bool(np.all(np.asarray(state.done))) and offsets_seen == set(range(BLOCK))
    for r in range(4):
        got = np.asarray(state.tokens[r, lens[r]:lens[r] + new]).tolist()
        assert got == cont[r][:new], (r, got, cont[r][:new])


def test_engine_refuses_a_mesh_for_a_hybrid_target(model):
    from dflash_jax.sharding import MeshConfig

    with pytest.raises(ValueError, match="hybrid linear-attention target"):
        Engine(load_target(model[0]), None, EngineConfig(max_length=64, mesh=MeshConfig(data=-1)))


@pytest.mark.slow
def test_choices_sharing_a_prompt_copy_its_recurrent_state(model):
    """The n choices of a prompt share its prefill: the linear layers' states are copied to each row, and
    each choice generates what it does alone."""
    target = load_target(model[0])
    engine = Engine(target, _drafter(target), EngineConfig(max_batch_size=4, max_length=48))
    prompt = list(np.random.RandomState(1).randint(0, 96, 13))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    shared = engine.generate([prompt] * 3, 12, sampling=params)
    assert engine.prefilled_prompts == 1
    assert [r.output_ids for r in shared] == [engine.generate([prompt], 12, sampling=p)[0].output_ids for p in params]


@pytest.mark.slow
def test_target_only_calls_of_an_adaptive_engine_extend_the_drafters_context(model):
    """An adaptive engine's target-only calls (``decoding.deferred_target_step``) on a hybrid target: the
    drafter's context of every committed position equals a prefill's of the same tokens, and a speculative
    call after them continues the target-only text."""
    target = load_target(model[0])
    config = EngineConfig(max_batch_size=2, max_length=48, steps_per_sync=4, speculation="adaptive",
                          speculation_blocks=(BLOCK,))
    engine, plain = Engine(target, _drafter(target), config), Engine(target, None, config)
    rng = np.random.RandomState(3)
    prompts = [list(rng.randint(0, target.config.vocab_size, n)) for n in (6, 11)]
    rows, _ = engine.prefill(prompts, [30, 30], [(), ()])
    state = engine.admit(engine.empty_state(2), rows, [0, 1])
    state, _ = engine.decode(state, 6, block=1)  # 4 + 2 steps
    state, snap = engine.decode(state, 3, block=BLOCK)
    tokens, starts = np.asarray(snap.tokens), np.asarray(snap.starts)
    want = [r.output_ids for r in plain.generate(prompts, 30)]
    for row, p in enumerate(prompts):
        n = int(starts[row])
        assert tokens[row, len(p):n + 1].tolist() == want[row][:n + 1 - len(p)]
        fresh, _ = engine.prefill([tokens[row, :n].tolist()], [1], [()])
        cache = state.draft_cache
        for got, ref in zip(cache.k + cache.v, fresh.draft_cache.k + fresh.draft_cache.v):
            np.testing.assert_allclose(np.asarray(got[row, :n]), np.asarray(ref[0, :n]), atol=2e-5, rtol=1e-5)
